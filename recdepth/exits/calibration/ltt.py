"""Calibration with a guarantee: Learn then Test over an ordered grid of exit settings
(docs/spec.md §4e), numpy and math only.

References:
- [LTT] A. N. Angelopoulos, S. Bates, E. J. Candès, M. I. Jordan, L. Lei, "Learn then
  Test: calibrating predictive algorithms to achieve risk control", 2021, arXiv:2110.01052.
- [RCPS] S. Bates, A. N. Angelopoulos, L. Lei, J. Malik, M. I. Jordan, "Distribution-free,
  risk-controlling prediction sets", J. ACM 68(6), 2021, arXiv:2101.02703 (the Hoeffding,
  Bentkus and Hoeffding–Bentkus upper confidence bounds; [LTT] turns the last into a p-value).

The problem. Candidate settings λ_1, …, λ_m are listed in a fixed order, fixed before the
calibration data are seen, from the most conservative (full depth) to the most aggressive.
Each calibration unit i = 1 … n (a window of held-out text, never a token: the tokens of
one window share its context and are not independent) has a loss L_i(λ) in [0, 1]
(`window_losses`). The units are i.i.d. (exchangeable) with the unit the guarantee is
about; R(λ) = E[L(λ)] is the risk and α the target. Setting λ_j gets the null hypothesis
H_j: R(λ_j) > α and a p-value p_j that is valid (super-uniform: P(p_j <= u) <= u for
every u when H_j holds) from the calibration losses alone:

- `hoeffding_bentkus_p` for losses in [0, 1]: min of Hoeffding's and Bentkus's tail
  bounds of the empirical risk;
- `binomial_p` for 0/1 losses: the exact binomial tail.

Fixed-sequence testing (`fixed_sequence`, one of [LTT]'s family-wise error procedures): test
H_1, H_2, … in the fixed order at level ε each and stop at the first p_j > ε. It controls
the family-wise error: P(some rejected H_j is true) <= ε. So with probability >= 1 − ε
over the draw of the calibration units, every certified setting (rejected null) has
R(λ_j) <= α, in particular the chosen one, the last certified (the most aggressive).
When even λ_1 is not certified nothing is, and the caller falls back to full depth
(whose loss against the full-depth reference is 0, so it meets any α >= 0).

`staircase` orders a joint per-group grid; `ltt` and `ltt_lazy` run the whole procedure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

PVALUES = ("hb", "binomial")
DEFAULT_LOSS_BOUND = 0.1  # nats; see `window_losses`
_ROUND = 9  # decimals n·r̂ is rounded to before its ceiling (`bentkus_p`)


# ------------------------------------------------------------------ the loss
def window_means(x, units) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unit ids sorted ascending, the mean of a per-token x over each unit's tokens, the
    number of tokens of each unit)."""
    x = np.asarray(x, dtype=float)
    units = np.asarray(units)
    if x.ndim != 1 or x.shape != units.shape or len(x) == 0:
        raise ValueError(f"ltt: expected one unit id per token (two non-empty 1-D arrays of one length), "
                         f"got shapes {x.shape} and {units.shape}")
    ids, inv = np.unique(units, return_inverse=True)
    count = np.bincount(inv, minlength=len(ids)).astype(float)
    return ids, np.bincount(inv, weights=x, minlength=len(ids)) / count, count


def window_losses(nll, ref_nll, units, bound: float = DEFAULT_LOSS_BOUND) -> np.ndarray:
    """The loss of each calibration unit (window), in [0, 1], in the order of the sorted
    unit ids:

        L_w = clip(mean_{t in w} (nll_t − ref_nll_t), 0, bound) / bound,

    nll the setting's per-token NLL, ref_nll the same tokens' NLL at full depth (`fixed`
    at exit.max_steps, decoded with the same noise keys, so the two are paired per token).
    The risk target for a CE increase δ is α = δ / bound (`alpha`).

    - The clip at 0 is conservative: a window that the setting happens to score better
      than full depth counts 0, not a negative loss that would offset another window's
      harm. While no window's increase exceeds `bound`, bound · mean_w L_w >= the mean of
      the window increases, so a guarantee on the clipped risk implies the same bound on
      the unclipped one.
    - The clip at `bound` is what makes the loss bounded (the p-values need L in [0, 1]):
      a window whose mean increase exceeds `bound` counts as `bound`. The guarantee is on
      this clipped loss, E[min(max(Δ_w, 0), bound)] <= δ; it says nothing about how far
      above `bound` the rare bad window goes.
    - The bound trades power for tail coverage: the p-values depend on α = δ / bound,
      and with all n losses 0 the smallest certifiable α is 1 − ε^(1/n) (`min_alpha`,
      0.031 for n = 96, ε = 0.05). Default 0.1 nats: on the default model (kl's τ path,
      windows of 128 tokens) no window's mean increase reaches 0.1 at any setting whose CE
      increase is <= 0.023 nats (192 windows), so near targets δ <= 0.02 the upper clip
      did not bind on any observed window; yet α = δ / 0.1 = 0.1 at
      δ = 0.01 is certifiable with ~100 windows. 0.5 is too loose there (α = 0.02 at
      δ = 0.01 is below `min_alpha(96, 0.05)`: nothing certified); 0.05 certifies cheaper
      settings at δ <= 0.01 but clips 8% of the windows at a CE increase of 0.023
      (docs/results/calibration.md). Rule of thumb: the smallest bound
      that no window exceeds near the target, about 5-10 δ.
    """
    if not (isinstance(bound, int | float) and math.isfinite(bound) and bound > 0):
        raise ValueError(f"calibration.loss_bound: expected a finite number > 0 (nats), got {bound!r}")
    nll, ref = np.asarray(nll, dtype=float), np.asarray(ref_nll, dtype=float)
    if nll.shape != ref.shape:
        raise ValueError(f"ltt: the setting's and the reference's records differ in shape, {nll.shape} vs {ref.shape}")
    _, inc, _ = window_means(nll - ref, units)
    return np.clip(inc, 0.0, bound) / bound


def answer_flips(correct, ref_correct, units) -> np.ndarray:
    """The loss of each calibration unit for an accuracy target, in [0, 1], in the order of
    the sorted unit ids: the fraction of the unit's answers that full depth gets right and
    the setting gets wrong,

        L_u = mean_{t in u} [ref_correct_t and not correct_t].

    Its mean bounds the accuracy drop from above, E[acc_ref − acc] = E[L] − E[the
    fraction the setting gets right and full depth wrong] <= E[L] (per-unit accuracies
    averaged over units), so a guarantee E[L] <= α bounds the drop by α (0.01 = one point).
    Needs no clip: the loss is a fraction already."""
    c, r = np.asarray(correct, dtype=bool), np.asarray(ref_correct, dtype=bool)
    if c.shape != r.shape:
        raise ValueError(f"ltt: the setting's and the reference's answers differ in shape, {c.shape} vs {r.shape}")
    _, flips, _ = window_means((r & ~c).astype(float), units)
    return flips


def alpha(delta: float, bound: float) -> float:
    """The normalised risk target α = δ / bound of a CE-increase target δ (nats)."""
    return float(delta) / float(bound)


# ------------------------------------------------------------------ p-values
def h1(a: float, b: float) -> float:
    """h1(a, b) = a log(a/b) + (1 − a) log((1 − a)/(1 − b)), the Bernoulli KL divergence
    KL(a ‖ b) ([RCPS], Hoeffding's bound), with 0 log 0 = 0; a in [0, 1], b in (0, 1)."""
    if not 0 < b < 1 or not 0 <= a <= 1:
        raise ValueError(f"h1: expected a in [0, 1] and b in (0, 1), got a={a!r}, b={b!r}")
    t1 = 0.0 if a == 0 else a * math.log(a / b)
    t2 = 0.0 if a == 1 else (1 - a) * math.log((1 - a) / (1 - b))
    return t1 + t2


def hoeffding_p(risk_hat: float, n: int, alpha: float) -> float:
    """Hoeffding's p-value exp(−n · h1(min(r̂, α), α)) for H: R > α, losses in [0, 1]
    (the Chernoff–Hoeffding bound P(R̂ <= r̂) <= exp(−n h1(r̂, R)) for r̂ <= R, [RCPS];
    1 when r̂ >= α)."""
    n = _n(n)
    if (p := _trivial(n, alpha)) is not None:
        return p
    return math.exp(-n * h1(min(max(float(risk_hat), 0.0), alpha), alpha))


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), exactly up to rounding: the sum of
    C(n, i) p^i (1 − p)^(n − i), i = 0 … k, in log space (math.lgamma), so no term
    under- or overflows."""
    n, k = _n(n), math.floor(k)
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if not 0 <= p <= 1:
        raise ValueError(f"binomial: expected a probability in [0, 1], got {p!r}")
    if p == 0:
        return 1.0
    if p == 1:
        return 0.0
    lp, lq, lgn = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    logs = [lgn - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * math.fsum(math.exp(v - top) for v in logs))


def binomial_p(k: int, n: int, alpha: float) -> float:
    """The exact p-value of H: R > α for 0/1 losses, k of the n losses equal to 1:
    P(Binomial(n, α) <= k) ([LTT], the exact binomial test). Valid since the number of
    1s is Binomial(n, R), stochastically larger than Binomial(n, α) when R >= α."""
    n = _n(n)
    if (p := _trivial(n, alpha)) is not None:
        return p
    return binomial_cdf(k, n, alpha)


def bentkus_p(risk_hat: float, n: int, alpha: float) -> float:
    """Bentkus's p-value e · P(Binomial(n, α) <= ⌈n r̂⌉) for H: R > α, losses in [0, 1]
    ([RCPS], after Bentkus 2004). n·r̂ is rounded to 9 decimals before the ceiling,
    so that a sum of losses that floating point puts a hair above an integer (10 × 0.3 =
    3.0000000000000004) is read as that integer."""
    n = _n(n)
    if (p := _trivial(n, alpha)) is not None:
        return p
    k = math.ceil(round(n * max(float(risk_hat), 0.0), _ROUND))
    return min(1.0, math.e * binomial_cdf(k, n, alpha))


def hoeffding_bentkus_p(risk_hat: float, n: int, alpha: float) -> float:
    """The Hoeffding–Bentkus p-value of H: R > α from the mean r̂ of n losses in [0, 1]:

        p = min(exp(−n · h1(min(r̂, α), α)), e · P(Binomial(n, α) <= ⌈n r̂⌉))

    ([LTT]; the bound of [RCPS]). The minimum of two valid p-values is not valid in
    general; this one is, because both are bounds on one tail probability,
    P(R̂ <= r̂) <= min(Hoeffding, Bentkus) under H. Edge cases: no units (n = 0) or
    α <= 0 give 1 (nothing can be certified; the loss is never negative); α >= 1 gives 0
    (a loss in [0, 1] never has a risk above 1)."""
    n = _n(n)
    if (p := _trivial(n, alpha)) is not None:
        return p
    return min(hoeffding_p(risk_hat, n, alpha), bentkus_p(risk_hat, n, alpha))


def min_alpha(n: int, epsilon: float) -> float:
    """The smallest α that n units could certify at level ε (every loss 0, where the
    Hoeffding–Bentkus p-value is (1 − α)^n): 1 − ε^(1/n); 1 for n = 0."""
    n = _n(n)
    return 1.0 if n == 0 else 1.0 - epsilon ** (1.0 / n)


def units_needed(alpha: float, epsilon: float) -> int:
    """The fewest units that could certify a risk of α at level ε, every loss 0 (the
    inverse of `min_alpha`): the smallest n with (1 − α)^n <= ε, ⌈log ε / log(1 − α)⌉
    (299 for α = 0.01, ε = 0.05; 29 for α = 0.1). Any loss above 0 needs more."""
    _epsilon(epsilon)
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"ltt: expected a risk target α > 0, got {alpha!r}")
    if alpha >= 1:
        return 1
    n = math.ceil(math.log(epsilon) / math.log1p(-alpha))
    return n - 1 if n > 1 and min_alpha(n - 1, epsilon) <= alpha else n  # rounding at an exact power


def _n(n) -> int:
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise ValueError(f"ltt: expected a number of units >= 0, got {n!r}")
    return int(n)


def _trivial(n: int, alpha: float) -> float | None:
    if not math.isfinite(alpha):
        raise ValueError(f"ltt: expected a finite risk target α, got {alpha!r}")
    if n == 0 or alpha <= 0:
        return 1.0
    if alpha >= 1:
        return 0.0
    return None


# ------------------------------------------------------------------ the procedure
def fixed_sequence(pvalues: Sequence[float], epsilon: float) -> int:
    """Fixed-sequence testing at level ε ([LTT]): walk the hypotheses in the given
    order, reject while p <= ε, stop at the first that is not rejected (a NaN p-value
    stops the walk too). Returns how many were rejected, i.e. certified: the first k. The
    chosen setting is the k-th (the most aggressive certified one); k = 0 certifies
    nothing (full depth)."""
    _epsilon(epsilon)
    k = 0
    for p in pvalues:
        if not p <= epsilon:  # also NaN
            break
        k += 1
    return k


def staircase(grid_size: int, groups: int) -> list[tuple[int, ...]]:
    """A fixed, data-independent path through the joint per-group grid {0 … K−1}^G (index 0
    the most conservative value of a group's knob, K−1 the most aggressive), from
    (0, …, 0) to (K−1, …, K−1): each step moves one group one grid step cheaper, the
    groups in turn (round robin, group 0 first):

        (0,0,0), (1,0,0), (1,1,0), (1,1,1), (2,1,1), …, (K−1,K−1,K−1)   (G = 3)

    G(K − 1) + 1 settings. Every shared setting (i, …, i) is on it, one every G steps, so
    it is the shared grid refined by the per-group settings in between. Group 0 is always
    at most one step ahead of the others: the order favours no group for a reason drawn
    from data. (An order chosen from other data, e.g. a separate split, would be valid too;
    chosen from the calibration split it would not.) G = 1 is the grid itself."""
    if grid_size < 1 or groups < 1:
        raise ValueError(f"staircase: need a grid and at least one group, got {grid_size} values, {groups} groups")
    s = [0] * groups
    path = [tuple(s)]
    for step in range((grid_size - 1) * groups):
        s[step % groups] += 1
        path.append(tuple(s))
    return path


def setting_pvalue(losses, alpha: float, kind: str = "hb") -> float:
    """The p-value of H: R > α from one setting's unit losses ("hb": Hoeffding–Bentkus,
    losses in [0, 1]; "binomial": exact, losses in {0, 1})."""
    x = np.asarray(losses, dtype=float)
    if x.ndim != 1:
        raise ValueError(f"ltt: expected one loss per unit (a 1-D array), got shape {x.shape}")
    if kind not in PVALUES:
        raise ValueError(f"ltt: pvalue must be one of {', '.join(PVALUES)}, got {kind!r}")
    if kind == "binomial":
        if not np.all((x == 0) | (x == 1)):
            raise ValueError("ltt: the binomial p-value needs 0/1 losses")
        return binomial_p(int(x.sum()), len(x), alpha)
    if len(x) and (not np.all(np.isfinite(x)) or x.min() < 0 or x.max() > 1):
        raise ValueError(f"ltt: losses must lie in [0, 1], got [{x.min()!r}, {x.max()!r}]")
    return hoeffding_bentkus_p(float(x.mean()) if len(x) else 0.0, len(x), alpha)


def ltt_lazy(losses: Iterable, alpha: float, epsilon: float, pvalue: str = "hb") -> dict:
    """Learn then Test on settings given in path order as an iterable of per-unit loss
    arrays, consumed lazily: fixed-sequence testing never looks past the first setting it
    does not certify, so an iterable that decodes each setting when asked decodes no more
    than that. Returns {"certified": k, "chosen": k − 1 or None, "pvalues", "risks"
    (empirical, of the tested settings), "tested", "n" (units), "alpha", "epsilon"}."""
    _epsilon(epsilon)
    ps, risks, n = [], [], None
    for x in losses:
        x = np.asarray(x, dtype=float)
        if n is not None and len(x) != n:
            raise ValueError(f"ltt: every setting needs the same units, got {len(x)} losses after {n}")
        n = len(x)
        ps.append(setting_pvalue(x, alpha, pvalue))
        risks.append(float(x.mean()) if n else math.nan)
        if not ps[-1] <= epsilon:
            break
    k = fixed_sequence(ps, epsilon)
    return {"certified": k, "chosen": k - 1 if k else None, "pvalues": ps, "risks": risks, "tested": len(ps),
            "n": n or 0, "alpha": float(alpha), "epsilon": float(epsilon)}


def ltt(losses, alpha: float, epsilon: float, pvalue: str = "hb") -> dict:
    """Learn then Test on a [settings, units] loss matrix, settings in path order (most
    conservative first): the p-value of every setting (all of them, for the record; the
    choice reads only the prefix fixed-sequence testing reaches), its empirical risk, the
    certified count k and the chosen index k − 1 (None: nothing certified, full depth)."""
    L = np.asarray(losses, dtype=float)
    if L.ndim != 2:
        raise ValueError(f"ltt: expected losses [settings, units], got shape {L.shape}")
    _epsilon(epsilon)
    ps = [setting_pvalue(row, alpha, pvalue) for row in L]
    k = fixed_sequence(ps, epsilon)
    return {"certified": k, "chosen": k - 1 if k else None, "pvalues": ps,
            "risks": [float(r) for r in L.mean(axis=1)] if L.shape[1] else [math.nan] * len(L),
            "tested": len(ps), "n": L.shape[1], "alpha": float(alpha), "epsilon": float(epsilon)}


def _epsilon(epsilon) -> None:
    if not (isinstance(epsilon, int | float) and not isinstance(epsilon, bool) and 0 < epsilon < 1):
        raise ValueError(f"calibration.epsilon: expected a number in (0, 1), got {epsilon!r}")


# ------------------------------------------------------------------ reporting
def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Clopper–Pearson (exact) interval of a binomial proportion, k successes in n:
    lo solves P(Bin(n, lo) >= k) = (1 − level)/2, hi solves P(Bin(n, hi) <= k) =
    (1 − level)/2 (bisection on `binomial_cdf`); lo = 0 for k = 0, hi = 1 for k = n."""
    n = _n(n)
    if n == 0 or not 0 <= k <= n:
        raise ValueError(f"clopper_pearson: expected 0 <= k <= n, n >= 1, got k={k!r}, n={n!r}")
    a = (1 - level) / 2

    def solve(f, target):  # f increasing in p on [0, 1]
        lo, hi = 0.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    low = 0.0 if k == 0 else solve(lambda p: 1 - binomial_cdf(k - 1, n, p), a)
    high = 1.0 if k == n else solve(lambda p: -binomial_cdf(k, n, p), -a)
    return low, high
