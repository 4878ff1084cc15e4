"""recdepth.stats against independent computations (docs/spec.md §4b): the closed-form CI
of a mean, coverage on data with a known mean, slow per-resample reference loops written
here from the definitions, brute force for the oracle, exact CSV round trips."""

import json
import math

import numpy as np
import pytest

from recdepth import stats

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


# ----------------------------------------------------------------- intervals
def test_bootstrap_indices_shape_range_and_seed():
    idx = stats.bootstrap_indices(50, 300, seed=3)
    assert idx.shape == (300, 50) and idx.min() >= 0 and idx.max() < 50
    assert np.array_equal(idx, stats.bootstrap_indices(50, 300, seed=3))
    assert not np.array_equal(idx, stats.bootstrap_indices(50, 300, seed=4))


def test_bootstrap_ci_of_a_mean_matches_the_closed_form():
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, 4000)
    m, lo, hi = stats.mean_ci(x, stats.bootstrap_indices(len(x), 2000, seed=2))
    half = 1.959964 * 2.0 / math.sqrt(len(x))  # normal-theory half-width, sd known
    assert m == pytest.approx(x.mean(), rel=1e-12)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)
    assert (lo + hi) / 2 == pytest.approx(x.mean(), abs=0.1 * half)


def test_bootstrap_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(3)
    idx = stats.bootstrap_indices(200, 400, seed=4)
    trials, covered = 200, 0
    for _ in range(trials):
        x = rng.normal(1.5, 3.0, 200)
        _, lo, hi = stats.mean_ci(x, idx)
        covered += lo <= 1.5 <= hi
    assert 0.90 <= covered / trials <= 0.99


def test_paired_difference():
    rng = np.random.default_rng(5)
    a = rng.normal(0, 1, 1000)
    idx = stats.bootstrap_indices(1000, 500)
    d, lo, hi = stats.diff_ci(a, a + 0.1, idx)
    assert d == pytest.approx(-0.1, abs=1e-12)
    assert lo == pytest.approx(-0.1, abs=1e-12) and hi == pytest.approx(-0.1, abs=1e-12)
    b = a + rng.normal(0.05, 0.1, 1000)  # strongly positively correlated with a
    _, plo, phi = stats.diff_ci(a, b, idx)
    # unpaired: a and b resampled independently
    idx2 = stats.bootstrap_indices(1000, 500, seed=99)
    u = a[idx].mean(axis=1) - b[idx2].mean(axis=1)
    ulo, uhi = np.quantile(u, [0.025, 0.975])
    assert phi - plo < 0.3 * (uhi - ulo)
    assert plo <= np.mean(a - b) <= phi


# ------------------------------------------------------------------ frontier
def ref_frontier(F, A):
    best, best_n = math.inf, None
    for n in F:
        if n <= A and F[n] < best:
            best, best_n = F[n], n
    return (math.nan, None) if best_n is None else (best, best_n)


def ref_needed(F, c):
    reach = [n for n in F if F[n] <= c]
    return (min(reach), True) if reach else (max(F), False)


def ref_hull(F, A):
    """The best per-token mix of fixed depths at mean cost <= A, by enumeration: a single
    depth n <= A, or two depths n_i <= A < n_j mixed to cost exactly A (a linear program
    with two constraints has an optimum on two points)."""
    cand = [F[n] for n in F if n <= A]
    cand += [F[i] + (F[j] - F[i]) * (A - i) / (j - i) for i in F for j in F if i <= A < j]
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


def test_vs_frontier_at_a_given_cost_against_a_slow_reference():
    rng = np.random.default_rng(22)
    n_tok = 50
    base = rng.gamma(2.0, 2.0, n_tok)
    fixed = {ms: base + 1.0 / ms + rng.normal(0, 0.05, n_tok) for ms in (4.3, 6.9, 8.9, 22.3)}
    rule = base + 0.1 + rng.normal(0, 0.05, n_tok)
    idx = stats.bootstrap_indices(n_tok, 200, seed=23)
    for cost in (3.0, 5.0, 10.0, 40.0):
        got = stats.vs_frontier_at(rule, cost, fixed, idx)
        mean = lambda v, sel: sum(v[i] for i in sel) / len(sel)  # noqa: E731
        d = [mean(rule, r) - ref_hull({k: mean(v, r) for k, v in fixed.items()}, cost) for r in idx.tolist()]
        want = rule.mean() - ref_hull({k: v.mean() for k, v in fixed.items()}, cost)
        if cost < 4.3:
            assert math.isnan(got["d"]) and math.isnan(got["d_lo"])
            continue
        assert got["d"] == pytest.approx(want)
        assert (got["d_lo"], got["d_hi"]) == pytest.approx(tuple(np.quantile(d, [0.025, 0.975])))


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


def slow_compare(nll, apps, fixed_nll, idx):
    """compare() from the definitions, one resample at a time, in plain Python."""
    def point(sel):
        c = sum(nll[i] for i in sel) / len(sel)
        A = sum(sum(apps[i]) / len(apps[i]) for i in sel) / len(sel)
        F = {n: sum(v[i] for i in sel) / len(sel) for n, v in fixed_nll.items()}
        front, front_n = ref_frontier(F, A)
        need, reached = ref_needed(F, c)
        return c, A, c - front, 1 - A / need, need, reached, front, front_n, c - ref_hull(F, A)

    full = point(range(len(nll)))
    res = [point(list(r)) for r in idx.tolist()]

    def q(k):
        v = sorted(r[k] for r in res if not math.isnan(r[k]))
        return (np.quantile(v, 0.025), np.quantile(v, 0.975)) if v else (math.nan, math.nan)
    return full, q, res


@pytest.mark.parametrize("case", ["between", "better_than_all", "below_smallest", "sometimes_undefined"])
def test_compare_against_a_slow_reference(case):
    rng = np.random.default_rng({"between": 6, "better_than_all": 7, "below_smallest": 8,
                                 "sometimes_undefined": 13}[case])
    n_tok, G = 60, 3
    base = rng.gamma(2.0, 2.0, n_tok)
    fixed_nll = {n: base + 0.3 / n + rng.normal(0, 0.05, n_tok) for n in (2, 4, 8)}
    if case == "between":
        nll, apps = base + 0.1 + rng.normal(0, 0.05, n_tok), rng.integers(2, 7, (n_tok, G))
    elif case == "better_than_all":
        nll, apps = base - 0.2, rng.integers(3, 9, (n_tok, G))
    elif case == "below_smallest":
        nll, apps = base + 0.5, np.ones((n_tok, G), dtype=int)
    else:  # A close to the smallest fixed n: some resamples fall below it
        nll = base + 0.2
        apps = np.repeat(rng.permutation(np.repeat([1, 3], n_tok // 2))[:, None], G, axis=1)  # A = 2 exactly
    idx = stats.bootstrap_indices(n_tok, 300, seed=9)
    got = stats.compare(nll, apps, fixed_nll, idx)
    (c, A, d, s, need, reached, front, front_n, dh), q, res = slow_compare(
        nll.tolist(), apps.tolist(), {k: v.tolist() for k, v in fixed_nll.items()}, idx)
    assert got["ce"] == pytest.approx(c) and got["mean_applications"] == pytest.approx(A)
    assert got["fixed_n"] == need and got["reached"] == reached and got["saving"] == pytest.approx(s)
    assert got["frontier_n"] == front_n
    if case != "below_smallest":
        assert got["d_hull"] == pytest.approx(dh) and (got["d_hull_lo"], got["d_hull_hi"]) == pytest.approx(q(8))
    assert (got["ce_lo"], got["ce_hi"]) == pytest.approx(q(0))
    assert (got["mean_applications_lo"], got["mean_applications_hi"]) == pytest.approx(q(1))
    assert (got["saving_lo"], got["saving_hi"]) == pytest.approx(q(3))
    undefined = np.mean([math.isnan(r[2]) for r in res])
    assert got["d_ce_undefined"] == pytest.approx(undefined)
    if case == "below_smallest":
        assert math.isnan(got["frontier_ce"]) and math.isnan(got["d_ce"]) and got["frontier_n"] is None
        assert math.isnan(got["d_ce_lo"]) and math.isnan(got["d_ce_hi"]) and undefined == 1
    else:
        assert got["frontier_ce"] == pytest.approx(front) and got["d_ce"] == pytest.approx(d)
        assert (got["d_ce_lo"], got["d_ce_hi"]) == pytest.approx(q(2))
    if case == "better_than_all":
        assert got["reached"] is False and got["fixed_n"] == 8
    if case == "between":
        assert got["reached"] is True
    if case == "sometimes_undefined":
        assert 0 < undefined < 1


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
    assert (stats.oracle_n(m, math.inf) == 1).all()
    n0 = stats.oracle_n(m, 0.0)
    assert ((n0 >= 1) & (n0 <= 7)).all()
    assert (m[np.arange(50), n0 - 1] == m[:, -1]).all()  # eps = 0: the max-depth NLL itself
    # two-sided: a depth whose target NLL is far BELOW the max-depth one is not "within eps"
    assert stats.oracle_n([[1.0, 3.0, 3.05]], 0.1).tolist() == [2]


def slow_oracle_saving(m, grid, c_tok, c_fixed, fixed_nll, idx):
    """oracle_saving() from the definitions, per resample, plain Python."""
    n_by_eps = {e: brute_oracle_n(m, e) for e in grid}

    def one(sel):
        c = c_fixed if c_tok is None else sum(c_tok[i] for i in sel) / len(sel)
        F = {n: sum(v[i] for i in sel) / len(sel) for n, v in fixed_nll.items()}
        pts = []
        for e in grid:
            ns = n_by_eps[e]
            ce = sum(m[i][ns[i] - 1] for i in sel) / len(sel)
            A = sum(ns[i] for i in sel) / len(sel)
            if ce <= c:
                pts.append((A, ce, e))
        if not pts:
            return math.nan, None, math.nan
        A, _, e = min(pts)
        return 1 - A / ref_needed(F, c)[0], e, A

    full = one(range(len(m)))
    res = [one(r) for r in idx.tolist()]
    v = [r[0] for r in res if not math.isnan(r[0])]
    q = tuple(np.quantile(v, [0.025, 0.975])) if v else (math.nan, math.nan)
    return full, q, np.mean([math.isnan(r[0]) for r in res])


@pytest.mark.parametrize("target", ["float", "per_token", "unreachable"])
def test_oracle_saving_against_a_slow_reference(target):
    rng = np.random.default_rng(11)
    n_tok, N = 80, 8
    m = rng.normal(3, 1, (n_tok, N)) + 0.4 / np.arange(1, N + 1)
    fixed_nll = {n: m[:, n - 1] + 0.05 for n in (1, 2, 4, 8)}
    grid = [0.0, 0.01, 0.1, 0.3, 1.0]
    idx = stats.bootstrap_indices(n_tok, 200, seed=12)
    rule = m[:, -1] + 0.1 + rng.normal(0, 0.05, n_tok)
    if target == "float":
        c_tok, c = None, float(m[:, -1].mean()) + 0.08
    elif target == "per_token":
        c_tok, c = rule, rule
    else:
        c_tok, c = None, float(m.min(axis=1).mean()) - 0.5  # below every oracle point
    got = stats.oracle_saving(m, grid, c, fixed_nll, idx)
    c0 = float(np.mean(c))
    (s, eps, A), q, undefined = slow_oracle_saving(
        m.tolist(), grid, None if c_tok is None else c_tok.tolist(), c0,
        {k: v.tolist() for k, v in fixed_nll.items()}, idx)
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
    stats.write_tokens(f, np.arange(n) // 8, np.arange(n), target, gpt2, nll, apps, ms)
    r = stats.read_tokens(f)
    assert r["nll"].tobytes() == nll.tobytes() and np.array_equal(r["apps"], apps)
    assert r["ms"][:10].tobytes() == ms[:10].tobytes() and np.isnan(r["ms"][10:]).all()
    assert r["window"].tolist() == (np.arange(n) // 8).tolist() and r["position"].tolist() == list(range(n))
    assert r["target"].tolist() == target.tolist() and r["target_gpt2"].tolist() == gpt2.tolist()
    assert f.read_text().splitlines()[0] == "window,position,target,target_gpt2,nll,apps_0,apps_1,apps_2,ms"
    assert [p.name for p in tmp_path.iterdir()] == ["eval_tokens.csv"]  # no temporary left behind
    # ms=None: an empty ms column; one group
    stats.write_tokens(f, [0, 0], [0, 1], [5, 6], [7, 8], [0.1, 0.2], [[1], [2]])
    r = stats.read_tokens(f)
    assert r["apps"].shape == (2, 1) and np.isnan(r["ms"]).all() and r["nll"].tolist() == [0.1, 0.2]
    # a model without recurrence (model=baseline): no apps columns at all
    stats.write_tokens(f, [0, 0], [0, 1], [5, 6], [7, 8], [0.1, 0.2], np.zeros((2, 0), dtype=int))
    r = stats.read_tokens(f)
    assert f.read_text().splitlines()[0] == "window,position,target,target_gpt2,nll,ms"
    assert r["apps"].shape == (2, 0) and r["nll"].tolist() == [0.1, 0.2]


def test_read_tokens_apps_columns_in_group_order(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("window,position,target,target_gpt2,nll,apps_1,apps_0,ms\n0,3,4,5,1.5,7,2,\n")
    r = stats.read_tokens(f)
    assert r["apps"].tolist() == [[2, 7]] and math.isnan(r["ms"][0]) and r["nll"][0] == 1.5


def test_read_tokens_errors_are_one_line_and_name_the_file(tmp_path):
    f = tmp_path / "eval_tokens.csv"
    f.write_text("window,position,target\n0,0,1\n")
    with pytest.raises(ValueError, match="no column 'target_gpt2'") as e:
        stats.read_tokens(f)
    assert "\n" not in str(e.value) and str(f) in str(e.value)
    f.write_text("window,position,target,target_gpt2,nll,apps_0,ms\n0,0,1,1,0.5,2,\n0,1,1,1,oops,2,\n")
    with pytest.raises(ValueError, match="row 2") as e:
        stats.read_tokens(f)
    assert "\n" not in str(e.value) and str(f) in str(e.value)
    f.write_text("window,position,target,target_gpt2,nll,apps_0,apps_2,ms\n")
    with pytest.raises(ValueError, match="apps_1"):
        stats.read_tokens(f)


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
    idx = stats.bootstrap_indices(n_tok, 1000)
    fixed_nll = {n: nll.tolist() for rule, _, n, nll, _ in jobs if rule == "fixed"}
    for j in (4, 5):
        _, _, _, nll, apps = jobs[j]
        (c, A, d, s, need, reached, front_ce, front_n, dh), q, _ = slow_compare(nll.tolist(), apps.tolist(),
                                                                                fixed_nll, idx)
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
    assert front[4]["verdict"] == "beats the fixed frontier"  # kl: near the deepest CE at ~3 applications
    assert front[5]["verdict"] == "worse than the fixed frontier"  # accel: 0.2 nats worse at ~5


def test_sweep_summary_with_per_group_values(tmp_path, caplog):
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
    with caplog.at_level(logging.INFO, logger="recdepth.sweep"):
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
    assert (tmp_path / "fig4_exits.png").is_file()


def _write_job(d, rule, tau, n, nll, apps, **extra):
    """A sweep job directory as an evaluation leaves it: eval_tokens.csv and metrics.json."""
    n_tok = len(nll)
    d.mkdir()
    stats.write_tokens(d / "eval_tokens.csv", np.zeros(n_tok, int), np.arange(n_tok), np.arange(n_tok) % 7,
                       np.arange(n_tok) % 7, nll, apps)
    ev = {"exit": rule, "tau": tau, "max_steps": n, "ce": float(np.mean(nll)), "ce_ci": [0, 0], "ppl": 1.0,
          "ms_per_token": 1.0 + float(apps.mean()), "applications_per_token": apps.mean(axis=0).tolist(),
          "tokens": n_tok, "tokens_per_s": 1.0, **extra}
    (d / "metrics.json").write_text(json.dumps({"eval": ev}))
