"""Windows of a token memmap, the training order, and the resumable training loader.

Train: step k trains on batch_size windows of block_size + 1 tokens at offsets that are
a pure function of (seed, k) (`TrainOrder`). Val: non-overlapping windows in order. The
loader's state is the step: a resumed run recomputes the batches it has not seen.

A batch is (x, y): inputs and targets, LongTensors [B, T] (y = -1 where a task's
answers-only loss masks a target). Over a task cache with per-step targets
(`TokenCache.step_width` = S > 0) it is (x, y, z), z a LongTensor [B, T, S]: z[b, p, t - 1]
the model id the prediction at input position p should give after loop application t,
-1 where there is none (the final target y applies; z is -1 wherever y is). Over a task
cache with in-place targets (a scored stream, `TokenCache.train_targets`) y is read from the
scored stream instead of the tokens: y[b, p] the scored symbol the token after p carries,
else that token; x stays the tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from recdepth.data.tasks import LABEL_DTYPE, NO_STEP


class WindowBatches(Dataset):
    """Map-style dataset whose item k is batch k: the windows of block_size + 1 tokens
    starting at offsets[k*B : (k+1)*B], as (x, y) LongTensors [B, block_size], y = x
    shifted by one (or the scored stream `targets`, shifted by one); with `steps`, (x, y, z)
    (the module's docstring). Batches (not single
    windows) are the items so one fancy-index read of the memmap serves a whole batch, and
    skipping k batches is just slicing offsets. The memmaps are reopened lazily in each
    worker instead of being pickled."""

    def __init__(
        self, file: Path, n_tokens: int, offsets: np.ndarray, block_size: int, batch_size: int,
        labels: Path | None = None, steps: Path | None = None, step_width: int = 0, targets: Path | None = None,
    ):
        self.file = Path(file)
        # A task's labels (LABEL_DTYPE, aligned with the tokens): targets that are not answers
        # become -1, which the loss ignores (`model.token_nll`): the answers-only loss.
        self.labels = None if labels is None else Path(labels)
        self._labels: np.memmap | None = None
        # A task's per-step targets (uint16 [n_tokens, step_width], NO_STEP: none): z.
        if (steps is None) != (int(step_width) == 0):
            raise ValueError(f"data: per-step targets need both their file and their width (got {steps}, "
                             f"step_width={step_width})")
        self.steps = None if steps is None else Path(steps)
        self.step_width = int(step_width)
        self._steps: np.memmap | None = None
        # A task's scored stream (uint16, aligned with the tokens): y is read from it.
        self.targets = None if targets is None else Path(targets)
        self._targets: np.memmap | None = None
        self.n_tokens = int(n_tokens)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self._tokens: np.memmap | None = None
        self._span = np.arange(self.block_size + 1, dtype=np.int64)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tokens"] = state["_labels"] = state["_steps"] = state["_targets"] = None
        return state

    def __len__(self) -> int:
        return math.ceil(len(self.offsets) / self.batch_size)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, ...]:
        if not 0 <= k < len(self):
            raise IndexError(k)
        if self._tokens is None:
            self._tokens = np.memmap(self.file, dtype=np.uint16, mode="r", shape=(self.n_tokens,))
        starts = self.offsets[k * self.batch_size : (k + 1) * self.batch_size]
        w = torch.from_numpy(self._tokens[starts[:, None] + self._span].astype(np.int64))
        y = w[:, 1:].contiguous()
        if self.targets is not None:
            if self._targets is None:
                self._targets = np.memmap(self.targets, dtype=np.uint16, mode="r", shape=(self.n_tokens,))
            y = torch.from_numpy(self._targets[starts[:, None] + self._span[1:]].astype(np.int64))
        if self.labels is not None:
            if self._labels is None:
                self._labels = np.memmap(self.labels, dtype=LABEL_DTYPE, mode="r", shape=(self.n_tokens,))
            answer = torch.from_numpy(self._labels[starts[:, None] + self._span[1:]] > 0)
            y = y.masked_fill(~answer, -1)
        if self.steps is None:
            return w[:, :-1].contiguous(), y
        if self._steps is None:
            self._steps = np.memmap(self.steps, dtype=np.uint16, mode="r", shape=(self.n_tokens, self.step_width))
        z = torch.from_numpy(self._steps[starts[:, None] + self._span[1:]].astype(np.int64))  # [B, T, S]
        z = z.masked_fill((z == NO_STEP) | (y < 0)[..., None], -1)
        return w[:, :-1].contiguous(), y, z


@dataclass(frozen=True)
class TrainOrder:
    """Which train windows each optimiser step sees.

    Window offsets are uniform over every full window of the train split (n_tokens
    tokens), drawn in sequence from numpy Generator(seed): offset i depends only on
    (seed, i), not on how many are drawn. Step k's global batch is offsets
    [k*W*B, (k+1)*W*B) and rank r takes its r-th slice of B, so W processes at batch B
    train on exactly the windows one process at batch W*B would. Batch k is thus a pure
    function of (seed, k): nothing but the step needs saving to resume. (Computing it
    draws the offsets before it: the bounded draw rejects a variable number of generator
    outputs, so no jump ahead reproduces this sequence; it draws ~30M offsets a second.)
    """

    n_tokens: int
    block_size: int
    batch_size: int
    max_steps: int
    seed: int
    world_size: int = 1
    align: int = 1
    """Offsets are multiples of this: a task's records (`recdepth.data.tasks.records.records`) are
    block_size tokens each, so align = block_size gives every window one whole record."""

    def draw(self, n: int) -> np.ndarray:
        """The first n window offsets of the seeded sequence."""
        rng = np.random.default_rng(self.seed)
        starts = (self.n_tokens - self.block_size - 1) // self.align + 1  # = n_tokens - block_size at align 1
        return rng.integers(0, starts, size=n, dtype=np.int64) * self.align

    def batch(self, step: int, rank: int = 0) -> np.ndarray:
        """The offsets of rank's batch_size windows at `step`."""
        B, W = self.batch_size, self.world_size
        start = (step * W + rank) * B
        return self.draw((step + 1) * W * B)[start : start + B]

    def offsets(self, rank: int = 0) -> np.ndarray:
        """rank's windows of all max_steps steps, in order (one draw)."""
        B, W = self.batch_size, self.world_size
        return self.draw(self.max_steps * W * B).reshape(self.max_steps, W, B)[:, rank].reshape(-1)

    def state(self) -> dict:
        """What fixes the order, checked when a checkpoint's loader state is restored."""
        state = {"seed": self.seed, "batch_size": self.batch_size, "world_size": self.world_size,
                 "max_steps": self.max_steps, "block_size": self.block_size}
        return state if self.align == 1 else {**state, "align": self.align}


class FromStep(torch.utils.data.Sampler):
    """Batch indices start .. n-1; its length stays n (the epoch Lightning counts is the
    whole run: after a resume its progress counters already hold the first `start`)."""

    def __init__(self, n: int, start: int = 0):
        self.n, self.start = int(n), int(start)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.n))


class ResumableLoader(DataLoader):
    """The training DataLoader, with the `state_dict` / `load_state_dict` Lightning looks
    for on a loader: the state is the number of optimiser steps taken (one batch each),
    plus what fixes the order (`TrainOrder.state`), which must match on resume. `dm` is
    the data module it feeds: its trainer's global_step is the steps taken, and a restore
    sets its start_step."""

    def __init__(self, ds: WindowBatches, order: TrainOrder, start: int, dm, **kw):
        super().__init__(ds, batch_size=None, sampler=FromStep(len(ds), start), **kw)  # items are whole batches
        self.order = order
        self.dm = dm

    def state_dict(self) -> dict:
        t = getattr(self.dm, "trainer", None)
        step = int(t.global_step) if t is not None else self.sampler.start
        return {"step": step, **self.order.state()}

    def load_state_dict(self, state: dict) -> None:
        now = self.order.state()
        diff = [f"{k}={state.get(k)!r} -> {v!r}" for k, v in now.items() if state.get(k) != v]
        if diff:
            raise ValueError(f"data: the checkpoint's data order differs from this run's ({', '.join(diff)}); "
                             "resume with the settings it was saved with")
        if not 0 <= state["step"] <= self.sampler.n:
            raise ValueError(f"data: checkpoint step {state['step']} outside [0, {self.sampler.n}]")
        self.sampler.start = int(state["step"])
        self.dm.start_step = int(state["step"])
