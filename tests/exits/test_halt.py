"""exit=halt: the rule that reads a halting head trained with the loop (recdepth/exits/rules/builtin.py,
`Halt`), on hand-made trajectories and in every decode path."""

import math

import pytest
import torch

from recdepth import exits
from recdepth.decode import engine as D
from recdepth.decode import scoring as S
from recdepth.decode.engine import RowNoise, decode_step
from recdepth.decode.kv_cache import new_caches
from recdepth.decode.settings import DecodeSettings
from recdepth.exits.gate import gate_probability
from recdepth.model.looped import GPTConfig, LoopedGPT

LAMBDAS = [0.1, 0.2, 0.05, 0.6, 0.3, 0.9, 0.2, 0.4]  # λ_n of one row, n = 1 .. 8


def head_model(reading="cdf", head="state", d=16, seed=0, dtype=torch.float64, groups=((1,),), **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=2 + sum(map(len, groups)), n_head=2, n_embd=d, block_size=20, vocab_size=40,
                    groups=[list(g) for g in groups], halt_head=head, halt_reading=reading, state_init="normal", **kw)
    return LoopedGPT(cfg).to(dtype).eval()


def by_hand(reading, tau, lams=LAMBDAS, max_steps=8):
    """The first n after which what is left to halt is below τ (max_steps if none): ACT's
    1 − Σ λ_j, PonderNet's ∏ (1 − λ_j) (the halting distribution's mass after n), 1 − λ_n."""
    for n in range(1, len(lams) + 1):
        if reading == "sum":
            left = 1 - sum(lams[:n])
        elif reading == "cdf":
            left = math.prod(1 - v for v in lams[:n])
        else:
            left = 1 - lams[n - 1]
        if n == max_steps or left < tau:
            return n
    return max_steps


@pytest.mark.parametrize("reading", ["sum", "cdf", "direct"])
@pytest.mark.parametrize("tau", [0.01, 0.15, 0.5, 0.75])
def test_the_rule_halts_where_what_is_left_first_falls_below_tau(reading, tau):
    """States whose first coordinate is logit(λ_n), a head reading that coordinate alone
    (w = e_0, b = 0): the monitor fires after the application a loop over n by hand finds."""
    m = head_model(reading)
    with torch.no_grad():
        m.halt.weight.zero_()
        m.halt.weight[0, 0] = 1.0
        m.halt.bias.zero_()
    policy = exits.build("halt", tau, max_steps=8).with_head(m).group(0)
    states = torch.zeros(len(LAMBDAS) + 1, 1, 16, dtype=torch.float64)
    for n, lam in enumerate(LAMBDAS, 1):
        states[n, 0, 0] = math.log(lam / (1 - lam))
    mon = policy.monitor(states[0])
    got = next(n for n in range(1, 9) if bool(mon.observe(states[n])[0]))
    assert got == by_hand(reading, tau)


def test_a_model_without_a_head_is_a_one_line_error():
    torch.manual_seed(0)
    m = LoopedGPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=20, vocab_size=40, groups=[[1]]))
    with pytest.raises(ValueError, match="^exit.name: rule 'halt' reads the checkpoint's halting head, and this "
                                         "model has none") as e:
        exits.build("halt", 0.5).with_head(m)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^exit.tau: expected a number in \\(0, 1\\) for rule 'halt'"):
        exits.build("halt", 1.5)


def random_head(m, scale=2.0, seed=3):
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        m.halt.weight.copy_(scale * torch.randn(m.halt.weight.shape, generator=g))
        m.halt.bias.fill_(-0.5)
    return m


def decode_all(m, idx, policy, noise, sharing="latest"):
    settings = DecodeSettings()
    B, T = idx.shape
    caches = new_caches(m, B, T, sharing, policy.max_steps_bound)
    out, apps = [], []
    for t in range(T):
        logits, a = decode_step(m, idx[:, t], t, caches, policy, settings, noise=noise)
        out.append(logits)
        apps.append(a)
    return torch.stack(out, 1), torch.stack(apps, 1)


@pytest.mark.parametrize("sharing", ["latest", "per_step"])
@pytest.mark.parametrize("reading, groups", [("sum", ((1,),)), ("cdf", ((1,),)), ("direct", ((1,),)),
                                             ("direct", ((1,), (2, 3)))], ids=["sum", "cdf", "direct", "two_groups"])
def test_batch_rows_equal_batch_one_under_noise(reading, groups, sharing):
    """A batch of windows under exit=halt gives each window its batch-1 logits and
    applications (keyed noise), and the head really varies the depth; with two recurrence
    groups, each group's own head."""
    m = random_head(head_model(reading, head="normed" if reading == "cdf" else "state", groups=groups))
    idx = torch.randint(0, 40, (3, 10), generator=torch.Generator().manual_seed(4))
    policy = exits.build("halt", 0.4, max_steps=10)
    batched, apps = decode_all(m, idx, policy, RowNoise(7, [10, 11, 12]), sharing)
    assert len(set(apps.flatten().tolist())) > 2
    for r in range(3):
        alone, apps_1 = decode_all(m, idx[r : r + 1], policy, RowNoise(7, [10 + r]), sharing)
        torch.testing.assert_close(batched[r : r + 1], alone, rtol=1e-10, atol=1e-10)
        assert torch.equal(apps[r : r + 1], apps_1)


@pytest.mark.parametrize("warm, copy_forward, reading, groups", [
    (False, False, "cdf", ((1,),)), (False, True, "cdf", ((1,),)), (False, False, "direct", ((1,), (2, 3))),
    pytest.param(True, False, "cdf", ((1,),), marks=pytest.mark.slow)],
    ids=["cold", "copy_forward", "two_groups_direct", "warm"])
def test_eager_lean_and_compiled_loop_give_identical_applications(warm, copy_forward, reading, groups):
    """exit=halt through the module step, the eager lean step and the compiled batch-1 loop
    (one graph with the head's check inside): identical applications, NLL within float32
    rounding; with eval.copy_forward (per_step cache: the write after the compiled loop); on
    two recurrence groups, each with its own head, read `direct` (the compiled loop once read
    every head as `cdf`); warm start too (the states the head reads start from the last
    token's; in `make test-slow`: default-suite time)."""
    m = random_head(head_model(reading, dtype=torch.float32, groups=groups), scale=1.0)
    tokens = torch.randint(0, 40, (60,), generator=torch.Generator().manual_seed(3))
    policy = exits.build("halt", 0.5, max_steps=9).with_head(m)
    recs, calls = {}, []
    compiled = D.lean_steps(m, "compiled")
    real = compiled.loop
    compiled.loop = lambda *a, calls=calls, real=real: calls.append(1) or real(*a)
    try:
        for step in ("module", "lean", "compiled"):
            run = DecodeSettings(batch_size=1, latency_tokens=0, warmup_tokens=0, seed=5, backend=step,
                                 warm_start=warm, copy_forward=copy_forward,
                                 cache="per_step" if copy_forward else "latest")
            _, recs[step] = S.evaluate_exit(m, tokens, policy, 19, run)
    finally:
        del compiled.loop
    assert len(calls) >= 19  # the compiled loop ran, the head's check inside it, at every token
    apps = recs["module"]["apps"].reshape(-1, len(groups))
    assert all(len(set(apps[:, g].tolist())) > 1 for g in range(len(groups)))  # every group's head varies its depth
    for step in ("lean", "compiled"):
        assert (recs[step]["apps"] == recs["module"]["apps"]).all(), (warm, step)
        assert abs(recs[step]["nll"] - recs["module"]["nll"]).max() <= 1e-5


@pytest.mark.parametrize("tau", [0.2, 0.5, 0.8])
def test_the_gate_is_the_direct_head_with_its_sign_flipped(tau):
    """The post-hoc gate is the `correct` head fitted on a frozen model (recdepth/exits/gate.py):
    exit=gate with a gate file (w, b) stops every token where exit=halt stops on a model whose
    `direct` head is (−w, −b), with the same logits, and its q is 1 − λ."""
    m = random_head(head_model("direct"))
    w, b = m.halt.weight.detach().clone(), m.halt.bias.detach().clone()  # [1, d], [1]: one group
    idx = torch.randint(0, 40, (3, 10), generator=torch.Generator().manual_seed(5))
    gate = exits.build("gate", tau, max_steps=8, gate=(-w, -b))
    halt = exits.build("halt", tau, max_steps=8).with_head(m)
    got, apps_gate = decode_all(m, idx, gate, RowNoise(7, [1, 2, 3]))
    want, apps_halt = decode_all(m, idx, halt, RowNoise(7, [1, 2, 3]))
    assert len(set(apps_halt.flatten().tolist())) > 2  # the head varies the depth
    assert torch.equal(apps_gate, apps_halt)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    x = torch.randn(5, 16, dtype=torch.float64)
    lam = torch.sigmoid(x @ w[0] + b[0])
    torch.testing.assert_close(gate_probability(x, -w[0], -b[0]), 1 - lam, rtol=1e-12, atol=1e-12)
