"""The comparison report (recdepth/report.py) on a tiny checkpoint, in-process: every family
of jobs is scored and written as a recdepth.evaluate job of one frontier sweep, the table's
winner is the one its rule says (recomputed here from the calibration split's numbers,
never the test split's), every setting but the oracle shares one batch (so its latency is
timed round-robin with the others: tests/decode/test_decoding.py), and a calibrated job's
override line reruns it in recdepth.evaluate with the same result."""

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recdepth.analysis.token_files import read_tokens
from recdepth.config.build import conf_dir

SMALL = ["report.max_steps=4", "report.fixed=[1,4]", "report.rules.accel=[0.1]", "report.rules.kl=[0.01]",
         *(f"report.rules.{r}=[]" for r in ("stepnorm", "stepnorm_rel", "accel_rel", "entropy_diff", "cosine")), "report.patience=[1]",
         "report.gate_tau=[0.5]", "report.calibrate=[fixed,accel,gate]", "report.max_ce_increase=0.02",
         "report.layer_applications=18", "gate.tokens=128", "gate.steps=20", "eval.tokens=24", "eval.latency_tokens=2",
         "eval.repeats=1", "eval.warmup_tokens=0", "calibration.tokens=24", "calibration.max_evals=4",
         "eval.latency_backend=null"]  # the default (auto) compiles its 12 timed settings: test_auto_latency_backend_...


def compose_report(*overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("report", overrides=list(overrides))


DRAWN: dict = {}  # the figures `done`'s report drew: "report" (report.png), "fig4" (jobs/fig4_exits.png)


@pytest.fixture(scope="module")
def done(tiny_ckpt, ckpt_env, tmp_path_factory):
    import recdepth.report as module
    from recdepth.analysis import plots
    from tests.drawn import capture

    out = tmp_path_factory.mktemp("report") / "r"
    with pytest.MonkeyPatch.context() as mp:
        figs = {"report": capture(mp, module, "figure"), "fig4": capture(mp, plots, "fig4")}
        res = module.report(compose_report(f"ckpt={tiny_ckpt}", f"run_dir={out}", *SMALL))
    DRAWN.update({k: v[0] for k, v in figs.items() if len(v) == 1})
    return out, res


def test_every_family_is_scored_and_summarised(done):
    out, res = done
    jobs = sorted((p for p in (out / "jobs").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    fams = [json.loads((p / "metrics.json").read_text())["family"] for p in jobs]
    # the frontier's settings in frontier_grid.settings' order (2 fixed, 2 grid rules, argmax
    # k=1, gate τ=0.5, the oracle), then 3 calibrated rules x 2 targets
    assert fams == ["fixed"] * 2 + ["grid"] * 4 + ["oracle"] + ["calibrated"] * 6
    # each job is a recdepth.evaluate job: its config.yaml composes as evaluate's, with the
    # report's test split, and its line is the setting's
    for p in jobs:
        c = OmegaConf.load(p / "config.yaml")
        m = json.loads((p / "metrics.json").read_text())
        assert c.eval.tokens == 24 and c.run_dir == str(p) and c.exit.name == m["eval"]["exit"]
        assert m["overrides"].split()[0] == f"exit={c.exit.name}"
    assert (out / "gate" / "gate.pt").is_file()
    for f in ("report.md", "report.png", "report.json", "jobs/frontier.md", "jobs/sweep_results.md",
              "jobs/fig4_exits.png"):
        assert (out / f).is_file(), f
    md = (out / "report.md").read_text()
    assert "## Calibrated to CE increase ≤ 0.02" in md and "## Calibrated to layer applications ≤ 18" in md
    # every scored job read the same test tokens
    pos = {tuple(read_tokens(p / "eval_tokens.csv")["position"]) for p in jobs}
    assert len(pos) == 1 and len(next(iter(pos))) == 24


@pytest.mark.slow  # about 35 s of compiling (make test-slow runs it)
def test_auto_latency_backend_compiles_the_reports_timings_and_changes_no_record(done, tiny_ckpt, tmp_path):
    """With eval.latency_backend at its default (auto) the report's shared pass times its 12
    settings with the compiled step where torch finds a C++ compiler (else with eval.backend),
    and every job's quality records are those of the run timed with eval.backend."""
    from recdepth.core.runtime import has_cpp_compiler
    from recdepth.report import report

    out0, _ = done
    out = tmp_path / "r"
    report(compose_report(f"ckpt={tiny_ckpt}", f"run_dir={out}", *SMALL[:-1]))
    timed = "compiled" if has_cpp_compiler() else "lean"
    seen = []
    for p in sorted((p for p in (out / "jobs").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        ev = json.loads((p / "metrics.json").read_text())["eval"]
        seen.append(ev.get("latency_backend"))
        a, b = read_tokens(p / "eval_tokens.csv"), read_tokens(out0 / "jobs" / p.name / "eval_tokens.csv")
        assert (a["nll"] == b["nll"]).all() and (a["apps"] == b["apps"]).all(), p.name
    assert seen == [timed] * 6 + [None] + [timed] * 6  # the oracle (job 6) decodes alone, untimed


def test_report_png_draws_every_scored_job_at_its_cost_and_ce(done):
    """report.png is the figure `report.figure` returned, and it plots the jobs' numbers
    (jobs/sweep_results.csv): against layer applications and against ms/token, the fixed
    depths as one curve, each rule's τ grid as one curve, each calibrated job as one marker,
    every y the job's CE minus the CE of fixed at report.max_steps. jobs/fig4_exits.png is
    Fig. 4 with the fixed frontier at the numbers of every job at one fixed depth (the
    calibrated `fixed` answers at a uniform depth among them)."""
    import csv

    from tests.drawn import curves, png_shows

    out, _ = done
    fig = DRAWN["report"]
    assert png_shows(fig, out / "report.png")
    rows = list(csv.DictReader(open(out / "jobs" / "sweep_results.csv")))
    fam = {r["job"]: json.loads((out / "jobs" / r["job"] / "metrics.json").read_text())["family"] for r in rows}
    ref = next(float(r["ce"]) for r in rows if fam[r["job"]] == "fixed" and r["max_steps"] == "4")
    for ax, key in zip(fig.axes, ("layer_applications", "ms_per_token")):
        def pts(rs, key=key):
            return sorted((float(r[key]), float(r["ce"]) - ref) for r in rs)

        drawn = curves(ax)
        np.testing.assert_allclose(drawn["fixed depth"], pts(r for r in rows if fam[r["job"]] == "fixed"), atol=1e-9)
        grid = {r["exit"] for r in rows if fam[r["job"]] == "grid"}
        assert grid == {"accel", "kl", "argmax_stability", "gate"}
        for rule in grid:
            np.testing.assert_allclose(drawn[f"{rule} (τ grid)"],
                                       pts(r for r in rows if fam[r["job"]] == "grid" and r["exit"] == rule), atol=1e-9)
        markers = sorted(tuple(line.get_xydata()[0]) for line in ax.get_lines()
                         if line.get_label().startswith("_") and len(line.get_xydata()) == 1)
        np.testing.assert_allclose(markers, pts(r for r in rows if fam[r["job"]] == "calibrated"), atol=1e-9)
    fig4 = DRAWN["fig4"]
    assert png_shows(fig4, out / "jobs" / "fig4_exits.png")
    uniform = [r for r in rows if r["exit"] == "fixed" and r["max_steps"].isdigit()]
    assert len(uniform) > 2  # the two fixed jobs and calibrated ones
    np.testing.assert_allclose(sorted(map(tuple, curves(fig4.axes[4])["fixed (frontier)"])),
                               pts(uniform, "layer_applications"), atol=1e-6)


def test_the_winner_follows_its_rule(done):
    """Recomputed from calibration.json's numbers of each job: the CE target's winner has
    the fewest layer applications on the calibration split among the rules that met the
    target there; the budget's winner the lowest calibration CE. The test split's numbers
    are reported for the winner, not used to choose it."""
    out, res = done
    rows = res["rows"]
    for kind, key in (("max_ce_increase", "layer_applications"), ("layer_applications", "ce")):
        cal = {}
        for r in (r for r in rows if r["target"] == kind):
            c = json.loads((out / "jobs" / str(r["job"]) / "metrics.json").read_text())["calibration"]
            if c["met"]:
                cal[r["job"]] = c[key]
        w = res["winners"][kind]
        if not cal:
            assert w is None
            continue
        assert cal[w["job"]] == pytest.approx(min(cal.values())) and w["chosen_on"] == "calibration split"
        r = next(r for r in rows if r["job"] == w["job"])
        assert r["rank"] == 1 and w["test_verdict"] == r["test_verdict"]
        q = "ce_increase" if kind == "max_ce_increase" else "layer_applications"
        lo, hi = r[f"test_{q}_ci"]
        assert lo <= r[f"test_{q}"] <= hi


class _Poison(dict):
    """A test-split record that fails the test if anything reads it."""

    def __getitem__(self, k):
        raise AssertionError(f"the selection read the test split ({k!r})")

    get = __getitem__


def test_the_selection_reads_no_test_record():
    from recdepth.exits.calibration.search import Target
    from recdepth.report import select

    def job(k, met, ce_inc, cost, ce):
        return {"job": k, "family": "calibrated", "rec": _Poison(), "eval": _Poison(), "test_target": _Poison(),
                "calibration": {"target": {"kind": "max_ce_increase", "value": 0.01}, "met": met,
                                "ce_increase": ce_inc, "layer_applications": cost, "ce": ce}}

    rows = [job(0, True, 0.009, 30.0, 4.0), job(1, True, 0.002, 25.0, 4.1), job(2, False, 0.03, 12.0, 4.2),
            job(3, True, 0.0, 25.0, 3.9), job(4, False, 0.011, 40.0, 4.0)]
    # met first, by cost then CE (3 before 1 at equal cost); then the misses, smallest miss first
    assert select(rows, Target("max_ce_increase", 0.01)) == [3, 1, 0, 4, 2]


def test_a_calibrated_line_reruns_in_evaluate(done, tiny_ckpt, ckpt_env, tmp_path):
    from recdepth.evaluate import evaluate

    out, res = done
    r = next(r for r in res["rows"] if r["rule"] == "accel" and r["target"] == "layer_applications")
    line = r["overrides"].split()
    ev = evaluate(compose_ev(f"ckpt={tiny_ckpt}", f"run_dir={tmp_path / 'ev'}", "eval.tokens=24",
                             "eval.latency_tokens=0", "eval.warmup_tokens=0", *line))["eval"]
    mine = read_tokens(out / "jobs" / str(r["job"]) / "eval_tokens.csv")
    theirs = read_tokens(tmp_path / "ev" / "eval_tokens.csv")
    assert np.array_equal(mine["apps"], theirs["apps"]) and np.allclose(mine["nll"], theirs["nll"], atol=1e-6)
    assert ev["layer_applications"] == pytest.approx(r["layer_applications"])


def compose_ev(*overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


def test_report_refuses_a_used_directory(done, tiny_ckpt):
    from recdepth.report import report

    out, _ = done
    with pytest.raises(FileExistsError, match="run_dir: .* already holds a report"):
        report(compose_report(f"ckpt={tiny_ckpt}", f"run_dir={out}", *SMALL))


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_the_grid_scored_as_one_batch_equals_each_setting_alone(done, tiny_ckpt, ckpt_env):
    """report.shared_rows (default 64): the fixed depths, the grids and the calibrated
    answers are scored together (`jobs.decode_shared`); each job's records are those
    of its setting decoded alone; the oracle decodes alone."""
    import torch

    from recdepth.app.checkpoints import checkpoint_data, load_checkpoint
    from recdepth.config.build import exit_policy
    from recdepth.decode.scoring import evaluate_exit
    from recdepth.decode.settings import DecodeSettings

    out, _ = done
    module, data = load_checkpoint(tiny_ckpt, torch.device("cpu"))
    tokens = torch.as_tensor(checkpoint_data(module, data, 1337).heldout_tokens(25))
    shared = 0
    for j in range(13):  # 2 fixed, 4 grid jobs, the oracle, 6 calibrated
        d = out / "jobs" / str(j)
        m = json.loads((d / "metrics.json").read_text())
        shared += m["eval"].get("shared_batch") == 12
        if m["family"] == "oracle" or "gate" in m["overrides"]:
            continue
        with initialize_config_dir(conf_dir(), version_base="1.3"):
            cfg = compose("evaluate", overrides=[f"ckpt={tiny_ckpt}", "run_dir=.", *m["overrides"].split()])
        _, alone = evaluate_exit(module.model, tokens, exit_policy(cfg), 24,
                                 DecodeSettings(seed=1337, batch_size=16, latency_tokens=0))
        rec = read_tokens(d / "eval_tokens.csv")
        assert np.allclose(rec["nll"], alone["nll"], rtol=0, atol=1e-4)
        assert np.array_equal(rec["apps"], alone["apps"]), m["overrides"]
    assert shared == 12
