"""Exact resume through the real CLI: a run killed with SIGKILL (between steps, or in the
middle of writing a checkpoint) and started again ends where an uninterrupted run ends.
The kills come from inside the run, at a chosen point (no polling, no sleeps)."""

import csv
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run
from tests.training.helpers import steps_of

# Long enough that a kill after the first checkpoint lands mid-run; every 4 steps a
# checkpoint, validations in between (a resumed run skips the one its checkpoint preceded).
ARGS = ["debug=tiny", "trainer.max_steps=16", "trainer.checkpoint_every=4"]

# Fault injection from outside: the 2nd write of a .ckpt file writes half of its bytes,
# then the process SIGKILLs itself, as a node that dies mid-write would.
DIE_MID_WRITE = """
import os, runpy, signal, sys
import fsspec.implementations.local as local
writes = []
real_write = local.LocalFileOpener.write
def write(self, data):
    if str(self.path).endswith(".ckpt"):
        writes.append(self.path)
        if len(writes) == 2:
            real_write(self, bytes(data)[: len(data) // 2])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    return real_write(self, data)
local.LocalFileOpener.write = write
sys.argv = ["recdepth.train", *sys.argv[1:]]
runpy.run_module("recdepth.train", run_name="__main__")
"""

# Fault injection at a chosen point of training: a Lightning callback added to every
# Trainer SIGKILLs the process after optimiser step n (`step:n`), or when fit() ends,
# after the final checkpoint and before validation, metrics and evaluation (`fit_end`).
KILL_AT = """
import os, runpy, signal, sys
import lightning
from lightning.pytorch.callbacks import Callback
when = sys.argv.pop(1)
class Kill(Callback):
    def on_train_batch_end(self, trainer, *args):
        if when == f"step:{trainer.global_step}":
            os.kill(os.getpid(), signal.SIGKILL)
    def on_fit_end(self, trainer, *args):
        if when == "fit_end":
            os.kill(os.getpid(), signal.SIGKILL)
init = lightning.Trainer.__init__
def with_kill(self, *args, callbacks=None, **kw):
    init(self, *args, callbacks=[*(callbacks or []), Kill()], **kw)
lightning.Trainer.__init__ = with_kill
sys.argv = ["recdepth.train", *sys.argv[1:]]
runpy.run_module("recdepth.train", run_name="__main__")
"""


@pytest.fixture(scope="module")
def straight(tmp_path_factory, env):
    """The uninterrupted run every resumed run must match: (metrics, training dir)."""
    d = tmp_path_factory.mktemp("straight")
    run([*ARGS, f"run_dir={d / 'run'}"], cwd=d, env=env)
    m = json.loads((d / "run" / "metrics.json").read_text())
    return m, Path(m["train_dir"])


def killed(when: str, args, cwd, env) -> None:
    p = subprocess.run([sys.executable, "-c", KILL_AT, when, *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]


def ckpt_step(train_dir: Path) -> int:
    return torch.load(train_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]


def val_steps(train_dir: Path) -> list[int]:
    with open(train_dir / "csv" / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("val/ce")]


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_the_same_command_resumes_a_killed_run_exactly(tmp_path, env, straight):
    """A is killed after step 5 (checkpoint at 4); B resumes it and is killed after step 6,
    before its own first checkpoint; C, the same command again, ends where an
    uninterrupted run ends, and a later launch reuses it."""
    ref, ref_dir = straight
    args = [*ARGS, f"run_dir={tmp_path / 'run'}"]
    killed("step:5", args, tmp_path, env)
    (train_dir,) = [d for d in (tmp_path / "outputs" / "runs").iterdir() if d.is_dir()]
    assert train_dir.name == ref_dir.name  # one identity, whatever the job directory
    assert ckpt_step(train_dir) == 4 and not (train_dir / "trained.json").exists()
    killed("step:6", args, tmp_path, env)
    assert ckpt_step(train_dir) == 4  # B died before saving: A's checkpoint is still there
    p = run(args, cwd=tmp_path, env=env)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["resumed_from"] == {"checkpoint": str(train_dir / "checkpoints" / "last.ckpt"), "step": 4}
    assert "Restoring states from the checkpoint" in p.stderr
    assert m["val_ce"] == pytest.approx(ref["val_ce"], abs=1e-6)
    assert m["eval"]["ce"] == pytest.approx(ref["eval"]["ce"], abs=1e-6)
    assert m["steps"] == ref["steps"] == 16 and m["tokens_seen"] == ref["tokens_seen"]
    # The training dir reads as one run: every checkpoint's diagnostics, identical
    # geometry, each validation once in the curves.
    assert steps_of(train_dir) == steps_of(ref_dir) == [0, 4, 8, 12, 16]
    a = json.loads((train_dir / "diagnostics" / "step_16.json").read_text())["groups"]
    b = json.loads((ref_dir / "diagnostics" / "step_16.json").read_text())["groups"]
    assert json.dumps(a) == json.dumps(b)
    assert val_steps(train_dir) == val_steps(ref_dir)
    # Finished: the next launch of this identity evaluates it without training.
    q = run([*ARGS, "exit=accel", f"run_dir={tmp_path / 'again'}"], cwd=tmp_path, env=env)
    assert "reuse: training identity" in q.stdout + q.stderr
    assert json.loads((tmp_path / "again" / "metrics.json").read_text())["reused"] is True


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_a_kill_in_the_middle_of_a_checkpoint_write_loses_nothing(tmp_path, env, straight):
    ref, _ = straight
    args = [*ARGS, f"run_dir={tmp_path / 'run'}"]
    p = subprocess.run([sys.executable, "-c", DIE_MID_WRITE, *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL
    (train_dir,) = [d for d in (tmp_path / "outputs" / "runs").iterdir() if d.is_dir()]
    assert ckpt_step(train_dir) == 4  # the half-written second checkpoint never replaced the first
    run(args, cwd=tmp_path, env=env)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["resumed_from"]["step"] == 4
    assert m["val_ce"] == pytest.approx(ref["val_ce"], abs=1e-6)
    assert steps_of(train_dir) == [0, 4, 8, 12, 16]


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_a_run_killed_before_its_first_and_after_its_last_checkpoint_reruns_in_place(tmp_path, env, straight):
    """A requeued job reruns: killed before any checkpoint (only step 0's diagnostics
    written), then after the final checkpoint but before validation and metrics.json."""
    ref, _ = straight
    args = [*ARGS, f"run_dir={tmp_path / 'run'}"]
    killed("step:2", args, tmp_path, env)
    (train_dir,) = [d for d in (tmp_path / "outputs" / "runs").iterdir() if d.is_dir()]
    assert steps_of(train_dir) == [0] and not (train_dir / "checkpoints").exists()
    killed("fit_end", args, tmp_path, env)
    assert ckpt_step(train_dir) == 16 and not (tmp_path / "run" / "metrics.json").exists()
    run(args, cwd=tmp_path, env=env)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["resumed_from"]["step"] == 16 and m["steps"] == 16
    assert m["val_ce"] == pytest.approx(ref["val_ce"], abs=1e-6)
    assert m["eval"]["ce"] == pytest.approx(ref["eval"]["ce"], abs=1e-6)
    assert steps_of(train_dir) == [0, 4, 8, 12, 16]


def test_a_checkpoint_that_does_not_belong_in_a_training_dir_is_refused(tmp_path, tiny_ckpt, ckpt_env):
    """A training dir whose last.ckpt is junk, or was saved under another training config:
    one line naming the file, before any work, and the file is left as it was. (The foreign
    checkpoint is the session's tiny one with this run's training config, one field changed.)"""
    import copy

    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.train import train
    from recdepth.training.runs import TrainingRun

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[*ARGS, f"run_dir={tmp_path / 'job'}", f"runs_dir={tmp_path / 'runs'}"])
    ckpt = TrainingRun(cfg).ckpt
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=f"runs_dir: {ckpt} is not a readable recdepth checkpoint"):
        train(cfg)
    assert ckpt.read_bytes() == b"not a checkpoint"
    other = torch.load(tiny_ckpt, map_location="cpu", weights_only=True)
    other["training_config"] = copy.deepcopy(TrainingRun(cfg).training)
    other["training_config"]["model"]["n_embd"] = 64
    torch.save(other, ckpt)
    with pytest.raises(ValueError, match=r"was saved under a different training config \(model.n_embd: 64 -> 128\)"):
        train(cfg)
    assert not (tmp_path / "job" / "metrics.json").exists()


class _Killed(BaseException):
    """The process 'dies' here: not an Exception, so no handler of recdepth's takes it for an error."""


def test_a_checkpoint_write_cut_halfway_leaves_the_last_whole_checkpoint(tmp_path, env, monkeypatch):
    """The default-run form of the kill mid-write (make test-slow's kills the process), in
    this process: a 4-step run, checkpoints every 2, whose second write of last.ckpt stops
    halfway through its bytes (the writer writes half, then raises). The file on disk is
    still the whole step-2 checkpoint: torch and the evaluation's loader read it, the
    resume's check (TrainingRun.resume_step) accepts it for this config, and the same
    command resumes from it and finishes."""
    import fsspec.implementations.local as local
    from hydra import compose, initialize_config_dir

    from recdepth.app.checkpoints import load_checkpoint
    from recdepth.config.build import conf_dir
    from recdepth.train import train
    from recdepth.training.runs import TrainingRun

    for k in ("RECDEPTH_CACHE", "WANDB_MODE"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where a half-written temporary file may be left
    args = ["debug=tiny", "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.val_check_interval=4",
            "callbacks=none", "eval.tokens=0", f"runs_dir={tmp_path / 'runs'}"]
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[*args, f"run_dir={tmp_path / 'killed'}"])
        again = compose("config", overrides=[*args, f"run_dir={tmp_path / 'again'}"])
    run = TrainingRun(cfg)
    real_write, cut = local.LocalFileOpener.write, []

    def write(self, data):
        if str(self.path) == str(run.ckpt) and len(cut) == 0 and run.ckpt.is_file():  # the second last.ckpt
            cut.append((len(data) // 2, len(data)))
            real_write(self, bytes(data)[: len(data) // 2])
            self.f.flush()
            raise _Killed
        return real_write(self, data)

    with monkeypatch.context() as m:
        m.setattr(local.LocalFileOpener, "write", write)
        with pytest.raises(_Killed):
            train(cfg)
    assert len(cut) == 1 and 0 < cut[0][0] < cut[0][1]  # the cut write was last.ckpt's second
    assert ckpt_step(run.dir) == 2 and run.resume_step(4) == 2
    module, _ = load_checkpoint(run.ckpt, torch.device("cpu"))
    assert module.checkpoint_step == 2 and not (run.dir / "trained.json").exists()
    res = train(again)
    assert res["resumed_from"] == {"checkpoint": str(run.ckpt), "step": 2} and res["steps"] == 4
    assert ckpt_step(run.dir) == 4
