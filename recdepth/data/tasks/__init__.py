"""Algorithmic tasks with known per-token difficulty (docs/spec.md §6): the test bed of
adaptive computation (ACT, PonderNet, looped transformers), generated, never downloaded.
Core layer: torch and numpy only (no Lightning, Hydra or `datasets`).

  task.py      `Task`, the one class a task is (its config and its generator), the
               registry (`names`, `lookup`), the splits and their hash buckets, `instances`
  records.py   instances as token records with per-token labels, each symbol's GPT-2 id
  answers.py   scoring the answer tokens of an evaluation (`score_answers`, `spearman`)
  hops.py, addition.py, modsum.py, roots.py, carry.py   the built-in tasks, one class each

A task of your own is one file in this folder: a dataclass subclass of `Task` (task.py says
what it holds). This package imports every module of its folder (`import_folder`), so the
file registers its task wherever tasks are used, and `data=<name>` selects it.
"""

from recdepth.core.registry import import_folder
from recdepth.data.tasks.addition import Addition  # the built-in tasks register on import
from recdepth.data.tasks.answers import average_ranks, score_answers, spearman
from recdepth.data.tasks.carry import Carry
from recdepth.data.tasks.hops import Hops
from recdepth.data.tasks.modsum import Modsum
from recdepth.data.tasks.records import LABEL_DTYPE, NO_STEP, records, symbol_ids
from recdepth.data.tasks.roots import Roots
from recdepth.data.tasks.task import (
    BUCKETS,
    DIGITS,
    MAX_REDRAWS,
    NAMES,
    SPLITS,
    SYMBOLS,
    TASK_VERSION,
    Instance,
    Task,
    Token,
    bucket,
    instances,
    lookup,
    names,
)

__all__ = ["BUCKETS", "DIGITS", "LABEL_DTYPE", "MAX_REDRAWS", "NAMES", "NO_STEP", "SPLITS", "SYMBOLS", "TASK_VERSION", "Addition",
           "Carry", "Hops", "Instance", "Modsum", "Roots", "Task", "Token", "average_ranks", "bucket", "instances", "lookup",
           "names", "records", "score_answers", "spearman", "symbol_ids"]

import_folder(__name__, __path__)  # a task file of one's own, beside the built-in ones
