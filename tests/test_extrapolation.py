"""Instances longer than the training block (issue 50): `eval.task` sets a task checkpoint's
fields anew for its extrapolation split (its sizes, carry's ripple), the model's block grows
where its positions allow (rope), learned positions refuse in one line; `exact` counts
instances whose every answer is right."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from recdepth.config.groups import EvalConfig
from recdepth.data.tasks.answers import instance_runs
from recdepth.model.looped import GPTConfig, LoopedGPT
from tests.helpers import run


def rope(block, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=block, vocab_size=60, groups=[[1]],
                    position="rope", attention_window=2, state_init="zero")
    return LoopedGPT(cfg).double().eval()


def test_a_grown_rope_model_equals_the_model_built_with_the_longer_block():
    short, long = rope(12), rope(40, seed=1)
    long.load_state_dict(short.state_dict())  # rope: no parameter depends on the block
    short.grow_block(40)
    idx = torch.randint(0, 60, (2, 37), generator=torch.Generator().manual_seed(0))
    got, _ = short(idx, loops=[6])
    want, _ = long(idx, loops=[6])
    assert torch.equal(got, want) and short.cfg.block_size == 40


def test_learned_positions_refuse_a_longer_block_in_one_line():
    torch.manual_seed(0)
    m = LoopedGPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=12, vocab_size=60, groups=[[1]]))
    with pytest.raises(ValueError, match=r"^eval.task: these instances need windows of 30 tokens, and this model's "
                                         r"learned positions end at block_size=12") as e:
        m.grow_block(30, "eval.task")
    assert "\n" not in str(e.value)
    m.grow_block(12)  # no longer: nothing to refuse


def test_instance_runs_by_hand():
    positions = np.array([1, 2, 3, 6, 7, 9, 10, 11])
    windows = np.array([0, 0, 0, 0, 0, 0, 1, 1])  # 9 and 10 are consecutive but in two windows
    ok = np.array([1, 1, 1, 1, 0, 1, 1, 1], dtype=bool)
    right, w = instance_runs(positions, windows, ok)
    assert right.tolist() == [1.0, 0.0, 1.0, 1.0] and w.tolist() == [0, 0, 0, 1]


def test_eval_task_needs_the_extrapolation_split_in_one_line():
    with pytest.raises(ValueError, match="^eval.task: sets the extrapolation split's instances anew; add "
                                         "eval.split=extrapolation") as e:
        EvalConfig(task={"extrapolation": [256, 256]})
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def carry_run(env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("carry")
    rd = tmp / "job"
    run(["debug=tiny", "experiment=carry", "trainer.max_steps=2", "data.train_records=100", "data.test_records=4",
         "data.validation_records=8", "data.extrapolation_records=6", "eval.tokens=64", "eval.latency_tokens=0",
         "callbacks=none", f"run_dir={rd}"], cwd=tmp, env=env)
    return tmp, rd / "train" / "checkpoints" / "last.ckpt"


def evaluate(tmp, env, ckpt, out, *extra):
    return subprocess.run([sys.executable, "-m", "recdepth.evaluate", f"ckpt={ckpt}", "exit=fixed", "exit.max_steps=3",
                           "eval.split=extrapolation", "eval.latency_tokens=0", f"run_dir={out}", *extra],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("regime", ["sequential", "parallel"])
def test_a_rope_task_checkpoint_evaluates_instances_longer_than_its_block(carry_run, env, regime):
    """debug carry trains on a block of 64 tokens; rippling 100-bit additions (103 tokens with
    EOT and newline) are evaluated in one command, each whole instance in a window of its own,
    their chains as long as the instance."""
    tmp, ckpt = carry_run
    out = tmp / f"long_{regime}"
    p = evaluate(tmp, env, ckpt, out, "+eval.task.extrapolation=[100,100]", "+eval.task.ripple=1",
                 f"eval.regime={regime}", "eval.tokens=309")
    assert p.returncode == 0, p.stderr[-3000:]
    a = json.loads((out / "metrics.json").read_text())["eval"]["answers"]
    assert a["tokens"] == 300 and a["instances"] == 3  # 3 windows of 103 tokens, 100 sum bits each
    assert sorted(int(d) for d in a["by_difficulty"]) == list(range(1, 100))  # d_i = i (d_0 = 1 too)
    assert 0.0 <= a["exact"][0] <= a["accuracy"][0]
    p = evaluate(tmp, env, ckpt, tmp / "bad", "+eval.task.ripple=2")
    assert p.returncode != 0 and "eval.task.ripple: expected a probability in [0, 1], got 2" in p.stderr


def test_a_longer_extrapolation_task_with_more_per_step_targets_shares_one_cache(tmp_path):
    """prefixsums states one per-step target per bit: its extrapolation split at 60 bits needs
    a wider steps file than the 8-32-bit train split; every split is written at the widest,
    and the train split (so the vocabulary) is the task's own."""
    from recdepth.config.schema import data_config
    from recdepth.data.datamodule import TokenDataModule

    base = {"source": "task", "train_records": 20, "test_records": 4, "validation_records": 4,
            "extrapolation_records": 4, "cache_dir": str(tmp_path), "task": {"name": "prefixsums"}}
    plain = TokenDataModule(data_config(base), 64, 2, 4)
    plain.setup()
    wide = TokenDataModule(data_config({**base, "extrapolation_task": {"extrapolation": [60, 60]}}), 64, 2, 4)
    wide.setup()
    assert wide.step_width > plain.step_width
    assert np.array_equal(wide.train_tokens, plain.train_tokens) and np.array_equal(wide.id_map, plain.id_map)
    start, n = wide.region("extrapolation")
    labels = wide.heldout_labels(n, start)
    assert labels.max() == 60  # a 60-bit instance's last parity needs all 60 bits


def test_a_rope_model_generates_past_its_training_block(carry_run, env):
    """debug carry's block is 64 tokens; with rope the block grows to the prompt and the tokens
    asked for, so generation runs to max_new_tokens instead of stopping at the block."""
    tmp, ckpt = carry_run
    out = tmp / "gen"
    p = subprocess.run([sys.executable, "-m", "recdepth.generate", f"ckpt={ckpt}", "prompt_ids=[1,2,3]",
                        "max_new_tokens=100", "stream=false", "exit=fixed", "exit.max_steps=2", f"run_dir={out}"],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    gen = json.loads((out / "generation.json").read_text())
    assert gen["tokens"] == 100 and gen["stopped"] == "max_new_tokens"


def test_make_frontier_passes_eval_task_to_every_job(carry_run, env):
    """`make frontier` on longer instances: each job scores the 100-bit additions, the fixed
    depths and the rule alike, in the grown block."""
    tmp, ckpt = carry_run
    out = tmp / "frontier"
    p = subprocess.run([sys.executable, "-m", "recdepth.evaluate", "--multirun", "hydra/sweeper=frontier", f"ckpt={ckpt}",
                        f"hydra.sweep.dir={out}", "eval.split=extrapolation", "+eval.task.extrapolation=[100,100]",
                        "eval.regime=parallel", "eval.tokens=206", "eval.latency_tokens=0", "hydra.sweeper.fixed=[1,2]",
                        "hydra.sweeper.warm_start=false", "hydra.sweeper.oracle=[]", "hydra.sweeper.rules.kl=[]",
                        "hydra.sweeper.rules.accel=[]", "hydra.sweeper.rules.stepnorm=[0.1]"],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    jobs = sorted(d for d in out.iterdir() if d.is_dir())
    assert len(jobs) == 3
    for job in jobs:
        a = json.loads((job / "metrics.json").read_text())["eval"]["answers"]
        assert a["tokens"] == 200 and a["instances"] == 2  # two 100-bit additions, 103 tokens a window


def test_diagnose_reads_the_longer_instances_of_the_extrapolation_split(carry_run, env):
    """`recdepth diagnose split=extrapolation +task.extrapolation=[100,100] +task.ripple=1`:
    windows of the grown block (103 tokens) from the extrapolation region, its labels by
    difficulty (a rippling carry's reach 99)."""
    tmp, ckpt = carry_run
    out = tmp / "diag"
    p = subprocess.run([sys.executable, "-m", "recdepth.diagnose", f"ckpt={ckpt}", "split=extrapolation",
                        "+task.extrapolation=[100,100]", "+task.ripple=1", "loop_dynamics.sequences=2", "loop_dynamics.loops=3",
                        "loop_dynamics.figures=false", f"run_dir={out}"],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["split"] == "extrapolation" and m["tokens"] == 2 * 103
    assert max(int(d) for g in m["by_difficulty"].values() for d in g) == 99  # rippling: d_i = i, past the trained 16
    p = subprocess.run([sys.executable, "-m", "recdepth.diagnose", f"ckpt={ckpt}", "+task.extrapolation=[100,100]",
                        f"run_dir={tmp / 'bad'}"], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and "task: sets the extrapolation split's instances anew; add split=extrapolation" in p.stderr


def test_experiment_mazes_trains_and_reads_larger_mazes_in_one_command(env, tmp_path):
    """A grid model trained on 3 x 3 mazes (5 x 5 grids, windows of 27) evaluates 7 x 7 mazes
    (9 x 9 grids) through the real CLI: the block grows to 83, every cell but the last is
    scored (walls at difficulty 1), one instance a maze, in the parallel regime the checkpoint
    carries (none on the command line); token-by-token decoding refuses."""
    rd = tmp_path / "job"
    run(["debug=tiny", "experiment=mazes", "data.task.size=[3,3]", "data.task.extrapolation=[5,5]",
         "model.block_size=27", "data.train_records=24", "data.test_records=4", "data.validation_records=4",
         "eval.tokens=54", "eval.latency_tokens=0", f"run_dir={rd}"], cwd=tmp_path, env=env)
    ckpt = rd / "train" / "checkpoints" / "last.ckpt"
    out = tmp_path / "big"
    p = evaluate(tmp_path, env, ckpt, out, "+eval.task.extrapolation=[7,7]", "eval.tokens=249")
    assert p.returncode == 0, p.stderr[-3000:]
    ev = json.loads((out / "metrics.json").read_text())["eval"]
    assert ev["regime"] == "parallel" and ev["settings_from"]["regime"] == "checkpoint"
    a = ev["answers"]
    assert a["tokens"] == 3 * 80 and a["instances"] == 3  # 81 cells a maze, the last (a wall) unscored
    assert a["by_difficulty"]["1"]["tokens"] > 3 * 40  # the walls: the outer ring alone is 32 a maze
    p = evaluate(tmp_path, env, ckpt, tmp_path / "seq", "+eval.task.extrapolation=[7,7]", "eval.tokens=249",
                 "eval.regime=sequential")
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1] == (
        "error: eval.regime: a grid model (model.attention=grid) reads every cell at once, so it decodes with "
        "eval.regime=parallel only, got 'sequential'")
    # make frontier on it: the checkpoint's grid, parallel regime and no oracle (mazes.yaml's frontier.oracle: [])
    sweep = tmp_path / "frontier"
    p = subprocess.run([sys.executable, "-m", "recdepth.evaluate", "--multirun", "hydra/sweeper=frontier", f"ckpt={ckpt}",
                        f"hydra.sweep.dir={sweep}", "eval.latency_tokens=0", "hydra.sweeper.rules.kl=[0.01]",
                        "hydra.sweeper.rules.stepnorm=[]", "hydra.sweeper.rules.accel=[]", "exit.max_steps=3"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    grid = json.loads((sweep / "grid.json").read_text())[str(ckpt)]
    assert grid["oracle"] == [] and grid["from"]["oracle"] == "checkpoint"
    jobs = [json.loads((sweep / str(j) / "metrics.json").read_text())["eval"] for j in range(8)]
    assert [e["exit"] for e in jobs] == ["fixed"] * 7 + ["kl"] and not (sweep / "8").exists()
    assert {e["regime"] for e in jobs} == {"parallel"}
