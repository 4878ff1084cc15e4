"""Two versions of the lean decode step side by side: ms per layer application of the
eager lean step, the other version's compiled step and this checkout's compiled step, in
interleaved rounds in one process (`recdepth.benchmarks.decode.layer_seconds`, the way `recdepth
bench decode` times the three `eval.backend`s), on fresh models of the default and paper
shapes (untrained: the cost does not depend on the weights).

    git show <commit>:recdepth/decode/lean_step.py > /tmp/lean_step_other.py
    OMP_NUM_THREADS=2 python benchmarks/lean_step_ab.py /tmp/lean_step_other.py [rounds]

One layer application = the slope of one decode step's time at context 64 from n = 2 to 6
applications per group, per looped layer; medians over the rounds. Before timing, each
step decodes the same token from the same state and noise, and its logits are compared
with the eager step's.
"""

import importlib.util
import sys

import torch

from recdepth.benchmarks.decode import GROUPS, filled, layer_seconds
from recdepth.core.runtime import tune_cpu_allocator
from recdepth.decode.engine import decode_step
from recdepth.decode.settings import DecodeSettings
from recdepth.exits import build
from recdepth.decode.lean_step import LeanSteps
from recdepth.model.looped import GPTConfig, LoopedGPT

spec = importlib.util.spec_from_file_location("lean_step_other", sys.argv[1])
other = importlib.util.module_from_spec(spec)
spec.loader.exec_module(other)
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 7
CTX = 64

tune_cpu_allocator()
for size, batches in (("cpu", (1, 16)), ("paper", (1,))):
    torch.manual_seed(0)
    model = LoopedGPT(GPTConfig.from_size(size, vocab_size=50257, groups=GROUPS)).eval()
    variants = {"lean": LeanSteps(model, False), "compiled (other)": other.LeanSteps(model, True),
                "compiled (this)": LeanSteps(model, True)}

    def use(m, k, v=variants):
        """Decode with variant k: the lean step `engine.lean_steps` hands out (the model's
        `_lean_steps`, its built steps by `eval.backend`) is that variant."""
        m._lean_steps = {"lean": v[k]}
        return DecodeSettings(backend="lean")

    for B in batches:
        with torch.no_grad():
            caches, tokens = filled(model, B, CTX, torch.Generator().manual_seed(0))
            logits = {}
            for k in variants:
                logits[k] = decode_step(model, tokens[:, CTX], CTX, caches, build("fixed", None, max_steps=6),
                                        use(model, k), generator=torch.Generator().manual_seed(1))[0]
        diff = {k: float((v - logits["lean"]).nan_to_num(0.0, 0.0, 0.0).abs().max()) for k, v in logits.items()}
        med = layer_seconds(model, B, CTX, 2, 6, 20, ROUNDS, tuple(variants), use)
        for k in variants:
            print(f"{size:5s} d={model.cfg.n_embd:3d} B={B:2d} {k:17s} {1e3 * med[k]:.4f} ms/layer application "
                  f"({med['compiled (other)'] / med[k]:.2f}x the other compiled step; max |dlogits| vs lean "
                  f"{diff[k]:.1e})", flush=True)
