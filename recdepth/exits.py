"""Early-exit rules for a looped group (SPEC §3; paper §4, eqs. 3-6, Algorithm 1).

A rule decides, per token (row), when to stop applying a group. With x^(0) the loop's
initial state, x^(n) the state after n applications and Δ^(j) = x^(j+1) − x^(j):

    rule          exits after application n when                         earliest n
    fixed/none    n = max_steps                                              —
    stepnorm      ‖Δ^(n−1)‖ < τ                                               1
    stepnorm_rel  ‖Δ^(n−1)‖ / (‖x^(n−1)‖ + ε) < τ                              1
    kl            KL(p^(n) ‖ p^(n−1)) < τ,  p^(j) = softmax(decode(x^(j)))    2
    accel         a^(n−1) < τ and a^(n−2) < τ,  a^(j) = ‖Δ^(j) − Δ^(j−1)‖      3
    accel_rel     as accel with â^(j) (eq. 6)                                  3

    oracle        (evaluation only) the smallest uniform n whose target NLL is within
                  τ of its NLL at max_steps (SPEC §4b): it reads the answer, so no model
                  can run it; `recdepth.decoding.evaluate_oracle` computes it as the bound
                  of what any rule could save at that quality

Every rule also stops at `max_steps` and never before `min_steps`. After the check that
fires, the newest state x^(n) is kept (deviation from Algorithm 1, which returns x^(n−1)
after paying for n applications; the decision, and so n, is identical).

Public API (used by the decoding engine, the tests and outside checks):
    policy = build(name, tau, min_steps=0, max_steps=32)
    x, n = iterate(f, x0, policy, decode=None)
and, for engines that drive their own loop, `policy.monitor(x0, decode)` whose
`observe(x_new)` returns the rows whose rule fires after that application.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from recdepth import geometry as geo

RULES = ("fixed", "stepnorm", "stepnorm_rel", "kl", "accel", "accel_rel")
ORACLE = "oracle"  # an evaluation bound, not a rule (see the module docstring)
ALIASES = {"none": "fixed"}


def kl_divergence(logp_new: Tensor, logp_old: Tensor) -> Tensor:
    """KL(p^(n) ‖ p^(n−1)) = Σ p^(n) (log p^(n) − log p^(n−1)) over the last axis
    (paper eq. 4; the direction Geiping et al. and the paper use).

    Entries with p^(n) = 0 (e.g. the -inf logits of a padded vocabulary) contribute 0,
    the 0·log 0 = 0 convention, instead of 0·(−inf + inf) = NaN."""
    p = logp_new.exp()
    return torch.where(p > 0, p * (logp_new - logp_old), 0.0).sum(-1)


@dataclass(frozen=True)
class ExitPolicy:
    """A validated exit rule. Build it with `build(...)`."""

    name: str
    tau: float | None
    min_steps: int = 0
    max_steps: int = 32

    @property
    def needs_decode(self) -> bool:
        return self.name == "kl"

    def monitor(self, x0: Tensor, decode: Callable[[Tensor], Tensor] | None = None) -> ExitMonitor:
        if self.name == ORACLE:
            raise ValueError("exit.name: 'oracle' reads the target token, so no loop can run it; "
                             "only the evaluation engine computes it (recdepth.decoding.evaluate_oracle)")
        if self.needs_decode and decode is None:
            raise ValueError("exit.name: rule 'kl' needs a decode function (state -> logits)")
        return ExitMonitor(self, x0, decode)


class ExitMonitor:
    """Incremental state of one loop under a rule: O(d) history per row.

    Call `observe(x_new)` once after every application with the new state of every row;
    it returns a bool tensor [N] of rows whose rule fires after this application. Rows
    that already exited may be passed anything: their history is never read again.
    """

    def __init__(self, policy: ExitPolicy, x0: Tensor, decode: Callable[[Tensor], Tensor] | None):
        self.p = policy
        self.decode = decode
        self.n = 0
        self.x_prev = x0
        self.d_prev: Tensor | None = None  # Δ^(n−2) when observing x^(n)
        self.s_prev: Tensor | None = None  # a^(n−2) (accel) or log p^(n−1) (kl)

    def observe(self, x_new: Tensor) -> Tensor:
        p = self.p
        self.n += 1
        N = x_new.shape[0]
        crit = None if p.name == "fixed" else self._criterion(x_new)
        self.x_prev = x_new
        if self.n >= p.max_steps:
            return torch.ones(N, dtype=torch.bool, device=x_new.device)
        if crit is None or self.n < p.min_steps:
            return torch.zeros(N, dtype=torch.bool, device=x_new.device)
        return crit

    def _criterion(self, x_new: Tensor) -> Tensor | None:
        """Update the history with x^(n); return the rule's test at n (None before its
        earliest n). History is kept below min_steps too, so the first allowed check
        sees a^(n−2) or p^(n−1)."""
        p = self.p
        if p.name == "kl":
            logits = self.decode(x_new)
            logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
            logp_prev, self.s_prev = self.s_prev, logp
            return None if logp_prev is None else kl_divergence(logp, logp_prev) < p.tau
        d = geo.step(self.x_prev, x_new)  # Δ^(n−1)
        if p.name == "stepnorm":
            return geo.step_norm(d) < p.tau
        if p.name == "stepnorm_rel":
            return geo.relative_step_norm(d, self.x_prev) < p.tau
        # accel / accel_rel: two hits, a^(n−1) and a^(n−2)
        d_prev, self.d_prev = self.d_prev, d
        if d_prev is None:
            return None
        a_fn = geo.acceleration if p.name == "accel" else geo.relative_acceleration
        a = a_fn(d, d_prev)
        a_prev, self.s_prev = self.s_prev, a
        return None if a_prev is None else (a < p.tau) & (a_prev < p.tau)


def _check_int(field: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"exit.{field}: expected an integer >= {lo}, got {value!r}")
    return value


def build(name: str, tau: float | None, min_steps: int = 0, max_steps: int = 32) -> ExitPolicy:
    """Validate and build an exit policy (SPEC §3). `tau` is ignored by `fixed`/`none`."""
    key = ALIASES.get(name, name)
    if key not in RULES and key != ORACLE:
        raise ValueError(f"exit.name: unknown exit rule {name!r} (expected one of: none, {', '.join(RULES)}, "
                         f"{ORACLE})")
    min_steps = _check_int("min_steps", min_steps, 0)
    max_steps = _check_int("max_steps", max_steps, 1)
    if max_steps < min_steps:
        raise ValueError(f"exit.max_steps: {max_steps} is smaller than exit.min_steps={min_steps}")
    if key != "fixed":
        ok = isinstance(tau, (int, float)) and not isinstance(tau, bool) and math.isfinite(tau)
        lo = 0 if key == ORACLE else None  # the oracle's ε may be 0 (as good as max_steps)
        if not (ok and (tau >= 0 if lo == 0 else tau > 0)):
            what = ">= 0 for the oracle's ε" if lo == 0 else f"> 0 for rule {key!r}"
            raise ValueError(f"exit.tau: expected a finite number {what}, got {tau!r}")
        tau = float(tau)
    return ExitPolicy(key, tau, min_steps, max_steps)


def iterate(
    f: Callable[[Tensor], Tensor],
    x0: Tensor,
    policy: ExitPolicy,
    decode: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Run `f` from `x0` [N, d] under `policy`; returns the final states [N, d] and the
    number of applications per row [N] (int64).

    `f` is always called with the full batch; rows whose rule has fired keep their state
    (later outputs for them are discarded).
    """
    mon = policy.monitor(x0, decode)
    x = x0
    n = torch.zeros(x0.shape[0], dtype=torch.long, device=x0.device)
    active = torch.ones(x0.shape[0], dtype=torch.bool, device=x0.device)
    while bool(active.any()):
        x_new = f(x)
        n += active
        fired = mon.observe(x_new)
        x = torch.where(active[:, None], x_new, x)
        active &= ~fired
    return x, n
