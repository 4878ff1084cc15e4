"""What a task is: `Task`, the one class a task is (its config and its generator), the
registry of tasks, and the splits every task's instances are drawn into.

A task is one dataclass subclass of `Task` in a file of its own (the built-in ones:
hops.py, addition.py, modsum.py, roots.py, carry.py beside this one): its name, its options as
fields (each with a docstring; `data.task.<field>`), their checks in `__post_init__` (one
line naming the dotted field), and `generate`, which draws one instance with the
difficulty of each answer token. Defining the subclass registers it: from then on
`data=<name>` selects it (recdepth/config/schema.py stores one `data` option per
registered task), and a stored config naming it (`data.task.name`) reads back as it.

Every task writes instances as runs of single GPT-2 tokens (" a", " 7", " =", ...), so the
token pipeline (recdepth/data/: compact vocabulary, cache, windows) carries them like
text, and labels each token: 0 = not an answer, d >= 1 = an answer of difficulty d.

Per-step targets (a task may state them; roots.py does): beside its label a token may carry
`steps`, a tuple of symbols: what the prediction of that token should be after loop
application 1, 2, ..., len(steps), and after the last one the token itself (its final
target). A task that states them returns (symbol, label, steps) triples from `generate`
(steps () where a token has none) and says the most steps any token has,
`step_width()` (S >= 1); a task without them returns (symbol, label) pairs and its
`step_width()` is 0. The token cache keeps them beside the labels (`<split>.steps.bin`,
S per token) and the batches carry them as a third tensor (recdepth/data/windows.py).

In-place targets (a task may state them; carry.py does): the prediction made at a position
is scored against the next token, unless that token carries a **scored symbol**, which
then replaces it as the target ("the prediction made at the previous position is scored
against this symbol instead of this token"). The inputs stay the tokens: an answer needs no
slot of its own in the input (carry: the input at position i is bit pair i, the target
there the sum bit s_i, carried by the token after pair i). A task that states them says so,
`in_place()` (True), and returns (symbol, label, steps, scored) from `generate`, steps ()
where a token has none and scored None where the target is the token itself; the label
sits, as always, on the token whose target is scored. The token cache keeps the scored
stream beside the tokens (`<split>.targets.bin`: the tokens with each scored symbol in
place of its token), the batches take y from it instead of from the tokens, and the
decoding engine scores against it (`decode_windows`' `targets`).

Splits: train, validation, test and extrapolation are drawn from disjoint seeds, and an
instance belongs to exactly one of train / validation / test by a hash of its tokens
(`bucket`), so no instance is in two splits, also where the instance space is small (all
2-digit additions). The extrapolation split draws sizes from `extrapolation` (larger than
`size`: more hops, digits, terms) and takes test's hash buckets.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from recdepth.core.checks import is_int
from recdepth.core.registry import Registry

SPLITS = ("train", "validation", "test", "extrapolation")
# Hash buckets (of 100) of each split: test 0-9, validation 10-19, train 20-99.
BUCKETS = {"test": range(0, 10), "validation": range(10, 20), "train": range(20, 100),
           "extrapolation": range(0, 10)}
NAMES = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
DIGITS = [str(d) for d in range(10)]
SYMBOLS = [*NAMES, *DIGITS, "=", "?", "+"]  # what an instance may write (each one GPT-2 token)
# Bump when a generator changes what it writes: old task caches then stop matching.
TASK_VERSION = 4  # 2: hops' unqueried distractor chains; 3: prefixsums' per-step targets; 4: labels in two bytes

MAX_REDRAWS = 10_000
# (symbol, label), or (symbol, label, steps) for a task with per-step targets, or (symbol,
# label, steps, scored) for a task with in-place targets: label 0 = not an answer, d >= 1 =
# difficulty; steps = the targets after applications 1..len(steps); scored = the symbol the
# previous position's prediction is scored against instead of this token (None: the token)
Token = tuple[str, int] | tuple[str, int, tuple[str, ...]] | tuple[str, int, tuple[str, ...], str | None]
Instance = list[Token]

_REGISTRY: Registry[type[Task]] = Registry("data.task.name", "task")  # name -> the task's class


@dataclass
class Task:
    """One generated task: its options (the dataclass fields, `data.task.*`) and its
    generator. Subclass it as a dataclass, give the field `name` your task's name as its
    default, add your options (each with a docstring and a check in `__post_init__`, which
    calls this one first) and write `generate`; the subclass registers itself under `name`."""

    name: str = ""
    """The task (set by `data=<task>`; a stored config names its task here)."""
    size: list[int] = field(default_factory=lambda: [1, 4])
    """Instance sizes of train/validation/test, [lo, hi] inclusive (a hops chain's length,
    an addend's digits, a modsum's terms, a roots query's hops)."""
    extrapolation: list[int] = field(default_factory=lambda: [5, 8])
    """Instance sizes of the extrapolation split, [lo, hi], above `size`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY.register(cls.__dict__.get("name"), cls, cls)  # the default of its field `name`

    def __post_init__(self):
        own = _REGISTRY.name_of(type(self))
        if own is None:
            raise TypeError(f"{type(self).__qualname__}: not a registered task (subclass Task with a name)")
        if self.name != own:
            raise ValueError(f"data.task.name: this is task {own}'s config, got {self.name!r} (select a task with "
                             f"data=<task>: {', '.join(_REGISTRY)})")
        for key in ("size", "extrapolation"):
            v = getattr(self, key)
            if not (isinstance(v, list | tuple) and len(v) == 2 and all(is_int(x) for x in v)):
                raise ValueError(f"data.task.{key}: expected [lo, hi] (two integers), got {v!r}")
            lo, hi = v
            if not self.min_size() <= lo <= hi:
                raise ValueError(f"data.task.{key}: expected [lo, hi] with {self.min_size()} <= lo <= hi, got "
                                 f"[{lo}, {hi}]")
            setattr(self, key, [int(lo), int(hi)])
        if self.extrapolation[0] <= self.size[1]:
            raise ValueError(f"data.task.extrapolation: sizes must exceed the training range data.task.size="
                             f"{list(self.size)}, got {list(self.extrapolation)}")

    # ------------------------------------------------------------------ the task
    def generate(self, rng: random.Random, sizes: tuple[int, int]) -> Instance:
        """One instance with sizes in [lo, hi] (`sizes`), drawn from `rng` only: its symbols
        (each in SYMBOLS) and each one's label (0, or the answer's difficulty >= 1); a task
        with per-step targets (`step_width() > 0`) gives each token its steps too, a tuple of
        at most step_width() symbols: (symbol, label, steps); a task with in-place targets
        (`in_place()`) its scored symbol too (None where there is none): (symbol, label,
        steps, scored)."""
        raise NotImplementedError

    def step_width(self) -> int:
        """S, the most per-step targets any token of any split states (the width of the
        cache's steps files and of a batch's third tensor); 0, the default: the task states
        none, and its `generate` returns (symbol, label) pairs."""
        return 0

    def has_step_targets(self) -> bool:
        """Whether the task states per-step targets (its data can train `loss.steps=trajectory`)."""
        return self.step_width() > 0

    def in_place(self) -> bool:
        """Whether the task states in-place targets (the module's docstring): its `generate`
        returns (symbol, label, steps, scored) and its cache a scored stream. Default: no,
        every prediction is scored against the next token."""
        return False

    def min_size(self) -> int:
        """The smallest `size` / `extrapolation` low end the task accepts (1; roots: 0 hops)."""
        return 1

    def one_per_record(self) -> bool:
        """Whether each record holds one instance, right after its EOT (a layout whose
        lookups are by position needs a fixed place in the window). Default: records pack
        whole instances greedily."""
        return False

    def grid_side(self, split: str) -> int | None:
        """N where each instance of the split is one N × N grid filling its window (EOT, N²
        cells, newline), read by a grid model (`model.attention=grid`); None, the default: the
        task writes no grids."""
        return None

    # ------------------------------------------------------------------ helpers
    def largest(self) -> int:
        """The largest instance size of any split."""
        return max(self.size[1], self.extrapolation[1])

    def sizes(self, split: str) -> tuple[int, int]:
        lo, hi = self.extrapolation if split == "extrapolation" else self.size
        return int(lo), int(hi)


def names() -> tuple[str, ...]:
    """Every registered task's name, in the order the tasks were defined."""
    return _REGISTRY.names()


def lookup(name: str) -> type[Task]:
    """The task class registered under `name`; a one-line ValueError naming data.task.name otherwise."""
    return _REGISTRY.lookup(name)


def bucket(inst: Instance) -> int:
    """The instance's hash bucket 0..99 (over its symbols only): which split may hold it."""
    h = hashlib.blake2b(" ".join(tok[0] for tok in inst).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % 100


def instances(task: Task, split: str, seed: int) -> Iterator[Instance]:
    """The split's instances, in order, forever: deterministic from (task, split, seed);
    an instance outside the split's hash buckets is drawn again."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
    rng = random.Random(f"recdepth-task/{task.name}/{split}/{seed}")
    sizes, keep = task.sizes(split), BUCKETS[split]
    misses = 0
    while True:
        inst = task.generate(rng, sizes)
        if bucket(inst) in keep:
            misses = 0
            yield inst
        else:
            misses += 1
            if misses > MAX_REDRAWS:  # ~10% of instances qualify: this many misses means none does
                key = "extrapolation" if split == "extrapolation" else "size"
                raise ValueError(f"data.task.{key}: the {split} split finds no instance at sizes {list(sizes)} "
                                 f"({MAX_REDRAWS} draws in a row outside its hash buckets: too few distinct instances; "
                                 "widen the range)")
