"""Token-by-token decoding with a KV cache under exit rules (SPEC §4)."""

import pytest
import torch
import torch.nn.functional as F

from recdepth import exits
from recdepth.decode import mixed as mixed_settings
from recdepth.decode.engine import RowNoise, decode_step, new_caches
from recdepth.decode.scoring import evaluate_exit, evaluate_oracle
from recdepth.decode.settings import DecodeSettings
from recdepth.model.looped import LoopedGPT
from tests.decode.helpers import decode_all, model


def test_kv_cache_decoding_equals_parallel_forward_without_recurrence():
    m = model([])
    idx = torch.randint(0, 60, (3, 12))
    ref, _ = m(idx, loops=[])
    got, _ = decode_all(m, idx, exits.build("fixed", None, max_steps=1))
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_one_application_per_group_equals_parallel_forward():
    """With one application, "latest" K/V sharing and the parallel pass coincide."""
    m = model([[1], [2, 3]])
    idx = torch.randint(0, 60, (2, 12))
    ref, _ = m(idx, loops=[1, 1])
    got, apps = decode_all(m, idx, exits.build("fixed", None, max_steps=1))
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    assert torch.all(apps == 1)


def test_last_position_equals_parallel_forward_on_its_own_prefix_for_fixed_n():
    """The first token has no earlier positions, so its loop is the parallel loop exactly."""
    m = model([[1], [2, 3]])
    idx = torch.randint(0, 60, (1, 1))
    ref, _ = m(idx, loops=[4, 4])
    got, apps = decode_all(m, idx, exits.build("fixed", None, max_steps=4))
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    assert apps.tolist() == [[[4, 4]]]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("n", [2, 5])
def test_per_step_cache_with_fixed_n_equals_the_parallel_forward(dtype, tol, n):
    """exit=fixed with budget n and a per-application cache: every position's decode-mode
    logits equal the parallel pass with n applications per group."""
    m = model([[1], [2, 3]]).to(dtype)
    idx = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(n))
    ref, _ = m(idx, loops=[n, n])
    got, apps = decode_all(m, idx, exits.build("fixed", None, max_steps=n), sharing="per_step")
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    assert torch.all(apps == n)
    # ... which "latest" sharing does not reproduce beyond the first token (SPEC §4).
    latest, _ = decode_all(m, idx, exits.build("fixed", None, max_steps=n))
    torch.testing.assert_close(latest[:, 0], ref[:, 0], rtol=tol, atol=tol)
    assert (latest[:, 1:, :60] - ref[:, 1:, :60]).abs().max() > 100 * tol  # the real vocabulary


def test_step_cache_finish_fills_later_slots_with_the_last_application():
    from recdepth.decode.engine import StepKVCache

    c = StepKVCache(3, 2, 5, 4, "cpu", torch.float64, max_steps=6)
    c.k.normal_()
    c.v.normal_()
    k0, v0 = c.k.clone(), c.v.clone()
    n = torch.tensor([1, 4, 6])
    c.finish(2, n)
    for b in range(3):
        for j in range(6):
            src = min(j, int(n[b]) - 1)
            assert torch.equal(c.k[b, :, j, 2], k0[b, :, src, 2]) and torch.equal(c.v[b, :, j, 2], v0[b, :, src, 2])
    assert torch.equal(c.k[:, :, :, [0, 1, 3, 4]], k0[:, :, :, [0, 1, 3, 4]])  # other positions untouched


@torch.no_grad()
def test_latest_sharing_reads_earlier_positions_at_their_last_application():
    """Slow reference for token 1 of a one-layer-group model: position 0's cached K/V come
    from its last application; token 1's loop attends to them and to its own current K/V."""
    m = model([[1]])
    idx = torch.randint(0, 60, (1, 2))
    n = 3
    got, _ = decode_all(m, idx, exits.build("fixed", None, max_steps=n))
    attn = m.h[1].attn

    def kv(h):  # K/V of layer 1 at one position, from its normed input
        q, k, v = attn.qkv(m.h[1].norm1(h)).split(32, -1)
        return q, k, v

    def layer1(h, k_other, v_other):
        q, k, v = kv(h)
        K, V = torch.cat([k_other, k], 0), torch.cat([v_other, v], 0)
        heads = []
        for hd in range(2):
            sl = slice(16 * hd, 16 * hd + 16)
            w = torch.softmax(q[:, sl] @ K[:, sl].T / 4.0, -1)
            heads.append(w @ V[:, sl])
        x = m.h[1].norm2(attn.proj(torch.cat(heads, -1)) + h)
        mlp = m.h[1].mlp  # proj(SiLU(fc(.))), written out (SPEC §1)
        return m.h[1].norm4(mlp.proj(F.silu(mlp.fc(m.h[1].norm3(x)))) + x)

    W = m.adapters[0].weight()
    x0 = m.h[0](m.embed(idx[:, :1]))[0]  # position 0 alone
    s = torch.zeros_like(x0)
    empty = torch.zeros(0, 32, dtype=torch.float64)
    for _ in range(n):
        u = torch.cat([s, x0], -1) @ W.T
        last_u = u
        s = layer1(u, empty, empty)
    _, k0, v0 = kv(last_u)  # position 0's latest entry
    x1 = m.h[0](m.embed(idx))[0, 1:]  # layer 0 at position 1 (causal, so same as decode)
    s = torch.zeros_like(x1)
    for _ in range(n):
        s = layer1(torch.cat([s, x1], -1) @ W.T, k0, v0)
    h = s
    # The engine: position 0's cached K/V, then token 1's group state.
    caches = new_caches(m, 1, 2)
    decode_step(m, idx[:, 0], 0, caches, exits.build("fixed", None, max_steps=n))
    torch.testing.assert_close(caches[1].k[0, :, 0].reshape(-1), k0[0], rtol=1e-10, atol=1e-12)
    from recdepth.decode.engine import loop_group

    e1 = m.h[0](m.embed(idx[:, 1:2], pos0=1), caches[0], 1)
    s_engine, _ = loop_group(m, 0, e1, exits.build("fixed", None, max_steps=n), caches, 1)
    torch.testing.assert_close(s_engine[0], h, rtol=1e-10, atol=1e-10)
    assert got.shape == (1, 2, 64)


@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("sharing", ["latest", "per_step"])
def test_batched_rows_get_exactly_their_batch_one_results(sharing, compact):
    """Exited rows either skipped (compact: the layers run on the looping rows only) or
    computed and masked: every row still gets exactly what it gets alone."""
    m = model([[1], [2, 3]], state_init="zero")
    idx = torch.randint(0, 60, (4, 12))
    for policy in (exits.build("accel", 0.5, max_steps=12), exits.build("kl", 1e-3, max_steps=12),
                   exits.build("stepnorm", 0.5, max_steps=12),
                   exits.build("entropy_diff", [1e-3, 1e-2], max_steps=[12, 9])):  # one tau per group
        batched, apps_b = decode_all(m, idx, policy, sharing=sharing, compact=compact)
        assert len(set(apps_b.flatten().tolist())) > 1  # rows and tokens really exit at different n
        for r in range(4):
            alone, apps_1 = decode_all(m, idx[r : r + 1], policy, sharing=sharing)
            torch.testing.assert_close(batched[r : r + 1], alone, rtol=1e-9, atol=1e-9)
            assert torch.equal(apps_b[r : r + 1], apps_1)
        assert len(set(apps_b[:, :, 0].flatten().tolist())) > 1  # rows really exit at different n


@torch.no_grad()
def test_engine_exit_counts_equal_iterate_on_the_same_states():
    m = model([[1], [2, 3]], state_init="zero")
    idx = torch.randint(0, 60, (1, 6))
    policy = exits.build("accel", 0.05, max_steps=20)
    caches = new_caches(m, 1, 6)
    for t in range(5):
        decode_step(m, idx[:, t], t, caches, policy)
    # Token 5, group 0: run the engine, then iterate() with the same f on a copy of the cache.
    import copy

    e = m.h[0](m.embed(idx[:, 5:6], pos0=5), caches[0], 5)
    c2 = copy.deepcopy(caches)
    from recdepth.decode.engine import loop_group

    s_eng, n_eng = loop_group(m, 0, e, policy, caches, 5)
    e_proj = m.adapters[0].input(e)
    f = lambda s: m.apply_group(0, s[:, None], e_proj, c2, 5)[:, 0]  # noqa: E731
    x, n_it = exits.iterate(f, torch.zeros(1, 32, dtype=torch.float64), policy)
    assert n_eng.tolist() == n_it.tolist()
    torch.testing.assert_close(s_eng[:, 0], x)


def test_evaluate_exit_reports_quality_cost_and_latency():
    m = model([[1], [2, 3]], state_init="normal")
    tokens = torch.randint(0, 60, (40,))
    res, rec = evaluate_exit(m.float(), tokens, exits.build("fixed", None, max_steps=3), n_tokens=30,
                             settings=DecodeSettings(latency_tokens=10, repeats=3))
    assert res["tokens"] == 30 and res["applications_per_token"] == [3.0, 3.0]
    assert res["ms_per_token_min"] <= res["ms_per_token"] <= res["ms_per_token_max"]
    assert res["ms_per_token"] > 0 and abs(res["ppl"] - 2.718281828 ** res["ce"]) < 1e-6 * res["ppl"]
    # The per-token record: windows of block_size = 12 tokens, targets in stream order.
    assert rec["position"].tolist() == list(range(30)) and rec["window"].tolist() == [0] * 12 + [1] * 12 + [2] * 6
    assert rec["target"].tolist() == tokens[1:31].tolist()
    assert rec["nll"].mean() == pytest.approx(res["ce"], rel=1e-12)
    assert (rec["ms"][:10] > 0).all() and __import__("numpy").isnan(rec["ms"][10:]).all()
    assert res["ce_ci"][0] < res["ce"] < res["ce_ci"][1]
    # The CE is the mean NLL of the scored targets: with a model that ignores its input
    # (zero LM head and bias), CE = log V.
    with torch.no_grad():
        m.wte.weight.zero_()
        m.lm_bias.zero_()
    res, _ = evaluate_exit(m, tokens, exits.build("fixed", None, max_steps=2), n_tokens=30)
    assert abs(res["ce"] - torch.log(torch.tensor(60.0)).item()) < 1e-5


def test_kl_is_finite_with_a_padded_vocabulary():
    """Padded logits are -inf; KL must treat their 0·log 0 terms as 0, not NaN."""
    logits_old = torch.tensor([[0.0, 1.0, float("-inf")]])
    logits_new = torch.tensor([[0.5, 0.2, float("-inf")]])
    lp_new, lp_old = logits_new.log_softmax(-1), logits_old.log_softmax(-1)
    kl = exits.kl_divergence(lp_new, lp_old)
    p, q = lp_new[0, :2].exp(), lp_old[0, :2].exp()
    assert torch.isfinite(kl).all()
    assert kl.item() == __import__("pytest").approx((p * (p / q).log()).sum().item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_and_entropy_sum_as_the_zeroed_terms_do(dtype):
    """`kl_divergence` and `entropy` sum p·(...) with `nansum` (one pass): the same bits as
    zeroing the p = 0 terms with `where` and summing (the form they replaced, whose value
    the recorded frontiers hold), on a padded vocabulary and on rows whose p underflows to
    0, and a float64 reference over the unpadded entries within rounding."""
    g = torch.Generator().manual_seed(4)
    scale = 30 if dtype == torch.float32 else 250  # log p down to -240 | -2000: some p underflow to 0
    z = scale * torch.randn(64, 19200, generator=g, dtype=dtype)
    z2 = z + 0.3 * torch.randn(64, 19200, generator=g, dtype=dtype)
    z[:, 19000:], z2[:, 19000:] = float("-inf"), float("-inf")  # the padded entries
    new, old = z.log_softmax(-1), z2.log_softmax(-1)
    p = new.exp()
    assert (p[:, :19000] == 0).any()
    assert torch.equal(exits.kl_divergence(new, old), torch.where(p > 0, p * (new - old), 0.0).sum(-1))
    assert torch.equal(exits.entropy(new), -torch.where(p > 0, p * new, 0.0).sum(-1))
    n64, o64 = new[:, :19000].double(), old[:, :19000].double()
    ref = (n64.exp() * (n64 - o64)).sum(-1)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    assert torch.allclose(exits.kl_divergence(new, old).double(), ref, rtol=tol, atol=tol)
    assert torch.allclose(exits.entropy(new).double(), -(n64.exp() * n64).sum(-1), rtol=tol, atol=tol)


# Every registered rule (but those reading a halting head, which needs a model with one
# recurrence group: tests/exits/test_halt.py) at a τ where it exits at varied n on this model
# (argmax_stability: its k); a rule not in TUNED (a newcomer's) at its own default τ. Then
# per-group values (this model has two groups) and the learned gate.
TUNED = {"fixed": (None, {}), "stepnorm": (0.3, {}), "stepnorm_rel": (0.05, {}), "kl": (1e-3, {}),
         "accel": (0.5, {}), "accel_rel": (0.6, {}), "entropy_diff": (1e-3, {}), "cosine": (1e-2, {}),
         "argmax_stability": (None, {"patience": 2})}
RULES = [(n, *TUNED.get(n, (exits.lookup(n).default_tau, {}))) for n in exits.names()
         if not (exits.lookup(n).reads_head or exits.lookup(n).gated)] + [
    ("cosine", [1e-2, 1e-3], {}),
    ("argmax_stability", None, {"patience": 1, "min_steps": [0, 4], "max_steps": [12, 9]}),
    # the learned gate (recdepth/exits/gate.py): a random one per group, weight [2, 32], bias [2]
    ("gate", [0.5, 0.3], {"gate": (0.3 * torch.randn(2, 32, generator=torch.Generator().manual_seed(11),
                                                     dtype=torch.float64), torch.tensor([0.0, 0.5]))})]


@pytest.mark.parametrize("rule, tau, kw", RULES, ids=lambda v: str(v).replace(" ", ""))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_rows_with_noisy_initial_states_equal_batch_one(rule, tau, kw, dtype):
    """SPEC §4, noise and batches: with state_init=normal, row r's noise comes from (seed,
    sequence, position, group), so batch B reproduces batch 1, for every rule. float64:
    the same logits (to rounding of the batched matmuls) and the same applications;
    float32: logits within 1e-4, applications equal except where a criterion lies within
    rounding of τ (counted; none on this model)."""
    m = model([[1], [2, 3]], state_init="normal").to(dtype)
    idx = torch.randint(0, 60, (4, 12), generator=torch.Generator().manual_seed(3))
    policy = exits.build(rule, tau, **{"max_steps": 12 if rule != "fixed" else 5, **kw})
    batched, apps_b = decode_all(m, idx, policy, noise=RowNoise(7, [10, 11, 12, 13]))
    if rule != "fixed":
        assert len(set(apps_b.flatten().tolist())) > 1  # rows and tokens really exit at different n
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    mismatched = 0
    for r in range(4):
        alone, apps_1 = decode_all(m, idx[r : r + 1], policy, noise=RowNoise(7, [10 + r]))
        torch.testing.assert_close(batched[r : r + 1], alone, rtol=tol, atol=tol)
        mismatched += int((apps_b[r : r + 1] != apps_1).sum())
    assert mismatched == 0
    # The keyed noise really is noise: another sequence id gives other logits.
    other, _ = decode_all(m, idx[:1], policy, noise=RowNoise(7, [99]))
    assert (other - batched[:1])[..., :60].abs().max() > 1e-3


def test_a_shared_generator_breaks_batch_one_equality():
    """Why the noise is keyed per row: drawing all rows from one generator (the old
    engine) gives a row in a batch other noise than alone, hence other logits."""
    m = model([[1], [2, 3]], state_init="normal")
    idx = torch.randint(0, 60, (3, 6), generator=torch.Generator().manual_seed(4))
    policy = exits.build("accel", 0.5, max_steps=12)
    batched, _ = decode_all(m, idx, policy, gen=torch.Generator().manual_seed(0))
    alone, _ = decode_all(m, idx[1:2], policy, gen=torch.Generator().manual_seed(0))
    assert (batched[1:2] - alone)[..., :60].abs().max() > 1e-3


@pytest.mark.parametrize("rule, tau", [("accel", 0.5), ("kl", 1e-3)])
def test_evaluate_exit_batched_equals_batch_one_records(rule, tau):
    m = model([[1], [2, 3]], state_init="normal")
    tokens = torch.randint(0, 60, (60,), generator=torch.Generator().manual_seed(5))
    policy = exits.build(rule, tau, max_steps=12)
    ev1, r1 = evaluate_exit(m, tokens, policy, 50, DecodeSettings(batch_size=1, latency_tokens=0, seed=3))
    ev4, r4 = evaluate_exit(m, tokens, policy, 50, DecodeSettings(batch_size=4, latency_tokens=20, seed=3))
    assert __import__("numpy").allclose(r1["nll"], r4["nll"], rtol=0, atol=1e-10)
    assert (r1["apps"] == r4["apps"]).all() and len(set(r4["apps"].flatten().tolist())) > 1
    assert ev4["batch_check"] == {"tokens": 20, "apps_mismatch": 0, "max_abs_dnll": ev4["batch_check"]["max_abs_dnll"]}
    assert ev4["batch_check"]["max_abs_dnll"] < 1e-10


@torch.no_grad()
# latest: slow (default-suite time, docs/results/test-suite.md); per_step runs by default
@pytest.mark.parametrize("sharing", [pytest.param("latest", marks=pytest.mark.slow), "per_step"])
def test_oracle_n_equals_brute_force(sharing):
    """SPEC §4b oracle, by brute force: for every token t and every n, decode tokens
    0..t-1 at fixed N (batch 1, the same noise keys), then token t at fixed n; the oracle's
    n is the smallest whose NLL is within ε of the NLL at N."""
    import numpy as np

    m = model([[1], [2, 3]], state_init="normal")
    T, N, eps, seed = 12, 6, 0.02, 11
    tokens = torch.randint(0, 60, (20,), generator=torch.Generator().manual_seed(6))
    ev, rec = evaluate_oracle(m, tokens, exits.build("oracle", eps, max_steps=N), 19,
                              DecodeSettings(seed=seed, cache=sharing, batch_size=2))
    brute = np.zeros((19, N))
    for t in range(19):
        w, p = divmod(t, T)
        window = tokens[w * T : w * T + T + 1]
        for n in range(1, N + 1):
            caches = new_caches(m, 1, T, sharing, N)
            noise = RowNoise(seed, [w])
            for q in range(p):
                decode_step(m, window[q : q + 1], q, caches, exits.build("fixed", None, max_steps=N), noise=noise)
            logits, a = decode_step(m, window[p : p + 1], p, caches, exits.build("fixed", None, max_steps=n),
                                    noise=noise)
            assert a.tolist() == [[n, n]]
            brute[t, n - 1] = m.nll(logits, window[p + 1 : p + 2]).item()
    np.testing.assert_allclose(rec["nll_by_n"], brute, rtol=0, atol=1e-10)
    n_brute = np.array([min(n for n in range(1, N + 1) if abs(brute[t, n - 1] - brute[t, -1]) <= eps) for t in range(19)])
    assert (rec["apps"] == n_brute[:, None]).all() and len(set(n_brute.tolist())) > 1
    assert ev["mean_applications"] == pytest.approx(n_brute.mean())
    assert ev["ce"] == pytest.approx(brute[np.arange(19), n_brute - 1].mean(), abs=1e-10)
    # its n = N row is exit=fixed max_steps=N exactly
    ev_fixed, rec_fixed = evaluate_exit(m, tokens, exits.build("fixed", None, max_steps=N), 19,
                                        DecodeSettings(seed=seed, cache=sharing, latency_tokens=0))
    np.testing.assert_allclose(rec["nll_by_n"][:, -1], rec_fixed["nll"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("pos", [0, 1, 5, 9])
@pytest.mark.parametrize("active", ["all", "some", "one"])
def test_attention_over_a_shared_history_equals_each_rows_own(pos, active):
    """`attend_shared` (the history read once per block of rows) equals `attend_rows` (each
    row's own cache) when every row of a block holds the same entries before pos and its
    own at pos, for every row subset, at pos 0 (only its own entry) too. float64."""
    from recdepth.decode.lean_step import attend_shared
    from recdepth.model.looped import attend_rows

    g = torch.Generator().manual_seed(pos)
    W, reps, H, T, hd = 3, 4, 2, 12, 8
    hist_k = torch.randn(W, H, T, hd, generator=g, dtype=torch.float64).repeat_interleave(reps, 0)
    hist_v = torch.randn(W, H, T, hd, generator=g, dtype=torch.float64).repeat_interleave(reps, 0)
    R = W * reps
    rows = {"all": torch.arange(R), "some": torch.tensor([0, 3, 5, 6, 7, 11]), "one": torch.tensor([7])}[active]
    q, k, v = (torch.randn(len(rows), H, 1, hd, generator=g, dtype=torch.float64) for _ in range(3))
    ck, cv = hist_k.clone(), hist_v.clone()
    ck[rows, :, pos], cv[rows, :, pos] = k[:, :, 0], v[:, :, 0]  # each row's own entry at pos
    ck[:, :, pos + 1 :] = cv[:, :, pos + 1 :] = float("nan")  # later positions are never read
    ref = attend_rows(q, ck[:, :, : pos + 1], cv[:, :, : pos + 1], rows)
    out = attend_shared(q, k, v, ck, cv, pos, rows, reps)
    assert out.shape == ref.shape == (len(rows), H, 1, hd)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("groups, sharing, warm_start, bos", [([[1], [2, 3]], "latest", False, None),
                                                              ([[1], [2, 3]], "latest", True, 7),
                                                              ([[1], [2], [3]], "per_step", False, None)])
def test_oracle_under_the_lean_step_reads_the_shared_history_once_per_window(groups, sharing, warm_start, bos):
    """Under the lean step the oracle's rows read their window's shared history once per
    window (`lean_step.attend_shared`, in the later groups and the layers outside the loops):
    NLL at every n and the oracle's n equal the module step's (each row attending to its own
    cache), float64 to rounding, and the shared attention really ran."""
    import numpy as np

    from recdepth.decode import lean_step as L

    m = model(groups, state_init="normal")
    tokens = torch.randint(0, 60, (40,), generator=torch.Generator().manual_seed(6))
    policy = exits.build("oracle", 0.02, max_steps=6)
    run = DecodeSettings(seed=3, cache=sharing, batch_size=2, warm_start=warm_start, bos=bos)
    _, ref = evaluate_oracle(m, tokens, policy, 35, run.replace(backend="module"))
    calls, real = [], L.attend_shared

    def counted(*a):
        calls.append(1)
        return real(*a)

    L.attend_shared = counted
    try:
        _, rec = evaluate_oracle(m, tokens, policy, 35, run.replace(backend="lean"))
    finally:
        L.attend_shared = real
    assert calls
    np.testing.assert_allclose(rec["nll_by_n"], ref["nll_by_n"], rtol=0, atol=1e-10)
    assert (rec["apps"] == ref["apps"]).all() and len(set(ref["apps"].ravel().tolist())) > 1


@torch.no_grad()
@pytest.mark.parametrize("groups, sharing, warm_start, bos", [([[1], [2, 3]], "latest", False, None),
                                                              ([[1], [2, 3]], "per_step", True, 7),
                                                              ([[1, 2]], "latest", True, None),
                                                              ([[2, 3]], "per_step", False, 7)])
def test_oracle_rows_loop_the_first_group_once_per_window(groups, sharing, warm_start, bos):
    """The oracle's N rows of a window share the first group's trajectory (`loop_shared`):
    the same NLL, argmax, applications and traced states as every row looping it
    (`share_first=False`), in float64 to rounding, while the first group's layer runs
    N applications per window and position instead of 1 + 2 + … + N."""
    from recdepth.decode.engine import decode_windows

    m = model(groups, state_init="normal")
    N, T = 5, 12
    tokens = torch.randint(0, 60, (30,), generator=torch.Generator().manual_seed(8))
    wins = [(0, T - (bos is not None)), (T - (bos is not None), 9)]
    limit = torch.arange(1, N + 1).repeat(len(wins))
    first = groups[0][0]
    out, rows = {}, {}
    for share in (True, False):
        seen = []
        hook = m.h[first].register_forward_hook(lambda mod, args, y, seen=seen: seen.append(y.shape[0]))
        trace = []
        run = DecodeSettings(cache=sharing, seed=4, warm_start=warm_start, bos=bos, share_first=share)
        out[share] = decode_windows(m, tokens, wins, exits.build("fixed", None, max_steps=N), run,
                                    reps=N, limit=limit, trace=trace) + (torch.stack(trace),)
        hook.remove()
        rows[share] = sum(seen)
    (nll, apps, _, ok, tr), (nll0, apps0, _, ok0, tr0) = out[True], out[False]
    torch.testing.assert_close(nll, nll0, rtol=0, atol=1e-12)
    torch.testing.assert_close(tr, tr0, rtol=0, atol=1e-12)
    assert torch.equal(apps, apps0) and torch.equal(ok, ok0)
    assert (apps[..., 0] == limit[:, None]).all()
    positions = T  # every window decodes T positions (BOS's included), the shorter one up to its longest
    assert rows[False] == positions * len(wins) * N * (N + 1) // 2  # row n loops n times
    assert rows[True] == positions * len(wins) * N  # one row per window loops N times


def test_per_group_values_fire_per_group_in_the_engine():
    """Three groups, each with its own exit values: fixed runs group g exactly
    max_steps[g] times; stepnorm with τ = [huge, tiny, huge] stops group 0 at its earliest
    n = 1, runs group 1 to its max_steps = 7 and holds group 2 until its min_steps = 4;
    the per-application cache is sized by the largest max_steps."""
    m = model([[1], [2], [3]], state_init="normal")
    idx = torch.randint(0, 60, (3, 6), generator=torch.Generator().manual_seed(8))
    noise = RowNoise(5, [0, 1, 2])
    for sharing in ("latest", "per_step"):
        _, apps = decode_all(m, idx, exits.build("fixed", None, max_steps=[2, 5, 3]), sharing=sharing, noise=noise)
        assert apps.tolist() == [[[2, 5, 3]] * 6] * 3
        p = exits.build("stepnorm", [1e30, 1e-30, 1e30], min_steps=[0, 0, 4], max_steps=[32, 7, 32])
        _, apps = decode_all(m, idx, p, sharing=sharing, noise=noise)
        assert apps.tolist() == [[[1, 7, 4]] * 6] * 3
    # group g under the per-group policy is group g under its own one-value policy
    taus, maxs = [1e-2, 1e-3, 1e-1], [12, 10, 8]
    p = exits.build("cosine", taus, max_steps=maxs)
    _, apps = decode_all(m, idx, p, noise=noise)
    assert len({tuple(a) for a in apps.reshape(-1, 3).tolist()}) > 1
    from recdepth.decode.engine import loop_group

    caches = new_caches(m, 3, 6)
    x = m.embed(idx[:, :1], pos0=0)
    for kind, i in m.plan:  # token 0, every group looped by hand under its own scalar policy
        if kind == "layer":
            x = m.h[i](x, caches[i], 0)
        else:
            x, n = loop_group(m, i, x, exits.build("cosine", taus[i], max_steps=maxs[i]), caches, 0, noise=noise)
            assert n.tolist() == apps[:, 0, i].tolist(), i


def test_evaluate_exit_checks_per_group_values_against_the_model():
    import json

    m = model([[1], [2, 3]], state_init="normal")
    tokens = torch.randint(0, 60, (30,), generator=torch.Generator().manual_seed(9))
    with pytest.raises(ValueError) as e:
        evaluate_exit(m, tokens, exits.build("cosine", [1e-2, 1e-3, 1e-2]), n_tokens=10)
    assert str(e.value).startswith("exit.tau: a list of 3 for 2 recurrence groups") and "\n" not in str(e.value)
    ev, rec = evaluate_exit(m, tokens, exits.build("entropy_diff", [1e-2, 1e-3], max_steps=[6, 9], patience=3),
                            n_tokens=20, settings=DecodeSettings(latency_tokens=0))
    assert (ev["tau"], ev["max_steps"], ev["min_steps"], ev["patience"]) == ([1e-2, 1e-3], [6, 9], 0, 3)
    assert json.loads(json.dumps(ev))["tau"] == [1e-2, 1e-3]
    assert rec["apps"][:, 0].max() <= 6 and rec["apps"][:, 1].max() <= 9


@pytest.mark.parametrize("rule, tau", [("fixed", None), ("kl", 1e-3), ("stepnorm", 0.3)])
def test_context_steps_loop_the_context_at_fixed_depth_and_the_rule_at_answers(rule, tau):
    """eval.context_steps (docs/spec.md §6) against a slow reference that decodes position by
    position at batch 1, choosing the policy per position: exit=fixed at k where the target
    is not an answer, the rule where it is. Same noise keys, so records must match exactly."""
    import numpy as np

    from recdepth.decode.engine import RowNoise

    m = model([[1], [2, 3]], state_init="normal")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 60, (13,), generator=gen)
    labels = np.zeros(13, dtype=np.int64)
    labels[[3, 4, 7, 11, 12]] = [1, 2, 1, 3, 2]  # targets 3, 4, 7, 11, 12 are answers
    k, N = 6, 9
    policy = exits.build(rule, tau, max_steps=N if rule != "fixed" else 2)
    _, rec = evaluate_exit(m, tokens, policy, n_tokens=12, labels=labels,
                           settings=DecodeSettings(warmup_tokens=0, latency_tokens=0, answers=False,
                                                   context_steps=k))
    context = exits.build("fixed", None, max_steps=k)
    caches = new_caches(m, 1, 12, "latest", max(k, N))
    noise = RowNoise(0, [0])
    ref_nll, ref_apps = [], []
    for pos in range(12):
        p = policy if labels[pos + 1] > 0 else context
        logits, a = decode_step(m, tokens[pos : pos + 1], pos, caches, p, noise=noise)
        ref_nll.append(m.nll(logits, tokens[pos + 1 : pos + 2]).item())
        ref_apps.append(a[0].tolist())
    assert rec["apps"].tolist() == ref_apps
    np.testing.assert_allclose(rec["nll"], ref_nll, rtol=1e-10, atol=1e-12)
    ctx = labels[1:13] == 0
    assert (rec["apps"][ctx] == k).all()  # every context position: exactly k per group
    if rule == "fixed":
        assert (rec["apps"][~ctx] == 2).all()
    # With the context at the rule's own depth, exit=fixed is plain exit=fixed.
    if rule == "fixed":
        _, same = evaluate_exit(m, tokens, policy, n_tokens=12, labels=labels,
                                settings=DecodeSettings(warmup_tokens=0, latency_tokens=0, answers=False,
                                                        context_steps=2))
        _, plain = evaluate_exit(m, tokens, policy, n_tokens=12,
                                 settings=DecodeSettings(warmup_tokens=0, latency_tokens=0))
        np.testing.assert_array_equal(same["nll"], plain["nll"])


def test_context_steps_need_answer_labels_and_match_the_oracle():
    m = model([[1]])
    tokens = torch.randint(0, 60, (13,))
    with pytest.raises(ValueError, match="eval.context_steps: .*no answer labels"):
        evaluate_exit(m, tokens, exits.build("kl", 1e-3, max_steps=4), n_tokens=12,
                      settings=DecodeSettings(latency_tokens=0, context_steps=4))
    with pytest.raises(ValueError, match="eval.context_steps: exit=oracle .*max_steps=4"):
        evaluate_exit(m, tokens, exits.build("oracle", 0.01, max_steps=4), n_tokens=12,
                      settings=DecodeSettings(latency_tokens=0, context_steps=3),
                      labels=__import__("numpy").ones(13, dtype=int))


# ------------------------------------------------ several exit settings in one batch (issue 23)
def _policies(dtype=torch.float64):
    out = []
    for rule, tau, kw in RULES:
        if "gate" in kw:
            kw = {**kw, "gate": tuple(t.to(dtype) for t in kw["gate"])}
        out.append(exits.build(rule, tau, **{"max_steps": 12 if rule != "fixed" else 5, **kw}))
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), pytest.param(torch.float32, 1e-4, marks=pytest.mark.slow)])
def test_mixed_settings_in_one_batch_equal_each_setting_alone(dtype, tol):
    """Every rule (per-group values and the gate included) decoded side by side, 7 rows a
    batch, so batches mix settings and windows and rows exit early and are compacted: each
    setting's records are its records decoded alone (float64: to rounding of the batched
    matmuls, applications identical; float32: within 1e-4 wherever the applications agree,
    which they do except where a criterion lies within rounding of τ: counted and bounded,
    as `bench settings` does. Which tokens those are depends on the CPU's kernels: none on
    one 2-core machine, one kl token of 840 on another)."""
    import numpy as np

    from recdepth.decode.scoring import decode_policies

    m = model([[1], [2, 3]], state_init="normal").to(dtype)
    tokens = torch.randint(0, 60, (80,), generator=torch.Generator().manual_seed(5))
    policies = _policies(dtype)
    recs, _ = decode_policies(m, tokens, policies, n_tokens=70, settings=DecodeSettings(seed=3, batch_size=7))
    mismatched, varied = 0, 0
    for p, rec in zip(policies, recs, strict=True):
        _, alone = evaluate_exit(m, tokens, p, n_tokens=70,
                                 settings=DecodeSettings(batch_size=3, latency_tokens=0, seed=3))
        assert set(rec) == set(alone) - {"ms", "cost", "loop_cost", "checks"}  # scoring prices the records
        for key in ("window", "position", "target", "correct"):
            assert np.array_equal(rec[key], alone[key]), key
        same = (rec["apps"] == alone["apps"]).all(1)  # tokens decoded at the same depths
        assert np.abs(rec["nll"] - alone["nll"])[same].max() < tol
        mismatched += int((~same).sum())
        varied += len(set(rec["apps"].flatten().tolist())) > 1
    total = 70 * len(policies)
    assert mismatched <= (0 if dtype == torch.float64 else 0.01 * total), f"{mismatched} of {total} tokens"
    assert varied >= len(policies) - 1  # all but fixed exit at varied n


def test_a_mixed_batch_stops_decoding_a_setting_whose_rows_have_all_exited(monkeypatch):
    """MixedMonitor: once every row of a decoding setting has exited, the head no longer
    decodes its rows while a slower setting of the batch loops on. kl at a τ it always
    meets exits at its first check (n = 2) beside fixed at 10: the monitor decodes kl's 2
    rows twice per group and position, not 10 times; the records are each setting's own."""
    import numpy as np

    from recdepth.decode.scoring import decode_policies

    m = model([[1], [2, 3]], state_init="normal")
    tokens = torch.randint(0, 60, (30,), generator=torch.Generator().manual_seed(6))
    policies = [exits.build("kl", 1e9, max_steps=10), exits.build("fixed", None, max_steps=10)]
    calls, real = [], LoopedGPT.decode_logits
    monkeypatch.setattr(LoopedGPT, "decode_logits", lambda self, x: calls.append((x.dim(), x.shape[0])) or real(self, x))
    recs, _ = decode_policies(m, tokens, policies, n_tokens=24,
                              settings=DecodeSettings(seed=3, batch_size=4))  # 2 windows x 2 settings
    monkeypatch.undo()
    monitor = [rows for dim, rows in calls if dim == 2]  # the monitor's [rows, d]; the next-token logits are [B, 1, d]
    positions = sum(dim == 3 for dim, _ in calls)
    assert positions == 12 and set(monitor) == {2} and len(monitor) == 2 * 2 * positions
    assert (recs[0]["apps"] == 2).all() and (recs[1]["apps"] == 10).all()
    for p, rec in zip(policies, recs, strict=True):
        _, alone = evaluate_exit(m, tokens, p, n_tokens=24,
                                 settings=DecodeSettings(batch_size=2, latency_tokens=0, seed=3))
        assert np.abs(rec["nll"] - alone["nll"]).max() < 1e-10 and (rec["apps"] == alone["apps"]).all()


def test_mixed_settings_with_context_steps_equal_each_alone():
    """eval.context_steps (a task's prompt at fixed depth) under mixed settings."""
    import numpy as np

    from recdepth.decode.scoring import decode_policies

    m = model([[1, 2]], state_init="normal")
    tokens = torch.randint(0, 60, (50,), generator=torch.Generator().manual_seed(8))
    labels = (torch.arange(50) % 3 == 0).numpy().astype(np.uint8)
    policies = [exits.build("kl", 1e-3, max_steps=10), exits.build("stepnorm", 0.3, max_steps=10),
                exits.build("fixed", None, max_steps=2)]
    recs, _ = decode_policies(m, tokens, policies, n_tokens=40, labels=labels,
                              settings=DecodeSettings(seed=1, batch_size=4, context_steps=6))
    for p, rec in zip(policies, recs, strict=True):
        _, alone = evaluate_exit(m, tokens, p, n_tokens=40, labels=labels,
                                 settings=DecodeSettings(latency_tokens=0, seed=1, answers=False, context_steps=6))
        assert np.abs(rec["nll"] - alone["nll"]).max() < 1e-10 and (rec["apps"] == alone["apps"]).all()
        assert (rec["apps"][labels[1:41] == 0] == 6).all()  # the context positions loop exactly 6


def test_evaluate_exits_gives_each_setting_its_eval_block_and_times_round_robin(monkeypatch):
    import recdepth.decode.scoring as dec

    m = model([[1], [2, 3]], state_init="normal")
    tokens = torch.randint(0, 60, (60,), generator=torch.Generator().manual_seed(5))
    policies = [exits.build("accel", 0.5, max_steps=12), exits.build("oracle", 0.01, max_steps=8),
                exits.build("kl", 1e-3, max_steps=12)]
    order = []
    real = dec.time_tokens

    def timed(model, tokens, policy, *a, **kw):
        order.append(policy.name)
        return real(model, tokens, policy, *a, **kw)

    monkeypatch.setattr(dec, "time_tokens", timed)
    out = dec.evaluate_exits(m, tokens, policies, n_tokens=50,
                             settings=DecodeSettings(batch_size=5, latency_tokens=4, repeats=2, seed=3))
    assert order == ["accel", "kl", "accel", "kl"]  # round-robin within each repeat; no oracle timing
    for p, (ev, rec) in zip(policies, out, strict=True):
        ev1, rec1 = evaluate_exit(m, tokens, p, n_tokens=50,
                                  settings=DecodeSettings(batch_size=5, latency_tokens=0, seed=3))
        assert ev["exit"] == p.name and abs(ev["ce"] - ev1["ce"]) < 1e-10
        assert ev["ce_ci"] == pytest.approx(ev1["ce_ci"], abs=1e-10)
        assert ev["applications_per_token"] == ev1["applications_per_token"]
        if p.name != "oracle":
            assert len(ev["ms_per_token_repeats"]) == 2 and (~__import__("numpy").isnan(rec["ms"][:4])).all()


def test_mixed_settings_decode_only_the_rows_of_rules_that_read_logits(monkeypatch):
    """Under exit.decode=head the head decodes each row on its own, so a batch mixing a kl
    setting with fixed and stepnorm ones decodes the kl rows only (their records are
    still those of kl alone: the test above); the coda reads every row's cache and
    decodes the whole batch."""
    import numpy as np

    from recdepth.decode.scoring import decode_policies

    m = model([[1], [2, 3]], state_init="normal").double()
    tokens = torch.randint(0, 60, (40,), generator=torch.Generator().manual_seed(2))
    decoded = []
    real = type(m).decode_logits
    monkeypatch.setattr(type(m), "decode_logits", lambda self, x: decoded.append(x.shape[0]) or real(self, x))
    policies = [exits.build("fixed", None, max_steps=3), exits.build("kl", 1e-3, max_steps=6),
                exits.build("stepnorm", 0.3, max_steps=6)]
    recs, _ = decode_policies(m, tokens, policies, n_tokens=36,
                              settings=DecodeSettings(seed=1, batch_size=9))  # 3 windows x 3 settings
    inside = [n for n in decoded if n != 9]  # the loops' decodes (the positions' own logits take all 9 rows)
    assert inside and set(inside) <= {1, 2, 3}  # the kl rows still looping, never a fixed or stepnorm row
    _, alone = evaluate_exit(m, tokens, policies[1], n_tokens=36,
                             settings=DecodeSettings(batch_size=3, latency_tokens=0, seed=1))
    assert np.abs(recs[1]["nll"] - alone["nll"]).max() < 1e-10 and (recs[1]["apps"] == alone["apps"]).all()


def test_mixed_policy_errors_are_one_line():
    with pytest.raises(ValueError, match="oracle"):
        mixed_settings.MixedPolicy((exits.build("oracle", 0.01, max_steps=4),), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="indices into 1 policies"):
        mixed_settings.MixedPolicy((exits.build("kl", 0.01),), torch.tensor([0, 1]))
    mixed = mixed_settings.MixedPolicy((exits.build("kl", 0.01, decode="head"), exits.build("kl", 0.1, decode="coda")),
                              torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="exit.decode: settings decoded side by side must decode alike"):
        _ = mixed.decode
    from recdepth.decode.scoring import decode_policies
    with pytest.raises(ValueError, match=r"eval\.batch_size: expected an integer >= 1, got 0$"):
        decode_policies(model([[1]]), torch.zeros(20, dtype=torch.long), [exits.build("kl", 0.01)], 10,
                        DecodeSettings(batch_size=0))


def test_bench_oracle_times_both_ways_and_compares_their_records(tiny_ckpt, ckpt_env, capsys):
    """`recdepth bench oracle --ckpt`: the oracle with its first group looped once per window
    and in every row give the same records (float32 rounding). No timing is asserted."""
    from recdepth import bench

    out = bench.main(["oracle", "--ckpt", str(tiny_ckpt), "--tokens", "12", "--batch", "2", "--rounds", "1",
                      "--max-steps", "4"])
    (row,) = out["rows"]
    assert row["apps_equal"] and row["max_dnll"] < 1e-4
    assert "first group once per window" in capsys.readouterr().out


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_bench_settings_decodes_a_frontier_grid_both_ways_alike(tiny_ckpt, ckpt_env, capsys):
    """`recdepth bench settings`: the mixed batches give each setting its own records, in
    float32 up to the rare application where a criterion lies within rounding of τ (counted;
    1 of 480 on the tiny checkpoint). No timing is asserted: the figures are the benchmark's."""
    from recdepth import bench

    out = bench.main(["settings", "--ckpt", str(tiny_ckpt), "--tokens", "12", "--batch", "2", "--rows", "5", "40"])
    assert out["settings"] == 20 and [m["rows"] for m in out["mixed"]] == [5, 40]
    assert all(m["apps_mismatch"] <= 0.02 * 20 * 12 for m in out["mixed"])
    assert all(m["max_dnll"] < 1e-4 for m in out["mixed"] if m["apps_mismatch"] == 0)
    assert "setting by setting at batch 2" in capsys.readouterr().out
