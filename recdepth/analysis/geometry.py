"""Loop geometry: the quantities of SPEC §2 (paper §2-§4), one function per equation.

Two kinds of input:
- pointwise forms on states/steps shaped `[..., d]` — what the exit rules evaluate after
  every application (the exit rules, recdepth/exits/rules/builtin.py, call these, it never re-derives them);
- trajectory forms on a recorded trajectory shaped `[K+1, ..., d]` (x^(0) .. x^(K), the
  states a group computes) — what the diagnostics evaluate. Each is written in terms of
  the pointwise form, so both read the same definition.

Norms are Euclidean over the last (feature) axis.
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-6  # SPEC §3: ε of the relative rules


# ---------------------------------------------------------------- pointwise forms
def step(x_prev: Tensor, x_next: Tensor) -> Tensor:
    """Loop step Δ^(k) = x^(k+1) − x^(k) (paper eq. 1)."""
    return x_next - x_prev


def step_norm(delta: Tensor) -> Tensor:
    """Step size ‖Δ^(k)‖₂ (paper §2; the step-norm exit statistic, eq. 3)."""
    return torch.linalg.vector_norm(delta, dim=-1)


def state_norm(x: Tensor) -> Tensor:
    """Scale of a state ‖x^(k)‖₂ (the denominator of the normalised step norm, paper §4)."""
    return torch.linalg.vector_norm(x, dim=-1)


def relative_step_norm(delta: Tensor, x_prev: Tensor, eps: float = EPS) -> Tensor:
    """Scale-free step size ‖Δ^(k)‖₂ / (‖x^(k)‖₂ + ε) (paper §4, normalised variant of eq. 3)."""
    return step_norm(delta) / (state_norm(x_prev) + eps)


def step_cosine(delta: Tensor, delta_prev: Tensor) -> Tensor:
    """Consecutive-step cosine cos∠(Δ^(k), Δ^(k−1)) (paper §2).

    A zero step has no direction; its cosine is defined as 0 (orthogonal) rather than NaN.
    """
    num = (delta * delta_prev).sum(-1)
    den = step_norm(delta) * step_norm(delta_prev)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), 0.0)


def state_cosine_distance(x_new: Tensor, x_old: Tensor) -> Tensor:
    """Cosine distance of consecutive states 1 − cos∠(x^(n), x^(n−1)) (Huginn's `cosine`
    exit statistic; docs/spec.md §3b).

    Computed as ½‖x̂^(n) − x̂^(n−1)‖₂² with x̂ = x / ‖x‖₂, the same quantity (for unit
    vectors ‖u − v‖² = 2 − 2 u·v) without the cancellation of 1 − cos near cos = 1. A zero
    state has no direction: against a non-zero state its cosine is 0 (distance 1, as in
    `step_cosine`); two zero states are equal, distance 0 (a state that stays at 0 has
    stopped moving).
    """
    n_new, n_old = state_norm(x_new), state_norm(x_old)
    tiny = torch.finfo(n_new.dtype).tiny
    u = x_new / n_new.clamp_min(tiny).unsqueeze(-1)
    v = x_old / n_old.clamp_min(tiny).unsqueeze(-1)
    dist = 0.5 * step_norm(u - v).square()
    some = (n_new > 0) | (n_old > 0)
    return torch.where((n_new > 0) & (n_old > 0), dist, some.to(dist.dtype))


def acceleration(delta: Tensor, delta_prev: Tensor) -> Tensor:
    """Acceleration a^(k) = ‖Δ^(k) − Δ^(k−1)‖₂ (paper eq. 5)."""
    return step_norm(delta - delta_prev)


def relative_acceleration(delta: Tensor, delta_prev: Tensor, eps: float = EPS) -> Tensor:
    """Bounded acceleration â^(k) = ‖Δ^(k) − Δ^(k−1)‖₂ / (‖Δ^(k)‖₂ + ‖Δ^(k−1)‖₂ + ε) ∈ [0, 2]
    (paper eq. 6)."""
    return acceleration(delta, delta_prev) / (step_norm(delta) + step_norm(delta_prev) + eps)


# ---------------------------------------------------------------- trajectory forms
def steps(traj: Tensor) -> Tensor:
    """All loop steps of a trajectory `[K+1, ..., d]` -> `[K, ..., d]` (eq. 1)."""
    return step(traj[:-1], traj[1:])


def state_norms(traj: Tensor) -> Tensor:
    """‖x^(k)‖₂ for k = 0..K: `[K+1, ..., d]` -> `[K+1, ...]`."""
    return state_norm(traj)


def step_norms(traj: Tensor) -> Tensor:
    """‖Δ^(k)‖₂ for k = 0..K−1: `[K+1, ..., d]` -> `[K, ...]`."""
    return step_norm(steps(traj))


def step_cosines(traj: Tensor) -> Tensor:
    """cos∠(Δ^(k), Δ^(k−1)) for k = 1..K−1: `[K+1, ..., d]` -> `[K−1, ...]`."""
    d = steps(traj)
    return step_cosine(d[1:], d[:-1])


def accelerations(traj: Tensor) -> Tensor:
    """a^(k) for k = 1..K−1 (eq. 5): `[K+1, ..., d]` -> `[K−1, ...]`."""
    d = steps(traj)
    return acceleration(d[1:], d[:-1])


def drift_to_loop_ratio(traj_g: Tensor, traj_next: Tensor) -> Tensor:
    """Drift-to-loop ratio at the boundary g → g+1 (paper eq. 2):

        DLR = ‖x_{g+1}^(0) − x_g^(K_g)‖₂ / ( (1/K_g) Σ_{k<K_g} ‖Δ_g^(k)‖₂ )

    `traj_g` is group g's trajectory `[K_g+1, ..., d]`, `traj_next` group g+1's
    `[K_{g+1}+1, ..., d]`; returns `[...]` (one ratio per token).
    """
    if traj_g.shape[0] < 2:
        raise ValueError("drift_to_loop_ratio: traj_g needs at least 2 states (K_g >= 1)")
    drift = step_norm(step(traj_g[-1], traj_next[0]))
    return drift / step_norms(traj_g).mean(0)
