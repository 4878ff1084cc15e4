"""The cost of an exit rule with its checks (docs/spec.md §4b), and the work the engine runs
for it (issue 47): each built-in rule's price against a count by hand from the FLOP
definitions, the checks the engine really runs (counted calls), forced rows that run no
check, the check that fires reused as the token's output, records equal to a slow
reference with and without forced rows, and the time per answer over answer tokens only."""

import numpy as np
import pytest
import torch

from recdepth import exits
from recdepth.analysis import stats
from recdepth.decode import engine
from recdepth.decode.engine import RowNoise, decode_step, new_caches
from recdepth.decode.scoring import evaluate_exit, latency_of, model_cost, score_task
from recdepth.decode.settings import DecodeSettings
from recdepth.model.looped import GPTConfig, LoopedGPT

pytestmark = pytest.mark.usefixtures("one_thread")

D, V = 16, 40


def model(n_layer=3, groups=((1,),), latent_norm=False, seed=0, dtype=torch.float64):
    """n_layer layers, the groups looped; by default prelude 0, core 1, coda 2."""
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=D, block_size=12, vocab_size=V,
                    groups=[list(g) for g in groups], state_init="normal", latent_norm=latent_norm)
    m = LoopedGPT(cfg).to(dtype).eval()
    with torch.no_grad():  # away from the init, so the rules vary depth
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def by_hand(m, rule):
    """One check's price in layer equivalents, from the definitions: a layer's matmuls are
    2·(3d² + d² + 2·d·4d) = 24d² FLOPs; the head 2·d·V_padded; kl's statistic 9 per logit,
    accel's 4 per state entry; a decode through the coda runs its layers, one each."""
    layer, Vp = 24 * D * D, m.cfg.padded_vocab_size
    head = 2 * D * Vp
    coda = m.cfg.n_layer - 1 - m.cfg.groups[-1][-1]
    return {"kl": coda + (head + 9 * Vp) / layer, "kl_head": (head + 9 * Vp) / layer, "accel": 4 * D / layer,
            "fixed": 0.0}[rule]


# ------------------------------------------------------------------ prices
@pytest.mark.parametrize("n_layer, rule, decode, reuse", [
    (3, "kl", "auto", True),        # a one-layer coda: the check is the output
    (4, "kl", "auto", True),        # a two-layer coda
    (4, "kl", "head", False),       # the head on the state of a group the coda follows: not the output
    (2, "kl", "auto", True),        # no coda: the head on the last group's state is the output
    (3, "accel", "auto", False),    # a state rule: O(d)
    (3, "fixed", "auto", False),    # no check
])
def test_each_rules_price_against_a_count_by_hand(n_layer, rule, decode, reuse):
    m = model(n_layer)
    p = exits.build(rule, None if rule == "fixed" else 1e-3, max_steps=7, decode=decode)
    c = model_cost(m, p)
    want = by_hand(m, "kl_head" if (rule == "kl" and (decode == "head" or n_layer == 2)) else rule)
    assert c.checks == pytest.approx((want,)) and c.reuse == (reuse,) and c.limits == (7.0,)
    assert c.layers == (1.0,) and c.outside == n_layer - 1


def test_a_latent_norm_makes_the_heads_check_not_the_output():
    """With latent_norm the state leaving the group is ln_f(s) and the head then norms it
    again: the check's head on s is not what the token outputs."""
    assert not model_cost(model(2, latent_norm=True), exits.build("kl", 1e-3)).reuse[0]
    assert model_cost(model(2), exits.build("kl", 1e-3)).reuse[0]


def test_the_oracle_is_priced_as_its_loop_alone():
    m = model(4)
    c = model_cost(m, exits.build("oracle", 0.01, max_steps=8))
    assert c == model_cost(m) and not c.checked
    apps = np.array([[1], [5], [8]])
    np.testing.assert_array_equal(c.per_token(apps), [4, 8, 11])


def test_billed_checks_by_hand():
    """n checks, none at the limit; with reuse the one that fires is the output: n − 1
    either way; a forced token none; a group without a check none."""
    c = stats.Cost([1, 2], 3, checks=[0.5, 0.0], limits=[4, 6])
    apps = np.array([[1, 1], [3, 6], [4, 2], [4, 6]])
    np.testing.assert_array_equal(c.billed_checks(apps), [[1, 0], [3, 0], [3, 0], [3, 0]])
    np.testing.assert_allclose(c.per_token(apps), [3 + 1 + 2 + 0.5, 3 + 3 + 12 + 1.5, 3 + 4 + 4 + 1.5,
                                                   3 + 4 + 12 + 1.5])
    np.testing.assert_array_equal(c.loop(apps), [6, 18, 11, 19])
    r = stats.Cost([1], 2, checks=[2.0], limits=[5], reuse=[True])
    np.testing.assert_array_equal(r.billed_checks(np.array([[1], [3], [5]])), [[0], [2], [4]])
    np.testing.assert_array_equal(r.billed_checks(np.array([[3], [3]]), checked=np.array([True, False])), [[2], [0]])
    with pytest.raises(ValueError, match="cost: expected 2 check prices"):
        stats.Cost([1, 2], 0, checks=[1.0], limits=[1, 1], reuse=[0, 0])


# ------------------------------------------------------- what the engine runs
def counted(m):
    """Count the decoding work: calls of the coda's last layer and of the head (rows, by call)."""
    calls = {"coda": 0, "head_rows": [], "check_rows": []}
    last = m.h[m.cfg.n_layer - 1]
    last.register_forward_hook(lambda *_: calls.__setitem__("coda", calls["coda"] + 1))
    head = m.decode_logits

    def decode_logits(x):
        calls["head_rows"].append(x.shape[0])
        if x.dim() == 2:  # a check's decode of states [rows, d]; the output's is [B, 1, d]
            calls["check_rows"].append(x.shape[0])
        return head(x)

    m.decode_logits = decode_logits
    return calls


@pytest.mark.parametrize("n_layer", [3, 4])
def test_a_kl_check_through_the_coda_runs_once_per_application_and_its_last_is_the_output(n_layer):
    """Batch 1, kl through a one- and a two-layer coda: per token the coda and the head run
    exactly n times (n − 1 checks billed, the one that fires is the output; at max_steps no
    check runs and the output is the coda's own pass), and the eval block's cost is the
    loop plus (n − 1) checks at the price by hand."""
    m = model(n_layer)
    calls = counted(m)
    tokens = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(1))
    p = exits.build("kl", 0.05, max_steps=6)
    ev, rec = evaluate_exit(m, tokens, p, 24, DecodeSettings(latency_tokens=0, warmup_tokens=0, seed=2))
    n = rec["apps"][:, 0]
    assert 1 < len(set(n.tolist())) and (n == 6).any() and (n < 6).any()  # both ways of stopping occur
    assert calls["coda"] == n.sum() and len(calls["head_rows"]) == n.sum()
    outside = n_layer - 1
    assert ev["loop_layer_applications"] == pytest.approx(np.mean(outside + n))
    assert ev["layer_applications"] == pytest.approx(np.mean(outside + n + (n - 1) * by_hand(m, "kl")))
    assert ev["checks_per_token"] == pytest.approx([np.mean(n - 1)])
    np.testing.assert_allclose(rec["cost"], outside + n + (n - 1) * by_hand(m, "kl"))


def test_the_reused_check_gives_the_records_of_a_second_pass():
    """Batch 1 reuses the check that fired as the output; batch 2 (each row its batch-1
    result) runs the coda and the head again: the same records (float64)."""
    m = model(4)
    tokens = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(1))
    p = exits.build("kl", 0.05, max_steps=6)
    for step in ("module", "lean"):
        _, one = evaluate_exit(m, tokens, p, 24, DecodeSettings(latency_tokens=0, warmup_tokens=0, seed=2, backend=step))
        _, two = evaluate_exit(m, tokens, p, 24, DecodeSettings(latency_tokens=0, warmup_tokens=0, seed=2, backend=step,
                                                                 batch_size=2))
        assert (one["apps"] == two["apps"]).all()
        np.testing.assert_allclose(one["nll"], two["nll"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("rule, tau", [("kl", 0.05), ("accel", 0.3)])
def test_head_and_state_checks_run_what_they_bill(rule, tau):
    """Two groups, no coda after the first: kl decodes with the head after every
    application but at max_steps (n − [n = max] per group), accel decodes nothing; the
    output's head runs once per token either way."""
    m = model(5, groups=((1,), (2, 3)))
    calls = counted(m)
    tokens = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(1))
    p = exits.build(rule, tau, max_steps=5)
    ev, rec = evaluate_exit(m, tokens, p, 24, DecodeSettings(latency_tokens=0, warmup_tokens=0, seed=2))
    a = rec["apps"]
    billed = (a - (a == 5)).sum()
    assert len(calls["check_rows"]) == (billed if rule == "kl" else 0)
    assert len(calls["head_rows"]) - len(calls["check_rows"]) == len(a)  # the output's head, once a token
    price = by_hand(m, "kl_head" if rule == "kl" else "accel")
    loop = 2 + a[:, 0] + 2 * a[:, 1]
    assert ev["layer_applications"] == pytest.approx(np.mean(loop + (a - (a == 5)).sum(1) * price))


# -------------------------------------------------------------- forced rows
def task_stream(seed=3):
    """36 tokens in 3 windows of 12 (block 12), 13 of their targets answers."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (37,), generator=g)
    labels = np.zeros(37, dtype=np.int64)
    labels[[2, 3, 5, 9, 11, 14, 15, 20, 26, 27, 30, 33, 36]] = 1
    return tokens, labels


@pytest.mark.parametrize("batch", [1, 3])
def test_forced_rows_run_no_check(batch):
    """Under eval.context_steps the context rows loop at fixed depth and the rule's check
    decodes the answer rows only. Batch 1: the checks are exactly the answers' n − [n = max]
    per group. Batch 3: at each position the monitor watches the answer rows, decoding them
    at every application up to the last answer row's n (never at max_steps)."""
    m = model(5, groups=((1,), (2, 3)))
    calls = counted(m)
    tokens, labels = task_stream()
    p, N, k = exits.build("kl", 0.05, max_steps=5), 5, 3
    _, rec = evaluate_exit(m, tokens, p, 36, DecodeSettings(latency_tokens=0, warmup_tokens=0, seed=2, batch_size=batch,
                                                             context_steps=k, answers=False), labels=labels)
    answer = labels[rec["position"] + 1] > 0
    a = rec["apps"]
    assert (a[~answer] == k).all()
    if batch == 1:
        assert sum(calls["check_rows"]) == (a[answer] - (a[answer] == N)).sum()
    else:
        want = 0
        for pos in range(12):  # the three windows' rows side by side at each position
            rows = rec["position"] % 12 == pos
            ans = answer[rows]
            if ans.any():
                want += ans.sum() * np.minimum(a[rows][ans].max(axis=0), N - 1).sum()
        assert sum(calls["check_rows"]) == want
    np.testing.assert_allclose(rec["cost"][~answer], rec["loop_cost"][~answer])  # forced: no check billed


def reference(m, tokens, labels, policy, k, n_tokens):
    """The slow reference: batch 1, one decode_step per position with the policy chosen for
    it (exit=fixed at k where the target is not an answer), module step, no fixed rows."""
    caches = new_caches(m, 1, m.cfg.block_size, "latest", max(k, policy.max_steps_bound))
    context = exits.build("fixed", None, max_steps=k)
    nll, apps = [], []
    for w in range(0, n_tokens, m.cfg.block_size):
        noise = RowNoise(2, [w // m.cfg.block_size])
        for pos in range(m.cfg.block_size):
            t = w + pos
            p = policy if labels[t + 1] > 0 else context
            logits, a = decode_step(m, tokens[t : t + 1], pos, caches, p, noise=noise)
            nll.append(m.nll(logits, tokens[t + 1 : t + 2]).item())
            apps.append(a[0].tolist())
    return np.array(nll), np.array(apps)


@pytest.mark.parametrize("step, batch", [("module", 1), ("lean", 1), ("module", 3), ("lean", 3)])
@pytest.mark.parametrize("n_layer, groups, rule, tau", [(3, ((1,),), "kl", 0.05), (5, ((1,), (2, 3)), "stepnorm", 0.5)])
def test_records_with_forced_rows_equal_the_reference(step, batch, n_layer, groups, rule, tau):
    m = model(n_layer, groups)
    tokens, labels = task_stream()
    p = exits.build(rule, tau, max_steps=6)
    ref_nll, ref_apps = reference(m, tokens, labels, p, 4, 36)
    _, rec = evaluate_exit(m, tokens, p, 36, DecodeSettings(latency_tokens=0, warmup_tokens=0, seed=2, backend=step,
                                                             batch_size=batch, context_steps=4, answers=False),
                           labels=labels)
    assert rec["apps"].tolist() == ref_apps.tolist()
    np.testing.assert_allclose(rec["nll"], ref_nll, rtol=0, atol=1e-10)


# latest: slow (default-suite time, docs/results/test-suite.md); per_step runs by default
@pytest.mark.parametrize("cache", [pytest.param("latest", marks=pytest.mark.slow), "per_step"])
def test_compiled_forced_and_coda_loops_run_as_one_graph_and_equal_the_reference(cache):
    """The compiled step at batch 1 (float32): a forced context row loops as exit=fixed in
    the compiled loop, and kl's checks through the coda run inside it too (the check that
    fires is the output), under either cache (per_step: each application in its own slot);
    records equal the eager reference within float32 rounding. A fixed depth below the
    context's (exit.max_steps 2, context 4) warms up and decodes too."""
    m = model(3, dtype=torch.float32)
    tokens, labels = task_stream()
    p = exits.build("kl", 0.05, max_steps=6)
    ref = evaluate_exit(m, tokens, p, 36, DecodeSettings(latency_tokens=0, warmup_tokens=0, seed=2, backend="module",
                                                         context_steps=4, answers=False, cache=cache),
                        labels=labels)[1]
    lean = engine.lean_steps(m, "compiled")
    names, real = [], lean.loop

    def loop(g, s, e_proj, kvs, pos, policy, coda=None, reuse=False):
        names.append((policy.name, coda is not None, reuse))
        return real(g, s, e_proj, kvs, pos, policy, coda, reuse)

    lean.loop = loop
    try:
        _, got = evaluate_exit(m, tokens, p, 36, DecodeSettings(latency_tokens=0, warmup_tokens=0, seed=2,
                                                                backend="compiled", context_steps=4, answers=False,
                                                                cache=cache), labels=labels)
        low = exits.build("fixed", None, max_steps=2)
        settings = DecodeSettings(latency_tokens=36, warmup_tokens=0, seed=2, context_steps=4, answers=False,
                                  cache=cache)
        ev, shallow = evaluate_exit(m, tokens, low, 36, settings.replace(backend="compiled"), labels=labels)
    finally:
        del lean.loop
    answer = labels[got["position"] + 1] > 0
    assert names.count(("fixed", False, False)) >= (~answer).sum() and names.count(("kl", True, True)) >= answer.sum()
    assert (got["apps"] == ref["apps"]).all()
    assert np.abs(got["nll"] - ref["nll"]).max() <= 1e-5
    _, eager = evaluate_exit(m, tokens, low, 36, settings.replace(backend="module", latency_tokens=0), labels=labels)
    assert (shallow["apps"] == eager["apps"]).all() and set(shallow["apps"][:, 0].tolist()) == {2, 4}
    assert np.abs(shallow["nll"] - eager["nll"]).max() <= 1e-5 and ev["batch_check"]["apps_mismatch"] == 0


# ---------------------------------------------------------- time per answer
def test_ms_per_answer_reads_the_answer_tokens_only():
    """score_task keeps the answers; their ms (the answer's own step) make ms_per_answer,
    the others' ms_per_context: answers timed at 10 and 14 ms in two repeats, context at 1 ms."""
    m = model(3)
    n = 8
    labels = np.array([0, 0, 1, 0, 1, 0, 0, 1, 1])  # targets 2, 4, 7, 8 are answers
    ms = np.where(labels[1:, None] > 0, [10.0, 14.0], 1.0)
    rec = {"window": np.array([0] * 4 + [1] * 4), "position": np.arange(n), "target": np.zeros(n, int),
           "nll": np.zeros(n), "apps": np.full((n, 1), 3), "correct": np.ones(n, bool), "ms": ms.mean(1),
           "ms_repeats": ms}
    engine_settings = DecodeSettings(context_steps=2)
    from recdepth.decode.scoring import token_costs

    token_costs(m, exits.build("kl", 1e-3), rec, labels, engine_settings)
    ev = {"ms_per_token": float(ms.mean(1).mean()), "flops_per_token": 1.0}  # every decoded token's
    ev, rec = score_task(m, exits.build("kl", 1e-3), ev, rec, labels, engine_settings)
    assert ev["ms_per_answer"] == 12.0 and ev["ms_per_answer_repeats"] == [10.0, 14.0]
    assert ev["flops_per_token"] == 1.0 and ev["flops_per_answer"] > 1.0  # the answers' own beside it
    assert ev["ms_per_token"] == pytest.approx((4 * 12 + 4 * 1) / 8) and ev["latency_answers"] == 4
    assert ev["ms_per_context"] == 1.0 and ev["latency_contexts"] == 4  # the other tokens', beside it
    assert ev["ms_per_answer_ci"][0] >= 10.0 and ev["ms_per_answer_ci"][1] <= 14.0


def test_latency_interval_against_a_slow_bootstrap():
    """stats.latency_ci: per resample, whole units drawn and one repeat; the percentiles
    against a loop written out here with the same draws."""
    rng = np.random.default_rng(0)
    units = np.repeat(np.arange(7), 3)
    ms = rng.gamma(2.0, 3.0, size=(21, 3))
    m, lo, hi, per = stats.latency_ci(ms, units, resamples=400)
    assert m == pytest.approx(np.median(ms.mean(0))) and per == pytest.approx(ms.mean(0).tolist())
    draws = stats.bootstrap_indices(7, 400, 0)
    pick = np.random.default_rng(1).integers(0, 3, 400)
    vals = [np.concatenate([ms[units == u, pick[r]] for u in draws[r]]).mean() for r in range(400)]
    assert (lo, hi) == pytest.approx(tuple(np.quantile(vals, [0.025, 0.975])))


def test_no_timed_answer_gives_no_latency():
    assert latency_of({"ms_repeats": np.full((3, 2), np.nan), "window": np.zeros(3)})["ms_per_answer"] is None
