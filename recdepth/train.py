"""`python -m recdepth.train`: train a looped GPT-2, then evaluate it under an exit rule.

    python -m recdepth.train model=grouped exit=accel
    python -m recdepth.train model=grouped exit=accel --multirun exit.tau=1e-5,1e-4,1e-3,1e-2

`train(cfg)` is a plain function returning the run's metrics (the dict written to
metrics.json), so sweepers and tests can call it directly. The recipe: validate the
config, find the training directory of its identity (recdepth/training/runs.py), train there
unless it holds a finished run (resuming its last checkpoint if it holds one), then
evaluate under cfg.exit. The job directory (`run_dir`) gets

    config.yaml     the resolved config
    metrics.json    val_ce, val_ppl, unigram_ce, train_seconds, tokens_seen, ..., eval{...}
    eval_tokens.csv the exit evaluation, one row per scored token
    train/          -> <runs_dir>/<identity>/: checkpoints/last.ckpt, csv/metrics.csv,
                       diagnostics/step_<n>.json, figures/ (Figs. 1, 2, 3, 5), trained.json
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from recdepth.app.checkpoints import start_from
from recdepth.app.jobs import evaluate_trained
from recdepth.cli.runner import hydra_main, refuse, start_job, task
from recdepth.cli.runner import job_dir as cli_job_dir
from recdepth.config import build
from recdepth.config.groups import EVAL_FROM_CHECKPOINT
from recdepth.config.schema import TrainConfig, validated
from recdepth.core.runtime import tune_cpu_allocator
from recdepth.training import distributed
from recdepth.training.lit import LoopedLM, TrainingDiverged
from recdepth.training.runs import TrainingRun, job_dir_lock, write_json

log = logging.getLogger("recdepth.train")


def train(cfg: DictConfig) -> dict:
    """Train (or reuse, or resume) cfg's training run, evaluate it under cfg.exit; write
    and return metrics.json's dict."""
    job_dir = cli_job_dir(cfg, "train")
    typed = validated(cfg)  # every field, before any work (recdepth/config/schema.py)
    distributed.check_launch(typed.trainer.strategy)  # and how this process was started
    policy = build.exit_policy(typed)
    run = TrainingRun(cfg)
    if distributed.is_worker():  # a DDP rank > 0: rank 0 decided everything and writes everything
        return fit(typed, run, job_dir, run.resume_step(typed.trainer.max_steps),
                   build.loggers(cfg, run.dir, job_dir.name))
    refuse(job_dir, "metrics.json")
    job_dir.mkdir(parents=True, exist_ok=True)
    lg: list = []
    try:
        with job_dir_lock(job_dir):
            with run.locked():
                start_job(job_dir, cfg)
                run.link(job_dir)
                metrics = run.trained()
                if metrics is not None:
                    log.info("reuse: training identity %s finished before in %s; evaluating its checkpoint",
                             run.identity, run.dir)
                    metrics = {**metrics, "reused": True, "model": cfg.model.name}
                else:
                    lg = build.loggers(cfg, run.dir, name=job_dir.name)
                    metrics = fit(typed, run, job_dir, run.resume_step(typed.trainer.max_steps), lg)
            metrics["train_dir"] = str(run.dir)
            if cfg.eval.tokens > 0:  # outside the identity lock: jobs of one identity evaluate side by side
                metrics["eval"] = evaluate_trained(run.ckpt, cfg, policy, job_dir)
            write_json(job_dir / "metrics.json", metrics)
            build.finish_loggers(lg, metrics, step=metrics["steps"])
    finally:
        build.finish_loggers(lg)
    log.info("val_ce %.4f (unigram %.4f), run dir %s, training dir %s", metrics["val_ce"], metrics["unigram_ce"],
             job_dir, run.dir)
    return metrics


def fit(cfg: TrainConfig, run: TrainingRun, job_dir: Path, resume_step: int | None, lg: list) -> dict:
    """Fit in run.dir (from its last.ckpt at `resume_step`, or from scratch) with loggers
    `lg` (CSV first), validate, and on rank 0 mark the run finished; return the training
    metrics (rank 0) or {} (other ranks)."""
    tune_cpu_allocator()
    L.seed_everything(cfg.seed, workers=True)
    dm = build.data_module(cfg, block_size=cfg.model.shape()["block_size"])
    dm.prepare_data()
    dm.setup()
    mcfg = build.model_config(cfg, vocab_size=dm.vocab_size, n_other=dm.n_other)  # the vocabulary is the data's
    module = LoopedLM(model=mcfg.to_dict(), sampler=build.sampler_args(cfg), optim=dataclasses.asdict(cfg.optim),
                      max_steps=cfg.trainer.max_steps, seed=cfg.seed, peak_flops=cfg.trainer.peak_flops,
                      loss=dataclasses.asdict(cfg.loss), halt=dataclasses.asdict(cfg.halt))
    if cfg.halt.init_from and resume_step is None:  # a halting head on a trained model (halt.init_from)
        start_from(module, cfg.halt.init_from)
    module.data_config = dataclasses.asdict(cfg.data)
    module.training_config = run.training
    if cfg.data.source == "task":  # a task checkpoint evaluates itself (its experiment's eval settings)
        module.eval_config = {k: getattr(cfg.eval, k) for k in EVAL_FROM_CHECKPOINT}
        module.frontier_config = cfg.frontier.carried()
    if mcfg.logit_bias:
        module.model.init_logit_bias(torch.as_tensor(dm.unigram_log_prior()))
    if dm.id_map is not None:
        module.vocab_to_gpt2 = torch.as_tensor(dm.id_map)
    log.info("model: %s, %.2fM parameters, groups %s, vocab %d (padded %d); training dir %s", cfg.model.name,
             module.model.num_params() / 1e6, mcfg.groups, mcfg.vocab_size, mcfg.padded_vocab_size, run.dir)

    t = cfg.trainer
    worker = distributed.is_worker()
    curves = [] if worker else run.rewind(resume_step)
    callbacks = [ModelCheckpoint(dirpath=str(run.ckpt.parent), save_last=True, save_top_k=0,
                                 every_n_train_steps=t.checkpoint_every, enable_version_counter=False),
                 LearningRateMonitor(logging_interval="step")]
    dyn = build.loop_dynamics_callback(cfg, run.dir, dm, mcfg)
    if dyn is not None:
        callbacks.append(dyn)
    for row in curves:  # the CSV logger starts its file afresh
        lg[0].log_metrics({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
    trainer = L.Trainer(
        max_steps=t.max_steps, val_check_interval=min(t.val_check_interval, t.max_steps),
        check_val_every_n_epoch=None, gradient_clip_val=t.gradient_clip_val,
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
        strategy=distributed.strategy(t, job_dir), precision=t.precision,
        use_distributed_sampler=False,  # TokenDataModule shards by rank itself
        log_every_n_steps=t.log_every_n_steps, enable_progress_bar=t.enable_progress_bar,
        logger=lg, callbacks=callbacks, default_root_dir=str(run.dir), num_sanity_val_steps=0,
        enable_model_summary=False,
    )
    if t.compile:
        # Each transformer block, in place (nn.Module.compile: parameter names, hence
        # checkpoints, stay as they are). Not the whole model: its Python loops unroll per
        # drawn loop count, and every new count would be a recompilation.
        for block in module.model.h:
            block.compile()
    try:
        try:
            trainer.fit(module, datamodule=dm, ckpt_path=None if resume_step is None else "last", weights_only=True)
        except TrainingDiverged as e:
            kept = (f"the last good checkpoint is {run.ckpt} (step "
                    f"{torch.load(run.ckpt, map_location='cpu', weights_only=True)['global_step']})"
                    if run.ckpt.is_file() else "no checkpoint had been written yet")
            raise TrainingDiverged(f"{e}; {kept}") from None
        # The periodic checkpoint may predate the last steps: always save the final state.
        trainer.save_checkpoint(run.ckpt, weights_only=False)  # full: resumable
        if trainer.global_step % trainer.val_check_batch != 0 or "val/ce" not in trainer.callback_metrics:
            trainer.validate(module, datamodule=dm, verbose=False)
        if not trainer.is_global_zero:
            return {}
        distributed.teardown(trainer)  # the ranks are done: only rank 0 goes on
        val_ce = float(trainer.callback_metrics["val/ce"])
        metrics = {
            "val_ce": val_ce, "val_ppl": float(torch.exp(torch.tensor(val_ce))), "unigram_ce": dm.unigram_ce(),
            "train_seconds": module.train_seconds,
            "tokens_seen": trainer.global_step * cfg.batch_size * mcfg.block_size * trainer.world_size,
            "steps": trainer.global_step, "model": cfg.model.name, "groups": mcfg.groups,
            "params": module.model.num_params(), "identity": run.identity,
        }
        if dyn is not None:
            metrics["diagnostics_seconds"] = dyn.seconds
        if resume_step is not None:
            metrics["resumed_from"] = {"checkpoint": str(run.ckpt), "step": resume_step}
        run.finish(metrics)
        return metrics
    finally:
        distributed.teardown(trainer, failed=sys.exc_info()[0] is not None)


_task = task(train, "val_ce")  # the Hydra task (recdepth/cli/runner.py)
_main = hydra_main(_task, "config")


def ddp_rank(argv: list[str]) -> None:
    """A DDP rank > 0, started by rank 0 (recdepth/training/distributed.py) as
    `python -m recdepth.train --ddp-rank <run_dir>/config.yaml`: trains the run rank 0
    composed (resuming the checkpoint rank 0 resumes), with no Hydra."""
    if len(argv) != 1 or not distributed.is_worker():
        raise SystemExit("recdepth.train --ddp-rank: started by recdepth's DDP launcher only "
                         "(use `python -m recdepth.train trainer=ddp`)")
    logging.basicConfig(level=logging.WARNING)
    train(OmegaConf.load(argv[0]))


def main() -> None:
    if sys.argv[1:2] == [distributed.RANK_FLAG]:
        return ddp_rank(sys.argv[2:])
    _main()


if __name__ == "__main__":
    # Run the main of the importable module recdepth.train, not of this __main__ copy: a
    # launcher that pickles the job (submitit) then pickles it by reference. By value,
    # cloudpickle's submodule guess drags in unpicklable torch config modules.
    import recdepth.train

    recdepth.train.main()
