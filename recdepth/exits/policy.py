"""An exit setting, validated: `ExitPolicy` and `build` / `validate` (SPEC §3, §3b, §3c).

A policy is a rule (recdepth/exits/rules/builtin.py, by name) with its numbers: τ, min_steps and
max_steps each one value for every group or a list of one value per recurrence group
(SPEC §3b; `policy.group(g)` is the one-value policy group g loops under), argmax_stability's
patience, the learned gate's weights, and how a decoding rule decodes a state:

- `exit.decode` (`DECODES`): `head` = the final norm and the LM head on the state; `coda` =
  the state as it leaves the group, the layers after the group (Huginn's coda; one
  recurrence group only) and then the head, Huginn's `predict_from_latents`; `auto` = coda
  for a model with one recurrence group and at least one layer after it, head otherwise
  (the engine builds the function: `recdepth.decode.state_decode.state_decoder`).
- `exit.kl_direction` (`KL_DIRECTIONS`): `new_old` = KL(p^(n) ‖ p^(n−1)), the paper's and
  recdepth's default; `old_new` = KL(p^(n−1) ‖ p^(n)), Huginn's `KLExitEvaluator`; `auto` =
  old_new for a model opened from an `hf=` directory (`ExitPolicy.resolve`), new_old otherwise.

Every rule also stops at `max_steps` and never before `min_steps`. After the check that
fires, the newest state x^(n) is kept (deviation from Algorithm 1, which returns x^(n−1)
after paying for n applications; the decision, and so n, is identical).

`oracle` is an evaluation bound, not a rule: the smallest uniform n whose target NLL is
within τ of its NLL at max_steps (SPEC §4b). It reads the answer, so no loop can run it;
`recdepth.decode.scoring.evaluate_oracle` computes it. `validate` accepts it (its ε >= 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from recdepth.core.checks import check_int
from recdepth.exits.monitor import ExitMonitor
from recdepth.exits.rule import ExitRule, canonical, lookup
from recdepth.exits.rules import PATIENCE  # and the built-in rules, registered

ORACLE = "oracle"  # an evaluation bound, not a rule (see the module docstring)
ORACLE_EPSILON = 0.01  # the oracle's default ε (exit=oracle, and the frontier's and report's oracle)
DEFAULT_RULE = "accel"  # every command's exit rule unless told otherwise (the paper's; conf/*.yaml name it too)
PER_GROUP = ("tau", "min_steps", "max_steps")  # fields that take one value per group
DECODES = ("auto", "coda", "head")  # exit.decode: what the decoding rules decode a state with
KL_DIRECTIONS = ("auto", "new_old", "old_new")  # exit.kl_direction: KL(p^(n)‖p^(n−1)) | KL(p^(n−1)‖p^(n))


@dataclass(frozen=True)
class ExitPolicy:
    """A validated exit rule. Build it with `build(...)`.

    `tau`, `min_steps` and `max_steps` are each one value for every group or a tuple of
    one value per recurrence group; `group(g)` is group g's one-value policy, the one a
    loop runs (`monitor`). `gate` (rule `gate` only): (weight [G, d], bias [G]) of every
    group's gate, or (weight [d], bias []) of one group's in `group(g)`'s policy.
    `decode` (`DECODES`) and `kl_direction` (`KL_DIRECTIONS`): see the module docstring;
    `resolve` decides their `auto` for one model. A rule that reads the model's halting head
    (exit=halt) takes it with `with_head`: its weights as `gate` (weight [1, d], bias [1]),
    `halt_input` and `halt_reading` (the model config's halt_head and halt_reading)."""

    name: str
    tau: float | tuple[float, ...] | None
    min_steps: int | tuple[int, ...] = 0
    max_steps: int | tuple[int, ...] = 32
    patience: int = PATIENCE
    gate: tuple[Tensor, Tensor] | None = field(default=None, compare=False, repr=False)
    decode: str = "auto"
    kl_direction: str = "auto"
    halt_input: str = "state"
    halt_reading: str = "cdf"

    @property
    def rule(self) -> ExitRule:
        """The rule this policy runs (recdepth/exits/rules/builtin.py); the oracle has none."""
        return lookup(self.name)

    @property
    def needs_decode(self) -> bool:
        """Whether a check decodes the state (O(d·V)): the rule's `decodes`."""
        return self.name != ORACLE and self.rule.decodes

    def lists(self) -> dict[str, tuple]:
        """The per-group fields the rule reads, {field: one value per group}."""
        read = [f for f in PER_GROUP if not (f == "tau" and self.name != ORACLE and not self.rule.takes_tau)]
        return {f: getattr(self, f) for f in read if isinstance(getattr(self, f), tuple)}

    @property
    def gate_groups(self) -> int | None:
        """The number of groups of an all-group gate (weight [G, d]); None otherwise."""
        return self.gate[0].shape[0] if self.gate is not None and self.gate[0].dim() == 2 else None

    @property
    def n_groups(self) -> int | None:
        """The number of groups the per-group values (or the gate) are for; None if every
        field is one value."""
        lists = self.lists()
        return len(next(iter(lists.values()))) if lists else self.gate_groups

    @property
    def max_steps_bound(self) -> int:
        """The most applications any group may run (what per-application caches are sized by)."""
        return max(self.max_steps) if isinstance(self.max_steps, tuple) else self.max_steps

    def group(self, g: int) -> ExitPolicy:
        """The policy of group g: every per-group field at its g-th value, the gate at group
        g's weight[g], bias[g] (self if nothing is per group)."""
        lists, G = self.lists(), self.gate_groups
        if not lists and G is None:
            return self
        n = self.n_groups
        if not 0 <= g < n:
            if not lists:
                raise ValueError(f"exit.gate: a gate for {G} recurrence groups, but the model has a group {g}")
            f = next(iter(lists))
            raise ValueError(f"exit.{f}: a list of {n} (one value per recurrence group), but the model has a group {g}")
        gate = self.gate if G is None else (self.gate[0][g], self.gate[1][g])
        return replace(self, **{f: lists[f][g] if f in lists else getattr(self, f) for f in PER_GROUP}, gate=gate)

    def resolve(self, coda: bool, hf: bool = False) -> ExitPolicy:
        """This policy with `auto` decided for one model: decode -> `coda` if `coda` (the model
        has one recurrence group and a layer after it: `recdepth.decode.state_decode.has_coda`), else
        `head`; kl_direction -> `old_new` (Huginn's) if `hf` (the model was opened from an
        hf= directory), else `new_old`. Values already chosen stay."""
        decode = self.decode if self.decode != "auto" else "coda" if coda else "head"
        kl = self.kl_direction if self.kl_direction != "auto" else "old_new" if hf else "new_old"
        return replace(self, decode=decode, kl_direction=kl)

    @property
    def needs_head(self) -> bool:
        """Whether `with_head` has work to do: a rule that reads the halting head, not yet given one."""
        return self.name != ORACLE and self.rule.reads_head and self.gate is None

    def with_head(self, model) -> ExitPolicy:
        """This policy as it runs on `model` (a LoopedGPT): a rule that reads the halting head
        (`ExitRule.reads_head`: exit=halt) takes the model's (one line if it has none); any
        other policy, or one that has its head already, is itself."""
        if not self.needs_head:
            return self
        if getattr(model, "halt", None) is None:
            raise ValueError(f"exit.name: rule {self.name!r} reads the checkpoint's halting head, and this model has "
                             "none (train one with halt=<loss>: act, pondernet, entropy or correct)")
        head = (model.halt.weight.detach(), model.halt.bias.detach())
        return replace(self, gate=head, halt_input=model.cfg.halt_head, halt_reading=model.cfg.halt_reading)

    def check_groups(self, n_groups: int) -> ExitPolicy:
        """Self, if its per-group values fit a model with `n_groups` recurrence groups;
        otherwise a one-line ValueError naming the field and the expected length."""
        for f, v in self.lists().items():
            if len(v) != n_groups and n_groups == 0:
                raise ValueError(f"exit.{f}: a list of {len(v)}, but the model has no recurrence groups (expected one "
                                 f"value), got {list(v)}")
            if len(v) != n_groups:
                raise ValueError(f"exit.{f}: a list of {len(v)} for {n_groups} recurrence groups (expected one value "
                                 f"for all groups, or a list of {n_groups}), got {list(v)}")
        if self.decode == "coda" and n_groups != 1:
            raise ValueError(f"exit.decode: coda decodes through the layers after the loop (Huginn's coda), defined "
                             f"for a model with one recurrence group; this one has {n_groups} (use exit.decode=head "
                             "or auto)")
        G = self.gate_groups
        if G is not None and G != n_groups:
            raise ValueError(f"exit.gate: a gate for {G} recurrence groups, but the model has {n_groups} (a gate "
                             "trained on another checkpoint?)")
        return self

    def check_model(self, n_groups: int, n_embd: int) -> ExitPolicy:
        """`check_groups`, and a gate's width d against the model's (one line naming exit.gate)."""
        self.check_groups(n_groups)
        if self.gate is not None and self.gate[0].shape[-1] != n_embd:
            raise ValueError(f"exit.gate: a gate for states of width d={self.gate[0].shape[-1]}, but the model has "
                             f"n_embd={n_embd} (a gate trained on another checkpoint?)")
        return self

    def monitor(self, x0: Tensor, decode: Callable[[Tensor], Tensor] | None = None) -> ExitMonitor:
        if self.name == ORACLE:
            raise ValueError("exit.name: 'oracle' reads the target token, so no loop can run it; "
                             "only the evaluation engine computes it (recdepth.decode.scoring.evaluate_oracle)")
        if self.lists():
            f = next(iter(self.lists()))
            raise ValueError(f"exit.{f}: one value per group; a loop runs one group, under policy.group(g)")
        gated = self.rule.gated or self.rule.reads_head
        if self.rule.reads_head and self.gate is None:
            raise ValueError(f"exit.name: rule {self.name!r} reads the model's halting head: attach it with "
                             "ExitPolicy.with_head(model)")
        if gated and self.gate is None:
            raise ValueError("exit.gate: rule 'gate' needs a trained gate (train one with python -m "
                             "recdepth.train_gate ckpt=<path>)")
        if gated and self.gate[0].dim() != 1:
            raise ValueError("exit.gate: one gate per group; a loop runs one group, under policy.group(g)")
        if self.needs_decode and decode is None:
            raise ValueError(f"exit.name: rule {self.name!r} needs a decode function (state -> logits)")
        return ExitMonitor(self, x0, decode)


def _check_tau(field: str, tau, key: str) -> float:
    """τ of rule `key` (its own check, `ExitRule.check_tau`), or the oracle's ε (>= 0)."""
    if key != ORACLE:
        return lookup(key).check_tau(f"exit.{field}", tau)
    if not (isinstance(tau, int | float) and not isinstance(tau, bool) and math.isfinite(tau) and tau >= 0):
        raise ValueError(f"exit.{field}: expected a finite number >= 0 for the oracle's ε, got {tau!r}")
    return float(tau)


def _is_list(v) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, str | bytes)


def _per_group(field: str, value, check, key: str):
    """One value, checked by `check(field, v)`, or a non-empty list of them (a tuple)."""
    if not _is_list(value):
        return check(field, value)
    if key == ORACLE:
        raise ValueError(f"exit.{field}: the oracle takes one value for all groups (its depth n is uniform over "
                         f"groups), got {list(value)!r}")
    if len(value) == 0:
        raise ValueError(f"exit.{field}: expected one value, or a list of one per recurrence group; got []")
    return tuple(check(f"{field}[{i}]", v) for i, v in enumerate(value))


def build(name: str, tau: float | Sequence[float] | None, min_steps: int | Sequence[int] = 0,
          max_steps: int | Sequence[int] = 32, patience: int = PATIENCE, groups: int | None = None,
          gate: tuple[Tensor, Tensor] | None = None, decode: str = "auto",
          kl_direction: str = "auto") -> ExitPolicy:
    """Validate and build an exit policy (SPEC §3, §3b, §3c). `tau` is ignored by
    `fixed`/`none` and `argmax_stability`, `patience` (k >= 1) read by `argmax_stability`
    only. `tau`, `min_steps` and `max_steps` are each one value or a list of one per
    recurrence group (all lists of one length); with `groups` (the model's number of
    groups) that length is checked too. Rule `gate` needs `gate` = (weight [G, d], bias
    [G]) (`recdepth.exits.gate.load_gate`), τ in (0, 1); the other rules ignore it. `decode`
    (`DECODES`) and `kl_direction` (`KL_DIRECTIONS`) are checked for every rule (coda needs
    one recurrence group, checked with `groups`). Every failure is one line naming the field."""
    policy = validate(name, tau, min_steps, max_steps, patience, decode=decode, kl_direction=kl_direction)
    if policy.name != ORACLE and policy.rule.gated:
        if gate is None:
            raise ValueError("exit.gate: rule 'gate' needs a trained gate file (train one with python -m "
                             "recdepth.train_gate ckpt=<path>)")
        w, b = gate
        if not (isinstance(w, Tensor) and isinstance(b, Tensor) and w.dim() == 2 and b.shape == (w.shape[0],)
                and w.shape[0] >= 1 and w.is_floating_point() and b.is_floating_point()):
            raise ValueError("exit.gate: expected weight [G, d] and bias [G] float tensors, got shapes "
                             f"{tuple(getattr(w, 'shape', ()))} and {tuple(getattr(b, 'shape', ()))}")
        if not (torch.isfinite(w).all() and torch.isfinite(b).all()):
            raise ValueError("exit.gate: the gate's weight or bias is not finite")
        lists = policy.lists()
        if lists:
            f, v = next(iter(lists.items()))
            if len(v) != w.shape[0]:
                raise ValueError(f"exit.{f}: a list of {len(v)}, but exit.gate is a gate for {w.shape[0]} recurrence "
                                 "groups")
        policy = replace(policy, gate=(w, b))
    return policy if groups is None else policy.check_groups(groups)


def validate(name: str, tau: float | Sequence[float] | None, min_steps: int | Sequence[int] = 0,
             max_steps: int | Sequence[int] = 32, patience: int = PATIENCE, groups: int | None = None,
             decode: str = "auto", kl_direction: str = "auto") -> ExitPolicy:
    """Every check of `build` but the gate's tensors, which a config names by file
    (recdepth/config/schema.py checks a config with it before any file is read): the policy
    without a gate."""
    key = canonical(name)
    if key != ORACLE:
        lookup(key)  # an unknown name: one line listing the rules
    min_steps = _per_group("min_steps", min_steps, lambda f, v: check_int(f"exit.{f}", v, 0), key)
    max_steps = _per_group("max_steps", max_steps, lambda f, v: check_int(f"exit.{f}", v, 1), key)
    patience = check_int("exit.patience", patience, 1)
    if decode not in DECODES:
        raise ValueError(f"exit.decode: expected one of auto, coda (through the layers after the loop, Huginn's), "
                         f"head (final norm + LM head), got {decode!r}")
    if kl_direction not in KL_DIRECTIONS:
        raise ValueError(f"exit.kl_direction: expected one of auto, new_old (KL(p_n ‖ p_n-1), the paper's), old_new "
                         f"(KL(p_n-1 ‖ p_n), Huginn's), got {kl_direction!r}")
    if key != ORACLE and not lookup(key).takes_tau:  # ignored: kept as given, for the records
        tau = tuple(tau) if _is_list(tau) else tau
    else:
        tau = _per_group("tau", tau, lambda f, v: _check_tau(f, v, key), key)
    policy = ExitPolicy(key, tau, min_steps, max_steps, patience, decode=decode, kl_direction=kl_direction)
    lists = policy.lists()
    if lists:
        (f0, v0), *rest = lists.items()
        for f, v in rest:
            if len(v) != len(v0):
                raise ValueError(f"exit.{f}: a list of {len(v)}, but exit.{f0} is a list of {len(v0)} (one value per "
                                 "recurrence group, or one value for all)")
    per = isinstance(min_steps, tuple) or isinstance(max_steps, tuple)
    for g in range(policy.n_groups or 1) if per else [None]:
        p = policy if g is None else policy.group(g)
        if p.max_steps < p.min_steps:
            at = "" if g is None else f" (group {g})"
            raise ValueError(f"exit.max_steps: {p.max_steps}{at} is smaller than exit.min_steps={p.min_steps}{at}")
    return policy if groups is None else policy.check_groups(groups)


