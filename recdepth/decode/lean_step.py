"""The lean decode step: one token's layer applications in static shapes, optionally
compiled (`eval.backend`, docs/spec.md §4, recdepth note on the lean step; its speed:
docs/results/decode-speed.md).

`recdepth.decode.engine` decodes a token by calling `Block.forward` with the layer's K/V cache:
about 60 operators per layer application (the profiler's count at d = 128), each a Python
call and a dispatch, which at batch 1 cost fifty times the arithmetic. This module
computes the same layer (SPEC §1's sandwich block, with the model's options: RoPE, q/k
bias, gated MLP) for one token in fewer operators, and with shapes that need not change
from token to token, so `torch.compile` can fuse it into a few kernels once:

- the K/V cache is the preallocated `KVCache` tensor [B, H, block_size, head_dim],
  written in place at the position (a tensor, not a Python int) with one `index_copy_`
  per tensor; eagerly the attention reads positions 0 .. pos, compiled it reads a span of
  the block at batch 1 (the power of two from 16 up that holds pos + 1), the whole block
  in a batch, with the later positions masked (`block_token`);
- q, k, v are views of one projection; a group application (the adapter and the group's
  layers, `group_token`) is one call;
- compiled at batch 1, a group's whole loop for a token, its exit checks included, is one
  call (`loop`: a `torch.while_loop` whose body is the application and the rule's check,
  `exits.observe_step`), so an application costs its kernels, not a call from Python, the
  graph's guards and an eager check (`fuse_loops`), under either cache (`per_step`: each
  application on its own slot), a decoding check through the head or the coda, which,
  where it is the token's output, the loop returns; the engine falls back to a call per
  application for a row limit (the oracle) and for batches.

It reads the same parameter tensors as the model (no copy), so it always computes the
current weights. It covers what batch-1 decoding and a batch do: a row mask `keep` (rows
still looping) or none, or a compacted batch's row index (`group_rows`, eager: the rows
still looping only, attended as `Block.forward` attends them), one-entry-per-position
caches (`eval.cache=latest`) and, eagerly, the current application's slot of a per_step
cache (`recdepth.decode.engine.cache_views`), one token; the decoding engine
(`recdepth.decode.engine.lean_of`) runs `Block.forward` as before for everything else
(a chunk of tokens, the coda's `PeekCache`, per_step caches under the compiled step outside
its batch-1 loop).

Equal to `Block.forward` up to float rounding (tests compare the two: float64 within
1e-12, float32 within 1e-5). Compiled, the masked entries' softmax weights are exactly 0,
but the attention sums over its span (batch 1) or the whole block and the kernels fuse differently (within
float32 rounding; recdepth.bench decode counts the applications that change because a
criterion lies within rounding of τ).
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import Tensor

from recdepth.exits.monitor import history0, observe_step
from recdepth.exits.policy import ExitPolicy
from recdepth.model.looped import (
    GRID_PARALLEL_ONLY,
    BlockWeights,
    LoopedGPT,
    attend_rows,
    block_out,
    first,
    linear,
    qkv_of,
)


def attend_shared(q: Tensor, k: Tensor, v: Tensor, ck: Tensor, cv: Tensor, pos: int, rows: Tensor,
                  reps: int, lo: int = 0) -> Tensor:
    """One token's attention at `pos` for rows whose history is shared in blocks of `reps`
    (the oracle's N rows of a window: after each position every row of a block holds its
    last row's entries, `recdepth.decode.engine.decode_windows`). q, k, v [b, H, 1, hd] are the cache rows
    `rows` (an index into ck, cv [R, H, n, hd]) at `pos`: each attends to its block's
    positions 0 .. pos − 1, read once per block from the block's last row, and to its own
    k, v at pos (the same softmax over positions 0 .. pos as `model.attend_rows`, summed in
    another order). Reading the history once per block, not once per row, is what pays:
    the oracle's attention is bound by reading the cache (N = 32 rows per window)."""
    R, H, _, hd = ck.shape
    W, scale, n = R // reps, hd**-0.5, pos - lo  # n: the earlier positions read (lo .. pos − 1; a window's)
    kp, vp = ck[reps - 1 :: reps, :, lo:pos], cv[reps - 1 :: reps, :, lo:pos]  # [W, H, n, hd], views
    qd = q.new_zeros(R, H, hd)
    qd[rows] = q[:, :, 0]
    scores = qd.view(W, reps, H, hd).transpose(1, 2) @ kp.transpose(-1, -2) * scale  # [W, H, reps, n]
    scores = scores.transpose(1, 2).reshape(R, H, n)[rows]
    p = torch.softmax(torch.cat([scores, (q[:, :, 0] * k[:, :, 0]).sum(-1, keepdim=True) * scale], -1), -1)
    pd = q.new_zeros(R, H, n)
    pd[rows] = p[..., :n]
    y = (pd.view(W, reps, H, n).transpose(1, 2) @ vp).transpose(1, 2).reshape(R, H, hd)[rows]  # [b, H, hd]
    return (y + p[..., n:] * v[:, :, 0])[:, :, None]


_STATIC: dict[str, types.FunctionType] = {}
_RULES: dict[tuple, ExitPolicy] = {}  # `LeanSteps.loop`'s rule objects, by (name and the options its check reads)


def _static(fn: types.FunctionType) -> types.FunctionType:
    """A copy of `fn` with a code object of its own, made once: dynamo keeps graphs, and
    which sizes it has seen change, per code object, so the batch-1 static graphs and the
    batches' dynamic ones do not mix."""
    if fn.__qualname__ not in _STATIC:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_static")
        _STATIC[fn.__qualname__] = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                                                      fn.__closure__)
    return _STATIC[fn.__qualname__]


class LeanSteps:
    """The lean single-token steps of one model (see the module docstring).

    `compile`: run them through `torch.compile` (fullgraph; graphs built on first use); False runs the same functions
    eagerly. Built once per model and step by `recdepth.decode.engine.lean_steps(model, step)`,
    which the engine calls with the step its `DecodeSettings` name."""

    def __init__(self, model: LoopedGPT, compile: bool = False):
        cfg = model.cfg
        if cfg.attention == "grid":  # its attention is causal over a cache: no grid neighbours
            raise ValueError(GRID_PARALLEL_ONLY)
        self.model, self.compiled = model, compile
        self.n_head, self.head_dim, self.eps = cfg.n_head, cfg.head_dim, cfg.norm_eps
        self.gated = cfg.mlp == "gated_silu"
        self.rotary = model.h[0].attn.rotary
        self.blocks = [b.weights() for b in model.h]
        self.group_blocks = [[self.blocks[layer] for layer in g] for g in cfg.groups]  # built once, read per application
        device = next(model.parameters()).device
        self.positions = torch.arange(cfg.block_size, device=device)
        self.pos = [self.positions[p : p + 1] for p in range(cfg.block_size)]  # no tensor made per token
        # Compiled at batch 1, the attention at position p reads the first span(p) entries, the power of two
        # from 16 up that holds p + 1 (at most the block), the later ones masked: a graph per
        # span, and a token early in a long block does not read the whole block (it pays at
        # Huginn's block of 512 and costs a little at the default 256; why it costs is not
        # known: docs/results/decode-speed.md).
        self.spans = [min(cfg.block_size, max(16, 1 << p.bit_length())) for p in range(cfg.block_size)]
        if self.rotary is not None:
            self.cos, self.sin = self.rotary(0, cfg.block_size, device)
        else:
            self.cos = self.sin = None
        self.window = cfg.attention_window  # sliding-window attention (model.first): None, or the last W positions
        self._block, self._group = self._block1, self._group1 = self.block_token, self.group_token
        if compile:
            # A graph per group length, qk_bias/keep present or not, and model (dynamo keys its
            # cache on the function's code, shared by every instance). Batches > 1 attend the
            # whole block and their batch size turns dynamic on its second value; batch 1 runs
            # copies of the functions with code of their own (`_static`) and static shapes, a
            # graph per span (dynamic=False keeps the span a constant of its graph; a shared
            # code object would also make every batch size a graph of its own). More than the
            # default 8 in a process that decodes several models (a test session), never one
            # per token.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            # cpp_wrapper: the graph's launcher in C++, not Python (faster at batch 1:
            # docs/results/decode-speed.md)
            opts = {"cpp_wrapper": True}
            self._block = torch.compile(self.block_token, fullgraph=True, options=opts)
            self._group = torch.compile(self.group_token, fullgraph=True, options=opts)
            self._block1 = torch.compile(types.MethodType(_static(LeanSteps.block_token), self), fullgraph=True,
                                         dynamic=False, options=opts)
            self._group1 = torch.compile(types.MethodType(_static(LeanSteps.group_token), self), fullgraph=True,
                                         dynamic=False, options=opts)
            # A group's whole loop at batch 1, its exit checks included, as one graph (`loop`): a graph
            # per group length and rule, the block attended whole (no graph per span).
            self._loop = torch.compile(self.loop_token, fullgraph=True, dynamic=False, options=opts)
        self.fuse_loops = compile  # batch-1 loops as one graph each (`loop`); False: a compiled call per application
        self._limits: dict[tuple, Tensor] = {}

    # ---------------------------------------------------------------- the math
    def block_token(self, x: Tensor, kc: Tensor, vc: Tensor, pos: Tensor, keep: Tensor | None, w: BlockWeights,
                    n_ctx: int, masked: bool = False) -> Tensor:
        """`Block.forward` for one token x [B, 1, d] at position `pos` ([1] long) with the
        layer's cache kc, vc [B, H, block_size, head_dim]: this token's k/v are written at
        `pos` (only in the rows where `keep` [B] is True, if given) and the attention reads
        positions 0 .. pos (SPEC §1; the decoding cache of SPEC §4): the first n_ctx = pos + 1
        entries, or with `masked` (compiled: no shape may depend on pos) the first n_ctx
        entries (pos's span at batch 1, the whole block in a batch; `_call`) with the
        positions after pos masked."""
        q, k, v = self._qkv(x, w, pos)
        if keep is not None:  # rows that have exited keep their entry
            m = keep[:, None, None, None]
            k = torch.where(m, k, kc.index_select(2, pos))
            v = torch.where(m, v, vc.index_select(2, pos))
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        if masked:  # static shapes (compiled): a span of the block, positions after pos masked
            # Written out rather than F.scaled_dot_product_attention: for one query the CPU
            # flash-attention kernel is an opaque call with its own buffers and threads, while
            # these few ops inductor fuses into its loops (faster, measured; the same
            # softmax(q k^T / sqrt(hd)) v, masked).
            kc, vc = kc[:, :, :n_ctx], vc[:, :, :n_ctx]
            scores = (q @ kc.transpose(-1, -2)) * self.head_dim**-0.5  # [B, H, 1, n_ctx]
            scores = scores.masked_fill(self._unread(self.positions[:n_ctx], pos, True), float("-inf"))
            y = torch.softmax(scores, -1) @ vc
        else:  # eager: positions first(pos) .. pos only (n_ctx = pos + 1)
            lo = first(n_ctx - 1, self.window)
            y = F.scaled_dot_product_attention(q, kc[:, :, lo:n_ctx], vc[:, :, lo:n_ctx])
        return self._block_out(x, y, w)

    def _qkv(self, x: Tensor, w: BlockWeights, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [B, H, 1, hd] of one token x [B, 1, d] at position `pos` ([1] long): the
        block's own `qkv_of`, rotated by the table's row at `pos`."""
        rope = None if self.cos is None else (self.cos.index_select(0, pos), self.sin.index_select(0, pos))
        return qkv_of(x, w, self.n_head, self.eps, rope)

    def _block_out(self, x: Tensor, y: Tensor, w: BlockWeights) -> Tensor:
        return block_out(x, y, w, self.eps, self.gated)

    def block_looping(self, x: Tensor, kc: Tensor, vc: Tensor, pos: Tensor, w: BlockWeights) -> tuple[Tensor, Tensor, Tensor]:
        """`block_token` at batch 1 inside a loop compiled whole (`loop_token`), where the cache
        may not be written: the attention reads the cached positions before `pos` and this
        token's own k/v, kept apart (the same softmax over positions 0 .. pos). Returns the
        block's output and this token's k, v [1, H, 1, hd], for the caller to write."""
        q, k, v = self._qkv(x, w, pos)
        scale = self.head_dim**-0.5
        scores = (q @ kc.transpose(-1, -2)) * scale  # [1, H, 1, block]
        scores = scores.masked_fill(self._unread(self.positions, pos, False), float("-inf"))
        p = torch.softmax(torch.cat([scores, (q * k).sum(-1, keepdim=True) * scale], -1), -1)
        y = p[..., :-1] @ vc + p[..., -1:] * v
        return self._block_out(x, y, w), k, v

    def loop_token(self, rule: ExitPolicy, s: Tensor, e_proj: Tensor, adapter_w: Tensor,
                   kvs: list[tuple[Tensor, Tensor]], pos: Tensor, ws: list[BlockWeights], limits: Tensor,
                   gate: tuple[Tensor, Tensor] | None, g: int | None, coda: list[tuple[Tensor, Tensor]] | None,
                   reuse: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """A group's loop for one token (batch 1) until its rule fires, as one
        `torch.while_loop`: each iteration is `group_token` (with `block_looping`) and the
        rule's check (`exits.observe_step`); after it, the last application's k/v are
        written at `pos`, as the step-by-step loop leaves them. Per-application caches
        (`eval.cache=per_step`, kvs [1, H, A, T, hd]): application j attends to slot j of the
        earlier positions, each application's k/v are carried in its slot and written at
        `pos` after the loop (the engine's `StepKVCache.finish` then fills the slots above n). `rule` holds the rule's
        name and kl direction (a graph each); its numbers are in `limits`. A decoding rule
        decodes with the head, or with `coda` (the caches of the layers after the group)
        through `leave_group`, those layers (`block_looping`: the cache before `pos`, their
        own k/v apart) and the head. With `reuse` (the decode is the token's output,
        `recdepth.decode.state_decode.check_is_output`) the last check's logits come back and
        its coda k/v are written at `pos`, so the coda and the head do not run again.
        Returns the final state [1, 1, d], the applications [] (long) and the logits [1, V]
        (None without `reuse`)."""
        model = self.model
        pos = pos.clone()  # a view of self.positions, which the loop also reads: its inputs may not alias
        hist = history0(rule, s[:, 0], model.cfg.padded_vocab_size)
        per_step = kvs[0][0].dim() == 5  # StepKVCache tensors [1, H, A, T, hd]: application j reads and writes slot j
        A = kvs[0][0].shape[2] if per_step else 0  # (set either way: the loop's body closes over it)
        if per_step:  # this position's entry in every slot, carried: each application writes its own
            kv0 = [t.index_select(3, pos)[:, :, :, 0].clone() for kc, vc in kvs for t in (kc, vc)]  # [1, H, A, hd]
        else:
            kv0 = [kc.new_zeros(kc.shape[:2] + (1, kc.shape[3])) for kc, _ in kvs for _ in "kv"]  # set every iteration
        coda_ws = [] if coda is None else [self.blocks[layer] for layer in model.coda]
        own = rule.needs_decode and (coda is not None or reuse)  # the body decodes (not observe_step's head)
        out0 = [s.new_zeros(1, model.cfg.padded_vocab_size)] if own else []
        out0 += [kc.new_zeros(kc.shape[:2] + (1, kc.shape[3])) for kc, _ in (coda or []) for _ in "kv"]
        n0 = torch.zeros((), dtype=torch.long, device=s.device)
        fired0 = torch.zeros(1, dtype=torch.bool, device=s.device)
        H = len(hist)

        def decode_own(u):  # u [1, 1, d] -> logits [1, V] and the coda's k/v
            x, new = u, []
            if coda is not None:
                x = model.leave_group(g, u)
                for (kc, vc), w in zip(coda, coda_ws, strict=True):
                    x, k, v = self.block_looping(x, kc, vc, pos, w)
                    new += [t.clone(memory_format=torch.contiguous_format) for t in (k, v)]
            return model.decode_logits(x)[:, 0], new

        def cond(n, fired, s, *rest):
            return ~fired.any()

        def body(n, fired, s, *rest):
            h, carried = rest[:H], rest[H : H + len(kv0)]
            u, new_kv = linear(s, adapter_w) + e_proj, []
            j = torch.clamp(n, max=A - 1).reshape(1) if per_step else None  # this application's slot
            for i, ((kc, vc), w) in enumerate(zip(kvs, ws, strict=True)):
                if per_step:
                    u, k, v = self.block_looping(u, kc.index_select(2, j)[:, :, 0], vc.index_select(2, j)[:, :, 0],
                                                 pos, w)
                    new_kv += [carried[2 * i].index_copy(2, j, k), carried[2 * i + 1].index_copy(2, j, v)]
                    continue
                u, k, v = self.block_looping(u, kc, vc, pos, w)
                # copies with the placeholders' strides: a loop's outputs may not alias (k, v are views of one projection)
                new_kv += [t.clone(memory_format=torch.contiguous_format) for t in (k, v)]
            n = n + 1
            if own:
                logits, coda_kv = decode_own(u)
                fired, h = observe_step(rule, n, s[:, 0], u[:, 0], tuple(h), limits, lambda _: logits, gate)
                return (n, fired, u, *h, *new_kv, logits, *coda_kv)
            decode = model.decode_logits if rule.needs_decode else None
            fired, h = observe_step(rule, n, s[:, 0], u[:, 0], tuple(h), limits, decode, gate)
            return (n, fired, u, *h, *new_kv)

        n, _, s, *rest = torch.while_loop(cond, body, (n0, fired0, s, *hist, *kv0, *out0))
        kv, done = rest[H : H + len(kv0)], rest[H + len(kv0) :]
        for i, (kc, vc) in enumerate(kvs):
            if per_step:  # every slot at pos; the engine then fills those above n (`StepKVCache.finish`)
                kc.index_copy_(3, pos, kv[2 * i][:, :, :, None])
                vc.index_copy_(3, pos, kv[2 * i + 1][:, :, :, None])
                continue
            kc.index_copy_(2, pos, kv[2 * i])
            vc.index_copy_(2, pos, kv[2 * i + 1])
        if not reuse:
            return s, n, None
        for i, (kc, vc) in enumerate(coda or []):  # the last check's coda pass is the token's
            kc.index_copy_(2, pos, done[1 + 2 * i])
            vc.index_copy_(2, pos, done[2 + 2 * i])
        return s, n, done[0]

    def block_rows(self, x: Tensor, kc: Tensor, vc: Tensor, pos: int, rows: Tensor, w: BlockWeights,
                   reps: int | None = None) -> Tensor:
        """`block_token` for a compacted batch (eager): x [b, 1, d] holds the rows `rows` (an
        index into the cache's B rows) only. Their k/v are written at `pos` in those rows,
        and the attention reads positions 0 .. pos of those rows as `Block.forward` does
        (`model.attend_rows`): the same kernels on the same operands. With `reps`, the rows'
        history is shared in blocks of that many (the oracle's), read once per block
        (`attend_shared`: the same attention to float rounding)."""
        q, k, v = self._qkv(x, w, self.pos[pos])
        kc[:, :, pos][rows], vc[:, :, pos][rows] = k[:, :, 0], v[:, :, 0]
        lo = first(pos, self.window)
        if reps is not None:
            return self._block_out(x, attend_shared(q, k, v, kc, vc, pos, rows, reps, lo), w)
        return self._block_out(x, attend_rows(q, kc[:, :, lo : pos + 1], vc[:, :, lo : pos + 1], rows), w)

    def _unread(self, positions: Tensor, pos: Tensor, own: bool) -> Tensor:
        """Which cache positions a query at `pos` does not read (masked): those after it
        (with `own` False, its own too: `block_looping` adds it apart) and, under a sliding
        window W, those before pos − W + 1 (`model.first`)."""
        out = positions > pos if own else positions >= pos
        if self.window is not None:
            out = out | (positions <= pos - self.window)
        return out

    def group_token(self, s: Tensor, e_proj: Tensor, adapter_w: Tensor, kvs: list[tuple[Tensor, Tensor]],
                    pos: Tensor, keep: Tensor | None, ws: list[BlockWeights], n_ctx: int, masked: bool = False) -> Tensor:
        """One application of a group for one token (`LoopedGPT.apply_group`): the adapter
        W_s s + e_proj, then the group's layers (`block_token`), each with its cache."""
        u = linear(s, adapter_w) + e_proj
        for (kc, vc), w in zip(kvs, ws, strict=True):
            u = self.block_token(u, kc, vc, pos, keep, w, n_ctx, masked)
        return u

    # ------------------------------------------------------- the engine's calls
    def layer(self, i: int, x: Tensor, k: Tensor, v: Tensor, pos: int, keep: Tensor | None = None,
              reps: int | None = None) -> Tensor:
        """Layer i for one token x [B, 1, d] (`model.h[i](x, cache, pos, keep)`) with its
        cache tensors k, v [B, H, block_size, head_dim]; with `reps` (and no `keep`), the
        rows' history is shared in blocks of that many (`block_rows`)."""
        if reps is not None and keep is None:
            return self.block_rows(x, k, v, pos, torch.arange(x.shape[0], device=x.device), self.blocks[i], reps)
        step, n_ctx, masked = self._call(self._block, self._block1, x.shape[0], pos)
        return step(x, k, v, self.pos[pos], keep, self.blocks[i], n_ctx, masked)

    def group_rows(self, g: int, s: Tensor, e_proj: Tensor, kvs: list[tuple[Tensor, Tensor]], pos: int,
                   rows: Tensor, reps: int | None = None) -> Tensor:
        """`model.apply_group(g, s, e_proj, caches, pos, rows)` for a compacted batch: s and
        e_proj [b, 1, d] hold the cache rows `rows` (an index) only (`block_rows`, with
        `reps` for a history shared in blocks; eager, compiled or not: its shapes change
        with every exit)."""
        u = F.linear(s, self.model.adapters[g].state.weight) + e_proj
        for (kc, vc), w in zip(kvs, self.group_blocks[g], strict=True):
            u = self.block_rows(u, kc, vc, pos, rows, w, reps)
        return u

    def group(self, g: int, s: Tensor, e_proj: Tensor, kvs: list[tuple[Tensor, Tensor]], pos: int,
              keep: Tensor | None = None) -> Tensor:
        """`model.apply_group(g, s, e_proj, caches, pos, keep)` for one token, with the cache
        tensors (k, v) of the group's layers."""
        step, n_ctx, masked = self._call(self._group, self._group1, s.shape[0], pos)
        return step(s, e_proj, self.model.adapters[g].state.weight, kvs, self.pos[pos], keep, self.group_blocks[g],
                    n_ctx, masked)

    def loop(self, g: int, s: Tensor, e_proj: Tensor, kvs: list[tuple[Tensor, Tensor]], pos: int,
             policy: ExitPolicy, coda: list[tuple[Tensor, Tensor]] | None = None,
             reuse: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
        """Group g's loop for one token at batch 1 under its one-group `policy`, compiled whole
        (`loop_token`; `coda`: the cache tensors of the layers after the group, for a rule that
        decodes through them; `reuse`: the last check's decode is the output): the final
        state [1, 1, d], the applications [1] and, with `reuse`, the output's logits [1, V].
        For the compiled step only (`fuse_loops`)."""
        key = (policy.tau, policy.min_steps, policy.max_steps, policy.patience)
        limits = self._limits.get(key)
        if limits is None:
            tau = math.nan if policy.tau is None else policy.tau
            limits = self._limits[key] = torch.tensor([tau, *key[1:]], dtype=torch.float64, device=s.device)
        gate = None if policy.gate is None else tuple(t.to(device=s.device, dtype=s.dtype) for t in policy.gate)
        # the options a check reads besides τ and the gate: kl's direction, the head's input and reading
        which = (policy.name, policy.kl_direction, policy.halt_input, policy.halt_reading)
        rule = _RULES.get(which)  # one object per rule, in every process-wide graph's guards
        if rule is None:
            rule = _RULES[which] = ExitPolicy(policy.name, None, kl_direction=policy.kl_direction,
                                              halt_input=policy.halt_input, halt_reading=policy.halt_reading)
        # g is a constant of the graph: passed only where the body reads it (leaving the group
        # into the coda), so groups of one shape share one graph as they did before
        s, n, logits = self._loop(rule, s, e_proj, self.model.adapters[g].state.weight, kvs, self.pos[pos],
                                  self.group_blocks[g], limits, gate, None if coda is None else g, coda, reuse)
        return s, n.reshape(1), logits

    def span_starts(self, after: int = 0) -> list[int]:
        """The first position of each attention span that starts at or after `after`."""
        return [p for p in range(after, len(self.spans)) if p == 0 or self.spans[p] != self.spans[p - 1]]

    def _call(self, batched, single, batch: int, pos: int) -> tuple:
        """(the function, n_ctx, masked) of a call at position pos: eager, positions 0 .. pos;
        compiled at batch 1, the static copy over pos's span; compiled batches, the whole
        block, both masked past pos."""
        if not self.compiled:
            return batched, pos + 1, False
        if batch == 1:
            return single, self.spans[pos], True
        return batched, len(self.spans), True
