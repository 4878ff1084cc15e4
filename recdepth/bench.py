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
the cost of one exit check relative to one loop application, measured beside the price the
cost bills for it (`state_decode.check_price`, docs/spec.md §4b), and the cost of one layer
application inside the decode loop.

`python -m recdepth.bench speculative --ckpt PATH` compares self-speculative with ordinary
greedy decoding (cache=latest, the default, and cache=per_step, whose tokens it returns) and
with greedy at a shallow fixed depth, on prompts from the test split, all timed after the
first generated token: tokens/s, speedups and acceptance rate, CIs over prompts.
`python -m recdepth.bench huginn` times Huginn's shape at small widths and extrapolates the
decode cost and memory of Huginn-0125 (an estimate).

`python -m recdepth.bench ltt --ckpt PATH` checks the guarantee of Learn-then-Test calibration
(docs/spec.md §4e; the protocol: docs/results/calibration.md): one rule's path decoded once over held-out windows, then LTT and the
empirical search on many random calibration/test halvings of them: violation rates with
95% intervals, and the layer applications each method's answer costs.

`python -m recdepth.bench intervals --sweep DIR` reads a finished frontier sweep and prints
its verdicts under the older statistics (tokens resampled, cost = mean applications) and
the current ones (whole windows, layer applications, Holm), side by side; it decodes nothing.

`python -m recdepth.bench settings --ckpt PATH` decodes a frontier grid (fixed depths, stepnorm,
kl and accel at four τ each) on the test split twice in one run: setting by setting at
`--batch` windows a batch, and as one batch of settings × windows (`scoring.decode_policies`,
`--rows` rows a batch); prints the wall times, their ratio and how far the records differ.

`python -m recdepth.bench decode [--ckpt PATH]` times one layer application of token-by-token
decoding per `eval.backend` (module, lean, compiled) at batch 1 and 16, for the default and the
paper shape, beside its arithmetic lower bound (recdepth/benchmarks/decode.py).

`python -m recdepth.bench oracle [--ckpt PATH]` times the oracle (SPEC §4b) with its first
group looped once per window against every row looping it, interleaved, and compares the
records (recdepth/benchmarks/sweeps.py).

`python -m recdepth.bench callbacks` instead times the default training run
(`python -m recdepth.train model=grouped`, exit evaluation off) twice in one process, with
`callbacks=none` and with the default `callbacks=loop_dynamics` (diagnostics at step 0,
every checkpoint and the end, figures at the end), and prints the overhead of the
loop-geometry callback: from the two wall times, and from the callback's own clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from recdepth.benchmarks import decode as bench_decode
from recdepth.benchmarks import speculative as bench_speculative
from recdepth.benchmarks import sweeps as bench_sweeps
from recdepth.core.runtime import measured_cpu_peak_flops, tune_cpu_allocator
from recdepth.model.looped import GPTConfig, LoopedGPT


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

    from recdepth.config.build import conf_dir
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
    from recdepth.decode.engine import decode_step
    from recdepth.decode.kv_cache import new_caches
    from recdepth.decode.scoring import evaluate_exit
    from recdepth.decode.settings import DecodeSettings
    from recdepth.decode.state_decode import check_price

    tune_cpu_allocator()
    torch.manual_seed(0)
    if args.ckpt:
        from recdepth.app.checkpoints import heldout_tokens, load_checkpoint

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
        decode_step(model, rows[:, 0], 0, caches, policy, generator=gen)  # warm-up token
        t = time.perf_counter()
        for pos in range(1, n + 1):
            decode_step(model, rows[:, pos], pos, caches, policy, generator=gen)
        return B * n / (time.perf_counter() - t)

    results = {"rules": []}
    print(f"\n{'rule':16s} {'tau':>7s} {'CE':>7s} {'ms/token':>9s} {'tok/s b1':>9s} "
          f"{'tok/s b' + str(args.batch_large):>10s} {'ratio':>6s} {'mean apps':>10s}  per group")
    for name in args.rules:
        for tau in (args.taus if exits.lookup(name).takes_tau else [None]):  # τ-free: once
            policy = exits.build(name, tau, max_steps=args.max_steps)
            ev, _ = evaluate_exit(model, tokens, policy, args.tokens, DecodeSettings(warmup_tokens=8, seed=0))
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
        # the price the cost bills (docs/spec.md §4b), of the head's decode timed here, in loop applications
        price = check_price(model, 0, dataclasses.replace(policy, decode="head"))["total"] / len(cfg.groups[0])
        results.setdefault("check_price", {})[name] = price
        print(f"exit check {name:16s}: {t_check * 1e6:8.1f} µs = {t_check / t_app:6.1%} of one loop application "
              f"(priced at {price:6.1%} by FLOPs)")
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
    from recdepth.decode.engine import decode_step
    from recdepth.decode.kv_cache import new_caches
    from recdepth.exits.policy import build

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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m recdepth.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="train", choices=["train", "callbacks", "exits", "huginn", "speculative", "ltt", "intervals",
                                                       "settings", "decode", "oracle"])
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
                   help="exits: rules (any registered rule, recdepth/exits/rules/builtin.py, e.g. entropy_diff cosine argmax_stability)")
    p.add_argument("--taus", type=float, nargs="+", default=[1e-5, 1e-4, 1e-3, 1e-2], help="exits: thresholds")
    p.add_argument("--tokens", type=int, default=256,
                   help="exits: tokens scored at batch 1 per rule and τ; settings, oracle: test-split tokens")
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
            "huginn": bench_huginn, "speculative": bench_speculative.bench_speculative, "ltt": bench_sweeps.bench_ltt,
            "intervals": bench_sweeps.bench_intervals, "settings": bench_sweeps.bench_settings,
            "decode": bench_decode.bench_decode, "oracle": bench_sweeps.bench_oracle}[args.what](args)


if __name__ == "__main__":
    main()
