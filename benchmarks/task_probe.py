"""A quick probe of a task (docs/results/tasks.md): the 4-layer looped model of
experiment=hops trained by a bare loop, then accuracy by difficulty at fixed depths of the
parallel forward. Faster to iterate on than the full run; not the shipped path.

    OMP_NUM_THREADS=2 POS=rope CHAINS=2 python benchmarks/task_probe.py hops 1000 32 2e-3 6 4
    args: task steps batch lr mean_recurrence backprop_depth [n_layer]; env POS (learned|rope),
    CHAINS, DISTRACTORS (hops), T (block size), INIT (state init), CACHE (token cache dir)
"""
import math, sys, time, torch, numpy as np
from recdepth.data.datamodule import TokenDataModule
from recdepth.model.looped import LoopedGPT, GPTConfig
from recdepth.training.sampler import lognormal_poisson
torch.set_num_threads(2); torch.manual_seed(0)
task, steps, B, lr, mean, bp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
nl = int(sys.argv[7]) if len(sys.argv) > 7 else 4
T = 128
kw = dict(size=(1, 4), extrapolation=(5, 8)) if task == "hops" else dict(size=(1, 4), extrapolation=(5, 6)) if task == "addition" else dict(size=(1, 6), extrapolation=(7, 9))
import os
kw.update(chains=int(os.environ.get("CHAINS", 2)), distractors=int(os.environ.get("DISTRACTORS", 2))) if task == "hops" else None
T = int(os.environ.get("T", 128))
from recdepth.config.schema import data_config
data = data_config({"source": "task", "cache_dir": os.environ.get("CACHE", "/tmp/recdepth-probe"), "loss": "answers",
                    "task": {"name": task, **{k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}}})
dm = TokenDataModule(data, T, B, steps)
dm.setup()
groups = [[1, 2]] if nl == 4 else [[1, 2, 3]] if nl == 5 else [[1]]
cfg = GPTConfig(n_layer=nl, n_head=4, n_embd=128, block_size=T, vocab_size=dm.vocab_size, n_other=dm.n_other, groups=groups, mean_recurrence=mean, logit_bias=False, position=os.environ.get("POS", "learned"), state_init=os.environ.get("INIT", "normal"))
model = LoopedGPT(cfg); opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
g = torch.Generator().manual_seed(2); t0 = time.time(); ds = dm.train_dataset()
def evaluate(ns):
    model.eval(); first, n = dm.region("test")
    toks = torch.as_tensor(dm.heldout_tokens(n + 1, 0)); lab = torch.as_tensor(dm.heldout_labels(n + 1, 0))
    X = toks[:-1].view(-1, T); Y = toks[1:].view(-1, T); L = lab[1:].view(-1, T)
    out = []
    with torch.no_grad():
        for nn in ns:
            torch.manual_seed(0); lg, _ = model(X, loops=[nn]); ok = (lg.argmax(-1) == Y)
            out.append(f"n={nn:2d} " + " ".join(f"d{d}:{ok[L == d].float().mean().item():.2f}" for d in sorted(set(L[L > 0].tolist()))[:8]))
    model.train(); return "\n".join(out)
for step in range(steps):
    lr_t = lr * min(1, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
    for pg in opt.param_groups: pg["lr"] = lr_t
    x, y = ds[step]
    n = lognormal_poisson(mean, 0.5, g)
    _, loss = model(x, y, loops=[max(n, 1)], backprop_depth=bp, generator=g)
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    if step % 250 == 0 or step == steps - 1:
        print(f"step {step} loss {loss.item():.3f} n {n} {time.time() - t0:.0f}s", flush=True)
    if step % 1000 == 999 or step == steps - 1:
        print(evaluate([1, 2, 4, 8, 16]), flush=True)
