"""Sliding-window attention (`model.attention_window`): a banded causal softmax, computed
here by hand, and the same records on every decode path (module, lean, compiled, batched
and compacted, both caches, the oracle's shared rows, the coda's decode, the speculative
chunk) as on the module path, token-by-token decoding under the per-step cache equal to
the parallel pass."""

import math

import pytest
import torch

from recdepth.decode import scoring as S
from recdepth.decode.generation import greedy, speculative
from recdepth.decode.settings import DecodeSettings
from recdepth.exits import build
from recdepth.model.config import GPTConfig
from recdepth.model.looped import CausalSelfAttention, LoopedGPT

W = 3


def model(window=W, groups=((1,), (2, 3)), block=20, seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=5, n_head=2, n_embd=16, block_size=block, vocab_size=40, groups=[list(g) for g in groups],
                    attention_window=window, **kw)
    m = LoopedGPT(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


TOKENS = torch.randint(0, 40, (80,), generator=torch.Generator().manual_seed(3))


def records(m, policy, step="module", batch_size=1, cache="latest", n=45, **kw):
    run = DecodeSettings(batch_size=batch_size, latency_tokens=0, warmup_tokens=0, cache=cache, seed=5, backend=step, **kw)
    return S.evaluate_exit(m, TOKENS, policy, n, run)[1]


def test_windowed_attention_is_a_banded_softmax():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=40, groups=[[1]], attention_window=W)
    attn = CausalSelfAttention(cfg)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = attn.attend(q, k, v)
    ref = torch.empty_like(out)
    for i in range(12):  # by hand: query i reads keys max(0, i - W + 1) .. i
        lo = max(0, i - W + 1)
        s = (q[:, :, i : i + 1] @ k[:, :, lo : i + 1].transpose(-1, -2)) / math.sqrt(8)
        ref[:, :, i : i + 1] = torch.softmax(s, -1) @ v[:, :, lo : i + 1]
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    k2 = k.clone()
    k2[:, :, :5] += torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64)  # outside every window from 7 on
    assert torch.equal(attn.attend(q, k2, v)[:, :, 7:], out[:, :, 7:])
    assert not torch.allclose(attn.attend(q, k2, v)[:, :, 4], out[:, :, 4])


def test_a_window_over_the_whole_block_changes_nothing():
    x = TOKENS[:20][None]
    a, b, c = (model(window=w, state_init="input") for w in (None, 20, W))
    assert torch.allclose(a(x, loops=[2, 3])[0], b(x, loops=[2, 3])[0], atol=1e-12, rtol=0)
    assert not torch.allclose(c(x, loops=[2, 3])[0], a(x, loops=[2, 3])[0])  # a real window does


@pytest.mark.parametrize("step", ["module", "lean"])
def test_decoding_with_the_per_step_cache_is_the_parallel_pass(step):
    """Under `cache=per_step` and a fixed depth, position p at application j reads every
    earlier position at application j, as the parallel pass does: the same NLL."""
    m = model(state_init="input")  # no noise: the parallel pass and decoding draw it differently
    n = 3
    rec = records(m, build("fixed", None, max_steps=n), step, batch_size=2, cache="per_step", n=19)
    x, y = TOKENS[:19][None], TOKENS[1:20][None]
    logits, _ = m(x, loops=[n, n])
    nll = m.nll(logits, y)[0].double().detach().numpy()
    assert abs(rec["nll"] - nll).max() < 1e-10


@pytest.mark.parametrize("cache", ["latest", "per_step"])
@pytest.mark.parametrize("rule, tau", [("fixed", None), ("stepnorm", 0.3), ("kl", 1e-2)])
def test_every_eager_path_equals_the_module_path(cache, rule, tau):
    m = model()
    policy = build(rule, tau, max_steps=9)
    ref = records(m, policy, "module", 1, cache)
    for step, b in (("module", 3), ("lean", 1), ("lean", 3)):  # batch 3: masked, then compacted rows
        got = records(m, policy, step, b, cache)
        assert abs(got["nll"] - ref["nll"]).max() < 1e-12, (step, b)
        assert (got["apps"] == ref["apps"]).all(), (step, b)
    assert len(set(ref["apps"].ravel().tolist())) > 1 or rule == "fixed"


def test_the_oracle_and_the_coda_decode_under_a_window():
    m = model()
    oracle = build("oracle", 0.01, max_steps=6)
    run = DecodeSettings(batch_size=2, seed=5)
    ref = S.evaluate_oracle(m, TOKENS, oracle, 40, run.replace(share_first=False))[1]
    for step in ("module", "lean"):  # the first group once per window; the lean step's shared history read once
        got = S.evaluate_oracle(m, TOKENS, oracle, 40, run.replace(backend=step))[1]
        assert abs(got["nll_by_n"] - ref["nll_by_n"]).max() < 1e-12, step
    coda = model(groups=((2,),))  # prelude, core, coda: kl decodes through the coda (PeekCache)
    kl = build("kl", 1e-2, max_steps=9, decode="coda")
    ref = records(coda, kl, "module")
    got = records(coda, kl, "lean", batch_size=3)
    assert abs(got["nll"] - ref["nll"]).max() < 1e-12 and (got["apps"] == ref["apps"]).all()


def test_speculative_decoding_is_greedy_under_a_window():
    m = model(groups=((2,),))
    policy = build("kl", 1e-2, max_steps=8)
    prompt = TOKENS[:5].tolist()
    ref = greedy(m, prompt, policy, 10, DecodeSettings(cache="per_step", seed=2))
    got = speculative(m, prompt, policy, 10, 2, 3, DecodeSettings(cache="per_step", seed=2))
    assert got.ids == ref.ids
    assert [r.apps for r in got.records] == [r.apps for r in ref.records]


@pytest.mark.slow  # 10 s of compiling; the eager lean step under the window runs by default (above)
def test_the_compiled_step_equals_the_module_path():
    m = model(dtype=torch.float32)
    policy = build("stepnorm", 0.3, max_steps=9)
    ref = records(m, policy, "module", 1, n=24)
    for b in (1, 3):  # batch 1: the loop compiled whole over attention spans; a batch: the whole block, masked
        got = records(m, policy, "compiled", b, n=24)
        assert abs(got["nll"] - ref["nll"]).max() < 1e-5, b
        assert (got["apps"] == ref["apps"]).all(), b


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_a_bad_window_is_one_line(bad):
    with pytest.raises(ValueError, match="^model.attention_window: expected null or an integer >= 1") as e:
        model(window=bad)
    assert "\n" not in str(e.value)


def test_flops_count_the_window():
    a, b = model(window=None), model(window=W)
    applications = (5 - 3) + 2 * 1 + 3 * 2  # outside layers, group 0 twice, group 1 (two layers) three times
    assert a.flops_per_token([2, 3], 16, None, False) - b.flops_per_token([2, 3], 16, None, False) == pytest.approx(
        applications * 4 * (16 - W) * 16)  # nanoGPT's 4·T·d of attention per layer application
