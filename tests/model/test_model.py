"""The looped GPT-2 (SPEC §1): groups, init, adapter, truncated backprop, vocab padding, FLOPs."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from recdepth.model.config import validate_groups
from recdepth.model.looped import GPTConfig, LoopedGPT


def tiny(**kw) -> GPTConfig:
    base = dict(n_layer=6, n_head=2, n_embd=32, block_size=16, vocab_size=100, groups=[[1], [2, 3]],
                mean_recurrence=3)
    base.update(kw)
    return GPTConfig(**base)


@pytest.mark.parametrize("groups, msg", [
    ([[4], [4, 5]], "more than one group"),       # overlapping
    ([[4, 6]], "not a contiguous"),               # non-contiguous
    ([[5, 4]], "not a contiguous"),               # decreasing
    ([[11, 12]], "out of range 0..11"),           # out of range
    ([[-1]], "out of range"),
    ([[6], [4]], "layer order"),                  # unordered
    ([[]], "empty group"),
    ([4, 5], "list of lists"),
])
def test_bad_groups_are_refused_with_a_clear_message(groups, msg):
    with pytest.raises(ValueError) as e:
        validate_groups(groups, 12)
    assert msg in str(e.value) and str(e.value).startswith("model.groups")
    assert "\n" not in str(e.value)


def test_paper_groups_are_accepted():
    assert validate_groups([[4], [5, 6], [7]], 12) == [[4], [5, 6], [7]]


@pytest.mark.parametrize("kw, field", [(dict(n_embd=30, n_head=4), "model.n_embd"),
                                       (dict(state_init="ones"), "model.state_init"),
                                       (dict(n_layer=0), "model.n_layer")])
def test_bad_config_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        tiny(**kw)


def test_execution_plan_visits_each_layer_once_in_order():
    m = LoopedGPT(tiny(groups=[[1], [2, 3]]))
    assert m.plan == [("layer", 0), ("group", 0), ("group", 1), ("layer", 4), ("layer", 5)]


def test_takase_init_std():
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=32, vocab_size=4096,
                    groups=[[1, 2]], mean_recurrence=8)
    m = LoopedGPT(cfg)
    sigma = math.sqrt(2 / (5 * 256))
    l_eff = 2 + 8 * 2  # two single layers + 8 applications of a 2-layer group
    assert cfg.effective_depth == l_eff
    # A normal truncated at ±3σ has std 0.98658σ.
    trunc = 0.98658
    assert m.wte.weight.std().item() == pytest.approx(sigma * trunc, rel=0.02)
    assert m.h[0].mlp.fc.weight.std().item() == pytest.approx(sigma * trunc, rel=0.03)
    assert m.h[0].attn.qkv.weight.std().item() == pytest.approx(sigma * trunc, rel=0.03)
    out = sigma / math.sqrt(2 * l_eff)
    assert m.h[1].attn.proj.weight.std().item() == pytest.approx(out * trunc, rel=0.05)
    assert m.h[3].mlp.proj.weight.std().item() == pytest.approx(out * trunc, rel=0.05)
    assert m.adapters[0].weight().std().item() == pytest.approx(sigma * trunc, rel=0.03)
    assert m.h[2].attn.qkv.weight.abs().max().item() <= 3 * sigma + 1e-7
    assert torch.all(m.h[0].norm1.weight == 1)


def test_state_init_noise_std_and_truncation():
    m = LoopedGPT(tiny())
    e = torch.zeros(64, 16, 32)
    s = m.initial_state(e, torch.Generator().manual_seed(0))
    std = math.sqrt(2 / 5)
    assert s.std().item() == pytest.approx(std * 0.98658, rel=0.02)
    assert s.abs().max().item() <= 3 * std + 1e-6
    s2 = m.initial_state(e, torch.Generator().manual_seed(0))
    assert torch.equal(s, s2)


def test_application_matches_spec_concat_adapter():
    """u = Linear(2d -> d)(concat(s, e)) then the group's layers, written out directly."""
    torch.manual_seed(0)
    m = LoopedGPT(tiny()).double()
    s, e = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)
    u = F.linear(torch.cat([s, e], -1), m.adapters[1].weight())
    ref = m.h[3](m.h[2](u))
    got = m.apply_group(1, s, m.adapters[1].input(e))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_padded_vocab_entries_take_no_probability():
    cfg = tiny(vocab_size=100)
    assert cfg.padded_vocab_size == 128
    m = LoopedGPT(cfg)
    idx = torch.randint(0, 100, (2, 8))
    logits, loss = m(idx, idx, loops=[2, 2])
    assert logits.shape[-1] == 128
    assert torch.all(torch.isinf(logits[..., 100:]))
    ref = F.cross_entropy(logits[..., :100].reshape(-1, 100), idx.reshape(-1))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_groups_change_the_function_and_loops_matter():
    torch.manual_seed(0)
    m = LoopedGPT(tiny(state_init="zero"))
    idx = torch.randint(0, 100, (1, 8))
    a, _ = m(idx, loops=[1, 1])
    b, _ = m(idx, loops=[3, 1])
    c, _ = m(idx, loops=[3, 1])
    assert not torch.allclose(a, b) and torch.equal(b, c)


def _count_backward_calls(m, layer):
    calls = {"fwd_grad": 0, "bwd": 0}

    def fwd(mod, inp, out):
        calls["fwd_grad"] += int(torch.is_grad_enabled())

    def bwd(mod, gin, gout):
        calls["bwd"] += 1

    m.h[layer].register_forward_hook(fwd)
    m.h[layer].register_full_backward_hook(bwd)
    return calls


@pytest.mark.parametrize("n, k", [(7, 2), (3, 8), (5, 5), (6, 1)])
def test_truncated_backprop_grads_only_the_last_k_applications(n, k):
    torch.manual_seed(0)
    m = LoopedGPT(tiny(groups=[[2]]))
    calls = _count_backward_calls(m, 2)
    idx = torch.randint(0, 100, (2, 8))
    _, loss = m(idx, idx, loops=[n], backprop_depth=k)
    loss.backward()
    assert calls["fwd_grad"] == min(n, k)
    assert calls["bwd"] == min(n, k)
    # The gradient still reaches e_g (so the layers before the group learn) through W_e.
    assert m.h[1].mlp.fc.weight.grad.abs().sum() > 0
    assert m.adapters[0].input.weight.grad.abs().sum() > 0


def test_truncated_backprop_equals_detaching_the_free_prefix():
    """Independent formulation: the graded suffix started from a detached state."""
    torch.manual_seed(0)
    m = LoopedGPT(tiny(groups=[[2]], state_init="zero")).double()
    idx = torch.randint(0, 100, (2, 8))
    _, loss = m(idx, idx, loops=[6], backprop_depth=2)
    loss.backward()
    g_ref = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    x = m.embed(idx)
    x = m.h[1](m.h[0](x))
    s = torch.zeros_like(x)
    for _ in range(4):
        s = F.linear(torch.cat([s, x], -1), m.adapters[0].weight())
        s = m.h[2](s).detach()
    for _ in range(2):
        s = m.h[2](F.linear(torch.cat([s, x], -1), m.adapters[0].weight()))
    x = m.h[5](m.h[4](m.h[3](s)))
    loss2 = F.cross_entropy(m.decode_logits(x).view(-1, 128), idx.view(-1))
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad, g_ref[k], rtol=1e-9, atol=1e-12)


def test_trace_records_every_state_without_changing_logits():
    torch.manual_seed(0)
    m = LoopedGPT(tiny())
    idx = torch.randint(0, 100, (2, 8))
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a, _ = m(idx, loops=[4, 2], generator=g())
    trace = []
    b, _ = m(idx, loops=[4, 2], generator=g(), trace=trace)
    assert torch.equal(a, b)
    assert [(kind, i, len(states)) for kind, i, states in trace] == [
        ("layer", 0, 1), ("group", 0, 4), ("group", 1, 2), ("layer", 4, 1), ("layer", 5, 1)]
    assert all(s.shape == (2, 8, 32) for _, _, states in trace for s in states)
    # The last state recorded is what the head decodes; a group's last state feeds the next layer.
    torch.testing.assert_close(m.decode_logits(trace[-1][2][-1]), b, rtol=0, atol=0)
    torch.testing.assert_close(m.h[4](trace[2][2][-1]), trace[3][2][0], rtol=0, atol=0)


@pytest.mark.parametrize("groups, loops", [([], []), ([[1], [2, 3]], [3, 2]), ([[0, 1, 2, 3, 4, 5]], [2])])
def test_flop_count_matches_torch_flop_counter(groups, loops):
    """Forward FLOPs from our formula vs torch's own counter of the ops actually run."""
    m = LoopedGPT(tiny(groups=groups))
    B, T = 2, 16
    idx = torch.randint(0, 100, (B, T))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m(idx, loops=loops)
    ours = m.flops_per_token(loops, T, None, train=False) * B * T
    # torch's counter skips CPU scaled_dot_product_attention; our formula adds nanoGPT's
    # attention term, 4·T·d per token per layer application, on top of the matmuls.
    apps = (6 - sum(len(g) for g in groups)) + sum(len(g) * n for g, n in zip(groups, loops))
    attention = apps * 4 * T * 32 * B * T
    assert ours - attention == pytest.approx(fc.get_total_flops(), rel=1e-9)


def test_train_flops_count_graded_work_three_times():
    m = LoopedGPT(tiny(groups=[[2]]))
    f_eval = m.flops_per_token([6], 16, 2, train=False)
    f_train = m.flops_per_token([6], 16, 2, train=True)
    f_full = m.flops_per_token([6], 16, None, train=True)
    # 4 no-grad applications are counted once instead of 3 times.
    app = 2 * 12 * 32 * 32 + 4 * 16 * 32 + 2 * 32 * 32
    assert f_full - f_train == pytest.approx(4 * app * 2)
    assert f_full == pytest.approx(3 * f_eval)


def test_logit_bias_starts_at_the_prior_and_can_be_switched_off():
    """With the prior in the bias and a zero embedding, the model predicts exactly the
    prior: its CE on any targets is the prior's CE, computed directly."""
    m = LoopedGPT(tiny(vocab_size=100))
    prior = torch.log_softmax(torch.randn(100), -1)
    m.init_logit_bias(prior)
    with torch.no_grad():
        m.wte.weight.zero_()
    idx = torch.randint(0, 100, (2, 8))
    _, loss = m(idx, idx, loops=[2, 2])
    assert loss.item() == pytest.approx(-prior[idx].mean().item(), rel=1e-6)
    plain = LoopedGPT(tiny(logit_bias=False))
    assert plain.lm_bias is None and "lm_bias" not in dict(plain.named_parameters())
    with pytest.raises(ValueError, match="logit_bias"):
        plain.init_logit_bias(prior)


def test_other_entry_ce_equals_the_full_vocabulary_ce_of_an_equivalent_model():
    """SPEC §4, vocabulary: a compact model whose last logit is "other" (shared by n_other
    tokenizer ids) scores exactly what a full-vocabulary model scores, where every unseen id
    has "other"'s embedding row and bias − log n_other (so each gets p(other) / n_other)."""
    torch.manual_seed(0)
    full_V, seen = 40, torch.tensor([0, 3, 4, 7, 9, 10, 15, 22, 23, 30, 31, 39])
    unseen = torch.tensor([i for i in range(full_V) if i not in set(seen.tolist())])
    n_other = len(unseen)
    compact = LoopedGPT(tiny(vocab_size=len(seen) + 1, n_other=n_other, state_init="zero")).double()
    with torch.no_grad():
        compact.lm_bias.normal_()
    full = LoopedGPT(tiny(vocab_size=full_V, state_init="zero")).double()
    sd = {k: v for k, v in compact.state_dict().items() if k not in ("wte.weight", "lm_bias")}
    full.load_state_dict(sd, strict=False)
    with torch.no_grad():
        other = compact.cfg.other_id
        full.wte.weight[seen] = compact.wte.weight[: len(seen)]
        full.wte.weight[unseen] = compact.wte.weight[other]
        full.lm_bias[seen] = compact.lm_bias[: len(seen)]
        full.lm_bias[unseen] = compact.lm_bias[other] - math.log(n_other)
    gpt = torch.randint(0, full_V, (3, 16))
    assert (~torch.isin(gpt, seen)).any()
    to_compact = torch.full((full_V,), other)
    to_compact[seen] = torch.arange(len(seen))
    ids = to_compact[gpt]
    x, y = ids[:, :-1], ids[:, 1:]
    _, loss_c = compact(x, y)
    _, loss_f = full(gpt[:, :-1], gpt[:, 1:])
    assert loss_c.item() == pytest.approx(loss_f.item(), rel=1e-12)
    # and the full model's distribution sums to one, so this is a proper cross-entropy
    logits, _ = full(gpt[:, :-1])
    assert torch.allclose(logits.float().softmax(-1).sum(-1), torch.ones(3, 15), atol=1e-6)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_scale_embeddings_scales_token_and_learned_position(position):
    """scale_embeddings multiplies the whole input embedding by sqrt(d): the token's and,
    with learned positions, the position's (Huginn has none; docs/spec.md §1b). Checked
    against a lookup by hand, at an offset pos0 as token-by-token decoding asks for."""
    torch.manual_seed(0)
    plain = LoopedGPT(tiny(position=position))
    scaled = LoopedGPT(tiny(position=position, scale_embeddings=True))
    scaled.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 100, (2, 5))
    d = plain.cfg.n_embd
    for pos0 in (0, 3):
        want = plain.wte.weight[idx]
        if position == "learned":
            want = want + plain.wpe.weight[pos0 : pos0 + 5]
        torch.testing.assert_close(plain.embed(idx, pos0), want)
        torch.testing.assert_close(scaled.embed(idx, pos0), want * math.sqrt(d))


def test_reset_parameters_names_every_parameter_and_refuses_one_it_does_not_know():
    """A parameter the init table (looped.INIT) does not name is a one-line error, not a
    truncated normal it was never meant to start from (a gain meant to start at 1)."""
    from recdepth.model import looped

    m = LoopedGPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32, groups=[[1, 2]]))
    m.h[2].register_parameter("gain", torch.nn.Parameter(torch.zeros(())))
    with pytest.raises(ValueError) as e:
        m.reset_parameters()
    msg = str(e.value)
    assert "\n" not in msg and "'h.2.gain'" in msg and "'h.gain'" in msg and "INIT" in msg
    looped.INIT["h.gain"] = "ones"
    try:
        m.reset_parameters()
        assert m.h[2].gain.item() == 1.0
    finally:
        del looped.INIT["h.gain"]
