"""The run config: where `conf/` is, the checks of the fields a run uses (one line naming
the field each), and the objects built from it (model config, sampler arguments, exit
policy, data module, loop-dynamics callback, loggers).

Lightning glue, below the entry points (`train`, `evaluate`, `bench`, `sweep`), which all
read their config through this module; it imports only the core and the other glue
modules (docs: recdepth/__init__.py, layers).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import urlparse

import torch
from omegaconf import DictConfig, OmegaConf

from recdepth import distributed, exits
from recdepth.data import TokenDataModule
from recdepth.decoding import validate_eval
from recdepth.model import GPTConfig

log = logging.getLogger("recdepth.config")


def conf_dir() -> str:
    """The config groups: always `recdepth/conf` beside this file. In a source checkout
    that is a symlink to the repository's top-level `conf/` (where the layout keeps it,
    mirroring the code); a wheel ships the files there (pyproject: package `recdepth.conf`)."""
    d = Path(__file__).resolve().parent / "conf"
    if not (d / "config.yaml").is_file():
        raise FileNotFoundError(f"recdepth: no config.yaml in {d} (a broken install? reinstall recdepth)")
    return str(d)


# ------------------------------------------------------------------- pieces
def model_config(cfg: DictConfig, vocab_size: int, n_other: int = 0) -> GPTConfig:
    m = cfg.model
    return GPTConfig.from_size(
        m.size, n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, block_size=m.block_size,
        groups=OmegaConf.to_object(m.groups), state_init=m.state_init, logit_bias=m.logit_bias,
        mean_recurrence=cfg.sampler.mean, vocab_size=vocab_size, n_other=n_other,
    )


def sampler_args(cfg: DictConfig) -> dict:
    s = cfg.sampler
    return dict(name=s.name, mean=s.mean, sigma=s.sigma, backprop_depth=s.backprop_depth)


PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def validate_run(cfg: DictConfig) -> None:
    """The top-level and trainer fields a run uses, checked before any work (one line each)."""
    def need_int(field: str, lo: int) -> None:
        v = OmegaConf.select(cfg, field)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{field}: expected an integer >= {lo}, got {v!r}")

    for field, lo in (("seed", 0), ("batch_size", 1), ("trainer.max_steps", 1), ("trainer.val_check_interval", 1),
                      ("trainer.checkpoint_every", 1), ("trainer.log_every_n_steps", 1)):
        need_int(field, lo)
    validate_eval(cfg.eval)
    clip = cfg.trainer.gradient_clip_val
    if clip is not None and (not isinstance(clip, int | float) or isinstance(clip, bool) or not clip >= 0):
        raise ValueError(f"trainer.gradient_clip_val: expected a number >= 0 or null, got {clip!r}")
    o = cfg.optim
    for field in ("lr", "weight_decay", "eps", "min_lr_ratio"):
        v = o[field]
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0 or v != v or v == float("inf"):
            raise ValueError(f"optim.{field}: expected a finite number >= 0, got {v!r}")
    if not o.lr > 0:
        raise ValueError(f"optim.lr: expected a number > 0, got {o.lr!r}")
    if not (len(o.betas) == 2 and all(isinstance(b, int | float) and 0 <= b < 1 for b in o.betas)):
        raise ValueError(f"optim.betas: expected two numbers in [0, 1), got {list(o.betas)!r}")
    need_int("optim.warmup_steps", 0)
    t = cfg.trainer
    if t.precision not in PRECISIONS:
        raise ValueError(f"trainer.precision: expected one of {', '.join(PRECISIONS)}, got {t.precision!r}")
    if t.accelerator not in ACCELERATORS:
        raise ValueError(f"trainer.accelerator: expected one of {', '.join(ACCELERATORS)}, got {t.accelerator!r}")
    if t.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.accelerator: {t.accelerator} asked for, but torch {torch.__version__} sees no CUDA "
                         "device (CPU build, or CUDA_VISIBLE_DEVICES empty?); on a CPU leave trainer=default")
    if not isinstance(t.compile, bool):
        raise ValueError(f"trainer.compile: expected true or false, got {t.compile!r}")


def exit_policy(cfg: DictConfig) -> exits.ExitPolicy:
    e = cfg.exit
    return exits.build(e.name, e.tau, min_steps=e.min_steps, max_steps=e.max_steps)


def data_module(cfg: DictConfig, block_size: int) -> TokenDataModule:
    if "paths" in cfg.data.keys() and OmegaConf.is_missing(cfg.data, "paths"):  # `in` is False for ???
        raise ValueError("data.paths: required for data=files (a file, directory or glob, or a list of them)")
    d = OmegaConf.to_container(cfg.data, resolve=True)
    if isinstance(d.get("paths"), str):
        d["paths"] = [d["paths"]]
    return TokenDataModule(block_size=block_size, batch_size=cfg.batch_size,
                           max_steps=cfg.trainer.max_steps, seed=cfg.seed, **d)


def loop_dynamics_callback(cfg: DictConfig, run_dir: Path, dm: TokenDataModule, mcfg: GPTConfig):
    """The `LoopDynamics` callback of `callbacks.loop_dynamics`, or None when the config has
    none. Its fixed held-out batch is the first sequences × seq_len val tokens."""
    c = cfg.get("callbacks", {}).get("loop_dynamics")
    if c is None:
        return None
    if not mcfg.groups:
        raise ValueError(f"callbacks.loop_dynamics: model={cfg.model.name} has no recurrence groups "
                         "(no loops to measure); use callbacks=none")
    from recdepth.callbacks import LoopDynamics

    T = mcfg.block_size if c.seq_len is None else int(c.seq_len)
    if not 2 <= T <= mcfg.block_size:
        raise ValueError(f"callbacks.loop_dynamics.seq_len: expected 2..{mcfg.block_size} (the block size), got {T}")
    if c.sequences < 1:
        raise ValueError(f"callbacks.loop_dynamics.sequences: expected >= 1, got {c.sequences}")
    batch = torch.as_tensor(dm.heldout_tokens(c.sequences * T)).view(c.sequences, T)
    return LoopDynamics(batch, run_dir, every_n_steps=c.every_n_steps, loops=c.loops,
                        pca_sequence=c.pca_sequence, pca_tokens=c.pca_tokens,
                        max_state_bytes=c.max_state_bytes, seed=c.seed, figures=c.figures,
                        decode=dm.decode)


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
    settings = wandb.Settings(init_timeout=float(w.get("init_timeout", 15)), silent=True)
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


def model_shape(mcfg: GPTConfig) -> dict:
    """The fields that fix a model's parameter shapes (vocabulary aside)."""
    return {"n_layer": mcfg.n_layer, "n_head": mcfg.n_head, "n_embd": mcfg.n_embd,
            "block_size": mcfg.block_size, "groups": [list(g) for g in mcfg.groups]}
