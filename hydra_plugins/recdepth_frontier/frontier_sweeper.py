"""`hydra/sweeper=frontier`: one multirun that evaluates a checkpoint on the whole exit
frontier (SPEC §4b), for `make frontier`:

    python -m recdepth.evaluate --multirun hydra/sweeper=frontier ckpt=<path> hydra.sweep.dir=<dir>

runs, as jobs of one sweep, the fixed-depth grid (`exit=fixed exit.max_steps=n` for each
n of `hydra.sweeper.fixed`), every rule at every τ of `hydra.sweeper.rules.<rule>`, and
the oracle at every ε of `hydra.sweeper.oracle`. Its grids live in
`conf/hydra/sweeper/frontier.yaml`. Any other override, including a sweep of your own
(`eval.cache=latest,per_step`), applies to every job (its cartesian product with the
frontier's jobs); the frontier's own `exit.*` overrides come last, so they win. The
sweep summary (`recdepth.sweep.SweepSummary`) then writes `frontier.csv`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper


def frontier_jobs(fixed: Sequence[int], rules: Mapping[str, Sequence[float]],
                  oracle: Sequence[float]) -> list[list[str]]:
    """The overrides of each frontier job, in order: fixed grid, rules, oracle."""
    jobs = [["exit=fixed", f"exit.max_steps={int(n)}"] for n in fixed]
    jobs += [[f"exit={rule}", f"exit.tau={float(tau)!r}"] for rule, taus in rules.items() for tau in taus]
    jobs += [["exit=oracle", f"exit.tau={float(eps)!r}"] for eps in oracle]
    return jobs


class FrontierSweeper(BasicSweeper):
    """Hydra's basic sweeper, with the frontier's jobs crossed with the user's overrides."""

    def __init__(self, fixed: Sequence[int], rules: Mapping[str, Sequence[float]], oracle: Sequence[float],
                 max_batch_size: int | None = None, params: Mapping[str, str] | None = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=dict(params or {}))
        bad = [n for n in fixed if isinstance(n, bool) or not isinstance(n, int) or n < 1]
        if bad or not fixed:
            raise ValueError(f"hydra.sweeper.fixed: expected a non-empty list of integers >= 1, got {list(fixed)!r}")
        self.jobs = frontier_jobs(fixed, rules or {}, oracle or [])

    def split_arguments(self, overrides, max_batch_size):  # an instance method here (a staticmethod upstream)
        user = BasicSweeper.split_arguments(overrides, None)[0]
        batches = [u + job for u in user for job in self.jobs]
        n = len(batches) if max_batch_size in (None, -1) else max_batch_size
        return [batches[i : i + n] for i in range(0, len(batches), n)]
