"""What an exit rule is: `ExitRule`, the one class a rule is, and the registry of rules.

A rule decides, per row, whether a group's loop may stop after application n. It is one
subclass of `ExitRule` (the built-in ones: recdepth/exits/rules/builtin.py): its metadata as class
attributes, and its check as two functions of tensors, `advance` (the history a rule
carries from one application to the next) and `fires` (the test after application n).
Both the eager monitor (`recdepth.exits.monitor.ExitMonitor`, the decoding engine's) and
the loop compiled whole (`recdepth.exits.monitor.observe_step`, the compiled batch-1 step)
call these two functions, so a rule is written once. Defining the subclass registers it:
from then on `exit=<name>` selects it, `build(name, ...)` builds it, and its τ grids join
the frontier's and the report's defaults (`grid`).

The functions see no Python branch on a value: `n`, τ and patience may be tensors (the
compiled loop carries them), and a test the monitor should not read yet (before
`earliest`, below min_steps, at max_steps) is masked by the caller, not skipped inside
the rule. A history entry before the first application is a placeholder (`history0`)
that `fires` is never read on, because of that mask.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from torch import Tensor

from recdepth.core.checks import is_number
from recdepth.core.registry import Registry

_REGISTRY: Registry[ExitRule] = Registry("exit.name", "exit rule")  # name -> the rule (one instance: stateless)


class Step(NamedTuple):
    """What a rule sees after application n of its loop (rows N, width d)."""

    x_prev: Tensor
    """x^(n−1) [N, d] (x^(0), the loop's initial state, at n = 1)."""
    x_new: Tensor
    """x^(n) [N, d]."""
    old: tuple[Tensor, ...]
    """The history after application n − 1 (`history0`'s placeholders at n = 1)."""
    logits: Tensor | None
    """decode(x^(n)) [N, V] for a rule that `decodes`; None otherwise."""
    tau: Any
    """τ: a float (eager) or a 0-d tensor (the compiled loop); NaN for a rule without τ."""
    patience: Any
    """exit.patience (k), an int or a 0-d tensor."""
    gate: tuple[Tensor, Tensor] | None
    """(weight [d], bias []) of the group's learned gate, for a rule that is `gated`, or of
    the model's halting head, for a rule that `reads_head`."""
    policy: Any
    """The one-group `ExitPolicy` (recdepth/exits/policy.py): the rule's static options (e.g.
    kl_direction)."""


class ExitRule:
    """One exit rule. Subclass it, set `name` and the metadata below, write `advance` (if the
    rule carries a history) and `fires`; the subclass registers itself under `name`.

    A rule's options besides τ, min/max steps and patience (kl's direction, the gate's
    weights) come from the policy (`Step.policy`, `Step.gate`)."""

    name: ClassVar[str]
    """exit.name that selects the rule (exit=<name>)."""
    earliest: ClassVar[int] = 1
    """The first application n after which `fires` is defined (accel: 3, it needs a^(n−2));
    the callers mask it before."""
    decodes: ClassVar[bool] = False
    """Whether a check reads the decoded logits (`Step.logits`): O(d·V) per check, against
    O(d) for a rule that reads the state only."""
    takes_tau: ClassVar[bool] = True
    """Whether the rule reads exit.tau (fixed and argmax_stability do not)."""
    gated: ClassVar[bool] = False
    """Whether the rule reads a trained gate's weights (exit.gate: rule `gate`)."""
    reads_head: ClassVar[bool] = False
    """Whether the rule reads the model's halting head, trained with the loop (rule `halt`):
    `Step.gate` carries its weights, `Step.policy` its input and reading (`ExitPolicy.with_head`)."""
    default_tau: ClassVar[float | None] = None
    """τ of `exit=<name>` when none is given."""
    frontier: ClassVar[tuple[float, ...]] = ()
    """The τ grid `make frontier` sweeps by default (empty: not in its default grid)."""
    report: ClassVar[tuple[float, ...]] = ()
    """The τ grid `recdepth report` sweeps by default (empty: not in its τ grid)."""
    calibrated: ClassVar[bool] = True
    """Whether `recdepth report` calibrates the rule per group by default."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name in RESERVED:
            raise TypeError(f"{cls.__qualname__}: {name!r} is reserved ({RESERVED[name]})")
        _REGISTRY.register(name, cls(), cls)

    # ------------------------------------------------------------------ the check
    def history0(self, x0: Tensor, vocab: int) -> tuple[Tensor, ...]:
        """The history before the first application, for states x0 [N, d] and `vocab` logits:
        placeholders of the shapes `advance` returns (the loop compiled whole carries them).
        Never read by `fires` (masked before `earliest`). Default: no history."""
        return ()

    def advance(self, s: Step) -> tuple[Tensor, ...]:
        """The history after application n, from `s.old` and the new state (or logits)."""
        return ()

    def fires(self, s: Step, new: tuple[Tensor, ...]) -> Tensor:
        """The rule's test after application n: bool [N], True where the loop may stop.
        `new` is `advance(s)`. Read only from n = `earliest` on, from min_steps on and before
        max_steps (the caller's mask)."""
        raise NotImplementedError

    def check_flops(self, d: int, vocab: int) -> float:
        """The price of one check of one row in FLOPs: the rule's own statistic, each
        element-wise operation over the state (d entries) or the logits (`vocab` entries)
        counted as one FLOP (a sum or a norm: one per entry per pass). The decode a rule
        that `decodes` reads its logits from (the head, or the coda and the head) is priced
        by the engine that runs it (recdepth/decode/state_decode.py, `decode_flops`), not
        here. The cost of a policy in layer equivalents adds both (docs/spec.md §4b).
        Default: nothing (a rule without a check, fixed)."""
        return 0.0

    # ------------------------------------------------------------- validation
    def check_tau(self, where: str, tau) -> float:
        """τ for this rule (one value; `where` names the field in the one-line error):
        default, a finite number > 0."""
        if not (is_number(tau) and tau > 0):
            raise ValueError(f"{where}: expected a finite number > 0 for rule {self.name!r}, got {tau!r}")
        return float(tau)


# Names no rule may take: the evaluation's oracle bound (recdepth.exits.policy) and the aliases.
ALIASES = {"none": "fixed"}
RESERVED = {"oracle": "the oracle bound, evaluation only", **{a: f"an alias of {n}" for a, n in ALIASES.items()}}


def names() -> tuple[str, ...]:
    """Every registered rule's name, in the order the rules were defined."""
    return _REGISTRY.names()


def canonical(name: str) -> str:
    """A rule's registered name (`none` is fixed's alias); the name itself otherwise."""
    return ALIASES.get(name, name)


def is_rule(name: str) -> bool:
    """Whether `name` (or its alias) is a registered rule (the oracle is not)."""
    return canonical(name) in _REGISTRY


def lookup(name: str) -> ExitRule:
    """The rule registered under `name` (or its alias); a one-line ValueError naming
    exit.name otherwise."""
    if canonical(name) not in _REGISTRY:
        raise ValueError(f"exit.name: unknown exit rule {name!r} (expected one of: none, {', '.join(_REGISTRY)}, "
                         "oracle)")
    return _REGISTRY[canonical(name)]


def grid(which: str) -> dict[str, list[float]]:
    """The default τ grid of every rule that has one: which = "frontier" (`make frontier`)
    or "report" (`recdepth report`), {rule: [τ, ...]} in the rules' order."""
    if which not in ("frontier", "report"):
        raise ValueError(f"grid: expected 'frontier' or 'report', got {which!r}")
    return {n: list(getattr(c, which)) for n, c in _REGISTRY.items() if getattr(c, which)}
