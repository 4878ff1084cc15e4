"""`hydra/sweeper=frontier`: one multirun that evaluates a checkpoint on the whole exit
frontier (SPEC §4b), for `make frontier`:

    python -m recdepth.evaluate --multirun hydra/sweeper=frontier ckpt=<path> hydra.sweep.dir=<dir>

runs, as jobs of one sweep, the settings of its grid (`hydra.sweeper.*`: the fields and
defaults of `recdepth.config.frontier_grid.FrontierSweeperConf`, registered in Hydra's
ConfigStore by recdepth/config/schema.py; `--cfg hydra` shows them): the fixed-depth grid
(`exit=fixed exit.max_steps=n`), with `hydra.sweeper.warm_start` (default true) the same
grid again with `eval.warm_start=true` (continuous compute, its own family "fixed (warm
start)" in the summary), every rule at every τ of `hydra.sweeper.rules.<rule>`,
argmax_stability at each k of `hydra.sweeper.patience`, the gate at each τ of
`hydra.sweeper.gate_tau` (give `exit.gate=<gate.pt>`), exit=halt at each of its τ where the
checkpoint has a halting head (`halt=<loss>` at training), and the oracle at every ε of
`hydra.sweeper.oracle`: `frontier_grid.settings`, the same expansion `recdepth.report`
scores. Any other override, including a sweep of your own (`eval.cache=latest,per_step`),
applies to every job (its cartesian product with the frontier's jobs); the frontier's own
`exit.*` overrides come last, so they win. A user override of `eval.warm_start` sets it for
every job, and the warm-start copy of the grid is then left out (it would repeat the fixed
grid). The sweep summary (`recdepth.sweep.SweepSummary`) then writes `frontier.csv`.

With Hydra's basic launcher (jobs one after another in this process) and
`hydra.sweeper.shared_rows` > 0 (default 64), the jobs that differ only in their exit
setting are decoded before they run as one batch of settings × windows, up to that many
rows a batch (`recdepth.app.jobs.decode_shared`); each job then writes its own
directory and files from those results, which equal its decoding alone. 0 decodes job by job.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from omegaconf import open_dict

from recdepth.cli.runner import override_key, unset
from recdepth.config.frontier_grid import (
    FRONTIER_FROM_CHECKPOINT,
    WARM,
    FrontierSweeperConf,
    exit_line,
    settings,
)

log = logging.getLogger("recdepth.frontier")


class FrontierSweeper(BasicSweeper):
    """Hydra's basic sweeper, with the frontier's jobs crossed with the user's overrides."""

    def __init__(self, fixed: Sequence[int], rules: Mapping[str, Sequence[float]], oracle: Sequence[float],
                 patience: Sequence[int] = (), gate_tau: Sequence[float] = (), warm_start: bool = True,
                 shared_rows: int = 64, max_batch_size: int | None = None,
                 params: Mapping[str, str] | None = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=dict(params or {}))
        grid = FrontierSweeperConf(fixed=list(fixed), rules={k: list(v) for k, v in (rules or {}).items()},
                                   oracle=list(oracle or []), patience=list(patience or []),
                                   gate_tau=list(gate_tau or []), warm_start=warm_start, shared_rows=shared_rows)
        self.grid = grid
        self.shared_rows = shared_rows
        self.used: dict[str, dict] = {}  # the grid on each checkpoint of the sweep (`grid_for`)

    def grid_for(self, ckpt: str | None) -> FrontierSweeperConf:
        """The grid on checkpoint `ckpt`: `hydra.sweeper.*`, with the grid keys a task
        checkpoint carries (its experiment's `frontier:` block, `FRONTIER_FROM_CHECKPOINT`)
        where the command line set none. The sweep directory's grid.json holds it per
        checkpoint, each key with where it came from."""
        from recdepth.app.checkpoints import eval_defaults
        from recdepth.training.runs import write_json

        hydra_cfg = self.config.hydra if self.config is not None else None  # None: called before Hydra's setup
        given = {override_key(o) for o in hydra_cfg.overrides.hydra} if hydra_cfg is not None else set()
        carried = eval_defaults(ckpt)["frontier"] if ckpt else {}
        mine = {k: v for k, v in unset(carried, "hydra.sweeper", given).items() if k in FRONTIER_FROM_CHECKPOINT}
        grid = dataclasses.replace(self.grid, **mine)  # validated again (FrontierGrid.__post_init__)
        if mine:
            log.info("frontier grid from the checkpoint: %s", ", ".join(f"{k}={v}" for k, v in mine.items()))
        self.used[str(ckpt)] = {"fixed": grid.fixed, "warm_start": grid.warm_start, "oracle": grid.oracle,
                                "from": {k: "checkpoint" if k in mine else "command" for k in FRONTIER_FROM_CHECKPOINT}}
        if hydra_cfg is not None:
            out = Path(hydra_cfg.sweep.dir)
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / "grid.json", self.used)  # one entry per checkpoint of the sweep
        return grid

    def jobs(self, user: Sequence[str]) -> list[list[str]]:
        """The frontier's jobs under the user's overrides `user`: the grid on its checkpoint
        (ckpt=, `grid_for`), exit=halt only where that checkpoint has a halting head."""
        from recdepth.app.checkpoints import has_halting_head

        ckpt = next((o.split("=", 1)[1] for o in user if override_key(o) == "ckpt"), None)
        grid = self.grid_for(ckpt)
        return [exit_line(s) for s in settings(grid, head=ckpt is not None and has_halting_head(ckpt))]

    def validate_batch_is_legal(self, batch) -> None:
        """Hydra's check that every job composes, then (basic launcher, shared_rows > 0) the
        batch's settings decoded side by side ahead of the jobs."""
        super().validate_batch_is_legal(batch)
        if self.shared_rows and isinstance(self.launcher, BasicLauncher):
            from recdepth.app.jobs import SWEEP, decode_shared
            from recdepth.cli.runner import checkpoint_eval

            jobs = []
            for overrides in batch:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with open_dict(cfg):  # the job's config: no hydra node; its run_dir is not read
                    del cfg["hydra"]
                    cfg.run_dir = "."
                checkpoint_eval(cfg, list(overrides))  # as the job itself will (recdepth.cli.runner.task)
                jobs.append(cfg)
            decode_shared(jobs, self.shared_rows, into=SWEEP)  # the jobs take theirs (recdepth.evaluate)

    def split_arguments(self, overrides, max_batch_size):  # an instance method here (a staticmethod upstream)
        user = BasicSweeper.split_arguments(overrides, None)[0]
        batches = [u + job for u in user for job in self.jobs(u)
                   if not (WARM in job and any(override_key(o) == "eval.warm_start" for o in u))]
        n = len(batches) if max_batch_size in (None, -1) else max_batch_size
        return [batches[i : i + n] for i in range(0, len(batches), n)]

