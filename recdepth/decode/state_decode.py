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
from recdepth.exits.policy import ORACLE, ExitPolicy
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
    and the K/V this pass computes for its own positions (kept here, not in the cache).
    `rows` (an index into the cache's rows, or None for all): the pass holds those rows
    only. `commit` writes the kept K/V into the cache, as the real pass would have."""

    def __init__(self, cache: KVCache, pos: int, rows: Tensor | None = None):
        self.cache, self.pos, self.rows = cache, pos, rows
        self.k = self.v = None

    def write(self, pos: int, k: Tensor, v: Tensor, rows: Tensor | None) -> None:
        if pos != self.pos or rows is not None:
            raise ValueError("PeekCache: one pass of every row at its own position")
        self.k, self.v = k, v

    def read(self, pos: int) -> tuple[Tensor, Tensor]:
        ck, cv = self.cache.read(self.pos - 1)  # positions 0 .. pos − 1, as cached
        if self.rows is not None:
            ck, cv = ck.index_select(0, self.rows), cv.index_select(0, self.rows)
        return torch.cat([ck, self.k], dim=2), torch.cat([cv, self.v], dim=2)

    def commit(self) -> None:
        """The kept K/V of one token (T = 1) into the cache at pos (its rows only)."""
        self.cache.write(self.pos, self.k, self.v, self.rows)


def coda_logits(model: LoopedGPT, g: int, s: Tensor, caches: list[KVCache], pos: int,
                rows: Tensor | None = None, peeks: list[PeekCache] | None = None) -> Tensor:
    """The logits the model would give if group g stopped at the states s [B, T, d] of
    positions pos .. pos + T − 1 (Huginn's `predict_from_latents`): `leave_group`, every layer
    after the group, the final norm and the head. The layers' attention reads the cached
    K/V of positions < pos and the K/V computed here for s (causal among the T positions),
    through `PeekCache`: nothing is written to `caches`. `rows`: s holds those cache rows
    only (an index; None: every row). `peeks`, if given, receives the layers' PeekCaches
    (their K/V, to `commit` when this pass is the token's own). One recurrence group only."""
    if model.n_groups != 1:
        raise ValueError(f"exit.decode: coda decodes through the layers after the loop (Huginn's coda), defined for "
                         f"a model with one recurrence group; this one has {model.n_groups} (use exit.decode=head)")
    x = model.leave_group(g, s)
    for layer in model.coda:
        peek = PeekCache(caches[layer], pos, rows)
        if peeks is not None:
            peeks.append(peek)
        x = model.h[layer](x, peek, pos)
    return model.decode_logits(x)


class CodaDecoder:
    """exit.decode=coda's decode of group g's states at one position (`coda_logits`), a
    function of the states [B, d] (or, with `chunk`, [T, d] of one row) that keeps its last
    pass: `commit` writes that pass's coda K/V into the caches, so when the check that
    fires is the token's output (`check_is_output`) the coda is not run a second time."""

    def __init__(self, model: LoopedGPT, g: int, caches: list[KVCache], pos: int, chunk: bool = False,
                 rows: Tensor | None = None):
        self.model, self.g, self.caches, self.pos, self.chunk, self.rows = model, g, caches, pos, chunk, rows
        self.peeks: list[PeekCache] = []

    def __call__(self, x: Tensor) -> Tensor:
        self.peeks = []
        if self.chunk:
            return coda_logits(self.model, self.g, x[None], self.caches, self.pos, self.rows, self.peeks)[0]
        return coda_logits(self.model, self.g, x[:, None], self.caches, self.pos, self.rows, self.peeks)[:, 0]

    def commit(self) -> None:
        for peek in self.peeks:
            peek.commit()


def check_is_output(model: LoopedGPT, g: int, policy: ExitPolicy) -> bool:
    """Whether group g's decoding check computes the token's own output, so the check that
    fires can be the output (no second pass through the coda and head): through the coda
    (`leave_group`, every layer after the one group, the head: what the token runs after
    its loop), or the head on the state of a group that is the last thing before the head
    and passes its state on as it is (no latent norm). False for a rule that does not
    decode."""
    if not policy.needs_decode:
        return False
    if decode_mode(model, policy) == "coda":
        return True
    return model.plan[-1] == ("group", g) and not model.cfg.latent_norm


def decode_flops(model: LoopedGPT, g: int, policy: ExitPolicy) -> tuple[int, float]:
    """What one decode of group g's state costs a decoding rule: (the layers it runs, the
    head's FLOPs). exit.decode=head: (0, the head); coda: (every layer after the group,
    the head). (0, 0) for a rule that does not decode."""
    if not policy.needs_decode:
        return 0, 0.0
    layers = len(model.coda) if decode_mode(model, policy) == "coda" else 0
    return layers, model.head_flops()


def check_price(model: LoopedGPT, g: int, policy: ExitPolicy) -> dict:
    """The price of one check of group g's rule in layer equivalents (docs/spec.md §4b): the
    layers its decode runs (`decode_flops`; one each, as a loop's layers count), the head's
    FLOPs and the rule's statistic (`ExitRule.check_flops`) over the FLOPs of one layer
    application's matmuls (`LoopedGPT.layer_flops()`). Returns {layers, head, statistic,
    total, flops} (flops: the check's FLOPs, its layers at `layer_flops()` each)."""
    if policy.name == ORACLE:
        return {"layers": 0, "head": 0.0, "statistic": 0.0, "total": 0.0, "flops": 0.0}
    unit = model.layer_flops()
    layers, head = decode_flops(model, g, policy)
    stat = policy.rule.check_flops(model.cfg.n_embd, model.cfg.padded_vocab_size)
    total = layers + (head + stat) / unit
    return {"layers": layers, "head": head / unit, "statistic": stat / unit, "total": total, "flops": total * unit}


def state_decoder(model: LoopedGPT, g: int, policy: ExitPolicy, caches: list[KVCache], pos: int,
                  chunk: bool = False, rows: Tensor | None = None) -> Callable[[Tensor], Tensor] | None:
    """The `decode` (state -> logits) a loop of group g at `pos` gives its exit monitor:
    None for a rule that does not decode; `model.decode_logits` (final norm + head) for
    exit.decode=head; a `CodaDecoder` for coda (`decode_mode`). The monitor passes states
    [B, d], one per row at `pos` (`rows`: the cache rows they are, an index; None: every
    row), or with `chunk` [T, d], the positions pos .. pos + T − 1 of one row
    (recdepth/decode/generation.py's chunk pass)."""
    if not policy.needs_decode:
        return None
    if decode_mode(model, policy) == "head":
        return model.decode_logits
    return CodaDecoder(model, g, caches, pos, chunk, rows)
