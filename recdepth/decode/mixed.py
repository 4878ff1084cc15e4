"""Several exit settings in one batch (a sweep's settings side by side): `MixedPolicy`
gives each row its own setting (rule, τ per group, min/max steps, patience, gate) and
`MixedMonitor` runs one exit monitor per setting over that setting's rows, so each row
exits as it would alone (recdepth/decode/scoring.py: `decode_settings`). The settings
themselves are recdepth/exits/.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from recdepth.exits.policy import ORACLE, ExitPolicy


@dataclass(frozen=True)
class MixedPolicy:
    """Several exit settings decoded side by side in one batch (a sweep's settings × its
    windows): row b loops under `policies[setting[b]]`, and its result is the one it gets
    with that policy alone (each setting's rows keep their own monitor, history and
    min/max steps). Duck-types the parts of `ExitPolicy` a loop reads (`group`, `monitor`,
    `needs_decode`, `max_steps_bound`, `resolve`, `decode`, `check_model`); a per-token
    summary is per setting, so `name` and the like are the settings' own."""

    policies: tuple[ExitPolicy, ...]
    setting: Tensor  # [B] long: the index into `policies` of each row
    # group(g)'s policies, built once per batch: a loop asks for them at every position
    _groups: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not self.policies:
            raise ValueError("MixedPolicy: no exit settings")
        if any(p.name == ORACLE for p in self.policies):
            raise ValueError("exit.name: 'oracle' reads the target token, so no loop can run it "
                             "(recdepth.decode.scoring.evaluate_oracle), mixed or alone")
        k = self.setting
        if k.dim() != 1 or (k.numel() and (int(k.min()) < 0 or int(k.max()) >= len(self.policies))):
            raise ValueError(f"MixedPolicy: setting must be [B] indices into {len(self.policies)} policies")

    @property
    def needs_decode(self) -> bool:
        return any(p.needs_decode for p in self.policies)

    @property
    def max_steps_bound(self) -> int:
        return max(p.max_steps_bound for p in self.policies)

    @property
    def decode(self) -> str:
        """The settings' common `exit.decode` (one decode function serves the batch)."""
        modes = {p.decode for p in self.policies if p.needs_decode} or {self.policies[0].decode}
        if len(modes) > 1:
            raise ValueError(f"exit.decode: settings decoded side by side must decode alike, got {sorted(modes)}")
        return modes.pop()

    @functools.cached_property
    def rows(self) -> list[tuple[ExitPolicy, Tensor]]:
        """(policy, its rows) of every setting with rows in this batch."""
        return [(p, r) for k, p in enumerate(self.policies) if (r := (self.setting == k).nonzero()[:, 0]).numel()]

    def group(self, g: int) -> MixedPolicy:
        if g not in self._groups:
            self._groups[g] = MixedPolicy(tuple(p.group(g) for p in self.policies), self.setting)
        return self._groups[g]

    def resolve(self, coda: bool, hf: bool = False) -> MixedPolicy:
        return MixedPolicy(tuple(p.resolve(coda, hf) for p in self.policies), self.setting)

    @functools.cached_property
    def _wants_head(self) -> bool:
        return any(p.needs_head for p in self.policies)

    def with_head(self, model) -> MixedPolicy:
        """Every setting with the model's halting head where its rule reads it (`ExitPolicy.with_head`);
        itself, without a pass over the settings, where none needs one (the loop asks per token)."""
        if not self._wants_head:
            return self
        new = tuple(p.with_head(model) for p in self.policies)
        return self if all(a is b for a, b in zip(new, self.policies, strict=True)) else MixedPolicy(new, self.setting)

    def check_model(self, n_groups: int, n_embd: int) -> MixedPolicy:
        for p in self.policies:
            p.check_model(n_groups, n_embd)
        return self

    def monitor(self, x0: Tensor, decode: Callable[[Tensor], Tensor] | None = None) -> MixedMonitor:
        return MixedMonitor(self, x0, decode)


class MixedMonitor:
    """`ExitMonitor` of a `MixedPolicy`: one monitor per setting over that setting's rows.
    A decoding rule's logits are computed once per application and each setting reads its
    rows. Under exit.decode=head (the head decodes each row on its own) only the rows of
    the settings that decode are decoded: a kl setting beside fixed and stepnorm ones
    costs the head on its own rows, not the batch's (the head was the largest part of a
    frontier sweep's shared decode, measured). The coda reads every row's cache, so it decodes the batch.

    `observe(x_new, active)`: a setting none of whose rows is still looping is not observed
    again (its rows' history is never read again), and under exit.decode=head its rows
    leave the decoded set, so a kl setting whose rows have all exited no longer pays the
    head while a slower setting of its batch loops on."""

    def __init__(self, policy: MixedPolicy, x0: Tensor, decode: Callable[[Tensor], Tensor] | None):
        self.decode = decode
        self._x: Tensor | None = None
        self._logits: Tensor | None = None
        self._sub: Tensor | slice | None = None  # the rows decoded, if not every row
        self._head = policy.decode == "head"  # decode the decoding settings' rows only
        self._rows = [rows for _, rows in policy.rows]
        self._live = [True] * len(self._rows)  # settings with a row still looping
        self._members = [rows.tolist() for rows in self._rows]  # for the liveness check, in Python
        self.parts = [(_block(rows), p.monitor(x0[_block(rows)], self._rows_decoder(k) if p.needs_decode else None))
                      for k, (p, rows) in enumerate(policy.rows)]
        self._decoding = [k for k, (p, _) in enumerate(policy.rows) if p.needs_decode]
        self._at: list[Tensor | slice | None] = [None] * len(self._rows)  # a setting's place among the decoded rows
        self._place(x0.shape[0], x0.device)

    def _place(self, B: int, device: torch.device) -> None:
        """The decoded rows (`_sub`) and each decoding setting's place among them (`_at`),
        for the live decoding settings."""
        need = [k for k in self._decoding if self._live[k]]
        if not self._head or not need:
            self._sub = None
            for k in need:
                self._at[k] = _block(self._rows[k])
            return
        sub = torch.cat([self._rows[k] for k in need]).sort().values
        at = None  # a row's place among the decoded rows
        if len(sub) < B:
            at = torch.full((B,), -1, dtype=torch.long, device=device)
            at[sub] = torch.arange(len(sub), device=device)
        self._sub = _block(sub) if len(sub) < B else None
        for k in need:
            self._at[k] = _block(self._rows[k] if at is None else at[self._rows[k]])

    def _rows_decoder(self, k: int) -> Callable[[Tensor], Tensor]:
        def decode(_x_rows: Tensor) -> Tensor:  # the rows' states, decoded with the other decoding rows
            if self._logits is None:
                self._logits = self.decode(self._x if self._sub is None else self._x[self._sub])
            return self._logits[self._at[k]]
        return decode

    def observe(self, x_new: Tensor, active: Tensor | None = None) -> Tensor:
        """Fired rows [B] after this application; `active` [B] (bool), if given: the rows
        still looping (the others' results are not read)."""
        self._x, self._logits = x_new, None
        if active is not None:
            flags = active.tolist()
            live = [any(flags[r] for r in rows) for rows in self._members]
            if live != self._live:
                dropped = any(self._live[k] and not live[k] for k in self._decoding)
                self._live = live
                if dropped:
                    self._place(x_new.shape[0], x_new.device)
        fired = torch.zeros(x_new.shape[0], dtype=torch.bool, device=x_new.device)
        for (rows, mon), live in zip(self.parts, self._live, strict=True):
            if live:
                fired[rows] = mon.observe(x_new[rows])
        return fired


def _block(rows: Tensor) -> Tensor | slice:
    """A setting's rows as a slice where they are one block (a sweep's batch holds each
    setting's windows side by side): reading them is then a view, not a copy of their
    states and logits (a kl setting's rows × V at every application); else the index."""
    if rows.numel() and int(rows[-1]) - int(rows[0]) + 1 == rows.numel():
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows

