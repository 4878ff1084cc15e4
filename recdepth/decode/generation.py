"""Generation under an exit rule: greedy decoding token by token, and self-speculative
decoding that drafts with few loop applications and verifies with the full rule
(docs/spec.md §4d).

Greedy (`greedy`) is the engine of `recdepth.decode.engine` (SPEC §4) run on its own output:
each prompt token and then each generated token goes through `decode_step` with a KV cache,
every recurrence group looping under the exit rule, and the next token is the argmax of
the logits (the first index wins an exact tie). The initial state of the loop of group g
at position p of row b is drawn from `noise_seed(seed, sequences[b], p, g)`, so a row of a
batch gets exactly its batch-1 tokens. Each generated token carries a record
(`TokenRecord`): its position, its id, the applications per group spent computing it (the
loops at the position before it, whose logits chose it) and why each group stopped.

Self-speculative (`speculative`, one prompt): the same model drafts `lookahead` tokens
greedily with `draft_steps` applications per group (exit=fixed), then ONE chunk pass
(`chunk_step`) runs the last committed token and the drafts through the model under the
full rule: all positions of the chunk go through each layer application together, each
position looping under the rule and frozen once it exits. The longest prefix of drafts the
verifier's argmax agrees with is accepted, plus the verifier's own token after it (at the
first mismatch, or after the last draft). Every token it returns is a verified one.

Exactness: speculative decoding returns the tokens (and applications) of `greedy` with
`cache="per_step"` under the same rule, seed and sequence. With the per-application cache
(`kv_cache.StepKVCache`) position i at application j reads earlier positions at
application j, which a parallel pass over the chunk can compute; with "latest" sharing
token-by-token decoding reads position i−1 at its FINAL application, which a parallel pass
cannot know while i−1 is still looping, so `speculative` refuses cache="latest". Under an
adaptive rule a position that has exited has its later application slots filled with its
last entry at once (`ChunkStepKVCache.fill`, what `StepKVCache.finish` does after each
token when decoding token by token), so positions still looping read it there, as they
would token by token. What can still differ is floating-point rounding: a chunk's matmuls
and attention are not the single-token ones, and a difference in the last bits can flip a
threshold test or an argmax tie (measured: docs/results/speculative.md). A rule that decodes through
the coda (`exit.decode=coda`) reads, in a chunk, earlier chunk positions at their current
application where token by token it reads their final state: the two agree when those
positions have exited, and may differ otherwise (docs/spec.md §4d). The entries the draft wrote
at positions the verifier then rejects are never read (reads stop at the current position)
and are overwritten by the next round's draft and verify.

Core layer: torch and recdepth's core modules only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from recdepth.core.checks import check_int
from recdepth.decode.engine import REFERENCE, RowNoise, decode_step, noise_seed
from recdepth.decode.kv_cache import KVCache, StepKVCache, check_cache, new_caches
from recdepth.decode.settings import DecodeSettings
from recdepth.decode.state_decode import state_decoder
from recdepth.exits.policy import ExitPolicy, build
from recdepth.model.looped import LoopedGPT

PER_STEP = DecodeSettings(cache="per_step")  # speculative decoding's default: it needs the per-application cache

SOURCES = ("greedy", "draft", "verify")
"""Where a generated token comes from: ordinary decoding; a drafted token the verifier
accepted; the verifier's own token (after the prompt, at the first mismatch, or after the
last accepted draft)."""
EXIT_REASONS = ("rule", "max_steps", "fixed")
"""Why a group stopped looping at a position: `rule` = the adaptive rule fired before
max_steps; `max_steps` = it ran to the cap (whether or not the rule would also have fired
at that very application); `fixed` = exit=fixed/none, whose depth is the budget itself."""
STOPS = ("max_new_tokens", "block_size")


@dataclass
class TokenRecord:
    """One generated token: `index` among the generated tokens, `position` in the sequence
    (prompt + generated), model id `token`, applications per group spent computing it (the
    loops at `position` − 1, whose logits chose it), the exit reason per group, its source."""

    index: int
    position: int
    token: int
    apps: list[int]
    reasons: list[str]
    source: str

    @property
    def total(self) -> int:
        return int(sum(self.apps))


@dataclass
class Generation:
    """The result of one prompt: prompt and generated ids (model ids), one record per
    generated token, why it stopped, wall seconds, the applications at each prompt
    position but the last ([P − 1][G]: predicting prompt tokens 1..P−1), and for
    speculative decoding its statistics (`stats`). `first_token_seconds`: the part of
    `seconds` until the first generated token is known (the prompt's pass and that token's:
    token by token for greedy, one chunk pass for speculative); `decode_seconds`, the rest,
    is the time of the other len(ids) − 1 tokens, which both methods start from the same
    state (prompt in the cache, first token chosen)."""

    prompt: list[int]
    ids: list[int]
    records: list[TokenRecord]
    stopped: str
    seconds: float
    cache: str
    prompt_apps: list[list[int]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    first_token_seconds: float | None = None

    @property
    def decode_seconds(self) -> float | None:
        """Wall seconds after the first generated token (`seconds` − `first_token_seconds`)."""
        return None if self.first_token_seconds is None else self.seconds - self.first_token_seconds

    @property
    def applications(self) -> int:
        """Applications spent on the generated tokens, summed over tokens and groups."""
        return sum(r.total for r in self.records)


# ------------------------------------------------------------------ checks
def budget(prompt_len: int, max_new_tokens: int, block_size: int) -> tuple[int, str]:
    """How many tokens can be generated, and what stops generation. Each generated token is
    predicted from a position < block_size, so prompt + generated holds at most
    block_size + 1 tokens (the last one is never fed back)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    if prompt_len < 1:
        raise ValueError("prompt: empty (generation needs at least one prompt token)")
    if prompt_len > block_size:
        raise ValueError(f"prompt: {prompt_len} tokens, more than the model's block_size={block_size} "
                         "(its learned positions end there)")
    room = block_size + 1 - prompt_len
    return (max_new_tokens, "max_new_tokens") if max_new_tokens <= room else (room, "block_size")


def check_speculative(cache: str, draft_steps: int, lookahead: int, copy_forward: bool = False) -> None:
    """The settings of `speculative`, one line naming the field each."""
    check_cache(cache)
    if copy_forward:
        raise ValueError("eval.copy_forward: not with speculative decoding (its verify pass runs a chunk of positions "
                         "side by side, so a stopped position cannot write forward before the next one reads it)")
    if cache != "per_step":
        raise ValueError(f"eval.cache: speculative decoding needs eval.cache=per_step, got {cache!r} (with latest sharing a "
                         "token reads the previous one at its final application, which a parallel verify pass "
                         "cannot know; docs/spec.md §4d)")
    for name, v in (("draft_steps", draft_steps), ("lookahead", lookahead)):
        check_int(f"speculative.{name}", v, 1)


def exit_reasons(apps: Tensor | list[int], policy: ExitPolicy) -> list[str]:
    """`EXIT_REASONS` of one position from its applications per group."""
    out = []
    for g, n in enumerate(apps.tolist() if isinstance(apps, Tensor) else apps):
        p = policy.group(g)
        out.append("fixed" if p.name == "fixed" else "max_steps" if n >= p.max_steps else "rule")
    return out


def _prompt_tensor(prompt_ids, model: LoopedGPT) -> Tensor:
    """Prompt ids as a LongTensor [B, P] on the model's device, checked against the vocabulary."""
    device = next(model.parameters()).device
    t = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2:
        raise ValueError(f"prompt_ids: expected a list of ids or a [batch, length] array, got shape {tuple(t.shape)}")
    if t.shape[1] == 0:
        raise ValueError("prompt: empty (generation needs at least one prompt token)")
    V = model.cfg.vocab_size
    bad = (t < 0) | (t >= V)
    if bad.any():
        raise ValueError(f"prompt_ids: id {int(t[bad][0])} is outside the model's vocabulary 0..{V - 1}")
    return t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _next_token(logits: Tensor) -> Tensor:
    """Greedy choice: the argmax over the logits (padded entries are −inf)."""
    return logits.argmax(-1)


# ------------------------------------------------------------------ greedy
@torch.no_grad()
def greedy(model: LoopedGPT, prompt_ids, policy: ExitPolicy, max_new_tokens: int,
           settings: DecodeSettings = REFERENCE, sequences: list[int] | None = None,
           on_token: Callable[[int, TokenRecord], None] | None = None) -> Generation | list[Generation]:
    """Greedy generation token by token under `policy` with the decoding engine (SPEC §4):
    `decode_step` over the prompt, then over each generated token, decoded as `settings`
    says (its cache sharing "latest" or "per_step", seed, step, warm start). `prompt_ids`: one prompt (a list of model ids; returns a
    Generation) or a [B, P] batch of prompts of one length (returns one per row; row b's
    noise is sequence `sequences[b]`, default b, and its result is exactly its batch-1
    result with that sequence). `on_token(row, record)` is called as each token comes.
    `settings.warm_start` (continuous compute, spec §4): each group's loop starts from the
    state it ended with at the previous position (the first position from noise)."""
    cache = settings.cache
    policy.check_model(model.n_groups, model.cfg.n_embd)
    single = torch.as_tensor(prompt_ids).dim() == 1
    prompt = _prompt_tensor(prompt_ids, model)
    B, P = prompt.shape
    n_new, stopped = budget(P, max_new_tokens, model.cfg.block_size)
    sequences = list(range(B)) if sequences is None else [int(q) for q in sequences]
    if len(sequences) != B:
        raise ValueError(f"sequences: {len(sequences)} noise sequences for {B} prompts")
    was_training = model.training
    model.eval()
    device = prompt.device
    caches = new_caches(model, B, model.cfg.block_size, cache, policy.max_steps_bound)
    noise = RowNoise(settings.seed, sequences)
    warm = [None] * model.n_groups if settings.warm_start else None
    _sync(device)
    t0 = time.perf_counter()
    prompt_apps = []
    for pos in range(P - 1):
        _, a = decode_step(model, prompt[:, pos], pos, caches, policy, settings, noise=noise, warm=warm)
        prompt_apps.append(a.cpu())
    tok = prompt[:, P - 1]
    ids: list[list[int]] = [[] for _ in range(B)]
    recs: list[list[TokenRecord]] = [[] for _ in range(B)]
    for i in range(n_new):
        pos = P - 1 + i
        logits, a = decode_step(model, tok, pos, caches, policy, settings, noise=noise, warm=warm)
        tok = _next_token(logits)
        toks, a = tok.tolist(), a.cpu()
        for b in range(B):
            r = TokenRecord(i, pos + 1, toks[b], a[b].tolist(), exit_reasons(a[b], policy), "greedy")
            ids[b].append(r.token)
            recs[b].append(r)
            if on_token is not None:
                on_token(b, r)
        if i == 0:  # tok.tolist() waited for the device
            t_first = time.perf_counter() - t0
    _sync(device)
    seconds = time.perf_counter() - t0
    model.train(was_training)
    pa = torch.stack(prompt_apps, 1) if prompt_apps else torch.zeros(B, 0, model.n_groups, dtype=torch.long)
    out = [Generation(prompt[b].tolist(), ids[b], recs[b], stopped, seconds, cache, pa[b].tolist(),
                      first_token_seconds=t_first) for b in range(B)]
    return out[0] if single else out


# ------------------------------------------------------------ chunk pass
class ChunkKVCache(KVCache):
    """A `KVCache` that also takes a chunk: T > 1 new positions written at once
    (`CausalSelfAttention`'s chunk path). One token at a time it is a KVCache."""

    def write(self, pos: int, k: Tensor, v: Tensor, rows: Tensor | None) -> None:
        T = k.shape[2]
        if T == 1:
            return super().write(pos, k, v, rows)
        if rows is not None:
            raise ValueError("chunk pass: one row only")
        self.k[:, :, pos : pos + T], self.v[:, :, pos : pos + T] = k, v


class ChunkStepKVCache(StepKVCache):
    """A `StepKVCache` (per-application slots) that also takes a chunk. In a chunk, only
    the positions still looping (`active`, a bool mask over the chunk, set by the chunk
    loop) write slot `step`; a position that exits has its later slots filled with its last
    entry right away (`fill`), so the positions still looping read it there at every later
    application, as token-by-token decoding reads it after `finish`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.active: Tensor | None = None

    def write(self, pos: int, k: Tensor, v: Tensor, rows: Tensor | None) -> None:
        T = k.shape[2]
        if T == 1:  # one token (decode_step, or a chunk loop down to its one looping position)
            return super().write(pos, k, v, rows)
        if rows is not None:
            raise ValueError("chunk pass: one row only")
        ks, vs = self.k[:, :, self.step, pos : pos + T], self.v[:, :, self.step, pos : pos + T]  # views
        if self.active is None:
            ks[:], vs[:] = k, v
        else:
            ks[:, :, self.active], vs[:, :, self.active] = k[:, :, self.active], v[:, :, self.active]

    def fill(self, pos: int, n: Tensor, done: Tensor) -> None:
        """Chunk positions i with done[i] stopped after n[i] applications: slots n[i].. of
        position pos + i get slot n[i] − 1 (`StepKVCache.finish`, position by position)."""
        for i in done.nonzero()[:, 0].tolist():
            p, m = pos + i, int(n[i])
            self.k[:, :, m:, p] = self.k[:, :, m - 1 : m, p]
            self.v[:, :, m:, p] = self.v[:, :, m - 1 : m, p]


def new_chunk_caches(model: LoopedGPT, max_len: int, max_steps: int) -> list[KVCache]:
    """Per-step caches of one row (looped layers: `ChunkStepKVCache` with `max_steps`
    slots; the others `ChunkKVCache`) that serve both `decode_step` and `chunk_step`."""
    cfg, p = model.cfg, next(model.parameters())
    looped = {layer for g in cfg.groups for layer in g}
    shape = (1, cfg.n_head, max_len, cfg.n_embd // cfg.n_head, p.device, p.dtype)
    return [ChunkStepKVCache(*shape, max_steps=max_steps) if layer in looped else ChunkKVCache(*shape)
            for layer in range(cfg.n_layer)]


def _chunk_group(model: LoopedGPT, g: int, e: Tensor, policy: ExitPolicy, caches: list[KVCache], pos: int,
                 noise: RowNoise, work: list[int], steps: list[int]) -> tuple[Tensor, Tensor]:
    """Loop group g over a chunk (e: [1, T, d] at positions pos..pos+T−1), each position
    under the rule with its own noise key and its own exit; returns the final states
    [1, T, d] and applications [T]. Each application runs the positions from the first
    to the last still looping (exited ones inside that range are computed, masked out and
    write nothing); work[g] gets the positions computed, steps[g] the applications run."""
    policy = policy.group(g)
    T = e.shape[1]
    e_proj = model.adapters[g].input(e)
    seeds = [noise_seed(noise.seed, noise.sequences[0], pos + i, g) for i in range(T)]
    # Positions as rows, so each draws from its own key exactly as decode_step draws it.
    # (Seam for eval.warm_start: a start that depends on the previous position's final
    # state would have to wait for it, which a parallel chunk cannot; see docs/generate.md, self-speculative decoding.)
    s = model.initial_state(e[0][:, None], None, seeds)[:, 0][None]
    # A rule that decodes reads the head, or the coda over the chunk (exit.decode; the coda's
    # attention reads the cache before the chunk and the chunk's own states, writing nothing)
    monitor = policy.monitor(s[0], state_decoder(model, g, policy, caches, pos, chunk=True))
    n = torch.zeros(T, dtype=torch.long, device=e.device)
    active = torch.ones(T, dtype=torch.bool, device=e.device)
    step_caches = [caches[layer] for layer in model.cfg.groups[g]]
    if not all(isinstance(c, ChunkStepKVCache) for c in step_caches):
        raise ValueError("cache: the chunk pass needs per-step chunk caches (new_chunk_caches)")
    j, lo, hi = 0, 0, T
    while True:
        for c in step_caches:
            c.step, c.active = j, active[lo:hi]
        s_new = s.clone()
        s_new[:, lo:hi] = model.apply_group(g, s[:, lo:hi], e_proj[:, lo:hi], caches, pos + lo)
        work[g] += hi - lo
        s = torch.where(active[None, :, None], s_new, s)
        n += active
        fired = monitor.observe(s[0])  # = s_new at the positions still looping; exited ones at their final state
        done = active & fired
        active = active & ~fired
        for c in step_caches:
            c.fill(pos, n, done)
        j += 1
        live = active.nonzero()[:, 0]
        if live.numel() == 0:
            break
        lo, hi = int(live[0]), int(live[-1]) + 1
    for c in step_caches:
        c.active = None
    steps[g] += j
    return s, n


@torch.no_grad()
def chunk_step(model: LoopedGPT, tokens: Tensor, pos: int, caches: list[KVCache], policy: ExitPolicy,
               noise: RowNoise, work: list[int] | None = None, steps: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """The chunk pass: tokens [T] of one row at positions pos..pos+T−1 through the model in
    one pass, every group looping under `policy` per position (exited positions frozen),
    with per-step chunk caches (`new_chunk_caches`) holding positions 0..pos−1. Returns
    logits [T, V_padded] and applications [T, G]: what `decode_step` returns position by
    position with cache="per_step", up to floating-point rounding. `work[g]` and `steps[g]`,
    if given, are increased by the positions computed in group g (summed over its
    applications) and by the applications it ran (those of its slowest position)."""
    tokens = tokens.reshape(-1)
    T = tokens.numel()
    work = [0] * model.n_groups if work is None else work
    steps = [0] * model.n_groups if steps is None else steps
    x = model.embed(tokens[None], pos0=pos)
    apps = torch.zeros(T, model.n_groups, dtype=torch.long, device=tokens.device)
    for kind, i in model.plan:
        if kind == "layer":
            x = model.h[i](x, caches[i], pos)
        else:
            x, apps[:, i] = _chunk_group(model, i, x, policy, caches, pos, noise, work, steps)
            x = model.leave_group(i, x)  # as decode_step: ln_f on the state leaving the loop (latent_norm)
    return model.decode_logits(x)[0], apps


def accepted(drafts: list[int], verified: list[int]) -> int:
    """How many drafts are accepted: the longest prefix where the verifier's token (the
    argmax at the position before) equals the draft. `verified` has one more entry than
    `drafts` (the verifier's token after the last draft)."""
    if len(verified) != len(drafts) + 1:
        raise ValueError(f"accepted: {len(drafts)} drafts need {len(drafts) + 1} verified tokens, got {len(verified)}")
    k = 0
    while k < len(drafts) and drafts[k] == verified[k]:
        k += 1
    return k


# ---------------------------------------------------------- speculative
@torch.no_grad()
def speculative(model: LoopedGPT, prompt_ids, policy: ExitPolicy, max_new_tokens: int, draft_steps: int,
                lookahead: int, settings: DecodeSettings = PER_STEP, sequence: int = 0,
                on_token: Callable[[int, TokenRecord], None] | None = None) -> Generation:
    """Self-speculative greedy generation of one prompt (module docstring; docs/spec.md §4d).

    The prompt goes through one chunk pass under `policy`, which gives the first token.
    Then each round drafts L = min(lookahead, tokens still wanted − 1, room left in the
    block) tokens with `decode_step` under exit=fixed at `draft_steps`, verifies the last
    committed token and the L drafts in one `chunk_step` under `policy`, and commits the
    accepted drafts plus the verifier's token after them (1 to L + 1 tokens per round).
    `settings`: its cache must be per_step (the default here), its seed keys the noise.
    The result equals `greedy` with cache="per_step" and the same seed and sequence (up
    to floating-point rounding). `stats`: rounds (verify passes after the prompt's),
    drafted, accepted, acceptance_rate (accepted / drafted), tokens_per_pass (tokens
    committed per verify pass), draft_applications, verify_applications (per position,
    rejected ones included), verify_work (positions computed, summed over applications:
    exited positions inside the looping range count too), verify_steps (the applications
    the passes ran one after another: per pass and group, its slowest position's), the
    same three for the prompt's pass, and the seconds of the prompt pass, drafts and
    verify passes."""
    cache, seed = settings.cache, settings.seed
    check_speculative(cache, draft_steps, lookahead, settings.copy_forward)
    policy.check_model(model.n_groups, model.cfg.n_embd)
    prompt = _prompt_tensor(prompt_ids, model)
    if prompt.shape[0] != 1:
        raise ValueError(f"prompt_ids: speculative decoding runs one prompt at a time, got {prompt.shape[0]}")
    prompt = prompt[0]
    P, T = prompt.numel(), model.cfg.block_size
    n_new, stopped = budget(P, max_new_tokens, T)
    was_training = model.training
    model.eval()
    device = prompt.device
    caches = new_chunk_caches(model, T, max(policy.max_steps_bound, draft_steps))
    noise = RowNoise(seed, [sequence])
    draft = build("fixed", None, max_steps=draft_steps)
    G = model.n_groups
    work_prefill, work, steps_prefill, steps = [0] * G, [0] * G, [0] * G, [0] * G
    ids: list[int] = []
    recs: list[TokenRecord] = []
    seq = prompt.tolist()

    def commit(tokens: list[int], apps: Tensor, sources: list[str]) -> None:
        for t, a, src in zip(tokens, apps.tolist(), sources):
            r = TokenRecord(len(ids), len(seq), t, a, exit_reasons(a, policy), src)
            ids.append(t)
            seq.append(t)
            recs.append(r)
            if on_token is not None:
                on_token(0, r)

    _sync(device)
    t0 = time.perf_counter()
    logits, pa = chunk_step(model, prompt, 0, caches, policy, noise, work_prefill, steps_prefill)
    first = int(_next_token(logits[-1]))
    pa = pa.cpu()
    _sync(device)
    t_prefill = time.perf_counter() - t0
    commit([first], pa[-1:], ["verify"])
    t_first = time.perf_counter() - t0  # as greedy's: after the first token's record
    rounds = drafted = n_accepted = draft_apps = verify_apps = 0
    t_draft = t_verify = 0.0
    while len(ids) < n_new:
        P_ = len(seq)  # seq[-1], at position P_ − 1, has not been through the model yet
        L = min(lookahead, n_new - len(ids) - 1, T - P_)
        t1 = time.perf_counter()
        drafts, tok = [], torch.tensor([seq[-1]], device=device)
        for i in range(L):
            lg, da = decode_step(model, tok, P_ - 1 + i, caches, draft, settings, noise=noise)
            tok = _next_token(lg)
            drafts.append(int(tok))
            draft_apps += int(da.sum())
        _sync(device)
        t2 = time.perf_counter()
        chunk = torch.tensor([seq[-1], *drafts], device=device)
        lg, va = chunk_step(model, chunk, P_ - 1, caches, policy, noise, work, steps)
        verified = _next_token(lg).tolist()
        _sync(device)
        t3 = time.perf_counter()
        t_draft, t_verify = t_draft + t2 - t1, t_verify + t3 - t2
        k = accepted(drafts, verified)
        rounds, drafted, n_accepted = rounds + 1, drafted + L, n_accepted + k
        verify_apps += int(va.sum())
        commit(drafts[:k] + [verified[k]], va[: k + 1].cpu(), ["draft"] * k + ["verify"])
    seconds = time.perf_counter() - t0
    model.train(was_training)
    stats = {
        "draft_steps": draft_steps, "lookahead": lookahead, "rounds": rounds, "drafted": drafted,
        "accepted": n_accepted, "acceptance_rate": n_accepted / drafted if drafted else None,
        "tokens_per_pass": (len(ids) - 1) / rounds if rounds else None,
        "draft_applications": draft_apps, "verify_applications": verify_apps,
        "verify_work": sum(work), "verify_steps": sum(steps), "prefill_applications": int(pa.sum()),
        "prefill_work": sum(work_prefill), "prefill_steps": sum(steps_prefill),
        "prefill_seconds": t_prefill, "draft_seconds": t_draft, "verify_seconds": t_verify,
    }
    return Generation(prompt.tolist(), ids, recs, stopped, seconds, cache, pa[:-1].tolist(), stats,
                      first_token_seconds=t_first)
