"""Statistics of exit evaluations from per-token records, numpy only. Follows
docs/spec.md §4b (fixed-depth frontier, oracle, intervals, cost).

Every exit-rule evaluation ("job") of one checkpoint scores the same held-out tokens in
the same order and writes one row per token (recdepth/analysis/token_files.py): window,
nll[i] (nats), apps[i, g] (applications of recurrence group g) and ms[i] (batch-1
latency, NaN where not timed). A job's CE is mean(nll); its cost A is the mean of
`Cost.per_token(apps)`, layer applications per token (Σ_g |g| · apps_g + the layers
outside the loops; without a Cost, the older unit: apps averaged over groups). Each
definition below lives in one function:

- fixed-depth frontier: the jobs with exit=fixed at n = 1, 2, 3, 4, 6, 8, 12, 16, 24, 32
  (every group runs exactly n; cost `Cost.uniform(n)`). For a rule job with cost A and CE c:
  - `frontier_ce`: the lowest CE among fixed n costing <= A (NaN, no n, if there is none);
  - `fixed_needed`: the smallest fixed n whose CE <= c; if no fixed n reaches c, the
    largest n of the grid, flagged reached=False (the saving is then a lower bound);
  - `saving`: 1 − A / (the cost of the fixed n needed for c);
  - `hull_ce`: the fixed frontier at exactly cost A: the lower convex hull of the points
    (cost_n, min_{m<=n} CE_m), i.e. the best mix of two fixed depths whose mean cost is A (a
    coin flip per token between them reaches it, up to the depth of the history). This
    is the equal-compute baseline the verdict uses: on a grid, "best fixed n <= A" for a
    rule at A = 7.96 is fixed-6, which costs 25% less;
  - `compare`: all of these for one job, with intervals and the p-value of the verdict.
- oracle (ε): nll_by_n[i, n−1] is token i's NLL at a uniform n = 1..N in every group
  (earlier tokens at N). `oracle_n`: per token the smallest n with |nll_by_n[i, n−1] −
  nll_by_n[i, N−1]| <= ε (two-sided: "within ε" of the max-depth prediction, so the
  oracle keeps the quality of N; a one-sided "<= + ε" would also pick depths where the
  target happens to score better, a best-of-N selection on the target that lowers CE
  below every fixed depth and measures luck, not saved compute); `oracle_point`: its CE
  (mean NLL at those n) and cost; `oracle_saving`: at a CE c, the oracle point over an ε
  grid with the lowest cost whose CE <= c, and 1 − A_oracle / cost(fixed_needed(c)). The
  oracle reads the target: a reference point, not a bound on rules that spend different
  depths per group.
- intervals: 95% paired percentile bootstrap over independent units, the held-out
  windows (`Bootstrap`; for tasks, instances): the same resampled units for every job of
  a quantity, the whole statistic recomputed per resample (every fixed CE, the rule's CE
  and A, then the frontier point / fixed n / oracle ε chosen again), the 2.5% and 97.5%
  percentiles of the resampled statistic are the interval (`mean_ci`, `diff_ci`,
  `compare`, `oracle_saving`, `vs_frontier_at`). Many comparisons: `boot_p` and `holm`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

LEVEL = 0.95


# ------------------------------------------------------------------ bootstrap
def bootstrap_indices(n: int, resamples: int = 1000, seed: int = 0) -> np.ndarray:
    """[resamples, n] unit indices drawn with replacement (a fixed seed: every job of a
    sweep is resampled the same way, which makes differences paired)."""
    if n < 1:
        raise ValueError(f"bootstrap: need at least one unit, got {n}")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


class Bootstrap:
    """The resamples of a paired percentile bootstrap over independent units
    (docs/spec.md §4b): `units[i]` names the unit of token i (its window; for a task, its
    instance). Each resample draws as many units as there are, with replacement
    (`bootstrap_indices` over the units, the same draws for every job of a sweep), and a
    resampled mean is the ratio estimator sum over the drawn units' tokens / their number
    of tokens, so windows of unequal length weigh by their tokens, as in the full mean.
    `Bootstrap(np.arange(n))` is the bootstrap over tokens. The reason for units: tokens
    of one window share its text's difficulty, so resampling tokens as if independent
    makes intervals of absolute quantities too narrow (spec §4b)."""

    def __init__(self, units, resamples: int = 1000, seed: int = 0):
        units = np.asarray(units)
        if units.ndim != 1 or len(units) < 1:
            raise ValueError(f"bootstrap: expected one unit id per token (a non-empty 1-D array), got shape {units.shape}")
        _, self.inverse = np.unique(units, return_inverse=True)
        self.n_units = int(self.inverse.max()) + 1
        self.tokens = len(units)
        idx = bootstrap_indices(self.n_units, resamples, seed)
        # counts[r, u]: how often resample r drew unit u
        self.counts = np.zeros((resamples, self.n_units))
        np.add.at(self.counts, (np.repeat(np.arange(resamples), self.n_units), idx.ravel()), 1.0)
        self.size = np.bincount(self.inverse, minlength=self.n_units).astype(float)

    @property
    def resamples(self) -> int:
        return len(self.counts)

    def __len__(self) -> int:
        return self.resamples

    def unit_sums(self, x) -> np.ndarray:
        """Per-unit sums of a per-token quantity: [units]."""
        x = np.asarray(x, dtype=float)
        if x.shape != (self.tokens,):
            raise ValueError(f"bootstrap: {len(x)} values for {self.tokens} tokens")
        return np.bincount(self.inverse, weights=x, minlength=self.n_units)

    def ratios(self, num, den) -> np.ndarray:
        """sum(num) / sum(den) over each resample's tokens: [resamples] (num, den per token)."""
        return (self.counts @ self.unit_sums(num)) / (self.counts @ self.unit_sums(den))

    def means(self, x) -> np.ndarray:
        """The mean of a per-token x over each resample's tokens: [resamples]."""
        return (self.counts @ self.unit_sums(x)) / (self.counts @ self.size)


def _interval(samples: np.ndarray) -> tuple[float, float]:
    """The 2.5% and 97.5% percentiles of the resampled statistic (its undefined, NaN,
    resamples left out; (nan, nan) if all are)."""
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if len(s) == 0:
        return math.nan, math.nan
    a = (1 - LEVEL) / 2
    lo, hi = np.quantile(s, [a, 1 - a])
    return float(lo), float(hi)


def interval(samples) -> tuple[float, float]:
    """The 95% percentile interval of resampled values of a statistic (NaNs left out)."""
    return _interval(samples)


def mean_ci(x, boot: Bootstrap) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of x and its 95% percentile-bootstrap interval. The
    resampled means are sums in another order than `x.mean()`, so where every resample
    equals the mean (a constant x, e.g. a cost every token pays alike) an end can miss it
    by a rounding error; an end within 1e-12 (relative) of the mean is the mean."""
    x = np.asarray(x, dtype=float)
    m = float(x.mean())
    lo, hi = _interval(boot.means(x))
    tol = 1e-12 * max(1.0, abs(m))
    return m, (m if abs(lo - m) <= tol else lo), (m if abs(hi - m) <= tol else hi)


def diff_ci(a, b, boot: Bootstrap) -> tuple[float, float, float]:
    """Paired difference mean(a − b) of two jobs on the same tokens, with its interval."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    return mean_ci(d, boot)


def boot_p(samples, null: float = 0.0) -> float:
    """Two-sided percentile-bootstrap p-value of "the statistic equals `null`": twice the
    smaller fraction of the (defined) resamples on either side of it, at most 1. It is
    below 0.05 exactly when the 95% percentile interval excludes `null` (up to the
    quantiles' interpolation), so Holm's procedure on these p-values controls the
    family-wise error of the interval verdicts (`holm`)."""
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if len(s) == 0:
        return math.nan
    return float(min(1.0, 2 * min((s <= null).mean(), (s >= null).mean())))


def holm(pvalues) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error control over m comparisons):
    with p sorted ascending, p_adj(i) = max_{j <= i} min(1, (m − j) p_(j)) (0-based j),
    in the input order; NaN p-values are left out of m and stay NaN."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(len(p), math.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m = len(ok)
    running = 0.0
    for rank, i in enumerate(ok[np.argsort(p[ok], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def latency_ci(ms, units, resamples: int = 1000, seed: int = 0) -> tuple[float, float, float, list[float]]:
    """Mean latency over timed tokens with its timing repeats: ms [tokens, repeats] (each
    token's ms in every repeat), `units` [tokens] (their windows or instances). Returns the
    median over repeats of the mean ms, its 95% percentile interval, each resample drawing
    whole units (`Bootstrap`) and one repeat (uniformly, seed 1, as `vs_frontier_at`
    does), and the mean of each repeat."""
    ms = np.asarray(ms, dtype=float)
    if ms.ndim != 2 or not ms.size:
        raise ValueError(f"latency_ci: expected ms [tokens, repeats], got shape {ms.shape}")
    per_rep = ms.mean(axis=0)
    boot = Bootstrap(units, resamples, seed)
    by_rep = np.stack([boot.means(ms[:, r]) for r in range(ms.shape[1])], axis=1)  # [resamples, repeats]
    pick = np.random.default_rng(1).integers(0, ms.shape[1], len(boot))
    lo, hi = _interval(by_rep[np.arange(len(boot)), pick])
    return float(np.median(per_rep)), lo, hi, [float(x) for x in per_rep]


# ------------------------------------------------------------------ cost
class Cost:
    """The cost of a token in layer applications (docs/spec.md §4b), with its exit checks.

    The loop: every layer that ran, counted once per application, Σ_g |g| · applications_g
    plus the layers outside the loops (run once); `layers[g]` = |g|, the layers of
    recurrence group g; `outside` = the model's other layers. A uniform depth n costs
    `uniform(n)` = outside + n Σ_g |g| (a fixed depth checks nothing). `loop(apps)` is this
    count alone, the unit recdepth used before checks were priced.

    The checks: `checks[g]` is the price of one check of group g's rule in layer
    equivalents (0: a rule without a check; a decoding rule's coda layers, head and
    statistic, a state rule's O(d) statistic: `recdepth.decode.state_decode.check_price`).
    A check runs after every application but the one at the group's `limits[g]` (its
    max_steps, where the limit decides, not the rule), and with `reuse[g]` the check that
    fires is the token's output (its decode is the coda and head the token runs anyway),
    so it is not billed again: a loop that ran n applications pays n checks, n − 1 at its
    limit, one fewer again with `reuse` when the rule fired (n − 1 either way).
    `per_token(apps)` = the loop + the checks billed, the cost every comparison uses.

    `Cost.mean_applications(G)` (|g| = 1/G, outside 0, no checks) is the older unit,
    applications averaged over groups, kept for records that do not say their groups' sizes."""

    def __init__(self, layers, outside: int = 0, checks=None, limits=None, reuse=None):
        self.layers = tuple(float(x) for x in layers)
        self.outside = float(outside)
        G = len(self.layers)
        self.checks = (0.0,) * G if checks is None else tuple(float(x) for x in checks)
        self.limits = (math.inf,) * G if limits is None else tuple(float(x) for x in limits)
        self.reuse = (False,) * G if reuse is None else tuple(bool(x) for x in reuse)
        if any(x <= 0 for x in self.layers) or self.outside < 0:
            raise ValueError(f"cost: group sizes must be > 0 and outside layers >= 0, got {self.layers}, {self.outside}")
        if not len(self.checks) == len(self.limits) == len(self.reuse) == G:
            raise ValueError(f"cost: expected {G} check prices, limits and reuse flags (one per group), got "
                             f"{self.checks}, {self.limits}, {self.reuse}")
        if any(not (x >= 0 and math.isfinite(x)) for x in self.checks) or any(not x >= 1 for x in self.limits):
            raise ValueError(f"cost: check prices must be finite and >= 0 and limits >= 1, got {self.checks}, "
                             f"{self.limits}")

    @classmethod
    def of_model(cls, groups, n_layer: int, checks=None, limits=None, reuse=None) -> Cost:
        """From a model config's groups (lists of layer indices) and n_layer."""
        return cls([len(g) for g in groups], n_layer - sum(len(g) for g in groups), checks, limits, reuse)

    @classmethod
    def mean_applications(cls, n_groups: int) -> Cost:
        return cls([1.0 / n_groups] * n_groups, 0)

    @property
    def checked(self) -> bool:
        """Whether any group's rule has a priced check (False: the loop alone, fixed depth)."""
        return any(self.checks)

    def _apps(self, apps) -> np.ndarray:
        a = np.asarray(apps, dtype=float)
        if a.ndim != 2 or a.shape[1] != len(self.layers):
            raise ValueError(f"cost: expected applications [tokens, {len(self.layers)}], got shape {a.shape}")
        return a

    def loop(self, apps) -> np.ndarray:
        """Layer applications of the loop alone, each token's, from its applications per group
        [tokens, G]: outside + Σ_g |g| · apps_g."""
        return self.outside + self._apps(apps) @ np.asarray(self.layers)

    def billed_checks(self, apps, checked=None) -> np.ndarray:
        """Checks billed per token and group [tokens, G]: n − [n >= limit] − [reuse and n < limit]
        for a group whose rule checks, 0 for one that does not; 0 for every group of a token
        whose depth was forced (`checked` [tokens] False: a task's context under
        eval.context_steps runs no check)."""
        a = self._apps(apps)
        limit, reuse = np.asarray(self.limits, dtype=float), np.asarray(self.reuse, dtype=bool)
        at_limit = a >= limit
        n = a - at_limit - (reuse & ~at_limit)
        n = np.where(np.asarray(self.checks, dtype=float) > 0, np.maximum(n, 0.0), 0.0)
        if checked is not None:
            n = n * np.asarray(checked, dtype=bool)[:, None]
        return n

    def per_token(self, apps, checked=None) -> np.ndarray:
        """The cost of each token in layer equivalents: `loop(apps)` plus its `billed_checks`
        times their prices (`checked`: see `billed_checks`)."""
        return self.loop(apps) + self.billed_checks(apps, checked) @ np.asarray(self.checks, dtype=float)

    def uniform(self, n) -> float | np.ndarray:
        """The cost of n applications in every group with no check (n may be an array)."""
        return self.outside + np.asarray(n, dtype=float) * sum(self.layers) if np.ndim(n) else \
            self.outside + float(n) * sum(self.layers)

    def loop_only(self) -> Cost:
        """The same model's cost without the checks (a fixed depth's, the oracle's)."""
        return Cost(self.layers, self.outside)

    def __eq__(self, other) -> bool:
        return isinstance(other, Cost) and (self.layers, self.outside, self.checks, self.limits, self.reuse) == (
            other.layers, other.outside, other.checks, other.limits, other.reuse)

    def __repr__(self) -> str:
        extra = f", checks={list(self.checks)}, limits={list(self.limits)}, reuse={list(self.reuse)}" \
            if self.checked else ""
        return f"Cost(layers={list(self.layers)}, outside={self.outside:g}{extra})"


# ------------------------------------------------------------------ frontier
def _costs(fixed: Mapping[int, float], cost: Cost | Mapping | None) -> dict[int, float]:
    """The cost of each fixed depth n: cost.uniform(n), cost[n] where cost is a table of
    costs, or n itself without a cost."""
    if isinstance(cost, Mapping):
        return {n: float(cost[n]) for n in fixed}
    return {n: (float(n) if cost is None else float(cost.uniform(n))) for n in fixed}


# "cost_n <= A" up to rounding: a rule's A is a mean (a ratio of sums per resample), and
# applications averaged over groups (k / G) are not exact in binary, so an A equal to a
# fixed depth's cost in exact arithmetic can come out an ulp below it, which would drop
# that depth from the frontier. A relative 1e-9 is far below the gap between distinct
# means of integer applications (1 / (tokens · G)).
_TIE = 1e-9


def _within(c: float, A: float) -> bool:
    """c <= A, with A's rounding error allowed for."""
    return c <= A + _TIE * max(1.0, abs(A))


def frontier_ce(fixed: Mapping[int, float], A: float, cost: Cost | None = None) -> tuple[float, int | None]:
    """The lowest CE among fixed depths n whose cost <= A, and that n ((nan, None) if none).
    Cost: `cost.uniform(n)` layer applications, or n without a Cost."""
    c = _costs(fixed, cost)
    below = [(ce, n) for n, ce in fixed.items() if _within(c[n], A)]
    if not below:
        return math.nan, None
    ce, n = min(below)
    return float(ce), int(n)


def fixed_needed(fixed: Mapping[int, float], c: float) -> tuple[int, bool]:
    """The smallest fixed n whose CE <= c, and True; (largest n, False) if none reaches c."""
    for n in sorted(fixed):
        if fixed[n] <= c:
            return int(n), True
    return int(max(fixed)), False


def hull_ce(fixed: Mapping[int, float], A: float, cost: Cost | None = None) -> float:
    """The fixed-depth frontier at cost A: the lowest CE that fixed depths mixed per token
    reach at mean cost <= A, i.e. the lower convex hull of the points (cost_n, min_{m<=n}
    CE_m) evaluated at A (NaN if A < the smallest cost; the smallest CE if A >= the
    largest). cost_n = `cost.uniform(n)` layer applications, or n without a Cost."""
    cn = _costs(fixed, cost)
    pts, best = [], math.inf
    for n, ce in sorted(fixed.items()):
        best = min(best, float(ce))
        pts.append((cn[n], best))
    if not pts or not _within(pts[0][0], A):
        return math.nan
    A = max(A, pts[0][0])
    if A >= pts[-1][0]:
        return pts[-1][1]
    hull: list[tuple[float, float]] = []  # Andrew's monotone chain, lower part
    for q in pts:
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (q[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (q[0] - hull[-2][0])) <= 0:
            hull.pop()
        hull.append(q)
    for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
        if x0 <= A <= x1:
            return y0 + (y1 - y0) * (A - x0) / (x1 - x0)
    return math.nan  # unreachable: A lies within [first cost, last cost]


def saving(A: float, fixed: Mapping[int, float], c: float, cost: Cost | None = None) -> float:
    """1 − A / (the cost of the fixed depth needed for CE c)."""
    return 1.0 - A / _costs(fixed, cost)[fixed_needed(fixed, c)[0]]


def _cost(apps, cost: Cost | None = None) -> np.ndarray:
    """Per-token cost: `cost.per_token(apps)` (layer applications), or without a Cost the
    applications averaged over groups; a 1-D apps is taken as the per-token cost itself."""
    a = np.asarray(apps, dtype=float)
    if a.ndim == 1:
        return a
    return cost.per_token(a) if cost is not None else a.mean(axis=1)


def compare(rule_nll, rule_apps, fixed_nll: Mapping[int, np.ndarray], boot: Bootstrap,
            cost: Cost | None = None) -> dict:
    """One rule job against the fixed-depth jobs (docs/spec.md §4b), with paired intervals.

    rule_nll [tokens], rule_apps [tokens, groups] (or [tokens], the per-token cost
    already), fixed_nll {n: [tokens]} on the same tokens, boot a `Bootstrap` over their
    units, cost the model's `Cost` (layer applications; None: applications averaged over
    groups, the older unit). Returns ce (lo, hi); cost = A, the mean cost per token (lo,
    hi), also under its older key mean_applications; frontier_n, frontier_ce =
    `frontier_ce` at A; d_ce = ce − frontier_ce (lo, hi); fixed_n, reached =
    `fixed_needed` for ce; saving = `saving` (lo, hi); hull_ce = `hull_ce` at A and d_hull
    = ce − hull_ce (lo, hi), the equal-compute comparison, with p_hull its bootstrap
    p-value (`boot_p`). Per resample the rule's CE and A and every fixed CE are recomputed
    on the same resampled units and the definitions applied again (the frontier point and
    the fixed n may change). Resamples where d_ce is undefined (no fixed n within A there)
    are left out of its interval; d_ce_undefined is their fraction."""
    nll, rc = np.asarray(rule_nll, dtype=float), _cost(rule_apps, cost)
    if len(nll) != len(rc) or not fixed_nll:
        raise ValueError(f"compare: {len(nll)} NLLs, {len(rc)} application rows, {len(fixed_nll)} fixed jobs")
    ns = sorted(fixed_nll)
    F = np.stack([np.asarray(fixed_nll[n], dtype=float) for n in ns])  # [fixed, tokens]
    if F.shape[1] != len(nll):
        raise ValueError(f"compare: the fixed jobs score {F.shape[1]} tokens, the rule {len(nll)}")
    ce, A = float(nll.mean()), float(rc.mean())
    fixed = {n: float(F[i].mean()) for i, n in enumerate(ns)}
    f_ce, f_n = frontier_ce(fixed, A, cost)
    n_need, reached = fixed_needed(fixed, ce)
    # per resample: everything again
    ce_r, A_r = boot.means(nll), boot.means(rc)
    F_r = np.stack([boot.means(F[i]) for i in range(len(ns))], axis=1)  # [resamples, fixed]
    d_r, s_r, h_r = np.empty(len(boot)), np.empty(len(boot)), np.empty(len(boot))
    for k in range(len(boot)):
        fk = dict(zip(ns, F_r[k].tolist()))
        d_r[k] = ce_r[k] - frontier_ce(fk, A_r[k], cost)[0]
        s_r[k] = saving(A_r[k], fk, ce_r[k], cost)
        h_r[k] = ce_r[k] - hull_ce(fk, A_r[k], cost)
    (ce_lo, ce_hi), (a_lo, a_hi) = _interval(ce_r), _interval(A_r)
    (d_lo, d_hi), (s_lo, s_hi), (h_lo, h_hi) = _interval(d_r), _interval(s_r), _interval(h_r)
    h_ce = hull_ce(fixed, A, cost)
    return {
        "ce": ce, "ce_lo": ce_lo, "ce_hi": ce_hi,
        "cost": A, "cost_lo": a_lo, "cost_hi": a_hi,
        "mean_applications": A, "mean_applications_lo": a_lo, "mean_applications_hi": a_hi,
        "frontier_n": f_n, "frontier_ce": f_ce,
        "d_ce": ce - f_ce, "d_ce_lo": d_lo, "d_ce_hi": d_hi, "d_ce_undefined": float(np.isnan(d_r).mean()),
        "fixed_n": n_need, "reached": reached,
        "saving": saving(A, fixed, ce, cost), "saving_lo": s_lo, "saving_hi": s_hi,
        "hull_ce": h_ce, "d_hull": ce - h_ce, "d_hull_lo": h_lo, "d_hull_hi": h_hi, "p_hull": boot_p(h_r),
    }


def vs_frontier_at(rule_nll, cost: float, fixed_nll: Mapping[float, np.ndarray], boot: Bootstrap,
                   cost_spread: Sequence[float] | None = None, fixed_spread: Mapping[float, Sequence[float]] | None = None) -> dict:
    """CE − the fixed frontier at a given cost that is not resampled over tokens (e.g. a
    rule's median ms/token, with fixed_nll keyed by each fixed job's ms/token): `hull_ce`
    over the fixed jobs' (cost, CE) at `cost`, paired over the same resampled units.
    Returns frontier_ce, d, d_lo, d_hi (NaN where the cost is below every fixed job's).

    Latency is noisy: with `cost_spread` (the rule's ms/token in each timing repeat) and
    `fixed_spread` ({key of fixed_nll: that job's repeats}), each resample also draws one
    repeat of the rule and one of every fixed job (uniformly, with a fixed seed), so the
    interval includes the spread over repeats as well as the sampling of the text."""
    nll = np.asarray(rule_nll, dtype=float)
    keys = sorted(fixed_nll)
    F = np.stack([np.asarray(fixed_nll[k], dtype=float) for k in keys])
    if F.shape[1] != len(nll):
        raise ValueError(f"vs_frontier_at: the fixed jobs score {F.shape[1]} tokens, the rule {len(nll)}")
    f_ce = hull_ce({k: float(F[i].mean()) for i, k in enumerate(keys)}, cost, None)
    ce_r = boot.means(nll)
    F_r = np.stack([boot.means(f) for f in F], axis=1)
    R = len(boot)
    if cost_spread is not None and fixed_spread is not None:
        rng = np.random.default_rng(1)
        rc = np.asarray(cost_spread, dtype=float)[rng.integers(0, len(cost_spread), R)]
        fc = np.stack([np.asarray(fixed_spread[k], dtype=float)[rng.integers(0, len(fixed_spread[k]), R)]
                       for k in keys], axis=1)
    else:
        rc, fc = np.full(R, float(cost)), np.tile(np.asarray(keys, dtype=float), (R, 1))
    d_r = np.array([ce_r[k] - _hull_at(fc[k], F_r[k], rc[k]) for k in range(R)])
    lo, hi = _interval(d_r)
    return {"frontier_ce": f_ce, "d": float(nll.mean()) - f_ce, "d_lo": lo, "d_hi": hi}


def _hull_at(costs, ces, A: float) -> float:
    """hull_ce over the points (costs[i], ces[i]) (costs in any order)."""
    order = np.argsort(costs, kind="stable")
    return hull_ce({i: float(ces[j]) for i, j in enumerate(order)}, A,
                   {i: float(costs[j]) for i, j in enumerate(order)})


# -------------------------------------------------------------------- oracle
def oracle_n(nll_by_n, eps: float) -> np.ndarray:
    """Per token, the oracle's n at eps (docs/spec.md §4b): the smallest n (1-based) with
    |nll_by_n[i, n−1] − nll_by_n[i, N−1]| <= eps, N the last column."""
    m = np.asarray(nll_by_n, dtype=float)
    if m.ndim != 2 or m.shape[1] < 1:
        raise ValueError(f"oracle_n: expected nll_by_n [tokens, N], got shape {m.shape}")
    ok = np.abs(m - m[:, -1:]) <= eps
    return ok.argmax(axis=1) + 1  # the last column always qualifies (eps >= 0)


def oracle_point(nll_by_n, eps: float, cost: Cost | None = None) -> tuple[float, float]:
    """(CE, mean cost) of the oracle at eps: the mean of each token's NLL at its oracle n,
    and the mean of cost.uniform(n) (of n itself without a Cost)."""
    m = np.asarray(nll_by_n, dtype=float)
    n = oracle_n(m, eps)
    c = n.astype(float) if cost is None else cost.uniform(n)
    return float(m[np.arange(len(m)), n - 1].mean()), float(np.mean(c))


def oracle_saving(nll_by_n, eps_grid: Sequence[float], c, fixed_nll: Mapping[int, np.ndarray],
                  boot: Bootstrap, cost: Cost | None = None) -> dict:
    """The oracle's saving at CE c (docs/spec.md §4b): over eps_grid, the oracle point with
    the lowest mean cost whose CE <= c, and 1 − A_oracle / (cost of fixed_needed(c)).

    c is a target CE (a float, held fixed across resamples) or a rule's per-token NLL
    [tokens] (then c is its mean, recomputed on every resample). Per resample the oracle's
    CE and A at every eps, every fixed CE (and c) are recomputed and the eps chosen again.
    Where no eps reaches c the saving is undefined (NaN, eps None); such resamples are
    left out of the interval and counted in saving_undefined (a fraction). Returns eps, ce,
    applications (the oracle's mean cost), fixed_n, reached (of fixed_needed(c)), saving,
    saving_lo, saving_hi, saving_undefined."""
    m = np.asarray(nll_by_n, dtype=float)
    eps_grid = sorted(float(e) for e in eps_grid)
    rows = np.arange(len(m))
    n_eps = [oracle_n(m, e) for e in eps_grid]
    pts_nll = np.stack([m[rows, n - 1] for n in n_eps])  # [eps, tokens]
    pts_n = np.stack([(n.astype(float) if cost is None else cost.uniform(n)) for n in n_eps])
    ns = sorted(fixed_nll)
    F = np.stack([np.asarray(fixed_nll[n], dtype=float) for n in ns])
    c_tok = None if np.ndim(c) == 0 else np.asarray(c, dtype=float)
    if F.shape[1] != len(m) or (c_tok is not None and len(c_tok) != len(m)):
        raise ValueError(f"oracle_saving: the oracle scores {len(m)} tokens, the fixed jobs {F.shape[1]}"
                         + ("" if c_tok is None else f", the rule {len(c_tok)}"))

    def choose(ces, As, fixed, target):
        """(index into eps_grid or None, saving)."""
        ok = [i for i in range(len(ces)) if ces[i] <= target]
        if not ok:
            return None, math.nan
        i = min(ok, key=lambda i: (As[i], ces[i]))
        return i, saving(As[i], fixed, target, cost)

    c0 = float(c) if c_tok is None else float(c_tok.mean())
    fixed = {n: float(F[i].mean()) for i, n in enumerate(ns)}
    i, s = choose(pts_nll.mean(axis=1), pts_n.mean(axis=1), fixed, c0)
    n_need, reached = fixed_needed(fixed, c0)
    P_r = np.stack([boot.means(p) for p in pts_nll], axis=1)  # [resamples, eps]
    N_r = np.stack([boot.means(p) for p in pts_n], axis=1)
    F_r = np.stack([boot.means(f) for f in F], axis=1)
    c_r = np.full(len(boot), c0) if c_tok is None else boot.means(c_tok)
    s_r = np.array([choose(P_r[k], N_r[k], dict(zip(ns, F_r[k].tolist())), c_r[k])[1] for k in range(len(boot))])
    lo, hi = _interval(s_r)
    return {"eps": None if i is None else eps_grid[i],
            "ce": math.nan if i is None else float(pts_nll[i].mean()),
            "applications": math.nan if i is None else float(pts_n[i].mean()),
            "fixed_n": n_need, "reached": reached,
            "saving": float(s), "saving_lo": lo, "saving_hi": hi,
            "saving_undefined": float(np.isnan(s_r).mean())}


# --------------------------------------------------------- per-token records
