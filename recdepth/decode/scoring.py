"""Scoring held-out text under exit rules with the decoding engine (SPEC §4, §4b).

`evaluate_exit` scores held-out windows `batch_size` at a time (quality, cost, a per-token
record), then times the first `latency_tokens` tokens again at batch 1, `repeats` times
(latency). `evaluate_exits` / `decode_settings` decode several settings side by side, one
row per (setting, window) (a sweep as one batch, each setting's records exactly its own).
`score_task` keeps a task's answers. `evaluate_oracle` computes the oracle bound of SPEC
§4b. The engine itself (caches, the group loop, `decode_step`, `decode_windows`) is
recdepth/decode/engine.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

import recdepth.data.tasks as tasks
from recdepth.analysis import stats
from recdepth.core.progress import Progress
from recdepth.core.runtime import has_cpp_compiler
from recdepth.decode.engine import (
    REFERENCE,
    decode_windows,
    merge_records,
    noise_seed,
    prepare_windows,
    records,
    span,
    warm_up,
)
from recdepth.decode.mixed import MixedPolicy
from recdepth.decode.parallel import check_regime, parallel_exit
from recdepth.decode.settings import AUTO, DecodeSettings
from recdepth.decode.state_decode import check_is_output, check_price, has_coda
from recdepth.exits.policy import ORACLE, ExitPolicy, build
from recdepth.model.looped import LoopedGPT

# auto compiles the latency passes of at least this many settings in one process (a sweep's
# shared pass): where its compiles pay for themselves (docs/results/sweep-time.md)
AUTO_COMPILE_SETTINGS = 8


def latency_backend_for(model: LoopedGPT, settings: DecodeSettings, timed: int) -> str:
    """The backend the batch-1 latency passes of `timed` settings timed in this process take
    (`settings.latency_backend`; None: as the quality pass, `settings.backend`). `auto`:
    "compiled" where it was measured to pay (docs/results/sweep-time.md): at least
    `AUTO_COMPILE_SETTINGS` settings, on a CPU, with a C++ compiler for torch.compile; else
    `settings.backend`. A GPU keeps its quality pass's backend (the compiled loop is unmeasured
    there). The quality pass and the timed ones are equal up to float rounding; `add_latency`'s
    `batch_check` counts what differs."""
    backend = settings.latency_backend
    if backend == AUTO:
        on_cpu = next(model.parameters()).device.type == "cpu"
        backend = "compiled" if timed >= AUTO_COMPILE_SETTINGS and on_cpu and has_cpp_compiler() else None
    return settings.backend if backend is None else backend


def _plain(v):
    """A per-group value (a tuple) as a JSON list; one value as it is."""
    return list(v) if isinstance(v, tuple) else v


def model_cost(model: LoopedGPT, policy: ExitPolicy | None = None) -> stats.Cost:
    """The cost per token of `model` looping under `policy` (docs/spec.md §4b): layer
    applications plus the checks the rule runs, each at its `state_decode.check_price`,
    none at a group's max_steps, and the firing check not billed again where it is the
    token's output (`state_decode.check_is_output`). Without a policy (or for the oracle,
    priced as its loop alone: a bound no rule can run), the loop's layer applications."""
    groups, n_layer = model.cfg.groups, model.cfg.n_layer
    if policy is None or policy.name == ORACLE:
        return stats.Cost.of_model(groups, n_layer)
    one = [policy.group(g) for g in range(model.n_groups)]
    return stats.Cost.of_model(groups, n_layer, checks=[check_price(model, g, p)["total"] for g, p in enumerate(one)],
                               limits=[p.max_steps for p in one],
                               reuse=[check_is_output(model, g, p) for g, p in enumerate(one)])


def checked_tokens(rec: dict, labels: np.ndarray | None, settings: DecodeSettings) -> np.ndarray | None:
    """[tokens] bool: the record's tokens whose loops the rule decided (None: all of them);
    under `eval.context_steps` a task's context positions (the target is not an answer)
    loop at fixed depth and run no check (`engine.context_rows`)."""
    if settings.context_steps is None or labels is None:
        return None
    return np.asarray(labels)[rec["position"] + 1] > 0


def token_costs(model: LoopedGPT, policy: ExitPolicy, rec: dict, labels: np.ndarray | None,
                settings: DecodeSettings) -> None:
    """Each token's cost into the record (in place): `cost`, layer equivalents with the
    checks (`model_cost(model, policy).per_token`), `loop_cost`, the loop alone, and
    `checks` [tokens, G], the checks billed."""
    cost, checked = model_cost(model, policy), checked_tokens(rec, labels, settings)
    rec["checks"] = cost.billed_checks(rec["apps"], checked)
    rec["loop_cost"] = cost.loop(rec["apps"])
    rec["cost"] = cost.per_token(rec["apps"], checked)


def _summary(model: LoopedGPT, policy: ExitPolicy, rec: dict, settings: DecodeSettings,
             resamples: int = 1000) -> dict:
    """The eval block of metrics.json. ce_ci: 95% bootstrap over windows (the unit the
    tokens' difficulty is shared in, spec §4b). Cost (docs/spec.md §4b): applications per
    group and their mean; `layer_applications`, the cost every comparison uses: layer
    applications plus the checks billed, in layer equivalents (the record's `cost`,
    `token_costs`); `loop_layer_applications`, the loop alone (the unit before checks were
    priced); `checks_per_token` per group and each check's price (`check_cost`:
    `state_decode.check_price`); FLOPs per token (`LoopedGPT.flops_per_token` at the mean
    applications and the mean attended context of the scored positions, plus the checks'
    FLOPs, a decode's coda layers with their attention)."""
    nll, apps = rec["nll"], rec["apps"]
    ce, lo, hi = stats.mean_ci(nll, stats.Bootstrap(rec["window"], resamples))
    per_group = apps.mean(axis=0).tolist()
    cost = model_cost(model, policy)
    if "cost" not in rec:
        token_costs(model, policy, rec, None, settings)
    # attended positions of each scored token: its place in its window + 1 (+ 1 for a BOS input)
    context = float(np.mean(rec["context"] if "context" in rec else attended(rec, settings.bos))) if len(nll) else 1.0
    prices = [check_price(model, g, policy.group(g) if policy.name != ORACLE else policy) for g in range(model.n_groups)]
    billed = rec["checks"].mean(axis=0) if len(nll) else np.zeros(model.n_groups)
    attention = model.layer_flops(context) - model.layer_flops()  # a decode's coda layers attend too
    check_flops = sum(float(b) * (p["flops"] + p["layers"] * attention) for b, p in zip(billed, prices, strict=True))
    return {
        "exit": policy.name, "tau": _plain(policy.tau), "min_steps": _plain(policy.min_steps),
        "max_steps": _plain(policy.max_steps), "patience": policy.patience,
        "ce": float(ce), "ce_ci": [float(lo), float(hi)], "ce_ci_unit": "window", "ppl": math.exp(ce),
        "applications_per_token": per_group,
        "mean_applications": float(np.mean(per_group)) if per_group else 0.0,  # model=baseline: no groups
        "layer_applications": float(np.mean(rec["cost"])) if len(nll) else 0.0,
        "loop_layer_applications": float(np.mean(rec["loop_cost"])) if len(nll) else 0.0,
        "checks_per_token": [float(b) for b in billed],
        "check_cost": [{k: v for k, v in p.items() if k != "flops"} for p in prices],
        "group_layers": [len(g) for g in model.cfg.groups], "outside_layers": int(cost.outside),
        "flops_per_token": float(model.flops_per_token(per_group, context, None, train=False)) + check_flops,
        "tokens": len(nll), "windows": int(len(np.unique(rec["window"]))), "cache": settings.cache,
        "warm_start": settings.warm_start, "batch_size": settings.batch_size, "backend": settings.backend,
    }


@torch.no_grad()
def evaluate_exit(model: LoopedGPT, tokens: Tensor, policy: ExitPolicy, n_tokens: int,
                  settings: DecodeSettings = REFERENCE, first_window: int = 0,
                  labels: np.ndarray | None = None, targets: np.ndarray | Tensor | None = None) -> tuple[dict, dict]:
    """Score `n_tokens` held-out next-token predictions under `policy` (SPEC §4), decoded as
    `settings` says (K/V cache sharing, warm start, step, BOS, context steps: see
    `DecodeSettings` and `engine.decode_windows`). Returns the `eval` block of
    metrics.json and the per-token record (`engine.records`, plus `ms`).

    `tokens` is a 1-D id tensor, cut into `windows`. Quality and cost: `settings.batch_size`
    windows decoded side by side (each row exactly its batch-1 result; throughput
    `tokens_per_s` at that batch). Latency: the first `latency_tokens` tokens (all by
    default) decoded again at batch 1 after `warmup_tokens` untimed steps, `repeats` times:
    `ms_per_token` is the median over repeats of the mean ms per token, with the min and
    max; each timed token's record carries its median ms. `first_window` is the noise key
    (SPEC §4's "sequence") of the stream's first window, the next ones following it: a
    split that starts elsewhere in the held-out text (calibration after test) passes its
    own, so its windows never draw the noise of another split's windows. The batch-1 pass is also checked
    against the batched one: `batch_check` counts timed tokens whose applications differ
    (a criterion within rounding of τ) and the largest NLL difference. Every pass (warm-up,
    batched, batch 1) decodes with the same settings, the timed ones with
    `latency_backend_for`'s step (recorded as `latency_backend`).
    `labels` (a task's, aligned with `tokens`) and `settings.answers`: see `score_task`.
    `targets` (a task's scored stream, aligned with `tokens`; in-place targets): every pass
    scores against it instead of the next token (`engine.decode_windows`).
    """
    policy.check_model(model.n_groups, model.cfg.n_embd)
    check_regime(model, settings.regime, n_tokens, oracle=policy.name == ORACLE)
    if settings.regime == "parallel" and policy.name != ORACLE:  # the oracle: the sequential regime's bound
        return evaluate_parallel(model, tokens, policy, n_tokens, settings, first_window, labels, targets)
    if policy.name == ORACLE:
        if settings.context_steps is not None and settings.context_steps != policy.max_steps_bound:
            raise ValueError(f"eval.context_steps: exit=oracle reads every position's history at exit.max_steps="
                             f"{policy.max_steps_bound}; set context_steps to that or null, got "
                             f"{settings.context_steps}")
        ev, rec = evaluate_oracle(model, tokens, policy, n_tokens, settings, first_window, targets)
        return score_task(model, policy, ev, rec, labels, settings)
    was_training = model.training
    model.eval()
    T = model.cfg.block_size
    tokens, n_tokens, wins = prepare_windows(model, tokens, n_tokens, settings.bos)
    warm_up(model, tokens, policy, settings)

    parts, t0 = [], time.perf_counter()
    with Progress(f"decoding under {policy.name}", len(wins)) as progress:
        for b in range(0, len(wins), settings.batch_size):
            ws = wins[b : b + settings.batch_size]
            nll, apps, _, ok = decode_windows(model, tokens, ws, policy, settings, first_window=first_window,
                                              labels=labels, targets=targets)
            parts.append(records(ws, nll, apps, tokens, T, first_window, settings.bos, ok, targets))
            progress.update(len(ws))
    batch_seconds = time.perf_counter() - t0
    rec = merge_records(parts)
    rec["ms"] = np.full(n_tokens, np.nan)
    token_costs(model, policy, rec, labels, settings)
    ev = _summary(model, policy, rec, settings)
    ev["tokens_per_s"] = n_tokens / batch_seconds

    n_lat = n_tokens if settings.latency_tokens is None else min(settings.latency_tokens, n_tokens)
    timed = settings.replace(backend=latency_backend_for(model, settings, 1)) if n_lat > 0 else settings
    ev["latency_backend"] = timed.backend
    if n_lat > 0 and timed.backend != settings.backend:  # its first calls (a compile) untimed too
        warm_up(model, tokens, policy, timed)
    timings = [time_tokens(model, tokens, policy, n_lat, timed, first_window, labels, targets)
               for _ in range(settings.repeats)] if n_lat > 0 else []
    add_latency(ev, rec, timings)
    model.train(was_training)
    return score_task(model, policy, ev, rec, labels, settings)


@torch.no_grad()
def decode_policies(model: LoopedGPT, tokens: Tensor, policies: Sequence[ExitPolicy], n_tokens: int,
                    settings: DecodeSettings = REFERENCE, first_window: int = 0,
                    labels: np.ndarray | None = None,
                    targets: np.ndarray | Tensor | None = None) -> tuple[list[dict], float]:
    """`evaluate_exit`'s batched pass for several exit policies at once (a sweep): every
    (policy, window) pair is a row, up to `settings.batch_size` rows a batch, each row
    looping under its own policy (`mixed.MixedPolicy`) and keyed by its window's
    noise, so each policy's records are those it gets decoded alone (exactly in float64;
    within rounding of the batched matmuls in float32, where a criterion within rounding of
    τ can flip a row's applications). Returns one record per policy (`engine.records`)
    and the seconds of the pass. `targets`: a scored stream, as `evaluate_exit`'s."""
    # `auto` decode and kl direction resolved as the engine reads them (records unchanged), so
    # the batch knows when the head decodes each row on its own (`MixedMonitor`)
    policies = [p.check_model(model.n_groups, model.cfg.n_embd).resolve(has_coda(model)) for p in policies]
    T, bos, max_rows = model.cfg.block_size, settings.bos, settings.batch_size
    tokens, n_tokens, wins = prepare_windows(model, tokens, n_tokens, bos)
    pairs = [(k, w) for k in range(len(policies)) for w in range(len(wins))]
    parts: list[list[dict]] = [[] for _ in policies]
    t0 = time.perf_counter()
    progress = Progress(f"decoding {len(policies)} settings side by side", len(pairs), unit="rows")
    for b in range(0, len(pairs), max_rows):
        progress.update(0)  # a bar from the first batch on
        chunk = pairs[b : b + max_rows]
        ws = [wins[w] for _, w in chunk]
        mixed = MixedPolicy(tuple(policies), torch.tensor([k for k, _ in chunk], device=tokens.device))
        nll, apps, _, ok = decode_windows(model, tokens, ws, mixed, settings, first_window=first_window,
                                          labels=labels, targets=targets)
        for k in sorted({k for k, _ in chunk}):
            rows = [i for i, (kk, _) in enumerate(chunk) if kk == k]
            parts[k].append(records([ws[i] for i in rows], nll[rows], apps[rows], tokens, T, first_window, bos,
                                     ok[rows], targets))
        progress.update(len(chunk))
    progress.close()
    return [merge_records(p) for p in parts], time.perf_counter() - t0


def decode_parallel(model: LoopedGPT, tokens: Tensor, wins: list[tuple[int, int]], policy: ExitPolicy,
                    settings: DecodeSettings, first_window: int = 0,
                    targets: np.ndarray | Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The windows `wins` (one length) in the parallel regime (`parallel.parallel_exit`), window
    w's noise keyed by `engine.noise_seed(seed, first_window + w's index, 0, 0)`: per-token NLL
    and correct [W, L], applications [W, L, 1], and the steps each window's pass ran [W]."""
    L = wins[0][1]
    if any(n != L for _, n in wins):
        raise ValueError("decode_parallel: windows of one length a batch")
    stream = tokens if targets is None else torch.as_tensor(targets, device=tokens.device)
    idx = torch.stack([tokens[a : a + L] for a, _ in wins])
    tgt = torch.stack([stream[a + 1 : a + L + 1] for a, _ in wins]).long()
    seeds = [noise_seed(settings.seed, first_window + a // span(model.cfg.block_size), 0, 0) for a, _ in wins]
    run = parallel_exit(model, idx, policy, settings.exit_level, settings.wake, row_seeds=seeds)
    nll = model.nll(run.logits, tgt).double().cpu()
    return nll, run.apps[..., None].cpu(), (run.logits.argmax(-1) == tgt).cpu(), run.steps.cpu()


@torch.no_grad()
def evaluate_parallel(model: LoopedGPT, tokens: Tensor, policy: ExitPolicy, n_tokens: int,
                      settings: DecodeSettings, first_window: int = 0, labels: np.ndarray | None = None,
                      targets: np.ndarray | Tensor | None = None) -> tuple[dict, dict]:
    """`evaluate_exit` in the parallel regime (`eval.regime=parallel`): the windows
    `settings.batch_size` at a time through `parallel.parallel_exit`, the records and the eval
    block as the sequential regime's, a token's applications and cost being its window's
    steps (the pass computes, and checks, every position at each of its steps: what it
    spends), plus `steps_per_window` (their mean over windows) and `own_applications` (a
    position's own, what its state took: overall, and on a task per answer and by
    difficulty; what a pass computing only the positions still looping would spend, which
    this one does not). Latency: each of the first windows holding
    `latency_tokens` tokens timed alone, `repeats` times; a token's ms is its window's pass
    over the window's tokens. `batch_check` compares those batch-1 passes with the batched one."""
    was_training = model.training
    model.eval()
    T = model.cfg.block_size
    tokens, n_tokens, wins = prepare_windows(model, tokens, n_tokens, settings.bos)
    groups = [[w for w in wins if w[1] == n] for n in dict.fromkeys(n for _, n in wins)]
    parts, steps, t0 = [], [], time.perf_counter()
    with Progress(f"decoding under {policy.name}, in parallel", len(wins)) as progress:
        for same in groups:
            for b in range(0, len(same), settings.batch_size):
                ws = same[b : b + settings.batch_size]
                nll, apps, ok, st = decode_parallel(model, tokens, ws, policy, settings, first_window, targets)
                part = records(ws, nll, apps, tokens, T, first_window, settings.bos, ok, targets)
                # what the pass spent on a position: every one of its steps (the position's own
                # applications, what its state took, are kept beside: own_apps)
                part["own_apps"] = part["apps"]
                part["apps"] = np.concatenate([np.full((n, 1), int(st[w])) for w, (_, n) in enumerate(ws)])
                parts.append(part)
                steps.append(st)
                progress.update(len(ws))
    batch_seconds = time.perf_counter() - t0
    rec = merge_records(parts)
    order = np.argsort(rec["position"], kind="stable")  # stream order (a short last window came last anyway)
    rec = {k: v[order] for k, v in rec.items()}
    rec["ms"] = np.full(n_tokens, np.nan)
    token_costs(model, policy, rec, labels, settings)
    ev = _summary(model, policy, rec, settings)
    ev.update(tokens_per_s=n_tokens / batch_seconds, regime="parallel", exit_level=settings.exit_level,
              wake=settings.wake, steps_per_window=float(torch.cat(steps).double().mean()))
    n_lat = n_tokens if settings.latency_tokens is None else min(settings.latency_tokens, n_tokens)
    timed_wins, covered = [], 0
    for w in wins:
        if covered >= n_lat:
            break
        timed_wins.append(w)
        covered += w[1]
    timings = []
    for _ in range(settings.repeats if n_lat > 0 else 0):
        secs, nll1, apps1 = [], [], []
        for w in timed_wins:
            t1 = time.perf_counter()
            nll, _, _, st = decode_parallel(model, tokens, [w], policy, settings, first_window, targets)
            ms = 1000 * (time.perf_counter() - t1) / w[1]
            secs += [ms] * w[1]
            nll1.append(nll[0].numpy())
            apps1.append(np.full((w[1], 1), int(st[0])))
        timings.append((np.asarray(secs)[:n_lat], np.concatenate(nll1)[:n_lat], np.concatenate(apps1)[:n_lat]))
    ev["latency_backend"] = "module"
    add_latency(ev, rec, timings)
    model.train(was_training)
    ev, rec = score_task(model, policy, ev, rec, labels, settings)
    own = rec["own_apps"][:, 0].astype(float)
    ev["own_applications"] = float(own.mean()) if len(own) else 0.0
    if "answers" in ev:
        lab = rec["label"]
        ev["answers"]["own_applications"] = float(own[lab > 0].mean())
        ev["answers"]["own_applications_by_difficulty"] = {str(int(d)): float(own[lab == d].mean())
                                                           for d in np.unique(lab[lab > 0])}
    return ev, rec


@torch.no_grad()
def evaluate_exits(model: LoopedGPT, tokens: Tensor, policies: Sequence[ExitPolicy], n_tokens: int,
                   settings: DecodeSettings = REFERENCE, first_window: int = 0,
                   labels: np.ndarray | None = None,
                   targets: np.ndarray | Tensor | None = None) -> list[tuple[dict, dict]]:
    """`evaluate_exit` of every policy in `policies`, the quality of all of them decoded as
    one batch (`decode_policies`, `settings.batch_size` rows a batch); latency stays a
    batch-1 measurement per policy, the policies timed round-robin within each of the
    `repeats` rounds so that drift of the machine spreads over all of them. The oracle (it
    reads the target) runs on its own. Returns (eval block, record) per policy, in order.
    An eval block's `batch_size` is the rows a batch, `tokens_per_s` the whole pass's
    tokens over its seconds and `shared_batch` the number of policies decoded side by
    side. The timed passes' step: `latency_backend_for` the policies timed here. `targets`: a
    scored stream, as `evaluate_exit`'s."""
    check_regime(model, settings.regime, n_tokens, oracle=any(p.name == ORACLE for p in policies))
    if settings.regime == "parallel":
        raise ValueError("eval.regime: parallel decodes one setting at a time (recdepth evaluate; make frontier "
                         "runs its jobs one by one there); settings side by side are sequential only")
    was_training = model.training
    model.eval()
    out: list[tuple[dict, dict] | None] = [None] * len(policies)
    loops = [k for k, p in enumerate(policies) if p.name != ORACLE]
    for k, p in enumerate(policies):
        if p.name == ORACLE:
            out[k] = evaluate_exit(model, tokens, p, n_tokens, settings.replace(latency_backend=None), first_window,
                                   labels, targets)
    model.eval()
    if loops:
        tokens_d, n_scored, _ = prepare_windows(model, tokens, n_tokens, settings.bos)
        for k in loops:
            warm_up(model, tokens_d, policies[k], settings)
        recs, seconds = decode_policies(model, tokens, [policies[k] for k in loops], n_tokens, settings,
                                        first_window, labels, targets)
        n_lat = n_scored if settings.latency_tokens is None else min(settings.latency_tokens, n_scored)
        timings: dict[int, list] = {k: [] for k in loops}
        timed = settings.replace(backend=latency_backend_for(model, settings, len(loops))) if n_lat > 0 else settings
        for k in loops if n_lat > 0 and timed.backend != settings.backend else ():  # its first calls untimed too
            warm_up(model, tokens_d, policies[k], timed)
        for _ in range(settings.repeats if n_lat > 0 else 0):
            for k in loops:
                timings[k].append(time_tokens(model, tokens_d, policies[k], n_lat, timed, first_window, labels,
                                              targets))
        for k, rec in zip(loops, recs, strict=True):
            rec["ms"] = np.full(n_scored, np.nan)
            token_costs(model, policies[k], rec, labels, settings)
            ev = _summary(model, policies[k], rec, settings)
            ev["tokens_per_s"] = n_scored * len(loops) / seconds
            ev["shared_batch"] = len(loops)  # the policies decoded side by side
            ev["latency_backend"] = timed.backend
            add_latency(ev, rec, timings[k])
            out[k] = score_task(model, policies[k], ev, rec, labels, settings)
    model.train(was_training)
    return out


def attended(rec: dict, bos: int | None = None) -> np.ndarray:
    """Positions each scored token attends to: its place in its window + 1 (+ 1 for a BOS
    input), a window starting at its first scored token (so on a full record only)."""
    first = {w: p for w, p in zip(rec["window"][::-1].tolist(), rec["position"][::-1].tolist(), strict=True)}
    start = np.array([first[w] for w in rec["window"].tolist()], dtype=float)
    return rec["position"] - start + 1 + (bos is not None)


def score_task(model: LoopedGPT, policy: ExitPolicy, ev: dict, rec: dict, labels: np.ndarray | None,
               settings: DecodeSettings) -> tuple[dict, dict]:
    """A task's scoring (docs/spec.md §6). With `labels` (aligned with the held-out tokens:
    0 = not an answer, d >= 1 = an answer of difficulty d) every record gets its target's
    `label`, and the eval block `answers` (`tasks.score_answers`). With `answers` (None:
    whenever there are labels) the record keeps the answer tokens only and the block's
    quality and cost (ce, applications, layer_applications, ...) are recomputed over
    them: what the sweep, the frontier, calibration and the report then read.
    `ms_per_token` and `flops_per_token` stay those of every decoded token, beside the
    answers' own `ms_per_answer` and `flops_per_answer` (`latency_of`; `ms_per_context`:
    the other tokens').
    `answers=True` without labels is an error."""
    answers, bos = settings.answers, settings.bos
    if labels is None:
        if answers:
            raise ValueError("eval.answers: true scores a task's answer tokens, but this data has no "
                             "answer labels (data=task has them)")
        return ev, rec
    rec["label"] = np.asarray(labels, dtype=np.int64)[rec["position"] + 1]
    if answers is None or answers:
        keep = rec["label"] > 0
        if not keep.any():
            raise ValueError("eval.tokens: the scored tokens hold no answer (score more tokens)")
        n = len(keep)
        rec["context"] = attended(rec, bos)  # before the filter: windows start at their first token
        timing = {"ms_repeats": rec["ms_repeats"][~keep], "window": rec["window"][~keep]} if "ms_repeats" in rec else {}
        context_latency = latency_of(timing, "context")  # the other tokens' (a task's context)
        rec = {k: (v[keep] if isinstance(v, np.ndarray) and len(v) == n else v) for k, v in rec.items()}
        rec["kept"] = np.flatnonzero(keep)  # rows of the full record (`add_latency` maps timings by it)
        latency = {k: v for k, v in ev.items() if k.startswith(("ms_", "latency", "repeats", "batch_check",
                                                                   "tokens_per_s"))}
        per_answer = _summary(model, policy, rec, settings)
        ev = {**ev, **per_answer, **latency, **latency_of(rec), **context_latency,
              "flops_per_answer": per_answer["flops_per_token"],
              "flops_per_token": ev["flops_per_token"]}  # FLOPs of every decoded token beside the answers
        if "nll_by_n" in rec:  # the oracle
            ev["ce_at_max_steps"] = float(rec["nll_by_n"][:, -1].mean())
    ev["scored"] = "answers" if answers is None or answers else "all"
    ev["answers"] = tasks.score_answers(rec, rec["label"], rec["cost"], rec["loop_cost"])
    return ev, rec


def latency_of(rec: dict, what: str = "answer", resamples: int = 1000) -> dict:
    """Time per answer (a task's answer tokens only, after `score_task` kept them): the
    batch-1 ms of the decode step that predicts an answer (its loops and checks, the
    layers after them and the head), over the timed answers. `ms_per_answer`: the median
    over timing repeats of the mean over answers; `ms_per_answer_ci`: its 95% interval,
    each resample drawing whole windows (for a task, its instances) and one timing repeat
    (`stats.latency_ci`); `ms_per_answer_repeats`: the mean of each repeat;
    `latency_answers`: the answers timed. All None when no answer was timed. With
    what="context", the same of the record's other tokens (`ms_per_context`, ...: the
    positions whose target is not an answer, under `eval.context_steps` looped at fixed depth)."""
    ms = rec.get("ms_repeats")
    timed = np.zeros(0, dtype=bool) if ms is None or not ms.size else np.isfinite(ms).all(axis=1)
    if not timed.any():
        return {f"ms_per_{what}": None, f"ms_per_{what}_ci": None, f"ms_per_{what}_repeats": None,
                f"latency_{what}s": 0}
    m, lo, hi, per_rep = stats.latency_ci(ms[timed], rec["window"][timed], resamples)
    return {f"ms_per_{what}": m, f"ms_per_{what}_ci": [lo, hi], f"ms_per_{what}_repeats": per_rep,
            f"latency_{what}s": int(timed.sum())}


@torch.no_grad()
def time_tokens(model: LoopedGPT, tokens: Tensor, policy: ExitPolicy, n_tokens: int,
                settings: DecodeSettings = REFERENCE, first_window: int = 0,
                labels: np.ndarray | None = None,
                targets: np.ndarray | Tensor | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One timed pass at batch 1 over the first `n_tokens` scored tokens (their windows one
    after another, SPEC §4 latency) as `settings` decode them (its step: the timed one;
    under the compiled step the graphs of every attention span are built first, untimed,
    `engine.warm_up` with no tokens): ms per token,
    and the NLL and applications of the pass (for `batch_check`). `add_latency` turns
    repeats of it into the latency fields; `recdepth.report` interleaves the repeats of
    several policies (round-robin) so that drift of the machine hits them alike."""
    was_training = model.training
    model.eval()
    T = model.cfg.block_size
    tokens, n_tokens, wins = prepare_windows(model, tokens, n_tokens, settings.bos)
    warm_up(model, tokens, policy, settings.replace(warmup_tokens=0))
    secs, nll1, apps1 = [], [], []
    with Progress(f"timing {policy.name} at batch 1", len(wins)) as progress:  # drawn between windows, untimed
        for w in wins:
            nll, apps, sec, _ = decode_windows(model, tokens, [w], policy, settings, timed=True,
                                               first_window=first_window, labels=labels, targets=targets)
            r = records([w], nll, apps, tokens, T, first_window, settings.bos)
            secs += sec[: w[1]]
            nll1.append(r["nll"])
            apps1.append(r["apps"])
            progress.update()
    model.train(was_training)
    return 1000 * np.asarray(secs), np.concatenate(nll1), np.concatenate(apps1)


def add_latency(ev: dict, rec: dict, timings: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """The latency fields of an `eval` block from repeats of `time_tokens` (in place):
    ms_per_token = the median over repeats of the mean ms per token, its min, max and every
    repeat (`ms_per_token_repeats`: the spread the equal-latency verdict includes), each
    timed token's median ms in rec["ms"], and `batch_check` (timed tokens whose
    applications differ from the batched pass, and the largest NLL difference)."""
    if not timings:
        ev.update(ms_per_token=None, latency_tokens=0, repeats=0)
        return
    ms = np.stack([t[0] for t in timings])
    n_lat = timed = ms.shape[1]
    per_rep = [float(m.mean()) for m in ms]
    _, nll1, apps1 = timings[-1]
    # a record that keeps a task's answers only (`score_task`) maps its rows to the timed tokens
    idx = np.arange(n_lat) if "kept" not in rec else rec["kept"][rec["kept"] < n_lat]
    nll1, apps1, n_lat = nll1[idx], apps1[idx], len(idx)
    rec["ms"][:n_lat] = np.median(ms, axis=0)[idx]
    rec["ms_repeats"] = np.full((len(rec["ms"]), len(timings)), np.nan)  # [tokens, repeats]: per-answer latency
    rec["ms_repeats"][:n_lat] = ms.T[idx]
    ev.update(ms_per_token=float(np.median(per_rep)), ms_per_token_min=min(per_rep), ms_per_token_max=max(per_rep),
              ms_per_token_repeats=per_rep, latency_tokens=timed, repeats=len(timings))
    ev["batch_check"] = {"tokens": n_lat, "apps_mismatch": int((apps1 != rec["apps"][:n_lat]).any(axis=1).sum()),
                         "max_abs_dnll": float(np.abs(nll1 - rec["nll"][:n_lat]).max()) if n_lat else 0.0}


@torch.no_grad()
def evaluate_oracle(model: LoopedGPT, tokens: Tensor, policy: ExitPolicy, n_tokens: int,
                    settings: DecodeSettings = REFERENCE, first_window: int = 0,
                    targets: np.ndarray | Tensor | None = None) -> tuple[dict, dict]:
    """The oracle of SPEC §4b (best uniform depth per token within ε: it reads the
    target, and it is no bound on rules that spend different depths per group) at ε = policy.tau, N = policy.max_steps: per token, the
    smallest uniform n (the same in every group) whose target NLL is within ε of its NLL
    at N, with every earlier token computed at N.

    Each window is decoded as N rows side by side, row n stopping every group after n
    applications, all with the window's noise; after each position every row takes the
    cache entries of row N, so the history is always the N-application one; with
    `warm_start` every row also starts the next position from row N's final group states.
    Row N is then exactly `exit=fixed max_steps=N` (with the same `warm_start`). The first
    group's input is the same in every row of a window, so it loops once per window and
    each row takes its state after n applications (`engine.loop_shared`; `settings.share_first`
    False loops it in every row: the same records, 1 + 2 + … + N applications instead of N). The record carries `nll_by_n` [tokens, N], from which
    the oracle at any other ε follows without decoding again (`recdepth.analysis.stats.oracle_n`).
    No latency: the oracle reads the target, so it cannot run for real."""
    was_training = model.training
    model.eval()
    N = policy.max_steps
    T = model.cfg.block_size
    bos, batch_size = settings.bos, settings.batch_size
    tokens, n_tokens, wins = prepare_windows(model, tokens, n_tokens, bos)
    fixed = build("fixed", None, max_steps=N)
    parts, by_n, ok_by_n, t0 = [], [], [], time.perf_counter()
    progress = Progress(f"decoding the oracle ({N} depths a window)", len(wins))
    for b in range(0, len(wins), batch_size):
        progress.update(0)
        ws = wins[b : b + batch_size]
        limit = torch.arange(1, N + 1, device=tokens.device).repeat(len(ws))
        nll, _, _, ok = decode_windows(model, tokens, ws, fixed, settings.replace(context_steps=None), reps=N,
                                       limit=limit, first_window=first_window, targets=targets)
        nll, ok = nll.view(len(ws), N, -1), ok.view(len(ws), N, -1)  # [window, n, position]
        by_n.append(np.concatenate([nll[w, :, :n].T.numpy() for w, (_, n) in enumerate(ws)]))
        ok_by_n.append(np.concatenate([ok[w, :, :n].T.numpy() for w, (_, n) in enumerate(ws)]))
        parts.append(records(ws, nll[:, -1], torch.zeros(len(ws), nll.shape[-1], model.n_groups,
                                                             dtype=torch.long), tokens, T, first_window, bos,
                             targets=targets))
        progress.update(len(ws))
    progress.close()
    seconds = time.perf_counter() - t0
    rec = merge_records(parts)
    rec["nll_by_n"] = np.concatenate(by_n)
    n = stats.oracle_n(rec["nll_by_n"], policy.tau)
    rec["nll"] = rec["nll_by_n"][np.arange(n_tokens), n - 1]
    rec["correct"] = np.concatenate(ok_by_n)[np.arange(n_tokens), n - 1]
    rec["apps"] = np.repeat(n[:, None], model.n_groups, axis=1)
    rec["ms"] = np.full(n_tokens, np.nan)
    ev = _summary(model, policy, rec, settings)
    ev.update(ms_per_token=None, latency_tokens=0, repeats=0, tokens_per_s=n_tokens / seconds,
              ce_at_max_steps=float(rec["nll_by_n"][:, -1].mean()))
    model.train(was_training)
    return ev, rec
