"""recdepth.analysis.stats against independent computations (docs/spec.md §4b): the closed-form CI
of a mean, coverage on data with a known mean (independent and dependent tokens), slow
per-resample reference loops written here from the definitions (each resample's tokens
gathered explicitly from its drawn windows), brute force for the oracle, hand counts of
layer applications (and a count of the layers a real forward runs), exact CSV round trips."""

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from recdepth.analysis import stats, token_files

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


# ------------------------------------------------------------------ references
def unit_tokens(units) -> list[list[int]]:
    """The tokens of each unit, units in sorted order of their ids."""
    units = list(np.asarray(units).tolist())
    return [[i for i, u in enumerate(units) if u == v] for v in sorted(set(units))]


def resampled_tokens(units, resamples: int, seed: int = 0) -> list[list[int]]:
    """Each resample's tokens, gathered explicitly: the drawn units (`bootstrap_indices`
    over the units, in sorted order of their ids), each contributing all its tokens, by
    list concatenation."""
    toks = unit_tokens(units)
    draws = stats.bootstrap_indices(len(toks), resamples, seed)
    return [[i for u in row for i in toks[u]] for row in draws.tolist()]


def mean_over(v, sel) -> float:
    return sum(v[i] for i in sel) / len(sel)


def exact_mean(v, sel) -> Fraction:
    """The mean of rational values (ints or Fractions) in exact arithmetic."""
    return sum((Fraction(v[i]) for i in sel), Fraction(0)) / len(sel)


def q95(v) -> tuple[float, float]:
    v = [x for x in v if not math.isnan(x)]
    return (float(np.quantile(v, 0.025)), float(np.quantile(v, 0.975))) if v else (math.nan, math.nan)


def p_two_sided(v, null=0.0) -> float:
    v = [x for x in v if not math.isnan(x)]
    return min(1.0, 2 * min(sum(x <= null for x in v), sum(x >= null for x in v)) / len(v))


# ----------------------------------------------------------------- intervals
def test_bootstrap_indices_shape_range_and_seed():
    idx = stats.bootstrap_indices(50, 300, seed=3)
    assert idx.shape == (300, 50) and idx.min() >= 0 and idx.max() < 50
    assert np.array_equal(idx, stats.bootstrap_indices(50, 300, seed=3))
    assert not np.array_equal(idx, stats.bootstrap_indices(50, 300, seed=4))
    with pytest.raises(ValueError):
        stats.bootstrap_indices(0, 10)


def test_token_bootstrap_reproduces_the_index_based_means():
    """Bootstrap(np.arange(n)) is the old bootstrap over tokens: the same seed gives
    x[bootstrap_indices(n, R)].mean(axis=1), whatever the unit ids' values."""
    rng = np.random.default_rng(30)
    n, R = 137, 500
    x = rng.normal(2, 3, n)
    want = x[stats.bootstrap_indices(n, R, seed=5)].mean(axis=1)
    np.testing.assert_allclose(stats.Bootstrap(np.arange(n), R, seed=5).means(x), want, rtol=1e-12, atol=0)
    np.testing.assert_allclose(stats.Bootstrap(7 * np.arange(n) + 3, R, seed=5).means(x), want, rtol=1e-12, atol=0)
    boot = stats.Bootstrap(np.arange(n), R, seed=5)
    assert len(boot) == boot.resamples == R and boot.n_units == n and boot.tokens == n


def test_window_bootstrap_against_a_slow_reference():
    """Windows of unequal length, their tokens interleaved and their ids not 0..W−1: each
    resample's mean is the mean over the drawn windows' tokens, gathered by list
    concatenation; counts say how often each window was drawn; ratios likewise."""
    rng = np.random.default_rng(31)
    lengths = rng.integers(1, 30, 17)
    ids = rng.choice(1000, size=len(lengths), replace=False)
    units = rng.permutation(np.repeat(ids, lengths))
    n, R = len(units), 300
    x, w = rng.normal(3, 1, n), rng.uniform(0.5, 2, n)
    boot = stats.Bootstrap(units, R, seed=7)
    samples = resampled_tokens(units, R, seed=7)
    xs, ws = x.tolist(), w.tolist()
    np.testing.assert_allclose(boot.means(x), [mean_over(xs, s) for s in samples], rtol=1e-12)
    np.testing.assert_allclose(boot.ratios(x, w), [sum(xs[i] for i in s) / sum(ws[i] for i in s) for s in samples],
                               rtol=1e-12)
    draws = stats.bootstrap_indices(len(ids), R, seed=7)
    length = dict(zip(ids.tolist(), lengths.tolist()))
    for r in range(0, R, 37):
        drawn = units[samples[r]]  # the unit of each token gathered for resample r
        for u, uid in enumerate(np.sort(ids)):  # column u: the u-th smallest id
            assert boot.counts[r, u] == np.sum(draws[r] == u) == np.sum(drawn == uid) / length[uid]
    assert boot.counts.shape == (R, len(ids)) and (boot.counts.sum(axis=1) == len(ids)).all()
    m, lo, hi = stats.mean_ci(x, boot)
    assert m == pytest.approx(x.mean(), rel=1e-12)  # the token mean, not a mean of window means
    assert (lo, hi) == pytest.approx(q95([mean_over(xs, s) for s in samples]))
    with pytest.raises(ValueError):
        boot.means(x[:-1])
    with pytest.raises(ValueError):
        stats.Bootstrap([])


def test_window_means_weigh_windows_by_their_tokens():
    """Window 0 has three tokens of value 1, window 1 one token of 5: a resample draws
    {0, 0} (mean 1), {0, 1} (8 / 4 = 2) or {1, 1} (5); never 3, the mean of window means."""
    boot = stats.Bootstrap([0, 0, 0, 1], 400, seed=1)
    got = boot.means([1.0, 1.0, 1.0, 5.0])
    assert set(np.round(got, 12).tolist()) == {1.0, 2.0, 5.0}
    assert np.allclose(got, np.where(boot.counts[:, 1] == 0, 1.0, np.where(boot.counts[:, 1] == 1, 2.0, 5.0)))


def test_bootstrap_ci_of_a_mean_matches_the_closed_form():
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, 4000)
    m, lo, hi = stats.mean_ci(x, stats.Bootstrap(np.arange(len(x)), 2000, seed=2))
    half = 1.959964 * 2.0 / math.sqrt(len(x))  # normal-theory half-width, sd known
    assert m == pytest.approx(x.mean(), rel=1e-12)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)
    assert (lo + hi) / 2 == pytest.approx(x.mean(), abs=0.1 * half)


def test_bootstrap_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(3)
    boot = stats.Bootstrap(np.arange(200), 400, seed=4)
    trials, covered = 200, 0
    for _ in range(trials):
        x = rng.normal(1.5, 3.0, 200)
        _, lo, hi = stats.mean_ci(x, boot)
        covered += lo <= 1.5 <= hi
    assert 0.90 <= covered / trials <= 0.99


def test_a_constant_quantity_has_the_degenerate_interval_at_its_mean():
    """A cost every token pays alike (a fractional one: applications plus checks) has no
    spread: every resample equals the mean, so the interval is [mean, mean]. Summed in the
    resamples' order it missed the mean by an ulp in about one case in ten (CI, stop 52)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        v = rng.uniform(1, 40)
        units = np.repeat(np.arange(37), rng.integers(1, 9, 37))
        m, lo, hi = stats.mean_ci(np.full(len(units), v), stats.Bootstrap(units, 200))
        assert lo == m == hi == pytest.approx(v, rel=1e-14)


@pytest.mark.parametrize("dependence", ["ar1", "window_effect"])
def test_coverage_on_dependent_tokens_windows_hold_tokens_do_not(dependence):
    """Synthetic held-out text: S data sets of W windows × L tokens with a known mean,
    tokens dependent within a window (AR(1), or a random effect per window), windows
    independent. 95% intervals resampling tokens under-cover; resampling windows they
    cover 95% up to Monte-Carlo noise, and their width matches the closed-form standard
    error of the mean."""
    rng = np.random.default_rng(32)
    S, W, L, R, mu = 500, 40, 50, 400, 2.0
    if dependence == "ar1":
        rho = 0.9
        e = np.empty((S, W, L))
        e[..., 0] = rng.normal(0, 1, (S, W))  # stationary start: every token has variance 1
        z = rng.normal(0, math.sqrt(1 - rho**2), (S, W, L))
        for t in range(1, L):
            e[..., t] = rho * e[..., t - 1] + z[..., t]
        lag = np.abs(np.subtract.outer(np.arange(L), np.arange(L)))
        var_mean = (rho ** lag).sum() / L**2 / W  # Var(mean) of W independent AR(1) windows
    else:
        su = 0.7
        e = rng.normal(0, su, (S, W, 1)) + rng.normal(0, 1, (S, W, L))
        var_mean = su**2 / W + 1 / (W * L)
    x = (mu + e).reshape(S, W * L)
    by_token = stats.Bootstrap(np.arange(W * L), R, seed=1)
    by_window = stats.Bootstrap(np.repeat(np.arange(W), L), R, seed=2)
    cover = {"token": 0, "window": 0}
    half = []
    for s in range(S):
        for name, boot in (("token", by_token), ("window", by_window)):
            _, lo, hi = stats.mean_ci(x[s], boot)
            cover[name] += lo <= mu <= hi
            if name == "window":
                half.append((hi - lo) / 2)
    tok, win = cover["token"] / S, cover["window"] / S
    assert tok < 0.85, (tok, win)
    assert 0.90 <= win <= 0.99, (tok, win)
    assert np.mean(half) == pytest.approx(1.959964 * math.sqrt(var_mean), rel=0.12)


def test_paired_difference():
    rng = np.random.default_rng(5)
    a = rng.normal(0, 1, 1000)
    boot = stats.Bootstrap(np.arange(1000), 500)
    d, lo, hi = stats.diff_ci(a, a + 0.1, boot)
    assert d == pytest.approx(-0.1, abs=1e-12)
    assert lo == pytest.approx(-0.1, abs=1e-12) and hi == pytest.approx(-0.1, abs=1e-12)
    b = a + rng.normal(0.05, 0.1, 1000)  # strongly positively correlated with a
    _, plo, phi = stats.diff_ci(a, b, boot)
    # unpaired: a and b resampled independently
    idx, idx2 = stats.bootstrap_indices(1000, 500), stats.bootstrap_indices(1000, 500, seed=99)
    u = a[idx].mean(axis=1) - b[idx2].mean(axis=1)
    ulo, uhi = np.quantile(u, [0.025, 0.975])
    assert phi - plo < 0.3 * (uhi - ulo)
    assert plo <= np.mean(a - b) <= phi


# ------------------------------------------------------- p-values and Holm
def test_boot_p_closed_forms():
    s = np.arange(100.0)  # 0 .. 99
    assert stats.boot_p(s, 9.5) == pytest.approx(2 * 10 / 100)  # 10 resamples at or below 9.5
    assert stats.boot_p(s, 89.5) == pytest.approx(2 * 10 / 100)
    assert stats.boot_p(s, 10.0) == pytest.approx(2 * 11 / 100)  # ties count on both sides
    assert stats.boot_p(s, -1.0) == 0.0 and stats.boot_p(s, 150.0) == 0.0
    assert stats.boot_p(s, 49.5) == 1.0  # 2 × 0.5, at most 1
    assert stats.boot_p(s - 9.5) == pytest.approx(0.2)  # null defaults to 0
    assert stats.boot_p(np.r_[s, np.nan, np.nan], 9.5) == pytest.approx(0.2)  # NaN resamples left out
    assert math.isnan(stats.boot_p([np.nan, np.nan]))
    assert stats.boot_p(np.zeros(10)) == 1.0


def test_boot_p_below_5_percent_iff_the_percentile_interval_excludes_the_null():
    rng = np.random.default_rng(33)
    z = rng.normal(0, 1, 4000)
    for shift in (-4.0, -3.0, -2.6, -1.3, -0.5, 0.0, 0.7, 1.4, 2.6, 3.5, 5.0):  # away from ±1.96
        s = z + shift
        lo, hi = np.quantile(s, [0.025, 0.975])
        p = stats.boot_p(s)
        assert (p < 0.05) == (lo > 0 or hi < 0), (shift, p, lo, hi)
        assert p == pytest.approx(2 * min(np.mean(s <= 0), np.mean(s >= 0)))


def holm_reject(p, alpha):
    """Holm's step-down test: sort ascending, reject p_(k) while p_(k) <= alpha / (m − k)."""
    ok = [i for i in range(len(p)) if not math.isnan(p[i])]
    order = sorted(ok, key=lambda i: p[i])
    rejected = set()
    for k, i in enumerate(order):
        if p[i] > alpha / (len(ok) - k):
            break
        rejected.add(i)
    return rejected


def test_holm_by_hand_and_against_the_step_down_test():
    # sorted: 0.005 (×4 = 0.02), 0.01 (×3 = 0.03), 0.03 (×2 = 0.06), 0.04 (×1, raised to 0.06)
    got = stats.holm([0.01, 0.04, 0.03, 0.005])
    assert got == pytest.approx([0.03, 0.06, 0.06, 0.02])
    got = stats.holm([0.01, np.nan, 0.04, 0.03, 0.005])  # NaN: left out of m and stays NaN
    assert math.isnan(got[1]) and np.delete(got, 1) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.3, 0.6]).tolist() == pytest.approx([0.6, 0.6])
    assert stats.holm([0.6, 0.7]).tolist() == [1.0, 1.0]  # capped at 1
    assert stats.holm([0.02]).tolist() == [0.02]
    assert stats.holm([]).tolist() == []
    assert np.isnan(stats.holm([np.nan, np.nan])).all()
    rng = np.random.default_rng(34)
    for _ in range(300):
        m = int(rng.integers(1, 12))
        p = np.where(rng.random(m) < 0.5, rng.uniform(0, 0.02, m), rng.uniform(0, 1, m))
        p[rng.random(m) < 0.1] = np.nan
        adj = stats.holm(p)
        ok = ~np.isnan(p)
        assert (np.isnan(adj) == ~ok).all()
        assert (adj[ok] >= p[ok] - 1e-15).all() and (adj[ok] <= 1).all()
        o = np.argsort(p[ok], kind="stable")
        assert (np.diff(adj[ok][o]) >= 0).all()  # monotone in the raw p-values
        for alpha in (0.01, 0.05, 0.1):
            assert set(np.flatnonzero(adj <= alpha).tolist()) == holm_reject(p.tolist(), alpha)


# ---------------------------------------------------------------------- cost
def test_cost_against_hand_counts():
    grouped = stats.Cost.of_model([[4], [5, 6], [7]], 12)
    assert grouped == stats.Cost([1, 2, 1], 8)
    assert grouped.per_token([[5, 6, 4]]).tolist() == [8 + 5 + 12 + 4] == [29]
    assert grouped.per_token([[1, 1, 1], [32, 1, 2]]).tolist() == [12, 8 + 32 + 2 + 2]
    assert grouped.uniform(4) == 24 and grouped.uniform(1) == 12 and grouped.uniform(32) == 8 + 32 * 4
    assert grouped.uniform(np.array([1, 2, 4])).tolist() == [12, 16, 24]
    single = stats.Cost.of_model([[4, 5, 6, 7]], 12)
    assert single == stats.Cost([4], 8)
    assert single.per_token([[3], [7]]).tolist() == [8 + 12, 8 + 28] and single.uniform(6) == 32
    huginn = stats.Cost.of_model([[2, 3, 4, 5]], 8)  # prelude 0-1 and coda 6-7 run once
    assert huginn == stats.Cost([4], 4)
    assert huginn.per_token([[32]]).tolist() == [4 + 128] and huginn.uniform(1) == 8
    baseline = stats.Cost.of_model([], 12)
    assert baseline.per_token(np.zeros((3, 0))).tolist() == [12, 12, 12] and baseline.uniform(5) == 12
    older = stats.Cost.mean_applications(3)  # the older unit: applications averaged over groups
    assert older.per_token([[5, 6, 4], [1, 2, 3]]) == pytest.approx([5.0, 2.0])
    assert older.uniform(7) == pytest.approx(7.0)
    with pytest.raises(ValueError):
        grouped.per_token([[1, 2]])
    with pytest.raises(ValueError):
        stats.Cost([1, 0], 3)
    with pytest.raises(ValueError):
        stats.Cost([1], -1)


def test_cost_of_the_model_configs():
    """Cost.of_model of the GPTConfig that conf/model/*.yaml builds (the way training does),
    against the layer counts by hand."""
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir, model_config

    want = {"grouped": stats.Cost([1, 2, 1], 8), "single": stats.Cost([4], 8), "huginn": stats.Cost([4], 2 + 2),
            "baseline": stats.Cost([], 12)}
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        for name, cost in want.items():
            cfg = compose("config", overrides=[f"model={name}", "run_dir=/tmp/unused", "runs_dir=/tmp/unused"])
            m = model_config(cfg, vocab_size=64)
            assert stats.Cost.of_model(m.groups, m.n_layer) == cost, name


@pytest.mark.parametrize("arch", ["grouped", "single", "huginn"])
def test_cost_counts_the_layers_a_forward_runs(arch):
    """The layer applications of a real forward pass, counted with a hook on every layer,
    equal Cost.per_token of the loops run and scoring.model_cost's model cost."""
    import torch

    from recdepth.decode.scoring import model_cost
    from recdepth.model.looped import GPTConfig, LoopedGPT

    groups, n_layer, loops, hand = {
        "grouped": ([[4], [5, 6], [7]], 12, [5, 6, 4], 29),
        "single": ([[4, 5, 6, 7]], 12, [3], 8 + 12),
        "huginn": ([[2, 3, 4, 5]], 8, [5], 2 + 20 + 2),
    }[arch]
    extra = dict(position="rope", mlp="gated_silu", qk_bias=True, scale_embeddings=True, latent_norm=True,
                 logit_bias=False) if arch == "huginn" else {}
    model = LoopedGPT(GPTConfig.from_size("tiny", n_layer=n_layer, groups=groups, vocab_size=64, **extra)).eval()
    calls = []
    for b in model.h:
        b.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long), loops=loops)
    cost = model_cost(model)
    assert len(calls) == hand
    assert cost == stats.Cost.of_model(groups, n_layer)
    assert cost.per_token([loops]).tolist() == [hand]


# ------------------------------------------------------------------ frontier
def ref_frontier(F, A, cn=None):
    cn = cn or {n: n for n in F}
    best, best_n = math.inf, None
    for n in F:
        if cn[n] <= A and F[n] < best:
            best, best_n = F[n], n
    return (math.nan, None) if best_n is None else (best, best_n)


def ref_needed(F, c):
    reach = [n for n in F if F[n] <= c]
    return (min(reach), True) if reach else (max(F), False)


def ref_hull(F, A, cn=None):
    """The best per-token mix of fixed depths at mean cost <= A, by enumeration: a single
    depth with cost <= A, or two depths cost_i <= A < cost_j mixed to cost exactly A (a
    linear program with two constraints has an optimum on two points). cn: the cost of
    each depth (n itself by default)."""
    cn = cn or {n: n for n in F}
    cand = [F[n] for n in F if cn[n] <= A]
    cand += [F[i] + (F[j] - F[i]) * (A - cn[i]) / (cn[j] - cn[i]) for i in F for j in F if cn[i] <= A < cn[j]]
    return min(cand) if cand else math.nan


def test_hull_ce_against_pairwise_mixtures():
    rng = np.random.default_rng(21)
    for _ in range(300):
        ns = sorted(rng.choice(GRID, size=rng.integers(1, len(GRID) + 1), replace=False).tolist())
        F = {n: float(rng.normal(3, 0.3)) for n in ns}
        A = float(rng.uniform(0.5, 35))
        got, want = stats.hull_ce(F, A), ref_hull(F, A)
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-12)
    F = {2: 4.0, 4: 3.0, 8: 2.8, 16: 2.9}
    assert stats.hull_ce(F, 3.0) == pytest.approx(3.5)  # half fixed-2, half fixed-4
    assert stats.hull_ce(F, 6.0) == pytest.approx(2.9)  # 4 to 8 on the hull
    assert stats.hull_ce(F, 12.0) == pytest.approx(2.8)  # more compute buys nothing past 8
    assert math.isnan(stats.hull_ce(F, 1.5))


def random_cost(rng):
    G = int(rng.integers(1, 4))
    return stats.Cost(rng.integers(1, 4, G).tolist(), int(rng.integers(0, 9)))


def test_frontier_functions_with_a_cost_against_the_references():
    """frontier_ce, hull_ce and saving with a Cost (or a table of costs) equal the
    references applied to the fixed depths' costs computed here: outside + n Σ|g|."""
    rng = np.random.default_rng(24)
    for _ in range(300):
        ns = sorted(rng.choice(GRID, size=rng.integers(1, len(GRID) + 1), replace=False).tolist())
        F = {n: float(rng.normal(3, 0.3)) for n in ns}
        cost = random_cost(rng)
        cn = {n: cost.outside + n * sum(cost.layers) for n in ns}
        A, c = float(rng.uniform(0, 1.1 * max(cn.values()))), float(rng.normal(3, 0.4))
        for given in (cost, cn):
            f_ce, f_n = stats.frontier_ce(F, A, given)
            w_ce, w_n = ref_frontier(F, A, cn)
            assert f_n == w_n and (f_ce == w_ce or (math.isnan(f_ce) and math.isnan(w_ce)))
            got, want = stats.hull_ce(F, A, given), ref_hull(F, A, cn)
            assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-12)
            assert stats.saving(A, F, c, given) == pytest.approx(1 - A / cn[ref_needed(F, c)[0]])


def test_frontier_in_layer_applications_by_hand():
    """A grouped model (groups [[4], [5, 6], [7]] of 12 layers: 8 outside) and
    F = {1: 4.0, 2: 3.4, 4: 3.0, 8: 2.9}: fixed n costs 8 + 4n = 12, 16, 24, 40 layer
    applications. A rule spending (2, 7, 2) applications costs 8 + 2 + 14 + 2 = 26 layer
    applications but only 11/3 applications on average over groups: counted in layers it
    is past fixed-4, counted in applications short of it."""
    F = {1: 4.0, 2: 3.4, 4: 3.0, 8: 2.9}
    cost = stats.Cost.of_model([[4], [5, 6], [7]], 12)
    A_layers, A_apps = float(cost.per_token([[2, 7, 2]])[0]), 11 / 3
    assert A_layers == 26
    assert stats.frontier_ce(F, A_layers, cost) == (3.0, 4)
    assert stats.frontier_ce(F, A_apps) == (3.4, 2)
    assert stats.hull_ce(F, A_layers, cost) == pytest.approx(3.0 + (2.9 - 3.0) * (26 - 24) / (40 - 24))  # 2.9875
    assert stats.hull_ce(F, A_apps) == pytest.approx(3.4 + (3.0 - 3.4) * (11 / 3 - 2) / (4 - 2))  # 3.0667
    # at CE 3.2 fixed-4 is needed: 24 layer applications (a loss of 1/12) or 4 applications (a saving of 1/12)
    assert stats.saving(A_layers, F, 3.2, cost) == pytest.approx(1 - 26 / 24)
    assert stats.saving(A_apps, F, 3.2) == pytest.approx(1 - (11 / 3) / 4)
    # (1, 4, 1): 8 + 1 + 8 + 1 = 18 layer applications, 2 on average
    A = float(cost.per_token([[1, 4, 1]])[0])
    assert A == 18 and stats.hull_ce(F, A, cost) == pytest.approx(3.4 - 0.4 * 2 / 8)  # 3.3
    assert stats.hull_ce(F, 2.0) == pytest.approx(3.4)
    assert math.isnan(stats.hull_ce(F, 11.0, cost)) and stats.frontier_ce(F, 11.0, cost)[1] is None  # below 12
    # Huginn: 2 + 2 layers outside a core of 4: fixed n costs 4 + 4n = 8, 12, 20, 36
    huginn = stats.Cost.of_model([[2, 3, 4, 5]], 8)
    assert stats.hull_ce(F, 16.0, huginn) == pytest.approx(3.4 + (3.0 - 3.4) * (16 - 12) / (20 - 12))  # 3.2
    assert stats.hull_ce(F, 16.0, {1: 8, 2: 12, 4: 20, 8: 36}) == pytest.approx(3.2)  # a table of costs
    # a table that is not affine in n changes the hull: fixed-2 at cost 2 lies above the
    # chord from (1, 4.0) to (2.5, 3.0), so the best mix at cost 2 is that chord's
    ms = {1: 1.0, 2: 2.0, 4: 2.5, 8: 6.0}
    assert stats.hull_ce(F, 2.0, ms) == pytest.approx(4.0 - 1.0 * (2.0 - 1.0) / 1.5)
    assert stats.hull_ce(F, 2.0) == pytest.approx(3.4)
    assert stats.frontier_ce(F, 2.0, ms) == (3.4, 2)


def test_vs_frontier_at_a_given_cost_against_a_slow_reference():
    rng = np.random.default_rng(22)
    n_tok = 60
    units = np.repeat(np.arange(12), rng.multinomial(n_tok - 12, np.ones(12) / 12) + 1)  # 12 unequal windows
    base = rng.gamma(2.0, 2.0, n_tok)
    fixed = {ms: base + 1.0 / ms + rng.normal(0, 0.05, n_tok) for ms in (4.3, 6.9, 8.9, 22.3)}
    rule = base + 0.1 + rng.normal(0, 0.05, n_tok)
    boot = stats.Bootstrap(units, 200, seed=23)
    samples = resampled_tokens(units, 200, seed=23)
    for cost in (3.0, 5.0, 10.0, 40.0):
        got = stats.vs_frontier_at(rule, cost, fixed, boot)
        d = [mean_over(rule, r) - ref_hull({k: mean_over(v, r) for k, v in fixed.items()}, cost) for r in samples]
        want = rule.mean() - ref_hull({k: v.mean() for k, v in fixed.items()}, cost)
        if cost < 4.3:
            assert math.isnan(got["d"]) and math.isnan(got["d_lo"])
            continue
        assert got["d"] == pytest.approx(want)
        assert (got["d_lo"], got["d_hi"]) == pytest.approx(q95(d))


def test_vs_frontier_at_includes_the_spread_over_timing_repeats():
    """Fixed jobs at 5, 10 and 20 ms/token (CE base + 0.5, + 0.2, + 0), a rule at a median
    of 10 ms with CE base + 0.1: against the frontier at 10 ms it is 0.1 nats better, with a
    tight interval over the text. Its timing repeats are 5, 10 and 20 ms, and at 20 ms the
    frontier is 0.1 nats better than the rule: with the spread over repeats the interval
    runs from about the difference at 5 ms to that at 20 ms, and contains 0."""
    rng = np.random.default_rng(25)
    n_tok = 200
    units = np.arange(n_tok) // 10
    base = rng.gamma(2.0, 2.0, n_tok)
    fixed = {5.0: base + 0.5 + rng.normal(0, 0.01, n_tok), 10.0: base + 0.2 + rng.normal(0, 0.01, n_tok),
             20.0: base + rng.normal(0, 0.01, n_tok)}
    rule = base + 0.1 + rng.normal(0, 0.01, n_tok)
    boot = stats.Bootstrap(units, 400, seed=3)
    plain = stats.vs_frontier_at(rule, 10.0, fixed, boot)
    assert plain["d"] == pytest.approx(rule.mean() - fixed[10.0].mean())
    assert plain["d_hi"] < 0  # resolved without the spread
    one = stats.vs_frontier_at(rule, 10.0, fixed, boot, [10.0], {k: [k] for k in fixed})
    assert (one["d"], one["d_lo"], one["d_hi"]) == pytest.approx((plain["d"], plain["d_lo"], plain["d_hi"]))
    spread = stats.vs_frontier_at(rule, 10.0, fixed, boot, [5.0, 10.0, 20.0], {k: [k] for k in fixed})
    assert spread["d"] == pytest.approx(plain["d"]) and spread["frontier_ce"] == pytest.approx(plain["frontier_ce"])
    assert spread["d_lo"] < 0 < spread["d_hi"]  # the spread over repeats swamps the difference
    at5, at20 = rule.mean() - fixed[5.0].mean(), rule.mean() - fixed[20.0].mean()  # -0.4, +0.1
    assert spread["d_lo"] == pytest.approx(at5, abs=0.02) and spread["d_hi"] == pytest.approx(at20, abs=0.02)
    # the fixed jobs' repeats too: fixed-10 timed once at 30 ms leaves the chord from 5 to
    # 20 ms as the frontier at 10 ms: base + 0.5 − 0.5 · 5 / 15
    moved = stats.vs_frontier_at(rule, 10.0, fixed, boot, [10.0], {5.0: [5.0], 10.0: [10.0, 30.0], 20.0: [20.0]})
    chord = fixed[5.0].mean() + (fixed[20.0].mean() - fixed[5.0].mean()) * (10 - 5) / (20 - 5)
    assert moved["d_lo"] == pytest.approx(rule.mean() - chord, abs=0.02)
    assert moved["d_hi"] == pytest.approx(plain["d"], abs=0.02)


def test_frontier_fixed_needed_and_saving_on_small_grids():
    rng = np.random.default_rng(20)
    for _ in range(200):
        ns = sorted(rng.choice(GRID, size=rng.integers(1, len(GRID) + 1), replace=False).tolist())
        F = {n: float(rng.normal(3, 0.3)) for n in ns}
        A, c = float(rng.uniform(0.5, 35)), float(rng.normal(3, 0.4))
        f_ce, f_n = stats.frontier_ce(F, A)
        w_ce, w_n = ref_frontier(F, A)
        assert f_n == w_n and (f_ce == w_ce or (math.isnan(f_ce) and math.isnan(w_ce)))
        assert stats.fixed_needed(F, c) == ref_needed(F, c)
        assert stats.saving(A, F, c) == pytest.approx(1 - A / ref_needed(F, c)[0])
    F = {1: 4.0, 2: 3.5, 4: 3.6, 8: 3.2}
    assert stats.frontier_ce(F, 0.9) == (pytest.approx(math.nan, nan_ok=True), None)
    assert stats.frontier_ce(F, 5.0) == (3.5, 2)  # lowest CE at n <= A, not the largest n
    assert stats.fixed_needed(F, 3.55) == (2, True)
    assert stats.fixed_needed(F, 3.5) == (2, True)  # CE <= c: a tie reaches it
    assert stats.frontier_ce(F, 2.0) == (3.5, 2)  # n <= A: n = A is on the frontier
    assert stats.fixed_needed(F, 3.0) == (8, False)
    assert stats.saving(2.0, F, 3.2) == pytest.approx(0.75)


def slow_compare(nll, cost_tok, fixed_nll, samples, cn=None):
    """compare() from the definitions, one resample (its list of tokens) at a time, in
    plain Python; cost_tok: each token's cost, rational (ints or Fractions: A is then
    exact, so "cost_n <= A" is decided without rounding), cn: each fixed depth's (n by
    default)."""
    cn = cn or {n: n for n in fixed_nll}

    def point(sel):
        c = mean_over(nll, sel)
        A = exact_mean(cost_tok, sel)
        F = {n: mean_over(v, sel) for n, v in fixed_nll.items()}
        front, front_n = ref_frontier(F, A, cn)
        need, reached = ref_needed(F, c)
        return (c, float(A), c - front, float(1 - A / cn[need]), need, reached, front, front_n,
                c - float(ref_hull(F, A, cn)))

    full = point(range(len(nll)))
    res = [point(s) for s in samples]
    return full, (lambda k: q95([r[k] for r in res])), res


@pytest.mark.parametrize("case", ["between", "better_than_all", "below_smallest", "sometimes_undefined",
                                  "windows", "layers"])
def test_compare_against_a_slow_reference(case):
    rng = np.random.default_rng({"between": 6, "better_than_all": 7, "below_smallest": 8,
                                 "sometimes_undefined": 13, "windows": 14, "layers": 15}[case])
    n_tok, G = 60, 3
    base = rng.gamma(2.0, 2.0, n_tok)
    fixed_nll = {n: base + 0.3 / n + rng.normal(0, 0.05, n_tok) for n in (2, 4, 8)}
    units, cost = np.arange(n_tok), None
    if case in ("between", "windows", "layers"):
        nll, apps = base + 0.1 + rng.normal(0, 0.05, n_tok), rng.integers(2, 7, (n_tok, G))
    elif case == "better_than_all":
        nll, apps = base - 0.2, rng.integers(3, 9, (n_tok, G))
    elif case == "below_smallest":
        nll, apps = base + 0.5, np.ones((n_tok, G), dtype=int)
    else:  # A close to the smallest fixed n: some resamples fall below it
        nll = base + 0.2
        apps = np.repeat(rng.permutation(np.repeat([1, 3], n_tok // 2))[:, None], G, axis=1)  # A = 2 exactly
    if case in ("windows", "layers"):  # 9 windows of unequal length
        units = np.repeat(np.arange(9), rng.multinomial(n_tok - 9, np.ones(9) / 9) + 1)
    if case == "layers":  # the grouped model: |g| = 1, 2, 1 and 8 layers outside
        cost = stats.Cost.of_model([[4], [5, 6], [7]], 12)
        cost_tok = [8 + a[0] + 2 * a[1] + a[2] for a in apps.tolist()]
        cn = {n: 8 + 4 * n for n in fixed_nll}
    else:
        cost_tok, cn = [Fraction(sum(a), len(a)) for a in apps.tolist()], None
    boot = stats.Bootstrap(units, 300, seed=9)
    got = stats.compare(nll, apps, fixed_nll, boot, cost)
    (c, A, d, s, need, reached, front, front_n, dh), q, res = slow_compare(
        nll.tolist(), cost_tok, {k: v.tolist() for k, v in fixed_nll.items()}, resampled_tokens(units, 300, seed=9), cn)
    assert got["ce"] == pytest.approx(c) and got["cost"] == pytest.approx(A)
    assert got["mean_applications"] == got["cost"]
    assert got["fixed_n"] == need and got["reached"] == reached and got["saving"] == pytest.approx(s)
    assert got["frontier_n"] == front_n
    if case != "below_smallest":
        assert got["d_hull"] == pytest.approx(dh) and (got["d_hull_lo"], got["d_hull_hi"]) == pytest.approx(q(8))
        assert got["p_hull"] == pytest.approx(p_two_sided([r[8] for r in res]))
    assert (got["ce_lo"], got["ce_hi"]) == pytest.approx(q(0))
    assert (got["cost_lo"], got["cost_hi"]) == pytest.approx(q(1))
    assert (got["mean_applications_lo"], got["mean_applications_hi"]) == pytest.approx(q(1))
    assert (got["saving_lo"], got["saving_hi"]) == pytest.approx(q(3))
    undefined = np.mean([math.isnan(r[2]) for r in res])
    assert got["d_ce_undefined"] == pytest.approx(undefined)
    if case == "below_smallest":
        assert math.isnan(got["frontier_ce"]) and math.isnan(got["d_ce"]) and got["frontier_n"] is None
        assert math.isnan(got["d_ce_lo"]) and math.isnan(got["d_ce_hi"]) and undefined == 1
        assert math.isnan(got["p_hull"])
    else:
        assert got["frontier_ce"] == pytest.approx(front) and got["d_ce"] == pytest.approx(d)
        assert (got["d_ce_lo"], got["d_ce_hi"]) == pytest.approx(q(2))
    if case == "better_than_all":
        assert got["reached"] is False and got["fixed_n"] == 8
    if case in ("between", "windows", "layers"):
        assert got["reached"] is True
    if case == "sometimes_undefined":
        assert 0 < undefined < 1


def test_a_cost_equal_to_a_fixed_depths_is_within_it_despite_rounding():
    """Seven tokens whose applications average to exactly 4 (84 / 21), though the float
    mean over groups, then tokens, comes out an ulp below 4: fixed-4 (n <= A) is on the
    frontier, and the hull at A is fixed-4's CE, not a mix with fixed-2."""
    apps = np.array([[1, 5, 7], [7, 4, 7], [7, 1, 1], [1, 3, 1], [1, 3, 6], [5, 3, 8], [6, 6, 1]])
    assert Fraction(int(apps.sum()), apps.size) == 4
    A = float(apps.mean(axis=1).mean())
    F = {2: 3.5, 4: 3.0, 8: 2.9}
    assert stats.frontier_ce(F, A) == (3.0, 4)
    assert stats.hull_ce(F, A) == pytest.approx(3.0, abs=1e-9)
    assert stats.hull_ce(F, 2 * (1 - 2**-52)) == pytest.approx(3.5)  # at the smallest depth, not below it
    fixed_nll = {n: np.full(7, ce) for n, ce in F.items()}
    got = stats.compare(np.full(7, 3.1), apps, fixed_nll, stats.Bootstrap(np.arange(7), 50))
    assert got["frontier_n"] == 4 and got["d_ce"] == pytest.approx(0.1)
    assert stats.frontier_ce(F, 4 - 1e-6) == (3.5, 2)  # a real shortfall still counts


def test_compare_with_a_cost_equals_passing_the_per_token_cost():
    """compare(apps, cost) is compare(the per-token layer applications counted by hand,
    cost): the Cost turns [tokens, groups] into Σ_g |g| apps_g + outside, nothing else."""
    rng = np.random.default_rng(16)
    n_tok = 80
    base = rng.gamma(2.0, 2.0, n_tok)
    fixed_nll = {n: base + 0.3 / n + rng.normal(0, 0.05, n_tok) for n in (1, 2, 4, 8)}
    nll, apps = base + 0.05 + rng.normal(0, 0.05, n_tok), rng.integers(1, 9, (n_tok, 3))
    boot = stats.Bootstrap(np.arange(n_tok) // 8, 300, seed=2)
    cost = stats.Cost.of_model([[4], [5, 6], [7]], 12)
    by_hand = np.array([8 + 1 * a + 2 * b + 1 * c for a, b, c in apps.tolist()], dtype=float)
    got, want = stats.compare(nll, apps, fixed_nll, boot, cost), stats.compare(nll, by_hand, fixed_nll, boot, cost)
    assert got.keys() == want.keys()
    for k in got:
        assert got[k] == pytest.approx(want[k], nan_ok=True), k
    assert got["cost"] == pytest.approx(by_hand.mean())
    # without a Cost: applications averaged over groups, the older unit
    old, mean_apps = stats.compare(nll, apps, fixed_nll, boot), stats.compare(nll, apps.mean(axis=1), fixed_nll, boot)
    for k in old:
        assert old[k] == pytest.approx(mean_apps[k], nan_ok=True), k
    assert old["cost"] == pytest.approx(apps.mean())


# -------------------------------------------------------------------- oracle
def brute_oracle_n(m, eps):
    N = len(m[0])
    return [next(n for n in range(1, N + 1) if abs(m[t][n - 1] - m[t][N - 1]) <= eps) for t in range(len(m))]


def test_oracle_n_by_brute_force():
    rng = np.random.default_rng(10)
    m = rng.normal(3, 1, (50, 7))
    for eps in (0.0, 0.1, 0.5, 2.0):
        got = stats.oracle_n(m, eps)
        assert got.tolist() == brute_oracle_n(m.tolist(), eps)
        ce, A = stats.oracle_point(m, eps)
        assert ce == pytest.approx(np.mean([m[t, got[t] - 1] for t in range(50)]))
        assert A == pytest.approx(np.mean(got))
        ce_l, A_l = stats.oracle_point(m, eps, stats.Cost.of_model([[4], [5, 6], [7]], 12))
        assert ce_l == ce and A_l == pytest.approx(np.mean([8 + 4 * n for n in got.tolist()]))
    assert (stats.oracle_n(m, math.inf) == 1).all()
    n0 = stats.oracle_n(m, 0.0)
    assert ((n0 >= 1) & (n0 <= 7)).all()
    assert (m[np.arange(50), n0 - 1] == m[:, -1]).all()  # eps = 0: the max-depth NLL itself
    # two-sided: a depth whose target NLL is far BELOW the max-depth one is not "within eps"
    assert stats.oracle_n([[1.0, 3.0, 3.05]], 0.1).tolist() == [2]


def slow_oracle_saving(m, grid, c_tok, c_fixed, fixed_nll, samples, cn=None):
    """oracle_saving() from the definitions, per resample (its list of tokens), plain
    Python; cn: the cost of a uniform depth n (n by default)."""
    cn = cn or (lambda n: n)
    n_by_eps = {e: brute_oracle_n(m, e) for e in grid}

    def one(sel):
        c = c_fixed if c_tok is None else mean_over(c_tok, sel)
        F = {n: mean_over(v, sel) for n, v in fixed_nll.items()}
        pts = []
        for e in grid:
            ns = n_by_eps[e]
            ce = sum(m[i][ns[i] - 1] for i in sel) / len(sel)
            A = sum(cn(ns[i]) for i in sel) / len(sel)
            if ce <= c:
                pts.append((A, ce, e))
        if not pts:
            return math.nan, None, math.nan
        A, _, e = min(pts)
        return 1 - A / cn(ref_needed(F, c)[0]), e, A

    full = one(range(len(m)))
    res = [one(r) for r in samples]
    return full, q95([r[0] for r in res]), np.mean([math.isnan(r[0]) for r in res])


@pytest.mark.parametrize("target", ["float", "per_token", "unreachable", "layers"])
def test_oracle_saving_against_a_slow_reference(target):
    rng = np.random.default_rng(11)
    n_tok, N = 80, 8
    m = rng.normal(3, 1, (n_tok, N)) + 0.4 / np.arange(1, N + 1)
    fixed_nll = {n: m[:, n - 1] + 0.05 for n in (1, 2, 4, 8)}
    grid = [0.0, 0.01, 0.1, 0.3, 1.0]
    units = np.arange(n_tok) // 5 if target == "layers" else np.arange(n_tok)
    boot = stats.Bootstrap(units, 200, seed=12)
    rule = m[:, -1] + 0.1 + rng.normal(0, 0.05, n_tok)
    cost, cn = None, None
    if target == "float":
        c_tok, c = None, float(m[:, -1].mean()) + 0.08
    elif target in ("per_token", "layers"):
        c_tok, c = rule, rule
    else:
        c_tok, c = None, float(m.min(axis=1).mean()) - 0.5  # below every oracle point
    if target == "layers":  # Huginn: 4 layers outside a core of 4
        cost, cn = stats.Cost.of_model([[2, 3, 4, 5]], 8), (lambda n: 4 + 4 * n)
    got = stats.oracle_saving(m, grid, c, fixed_nll, boot, cost)
    c0 = float(np.mean(c))
    (s, eps, A), q, undefined = slow_oracle_saving(
        m.tolist(), grid, None if c_tok is None else c_tok.tolist(), c0,
        {k: v.tolist() for k, v in fixed_nll.items()}, resampled_tokens(units, 200, seed=12), cn)
    assert (got["fixed_n"], got["reached"]) == ref_needed({n: v.mean() for n, v in fixed_nll.items()}, c0)
    assert got["saving_undefined"] == pytest.approx(undefined)
    if target == "unreachable":
        assert got["eps"] is None and math.isnan(got["saving"]) and math.isnan(got["applications"])
        assert math.isnan(got["saving_lo"]) and undefined == 1
        return
    assert got["eps"] == eps and got["applications"] == pytest.approx(A) and got["saving"] == pytest.approx(s)
    assert got["ce"] <= c0
    assert (got["saving_lo"], got["saving_hi"]) == pytest.approx(q)


# --------------------------------------------------------- per-token records
def test_token_records_round_trip_exactly(tmp_path):
    rng = np.random.default_rng(12)
    n = 25
    nll = rng.normal(4, 1, n) / 3  # full-precision floats
    apps = rng.integers(1, 33, (n, 3))
    ms = np.where(np.arange(n) < 10, rng.uniform(1, 20, n) / 7, np.nan)
    target, gpt2 = rng.integers(0, 100, n), rng.integers(-1, 100, n)
    f = tmp_path / "eval_tokens.csv"
    token_files.write_tokens(f, np.arange(n) // 8, np.arange(n), target, gpt2, nll, apps, ms)
    r = token_files.read_tokens(f)
    assert r["nll"].tobytes() == nll.tobytes() and np.array_equal(r["apps"], apps)
    assert r["ms"][:10].tobytes() == ms[:10].tobytes() and np.isnan(r["ms"][10:]).all()
    assert r["window"].tolist() == (np.arange(n) // 8).tolist() and r["position"].tolist() == list(range(n))
    assert r["target"].tolist() == target.tolist() and r["target_gpt2"].tolist() == gpt2.tolist()
    assert f.read_text().splitlines()[0] == "window,position,target,target_gpt2,nll,apps_0,apps_1,apps_2,ms"
    assert [p.name for p in tmp_path.iterdir()] == ["eval_tokens.csv"]  # no temporary left behind
    # ms=None: an empty ms column; one group
    token_files.write_tokens(f, [0, 0], [0, 1], [5, 6], [7, 8], [0.1, 0.2], [[1], [2]])
    r = token_files.read_tokens(f)
    assert r["apps"].shape == (2, 1) and np.isnan(r["ms"]).all() and r["nll"].tolist() == [0.1, 0.2]
    # a model without recurrence (model=baseline): no apps columns at all
    token_files.write_tokens(f, [0, 0], [0, 1], [5, 6], [7, 8], [0.1, 0.2], np.zeros((2, 0), dtype=int))
    r = token_files.read_tokens(f)
    assert f.read_text().splitlines()[0] == "window,position,target,target_gpt2,nll,ms"
    assert r["apps"].shape == (2, 0) and r["nll"].tolist() == [0.1, 0.2]


def test_the_cost_column_round_trips_and_older_files_have_none(tmp_path):
    f = tmp_path / "eval_tokens.csv"
    cost = np.array([1 / 3, 7.25, 12.0])
    token_files.write_tokens(f, [0, 0, 1], [0, 1, 2], [5, 6, 7], [5, 6, 7], [0.1, 0.2, 0.3], [[1], [5], [9]],
                             cost=cost, task={"answer": [1, 1, 0], "difficulty": [2, 1, 0], "correct": [1, 0, 1]})
    assert f.read_text().splitlines()[0] == "window,position,target,target_gpt2,nll,apps_0,ms,cost,answer,difficulty,correct"
    r = token_files.read_tokens(f)
    assert r["cost"].tobytes() == cost.tobytes() and r["difficulty"].tolist() == [2, 1, 0]
    token_files.write_tokens(f, [0], [0], [5], [5], [0.1], [[1]])
    assert "cost" not in token_files.read_tokens(f)


def test_read_tokens_apps_columns_in_group_order(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("window,position,target,target_gpt2,nll,apps_1,apps_0,ms\n0,3,4,5,1.5,7,2,\n")
    r = token_files.read_tokens(f)
    assert r["apps"].tolist() == [[2, 7]] and math.isnan(r["ms"][0]) and r["nll"][0] == 1.5


def test_read_tokens_errors_are_one_line_and_name_the_file(tmp_path):
    f = tmp_path / "eval_tokens.csv"
    f.write_text("window,position,target\n0,0,1\n")
    with pytest.raises(ValueError, match="no column 'target_gpt2'") as e:
        token_files.read_tokens(f)
    assert "\n" not in str(e.value) and str(f) in str(e.value)
    f.write_text("window,position,target,target_gpt2,nll,apps_0,ms\n0,0,1,1,0.5,2,\n0,1,1,1,oops,2,\n")
    with pytest.raises(ValueError, match="row 2") as e:
        token_files.read_tokens(f)
    assert "\n" not in str(e.value) and str(f) in str(e.value)
    f.write_text("window,position,target,target_gpt2,nll,apps_0,apps_2,ms\n")
    with pytest.raises(ValueError, match="apps_1"):
        token_files.read_tokens(f)


# ------------------------------------------------- a sweep on synthetic files
def test_sweep_frontier_csv_from_synthetic_token_files_matches_the_slow_reference(tmp_path):
    """sweep.summarize on a sweep directory of synthetic jobs (eval_tokens.csv +
    metrics.json, as recdepth.evaluate writes them): frontier.csv's numbers equal the slow
    per-resample reference computed here from the same per-token values."""
    import csv

    from recdepth import sweep

    rng = np.random.default_rng(40)
    n_tok, G = 120, 3
    base = rng.gamma(2.0, 2.0, n_tok)
    jobs = [("fixed", None, n, base + 0.4 / n + rng.normal(0, 0.03, n_tok), np.full((n_tok, G), n))
            for n in (1, 2, 4, 8)]
    jobs.append(("kl", 1e-3, 8, base + 0.02 + rng.normal(0, 0.03, n_tok), rng.integers(2, 5, (n_tok, G))))
    jobs.append(("accel", 1e-2, 8, base + 0.2 + rng.normal(0, 0.03, n_tok), rng.integers(3, 8, (n_tok, G))))
    for j, (rule, tau, n, nll, apps) in enumerate(jobs):
        _write_job(tmp_path / str(j), rule, tau, n, nll, apps)
    sweep.summarize(tmp_path)
    front = {int(r["job"]): r for r in csv.DictReader(open(tmp_path / "frontier.csv"))}
    assert sorted(front) == [4, 5]
    samples = resampled_tokens(WINDOWS(n_tok), 1000)  # whole windows, as the sweep resamples
    fixed_nll = {n: nll.tolist() for rule, _, n, nll, _ in jobs if rule == "fixed"}
    p = {}
    for j in (4, 5):
        _, _, _, nll, apps = jobs[j]
        (c, A, d, s, need, reached, front_ce, front_n, dh), q, res = slow_compare(
            nll.tolist(), [Fraction(sum(a), len(a)) for a in apps.tolist()], fixed_nll, samples)
        p[j] = p_two_sided([x[8] for x in res])
        r = front[j]
        assert float(r["ce"]) == pytest.approx(c, abs=1e-12) and float(r["mean_applications"]) == pytest.approx(A)
        assert int(r["fixed_n"]) == need and (r["reached"] == "True") == reached
        assert float(r["saving"]) == pytest.approx(s) and int(r["frontier_n"]) == front_n
        assert float(r["d_hull"]) == pytest.approx(dh)
        assert (float(r["d_hull_lo"]), float(r["d_hull_hi"])) == pytest.approx(q(8))
        assert (float(r["saving_lo"]), float(r["saving_hi"])) == pytest.approx(q(3))
        lo, hi = q(8)
        assert r["verdict"] == ("beats the fixed frontier" if hi < 0 else
                                "worse than the fixed frontier" if lo > 0 else "not resolved")
    # Holm over the two comparisons, by hand: the smaller p times 2, the larger at least that
    small, large = sorted(p, key=p.get)
    assert float(front[small]["p_holm"]) == pytest.approx(min(1, 2 * p[small]))
    assert float(front[large]["p_holm"]) == pytest.approx(max(min(1, 2 * p[small]), p[large]))
    assert front[4]["verdict"] == "beats the fixed frontier"  # kl: near the deepest CE at ~3 applications
    assert front[5]["verdict"] == "worse than the fixed frontier"  # accel: 0.2 nats worse at ~5


def test_sweep_summary_with_per_group_values(tmp_path, caplog, monkeypatch):
    """Jobs with one τ (or max_steps) per group and argmax_stability's k: the summary shows
    them, the frontier compares them like any rule (by mean applications; a fixed job with
    one max_steps per group is not a point of the fixed frontier), and Fig. 4 leaves the
    per-group τ jobs out of its panels against τ, saying so."""
    import csv
    import logging

    from recdepth import sweep

    rng = np.random.default_rng(41)
    n_tok, G = 100, 3
    base = rng.gamma(2.0, 2.0, n_tok)
    jobs = [("fixed", None, n, {}, base + 0.4 / n, np.full((n_tok, G), n)) for n in (1, 2, 4, 8)]
    jobs.append(("cosine", [1e-3, 1e-2, 1e-3], 8, {}, base + 0.05, rng.integers(2, 6, (n_tok, G))))
    jobs.append(("fixed", None, [2, 4, 8], {}, base + 0.1, np.tile([2, 4, 8], (n_tok, 1))))
    jobs.append(("argmax_stability", None, 8, {"patience": 3}, base + 0.06, rng.integers(4, 8, (n_tok, G))))
    for j, (rule, tau, n, kw, nll, apps) in enumerate(jobs):
        _write_job(tmp_path / str(j), rule, tau, n, nll, apps, patience=kw.get("patience", 5))
    from recdepth.analysis import plots
    from tests.drawn import capture, curves, png_shows

    figs = capture(monkeypatch, plots, "fig4")
    with caplog.at_level(logging.INFO, logger="recdepth.plots"):
        sweep.summarize(tmp_path)
    assert "job(s) 4 have one τ per group" in caplog.text
    rows = {int(r["job"]): r for r in csv.DictReader(open(tmp_path / "sweep_results.csv"))}
    assert rows[4]["tau"] == "[0.001, 0.01, 0.001]" and rows[5]["max_steps"] == "[2, 4, 8]"
    assert rows[6]["patience"] == "3" and rows[4]["patience"] == "" and rows[0]["patience"] == ""
    md = (tmp_path / "sweep_results.md").read_text()
    assert "| [0.001, 0.01, 0.001] |" in md and "| 2 / 4 / 8 |" in md and "| k = 3 |" in md
    front = {int(r["job"]): r for r in csv.DictReader(open(tmp_path / "frontier.csv"))}
    assert sorted(front) == [4, 5, 6]
    assert float(front[5]["mean_applications"]) == pytest.approx(14 / 3)
    assert front[4]["tau"] == "[0.001, 0.01, 0.001]" and front[6]["patience"] == "3"
    assert "k = 3" in (tmp_path / "frontier.md").read_text()
    # Fig. 4: against τ only argmax_stability's level (the per-group τ job is left out; the fixed
    # grids are the frontier panels'); against layer applications every job, each rule at its
    # cost and CE − CE(fixed 8), the fixed frontier through the four uniform depths
    (fig,) = figs
    assert png_shows(fig, tmp_path / "fig4_exits.png")
    for ax, key in zip(fig.axes[:4], ("ms_per_token", "ppl", "ce", "layer_applications")):
        drawn = curves(ax)
        assert set(drawn) == {"argmax_stability (k = 3)"}
        assert (drawn["argmax_stability (k = 3)"][:, 1] == float(rows[6][key])).all()
    drawn, ref = curves(fig.axes[4]), float(rows[3]["ce"])

    def at(*jobs):
        return [[float(rows[j]["layer_applications"]), float(rows[j]["ce"]) - ref] for j in jobs]

    np.testing.assert_allclose(drawn["fixed (frontier)"], at(0, 1, 2, 3), atol=1e-12)
    for j, fam in ((4, "cosine"), (5, "fixed (per group)"), (6, "argmax_stability")):
        np.testing.assert_allclose(drawn[fam], at(j), atol=1e-12)


def WINDOWS(n_tok):
    """The synthetic jobs' windows: 4 tokens each."""
    return np.arange(n_tok) // 4


def _write_job(d, rule, tau, n, nll, apps, **extra):
    """A sweep job directory as an evaluation leaves it (an older one, whose metrics.json
    does not give its groups' sizes: cost in mean applications): eval_tokens.csv and
    metrics.json."""
    n_tok = len(nll)
    d.mkdir()
    token_files.write_tokens(d / "eval_tokens.csv", WINDOWS(n_tok), np.arange(n_tok), np.arange(n_tok) % 7,
                       np.arange(n_tok) % 7, nll, apps)
    ev = {"exit": rule, "tau": tau, "max_steps": n, "ce": float(np.mean(nll)), "ce_ci": [0, 0], "ppl": 1.0,
          "ms_per_token": 1.0 + float(apps.mean()), "applications_per_token": apps.mean(axis=0).tolist(),
          "tokens": n_tok, "tokens_per_s": 1.0, **extra}
    (d / "metrics.json").write_text(json.dumps({"eval": ev}))


def test_sweep_callback_writes_the_table_after_each_job_and_the_frontier_at_the_end(tmp_path):
    """SweepSummary: after a job, sweep_results.csv holds every job so far and nothing
    slower is written (no frontier, no figure); at the end of the sweep the whole summary,
    the same files `summarize` writes on its own."""
    import csv
    import filecmp

    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from recdepth import sweep

    rng = np.random.default_rng(42)
    n_tok, G = 60, 3
    base = rng.gamma(2.0, 2.0, n_tok)
    jobs = [("fixed", None, n, base + 0.4 / n, np.full((n_tok, G), n)) for n in (1, 2, 4)]
    jobs.append(("kl", 1e-3, 4, base + 0.05, rng.integers(1, 4, (n_tok, G))))
    cfg = OmegaConf.create({"hydra": {"mode": RunMode.MULTIRUN, "sweep": {"dir": str(tmp_path / "sweep")}}})
    callback = sweep.SweepSummary()
    (tmp_path / "sweep").mkdir()
    for j, (rule, tau, n, nll, apps) in enumerate(jobs):
        _write_job(tmp_path / "sweep" / str(j), rule, tau, n, nll, apps)
        callback.on_job_end(cfg)
        rows = list(csv.DictReader(open(tmp_path / "sweep" / "sweep_results.csv")))
        assert [int(r["job"]) for r in rows] == list(range(j + 1))
        assert not (tmp_path / "sweep" / "frontier.csv").exists()
        assert not (tmp_path / "sweep" / "fig4_exits.png").exists()
    callback.on_multirun_end(cfg)
    front = list(csv.DictReader(open(tmp_path / "sweep" / "frontier.csv")))
    assert [int(r["job"]) for r in front] == [3]
    alone = tmp_path / "alone"
    alone.mkdir()
    for j, (rule, tau, n, nll, apps) in enumerate(jobs):
        _write_job(alone / str(j), rule, tau, n, nll, apps)
    sweep.summarize(alone)
    for f in ("sweep_results.csv", "frontier.csv", "frontier.md"):
        assert filecmp.cmp(tmp_path / "sweep" / f, alone / f, shallow=False), f
    import matplotlib.image as mpimg  # the same Fig. 4, pixel for pixel (what it draws: the test above)

    assert (mpimg.imread(tmp_path / "sweep" / "fig4_exits.png") == mpimg.imread(alone / "fig4_exits.png")).all()


def test_frontier_reads_each_jobs_cost_with_its_checks_and_a_tasks_time_per_answer(tmp_path):
    """A job whose eval_tokens.csv has the `cost` column (its checks priced) sits on the
    frontier at that cost, the loop alone beside it; with every timed job giving ms per
    answer (a task), the equal-latency comparison reads those."""
    import csv

    from recdepth import sweep

    rng = np.random.default_rng(42)
    n_tok = 80
    base = rng.gamma(2.0, 2.0, n_tok)
    jobs = [("fixed", None, n, base + 0.4 / n, np.full((n_tok, 1), n)) for n in (1, 2, 4, 8)]
    jobs.append(("kl", 1e-3, 8, base + 0.06, rng.integers(2, 5, (n_tok, 1))))
    for j, (rule, tau, n, nll, apps) in enumerate(jobs):
        _write_job(tmp_path / str(j), rule, tau, n, nll, apps, group_layers=[1], outside_layers=2,
                   ms_per_answer=10.0 + n if rule == "fixed" else 30.0, ms_per_answer_ci=[1.0, 50.0],
                   ms_per_answer_repeats=[10.0 + n] * 3 if rule == "fixed" else [30.0] * 3,
                   ms_per_token_repeats=[1.0 + float(apps.mean())] * 3)
    _, _, _, nll, apps = jobs[4]
    cost = 2 + apps[:, 0] + 1.04 * (apps[:, 0] - 1)  # a kl check through a one-layer coda, n − 1 of them
    token_files.write_tokens(tmp_path / "4" / "eval_tokens.csv", WINDOWS(n_tok), np.arange(n_tok),
                             np.arange(n_tok) % 7, np.arange(n_tok) % 7, nll, apps, cost=cost)
    sweep.summarize(tmp_path)
    (r,) = list(csv.DictReader(open(tmp_path / "frontier.csv")))
    assert float(r["layer_applications"]) == pytest.approx(cost.mean())
    assert float(r["loop_layer_applications"]) == pytest.approx(2 + apps.mean())
    fixed = {n: float(np.mean(nll_n)) for _, _, n, nll_n, _ in jobs[:4]}
    assert float(r["hull_ce"]) == pytest.approx(stats.hull_ce(fixed, cost.mean(), stats.Cost([1], 2)))
    # 30 ms per answer: dearer than every fixed depth (11 .. 18 ms), so the frontier there is fixed 8's CE
    assert r["latency"] == "ms_per_answer" and float(r["ms_frontier_ce"]) == pytest.approx(fixed[8])
    assert "ms/answer" in (tmp_path / "frontier.md").read_text()
