"""`python -m recdepth.diagnose ckpt=<path>` (or `hf=<dir>`): the paper's loop-geometry diagnostics (SPEC §2;
Figs. 1, 2, 3, 5) of one trained model, without training.

    python -m recdepth.diagnose ckpt=outputs/runs/<id>/train/checkpoints/last.ckpt
    python -m recdepth.diagnose ckpt=<path> loop_dynamics.loops=64 loop_dynamics.sequences=8
    python -m recdepth.diagnose hf=/models/huginn-0125 dtype=bfloat16 device=cuda loop_dynamics.seq_len=512

The training run measures the same quantities at every checkpoint (callbacks=loop_dynamics);
this command measures one model after the fact, on the first `sequences × seq_len` tokens of
its held-out split (for `hf=`, the tail of `data`'s documents under the directory's
tokenizer.json, as recdepth.evaluate), with `loops` applications of every group. It writes into its run dir
`diagnostics/step_<global step>.json` (the training callback's format, so
`python -m recdepth.figures <run_dir>` redraws it), `figures/fig{1,2,3,5}_*.{png,pdf}` and
`metrics.json` (the summary scalars: step norms, cosines, DLR per boundary).
"""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig

from recdepth.analysis import diagnostics
from recdepth.app.checkpoints import open_model, resolve_device
from recdepth.cli.runner import hydra_main, job_dir, refuse, start_job, task
from recdepth.config.schema import validated
from recdepth.training.runs import write_json

log = logging.getLogger("recdepth.diagnose")


def diagnose(cfg: DictConfig) -> dict:
    """Measure the loop geometry of cfg.ckpt (or cfg.hf); write and return metrics.json's dict."""
    run_dir = job_dir(cfg, "diagnose")
    run = validated(cfg)
    refuse(run_dir, "metrics.json", *[p.relative_to(run_dir) for p in diagnostics.diagnostics_files(run_dir)],
           what="diagnostics")
    opened = open_model(run, resolve_device(run.device))
    model = opened.model
    if model.n_groups == 0:
        raise ValueError(f"{opened.kind}: {opened.source} has no recurrence groups (model.groups is empty): nothing loops")
    c = run.loop_dynamics
    T = c.seq_len or model.cfg.block_size
    if not 2 <= T <= model.cfg.block_size:
        raise ValueError(f"loop_dynamics.seq_len: expected 2..{model.cfg.block_size} (the block size), got {T}")
    start = 0
    if run.split == "extrapolation":
        if opened.region is None or "extrapolation" not in opened.regions():
            raise ValueError("split: extrapolation is a task checkpoint's region; this model has none")
        start, n = opened.region("extrapolation")
        if c.sequences * T + 1 > n:
            raise ValueError(f"loop_dynamics.sequences: {c.sequences} windows of {T} tokens need "
                             f"{c.sequences * T + 1}, the extrapolation region holds {n}")
    batch = opened.heldout(c.sequences * T, start).view(c.sequences, T)
    lab = opened.labels(c.sequences * T + 1, start)  # a task: the label of each position's target
    labels = None if lab is None else torch.as_tensor(lab[1:]).view(c.sequences, T)
    start_job(run_dir, cfg)
    d = diagnostics.measure(model, batch.to(next(model.parameters()).device), run_dir, opened.step,
                            opened.decode, loops=c.loops, seed=c.seed, pca_sequence=c.pca_sequence,
                            pca_tokens=c.pca_tokens, max_state_bytes=c.max_state_bytes, labels=labels)
    metrics = {opened.kind: opened.source, "global_step": opened.step, "split": run.split,
               "groups": model.cfg.groups, "loops": c.loops, "tokens": c.sequences * T,
               "seconds": d["seconds"], "geometry": diagnostics.summary_scalars(d)}
    if labels is not None:  # a task: step norms and cosines by answer difficulty (docs/spec.md §6)
        metrics["by_difficulty"] = {g["name"]: g["by_difficulty"] for g in d["groups"]}
    if c.figures:
        from recdepth.analysis import plots

        metrics["figures"] = [str(p) for p in plots.draw_all(run_dir)]
    write_json(run_dir / "metrics.json", metrics)
    log.info("loop geometry of %s (step %d, %d loops, %d tokens) in %.1f s: DLR %s; figures in %s",
             opened.source, opened.step, c.loops, c.sequences * T, d["seconds"],
             [round(b["mean"], 2) for b in d["dlr"]], run_dir / "figures")
    return metrics


_task = task(diagnose, "seconds")  # the Hydra task (recdepth/cli/runner.py)
main = hydra_main(_task, "diagnose")


if __name__ == "__main__":
    import recdepth.diagnose  # the importable module's main (see recdepth/evaluate.py)

    recdepth.diagnose.main()
