"""K/V caches of token-by-token decoding (SPEC §4): one entry per position per layer
("latest" sharing, each application overwriting its position's entry) or one per
application ("per_step"), each row owning its entries so a row's result in a batch is
its result alone. The engine that reads and writes them is recdepth/decode/engine.py.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from recdepth.model.looped import LoopedGPT

SHARING = ("latest", "per_step")


class KVCache:
    """K/V of one layer for token-by-token decoding, shaped [B, H, T, head_dim].

    One entry per position ("latest" sharing, SPEC §4): a looped layer overwrites its
    position's entry at every application, so earlier positions are always read at their
    last computed application. Each row owns its own entries; `rows` restricts a write to
    the rows still looping, so a row that has exited is never overwritten by another's step:
    a bool mask [B] when k/v hold every row, or an index [b] when they hold only those rows
    (a compacted batch).
    """

    def __init__(self, batch: int, n_head: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_head, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def _slot(self, pos: int) -> tuple[Tensor, Tensor]:
        """Views [B, H, head_dim] of the entries the current application writes at `pos`."""
        return self.k[:, :, pos], self.v[:, :, pos]

    def write(self, pos: int, k: Tensor, v: Tensor, rows: Tensor | None) -> None:
        ks, vs = self._slot(pos)  # views: assignments below write into the cache
        if rows is None:
            ks[:], vs[:] = k[:, :, 0], v[:, :, 0]
        elif rows.dtype == torch.bool:  # k/v of every row; write the masked ones
            ks[rows], vs[rows] = k[rows, :, 0], v[rows, :, 0]
        else:  # k/v of the rows listed in `rows` only (compacted batch)
            ks[rows], vs[rows] = k[:, :, 0], v[:, :, 0]

    def read(self, pos: int) -> tuple[Tensor, Tensor]:
        return self.k[:, :, : pos + 1], self.v[:, :, : pos + 1]

    def take(self, rows: Tensor) -> KVCache:
        """A cache of the same kind holding a copy of rows `rows` (an index) only."""
        out = copy.copy(self)
        out.k, out.v = self.k[rows], self.v[rows]
        return out


class StepKVCache(KVCache):
    """K/V of one looped layer indexed by (application, position), shaped [B, H, A, T, head_dim]
    (Huginn's per-step cache; `eval.cache=per_step`).

    Application j of the layer (set `step = j` before it) writes slot j of the current
    position and reads slot j of every position, so a token attends to earlier tokens at
    the same depth of the loop. A position whose loop stopped after n < A applications
    has its last entry copied into slots n..A−1 (`finish`), so later tokens read it at its
    last application when they loop longer. With the same fixed n for every token this is
    exactly the parallel forward pass.
    """

    def __init__(self, batch: int, n_head: int, max_len: int, head_dim: int, device, dtype, max_steps: int):
        self.k = torch.zeros(batch, n_head, max_steps, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.step = 0

    def _slot(self, pos: int) -> tuple[Tensor, Tensor]:
        return self.k[:, :, self.step, pos], self.v[:, :, self.step, pos]

    def read(self, pos: int) -> tuple[Tensor, Tensor]:
        return self.k[:, :, self.step, : pos + 1], self.v[:, :, self.step, : pos + 1]

    def finish(self, pos: int, n: Tensor) -> None:
        """Position `pos` ran n[b] applications in row b: fill slots n[b].. with slot n[b]−1."""
        A = self.k.shape[2]
        src = torch.minimum(torch.arange(A, device=n.device)[None, :], (n - 1)[:, None])  # [B, A]
        idx = src[:, None, :, None].expand(-1, self.k.shape[1], -1, self.k.shape[-1])
        self.k[:, :, :, pos] = self.k[:, :, :, pos].gather(2, idx)
        self.v[:, :, :, pos] = self.v[:, :, :, pos].gather(2, idx)


def new_caches(model: LoopedGPT, batch: int, max_len: int, sharing: str = "latest",
               max_steps: int = 32) -> list[KVCache | StepKVCache]:
    """One K/V cache per layer. `sharing` decides what a looped layer keeps per position:
    "latest" (SPEC §4, default): one entry, overwritten by every application;
    "per_step": one entry per application (at most `max_steps`), read at the same depth
    of the loop (Huginn's per-step cache; with a fixed n it equals the parallel pass)."""
    check_cache(sharing)
    cfg, p = model.cfg, next(model.parameters())
    looped = {layer for g in cfg.groups for layer in g}
    shape = (batch, cfg.n_head, max_len, cfg.n_embd // cfg.n_head, p.device, p.dtype)
    return [StepKVCache(*shape, max_steps=max_steps) if sharing == "per_step" and layer in looped
            else KVCache(*shape) for layer in range(cfg.n_layer)]


def check_cache(sharing: str, key: str = "eval.cache") -> None:
    """A K/V cache name (`SHARING`), or a one-line error naming the config `key` it came from."""
    if sharing not in SHARING:
        raise ValueError(f"{key}: expected one of {', '.join(SHARING)}, got {sharing!r}")
