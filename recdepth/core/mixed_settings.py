"""Several exit settings in one batch (a sweep's settings side by side): `MixedPolicy`
gives each row its own setting (rule, τ per group, min/max steps, patience, gate) and
`MixedMonitor` runs one exit monitor per setting over that setting's rows, so each row
exits as it would alone (recdepth/core/scoring.py: `decode_settings`). The settings
themselves are recdepth/core/exits.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from recdepth.core.exits import ORACLE, ExitPolicy


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
                             "(recdepth.core.scoring.evaluate_oracle), mixed or alone")
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
    costs the head on its own rows, not the batch's (the head was 37% of a frontier sweep's
    shared decode, measured). The coda reads every row's cache, so it decodes the batch."""

    def __init__(self, policy: MixedPolicy, x0: Tensor, decode: Callable[[Tensor], Tensor] | None):
        self.decode = decode
        self._x: Tensor | None = None
        self._logits: Tensor | None = None
        self._sub: Tensor | slice | None = None  # the rows decoded, if not every row
        at = None  # a row's place among the decoded rows
        need = [rows for p, rows in policy.rows if p.needs_decode]
        if need and policy.decode == "head":
            sub = torch.cat(need).sort().values
            if len(sub) < x0.shape[0]:
                self._sub = _block(sub)
                at = torch.full((x0.shape[0],), -1, dtype=torch.long, device=x0.device)
                at[sub] = torch.arange(len(sub), device=x0.device)
        self.parts = [(_block(rows), p.monitor(x0[_block(rows)],
                                               self._rows_decoder(_block(rows if at is None else at[rows]))
                                               if p.needs_decode else None))
                      for p, rows in policy.rows]

    def _rows_decoder(self, idx: Tensor | slice) -> Callable[[Tensor], Tensor]:
        def decode(_x_rows: Tensor) -> Tensor:  # the rows' states, decoded with the other decoding rows
            if self._logits is None:
                self._logits = self.decode(self._x if self._sub is None else self._x[self._sub])
            return self._logits[idx]
        return decode

    def observe(self, x_new: Tensor) -> Tensor:
        self._x, self._logits = x_new, None
        fired = torch.zeros(x_new.shape[0], dtype=torch.bool, device=x_new.device)
        for rows, mon in self.parts:
            fired[rows] = mon.observe(x_new[rows])
        return fired


def _block(rows: Tensor) -> Tensor | slice:
    """A setting's rows as a slice where they are one block (a sweep's batch holds each
    setting's windows side by side): reading them is then a view, not a copy of their
    states and logits (a kl setting's rows × V at every application); else the index."""
    if rows.numel() and int(rows[-1]) - int(rows[0]) + 1 == rows.numel():
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows

