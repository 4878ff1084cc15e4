"""`python -m recdepth.train_gate ckpt=<path>`: fit the learned exit gate (SPEC §3c) of a
frozen checkpoint, one Linear(d -> 1) per recurrence group, on the checkpoint's train split.

    python -m recdepth.train_gate ckpt=<run_dir>/train/checkpoints/last.ckpt gate.max_steps=32
    python -m recdepth.evaluate ckpt=<same> exit=gate exit.gate=<gate run_dir>/gate.pt exit.tau=0.5

The windows are drawn (seeded by `seed`) from the checkpoint's own train split, never its
val split, which holds the evaluation's tokens (on a task, whole records, and by default
only the answers are fitted on). For every group g and n < N = gate.max_steps the state
x_g^(n) is a feature and [NLL(n) − NLL(N) > gate.margin] its label (`recdepth.exits.gate`); the
states are those the decoding engine visits (gate.states=decode, `recdepth.decode.gate_states`)
or the parallel pass's (gate.states=parallel), the classes weighted equally (gate.balance).
The run directory gets `gate.pt` (what exit=gate reads: weight [G, d], bias [G] and the
metadata), `gate.json` (the metadata) and `config.yaml`.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
from omegaconf import DictConfig

from recdepth.app.checkpoints import open_model, resolve_device
from recdepth.cli.runner import hydra_main, job_dir, refuse, start_job, task
from recdepth.config.schema import validated
from recdepth.decode.engine import span
from recdepth.decode.gate_states import decoding_gate_data
from recdepth.decode.settings import DecodeSettings
from recdepth.exits.gate import collect_gate_data, fit_gate, gate_labels, save_gate
from recdepth.training.runs import write_json

log = logging.getLogger("recdepth.train_gate")


def train_offsets(n_train: int, n_tokens: int, block_size: int, seed: int, align: int = 1) -> np.ndarray:
    """ceil(n_tokens / block_size) distinct random offsets (seeded) of windows of
    block_size + 1 tokens in a train split of n_train tokens, multiples of `align` (a
    task's records: block_size), in increasing order."""
    n_avail = len(range(0, n_train - block_size, align))
    if n_avail < 1:
        raise ValueError(f"data: the train split ({n_train} tokens) is shorter than one window")
    W = min(math.ceil(n_tokens / block_size), n_avail)
    return np.sort(np.random.default_rng(seed).choice(n_avail, size=W, replace=False)) * align


def train_windows(train_tokens, offsets: np.ndarray, block_size: int) -> torch.Tensor:
    """The windows of block_size + 1 tokens at `offsets`: [W, block_size + 1] int64."""
    return torch.as_tensor(np.stack([np.asarray(train_tokens[o : o + block_size + 1], dtype=np.int64)
                                     for o in offsets]))


def train_gate(cfg: DictConfig) -> dict:
    """Fit the gate of cfg's model (ckpt= or hf=) under cfg.gate on its train split; write
    gate.pt, gate.json and config.yaml into cfg.run_dir and return gate.json's dict. An hf=
    model's train split is the head of `data` under its tokenizer, each window starting
    with its BOS (as its evaluation's windows do)."""
    run_dir = job_dir(cfg, "train_gate")
    run = validated(cfg)
    g = run.gate
    refuse(run_dir, "gate.pt")
    t0 = time.perf_counter()
    device = resolve_device(run.device)
    opened = open_model(run, device)
    model = opened.model
    if model.n_groups == 0:
        raise ValueError(f"{opened.kind}: {opened.source} has no recurrence groups (nothing to gate)")
    train_targets = opened.train_targets()  # a task's in-place targets (data=carry), else None
    T = model.cfg.block_size
    train_tokens, task_labels = opened.train()  # a task's per-token labels (0 = not an answer), else None
    S = span(T, opened.bos)  # stream tokens a window scores (after BOS, if any)
    answers = task_labels is not None if g.answers is None else g.answers
    if answers and task_labels is None:
        raise ValueError("gate.answers: true needs a task's answer labels (data=task); this checkpoint's data has none")
    offsets = train_offsets(len(train_tokens), g.tokens, S, run.seed, align=T if task_labels is not None else 1)
    wins = train_windows(train_tokens, offsets, S)
    if opened.bos is not None:
        wins = torch.cat([torch.full((len(wins), 1), opened.bos, dtype=wins.dtype), wins], 1)
    keep = (torch.as_tensor(np.stack([np.asarray(task_labels[o + 1 : o + T + 1]) for o in offsets])) > 0
            if answers else None)
    if keep is not None and not bool(keep.any()):
        raise ValueError(f"gate.tokens: the {len(offsets)} train windows drawn hold no answer; raise gate.tokens")
    scored = None if train_targets is None else train_windows(train_targets, offsets, S)
    if g.states == "decode":
        settings = DecodeSettings(seed=run.seed, cache=g.cache)
        per_group = decoding_gate_data(model, wins, g.max_steps, settings, keep=keep, targets=scored)
    else:
        starts = range(0, len(wins), g.batch_size)
        batches = [wins[i : i + g.batch_size].to(device) for i in starts]
        targets = None if scored is None else [scored[i : i + g.batch_size] for i in starts]
        per_group = collect_gate_data(model, batches, g.max_steps, generator_seed=run.seed, scored=targets)
        if keep is not None:  # the parallel collector returns every target, window by window
            per_group = [(f[keep.reshape(-1)], n[keep.reshape(-1)]) for f, n in per_group]
    t_collect = time.perf_counter() - t0
    ws, bs, fits = [], [], []
    for feats, nll_by_n in per_group:
        labels = gate_labels(nll_by_n, g.margin)
        w, b, st = fit_gate(feats.reshape(-1, feats.shape[-1]), labels.reshape(-1), steps=g.steps,
                            weight_decay=g.weight_decay, balance=g.balance)
        st["nll_gain_mean"] = float((nll_by_n[:, 0] - nll_by_n[:, -1]).mean())  # NLL(1) − NLL(N)
        ws.append(w)
        bs.append(b)
        fits.append(st)
    meta = {opened.kind: opened.source, "n_embd": model.cfg.n_embd, "groups": model.cfg.groups,
            "max_steps": g.max_steps, "margin": g.margin, "tokens": int(wins.shape[0] * T), "seed": run.seed,
            "steps": g.steps, "weight_decay": g.weight_decay, "states": g.states, "cache": g.cache, "balance": g.balance,
            "answers": bool(answers), "examples": int(per_group[0][0].shape[0]),
            "accuracy": [f["accuracy"] for f in fits], "balanced_accuracy": [f["balanced_accuracy"] for f in fits],
            "label_rate": [f["label_rate"] for f in fits],
            "log_loss": [f["log_loss"] for f in fits], "nll_gain_mean": [f["nll_gain_mean"] for f in fits],
            "collect_seconds": t_collect, "seconds": time.perf_counter() - t0}
    start_job(run_dir, cfg)
    path = run_dir / "gate.pt"
    save_gate(path, torch.stack(ws), torch.stack(bs), meta)
    write_json(run_dir / "gate.json", meta)
    for i, f in enumerate(fits):
        log.info("gate of group %d %s: label rate %.3f, train accuracy %.3f (balanced %.3f), log-loss %.4f", i,
                 model.cfg.groups[i], f["label_rate"], f["accuracy"], f["balanced_accuracy"], f["log_loss"])
    use = f"exit=gate exit.gate={path.resolve()} exit.tau=0.5 exit.max_steps={g.max_steps}"
    log.info("gate fitted on %d train tokens in %.1f s; use it with: %s", meta["tokens"], meta["seconds"], use)
    print(use)
    return meta


_task = task(train_gate, "seconds")  # the Hydra task (recdepth/cli/runner.py)
main = hydra_main(_task, "train_gate")


if __name__ == "__main__":
    # As recdepth.evaluate: run the importable module's main (a pickling launcher then
    # pickles the job by reference).
    import recdepth.train_gate

    recdepth.train_gate.main()
