"""`python -m recdepth.evaluate ckpt=<path> exit=accel exit.tau=1e-3`: score a trained checkpoint
under an exit rule, token by token with a KV cache (SPEC §4), without training anything.

    python -m recdepth.evaluate ckpt=outputs/2026-11-22/10-00-00/train/checkpoints/last.ckpt exit=kl
    python -m recdepth.evaluate ckpt=<path> --multirun exit=fixed,stepnorm,kl,accel exit.tau=1e-5,1e-4,1e-3,1e-2

    python -m recdepth.evaluate hf=/models/huginn-0125 dtype=bfloat16 device=cuda exit=kl data=files data.paths=/text

The held-out text is the checkpoint's own val split: the data config and the compact
vocabulary travel in the checkpoint, so the tokens are exactly those the training run
held out. A Hugging Face checkpoint directory (`hf=`, Huginn's format) brings its own
tokenizer.json; its held-out text is the tail (data.val_fraction) of the documents of
`data` (default: the shipped Shakespeare), tokenized with it (`checkpoints.open_model`). Each run directory gets `config.yaml`, `metrics.json` with the same `eval`
block as a training run, and `eval_tokens.csv`, one row per scored token (`write_eval`);
a multirun also gets the sweep summary (`recdepth.sweep`), with the fixed-depth frontier
when the sweep has fixed-depth jobs (`make frontier`).
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

from recdepth.app.checkpoints import open_model, resolve_device
from recdepth.app.jobs import SWEEP, Precomputed, for_model, run_eval, split_start
from recdepth.cli.runner import hydra_main, job_dir, refuse, start_job, task
from recdepth.config.build import exit_policy
from recdepth.config.groups import EVAL_FROM_CHECKPOINT
from recdepth.config.schema import validated
from recdepth.training.runs import write_json

log = logging.getLogger("recdepth.evaluate")


def evaluate(cfg: DictConfig, record: dict | None = None, opened=None,
             precomputed: Precomputed | None = None) -> dict:
    """Evaluate cfg.ckpt (or cfg.hf) under cfg.exit; write and return metrics.json's dict
    (with `record`'s keys first: what a caller such as recdepth.report files with the job).
    `opened`: the model when the caller has it open already (`checkpoints.open_model`).
    `precomputed`: results decoded ahead of this job with its sweep
    (`jobs.decode_shared`); the job takes its own from it, if there, instead of decoding."""
    run_dir = job_dir(cfg, "evaluate")
    run = validated(cfg)  # every field, before any work (recdepth/config/schema.py)
    policy = exit_policy(run)  # the validated object: the config is validated once
    refuse(run_dir, "metrics.json")
    device = resolve_device(cfg.device)
    shared = None if precomputed is None else precomputed.take(cfg)  # the model it was decoded with, its results
    opened = shared[0] if shared else (opened or open_model(run, device))
    model = opened.model
    policy = for_model(policy, opened)
    start = split_start(opened, OmegaConf.select(cfg, "eval.split") or "test")
    n = cfg.eval.tokens + 1
    tokens, labels = (None, None) if shared else (opened.heldout(n, start), opened.labels(n, start))
    targets = None if shared else opened.targets(n, start)  # a task's scored stream (in-place targets)
    start_job(run_dir, cfg)
    ev = run_eval(model, tokens, policy, cfg, run_dir, opened.vocab_to_gpt2, bos=opened.bos, labels=labels,
                  shared=shared[1] if shared else None, targets=targets)
    taken = OmegaConf.select(cfg, "eval.from_checkpoint") or []  # a task checkpoint's own (cli.runner.checkpoint_eval)
    ev["settings_from"] = {k: "checkpoint" if k in taken else "command" for k in EVAL_FROM_CHECKPOINT}
    metrics = {**(record or {}), opened.kind: opened.source, "groups": model.cfg.groups, "params": model.num_params(),
               "device": str(device), "eval": ev}
    write_json(run_dir / "metrics.json", metrics)
    return metrics


def evaluate_job(cfg: DictConfig) -> dict:
    """One job of `python -m recdepth.evaluate` (single run or multirun): `evaluate` with
    what the frontier sweeper decoded ahead of the multirun's jobs (`jobs.SWEEP`)."""
    return evaluate(cfg, precomputed=SWEEP)


_task = task(evaluate_job, "ce")  # the Hydra task (recdepth/cli/runner.py)
main = hydra_main(_task, "evaluate")


if __name__ == "__main__":
    # Run the main of the importable module recdepth.evaluate, not of this __main__ copy: a
    # launcher that pickles the job (submitit) then pickles it by reference. By value,
    # cloudpickle's submodule guess drags in unpicklable torch config modules.
    import recdepth.evaluate

    recdepth.evaluate.main()
