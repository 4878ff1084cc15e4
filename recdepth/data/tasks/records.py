"""A task's instances as token records: each symbol's GPT-2 id, and records of `length`
tokens (one training/evaluation window's inputs each) with their per-token labels and, for a
task with per-step targets, each token's per-step targets (NO_STEP where it has none), and
for a task with in-place targets the scored stream (the tokens, a scored symbol in place of
the token that carries it)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from recdepth.data.tasks.task import SYMBOLS, Task, instances

NO_STEP = 0xFFFF  # a per-step target slot without a target (no GPT-2 or model id is this large)
# A token's label (0, or its difficulty) as the records and the token cache store it: two bytes,
# so a 512-bit prefix sum's last bit keeps its difficulty 512 (one byte stopped at 255)
LABEL_DTYPE = np.uint16
MAX_LABEL = int(np.iinfo(LABEL_DTYPE).max)


def symbol_ids(encode: Callable[[str], list[int]]) -> dict[str, int]:
    """Each symbol's GPT-2 id (" a", " 7", " =", ...; newline ends an instance), checked to be one token."""
    ids = {}
    for s in [*SYMBOLS, "\n"]:
        t = encode(s if s == "\n" else " " + s)
        if len(t) != 1:
            raise AssertionError(f"task symbol {s!r} is {len(t)} GPT-2 tokens, expected 1")
        ids[s] = t[0]
    return ids


def records(task: Task, split: str, seed: int, n_records: int, length: int, ids: dict[str, int],
            eot: int) -> tuple[np.ndarray, ...]:
    """n_records records of `length` tokens: EOT, then whole instances (each ending in a
    newline) packed greedily (one a record where `task.one_per_record()`), the rest EOT.
    Returns GPT-2 ids and labels (`LABEL_DTYPE`), both [n_records * length], and for a task with
    per-step targets (`task.step_width()` = S > 0) a third array, their GPT-2 ids
    [n_records * length, S] (uint16): row i, column t - 1 the target of token i after loop
    application t, NO_STEP past the token's last step (its own id is the target from there).
    For a task with in-place targets (`task.in_place()`) a last array, the scored stream's
    GPT-2 ids [n_records * length] (uint16): the tokens, each scored symbol in place of its
    token. A record is one training/evaluation window's inputs: windows of block_size =
    length tokens at multiples of length see one record each, from its EOT."""
    one_each = task.one_per_record()
    width = task.step_width()
    tokens = np.full((n_records, length), eot, dtype=np.uint16)
    labels = np.zeros((n_records, length), dtype=LABEL_DTYPE)
    steps = np.full((n_records, length, width), NO_STEP, dtype=np.uint16) if width else None
    targets = tokens.copy() if task.in_place() else None  # filled with the tokens below, then the scored symbols
    it = instances(task, split, seed)
    pending = None
    for r in range(n_records):
        pos = 1
        while True:
            inst = pending if pending is not None else next(it)
            pending = None
            n = len(inst) + 1
            if n > length - 1:
                raise ValueError(f"data.block_size: a {task.name} instance of {n} tokens (size "
                                 f"{list(task.sizes(split))}) does not fit a window of {length} tokens after its EOT")
            if pos + n > length or (one_each and pos > 1):
                pending = inst
                break
            for j, (s, lab, *more) in enumerate(inst):
                tokens[r, pos + j] = ids[s]
                if not 0 <= lab <= MAX_LABEL:
                    raise ValueError(f"data.task: a {task.name} token's label is {lab}, expected 0 (no answer) or a "
                                     f"difficulty 1 .. {MAX_LABEL}")
                labels[r, pos + j] = lab
                if more and more[0]:
                    if len(more[0]) > width:
                        raise ValueError(f"data.task: a {task.name} token states {len(more[0])} per-step targets, "
                                         f"more than the task's step_width() = {width}")
                    steps[r, pos + j, : len(more[0])] = [ids[x] for x in more[0]]
                if targets is not None:
                    targets[r, pos + j] = ids[s]
                scored = more[1] if len(more) > 1 else None
                if scored is not None:
                    if targets is None:
                        raise ValueError(f"data.task: a {task.name} token states a scored symbol, but the task's "
                                         "in_place() is False")
                    targets[r, pos + j] = ids[scored]
            tokens[r, pos + n - 1] = ids["\n"]
            if targets is not None:
                targets[r, pos + n - 1] = ids["\n"]
            pos += n
    out = (tokens.reshape(-1), labels.reshape(-1))
    out += () if steps is None else (steps.reshape(-1, width),)
    return out + (() if targets is None else (targets.reshape(-1),))
