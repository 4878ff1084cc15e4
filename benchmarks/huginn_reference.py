"""recdepth's greedy decoding against Huginn's reference code on the same weights.

Run outside the project's environment (it needs `transformers`, which recdepth does not):

    python -m venv --system-site-packages /tmp/hvenv && /tmp/hvenv/bin/pip install transformers==4.53.3
    git clone https://github.com/seal-rg/recurrent-pretraining /tmp/recpre   # the reference code
    OMP_NUM_THREADS=2 /tmp/hvenv/bin/python benchmarks/huginn_reference.py /tmp/recpre/recpre [new tokens] [rounds]

A small random model with Huginn's options (d = 128, prelude 2, core 4, coda 2, vocabulary
65,000 so no id is one of Huginn's stop tokens) is written with `recdepth.integrations.hf.save_hf`
and loaded twice: by Huginn's `RavenForCausalLM` (`raven_modeling_minimal.py`, via
`trust_remote_code`) and by `recdepth.integrations.hf.load_hf`. Both generate greedily from a
one-token prompt at 32 recurrence steps, batch 1, float32: Huginn's `generate_minimal`
(its dynamic per-step cache) against `recdepth.decode.generation.greedy` under `exit=fixed`
with each `eval.backend` and cache sharing. Rounds are interleaved; each prints the median
ms per generated token, its range, the ratio to Huginn's median, and how many generated
tokens equal Huginn's (the mapping check: all of them, for every row). Transformers 4.46
and 4.51 fail on this version of the reference code, 4.54 too; 4.53.3 runs it.
"""

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from recdepth.decode.generation import greedy
from recdepth.decode.settings import DecodeSettings
from recdepth.exits import build
from recdepth.integrations.hf import load_hf, save_hf
from recdepth.model.looped import GPTConfig, LoopedGPT

REF = Path(sys.argv[1])
NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 64
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
STEPS = 32

torch.manual_seed(0)
cfg = GPTConfig(n_layer=8, n_head=4, n_embd=128, block_size=512, vocab_size=65000, groups=[[2, 3, 4, 5]],
                logit_bias=False, position="rope", rope_base=50000.0, mlp="gated_silu", qk_bias=True,
                scale_embeddings=True, latent_norm=True, mean_recurrence=STEPS)
d = Path(tempfile.mkdtemp()) / "weights"
save_hf(LoopedGPT(cfg), d)
for f in ("raven_modeling_minimal.py", "raven_config_minimal.py"):
    shutil.copy(REF / f, d / f)
c = json.loads((d / "config.json").read_text())  # where transformers finds the remote code
c["auto_map"] = {"AutoConfig": "raven_config_minimal.RavenConfig",
                 "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"}
(d / "config.json").write_text(json.dumps(c))
huginn = AutoModelForCausalLM.from_pretrained(str(d), trust_remote_code=True, torch_dtype=torch.float32).eval()
ours, _ = load_hf(d)
prompt = torch.randint(0, 64000, (1, 1))
policy = build("fixed", None, max_steps=STEPS)


def run_huginn():
    gc = GenerationConfig(do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        out = huginn.generate_minimal(prompt, generation_config=gc, num_steps=STEPS, max_new_tokens=NEW)
        s = time.perf_counter() - t
    ids = out[0, 1:].tolist()
    assert len(ids) == NEW, f"Huginn stopped after {len(ids)} tokens"
    return 1000 * s / NEW, ids


def run_ours(step, cache):
    with torch.no_grad():
        g = greedy(ours, prompt[0].tolist(), policy, NEW, DecodeSettings(cache=cache, backend=step))
    return 1000 * g.seconds / NEW, g.ids


calls = [0]  # Huginn's core layers run 4 x STEPS times per token (the step count took)
for blk in huginn.transformer.core_block:
    blk.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
run_huginn()
print(f"Huginn core-layer calls per token: {calls[0] / NEW:.0f} (4 x {STEPS} = {4 * STEPS})")
kinds = [("huginn generate_minimal", run_huginn)] + [
    (f"recdepth {s} {c}", lambda s=s, c=c: run_ours(s, c)) for s in ("module", "lean", "compiled")
    for c in ("per_step", "latest")]
for _, f in kinds:  # warm-up (and compile)
    f()
ms = {k: [] for k, _ in kinds}
ids = {}
for _ in range(ROUNDS):
    for k, f in kinds:
        t, ids[k] = f()
        ms[k].append(t)
ref = statistics.median(ms[kinds[0][0]])
for k, _ in kinds:
    med = statistics.median(ms[k])
    same = sum(a == b for a, b in zip(ids[k], ids[kinds[0][0]]))
    print(f"{k:26s} {med:7.2f} ms/token ({min(ms[k]):.2f}-{max(ms[k]):.2f})  {med / ref:5.3f}x Huginn  "
          f"tokens equal to Huginn's: {same}/{NEW}")
