"""Continuous compute (`eval.warm_start`, docs/spec.md §4): a token's loop in group g starts
from the state group g's loop ended with for the previous token of the same window."""

import csv
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from recdepth import exits
from recdepth.decode.engine import RowNoise, decode_step, noise_seed, windows
from recdepth.decode.kv_cache import new_caches
from recdepth.decode.scoring import evaluate_exit, evaluate_oracle
from recdepth.decode.settings import DecodeSettings
from tests.decode.helpers import model

T = 12  # the tiny models' block size


def decode_rows(m, idx, policy, warm_start, sharing="latest", compact=True, seqs=None, seed=7):
    """Rows [B, L] decoded side by side from position 0 (one window per row, noise keyed
    by `seqs`): logits [B, L, V] and applications [B, L, G]."""
    B, L = idx.shape
    caches = new_caches(m, B, T, sharing, policy.max_steps_bound)
    noise = RowNoise(seed, range(B) if seqs is None else seqs)
    warm = [None] * m.n_groups if warm_start else None
    out, apps = [], []
    for p in range(L):
        logits, a = decode_step(m, idx[:, p], p, caches, policy, DecodeSettings(compact=compact), noise=noise,
                                warm=warm)
        out.append(logits)
        apps.append(a)
    return torch.stack(out, 1), torch.stack(apps, 1)


@torch.no_grad()
def slow_reference(m, tokens, n_tokens, n, seed, sharing="latest"):
    """The definition, written out: each window alone (batch 1), position by position; group
    g runs n[g] applications of `model.apply_group`, starting at position 0 from the keyed
    noise and at every later position from the state its own loop ended with at the
    previous position. Returns the NLL of every scored token, in stream order."""
    nll = []
    for start, L in windows(n_tokens, T):
        w = start // T
        caches = new_caches(m, 1, T, sharing, max(n))
        prev = {}
        for p in range(L):
            x = m.embed(tokens[start + p].view(1, 1), pos0=p)
            for kind, i in m.plan:
                if kind == "layer":
                    x = m.h[i](x, caches[i], p)
                    continue
                e_proj = m.adapters[i].input(x)
                s = prev[i] if p > 0 else m.initial_state(x, row_seeds=[noise_seed(seed, w, p, i)])
                for j in range(n[i]):
                    for layer in m.cfg.groups[i]:
                        caches[layer].step = j  # read by the per-step cache only
                    s = m.apply_group(i, s, e_proj, caches, p)
                if sharing == "per_step":
                    for layer in m.cfg.groups[i]:
                        caches[layer].finish(p, torch.tensor([n[i]]))
                prev[i] = x = s
            nll.append(m.nll(m.decode_logits(x)[:, 0], tokens[start + p + 1].view(1)).item())
    return np.array(nll)


# ------------------------------------------------------------------ (a) the definition
@pytest.mark.parametrize("sharing", ["latest", "per_step"])
@pytest.mark.parametrize("n", [[3, 3], [2, 5]])
def test_warm_start_equals_the_slow_reference(sharing, n):
    m = model([[1], [2, 3]], state_init="normal")
    tokens = torch.randint(0, 60, (31,), generator=torch.Generator().manual_seed(21))
    ref = slow_reference(m, tokens, 30, n, seed=5, sharing=sharing)
    policy = exits.build("fixed", None, max_steps=n)
    run = DecodeSettings(seed=5, cache=sharing, batch_size=2, latency_tokens=0)
    ev, rec = evaluate_exit(m, tokens, policy, n_tokens=30, settings=run.replace(warm_start=True))
    np.testing.assert_allclose(rec["nll"], ref, rtol=0, atol=1e-10)
    assert (rec["apps"] == np.array(n)).all() and ev["warm_start"] is True
    # the reference is not the cold evaluation: it starts later tokens from other states
    _, cold = evaluate_exit(m, tokens, policy, n_tokens=30, settings=run)
    assert np.abs(cold["nll"] - ref).max() > 1e-4


# ---------------------------------------------------------- (b) batches are exact per row
@pytest.mark.parametrize("sharing, compact, rule, tau", [("latest", True, "accel", 0.5), ("per_step", True, "kl", 1e-3),
                                                         ("latest", False, "kl", 1e-3)])
def test_batched_rows_with_warm_start_equal_batch_one(sharing, compact, rule, tau):
    """Compacted (exited rows dropped from the layers' work) or masked: each row carries its
    own warm states and gets exactly its batch-1 result."""
    m = model([[1], [2, 3]], state_init="normal")
    idx = torch.randint(0, 60, (4, T), generator=torch.Generator().manual_seed(22))
    policy = exits.build(rule, tau, max_steps=12)
    batched, apps_b = decode_rows(m, idx, policy, True, sharing, compact, seqs=[10, 11, 12, 13])
    # rows leave the loop at different depths at the same position: the batch is compacted
    assert sum(len(set(apps_b[:, p, 0].tolist())) > 1 for p in range(1, T)) >= 3
    for r in range(4):
        alone, apps_1 = decode_rows(m, idx[r : r + 1], policy, True, sharing, seqs=[10 + r])
        torch.testing.assert_close(batched[r : r + 1], alone, rtol=1e-10, atol=1e-10)
        assert torch.equal(apps_b[r : r + 1], apps_1)


def test_evaluate_exit_with_warm_start_batched_equals_batch_one():
    """Through evaluate_exit: batch 4 gives every token's batch-1 NLL and applications, and
    the batch-1 latency pass runs warm too (its batch_check agrees with the batched pass)."""
    m = model([[1], [2, 3]], state_init="normal")
    tokens = torch.randint(0, 60, (31,), generator=torch.Generator().manual_seed(23))
    policy = exits.build("accel", 0.5, max_steps=12)
    _, r1 = evaluate_exit(m, tokens, policy, n_tokens=30,
                          settings=DecodeSettings(batch_size=1, latency_tokens=0, seed=3, warm_start=True))
    ev4, r4 = evaluate_exit(m, tokens, policy, n_tokens=30,
                            settings=DecodeSettings(batch_size=3, latency_tokens=16, seed=3, warm_start=True,
                                                    warmup_tokens=2))
    np.testing.assert_allclose(r4["nll"], r1["nll"], rtol=0, atol=1e-10)
    assert (r1["apps"] == r4["apps"]).all() and len(set(r4["apps"].flatten().tolist())) > 1
    assert ev4["batch_check"]["apps_mismatch"] == 0 and ev4["batch_check"]["max_abs_dnll"] < 1e-10
    assert ev4["warm_start"] is True


# ------------------------------------------------ (c) first position cold, later ones not
@pytest.mark.parametrize("rule, tau", [("fixed", None), ("stepnorm", 0.3)])
def test_first_position_of_each_window_is_cold_and_later_ones_are_not(rule, tau):
    m = model([[1], [2, 3]], state_init="normal")
    tokens = torch.randint(0, 60, (40,), generator=torch.Generator().manual_seed(24))
    policy = exits.build(rule, tau, max_steps=6)
    run = DecodeSettings(seed=9, batch_size=3, latency_tokens=0)
    ev_c, cold = evaluate_exit(m, tokens, policy, 39, run)
    ev_d, default = evaluate_exit(m, tokens, policy, 39, run.replace(warm_start=False))
    ev_w, warm = evaluate_exit(m, tokens, policy, 39, run.replace(warm_start=True))
    assert (ev_c["warm_start"], ev_d["warm_start"], ev_w["warm_start"]) == (False, False, True)
    assert np.array_equal(default["nll"], cold["nll"]) and np.array_equal(default["apps"], cold["apps"])
    first = warm["position"] % T == 0
    assert first.sum() == 4  # windows start at 0, 12, 24, 36
    assert np.array_equal(warm["nll"][first], cold["nll"][first])
    assert np.array_equal(warm["apps"][first], cold["apps"][first])
    d = np.abs(warm["nll"][~first] - cold["nll"][~first])
    assert (d > 1e-8).mean() > 0.9, d  # nearly every later token changes
    if rule != "fixed":  # the warm state is not the noise: the rule exits at other depths
        assert (warm["apps"][~first] != cold["apps"][~first]).any()


# ------------------------------------------------------------------------- (d) the oracle
@torch.no_grad()
@pytest.mark.parametrize("sharing", ["latest", "per_step"])
def test_oracle_with_warm_start_uses_the_n_application_history(sharing):
    """Row N of the warm oracle is exit=fixed max_steps=N with warm start; row n < N is
    token t at n applications started from the warm state that fixed N left at t − 1
    (brute force here, batch 1), never from its own shallower history."""
    m = model([[1], [2, 3]], state_init="normal")
    N, eps, seed, n_tok = 4, 0.02, 11, 15
    tokens = torch.randint(0, 60, (16,), generator=torch.Generator().manual_seed(25))
    ev, rec = evaluate_oracle(m, tokens, exits.build("oracle", eps, max_steps=N), n_tokens=n_tok,
                              settings=DecodeSettings(seed=seed, cache=sharing, batch_size=2, warm_start=True))
    assert ev["warm_start"] is True
    _, fixed = evaluate_exit(m, tokens, exits.build("fixed", None, max_steps=N), n_tokens=n_tok,
                             settings=DecodeSettings(seed=seed, cache=sharing, latency_tokens=0, warm_start=True))
    np.testing.assert_allclose(rec["nll_by_n"][:, -1], fixed["nll"], rtol=0, atol=1e-10)
    brute = np.zeros((n_tok, N))
    for t in range(n_tok):
        w, p = divmod(t, T)
        window = tokens[w * T : w * T + T + 1]
        for n in range(1, N + 1):
            caches, noise, warm = new_caches(m, 1, T, sharing, N), RowNoise(seed, [w]), [None, None]
            for q in range(p):
                decode_step(m, window[q : q + 1], q, caches, exits.build("fixed", None, max_steps=N), noise=noise,
                            warm=warm)
            logits, _ = decode_step(m, window[p : p + 1], p, caches, exits.build("fixed", None, max_steps=n),
                                    noise=noise, warm=warm)
            brute[t, n - 1] = m.nll(logits, window[p + 1 : p + 2]).item()
    np.testing.assert_allclose(rec["nll_by_n"], brute, rtol=0, atol=1e-10)
    _, cold = evaluate_oracle(m, tokens, exits.build("oracle", eps, max_steps=N), n_tokens=n_tok,
                              settings=DecodeSettings(seed=seed, cache=sharing, batch_size=2))
    assert np.abs(cold["nll_by_n"][:, :-1] - rec["nll_by_n"][:, :-1]).max() > 1e-4


def test_decode_step_checks_its_warm_states():
    m = model([[1], [2, 3]], state_init="normal")
    caches = new_caches(m, 1, T)
    with pytest.raises(ValueError, match="1 warm states for 2 recurrence groups"):
        decode_step(m, torch.tensor([3]), 0, caches, exits.build("fixed", None, max_steps=2), warm=[None])


# ------------------------------------------------------------------ config and sweeper
def test_eval_warm_start_in_every_config_with_an_eval_block():
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.config.schema import validated

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        for name, extra in (("config", []), ("evaluate", ["ckpt=x.ckpt"]),
                            ("calibrate", ["ckpt=x.ckpt", "target.layer_applications=24"]), ("report", ["ckpt=x.ckpt"])):
            cfg = compose(name, overrides=["run_dir=."] + extra)
            assert cfg.eval.warm_start is False, name
            on = compose(name, overrides=["run_dir=.", "eval.warm_start=true"] + extra)
            assert validated(on).eval.warm_start is True, name
        with pytest.raises(Exception, match="warm_start"):
            compose("evaluate", overrides=["ckpt=x.ckpt", "eval.warm_start=sometimes"])


def test_frontier_sweeper_warm_family_switch():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.recdepth_frontier.frontier_sweeper import FrontierSweeper
    from recdepth.config.frontier_grid import FrontierGrid, exit_line, settings

    parse = OverridesParser.create().parse_overrides

    def jobs(**grid):
        return [exit_line(s) for s in settings(FrontierGrid(**grid))]

    assert jobs(fixed=[1, 2], rules={"kl": [1e-3]}, oracle=[1e-2], warm_start=True) == [
        ["exit=fixed", "exit.max_steps=1"], ["exit=fixed", "exit.max_steps=2"],
        ["exit=fixed", "exit.max_steps=1", "eval.warm_start=true"],
        ["exit=fixed", "exit.max_steps=2", "eval.warm_start=true"],
        ["exit=kl", "exit.tau=0.001"], ["exit=oracle", "exit.tau=0.01"]]
    assert not any("eval.warm_start=true" in j for j in jobs(fixed=[1, 2], rules={}, oracle=[]))
    s = FrontierSweeper([1, 2], {}, [])  # on by default
    assert len(s.split_arguments(parse(["eval.tokens=8"]), None)[0]) == 4
    # the user's eval.warm_start goes to every job; the grid's warm copy would repeat it
    (batch,) = s.split_arguments(parse(["eval.warm_start=true,false"]), None)
    assert batch == [[f"eval.warm_start={v}", "exit=fixed", f"exit.max_steps={n}"]
                     for v in ("True", "False") for n in (1, 2)]
    with pytest.raises(ValueError, match="hydra.sweeper.warm_start"):
        FrontierSweeper([1, 2], {}, [], warm_start="yes")
    with pytest.raises(ValueError, match="hydra.sweeper.fixed"):
        FrontierSweeper([3], {}, [])
    with pytest.raises(ValueError, match="report.fixed"):
        from recdepth.config.schema import ReportSettings

        ReportSettings(fixed=[2, 2])


def test_one_grid_expands_the_same_for_make_frontier_and_the_report():
    """frontier_grid.settings: argmax_stability at each k and the gate at each τ after the
    rules, every setting but the fixed ones at max_steps when given, the gate's file
    appended; the sweeper's jobs are exactly these lines; the sweeper's config
    (hydra/sweeper=frontier, from the ConfigStore) holds FrontierGrid's defaults."""
    from hydra import compose, initialize_config_dir

    from hydra_plugins.recdepth_frontier.frontier_sweeper import FrontierSweeper
    from recdepth.config.build import conf_dir
    from recdepth.config.frontier_grid import FrontierGrid, exit_line, settings

    grid = FrontierGrid(fixed=[1, 3], rules={"accel": [0.1]}, patience=[2], gate_tau=[0.5], oracle=[0.0])
    got = [(s.family, exit_line(s)) for s in settings(grid, max_steps=6, gate="g.pt")]
    assert got == [("fixed", ["exit=fixed", "exit.max_steps=1"]), ("fixed", ["exit=fixed", "exit.max_steps=3"]),
                   ("grid", ["exit=accel", "exit.tau=0.1", "exit.max_steps=6"]),
                   ("grid", ["exit=argmax_stability", "exit.patience=2", "exit.max_steps=6"]),
                   ("grid", ["exit=gate", "exit.tau=0.5", "exit.max_steps=6", "exit.gate=g.pt"]),
                   ("oracle", ["exit=oracle", "exit.tau=0.0", "exit.max_steps=6"])]
    sweeper = FrontierSweeper([1, 3], {"accel": [0.1], "halt": [0.3]}, [0.0], patience=[2], gate_tau=[0.5],
                              warm_start=False)
    headed = FrontierGrid(fixed=[1, 3], rules={"accel": [0.1], "halt": [0.3]}, patience=[2], gate_tau=[0.5],
                          oracle=[0.0])
    # no ckpt= among the user's overrides: no halting head to read, so exit=halt is left out
    assert sweeper.jobs([]) == [exit_line(s) for s in settings(grid)]
    assert ["exit=halt", "exit.tau=0.3"] in [exit_line(s) for s in settings(headed, head=True)]
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("evaluate", overrides=["ckpt=x.ckpt", "hydra/sweeper=frontier"], return_hydra_config=True)
    sw, default = cfg.hydra.sweeper, FrontierGrid()
    assert sw._target_.endswith("FrontierSweeper") and sw.warm_start is True and sw.shared_rows == 64
    assert list(sw.fixed) == default.fixed and {k: list(v) for k, v in sw.rules.items()} == default.rules
    assert list(sw.oracle) == default.oracle and list(sw.patience) == [] == default.patience


# ------------------------------------------------------- (e) the frontier sweep, for real
@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_frontier_sweep_reports_warm_start_as_its_own_family(tmp_path, env, tiny_ckpt):
    """`hydra/sweeper=frontier` with its default warm-start family: the warm fixed jobs are
    their own family "fixed (warm start)" in frontier.csv/.md, compared with the cold fixed
    frontier (never part of it); a sweep whose fixed jobs are all warm uses them as its frontier."""
    from recdepth import sweep as summary

    out = tmp_path / "frontier"
    q = subprocess.run(
        [sys.executable, "-m", "recdepth.evaluate", "--multirun", "hydra/sweeper=frontier", f"ckpt={tiny_ckpt}",
         f"hydra.sweep.dir={out}", "eval.tokens=40", "eval.latency_tokens=4", "eval.repeats=1",
         "eval.warmup_tokens=1", "hydra.sweeper.fixed=[1,2,4]", "hydra.sweeper.rules.accel=[0.5]",
         "hydra.sweeper.rules.stepnorm=[]", "hydra.sweeper.rules.kl=[]", "hydra.sweeper.oracle=[]",
         "exit.max_steps=4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-3000:]
    jobs = list(csv.DictReader(open(out / "sweep_results.csv")))
    assert [(r["exit"], r["max_steps"], r["warm_start"]) for r in jobs] == [
        ("fixed", "1", "False"), ("fixed", "2", "False"), ("fixed", "4", "False"),
        ("fixed", "1", "True"), ("fixed", "2", "True"), ("fixed", "4", "True"), ("accel", "4", "False")]
    assert all(r["status"] == "ok" for r in jobs)
    for r in jobs:  # what each job ran, from its own metrics.json
        ev = json.loads((out / r["job"] / "metrics.json").read_text())["eval"]
        assert ev["warm_start"] is (r["warm_start"] == "True")
    cold = {int(r["max_steps"]): float(r["ce"]) for r in jobs[:3]}
    warm = {int(r["max_steps"]): float(r["ce"]) for r in jobs[3:6]}
    assert abs(cold[4] - warm[4]) > 1e-6  # warm start changes what the fixed grid computes
    front = {int(r["job"]): r for r in csv.DictReader(open(out / "frontier.csv"))}
    assert sorted(front) == [3, 4, 5, 6]  # the cold grid is the frontier, the warm grid a family
    assert [front[j]["family"] for j in (3, 4, 5, 6)] == ["fixed (warm start)"] * 3 + ["accel"]
    for j, n in ((3, 1), (4, 2), (5, 4)):  # compared with the cold grid: its best CE at m <= n
        assert float(front[j]["mean_applications"]) == n and int(front[j]["frontier_n"]) <= n
        assert float(front[j]["frontier_ce"]) == pytest.approx(min(cold[m] for m in cold if m <= n), abs=1e-12)
        assert float(front[j]["ce"]) == pytest.approx(warm[n], abs=1e-12)
    assert "| fixed (warm start) |" in (out / "frontier.md").read_text()
    assert "| fixed (warm start) |" in (out / "sweep_results.md").read_text()
    assert (out / "fig4_exits.png").is_file()
    # all-warm: the same warm jobs alone, and the accel job, form a sweep with the warm frontier
    alone = tmp_path / "warm_only"
    for k, j in enumerate((3, 4, 5, 6)):
        shutil.copytree(out / str(j), alone / str(k))
    summary.summarize(alone)
    front = list(csv.DictReader(open(alone / "frontier.csv")))
    assert [r["family"] for r in front] == ["accel"]
    accel_A = float(front[0]["layer_applications"])  # cost in layer applications: 8 + 4n at a uniform n
    best = min((n for n in warm if 8 + 4 * n <= accel_A), key=warm.get, default=None)
    assert (front[0]["frontier_n"] or None) == (None if best is None else str(best))


def test_the_default_frontier_sweep_draws_and_tabulates_the_warm_start_family(tmp_path, tiny_ckpt, cli_here,
                                                                                monkeypatch):
    """hydra/sweeper=frontier at its default (hydra.sweeper.warm_start=true), in-process: the
    sweeper adds the fixed grid again under eval.warm_start=true; those jobs, and only those,
    are the family "fixed (warm start)" of frontier.csv/.md, each compared with the cold grid
    (its frontier), and Fig. 4 draws them as their own curve at their own CEs."""
    from recdepth.analysis import plots
    from recdepth.cli import runner as cli
    from tests.drawn import capture, curves, png_shows

    figs = capture(monkeypatch, plots, "fig4")
    monkeypatch.setattr(cli, "_FAILED", [])
    out = tmp_path / "frontier"
    code, err, _ = cli_here("recdepth.evaluate", [
        "--multirun", "hydra/sweeper=frontier", f"ckpt={tiny_ckpt}", f"hydra.sweep.dir={out}", "eval.tokens=12",
        "eval.latency_tokens=2", "eval.repeats=1", "eval.warmup_tokens=0", "eval.latency_backend=null",
        "hydra.sweeper.fixed=[1,2]", *(f"hydra.sweeper.rules.{r}=[]" for r in ("accel", "stepnorm", "kl")),
        "hydra.sweeper.oracle=[]", "exit.max_steps=2"], tmp_path)
    assert code == 0, err[-3000:]
    jobs = list(csv.DictReader(open(out / "sweep_results.csv")))
    assert [(r["exit"], r["max_steps"], r["warm_start"]) for r in jobs] == [
        ("fixed", "1", "False"), ("fixed", "2", "False"), ("fixed", "1", "True"), ("fixed", "2", "True")]
    ev = {int(r["job"]): json.loads((out / r["job"] / "metrics.json").read_text())["eval"] for r in jobs}
    for j in ev:  # the sweeper's own lines: eval.warm_start=true on the second copy of the grid only
        overrides = (out / str(j) / ".hydra" / "overrides.yaml").read_text()
        assert ("eval.warm_start=true" in overrides) is (j >= 2) is ev[j]["warm_start"]
    cold = {ev[j]["max_steps"]: ev[j]["ce"] for j in (0, 1)}
    warm = {ev[j]["max_steps"]: ev[j]["ce"] for j in (2, 3)}
    assert all(abs(cold[n] - warm[n]) > 1e-6 for n in (1, 2))  # warm start changes what the grid computes
    front = {int(r["job"]): r for r in csv.DictReader(open(out / "frontier.csv"))}
    assert sorted(front) == [2, 3]  # the cold grid is the frontier, the warm grid a family compared with it
    for j, n in ((2, 1), (3, 2)):
        f = front[j]
        assert (f["family"], f["warm_start"], float(f["mean_applications"])) == ("fixed (warm start)", "True", n)
        assert float(f["ce"]) == pytest.approx(warm[n], abs=1e-12)
        assert float(f["frontier_ce"]) == pytest.approx(min(cold[m] for m in cold if m <= n), abs=1e-12)
    assert "| fixed (warm start) |" in (out / "frontier.md").read_text()
    assert "| fixed (warm start) |" in (out / "sweep_results.md").read_text()
    # Fig. 4's frontier panels: the cold grid as the frontier, the warm grid its own curve, each
    # at its jobs' layer applications and CE minus the cold grid's deepest CE; the third panel
    # the warm jobs' CE minus the frontier, frontier.csv's d_hull
    (fig,) = figs
    apps = {j: float(r["layer_applications"]) for j, r in enumerate(jobs)}
    drawn = curves(fig.axes[4])
    np.testing.assert_allclose(drawn["fixed (frontier)"], [[apps[j], ev[j]["ce"] - cold[2]] for j in (0, 1)],
                               rtol=0, atol=1e-6)
    np.testing.assert_allclose(drawn["fixed (warm start)"], [[apps[j], ev[j]["ce"] - cold[2]] for j in (2, 3)],
                               rtol=0, atol=1e-6)
    np.testing.assert_allclose(curves(fig.axes[6])["fixed (warm start)"],
                               [[float(front[j]["layer_applications"]), float(front[j]["d_hull"])] for j in (2, 3)])
    assert png_shows(fig, out / "fig4_exits.png")
