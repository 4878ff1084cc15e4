"""Loop-geometry diagnostics (SPEC §2): statistics against a slow reference, the memory
bound, RNG neutrality, the LoopDynamics callback in a real Lightning fit, and the figures."""

import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from recdepth.analysis import diagnostics, plots
from recdepth.model.looped import GPTConfig, LoopedGPT
from recdepth.training.callbacks import LoopDynamics
from tests.tiny_fit import tiny_fit

CFG = dict(n_layer=6, n_head=2, n_embd=32, block_size=16, vocab_size=100, groups=[[1], [2, 3]],
           mean_recurrence=3)


def model(**kw) -> LoopedGPT:
    torch.manual_seed(0)
    return LoopedGPT(GPTConfig(**{**CFG, **kw})).eval()


def reference_states(m: LoopedGPT, idx, n):
    """Every state, in depth order, by calling the layers one by one (not through forward's
    trace): a list of (kind, index, [states]) with zero initial states."""
    out, x = [], m.embed(idx)
    for kind, i in m.plan:
        if kind == "layer":
            x = m.h[i](x)
            out.append((kind, i, [x]))
            continue
        e, s, states = x, torch.zeros_like(x), []
        for _ in range(n):
            s = m.adapters[i].state(s) + m.adapters[i].input(e)
            for layer in m.cfg.groups[i]:
                s = m.h[layer](s)
            states.append(s)
        out.append((kind, i, states))
        x = s
    return out


def per_token_reference(states):
    """Step norms, cosines and accelerations of one token's trajectory, in float64 Python."""
    xs = [np.asarray(s, dtype=np.float64) for s in states]
    D = [xs[k + 1] - xs[k] for k in range(len(xs) - 1)]
    nrm = [math.sqrt(float(d @ d)) for d in D]
    cos = [float(D[k] @ D[k - 1]) / (nrm[k] * nrm[k - 1]) for k in range(1, len(D))]
    acc = [math.sqrt(float((D[k] - D[k - 1]) @ (D[k] - D[k - 1]))) for k in range(1, len(D))]
    return nrm, cos, acc


@torch.no_grad()
def test_statistics_match_a_slow_per_token_reference():
    m = model(state_init="zero")  # deterministic initial state: the reference can redo it
    idx = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(1))
    n = 6
    d = diagnostics.loop_dynamics(m, idx, loops=n, pca_tokens=5)
    ref = reference_states(m, idx, n)
    trajs = [states for kind, _, states in ref if kind == "group"]
    B, T = idx.shape
    for g, states in enumerate(trajs):
        per_tok = [per_token_reference([s[b, t] for s in states]) for b in range(B) for t in range(T)]
        for j, q in enumerate(("step_norm", "step_cosine", "acceleration")):
            vals = np.array([p[j] for p in per_tok])  # [tokens, K or K-1]
            np.testing.assert_allclose(d["groups"][g][q]["mean"], vals.mean(0), rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(d["groups"][g][q]["std"], vals.std(0), rtol=1e-3, atol=1e-6)
        xn = np.array([[np.linalg.norm(np.float64(s[b, t])) for s in states] for b in range(B) for t in range(T)])
        np.testing.assert_allclose(d["groups"][g]["state_norm"]["mean"], xn.mean(0), rtol=1e-5)
        assert d["groups"][g]["rounding_floor"] == pytest.approx(2.0**-23 * xn.mean(), rel=1e-5)  # fp32 eps
        assert len(d["groups"][g]["step_norm"]["mean"]) == n - 1
        assert len(d["groups"][g]["step_cosine"]["mean"]) == n - 2
    # DLR at the boundary 0 -> 1, per token from eq. 2 written out.
    dlr = []
    for b in range(B):
        for t in range(T):
            nrm = per_token_reference([s[b, t] for s in trajs[0]])[0]
            drift = np.linalg.norm(np.float64(trajs[1][0][b, t]) - np.float64(trajs[0][-1][b, t]))
            dlr.append(drift / (sum(nrm) / len(nrm)))
    (bd,) = d["dlr"]
    assert bd["name"] == "1→2-3" and (bd["from"], bd["to"]) == (0, 1)
    assert bd["mean"] == pytest.approx(np.mean(dlr), rel=1e-4)
    assert bd["std"] == pytest.approx(np.std(dlr), rel=1e-3)
    assert bd["median"] == pytest.approx(np.median(dlr), rel=1e-4)
    assert d["batch"] == {"sequences": 3, "seq_len": 8, "tokens": 24, "rows_per_pass": 3}


@torch.no_grad()
def test_pca_of_the_union_of_states_matches_an_eigendecomposition():
    m = model(state_init="zero")
    idx = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    n, row, tokens = 5, 1, 6
    p = diagnostics.loop_dynamics(m, idx, loops=n, pca_sequence=row, pca_tokens=tokens)["pca"]
    ref = reference_states(m, idx, n)
    # Depth order: layer 0, group 1 (n states), group 2-3 (n states), layer 4, layer 5.
    assert [(s["kind"], s["index"], s["states"]) for s in p["stages"]] == [
        ("layer", 0, 1), ("group", 0, n), ("group", 1, n), ("layer", 4, 1), ("layer", 5, 1)]
    X = np.concatenate([np.float64(s[row, :tokens]) for _, _, states in ref for s in states])
    Xc = X - X.mean(0)
    w, V = np.linalg.eigh(Xc.T @ Xc)  # ascending eigenvalues
    top = V[:, ::-1][:, :2]
    np.testing.assert_allclose(p["explained_variance"], w[::-1][:2] / w.sum(), rtol=1e-6)
    xy = np.asarray(p["xy"]).reshape(-1, 2)  # [S * tokens, 2] in the same order as X
    proj = Xc @ top
    for a in range(2):  # equal up to the sign of each axis (rounded to 5 decimals in the JSON)
        sign = np.sign(proj[:, a] @ xy[:, a])
        np.testing.assert_allclose(xy[:, a], sign * proj[:, a], atol=2e-5)
    assert p["token_ids"] == idx[row, :tokens].tolist() and p["sequence"] == row


def test_capture_is_chunked_to_the_memory_bound_without_changing_results(monkeypatch):
    m = model(state_init="zero")
    idx = torch.randint(0, 100, (5, 16), generator=torch.Generator().manual_seed(3))
    n = 7
    whole = diagnostics.loop_dynamics(m, idx, loops=n)
    # Every captured state is [rows, 16, 32] float32; a pass holds 3 layers + 2 groups × n states.
    per_row = (3 + 2 * n) * 16 * 32 * 4
    budget = 2 * per_row + 1  # room for two rows
    peaks = []
    real = diagnostics.capture

    def spy(*a, **k):
        trace = real(*a, **k)
        peaks.append(sum(st.numel() * st.element_size() for _, _, st in trace))
        return trace

    monkeypatch.setattr(diagnostics, "capture", spy)
    chunked = diagnostics.loop_dynamics(m, idx, loops=n, max_state_bytes=budget)
    assert chunked["batch"]["rows_per_pass"] == 2 and len(peaks) == 3  # rows 0-1, 2-3, 4
    assert max(peaks) <= budget
    for g in range(2):
        for q in ("step_norm", "step_cosine", "acceleration"):
            np.testing.assert_allclose(chunked["groups"][g][q]["mean"], whole["groups"][g][q]["mean"], rtol=1e-5)
    assert chunked["dlr"][0]["mean"] == pytest.approx(whole["dlr"][0]["mean"], rel=1e-5)
    np.testing.assert_allclose(chunked["pca"]["xy"], whole["pca"]["xy"], atol=1e-4)


@torch.no_grad()
def test_a_converged_loop_is_flagged_at_the_rounding_floor():
    m = model()
    m.adapters[0].state.weight.zero_()  # group 0 ignores its state: x^(k) is the same for every k
    d = diagnostics.loop_dynamics(m, torch.randint(0, 100, (2, 8)), loops=5)
    g0, g1 = d["groups"]
    assert g0["step_norm"]["mean"] == [0.0] * 4 and g0["first_k_near_floor"] == 0
    assert g0["step_cosine"]["mean"] == [0.0] * 3  # a zero step has no direction (geometry.step_cosine)
    assert g1["first_k_near_floor"] is None  # 5 loops of a random group: steps still large


def test_white_noise_steps_have_cosine_minus_one_half():
    """Why the floor matters: once x^(k) is a fixed point plus independent rounding noise
    n_k, Δ^(k) = n_{k+1} − n_k and Δ^(k−1) = n_k − n_{k−1} share −n_k and +n_k, so
    E cos = −Var(n)/(2 Var(n)) = −1/2, whatever the loop does."""
    from recdepth.analysis import geometry as geo

    x = torch.randn(40, 2000, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert geo.step_cosines(x).mean().item() == pytest.approx(-0.5, abs=0.01)


def test_paper_size_capture_fits_the_default_bound():
    cfg = GPTConfig.from_size("paper", groups=[[4], [5, 6], [7]], vocab_size=50257)
    with torch.device("meta"):
        m = LoopedGPT(cfg)
    n_states = 3 * 30 + 8  # 30 applications of 3 groups + the 8 layers run once
    row = n_states * 512 * 768 * 4
    rows = diagnostics.rows_per_pass(m, 512, [30] * 3, diagnostics.DEFAULT_MAX_STATE_BYTES)
    assert rows == 1 and rows * row <= diagnostics.DEFAULT_MAX_STATE_BYTES
    assert diagnostics.rows_per_pass(m, 512, [30] * 3, 10 * row) == 10


def test_diagnostics_leave_the_global_rng_and_the_mode_alone():
    m = model()  # Huginn noise: drawn from the diagnostics' own generator
    m.train()
    idx = torch.randint(0, 100, (2, 8))
    before = torch.get_rng_state()
    a = diagnostics.loop_dynamics(m, idx, loops=4, seed=5)
    assert torch.equal(torch.get_rng_state(), before) and m.training
    b = diagnostics.loop_dynamics(m, idx, loops=4, seed=5)
    c = diagnostics.loop_dynamics(m, idx, loops=4, seed=6)
    assert a["groups"] == b["groups"]  # same seed, same noise: checkpoints are comparable
    assert a["groups"] != c["groups"]


@pytest.mark.parametrize("kw, msg", [(dict(loops=2), "loops must be >= 3"),
                                     (dict(pca_sequence=4), "pca_sequence=4")])
def test_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        diagnostics.loop_dynamics(model(), torch.zeros(2, 4, dtype=torch.long), **kw)
    with pytest.raises(ValueError, match="no recurrence groups"):
        diagnostics.loop_dynamics(model(groups=[]), torch.zeros(2, 4, dtype=torch.long))


def test_summary_scalars():
    d = diagnostics.loop_dynamics(model(), torch.randint(0, 100, (2, 8)), loops=5)
    s = diagnostics.summary_scalars(d)
    g = d["groups"][1]
    assert s["geometry/g2-3/step_norm_ratio"] == pytest.approx(g["step_norm"]["mean"][-1] / g["step_norm"]["mean"][0])
    assert s["geometry/g2-3/cosine_tail_mean"] == pytest.approx(np.mean(g["step_cosine"]["mean"][1:]))  # k = 2, 3
    assert s["geometry/dlr/1_to_2-3_mean"] == d["dlr"][0]["mean"]


# ------------------------------------------------------------- the callback
def fit(tmp, callback: bool, max_steps=5, every=2):
    """A real Lightning fit of a tiny LoopedLM, with or without LoopDynamics; returns (module, callback)."""
    held = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(1))
    cbs = [LoopDynamics(held, tmp, every_n_steps=every, loops=6, pca_tokens=4)] if callback else []
    lm, _ = tiny_fit(tmp, cbs, max_steps=max_steps)
    return lm, (cbs[0] if cbs else None)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    fit(d, callback=True)
    return d


def test_callback_writes_step_0_every_cadence_and_the_end(run_dir):
    files = diagnostics.diagnostics_files(run_dir)
    assert [p.name for p in files] == ["step_0.json", "step_2.json", "step_4.json", "step_5.json"]
    hist = diagnostics.load_diagnostics(run_dir)
    assert [h["global_step"] for h in hist] == [0, 2, 4, 5]
    assert all(h["loops"] == 6 and h["batch"]["tokens"] == 24 for h in hist)
    assert hist[0]["groups"] != hist[-1]["groups"]  # training moved the geometry
    # Scalars reached the logger at the diagnostics steps.
    import csv

    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    logged = {int(r["step"]) for r in rows if r.get("geometry/dlr/1_to_2-3_mean")}
    assert logged == {0, 2, 4, 5}
    names = sorted(p.name for p in (run_dir / "figures").iterdir())
    assert names == sorted(f"{f}.{x}" for f in ("fig1_pca", "fig2_dlr", "fig3_loop_dynamics", "fig5_cosines")
                           for x in ("png", "pdf"))


def test_callback_does_not_change_training(tmp_path):
    a, cb = fit(tmp_path / "a", callback=True)
    b, _ = fit(tmp_path / "b", callback=False)
    assert cb.seconds > 0 and len(cb.history) == 4
    for (k, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), k


def test_a_fresh_run_refuses_old_diagnostics(tmp_path, run_dir):
    shutil.copytree(run_dir / "diagnostics", tmp_path / "diagnostics")
    with pytest.raises(FileExistsError, match="already holds diagnostics"):
        fit(tmp_path, callback=True)
    assert len(list((tmp_path / "diagnostics").glob("step_*.json"))) == 4  # untouched


@pytest.mark.parametrize("kw, field", [(dict(every_n_steps=0), "every_n_steps"), (dict(loops=2), "loops"),
                                       (dict(pca_sequence=3), "pca_sequence"),
                                       (dict(batch=torch.zeros(4)), "batch")])
def test_callback_validates_its_fields(tmp_path, kw, field):
    args = {"batch": torch.zeros(3, 8, dtype=torch.long), "run_dir": tmp_path, **kw}
    with pytest.raises(ValueError, match=f"callbacks.loop_dynamics.{field}: expected"):
        LoopDynamics(**args)


# ---------------------------------------------------------------- figures
def test_figures_redraw_from_the_json_alone(tmp_path, run_dir):
    only = tmp_path / "copy"
    shutil.copytree(run_dir / "diagnostics", only / "diagnostics")
    p = subprocess.run([sys.executable, "-m", "recdepth.figures", str(only)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    written = p.stdout.split()
    assert len(written) == 8
    for f in written:
        head = open(f, "rb").read(8)
        assert head.startswith(b"\x89PNG") if f.endswith(".png") else head.startswith(b"%PDF")


def test_figure_contents_follow_the_json(run_dir):
    import matplotlib.pyplot as plt

    hist = diagnostics.load_diagnostics(run_dir)
    K = hist[-1]["steps"]  # 5
    f3 = plots.fig3_loop_dynamics(hist, steps=4)
    axes = f3.axes
    assert len(axes) == 2 * 2
    for ax in axes[:2]:  # row a: step norms, k = 0..3, one curve per checkpoint
        curves = [ln for ln in ax.lines if ln.get_label().startswith("step ")]
        assert len(curves) == len(hist) and list(ax.lines[0].get_xdata()) == [0, 1, 2, 3]
    np.testing.assert_allclose(axes[1].lines[-1].get_ydata(), hist[-1]["groups"][1]["step_norm"]["mean"][:4])
    for ax in axes[2:]:  # row b: cosines, k = 1..3
        assert list(ax.lines[0].get_xdata()) == [1, 2, 3]
    f5 = plots.fig5_cosines(hist)
    assert len(f5.axes) == 2 and list(f5.axes[0].lines[0].get_xdata()) == list(range(1, K))
    f2 = plots.fig2_dlr(hist)
    ax = f2.axes[0]
    mean_line = ax.lines[0]
    assert list(mean_line.get_xdata()) == [0, 2, 4, 5]
    np.testing.assert_allclose(mean_line.get_ydata(), [h["dlr"][0]["mean"] for h in hist])
    f1 = plots.fig1_pca(hist[-1])
    S, n_tok = len(hist[-1]["pca"]["xy"]), len(hist[-1]["pca"]["xy"][0])
    (lc,) = f1.axes[0].collections[:1]
    assert len(lc.get_segments()) == (S - 1) * n_tok  # one polyline per token through every state
    assert "PC 1" in f1.axes[0].get_xlabel() and f1.axes[0].child_axes  # the inset zoom
    for f in (f1, f2, f3, f5):
        plt.close(f)


def test_figures_cli_errors_name_the_problem(tmp_path, cli_here):
    code, err, _ = cli_here("recdepth.figures", [tmp_path], tmp_path)
    assert code == 2 and "no diagnostics/step_*.json" in err and str(tmp_path) in err
    (tmp_path / "diagnostics").mkdir()
    (tmp_path / "diagnostics" / "step_3.json").write_text("{not json")
    code, err, _ = cli_here("recdepth.figures", [tmp_path], tmp_path)
    assert code == 2 and "step_3.json: not readable JSON" in err
    assert len(err.strip().splitlines()) == 1
