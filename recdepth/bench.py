"""`python -m recdepth.bench`: training throughput, MFU and the cost of the loop machinery.

Prints, from one run on one machine (figures are ratios measured side by side):

1. training tokens/s and MFU of `model=baseline` and `model=grouped` (the paper's groups at
   the fixed mean recurrence r, truncated backprop k) at the CPU size;
2. the marginal cost of one layer application, as a slope so that fixed costs (embedding,
   LM head, optimiser) cancel:
     grouped:  [t(loops = n2) − t(loops = n1)] / [(n2 − n1) · 4 layers]   (groups 4, 5-6, 7)
     baseline: [t(L = 16) − t(L = 12)] / 4
   both with full backprop, so every application is graded. Their ratio is the
   per-application cost of the recurrence machinery (adapter, fresh-noise init, loop).

`python -m recdepth.bench exits [--ckpt PATH]` measures the exit rules on a trained
checkpoint (or, without one, a fresh CPU-size grouped model): per rule and τ, ms/token at
batch 1, tokens/s at batch 16 and their ratio, mean applications per token and CE; then
the cost of one exit check relative to one loop application, and the cost of one layer
application inside the decode loop.

`python -m recdepth.bench speculative --ckpt PATH` compares self-speculative with ordinary
greedy decoding (cache=latest, the default, and cache=per_step, whose tokens it returns) and
with greedy at a shallow fixed depth, on prompts from the test split, all timed after the
first generated token: tokens/s, speedups and acceptance rate, CIs over prompts.
`python -m recdepth.bench huginn` times Huginn's shape at small widths and extrapolates the
decode cost and memory of Huginn-0125 (an estimate).

`python -m recdepth.bench ltt --ckpt PATH` checks the guarantee of Learn-then-Test calibration
(docs/spec.md §4e): one rule's path decoded once over held-out windows, then LTT and the
empirical search on many random calibration/test halvings of them: violation rates with
95% intervals, and the layer applications each method's answer costs.

`python -m recdepth.bench intervals --sweep DIR` reads a finished frontier sweep and prints
its verdicts under the older statistics (tokens resampled, cost = mean applications) and
the current ones (whole windows, layer applications, Holm), side by side; it decodes nothing.

`python -m recdepth.bench settings --ckpt PATH` decodes a frontier grid (fixed depths, stepnorm,
kl and accel at four τ each) on the test split twice in one run: setting by setting at
`--batch` windows a batch, and as one batch of settings × windows (`decoding.decode_settings`,
`--rows` rows a batch); prints the wall times, their ratio and how far the records differ.

`python -m recdepth.bench decode [--ckpt PATH]` times one layer application of token-by-token
decoding per `eval.step` (module, lean, compiled) at batch 1 and 16, for the default and the
paper shape, beside its arithmetic lower bound (recdepth/bench_decode.py).

`python -m recdepth.bench callbacks` instead times the default training run
(`python -m recdepth.train model=grouped`, exit evaluation off) twice in one process, with
`callbacks=none` and with the default `callbacks=loop_dynamics` (diagnostics at step 0,
every checkpoint and the end, figures at the end), and prints the overhead of the
loop-geometry callback: from the two wall times, and from the callback's own clock.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from recdepth import bench_decode
from recdepth.model import GPTConfig, LoopedGPT
from recdepth.runtime import measured_cpu_peak_flops, tune_cpu_allocator


def step_time(model: LoopedGPT, loops, backprop_depth, batch: int, vocab: int, steps: int, warmup: int = 2) -> float:
    """Median wall time of a full training step (forward, backward, AdamW)."""
    T = model.cfg.block_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, T), generator=g)
    y = torch.randint(0, vocab, (batch, T), generator=g)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        _, loss = model(x, y, loops=loops, backprop_depth=backprop_depth)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_train(args) -> dict:
    tune_cpu_allocator()
    torch.manual_seed(0)
    peak = measured_cpu_peak_flops()
    V, B = args.vocab, args.batch
    base = dict(size=args.size, vocab_size=V, mean_recurrence=args.r)
    paper_groups = [[4], [5, 6], [7]]
    print(f"# recdepth bench: size={args.size}, batch={B}, vocab={V}, r={args.r}, k={args.k}, "
          f"threads={torch.get_num_threads()}, measured fp32 matmul peak {peak / 1e9:.0f} GFLOP/s")

    results = {}
    print("\n## training throughput (full step: forward, backward, AdamW)")
    print(f"{'model':10s} {'loops':>12s} {'ms/step':>9s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'MFU':>6s}")
    for name, groups, loops in (("baseline", [], []), ("grouped", paper_groups, [args.r] * 3)):
        m = LoopedGPT(GPTConfig.from_size(groups=groups, **base))
        t = step_time(m, loops, args.k, B, V, args.steps)
        tokens = B * m.cfg.block_size
        flops = m.flops_per_token(loops, m.cfg.block_size, args.k, train=True) * tokens
        results[name] = dict(ms=t * 1e3, tokens_per_s=tokens / t, mfu=flops / t / peak)
        print(f"{name:10s} {str(loops):>12s} {t * 1e3:9.0f} {tokens / t:9.0f} {flops / t / 1e9:8.1f} "
              f"{flops / t / peak:6.1%}")

    print("\n## marginal cost of one layer application (full backprop; slopes)")
    n1, n2 = args.slope_loops
    g = LoopedGPT(GPTConfig.from_size(groups=paper_groups, **base))
    b12 = LoopedGPT(GPTConfig.from_size(groups=[], **base))
    b16 = LoopedGPT(GPTConfig.from_size(groups=[], **{**base, "n_layer": 16}))
    # Interleave the four measurements, several rounds, and take medians: drift on a
    # shared machine then hits all four alike.
    samples = {k: [] for k in ("g1", "g2", "b12", "b16")}
    for _ in range(args.rounds):
        samples["g1"].append(step_time(g, [n1] * 3, None, B, V, args.steps))
        samples["g2"].append(step_time(g, [n2] * 3, None, B, V, args.steps))
        samples["b12"].append(step_time(b12, [], None, B, V, args.steps))
        samples["b16"].append(step_time(b16, [], None, B, V, args.steps))
    med = {k: statistics.median(v) for k, v in samples.items()}
    per_app_g = (med["g2"] - med["g1"]) / ((n2 - n1) * 4)
    per_app_b = (med["b16"] - med["b12"]) / 4
    ratio = per_app_g / per_app_b
    print(f"grouped  : {per_app_g * 1e3:7.2f} ms per layer application (loops {n1} -> {n2})")
    print(f"baseline : {per_app_b * 1e3:7.2f} ms per layer application (12 -> 16 layers)")
    print(f"ratio    : {ratio:7.3f}  (recurrence machinery costs {ratio - 1:+.1%} per application; target <= +10%)")
    results["per_application"] = dict(grouped_ms=per_app_g * 1e3, baseline_ms=per_app_b * 1e3, ratio=ratio)
    return results


def bench_callbacks(args) -> dict:
    """Training wall time with and without the LoopDynamics callback at its default cadence."""
    import tempfile

    from hydra import compose, initialize_config_dir

    from recdepth.config import conf_dir
    from recdepth.train import train

    base = ["model=grouped", "eval.tokens=0", "trainer.enable_progress_bar=false", *args.overrides]
    if args.train_steps is not None:
        base.append(f"trainer.max_steps={args.train_steps}")
    print(f"# recdepth bench callbacks: overrides {base}, threads={torch.get_num_threads()}")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("without", ["callbacks=none"]), ("with", [])):
            with initialize_config_dir(conf_dir(), version_base="1.3"):
                cfg = compose("config", overrides=[*base, *extra, f"run_dir={tmp}/{name}", f"runs_dir={tmp}/runs"])
            m = train(cfg)
            n_diag = len(list(Path(m["train_dir"]).glob("diagnostics/step_*.json")))
            out[name] = dict(train_seconds=m["train_seconds"], steps=m["steps"], val_ce=m["val_ce"],
                             callback_seconds=m.get("diagnostics_seconds", 0.0), diagnostics=n_diag)
    w, wo = out["with"], out["without"]
    overhead = w["train_seconds"] / wo["train_seconds"] - 1
    own = w["callback_seconds"] / (w["train_seconds"] - w["callback_seconds"])
    print(f"\n{'run':28s} {'steps':>6s} {'train s':>9s} {'callback s':>11s} {'diagnostics':>12s} {'val CE':>7s}")
    for name in ("without", "with"):
        r = out[name]
        print(f"{name + ' LoopDynamics':28s} {r['steps']:6d} {r['train_seconds']:9.1f} {r['callback_seconds']:11.1f} "
              f"{r['diagnostics']:12d} {r['val_ce']:7.4f}")
    print(f"overhead, wall times   : {overhead:+.1%}  (target <= +5%; includes run-to-run noise)")
    print(f"overhead, callback clock: {own:+.1%}  (time inside the callback / the rest of the run)")
    out["overhead_wall"], out["overhead_callback_clock"] = overhead, own
    return out


def _median_time(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def bench_exits(args) -> dict:
    """Latency / throughput / compute per exit rule and τ, and the cost of the exit check."""
    from recdepth import exits
    from recdepth.decoding import decode_step, evaluate_exit, new_caches

    tune_cpu_allocator()
    torch.manual_seed(0)
    if args.ckpt:
        from recdepth.checkpoints import heldout_tokens, load_checkpoint

        module, data = load_checkpoint(args.ckpt, torch.device("cpu"))
        model = module.model
        T = model.cfg.block_size
        tokens = heldout_tokens(module, data, max(args.tokens + 1, args.batch_large * (T + 1)), seed=0)
        source = f"checkpoint {args.ckpt}"
    else:
        model = LoopedGPT(GPTConfig.from_size(args.size, groups=[[4], [5, 6], [7]], vocab_size=args.vocab)).eval()
        T = model.cfg.block_size
        tokens = torch.randint(0, args.vocab, (max(args.tokens + 1, args.batch_large * (T + 1)),))
        source = f"a fresh (untrained) {args.size}-size grouped model"
    cfg = model.cfg
    print(f"# recdepth bench exits: {source}; d={cfg.n_embd}, groups {cfg.groups}, "
          f"{args.tokens} tokens at batch 1, {args.batch_large} x {args.large_tokens} tokens batched, "
          f"max_steps {args.max_steps}, threads={torch.get_num_threads()}")

    def throughput(policy) -> float:
        """tokens/s decoding batch_large rows of held-out text together."""
        B, n = args.batch_large, args.large_tokens
        rows = tokens[: B * (T + 1)].view(B, T + 1)
        caches = new_caches(model, B, T, "latest", policy.max_steps_bound)
        gen = torch.Generator().manual_seed(0)
        decode_step(model, rows[:, 0], 0, caches, policy, gen)  # warm-up token
        t = time.perf_counter()
        for pos in range(1, n + 1):
            decode_step(model, rows[:, pos], pos, caches, policy, gen)
        return B * n / (time.perf_counter() - t)

    results = {"rules": []}
    print(f"\n{'rule':16s} {'tau':>7s} {'CE':>7s} {'ms/token':>9s} {'tok/s b1':>9s} "
          f"{'tok/s b' + str(args.batch_large):>10s} {'ratio':>6s} {'mean apps':>10s}  per group")
    for name in args.rules:
        for tau in ([None] if exits.ALIASES.get(name, name) in exits.NO_TAU else args.taus):  # τ-free: once
            policy = exits.build(name, tau, max_steps=args.max_steps)
            ev, _ = evaluate_exit(model, tokens, policy, args.tokens, warmup_tokens=8, seed=0)
            tps = throughput(policy)
            b1 = 1000 / ev["ms_per_token"]
            apps = ev["applications_per_token"]
            row = dict(rule=name, tau=tau, ce=ev["ce"], ms_per_token=ev["ms_per_token"], tokens_per_s_b1=b1,
                       tokens_per_s_batched=tps, batch_ratio=tps / b1, applications=apps)
            results["rules"].append(row)
            print(f"{name:16s} {'—' if tau is None else f'{tau:g}':>7s} {ev['ce']:7.4f} {ev['ms_per_token']:9.2f} "
                  f"{b1:9.1f} {tps:10.1f} {tps / b1:6.2f} {sum(apps) / len(apps):10.2f}  "
                  + " / ".join(f"{a:.1f}" for a in apps))

    # Cost of one exit check vs one loop application (batch 1, group 0, a cache 64 deep).
    pos = min(64, T - 1)
    caches = new_caches(model, 1, T)
    for p in range(pos):
        decode_step(model, tokens[p : p + 1], p, caches, exits.build("fixed", None, max_steps=4))
    e = torch.randn(1, 1, cfg.n_embd)
    e_proj = model.adapters[0].input(e)
    s0 = torch.randn(1, 1, cfg.n_embd)
    t_app = _median_time(lambda: model.apply_group(0, s0, e_proj, caches, pos), args.reps)
    print(f"\none application of group {cfg.groups[0]} at batch 1 (cache depth {pos}): {t_app * 1e3:.3f} ms "
          f"= {t_app * 1e3 / len(cfg.groups[0]):.3f} ms per layer application")
    xs = [torch.randn(1, cfg.n_embd) for _ in range(4)]
    results["check_cost"] = {}
    for name in args.rules:
        if name == "fixed":
            continue
        policy = exits.build(name, 1e-30, max_steps=10**9)  # never fires: a check every call

        decode = model.decode_logits if policy.needs_decode else None

        def setup(policy=policy, decode=decode):
            return policy.monitor(xs[0], decode)

        def checks(policy=policy, decode=decode):
            mon = policy.monitor(xs[0], decode)
            for x in xs[1:]:
                mon.observe(x)
        # three observe() calls (the third is a full check for every rule), less the set-up
        t_check = (_median_time(checks, args.reps) - _median_time(setup, args.reps)) / 3
        results["check_cost"][name] = t_check / t_app
        print(f"exit check {name:16s}: {t_check * 1e6:8.1f} µs = {t_check / t_app:6.1%} of one loop application")
    results["layer_application_ms"] = t_app * 1e3 / len(cfg.groups[0])
    return results


HUGINN_0125 = dict(n_embd=5280, n_head=55, intermediate_size=17920, vocab_size=65536, block_size=4096)


def huginn_shape(d: int, vocab: int, block_size: int) -> GPTConfig:
    """Huginn-0125's shape (prelude 2, core 4, coda 2; head_dim 96; I/d = 17920/5280) at width d."""
    inter = max(64, round(d * HUGINN_0125["intermediate_size"] / HUGINN_0125["n_embd"] / 64) * 64)
    return GPTConfig(n_layer=8, n_head=max(1, d // 96), n_embd=d, block_size=block_size, vocab_size=vocab,
                     groups=[[2, 3, 4, 5]], mean_recurrence=32, logit_bias=False, position="rope", mlp="gated_silu",
                     intermediate_size=inter, qk_bias=True, scale_embeddings=True, latent_norm=True)


def _core_params(model: LoopedGPT) -> int:
    """Parameters one application of the core reads: its layers and the adapter's state half."""
    return sum(p.numel() for i in model.core for p in model.h[i].parameters()) + model.adapters[0].state.weight.numel()


def _decode_seconds(model: LoopedGPT, tokens, n: int, reps: int) -> float:
    """Median seconds of one decode step at batch 1 with n applications per group, for the
    last of `tokens` after the others filled the cache (at one application each: cheap)."""
    from recdepth.decoding import decode_step, new_caches
    from recdepth.exits import build

    caches = new_caches(model, 1, model.cfg.block_size, "latest")
    one, policy = build("fixed", None, max_steps=1), build("fixed", None, max_steps=n)
    pos = len(tokens) - 1
    for p in range(pos):
        decode_step(model, tokens[p : p + 1], p, caches, one)
    return _median_time(lambda: decode_step(model, tokens[pos:], pos, caches, policy), reps=reps, warmup=1)


@torch.no_grad()
def bench_huginn(args) -> dict:
    """Decode cost of Huginn's shape at widths that fit this machine, fitted against the
    bytes an application reads and extrapolated to Huginn-0125 (an estimate: batch-1 decoding
    reads every weight once per application, so it scales with the weights' bytes)."""
    tune_cpu_allocator()
    torch.manual_seed(0)
    rows = []
    for d in args.widths:
        cfg = huginn_shape(d, args.vocab_huginn, args.context + 8)
        model = LoopedGPT(cfg).eval()
        tokens = torch.randint(0, cfg.vocab_size, (args.context + 1,))

        n1, n2 = args.slope_loops
        t1, t2 = (_decode_seconds(model, tokens, n, args.huginn_reps) for n in (n1, n2))
        app = (t2 - t1) / (n2 - n1)
        rows.append({"d": d, "params": model.num_params(), "core_params": _core_params(model),
                     "ms_per_application": 1000 * app, "ms_rest": 1000 * (t1 - n1 * app)})
        print(f"d={d:5d}  params {model.num_params() / 1e6:7.1f}M  core {rows[-1]['core_params'] / 1e6:7.1f}M  "
              f"{rows[-1]['ms_per_application']:8.2f} ms/application  {rows[-1]['ms_rest']:8.2f} ms rest", flush=True)
        del model
    # least squares: ms per application = a + b * core bytes (fp32); rest = c + e * other bytes
    import numpy as np

    x = np.array([r["core_params"] * 4 for r in rows], dtype=float)
    y = np.array([r["ms_per_application"] for r in rows])
    b, a = np.polyfit(x, y, 1)
    xr = np.array([(r["params"] - r["core_params"]) * 4 for r in rows], dtype=float)
    e, c = np.polyfit(xr, np.array([r["ms_rest"] for r in rows]), 1)
    hcfg = huginn_shape(HUGINN_0125["n_embd"], HUGINN_0125["vocab_size"], HUGINN_0125["block_size"])
    with torch.device("meta"):  # counted, not allocated
        huginn = LoopedGPT(hcfg)
    h_core, h_params = _core_params(huginn), huginn.num_params()
    est = {}
    for name, nbytes in (("float32", 4), ("bfloat16", 2)):
        app_ms = a + b * h_core * 4  # measured in fp32: fp32 bytes; bf16 on CPU is not faster here
        rest_ms = c + e * (h_params - h_core) * 4
        est[name] = {"weights_GB": h_params * nbytes / 1e9, "ms_per_application": app_ms,
                     "ms_per_token_32": rest_ms + 32 * app_ms,
                     "kv_MB_per_token_latest": 8 * 2 * hcfg.n_embd * nbytes / 1e6,
                     "kv_MB_per_token_per_step_32": (4 + 4 * 32) * 2 * hcfg.n_embd * nbytes / 1e6}
    print(f"Huginn-0125: {h_params / 1e9:.2f}B parameters, core application reads {h_core / 1e9:.2f}B")
    print(f"fit: ms/application = {a:.3f} + {b * 1e9:.3f} ms/GB of core weights; rest = {c:.3f} + {e * 1e9:.3f} ms/GB")
    for name, v in est.items():
        print(f"ESTIMATE {name:8s}: weights {v['weights_GB']:.1f} GB, {v['ms_per_application']:.0f} ms/application, "
              f"{v['ms_per_token_32'] / 1000:.1f} s/token at 32 applications (CPU, batch 1, fp32 timings); "
              f"K/V {v['kv_MB_per_token_latest']:.2f} MB/token (latest), "
              f"{v['kv_MB_per_token_per_step_32']:.1f} MB/token (per_step, 32)")
    return {"rows": rows, "fit": {"a_ms": a, "b_ms_per_byte": b, "c_ms": c, "e_ms_per_byte": e}, "huginn_0125": est,
            "params": h_params, "core_params": h_core}


def _machine() -> str:
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

    from recdepth import stats

    by = {r["config"]: r for r in rows}
    rate = {k: np.asarray(r["decode_tokens"], float) / np.asarray(r["decode_seconds"], float) for k, r in by.items()}
    idx = stats.bootstrap_indices(len(rows[0]["decode_seconds"]), resamples, seed)

    def med(x):
        return {"point": float(np.median(x)), "ci": list(stats._interval(np.median(x[idx], axis=1)))}

    return {k: {"ms_per_token": med(1000 / rate[k]), **{b: med(rate[k] / rate[base])
                                                         for b, base in r["baselines"].items()}}
            for k, r in by.items()}


@torch.no_grad()
def bench_speculative(args) -> dict:
    """Self-speculative against ordinary greedy decoding on a checkpoint's test split,
    timed fairly (issue 21).

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

    from recdepth import stats
    from recdepth.checkpoints import heldout_tokens, load_checkpoint
    from recdepth.exits import build
    from recdepth.generation import greedy, speculative

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
                            lambda pr, i, pol=policy, c=cache: greedy(model, pr, pol, N, cache=c, seed=0, sequences=[i])))
        for ds in args.draft_steps:
            for la in args.lookaheads:
                configs.append((f"{rname}/speculative/{ds}/{la}", rname, f"speculative, draft {ds}, lookahead {la}",
                                lambda pr, i, pol=policy, ds=ds, la=la: speculative(model, pr, pol, N, ds, la,
                                                                                     cache="per_step", seed=0,
                                                                                     sequence=i)))
    if args.shallow:
        shallow = build("fixed", None, max_steps=args.shallow)
        configs.append(("shallow/greedy/latest", "fixed", f"greedy fixed {args.shallow}, cache=latest",
                        lambda pr, i: greedy(model, pr, shallow, N, cache="latest", seed=0, sequences=[i])))
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
    ci = stats._interval

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
           "threads": torch.get_num_threads(), "machine": _machine(), "date": datetime.date.today().isoformat(),
           "wall_seconds": time.perf_counter() - t_start, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return out

@torch.no_grad()
def bench_ltt(args) -> dict:
    """Does Learn-then-Test calibration (docs/spec.md §4e, recdepth/ltt.py) keep its promise
    on real decodes? One rule's path of settings (most conservative first) is decoded once
    over `--windows` held-out windows of the checkpoint's val split (windows decode
    independently and batched rows are exact, so a window's record does not depend on which
    other windows it is decoded with), with `fixed` at --max-steps as the paired reference.
    Then, for `--partitions` random half/half splits of the windows into calibration and
    test, and for each loss bound b and target δ (α = δ / b):
    - LTT (Hoeffding–Bentkus p-values, fixed-sequence testing at ε) on the calibration half;
      violation: the chosen setting's test-half risk (mean clipped window loss) > α;
    - the empirical method (the cheapest setting on the same path whose calibration-half CE
      increase over full depth is <= δ, as the §4c search would answer on this path), with the
      same violation criterion; and for both the CE-increase criterion (test-half CE increase > δ).
    Violation rates get 95% Clopper–Pearson intervals over partitions (the partitions share
    one pool of windows: the interval is over the partition draw given this pool). Cost: the
    mean layer applications per token (`decoding.model_cost`) of the chosen setting on the
    test half. The path is decoded until its pooled CE increase exceeds 2 max(δ) and its
    pooled risk exceeds 2 max(α) (or the grid ends); a partition whose LTT walk or empirical
    choice reaches the last decoded setting is counted and reported (`truncated`). With
    `--ltt-shared-rows`, the path's settings are decoded --ltt-shared-rows // --windows at a
    time as one batch (`decoding.evaluate_exits`; a few past the stop are decoded unread)."""
    import json

    import numpy as np

    from recdepth import ltt
    from recdepth.checkpoints import heldout_tokens, load_checkpoint
    from recdepth.decoding import evaluate_exit, evaluate_exits, model_cost
    from recdepth.exits import build

    tune_cpu_allocator()
    t_start = time.perf_counter()
    module, data = load_checkpoint(args.ckpt, torch.device("cpu"))
    model = module.model
    T, G, W = model.cfg.block_size, model.n_groups, args.windows
    tokens = heldout_tokens(module, data, W * T + 1, seed=0)
    cost = model_cost(model)
    rule, N = args.ltt_rule, args.max_steps
    grid = list(args.ltt_grid) if args.ltt_grid else (
        list(range(N, 0, -1)) if rule == "fixed" else _bench_tau_grid())
    if rule == "fixed":
        grid = [int(v) for v in grid]
    path = ltt.staircase(len(grid), G) if args.ltt_path == "staircase" else [(i,) * G for i in range(len(grid))]

    def policy(setting):
        vals = [grid[i] for i in setting]
        v = vals[0] if len(set(vals)) == 1 else vals
        return build("fixed", None, max_steps=v) if rule == "fixed" else build(rule, v, max_steps=N)

    def decode(p):
        t = time.perf_counter()
        _, rec = evaluate_exit(model, tokens, p, W * T, warmup_tokens=0, seed=args.seed, batch_size=args.ltt_batch,
                               latency_tokens=0)
        _, _, cnt = ltt.window_means(rec["nll"], rec["window"])
        return rec, cnt, time.perf_counter() - t

    print(f"# recdepth bench ltt: {args.ckpt}; {W} windows x {T} tokens of the val split, rule {rule} on the "
          f"{args.ltt_path} path over {grid[0]:g} .. {grid[-1]:g} ({len(path)} settings), reference fixed-{N}, "
          f"{args.partitions} half/half partitions, epsilon {args.epsilon:g}, threads={torch.get_num_threads()}",
          flush=True)
    ref, cnt, secs = decode(build("fixed", None, max_steps=N))
    ntok = cnt
    print(f"reference fixed-{N}: CE {ref['nll'].mean():.4f}, {cost.per_token(ref['apps']).mean():.1f} layer "
          f"applications per token, decoded in {secs:.0f} s", flush=True)
    bounds, deltas = list(args.loss_bounds), list(args.deltas)
    inc_sum, apps_sum, losses, rows = [], [], {b: [] for b in bounds}, []

    def add(rec, label, secs):
        _, inc, _ = ltt.window_means(rec["nll"] - ref["nll"], rec["window"])
        _, lapps, _ = ltt.window_means(cost.per_token(rec["apps"]), rec["window"])
        inc_sum.append(inc * ntok)
        apps_sum.append(lapps * ntok)
        for b in bounds:
            losses[b].append(np.clip(inc, 0, b) / b)
        row = {"setting": label, "ce_increase": float(inc_sum[-1].sum() / ntok.sum()),
               "layer_applications": float(apps_sum[-1].sum() / ntok.sum()),
               "risk": {str(b): float(losses[b][-1].mean()) for b in bounds},
               "clipped_at_bound": {str(b): float((inc > b).mean()) for b in bounds}, "seconds": secs}
        rows.append(row)
        print(f"  {label:>24s}  CE increase {row['ce_increase']:+.5f}  layer applications "
              f"{row['layer_applications']:6.2f}  risk " + " ".join(f"b={b:g}: {row['risk'][str(b)]:.4f}" for b in bounds)
              + f"  ({secs:.0f} s)", flush=True)
        return row

    add(ref, f"fixed-{N} (full depth)", secs)  # index 0: full depth, the fallback of both methods
    stop_inc, stop_risk = 2 * max(deltas), {b: 2 * max(deltas) / b for b in bounds}
    chunk = max(1, args.ltt_shared_rows // W)  # settings decoded side by side (0: one by one)

    def decoded_path():
        for i in range(0, len(path), chunk):
            part = path[i : i + chunk]
            if len(part) == 1:
                yield part[0], *decode(policy(part[0]))[::2]
                continue
            t = time.perf_counter()
            out = evaluate_exits(model, tokens, [policy(s) for s in part], W * T, warmup_tokens=0, seed=args.seed,
                                 max_rows=args.ltt_shared_rows, latency_tokens=0)
            secs = (time.perf_counter() - t) / len(part)
            for s, (_, rec) in zip(part, out, strict=True):
                yield s, rec, secs

    for s, rec, secs in decoded_path():
        row = add(rec, " ".join(f"{grid[i]:g}" for i in sorted(set(s))) if len(set(s)) == 1
                  else "[" + ",".join(f"{grid[i]:g}" for i in s) + "]", secs)
        if row["ce_increase"] > stop_inc and all(row["risk"][str(b)] > stop_risk[b] for b in bounds):
            break
    decoded = len(rows) - 1  # settings of the path decoded (row 0 is the reference)
    inc_sum, apps_sum = np.stack(inc_sum), np.stack(apps_sum)
    L = {b: np.stack(v) for b, v in losses.items()}

    rng = np.random.default_rng(args.seed)
    P, half = args.partitions, W // 2
    parts = [rng.permutation(W) for _ in range(P)]
    results = []
    for b in bounds:
        for d in deltas:
            a = ltt.alpha(d, b)
            rec = {m: {"viol": 0, "viol_ce": 0, "apps": [], "ce_inc": [], "risk": [], "none": 0, "truncated": 0}
                   for m in ("ltt", "empirical")}
            for perm in parts:
                cal, test = perm[:half], perm[half:]
                tok_c, tok_t = ntok[cal].sum(), ntok[test].sum()
                # LTT over the path (rows 1..), full depth (row 0) if nothing is certified
                ps = [ltt.hoeffding_bentkus_p(float(L[b][j, cal].mean()), half, a) for j in range(1, decoded + 1)]
                k = ltt.fixed_sequence(ps, args.epsilon)
                chosen = {"ltt": k}  # row index: k-th path setting, or 0 = full depth
                # empirical: cheapest (calibration layer applications) with calibration CE increase <= δ
                inc_c = inc_sum[:, cal].sum(axis=1) / tok_c
                apps_c = apps_sum[:, cal].sum(axis=1) / tok_c
                ok = np.flatnonzero(inc_c <= d)
                chosen["empirical"] = int(ok[np.argmin(apps_c[ok])])
                for m, j in chosen.items():
                    r = rec[m]
                    risk_t = float(L[b][j, test].mean())
                    ce_t = float(inc_sum[j, test].sum() / tok_t)
                    r["viol"] += risk_t > a
                    r["viol_ce"] += ce_t > d
                    r["risk"].append(risk_t)
                    r["ce_inc"].append(ce_t)
                    r["apps"].append(float(apps_sum[j, test].sum() / tok_t))
                    r["none"] += j == 0
                    r["truncated"] += (j == decoded) and decoded < len(path)
            pool_ok = [j for j in range(decoded + 1) if L[b][j].mean() <= a]
            best_pool = min(pool_ok, key=lambda j: apps_sum[j].sum())
            for m in ("ltt", "empirical"):
                r = rec[m]
                lo, hi = ltt.clopper_pearson(r["viol"], P)
                lo2, hi2 = ltt.clopper_pearson(r["viol_ce"], P)
                results.append({
                    "loss_bound": b, "delta": d, "alpha": a, "method": m, "partitions": P,
                    "violation_rate": r["viol"] / P, "violation_ci": [lo, hi],
                    "ce_violation_rate": r["viol_ce"] / P, "ce_violation_ci": [lo2, hi2],
                    "full_depth_rate": r["none"] / P, "truncated": r["truncated"],
                    "layer_applications": float(np.mean(r["apps"])), "test_risk": float(np.mean(r["risk"])),
                    "test_ce_increase": float(np.mean(r["ce_inc"])),
                    "pool_best_layer_applications": float(apps_sum[best_pool].sum() / ntok.sum()),
                    "min_alpha": ltt.min_alpha(half, args.epsilon)})
    print(f"\n{W} windows ({half} calibration / {W - half} test per partition), {P} partitions, epsilon "
          f"{args.epsilon:g}; violation = test-half risk > alpha (the guarantee's event) or test-half CE "
          f"increase > delta; 95% Clopper-Pearson intervals over partitions; layer applications per token on the "
          f"test half (full depth {rows[0]['layer_applications']:.1f}); min alpha certifiable with {half} windows: "
          f"{ltt.min_alpha(half, args.epsilon):.4f}\n")
    head = ("| loss bound b | δ | α = δ/b | method | violation: risk > α [95% CI] | violation: CE incr. > δ [95% CI] "
            "| full depth | layer applications / token | test CE increase | cheapest on the pool with risk ≤ α |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        print(f"| {r['loss_bound']:g} | {r['delta']:g} | {r['alpha']:.3g} | "
              f"{'LTT' if r['method'] == 'ltt' else 'empirical (no guarantee)'} | "
              f"{r['violation_rate']:.3f} [{r['violation_ci'][0]:.3f}, {r['violation_ci'][1]:.3f}] | "
              f"{r['ce_violation_rate']:.3f} [{r['ce_violation_ci'][0]:.3f}, {r['ce_violation_ci'][1]:.3f}] | "
              f"{r['full_depth_rate']:.0%} | {r['layer_applications']:.2f} | {r['test_ce_increase']:+.5f} | "
              f"{r['pool_best_layer_applications']:.2f} |")
    if any(r["truncated"] for r in results):
        print("WARNING: some partitions chose the last decoded setting; decode more of the path (the stop rule)")
    out = {"ckpt": str(args.ckpt), "rule": rule, "path": args.ltt_path, "grid": grid, "max_steps": N, "windows": W,
           "block_size": T, "partitions": P, "epsilon": args.epsilon, "seed": args.seed, "decoded": decoded,
           "path_length": len(path), "settings": rows, "results": results,
           "window_tokens": ntok.tolist(), "window_ce_increase_sum": inc_sum.tolist(),
           "window_layer_applications_sum": apps_sum.tolist(),
           "seconds": time.perf_counter() - t_start}
    print(f"\ntotal {out['seconds']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return out


def _bench_tau_grid() -> list[float]:
    """bench ltt's default τ path: calibration.TAU_GRID from 1e-3 to 1, two values per decade
    below 1e-2 (1e-3, 3.16e-3: the conservative end, where kl's CE barely moves on the
    default model) and all four from 1e-2 to 1."""
    from recdepth.calibration import TAU_GRID

    return [t for i, t in enumerate(TAU_GRID) if 1e-3 <= t <= 1.0 and (t >= 1e-2 or i % 2 == 0)]


def bench_intervals(args) -> dict:
    """A finished frontier sweep (`--sweep <dir>`, e.g. `make frontier`'s) under the older
    statistics (tokens resampled as if independent; cost = applications averaged over
    groups) and the current ones (whole windows resampled; cost = layer applications,
    docs/spec.md §4b), verdict by verdict, with the width of each fixed job's absolute CE
    interval and of its paired difference to the deepest fixed job both ways. Reads the
    jobs' eval_tokens.csv; decodes nothing."""
    import numpy as np

    from recdepth import stats, sweep

    d = Path(args.sweep)
    rows = sweep.collect(d)
    inputs = sweep.frontier_inputs(d, rows)
    if inputs is None:
        raise SystemExit(f"--sweep: {d} has fewer than two fixed-depth jobs (not a frontier sweep)")
    tokens, fixed, _ = inputs
    n = len(next(iter(fixed.values()))["nll"])
    by_tok, by_win = stats.Bootstrap(np.arange(n), args.resamples), sweep.bootstrap(inputs, args.resamples)
    # before: no timing spread either (the latency verdict took each ms/token as exact)
    old = sweep.frontier_rows(inputs, [{**r, "ms_repeats": ""} for r in rows], by_tok, None)
    new = sweep.frontier_rows(inputs, rows, by_win, sweep.sweep_cost(rows))
    ref = fixed[max(fixed)]["nll"]
    widths = []
    for k in sorted(fixed):
        x = fixed[k]["nll"]
        w = [stats.mean_ci(x, b) for b in (by_tok, by_win)]
        p = [stats.diff_ci(x, ref, b) for b in (by_tok, by_win)]
        widths.append({"n": k, "ce": float(np.mean(x)), "ce_width_tokens": w[0][2] - w[0][1],
                       "ce_width_windows": w[1][2] - w[1][1], "paired_width_tokens": p[0][2] - p[0][1],
                       "paired_width_windows": p[1][2] - p[1][1]})
    print(f"{n} tokens in {by_win.n_units} windows, {args.resamples} resamples; cost: "
          f"{sweep.sweep_cost(rows) or 'mean applications (the jobs do not say their group sizes)'}")
    print("fixed n | CE | CE 95% width: tokens / windows (ratio) | CE - CE(fixed max) width: tokens / windows")
    for w in widths:
        print(f"{w['n']:7d} | {w['ce']:.4f} | {w['ce_width_tokens']:.4f} / {w['ce_width_windows']:.4f} "
              f"({w['ce_width_windows'] / w['ce_width_tokens']:.2f}x) | {w['paired_width_tokens']:.4f} / "
              f"{w['paired_width_windows']:.4f}")
    fmt = lambda r, k="d_hull": ("—" if r[k] in ("", None) else  # noqa: E731
                                 f"{r[k]:+.4f} [{r[k + '_lo']:+.4f}, {r[k + '_hi']:+.4f}]")
    print("job | family | tau | mean apps | layer apps | before: CE - frontier at A (tokens, mean apps) -> verdict "
          "| after: CE - frontier at cost (windows, layer apps) -> verdict | after, Holm "
          "| CE - frontier at its ms/token: before (tokens, ms exact) | after (windows, spread of repeats)")
    out = []
    for a, b in zip(old, new):
        changed = "" if a["verdict"] == b["verdict"] else "  <- changed"
        print(f"{a['job']} | {a['family']} | {sweep._tau(a)} | {a['mean_applications']:.2f} | "
              f"{b['layer_applications']:.2f} | {fmt(a)} {a['verdict']} | {fmt(b)} {b['verdict']} | "
              f"{b.get('verdict_holm', '')} | {fmt(a, 'd_ms')} | {fmt(b, 'd_ms')}{changed}")
        keep = ("d_hull", "d_hull_lo", "d_hull_hi", "verdict", "d_ms", "d_ms_lo", "d_ms_hi")
        out.append({"job": a["job"], "family": a["family"],
                    "before": {k: a[k] for k in (*keep, "mean_applications")},
                    "after": {k: b[k] for k in (*keep, "verdict_holm", "layer_applications", "p_hull", "p_holm")}})
    return {"widths": widths, "rows": out}


def bench_settings(args) -> dict:
    """A frontier grid's quality pass, setting by setting against one mixed batch."""
    import numpy as np

    from recdepth import exits
    from recdepth.checkpoints import checkpoint_data, load_checkpoint
    from recdepth.decoding import decode_settings, evaluate_exit

    if args.ckpt is None:
        raise ValueError("settings: --ckpt <training checkpoint> is required")
    tune_cpu_allocator()
    module, data = load_checkpoint(args.ckpt, torch.device("cpu"))
    dm = checkpoint_data(module, data, 0)
    n = args.tokens
    tokens, labels = torch.as_tensor(dm.heldout_tokens(n + 1, 0)), dm.heldout_labels(n + 1, 0)
    grid = [exits.build("fixed", None, max_steps=k) for k in (1, 2, 3, 4, 6, 8, 16, 32)]
    grid += [exits.build(r, t, max_steps=32) for r, ts in (("stepnorm", (0.01, 0.03, 0.1, 0.3)),
                                                            ("kl", (1e-4, 1e-3, 1e-2, 3e-2)),
                                                            ("accel", (0.01, 0.03, 0.1, 0.3))) for t in ts]
    kw = dict(seed=0, labels=labels, context_steps=args.context_steps)
    t0 = time.perf_counter()
    alone = [evaluate_exit(module.model, tokens, p, n, batch_size=args.batch, latency_tokens=0, answers=False,
                           **kw)[1] for p in grid]
    t_alone = time.perf_counter() - t0
    print(f"{args.ckpt}: {len(grid)} settings x {n} tokens (context_steps={args.context_steps}), "
          f"{torch.get_num_threads()} threads\n  setting by setting at batch {args.batch}: {t_alone:.1f} s")
    out = {"settings": len(grid), "tokens": n, "alone_s": t_alone, "mixed": []}
    for rows in args.rows:
        recs, secs = decode_settings(module.model, tokens, grid, n, max_rows=rows, **kw)
        dn = max(float(np.abs(a["nll"] - r["nll"]).max()) for a, r in zip(alone, recs, strict=True))
        mm = sum(int((a["apps"] != r["apps"]).sum()) for a, r in zip(alone, recs, strict=True))
        print(f"  mixed, {rows} rows a batch: {secs:.1f} s ({t_alone / secs:.2f}x); max |NLL difference| "
              f"{dn:.2e}, applications differing {mm} of {len(grid) * n}")
        out["mixed"].append({"rows": rows, "s": secs, "speedup": t_alone / secs, "max_dnll": dn, "apps_mismatch": mm})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m recdepth.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="train", choices=["train", "callbacks", "exits", "huginn", "speculative", "ltt", "intervals",
                                                       "settings", "decode"])
    p.add_argument("--size", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=19379, help="vocabulary (default: the Shakespeare compact vocab)")
    p.add_argument("--r", type=int, default=12, help="loops per group for the throughput row")
    p.add_argument("--k", type=int, default=8, help="backprop depth for the throughput row")
    p.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the slope measurements")
    p.add_argument("--slope-loops", type=int, nargs=2, default=[2, 6], metavar=("N1", "N2"))
    p.add_argument("--train-steps", type=int, default=None,
                   help="callbacks: trainer.max_steps of both runs (default: the config's 800)")
    p.add_argument("--ckpt", default=None, help="exits: a training checkpoint (default: a fresh cpu-size model)")
    p.add_argument("--rules", nargs="+", default=["fixed", "stepnorm", "kl", "accel"],
                   help="exits: rules (any of recdepth.exits.RULES, e.g. entropy_diff cosine argmax_stability)")
    p.add_argument("--taus", type=float, nargs="+", default=[1e-5, 1e-4, 1e-3, 1e-2], help="exits: thresholds")
    p.add_argument("--tokens", type=int, default=256, help="exits: tokens scored at batch 1 per rule and τ; settings: test-split tokens")
    p.add_argument("--batch-large", type=int, default=16, help="exits: rows of the batched throughput run")
    p.add_argument("--large-tokens", type=int, default=32, help="exits: tokens per row of the batched run")
    p.add_argument("--max-steps", type=int, default=32, help="exits: exit.max_steps")
    p.add_argument("--reps", type=int, default=200, help="exits: repetitions of the micro-timings")
    p.add_argument("--prompts", type=int, default=32,
                   help="speculative: prompts, one per window of the test split (32 windows by default)")
    p.add_argument("--prompt-len", type=int, default=16, help="speculative: tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32,
                   help="speculative: tokens generated per prompt (all but the first timed)")
    p.add_argument("--draft-steps", type=int, nargs="+", default=[2, 4], help="speculative: draft depths")
    p.add_argument("--lookaheads", type=int, nargs="+", default=[4, 8], help="speculative: drafted tokens per pass")
    p.add_argument("--shallow", type=int, default=8,
                   help="speculative: also greedy at this fixed depth (cache=latest), the cheapest whose CE is not "
                        "resolved from full depth's (8 on the default model); 0: not run")
    p.add_argument("--out", default=None, help="speculative, ltt: write the results (JSON) here")
    p.add_argument("--widths", type=int, nargs="+", default=[384, 768, 1152, 1536],
                   help="huginn: widths of Huginn's shape to time (head_dim 96)")
    p.add_argument("--context", type=int, default=64, help="huginn: cached positions before the timed token")
    p.add_argument("--vocab-huginn", type=int, default=65536, help="huginn: vocabulary (Huginn's 65536)")
    p.add_argument("--huginn-reps", type=int, default=5, help="huginn: timed decode steps per measurement")
    p.add_argument("--windows", type=int, default=192, help="ltt: held-out windows of the block size")
    p.add_argument("--partitions", type=int, default=200, help="ltt: random calibration/test halvings")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.005, 0.01, 0.02], help="ltt: CE-increase targets")
    p.add_argument("--epsilon", type=float, default=0.05, help="ltt: calibration.epsilon")
    p.add_argument("--loss-bounds", type=float, nargs="+", default=[0.05, 0.1, 0.5],
                   help="ltt: calibration.loss_bound values")
    p.add_argument("--ltt-rule", default="kl", help="ltt: the exit rule whose path is calibrated")
    p.add_argument("--ltt-grid", type=float, nargs="+", default=None,
                   help="ltt: the knob's values, most conservative first (default: τ of calibration.TAU_GRID in "
                        "[1e-3, 1], two per decade below 1e-2; fixed: max_steps N .. 1)")
    p.add_argument("--ltt-path", choices=["shared", "staircase"], default="shared",
                   help="ltt: one value for every group (shared) or ltt.staircase over the per-group grid")
    p.add_argument("--ltt-batch", type=int, default=16, help="ltt: windows decoded side by side")
    p.add_argument("--ltt-shared-rows", type=int, default=0,
                   help="ltt: decode the path's settings side by side, this many rows (settings x windows) a batch, "
                        "each record as decoded alone (0: setting by setting)")
    p.add_argument("--seed", type=int, default=1337, help="ltt: loop noise and partition seed")
    p.add_argument("--sweep", default=None, help="intervals: a finished frontier sweep directory (make frontier's OUT)")
    p.add_argument("--resamples", type=int, default=1000, help="intervals: bootstrap resamples")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256], help="settings: rows a mixed batch")
    p.add_argument("--context-steps", type=int, default=None, help="settings: eval.context_steps (a task's prompt)")
    bench_decode.add_arguments(p)
    p.add_argument("overrides", nargs="*", default=[], help="callbacks: extra Hydra overrides for both runs")
    args = p.parse_intermixed_args(argv)
    return {"callbacks": bench_callbacks, "exits": bench_exits, "train": bench_train,
            "huginn": bench_huginn, "speculative": bench_speculative, "ltt": bench_ltt,
            "intervals": bench_intervals, "settings": bench_settings,
            "decode": bench_decode.bench_decode}[args.what](args)


if __name__ == "__main__":
    main()
