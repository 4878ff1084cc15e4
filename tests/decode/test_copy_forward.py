"""`eval.copy_forward` (docs/spec.md §4): a position the exit rule stopped after n
applications runs one more that only writes its cache, so later tokens read its final state
x^(n) at every deeper application, as the Universal Transformer's parallel pass copies a
halted position's state forward."""

import pytest
import torch

from recdepth import exits
from recdepth.decode.engine import decode_step, new_caches
from recdepth.decode.generation import check_speculative
from recdepth.decode.settings import DecodeSettings
from tests.decode.helpers import model

MAX = 48  # far above where stepnorm_rel τ = 0.3 stops on this model: every position is stopped by the rule


def decode(m, idx, policy, **settings):
    B, T = idx.shape
    caches = new_caches(m, B, T, settings.get("cache", "latest"), policy.max_steps_bound)
    out, apps = [], []
    for t in range(T):
        logits, a = decode_step(m, idx[:, t], t, caches, policy, DecodeSettings(**settings))
        out.append(logits)
        apps.append(a)
    return torch.stack(out, 1), torch.stack(apps, 1)


def parallel_halted(m, idx, depth):
    """The reference: the parallel pass in which position t of group g runs depth[b, t, g]
    applications and then keeps its state, which the other positions read at every later
    application (every position of a group loops together; nothing is cached)."""
    x = m.embed(idx)
    for kind, i in m.plan:
        if kind == "layer":
            x = m.h[i](x)
            continue
        e_proj, s = m.adapters[i].input(x), m.initial_state(x, None)
        for j in range(1, int(depth[..., i].max()) + 1):
            s = torch.where((depth[..., i] >= j)[..., None], m.apply_group(i, s, e_proj), s)
        x = m.leave_group(i, s)
    return m.decode_logits(x)


@pytest.fixture(scope="module")
def setup():
    # one-layer groups: a halted position's K/V at every later application are then a function of
    # its final state alone, in the reference as in the cache (in a group of two layers the
    # second layer's input also reads the neighbours of that application, which a cache written
    # once cannot follow)
    m = model([[1], [3]])
    idx = torch.randint(0, 60, (3, 12), generator=torch.Generator().manual_seed(0))
    return m, idx, exits.build("stepnorm_rel", 0.3, max_steps=MAX)


@pytest.mark.parametrize("backend, batch_one, compact", [("module", False, True), ("module", False, False),
                                                         ("module", True, True), ("lean", False, True),
                                                         ("lean", True, True)])
def test_per_step_cache_with_copy_forward_equals_the_parallel_pass_that_keeps_halted_states(setup, backend,
                                                                                           batch_one, compact):
    m, idx, policy = setup
    kw = dict(cache="per_step", copy_forward=True, backend=backend, compact=compact)
    if batch_one:
        parts = [decode(m, idx[b : b + 1], policy, **kw) for b in range(idx.shape[0])]
        got, apps = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        got, apps = decode(m, idx, policy, **kw)
    assert int(apps.max()) < MAX and int(apps.min()) >= 2  # every position stopped by the rule, and wrote once
    depth = apps - 1  # the applications whose state it kept; the last one only wrote forward
    assert len(depth.unique()) >= 5  # the positions stop at many different depths
    torch.testing.assert_close(got, parallel_halted(m, idx, depth), rtol=1e-9, atol=1e-9)


def test_without_copy_forward_a_stopped_position_offers_its_last_input_instead(setup):
    """The same rule without copy_forward: later positions read a stopped one through the input
    of its last application, which the reference (its final state) is not."""
    m, idx, policy = setup
    got, apps = decode(m, idx, policy, cache="per_step")
    ref = parallel_halted(m, idx, apps)
    torch.testing.assert_close(got[:, 0], ref[:, 0], rtol=1e-9, atol=1e-9)  # the first position reads nobody
    assert (got[:, 1:, :60] - ref[:, 1:, :60]).abs().max() > 1e-4


@pytest.mark.parametrize("cache", ["latest", "per_step"])
def test_copy_forward_leaves_fixed_depth_alone_and_batch_b_equals_batch_1(setup, cache):
    m, idx, policy = setup
    fixed = exits.build("fixed", None, max_steps=4)
    a, apps_a = decode(m, idx, fixed, cache=cache, copy_forward=True)
    b, _ = decode(m, idx, fixed, cache=cache)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.all(apps_a == 4)  # stopped by max_steps: nothing written forward, nothing billed
    got, apps = decode(m, idx, policy, cache=cache, copy_forward=True)
    for row in range(idx.shape[0]):
        one, apps_one = decode(m, idx[row : row + 1], policy, cache=cache, copy_forward=True)
        assert torch.equal(apps_one[0], apps[row])
        torch.testing.assert_close(one[0], got[row], rtol=1e-9, atol=1e-9)


def test_copy_forward_refuses_speculative_decoding_in_one_line():
    with pytest.raises(ValueError, match=r"^eval\.copy_forward: not with speculative decoding") as e:
        check_speculative("per_step", 2, 4, copy_forward=True)
    assert "\n" not in str(e.value)


def test_copy_forward_is_a_checked_bool():
    with pytest.raises(ValueError, match="eval.copy_forward"):
        DecodeSettings(copy_forward="yes")
