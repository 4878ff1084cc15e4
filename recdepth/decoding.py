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
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from recdepth.exits import ExitPolicy
from recdepth.model import KVCache, LoopedGPT, StepKVCache

SHARING = ("latest", "per_step")


def new_caches(model: LoopedGPT, batch: int, max_len: int, sharing: str = "latest",
               max_steps: int = 32) -> list[KVCache | StepKVCache]:
    """One K/V cache per layer. `sharing` decides what a looped layer keeps per position:
    "latest" (SPEC §4, default): one entry, overwritten by every application;
    "per_step": one entry per application (at most `max_steps`), read at the same depth
    of the loop (Huginn's per-step cache; with a fixed n it equals the parallel pass)."""
    if sharing not in SHARING:
        raise ValueError(f"eval.cache: expected one of {', '.join(SHARING)}, got {sharing!r}")
    cfg, p = model.cfg, next(model.parameters())
    looped = {layer for g in cfg.groups for layer in g}
    shape = (batch, cfg.n_head, max_len, cfg.n_embd // cfg.n_head, p.device, p.dtype)
    return [StepKVCache(*shape, max_steps=max_steps) if sharing == "per_step" and layer in looped
            else KVCache(*shape) for layer in range(cfg.n_layer)]


def loop_group(model: LoopedGPT, g: int, e: Tensor, policy: ExitPolicy, caches: list[KVCache],
               pos: int, generator: torch.Generator | None = None, compact: bool = True) -> tuple[Tensor, Tensor]:
    """Loop group g for the token at `pos` (e: [B, 1, d]) until every row's rule fires.
    Returns the final states [B, 1, d] and applications per row [B].

    With `compact`, once some rows have exited the layers run on the rows still looping
    only (their attention reads the full cache in place), so compute saved by early exits
    is wall-clock saved; without it, exited rows are computed and masked out. Either way a
    row's result is exactly its batch-1 result."""
    B = e.shape[0]
    e_proj = model.adapters[g].input(e)
    s = model.initial_state(e, generator)
    decode = model.decode_logits if policy.needs_decode else None
    monitor = policy.monitor(s[:, 0], decode)
    n = torch.zeros(B, dtype=torch.long, device=e.device)
    active = torch.ones(B, dtype=torch.bool, device=e.device)
    step_caches = [caches[layer] for layer in model.cfg.groups[g] if isinstance(caches[layer], StepKVCache)]
    j, n_active = 0, B
    while True:
        for c in step_caches:
            c.step = j
        if B == 1:  # the one row is active while looping
            s = s_new = model.apply_group(g, s, e_proj, caches, pos, None)
        elif compact and n_active < B:
            idx = active.nonzero()[:, 0]
            s = s_new = s.index_copy(0, idx, model.apply_group(g, s[idx], e_proj[idx], caches, pos, idx))
        else:
            s_new = model.apply_group(g, s, e_proj, caches, pos, active)
            s = torch.where(active[:, None, None], s_new, s)
        n += active
        fired = monitor.observe(s_new[:, 0])
        active = active & ~fired
        j += 1
        n_active = int(active.sum()) if B > 1 else 1
        if n_active == 0 or (B == 1 and bool(fired[0])):
            for c in step_caches:
                c.finish(pos, n)
            return s, n


@torch.no_grad()
def decode_step(model: LoopedGPT, tokens: Tensor, pos: int, caches: list[KVCache], policy: ExitPolicy,
                generator: torch.Generator | None = None, compact: bool = True) -> tuple[Tensor, Tensor]:
    """One decoding step for tokens [B] at position `pos`: logits [B, V_padded] for the
    next token and applications [B, G] per group."""
    x = model.embed(tokens[:, None], pos0=pos)
    apps = torch.zeros(tokens.shape[0], model.n_groups, dtype=torch.long, device=tokens.device)
    for kind, i in model.plan:
        if kind == "layer":
            x = model.h[i](x, caches[i], pos)
        else:
            x, apps[:, i] = loop_group(model, i, x, policy, caches, pos, generator, compact)
    return model.decode_logits(x)[:, 0], apps


@torch.no_grad()
def evaluate_exit(model: LoopedGPT, tokens: Tensor, policy: ExitPolicy, n_tokens: int,
                  warmup_tokens: int = 8, seed: int = 0, cache: str = "latest") -> dict:
    """Score `n_tokens` held-out next-token predictions at batch 1 under `policy`, with
    K/V `cache` sharing "latest" (SPEC §4) or "per_step" (see `new_caches`).

    `tokens` is a 1-D id tensor; it is cut into windows of block_size + 1 (a fresh cache
    per window, as in generation from a fresh context). Returns SPEC §4's quality, cost
    and latency as the `eval` block of metrics.json.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    T = model.cfg.block_size
    tokens = tokens.to(device=device, dtype=torch.long)
    n_tokens = min(n_tokens, tokens.numel() - 1)
    if n_tokens < 1:
        raise ValueError("eval.tokens: need at least 2 held-out tokens to score one prediction")
    gen = torch.Generator(device=device).manual_seed(seed)

    # Warm-up (untimed, unscored): first calls allocate and pick kernels.
    caches = new_caches(model, 1, T, cache, policy.max_steps)
    for pos in range(min(warmup_tokens, T, tokens.numel())):
        decode_step(model, tokens[pos : pos + 1], pos, caches, policy, gen)

    nll, seconds = 0.0, 0.0
    apps = torch.zeros(model.n_groups, dtype=torch.long)
    scored = 0
    while scored < n_tokens:
        window = tokens[scored : scored + T + 1]  # targets scored+1 .. scored+T
        caches = new_caches(model, 1, T, cache, policy.max_steps)
        n_win = min(window.numel() - 1, n_tokens - scored)
        for pos in range(n_win):
            t0 = time.perf_counter()
            logits, a = decode_step(model, window[pos : pos + 1], pos, caches, policy, gen)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - t0
            nll -= F.log_softmax(logits.float(), -1)[0, window[pos + 1]].item()
            apps += a[0].cpu()
        scored += n_win
    model.train(was_training)
    ce = nll / n_tokens
    return {
        "exit": policy.name,
        "tau": policy.tau,
        "min_steps": policy.min_steps,
        "max_steps": policy.max_steps,
        "ce": ce,
        "ppl": math.exp(ce),
        "ms_per_token": 1000 * seconds / n_tokens,
        "applications_per_token": (apps.double() / n_tokens).tolist(),
        "tokens": n_tokens,
        "cache": cache,
    }
