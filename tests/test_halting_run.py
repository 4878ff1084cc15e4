"""A halting head trained with the loop (issue 48) through the real commands, at debug size:
`experiment=roots halt=pondernet` trains and evaluates under exit=halt, a frontier sweep
scores exit=halt beside the fixed depths, `recdepth calibrate` calibrates it (these two in
`make test-slow`: default-suite time); a checkpoint without a head refuses exit=halt in one
line, and a bad `halt.*` value is one line too."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import SMALL, run


@pytest.fixture(scope="module")
def halt_run(env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("halt")
    rd = tmp / "job"
    run([*SMALL, "halt=pondernet", "exit=halt", "exit.max_steps=6", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
         f"run_dir={rd}"],
        cwd=tmp, env=env)
    return tmp, rd


def test_a_halting_run_trains_its_head_and_evaluates_under_it(halt_run):
    _, rd = halt_run
    ckpt = torch.load(rd / "train" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["hyper_parameters"]["halt"]["loss"] == "pondernet"
    m = ckpt["hyper_parameters"]["model"]
    assert (m["halt_head"], m["halt_bias"], m["halt_reading"]) == ("state", -3.0, "cdf")
    w = ckpt["state_dict"]["model.halt.weight"]
    assert w.shape == (1, m["n_embd"]) and w.abs().sum() > 0  # it started at 0 and learned
    curves = list(csv.DictReader(open(rd / "train" / "csv" / "metrics.csv")))
    assert any(r.get("train/halt_loss") for r in curves) and any(r.get("train/halt_expected_n") for r in curves)
    ev = json.loads((rd / "metrics.json").read_text())["eval"]
    assert ev["exit"] == "halt" and ev["answers"]["windows"] == 6
    assert 8.0 < ev["layer_applications"] < 8.1  # prelude, 6 applications, coda, and 5 checks of 5d FLOPs each


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_the_frontier_scores_exit_halt_on_a_checkpoint_with_a_head(halt_run, env):
    tmp, rd = halt_run
    sweep = tmp / "frontier"
    q = subprocess.run(
        [sys.executable, "-m", "recdepth.evaluate", "--multirun", "hydra/sweeper=frontier",
         f"ckpt={rd / 'train' / 'checkpoints' / 'last.ckpt'}", f"hydra.sweep.dir={sweep}", "eval.tokens=288",
         "eval.latency_tokens=0", "eval.context_steps=4", "hydra.sweeper.fixed=[1,3]", "hydra.sweeper.rules.kl=[]",
         "hydra.sweeper.rules.stepnorm=[]", "hydra.sweeper.rules.accel=[]", "hydra.sweeper.rules.halt=[0.3,0.9]",
         "hydra.sweeper.oracle=[]", "hydra.sweeper.warm_start=false", "exit.max_steps=3"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-3000:]
    jobs = list(csv.DictReader(open(sweep / "sweep_results.csv")))
    assert sorted((r["exit"], r["tau"]) for r in jobs if r["status"] == "ok") == [
        ("fixed", ""), ("fixed", ""), ("halt", "0.3"), ("halt", "0.9")]


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_calibrate_finds_a_halting_threshold(halt_run, env, ckpt_env):
    from hydra import compose, initialize_config_dir

    from recdepth.calibrate import calibrate
    from recdepth.config.build import conf_dir

    tmp, rd = halt_run
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("calibrate", overrides=[f"ckpt={rd / 'train' / 'checkpoints' / 'last.ckpt'}", "exit=halt",
                                               "exit.max_steps=3", "eval.tokens=288", "eval.context_steps=4",
                                               "eval.latency_tokens=0", "target.max_accuracy_drop=0.5",
                                               "calibration.method=ltt", "calibration.epsilon=0.2",
                                               "calibration.per_group=false", "device=cpu",
                                               f"run_dir={tmp / 'calibrate'}"])
    out = calibrate(cfg)
    assert out["exit"]["name"] == "halt" and 0 < out["exit"]["tau"] < 1
    assert "accuracy_drop" in out["test"]


def test_the_default_text_model_trains_a_head_per_group_and_evaluates_under_them(env, tmp_path):
    """`halt=correct` on the default text model (three recurrence groups): every group's head
    moves off zero (the earlier groups' from their drawn applications), and `exit=halt`
    evaluates with each group's applications its head's."""
    rd = tmp_path / "job"
    run(["debug=tiny", "halt=correct", "halt.label=margin", "halt.margin=0.05", "exit=halt", "exit.tau=0.5",
         "exit.max_steps=4", "trainer.max_steps=8", "trainer.log_every_n_steps=1", "callbacks=none",
         "eval.tokens=64", "eval.latency_tokens=0", f"run_dir={rd}"], cwd=tmp_path, env=env)
    ckpt = torch.load(rd / "train" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    m = ckpt["hyper_parameters"]["model"]
    w = ckpt["state_dict"]["model.halt.weight"]
    assert len(m["groups"]) == 3 and w.shape == (3, m["n_embd"]) and m["halt_reading"] == "direct"
    assert (w.abs().sum(1) > 0).all()  # each head started at 0 and learned
    ev = json.loads((rd / "metrics.json").read_text())["eval"]
    assert ev["exit"] == "halt" and len(ev["applications_per_token"]) == 3
    assert all(1 <= a <= 4 for a in ev["applications_per_token"])
    assert all(c["layers"] == 0 and c["statistic"] > 0 for c in ev["check_cost"])  # each head's check, decoding-free


def test_exit_halt_on_a_checkpoint_without_a_head_is_one_line(tiny_ckpt, env, cli_here, tmp_path):
    code, err, _ = cli_here("recdepth.evaluate", [f"ckpt={tiny_ckpt}", "exit=halt", "eval.tokens=6"], tmp_path)
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert "exit.name: rule 'halt' reads the checkpoint's halting head, and this model has none" in line


@pytest.mark.parametrize("args, message", [
    (["halt=act", "halt.epsilon=2"], "halt.epsilon: expected a number in (0, 1), got 2"),
    (["halt.loss=ponder"], "halt.loss: unknown halting loss 'ponder'"),
    (["halt=pondernet"], "halt.loss: pondernet needs the loss after every application of every group"),
    (["halt=correct", "halt.label=improvement"], "halt.label: improvement compares two successive applications"),
])
def test_a_bad_halt_value_is_one_line(args, message, env, cli_here, tmp_path):
    code, err, _ = cli_here("recdepth.train", ["debug=tiny", *args], tmp_path)
    assert code == 1
    assert message in err.strip().splitlines()[-1]


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_a_second_stage_trains_the_head_alone_on_a_frozen_model(halt_run, env):
    """halt.init_from + halt.freeze (the post-hoc gate's setting): the run starts from the
    checkpoint's weights, and only the halting head moves; a checkpoint of another model is
    refused in one line naming halt.init_from."""
    tmp, rd = halt_run
    first = rd / "train" / "checkpoints" / "last.ckpt"
    second = tmp / "second"
    small = [a for a in SMALL if not a.startswith("eval.tokens=")]
    run([*small, "halt=correct", f"halt.init_from={first}", "halt.freeze=true", "eval.tokens=0", "trainer.max_steps=2",
         f"run_dir={second}"], cwd=tmp, env=env)
    a = torch.load(first, map_location="cpu", weights_only=True)["state_dict"]
    b = torch.load(second / "train" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert b["hyper_parameters"]["model"]["halt_reading"] == "direct"  # read as correct's head
    moved = sorted(k for k in a if not torch.equal(a[k], b["state_dict"][k]))
    assert moved and all(k.startswith("model.halt.") for k in moved)
    p = run([*SMALL, "halt=correct", f"halt.init_from={first}", "model.n_embd=32", "trainer.max_steps=2",
             f"run_dir={tmp / 'other'}"], cwd=tmp, env=env, check=False)
    assert p.returncode == 1
    assert "halt.init_from: " in p.stderr and "is another model (model.n_embd: " in p.stderr
