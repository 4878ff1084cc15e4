"""Token-by-token decoding with a KV cache under an exit rule (SPEC §4, the reference).

Held-out text is fed left to right as in generation. For the current token every
recurrence group loops under the exit rule, row by row; the token's next-token
log-probability is scored (teacher forcing). Looped layers keep one K/V entry per
position ("latest" sharing): each application overwrites the current position's entry,
so later tokens read an earlier position at its last computed application. Each row
reads only its own cache rows, and a row that has exited is never written again, so a
row's result in a batch is exactly its result alone.

Quality = cross-entropy / perplexity over the scored tokens; cost = mean applications per
token per group; latency = wall-clock ms per token at batch 1 after a warm-up, exit
checks included.

Noise: with `state_init=normal` the initial state of row b's loop for the token at
position p in group g is drawn from a generator seeded by `noise_seed(seed, sequence_b, p,
g)` alone (SPEC §4, noise and batches), so a window's result does not depend on the
other windows decoded beside it: batch B reproduces batch 1.

Continuous compute (`warm_start`, SPEC §4, recdepth's continuous compute): row b's loop
for the token at position p > 0 in group g starts from the state group g's loop ended
with for row b at position p − 1 (the group's output there) instead of the initial state;
position 0 of a window starts as above. The carried states are per row, so batch B still
reproduces batch 1.

The scoring built on this engine (evaluate_exit(s), latency, the oracle) is
recdepth/decode/scoring.py.

Over 600 lines: the group loop's ways to run (compiled whole, reference with rows compacted
or masked, shared history for the oracle) and their cache bookkeeping (per-application
slots, copy forward) must change together; splitting them apart would spread one loop's
invariants over files.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from recdepth.decode.kv_cache import KVCache, StepKVCache, new_caches
from recdepth.decode.lean_step import LeanSteps
from recdepth.decode.mixed import MixedPolicy
from recdepth.decode.settings import DecodeSettings
from recdepth.decode.state_decode import CodaDecoder, check_is_output, decode_mode, state_decoder
from recdepth.exits.policy import ExitPolicy, build
from recdepth.model.looped import LoopedGPT

REFERENCE = DecodeSettings()  # the engine's defaults: Block.forward, one window a batch

def noise_seed(seed: int, sequence: int, position: int, group: int) -> int:
    """The seed of one row's initial-state noise (SPEC §4, noise and batches): a hash of
    (seed, sequence, position, group) alone, never of the batch a row is decoded in."""
    h = hashlib.blake2b(struct.pack("<4q", seed, sequence, position, group), digest_size=8)
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


class RowNoise:
    """Per-row noise keys of a decoding batch: row b is sequence `sequences[b]`."""

    def __init__(self, seed: int, sequences: Sequence[int]):
        self.seed, self.sequences = int(seed), [int(q) for q in sequences]

    def seeds(self, position: int, group: int, rows: Tensor | None = None) -> list[int]:
        seqs = self.sequences if rows is None else [self.sequences[i] for i in rows.tolist()]
        return [noise_seed(self.seed, q, position, group) for q in seqs]


def lean_steps(model: LoopedGPT, backend: str) -> LeanSteps | None:
    """The one-token step that `backend` names (`DecodeSettings.backend`) for `model`: None for
    "module" (`Block.forward`, the reference); "lean" = `recdepth.decode.lean_step`'s
    static-shape step, eager; "compiled" = the same under torch.compile (graphs built on
    first use). Built once per model and backend and kept with the model (`_lean_steps`, a
    cache: which one runs is always the settings' choice)."""
    if backend == "module":
        return None
    built = model.__dict__.setdefault("_lean_steps", {})
    if backend not in built:
        if backend not in ("lean", "compiled"):
            DecodeSettings(backend=backend)  # the one-line error naming eval.backend
        built[backend] = LeanSteps(model, compile=backend == "compiled")
    return built[backend]


def lean_of(lean: LeanSteps | None, caches: list) -> LeanSteps | None:
    """`lean` if it computes a one-token call on these layer caches: one entry per position
    (`KVCache`), or, eagerly, one per application (`StepKVCache`, its current application's
    slot: `cache_views`); else None (the caller runs `Block.forward`: the coda's
    `PeekCache`, generation's chunk caches, a `StepKVCache` under the compiled step, whose
    batch-1 loops take the compiled loop instead, `fuses_loop`)."""
    if lean is None:
        return None
    for c in caches:
        if not (type(c) is KVCache or (type(c) is StepKVCache and not lean.compiled)):
            return None
    return lean


def cache_views(c: KVCache) -> tuple[Tensor, Tensor]:
    """The (k, v) [B, H, T, head_dim] a lean step reads and writes in place: a `KVCache`'s
    tensors, or the slot of a `StepKVCache`'s current application (views: a write lands in
    the cache)."""
    if type(c) is StepKVCache:
        return c.k[:, :, c.step], c.v[:, :, c.step]
    return c.k, c.v


def apply_group(model: LoopedGPT, g: int, s: Tensor, e_proj: Tensor, caches: list[KVCache], pos: int,
                rows: Tensor | None, reps: int | None = None, lean: LeanSteps | None = None) -> Tensor:
    """One application of group g for one token, `model.apply_group` or the `lean` step
    (`lean_steps`, where `lean_of` says it applies; rows None, a bool mask over the batch, or an index of the rows s holds: a
    compacted batch; with an index, `reps`: the rows' history is shared in blocks of that
    many, `LeanSteps.block_rows`)."""
    mine = [caches[layer] for layer in model.cfg.groups[g]]
    lean = lean_of(lean, mine)
    if lean is None:
        return model.apply_group(g, s, e_proj, caches, pos, rows)
    if rows is not None and rows.dtype != torch.bool:
        return lean.group_rows(g, s, e_proj, [cache_views(c) for c in mine], pos, rows, reps)
    return lean.group(g, s, e_proj, [cache_views(c) for c in mine], pos, rows)


def _forced(fired: Tensor, n: Tensor, fixed_rows: Tensor | None, fixed_steps: int | None,
            limit: Tensor | None) -> Tensor:
    """`fired` with the rows the rule does not decide: `fixed_rows` stop exactly at
    `fixed_steps` applications, and every row at its `limit` (n: applications so far)."""
    if fixed_rows is not None:
        fired = torch.where(fixed_rows, n >= fixed_steps, fired)
    if limit is not None:
        fired = fired | (n >= limit)
    return fired


def _writes_forward(settings: DecodeSettings, policy: ExitPolicy | MixedPolicy, by_rule: Tensor, n: Tensor,
                    limit: Tensor | None) -> Tensor:
    """[B] bool: the rows that write forward (`eval.copy_forward`, docs/spec.md §4): those the
    exit rule stopped (`by_rule`) after n applications below their max_steps (and `limit`),
    none without copy_forward. A row stopped by max_steps, a per-row limit or a forced count
    writes nothing: nobody reads deeper than the deepest application."""
    if not settings.copy_forward:
        return torch.zeros_like(by_rule)
    if isinstance(policy, MixedPolicy):
        top = torch.tensor([p.max_steps for p in policy.policies], device=n.device)[policy.setting.to(n.device)]
    else:
        top = torch.full_like(n, policy.max_steps)
    out = by_rule & (n < top)
    return out if limit is None else out & (n < limit)


def _write_forward(model: LoopedGPT, g: int, s: Tensor, e_proj: Tensor, caches: list[KVCache], pos: int,
                   n: Tensor, lean: LeanSteps | None) -> Tensor:
    """A batch-1 row the rule stopped after n applications writes forward (`eval.copy_forward`):
    one more application of group g from its final state s, kept only in the group's caches at
    application n + 1 (the K/V its next application reads from x^(n)), its output dropped.
    Returns n + 1, the applications it cost."""
    for layer in model.cfg.groups[g]:
        if isinstance(caches[layer], StepKVCache):
            caches[layer].step = int(n[0])
    apply_group(model, g, s, e_proj, caches, pos, None, lean=lean)
    return n + 1


def loop_group(model: LoopedGPT, g: int, e: Tensor, policy: ExitPolicy, caches: list[KVCache],
               pos: int, settings: DecodeSettings = REFERENCE, *, generator: torch.Generator | None = None,
               noise: RowNoise | None = None, limit: Tensor | None = None,
               init: Tensor | None = None, fixed_rows: Tensor | None = None,
               reps: int | None = None, out: dict | None = None) -> tuple[Tensor, Tensor]:
    """Loop group g for the token at `pos` (e: [B, 1, d]) until every row's rule fires.
    Returns the final states [B, 1, d] and applications per row [B].

    Two ways to run it, each a named function: the compiled loop as one graph where
    `fuses_loop` says so, else the reference loop `_loop_steps` (its rows compacted or
    masked as `settings.compact` says, `_apply_rows`). `settings`: its `step`
    (`lean_steps`), `compact` and `context_steps` are read here.

    `noise` keys each row's initial state (otherwise all rows draw from `generator`);
    `limit` [B], if given, stops row b after limit[b] applications at the latest (a per-row
    max_steps). `init` [B, 1, d], if given, is row b's starting state instead of
    `model.initial_state` (no noise is drawn; the warm start of continuous compute).
    `fixed_rows` [B] (bool): those rows ignore the rule and loop exactly
    `settings.context_steps` applications (a task's context positions under
    `eval.context_steps`, docs/spec.md §6), and run no check: the rule's monitor watches
    the other rows only; a batch of 1 whose row is forced loops as exit=fixed at
    context_steps (`forced`), on the compiled loop where it applies. A per-group `policy`
    loops group g under its group-g values (`policy.group(g)`). A rule that decodes the
    state decodes it as `exit.decode` says (`state_decoder`: the head, or through the coda
    without writing its cache). `reps`: the rows' history is shared in blocks of that many
    (the oracle's, `decode_step`'s `shared`); the lean step then reads it once per block
    (`lean_step.attend_shared`), on the compacted rows from the first application.

    `out` (a dict, batch 1): where the check that fired decoded the token's own output
    (`state_decode.check_is_output`), `out["logits"]` receives its logits [1, V] and the
    coda's K/V at `pos` are written as the coda's own pass would write them, so the caller
    runs neither the coda nor the head again (`decode_step`)."""
    policy = policy.with_head(model).group(g)  # exit=halt: the model's halting head (attached once by the jobs)
    B = e.shape[0]
    e_proj = model.adapters[g].input(e)
    if init is None:
        s = model.initial_state(e, generator, None if noise is None else noise.seeds(pos, g))
    elif init.shape != e.shape:
        raise ValueError(f"loop_group: initial state of shape {tuple(init.shape)} for input {tuple(e.shape)}")
    else:
        s = init
    if fixed_rows is not None and settings.context_steps is None:
        raise ValueError("loop_group: fixed_rows need settings.context_steps (the applications they loop)")
    if B == 1 and fixed_rows is not None:  # one row: forced (exit=fixed at context_steps) or the rule's
        policy = forced(settings.context_steps) if bool(fixed_rows[0]) else policy
        fixed_rows = None
    mine = [caches[layer] for layer in model.cfg.groups[g]]
    fast = lean_steps(model, settings.backend)
    reuse = out is not None and B == 1 and check_is_output(model, g, policy)
    if fuses_loop(model, g, fast, policy, B, limit, caches):
        coda = [(caches[layer].k, caches[layer].v) for layer in model.coda] \
            if policy.needs_decode and decode_mode(model, policy) == "coda" else None
        s, n, logits = fast.loop(g, s, e_proj, [(c.k, c.v) for c in mine], pos, policy, coda, reuse)
        if settings.copy_forward and int(n[0]) < policy.max_steps:  # the rule stopped it: write forward
            n = _write_forward(model, g, s, e_proj, caches, pos, n, lean_of(fast, mine))
        for c in mine:
            if type(c) is StepKVCache:  # slots above n take the last application's entry
                c.finish(pos, n)
        if reuse:
            out["logits"] = logits
        return s, n
    lean = lean_of(fast, mine)
    return _loop_steps(model, g, s, e_proj, policy, caches, pos, settings, lean, limit, fixed_rows,
                       reps if lean is not None and settings.compact else None, out if reuse else None)


@functools.cache
def forced(steps: int) -> ExitPolicy:
    """exit=fixed at `steps`: the policy a forced row loops under (a task's context at
    eval.context_steps), which runs no check."""
    return build("fixed", None, max_steps=steps)


def fuses_loop(model: LoopedGPT, g: int, lean: LeanSteps | None, policy: ExitPolicy, B: int,
               limit: Tensor | None, caches: list[KVCache]) -> bool:
    """Whether `loop_group` runs group g's whole loop as one compiled graph (`LeanSteps.loop`,
    a `torch.while_loop` whose body is the application and the rule's check, a decoding
    check through the head or the coda): the compiled step at batch 1 under one rule (an
    `ExitPolicy`; a forced row's is exit=fixed) with no row limit, the group's caches one
    entry per position or one per application (`KVCache`, `StepKVCache`), and the coda's
    caches, if it decodes through them, one entry per position. Everything else runs
    `_loop_steps`."""
    if not (B == 1 and lean is not None and lean.fuse_loops and limit is None and isinstance(policy, ExitPolicy)):
        return False
    if any(type(caches[layer]) not in (KVCache, StepKVCache) for layer in model.cfg.groups[g]):
        return False
    if policy.needs_decode and decode_mode(model, policy) == "coda":
        return all(type(caches[layer]) is KVCache for layer in model.coda)
    return True


def _loop_steps(model: LoopedGPT, g: int, s: Tensor, e_proj: Tensor, policy: ExitPolicy, caches: list[KVCache],
                pos: int, settings: DecodeSettings, lean: LeanSteps | None, limit: Tensor | None,
                fixed_rows: Tensor | None, reps: int | None, out: dict | None = None) -> tuple[Tensor, Tensor]:
    """The reference loop of `loop_group`: one application at a time from Python, the rule
    checked after each (`policy.monitor`), until every row has fired. Per application the
    rows run one of three ways (`_apply_rows`): the one row of a batch of 1; with
    `settings.compact`, once a row has exited (or the oracle's shared history, `reps`), the
    rows still looping only; else every row, the exited ones masked. Per-application caches
    (`StepKVCache`) are told the application and, at the end, each row's count. Rows in
    `fixed_rows` are not watched by the monitor (no check runs for them: it watches, and a
    decoding rule decodes, the other rows only). `out`: `loop_group`'s (batch 1)."""
    B, fixed_steps = s.shape[0], settings.context_steps
    checked = None if fixed_rows is None else (~fixed_rows).nonzero()[:, 0]  # the rows the rule decides
    if checked is not None and len(checked) == B:
        checked = None
    idle = checked is not None and not len(checked)  # every row forced: nothing to check
    watch = policy if checked is None else _rows_policy(policy, checked)
    decode = None if idle else state_decoder(model, g, watch, caches, pos, rows=checked)  # head, or the coda
    monitor = None if idle else watch.monitor(s[:, 0] if checked is None else s[checked, 0], decode)
    n = torch.zeros(B, dtype=torch.long, device=s.device)
    active = torch.ones(B, dtype=torch.bool, device=s.device)
    step_caches = [caches[layer] for layer in model.cfg.groups[g] if isinstance(caches[layer], StepKVCache)]
    j, n_active = 0, B
    writing = None  # rows the rule stopped at the last application, writing forward in this one (copy_forward)
    while True:
        for c in step_caches:
            c.step = j
        if writing is None:
            s, s_new = _apply_rows(model, g, s, e_proj, caches, pos, active, n_active, settings.compact, reps, lean)
        else:  # their application only writes the cache: their state stays the one the rule stopped
            kept = s
            s, s_new = _apply_rows(model, g, s, e_proj, caches, pos, active | writing,
                                   n_active + int(writing.sum()), settings.compact, reps, lean)
            s = torch.where(writing[:, None, None], kept, s)
            n += writing
            writing = None
        j += 1
        if B > 1 and n_active == 0:  # only writing rows ran this application
            for c in step_caches:
                c.finish(pos, n)
            return s, n
        if B == 1:  # the one row has run j applications: no row bookkeeping per application
            fired = by_rule = monitor.observe(s_new[:, 0])
            if limit is not None:
                n.fill_(j)
                fired = _forced(fired, n, None, fixed_steps, limit)
            if bool(fired[0]):
                n.fill_(j)
                if settings.copy_forward and bool(_writes_forward(settings, policy, by_rule, n, limit)[0]):
                    n = _write_forward(model, g, s, e_proj, caches, pos, n, lean)
                for c in step_caches:
                    c.finish(pos, n)
                if out is not None and getattr(monitor, "logits", None) is not None:  # this check is the output
                    out["logits"] = monitor.logits
                    if isinstance(decode, CodaDecoder):
                        decode.commit()
                return s, n
            continue
        n += active
        fired = torch.zeros(B, dtype=torch.bool, device=s.device)
        if checked is None:
            fired = monitor.observe(s_new[:, 0], active)
        elif not idle and bool(active[checked].any()):
            fired[checked] = monitor.observe(s_new[checked, 0], active[checked])
        by_rule = fired & active if settings.copy_forward else None  # before the limits join it
        fired = _forced(fired, n, fixed_rows, fixed_steps, limit)
        active = active & ~fired
        n_active = int(active.sum())
        if settings.copy_forward:
            forward = _writes_forward(settings, policy, by_rule, n, limit)
            if bool(forward.any()):
                writing = forward
                continue
        if n_active == 0:
            for c in step_caches:
                c.finish(pos, n)
            return s, n


def _rows_policy(policy: ExitPolicy | MixedPolicy, rows: Tensor) -> ExitPolicy | MixedPolicy:
    """`policy` for the rows `rows` of a batch (an index): a `MixedPolicy` keeps those rows'
    settings, one rule is every row's."""
    return MixedPolicy(policy.policies, policy.setting[rows]) if isinstance(policy, MixedPolicy) else policy


def _apply_rows(model: LoopedGPT, g: int, s: Tensor, e_proj: Tensor, caches: list[KVCache], pos: int,
                active: Tensor, n_active: int, compact: bool, reps: int | None,
                lean: LeanSteps | None) -> tuple[Tensor, Tensor]:
    """One application of group g to the rows still looping: (the states after it, exited
    rows kept; what the monitor observes). A batch of 1 (its row loops while the loop runs);
    compacted, the looping rows only, gathered by index (a row's attention reads the full
    cache in place, so compute saved by early exits is wall-clock saved); masked, every row
    computed and the exited ones kept. Each way a row's result is exactly its batch-1 result."""
    B = s.shape[0]
    if B == 1:
        s = apply_group(model, g, s, e_proj, caches, pos, None, lean=lean)
        return s, s
    if compact and (n_active < B or reps is not None):
        idx = active.nonzero()[:, 0]
        s = s.index_copy(0, idx, apply_group(model, g, s[idx], e_proj[idx], caches, pos, idx, reps, lean))
        return s, s
    s_new = apply_group(model, g, s, e_proj, caches, pos, active, lean=lean)
    return torch.where(active[:, None, None], s_new, s), s_new


def loop_shared(model: LoopedGPT, g: int, e: Tensor, caches: list[KVCache], pos: int, reps: int,
                limit: Tensor, noise: RowNoise, init: Tensor | None = None,
                settings: DecodeSettings = REFERENCE) -> tuple[Tensor, Tensor]:
    """`loop_group` under exit=fixed with a per-row `limit`, for rows that come in blocks of
    `reps` holding the same input e [R, 1, d], history, noise key and warm state `init`,
    each block's last row with the block's largest limit: the oracle's N rows of a window
    (`decode_windows` with reps). Every row of a block runs the same trajectory until its
    limit, so only each block's last row is computed (R / reps rows, on copies of its cache
    rows) and row r takes the state after limit[r] applications: 1/reps of the group's
    applications, the same states. Only the computed rows' cache entries at `pos` are
    written; the other rows of a block get them from `_sync_rows` after the position, as
    every row gets its block's history (`decode_windows`).
    Returns the states [R, 1, d] and the applications (limit) [R]."""
    R = e.shape[0]
    last = torch.arange(reps - 1, R, reps, device=e.device)
    steps = int(limit.max())
    if not bool((limit[last] == steps).all()):
        raise ValueError("loop_shared: each block's last row must run the most applications (the oracle's row N)")
    mine = model.cfg.groups[g]
    sub = list(caches)
    for layer in mine:  # the computed rows' entries, as caches of their own (attention over W rows, not R)
        sub[layer] = caches[layer].take(last)
    e = e[last]
    e_proj = model.adapters[g].input(e)
    s = model.initial_state(e, None, noise.seeds(pos, g, last)) if init is None else init[last]
    step_caches = [sub[layer] for layer in mine if isinstance(sub[layer], StepKVCache)]
    trajectory, lean = [], lean_steps(model, settings.backend)
    for j in range(steps):
        for c in step_caches:
            c.step = j
        s = apply_group(model, g, s, e_proj, sub, pos, None, lean=lean)
        trajectory.append(s)
    for c in step_caches:
        c.finish(pos, torch.full((len(last),), steps, device=e.device))
    for layer in mine:
        caches[layer].k[last, ..., pos, :] = sub[layer].k[..., pos, :]
        caches[layer].v[last, ..., pos, :] = sub[layer].v[..., pos, :]
    states = torch.stack(trajectory)[limit - 1, torch.arange(R, device=e.device) // reps]  # [R, 1, d]
    return states, limit.clone()


@torch.no_grad()
def decode_step(model: LoopedGPT, tokens: Tensor, pos: int, caches: list[KVCache], policy: ExitPolicy,
                settings: DecodeSettings = REFERENCE, *, generator: torch.Generator | None = None,
                noise: RowNoise | None = None, limit: Tensor | None = None,
                warm: list[Tensor | None] | None = None,
                states: list[Tensor | None] | None = None, fixed_rows: Tensor | None = None,
                shared: int | None = None) -> tuple[Tensor, Tensor]:
    """One decoding step for tokens [B] at position `pos`: logits [B, V_padded] for the
    next token and applications [B, G] per group (`settings`, `noise`, `limit`,
    `fixed_rows`: see `loop_group`). `shared` (the oracle's rows, `decode_windows`): the
    rows come in blocks of that many with the same history and a fixed-rule `limit`, so the
    first group, whose input is the same in every row of a block, loops once per block
    (`loop_shared`), and the lean step reads the later groups' shared history once per block
    (`loop_group`'s `reps`).
    `states`, if given (one entry per group), receives each group's final loop state
    [B, 1, d] (before `leave_group`: what the exit monitor saw last; the gate's features).
    At batch 1, where a decoding rule's check that fired computed the token's output
    (`state_decode.check_is_output`: through the coda, or the head after the last group),
    its logits are returned and the coda and head are not run again (`loop_group`'s `out`).

    `warm` (continuous compute): one entry per group, read and replaced in place. Group g
    starts from warm[g] [B, 1, d] when it is not None (else from its initial state), and
    warm[g] becomes the state its loop ended with, for the next position of the same rows.
    Start a window with `[None] * model.n_groups`."""
    if warm is not None and len(warm) != model.n_groups:
        raise ValueError(f"decode_step: {len(warm)} warm states for {model.n_groups} recurrence groups")
    x = model.embed(tokens[:, None], pos0=pos)
    apps = torch.zeros(tokens.shape[0], model.n_groups, dtype=torch.long, device=tokens.device)
    first = _first_group(model) if shared else None
    fast = lean_steps(model, settings.backend)
    out = {} if tokens.shape[0] == 1 else None  # batch 1: a check that decoded the output is the output
    for kind, i in model.plan:
        if kind == "layer":
            lean = lean_of(fast, [caches[i]])
            x = model.h[i](x, caches[i], pos) if lean is None else lean.layer(i, x, caches[i].k, caches[i].v, pos,
                                                                               reps=shared)
        else:
            init = None if warm is None else warm[i]
            if shared and i == first:  # the first group's input is the same in every row of a block
                x, apps[:, i] = loop_shared(model, i, x, caches, pos, shared, limit, noise, init, settings)
            else:
                x, apps[:, i] = loop_group(model, i, x, policy, caches, pos, settings, generator=generator,
                                           noise=noise, limit=limit, init=init, fixed_rows=fixed_rows, reps=shared,
                                           out=out)
            if states is not None:
                states[i] = x
            x = model.leave_group(i, x)
            if warm is not None:  # the state leaving the group (after a latent norm: Huginn's latent_states)
                warm[i] = x
            if out:  # the check that fired decoded what follows (the coda, its caches written, and the head)
                return out["logits"], apps
    return model.decode_logits(x)[:, 0], apps


def windows(n_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """The held-out stream cut into windows of block_size + 1 tokens with stride block_size
    (a fresh cache per window, as in generation from a fresh context): (start, scored)
    pairs, window w scoring the targets start+1 .. start+scored."""
    return [(w, min(block_size, n_tokens - w)) for w in range(0, n_tokens, block_size)]


def span(block_size: int, bos: int | None = None) -> int:
    """Targets a window scores at most, and the stride of `windows`: block_size, or with a
    `bos` id block_size − 1 (the window's first input is then BOS, at position 0, and its
    tokens follow at positions 1 .. block_size − 1; docs/spec.md §4)."""
    return block_size - (bos is not None)


def _sync_rows(caches: list[KVCache], pos: int, src: Tensor) -> None:
    """Row b's cache entries at `pos` become row src[b]'s (every application slot). Only
    the position's entries are gathered (indexing the rows first would copy every row's
    whole cache, a large part of the oracle's time, measured)."""
    for c in caches:
        c.k[..., pos, :] = c.k[..., pos, :].index_select(0, src)
        c.v[..., pos, :] = c.v[..., pos, :].index_select(0, src)


def decode_windows(model: LoopedGPT, tokens: Tensor, wins: list[tuple[int, int]], policy: ExitPolicy,
                    settings: DecodeSettings = REFERENCE, *, reps: int = 1, limit: Tensor | None = None,
                    timed: bool = False, first_window: int = 0,
                    trace: list[Tensor] | None = None, labels: np.ndarray | None = None,
                    keys: Sequence[int] | None = None,
                    targets: Tensor | np.ndarray | None = None) -> tuple[Tensor, Tensor, list[float], Tensor]:
    """Decode windows side by side, `reps` rows per window (row r is window r // reps), as
    `settings` says (its cache, seed, warm_start, bos, context_steps, step, share_first).
    Returns nll [R, L], applications [R, L, G], with `timed` the seconds of each
    position, and whether the argmax prediction is the target [R, L] (a task's accuracy). With reps > 1 the rows of a window share their history: after each position
    every row takes the cache entries of the window's last row (the oracle's max_steps),
    and with `warm_start` that row's final group states too (`decode_step`'s `warm`); under
    exit=fixed with a `limit` whose largest value is each window's last row's (the oracle),
    the first group loops once per window and each row takes its state after its limit
    (`loop_shared`; `settings.share_first=False` loops every row, the reference it is tested against).
    With `bos`, each window's first input is that id (position 0, its loops run under the
    rule) and the window's tokens follow at positions 1 ..; BOS's own prediction is neither
    scored nor timed, so nll, applications and seconds are those of the window's tokens.
    `trace`, if given, receives per scored position the groups' final loop states [R, G, d].
    `context_steps` with a task's `labels` (aligned with `tokens`): a position whose target
    is not an answer (and BOS) loops exactly that many applications, the rule deciding at
    answer positions only (`eval.context_steps`, docs/spec.md §6). `keys`: each window's noise
    key (SPEC §4's "sequence"), in place of first_window + its offset // span: windows of
    separate texts laid side by side in one stream, each keyed as it would be alone.
    `targets` (a task's scored stream, aligned with `tokens`: in-place targets, docs/tasks.md):
    the prediction at stream position p is scored (nll, correct) against targets[p + 1]
    instead of tokens[p + 1]; the inputs stay `tokens`."""
    device, T = tokens.device, model.cfg.block_size
    cache, seed, bos, context_steps = settings.cache, settings.seed, settings.bos, settings.context_steps
    lead = int(bos is not None)
    L = max(n for _, n in wins)
    if L + lead > T:
        raise ValueError(f"decode_windows: windows of {L} scored tokens{' after BOS' if lead else ''} exceed "
                         f"model.block_size={T}")
    R = len(wins) * reps
    idx = torch.zeros(R, lead + L + 1, dtype=torch.long, device=device)
    for w, (start, n) in enumerate(wins):
        idx[w * reps : (w + 1) * reps, lead : lead + n + 1] = tokens[start : start + n + 1]
    if lead:
        idx[:, 0] = bos
    tgt = idx  # what position p's prediction is scored against: tgt[:, p + 1]
    if targets is not None:
        targets, tgt = torch.as_tensor(targets).to(device=device, dtype=torch.long), idx.clone()
        for w, (start, n) in enumerate(wins):
            tgt[w * reps : (w + 1) * reps, lead : lead + n + 1] = targets[start : start + n + 1]
    if keys is None:
        keys = [first_window + start // span(T, bos) for start, _ in wins]
    elif len(keys) != len(wins):
        raise ValueError(f"decode_windows: {len(keys)} noise keys for {len(wins)} windows")
    noise = RowNoise(seed, [int(keys[r // reps]) for r in range(R)])
    context = None if context_steps is None else context_rows(wins, labels, reps, lead, L).to(device)
    caches = new_caches(model, R, T, cache, max(policy.max_steps_bound, context_steps or 0))
    src = torch.arange(R, device=device) // reps * reps + reps - 1
    warm = [None] * model.n_groups if settings.warm_start else None
    shared = reps if settings.share_first and _shares_first(model, policy, reps, limit, context) else None
    nll = torch.empty(R, L, dtype=torch.float64)
    apps = torch.empty(R, L, model.n_groups, dtype=torch.long)
    correct = torch.empty(R, L, dtype=torch.bool)
    seconds = []
    for pos in range(lead + L):
        t0 = time.perf_counter()
        states = None if trace is None else [None] * model.n_groups
        logits, a = decode_step(model, idx[:, pos], pos, caches, policy, settings, noise=noise, limit=limit, warm=warm,
                                states=states, fixed_rows=None if context is None else context[:, pos],
                                shared=shared)
        if timed and device.type == "cuda":
            torch.cuda.synchronize()
        if pos >= lead:  # BOS's step: decoded, not timed or scored
            seconds.append(time.perf_counter() - t0)
        if reps > 1:
            _sync_rows(caches, pos, src)
            if warm is not None:
                warm[:] = [w[src] for w in warm]
        if pos >= lead:
            nll[:, pos - lead] = model.nll(logits, tgt[:, pos + 1]).double().cpu()
            correct[:, pos - lead] = (logits.argmax(-1) == tgt[:, pos + 1]).cpu()
            apps[:, pos - lead] = a.cpu()
            if trace is not None:
                trace.append(torch.cat(states, 1).float().cpu())
    return nll, apps, seconds, correct


def _first_group(model: LoopedGPT) -> int:
    """The recurrence group the model runs first (its input is the layers before it)."""
    return next(i for kind, i in model.plan if kind == "group")


def _shares_first(model: LoopedGPT, policy: ExitPolicy, reps: int, limit: Tensor | None,
                  context: Tensor | None) -> bool:
    """Whether `decode_windows`' rows may loop the first group once per window
    (`loop_shared`): reps > 1 rows per window under exit=fixed with a per-row `limit` that
    the rule never cuts short, each window's last row looping the most, no fixed context."""
    if reps == 1 or limit is None or policy.name != "fixed" or context is not None or model.n_groups == 0:
        return False
    top = int(limit.max())
    return policy.group(_first_group(model)).max_steps >= top and bool((limit.view(-1, reps)[:, -1] == top).all())


def context_rows(wins: list[tuple[int, int]], labels: np.ndarray | None, reps: int, lead: int, L: int) -> Tensor:
    """[R, lead + L] bool: True where decode_windows' row r at input position p predicts a
    target that is not an answer (BOS and the positions past a short window included): the
    positions `eval.context_steps` loops at fixed depth."""
    if labels is None:
        raise ValueError("eval.context_steps: runs a task's context at fixed depth and the rule on its answers, "
                         "but this data has no answer labels (data=task has them; else context_steps=null)")
    labels = np.asarray(labels)
    ctx = torch.ones(len(wins) * reps, lead + L, dtype=torch.bool)
    for w, (start, n) in enumerate(wins):
        ctx[w * reps : (w + 1) * reps, lead : lead + n] = torch.from_numpy(labels[start + 1 : start + n + 1] == 0)
    return ctx


def records(wins: list[tuple[int, int]], nll: Tensor, apps: Tensor, tokens: Tensor, block_size: int,
             first_window: int = 0, bos: int | None = None, correct: Tensor | None = None,
             targets: Tensor | np.ndarray | None = None) -> dict:
    """One row per scored token, in stream order: window (its noise key: first_window + the
    window's index in the stream), position (of the input token in the held-out stream),
    target (model id), nll, applications per group [N, G], correct (argmax = target; with
    `correct`). With `bos` the windows are
    `span(block_size, bos)` tokens apart; positions and targets are the stream's either way.
    `targets` (a scored stream, as `decode_windows`'): the targets are its, not the tokens'."""
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0)  # noqa: E731
    scored = tokens if targets is None else torch.as_tensor(targets)
    stride = span(block_size, bos)
    rec = {} if correct is None else {"correct": cat([correct[w, :n].numpy() for w, (_, n) in enumerate(wins)])
                                      .astype(bool)}
    return rec | {
        "window": cat([np.full(n, first_window + start // stride) for start, n in wins]).astype(np.int64),
        "position": cat([np.arange(start, start + n) for start, n in wins]).astype(np.int64),
        "target": cat([scored[start + 1 : start + n + 1].cpu().numpy() for start, n in wins]).astype(np.int64),
        "nll": cat([nll[w, :n].numpy() for w, (_, n) in enumerate(wins)]),
        "apps": np.concatenate([apps[w, :n].numpy() for w, (_, n) in enumerate(wins)]),
    }


def merge_records(parts: list[dict]) -> dict:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def prepare_windows(model: LoopedGPT, tokens: Tensor, n_tokens: int,
             bos: int | None = None) -> tuple[Tensor, int, list[tuple[int, int]]]:
    device = next(model.parameters()).device
    tokens = tokens.to(device=device, dtype=torch.long)
    n_tokens = min(n_tokens, tokens.numel() - 1)
    if n_tokens < 1:
        raise ValueError("eval.tokens: need at least 2 held-out tokens to score one prediction")
    if bos is not None and not 0 <= bos < model.cfg.vocab_size:
        raise ValueError(f"bos: id {bos} is outside the model's vocabulary 0..{model.cfg.vocab_size - 1}")
    if bos is not None and model.cfg.block_size < 2:
        raise ValueError("bos: a window needs block_size >= 2 to hold BOS and one token")
    return tokens, n_tokens, windows(n_tokens, span(model.cfg.block_size, bos))


def warm_up(model: LoopedGPT, tokens: Tensor, policy: ExitPolicy, settings: DecodeSettings = REFERENCE) -> None:
    """Untimed, unscored decode steps at batch 1 (`settings.warmup_tokens` of them): first
    calls allocate and pick kernels. Under the compiled step also one step at the first
    position of each later attention span (`LeanSteps.spans`), with warmup_tokens = 0 too,
    so that no graph is compiled inside a timed pass (it compiles every span of the block,
    reached or not), and with `context_steps` the loop of a forced context row (`forced`)."""
    n = min(settings.warmup_tokens, model.cfg.block_size, tokens.numel())
    lean = lean_steps(model, settings.backend)
    spans = lean.span_starts(n) if lean is not None and lean.compiled and tokens.numel() else []
    if n or spans:
        caches = new_caches(model, 1, model.cfg.block_size, settings.cache,
                            max(policy.max_steps_bound, settings.context_steps or 0))
        noise = RowNoise(settings.seed, [-1])
        warm = [None] * model.n_groups if settings.warm_start else None
        for pos in range(n):
            decode_step(model, tokens[pos : pos + 1], pos, caches, policy, settings, noise=noise, warm=warm)
        for pos in spans:  # even with warmup_tokens = 0: a compile is never timed
            decode_step(model, tokens[:1], pos, caches, policy, settings, noise=noise, warm=warm)
        if spans and settings.context_steps is not None:  # a task's context loops as exit=fixed (`forced`)
            decode_step(model, tokens[:1], 0, caches, forced(settings.context_steps), settings, noise=noise,
                        warm=None if warm is None else [None] * model.n_groups)
