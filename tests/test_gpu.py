"""The GPU paths: a checkpoint opened on a CUDA GPU decodes as it does on the CPU.

CI has no GPU, so these tests are skipped there (reported as skipped, never as passed);
a session lent a GPU runs them (`python -m pytest tests/test_gpu.py`, benchmarks/gpu_check.sh;
docs/results/gpu.md).
"""

import numpy as np
import pytest
import torch

from recdepth.app.checkpoints import heldout_tokens, load_checkpoint
from recdepth.decode.scoring import evaluate_exit
from recdepth.decode.settings import DecodeSettings
from recdepth.exits import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


def test_a_checkpoint_opens_on_the_gpu_with_its_training_state(tiny_ckpt, ckpt_env):
    """map_location=cuda hands the loop sampler's generator state over on the GPU; it is
    a CPU byte tensor (the first GPU run of `recdepth evaluate device=cuda` failed on it)."""
    cpu, _ = load_checkpoint(tiny_ckpt, torch.device("cpu"))
    gpu, _ = load_checkpoint(tiny_ckpt, torch.device("cuda"))
    assert next(gpu.model.parameters()).is_cuda
    assert torch.equal(gpu.sampler.generator.get_state(), cpu.sampler.generator.get_state())
    assert [gpu.sampler.sample() for _ in range(5)] == [cpu.sampler.sample() for _ in range(5)]


@pytest.mark.parametrize("step", ["lean", "compiled"])
def test_gpu_decoding_equals_cpu_decoding(tiny_ckpt, ckpt_env, step):
    """The test split under the kl rule (τ = 1e-2: depths 5 to 8 on this checkpoint) on the GPU (eval.backend lean and compiled) and
    on the CPU (lean): NLLs within float32 rounding, applications identical but for
    tokens whose criterion lies within rounding of τ (at most 2 of 48 here)."""
    recs = {}
    for device, s in (("cpu", "lean"), ("cuda", step)):
        module, data = load_checkpoint(tiny_ckpt, torch.device(device))
        tokens = heldout_tokens(module, data, 49, 1337)
        _, recs[device] = evaluate_exit(module.model, tokens, build("kl", 1e-2, max_steps=8), 48,
                                        DecodeSettings(batch_size=4, latency_tokens=0, warmup_tokens=0, backend=s))
    a, b = recs["cpu"], recs["cuda"]
    same = (a["apps"] == b["apps"]).all(axis=1)
    assert same.sum() >= 46
    assert np.abs(a["nll"][same] - b["nll"][same]).max() <= 1e-3
    assert len(set(a["apps"].ravel().tolist())) > 1  # the rule exits at different depths: a real test of it
