"""Scoring a task's answers (docs/spec.md §6): accuracy, NLL and layer applications on the
answer tokens, overall and per difficulty, with bootstrap intervals over windows, and
Spearman's correlation of applications with difficulty."""

from __future__ import annotations

import numpy as np

from recdepth.analysis import stats


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of x, ties sharing their mean rank (Spearman's convention)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return sums[inv] / counts[inv]


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks (NaN when
    either side is constant)."""
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


def instance_runs(positions: np.ndarray, windows: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An instance's answers as the task writes them, a run of consecutive answer positions in
    one window (carry's sum bits, prefixsums' parities, addition's digits; a single answer
    where an instance has one): per run, whether every answer in it is right (1.0 / 0.0), and
    its window. `positions`, `windows`, `ok`: the answers' stream positions, windows and
    correctness, in stream order."""
    if not len(positions):
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    new = np.ones(len(positions), dtype=bool)
    new[1:] = (np.diff(positions) != 1) | (windows[1:] != windows[:-1])
    run = np.cumsum(new) - 1
    right = np.ones(run[-1] + 1)
    np.minimum.at(right, run, np.asarray(ok, dtype=float))
    return right, np.asarray(windows)[new]


def score_answers(rec: dict, labels: np.ndarray, cost_per_token: np.ndarray,
                  loop_cost_per_token: np.ndarray | None = None, resamples: int = 1000, seed: int = 0) -> dict:
    """The `answers` block of an evaluation on a task (docs/spec.md §6): over the scored
    tokens that are answers (labels > 0; `labels` aligned with rec's targets), accuracy
    (argmax = target), NLL and cost per answer token (`layer_applications`: the cost with
    the rule's checks, docs/spec.md §4b; `loop_layer_applications`, with
    `loop_cost_per_token`: the loop alone), overall and per difficulty, each with a 95%
    bootstrap interval over windows (a window is one record of whole instances drawn
    independently), Spearman's correlation of the cost with difficulty (its interval
    from the same window resamples), and `exact`: the fraction of `instances` whose every
    answer is right (`instance_runs`), its interval over windows."""
    answer = np.asarray(labels) > 0
    if not answer.any():
        raise ValueError("answers: no answer tokens among the scored tokens (eval.tokens too small?)")
    diff = np.asarray(labels)[answer]
    ok = np.asarray(rec["correct"], dtype=float)[answer]
    nll = np.asarray(rec["nll"], dtype=float)[answer]
    cost = np.asarray(cost_per_token, dtype=float)[answer]
    windows = np.asarray(rec["window"])[answer]
    boot = stats.Bootstrap(windows, resamples, seed)

    def ci(x):
        m, lo, hi = stats.mean_ci(x, boot)
        return [m, lo, hi]

    loop = None if loop_cost_per_token is None else np.asarray(loop_cost_per_token, dtype=float)[answer]
    out = {"tokens": int(answer.sum()), "windows": boot.n_units, "accuracy": ci(ok), "nll": ci(nll),
           "layer_applications": ci(cost), "by_difficulty": {}}
    if "position" in rec:  # a decoding's record (a hand-made one may hold only what it tests)
        run_ok, run_windows = instance_runs(np.asarray(rec["position"])[answer], windows, ok)
        m, lo, hi = stats.mean_ci(run_ok, stats.Bootstrap(run_windows, resamples, seed))
        out.update(instances=len(run_ok), exact=[m, lo, hi])
    if loop is not None:
        out["loop_layer_applications"] = ci(loop)
    for d in np.unique(diff).tolist():
        sel = diff == d
        b = stats.Bootstrap(windows[sel], resamples, seed)
        out["by_difficulty"][str(int(d))] = {
            "tokens": int(sel.sum()), "accuracy": [*stats.mean_ci(ok[sel], b)],
            "nll": float(nll[sel].mean()), "layer_applications": float(cost[sel].mean())}
        if loop is not None:
            out["by_difficulty"][str(int(d))]["loop_layer_applications"] = float(loop[sel].mean())
    rho = spearman(cost, diff)
    rs = []
    if np.isfinite(rho):
        rng_idx = stats.bootstrap_indices(boot.n_units, resamples, seed)
        members = [np.flatnonzero(boot.inverse == u) for u in range(boot.n_units)]
        for r in range(min(resamples, 200)):  # ranks per resample: 200 keep this to a second
            idx = np.concatenate([members[u] for u in rng_idx[r]])
            rs.append(spearman(cost[idx], diff[idx]))
    lo, hi = stats.interval(np.asarray(rs)) if rs else (float("nan"), float("nan"))
    out["spearman_applications_difficulty"] = [rho, lo, hi]
    return out
