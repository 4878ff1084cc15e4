"""Run bookkeeping: a training run's directory is its identity.

- **Training identity**: a hash of what changes the trained weights (`what_trains`), and
  only that. Exit and eval settings, where a run reports to, and labels like `model.name`
  are not part of it.
- **Training directory** `<runs_dir>/<identity>/` (default `outputs/runs/`) holds the one
  training run of that identity: `checkpoints/last.ckpt`, `csv/metrics.csv`,
  `diagnostics/`, `figures/`, `wandb/`, and `trained.json` (the training metrics), written
  when training finished.
- **Reuse** is "that directory holds trained.json and its checkpoint": the run is
  evaluated, not trained again. A sweep over exit settings trains once.
- **Resume** is Lightning's `ckpt_path="last"` in that directory: the same command after a
  kill, a crash or a SLURM requeue continues from `checkpoints/last.ckpt`. Curves and
  diagnostics written after that checkpoint are dropped first (`TrainingRun.rewind`);
  training is deterministic, so they come back identical.
- **Locks** (the `filelock` package): `<runs_dir>/<identity>.lock` is held while a process
  trains an identity, so concurrent launches of it (a parallel sweep) wait for the first
  and then reuse its result; `<job dir>/.lock` refuses a second process writing the same
  job directory. The kernel drops both when their holder dies, SIGKILL included.

A job directory (Hydra's run dir, `run_dir`) holds what one launch produced: config.yaml,
metrics.json, the exit evaluation, and `train`, a link to its training directory.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import os
from pathlib import Path

import filelock
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recdepth.data.config import node as data_node
from recdepth.data.config import upgrade as data_upgrade
from recdepth.model.config import OPTION_DEFAULTS, SIZES, shape_of

log = logging.getLogger("recdepth.training.runs")

# Config keys that decide what training produces; exit, eval, logger, callbacks, run_dir
# and runs_dir do not (a sweep over exit settings trains once). Within them, settings
# that only change how a run reports itself, or where it runs, are dropped too.
TRAINING_KEYS = ("seed", "batch_size", "optim", "model", "sampler", "loss", "halt", "data", "trainer")
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
    kept), so `model.n_embd=128` on the cpu preset is the cpu preset; the architecture
    options of docs/spec.md §1b dropped at their defaults (`model.rope_base` under
    learned positions), so a run from before them keeps its identity; `sampler.sigma`
    dropped under `sampler=fixed`, which never reads it; `loss` dropped where it is the loss
    after the last application (what every run before `loss` trained with); `halt` dropped
    without a halting head (halt=none, every run before it), `halt.through_state` at its
    default; and `data` as its source's config
    (recdepth/data/sources/), the keys its source has, a key missing (a config from before
    the schema) taking its default; an old flat one upgraded first (`recdepth.data.config.
    upgrade`, which says what that does to a task run's identity). Also applied to the
    training config a checkpoint was saved with."""
    sub = json.loads(json.dumps(training, default=str))
    d = sub.get("data")
    if isinstance(d, dict):
        try:
            full = OmegaConf.merge(data_node(d), data_upgrade(d))
            sub["data"] = OmegaConf.to_container(full, resolve=True, throw_on_missing=False)
        except (ValueError, OmegaConfBaseException):  # not a data config this recdepth knows: hashed as it is
            pass
    for group, keys in NOT_TRAINING.items():
        for k in keys:
            (sub.get(group) or {}).pop(k, None)
    m = sub.get("model")
    if isinstance(m, dict):
        m.pop("name", None)
        if m.get("size") in SIZES:
            size = m.pop("size")
            m.update(shape_of(size, **{k: m.get(k) for k in SIZES[size]}))
        if m.get("position", "learned") == "learned":
            m.pop("rope_base", None)  # read by rope only
        for k, v in {**OPTION_DEFAULTS, "intermediate_size": None}.items():
            if k in m and m[k] == v:  # Huginn's options (docs/spec.md §1b) at their defaults: the model before them
                del m[k]
    s = sub.get("sampler")
    if isinstance(s, dict) and s.get("name") == "fixed":
        s.pop("sigma", None)
    lo = sub.get("loss")
    if lo is None or (isinstance(lo, dict) and lo.get("steps", "last") == "last" and not lo.get("anneal_to")):
        sub.pop("loss", None)  # the loss after the last application: the runs from before `loss`
    h = sub.get("halt")
    if h is None or (isinstance(h, dict) and h.get("loss", "none") == "none"):
        sub.pop("halt", None)  # no halting head: the runs from before `halt`
    elif isinstance(h, dict) and h.get("through_state", True) is True:
        h.pop("through_state", None)  # at its default: the halting runs from before it
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


# ------------------------------------------------------------- the training run
class TrainingRun:
    """The training directory of cfg's identity, `<runs_dir>/<identity>/`."""

    def __init__(self, cfg: DictConfig):
        self.identity, self.training = training_identity(cfg)
        self.dir = Path(cfg.runs_dir).resolve() / self.identity
        self.ckpt = self.dir / "checkpoints" / "last.ckpt"
        self._lock = filelock.FileLock(self.dir.parent / f"{self.identity}.lock")

    @contextlib.contextmanager
    def locked(self):
        """Hold the identity lock; a second process of this identity waits here, with a
        log line, and afterwards finds the run finished (reuse) or resumable."""
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            log.info("identity lock: %s is held by another process; waiting for it (then its result is reused)",
                     self._lock.lock_file)
            self._lock.acquire()
        try:
            yield self
        finally:
            self._lock.release()

    def trained(self) -> dict | None:
        """The training metrics of a finished run (trained.json, and its checkpoint), else None."""
        f = self.dir / "trained.json"
        if not f.is_file():
            return None
        if not self.ckpt.is_file():
            raise FileNotFoundError(f"runs_dir: {self.dir} holds trained.json but no checkpoints/last.ckpt; "
                                    "delete the directory to train it again")
        return json.loads(f.read_text())

    def finish(self, metrics: dict) -> None:
        """Training finished: from now on this identity is reused."""
        write_json(self.dir / "trained.json", {k: metrics[k] for k in TRAINING_METRICS if k in metrics})

    def resume_step(self, max_steps: int) -> int | None:
        """The step of the checkpoint a run continues from, None to start fresh. The
        checkpoint is refused (one line) if it is unreadable, past trainer.max_steps, or
        was saved under a different training config. One at max_steps is accepted: its run
        was killed after training and before it finished (validation, evaluation)."""
        if not self.ckpt.is_file():
            return None
        where = f"runs_dir: {self.ckpt}"
        try:
            c = torch.load(self.ckpt, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # truncated, not a checkpoint, or carries objects weights_only refuses
            raise ValueError(f"{where} is not a readable recdepth checkpoint ({type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:160]}); move it away to train again") from e
        if not isinstance(c, dict) or "global_step" not in c or "training_config" not in c:
            raise ValueError(f"{where} is not a recdepth training checkpoint; move it away to train again")
        diff = config_diff(what_trains(c["training_config"]), self.training)
        if diff:
            raise ValueError(f"{where} was saved under a different training config ({'; '.join(diff)}); "
                             "move it away to train again")
        step = int(c["global_step"])
        if step > max_steps:
            raise ValueError(f"{where} is at step {step}, past trainer.max_steps={max_steps}")
        return step

    def rewind(self, step: int | None) -> list[dict]:
        """Before (re)starting at `step` (None: from scratch): drop the diagnostics written
        after it, and return the curves up to it (csv/metrics.csv, which the CSV logger
        starts afresh; they are logged again first). Training is deterministic, so what a
        killed run wrote past its checkpoint comes back identical."""
        last = -1 if step is None else step
        for f in self.dir.glob("diagnostics/step_*.json"):
            if int(f.stem.split("_")[1]) > last:
                f.unlink()
        f = self.dir / "csv" / "metrics.csv"
        if step is None or not f.is_file():
            return []
        with open(f, newline="") as fh:
            return [{k: int(v) if k in ("step", "epoch") else float(v) for k, v in row.items() if v != ""}
                    for row in csv.DictReader(fh) if row.get("step", "") != "" and int(row["step"]) <= step]

    def link(self, job_dir: Path) -> None:
        """`<job_dir>/train` -> this training directory (where its checkpoint, curves and
        diagnostics are). Best effort: a filesystem without symlinks still has metrics.json's
        `train_dir`."""
        link = job_dir / "train"
        if link.is_symlink() or link.exists():
            return
        with contextlib.suppress(OSError):
            link.symlink_to(self.dir, target_is_directory=True)


@contextlib.contextmanager
def job_dir_lock(job_dir: Path):
    """Hold `<job_dir>/.lock`: two launches in the same second share Hydra's timestamped
    run dir; the second is refused rather than writing over the first."""
    lock = filelock.FileLock(job_dir / ".lock")
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise FileExistsError(f"run_dir: {job_dir} is in use by another recdepth run; choose a new run_dir") from None
    try:
        yield
    finally:
        lock.release()
