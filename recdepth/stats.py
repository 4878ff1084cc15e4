"""Statistics of exit evaluations from per-token records (docs/spec.md §4b: fixed-depth
frontier, oracle, intervals). numpy only.

Every evaluation of one checkpoint scores the same held-out tokens in the same order and
writes one row per token (`write_tokens` / `read_tokens`): its NLL and the applications
of every group. A job's CE is the mean NLL; its cost A the mean applications per token
(over tokens and groups). Everything here is a function of those arrays:

- fixed-depth frontier (`exit=fixed`, n = 1, 2, 3, 4, 6, 8, 12, 16, 24, 32): for a job with
  cost A and CE c, the frontier CE at A is the lowest CE among fixed n <= A
  (`frontier_ce`); the fixed applications needed for c are the smallest fixed n whose CE
  <= c (`fixed_needed`; if none reaches c, the largest n, flagged, a conservative bound);
  saving = 1 − A / that n (`saving`);
- oracle (ε): per token, the smallest uniform n whose NLL is within ε of its NLL at the
  largest n (`oracle_n`, `oracle_point`, `oracle_saving`);
- intervals: 95% paired percentile bootstrap over tokens (`bootstrap_indices`): the same
  resampled token indices for every job of a comparison, and the whole statistic
  recomputed per resample (the frontier point, the fixed n reached, the oracle's ε).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

LEVEL = 0.95


# ------------------------------------------------------------------ bootstrap
def bootstrap_indices(n: int, resamples: int = 1000, seed: int = 0) -> np.ndarray:
    """[resamples, n] token indices drawn with replacement (a fixed seed: every job of a
    sweep is resampled the same way, which makes differences paired)."""
    if n < 1:
        raise ValueError(f"bootstrap: need at least one token, got {n}")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _interval(samples: np.ndarray) -> tuple[float, float]:
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if len(s) == 0:
        return math.nan, math.nan
    a = (1 - LEVEL) / 2
    lo, hi = np.quantile(s, [a, 1 - a])
    return float(lo), float(hi)


def resampled_means(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The mean of x over each resample: [resamples]."""
    return np.asarray(x, dtype=float)[idx].mean(axis=1)


def mean_ci(x, idx: np.ndarray) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of x and its 95% percentile-bootstrap interval."""
    x = np.asarray(x, dtype=float)
    return (float(x.mean()), *_interval(resampled_means(x, idx)))


def diff_ci(a, b, idx: np.ndarray) -> tuple[float, float, float]:
    """Paired difference mean(a − b) of two jobs on the same tokens, with its interval."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    return mean_ci(d, idx)


# ------------------------------------------------------------------ frontier
def frontier_ce(fixed: Mapping[int, float], A: float) -> tuple[float, int | None]:
    """The lowest CE among fixed depths n <= A, and that n ((nan, None) if none)."""
    below = [(ce, n) for n, ce in fixed.items() if n <= A]
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


def saving(A: float, fixed: Mapping[int, float], c: float) -> float:
    """1 − A / (the fixed applications needed for CE c)."""
    return 1.0 - A / fixed_needed(fixed, c)[0]


def _cost(apps) -> np.ndarray:
    """Applications per token, averaged over groups: [tokens]."""
    a = np.asarray(apps, dtype=float)
    return a.mean(axis=1) if a.ndim == 2 else a


def compare(rule_nll, rule_apps, fixed_nll: Mapping[int, np.ndarray], idx: np.ndarray) -> dict:
    """One job against the fixed-depth jobs, with paired bootstrap intervals (module doc)."""
    nll, cost = np.asarray(rule_nll, dtype=float), _cost(rule_apps)
    ns = sorted(fixed_nll)
    F = np.stack([np.asarray(fixed_nll[n], dtype=float) for n in ns])  # [fixed, tokens]
    ce, A = float(nll.mean()), float(cost.mean())
    fixed = {n: float(F[i].mean()) for i, n in enumerate(ns)}
    f_ce, f_n = frontier_ce(fixed, A)
    n_need, reached = fixed_needed(fixed, ce)
    # per resample: everything again
    ce_r, A_r = resampled_means(nll, idx), resampled_means(cost, idx)
    F_r = np.stack([resampled_means(F[i], idx) for i in range(len(ns))], axis=1)  # [resamples, fixed]
    d_r, s_r = np.empty(len(idx)), np.empty(len(idx))
    for k in range(len(idx)):
        fk = dict(zip(ns, F_r[k]))
        d_r[k] = ce_r[k] - frontier_ce(fk, A_r[k])[0]
        s_r[k] = 1.0 - A_r[k] / fixed_needed(fk, ce_r[k])[0]
    return {
        "ce": ce, "ce_lo": _interval(ce_r)[0], "ce_hi": _interval(ce_r)[1],
        "mean_applications": A,
        "frontier_n": f_n, "frontier_ce": f_ce,
        "d_ce": ce - f_ce, "d_ce_lo": _interval(d_r)[0], "d_ce_hi": _interval(d_r)[1],
        "fixed_n": n_need, "reached": reached,
        "saving": 1.0 - A / n_need, "saving_lo": _interval(s_r)[0], "saving_hi": _interval(s_r)[1],
    }


# -------------------------------------------------------------------- oracle
def oracle_n(nll_by_n, eps: float) -> np.ndarray:
    """Per token, the smallest n (1-based) with nll_by_n[:, n−1] <= nll_by_n[:, −1] + eps."""
    m = np.asarray(nll_by_n, dtype=float)
    ok = m <= m[:, -1:] + eps
    return ok.argmax(axis=1) + 1  # the last column always qualifies


def oracle_point(nll_by_n, eps: float) -> tuple[float, float]:
    """(CE, mean applications) of the oracle at eps."""
    m = np.asarray(nll_by_n, dtype=float)
    n = oracle_n(m, eps)
    return float(m[np.arange(len(m)), n - 1].mean()), float(n.mean())


def oracle_saving(nll_by_n, eps_grid: Sequence[float], c: float, fixed_nll: Mapping[int, np.ndarray],
                  idx: np.ndarray) -> dict:
    """The oracle at CE c: over eps_grid, the oracle point with the fewest mean
    applications whose CE <= c (else the largest-CE-quality one, eps = min), and its saving
    1 − A_oracle / fixed_needed(c), with the choice redone per resample."""
    m = np.asarray(nll_by_n, dtype=float)
    eps_grid = sorted(float(e) for e in eps_grid)
    rows = np.arange(len(m))
    pts_nll = np.stack([m[rows, oracle_n(m, e) - 1] for e in eps_grid])  # [eps, tokens]
    pts_n = np.stack([oracle_n(m, e).astype(float) for e in eps_grid])
    ns = sorted(fixed_nll)
    F = np.stack([np.asarray(fixed_nll[n], dtype=float) for n in ns])

    def choose(ces, As, fixed, target):
        ok = [i for i in range(len(ces)) if ces[i] <= target]
        i = min(ok, key=lambda i: As[i]) if ok else 0
        return As[i], 1.0 - As[i] / fixed_needed(fixed, target)[0], eps_grid[i]

    fixed = {n: float(F[i].mean()) for i, n in enumerate(ns)}
    A, s, eps = choose(pts_nll.mean(axis=1), pts_n.mean(axis=1), fixed, c)
    P_r = np.stack([resampled_means(p, idx) for p in pts_nll], axis=1)  # [resamples, eps]
    N_r = np.stack([resampled_means(p, idx) for p in pts_n], axis=1)
    F_r = np.stack([resampled_means(f, idx) for f in F], axis=1)
    s_r = np.array([choose(P_r[k], N_r[k], dict(zip(ns, F_r[k])), c)[1] for k in range(len(idx))])
    lo, hi = _interval(s_r)
    return {"applications": float(A), "eps": eps, "saving": float(s), "saving_lo": lo, "saving_hi": hi}


# --------------------------------------------------------- per-token records
def write_tokens(path: str | os.PathLike, window, position, target, target_gpt2, nll, apps, ms=None) -> None:
    """eval_tokens.csv: window, position, target, target_gpt2, nll, apps_<g>..., ms (empty
    where not timed). Floats are written with repr precision (read back exactly);
    atomically (a temporary file, then a rename)."""
    path = Path(path)
    apps = np.asarray(apps)
    n = len(nll)
    ms = np.full(n, np.nan) if ms is None else np.asarray(ms, dtype=float)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["window", "position", "target", "target_gpt2", "nll",
                    *[f"apps_{g}" for g in range(apps.shape[1])], "ms"])
        for i in range(n):
            w.writerow([int(window[i]), int(position[i]), int(target[i]), int(target_gpt2[i]), repr(float(nll[i])),
                        *[int(a) for a in apps[i]], "" if math.isnan(ms[i]) else repr(float(ms[i]))])
    os.replace(tmp, path)


def read_tokens(path: str | os.PathLike) -> dict:
    """An eval_tokens.csv as arrays: window, position, target, target_gpt2, nll, apps
    [tokens, groups], ms (NaN where not timed)."""
    path = Path(path)
    with open(path, newline="") as f:
        r = csv.reader(f)
        head = next(r, None)
        rows = list(r)
    if head is None:
        raise ValueError(f"{path}: empty file, expected an eval_tokens.csv header")
    for col in ("window", "position", "target", "target_gpt2", "nll", "apps_0", "ms"):
        if col not in head:
            raise ValueError(f"{path}: no column {col!r} (expected an eval_tokens.csv written by recdepth)")
    col = {c: i for i, c in enumerate(head)}
    g_cols = [col[c] for c in head if c.startswith("apps_")]
    ints = lambda c: np.array([int(x[col[c]]) for x in rows], dtype=np.int64)  # noqa: E731
    return {
        "window": ints("window"), "position": ints("position"), "target": ints("target"),
        "target_gpt2": ints("target_gpt2"),
        "nll": np.array([float(x[col["nll"]]) for x in rows]),
        "apps": np.array([[int(x[i]) for i in g_cols] for x in rows], dtype=np.int64).reshape(len(rows), len(g_cols)),
        "ms": np.array([float(x[col["ms"]]) if x[col["ms"]] else math.nan for x in rows]),
    }


def save_array(path: str | os.PathLike, a: np.ndarray) -> None:
    """np.save, atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, a)
    os.replace(tmp, path)
