"""Halting learned with the loop: the losses that train a halting head (`halt.*`, docs/spec.md §1d).

The head (recdepth/model/looped.py, `halt_logit`; one per recurrence group) reads its group's
state after each application n = 1 .. N of a training pass (N: the pass's sampled count) and
gives λ_n = σ(z_n). A loss here turns the λ_n and the per-application token losses L_n (the
token's NLL of its final target with the group stopped after n and the rest of the pass run
from there: for the last group the coda and the head on x^(n), what `loss.steps` computes)
into one scalar, added to the objective of `loss.*`:

    act        ACT (Graves 2016): h_n = λ_n, N(t) = the first n with Σ_{j≤n} h_j ≥ 1 − ε
               (else N), p_n = h_n before N(t), p_{N(t)} = R = 1 − Σ_{j<N(t)} h_j, 0 after;
               loss = L(decode(Σ_n p_n x^(n))) + β·(N(t) + R)    (the output is the mixture
               of the states; N(t) carries no gradient, R does)
    pondernet  PonderNet (Banino et al. 2021): p_n = λ_n ∏_{j<n} (1 − λ_j), the remainder at
               N (λ_N read as 1) so Σ p_n = 1; loss = Σ_n p_n L_n + β·KL(p ‖ g), g the
               geometric(λ_p) truncated to 1 .. N and renormalised
    entropy    Ouro's stage I: the same p; loss = Σ_n p_n L_n − β·H(p)
    correct    BCE(λ_n, y_n) over every n, y_n = "the prediction after application n is
               right" (`halt.label`: right = argmax is the target; margin = L_n − L_N ≤ margin
               nats; improvement = L_n − L_{n+1} ≤ margin, Ouro's stage II; y_N = 1 for the
               last two). The post-hoc gate (recdepth/exits/gate.py, `recdepth train-gate`) is
               this loss with label margin on a frozen model, fitted by logistic regression
               (its sign flipped: q = 1 − λ), read by the same `direct` reading.

Each is the mean over the scored tokens (target >= 0) of a per-token quantity. With several
recurrence groups a group's L_n costs the rest of the pass each (the later groups, the coda,
the head), so each training step draws one group and, for every row, one application n of
it, uniformly from 1 .. N, and takes L_n from one more pass (without gradient) from that
state on. Only a loss that is a mean over applications of a term of that application alone
(`samples`: correct with label right or margin) can be trained so: the drawn group and
application estimate the mean over groups and applications without bias. What the head
means at inference (`exit=halt`, recdepth/exits/rules/builtin.py) is the loss's `reading`, through what
is left to halt after n: `sum` (ACT: 1 − Σ_{j≤n} λ_j; ACT trains to halt once it is below ε),
`cdf` (PonderNet, Ouro: ∏_{j≤n} (1 − λ_j), the halting distribution's mass after n; below 0.5:
its median) or `direct` (correct: 1 − λ_n, the probability that the answer after n is wrong);
the rule halts once it is below τ. One deterministic reading per loss; PonderNet's sampled
halting is not offered (a sample makes a token's depth random).

Core: torch only. Defining a subclass of `HaltingLoss` registers it (`halt.loss=<name>`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from recdepth.core.checks import is_number
from recdepth.core.registry import Registry
from recdepth.exits.gate import margin_labels

_REGISTRY: Registry[HaltingLoss] = Registry("halt.loss", "halting loss")
READINGS = ("sum", "cdf", "direct")  # how exit=halt reads the head (GPTConfig.halt_reading)
INPUTS = ("state", "normed")  # what the head reads (GPTConfig.halt_head)
LABELS = ("right", "margin", "improvement")  # correct's label (halt.label)


class HaltInputs(NamedTuple):
    """What a halting loss sees of one training pass (N applications, batch B, length T)."""

    z: Tensor
    """The head's logits z_n [N, B, T] (λ_n = σ(z_n)), float32."""
    nll: Tensor
    """L_n [N, B, T]: each token's NLL of its final target with the loop stopped after n."""
    right: Tensor
    """[N, B, T] bool: the argmax after application n is the final target."""
    scored: Tensor
    """[B, T] bool: the tokens that count (target >= 0)."""
    mixture: Callable[[Tensor], Tensor]
    """weights p [N, B, T] -> the NLL [B, T] of the output decoded from Σ_n p_n x^(n) (ACT)."""
    sampled: bool = False
    """True for a group of a multi-group model: the first axis holds two entries per token,
    (n, N), n its one application drawn from 1 .. N, not every application."""


@dataclass(frozen=True)
class HaltSettings:
    """The numbers of `halt.*` a loss reads (recdepth/config/groups.py: HaltConfig documents them)."""

    beta: float = 0.01
    prior: float = 0.2
    epsilon: float = 0.01
    label: str = "right"
    margin: float = 0.0

    def __post_init__(self):
        for name, v, lo, hi in (("beta", self.beta, 0.0, math.inf), ("margin", self.margin, 0.0, math.inf)):
            if not is_number(v) or not lo <= v < hi:
                raise ValueError(f"halt.{name}: expected a finite number >= {lo:g}, got {v!r}")
        for name, v in (("prior", self.prior), ("epsilon", self.epsilon)):
            if not is_number(v) or not 0 < v < 1:
                raise ValueError(f"halt.{name}: expected a number in (0, 1), got {v!r}")
        if self.label not in LABELS:
            raise ValueError(f"halt.label: expected one of {', '.join(LABELS)}, got {self.label!r}")


class HaltingLoss:
    """One halting loss: `name` (halt.loss=<name>), its `reading` at inference, and `loss`."""

    name: ClassVar[str]
    reading: ClassVar[str]
    """How exit=halt reads a head trained with this loss: one of READINGS."""
    samples: ClassVar[bool] = False
    """Whether `per_token` is the mean over applications of `per_application`, a term of one
    application alone, so that one drawn application estimates it (`HaltInputs.sampled`:
    what each group of a multi-group model gives; see the module docstring)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.reading not in READINGS:
            raise TypeError(f"{cls.__qualname__}: reading must be one of {READINGS}, got {cls.reading!r}")
        _REGISTRY.register(cls.__dict__.get("name"), cls(), cls)

    def per_token(self, h: HaltInputs, s: HaltSettings) -> Tensor:
        """The loss of each token [B, T]."""
        raise NotImplementedError

    def per_application(self, h: HaltInputs, s: HaltSettings) -> Tensor:
        """The term of each application and token [N, B, T] (a loss that `samples`)."""
        raise NotImplementedError

    def loss(self, h: HaltInputs, s: HaltSettings) -> Tensor:
        """The mean of `per_token` over the scored tokens."""
        return (self.per_token(h, s) * h.scored).sum() / h.scored.sum().clamp(min=1)


def halting_distribution(z: Tensor) -> Tensor:
    """PonderNet's p_n = λ_n ∏_{j<n} (1 − λ_j) over n = 1 .. N, λ = σ(z), with the remainder
    at N (λ_N read as 1): [N, ...] -> [N, ...], summing to 1 over the first axis. In log
    space (log λ = logsigmoid(z), log(1 − λ) = logsigmoid(−z)): returns log p."""
    log_stay = F.logsigmoid(-z)
    before = torch.cumsum(log_stay, 0) - log_stay  # Σ_{j<n} log(1 − λ_j)
    log_halt = F.logsigmoid(z)
    last = torch.zeros_like(z[-1:])  # λ_N = 1
    return before + torch.cat([log_halt[:-1], last], 0)


def expected_loss(h: HaltInputs) -> tuple[Tensor, Tensor]:
    """(log p [N, ...], Σ_n p_n L_n [...]): PonderNet's halting distribution and the loss it
    expects, the part pondernet and entropy share."""
    log_p = halting_distribution(h.z)
    return log_p, (log_p.exp() * h.nll).sum(0)


def truncated_geometric(N: int, prior: float, like: Tensor) -> Tensor:
    """log g_n, n = 1 .. N: the geometric distribution of parameter λ_p = `prior`, g_n ∝
    λ_p (1 − λ_p)^(n−1), truncated to 1 .. N and renormalised ([N], like's dtype and device)."""
    n = torch.arange(N, dtype=torch.float64)
    log_g = math.log(prior) + n * math.log1p(-prior)
    return (log_g - torch.logsumexp(log_g, 0)).to(like)


def act_weights(z: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    """ACT's (p [N, ...], N(t) [...] as float, R [...]) from halting logits z [N, ...]:
    h = σ(z), N(t) the first n with Σ_{j≤n} h_j ≥ 1 − ε (N if none), R = 1 − Σ_{j<N(t)} h_j,
    p_n = h_n for n < N(t), p_{N(t)} = R, 0 after. N(t) is a count (no gradient); R and the
    p_n carry h's."""
    h = torch.sigmoid(z)
    N = z.shape[0]
    c = torch.cumsum(h, 0)
    reached = c >= 1 - epsilon
    reached[-1] = True
    idx = reached.float().argmax(0)  # the first n (0-based) that reaches 1 − ε
    n = torch.arange(N, device=z.device).view(-1, *([1] * (z.dim() - 1)))
    before = n < idx
    R = 1 - (h * before).sum(0)
    p = torch.where(before, h, torch.zeros_like(h)) + torch.where(n == idx, R.unsqueeze(0), torch.zeros_like(h))
    return p, (idx + 1).to(h.dtype), R


def correct_labels(h: HaltInputs, s: HaltSettings) -> Tensor:
    """correct's label y_n [N, B, T] (float): see the module docstring (`halt.label`)."""
    if s.label == "right":
        y = h.right
    elif s.label == "margin":  # the post-hoc gate's label too (negated: its 1 is "continue")
        y = margin_labels(h.nll, s.margin, dim=0)
    else:  # improvement: L_n − L_{n+1} ≤ margin; y_N = 1
        y = h.nll - torch.cat([h.nll[1:], h.nll[-1:]], 0) <= s.margin
    return y.to(h.z.dtype)


class ACT(HaltingLoss):
    """ACT: the mixture's loss plus the ponder cost β·(N(t) + R)."""

    name = "act"
    reading = "sum"

    def per_token(self, h: HaltInputs, s: HaltSettings) -> Tensor:
        p, n, R = act_weights(h.z, s.epsilon)
        return h.mixture(p) + s.beta * (n + R)


class PonderNet(HaltingLoss):
    """PonderNet: Σ p_n L_n + β·KL(p ‖ truncated geometric(λ_p))."""

    name = "pondernet"
    reading = "cdf"

    def per_token(self, h: HaltInputs, s: HaltSettings) -> Tensor:
        log_p, expected = expected_loss(h)
        log_g = truncated_geometric(h.z.shape[0], s.prior, h.z).view(-1, *([1] * (h.z.dim() - 1)))
        return expected + s.beta * (log_p.exp() * (log_p - log_g)).sum(0)


class Entropy(HaltingLoss):
    """Ouro's stage I: Σ p_n L_n − β·H(p) (a uniform prior)."""

    name = "entropy"
    reading = "cdf"

    def per_token(self, h: HaltInputs, s: HaltSettings) -> Tensor:
        log_p, expected = expected_loss(h)
        return expected + s.beta * (log_p.exp() * log_p).sum(0)


class Correct(HaltingLoss):
    """BCE of λ_n against "the prediction after application n is right", every n (a drawn n
    when `sampled`)."""

    name = "correct"
    reading = "direct"
    samples = True

    def per_application(self, h: HaltInputs, s: HaltSettings) -> Tensor:
        return F.binary_cross_entropy_with_logits(h.z, correct_labels(h, s), reduction="none")

    def per_token(self, h: HaltInputs, s: HaltSettings) -> Tensor:
        bce = self.per_application(h, s)
        return bce[0] if h.sampled else bce.mean(0)


def check_groups(name: str, label: str, n_groups: int) -> None:
    """Whether halt.loss=`name` (with halt.label=`label`) can train heads on a model with
    `n_groups` recurrence groups; a one-line ValueError naming the field otherwise."""
    if n_groups < 1:
        raise ValueError("halt.loss: a halting head reads a recurrence group's state, and this model has none")
    if n_groups == 1:
        return
    if not lookup(name).samples:
        raise ValueError(f"halt.loss: {name} needs the loss after every application of every group, which on a "
                         f"model with {n_groups} recurrence groups costs the rest of the pass per application; "
                         "there halt.loss=correct (each token's application drawn) or one group (model=single)")
    if name == "correct" and label == "improvement":
        raise ValueError(f"halt.label: improvement compares two successive applications, and on a model with "
                         f"{n_groups} recurrence groups one application is drawn per token (label right or margin)")


def names() -> tuple[str, ...]:
    """Every registered halting loss, in the order defined."""
    return _REGISTRY.names()


def lookup(name: str) -> HaltingLoss:
    """The loss registered under `name`; a one-line ValueError naming halt.loss otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"halt.loss: unknown halting loss {name!r} (expected none or one of {', '.join(_REGISTRY)})")
    return _REGISTRY[name]
