"""The run config: where `conf/` is, and the objects built from the validated config
(model config, sampler arguments, exit policy, data module, loop-dynamics callback,
loggers). The config's keys, types and ranges are recdepth/config/schema.py's (`validated`).

Lightning glue, below the entry points (`train`, `evaluate`, `bench`, `sweep`), which all
read their config through this module; it imports only the core and the other glue
modules (docs: recdepth/__init__.py, layers).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from urllib.parse import urlparse

import torch
from omegaconf import DictConfig, OmegaConf

from recdepth import exits
from recdepth.config.schema import TrainConfig, validated
from recdepth.data.datamodule import TokenDataModule
from recdepth.exits.gate import load_gate
from recdepth.model.config import GPTConfig
from recdepth.training import distributed, halting

log = logging.getLogger("recdepth.config.build")


def conf_dir() -> str:
    """The config groups: always `recdepth/conf` (the package's, beside config/). In a source checkout
    that is a symlink to the repository's top-level `conf/` (where the layout keeps it,
    mirroring the code); a wheel ships the files there (pyproject: package `recdepth.conf`).
    Importing this module registers the schema the groups compose onto (recdepth/config/schema.py)."""
    d = Path(__file__).resolve().parent.parent / "conf"
    if not (d / "config.yaml").is_file():
        raise FileNotFoundError(f"recdepth: no config.yaml in {d} (a broken install? reinstall recdepth)")
    return str(d)


# ------------------------------------------------------------------- pieces
# Each takes the typed config (`schema.validated`'s); a DictConfig is validated on the way in.
def typed(cfg):
    """The validated object of a composed config; a validated object (any root) as it is."""
    return cfg if dataclasses.is_dataclass(cfg) else validated(cfg)


def model_config(cfg: TrainConfig | DictConfig, vocab_size: int, n_other: int = 0) -> GPTConfig:
    run = typed(cfg)
    m = run.model
    h = run.halt  # a halting head (halt.*): its input, initial bias and how exit=halt reads it
    head = dict(halt_head=h.input, halt_bias=h.init_bias, halt_reading=halting.lookup(h.loss).reading) if h.on else {}
    return GPTConfig(**m.shape(), **m.options(), groups=m.groups, state_init=m.state_init, logit_bias=m.logit_bias,
                     mean_recurrence=run.sampler.mean, vocab_size=vocab_size, n_other=n_other, **head)


def sampler_args(cfg: TrainConfig | DictConfig) -> dict:
    """`LoopSampler`'s arguments (all but n_groups and seed)."""
    return dataclasses.asdict(typed(cfg).sampler)


def exit_policy(cfg) -> exits.ExitPolicy:
    """The exit policy of `exit`; a training config knows its model's groups and width, so
    per-group values and a gate are checked against them here (an evaluation's checkpoint:
    `ExitPolicy.check_model`). exit=gate reads its gate file, `exit.gate` (`gate.load_gate`)."""
    run = typed(cfg)
    kw = dataclasses.asdict(run.exit)
    path = kw.pop("gate")
    kw.pop("calibrated_on")  # checked by the evaluation against its test range (evaluation.check_calibration)
    if exits.is_rule(run.exit.name) and exits.lookup(run.exit.name).gated:
        if not path:
            raise ValueError("exit.gate: required for exit=gate (the gate.pt written by python -m "
                             "recdepth.train_gate ckpt=<path>)")
        w, b, _ = load_gate(path)
        kw["gate"] = (w, b)
    policy = exits.build(**kw)
    if isinstance(run, TrainConfig):
        policy.check_model(len(run.model.groups), run.model.shape()["n_embd"])
    return policy


def data_module(cfg: TrainConfig | DictConfig, block_size: int) -> TokenDataModule:
    """The data module of the run's data config (`data`) at its batch size, steps and seed."""
    run = typed(cfg)
    return TokenDataModule(run.data, block_size=block_size, batch_size=run.batch_size,
                           max_steps=run.trainer.max_steps, seed=run.seed)


def loop_dynamics_callback(cfg: TrainConfig | DictConfig, run_dir: Path, dm: TokenDataModule, mcfg: GPTConfig):
    """The `LoopDynamics` callback of `callbacks.loop_dynamics`, or None when the config has
    none. Its fixed held-out batch is the first sequences × seq_len val tokens."""
    c = typed(cfg).callbacks.loop_dynamics
    if c is None:
        return None
    from recdepth.training.callbacks import LoopDynamics

    kw = dataclasses.asdict(c)
    rows, T = kw.pop("sequences"), kw.pop("seq_len") or mcfg.block_size
    batch = torch.as_tensor(dm.heldout_tokens(rows * T)).view(rows, T)
    return LoopDynamics(batch, run_dir, **kw, decode=dm.decode)


def wandb_init(w: DictConfig, save_dir: Path, name: str, **kw):
    """A W&B run for `logger.wandb` w, or None with mode=disabled. `auto` tries online when
    an API key is configured, bounded by w.init_timeout seconds (W&B's own `init_timeout`),
    and falls back to offline (sync later with `wandb sync`) when the server cannot be
    reached; without a key it is offline at once. Never blocks longer, never fails a run
    for want of a network."""
    import wandb

    mode = os.environ.get("WANDB_MODE") if w.mode == "auto" and os.environ.get("WANDB_MODE") else w.mode
    if mode == "disabled":
        return None
    if mode == "auto":
        mode = "online" if _has_wandb_key() else "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    settings = wandb.Settings(init_timeout=float(w.init_timeout), silent=True)
    args = dict(project=w.project, entity=w.entity, dir=str(save_dir), name=name, settings=settings,
                reinit="create_new", **kw)
    try:
        run = wandb.init(mode=mode, **args)
    except (wandb.errors.CommError, wandb.errors.AuthenticationError, wandb.errors.UsageError) as e:
        if w.mode != "auto":
            raise
        log.warning("wandb: no answer from the server (%s); logging offline",
                    (str(e).splitlines() or [type(e).__name__])[0][:120])
        mode, run = "offline", wandb.init(mode="offline", **args)
    log.info("wandb: %s mode", mode)
    return run


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators(urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
                                             .hostname) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def loggers(cfg: DictConfig, run_dir: Path, name: str) -> list:
    """The CSV logger (always first) and, with `logger.wandb`, W&B (rank 0 only), both
    writing into run_dir."""
    from lightning.pytorch.loggers import CSVLogger

    out = [CSVLogger(save_dir=str(run_dir), name="csv", version="")]
    w = None if distributed.is_worker() else cfg.logger.get("wandb")  # rank 0 reports for all ranks
    run = None if w is None else wandb_init(w, run_dir, name, tags=list(w.tags),
                                            config=OmegaConf.to_container(cfg, resolve=True))
    if run is not None:
        from lightning.pytorch.loggers import WandbLogger

        out.append(WandbLogger(experiment=run, save_dir=str(run_dir)))
    return out


def finish_loggers(lg: list, metrics: dict | None = None, step: int = 0) -> None:
    """Log `metrics` (flattened, as final/<key>) to every logger; without metrics, close
    them (the W&B run is finished: a sweep's next job starts its own)."""
    if metrics is not None:
        for lgr in lg:
            lgr.log_metrics({f"final/{k}": v for k, v in _numbers(metrics).items()}, step=step)
        return
    for lgr in lg:
        if type(lgr).__name__ == "WandbLogger":
            lgr.experiment.finish()


def _numbers(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
        elif isinstance(v, list) and all(isinstance(x, int | float) for x in v) and k != "groups":
            out.update({f"{prefix}{k}_{i}": x for i, x in enumerate(v)})
    return out
