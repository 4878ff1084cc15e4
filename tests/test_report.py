"""The comparison report (recdepth/report.py) on a tiny checkpoint, in-process: every family
of jobs is scored and written as a sweep job, the table's winner is the one its rule says
(recomputed here from the jobs' own per-token records), and a calibrated job's override
line reruns it in recdepth.evaluate with the same result."""

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from recdepth.config import conf_dir
from recdepth.stats import read_tokens

SMALL = ["report.max_steps=4", "report.fixed=[1,4]", "report.rules.accel=[0.1]", "report.rules.kl=[0.01]",
         *(f"report.rules.{r}=[]" for r in ("stepnorm", "stepnorm_rel", "accel_rel", "entropy_diff", "cosine")), "report.patience=[1]",
         "report.gate_tau=[0.5]", "report.calibrate=[fixed,accel,gate]", "report.max_ce_increase=0.02",
         "report.applications=2.5", "gate.tokens=128", "gate.steps=20", "eval.tokens=24", "eval.latency_tokens=2",
         "eval.repeats=1", "eval.warmup_tokens=0", "calibration.tokens=24", "calibration.max_evals=4"]


def compose_report(*overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("report", overrides=list(overrides))


@pytest.fixture(scope="module")
def done(tiny_ckpt, ckpt_env, tmp_path_factory):
    from recdepth.report import report

    out = tmp_path_factory.mktemp("report") / "r"
    return out, report(compose_report(f"ckpt={tiny_ckpt}", f"run_dir={out}", *SMALL))


def test_every_family_is_scored_and_summarised(done):
    out, res = done
    jobs = sorted((p for p in (out / "jobs").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    fams = [json.loads((p / "metrics.json").read_text())["family"] for p in jobs]
    # 2 fixed + oracle + 2 grid rules + argmax k=1 + gate τ=0.5 + 3 calibrated rules x 2 targets
    assert fams == ["fixed"] * 2 + ["oracle"] + ["grid"] * 4 + ["calibrated"] * 6
    assert (out / "gate" / "gate.pt").is_file()
    for f in ("report.md", "report.png", "report.json", "jobs/frontier.md", "jobs/sweep_results.md",
              "jobs/fig4_exits.png"):
        assert (out / f).is_file(), f
    md = (out / "report.md").read_text()
    assert "## Calibrated to CE increase ≤ 0.02" in md and "## Calibrated to applications ≤ 2.5" in md
    # every scored job read the same test tokens
    pos = {tuple(read_tokens(p / "eval_tokens.csv")["position"]) for p in jobs}
    assert len(pos) == 1 and len(next(iter(pos))) == 24


def test_the_winner_follows_its_rule(done):
    """Recomputed from the per-token records: the CE target's winner has the fewest mean
    applications among the calibrated rules whose test interval did not violate the
    target; the budget's winner the lowest CE."""
    out, res = done
    rows = res["rows"]
    for kind, key in (("max_ce_increase", "applications"), ("applications", "ce")):
        ok = [r for r in rows if r["target"] == kind and r["test_verdict"] != "violated"]
        w = res["winners"][kind]
        if not ok:
            assert w is None
            continue
        vals = {}
        for r in ok:
            t = read_tokens(out / "jobs" / str(r["job"]) / "eval_tokens.csv")
            vals[r["job"]] = t["apps"].mean() if key == "applications" else t["nll"].mean()
        assert vals[w["job"]] == pytest.approx(min(vals.values()))
        # the verdict's interval: the test quantity against the bound
        r = next(r for r in rows if r["job"] == w["job"])
        q = "ce_increase" if kind == "max_ce_increase" else "applications"
        lo, hi = r[f"test_{q}_ci"]
        assert lo <= r[f"test_{q}"] <= hi and not lo > r["bound"]


def test_a_calibrated_line_reruns_in_evaluate(done, tiny_ckpt, ckpt_env, tmp_path):
    from recdepth.evaluate import evaluate

    out, res = done
    r = next(r for r in res["rows"] if r["rule"] == "accel" and r["target"] == "applications")
    line = r["overrides"].split()
    ev = evaluate(compose_ev(f"ckpt={tiny_ckpt}", f"run_dir={tmp_path / 'ev'}", "eval.tokens=24",
                             "eval.latency_tokens=0", "eval.warmup_tokens=0", *line))["eval"]
    mine = read_tokens(out / "jobs" / str(r["job"]) / "eval_tokens.csv")
    theirs = read_tokens(tmp_path / "ev" / "eval_tokens.csv")
    assert np.array_equal(mine["apps"], theirs["apps"]) and np.allclose(mine["nll"], theirs["nll"], atol=1e-6)
    assert ev["mean_applications"] == pytest.approx(r["applications"])


def compose_ev(*overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


def test_report_refuses_a_used_directory(done, tiny_ckpt):
    from recdepth.report import report

    out, _ = done
    with pytest.raises(FileExistsError, match="run_dir: .* already holds a report"):
        report(compose_report(f"ckpt={tiny_ckpt}", f"run_dir={out}", *SMALL))
