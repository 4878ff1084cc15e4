"""Where the training loss is taken along the loop (`loss.*`, docs/spec.md §1c).

`last` (Geiping et al.'s recipe, the default): one loss after the last application. The
per-step objectives tie the loss to each application of the model's last recurrence group
(the graded ones: the backprop window, all of them with `sampler.backprop_depth=null`):

- `all`: after every graded application t, the final target (the answer as the target
  after every application: "deep supervision", Yang et al.'s loss over the last loops);
- `trajectory`: after application t, a per-step target the data supplies (a task's
  `steps`: on roots, the node t hops up from the query), the final target where it has
  none (past its last step, and every token that is not an answer).

A step's loss is the mean token NLL over the scored targets (-1: not scored), as `last`'s;
the objective is their weighted mean over the graded applications (`weights`: uniform, or
linear in t, which leans on the late ones). Earlier groups run their sampled applications
and reach the loss through the last group's. A schedule anneals from `steps` to
`anneal_to` over training: from step `anneal_start` to `anneal_end` (fractions of
trainer.max_steps) the loss is (1 − λ)·L(steps) + λ·L(anneal_to), λ rising linearly 0 → 1.

Core layer: torch only. The model computes the per-application logits (`LoopedGPT.forward`
with an objective); this module says what loss they make.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

STEPS = ("last", "all", "trajectory")
WEIGHTS = ("uniform", "linear")


def check(steps: str, weights: str, anneal_to: str | None, anneal_start: float, anneal_end: float) -> None:
    """The `loss` group's values, one line naming the field each."""
    if steps not in STEPS:
        raise ValueError(f"loss.steps: expected one of {', '.join(STEPS)}, got {steps!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"loss.weights: expected one of {', '.join(WEIGHTS)}, got {weights!r}")
    if anneal_to is not None and (anneal_to not in STEPS or anneal_to == steps):
        raise ValueError(f"loss.anneal_to: expected null or one of {', '.join(s for s in STEPS if s != steps)} "
                         f"(an objective other than loss.steps={steps}), got {anneal_to!r}")
    for name, v in (("anneal_start", anneal_start), ("anneal_end", anneal_end)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
            raise ValueError(f"loss.{name}: expected a fraction of trainer.max_steps in [0, 1], got {v!r}")
    if anneal_end < anneal_start:
        raise ValueError(f"loss.anneal_end: expected >= loss.anneal_start={anneal_start}, got {anneal_end}")


@dataclass(frozen=True)
class Objective:
    """One training objective: `steps` with its `weights`, annealed toward `anneal_to`."""

    steps: str = "last"
    weights: str = "uniform"
    anneal_to: str | None = None
    anneal_start: float = 0.5
    anneal_end: float = 1.0

    def __post_init__(self):
        check(self.steps, self.weights, self.anneal_to, self.anneal_start, self.anneal_end)

    @property
    def uses(self) -> set[str]:
        """The objectives this one mixes at some point of training."""
        return {self.steps} | ({self.anneal_to} if self.anneal_to else set())

    def mix(self, step: int, max_steps: int) -> dict[str, float]:
        """Each objective's weight at optimiser step `step` of `max_steps` (they sum to 1)."""
        if self.anneal_to is None:
            return {self.steps: 1.0}
        a, b = self.anneal_start * max_steps, self.anneal_end * max_steps
        lam = 1.0 if step >= b else 0.0 if step < a or b == a else (step - a) / (b - a)
        return {self.steps: 1.0 - lam, self.anneal_to: lam}

    def loss(self, mix: dict[str, float], final: Tensor, per_step: Sequence[tuple[int, Tensor]], targets: Tensor,
             step_targets: Tensor | None, nll: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """The loss of one batch. `final`: logits after the last application [B, T, V];
        `per_step`: (t, logits after application t) of the last group's graded applications
        (t counted from 1 over all its applications); `targets` [B, T] (-1: not scored);
        `step_targets` [B, T, S] (-1: none; the final target then) or None; `nll`: the
        model's token NLL. `mix`: `self.mix(...)`."""
        total = None
        for kind, w in mix.items():
            if w == 0.0:
                continue
            if kind == "last":
                part = mean_nll(nll(final, targets), targets)
            else:
                part = self.along(per_step, targets, step_targets if kind == "trajectory" else None, nll)
            total = w * part if total is None else total + w * part
        return total

    def along(self, per_step: Sequence[tuple[int, Tensor]], targets: Tensor, step_targets: Tensor | None,
              nll: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """The weighted mean over applications of each application's mean NLL, against the
        final targets, or with `step_targets` against target t where there is one."""
        if not per_step:
            raise ValueError("loss.steps: no graded application of the last recurrence group to take a loss at")
        w = [1.0 if self.weights == "uniform" else float(t) for t, _ in per_step]
        w = [v / sum(w) for v in w]
        total = None
        for wt, (t, logits) in zip(w, per_step, strict=True):
            tgt = targets if step_targets is None else target_at(t, targets, step_targets)
            part = wt * mean_nll(nll(logits, tgt), tgt)
            total = part if total is None else total + part
        return total


def target_at(t: int, targets: Tensor, step_targets: Tensor) -> Tensor:
    """The target after application t: step_targets[..., t − 1] where it is set (>= 0),
    else the final target (past the data's last step: the final target everywhere)."""
    if t > step_targets.shape[-1]:
        return targets
    z = step_targets[..., t - 1]
    return torch.where(z >= 0, z, targets)


def mean_nll(nll: Tensor, targets: Tensor) -> Tensor:
    """Mean token NLL over the scored targets (-1: not scored), as the model's `last` loss."""
    return nll.sum() / (targets >= 0).sum().clamp(min=1)
