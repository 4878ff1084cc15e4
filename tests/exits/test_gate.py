"""The learned exit gate (recdepth/exits/gate.py, rule `gate` in recdepth/exits/rules/builtin.py, SPEC §3c).

Expected values come from the spec's equations, computed independently here:
    label   y^(n) = [nll(n) − nll(N) > margin]       (n = 1 .. N − 1)
    gate    q^(n) = σ(w_g · x^(n) + b_g)
    rule    exit after application n when q^(n) < τ  (earliest n = 1; always at max_steps)
and nll(n) of group g is the model's own parallel forward with loops[g] = n, the other
groups at N, the noise generator seeded alike for every n.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from recdepth import exits
from recdepth.config.build import conf_dir, exit_policy
from recdepth.decode.engine import RowNoise, decode_step
from recdepth.decode.gate_states import decoding_gate_data
from recdepth.decode.kv_cache import new_caches
from recdepth.decode.settings import DecodeSettings
from recdepth.exits.gate import (
    class_weights,
    collect_gate_data,
    fit_gate,
    gate_labels,
    gate_probability,
    load_gate,
    save_gate,
)
from recdepth.model.looped import GPTConfig, LoopedGPT


def tiny_model(groups=((1,), (2, 3)), seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=5, n_head=2, n_embd=32, block_size=12, vocab_size=60, groups=[list(g) for g in groups],
                    mean_recurrence=3, state_init="normal")
    return LoopedGPT(cfg).double().eval()


def one_line_error(fn, *fragments):
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


# ------------------------------------------------------------------- the math
def test_gate_labels_by_hand():
    """N = 4, margin 0.1. Row 0: nll = 3, 2.5, 2, 2 → gains to N: 1, 0.5, 0 → 1, 1, 0.
    Row 1: 1, 1.2, 0.9, 1 → gains 0, 0.2, −0.1 → 0, 1, 0. Row 2: a gain of exactly the
    margin (0.25, exact in binary) is not "more than" it → 0."""
    nll = torch.tensor([[3.0, 2.5, 2.0, 2.0], [1.0, 1.2, 0.9, 1.0], [1.25, 1.0, 1.0, 1.0]])
    assert gate_labels(nll, 0.1).tolist() == [[True, True, False], [False, True, False], [True, False, False]]
    assert gate_labels(nll[2:], 0.25).tolist() == [[False, False, False]]
    # leading axes are kept: [2, 3, 4] -> [2, 3, 3]
    assert gate_labels(torch.stack([nll, nll]), 0.1).shape == (2, 3, 3)


def test_gate_probability_is_the_logistic_of_the_affine_score():
    x = torch.tensor([[1.0, 2.0, -1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    w, b = torch.tensor([0.5, -0.25, 2.0], dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    s0 = 0.5 * 1 - 0.25 * 2 + 2 * -1 + 0.3  # −1.7
    want = [1 / (1 + math.exp(-s0)), 1 / (1 + math.exp(-0.3))]
    assert gate_probability(x, w, b).tolist() == pytest.approx(want, abs=1e-15)


def _synthetic(n, d, w_star, b_star, gen):
    """States with an offset and unequal scales (the fit's standardisation must fold back),
    labelled by a known linear rule."""
    scale = torch.linspace(0.2, 5.0, d, dtype=torch.float64)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * scale + 3.0
    return x, (x @ w_star + b_star) > 0


def test_fit_gate_recovers_a_known_linear_stopping_rule():
    d, gen = 8, torch.Generator().manual_seed(0)
    w_star = torch.randn(d, generator=gen, dtype=torch.float64)
    b_star = -float(w_star.sum()) * 3.0 + 0.5  # the boundary passes near the data's mean
    x, y = _synthetic(4000, d, w_star, b_star, gen)
    assert 0.2 < y.double().mean() < 0.8  # both classes well represented
    w, b, st = fit_gate(x, y, steps=200)
    assert w.shape == (d,) and b.shape == () and st["label_rate"] == pytest.approx(float(y.double().mean()))
    x_new, y_new = _synthetic(4000, d, w_star, b_star, gen)  # held out
    pred = gate_probability(x_new.float(), w, b) > 0.5
    assert (pred == y_new).double().mean() >= 0.99
    assert torch.nn.functional.cosine_similarity(w.double(), w_star, dim=0) > 0.98
    assert st["accuracy"] >= 0.99


def test_fit_gate_with_one_class_is_the_constant_log_odds():
    x = torch.randn(10, 3)
    w, b, st = fit_gate(x, torch.ones(10, dtype=torch.bool))
    assert torch.equal(w, torch.zeros(3)) and b.item() == pytest.approx(math.log(10.5 / 0.5), rel=1e-6)
    assert st["accuracy"] == 1.0 and st["label_rate"] == 1.0


def _ref_gate_n(xs, w, b, tau, min_steps, max_steps):
    """Slow reference: the first n >= max(min_steps, 1) with σ(w·x^(n) + b) < τ, else max_steps
    (plain Python floats)."""
    for n in range(1, max_steps + 1):
        if n == max_steps:
            return n
        q = 1 / (1 + math.exp(-(sum(wi * xi for wi, xi in zip(w, xs[n])) + b)))
        if n >= min_steps and q < tau:
            return n


def test_exit_rule_gate_stops_where_the_known_rule_says():
    """x -> A x + c on rows with their own start: each group's gate (weight[g], bias[g])
    exits each row where the slow reference does, through `iterate` and `policy.group(g)`,
    with a per-group τ; the groups really differ."""
    d, rows, gen = 6, 40, torch.Generator().manual_seed(1)
    A = 0.8 * torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]  # a rotating contraction
    c = torch.randn(d, generator=gen, dtype=torch.float64)
    f = lambda x: x @ A.T + c  # noqa: E731
    x0 = 3 * torch.randn(rows, d, generator=gen, dtype=torch.float64)
    W = torch.randn(2, d, generator=gen, dtype=torch.float64)
    B = torch.tensor([0.2, -0.4], dtype=torch.float64)
    taus, mins, maxs = [0.3, 0.6], [0, 2], [20, 15]
    policy = exits.build("gate", taus, min_steps=mins, max_steps=maxs, gate=(W, B), groups=2)
    traj = [x0]
    for _ in range(max(maxs)):
        traj.append(f(traj[-1]))
    got = []
    for g in range(2):
        _, n = exits.iterate(f, x0.clone(), policy.group(g))
        want = [_ref_gate_n([t[r].tolist() for t in traj], W[g].tolist(), B[g].item(), taus[g], mins[g], maxs[g])
                for r in range(rows)]
        assert n.tolist() == want, g
        got.append(n.tolist())
    assert got[0] != got[1] and len(set(got[0])) > 2 and len(set(got[1])) > 2


def test_gate_policy_errors_are_one_line():
    W, B = torch.zeros(3, 8), torch.zeros(3)
    one_line_error(lambda: exits.build("gate", 0.5), "exit.gate", "recdepth.train_gate")
    for tau in (0.0, 1.0, 1.5, -0.1):
        one_line_error(lambda tau=tau: exits.build("gate", tau, gate=(W, B)), "exit.tau", "(0, 1)")
    one_line_error(lambda: exits.build("gate", [0.5, 1.0, 0.5], gate=(W, B)), "exit.tau[1]", "(0, 1)")
    one_line_error(lambda: exits.build("gate", 0.5, gate=(W, torch.zeros(2))), "exit.gate", "[G, d]")
    one_line_error(lambda: exits.build("gate", [0.5, 0.5], gate=(W, B)), "exit.tau", "a gate for 3")
    p = exits.build("gate", 0.5, gate=(W, B))
    one_line_error(lambda: p.check_groups(2), "exit.gate", "3 recurrence groups", "has 2")
    one_line_error(lambda: p.check_model(3, 16), "exit.gate", "d=8", "n_embd=16")
    assert p.check_model(3, 8) is p
    one_line_error(lambda: p.monitor(torch.zeros(1, 8)), "exit.gate", "policy.group(g)")  # all groups' gate
    one_line_error(lambda: p.group(3), "exit.gate", "3 recurrence groups")
    q = p.group(1)
    assert q.gate[0].shape == (8,) and q.group(0) is q  # one group's gate: its own group g
    assert exits.build("stepnorm", 1e-3, gate=(W, B)).gate is None  # other rules ignore it


# ------------------------------------------------------------------ the data
@torch.no_grad()
def test_collect_gate_data_equals_the_models_own_forward():
    """nll_by_n of group g at n is model(idx, loops=[.. n ..]) with the generator reseeded
    (every other group at N); the features are the N-run's trajectory (`trace`)."""
    m, N, seed = tiny_model(), 4, 5
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 60, (2, 13), generator=gen), torch.randint(0, 60, (1, 13), generator=gen)]
    data = collect_gate_data(m, batches, N, generator_seed=seed)
    assert len(data) == 2
    for g in range(2):
        feats, nll = data[g]
        assert feats.shape == (3 * 12, N - 1, 32) and nll.shape == (3 * 12, N)
        for n in range(1, N + 1):
            loops = [N, N]
            loops[g] = n
            ref = []
            for w in batches:
                logits, _ = m(w[:, :-1], loops=loops, generator=torch.Generator().manual_seed(seed))
                ref.append(m.nll(logits, w[:, 1:]).reshape(-1))
            ref = torch.cat(ref)
            torch.testing.assert_close(nll[:, n - 1].double(), ref, rtol=1e-6, atol=1e-6)
            if n < N:
                margin = 0.01
                want = (ref - nll[:, -1].double()) > margin  # the label from the independent NLLs
                assert torch.equal(gate_labels(nll, margin)[:, n - 1], want)
        trace = []
        m(batches[0][:, :-1], loops=[N, N], generator=torch.Generator().manual_seed(seed), trace=trace)
        traj = next(rec for kind, i, rec in trace if kind == "group" and i == g)
        for n in range(1, N):
            torch.testing.assert_close(feats[:24, n - 1].double(), traj[n - 1].reshape(-1, 32), rtol=1e-6, atol=1e-6)
    # depth matters: the NLLs at different n differ (the labels are not trivially constant)
    assert (data[0][1][:, 0] - data[0][1][:, -1]).abs().max() > 1e-3


@torch.no_grad()
def test_decoding_gate_data_equals_a_batch_one_decode_at_each_depth():
    """decoding_gate_data's nll(n) and state x^(n) at position t of a window are those of a
    slow batch-1 decode: positions 0 .. t − 1 at exit=fixed N, then position t at fixed n,
    its final states read through continuous compute's `warm` (leave_group is the identity
    without a latent norm), not the `states` hook the collector uses. `keep` selects targets."""
    m, N, seed, T = tiny_model(), 4, 3, 6
    gen = torch.Generator().manual_seed(1)
    wins = torch.randint(0, 60, (3, T + 1), generator=gen)
    keep = torch.rand(3, T, generator=gen) < 0.6
    data = decoding_gate_data(m, wins, N, DecodeSettings(seed=seed), keep=keep)
    K = int(keep.sum())
    assert len(data) == 2 and all(f.shape == (K, N - 1, 32) and n.shape == (K, N) for f, n in data)
    k = 0
    for w in range(3):
        for t in range(T):
            if not keep[w, t]:
                continue
            for n in range(1, N + 1):
                caches, noise = new_caches(m, 1, m.cfg.block_size, "latest", N), RowNoise(seed, [w])
                for pos in range(t):
                    decode_step(m, wins[w, pos : pos + 1], pos, caches, exits.build("fixed", None, max_steps=N),
                                noise=noise)
                warm = [None, None]
                logits, apps = decode_step(m, wins[w, t : t + 1], t, caches, exits.build("fixed", None, max_steps=n),
                                           noise=noise, warm=warm)
                assert apps.tolist() == [[n, n]]
                nll = m.nll(logits, wins[w, t + 1 : t + 2])[0]
                torch.testing.assert_close(data[0][1][k, n - 1].double(), nll, rtol=1e-5, atol=1e-5)
                if n < N:
                    for g in range(2):
                        torch.testing.assert_close(data[g][0][k, n - 1].double(), warm[g][0, 0], rtol=1e-5, atol=1e-5)
            k += 1
    assert k == K
    # the decoding states are not the parallel pass's (the reason for collecting them here)
    par = collect_gate_data(m, [wins], N, generator_seed=seed)
    assert (par[0][1][keep.reshape(-1)][:, 0] - data[0][1][:, 0]).abs().max() > 1e-4
    one_line_error(lambda: decoding_gate_data(m, wins, 1), "gate.max_steps")


def test_class_weights_and_the_balanced_fit():
    """Balanced weights give each class half the total weight. The balanced fit (no weight
    decay) is a stationary point of the class-weighted BCE (its gradient, computed here, is
    0), so its weighted mean probability is ½; the unweighted fit's mean probability is the
    label rate (the intercept's own stationarity condition)."""
    y = torch.tensor([1, 0, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    wts = class_weights(y)
    assert torch.allclose(wts[y].sum(), wts[~y].sum()) and math.isclose(float(wts.sum()), 8.0)
    assert torch.equal(class_weights(torch.ones(4, dtype=torch.bool)), torch.ones(4, dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=gen, dtype=torch.float64)
    lab = (x[:, 0] + 0.8 * torch.randn(60, generator=gen, dtype=torch.float64)) > 1.0  # rare positives
    assert 0 < int(lab.sum()) < 20
    c, yd = class_weights(lab), lab.double()
    w1, b1, st = fit_gate(x, lab, steps=300, weight_decay=0.0, balance=True)
    p = torch.sigmoid(x @ w1.double() + b1.double())
    assert ((p - yd) * c @ x / 60).abs().max() < 1e-4 and abs(float(((p - yd) * c).mean())) < 1e-4
    assert math.isclose(float((c * p).sum() / c.sum()), 0.5, abs_tol=1e-4)
    w0, b0, st0 = fit_gate(x, lab, steps=300, weight_decay=0.0)
    p0 = torch.sigmoid(x @ w0.double() + b0.double())
    assert math.isclose(float(p0.mean()), float(yd.mean()), abs_tol=1e-4)
    assert float(p.mean()) > float(p0.mean())  # balancing raises "continue" where positives are rare
    assert 0.0 <= st["balanced_accuracy"] <= 1.0 and st["label_rate"] == st0["label_rate"] == float(yd.mean())


# ------------------------------------------------------------------ the file
def test_gate_file_round_trip_and_bad_files(tmp_path):
    W, B = torch.randn(3, 8), torch.randn(3)
    save_gate(tmp_path / "gate.pt", W, B, {"margin": 0.01, "max_steps": 32})
    w, b, meta = load_gate(tmp_path / "gate.pt")
    assert torch.equal(w, W) and torch.equal(b, B) and meta["margin"] == 0.01
    one_line_error(lambda: load_gate(tmp_path / "none.pt"), "exit.gate", "no gate file")
    (tmp_path / "junk.pt").write_text("not a torch file")
    one_line_error(lambda: load_gate(tmp_path / "junk.pt"), "exit.gate", "junk.pt", "not a readable gate file")
    torch.save({"weight": W}, tmp_path / "other.pt")
    one_line_error(lambda: load_gate(tmp_path / "other.pt"), "exit.gate", "other.pt", "not a gate file")


def _eval_cfg(*overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("evaluate", overrides=["ckpt=x.ckpt", "run_dir=/tmp/unused", *overrides])


def test_exit_policy_reads_the_gate_file(tmp_path):
    W, B = torch.randn(3, 8), torch.randn(3)
    save_gate(tmp_path / "gate.pt", W, B, {})
    p = exit_policy(_eval_cfg("exit=gate", f"exit.gate={tmp_path / 'gate.pt'}", "exit.tau=0.3"))
    assert p.name == "gate" and p.tau == 0.3 and torch.equal(p.gate[0], W) and torch.equal(p.group(2).gate[1], B[2])
    one_line_error(lambda: exit_policy(_eval_cfg("exit=gate")), "exit.gate", "required")
    one_line_error(lambda: exit_policy(_eval_cfg("exit=gate", f"exit.gate={tmp_path / 'no.pt'}")), "exit.gate", "no.pt")
    one_line_error(lambda: exit_policy(_eval_cfg("exit=gate", f"exit.gate={tmp_path / 'gate.pt'}", "exit.tau=2")),
                   "exit.tau", "(0, 1)")
    assert exit_policy(_eval_cfg("exit=cosine", "exit.gate=/nowhere.pt")).gate is None  # other rules ignore it


# ------------------------------------------------------------------ end to end
@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_train_gate_then_evaluate_exit_gate(tmp_path, env, tiny_ckpt, ckpt_env):
    """The session's tiny checkpoint (debug=tiny), `python -m recdepth.train_gate` on it, then the
    evaluation under exit=gate in-process at τ = 0.05 and 0.95: a larger τ exits no later."""
    from recdepth.evaluate import evaluate

    def cli(mod, *args):
        p = subprocess.run([sys.executable, "-m", mod, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return p

    ckpt = tiny_ckpt
    gdir, N = tmp_path / "gate", 6
    p = cli("recdepth.train_gate", f"ckpt={ckpt}", "gate.tokens=256", f"gate.max_steps={N}", "gate.steps=30",
            f"hydra.run.dir={gdir}")
    meta = json.loads((gdir / "gate.json").read_text())
    assert meta["groups"] == [[4], [5, 6], [7]] and meta["tokens"] == 256 and meta["max_steps"] == N
    assert all(0 <= a <= 1 for a in meta["accuracy"]) and all(0 <= r <= 1 for r in meta["label_rate"])
    assert f"exit.gate={gdir / 'gate.pt'}" in p.stdout
    w, b, _ = load_gate(gdir / "gate.pt")
    assert w.shape == (3, 128) and b.shape == (3,)

    apps = {}
    for tau in (0.05, 0.95):
        cfg = _eval_cfg(f"ckpt={ckpt}", "exit=gate", f"exit.gate={gdir / 'gate.pt'}", f"exit.tau={tau}",
                        f"exit.max_steps={N}", "eval.tokens=24", "eval.latency_tokens=0", "eval.warmup_tokens=0",
                        "device=cpu", f"run_dir={tmp_path / f'ev{tau}'}")
        ev = evaluate(cfg)["eval"]
        assert ev["exit"] == "gate" and ev["tau"] == tau and ev["tokens"] == 24
        assert all(1 <= a <= N for a in ev["applications_per_token"])
        apps[tau] = ev["applications_per_token"]
    assert all(hi <= lo for hi, lo in zip(apps[0.95], apps[0.05])), apps
    # a gate for another model is refused before any work
    save_gate(tmp_path / "narrow.pt", torch.zeros(3, 16), torch.zeros(3), {})
    cfg = _eval_cfg(f"ckpt={ckpt}", "exit=gate", f"exit.gate={tmp_path / 'narrow.pt'}", "eval.tokens=4",
                    "device=cpu", f"run_dir={tmp_path / 'ev_bad'}")
    one_line_error(lambda: evaluate(cfg), "exit.gate", "n_embd=128")
    assert not (tmp_path / "ev_bad" / "metrics.json").exists()
