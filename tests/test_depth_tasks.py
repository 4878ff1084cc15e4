"""The tasks where depth pays (issue 40), at debug size through the real commands:
`experiment=roots` trained with its per-step targets, evaluated by difficulty under both
caches, a frontier sweep, and Learn then Test to an accuracy-drop target with instances
(windows of one record) as the units; `experiment=carry`, whose answers are in place,
evaluated and calibrated against its scored stream, never the next token."""

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import SMALL, run


@pytest.fixture(scope="module")
def roots_run(env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("roots")
    rd = tmp / "job"
    run([*SMALL, "trainer.max_steps=4", "frontier.fixed=[1,3]", f"run_dir={rd}"], cwd=tmp, env=env)
    return tmp, rd


def test_debug_roots_trains_with_per_step_targets_and_evaluates_by_difficulty(roots_run):
    _, rd = roots_run
    cfg = (rd / "config.yaml").read_text()
    assert "steps: trajectory" in cfg and "state_init: input" in cfg
    ev = json.loads((rd / "metrics.json").read_text())["eval"]
    rows = list(csv.DictReader(open(rd / "eval_tokens.csv")))
    # 6 instances of up to 8 queries, each scored at its answer, difficulty = hops + 1 in 1..9
    assert ev["scored"] == "answers" and 6 <= len(rows) <= 48 and ev["answers"]["windows"] == 6
    assert all(1 <= int(r["difficulty"]) <= 9 for r in rows)
    assert ev["answers"]["accuracy"][0] == pytest.approx(np.mean([int(r["correct"]) for r in rows]))


@pytest.mark.parametrize("cache", ["per_step", pytest.param("latest", marks=pytest.mark.slow)])
def test_debug_roots_frontier_sweep_under_each_cache(roots_run, env, cache):
    """One frontier sweep per cache (latest in make test-slow: default-suite time). per_step:
    the checkpoint's own cache and frontier grid (fixed [1, 3], no warm-start copy: the
    run's `frontier:`); latest: the command's cache and grid ([1, 2], warm start off)."""
    tmp, rd = roots_run
    ckpt = rd / "train" / "checkpoints" / "last.ckpt"
    sweep = tmp / f"frontier_{cache}"
    own = cache == "per_step"
    q = subprocess.run(
        [sys.executable, "-m", "recdepth.evaluate", "--multirun", "hydra/sweeper=frontier", f"ckpt={ckpt}",
         f"hydra.sweep.dir={sweep}", "eval.latency_tokens=0", "eval.context_steps=3",
         *([] if own else [f"eval.cache={cache}", "hydra.sweeper.fixed=[1,2]", "hydra.sweeper.warm_start=false"]),
         "hydra.sweeper.rules.kl=[0.01]", "hydra.sweeper.rules.stepnorm=[]", "hydra.sweeper.rules.accel=[]",
         "hydra.sweeper.oracle=[0.01]", "exit.max_steps=3"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-3000:]
    jobs = list(csv.DictReader(open(sweep / "sweep_results.csv")))
    assert len(jobs) == 4 and all(r["status"] == "ok" for r in jobs)
    grid = [1, 3] if own else [1, 2]
    assert sorted(int(json.loads((sweep / str(j) / "metrics.json").read_text())["eval"]["max_steps"])
                  for j in range(2)) == grid  # the two fixed jobs; no warm-start copies
    assert json.loads((sweep / "grid.json").read_text()) == {str(ckpt): {
        "fixed": grid, "warm_start": False, "oracle": [0.01],
        "from": {**dict.fromkeys(("fixed", "warm_start"), "checkpoint" if own else "command"), "oracle": "command"}}}
    # the checkpoint's own eval.tokens (SMALL's 288) and cache where the command line set none;
    # the jobs decoded side by side all the same (the sweep's shared decode took them)
    for j in range(4):
        m = json.loads((sweep / str(j) / "metrics.json").read_text())
        assert m["eval"]["cache"] == cache and m["eval"]["settings_from"] == {
            "tokens": "checkpoint", "context_steps": "command",
            "cache": "checkpoint" if cache == "per_step" else "command", "regime": "checkpoint"}
        assert "tokens: 288" in (sweep / str(j) / "config.yaml").read_text()
        if m["eval"]["exit"] != "oracle":
            assert m["eval"]["shared_batch"] == 3
    diff = list(csv.DictReader(open(sweep / "difficulty.csv")))
    assert {r["exit"] for r in diff} == {"fixed", "kl", "oracle"}
    assert (sweep / "frontier_accuracy.csv").is_file()
    best = list(csv.DictReader(open(sweep / "best_fixed.csv")))  # each rule against the best fixed depth
    assert sorted(r["rule"].split()[0] for r in best) == ["kl", "oracle"] and {int(r["best_fixed_n"]) for r in best} <= set(grid)
    # the fixed n = 1 job's answers each cost prelude + 1 application + coda = 3 layer applications
    one = next(r for r in diff if r["exit"] == "fixed" and r["max_steps"] == "1")
    assert float(one["layer_applications"]) == pytest.approx(3.0)


def test_a_task_checkpoint_evaluates_with_its_experiments_settings(roots_run, env):
    """`recdepth evaluate ckpt=<task checkpoint>` with no eval.* scores as its experiment chose
    (eval.tokens, context_steps, cache, regime: here SMALL's 288 and 4, roots' per_step and
    sequential), metrics.json
    saying so; a value on the command line wins."""
    tmp, rd = roots_run
    ckpt = rd / "train" / "checkpoints" / "last.ckpt"
    for name, extra in (("own", []), ("mine", ["eval.cache=latest", "eval.tokens=96"])):
        p = subprocess.run([sys.executable, "-m", "recdepth.evaluate", f"ckpt={ckpt}", "exit=fixed", "exit.max_steps=2",
                            "eval.latency_tokens=0", f"run_dir={tmp / name}", *extra],
                           cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    own = json.loads((tmp / "own" / "metrics.json").read_text())["eval"]
    mine = json.loads((tmp / "mine" / "metrics.json").read_text())["eval"]
    assert own["cache"] == "per_step" and own["settings_from"] == dict.fromkeys(
        ("tokens", "context_steps", "cache", "regime"), "checkpoint")
    text = (tmp / "own" / "config.yaml").read_text()
    assert "tokens: 288" in text and "context_steps: 4" in text
    assert mine["cache"] == "latest" and mine["settings_from"] == {"tokens": "command", "context_steps": "checkpoint",
                                                                   "cache": "command", "regime": "checkpoint"}
    assert "tokens: 96" in (tmp / "mine" / "config.yaml").read_text()


def test_the_parallel_regime_at_a_fixed_depth_scores_as_the_per_step_cache(roots_run, env):
    """eval.regime=parallel at a fixed depth is the training pass, which the per_step cache
    reproduces token by token: the two regimes score every answer alike; under a rule the
    positions stop at their own applications and the window at its slowest."""
    tmp, rd = roots_run
    ckpt = rd / "train" / "checkpoints" / "last.ckpt"
    common = ["exit.max_steps=3", "eval.context_steps=null", "eval.latency_tokens=2", "eval.repeats=1"]
    for name, extra in (("seq", ["exit=fixed", "eval.cache=per_step"]), ("par", ["exit=fixed", "eval.regime=parallel"]),
                        ("rule", ["exit=stepnorm", "exit.tau=0.3", "eval.regime=parallel", "eval.wake=true"])):
        p = subprocess.run([sys.executable, "-m", "recdepth.evaluate", f"ckpt={ckpt}", *common,
                            f"run_dir={tmp / name}", *extra], cwd=tmp, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    seq, par = (list(csv.DictReader(open(tmp / n / "eval_tokens.csv"))) for n in ("seq", "par"))
    assert len(seq) == len(par) > 0 and [r["position"] for r in seq] == [r["position"] for r in par]
    assert max(abs(float(a["nll"]) - float(b["nll"])) for a, b in zip(seq, par, strict=True)) < 1e-4
    ev = json.loads((tmp / "par" / "metrics.json").read_text())["eval"]
    assert ev["regime"] == "parallel" and ev["steps_per_window"] == 3
    ev = json.loads((tmp / "rule" / "metrics.json").read_text())["eval"]
    assert ev["wake"] is True and ev["answers"]["own_applications"] <= ev["mean_applications"] <= 3
    assert ev["batch_check"]["apps_mismatch"] == 0  # the timed batch-1 passes ran the batched steps
    p = subprocess.run([sys.executable, "-m", "recdepth.evaluate", f"ckpt={ckpt}", "exit=fixed", *common,
                        "eval.regime=parallel", "eval.warm_start=true", f"run_dir={tmp / 'bad'}"],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and "eval.warm_start: not with eval.regime=parallel" in p.stderr


def test_a_task_checkpoint_gives_the_report_its_grid(roots_run):
    """recdepth report on a task checkpoint takes the grid its experiment chose (the run's
    `frontier.fixed=[1,3]` and roots' warm_start false) where the command line sets none."""
    from recdepth.cli.runner import checkpoint_eval, compose_job

    _, rd = roots_run
    ckpt = rd / "train" / "checkpoints" / "last.ckpt"
    for given, fixed, taken in (([], [1, 3], ["fixed", "warm_start"]),
                                (["report.fixed=[2,4]", "report.warm_start=true"], [2, 4], [])):
        overrides = [f"ckpt={ckpt}", *given]
        cfg = compose_job("report", overrides)
        before = (list(cfg.report.fixed), cfg.report.warm_start)
        assert before[0] == ([2, 4] if given else [1, 2, 3, 4, 6, 8, 12, 16, 24, 32])  # the command's grid...
        got = checkpoint_eval(cfg, overrides)
        assert list(cfg.report.fixed) == fixed and cfg.report.warm_start is (not taken)  # ...the checkpoint's where taken
        assert list(cfg.report.from_checkpoint) == taken
        assert got == ["eval.cache", "eval.context_steps", "eval.regime", "eval.tokens",
                       *(f"report.{k}" for k in taken)]


def test_ltt_to_an_accuracy_drop_on_roots(roots_run, env, ckpt_env):
    """calibration.method=ltt target.max_accuracy_drop: the per-window losses are the
    fractions of answers full depth gets right and the setting wrong, recomputed here from
    two decodes of the calibration split; a split too small for the target is refused in
    one line that names the validation records it needs."""
    from hydra import compose, initialize_config_dir

    from recdepth.app.calibration import calibration_split, load_splits, policy_at
    from recdepth.calibrate import calibrate
    from recdepth.config.build import conf_dir
    from recdepth.config.schema import validated
    from recdepth.exits import build

    tmp, rd = roots_run
    ckpt = rd / "train" / "checkpoints" / "last.ckpt"

    def cfg(*extra):
        with initialize_config_dir(conf_dir(), version_base="1.3"):
            return compose("calibrate", overrides=[f"ckpt={ckpt}", "exit=fixed", "exit.max_steps=3", "eval.tokens=288",
                                                   "eval.context_steps=4", "eval.latency_tokens=2", "eval.repeats=1",
                                                   "calibration.method=ltt", "calibration.per_group=false",
                                                   "device=cpu", *extra])

    # one point at ε = 0.05 needs 299 instances; the validation split has 12
    with pytest.raises(ValueError, match=r"only with >= 299 calibration windows of 48 tokens .* raise "
                                         r"data.validation_records to >= 299") as e:
        calibrate(cfg("target.max_accuracy_drop=0.01", f"run_dir={tmp / 'small'}"))
    assert "\n" not in str(e.value)
    # half the answers at ε = 0.2 needs ⌈log 0.2 / log 0.5⌉ = 3 of the 12 instances
    opts = ("target.max_accuracy_drop=0.5", "calibration.epsilon=0.2")
    out = calibrate(cfg(*opts, f"run_dir={tmp / 'ltt'}"))
    c = out["calibration"]
    assert c["loss"] == "answer_flips" and c["alpha"] == 0.5 and c["windows"] == 12 and c["tokens"] == 12 * 48
    assert "accuracy_drop" in out["test"] and out["test"]["ltt_alpha"] == 0.5
    run_ = validated(cfg(*opts, f"run_dir={tmp / 'again'}"))
    from recdepth.exits.calibration.search import Target

    opened, _, _, cal_tokens, labels = load_splits(run_, Target("max_accuracy_drop", 0.5))
    split = calibration_split(run_, opened.model, cal_tokens, labels["calibration"])
    ref = split.decode(build("fixed", None, max_steps=3))
    for values, risk in zip(c["settings"], c["risks"], strict=True):
        rec = split.decode(policy_at(build("fixed", None, max_steps=3), "max_steps", values))
        flips = {}
        for w, got, want in zip(rec["window"], rec["correct"], ref["correct"], strict=True):
            flips.setdefault(int(w), []).append(bool(want) and not bool(got))
        assert len(flips) == 12 and risk == pytest.approx(np.mean([np.mean(v) for v in flips.values()]))


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_debug_carry_evaluates_and_calibrates_against_its_in_place_targets(env, ckpt_env, tmp_path):
    """Every scored target of carry is a sum bit (` 0` or ` 1`), in the evaluation and in
    both splits of an ltt calibration to an accuracy drop; its answers are the pairs'."""
    from hydra import compose, initialize_config_dir

    from recdepth.analysis.token_files import read_tokens
    from recdepth.calibrate import calibrate
    from recdepth.config.build import conf_dir
    from recdepth.data.tokenizer import gpt2

    rd = tmp_path / "job"
    run(["debug=tiny", "experiment=carry", "data.train_records=100", "data.test_records=4",
         "data.validation_records=8", "data.extrapolation_records=2", "eval.tokens=256", "eval.latency_tokens=2",
         "callbacks=none", f"run_dir={rd}"], cwd=tmp_path, env=env)
    bits = {gpt2().encode(" 0")[0], gpt2().encode(" 1")[0]}
    rows = list(csv.DictReader(open(rd / "eval_tokens.csv")))
    assert rows and {int(r["target_gpt2"]) for r in rows} <= bits
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("calibrate", overrides=[f"ckpt={rd / 'train' / 'checkpoints' / 'last.ckpt'}", "exit=fixed",
                                              "exit.max_steps=2", "eval.tokens=256", "eval.latency_tokens=2",
                                              "eval.repeats=1", "calibration.method=ltt", "calibration.per_group=false",
                                              "target.max_accuracy_drop=0.5", "calibration.epsilon=0.2", "device=cpu",
                                              f"run_dir={tmp_path / 'cal'}"])
    out = calibrate(cfg)
    assert out["calibration"]["windows"] == 8 and "accuracy_drop" in out["test"]
    cal = read_tokens(tmp_path / "cal" / "calibration_tokens.csv")
    test = list(csv.DictReader(open(tmp_path / "cal" / "eval_tokens.csv")))
    assert set(cal["target_gpt2"].tolist()) <= bits and {int(r["target_gpt2"]) for r in test} <= bits
    # the learned gate fits on carry's answers, its labels from the sum bits (tests/data/test_carry.py),
    # from the decode's states or the parallel pass's
    from recdepth.train_gate import train_gate

    def gate_cfg(*extra):
        with initialize_config_dir(conf_dir(), version_base="1.3"):
            return compose("train_gate", overrides=[f"ckpt={rd / 'train' / 'checkpoints' / 'last.ckpt'}",
                                                    "gate.tokens=96", "gate.max_steps=3", "gate.steps=20",
                                                    "device=cpu", *extra])
    meta = train_gate(gate_cfg("gate.cache=per_step", f"run_dir={tmp_path / 'gate'}"))
    assert (tmp_path / "gate" / "gate.pt").is_file() and meta["answers"] and meta["max_steps"] == 3
    assert meta["cache"] == "per_step"  # fitted under the cache carry is evaluated with
    assert 0 < meta["examples"] < meta["tokens"]  # answers only: the in-place sum bits, not every token
    par = train_gate(gate_cfg("gate.states=parallel", f"run_dir={tmp_path / 'gate2'}"))
    assert par["states"] == "parallel" and par["examples"] == meta["examples"]
    with pytest.raises(ValueError, match="gate.cache") as e:
        train_gate(gate_cfg("gate.cache=newest", f"run_dir={tmp_path / 'gate3'}"))
    assert "\n" not in str(e.value) and "per_step" in str(e.value)
