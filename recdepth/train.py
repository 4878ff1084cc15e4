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
import sys
from pathlib import Path

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from recdepth import distributed, exits
from recdepth.config import (
    conf_dir,
    data_module,
    exit_policy,
    loggers,
    loop_dynamics_callback,
    model_config,
    model_shape,
    sampler_args,
    validate_run,
)
from recdepth.evaluate import eval_after_training, reuse_trained
from recdepth.lit import LoopedLM, TrainingDiverged
from recdepth.runs import (
    FileLock,
    carry_over,
    check_resumable,
    earlier_curves,
    find_resume,
    index_files,
    read_entry,
    register_partial,
    registered,
    same_training,
    training_identity,
    write_json,
)
from recdepth.runtime import tune_cpu_allocator
from recdepth.sampler import LoopSampler
from recdepth.sweep import guarded, run_hydra_main

log = logging.getLogger("recdepth.train")


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
                                on_trained=lambda m: registered(finished, identity, run_dir, m, lock))
    finally:
        lock.release()
        owner.release()


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
            metrics["eval"] = eval_after_training(module.model, dm, policy, cfg, run_dir)
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


def ddp_rank(argv: list[str]) -> None:
    """A DDP rank > 0, started by rank 0 (recdepth/distributed.py) as
    `python -m recdepth.train --ddp-rank <run_dir>/config.yaml <checkpoint | null>`: trains
    the run rank 0 composed, with rank 0's resume decision, and no Hydra."""
    if len(argv) != 2 or not distributed.is_worker():
        raise SystemExit("recdepth.train --ddp-rank: started by recdepth's DDP launcher only "
                         "(use `python -m recdepth.train trainer=ddp`)")
    logging.basicConfig(level=logging.WARNING)
    cfg = OmegaConf.load(argv[0])
    cfg.ckpt_path = None if argv[1] == "null" else argv[1]
    train(cfg)


def main() -> None:
    if sys.argv[1:2] == [distributed.RANK_FLAG]:
        return ddp_rank(sys.argv[2:])
    run_hydra_main(_hydra_main)


if __name__ == "__main__":
    main()
