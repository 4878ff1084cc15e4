"""`recdepth bench decode`: the cost of one layer application in token-by-token decoding,
per backend (`eval.backend`: module, lean, compiled), beside its arithmetic
lower bound (results: docs/results/decode-speed.md).

For each shape (the default model, or `--ckpt`'s, and the paper's d = 768) and batch size,
the cache is filled to `--context` positions and one decode step at the next position is
timed with every group looping n1 and then n2 applications (`exit=fixed`); the slope

    [t(n2) − t(n1)] / [(n2 − n1) · looped layers]

is the time of one layer application of the whole batch (the embedding, the layers outside
the loops and the LM head cancel). The three steps are timed in interleaved rounds, and
the medians are compared within the run. The lower bound is the same slope of the model's
own FLOP count (`LoopedGPT.flops_per_token`: matmuls and attention at that context) times
the batch, over this machine's fp32 matmul peak measured in the same run
(`runtime.measured_cpu_peak_flops`), or the bytes an application must read (its weights
once, each row's K/V) over the read bandwidth measured in the same run, whichever is
larger (at batch 1 and d = 768 the weights' bytes bound it). With `--ckpt`, the test split
is also scored under `--rule` with each backend and the records compared with the module
backend's (largest NLL difference, applications that differ: a criterion within rounding of
τ). `--device cuda` times the same on a GPU (each timing waits for the GPU's kernels; peak
and bandwidth measured there).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from recdepth.core.runtime import measured_cpu_peak_flops, tune_cpu_allocator
from recdepth.decode.engine import decode_step
from recdepth.decode.kv_cache import new_caches
from recdepth.decode.scoring import evaluate_exit
from recdepth.decode.settings import BACKENDS, DecodeSettings
from recdepth.exits.policy import build
from recdepth.model.looped import GPTConfig, LoopedGPT

GROUPS = [[4], [5, 6], [7]]  # the default model's recurrence groups (conf/model/grouped.yaml)


def looped_layers(model: LoopedGPT) -> int:
    return sum(len(g) for g in model.cfg.groups)


def bound_seconds(model: LoopedGPT, batch: int, context: int, n1: int, n2: int, peak: float) -> float:
    """Arithmetic lower bound of one layer application of the batch: the model's FLOPs at
    n2 minus n1 applications per group, per looped layer, times the batch, over `peak`."""
    G = model.n_groups
    f = [model.flops_per_token([n] * G, context, None, train=False) for n in (n1, n2)]
    return batch * (f[1] - f[0]) / ((n2 - n1) * looped_layers(model)) / peak


def bytes_per_layer(model: LoopedGPT, batch: int, context: int) -> float:
    """Bytes one layer application of the batch must read at least: the looped layers' and
    the adapters' state-half weights per looped layer (read once for the whole batch) and
    each row's K/V of `context` positions."""
    p = next(model.parameters())
    weights = sum(q.numel() for g, layers in enumerate(model.cfg.groups) for layer in layers
                  for q in model.h[layer].parameters())
    weights += sum(model.adapters[g].state.weight.numel() for g in range(model.n_groups))
    kv = 2 * context * model.cfg.n_embd * batch
    return (weights / looped_layers(model) + kv) * p.element_size()


def sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (a CUDA timing reads the clock after them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_rate(op, amount: float, device: torch.device, seconds: float = 0.5) -> float:
    """The best `amount` per second `op()` reaches on `device` over `seconds` of repeats
    (each timing waits for the device's kernels, `sync`)."""
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        sync(device)
        t = time.perf_counter()
        op()
        sync(device)
        best = max(best, amount / (time.perf_counter() - t))
    return best


def measured_bandwidth(nbytes: int = 1 << 28, seconds: float = 0.5, device: torch.device | None = None) -> float:
    """The best bytes/s this process reads a tensor of `nbytes` with (a sum) on `device`
    (None: the CPU): the memory side of the lower bound, as `measured_peak_flops` is the
    arithmetic side."""
    device = torch.device("cpu") if device is None else device
    x = torch.ones(nbytes // 4, device=device)
    return best_rate(x.sum, nbytes, device, seconds)


def measured_peak_flops(device: torch.device, n: int = 4096, seconds: float = 0.5) -> float:
    """This machine's fp32 matmul peak on `device`, measured: the CPU's
    (`runtime.measured_cpu_peak_flops`), or the best of square fp32 GEMMs of size `n` on a GPU
    (at torch's default fp32 matmul precision, the one decoding runs at)."""
    if device.type != "cuda":
        return measured_cpu_peak_flops()
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, device=device) for _ in range(2))
    return best_rate(lambda: a @ b, 2 * n**3, device, seconds)


@torch.no_grad()
def filled(model: LoopedGPT, batch: int, context: int, gen: torch.Generator) -> tuple[list, torch.Tensor]:
    """Caches of `batch` rows holding `context` positions (one application per group each)
    and the token ids [batch, context + 1]."""
    device = next(model.parameters()).device
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, context + 1), generator=gen).to(device)
    caches = new_caches(model, batch, model.cfg.block_size, "latest")
    one = build("fixed", None, max_steps=1)
    for p in range(context):
        decode_step(model, tokens[:, p], p, caches, one)
    return caches, tokens


def backend_settings(model: LoopedGPT, backend: str) -> DecodeSettings:
    """The settings `layer_seconds` decodes with for `backend` (an `eval.backend`): that backend."""
    return DecodeSettings(backend=backend)


@torch.no_grad()
def layer_seconds(model: LoopedGPT, batch: int, context: int, n1: int, n2: int, reps: int, rounds: int,
                  backends: tuple[str, ...], use=backend_settings) -> dict[str, float]:
    """Median seconds of one layer application per backend (the slope above), the backends
    timed in `rounds` interleaved rounds of `reps` decode steps at each n. `use(model, s)`
    returns the `DecodeSettings` the decodes of backend s run with (`backend_settings`:
    `DecodeSettings(backend=s)`; benchmarks/lean_step_ab.py passes other versions of the lean
    step). On a GPU each timing waits for the backend's kernels (`sync`)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    caches, tokens = filled(model, batch, context, gen)
    fixed = {n: build("fixed", None, max_steps=n) for n in (n1, n2)}
    per: dict[str, list[float]] = {s: [] for s in backends}
    for s in backends:  # compile (and first-call) costs out of the timings
        settings = use(model, s)
        for n in (n1, n2):
            decode_step(model, tokens[:, context], context, caches, fixed[n], settings)
    for _ in range(rounds):
        for s in backends:
            settings = use(model, s)
            t = {}
            for n in (n1, n2):
                times = []
                for _ in range(reps):
                    sync(device)
                    t0 = time.perf_counter()
                    decode_step(model, tokens[:, context], context, caches, fixed[n], settings)
                    sync(device)
                    times.append(time.perf_counter() - t0)
                t[n] = statistics.median(times)
            per[s].append((t[n2] - t[n1]) / ((n2 - n1) * looped_layers(model)))
    return {s: statistics.median(v) for s, v in per.items()}


def shapes(args, device: torch.device) -> list[tuple[str, LoopedGPT, object]]:
    """(name, model on `device`, checkpoint data or None) of each shape timed."""
    out = []
    if args.ckpt is not None:
        from recdepth.app.checkpoints import load_checkpoint

        module, data = load_checkpoint(args.ckpt, device)
        out.append(("checkpoint", module.model.eval(), (module, data)))
    else:
        cfg = GPTConfig.from_size("cpu", vocab_size=50257, groups=GROUPS)
        out.append(("default (cpu size)", LoopedGPT(cfg).to(device).eval(), None))
    if not args.no_paper:
        cfg = GPTConfig.from_size("paper", vocab_size=50257, groups=GROUPS)
        out.append(("paper (d = 768)", LoopedGPT(cfg).to(device).eval(), None))
    return out


@torch.no_grad()
def records(module, data, rule: str, tau: float | None, n_tokens: int, backends: tuple[str, ...]) -> dict:
    """The test split scored under `rule` with each backend: seconds, and the records against
    the module backend's."""
    from recdepth.app.checkpoints import checkpoint_data

    dm = checkpoint_data(module, data, 0)
    tokens = torch.as_tensor(dm.heldout_tokens(n_tokens + 1, 0))
    policy = build(rule, tau, max_steps=32)
    out, ref = {}, None
    for s in backends:
        t0 = time.perf_counter()
        _, rec = evaluate_exit(module.model, tokens, policy, n_tokens,
                               DecodeSettings(batch_size=16, latency_tokens=0, warmup_tokens=0, backend=s))
        secs = time.perf_counter() - t0
        ref = rec if ref is None else ref
        out[s] = {"s": secs, "max_dnll": float(np.abs(rec["nll"] - ref["nll"]).max()),
                  "apps_differ": int((rec["apps"] != ref["apps"]).any(axis=1).sum()), "tokens": n_tokens}
    return out


def bench_decode(args) -> dict:
    tune_cpu_allocator()
    torch.manual_seed(0)
    backends = tuple(args.backends)
    for s in backends:
        if s not in BACKENDS:
            raise ValueError(f"--backends: expected some of {', '.join(BACKENDS)}, got {s!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {args.device} asked for, but torch sees no CUDA GPU")
    peak, bw = measured_peak_flops(device), measured_bandwidth(device=device)
    n1, n2 = args.slope_loops
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"{where}: fp32 matmul peak {peak / 1e9:.0f} GFLOP/s, read bandwidth {bw / 1e9:.1f} GB/s; "
          f"one layer application = slope of decode-step time from n = {n1} to {n2} per group, context "
          f"{args.context}; bound = max(FLOPs / peak, bytes / bandwidth)", flush=True)
    rows = []
    for name, model, ckpt in shapes(args, device):
        for B in args.batches:
            secs = layer_seconds(model, B, args.context, n1, n2, args.decode_reps, args.rounds, backends)
            lb = max(bound_seconds(model, B, args.context + 1, n1, n2, peak),
                     bytes_per_layer(model, B, args.context + 1) / bw)
            for s in backends:
                row = {"shape": name, "d": model.cfg.n_embd, "batch": B, "backend": s, "ms": 1e3 * secs[s],
                       "bound_ms": 1e3 * lb, "over_bound": secs[s] / lb, "vs_module": secs.get("module", np.nan) / secs[s]}
                rows.append(row)
                print(f"{name:20s} B={B:3d} {s:9s} {row['ms']:8.4f} ms/layer application  bound {row['bound_ms']:8.4f} "
                      f"({row['over_bound']:6.1f}x)  {row['vs_module']:5.2f}x module", flush=True)
        if ckpt is not None and args.tokens:
            rec = records(*ckpt, args.rule, args.tau, args.tokens, backends)
            for s, r in rec.items():
                print(f"{name}: {args.rule} τ={args.tau} on {r['tokens']} test tokens, batch 16, backend {s}: {r['s']:.1f} s,"
                      f" max |dNLL| vs module {r['max_dnll']:.2e}, tokens whose applications differ "
                      f"{r['apps_differ']}", flush=True)
            rows.append({"shape": name, "records": rec})
        del model
    return {"peak_flops": peak, "rows": rows}


def add_arguments(p) -> None:
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), help="decode: eval.backend values to time")
    p.add_argument("--device", default="cpu", help="decode: cpu | cuda | cuda:<n> (timings wait for the GPU's kernels)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="decode: batch sizes")
    p.add_argument("--no-paper", action="store_true", help="decode: skip the paper shape (d = 768)")
    p.add_argument("--rule", default="accel", help="decode: with --ckpt, the rule the records are compared under")
    p.add_argument("--tau", type=float, default=1e-3, help="decode: its τ")
    p.add_argument("--decode-reps", type=int, default=20, help="decode: timed decode steps per n, backend and round")
