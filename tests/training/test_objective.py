"""Per-step training objectives (`loss.steps`, recdepth/training/objective.py) against a loss
computed by hand: the model's layers called one by one, the coda and head run after each
application of the last group, the NLL written out with log-softmax."""

import math

import pytest
import torch
import torch.nn.functional as F

from recdepth.model.config import GPTConfig
from recdepth.model.looped import LoopedGPT
from recdepth.training.objective import Objective, target_at


def model(groups=([1],), n_layer=3, **kw) -> LoopedGPT:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=8, vocab_size=11, groups=[list(g) for g in groups],
                    mean_recurrence=3, state_init="input", **kw)
    return LoopedGPT(cfg).double().eval()


def batch(B=3, T=6, V=11, S=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y[:, :2] = -1  # not scored (a task's context)
    z = torch.randint(0, V, (B, T, S), generator=g)
    z[torch.rand(B, T, S, generator=g) < 0.3] = -1  # no per-step target: the final one
    z[y < 0] = -1
    return x, y, z


def by_hand(m: LoopedGPT, x, y, n: int, targets_at) -> list[float]:
    """Each application t = 1..n of the only group: the mean NLL over scored tokens of the
    logits after it (coda and head run on it), against targets_at(t)."""
    h = m.embed(x)
    for layer in range(m.cfg.groups[0][0]):  # the prelude
        h = m.h[layer](h)
    e_proj = m.adapters[0].input(h)
    s = h  # state_init=input
    out = []
    for t in range(1, n + 1):
        u = m.adapters[0].state(s) + e_proj
        for layer in m.cfg.groups[0]:
            u = m.h[layer](u)
        s = u
        c = s
        for layer in range(m.cfg.groups[0][-1] + 1, m.cfg.n_layer):  # the coda
            c = m.h[layer](c)
        logp = F.log_softmax(m.decode_logits(c).double(), -1)
        tgt = targets_at(t)
        keep = tgt >= 0
        nll = -logp[keep].gather(-1, tgt[keep][:, None])[:, 0]
        out.append(float(nll.sum() / keep.sum()))
    return out


def test_last_is_the_loss_without_an_objective():
    m = model()
    x, y, z = batch()
    _, plain = m(x, y, loops=[3])
    _, last = m(x, y, loops=[3], objective=Objective("last"), step_targets=z)
    assert last.item() == plain.item()
    hand = by_hand(m, x, y, 3, lambda t: y)
    assert float(plain) == pytest.approx(hand[-1], abs=1e-12)


@pytest.mark.parametrize("weights", ["uniform", "linear"])
def test_all_is_the_weighted_mean_of_each_applications_loss(weights):
    m = model()
    x, y, z = batch()
    _, loss = m(x, y, loops=[4], objective=Objective("all", weights), step_targets=z)
    per_t = by_hand(m, x, y, 4, lambda t: y)
    w = [1, 1, 1, 1] if weights == "uniform" else [1, 2, 3, 4]
    assert float(loss) == pytest.approx(sum(a * b for a, b in zip(w, per_t)) / sum(w), abs=1e-12)
    assert len(set(per_t)) == 4  # the applications' losses differ: the weighting is tested


def test_trajectory_takes_target_t_where_the_data_has_one():
    m = model()
    x, y, z = batch(S=3)
    _, loss = m(x, y, loops=[5], objective=Objective("trajectory"), step_targets=z)

    def tgt(t):  # independent of target_at: written per element
        out = y.clone()
        for b in range(y.shape[0]):
            for p in range(y.shape[1]):
                if t <= z.shape[-1] and z[b, p, t - 1] >= 0:
                    out[b, p] = z[b, p, t - 1]
        return out

    per_t = by_hand(m, x, y, 5, tgt)
    assert float(loss) == pytest.approx(sum(per_t) / 5, abs=1e-12)
    assert torch.equal(target_at(2, y, z), tgt(2)) and torch.equal(target_at(4, y, z), y)  # past S: the final


def test_truncated_backprop_takes_the_graded_applications_only():
    m = model()
    x, y, z = batch()
    _, loss = m(x, y, loops=[5], backprop_depth=2, objective=Objective("all"), step_targets=z)
    per_t = by_hand(m, x, y, 5, lambda t: y)
    assert float(loss) == pytest.approx((per_t[3] + per_t[4]) / 2, abs=1e-12)
    with torch.no_grad():  # no gradient: every application is run, none is "graded" apart
        _, loss = m(x, y, loops=[5], backprop_depth=2, objective=Objective("all"), step_targets=z)
    assert float(loss) == pytest.approx(sum(per_t) / 5, abs=1e-12)


def test_the_anneal_mixes_the_two_objectives():
    o = Objective("trajectory", anneal_to="last", anneal_start=0.5, anneal_end=0.75)
    assert o.mix(0, 100) == {"trajectory": 1.0, "last": 0.0}
    assert o.mix(60, 100) == pytest.approx({"trajectory": 0.6, "last": 0.4})
    assert o.mix(75, 100) == {"trajectory": 0.0, "last": 1.0} and o.mix(99, 100)["last"] == 1.0
    m = model()
    x, y, z = batch()
    _, mixed = m(x, y, loops=[3], objective=o, step_targets=z, mix=o.mix(60, 100))
    _, traj = m(x, y, loops=[3], objective=Objective("trajectory"), step_targets=z)
    _, last = m(x, y, loops=[3])
    assert float(mixed) == pytest.approx(0.6 * float(traj) + 0.4 * float(last), abs=1e-12)


def test_the_per_step_losses_are_the_last_groups():
    """With two groups the first runs its sampled applications; the per-step losses are
    taken along the last group, through the layers after it."""
    m = model(groups=([1], [2]), n_layer=4)
    x, y, z = batch()
    _, loss = m(x, y, loops=[2, 3], objective=Objective("all"), step_targets=z)
    h = m.h[0](m.embed(x))
    h = m.leave_group(0, m.run_group(0, h, 2))
    e_proj, s, per_t = m.adapters[1].input(h), h, []
    for _ in range(3):
        s = m.apply_group(1, s, e_proj)
        logp = F.log_softmax(m.decode_logits(m.h[3](s)).double(), -1)
        keep = y >= 0
        per_t.append(float(-logp[keep].gather(-1, y[keep][:, None]).sum() / keep.sum()))
    assert float(loss) == pytest.approx(sum(per_t) / 3, abs=1e-12)


@pytest.mark.parametrize("kw, field", [(dict(steps="every"), "loss.steps"), (dict(weights="cubic"), "loss.weights"),
                                       (dict(steps="all", anneal_to="all"), "loss.anneal_to"),
                                       (dict(anneal_start=1.5), "loss.anneal_start"),
                                       (dict(anneal_start=0.8, anneal_end=0.5), "loss.anneal_end")])
def test_bad_objectives_are_one_line(kw, field):
    with pytest.raises(ValueError, match=f"^{field}: expected") as e:
        Objective(**kw)
    assert "\n" not in str(e.value)


def test_trajectory_without_per_step_targets_is_one_line():
    from recdepth.training.lit import LoopedLM

    module = LoopedLM(model=dict(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab_size=11, groups=[[1]],
                                 mean_recurrence=2), sampler=dict(name="fixed", mean=2, sigma=0.0, backprop_depth=None),
                      optim=dict(lr=1e-3), max_steps=10, loss=dict(steps="trajectory"))
    x, y, _ = batch()
    with pytest.raises(ValueError, match="^loss.steps: trajectory needs per-step targets") as e:
        module.training_step((x, y), 0)
    assert "\n" not in str(e.value)
    assert math.isfinite(float(module.model(x, y, loops=[2])[1]))


def test_trajectory_on_data_without_per_step_targets_is_refused_by_the_config():
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.config.schema import validated

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        text = compose("config", overrides=["loss.steps=trajectory", "run_dir=/tmp/unused"])
        roots = compose("config", overrides=["loss.steps=trajectory", "data=roots", "run_dir=/tmp/unused"])
    with pytest.raises(ValueError, match="^loss.steps: trajectory needs per-step targets, and data=shakespeare"):
        validated(text)
    assert validated(roots).loss.steps == "trajectory"
