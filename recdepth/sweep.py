"""`SweepSummary`, the Hydra callback that aggregates a multirun, and `summarize`, its work.

`SweepSummary` (registered in `conf/config.yaml` and `conf/evaluate.yaml` under
`hydra.callbacks`) works for any multirun of `recdepth.train` or `recdepth.evaluate`: after
every job it writes sweep_results.csv / .md (one row per job so far, `write_results`), and at
the end of the sweep the whole summary (`summarize`): those tables, frontier.csv / .md, a
task's tables and fig4_exits.{png,pdf} into the sweep directory (what each holds:
recdepth/analysis/frontier.py; the figure: recdepth/analysis/plots.py's `fig4`), and a W&B table with
the same rows when the sweep's config has `logger.wandb`. The frontier's bootstrap and the
figure read every job's records, so redoing them after every job would make a sweep's summary
work grow with the square of its jobs (measured: docs/results/sweep-time.md); `summarize(dir)`
writes the whole summary of a sweep stopped before its end. A job that raised is recorded
as `failed` (its error in `<job>/error.txt`); the others are still aggregated, and the
command exits non-zero after the sweep (`recdepth.cli.runner`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from recdepth.analysis import plots, task_tables
from recdepth.analysis.frontier import (
    COLUMNS,
    FRONTIER_COLUMNS,
    _write_csv,
    bootstrap,
    collect,
    error_inputs,
    frontier_inputs,
    frontier_markdown,
    frontier_rows,
    markdown,
    oracle_curve,
    paired_vs_max,
    sweep_cost,
)

log = logging.getLogger("recdepth.sweep")


def write_results(sweep_dir: Path) -> list[dict]:
    """Write sweep_results.csv / .md (one row per job directory so far) into sweep_dir;
    return the rows."""
    rows = collect(sweep_dir)
    spaced = ("applications_per_token", "group_layers", "ms_repeats")
    _write_csv(sweep_dir / "sweep_results.csv", COLUMNS, [
        {**r, **{k: " ".join(map(str, r[k])) if isinstance(r[k], list) else r[k] for k in spaced}} for r in rows])
    (sweep_dir / "sweep_results.md").write_text(markdown(rows))
    return rows


def summarize(sweep_dir: str | Path) -> list[dict]:
    """Write sweep_results.csv / .md, frontier.csv / .md (with fixed jobs at two or more
    depths) and Fig. 4 into sweep_dir; return the rows."""
    import matplotlib.pyplot as plt

    sweep_dir = Path(sweep_dir)
    rows = write_results(sweep_dir)
    oracle, paired, front = None, {}, []
    try:
        inputs = frontier_inputs(sweep_dir, rows)  # every job's eval_tokens.csv, read once
        if inputs is not None:
            boot, cost = bootstrap(inputs), sweep_cost(rows)
            front = frontier_rows(inputs, rows, boot, cost)
            if front:
                paired = paired_vs_max(inputs, boot)
                oracle = None if inputs[2] is None else oracle_curve(inputs[2], cost)
    except ValueError as e:
        log.warning("%s", e)
        front = []
    if front:
        _write_csv(sweep_dir / "frontier.csv", FRONTIER_COLUMNS, front)
        (sweep_dir / "frontier.md").write_text(frontier_markdown(front))
        errors = error_inputs(inputs)
        if errors is not None:  # a task: the same comparisons with accuracy as the quality axis
            acc = frontier_rows(errors, rows, boot, cost)
            _write_csv(sweep_dir / "frontier_accuracy.csv", FRONTIER_COLUMNS, acc)
            (sweep_dir / "frontier_accuracy.md").write_text(
                "Quality = error rate (1 − answer accuracy): the 'error' columns hold error rates, lower is "
                "better; ms/token comparisons too. No oracle column (the oracle picks its depth by NLL).\n\n"
                + frontier_markdown(acc, "error"))
    task_tables.write(sweep_dir, rows)  # a task: accuracy by difficulty and depth (docs/spec.md §6)
    if any(r["status"] == "ok" and r["ce"] != "" for r in rows):
        fig = plots.fig4(rows, oracle, front, paired)
        for fmt in ("png", "pdf"):
            fig.savefig(sweep_dir / f"fig4_exits.{fmt}", dpi=150 if fmt == "png" else None)
        plt.close(fig)
    return rows


def _wandb_table(config: DictConfig, sweep_dir: Path, rows: list[dict]) -> None:
    w = OmegaConf.select(config, "logger.wandb")
    if w is None:
        return
    from recdepth.config.build import wandb_init

    run = wandb_init(w, sweep_dir, f"sweep-{sweep_dir.name}", job_type="sweep-summary")
    if run is None:
        return
    import wandb

    try:  # the run is finished whatever happens while logging
        cols = [c for c in COLUMNS if c != "applications_per_token"]
        # a failed job's empty cells are None, W&B's missing value: a "—" string in a number
        # column makes wandb.Table refuse the row (and Hydra would turn that into a warning)
        cell = lambda v: None if v in ("", None) else str(v) if isinstance(v, list) else v  # noqa: E731
        table = wandb.Table(columns=cols + ["applications_per_token"],
                            data=[[cell(r[c]) for c in cols]
                                  + [" / ".join(map(str, r["applications_per_token"] or []))] for r in rows])
        log_items = {"sweep/results": table}
        if (sweep_dir / "fig4_exits.png").is_file():
            log_items["sweep/fig4"] = wandb.Image(str(sweep_dir / "fig4_exits.png"))
        run.log(log_items)
    finally:
        run.finish()


class SweepSummary(Callback):
    """Hydra callback: the results table after every job of a multirun, the whole summary
    at its end."""

    def on_job_end(self, config: DictConfig, job_return=None, **kwargs) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            write_results(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = summarize(sweep_dir)
        _wandb_table(config, sweep_dir, rows)
        n_ok = sum(r["status"] == "ok" for r in rows)
        log.info("sweep summary: %d/%d jobs ok -> %s", n_ok, len(rows), sweep_dir / "sweep_results.md")
