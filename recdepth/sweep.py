"""Sweeps: failure-tolerant Hydra jobs and `SweepSummary`, the Hydra callback that aggregates them.

`SweepSummary` (registered in `conf/config.yaml` and `conf/evaluate.yaml` under
`hydra.callbacks`) works for any multirun of `recdepth.train` or `recdepth.evaluate`: after
every job and at the end of the sweep it reads every job directory of the sweep and writes,
into the sweep directory,

    sweep_results.csv   one row per job: job, overrides, status, exit, tau, ce, ppl,
                        ms_per_token, applications per group and their mean, reused, error
    sweep_results.md    the same as a Markdown table
    fig4_exits.{png,pdf} the paper's Fig. 4: ms/token, PPL, CE and mean applications per
                        token against τ (log-x), one line per exit rule (`fixed` dashed)

and, at the end, a W&B table with the same rows when the sweep's config has `logger.wandb`.
A job that raised is recorded as `failed` (its error in `<job>/error.txt`); the others are
still aggregated, and the command exits non-zero after the sweep (`run_hydra_main`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import sys
import traceback
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("recdepth.sweep")
_FAILED: list[str] = []  # jobs of this process that raised (multirun only)


# ------------------------------------------------------------------- jobs
def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def guarded(fn, cfg: DictConfig, key: str) -> float:
    """Run a job function. In a multirun, a job that raises is logged, its traceback written
    to `<run_dir>/error.txt`, and NaN returned, so Hydra goes on to the other jobs and to
    the sweep summary; `run_hydra_main` exits non-zero afterwards. A single run raises."""
    if not _is_multirun():
        try:
            return _objective(fn(cfg), key)
        except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
            # A bad input, a refused file or a diverged run: its one-line message is the
            # whole story (HYDRA_FULL_ERROR=1 keeps the traceback).
            if os.environ.get("HYDRA_FULL_ERROR") == "1" or not _one_line(e):
                raise
            raise SystemExit(f"error: {e}") from None
    try:
        return _objective(fn(cfg), key)
    except Exception as e:
        run_dir = Path(OmegaConf.select(cfg, "run_dir"))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "error.txt").write_text("".join(traceback.format_exception(e)))
        log.error("job failed: %s: %s (traceback in %s)", type(e).__name__, e, run_dir / "error.txt")
        _FAILED.append(str(run_dir))
        return math.nan


def _one_line(e: Exception) -> bool:
    """recdepth's own errors are one line: `field: ...` (or a diverged run's report);
    anything else (a bug, a library's multi-line report) keeps its traceback."""
    msg = str(e)
    if "\n" in msg:
        return False
    if type(e).__name__ == "TrainingDiverged":
        return True
    return not isinstance(e, RuntimeError) and msg.split(" ", 1)[0].endswith(":")


def _objective(metrics: dict, key: str) -> float:
    v = metrics.get(key, metrics.get("eval", {}).get(key))
    return float(v) if v is not None else math.nan


def hoist_mode_flags(argv: list[str]) -> list[str]:
    """Move bare `--multirun`/`-m` in front of the overrides. Hydra's argparse takes the
    overrides as one positional list, so `model=grouped --multirun exit.tau=...` (overrides
    on both sides of the flag, the form this project documents) would be refused."""
    flags = [a for a in argv if a in ("--multirun", "-m")]
    return flags + [a for a in argv if a not in ("--multirun", "-m")]


def run_hydra_main(hydra_main) -> None:
    """Call a @hydra.main function with the documented argv forms; exit 1 if a job failed."""
    sys.argv[1:] = hoist_mode_flags(sys.argv[1:])
    hydra_main()
    if _FAILED:
        print(f"{len(_FAILED)} job(s) failed: " + ", ".join(_FAILED), file=sys.stderr)
        sys.exit(1)


# -------------------------------------------------------------- aggregation
COLUMNS = ["job", "overrides", "status", "exit", "tau", "ce", "ppl", "ms_per_token", "applications_per_token",
           "mean_applications", "reused", "error"]


def _job_row(job_dir: Path) -> dict:
    row = {c: "" for c in COLUMNS}
    row["job"] = int(job_dir.name)
    ov = job_dir / ".hydra" / "overrides.yaml"
    if ov.is_file():
        row["overrides"] = " ".join(OmegaConf.to_container(OmegaConf.load(ov)))
    cfg_file = job_dir / ".hydra" / "config.yaml"
    if cfg_file.is_file():
        ex = OmegaConf.load(cfg_file).get("exit") or {}
        row["exit"], row["tau"] = ex.get("name", ""), ex.get("tau")
    m_file = job_dir / "metrics.json"
    if m_file.is_file():
        m = json.loads(m_file.read_text())
        ev = m.get("eval")
        row["status"] = "ok"
        row["reused"] = bool(m.get("reused", False))
        if ev:
            apps = ev["applications_per_token"]
            row.update(exit=ev["exit"], tau=ev["tau"], ce=ev["ce"], ppl=ev["ppl"], ms_per_token=ev["ms_per_token"],
                       applications_per_token=apps, mean_applications=sum(apps) / len(apps) if apps else 0.0)
    elif (job_dir / "error.txt").is_file():
        lines = (job_dir / "error.txt").read_text().strip().splitlines()
        row["status"], row["error"] = "failed", lines[-1] if lines else "error"
    else:
        row["status"] = "incomplete"
    return row


def collect(sweep_dir: str | Path) -> list[dict]:
    """One row per job directory (`<sweep_dir>/<n>/`), by job number."""
    jobs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()]
    return [_job_row(p) for p in sorted(jobs, key=lambda p: int(p.name))]


def _fmt(v, digits=4) -> str:
    if v is None or v == "":
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, list):
        return " / ".join(f"{x:.1f}" for x in v)
    return str(v)


def markdown(rows: list[dict]) -> str:
    head = ["job", "exit", "τ", "CE", "PPL", "ms/token", "applications per token (per group)", "mean", "status"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        status = r["status"] + (f": {r['error']}" if r["error"] else "") + (" (reused checkpoint)" if r["reused"] is True else "")
        tau = f"{r['tau']:g}" if isinstance(r["tau"], float | int) else "—"
        out.append("| " + " | ".join([str(r["job"]), _fmt(r["exit"]), tau, _fmt(r["ce"]), _fmt(r["ppl"], 2),
                                      _fmt(r["ms_per_token"], 2), _fmt(r["applications_per_token"]),
                                      _fmt(r["mean_applications"], 2), status.replace("|", "/")]) + " |")
    return "\n".join(out) + "\n"


def fig4(rows: list[dict]):
    """The paper's Fig. 4: latency, PPL, CE and compute against τ, one line per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r["ce"] != ""]
    panels = [("ms_per_token", "ms / token"), ("ppl", "PPL"), ("ce", "CE (nats)"),
              ("mean_applications", "mean applications per token")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    rules = sorted({r["exit"] for r in ok})
    colors = dict(zip(rules, plt.get_cmap("tab10").colors))
    taus = sorted({r["tau"] for r in ok if isinstance(r["tau"], float | int)})
    for ax, (key, label) in zip(axes, panels):
        for rule in rules:
            pts = sorted((r["tau"], r[key]) for r in ok if r["exit"] == rule and isinstance(r["tau"], float | int))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[rule], label=rule)
            flat = [r[key] for r in ok if r["exit"] == rule and not isinstance(r["tau"], float | int)]
            if flat:  # rules without a threshold (fixed): one level across τ
                ax.axhline(sum(flat) / len(flat), color=colors[rule], ls="--", label=f"{rule} (no τ)")
        if taus:
            ax.set_xscale("log")
        ax.set_xlabel("τ")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    n_failed = sum(r["status"] != "ok" for r in rows)
    fig.suptitle("Fig. 4: exit policies — latency and quality against the threshold τ"
                 + (f" ({n_failed} job(s) not ok, left out)" if n_failed else ""), fontsize=10)
    fig.tight_layout()
    return fig


def summarize(sweep_dir: str | Path) -> list[dict]:
    """Write sweep_results.csv / .md and Fig. 4 into sweep_dir; return the rows."""
    import matplotlib.pyplot as plt

    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    with open(sweep_dir / "sweep_results.csv.tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({**r, "applications_per_token": " ".join(map(str, r["applications_per_token"] or []))})
    (sweep_dir / "sweep_results.csv.tmp").replace(sweep_dir / "sweep_results.csv")
    (sweep_dir / "sweep_results.md").write_text(markdown(rows))
    if any(r["status"] == "ok" and r["ce"] != "" for r in rows):
        fig = fig4(rows)
        for fmt in ("png", "pdf"):
            fig.savefig(sweep_dir / f"fig4_exits.{fmt}", dpi=150 if fmt == "png" else None)
        plt.close(fig)
    return rows


def _wandb_table(config: DictConfig, sweep_dir: Path, rows: list[dict]) -> None:
    w = OmegaConf.select(config, "logger.wandb")
    if w is None:
        return
    from recdepth.train import wandb_mode

    mode = wandb_mode(w.mode)
    if mode == "disabled":
        return
    import wandb

    run = wandb.init(project=w.project, entity=w.entity, dir=str(sweep_dir), mode=mode,
                     name=f"sweep-{sweep_dir.name}", job_type="sweep-summary", reinit=True)
    try:  # the run is finished whatever happens while logging
        cols = [c for c in COLUMNS if c != "applications_per_token"]
        table = wandb.Table(columns=cols + ["applications_per_token"],
                            data=[[_fmt(r[c]) if r[c] in ("", None) else r[c] for c in cols]
                                  + [" / ".join(map(str, r["applications_per_token"] or []))] for r in rows])
        log_items = {"sweep/results": table}
        if (sweep_dir / "fig4_exits.png").is_file():
            log_items["sweep/fig4"] = wandb.Image(str(sweep_dir / "fig4_exits.png"))
        run.log(log_items)
    finally:
        run.finish()


class SweepSummary(Callback):
    """Hydra callback: aggregate a multirun after every job and at its end."""

    def on_job_end(self, config: DictConfig, job_return=None, **kwargs) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            summarize(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = summarize(sweep_dir)
        _wandb_table(config, sweep_dir, rows)
        n_ok = sum(r["status"] == "ok" for r in rows)
        log.info("sweep summary: %d/%d jobs ok -> %s", n_ok, len(rows), sweep_dir / "sweep_results.md")
