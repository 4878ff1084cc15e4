"""Running a rule over a loop: the eager monitor, the same check as a function of tensors for
a loop compiled whole, and the reference loop.

    ExitMonitor(policy, x0, decode)   the decoding engine's: `observe(x_new)` after every
                                      application returns the rows whose rule fires
    history0 / observe_step           the same decision with the history as a tuple of tensors
                                      and τ, min/max steps, patience as one tensor, no branch on
                                      a value (`torch.while_loop`: the compiled batch-1 loop,
                                      `recdepth.decode.lean_step.LeanSteps.loop`)
    iterate(f, x0, policy)            the reference loop (tests, outside checks)

Both forms call the rule's own `advance` and `fires` (recdepth/exits/rule.py), so they
decide alike by construction; tests/exits/test_exits.py checks both against a slow per-row
reference for every rule, τ and step limit. The eager monitor reads `fires` only where it
can decide (from the rule's earliest n and min_steps on, before max_steps); the compiled
form computes it at every application and masks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from recdepth.exits.rule import ExitRule, Step

ExitPolicy = Any  # recdepth.exits.policy.ExitPolicy, which builds the monitor (and so is imported after this module)


class ExitMonitor:
    """Incremental state of one loop under a one-group policy: the rule's history (O(d) per
    row; O(V) for kl, which keeps log p^(n−1)) and the previous state.

    Call `observe(x_new)` once after every application with the new state of every row;
    it returns a bool tensor [N] of rows whose rule fires after this application. Rows
    that already exited may be passed anything: their history is never read again. At
    max_steps the limit decides and no check runs (nothing is decoded: docs/spec.md §4b,
    the checks a cost bills). `logits` keeps the last check's decode, which the engine
    reuses as the token's output where the decode is that output
    (`recdepth.decode.state_decode.check_is_output`).
    Build it with `policy.monitor(x0, decode)`, which checks the policy first.
    """

    def __init__(self, policy: ExitPolicy, x0: Tensor, decode: Callable[[Tensor], Tensor] | None):
        self.p = policy
        self.rule: ExitRule = policy.rule
        self.decode = decode
        self.n = 0
        self.x_prev = x0
        # placeholders, never read before the rule's earliest n: a vocabulary of 1 broadcasts as any
        self.hist = self.rule.history0(x0, 1)
        self.tau = float("nan") if policy.tau is None else policy.tau
        self.logits: Tensor | None = None  # this application's decoded logits (a rule that decodes; None: no check)
        # the gate's weights where the state is
        self.gate = None if policy.gate is None else tuple(t.to(device=x0.device, dtype=x0.dtype) for t in policy.gate)

    def observe(self, x_new: Tensor, active: Tensor | None = None) -> Tensor:
        """`active` (the rows still looping) is for `MixedMonitor`, which skips settings
        whose rows have all exited; one setting computes every row's statistic in one call."""
        p, r = self.p, self.rule
        self.n += 1
        self.logits = None
        if self.n >= p.max_steps:  # the limit decides: no check (no decode), its history never read again
            return torch.ones(x_new.shape[0], dtype=torch.bool, device=x_new.device)
        logits = self.decode(x_new) if r.decodes else None
        self.logits = logits
        s = Step(self.x_prev, x_new, self.hist, logits, self.tau, p.patience, self.gate, p)
        new = r.advance(s)  # history is kept below min_steps too: the first allowed check sees it whole
        decide = p.min_steps <= self.n < p.max_steps and self.n >= r.earliest
        crit = r.fires(s, new) if decide else None
        self.x_prev, self.hist = x_new, new
        N = x_new.shape[0]
        if crit is None:
            return torch.zeros(N, dtype=torch.bool, device=x_new.device)
        return crit


def history0(p: ExitPolicy, x0: Tensor, vocab: int) -> tuple[Tensor, ...]:
    """What `observe_step` carries between applications for rule p.name, before the first,
    for states x0 [N, d] and `vocab` logits: the rule's `history0`, in memory of its own (a
    loop's carried values may not be broadcast views)."""
    return tuple(h.contiguous() for h in p.rule.history0(x0, vocab))


def observe_step(p: ExitPolicy, n: Tensor, x_prev: Tensor, x_new: Tensor, hist: tuple[Tensor, ...],
                 limits: Tensor, decode: Callable[[Tensor], Tensor] | None = None,
                 gate: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """`ExitMonitor.observe` as a function of tensors: no branch on a value, so one graph
    serves every τ and step bound. After application n ([] long) with states x_prev =
    x^(n−1), x_new = x^(n) [N, d] and the history `hist` (`history0`), returns the rows whose
    rule fires [N] and the new history. `limits` = [τ, min_steps, max_steps, patience]
    (float64); `decode` and `gate` ((weight [d], bias [])) as for the monitor."""
    tau, min_steps, max_steps, patience = limits.unbind()
    r = p.rule
    logits = decode(x_new) if r.decodes else None
    s = Step(x_prev, x_new, hist, logits, tau, patience, gate, p)
    new = r.advance(s)
    test = r.fires(s, new) & (n >= r.earliest)
    return (n >= max_steps) | ((n >= min_steps) & test), new


def iterate(
    f: Callable[[Tensor], Tensor],
    x0: Tensor,
    policy: ExitPolicy,
    decode: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Run `f` from `x0` [N, d] under a one-group `policy` (`policy.group(g)` of a per-group
    one); returns the final states [N, d] and the number of applications per row [N]
    (int64).

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
