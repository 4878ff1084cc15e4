"""`recdepth bench speculative --ckpt PATH`: self-speculative against ordinary greedy
decoding, timed fairly (docs/results/speculative.md; recdepth/decode/generation.py). See recdepth/bench.py for
the benches and their options."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from recdepth.core.runtime import tune_cpu_allocator


def machine() -> str:
    """The CPU in words: architecture, model name (Linux), CPUs."""
    import os
    import platform

    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{platform.machine()}, {model}, {os.cpu_count()} CPUs"


def speculative_medians(rows: list[dict], resamples: int = 1000, seed: int = 0) -> dict:
    """Medians over prompts for `bench_speculative`'s rows (or its JSON's): per configuration
    the per-prompt ms/token and the per-prompt speedup over each of its baselines (ratio of
    the two tokens/s on that prompt), each with its 95% percentile-bootstrap interval over
    prompts (the draws of `stats.Bootstrap(np.arange(n), resamples, seed)`)."""
    import numpy as np

    from recdepth.analysis import stats

    by = {r["config"]: r for r in rows}
    rate = {k: np.asarray(r["decode_tokens"], float) / np.asarray(r["decode_seconds"], float) for k, r in by.items()}
    idx = stats.bootstrap_indices(len(rows[0]["decode_seconds"]), resamples, seed)

    def med(x):
        return {"point": float(np.median(x)), "ci": list(stats.interval(np.median(x[idx], axis=1)))}

    return {k: {"ms_per_token": med(1000 / rate[k]), **{b: med(rate[k] / rate[base])
                                                         for b, base in r["baselines"].items()}}
            for k, r in by.items()}


@torch.no_grad()
def bench_speculative(args) -> dict:
    """Self-speculative against ordinary greedy decoding on a checkpoint's test split,
    timed fairly (docs/results/speculative.md).

    Prompts: the first `prompt_len` tokens of each of the first `prompts` windows of the
    held-out stream (`heldout_tokens` from offset 0, windows of block_size: the test split,
    which with the default eval.tokens = 4096 and block_size 128 holds 32 windows; more
    prompts run on into the calibration split). Per exit rule (fixed at max_steps, accel
    τ = 1e-3): greedy with cache=latest (the default), greedy with cache=per_step (whose
    tokens speculative decoding returns), and speculative decoding per (draft_steps,
    lookahead); plus greedy at fixed `shallow` (cache=latest). All run on each prompt, one
    after another, the order rotated from prompt to prompt, so machine drift hits every
    configuration alike; each is run once untimed on the first prompt before.

    Timing: every configuration is timed after its first generated token
    (`Generation.decode_seconds`): from the same state (prompt in the cache, first token
    chosen) over the other new_tokens − 1 tokens. The prompt (token by token for greedy, one
    chunk pass for speculative) is reported apart, as ms to the first token. Intervals: 95%
    percentile bootstrap over prompts (`stats.Bootstrap`), tokens/s as Σ tokens / Σ seconds
    per resample, speedups as the ratio of two such rates on the same resampled prompts."""
    import datetime
    import json

    import numpy as np

    from recdepth.analysis import stats
    from recdepth.app.checkpoints import heldout_tokens, load_checkpoint
    from recdepth.decode.generation import greedy, speculative
    from recdepth.decode.settings import DecodeSettings
    from recdepth.exits.policy import build

    P, n, N = args.prompt_len, args.prompts, args.new_tokens
    if n < 1 or P < 1 or N < 2:
        raise ValueError(f"speculative: need --prompts >= 1, --prompt-len >= 1 and --new-tokens >= 2 "
                         f"(the first token is not timed), got {n}, {P}, {N}")
    tune_cpu_allocator()
    module, data = load_checkpoint(args.ckpt, torch.device("cpu"))
    model = module.model
    stride = model.cfg.block_size  # one prompt per window of the test split
    if P > stride:
        raise ValueError(f"speculative: --prompt-len {P} is more than a window (block_size {stride})")
    val = heldout_tokens(module, data, n * stride, seed=0)
    prompts = [val[i * stride : i * stride + P].tolist() for i in range(n)]
    tau = 1e-3
    rules = {"fixed": build("fixed", None, max_steps=args.max_steps),
             "accel": build("accel", tau, max_steps=args.max_steps)}
    rule_label = {"fixed": f"fixed {args.max_steps}", "accel": "accel τ = 1e-3"}

    # configurations: (key, rule, label, run(prompt, i) -> Generation)
    configs = []
    for rname, policy in rules.items():
        for cache in ("latest", "per_step"):
            configs.append((f"{rname}/greedy/{cache}", rname, f"greedy, cache={cache}",
                            lambda pr, i, pol=policy, c=cache: greedy(model, pr, pol, N, DecodeSettings(cache=c, seed=0),
                                                                      sequences=[i])))
        for ds in args.draft_steps:
            for la in args.lookaheads:
                configs.append((f"{rname}/speculative/{ds}/{la}", rname, f"speculative, draft {ds}, lookahead {la}",
                                lambda pr, i, pol=policy, ds=ds, la=la: speculative(
                                    model, pr, pol, N, ds, la, DecodeSettings(cache="per_step", seed=0), sequence=i)))
    if args.shallow:
        shallow = build("fixed", None, max_steps=args.shallow)
        configs.append(("shallow/greedy/latest", "fixed", f"greedy fixed {args.shallow}, cache=latest",
                        lambda pr, i: greedy(model, pr, shallow, N, DecodeSettings(cache="latest", seed=0),
                                             sequences=[i])))
    print(f"# recdepth bench speculative: checkpoint {args.ckpt}; {n} prompts of {P} tokens (test split, one per "
          f"window), {N} new tokens each, timed after the first; {len(configs)} configurations interleaved per "
          f"prompt; threads={torch.get_num_threads()}", flush=True)

    for _, _, _, run in configs:  # warm-up, untimed
        run(prompts[0], 0)
    res: dict[str, list] = {key: [None] * n for key, *_ in configs}
    t_start = time.perf_counter()
    for i, pr in enumerate(prompts):
        r = i % len(configs)
        for key, _, _, run in configs[r:] + configs[:r]:
            res[key][i] = run(pr, i)
        if (i + 1) % 8 == 0 or i + 1 == n:
            print(f"  {i + 1}/{n} prompts, {time.perf_counter() - t_start:.0f} s", flush=True)

    boot = stats.Bootstrap(np.arange(n))
    ci = stats.interval

    def arr(key, f):
        return np.array([f(g) for g in res[key]], dtype=float)

    def rate(key):  # tokens after the first, per second: (point, per-resample)
        tok, sec = arr(key, lambda g: len(g.ids) - 1), arr(key, lambda g: g.decode_seconds)
        return tok.sum() / sec.sum(), boot.ratios(tok, sec)

    rates = {key: rate(key) for key, *_ in configs}

    def speedup(key, base):
        (a, ra), (b, rb) = rates[key], rates[base]
        return {"point": a / b, "ci": list(ci(ra / rb))}

    def same(key, base):
        return int(sum(g.ids == h.ids for g, h in zip(res[key], res[base])))

    rows = []
    for key, rname, label, _ in configs:
        gens = res[key]
        tps, tps_r = rates[key]
        tok, sec = arr(key, lambda g: len(g.ids) - 1), arr(key, lambda g: g.decode_seconds)
        apps = arr(key, lambda g: sum(rec.total for rec in g.records[1:]))
        row = {"config": key, "exit": rule_label[rname] if not key.startswith("shallow") else f"fixed {args.shallow}",
               "method": label, "tokens_per_s": tps, "tokens_per_s_ci": list(ci(tps_r)),
               "ms_per_token": 1000 * sec.sum() / tok.sum(), "ms_per_token_ci": list(1000 * np.array(ci(1 / tps_r))),
               "first_token_ms": 1000 * float(np.mean(arr(key, lambda g: g.first_token_seconds))),
               "total_seconds": float(np.sum(arr(key, lambda g: g.seconds))),
               "applications_per_token": apps.sum() / tok.sum(),
               "vs_greedy_latest": speedup(key, f"{rname}/greedy/latest"),
               "vs_greedy_per_step": speedup(key, f"{rname}/greedy/per_step"),
               "identical_to_greedy_per_step": same(key, f"{rname}/greedy/per_step"),
               "identical_to_greedy_latest": same(key, f"{rname}/greedy/latest"), "prompts": n,
               "baselines": {"vs_greedy_latest": f"{rname}/greedy/latest",
                             "vs_greedy_per_step": f"{rname}/greedy/per_step",
                             **({"vs_shallow": "shallow/greedy/latest"} if args.shallow else {})},
               "decode_seconds": sec.tolist(), "decode_tokens": tok.tolist()}
        if args.shallow:
            row["vs_shallow"] = speedup(key, "shallow/greedy/latest")
        if "/speculative/" in key:
            d, a = arr(key, lambda g: g.stats["drafted"]), arr(key, lambda g: g.stats["accepted"])
            row.update(draft_steps=gens[0].stats["draft_steps"], lookahead=gens[0].stats["lookahead"],
                       acceptance=a.sum() / d.sum(), acceptance_ci=list(ci(boot.ratios(a, d))),
                       tokens_per_pass=(tok.sum()) / arr(key, lambda g: g.stats["rounds"]).sum())
        rows.append(row)

    def fmt(v, ci_, f="{:.2f}"):
        return f"{f.format(v)} [{f.format(ci_[0])}, {f.format(ci_[1])}]"

    sh = f" | vs greedy fixed {args.shallow}" if args.shallow else ""
    print(f"\n| exit | method | tokens/s | ms/token | ms to first token | applications/token | vs greedy latest "
          f"| vs greedy per_step{sh} | acceptance | tokens/pass | tokens = greedy per_step | tokens = greedy latest |")
    print("|---" * (12 + bool(args.shallow)) + "|")
    for row in rows:
        spec = "acceptance" in row
        print(f"| {row['exit']} | {row['method']} | {fmt(row['tokens_per_s'], row['tokens_per_s_ci'], '{:.1f}')} "
              f"| {fmt(row['ms_per_token'], row['ms_per_token_ci'], '{:.1f}')} | {row['first_token_ms']:.0f} "
              f"| {row['applications_per_token']:.1f} "
              f"| {fmt(row['vs_greedy_latest']['point'], row['vs_greedy_latest']['ci'])}× "
              f"| {fmt(row['vs_greedy_per_step']['point'], row['vs_greedy_per_step']['ci'])}× "
              + (f"| {fmt(row['vs_shallow']['point'], row['vs_shallow']['ci'])}× " if args.shallow else "")
              + (f"| {fmt(row['acceptance'], row['acceptance_ci'], '{:.3f}')} | {row['tokens_per_pass']:.2f} "
                 if spec else "| — | — ")
              + f"| {row['identical_to_greedy_per_step']}/{n} | {row['identical_to_greedy_latest']}/{n} |")
    print("\ntokens/s and ms/token: the new_tokens − 1 tokens after the first, Σ tokens / Σ seconds over prompts; "
          "[95% bootstrap interval over prompts]. Speedups: ratio of tokens/s on the same resampled prompts, against "
          "greedy under the same rule (the fixed-depth row: against full depth). applications/token: summed over "
          "groups, after the first token. Speculative decoding returns greedy per_step's tokens (up to rounding); "
          "greedy latest may legitimately differ: with latest sharing a position reads earlier positions at their "
          "final application, with per_step at its own application, another computation.")
    medians = speculative_medians(rows)
    print(f"\n| exit | method | median ms/token | median speedup vs greedy latest | vs greedy per_step{sh} |")
    print("|---" * (5 + bool(args.shallow)) + "|")
    for row in rows:
        m = medians[row["config"]]
        print(f"| {row['exit']} | {row['method']} | {fmt(m['ms_per_token']['point'], m['ms_per_token']['ci'], '{:.1f}')} "
              + " ".join(f"| {fmt(m[b]['point'], m[b]['ci'])}×" for b in row["baselines"]) + " |")
        row["median"] = m
    print("\nMedians over prompts of the per-prompt ms/token and of the per-prompt speedups (paired by prompt), "
          "[95% bootstrap interval over prompts]: unlike the Σ ratios above, robust to a burst of other load on a "
          "shared machine slowing one configuration on one prompt.")
    out = {"checkpoint": str(args.ckpt), "prompts": n, "prompt_len": P, "new_tokens": N, "timed_tokens": N - 1,
           "max_steps": args.max_steps, "accel_tau": tau, "shallow": args.shallow,
           "threads": torch.get_num_threads(), "machine": machine(), "date": datetime.date.today().isoformat(),
           "wall_seconds": time.perf_counter() - t_start, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return out

