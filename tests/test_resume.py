"""Exact resume through the real CLI: a run killed with SIGKILL (between steps, or in the
middle of writing a checkpoint) and started again ends where an uninterrupted run ends."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_cli import run

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


@pytest.fixture(scope="module")
def straight(tmp_path_factory, env):
    """The uninterrupted run every resumed run must match."""
    d = tmp_path_factory.mktemp("straight")
    run([*ARGS, f"run_dir={d / 'run'}", "reuse.enabled=false"], cwd=d, env=env)
    return json.loads((d / "run" / "metrics.json").read_text()), d / "run"


def steps_of(run_dir: Path) -> list[int]:
    return sorted(int(f.stem.split("_")[1]) for f in run_dir.glob("diagnostics/step_*.json"))


def kill_after_first_checkpoint(args, cwd, env, pattern) -> int:
    """Start the CLI, SIGKILL it as soon as a checkpoint exists; return that checkpoint's step."""
    p = subprocess.Popen([sys.executable, "-m", "recdepth.train", *args], cwd=cwd, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list(cwd.glob(pattern)) and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    (ckpt,) = cwd.glob(pattern)
    return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]


def test_the_same_command_resumes_a_killed_run_exactly(tmp_path, env, straight):
    ref, ref_dir = straight
    # Hydra's timestamped run dirs: the second launch gets a new directory and finds the
    # interrupted run through its training identity.
    step = kill_after_first_checkpoint(ARGS, tmp_path, env, "outputs/*/*/checkpoints/last.ckpt")
    assert 0 < step < 16
    (killed,) = [d for d in tmp_path.glob("outputs/*/*") if (d / "checkpoints").is_dir()]
    assert not (killed / "metrics.json").exists()  # it really died before the end
    before = sorted(p.name for p in killed.rglob("*"))
    time.sleep(1.1)  # a new second: a new Hydra run dir
    p = run(ARGS, cwd=tmp_path, env=env)
    (done,) = [d for d in tmp_path.glob("outputs/*/*") if (d / "metrics.json").is_file()]
    m = json.loads((done / "metrics.json").read_text())
    assert m["resumed_from"]["step"] == step and "Restoring states from the checkpoint" in p.stderr
    assert m["val_ce"] == pytest.approx(ref["val_ce"], abs=1e-6)
    assert m["eval"]["ce"] == pytest.approx(ref["eval"]["ce"], abs=1e-6)
    assert m["steps"] == ref["steps"] == 16 and m["tokens_seen"] == ref["tokens_seen"]
    # The resumed dir reads as one run: every checkpoint's diagnostics, identical geometry.
    assert steps_of(done) == steps_of(ref_dir) == [0, 4, 8, 12, 16]
    a = json.loads((done / "diagnostics" / "step_16.json").read_text())["groups"]
    b = json.loads((ref_dir / "diagnostics" / "step_16.json").read_text())["groups"]
    assert json.dumps(a) == json.dumps(b)
    assert sorted(p.name for p in killed.rglob("*")) == before  # the killed run's files are left alone
    # Finished: the index now reuses it, and nothing is left "in progress".
    assert not list(tmp_path.glob("outputs/trained/*.partial.json"))
    q = run([*ARGS, "exit=accel"], cwd=tmp_path, env=env)
    assert "reuse: training identity" in q.stdout + q.stderr


def test_a_kill_in_the_middle_of_a_checkpoint_write_loses_nothing(tmp_path, env, straight):
    ref, _ = straight
    rd = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", DIE_MID_WRITE, *ARGS, f"run_dir={rd}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL
    # The half-written second checkpoint never replaced the first.
    ckpt = torch.load(rd / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4
    # `ckpt_path=last` in the same run dir continues in place.
    run([*ARGS, f"run_dir={rd}", "ckpt_path=last"], cwd=tmp_path, env=env)
    m = json.loads((rd / "metrics.json").read_text())
    assert m["resumed_from"]["step"] == 4
    assert m["val_ce"] == pytest.approx(ref["val_ce"], abs=1e-6)
    assert steps_of(rd) == [0, 4, 8, 12, 16]


def test_a_checkpoint_of_another_config_is_refused(tmp_path, env, straight):
    _, ref_dir = straight
    ckpt = ref_dir / "checkpoints" / "last.ckpt"
    # A different model shape: one line naming the differing keys.
    p = run([*ARGS, f"run_dir={tmp_path / 'a'}", f"ckpt_path={ckpt}", "model.n_embd=64"], cwd=tmp_path, env=env,
            check=False)
    assert p.returncode != 0
    assert f"ckpt_path: {ckpt} was saved under a different training config" in p.stderr
    assert "model_shape.n_embd: 128 -> 64" in p.stderr
    # ckpt_path=last with nothing to resume, and a file that is not a checkpoint.
    p = run([*ARGS, f"run_dir={tmp_path / 'c'}", "ckpt_path=last", "reuse.enabled=false"], cwd=tmp_path, env=env,
            check=False)
    assert p.returncode != 0 and "ckpt_path=last: no checkpoint at" in p.stderr
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    p = run([*ARGS, f"run_dir={tmp_path / 'd'}", f"ckpt_path={junk}"], cwd=tmp_path, env=env, check=False)
    assert p.returncode != 0 and f"ckpt_path: {junk} is not a readable recdepth checkpoint" in p.stderr
    for d in "acd":
        assert not (tmp_path / d / "checkpoints").exists()  # refused before any work



def kill_when(args, cwd, env, ready) -> None:
    """Start the CLI and SIGKILL it as soon as `ready()` is true."""
    p = subprocess.Popen([sys.executable, "-m", "recdepth.train", *args], cwd=cwd, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not ready() and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert p.poll() is None, "the run ended before the kill"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()


def test_a_resumed_run_killed_before_its_own_first_checkpoint_loses_nothing(tmp_path, env, straight):
    """A killed at step 4; B resumes it and is killed before saving anything; C must still
    start from A's step 4, not from scratch."""
    ref, _ = straight
    kill_after_first_checkpoint(ARGS, tmp_path, env, "outputs/*/*/checkpoints/last.ckpt")
    (a,) = [d for d in tmp_path.glob("outputs/2*/*")]
    (partial,) = tmp_path.glob("outputs/trained/*.partial.json")
    time.sleep(1.1)
    kill_when(ARGS, tmp_path, env, lambda: json.loads(partial.read_text())["run_dir"] != str(a.resolve()))  # B in
    (b,) = [d for d in tmp_path.glob("outputs/2*/*") if d != a]
    assert not (b / "checkpoints").exists()
    time.sleep(1.1)
    run(ARGS, cwd=tmp_path, env=env)
    (c,) = [d for d in tmp_path.glob("outputs/2*/*") if (d / "metrics.json").is_file()]
    m = json.loads((c / "metrics.json").read_text())
    assert m["resumed_from"] == {"checkpoint": str((a / "checkpoints" / "last.ckpt").resolve()), "step": 4}
    assert m["val_ce"] == pytest.approx(ref["val_ce"], abs=1e-6)


def test_a_run_dir_killed_before_its_first_and_after_its_last_checkpoint_reruns_in_place(tmp_path, env, straight):
    """A requeued job reruns in its own dir: killed before any checkpoint (only step 0's
    diagnostics written), then after the final checkpoint but before metrics.json."""
    ref, _ = straight
    rd = tmp_path / "run"
    args = [*ARGS, f"run_dir={rd}"]
    kill_when(args, tmp_path, env, lambda: (rd / "diagnostics" / "step_0.json").is_file())
    assert not (rd / "checkpoints").exists()
    last = rd / "checkpoints" / "last.ckpt"

    def trained() -> bool:
        try:
            return torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 16
        except Exception:  # not there yet
            return False

    kill_when(args, tmp_path, env, trained)
    assert not (rd / "metrics.json").exists()
    p = run([*args, "ckpt_path=null"], cwd=tmp_path, env=env, check=False)  # fresh over a checkpoint: refused
    assert p.returncode != 0 and "already holds checkpoints/last.ckpt and ckpt_path=null starts fresh" in p.stderr
    run(args, cwd=tmp_path, env=env)
    m = json.loads((rd / "metrics.json").read_text())
    assert m["resumed_from"]["step"] == 16 and m["steps"] == 16
    assert m["val_ce"] == pytest.approx(ref["val_ce"], abs=1e-6)
    assert m["eval"]["ce"] == pytest.approx(ref["eval"]["ce"], abs=1e-6)
    assert steps_of(rd) == [0, 4, 8, 12, 16]
