"""The entry points' runner: their job directory, their argv forms, their one-line errors
and their failure-tolerant multirun jobs. Every entry point (train, evaluate, calibrate,
report, generate, diagnose, train_gate) is a plain function of its config, `job(cfg) ->
dict`, that starts with `job_dir`, `refuse` and `start_job`, and is made a command by

    _task = task(job, key)          the Hydra task function (module-level, so a launcher
                                    that pickles it, submitit, pickles it by reference)
    main = hydra_main(_task, name)  compose conf/<name>.yaml with the command line, run

    job_dir(cfg, entry)   cfg.run_dir, or one line when called outside Hydra without one
    refuse(run_dir, ...)  one line if the directory already holds a result (never overwritten)
    start_job(run_dir, cfg)   the directory and its config.yaml (the resolved config)
    compose_job(name, overrides)  conf/<name>.yaml composed with overrides, as its command
                          line would (a command that runs another's jobs: the report)
    checkpoint_eval(cfg, overrides)  a task checkpoint's own eval settings (and report grid) where the command
                          line sets none (every command's job does this before it starts)
    unset(values, prefix, given)  the carried settings the command line did not set (also the
                          frontier sweeper's, for its grid)
    run_hydra_main(main)  call a @hydra.main function: `--multirun` may stand anywhere
                          among the overrides (`hoist_mode_flags`), a config OmegaConf
                          refuses is one line naming the field (`schema.config_error`),
                          and the process exits 1 after a sweep in which a job failed
    guarded(fn, cfg, key) run one job: a single run's own errors are one line; in a
                          multirun a job that raises writes `<run_dir>/error.txt` and
                          returns NaN, so Hydra goes on to the other jobs and to the sweep
                          summary (`recdepth.sweep.SweepSummary`)
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from recdepth.config.build import conf_dir
from recdepth.config.schema import config_error, register_configs

log = logging.getLogger("recdepth.cli.runner")


def job_dir(cfg: DictConfig, entry: str) -> Path:
    """cfg.run_dir as a Path; outside a Hydra run `${hydra:runtime.output_dir}` does not
    resolve, so calling `entry(cfg)` without run_dir=... is one line naming it."""
    try:
        return Path(cfg.run_dir)
    except Exception:
        raise ValueError(f"run_dir: set run_dir=<directory> when calling {entry}(cfg) outside Hydra") from None


def refuse(run_dir: Path, *names: str | Path, what: str | None = None) -> None:
    """One line if run_dir already holds any of `names` (files or directories): nothing a
    user produced is overwritten. `what` names the result in the message (default: the
    first name held)."""
    held = [n for n in names if (run_dir / n).exists()]
    if held:
        raise FileExistsError(f"run_dir: {run_dir} already holds {what or held[0]}; choose a new run_dir")


def start_job(run_dir: Path, cfg: DictConfig) -> None:
    """Create the job directory and write config.yaml, the resolved config, its first file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def task(job: Callable[[DictConfig], dict], key: str) -> Callable[[DictConfig], float]:
    """The Hydra task function of an entry point: `guarded(job, cfg, key)` (`key`: the
    metric a sweeper optimises). Bind it to `_task` in the job's module: it is named
    `<module>._task`, so a launcher that pickles it (submitit) pickles it by reference."""

    def _task(cfg: DictConfig) -> float:
        checkpoint_eval(cfg, HydraConfig.get().overrides.task if HydraConfig.initialized() else [])
        return guarded(job, cfg, key)

    _task.__module__, _task.__qualname__ = job.__module__, "_task"
    return _task


def override_key(override: str) -> str:
    """The config key of a command-line override (`+eval.cache=per_step` -> eval.cache)."""
    return override.split("=", 1)[0].lstrip("+~")


def unset(values: dict, prefix: str, given: set[str]) -> dict:
    """The entries of `values` (settings a checkpoint carries) whose key `<prefix>.<key>` is
    not among `given`, the keys the command line set: a value on the command line wins."""
    return {k: v for k, v in values.items() if f"{prefix}.{k}" not in given}


def checkpoint_eval(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """A task checkpoint evaluates itself: the settings its experiment chose, carried by `ckpt=`
    (`checkpoints.eval_defaults`), become the command's (in place) where `overrides`, the
    command line, sets none: the eval keys `EVAL_FROM_CHECKPOINT` in cfg.eval and, for
    recdepth.report, the grid keys `FRONTIER_FROM_CHECKPOINT` in cfg.report. Each block's
    `from_checkpoint` lists the keys taken (a job's metrics.json and report.json report them).
    Returns the dotted keys taken. Nothing for hf= or a checkpoint that carries none (the
    command's defaults stay)."""
    ckpt = OmegaConf.select(cfg, "ckpt")
    if not ckpt:
        return []
    from recdepth.app.checkpoints import eval_defaults

    given = {override_key(o) for o in overrides}
    carried = eval_defaults(ckpt)
    taken = []
    for name, values in (("eval", carried["eval"]), ("report", carried["frontier"])):
        block = OmegaConf.select(cfg, name)
        if block is None or "from_checkpoint" not in block:
            continue
        mine = {k: v for k, v in unset(values, name, given).items() if k in block}
        for k, v in mine.items():
            block[k] = v
        block.from_checkpoint = sorted(mine)
        taken += [f"{name}.{k}" for k in sorted(mine)]
    return taken


def compose_job(config_name: str, overrides: list[str]) -> DictConfig:
    """conf/<config_name>.yaml composed with `overrides` as `python -m recdepth.<command>
    <overrides>` composes it (Hydra's compose API: inside a running Hydra app with its
    search path, outside one with conf/), without the hydra node."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()  # exit rules defined since the schema was imported
    if GlobalHydra.instance().is_initialized():
        return compose(config_name, overrides=list(overrides))
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose(config_name, overrides=list(overrides))


def hydra_main(task_fn: Callable[[DictConfig], float], config_name: str) -> Callable[[], None]:
    """`main()` of an entry point: compose conf/<config_name>.yaml with the command line and
    run `task_fn` (`run_hydra_main`: the documented argv forms and one-line errors)."""
    decorated = hydra.main(config_path=conf_dir(), config_name=config_name, version_base="1.3")(task_fn)

    def main() -> None:
        register_configs()  # exit rules defined since the schema was imported
        run_hydra_main(decorated)

    return main
_FAILED: list[str] = []  # jobs of this process that raised (multirun only)


def _is_multirun() -> bool:
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


# Hydra's internals, in one place: Hydra has no public hook for how a composition error is
# reported, so `one_line_errors` wraps `hydra._internal.utils.run_and_report` (where
# `hydra.main` reports them) for the duration of a command, and `_override_under_null` reads
# the key being overridden from the frame of `ConfigLoaderImpl._apply_overrides_to_config`.
# tests/config/test_schema.py::test_the_hydra_internals_recdepth_reads_are_there fails when a Hydra
# release moves either.
HYDRA_REPORT = ("hydra._internal.utils", "run_and_report")
HYDRA_OVERRIDE_FRAME = ("hydra._internal.config_loader_impl", "ConfigLoaderImpl", "_apply_overrides_to_config")


def _override_under_null(e: BaseException) -> str | None:
    """One line for an override of a key under a node the config sets to null, e.g.
    `callbacks=none callbacks.loop_dynamics.loops=5`: OmegaConf asserts on it without
    naming the key, so the key is read from Hydra's override loop in the traceback."""
    if not (isinstance(e, AssertionError) and str(e) in ("Unexpected type for root: NoneType",
                                                          "Unexpected type: None")):
        return None
    tb, key = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == HYDRA_OVERRIDE_FRAME[-1]:
            key = tb.tb_frame.f_locals.get("key")
        tb = tb.tb_next
    if not isinstance(key, str):
        return None
    if key.startswith("data."):  # evaluate, calibrate, generate, ...: the data node is the checkpoint's
        return (f"{key}: no data group here: a training checkpoint (ckpt=) carries its own data config; with "
                "hf=<dir>, choose one first (data=files data.paths=...)")
    return (f"{key}: {key.rsplit('.', 1)[0]} is null in this config (a group option such as callbacks=none "
            "sets it so); pick an option that has it, or drop the override")


@contextlib.contextmanager
def one_line_errors():
    """While inside: a config Hydra cannot compose because OmegaConf refused a value (a wrong
    type, a key the schema does not have, a key under a null node) exits with one line
    naming the field (`schema.config_error`, `_override_under_null`) instead of Hydra's
    multi-line report (HYDRA_FULL_ERROR=1 keeps Hydra's). Hydra's function is put back after."""
    module = importlib.import_module(HYDRA_REPORT[0])
    report = getattr(module, HYDRA_REPORT[1])

    def one_line_report(func):
        def condensed():
            try:
                return func()
            except Exception as e:
                msg = config_error(e) or _override_under_null(e)
                if msg is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                raise SystemExit(f"error: {msg}") from None
        return report(condensed)

    setattr(module, HYDRA_REPORT[1], one_line_report)
    try:
        yield
    finally:
        setattr(module, HYDRA_REPORT[1], report)


def run_hydra_main(hydra_main) -> None:
    """Call a @hydra.main function with the documented argv forms (`hoist_mode_flags`) and
    one-line composition errors (`one_line_errors`); exit 1 if a job failed."""
    sys.argv[1:] = hoist_mode_flags(sys.argv[1:])
    _FAILED.clear()  # this command's jobs only (a process may run several, e.g. the tests)
    with one_line_errors():
        hydra_main()
    if _FAILED:
        print(f"{len(_FAILED)} job(s) failed: " + ", ".join(_FAILED), file=sys.stderr)
        sys.exit(1)
