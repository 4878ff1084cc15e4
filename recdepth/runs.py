"""Run bookkeeping: what a training run is, where it lives, and how it is picked up again.

- **Training identity**: a hash of every config key that decides what training produces.
  Two runs with the same identity train the same model, so a sweep over exit settings
  trains once (`reuse`), and a killed run can be found again by the same command
  (`resume`).
- **Index** (`reuse.index`, default `outputs/trained`): `<identity>.json` for a finished
  run (its run dir, checkpoint and training metrics), `<identity>.partial.json` for one
  that started and has not finished, and `<identity>.lock`, held (flock) for as long as a
  process trains that identity: a second process with the same identity (a parallel sweep
  launcher) waits for it, then reuses its result instead of training it twice. The kernel
  drops the lock when its holder dies, SIGKILL included.
- **Resume** (`ckpt_path`): `auto` (default) continues this run dir's `last.ckpt`, or the
  interrupted run of the same identity; `last` insists on one of them; a path resumes
  that file; `null` always starts fresh. A checkpoint saved under another training
  config is refused with the keys that differ.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import os
import shutil
import socket
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from recdepth.model import SIZES, shape_of

log = logging.getLogger("recdepth.runs")

# Config keys that decide what training produces; exit, eval, logger, callbacks, run_dir,
# ckpt_path and reuse do not (a sweep over exit settings trains once). Within them,
# settings that only change how a run reports itself, or where it runs, are dropped too.
TRAINING_KEYS = ("seed", "batch_size", "optim", "model", "sampler", "data", "trainer")
# Validation, checkpoints and diagnostics draw from generators of their own, so their
# cadence changes nothing trained; nor does the accelerator or compiling (numerics aside).
NOT_TRAINING = {"trainer": ("enable_progress_bar", "log_every_n_steps", "peak_flops", "val_check_interval",
                            "checkpoint_every", "accelerator", "compile"),
                "data": ("cache_dir", "num_workers")}
TRAINING_METRICS = ("val_ce", "val_ppl", "unigram_ce", "train_seconds", "tokens_seen", "steps", "model",
                    "groups", "params", "diagnostics_seconds", "identity")


def write_json(path: Path, obj) -> None:
    """Write JSON atomically: a reader (or a kill) never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------ identity
def what_trains(training: dict) -> dict:
    """The training config reduced to what changes the trained weights (a copy): the
    NOT_TRAINING keys dropped; `model.name` dropped (a preset's label: `model=single` and
    `model=grouped 'model.groups=[[4,5,6,7]]'` are one network); `model.size` replaced by
    the shape it stands for (n_layer, n_head, n_embd, block_size, each explicit override
    kept), so `model.n_embd=128` on the cpu preset is the cpu preset; and `sampler.sigma`
    dropped under `sampler=fixed`, which never reads it. Also applied to the training
    config a checkpoint was saved with, so checkpoints from before a key was dropped
    still resume."""
    sub = json.loads(json.dumps(training, default=str))
    for group, keys in NOT_TRAINING.items():
        for k in keys:
            (sub.get(group) or {}).pop(k, None)
    m = sub.get("model")
    if isinstance(m, dict):
        m.pop("name", None)
        if m.get("size") in SIZES:
            size = m.pop("size")
            m.update(shape_of(size, **{k: m.get(k) for k in SIZES[size]}))
    s = sub.get("sampler")
    if isinstance(s, dict) and s.get("name") == "fixed":
        s.pop("sigma", None)
    return sub


def training_identity(cfg: DictConfig) -> tuple[str, dict]:
    """(identity, what it hashes): sha256 over `what_trains` of the resolved TRAINING_KEYS
    and the recdepth version, first 16 hex digits."""
    from recdepth import __version__

    sub = what_trains({k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
                       for k in TRAINING_KEYS})
    sub["recdepth"] = __version__
    blob = json.dumps(sub, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16], sub


def _flat(d, prefix: str = "") -> dict:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def config_diff(saved: dict, now: dict, limit: int = 4) -> list[str]:
    """`key: saved -> now` for the keys (dotted) whose values differ."""
    a, b = _flat(saved), _flat(now)
    diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return diff[:limit] + ([f"... {len(diff) - limit} more"] if len(diff) > limit else [])


# --------------------------------------------------------------------- index
def index_files(cfg: DictConfig, identity: str) -> tuple[Path, Path, Path]:
    """(finished entry, partial entry, lock) of an identity in the reuse index."""
    root = Path(cfg.reuse.index)
    return root / f"{identity}.json", root / f"{identity}.partial.json", root / f"{identity}.lock"


def read_entry(path: Path) -> dict | None:
    """An index entry, if it is valid JSON and its checkpoint still exists."""
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
    except json.JSONDecodeError:
        log.warning("index: %s is not valid JSON; ignoring it", path)
        return None
    if not Path(entry.get("checkpoint", "")).is_file():
        if path.name.endswith(".partial.json"):
            # Killed before its first checkpoint: the checkpoint it had resumed from, if any.
            fallback = entry.get("resumed_from")
            return {**entry, "checkpoint": fallback} if fallback and Path(fallback).is_file() else None
        log.warning("reuse: %s points at a missing checkpoint %s; training again", path, entry.get("checkpoint"))
        return None
    return entry


def _entry(identity: str, run_dir: Path) -> dict:
    """What every index entry holds: the identity, its run dir and that dir's checkpoint."""
    return {"identity": identity, "run_dir": str(run_dir.resolve()),
            "checkpoint": str((run_dir / "checkpoints" / "last.ckpt").resolve())}


def register_partial(path: Path, identity: str, run_dir: Path, resumed_from: Path | None = None) -> None:
    """Record that run_dir has started training this identity. Its own checkpoint comes
    later; until then the checkpoint it resumed from stands in, so a run killed before
    its first checkpoint loses nothing an earlier run had saved."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {**_entry(identity, run_dir),
                      "resumed_from": None if resumed_from is None else str(Path(resumed_from).resolve()),
                      "pid": os.getpid(), "host": socket.gethostname()})


def register_trained(index: Path, identity: str, run_dir: Path, metrics: dict) -> None:
    """Record a finished training run (`reuse.index/<identity>.json`); drop its partial entry."""
    index.parent.mkdir(parents=True, exist_ok=True)
    write_json(index, {**_entry(identity, run_dir),
                       "training": {k: metrics[k] for k in TRAINING_METRICS if k in metrics}})
    with contextlib.suppress(FileNotFoundError):
        (index.parent / f"{identity}.partial.json").unlink()


class FileLock:
    """An exclusive flock on a file: `<index>/<identity>.lock` (one process at a time
    trains an identity) or `<run_dir>/.lock` (one process at a time writes a run dir).
    `acquire()` blocks, with a log line naming the holder, while another process has it;
    `acquire(wait=False)` raises BlockingIOError naming the holder instead. `release` is
    idempotent. path None: a no-op lock."""

    def __init__(self, path: Path | None):
        self.path, self._f = path, None

    def acquire(self, wait: bool = True) -> None:
        if self.path is None:
            return
        try:
            import fcntl
        except ImportError:  # not POSIX: no cross-process lock; reuse still works sequentially
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 (held open for as long as the lock)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            if not wait:
                f.close()
                raise BlockingIOError(f"{self.path} is held by {holder}") from None
            log.info("identity lock: %s is held by %s; waiting for it (then its result is reused)", self.path, holder)
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:  # a filesystem without flock (Lustre without -o flock, some NFS)
            f.close()
            log.warning("lock: cannot lock %s (%s); going on without it", self.path, e)
            return
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._f = f

    def release(self) -> None:
        if self._f is not None:
            import fcntl

            fcntl.flock(self._f, fcntl.LOCK_UN)
            self._f.close()
            self._f = None


# -------------------------------------------------------------------- resume
def find_resume(cfg: DictConfig, run_dir: Path, partial: Path | None) -> Path | None:
    """The checkpoint this run continues from, per `ckpt_path` (see the module docstring)."""
    want = cfg.get("ckpt_path", "auto")
    if want is None or str(want).lower() in ("null", "none"):
        return None
    if str(want) not in ("auto", "last"):
        p = Path(str(want))
        if not p.is_file():
            raise FileNotFoundError(f"ckpt_path: no checkpoint file at {p}")
        return p
    here = run_dir / "checkpoints" / "last.ckpt"
    if here.is_file():
        return here
    entry = read_entry(partial) if partial is not None else None
    if entry is not None:
        return Path(entry["checkpoint"])
    if want == "last":
        where = f" and no interrupted run of this training identity in {partial.parent}" if partial else ""
        raise FileNotFoundError(f"ckpt_path=last: no checkpoint at {here}{where}")
    return None


def check_resumable(ckpt: Path, training: dict, max_steps: int) -> int:
    """Refuse (one line) a checkpoint that is unreadable, past trainer.max_steps, or was
    saved under a different training config; return its global step. A checkpoint at
    max_steps is accepted: its run was killed after training and before it finished
    (validation, evaluation), and resuming it does just that."""
    try:
        c = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, not a checkpoint, or carries objects weights_only refuses
        raise ValueError(f"ckpt_path: {ckpt} is not a readable recdepth checkpoint "
                         f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})") from e
    if not isinstance(c, dict) or "global_step" not in c or "state_dict" not in c:
        raise ValueError(f"ckpt_path: {ckpt} is not a Lightning checkpoint (no global_step / state_dict)")
    saved, now = c.get("training_config"), training
    if saved is not None:
        saved = what_trains(saved)
    if saved is None:  # not written by recdepth.train: at least the model's shape must match
        shape = training["model_shape"]
        hp = (c.get("hyper_parameters") or {}).get("model") or {}
        saved = {"model": {k: hp.get(k) for k in shape}}
        now = {"model": shape}
    diff = config_diff(saved, now)
    if diff:
        raise ValueError(f"ckpt_path: {ckpt} was saved under a different training config ({'; '.join(diff)}); "
                         "resume with the config it was saved with, or set ckpt_path=null to start fresh")
    step = int(c["global_step"])
    if step > max_steps:
        raise ValueError(f"ckpt_path: {ckpt} is at step {step}, past trainer.max_steps={max_steps}; "
                         "nothing to resume (set ckpt_path=null to train again)")
    return step


def run_dir_of(ckpt: Path) -> Path | None:
    """The run dir a checkpoint was saved in (`<run_dir>/checkpoints/x.ckpt`), if any."""
    ckpt = ckpt.resolve()
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


def carry_over(ckpt: Path, step: int, run_dir: Path) -> None:
    """Continuing another directory's run here: bring its loop diagnostics and training
    curves up to the checkpoint's step, so this run dir reads as one uninterrupted run.
    The old directory is left as it was."""
    old = run_dir_of(ckpt)
    if old is None or old == run_dir.resolve():
        return  # a checkpoint file outside any run dir, or in place: nothing to bring
    n = 0
    for f in sorted(old.glob("diagnostics/step_*.json")):
        if int(f.stem.split("_")[1]) <= step:
            (run_dir / "diagnostics").mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, run_dir / "diagnostics" / f.name)
            n += 1
    log.info("resume: continuing %s (step %d) in %s; carried over %d diagnostics files", old, step, run_dir, n)


def earlier_curves(ckpt: Path, step: int) -> list[dict]:
    """The rows of the resumed run's csv/metrics.csv up to the checkpoint's step (the CSV
    logger starts its file afresh; these are written back into it first)."""
    old = run_dir_of(ckpt)
    f = None if old is None else old / "csv" / "metrics.csv"
    if f is None or not f.is_file():
        return []
    rows = []
    with open(f, newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get("step", "") != "" and int(row["step"]) <= step:
                rows.append({k: int(v) if k in ("step", "epoch") else float(v) for k, v in row.items() if v != ""})
    return rows


def same_training(run_dir: Path, identity: str) -> bool:
    """Whether run_dir's config.yaml (written by the run that used it) has this training identity."""
    try:
        return training_identity(OmegaConf.load(run_dir / "config.yaml"))[0] == identity
    except Exception:  # no config.yaml, or one from another version of the config
        return False


def registered(finished: Path | None, identity: str, run_dir: Path, metrics: dict, lock: FileLock) -> None:
    """Training finished: record it in the index and let the next process of this identity in."""
    if finished is not None:
        register_trained(finished, identity, run_dir, metrics)
    lock.release()
