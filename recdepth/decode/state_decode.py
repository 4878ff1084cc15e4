"""What the decoding rules decode a loop state with (SPEC §3 `exit.decode`, docs/spec.md §3b):
the LM head on the state, or Huginn's coda — the layers after the loop read the decoding
cache without writing it (`PeekCache`) — and `state_decoder`, the function an exit monitor
is given. Split from recdepth/decode/engine.py, the engine that calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from recdepth.decode.kv_cache import KVCache
from recdepth.exits.policy import ExitPolicy
from recdepth.model.looped import LoopedGPT


def has_coda(model: LoopedGPT) -> bool:
    """Whether `model` is a prelude / core / coda model: exactly one recurrence group and at
    least one layer after it (what `exit.decode=auto` decodes through the coda for)."""
    return model.n_groups == 1 and model.cfg.groups[0][-1] < model.cfg.n_layer - 1


def decode_mode(model: LoopedGPT, policy: ExitPolicy) -> str:
    """`policy.decode` for this model: "coda" or "head" (`auto` resolved by `has_coda`)."""
    return policy.resolve(has_coda(model)).decode


class PeekCache:
    """One layer's decoding cache, read but never written, for a hypothetical pass at
    positions pos .. pos + T − 1: attention reads the cached K/V of positions 0 .. pos − 1
    and the K/V this pass computes for its own positions (kept here, not in the cache)."""

    def __init__(self, cache: KVCache, pos: int):
        self.cache, self.pos = cache, pos
        self.k = self.v = None

    def write(self, pos: int, k: Tensor, v: Tensor, rows: Tensor | None) -> None:
        if pos != self.pos or rows is not None:
            raise ValueError("PeekCache: one pass of every row at its own position")
        self.k, self.v = k, v

    def read(self, pos: int) -> tuple[Tensor, Tensor]:
        ck, cv = self.cache.read(self.pos - 1)  # positions 0 .. pos − 1, as cached
        return torch.cat([ck, self.k], dim=2), torch.cat([cv, self.v], dim=2)


def coda_logits(model: LoopedGPT, g: int, s: Tensor, caches: list[KVCache], pos: int) -> Tensor:
    """The logits the model would give if group g stopped at the states s [B, T, d] of
    positions pos .. pos + T − 1 (Huginn's `predict_from_latents`): `leave_group`, every layer
    after the group, the final norm and the head. The layers' attention reads the cached
    K/V of positions < pos and the K/V computed here for s (causal among the T positions),
    through `PeekCache`: nothing is written to `caches`. One recurrence group only."""
    if model.n_groups != 1:
        raise ValueError(f"exit.decode: coda decodes through the layers after the loop (Huginn's coda), defined for "
                         f"a model with one recurrence group; this one has {model.n_groups} (use exit.decode=head)")
    x = model.leave_group(g, s)
    for layer in model.coda:
        x = model.h[layer](x, PeekCache(caches[layer], pos), pos)
    return model.decode_logits(x)


def state_decoder(model: LoopedGPT, g: int, policy: ExitPolicy, caches: list[KVCache], pos: int,
                  chunk: bool = False) -> Callable[[Tensor], Tensor] | None:
    """The `decode` (state -> logits) a loop of group g at `pos` gives its exit monitor:
    None for a rule that does not decode; `model.decode_logits` (final norm + head) for
    exit.decode=head; `coda_logits` for coda (`decode_mode`). The monitor passes states
    [B, d], one per row at `pos`, or with `chunk` [T, d], the positions pos .. pos + T − 1 of
    one row (recdepth/decode/generation.py's chunk pass)."""
    if not policy.needs_decode:
        return None
    if decode_mode(model, policy) == "head":
        return model.decode_logits
    if chunk:
        return lambda x: coda_logits(model, g, x[None], caches, pos)[0]
    return lambda x: coda_logits(model, g, x[:, None], caches, pos)[:, 0]
