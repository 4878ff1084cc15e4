"""Helpers the decoding tests share (tests/decode, tests/integrations): a small float64
model and token-by-token decoding of a batch."""

import torch

from recdepth.decode.engine import decode_step, new_caches
from recdepth.decode.settings import DecodeSettings
from recdepth.model.looped import GPTConfig, LoopedGPT


def model(groups, state_init="zero", seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=5, n_head=2, n_embd=32, block_size=12, vocab_size=60, groups=groups,
                    mean_recurrence=3, state_init=state_init)
    return LoopedGPT(cfg).double().eval()


def decode_all(m, idx, policy, gen=None, sharing="latest", compact=True, noise=None):
    B, T = idx.shape
    caches = new_caches(m, B, T, sharing, policy.max_steps_bound)
    out, apps = [], []
    for t in range(T):
        logits, a = decode_step(m, idx[:, t], t, caches, policy, DecodeSettings(compact=compact), generator=gen,
                                noise=noise)
        out.append(logits)
        apps.append(a)
    return torch.stack(out, 1), torch.stack(apps, 1)
