"""An exit rule's check as a function of tensors (`observe_step`), for a loop compiled whole
(`torch.while_loop`: `recdepth.core.lean_step.LeanSteps.loop`, the compiled step at batch 1).

`recdepth.core.exits.ExitMonitor.observe` keeps a rule's history in Python attributes and
returns early before a rule's earliest n; a graph may do neither. Here the history is a
tuple of tensors carried through the loop (`history0` gives its start), τ, min_steps,
max_steps and patience are one tensor (one graph serves every value), and a test before
the rule's earliest n compares a placeholder that never passes or is masked by n. The
statistics are the monitor's functions (`recdepth.core.geometry`, `exits.kl_divergence`,
`exits.entropy`, ...); tests/test_exits.py checks the decisions against the same slow
reference as the monitor's, for every rule, τ and step limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from recdepth.core import geometry as geo
from recdepth.core.exits import DECODING, GATE, ExitPolicy, entropy, entropy_change, kl_divergence
from recdepth.core.gate import gate_probability


def history0(p: ExitPolicy, x0: Tensor, vocab: int) -> tuple[Tensor, ...]:
    """What `observe_step` carries between applications for rule p.name, before the first
    one, for states x0 [N, d] and `vocab` logits: accel(_rel) Δ^(n−2) and a^(n−2), kl log p^(n−1),
    entropy_diff H(p^(n−1)), argmax_stability the last argmax and its run; nothing otherwise.
    The values before a rule's earliest n are placeholders its test never passes on."""
    N = x0.shape[0]
    if p.name in ("accel", "accel_rel"):
        return torch.zeros_like(x0), x0.new_full((N,), math.inf)
    if p.name == "kl":
        return (x0.new_zeros(N, vocab, dtype=torch.promote_types(x0.dtype, torch.float32)),)
    if p.name == "entropy_diff":
        return (x0.new_zeros(N, dtype=torch.promote_types(x0.dtype, torch.float32)),)
    if p.name == "argmax_stability":
        return x0.new_full((N,), -1, dtype=torch.long), x0.new_zeros(N, dtype=torch.long)
    return ()


def observe_step(p: ExitPolicy, n: Tensor, x_prev: Tensor, x_new: Tensor, hist: tuple[Tensor, ...],
                 limits: Tensor, decode: Callable[[Tensor], Tensor] | None = None,
                 gate: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """`ExitMonitor.observe` as a function of tensors (see the module docstring): no branch
    on a value, so one graph serves every τ and step bound. After application n ([] long) with states
    x_prev = x^(n−1), x_new = x^(n) [N, d] and the history `hist` (`history0`), returns the
    rows whose rule fires [N] and the new history. `limits` = [τ, min_steps, max_steps,
    patience] (float64); `decode` and `gate` ((weight [d], bias [])) as for the monitor.
    The statistics are the monitor's functions; a rule's test before its earliest n
    compares a placeholder that never passes (accel: a^(n−2) = inf), or is masked by n.
    Tests compare it with `ExitMonitor` for every rule."""
    tau, min_steps, max_steps, patience = limits.unbind()
    if p.name == "fixed":
        test = torch.zeros(x_new.shape[0], dtype=torch.bool, device=x_new.device)
    elif p.name in DECODING:
        logits = decode(x_new)
        if p.name == "argmax_stability":
            tok_prev, run_prev = hist
            tok = logits.argmax(-1)
            run = torch.where(tok == tok_prev, run_prev + 1, 1)  # argmax_run; tok_prev = -1 at n = 1
            test, hist = run > patience, (tok, run)
        else:
            logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
            if p.name == "kl":
                (logp_prev,) = hist
                kl = kl_divergence(logp_prev, logp) if p.kl_direction == "old_new" else kl_divergence(logp, logp_prev)
                test, hist = (kl < tau) & (n >= 2), (logp,)
            else:  # entropy_diff
                (h_prev,) = hist
                h = entropy(logp)
                test, hist = (entropy_change(h, h_prev) < tau) & (n >= 2), (h,)
    elif p.name == GATE:
        test = gate_probability(x_new, *gate) < tau
    elif p.name == "cosine":
        test = geo.state_cosine_distance(x_new, x_prev) < tau
    else:
        d = geo.step(x_prev, x_new)  # Δ^(n−1)
        if p.name == "stepnorm":
            test = geo.step_norm(d) < tau
        elif p.name == "stepnorm_rel":
            test = geo.relative_step_norm(d, x_prev) < tau
        else:  # accel / accel_rel: a^(n−1) and a^(n−2) below τ; a^(n−1) needs Δ^(n−2) (n >= 2)
            d_prev, a_prev = hist
            a_fn = geo.acceleration if p.name == "accel" else geo.relative_acceleration
            a = torch.where(n >= 2, a_fn(d, d_prev), math.inf)
            test, hist = (a < tau) & (a_prev < tau), (d, a)
    return (n >= max_steps) | ((n >= min_steps) & test), hist
