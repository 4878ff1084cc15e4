"""The built-in exit rules (SPEC §3, §3b, §3c; paper §4, eqs. 3-6, Algorithm 1), one class each.

With x^(0) the loop's initial state, x^(n) the state after n applications,
Δ^(j) = x^(j+1) − x^(j) and p^(j) = softmax(decode(x^(j))) (the model's own output head on
the state, `exit.decode`):

    rule              exits after application n when                   earliest n  a check's statistic
    fixed/none        n = max_steps                                        —        none
    stepnorm          ‖Δ^(n−1)‖ < τ                                         1        3d
    stepnorm_rel      ‖Δ^(n−1)‖ / (‖x^(n−1)‖ + ε) < τ                        1        5d
    kl                KL(p^(n) ‖ p^(n−1)) < τ  (exit.kl_direction)            2        9V, after a decode
    accel             a^(n−1) < τ and a^(n−2) < τ,  a^(j) = ‖Δ^(j) − Δ^(j−1)‖ 3        4d
    accel_rel         as accel with â^(j) (eq. 6)                            3        8d
    entropy_diff      |H(p^(n)) − H(p^(n−1))| < τ                            2        8V, after a decode
    cosine            1 − cos(x^(n), x^(n−1)) < τ                            1        6d
    argmax_stability  argmax p^(j) equal for j = n−k … n (k = patience)      k + 1    V, after a decode
    halt              r^(n) < τ, r what the trained head leaves to halt:     1        5d
                      1 − Σ λ_j, ∏ (1 − λ_j) or 1 − λ_n; λ_j = σ(w · f(x^(j)) + b)
    gate              halt's 1 − λ_n (`direct`) of a head fitted on a frozen   1        2d
                      model: q^(n) = σ(w_g · x^(n) + b_g) < τ,  τ in (0, 1)

The last column is each rule's `check_flops` (element-wise operations, one FLOP each); a
decode (the head, 2·d·V, and under exit.decode=coda the layers after the group) is priced
by the engine that runs it, and the two make a check's price in layer equivalents
(docs/spec.md §4b, `recdepth.decode.state_decode.check_price`).

Each equation is one function: `geometry.step_norm`, `geometry.relative_step_norm`,
`geometry.acceleration`, `geometry.relative_acceleration`, `geometry.state_cosine_distance`
(state math, recdepth/analysis/geometry.py) and `kl_divergence`, `entropy`, `entropy_change`,
`argmax_run` (distribution math, below). To add a rule, write a class like these in a file
of its own in this folder (recdepth/exits/rules/): docs/contributing.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from recdepth.analysis import geometry as geo
from recdepth.exits.rule import ExitRule, Step
from recdepth.model.looped import halt_logit

PATIENCE = 5  # argmax_stability's default k (Huginn: 5 steps)


# ------------------------------------------------------------ distribution math
def kl_divergence(logp_new: Tensor, logp_old: Tensor) -> Tensor:
    """KL(p^(n) ‖ p^(n−1)) = Σ p^(n) (log p^(n) − log p^(n−1)) over the last axis
    (paper eq. 4; `exit.kl_direction=new_old`). Huginn's code computes the other direction,
    KL(p^(n−1) ‖ p^(n)) = kl_divergence(logp_old, logp_new) (`old_new`).

    Entries with p^(n) = 0 (e.g. the -inf logits of a padded vocabulary) contribute 0,
    the 0·log 0 = 0 convention, instead of 0·(−inf + inf) = NaN: `nansum` skips them (the
    same sum as zeroing them with `where`, bit for bit, in one pass over V instead of three),
    but it also skips a NaN in log p^(n−1) itself."""
    return (logp_new.exp() * (logp_new - logp_old)).nansum(-1)


def entropy(logp: Tensor) -> Tensor:
    """Shannon entropy H(p) = −Σ p log p (nats) over the last axis, from log-probabilities.
    Entries with p = 0 (padded logits) contribute 0 (0·log 0 = 0; `nansum` skips the NaN of
    0·(−inf), as `kl_divergence`)."""
    return -(logp.exp() * logp).nansum(-1)


def entropy_change(h_new: Tensor, h_old: Tensor) -> Tensor:
    """|H(p^(n)) − H(p^(n−1))|, the `entropy_diff` statistic (Huginn's entropy-diff;
    docs/spec.md §3b), from the two entropies (`entropy`)."""
    return (h_new - h_old).abs()


def argmax_run(tok_new: Tensor, tok_old: Tensor | None, run_old: Tensor | None) -> Tensor:
    """Run length r^(n) of the decoded argmax: how many consecutive j ≤ n, counted from
    j = 1, have argmax p^(j) = argmax p^(n). r^(1) = 1; r^(n) = r^(n−1) + 1 if argmax p^(n)
    = argmax p^(n−1), else 1 (`tok_old`, `run_old` None at n = 1). `argmax_stability`
    fires when r^(n) ≥ k + 1, i.e. argmax p^(j) is equal for j = n−k … n (docs/spec.md §3b).

    The tokens are the argmax of the logits, which is the argmax of p without the ties
    that rounding in the softmax can create."""
    if tok_old is None:
        return torch.ones_like(tok_new)
    return torch.where(tok_new == tok_old, run_old + 1, 1)


def log_probs(logits: Tensor) -> Tensor:
    """log p from the logits, at least in float32 (a bfloat16 model's head is read in float32)."""
    return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)


def _placeholder(x0: Tensor, *shape: int, dtype: torch.dtype | None = None, value: float = 0.0) -> Tensor:
    """A history entry before the first application: never read (the caller masks the test
    before the rule's earliest n), so one element broadcast to the shape, not an allocation."""
    return x0.new_full((1,) * len(shape), value, dtype=dtype).expand(*shape)


def _in_unit_interval(where: str, tau, expected: str) -> float:
    """τ in (0, 1), or a one-line ValueError naming `where` and what was `expected`."""
    ok = isinstance(tau, int | float) and not isinstance(tau, bool) and math.isfinite(tau)
    if not (ok and 0 < tau < 1):
        raise ValueError(f"{where}: expected {expected}, got {tau!r}")
    return float(tau)


# ------------------------------------------------------------------------ rules
class Fixed(ExitRule):
    """Exit at max_steps, whatever the state: the fixed-depth reference. τ is ignored."""

    name = "fixed"
    takes_tau = False

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        return torch.zeros(s.x_new.shape[0], dtype=torch.bool, device=s.x_new.device)


class StepNorm(ExitRule):
    """‖Δ^(n−1)‖ < τ (paper eq. 3)."""

    name = "stepnorm"
    default_tau = 1e-3
    frontier = (1e-2, 3e-2, 1e-1, 3e-1)
    report = (0.03, 0.1, 0.3)

    def check_flops(self, d: int, vocab: int) -> float:
        return 3.0 * d  # Δ, its squares, their sum

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        return geo.step_norm(geo.step(s.x_prev, s.x_new)) < s.tau


class StepNormRel(ExitRule):
    """‖Δ^(n−1)‖ / (‖x^(n−1)‖ + ε) < τ (paper §4, the scale-free step norm)."""

    name = "stepnorm_rel"
    default_tau = 0.03
    report = (0.01, 0.03, 0.1)

    def check_flops(self, d: int, vocab: int) -> float:
        return 5.0 * d  # Δ, ‖Δ‖ (2d), ‖x^(n−1)‖ (2d)

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        return geo.relative_step_norm(geo.step(s.x_prev, s.x_new), s.x_prev) < s.tau


class KL(ExitRule):
    """KL between consecutive decoded distributions < τ (paper eq. 4). exit.kl_direction:
    new_old = KL(p^(n) ‖ p^(n−1)), the paper's; old_new = KL(p^(n−1) ‖ p^(n)), Huginn's
    `KLExitEvaluator`. History: log p^(n−1)."""

    name = "kl"
    earliest = 2
    decodes = True
    default_tau = 1e-3
    frontier = (1e-4, 1e-3, 1e-2, 3e-2)
    report = (1e-4, 1e-3, 1e-2)

    def check_flops(self, d: int, vocab: int) -> float:
        return 9.0 * vocab  # log_softmax (max, subtract, exp, sum, subtract: 5V), KL (exp, subtract, multiply, sum: 4V)

    def history0(self, x0: Tensor, vocab: int) -> tuple[Tensor, ...]:
        return (_placeholder(x0, x0.shape[0], vocab, dtype=torch.promote_types(x0.dtype, torch.float32)),)

    def advance(self, s: Step) -> tuple[Tensor, ...]:
        return (log_probs(s.logits),)

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        (logp_prev,), (logp,) = s.old, new
        if s.policy.kl_direction == "old_new":  # Huginn's KL(p^(n−1) ‖ p^(n))
            return kl_divergence(logp_prev, logp) < s.tau
        return kl_divergence(logp, logp_prev) < s.tau  # new_old (auto, unresolved, reads as new_old)


class Accel(ExitRule):
    """Two accelerations in a row below τ: a^(n−1) < τ and a^(n−2) < τ, a^(j) = ‖Δ^(j) − Δ^(j−1)‖
    (paper eq. 5, Algorithm 1). History: Δ^(n−1) and a^(n−1)."""

    name = "accel"
    earliest = 3
    default_tau = 1e-3
    frontier = (1e-2, 3e-2, 1e-1, 3e-1)
    report = (0.03, 0.1, 0.3)

    def check_flops(self, d: int, vocab: int) -> float:
        return 4.0 * d  # Δ, Δ − Δ_prev, its norm (2d)

    @staticmethod
    def statistic(d: Tensor, d_prev: Tensor) -> Tensor:
        return geo.acceleration(d, d_prev)

    def history0(self, x0: Tensor, vocab: int) -> tuple[Tensor, ...]:
        return _placeholder(x0, *x0.shape), _placeholder(x0, x0.shape[0], value=math.inf)

    def advance(self, s: Step) -> tuple[Tensor, ...]:
        d = geo.step(s.x_prev, s.x_new)  # Δ^(n−1); a^(n−1) needs Δ^(n−2), from n = 2 on
        return d, self.statistic(d, s.old[0])

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        return (new[1] < s.tau) & (s.old[1] < s.tau)


class AccelRel(Accel):
    """As accel, with the bounded acceleration â^(j) = ‖Δ^(j) − Δ^(j−1)‖ / (‖Δ^(j)‖ + ‖Δ^(j−1)‖ + ε)
    (paper eq. 6)."""

    name = "accel_rel"
    default_tau = 0.03
    frontier = ()
    report = (0.01, 0.03, 0.1)

    def check_flops(self, d: int, vocab: int) -> float:
        return 8.0 * d  # as accel, and the norms of Δ and Δ_prev (2d each)

    @staticmethod
    def statistic(d: Tensor, d_prev: Tensor) -> Tensor:
        return geo.relative_acceleration(d, d_prev)


class EntropyDiff(ExitRule):
    """|H(p^(n)) − H(p^(n−1))| < τ (Huginn's entropy-diff; SPEC §3b). History: H(p^(n−1))."""

    name = "entropy_diff"
    earliest = 2
    decodes = True
    default_tau = 1e-3
    report = (1e-4, 1e-3, 1e-2)

    def check_flops(self, d: int, vocab: int) -> float:
        return 8.0 * vocab  # log_softmax (5V), the entropy (exp, multiply, sum: 3V)

    def history0(self, x0: Tensor, vocab: int) -> tuple[Tensor, ...]:
        return (_placeholder(x0, x0.shape[0], dtype=torch.promote_types(x0.dtype, torch.float32)),)

    def advance(self, s: Step) -> tuple[Tensor, ...]:
        return (entropy(log_probs(s.logits)),)

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        return entropy_change(new[0], s.old[0]) < s.tau


class Cosine(ExitRule):
    """1 − cos(x^(n), x^(n−1)) < τ: consecutive states point the same way (Huginn's; SPEC §3b)."""

    name = "cosine"
    default_tau = 1e-3
    report = (1e-4, 1e-3, 1e-2)

    def check_flops(self, d: int, vocab: int) -> float:
        return 6.0 * d  # the dot product (2d), two norms (2d each)

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        return geo.state_cosine_distance(s.x_new, s.x_prev) < s.tau


class ArgmaxStability(ExitRule):
    """The decoded argmax the same for k + 1 applications in a row, j = n−k … n (k = exit.patience,
    Huginn's default 5; SPEC §3b). τ is ignored. History: the last argmax and its run length;
    the run carries its own earliest n (k + 1)."""

    name = "argmax_stability"
    decodes = True
    takes_tau = False

    def check_flops(self, d: int, vocab: int) -> float:
        return float(vocab)  # the argmax

    def history0(self, x0: Tensor, vocab: int) -> tuple[Tensor, ...]:
        N = x0.shape[0]  # tok = −1 matches no argmax: r^(1) = 1
        return (_placeholder(x0, N, dtype=torch.long, value=-1), _placeholder(x0, N, dtype=torch.long))

    def advance(self, s: Step) -> tuple[Tensor, ...]:
        tok_prev, run_prev = s.old
        tok = s.logits.argmax(-1)
        return tok, argmax_run(tok, tok_prev, run_prev)  # tok_prev = −1 at n = 1: r^(1) = 1

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        return new[1] > s.patience  # r^(n) >= k + 1: equal for j = n−k … n


def left_to_halt(reading: str, old: Tensor, z: Tensor) -> Tensor:
    """r^(n), what a halting head leaves to halt after application n, from r^(n−1) (`old`)
    and the head's logit z^(n) (λ = σ(z)): `sum` r − λ; `cdf` r · (1 − λ); `direct` 1 − λ."""
    if reading == "sum":
        return old - torch.sigmoid(z)
    stay = torch.sigmoid(-z)  # 1 − λ, without the cancellation of 1 − σ(z) as λ → 1
    return old * stay if reading == "cdf" else stay


class Halt(ExitRule):
    """The halting head trained with the loop (`halt.*`, recdepth/training/halting.py; docs/spec.md
    §1d): λ_n = σ(w · f(x^(n)) + b) (`looped.halt_logit`), read as the loss that trained it says
    (`ExitPolicy.halt_reading`, from the checkpoint), through r^(n), what is left to halt:
    `sum` (ACT) r = 1 − Σ_{j≤n} λ_j; `cdf` (PonderNet, Ouro) r = ∏_{j≤n} (1 − λ_j), the mass of
    the halting distribution after n; `direct` (correct) r = 1 − λ_n, the head's probability
    that the answer after n is wrong. Halt when r^(n) < τ: τ in (0, 1), a larger τ exits
    earlier, as every rule (ACT's training threshold 1 − ε is τ = ε; τ = 0.5 under `cdf` is the
    halting distribution's median). History: r^(n) (1 before the first application)."""

    name = "halt"
    reads_head = True
    default_tau = 0.5
    frontier = (0.01, 0.03, 0.1, 0.3, 0.5)
    report = (0.03, 0.1, 0.3)

    def check_flops(self, d: int, vocab: int) -> float:
        return 5.0 * d  # w · f(x): 2d, and the rms norm of a `normed` head 3d (counted for both inputs)

    def history0(self, x0: Tensor, vocab: int) -> tuple[Tensor, ...]:
        return (x0.new_ones(x0.shape[0], dtype=torch.promote_types(x0.dtype, torch.float32)),)

    def advance(self, s: Step) -> tuple[Tensor, ...]:
        w, b = s.gate
        z = halt_logit(s.x_new, w, b, s.policy.halt_input == "normed").to(s.old[0].dtype)
        return (left_to_halt(s.policy.halt_reading, s.old[0], z),)

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        return new[0] < s.tau

    def check_tau(self, where: str, tau) -> float:
        return _in_unit_interval(where, tau, "a number in (0, 1) for rule 'halt' (halt once what is left of the "
                                             "head's halting is below τ)")


class Gate(Halt):
    """The learned exit gate (SPEC §3c, recdepth/exits/gate.py): the `correct` head fitted on a
    frozen checkpoint, read as `Halt` reads a `direct` head, from the gate file of `recdepth
    train-gate` (exit.gate) instead of the checkpoint. The file keeps the gate's sign, q^(n) =
    σ(w_g · x^(n) + b_g), the probability that running on to max_steps still lowers the loss by
    more than its margin, which is r^(n) = 1 − λ^(n) of the head λ = σ(−(w_g · x + b_g)): exit
    once q < τ. τ is a probability in (0, 1); a larger τ exits earlier."""

    name = "gate"
    gated = True
    reads_head = False
    default_tau = 0.5
    frontier = ()
    report = ()

    def check_flops(self, d: int, vocab: int) -> float:
        return 2.0 * d  # w · x (the sigmoid is one operation)

    def advance(self, s: Step) -> tuple[Tensor, ...]:
        w, b = s.gate
        return (left_to_halt("direct", s.old[0], -halt_logit(s.x_new, w, b, False).to(s.old[0].dtype)),)

    def check_tau(self, where: str, tau) -> float:
        return _in_unit_interval(where, tau, "a probability in (0, 1) for rule 'gate' (exit once the gate's q < τ)")
