"""task: a generated algorithmic task (recdepth/data/tasks/, docs/spec.md §6), records of
block_size tokens with per-token answer labels; `data=<task>` selects the task (`data=task`:
hops), `data.task.*` are its options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from recdepth.core.checks import check_int
from recdepth.data import tasks
from recdepth.data.sources.source import DataConfig
from recdepth.data.token_cache import TokenCache, prepare_task_tokens

LOSSES = ("all", "answers")


@dataclass
class TaskData(DataConfig):
    """`data=<task>` (hops | addition | modsum | roots | a task of your own): records of block_size
    tokens, one window each, of the task's instances; the loss and the evaluations count
    the answer tokens."""

    source: str = "task"
    val_tokens: int | None = None
    task: tasks.Task = field(default_factory=tasks.Hops)
    """The task and its options (`data.task.*`: recdepth/data/tasks/<name>.py), chosen with
    `data=<task>`; its name is `data.task.name`."""
    train_records: int = 20000
    """Train records of block_size tokens (whole instances each)."""
    test_records: int = 256
    """Test records (the evaluations' split: eval.tokens <= test_records * block_size)."""
    validation_records: int = 256
    """Validation records (training's val/ce; recdepth.calibrate's split)."""
    extrapolation_records: int = 256
    """Extrapolation records (harder instances, never trained on); 0: none at training (a task
    whose larger instances need a larger window than the model's: data=mazes; `recdepth
    evaluate`'s eval.task writes them in a grown block)."""
    instance_seed: int = 0
    """Seed of the instances (the training order has its own, `seed`)."""
    loss: str = "answers"
    """answers (the task's answer tokens only) | all (every next token)."""
    extrapolation_task: dict[str, Any] = field(default_factory=dict)
    """Fields of `task` set anew for the extrapolation split alone (what `recdepth evaluate`'s
    eval.task sets on a checkpoint: longer instances, carry's ripple); the other splits, and
    so the vocabulary, stay the task's. Empty: the task's."""

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.task, tasks.Task):
            raise ValueError(f"data.task: expected a task's config (select one with data=<task>: "
                             f"{', '.join(tasks.names())}), got {self.task!r}")
        for split in ("train", "test", "validation", "extrapolation"):
            check_int(f"data.{split}_records", getattr(self, f"{split}_records"), int(split != "extrapolation"))
        check_int("data.instance_seed", self.instance_seed, 0)
        if self.loss not in LOSSES:
            raise ValueError(f"data.loss: expected one of {', '.join(LOSSES)}, got {self.loss!r}")

    @classmethod
    def node(cls, d: dict) -> DictConfig:
        """TaskData's node with `task` of the class `d` names (data.task.name; hops without one)."""
        n = OmegaConf.structured(cls)
        name = (d.get("task") or {}).get("name") if isinstance(d.get("task"), dict) else None
        if name is not None:
            n.task = OmegaConf.structured(tasks.lookup(name))
        return n

    def answers_only(self) -> bool:
        return self.loss == "answers"

    def step_width(self) -> int:
        # a task that states per-step targets (data=roots): S > 0; the widest of the splits' tasks
        return max(self.task.step_width(), self.split_task().step_width())

    def records(self) -> dict[str, int]:
        """Records per split (train, test, validation, extrapolation)."""
        return {s: int(getattr(self, f"{s}_records")) for s in ("train", "test", "validation", "extrapolation")}

    def split_task(self) -> tasks.Task:
        """The task the extrapolation split is drawn from: `task` with `extrapolation_task`'s
        fields (its own checks, one line naming data.task.<field>)."""
        return dataclasses.replace(self.task, **self.extrapolation_task) if self.extrapolation_task else self.task

    def prepare(self, block_size: int, progress: bool = True) -> TokenCache:
        return prepare_task_tokens(self.task, block_size, self.records(), self.instance_seed, self.cache_dir,
                                   extrapolation=self.split_task() if self.extrapolation_task else None)
