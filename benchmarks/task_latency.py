"""Where a task's batch-1 time goes: rules timed side by side on a task checkpoint, each
token's ms split into the answers and the context, in interleaved rounds in one process.

    OMP_NUM_THREADS=2 python benchmarks/task_latency.py <ckpt> [--rules fixed:8 kl:0.01]
        [--tokens 480] [--backend compiled] [--cache per_step] [--context-steps 32] [--rounds 3] [--profile]

Each rule is `scoring.time_tokens` over the first `--tokens` held-out tokens of the test
split (whole windows, as `recdepth.evaluate` times them), warmed up first (graphs built,
untimed); the rules take turns within each round, so drift of the machine hits them alike.
Prints, per rule, the median over rounds of the mean ms per token, per answer and per
context token (the answer's own step: its loops and checks, the layers after them and the
head; a context token under `--context-steps` loops at fixed depth), and the records'
applications against the first round's (they must not change). `--profile` prints
cProfile's top functions of each rule's last round.
"""

import argparse
import cProfile
import pstats
import statistics

import numpy as np
import torch

from recdepth import exits
from recdepth.core.runtime import tune_cpu_allocator
from recdepth.decode.scoring import time_tokens
from recdepth.decode.settings import DecodeSettings
from recdepth.decode.state_decode import has_coda
from recdepth.app.checkpoints import checkpoint_data, load_checkpoint


def policy(spec: str, model) -> exits.ExitPolicy:
    """`fixed:<n>` or `<rule>:<τ>` (argmax_stability: `<k>`), at most 32 applications."""
    name, value = spec.split(":")
    if name == "fixed":
        return exits.build("fixed", None, max_steps=int(value))
    if name == "argmax_stability":
        return exits.build(name, None, max_steps=32, patience=int(value)).resolve(has_coda(model))
    return exits.build(name, float(value), max_steps=32).resolve(has_coda(model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--rules", nargs="+", default=["fixed:8", "kl:0.01"])
    ap.add_argument("--tokens", type=int, default=480)
    ap.add_argument("--backend", default="compiled")
    ap.add_argument("--cache", default="per_step")
    ap.add_argument("--context-steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    tune_cpu_allocator()
    module, data = load_checkpoint(args.ckpt, torch.device("cpu"))
    model = module.model.eval()
    dm = checkpoint_data(module, data, args.seed)
    n = args.tokens
    tokens = torch.as_tensor(dm.heldout_tokens(n + 1, 0))
    labels, targets = dm.heldout_labels(n + 1, 0), dm.heldout_targets(n + 1, 0)
    answer = np.asarray(labels)[1 : n + 1] > 0
    settings = DecodeSettings(cache=args.cache, backend=args.backend, context_steps=args.context_steps, warmup_tokens=8,
                              seed=args.seed)
    policies = {spec: policy(spec, model) for spec in args.rules}
    first = {spec: time_tokens(model, tokens, p, n, settings, labels=labels, targets=targets)
             for spec, p in policies.items()}  # warm: graphs built, the reference records
    times: dict[str, list[np.ndarray]] = {spec: [] for spec in policies}
    profiles = {}
    for r in range(args.rounds):
        for spec, p in policies.items():
            prof = cProfile.Profile() if args.profile and r == args.rounds - 1 else None
            if prof:
                prof.enable()
            ms, _, apps = time_tokens(model, tokens, p, n, settings, labels=labels, targets=targets)
            if prof:
                prof.disable()
                profiles[spec] = prof
            if not (apps == first[spec][2]).all():
                raise SystemExit(f"{spec}: applications changed between rounds")
            times[spec].append(ms)
    print(f"# {args.ckpt}: {n} tokens ({int(answer.sum())} answers), backend {args.backend}, cache {args.cache}, "
          f"context_steps {args.context_steps}, {args.rounds} rounds, threads={torch.get_num_threads()}")
    print(f"{'rule':>20s} {'ms/token':>9s} {'ms/answer':>10s} {'ms/context':>11s}  applications per answer")
    for spec, runs in times.items():
        tok = statistics.median(float(m.mean()) for m in runs)
        ans = statistics.median(float(m[answer].mean()) for m in runs)
        ctx = statistics.median(float(m[~answer].mean()) for m in runs) if (~answer).any() else float("nan")
        print(f"{spec:>20s} {tok:9.3f} {ans:10.3f} {ctx:11.3f}  {first[spec][2][answer].mean(axis=0).round(2).tolist()}")
    for spec, prof in profiles.items():
        print(f"\n## profile of {spec}, last round")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
