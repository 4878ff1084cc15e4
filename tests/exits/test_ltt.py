"""Learn then Test (recdepth/exits/calibration/ltt.py, docs/spec.md §4e) against independent computations:
binomial tails by enumerating every outcome, the Hoeffding term from its formula written
out here, the p-values' super-uniformity and the procedure's family-wise error by Monte
Carlo on synthetic losses of known risk (with a deliberately invalid procedure as the
harness's positive control), fixed-sequence testing against a brute-force reference, the
staircase against a closed-form index formula, and the calibrate entry point with
calibration.method=ltt on the tiny checkpoint."""

import itertools
import math

import numpy as np
import pytest

from recdepth.exits.calibration import ltt


def brute_cdf(k, n, p):
    """P(Bin(n, p) <= k) by enumerating all 2^n outcomes of n Bernoulli(p) draws."""
    total = 0.0
    for outcome in itertools.product((0, 1), repeat=n):
        if sum(outcome) <= k:
            total += math.prod(p if o else 1 - p for o in outcome)
    return total


def mc_bound(eps, trials):
    """ε plus 4 binomial standard errors: the Monte Carlo slack of "P(event) <= ε"."""
    return eps + 4 * math.sqrt(eps * (1 - eps) / trials)


# ------------------------------------------------------------------ p-values
@pytest.mark.parametrize("n", [1, 5, 9, 12])
@pytest.mark.parametrize("p", [0.03, 0.2, 0.5, 0.87])
def test_binomial_cdf_matches_enumeration(n, p):
    for k in range(-1, n + 1):
        assert ltt.binomial_cdf(k, n, p) == pytest.approx(brute_cdf(k, n, p), rel=1e-12, abs=1e-15)
        assert ltt.binomial_p(k, n, p) == pytest.approx(brute_cdf(k, n, p), rel=1e-12, abs=1e-15)


def test_binomial_cdf_large_n_is_finite_and_matches_the_normal_approximation():
    # n = 20000 terms underflow in linear space (0.9^20000); the log-space sum does not
    n, p = 20000, 0.1
    mu, sd = n * p, math.sqrt(n * p * (1 - p))
    for z in (-2.0, 0.0, 1.5):
        k = math.floor(mu + z * sd)
        normal = 0.5 * math.erfc(-(k + 0.5 - mu) / sd / math.sqrt(2))  # continuity-corrected
        assert ltt.binomial_cdf(k, n, p) == pytest.approx(normal, abs=3e-3)
    assert 0 < ltt.binomial_cdf(0, n, p) < 1e-300 or ltt.binomial_cdf(0, n, p) == 0.0


def test_hoeffding_term_by_hand():
    # n = 100, r̂ = 0.05, α = 0.1: h1 = 0.05 ln(0.5) + 0.95 ln(0.95 / 0.9)
    h = 0.05 * math.log(0.05 / 0.1) + 0.95 * math.log(0.95 / 0.9)
    assert ltt.h1(0.05, 0.1) == pytest.approx(h, rel=1e-14)
    assert ltt.hoeffding_p(0.05, 100, 0.1) == pytest.approx(math.exp(-100 * h), rel=1e-12)
    # r̂ = 0: h1 = −ln(1 − α), p = (1 − α)^n
    assert ltt.hoeffding_p(0.0, 40, 0.2) == pytest.approx(0.8 ** 40, rel=1e-12)
    # r̂ >= α: nothing to reject
    assert ltt.hoeffding_p(0.1, 100, 0.1) == 1.0 and ltt.hoeffding_p(0.3, 100, 0.1) == 1.0


def test_bentkus_term_and_hb_is_the_min_of_both():
    # n = 10, r̂ = 0.3 (10 × 0.3 is 3.0000000000000004 in floating point: k must be 3)
    assert ltt.bentkus_p(0.3, 10, 0.5) == pytest.approx(math.e * brute_cdf(3, 10, 0.5), rel=1e-12)
    # a non-integer n·r̂ rounds up: n = 10, r̂ = 0.21 -> k = 3
    assert ltt.bentkus_p(0.21, 10, 0.5) == pytest.approx(math.e * brute_cdf(3, 10, 0.5), rel=1e-12)
    seen = set()
    for n, r, a in [(12, 0.0, 0.3), (12, 0.1, 0.3), (12, 0.25, 0.3), (200, 0.02, 0.1), (200, 0.08, 0.1),
                    (11, 0.05, 0.5), (500, 0.3, 0.35)]:
        hoef = math.exp(-n * (ltt.h1(min(r, a), a)))
        bent = min(1.0, math.e * (brute_cdf(math.ceil(round(n * r, 9)), n, a) if n <= 12
                                  else ltt.binomial_cdf(math.ceil(round(n * r, 9)), n, a)))
        assert ltt.hoeffding_bentkus_p(r, n, a) == pytest.approx(min(hoef, bent), rel=1e-12)
        seen.add("hoeffding" if hoef < bent else "bentkus")
    assert seen == {"hoeffding", "bentkus"}  # both branches of the min are exercised


def test_edge_cases_of_the_pvalues():
    assert ltt.hoeffding_bentkus_p(0.0, 0, 0.1) == 1.0  # no data certifies nothing
    assert ltt.hoeffding_bentkus_p(0.0, 1000, 0.0) == 1.0  # a zero risk can never be certified
    assert ltt.hoeffding_bentkus_p(0.9, 5, 1.0) == 0.0  # a [0, 1] loss never has risk > 1
    assert ltt.binomial_p(3, 0, 0.2) == 1.0
    with pytest.raises(ValueError, match="ltt: expected a number of units"):
        ltt.hoeffding_bentkus_p(0.1, -1, 0.1)
    with pytest.raises(ValueError, match="losses must lie in"):
        ltt.setting_pvalue([0.1, 1.5], 0.1)
    with pytest.raises(ValueError, match="0/1 losses"):
        ltt.setting_pvalue([0.0, 0.5], 0.1, "binomial")


def test_min_alpha_is_where_zero_losses_reach_epsilon():
    for n, eps in [(16, 0.05), (128, 0.05), (1000, 0.1)]:
        a = ltt.min_alpha(n, eps)
        assert a == pytest.approx(1 - eps ** (1 / n), rel=1e-12)
        assert ltt.hoeffding_bentkus_p(0.0, n, a * 1.0001) <= eps < ltt.hoeffding_bentkus_p(0.0, n, a * 0.9999)


def test_pvalues_are_super_uniform_at_the_boundary_risk():
    """Losses with risk exactly α: P(p <= u) <= u (+ Monte Carlo noise) at several u, for
    the exact binomial p-value on Bernoulli(α) losses and for Hoeffding–Bentkus on 0/1
    and on continuous Beta losses; under an alternative (risk α/3) the tests have power."""
    rng = np.random.default_rng(0)
    trials, n, a = 4000, 60, 0.2
    draws = {
        "binomial": (rng.random((trials, n)) < a).astype(float),
        "hb-bernoulli": (rng.random((trials, n)) < a).astype(float),
        "hb-beta": rng.beta(0.5, 0.5 * (1 - a) / a, (trials, n)),  # mean a
    }
    for name, L in draws.items():
        kind = "binomial" if name == "binomial" else "hb"
        p = np.array([ltt.setting_pvalue(row, a, kind) for row in L])
        for u in (0.01, 0.05, 0.2):
            assert (p <= u).mean() <= mc_bound(u, trials), (name, u)
    # the exact binomial test at the boundary has size P(Bin <= k*) with k* the largest k
    # whose tail <= ε (a closed form); the Monte Carlo rate matches it
    L = draws["binomial"]
    p = np.array([ltt.binomial_p(int(r.sum()), n, a) for r in L])
    kstar = max(k for k in range(n + 1) if ltt.binomial_cdf(k, n, a) <= 0.05)
    size = ltt.binomial_cdf(kstar, n, a)
    assert 0.02 < size <= 0.05
    assert abs((p <= 0.05).mean() - size) < 4 * math.sqrt(size * (1 - size) / trials)
    # power under an alternative: risk a/3 with n = 60 is certified most of the time
    alt = rng.beta(0.5, 0.5 * (1 - a / 3) / (a / 3), (500, n))
    assert np.mean([ltt.setting_pvalue(r, a) <= 0.05 for r in alt]) > 0.5


# ------------------------------------------------------------------ the procedure
def reference_count(pvalues, eps):
    """The largest j such that H_1 … H_j all have p <= ε (brute force over j)."""
    return max(j for j in range(len(pvalues) + 1) if all(p <= eps for p in pvalues[:j]))


def test_fixed_sequence_matches_the_brute_force_reference():
    rng = np.random.default_rng(1)
    for _ in range(500):
        m = int(rng.integers(0, 8))
        ps = list(rng.choice([0.001, 0.01, 0.05, 0.0500001, 0.3, np.nan], size=m, p=[.3, .3, .1, .1, .1, .1]))
        assert ltt.fixed_sequence(ps, 0.05) == reference_count(ps, 0.05)
    assert ltt.fixed_sequence([0.01, 0.2, 0.001], 0.05) == 1  # later small p-values are never reached
    with pytest.raises(ValueError, match="calibration.epsilon"):
        ltt.fixed_sequence([0.01], 1.5)


def test_ltt_lazy_reads_no_further_than_the_first_uncertified_setting():
    L = np.array([[0.0] * 50, [0.01] * 50, [0.5] * 50, [0.0] * 50])
    read = []

    def gen():
        for i, row in enumerate(L):
            read.append(i)
            yield row

    lazy = ltt.ltt_lazy(gen(), 0.2, 0.05)
    full = ltt.ltt(L, 0.2, 0.05)
    assert read == [0, 1, 2] and lazy["tested"] == 3
    assert lazy["certified"] == full["certified"] == 2 and lazy["chosen"] == full["chosen"] == 1
    assert lazy["pvalues"] == full["pvalues"][:3] and full["risks"] == pytest.approx([0, 0.01, 0.5, 0])
    assert full["pvalues"][3] <= 0.05  # certifiable on its own, but behind an uncertified setting
    none = ltt.ltt(L[2:], 0.2, 0.05)
    assert none["certified"] == 0 and none["chosen"] is None


@pytest.mark.parametrize("kind", ["hb", "binomial"])
def test_family_wise_error_on_synthetic_losses_of_known_risk(kind):
    """Settings of known risk along a path (safe ones first, then one at exactly α and
    riskier ones): over many calibration draws, the chance that LTT certifies a setting
    of risk >= α is <= ε (+ Monte Carlo noise). The same harness flags the naive choice
    (the last setting whose empirical risk <= α), which has no guarantee."""
    rng = np.random.default_rng(2)
    a, eps, n, trials = 0.1, 0.1, 80, 2000
    risks = np.array([0.0, 0.02, 0.05, 0.08, 0.1, 0.1, 0.13, 0.2])

    def draw():
        if kind == "binomial":
            return (rng.random((len(risks), n)) < risks[:, None]).astype(float)
        # Beta losses with the given means (a point mass at 0 for risk 0)
        out = np.zeros((len(risks), n))
        for j, r in enumerate(risks):
            if r > 0:
                out[j] = rng.beta(2 * r / (1 - r), 2.0, n) if r < 1 else 1.0
        return out

    errors = naive_errors = 0
    for _ in range(trials):
        L = draw()
        res = ltt.ltt(L, a, eps, kind)
        errors += res["chosen"] is not None and risks[res["chosen"]] >= a
        ok = np.flatnonzero(L.mean(axis=1) <= a)
        naive_errors += len(ok) > 0 and risks[ok.max()] >= a
    assert errors / trials <= mc_bound(eps, trials)
    assert naive_errors / trials > 2 * eps  # the harness can see a violation


def test_with_enough_data_every_clearly_safe_setting_is_certified():
    rng = np.random.default_rng(3)
    risks = [0.0, 0.02, 0.04, 0.06, 0.08, 0.12, 0.15]  # 5 below α = 0.1, the rest above
    n = 5000
    for _ in range(20):
        L = np.stack([(rng.random(n) < r).astype(float) for r in risks])
        assert ltt.ltt(L, 0.1, 0.05)["certified"] == 5
        assert ltt.ltt(L, 0.1, 0.05, "binomial")["certified"] == 5


# ------------------------------------------------------------------ the staircase
@pytest.mark.parametrize("K,G", [(1, 1), (1, 3), (5, 1), (4, 3), (6, 2)])
def test_staircase_order(K, G):
    path = ltt.staircase(K, G)
    assert len(path) == G * (K - 1) + 1 and len(set(path)) == len(path)
    assert path[0] == (0,) * G and path[-1] == (K - 1,) * G
    # closed form: after t steps group g has moved ceil((t − g) / G) times (0 if t <= g)
    for t, s in enumerate(path):
        assert s == tuple(max(0, -(-(t - g) // G)) for g in range(G))
    for t in range(1, len(path)):  # one group, one step more aggressive, in turn
        d = np.subtract(path[t], path[t - 1])
        assert d[(t - 1) % G] == 1 and np.count_nonzero(d) == 1
    shared = [(i,) * G for i in range(K)]
    assert [s for s in path if len(set(s)) == 1] == shared  # the shared grid, in order
    assert max(max(s) - min(s) for s in path) <= 1


# ------------------------------------------------------------------ the loss
def test_window_losses_by_hand():
    units = np.array([7, 7, 7, 2, 2, 9, 9, 9, 9])
    ref = np.array([1.0, 2.0, 3.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    nll = ref + np.array([0.03, -0.01, 0.04, -0.2, 0.1, 0.5, 0.2, 0.3, 0.2])
    # windows in sorted id order 2, 7, 9: mean increases −0.05, 0.02, 0.3
    got = ltt.window_losses(nll, ref, units, bound=0.1)
    assert got == pytest.approx([0.0, 0.02 / 0.1, 1.0])
    assert ltt.window_losses(nll, ref, units, bound=1.0) == pytest.approx([0.0, 0.02, 0.3])
    ids, means, count = ltt.window_means(nll - ref, units)
    assert list(ids) == [2, 7, 9] and list(count) == [2, 3, 4] and means == pytest.approx([-0.05, 0.02, 0.3])
    assert ltt.alpha(0.01, 0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="calibration.loss_bound"):
        ltt.window_losses(nll, ref, units, bound=0.0)


def test_clopper_pearson():
    n, lvl = 25, 0.95
    a = (1 - lvl) / 2
    assert ltt.clopper_pearson(0, n)[1] == pytest.approx(1 - a ** (1 / n), rel=1e-9)
    assert ltt.clopper_pearson(n, n)[0] == pytest.approx(a ** (1 / n), rel=1e-9)
    for k in range(n + 1):
        lo, hi = ltt.clopper_pearson(k, n)
        assert lo <= k / n <= hi
        lo2, hi2 = ltt.clopper_pearson(n - k, n)
        assert lo == pytest.approx(1 - hi2, abs=1e-9) and hi == pytest.approx(1 - lo2, abs=1e-9)
    lo, hi = ltt.clopper_pearson(3, 10)  # endpoints solve the tail equations (enumeration)
    assert 1 - brute_cdf(2, 10, lo) == pytest.approx(a, abs=1e-9)
    assert brute_cdf(3, 10, hi) == pytest.approx(a, abs=1e-9)


# ------------------------------------------------------------------ the entry point
def compose_cal(*overrides):
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("calibrate", overrides=list(overrides))


CAL = ["exit=fixed", "exit.max_steps=3", "eval.tokens=20", "eval.latency_tokens=2", "eval.repeats=1",
       "eval.warmup_tokens=0", "calibration.method=ltt", "calibration.loss_bound=1.0"]


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_calibrate_ltt_certifies_a_prefix_and_records_it(tiny_ckpt, ckpt_env, tmp_path):
    """calibration.method=ltt on the tiny checkpoint: the recorded p-values are the
    Hoeffding–Bentkus p-values of the recorded risks (closed form here), the answer is the
    last setting of the certified prefix, and its recorded risk is the mean clipped window
    loss recomputed from its calibration record against a full-depth decode done here."""
    from recdepth.analysis.token_files import read_tokens
    from recdepth.app.calibration import calibration_split, load_splits
    from recdepth.calibrate import calibrate
    from recdepth.config.schema import validated
    from recdepth.exits import build

    run = tmp_path / "ltt"
    opts = [f"ckpt={tiny_ckpt}", f"run_dir={run}", *CAL, "target.max_ce_increase=0.5", "calibration.tokens=300",
            "calibration.epsilon=0.2"]
    out = calibrate(compose_cal(*opts))
    c = out["calibration"]
    n, a, eps = c["windows"], c["alpha"], c["epsilon"]
    assert c["method"] == "ltt" and a == pytest.approx(0.5 / 1.0) and eps == 0.2
    assert c["path"] == "staircase" and c["path_length"] == 3 * (3 - 1) + 1  # 3 groups, max_steps 3 .. 1
    assert c["min_alpha"] == pytest.approx(1 - eps ** (1 / n)) and c["min_alpha"] < a
    for r, p in zip(c["risks"], c["pvalues"]):  # HB from its two closed-form terms
        hoef = math.exp(-n * ((min(r, a) * math.log(min(r, a) / a) if min(r, a) > 0 else 0)
                              + (1 - min(r, a)) * math.log((1 - min(r, a)) / (1 - a))))
        bent = min(1.0, math.e * sum(math.comb(n, i) * a ** i * (1 - a) ** (n - i)
                                     for i in range(math.ceil(round(n * r, 9)) + 1)))
        assert p == pytest.approx(min(hoef, bent), rel=1e-9)
    k = c["certified"]
    assert all(p <= eps for p in c["pvalues"][:k])
    assert k == c["tested"] or c["pvalues"][k] > eps  # the walk stopped at the first uncertified
    assert k >= 1, "δ = 0.5 nats on windows of the tiny model certifies at least the most conservative setting"
    assert c["status"].startswith(f"certified {k} of")
    assert out["exit"]["max_steps"] == c["settings"][k - 1] or [out["exit"]["max_steps"]] * 3 == c["settings"][k - 1]
    # the answer's risk, recomputed from its calibration record and a full-depth decode here
    cfg = validated(compose_cal(*opts))
    module, _, _, cal_tokens, _ = load_splits(cfg)
    assert n == -(-300 // module.model.cfg.block_size)  # windows of the block size
    ref = calibration_split(cfg, module.model, cal_tokens).decode(build("fixed", None, max_steps=3))
    rec = read_tokens(run / "calibration_tokens.csv")
    assert np.array_equal(rec["window"], ref["window"])
    inc = {}
    for w, d in zip(rec["window"], rec["nll"] - ref["nll"]):
        inc.setdefault(w, []).append(d)
    risk = np.mean([min(max(np.mean(v), 0.0), 1.0) for v in inc.values()])
    assert len(inc) == n and c["risks"][k - 1] == pytest.approx(risk, abs=1e-6)
    assert out["test"]["ltt_alpha"] == a and 0 <= out["test"]["ltt_risk"] <= 1


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_calibrate_ltt_shared_equals_one_by_one(tiny_ckpt, ckpt_env, tmp_path):
    """The path decoded a few settings a batch (calibration.shared_rows) certifies what the
    path decoded one setting at a time does: same settings tested and certified, the same
    risks and answer (the records are the ones each setting gets alone)."""
    from recdepth.calibrate import calibrate

    opts = [f"ckpt={tiny_ckpt}", *CAL, "target.max_ce_increase=0.5", "calibration.tokens=300",
            "calibration.epsilon=0.2"]
    one = calibrate(compose_cal(*opts, f"run_dir={tmp_path / 'one'}", "calibration.shared_rows=0"))
    shared = calibrate(compose_cal(*opts, f"run_dir={tmp_path / 'shared'}", "calibration.shared_rows=9"))
    a, b = one["calibration"], shared["calibration"]
    assert b["windows"] == 3  # 9 rows: three settings of three windows a batch
    assert (a["tested"], a["certified"], a["settings"]) == (b["tested"], b["certified"], b["settings"])
    assert a["risks"] == pytest.approx(b["risks"], abs=1e-6) and a["tested"] >= 2
    assert one["exit"] == shared["exit"]


def test_calibrate_ltt_refuses_a_split_too_small_to_certify_anything(tiny_ckpt, ckpt_env, tmp_path):
    """δ = 0.001 nats at loss_bound 1 is α = 0.001: even with every loss 0 that needs
    ⌈log 0.05 / log 0.999⌉ = 2995 windows, and 64 tokens are one window of the tiny model's
    128. Refused in one line that says what it needs, before anything is decoded or written."""
    from recdepth.calibrate import calibrate

    run = tmp_path / "n"
    with pytest.raises(ValueError, match=r"calibration.tokens: .* only with >= 2995 calibration windows of 128 tokens "
                                         r"\(383360 tokens, every loss 0\), got 1") as e:
        calibrate(compose_cal(f"ckpt={tiny_ckpt}", f"run_dir={run}", *CAL, "target.max_ce_increase=0.001",
                              "calibration.tokens=64"))
    assert "\n" not in str(e.value) and not (run / "calibration.json").exists()


def test_units_needed_is_the_fewest_windows_a_zero_loss_certifies():
    """Against a brute-force search over n of the Hoeffding–Bentkus p-value at r̂ = 0
    (a second formula: the p-value itself, not min_alpha's closed form)."""
    for a, eps in [(0.01, 0.05), (0.1, 0.05), (0.2, 0.1), (0.5, 0.01), (0.03, 0.2)]:
        n = ltt.units_needed(a, eps)
        assert ltt.hoeffding_bentkus_p(0.0, n, a) <= eps < ltt.hoeffding_bentkus_p(0.0, n - 1, a)
    assert ltt.units_needed(0.01, 0.05) == 299 and ltt.units_needed(0.1, 0.05) == 29


def test_answer_flips_by_hand_and_bound_the_accuracy_drop():
    """Per-unit fraction of answers right at full depth and wrong at the setting, by hand;
    its mean over units is >= the per-unit accuracy drop's mean."""
    ref = np.array([1, 1, 0, 1, 1, 1, 0, 0], dtype=bool)
    got = np.array([1, 0, 1, 0, 1, 1, 0, 1], dtype=bool)
    units = np.array([5, 5, 5, 2, 2, 9, 9, 9])
    flips = ltt.answer_flips(got, ref, units)  # units sorted: 2, 5, 9
    assert flips.tolist() == pytest.approx([1 / 2, 1 / 3, 0.0])
    drop = [np.mean(ref[units == u]) - np.mean(got[units == u]) for u in (2, 5, 9)]
    assert flips.mean() >= np.mean(drop) and drop == pytest.approx([1 / 2, 0.0, -1 / 3])
    with pytest.raises(ValueError, match="differ in shape"):
        ltt.answer_flips(got[:3], ref, units)


def test_calibration_size_sizes_ltt_to_its_target():
    """calibration.tokens=null: 2048 for the empirical search; under ltt four times the
    windows a zero loss needs, capped by the room there is; explicit values kept; too few
    windows refused with what they need (on a task, the validation records)."""
    from types import SimpleNamespace as NS

    from recdepth.app.calibration import calibration_size
    from recdepth.exits.calibration.search import Target

    def run(method, tokens=None, eps=0.05, bound=0.1):
        return NS(calibration=NS(method=method, tokens=tokens, epsilon=eps, loss_bound=bound))

    acc, ce = Target("max_accuracy_drop", 0.01), Target("max_ce_increase", 0.01)
    assert calibration_size(run("empirical"), ce, 10**6, 48) == 2048
    assert calibration_size(run("empirical", 300), ce, 10**6, 48) == 300
    assert calibration_size(run("ltt"), acc, 10**6, 48) == 4 * 299 * 48
    assert calibration_size(run("ltt"), acc, 512 * 48, 48, task=True) == 512 * 48  # all the room there is
    assert calibration_size(run("ltt"), ce, 10**6, 128) == 4 * 29 * 128  # α = 0.01 / 0.1
    assert calibration_size(run("ltt", 29 * 128), ce, 10**6, 128) == 29 * 128
    with pytest.raises(ValueError, match=r"raise data.validation_records to >= 299") as e:
        calibration_size(run("ltt"), acc, 64 * 48, 48, task=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"got 28 \(3584 tokens"):
        calibration_size(run("ltt", 28 * 128), ce, 10**6, 128)
    with pytest.raises(ValueError, match="target.max_accuracy_drop: Learn then Test cannot certify a risk of 0"):
        calibration_size(run("ltt"), Target("max_accuracy_drop", 0.0), 10**6, 48)


@pytest.mark.parametrize("overrides,msg", [
    (["target.layer_applications=20"], "calibration.method: ltt needs target.max_ce_increase"),
    (["target.max_ce_increase=1.0"], "calibration.loss_bound: must exceed target.max_ce_increase"),
    (["target.max_ce_increase=0.1", "calibration.epsilon=1.5"], "calibration.epsilon: expected a number in"),
    (["target.max_ce_increase=0.1", "calibration.loss_bound=0"], "calibration.loss_bound: expected a finite number"),
    (["target.max_ce_increase=0.1", "calibration.method=bonferroni"], "calibration.method: expected one of"),
])
def test_calibrate_ltt_bad_input_is_one_line(tiny_ckpt, ckpt_env, tmp_path, overrides, msg):
    from recdepth.calibrate import calibrate

    with pytest.raises(ValueError, match=msg) as e:
        calibrate(compose_cal(f"ckpt={tiny_ckpt}", f"run_dir={tmp_path / 'c'}", *CAL, *overrides))
    assert "\n" not in str(e.value)


def test_calibrate_empirical_is_labelled_no_guarantee(tiny_ckpt, ckpt_env, tmp_path):
    from recdepth.calibrate import calibrate

    cal = [o for o in CAL if not o.startswith("calibration.")]
    out = calibrate(compose_cal(f"ckpt={tiny_ckpt}", f"run_dir={tmp_path / 'e'}", *cal, "target.max_ce_increase=0.01",
                                "calibration.tokens=40", "calibration.max_evals=2"))
    c = out["calibration"]
    assert c["method"] == "empirical" and c["guarantee"] == "no guarantee"
    assert "pvalues" not in c and "ltt_risk" not in out["test"]


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_bench_ltt_shared_rows_decodes_the_path_as_one_by_one(tiny_ckpt, ckpt_env, capsys):
    """`bench ltt --ltt-shared-rows`: the path's settings decoded side by side give the rows
    (CE increase, layer applications, risks) of the path decoded setting by setting."""
    from recdepth import bench

    args = ["ltt", "--ckpt", str(tiny_ckpt), "--windows", "4", "--partitions", "20", "--max-steps", "3",
            "--ltt-rule", "fixed", "--deltas", "0.5", "--loss-bounds", "1.0"]
    one = bench.main(args)
    shared = bench.main([*args, "--ltt-shared-rows", "12"])  # three settings of four windows a batch
    a, b = one["settings"], shared["settings"]
    assert len(a) == len(b) >= 3
    for x, y in zip(a, b, strict=True):
        assert x["setting"] == y["setting"]
        assert x["ce_increase"] == pytest.approx(y["ce_increase"], abs=1e-6)
        assert x["layer_applications"] == pytest.approx(y["layer_applications"], abs=1e-9)
