"""The settings of one exit frontier (docs/spec.md §4b), written once for both commands that
score one: `make frontier` (the Hydra sweeper, its grid under `hydra.sweeper.*`) and
`recdepth.report` (its grid under `report.*`).

    FrontierGrid        the grid: fixed depths, each rule's τ, argmax_stability's k, the
                        gate's probabilities, the oracle's ε, the fixed grid again under
                        warm start; the defaults of `make frontier`
    FrontierSweeperConf hydra/sweeper=frontier: the grid and the sweeper's own keys
                        (registered in Hydra's ConfigStore by recdepth/config/schema.py)
    FrontierChoice      `frontier` of a training run: the fixed grid a task's experiment
                        chooses; its checkpoints carry it (`FRONTIER_FROM_CHECKPOINT`)
    settings(grid)      the grid as settings, in order: fixed, fixed (warm start), rules,
                        argmax_stability, gate, oracle
    exit_line(setting)  a setting's command-line overrides of recdepth.evaluate

Both commands then score the settings the same way: every setting a `recdepth.evaluate`
job with its own directory, the jobs that differ only in exit.* decoded ahead of them as
one batch (`jobs.decode_shared`), the directory summarised by
`recdepth.sweep.summarize` (frontier.csv, Fig. 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

WARM = "eval.warm_start=true"

# The grid keys a task's checkpoint carries (its experiment's `frontier:` block) and `make
# frontier` and `recdepth report` take as their defaults on it; a value on the command line wins
# (the sweeper; recdepth.cli.runner.checkpoint_eval for the report).
FRONTIER_FROM_CHECKPOINT = ("fixed", "warm_start", "oracle")


def check_fixed(where: str, fixed) -> None:
    """A fixed-depth grid: at least two distinct depths, integers >= 1 (one line naming `where`)."""
    bad = [n for n in fixed if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad or len(set(fixed)) < 2:
        raise ValueError(f"{where}: expected at least two depths, integers >= 1 (the frontier), got {list(fixed)!r}")


def _rules_grid() -> dict[str, list[float]]:
    """make frontier's τ grid: every registered rule's own (`ExitRule.frontier`)."""
    from recdepth import exits

    return exits.grid("frontier")


def _oracle() -> list[float]:
    from recdepth import exits

    return [exits.ORACLE_EPSILON]


@dataclass
class FrontierGrid:
    """One exit frontier's grid (docs/spec.md §4b)."""

    fixed: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    """exit=fixed exit.max_steps=n at each n: the reference curve (at least two depths, each >= 1)."""
    rules: dict[str, list[float]] = field(default_factory=_rules_grid)
    """Each threshold rule at each τ (drop one with `<grid>.rules.<rule>=[]`, add one with
    `+<grid>.rules.<rule>=[...]`). Default: each rule's own grid (`ExitRule.frontier`;
    stepnorm, kl, accel, ...; halt only on a checkpoint with a halting head)."""
    patience: list[int] = field(default_factory=list)
    """argmax_stability at each k (>= 1)."""
    gate_tau: list[float] = field(default_factory=list)
    """The learned gate at each probability τ in (0, 1) (it needs a gate file: exit.gate, report.gate)."""
    oracle: list[float] = field(default_factory=_oracle)
    """The oracle at each ε (>= 0); the summary draws its curve at every ε from its NLLs."""
    warm_start: bool = False
    """The fixed grid again with eval.warm_start=true (continuous compute): its own family,
    "fixed (warm start)"."""

    where: ClassVar[str] = "frontier"  # the prefix that names a bad field

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Every value of the grid, with a one-line error naming the field."""
        from recdepth import exits

        w = self.where
        check_fixed(f"{w}.fixed", self.fixed)
        if not isinstance(self.warm_start, bool):
            raise ValueError(f"{w}.warm_start: expected true or false, got {self.warm_start!r}")
        for rule, taus in self.rules.items():
            if not exits.is_rule(rule):
                raise ValueError(f"{w}.rules: unknown exit rule {rule!r} (expected any of {', '.join(exits.names())})")
            for t in taus:
                exits.validate(rule, t)
        for t in self.gate_tau:
            exits.validate("gate", t)
        for k in self.patience:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"{w}.patience: expected integers >= 1 (argmax_stability's k), got {list(self.patience)!r}")
        for e in self.oracle:
            exits.validate("oracle", e)


@dataclass
class FrontierSweeperConf(FrontierGrid):
    """`hydra/sweeper=frontier` (hydra_plugins/recdepth_frontier): the exit frontier as one
    multirun of recdepth.evaluate (`make frontier`). Every field is an override:
    'hydra.sweeper.fixed=[1,2,4,8]', 'hydra.sweeper.rules.kl=[]', '+hydra.sweeper.rules.accel_rel=[0.1]'."""

    _target_: str = "hydra_plugins.recdepth_frontier.frontier_sweeper.FrontierSweeper"
    max_batch_size: int | None = None
    """Hydra's: jobs per launcher batch (null: all)."""
    params: dict[str, str] | None = None
    """Hydra's basic-sweeper params (sweeps of your own; or give them on the command line)."""
    warm_start: bool = True
    """As FrontierGrid's, on by default here: `make frontier` draws the warm-start curve."""
    shared_rows: int = 64
    """Jobs that differ only in exit.* decoded ahead of them as one batch of settings ×
    windows, this many rows a batch (basic launcher); 0: job by job."""

    where: ClassVar[str] = "hydra.sweeper"

    def check(self) -> None:
        super().check()
        if isinstance(self.shared_rows, bool) or not isinstance(self.shared_rows, int) or self.shared_rows < 0:
            raise ValueError(f"hydra.sweeper.shared_rows: expected an integer >= 0 (0: job by job), got {self.shared_rows!r}")


@dataclass
class FrontierChoice:
    """`frontier` of a training run: the frontier grid a task's experiment chooses for its
    checkpoints (conf/experiment/roots.yaml). A task checkpoint carries the values set here
    (`FRONTIER_FROM_CHECKPOINT`), and `make frontier` and `recdepth report` on it take them
    where the command line sets none; null leaves the command's own default."""

    fixed: list[int] | None = None
    """The fixed depths of the frontier (at least two, each >= 1); null: the command's grid."""
    warm_start: bool | None = None
    """Whether the fixed grid is drawn again under warm start; null: the command's default."""
    oracle: list[float] | None = None
    """The oracle's ε grid; [] leaves the oracle out (it decodes token by token, which a grid
    model cannot: conf/experiment/mazes.yaml); null: the command's grid."""

    def __post_init__(self):
        from recdepth import exits

        if self.fixed is not None:
            check_fixed("frontier.fixed", self.fixed)
        if self.warm_start is not None and not isinstance(self.warm_start, bool):
            raise ValueError(f"frontier.warm_start: expected true, false or null, got {self.warm_start!r}")
        for e in self.oracle or []:
            exits.validate("oracle", e)

    def carried(self) -> dict:
        """The values a checkpoint carries: those set (not null)."""
        return {k: v for k in FRONTIER_FROM_CHECKPOINT if (v := getattr(self, k)) is not None}


@dataclass(frozen=True)
class Setting:
    """One setting of a frontier: its family in the report ("fixed", "grid", "oracle"), its
    exit.* values (the rest from conf/exit/<name>.yaml and the schema) and warm start."""

    family: str
    exit: dict[str, Any]
    warm_start: bool = False


def settings(grid: FrontierGrid, max_steps: int | None = None, gate: str | None = None,
             head: bool = False) -> list[Setting]:
    """The grid's settings in order: fixed, fixed under warm start, each rule at each τ,
    argmax_stability at each k, the gate at each τ, the oracle at each ε. `max_steps`: every
    setting but the fixed ones stops there (None: exit.max_steps as configured); `gate`: the
    gate's file (None: given by the user as exit.gate); `head`: whether the model has a
    halting head (without one the rules that read it, exit=halt, are left out)."""
    from recdepth import exits

    n = {} if max_steps is None else {"max_steps": int(max_steps)}
    fixed = [{"name": "fixed", "max_steps": int(k)} for k in grid.fixed]
    out = [Setting("fixed", e) for e in fixed]
    out += [Setting("fixed", e, warm_start=True) for e in fixed] if grid.warm_start else []
    out += [Setting("grid", {"name": rule, "tau": float(t), **n}) for rule, taus in grid.rules.items() for t in taus
            if head or not exits.lookup(rule).reads_head]
    out += [Setting("grid", {"name": "argmax_stability", "patience": int(k), **n}) for k in grid.patience]
    out += [Setting("grid", {"name": "gate", "tau": float(t), **n, **({"gate": gate} if gate else {})})
            for t in grid.gate_tau]
    out += [Setting("oracle", {"name": "oracle", "tau": float(e), **n}) for e in grid.oracle]
    return out


def exit_line(s: Setting) -> list[str]:
    """The overrides of recdepth.evaluate that select setting `s`: `exit=<name>`, then each
    exit.* value (a per-group value as a list), then eval.warm_start=true under warm start."""
    def fmt(v):
        if isinstance(v, list | tuple):
            return "[" + ",".join(fmt(x) for x in v) + "]"
        return repr(v) if isinstance(v, float) else "null" if v is None else str(v)

    line = [f"exit={s.exit['name']}"] + [f"exit.{k}={fmt(v)}" for k, v in s.exit.items() if k != "name"]
    return line + ([WARM] if s.warm_start else [])
