"""What the exit rules decode, the kl rule's direction and BOS at the start of hf= windows
(issue 21; docs/spec.md §1b, §3, §3b, §4).

- `exit.decode=coda`: a state is decoded as Huginn's `predict_from_latents` decodes it (the
  state leaving the loop, the layers after it, the final norm, the head), the coda's
  attention reading the earlier positions' cached K/V and the current state's own K/V
  without writing the cache. Checked against a parallel forward of the coda layers over
  the prefix's real states and the hypothetical one.
- `exit.kl_direction`: new_old = KL(p^(n) ‖ p^(n−1)), old_new = KL(p^(n−1) ‖ p^(n))
  (Huginn's F.kl_div(log p^(n), log p^(n−1), log_target=True)), each against a sum written
  out here; hf= models default to old_new.
- hf= windows: with a tokenizer BOS, each window's first input is BOS and the scored
  targets are the text's own tokens, checked against a parallel forward of [BOS] + window.
"""

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from recdepth import exits
from recdepth.config.build import conf_dir, model_config
from recdepth.decode.engine import decode_step
from recdepth.decode.generation import chunk_step, new_chunk_caches
from recdepth.decode.kv_cache import new_caches
from recdepth.decode.scoring import evaluate_exit
from recdepth.decode.settings import DecodeSettings
from recdepth.decode.state_decode import coda_logits, decode_mode, has_coda, state_decoder
from recdepth.integrations.hf import HFTokenizer, save_hf
from recdepth.model.looped import GPTConfig, LoopedGPT

V = 60
T = 16
HUGINN = dict(position="rope", mlp="gated_silu", qk_bias=True, scale_embeddings=True, latent_norm=True,
              logit_bias=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def huginn_style(seed=0, state_init="zero", n_layer=5, groups=((1, 2),)):
    """Prelude 0, core [1, 2], coda [3, 4] in float64. The coda's output projections are
    scaled up: at the init they are small, so the coda would be nearly a normalisation and
    decoding through it would hardly differ from the head."""
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=T, vocab_size=V, groups=[list(g) for g in groups],
                    mean_recurrence=4, state_init=state_init, **HUGINN)
    m = LoopedGPT(cfg).double().eval()
    with torch.no_grad():
        for layer in range(cfg.groups[-1][-1] + 1, n_layer):
            m.h[layer].attn.proj.weight.mul_(30.0)
            m.h[layer].mlp.proj.weight.mul_(30.0)
            m.h[layer].attn.qk_bias.normal_(0, 0.5)
        m.ln_f.weight.uniform_(0.5, 1.5)
    return m


def decode_prefix(m, idx, policy, caches):
    """decode_step over idx [B, P]; the states leaving the group at each position [B, P, d]
    (decode_step's `warm` slot receives them; a fresh [None] each step keeps every loop cold)."""
    leaving, apps, logits = [], [], []
    for p in range(idx.shape[1]):
        w = [None]
        lg, a = decode_step(m, idx[:, p], p, caches, policy, warm=w)
        leaving.append(w[0])
        apps.append(a)
        logits.append(lg)
    return torch.cat(leaving, 1), torch.stack(apps, 1), torch.stack(logits, 1)


def parallel_coda(m, states):
    """The slow reference: the coda layers as a parallel causal forward over states [B, t, d]
    that have already left the loop (positions 0 .. t − 1), then the head: [B, t, V_padded]."""
    x = states
    for layer in m.coda:
        x = m.h[layer](x)
    return m.decode_logits(x)


def snapshot(caches):
    return [(c.k.clone(), c.v.clone()) for c in caches]


def assert_unchanged(caches, snap):
    for c, (k, v) in zip(caches, snap):
        assert torch.equal(c.k, k) and torch.equal(c.v, v)


# ------------------------------------------------------------------ exit.decode=coda
@torch.no_grad()
def test_coda_decode_equals_a_parallel_forward_of_the_coda_and_writes_nothing():
    m = huginn_style()
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    caches = new_caches(m, 2, T)
    leaving, _, logits = decode_prefix(m, idx, exits.build("fixed", None, max_steps=3), caches)
    # the real pass is the parallel coda over the states that left the loop
    torch.testing.assert_close(logits, parallel_coda(m, leaving), rtol=1e-10, atol=1e-10)
    P = 6
    s = torch.randn(2, 1, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    snap = snapshot(caches)
    got = coda_logits(m, 0, s, caches, P)[:, 0]
    assert_unchanged(caches, snap)
    ref = parallel_coda(m, torch.cat([leaving, m.leave_group(0, s)], 1))[:, -1]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(got, m.decode_logits(s)[:, 0], atol=1e-2)  # the head is something else
    policy = exits.build("kl", 1e-3)  # what a monitor is given: the same function, per row
    torch.testing.assert_close(state_decoder(m, 0, policy, caches, P)(s[:, 0]), ref, rtol=1e-10, atol=1e-10)
    # a chunk of three hypothetical states of row 0 at positions P .. P + 2, causal among themselves
    row0 = [copy.copy(c) for c in caches]
    for c in row0:
        c.k, c.v = c.k[:1], c.v[:1]
    s3 = torch.randn(1, 3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got3 = coda_logits(m, 0, s3, row0, P)
    assert_unchanged(caches, snap)
    ref3 = parallel_coda(m, torch.cat([leaving[:1], m.leave_group(0, s3)], 1))[:, P:]
    torch.testing.assert_close(got3, ref3, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state_decoder(m, 0, policy, row0, P, chunk=True)(s3[0]), ref3[0], rtol=1e-10,
                               atol=1e-10)


def kl_new_old(lp_new, lp_old):
    """Σ p_new (log p_new − log p_old) over the real vocabulary, written out (the padded
    entries carry no probability)."""
    lp_new, lp_old = lp_new[..., :V], lp_old[..., :V]
    return float((lp_new.exp() * (lp_new - lp_old)).sum())


@torch.no_grad()
@pytest.mark.parametrize("direction", ["new_old", "old_new"])
def test_a_kl_loop_exits_where_the_kl_of_the_coda_decoded_states_says(direction):
    """Token by token under exit=kl decode=coda: at each position the engine's applications
    are those of a loop written here whose KL (in the chosen direction) comes from the
    parallel coda reference; the logits are the reference's at the exit state."""
    m = huginn_style()
    idx = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(4))
    M = 12
    caches = new_caches(m, 1, T)
    leaving = torch.zeros(1, 0, 32, dtype=torch.float64)
    kls, got_apps, ref_apps = [], [], []
    # τ between the smallest and largest KL the loops see, so that exits vary
    for tau in (3e-3,):
        policy = exits.build("kl", tau, max_steps=M, decode="coda", kl_direction=direction)
        for p in range(idx.shape[1]):
            mine = copy.deepcopy(caches)  # the reference loop writes its own copy
            x = m.h[0](m.embed(idx[:, p : p + 1], pos0=p), mine[0], p)
            e_proj = m.adapters[0].input(x)
            s = torch.zeros_like(x)
            prev, n = None, 0
            while True:
                s = m.apply_group(0, s, e_proj, mine, p)
                n += 1
                lp = F.log_softmax(parallel_coda(m, torch.cat([leaving, m.leave_group(0, s)], 1))[:, -1], -1)
                if prev is not None:
                    kl = kl_new_old(lp, prev) if direction == "new_old" else kl_new_old(prev, lp)
                    kls.append(kl)
                    if kl < tau:
                        break
                if n == M:
                    break
                prev = lp
            ref_logits = parallel_coda(m, torch.cat([leaving, m.leave_group(0, s)], 1))[:, -1]
            w = [None]
            lg, a = decode_step(m, idx[:, p], p, caches, policy, warm=w)
            torch.testing.assert_close(lg, ref_logits, rtol=1e-9, atol=1e-9)
            leaving = torch.cat([leaving, w[0]], 1)
            got_apps.append(int(a[0, 0]))
            ref_apps.append(n)
    assert got_apps == ref_apps
    assert len(set(got_apps)) > 1 and min(got_apps) < M  # the rule fired, at different depths
    assert min(abs(math.log(k / 3e-3)) for k in kls) > 1e-6  # no KL within rounding of τ


@torch.no_grad()
def test_head_and_coda_decoding_give_different_exits():
    """The same rule decoding with the head instead: another sequence of applications, so
    the tests above could tell the two apart."""
    m = huginn_style()
    idx = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(4))
    apps = {}
    for dec in ("coda", "head"):
        _, a, _ = decode_prefix(m, idx, exits.build("kl", 3e-3, max_steps=12, decode=dec), new_caches(m, 1, T))
        apps[dec] = a[0, :, 0].tolist()
    assert apps["coda"] != apps["head"]
    _, a, _ = decode_prefix(m, idx, exits.build("kl", 3e-3, max_steps=12), new_caches(m, 1, T))
    assert a[0, :, 0].tolist() == apps["coda"]  # auto = coda on a prelude/core/coda model


@torch.no_grad()
@pytest.mark.parametrize("rule", ["kl", "argmax_stability"])
def test_the_chunk_pass_decodes_through_the_coda_like_decode_step(rule):
    """One-token chunks (positions one after another, per-step cache) reproduce decode_step
    with cache=per_step exactly under a rule that decodes through the coda."""
    m = huginn_style(state_init="normal")
    policy = exits.build(rule, 3e-3, max_steps=10, patience=2)
    toks = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(6))
    from recdepth.decode.engine import RowNoise

    noise = RowNoise(5, [0])
    ref_caches = new_caches(m, 1, T, "per_step", 10)
    ref = [decode_step(m, toks[p : p + 1], p, ref_caches, policy, noise=noise) for p in range(9)]
    caches = new_chunk_caches(m, T, 10)
    got = [chunk_step(m, toks[p : p + 1], p, caches, policy, noise) for p in range(9)]
    torch.testing.assert_close(torch.cat([g[0] for g in got]), torch.cat([r[0] for r in ref]), rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.cat([g[1] for g in got]), torch.cat([r[1] for r in ref]))
    assert len(set(torch.cat([r[1] for r in ref])[:, 0].tolist())) > 1


def test_auto_decodes_through_the_coda_of_a_prelude_core_coda_model_only():
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        kinds = {name: compose("config", overrides=["run_dir=/unused", f"model={name}"]) for name in ("huginn", "grouped", "single",
                                                                                   "baseline")}
    kl = exits.build("kl", 1e-3)
    got = {name: decode_mode(LoopedGPT(model_config(cfg, 100)), kl) for name, cfg in kinds.items()}
    assert got == {"huginn": "coda", "single": "coda", "grouped": "head", "baseline": "head"}
    end = huginn_style(n_layer=3)  # one group, nothing after it: head
    assert not has_coda(end) and decode_mode(end, kl) == "head"
    m = huginn_style()
    assert has_coda(m) and state_decoder(m, 0, exits.build("kl", 1e-3, decode="head"), [], 0) == m.decode_logits
    assert state_decoder(m, 0, exits.build("accel", 1e-3, decode="coda"), [], 0) is None  # decodes nothing
    assert exits.build("kl", 1e-3).resolve(True).decode == "coda"
    assert exits.build("kl", 1e-3).resolve(False).decode == "head"
    assert exits.build("kl", 1e-3, decode="head").resolve(True).decode == "head"


def _one_line(fn, field):
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert msg.startswith(f"{field}:") and "\n" not in msg, msg


def test_bad_values_and_coda_on_several_groups_fail_in_one_line():
    _one_line(lambda: exits.build("kl", 1e-3, decode="lm_head"), "exit.decode")
    _one_line(lambda: exits.build("kl", 1e-3, kl_direction="forward"), "exit.kl_direction")
    _one_line(lambda: exits.build("kl", 1e-3, decode="coda", groups=3), "exit.decode")
    _one_line(lambda: exits.build("kl", 1e-3, decode="coda").check_model(0, 32), "exit.decode")
    assert exits.build("kl", 1e-3, decode="coda", groups=1).decode == "coda"
    grouped = huginn_style(n_layer=6, groups=((1,), (2, 3)))
    _one_line(lambda: coda_logits(grouped, 0, torch.zeros(1, 1, 32, dtype=torch.float64), [], 0), "exit.decode")
    from recdepth.config.schema import validated

    for overrides, field in ((["exit=kl", "exit.decode=lm_head"], "exit.decode"),
                             (["exit=kl", "exit.kl_direction=forward"], "exit.kl_direction"),
                             (["model=grouped", "exit=kl", "exit.decode=coda"], "exit.decode")):
        with initialize_config_dir(conf_dir(), version_base="1.3"):
            cfg = compose("config", overrides=["run_dir=/unused", *overrides])
        _one_line(lambda cfg=cfg: validated(cfg), field)


# ------------------------------------------------------------------ exit.kl_direction
def test_kl_direction_against_a_hand_computation():
    """p^(n−1) = (0.5, 0.5), p^(n) = (0.9, 0.1): KL(new‖old) = 0.9 ln 1.8 + 0.1 ln 0.2 ≈ 0.368,
    KL(old‖new) = 0.5 ln(5/9) + 0.5 ln 5 ≈ 0.511. Each direction fires exactly below its own
    value; old_new is what Huginn's F.kl_div(log p_new, log p_old, log_target=True) gives."""
    old = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log()
    new = torch.tensor([[0.9, 0.1]], dtype=torch.float64).log()
    hand = {"new_old": 0.9 * math.log(1.8) + 0.1 * math.log(0.2),
            "old_new": 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)}
    assert hand["old_new"] - hand["new_old"] > 0.1
    huginn = float(F.kl_div(new, old, reduction="none", log_target=True).sum())
    assert huginn == pytest.approx(hand["old_new"], rel=1e-12)

    def fires(direction, tau):
        mon = exits.build("kl", tau, kl_direction=direction).monitor(old, decode=lambda x: x)
        assert not bool(mon.observe(old)[0])  # n = 1: no KL yet
        return bool(mon.observe(new)[0])

    for direction, value in hand.items():
        assert fires(direction, value * (1 + 1e-9)) and not fires(direction, value * (1 - 1e-9))
    assert fires("auto", hand["new_old"] * (1 + 1e-9)) and not fires("auto", hand["new_old"] * (1 - 1e-9))
    policy = exits.build("kl", 1e-3)
    assert policy.resolve(False, hf=True).kl_direction == "old_new"
    assert policy.resolve(False, hf=False).kl_direction == "new_old"
    assert exits.build("kl", 1e-3, kl_direction="new_old").resolve(False, hf=True).kl_direction == "new_old"
    assert policy.group(0).kl_direction == "auto" and exits.build("kl", [1e-3, 1e-2], decode="head",
                                                                  kl_direction="old_new").group(1).decode == "head"


# ------------------------------------------------------------------ hf=: BOS, defaults
TEXT = ("the quick brown fox jumps over the lazy dog . a stitch in time saves nine . " * 6)
BOS, EOS = "<|begin_text|>", "<|end_text|>"


@pytest.fixture(scope="module")
def hf_bos(tmp_path_factory):
    """A zero-state Huginn-format directory whose tokenizer names a BOS (as an AddedToken
    dict, the way transformers writes it) and an EOS; block_size 16."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("huginn_bos")
    words = sorted(set(TEXT.split()))
    vocab = {w: i for i, w in enumerate(["[UNK]", BOS, EOS, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": BOS}, "eos_token": EOS}))
    m = huginn_style(n_layer=4, groups=((1, 2),)).float()
    save_hf(m, d)
    (d / "text.txt").write_text(TEXT)
    return d, vocab


def _evaluate(d, out, *overrides):
    from recdepth.evaluate import evaluate

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("evaluate", overrides=[f"hf={d}", "data=files", f"data.paths={d / 'text.txt'}",
                                             "data.val_fraction=0.5", f"run_dir={out}", "eval.latency_tokens=0",
                                             "eval.warmup_tokens=0", "device=cpu", *overrides])
    return evaluate(cfg)


def test_hf_windows_start_with_bos_and_score_the_texts_tokens(hf_bos, tmp_path):
    from recdepth.analysis.token_files import read_tokens
    from recdepth.integrations.hf import load_hf

    d, vocab = hf_bos
    tok = HFTokenizer(d)
    assert tok.bos_id == vocab[BOS] and tok.eos_id == vocab[EOS]
    n = 40  # windows of 15 scored tokens (block_size 16 minus BOS): 15 + 15 + 10
    m = _evaluate(d, tmp_path / "e", "exit=fixed", "exit.max_steps=3", f"eval.tokens={n}", "eval.cache=per_step")
    assert m["eval"]["bos"] == vocab[BOS]
    ids = [vocab[w] for w in TEXT.split()] + [vocab[EOS]]
    held = np.asarray(ids[len(ids) - round(len(ids) * 0.5):][: n + 1])
    rec = read_tokens(tmp_path / "e" / "eval_tokens.csv")
    assert np.array_equal(rec["target"], held[1:]) and np.array_equal(rec["position"], np.arange(n))
    assert np.array_equal(rec["window"], np.arange(n) // 15)
    # the reference: a parallel forward of [BOS] + each window's tokens (zero state, fixed
    # depth, per-step cache: token by token equals the parallel pass), BOS's prediction left out
    loaded, _ = load_hf(d)
    nll = []
    for start in range(0, n, 15):
        k = min(15, n - start)
        x = torch.as_tensor([vocab[BOS], *held[start : start + k + 1]])
        with torch.no_grad():
            logits, _ = loaded(x[None, :-1], loops=[3])
        nll.append(loaded.nll(logits[0, 1:], x[2:]).double().numpy())
    assert np.allclose(rec["nll"], np.concatenate(nll), atol=1e-5)
    with torch.no_grad():  # and without BOS the same targets score otherwise
        plain, _ = loaded(torch.as_tensor(held[None, :15]), loops=[3])
    assert not np.allclose(rec["nll"][:15], loaded.nll(plain[0], torch.as_tensor(held[1:16])).numpy(), atol=1e-3)


def test_hf_evaluation_defaults_to_huginns_kl_and_the_coda(hf_bos, tmp_path):
    d, _ = hf_bos
    base = ["exit=kl", "exit.tau=1e-2", "exit.max_steps=4", "eval.tokens=8"]
    m = _evaluate(d, tmp_path / "a", *base)
    assert (m["eval"]["kl_direction"], m["eval"]["decode"]) == ("old_new", "coda")
    m = _evaluate(d, tmp_path / "b", *base, "exit.kl_direction=new_old", "exit.decode=head")
    assert (m["eval"]["kl_direction"], m["eval"]["decode"]) == ("new_old", "head")


@torch.no_grad()
def test_the_oracle_with_bos_keeps_row_n_equal_to_fixed_n():
    """evaluate_exit's `bos` reaches the oracle too: its NLL at N is exit=fixed at N with BOS."""
    m = huginn_style(state_init="normal")
    tokens = torch.randint(3, V, (40,), generator=torch.Generator().manual_seed(8))
    run = DecodeSettings(seed=3, latency_tokens=0, warmup_tokens=0, bos=1)
    ev, rec = evaluate_exit(m, tokens, exits.build("fixed", None, max_steps=4), 30, run)
    ev_o, rec_o = evaluate_exit(m, tokens, exits.build("oracle", 1e-3, max_steps=4), 30, run)
    np.testing.assert_allclose(rec_o["nll_by_n"][:, -1], rec["nll"], rtol=1e-9, atol=1e-9)
    assert np.array_equal(rec_o["target"], tokens[1:31].numpy()) and np.array_equal(rec["target"], rec_o["target"])
    _, rec_plain = evaluate_exit(m, tokens, exits.build("fixed", None, max_steps=4), 30, run.replace(bos=None))
    assert np.array_equal(rec_plain["target"], rec["target"]) and not np.allclose(rec_plain["nll"], rec["nll"])
