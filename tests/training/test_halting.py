"""The halting losses (recdepth/training/halting.py) against hand computations in float64, and
the model's training pass that feeds them (`LoopedGPT.forward(halting=...)`)."""

import math

import pytest
import torch
import torch.nn.functional as F

from recdepth.model.looped import GPTConfig, LoopedGPT, halt_logit
from recdepth.training import halting
from recdepth.training.halting import HaltInputs, HaltSettings
from recdepth.training.objective import Objective

N, B, T = 6, 2, 3


def inputs(seed=0, z_scale=2.0, mixture=None):
    g = torch.Generator().manual_seed(seed)
    z = z_scale * torch.randn(N, B, T, generator=g, dtype=torch.float64)
    nll = 3 * torch.rand(N, B, T, generator=g, dtype=torch.float64)
    right = torch.rand(N, B, T, generator=g) > 0.5
    scored = torch.tensor([[True, True, False], [True, False, True]])
    return HaltInputs(z, nll, right, scored, mixture or (lambda p: (p * nll).sum(0)))


def by_hand_p(lam):
    """PonderNet's p_n = λ_n ∏_{j<n} (1 − λ_j), the remainder at N, one token at a time."""
    p, stay = [], 1.0
    for n, v in enumerate(lam):
        p.append(stay if n == len(lam) - 1 else v * stay)
        stay *= 1 - v
    return p


def scored_mean(per_token, scored):
    vals = [per_token[b][t] for b in range(B) for t in range(T) if scored[b, t]]
    return sum(vals) / len(vals)


def test_halting_distribution_is_ponderNets_with_the_remainder_at_N():
    h = inputs()
    p = halting.halting_distribution(h.z).exp()
    lam = torch.sigmoid(h.z)
    for b in range(B):
        for t in range(T):
            want = by_hand_p(lam[:, b, t].tolist())
            assert p[:, b, t].tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert torch.allclose(p.sum(0), torch.ones(B, T, dtype=torch.float64), atol=1e-14)


def test_truncated_geometric_is_the_renormalised_geometric():
    lam_p = 0.3
    g = halting.truncated_geometric(5, lam_p, torch.zeros(1, dtype=torch.float64)).exp()
    raw = [lam_p * (1 - lam_p) ** k for k in range(5)]
    assert g.tolist() == pytest.approx([r / sum(raw) for r in raw], rel=1e-12)


def test_pondernet_is_the_expected_loss_plus_beta_kl_to_the_prior():
    h, s = inputs(1), HaltSettings(beta=0.7, prior=0.25)
    lam = torch.sigmoid(h.z)
    raw = [0.25 * 0.75**k for k in range(N)]
    g = [r / sum(raw) for r in raw]
    per = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            p = by_hand_p(lam[:, b, t].tolist())
            expected = sum(p[n] * float(h.nll[n, b, t]) for n in range(N))
            kl = sum(p[n] * math.log(p[n] / g[n]) for n in range(N))
            per[b][t] = expected + 0.7 * kl
    assert float(halting.lookup("pondernet").loss(h, s)) == pytest.approx(scored_mean(per, h.scored), rel=1e-12)


def test_entropy_is_the_expected_loss_minus_beta_entropy():
    h, s = inputs(2), HaltSettings(beta=0.05)
    lam = torch.sigmoid(h.z)
    per = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            p = by_hand_p(lam[:, b, t].tolist())
            H = -sum(v * math.log(v) for v in p)
            per[b][t] = sum(p[n] * float(h.nll[n, b, t]) for n in range(N)) - 0.05 * H
    assert float(halting.lookup("entropy").loss(h, s)) == pytest.approx(scored_mean(per, h.scored), rel=1e-12)


def by_hand_act(h_units, eps):
    """Graves's ACT for one token: N(t), R and p."""
    total, Nt = 0.0, len(h_units)
    for n, v in enumerate(h_units):
        if total + v >= 1 - eps or n == len(h_units) - 1:
            Nt = n + 1
            break
        total += v
    R = 1 - sum(h_units[: Nt - 1])
    p = [h_units[n] if n < Nt - 1 else (R if n == Nt - 1 else 0.0) for n in range(len(h_units))]
    return Nt, R, p


@pytest.mark.parametrize("z_scale, shift", [(2.0, 0.0), (0.5, -4.0)], ids=["halts", "runs-to-N"])
def test_act_is_the_mixtures_loss_plus_the_ponder_cost(z_scale, shift):
    """ACT's halting step N(t), remainder R and mixture weights by a loop over n, one token
    at a time; the mixture function sees exactly p (a linear stand-in, Σ p_n c_n). With
    small halting units no token reaches 1 − ε: N(t) = N and R = 1 − Σ_{n<N} h_n."""
    h0 = inputs(3, z_scale)
    h = h0._replace(z=h0.z + shift)
    c = torch.arange(1, N + 1, dtype=torch.float64).view(N, 1, 1).expand(N, B, T)
    h = h._replace(mixture=lambda p: (p * c).sum(0))
    s = HaltSettings(beta=0.1, epsilon=0.01)
    lam = torch.sigmoid(h.z)
    per = [[0.0] * T for _ in range(B)]
    reached = []
    for b in range(B):
        for t in range(T):
            Nt, R, p = by_hand_act(lam[:, b, t].tolist(), 0.01)
            reached.append(Nt)
            per[b][t] = sum(p[n] * (n + 1) for n in range(N)) + 0.1 * (Nt + R)
    assert float(halting.lookup("act").loss(h, s)) == pytest.approx(scored_mean(per, h.scored), rel=1e-12)
    if shift:
        assert set(reached) == {N}
    else:
        assert len(set(reached)) > 1


@pytest.mark.parametrize("label", ["right", "margin", "improvement"])
def test_correct_is_bce_against_its_label_at_every_application(label):
    h, s = inputs(4), HaltSettings(label=label, margin=0.4)
    per = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            nll = h.nll[:, b, t].tolist()
            tot = 0.0
            for n in range(N):
                if label == "right":
                    y = float(h.right[n, b, t])
                elif label == "margin":
                    y = float(nll[n] - nll[-1] <= 0.4)
                else:
                    y = float(n == N - 1 or nll[n] - nll[n + 1] <= 0.4)
                lam = 1 / (1 + math.exp(-float(h.z[n, b, t])))
                tot += -(y * math.log(lam) + (1 - y) * math.log(1 - lam))
            per[b][t] = tot / N
    assert float(halting.lookup("correct").loss(h, s)) == pytest.approx(scored_mean(per, h.scored), rel=1e-12)


def test_each_loss_says_how_exit_halt_reads_it():
    assert {n: halting.lookup(n).reading for n in halting.names()} == {
        "act": "sum", "pondernet": "cdf", "entropy": "cdf", "correct": "direct"}


@pytest.mark.parametrize("kw, field", [({"prior": 1.0}, "halt.prior"), ({"epsilon": 0.0}, "halt.epsilon"),
                                       ({"beta": -1.0}, "halt.beta"), ({"label": "wrong"}, "halt.label"),
                                       ({"margin": float("nan")}, "halt.margin")])
def test_bad_settings_are_one_line_errors(kw, field):
    with pytest.raises(ValueError, match=f"^{field}: ") as e:
        HaltSettings(**kw)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the training pass
def tiny(head="state", groups=((1,),), n_layer=3):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=12, vocab_size=30, groups=[list(g) for g in groups],
                    state_init="zero", halt_head=head, logit_bias=False)
    m = LoopedGPT(cfg).double()
    with torch.no_grad():
        m.halt.weight.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("head", ["state", "normed"])
def test_the_pass_hands_the_loss_each_applications_logit_and_loss(head):
    """What `forward(halting=...)` hands a loss, against independent passes: L_n is the NLL of
    model(idx, loops=[n]) (the first n applications of an N-run are an n-run: zero initial
    state), z_n the head on the trace's state x^(n), `right` the argmax of that pass, and
    the mixture at a one-hot p the NLL at that n. The loss is added to the objective's."""
    m = tiny(head)
    idx = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(2))
    tgt[0, :3] = -1
    seen = {}

    def grab(**kw):
        seen.update(kw)
        return torch.zeros((), dtype=torch.float64)

    _, loss = m(idx, tgt, loops=[5], objective=Objective(), halting=grab)
    _, plain = m(idx, tgt, loops=[5])
    assert float(loss.detach()) == pytest.approx(float(plain.detach()), rel=1e-12)  # + the zero the loss returned
    trace = []
    m(idx, loops=[5], trace=trace)
    states = next(rec for kind, _, rec in trace if kind == "group")
    for n in range(1, 6):
        logits, _ = m(idx, loops=[n])
        nll = m.nll(logits, tgt)
        assert torch.allclose(seen["nll"][n - 1], nll, atol=1e-12)
        assert torch.equal(seen["right"][n - 1], (logits.argmax(-1) == tgt) & (tgt >= 0))
        x = states[n - 1]
        if head == "normed":
            x = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        z = (x * m.halt.weight[0]).sum(-1) + m.halt.bias[0]
        assert torch.allclose(seen["z"][n - 1], z, atol=1e-12)
        onehot = torch.zeros(5, 2, 8, dtype=torch.float64)
        onehot[n - 1] = 1
        assert torch.allclose(seen["mixture"](onehot), nll, atol=1e-12)
    assert torch.equal(seen["scored"], tgt >= 0)


def test_the_head_starts_at_its_bias_and_learns_from_the_loss():
    m = tiny()
    m.reset_parameters()
    assert torch.equal(m.halt.weight, torch.zeros_like(m.halt.weight)) and float(m.halt.bias.detach()) == -3.0
    idx = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(1))
    loss_fn, s = halting.lookup("pondernet"), HaltSettings()
    _, loss = m(idx, idx, loops=[4], objective=Objective(), halting=lambda **kw: loss_fn.loss(HaltInputs(**kw), s))
    loss.backward()
    assert m.halt.weight.grad.abs().sum() > 0 and m.halt.bias.grad.abs() > 0


def test_halt_logit_is_a_per_row_dot_product():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 7, 16, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)
    z = halt_logit(x, w, torch.tensor(0.3, dtype=torch.float64), normed=False)
    assert torch.allclose(z, x @ w + 0.3, atol=1e-12)
    zn = halt_logit(x, w, torch.tensor(0.3, dtype=torch.float64), normed=True)
    assert torch.allclose(zn, F.rms_norm(x, (16,), eps=1e-6) @ w + 0.3, atol=1e-12)


def test_a_head_needs_a_recurrence_group_and_several_take_correct_alone():
    with pytest.raises(ValueError, match="^halt.loss: a halting head reads a recurrence group's state, and this model "
                                         "has none"):
        GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=12, vocab_size=30, groups=[], halt_head="state")
    with pytest.raises(ValueError, match="^halt.input: unknown 'logits'"):
        GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=12, vocab_size=30, groups=[[1]], halt_head="logits")
    assert tiny(groups=((1,), (2,)), n_layer=4).halt.weight.shape == (2, 16)  # a head per group
    for name in ("act", "pondernet", "entropy"):
        halting.check_groups(name, "right", 1)
        with pytest.raises(ValueError, match=f"^halt.loss: {name} needs the loss after every application of every "
                                             "group") as e:
            halting.check_groups(name, "right", 3)
        assert "\n" not in str(e.value)
    halting.check_groups("correct", "margin", 3)
    with pytest.raises(ValueError, match="^halt.label: improvement compares two successive applications"):
        halting.check_groups("correct", "improvement", 2)


def test_a_drawn_application_trains_on_its_own_term():
    """`sampled` inputs (an earlier group's: entries (n, N)): correct's per-token loss is the
    BCE at the drawn n alone, its label against the last entry's loss (margin) or the drawn
    n's argmax (right), by hand."""
    g = torch.Generator().manual_seed(9)
    z = torch.randn(2, B, T, generator=g, dtype=torch.float64)
    nll = torch.rand(2, B, T, generator=g, dtype=torch.float64)
    right = torch.rand(2, B, T, generator=g) > 0.5
    scored = torch.ones(B, T, dtype=torch.bool)
    h = HaltInputs(z, nll, right, scored, None, sampled=True)
    for label, y in (("right", right[0].double()), ("margin", (nll[0] - nll[1] <= 0.1).double())):
        got = halting.lookup("correct").per_token(h, HaltSettings(label=label, margin=0.1))
        lam = torch.sigmoid(z[0])
        want = -(y * lam.log() + (1 - y) * (1 - lam).log())
        assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("state_init", ["zero", "normal"])
def test_each_groups_term_is_its_drawn_application_and_the_rest_of_the_pass(state_init):
    """On two groups, `forward(halting=...)` hands the loss one `sampled` term a pass, of a
    drawn group read by its own head: each row's drawn n and the last N, where L_n is the NLL
    of an independent pass with that group run n times (the other at its count; with a noisy
    initial state, the pass's own noise replayed), z the group's head on that pass's state
    x^(n), and the entry N the pass itself. Over seeds both groups and every n are drawn."""
    m = tiny(groups=((1,), (2,)), n_layer=4)
    m.cfg.state_init = state_init
    idx = torch.randint(0, 30, (3, 8), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 30, (3, 8), generator=torch.Generator().manual_seed(2))
    loops = [4, 3]
    drawn = {0: set(), 1: set()}
    for seed in range(16):
        calls = []

        def grab(calls=calls, **kw):
            calls.append(kw)
            return torch.zeros((), dtype=torch.float64)

        noise = torch.Generator().manual_seed(100 + seed)
        start = noise.get_state()
        logits, _ = m(idx, tgt, loops=loops, objective=Objective(), halting=grab, generator=noise)
        assert [c["sampled"] for c in calls] == [True]
        got, matched = calls[0], []
        assert got["z"].shape == (2, 3, 8)
        for g in (0, 1):  # which group was drawn: the one whose head and states give its z_N
            trace = []
            replay = torch.Generator().manual_seed(0)
            replay.set_state(start)
            m(idx, loops=loops, trace=trace, generator=replay)
            x = next(rec for kind, i, rec in trace if kind == "group" and i == g)[-1]
            if not torch.allclose(got["z"][1], (x * m.halt.weight[g]).sum(-1) + m.halt.bias[g], atol=1e-12):
                continue
            matched.append(g)
            assert torch.allclose(got["nll"][1], m.nll(logits, tgt), atol=1e-12)
            for b in range(3):
                found = []
                for n in range(1, loops[g] + 1):
                    replay = torch.Generator().manual_seed(0)
                    replay.set_state(start)
                    trace = []
                    ref, _ = m(idx, loops=[n if i == g else c for i, c in enumerate(loops)], trace=trace,
                               generator=replay)
                    x = next(rec for kind, i, rec in trace if kind == "group" and i == g)[n - 1]
                    z = (x[b] * m.halt.weight[g]).sum(-1) + m.halt.bias[g]
                    if torch.allclose(got["z"][0, b], z, atol=1e-12):
                        found.append(n)
                        assert torch.allclose(got["nll"][0, b], m.nll(ref, tgt)[b], atol=1e-12)
                        assert torch.equal(got["right"][0, b], ref[b].argmax(-1) == tgt[b])
                    if n == loops[g]:
                        assert torch.allclose(got["z"][1, b], z, atol=1e-12)
                assert len(found) == 1, found
                drawn[g].add(found[0])
        assert len(matched) == 1
    assert drawn == {0: {1, 2, 3, 4}, 1: {1, 2, 3}}


@pytest.fixture
def expected_depth(monkeypatch):
    """A loss of this test only: Σ p_n L_n + β Σ p_n n (the expected depth as the ponder cost)."""
    import copy

    monkeypatch.setattr(halting, "_REGISTRY", copy.copy(halting._REGISTRY))

    class ExpectedDepth(halting.HaltingLoss):
        name = "expected_depth"
        reading = "cdf"

        def per_token(self, h, s):
            p = halting.halting_distribution(h.z).exp()
            n = torch.arange(1, p.shape[0] + 1, dtype=p.dtype).view(-1, 1, 1)
            return (p * h.nll).sum(0) + s.beta * (p * n).sum(0)

    return ExpectedDepth


def test_a_halting_loss_is_one_class(expected_depth, env, tmp_path):
    """docs/contributing.md, "Add a halting loss": the class above is `halt=expected_depth`;
    a debug-size run trains a head with it through `train(cfg)` (its head moves off zero)."""
    from recdepth.cli.runner import compose_job
    from recdepth.train import train

    assert halting.lookup("expected_depth").reading == "cdf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECDEPTH_CACHE", env["RECDEPTH_CACHE"])
        mp.setenv("WANDB_MODE", "offline")
        cfg = compose_job("config", ["debug=tiny", "model=single", "halt=expected_depth", "halt.beta=0.1",
                                    "eval.tokens=0", "callbacks=none", f"runs_dir={tmp_path / 'runs'}",
                                    f"run_dir={tmp_path / 'run'}"])
        assert cfg.halt.loss == "expected_depth"
        train(cfg)
    ckpt = torch.load(tmp_path / "run" / "train" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["halt"]["loss"] == "expected_depth"
    assert ckpt["hyper_parameters"]["model"]["halt_reading"] == "cdf"
    assert ckpt["state_dict"]["model.halt.weight"].abs().sum() > 0


def test_huginns_format_refuses_a_halting_head(tmp_path):
    """Huginn's checkpoint format has no place for the head: save_hf refuses it in one line
    rather than dropping it."""
    from recdepth.integrations.hf import save_hf

    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=12, vocab_size=30, groups=[[1, 2]], position="rope",
                    mlp="gated_silu", scale_embeddings=True, latent_norm=True, logit_bias=False, halt_head="state")
    with pytest.raises(ValueError, match=r"^save_hf: model.halt_head: 'state' has no counterpart in Huginn's") as e:
        save_hf(LoopedGPT(cfg), tmp_path / "hf")
    assert "\n" not in str(e.value) and not (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize("groups", [((1,),), ((1,), (2,))], ids=["one_group", "two_groups"])
def test_through_state_false_keeps_corrects_gradient_on_the_head(groups):
    """`halt.through_state=false` (`forward(halt_through_state=False)`): correct's term, whose
    labels carry no gradient, moves the heads alone; with it true the layers too."""
    m = tiny(groups=groups, n_layer=2 + len(groups))
    idx = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(1))
    fn, s = halting.lookup("correct"), HaltSettings()
    layers = [p for n, p in m.named_parameters() if n.startswith("h.")]
    for through in (True, False):
        _, plain = m(idx, idx, loops=[3] * len(groups))
        _, loss = m(idx, idx, loops=[3] * len(groups), objective=Objective(), halt_through_state=through,
                    halting=lambda **kw: fn.loss(HaltInputs(**kw), s), generator=torch.Generator().manual_seed(2))
        grads = torch.autograd.grad(loss - plain, layers + [m.halt.weight], allow_unused=True)
        moved = sum(0.0 if g is None else float(g.abs().sum()) for g in grads[:-1])
        assert (moved > 1e-6) is through, (through, moved)
        assert grads[-1].abs().sum() > 0
