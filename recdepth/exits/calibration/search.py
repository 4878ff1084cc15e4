"""Per-group calibration of an exit rule to a stated target (docs/spec.md §4c), numpy only.

A rule's knob is a grid per recurrence group, ordered from expensive to cheap: τ ascending
for the threshold rules (a larger τ exits earlier), max_steps descending for `fixed`,
patience descending for `argmax_stability` (one value for every group). A setting is one
grid index per group. `evaluate(setting)` decodes the calibration split under it for real
and returns its per-token NLL [tokens] and applications [tokens, groups]; nothing is
replayed or extrapolated, so the CE and cost the search sees are exactly those of real
decoding on the calibration split (the gap to the test split is sampling, which the test
evaluation measures with its interval).

Cost: A is the mean cost per token in layer applications (`stats.Cost`: Σ_g |g| · the
applications of group g, plus the layers outside the loops; docs/spec.md §4b), so a
two-layer group's applications weigh twice a one-layer group's.

Targets (`Target`), on the calibration split:
- `max_ce_increase` δ: minimise A subject to CE − CE_ref <= δ, where CE_ref is the CE of
  `fixed` at the rule's max_steps (every group at full depth);
- `layer_applications` B: minimise CE subject to A <= B (layer applications per token).

The search (`search`):
1. one shared index for every group, found by bisection along the grid for the boundary
   between settings that meet the target and settings that do not (the CE and A of a rule
   are monotone in its knob up to sampling noise; bisection needs no more than that:
   whatever it ends on, the answer is the best evaluated setting that meets the target);
2. with `per_group`, a local search from there: single-group moves (one group one grid
   step cheaper or dearer) and exchange moves (one group a step cheaper, another a step
   dearer); the best move that meets the target and improves the objective is taken,
   until none does or `max_evals` settings have been decoded.
The answer is the best evaluated setting that meets the target (`best`); if none does,
the search says so (`Result.met` False) and returns the one closest to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from recdepth.analysis.stats import Cost
from recdepth.core.checks import is_number

TARGETS = ("max_ce_increase", "layer_applications", "max_accuracy_drop")


@dataclass(frozen=True)
class Target:
    """What the calibration must hold on the calibration split: `kind` is max_ce_increase
    (nats over the full-depth CE, >= 0), layer_applications (mean layer applications per
    token, > 0: Σ_g |g| · applications_g + the layers outside the loops) or
    max_accuracy_drop (a task's answer accuracy below full depth's, a fraction in [0, 1):
    0.01 = one point; Learn then Test only, `ltt.answer_flips`)."""

    kind: str
    value: float

    def __post_init__(self):
        if self.kind not in TARGETS:
            raise ValueError(f"target: expected one of {', '.join(TARGETS)}, got {self.kind!r}")
        v = self.value
        ok = is_number(v)
        expect = {"max_ce_increase": (lambda x: x >= 0, ">= 0 (nats)"),
                  "layer_applications": (lambda x: x > 0, "> 0 (layer applications per token)"),
                  "max_accuracy_drop": (lambda x: 0 <= x < 1, "in [0, 1) (a fraction of the answers: 0.01 = one point)")}
        good, what = expect[self.kind]
        if not ok or not good(v):
            raise ValueError(f"target.{self.kind}: expected a finite number {what}, got {v!r}")


@dataclass(frozen=True)
class Point:
    """One evaluated setting: grid indices per group, CE (mean NLL), mean cost per token
    (layer applications) and mean applications per group."""

    setting: tuple[int, ...]
    ce: float
    cost: float
    per_group: tuple[float, ...]


def point(setting: Sequence[int], nll: np.ndarray, apps: np.ndarray, cost: Cost | None = None,
          costs: np.ndarray | None = None) -> Point:
    """The CE and cost of per-token records (nll [N], apps [N, G]), as `stats` defines them:
    CE = mean NLL; cost = the mean of `costs` where given (each token's cost as its decode
    priced it, the rule's checks included: a record's `cost`, `scoring.token_costs`), else
    of `cost.per_token(apps)` (layer applications; without a Cost, the mean of apps over
    tokens and groups)."""
    apps = np.asarray(apps, dtype=float)
    per = apps.mean(axis=0) if apps.size else np.zeros(0)
    if costs is not None:
        c = float(np.mean(costs)) if len(costs) else 0.0
    else:
        c = float(cost.per_token(apps).mean()) if (cost is not None and apps.size) else (float(per.mean()) if per.size else 0.0)
    return Point(tuple(int(i) for i in setting), float(np.mean(nll)), c, tuple(float(a) for a in per))


def meets(p: Point, target: Target, ce_ref: float) -> bool:
    """Whether a point holds the target (CE − CE_ref <= δ, or A <= B)."""
    if target.kind == "max_ce_increase":
        return p.ce - ce_ref <= target.value
    return p.cost <= target.value


def _key(p: Point, target: Target) -> tuple[float, float]:
    """The objective, lower is better: (A, CE) under a CE target, (CE, A) under a budget."""
    return (p.cost, p.ce) if target.kind == "max_ce_increase" else (p.ce, p.cost)


def _miss(p: Point, target: Target, ce_ref: float) -> float:
    """How far a point is from the target (0 if it holds it)."""
    if target.kind == "max_ce_increase":
        return max(p.ce - ce_ref - target.value, 0.0)
    return max(p.cost - target.value, 0.0)


@dataclass
class Result:
    """The search's answer and every setting it decoded, in order."""

    best: Point
    met: bool
    ce_ref: float
    target: Target
    history: list[Point] = field(default_factory=list)


def best(points: Sequence[Point], target: Target, ce_ref: float) -> tuple[Point, bool]:
    """The best point that holds the target, or (if none does) the one that misses it least."""
    ok = [p for p in points if meets(p, target, ce_ref)]
    if ok:
        return min(ok, key=lambda p: _key(p, target)), True
    return min(points, key=lambda p: (_miss(p, target, ce_ref), _key(p, target))), False


def search(evaluate: Callable[[tuple[int, ...]], tuple[np.ndarray, np.ndarray]], grid_size: int, groups: int,
           target: Target, ce_ref: float, per_group: bool = True, max_evals: int = 32,
           cost: Cost | None = None,
           evaluate_many: Callable[[list[tuple[int, ...]]], list[tuple[np.ndarray, np.ndarray]]] | None = None
           ) -> Result:
    """Calibrate a knob with `grid_size` values per group (index 0 the most expensive) for
    `groups` groups to `target` (see the module docstring). `evaluate(setting)` returns
    (nll [N], apps [N, G]) of real decoding under that setting; each setting is decoded
    once; a third entry, if it returns one, is each token's cost as decoded (its checks
    included), read instead of `cost`. `evaluate_many(settings)`, if given, decodes settings that do not depend on each
    other in one call (both ends of the bisection; a round of per-group moves): the same
    settings are decoded as one by one, so the answer is the same. `per_group` False keeps
    one index for all groups (phase 1 only). `cost`: the model's layer-application cost
    (None: applications averaged over groups)."""
    if grid_size < 1 or groups < 1:
        raise ValueError(f"calibration: need a grid and at least one group, got {grid_size} values, {groups} groups")
    if max_evals < 2:
        raise ValueError(f"calibration.max_evals: expected an integer >= 2, got {max_evals}")
    seen: dict[tuple[int, ...], Point] = {}

    def ev(setting: tuple[int, ...]) -> Point | None:
        if setting not in seen:
            if len(seen) >= max_evals:
                return None
            r = evaluate(setting)
            seen[setting] = point(setting, r[0], r[1], cost, *r[2:])
        return seen[setting]

    def ahead(settings: list[tuple[int, ...]]) -> None:
        """Decode, in one call, the settings `ev` would decode next in this order (the
        unseen ones, up to max_evals)."""
        new = list(dict.fromkeys(s for s in settings if s not in seen))[: max(0, max_evals - len(seen))]
        if evaluate_many is not None and len(new) > 1:
            for s, r in zip(new, evaluate_many(new), strict=True):
                seen[s] = point(s, r[0], r[1], cost, *r[2:])

    # 1. the shared index: bisection for the boundary along the grid. Under a CE target
    # index 0 (full depth) holds it and cheaper ones eventually do not; under a budget the
    # cheap end holds it and the dear end does not. lo holds / hi does not (CE), or the reverse.
    ce_target = target.kind == "max_ce_increase"
    lo, hi = 0, grid_size - 1
    ahead([(lo,) * groups, (hi,) * groups])
    ok_lo, ok_hi = (meets(ev((i,) * groups), target, ce_ref) for i in (lo, hi))
    if ok_lo and ok_hi:  # every shared setting holds it: the cheapest (CE) / the dearest (budget)
        lo = hi = hi if ce_target else lo
    elif not (ok_lo if ce_target else ok_hi):  # not even the safe end holds it: nothing to bisect
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = ev((mid,) * groups)
        if p is None:
            break
        if meets(p, target, ce_ref) == ce_target:
            lo = mid
        else:
            hi = mid

    # 2. per group: single and exchange moves from the best point so far
    if per_group and groups > 1:
        moves = [{g: s} for g in range(groups) for s in (1, -1)]
        moves += [{g: 1, h: -1} for g in range(groups) for h in range(groups) if g != h]
        while True:
            cur, _ = best(list(seen.values()), target, ce_ref)
            cands = []
            for m in moves:
                s = tuple(i + m.get(g, 0) for g, i in enumerate(cur.setting))
                if all(0 <= i < grid_size for i in s):
                    cands.append(s)
            improved = False
            ahead(cands)
            for s in cands:
                p = ev(s)
                if p is None:
                    break
                if meets(p, target, ce_ref) and (not meets(cur, target, ce_ref) or _key(p, target) < _key(cur, target)):
                    improved = True
            if not improved or len(seen) >= max_evals:
                break
    b, met = best(list(seen.values()), target, ce_ref)
    return Result(b, met, ce_ref, target, list(seen.values()))


# ----------------------------------------------------------------- knobs
TAU_GRID = tuple(float(f"{10 ** (e / 4):.3g}") for e in range(-32, 9))  # 1e-8 .. 100, 4 per decade
PROBABILITY_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95 (rule `gate`)


def knob(rule: str, max_steps: int) -> tuple[str, tuple]:
    """The exit field a rule is calibrated on and its grid, expensive first:
    `fixed` -> max_steps N .. 1; `argmax_stability` -> patience N−1 .. 1 (one value for
    every group); `gate` -> τ, a probability, 0.05 .. 0.95; the others -> τ, 1e-8 .. 100,
    four values per decade."""
    if rule == "fixed":
        return "max_steps", tuple(range(max_steps, 0, -1))
    if rule == "argmax_stability":
        return "patience", tuple(range(max(max_steps - 1, 1), 0, -1))
    if rule == "gate":
        return "tau", PROBABILITY_GRID
    return "tau", TAU_GRID
