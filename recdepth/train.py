"""`python -m recdepth.train`: train a looped GPT-2, then evaluate it under an exit rule.

    python -m recdepth.train model=grouped exit=accel
    python -m recdepth.train model=grouped exit=accel --multirun exit.tau=1e-5,1e-4,1e-3,1e-2

`train(cfg)` is a plain function returning the run's metrics (the dict written to
metrics.json), so sweepers and tests can call it directly. Every run directory holds:

    config.yaml             the resolved config
    checkpoints/last.ckpt   the final Lightning checkpoint
    metrics.json            val_ce, val_ppl, unigram_ce, train_seconds, tokens_seen, eval{...}
    csv/metrics.csv         the training curves (and wandb/ with logger=wandb)
    diagnostics/step_<n>.json   loop geometry at step 0 and every checkpoint (callbacks=loop_dynamics)
    figures/                the paper's Figs. 1, 2, 3, 5 (PNG + PDF), drawn at the end
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from recdepth import distributed, exits
from recdepth.data import TokenDataModule
from recdepth.decoding import validate_eval
from recdepth.lit import LoopedLM, TrainingDiverged
from recdepth.model import GPTConfig
from recdepth.runs import (  # noqa: F401 (re-exported: training_identity and the index are public here)
    NOT_TRAINING,
    TRAINING_KEYS,
    FileLock,
    carry_over,
    check_resumable,
    earlier_curves,
    find_resume,
    index_files,
    read_entry,
    register_partial,
    register_trained,
    training_identity,
    write_json,
)
from recdepth.runtime import tune_cpu_allocator
from recdepth.sampler import LoopSampler
from recdepth.sweep import guarded, hoist_mode_flags, run_hydra_main  # noqa: F401 (hoist_mode_flags: public)

log = logging.getLogger("recdepth.train")


def conf_dir() -> str:
    """`conf/` ships inside the wheel as recdepth/conf; in a source checkout (editable
    install) it sits at the top of the repository."""
    here = Path(__file__).resolve().parent
    for cand in (here / "conf", here.parent / "conf"):
        if (cand / "config.yaml").is_file():
            return str(cand)
    raise FileNotFoundError(f"recdepth: no conf/config.yaml next to {here} or its parent")


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


def wandb_mode(requested: str, timeout: float = 2.0) -> str:
    """Resolve `auto`: online only if an API key is configured and the server accepts a
    TCP connection within `timeout` seconds; otherwise offline. Never blocks longer."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "online"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    if not has_key:
        try:
            import netrc

            has_key = netrc.netrc().authenticators("api.wandb.ai") is not None
        except (OSError, netrc.NetrcParseError):
            has_key = False
    if not has_key:
        return "offline"
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return "online"
    except OSError:
        return "offline"


def loggers(cfg: DictConfig, run_dir: Path) -> list:
    from lightning.pytorch.loggers import CSVLogger

    out = [CSVLogger(save_dir=str(run_dir), name="csv", version="")]
    w = cfg.logger.get("wandb")
    if w is not None:
        mode = wandb_mode(w.mode)
        if mode != "disabled":
            from lightning.pytorch.loggers import WandbLogger

            os.environ.setdefault("WANDB_SILENT", "true")
            out.append(WandbLogger(
                project=w.project, entity=w.entity, save_dir=str(run_dir), offline=mode == "offline",
                name=run_dir.name, tags=list(w.tags), config=OmegaConf.to_container(cfg, resolve=True),
            ))
            log.info("wandb: %s mode", mode)
    return out


# -------------------------------------------------------------- reuse / eval
def exit_eval(model, dm: TokenDataModule, policy: exits.ExitPolicy, cfg: DictConfig, run_dir: Path) -> dict:
    """SPEC §4 evaluation of `model` on the first eval.tokens held-out tokens; writes
    run_dir/eval_tokens.csv and returns the `eval` block."""
    from recdepth.evaluate import run_eval

    heldout = torch.as_tensor(dm.heldout_tokens(cfg.eval.tokens + 1))
    vocab = None if dm.id_map is None else torch.as_tensor(dm.id_map)
    return run_eval(model, heldout, policy, cfg, run_dir, vocab)


def reuse_trained(cfg: DictConfig, run_dir: Path, policy: exits.ExitPolicy,
                  identity: str, index: Path, entry: dict) -> dict:
    """A training run with this identity finished before: evaluate its checkpoint instead."""
    log.info("reuse: training identity %s was trained by %s; reusing its checkpoint %s (index %s; "
             "reuse.enabled=false trains again)", identity, entry["run_dir"], entry["checkpoint"], index)
    metrics = {**entry["training"], "reused": True, "trained_run": entry["run_dir"],
               "checkpoint": entry["checkpoint"]}
    if cfg.eval.tokens > 0:
        dm = data_module(cfg, block_size=model_config(cfg, vocab_size=50257).block_size)
        dm.prepare_data()
        dm.setup()
        device = torch.device("cuda" if cfg.trainer.accelerator in ("auto", "gpu", "cuda")
                              and torch.cuda.is_available() else "cpu")
        module = LoopedLM.load_from_checkpoint(entry["checkpoint"], map_location=device, weights_only=True)
        metrics["eval"] = exit_eval(module.model.to(device), dm, policy, cfg, run_dir)
    write_json(run_dir / "metrics.json", metrics)
    return metrics


# -------------------------------------------------------------------- train
def train(cfg: DictConfig) -> dict:
    """Train, validate, evaluate under cfg.exit; write and return metrics.json's dict.

    Before any work: validate the config, then, holding the training identity's lock,
    reuse a finished run of the same identity, or resume an interrupted one (`ckpt_path`,
    recdepth/runs.py), or start fresh."""
    try:
        run_dir = Path(cfg.run_dir)
    except Exception:  # ${hydra:...} does not resolve outside a Hydra run
        raise ValueError("run_dir: set run_dir=<directory> when calling train(cfg) outside Hydra") from None
    # Validate everything that can be validated before any work starts.
    validate_run(cfg)
    policy = exit_policy(cfg)
    probe = model_config(cfg, vocab_size=50257)  # validates the model fields
    LoopSampler(n_groups=len(probe.groups), **sampler_args(cfg))  # and the sampler's
    distributed.strategy(cfg.trainer)  # and the trainer's
    identity, training = training_identity(cfg)
    training["model_shape"] = model_shape(probe)  # also checked against a resumed checkpoint's
    if distributed.is_worker():  # a DDP rank > 0: rank 0 decided everything and writes everything
        return fit_and_evaluate(cfg, run_dir, policy, identity, training, resume=cfg.get("ckpt_path"))

    if (run_dir / "metrics.json").exists():
        raise FileExistsError(f"run_dir: {run_dir} already holds metrics.json; choose a new run_dir")
    finished, partial, lock_file = index_files(cfg, identity) if cfg.reuse.enabled else (None, None, None)
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = FileLock(run_dir / ".lock")  # two runs started in the same second share a Hydra run dir
    try:
        owner.acquire(wait=False)
    except BlockingIOError as e:
        raise FileExistsError(f"run_dir: {run_dir} is in use by another recdepth run ({e}); choose a new run_dir") from None
    lock = FileLock(lock_file)
    try:
        lock.acquire()
        entry = read_entry(finished) if finished is not None else None
        resume = None if entry is not None else find_resume(cfg, run_dir, partial)
        step, restart = 0, False
        if resume is not None:
            step = check_resumable(resume, training, cfg.trainer.max_steps)
        elif entry is None and (run_dir / "checkpoints" / "last.ckpt").is_file():  # ckpt_path=null
            raise FileExistsError(f"run_dir: {run_dir} already holds checkpoints/last.ckpt and ckpt_path=null "
                                  "starts fresh; choose a new run_dir (or resume it: ckpt_path=last)")
        elif entry is None and any(run_dir.glob("diagnostics/step_*.json")):
            if not same_training(run_dir, identity):
                raise FileExistsError(f"run_dir: {run_dir} already holds diagnostics/step_*.json of another run; "
                                      "choose a new run_dir")
            # This run, stopped before its first checkpoint (a requeued job): start it again.
            # Training is deterministic, so the diagnostics it wrote are the ones it will write.
            log.info("run_dir: %s was stopped before its first checkpoint; training it again from step 0", run_dir)
            restart = True
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if entry is not None:
            lock.release()
            return reuse_trained(cfg, run_dir, policy, identity, finished, entry)
        if resume is not None:
            carry_over(resume, step, run_dir)
        if partial is not None:
            register_partial(partial, identity, run_dir, resumed_from=resume)
        return fit_and_evaluate(cfg, run_dir, policy, identity, training, resume=resume, resumed_step=step,
                                keep_diagnostics=restart,
                                on_trained=lambda m: _registered(finished, identity, run_dir, m, lock))
    finally:
        lock.release()
        owner.release()


def same_training(run_dir: Path, identity: str) -> bool:
    """Whether run_dir's config.yaml (written by the run that used it) has this training identity."""
    try:
        return training_identity(OmegaConf.load(run_dir / "config.yaml"))[0] == identity
    except Exception:  # no config.yaml, or one from another version of the config
        return False


def _registered(finished: Path | None, identity: str, run_dir: Path, metrics: dict, lock: FileLock) -> None:
    """Training finished: record it in the index and let the next process of this identity in."""
    if finished is not None:
        register_trained(finished, identity, run_dir, metrics)
    lock.release()


def model_shape(mcfg: GPTConfig) -> dict:
    """The fields that fix a model's parameter shapes (vocabulary aside)."""
    return {"n_layer": mcfg.n_layer, "n_head": mcfg.n_head, "n_embd": mcfg.n_embd,
            "block_size": mcfg.block_size, "groups": [list(g) for g in mcfg.groups]}


def fit_and_evaluate(cfg: DictConfig, run_dir: Path, policy: exits.ExitPolicy, identity: str, training: dict,
                     resume: Path | str | None = None, resumed_step: int = 0, keep_diagnostics: bool = False,
                     on_trained=None) -> dict:
    """Fit (from `resume` if given), validate, evaluate; rank 0 writes metrics.json."""
    tune_cpu_allocator()
    L.seed_everything(cfg.seed, workers=True)
    probe = model_config(cfg, vocab_size=50257)
    dm = data_module(cfg, block_size=probe.block_size)
    dm.prepare_data()
    dm.setup()
    mcfg = model_config(cfg, vocab_size=dm.vocab_size, n_other=dm.n_other)
    module = LoopedLM(
        model=mcfg.to_dict(),
        sampler=sampler_args(cfg),
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        max_steps=cfg.trainer.max_steps, seed=cfg.seed, peak_flops=cfg.trainer.peak_flops,
    )
    module.data_config = OmegaConf.to_container(cfg.data, resolve=True)
    module.training_config = training
    if mcfg.logit_bias:
        module.model.init_logit_bias(torch.as_tensor(dm.unigram_log_prior()))
    if dm.id_map is not None:
        module.vocab_to_gpt2 = torch.as_tensor(dm.id_map)
    log.info("model: %s, %.2fM parameters, groups %s, vocab %d (padded %d)", cfg.model.name,
             module.model.num_params() / 1e6, mcfg.groups, mcfg.vocab_size, mcfg.padded_vocab_size)

    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    t = cfg.trainer
    ckpt = ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), save_last=True, save_top_k=0,
                           every_n_train_steps=t.checkpoint_every)
    callbacks = [ckpt, LearningRateMonitor(logging_interval="step")]
    dyn = loop_dynamics_callback(cfg, run_dir, dm, mcfg)
    if dyn is not None:
        dyn.keep_existing = keep_diagnostics
        callbacks.append(dyn)
    lg = loggers(cfg, run_dir)
    if resume is not None and not distributed.is_worker():
        for row in earlier_curves(Path(resume), resumed_step):  # the CSV logger starts its file afresh
            lg[0].log_metrics({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
    trainer = L.Trainer(
        max_steps=t.max_steps, val_check_interval=min(t.val_check_interval, t.max_steps),
        check_val_every_n_epoch=None, gradient_clip_val=t.gradient_clip_val,
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.get("num_nodes", 1),
        strategy=distributed.strategy(t, run_dir, resume),
        precision=t.precision, use_distributed_sampler=False,  # TokenDataModule shards by rank itself
        log_every_n_steps=t.log_every_n_steps, enable_progress_bar=t.enable_progress_bar,
        logger=lg, callbacks=callbacks,
        default_root_dir=str(run_dir), num_sanity_val_steps=0, enable_model_summary=False,
    )
    if t.compile:
        # Each transformer block, in place (nn.Module.compile: parameter names, hence
        # checkpoints, stay as they are). Not the whole model: its Python loops unroll per
        # drawn loop count, and every new count would be a recompilation.
        for block in module.model.h:
            block.compile()
    try:
        try:
            trainer.fit(module, datamodule=dm, ckpt_path=None if resume is None else str(resume), weights_only=True)
        except TrainingDiverged as e:
            last = run_dir / "checkpoints" / "last.ckpt"
            kept = (f"the last good checkpoint is {last} (step "
                    f"{torch.load(last, map_location='cpu', weights_only=True)['global_step']})"
                    if last.is_file() else "no checkpoint had been written yet")
            raise TrainingDiverged(f"{e}; {kept}") from None
        train_seconds = module.train_seconds
        # The periodic checkpoint may predate the last steps: always save the final state.
        trainer.save_checkpoint(run_dir / "checkpoints" / "last.ckpt", weights_only=False)  # full: resumable
        if trainer.global_step % trainer.val_check_batch != 0 or "val/ce" not in trainer.callback_metrics:
            trainer.validate(module, datamodule=dm, verbose=False)
        if not trainer.is_global_zero:
            return {}
        distributed.teardown(trainer)  # the ranks are done: only rank 0 evaluates
        val_ce = float(trainer.callback_metrics["val/ce"])
        metrics = {
            "val_ce": val_ce,
            "val_ppl": float(torch.exp(torch.tensor(val_ce))),
            "unigram_ce": dm.unigram_ce(),
            "train_seconds": train_seconds,
            "tokens_seen": trainer.global_step * cfg.batch_size * mcfg.block_size * trainer.world_size,
            "steps": trainer.global_step,
            "model": cfg.model.name,
            "groups": mcfg.groups,
            "params": module.model.num_params(),
        }
        if dyn is not None:
            metrics["diagnostics_seconds"] = dyn.seconds
        metrics["identity"] = identity
        if resume is not None:
            metrics["resumed_from"] = {"checkpoint": str(Path(resume).resolve()), "step": resumed_step}
        if on_trained is not None:
            on_trained(metrics)
        if cfg.eval.tokens > 0:
            # Lightning moves the module back to the CPU at teardown; evaluate (and time)
            # on the device that trained it, eagerly: token-by-token decoding changes the
            # cache position every call, which a compiled block would recompile for.
            if t.compile:
                for block in module.model.h:
                    block._compiled_call_impl = None  # undoes nn.Module.compile (torch keeps it there)
            module.to(trainer.strategy.root_device)
            metrics["eval"] = exit_eval(module.model, dm, policy, cfg, run_dir)
        write_json(run_dir / "metrics.json", metrics)
        for lgr in lg:
            lgr.log_metrics({f"final/{k}": v for k, v in _flat(metrics).items()}, step=trainer.global_step)
        log.info("val_ce %.4f (unigram %.4f), %.0f s, run dir %s", val_ce, metrics["unigram_ce"],
                 train_seconds, run_dir)
        return metrics
    finally:
        distributed.teardown(trainer, failed=sys.exc_info()[0] is not None)
        for lgr in lg:
            if type(lgr).__name__ == "WandbLogger":
                import wandb

                wandb.finish()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
        elif isinstance(v, list) and all(isinstance(x, (int, float)) for x in v) and k != "groups":
            out.update({f"{prefix}{k}_{i}": x for i, x in enumerate(v)})
    return out


@hydra.main(config_path=conf_dir(), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float:
    return guarded(train, cfg, "val_ce")


def main() -> None:
    run_hydra_main(_hydra_main)


if __name__ == "__main__":
    main()
