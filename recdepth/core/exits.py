"""Early-exit rules for a looped group (SPEC §3 and §3b; paper §4, eqs. 3-6, Algorithm 1).

A rule decides, per token (row), when to stop applying a group. With x^(0) the loop's
initial state, x^(n) the state after n applications, Δ^(j) = x^(j+1) − x^(j) and
p^(j) = softmax(decode(x^(j))) (the model's own output head on the state):

    rule              exits after application n when                   earliest n  cost per check
    fixed/none        n = max_steps                                        —        none
    stepnorm          ‖Δ^(n−1)‖ < τ                                         1        O(d)
    stepnorm_rel      ‖Δ^(n−1)‖ / (‖x^(n−1)‖ + ε) < τ                        1        O(d)
    kl                KL(p^(n) ‖ p^(n−1)) < τ  (exit.kl_direction, below)     2        O(d·V) decodes
    accel             a^(n−1) < τ and a^(n−2) < τ,  a^(j) = ‖Δ^(j) − Δ^(j−1)‖ 3        O(d)
    accel_rel         as accel with â^(j) (eq. 6)                            3        O(d)
    entropy_diff      |H(p^(n)) − H(p^(n−1))| < τ                            2        O(d·V) decodes
    cosine            1 − cos(x^(n), x^(n−1)) < τ                            1        O(d)
    argmax_stability  argmax p^(j) equal for j = n−k … n (k = patience)      k + 1    O(d·V) decodes
    gate              q^(n) = σ(w_g · x^(n) + b_g) < τ,  τ in (0, 1)          1        O(d)

    oracle            (evaluation only) the smallest uniform n whose target NLL is within
                      τ of its NLL at max_steps (SPEC §4b): it reads the answer, so no model
                      can run it; `recdepth.core.scoring.evaluate_oracle` computes it as the
                      bound of what any rule could save at that quality

The decoding rules (`DECODING`: kl, entropy_diff, argmax_stability) run the LM head on the
state at every check: d·V multiply-adds (at d = 768, V = 50257 about five layer
applications' worth of FLOPs, 12·d² each); the others read the state only, O(d). What
"decode" is (`exit.decode`, `DECODES`): `head` = the final norm and the LM head on the
state; `coda` = the state as it leaves the group, the layers after the group (Huginn's
coda; one recurrence group only) and then the head, Huginn's `predict_from_latents`;
`auto` = coda for a model with one recurrence group and at least one layer after it, head
otherwise (the engine builds the function: `recdepth.core.state_decode.state_decoder`). The kl
rule's direction (`exit.kl_direction`, `KL_DIRECTIONS`): `new_old` = KL(p^(n) ‖ p^(n−1)),
the paper's and recdepth's default; `old_new` = KL(p^(n−1) ‖ p^(n)), Huginn's
`KLExitEvaluator` (F.kl_div(log p^(n), log p^(n−1), log_target=True)); `auto` = old_new
for a model opened from an `hf=` directory (`ExitPolicy.resolve`), new_old otherwise.
Each equation is one function:
`geometry.step_norm`, `geometry.relative_step_norm`, `geometry.acceleration`,
`geometry.relative_acceleration`, `geometry.state_cosine_distance` (state math) and
`kl_divergence`, `entropy`, `entropy_change`, `argmax_run` (distribution math, below).
`fixed`, `none` and `argmax_stability` ignore τ; only `argmax_stability` reads `patience`.

`gate` is the learned exit gate (SPEC §3c, `recdepth.core.gate`): a logistic Linear(d -> 1)
per group, fitted on a frozen checkpoint by `python -m recdepth.train_gate`; q^(n) is its
predicted probability that running on to max_steps still lowers the loss by more than
its margin, so it exits once that is unlikely (a larger τ exits earlier, like the other
rules). The policy holds every group's gate, weight [G, d] and bias [G]; `group(g)` picks
group g's.

Every rule also stops at `max_steps` and never before `min_steps`. After the check that
fires, the newest state x^(n) is kept (deviation from Algorithm 1, which returns x^(n−1)
after paying for n applications; the decision, and so n, is identical).

Per group: `tau`, `min_steps` and `max_steps` each take one value for every group or a
list of one value per recurrence group (SPEC §3b); `policy.group(g)` is the one-value
policy that group g loops under.

Public API (used by the decoding engine, the tests and outside checks):
    policy = build(name, tau, min_steps=0, max_steps=32, patience=5, groups=None, gate=None,
                   decode="auto", kl_direction="auto")
    x, n = iterate(f, x0, policy.group(g), decode=None)
and, for engines that drive their own loop, `policy.group(g).monitor(x0, decode)` whose
`observe(x_new)` returns the rows whose rule fires after that application.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from recdepth.core import geometry as geo
from recdepth.core.gate import gate_probability

RULES = ("fixed", "stepnorm", "stepnorm_rel", "kl", "accel", "accel_rel", "entropy_diff", "cosine",
         "argmax_stability", "gate")
ORACLE = "oracle"  # an evaluation bound, not a rule (see the module docstring)
ALIASES = {"none": "fixed"}
DECODING = ("kl", "entropy_diff", "argmax_stability")  # decode every check: O(d·V)
NO_TAU = ("fixed", "argmax_stability")  # rules that ignore exit.tau
COST = {r: "none" if r == "fixed" else "O(d·V)" if r in DECODING else "O(d)" for r in RULES}
PER_GROUP = ("tau", "min_steps", "max_steps")  # fields that take one value per group
PATIENCE = 5  # argmax_stability's default k (Huginn: 5 steps)
GATE = "gate"  # the learned gate: τ is a probability, and it needs its weights (`build(gate=...)`)
DECODES = ("auto", "coda", "head")  # exit.decode: what the decoding rules decode a state with
KL_DIRECTIONS = ("auto", "new_old", "old_new")  # exit.kl_direction: KL(p^(n)‖p^(n−1)) | KL(p^(n−1)‖p^(n))


def kl_divergence(logp_new: Tensor, logp_old: Tensor) -> Tensor:
    """KL(p^(n) ‖ p^(n−1)) = Σ p^(n) (log p^(n) − log p^(n−1)) over the last axis
    (paper eq. 4; `exit.kl_direction=new_old`). Huginn's code computes the other direction,
    KL(p^(n−1) ‖ p^(n)) = kl_divergence(logp_old, logp_new) (`old_new`).

    Entries with p^(n) = 0 (e.g. the -inf logits of a padded vocabulary) contribute 0,
    the 0·log 0 = 0 convention, instead of 0·(−inf + inf) = NaN: `nansum` skips them, the
    same sum as zeroing them with `where` bit for bit (one pass over V instead of three,
    2× faster at 64 rows on the CPU) but for a NaN in log p^(n−1) itself, skipped too."""
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


@dataclass(frozen=True)
class ExitPolicy:
    """A validated exit rule. Build it with `build(...)`.

    `tau`, `min_steps` and `max_steps` are each one value for every group or a tuple of
    one value per recurrence group; `group(g)` is group g's one-value policy, the one a
    loop runs (`monitor`). `gate` (rule `gate` only): (weight [G, d], bias [G]) of every
    group's gate, or (weight [d], bias []) of one group's in `group(g)`'s policy.
    `decode` (`DECODES`) and `kl_direction` (`KL_DIRECTIONS`): see the module docstring;
    `resolve` decides their `auto` for one model."""

    name: str
    tau: float | tuple[float, ...] | None
    min_steps: int | tuple[int, ...] = 0
    max_steps: int | tuple[int, ...] = 32
    patience: int = PATIENCE
    gate: tuple[Tensor, Tensor] | None = field(default=None, compare=False, repr=False)
    decode: str = "auto"
    kl_direction: str = "auto"

    @property
    def needs_decode(self) -> bool:
        """Whether a check decodes the state (O(d·V)); see `DECODING`."""
        return self.name in DECODING

    def lists(self) -> dict[str, tuple]:
        """The per-group fields the rule reads, {field: one value per group}."""
        read = [f for f in PER_GROUP if not (f == "tau" and self.name in NO_TAU)]
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
        has one recurrence group and a layer after it: `recdepth.core.state_decode.has_coda`), else
        `head`; kl_direction -> `old_new` (Huginn's) if `hf` (the model was opened from an
        hf= directory), else `new_old`. Values already chosen stay."""
        decode = self.decode if self.decode != "auto" else "coda" if coda else "head"
        kl = self.kl_direction if self.kl_direction != "auto" else "old_new" if hf else "new_old"
        return replace(self, decode=decode, kl_direction=kl)

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
                             "only the evaluation engine computes it (recdepth.core.scoring.evaluate_oracle)")
        if self.lists():
            f = next(iter(self.lists()))
            raise ValueError(f"exit.{f}: one value per group; a loop runs one group, under policy.group(g)")
        if self.name == GATE and self.gate is None:
            raise ValueError("exit.gate: rule 'gate' needs a trained gate (train one with python -m "
                             "recdepth.train_gate ckpt=<path>)")
        if self.name == GATE and self.gate[0].dim() != 1:
            raise ValueError("exit.gate: one gate per group; a loop runs one group, under policy.group(g)")
        if self.needs_decode and decode is None:
            raise ValueError(f"exit.name: rule {self.name!r} needs a decode function (state -> logits)")
        return ExitMonitor(self, x0, decode)


class ExitMonitor:
    """Incremental state of one loop under a one-group rule: O(d) history per row (O(V)
    for kl, which keeps log p^(n−1); entropy_diff keeps H(p^(n−1)) and argmax_stability
    the last argmax and its run length, on top of the previous state).

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
        # a^(n−2) (accel), log p^(n−1) (kl), H(p^(n−1)) (entropy_diff), argmax p^(n−1) (argmax_stability)
        self.s_prev: Tensor | None = None
        self.run: Tensor | None = None  # argmax_stability: r^(n−1), the argmax's run length
        if policy.name == GATE:  # the gate's weights where the state is
            self.gate_w, self.gate_b = (t.to(device=x0.device, dtype=x0.dtype) for t in policy.gate)

    def observe(self, x_new: Tensor, active: Tensor | None = None) -> Tensor:
        """`active` (the rows still looping) is for `MixedMonitor`, which skips settings
        whose rows have all exited; one setting computes every row's statistic in one call."""
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
        sees a^(n−2), p^(n−1) or the argmax's whole run."""
        p = self.p
        if p.name in DECODING:
            logits = self.decode(x_new)
            if p.name == "argmax_stability":
                tok = logits.argmax(-1)
                self.run = argmax_run(tok, self.s_prev, self.run)
                self.s_prev = tok
                return self.run > p.patience  # r^(n) >= k + 1: equal for j = n−k … n
            logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
            if p.name == "kl":
                logp_prev, self.s_prev = self.s_prev, logp
                if logp_prev is None:
                    return None
                if p.kl_direction == "old_new":  # Huginn's KL(p^(n−1) ‖ p^(n))
                    return kl_divergence(logp_prev, logp) < p.tau
                return kl_divergence(logp, logp_prev) < p.tau  # new_old (auto, unresolved, reads as new_old)
            h = entropy(logp)  # entropy_diff
            h_prev, self.s_prev = self.s_prev, h
            return None if h_prev is None else entropy_change(h, h_prev) < p.tau
        if p.name == GATE:
            return gate_probability(x_new, self.gate_w, self.gate_b) < p.tau
        if p.name == "cosine":
            return geo.state_cosine_distance(x_new, self.x_prev) < p.tau
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


def _check_tau(field: str, tau, key: str) -> float:
    ok = isinstance(tau, int | float) and not isinstance(tau, bool) and math.isfinite(tau)
    oracle = key == ORACLE  # the oracle's ε may be 0 (as good as max_steps)
    if key == GATE and not (ok and 0 < tau < 1):
        raise ValueError(f"exit.{field}: expected a probability in (0, 1) for rule 'gate' (exit once the gate's "
                         f"q < τ), got {tau!r}")
    if not (ok and (tau >= 0 if oracle else tau > 0)):
        what = ">= 0 for the oracle's ε" if oracle else f"> 0 for rule {key!r}"
        raise ValueError(f"exit.{field}: expected a finite number {what}, got {tau!r}")
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
    [G]) (`recdepth.core.gate.load_gate`), τ in (0, 1); the other rules ignore it. `decode`
    (`DECODES`) and `kl_direction` (`KL_DIRECTIONS`) are checked for every rule (coda needs
    one recurrence group, checked with `groups`). Every failure is one line naming the field."""
    policy = validate(name, tau, min_steps, max_steps, patience, decode=decode, kl_direction=kl_direction)
    if policy.name == GATE:
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
    (recdepth/glue/schema.py checks a config with it before any file is read): the policy
    without a gate."""
    key = ALIASES.get(name, name)
    if key not in RULES and key != ORACLE:
        raise ValueError(f"exit.name: unknown exit rule {name!r} (expected one of: none, {', '.join(RULES)}, "
                         f"{ORACLE})")
    min_steps = _per_group("min_steps", min_steps, lambda f, v: _check_int(f, v, 0), key)
    max_steps = _per_group("max_steps", max_steps, lambda f, v: _check_int(f, v, 1), key)
    patience = _check_int("patience", patience, 1)
    if decode not in DECODES:
        raise ValueError(f"exit.decode: expected one of auto, coda (through the layers after the loop, Huginn's), "
                         f"head (final norm + LM head), got {decode!r}")
    if kl_direction not in KL_DIRECTIONS:
        raise ValueError(f"exit.kl_direction: expected one of auto, new_old (KL(p_n ‖ p_n-1), the paper's), old_new "
                         f"(KL(p_n-1 ‖ p_n), Huginn's), got {kl_direction!r}")
    if key in NO_TAU:  # ignored: kept as given, for the records
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
