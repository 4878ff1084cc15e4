"""Scoring a checkpoint under exit rules for the commands: a job's decoding settings
(`decode_settings`), the policy checked against the opened model (`for_model`), the shared
decode of a sweep's settings as one batch (`decode_shared`, handed to each job as a
`Precomputed`), the job files (`write_eval`: eval_tokens.csv, oracle_nll.npy) and the eval
block after training (`evaluate_trained`). `recdepth.evaluate`, `recdepth.calibrate`,
`recdepth.report`, `recdepth.train` and the frontier sweeper use it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from recdepth.analysis import token_files
from recdepth.app.checkpoints import (
    checkpoint_data,
    load_checkpoint,
    open_model,
    resolve_device,
)
from recdepth.config.build import exit_policy
from recdepth.config.groups import EvalConfig
from recdepth.config.schema import validated
from recdepth.decode.scoring import evaluate_exit, evaluate_exits
from recdepth.decode.settings import DecodeSettings
from recdepth.decode.state_decode import has_coda
from recdepth.exits.policy import ORACLE, ExitPolicy

log = logging.getLogger("recdepth.evaluate")


def for_model(policy: ExitPolicy, opened) -> ExitPolicy:
    """The policy checked against the opened model (per-group values, a gate), with its
    halting head where the rule reads it (exit=halt; one line if the model has none) and its
    `auto` exit.decode and exit.kl_direction decided for it."""
    model = opened.model
    policy.check_model(model.n_groups, model.cfg.n_embd)
    return policy.with_head(model).resolve(has_coda(model), hf=opened.kind == "hf")


# eval keys an older run's config.yaml may lack, read as the code before them did
_LATER_KEYS = {"answers": None, "context_steps": None, "latency_backend": None, "backend": EvalConfig.backend,
               "copy_forward": False, "regime": "sequential", "exit_level": "token", "wake": False}
# eval keys renamed since: an older run's config.yaml names them so
_RENAMED = {"backend": "step", "latency_backend": "latency_step"}


def decode_settings(cfg, bos: int | None = None) -> DecodeSettings:
    """The eval block (and the seed) as the engine's `DecodeSettings`, from a composed config
    or the validated object (an older run's config.yaml may lack the later keys,
    `_LATER_KEYS`, or name them as before, `_RENAMED`); `bos`: the opened model's BOS id (an hf= tokenizer's), if any."""
    e = cfg.eval
    keys = ("cache", "copy_forward", "warm_start", "backend", "context_steps", "batch_size", "warmup_tokens", "latency_tokens",
            "repeats", "latency_backend", "answers", "regime", "exit_level", "wake")
    return DecodeSettings(seed=cfg.seed, bos=bos, **{k: getattr(e, k, getattr(e, _RENAMED.get(k, k), _LATER_KEYS.get(k)))
                                                      for k in keys})


class Precomputed:
    """Jobs of a sweep decoded ahead of them as one batch (`decode_shared`), handed over to
    the jobs: job key (`job_key`) -> a list (a sweep may hold one setting twice) of (the
    `Opened` model it was decoded with, (eval block, per-token record)). A job given one
    (`recdepth.evaluate.evaluate(cfg, precomputed=...)`) takes its entry (`take`) and writes
    it instead of opening its checkpoint and decoding again."""

    def __init__(self) -> None:
        self.jobs: dict[str, list[tuple[object, tuple[dict, dict]]]] = {}

    def put(self, cfg: DictConfig, opened, result: tuple[dict, dict]) -> None:
        self.jobs.setdefault(job_key(cfg), []).append((opened, result))

    def take(self, cfg: DictConfig):
        """(the `Opened` model, (eval block, record)) left for this job, removed; or None
        (the job opens its checkpoint and decodes itself)."""
        key = job_key(cfg)
        entries = self.jobs.get(key)
        if not entries:
            return None
        first = entries.pop(0)
        if not entries:
            del self.jobs[key]
        return first

    def __len__(self) -> int:
        return sum(len(v) for v in self.jobs.values())


# What the frontier sweeper (hydra_plugins/recdepth_frontier) decodes ahead of a multirun's
# jobs. Hydra's launcher calls a job with its config only, so the evaluate command's Hydra
# task hands this one to `evaluate` (recdepth/evaluate.py: `evaluate_job`).
SWEEP = Precomputed()


KEYS = ("ckpt", "hf", "dtype", "device", "seed", "data", "eval", "exit")  # what a job's decode reads


def job_key(cfg: DictConfig, without: tuple[str, ...] = ()) -> str:
    """A job's decode as a string: the model, dtype, device, seed, data, eval.* and exit.*
    (not its run_dir), with `without` left out."""
    part = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
            for k in KEYS if k in cfg and k not in without}
    return json.dumps(part, sort_keys=True, default=str)


def decode_shared(jobs: list[DictConfig], max_rows: int, opened=None,
                  into: Precomputed | None = None) -> Precomputed:
    """Decode the jobs of a sweep (their composed configs, run_dir aside) that differ only in
    exit.* as one batch each (`scoring.evaluate_exits`: every job's records are those it
    gets alone, its latency timed at batch 1 round-robin with the others), ahead of the
    jobs, which then write these results (`run_eval`): returned as a `Precomputed` (`into`,
    if given, gains them). The oracle, a job alone in its
    group and a job whose config or checkpoint fails (or whose exit was calibrated on the
    tokens it would score) are left to the job itself, which decodes alone and reports its
    own error. `opened`: the jobs' model when the caller has it open already (the report)."""
    into = Precomputed() if into is None else into
    groups: dict[str, list[tuple[DictConfig, ExitPolicy]]] = {}
    runs: dict[int, object] = {}  # each job's config validated once: id(cfg) -> its typed object
    for cfg in jobs:
        try:
            runs[id(cfg)] = validated(cfg)
            policy = exit_policy(runs[id(cfg)])
            check_test_split(cfg)
        except (ValueError, FileNotFoundError):
            continue
        if policy.name != ORACLE:
            groups.setdefault(job_key(cfg, without=("exit",)), []).append((cfg, policy))
    for group in groups.values():
        if len(group) < 2 or OmegaConf.select(group[0][0], "eval.regime") == "parallel":  # one setting at a time
            continue
        cfg, n = group[0][0], group[0][0].eval.tokens
        try:
            got = opened or open_model(runs[id(cfg)], resolve_device(cfg.device))
            policies = [for_model(p, got) for _, p in group]
            start = split_start(got, OmegaConf.select(cfg, "eval.split") or "test")
        except (ValueError, FileNotFoundError):
            continue
        log.info("decoding %d settings side by side (up to %d rows a batch)", len(group), max_rows)
        settings = decode_settings(cfg, got.bos).replace(batch_size=max_rows)
        results = evaluate_exits(got.model, got.heldout(n + 1, start), policies, n, settings,
                                 labels=got.labels(n + 1, start), targets=got.targets(n + 1, start))
        for (c, _), result in zip(group, results, strict=True):
            into.put(c, got, result)
    return into


def split_start(opened, split: str) -> int:
    """Where eval.split starts in the held-out stream: the test split at 0; a task's
    extrapolation split at its region (docs/spec.md §6)."""
    if split == "test":
        return 0
    if opened.region is None:
        raise ValueError(f"eval.split: {split} exists for data=task checkpoints only (this is an hf= model)")
    return opened.region(split)[0]


def run_eval(model, tokens: torch.Tensor | None, policy, cfg: DictConfig, run_dir: Path,
             vocab_to_gpt2: torch.Tensor | None, bos: int | None = None, labels: np.ndarray | None = None,
             shared: tuple[dict, dict] | None = None, targets: np.ndarray | None = None) -> dict:
    """SPEC §4 evaluation of `model` on held-out `tokens` under `policy` with cfg.eval's
    settings; writes the per-token record into run_dir and returns the `eval` block, which
    also records what the rules that decode decoded with (`decode`), the kl rule's
    `kl_direction` (`auto` as the engine reads it) and the `bos` id each window started with
    (an hf= model's tokenizer BOS, else null). On a task (`labels`, aligned with `tokens`)
    the block gains `answers` (`tasks.score_answers`: accuracy, NLL and cost on the answer
    tokens, per difficulty) and eval_tokens.csv the answer, difficulty and correct columns.
    `shared`: the (eval block, record) this job got decoded with its sweep
    (`Precomputed.take`), written instead of decoding `tokens`. `targets`: a task's scored
    stream (in-place targets, aligned with `tokens`), scored against instead of the next token."""
    e = cfg.eval
    check_test_split(cfg)
    if shared is not None:
        ev, rec = shared
    else:
        ev, rec = evaluate_exit(model, tokens, policy, e.tokens, decode_settings(cfg, bos), labels=labels,
                                targets=targets)
    used = policy.resolve(has_coda(model))
    ev.update(decode=used.decode, kl_direction=used.kl_direction, bos=bos)
    write_eval(run_dir, rec, vocab_to_gpt2)
    log_eval(ev)
    return ev


def check_test_split(cfg: DictConfig) -> None:
    """`check_calibration` of a job scoring the test split (the other splits lie past the
    calibration split)."""
    if (OmegaConf.select(cfg, "eval.split") or "test") == "test":
        check_calibration(OmegaConf.select(cfg, "exit.calibrated_on"), cfg.eval.tokens)


def check_calibration(calibrated_on, n_tokens: int) -> None:
    """Refuse to score a test range that overlaps the tokens the exit was calibrated on: the
    test split is val tokens 0 .. eval.tokens (targets 1 .. eval.tokens), docs/spec.md §4c."""
    if calibrated_on is None:
        return
    first, last = int(calibrated_on[0]), int(calibrated_on[1])
    if first <= n_tokens and last >= 0:
        raise ValueError(f"exit.calibrated_on: this exit was calibrated on val tokens [{first}, {last}]; "
                         f"eval.tokens={n_tokens} scores val tokens [0, {n_tokens}], which overlap them "
                         f"(choose eval.tokens < {first})")


def write_eval(run_dir: Path, rec: dict, vocab_to_gpt2: torch.Tensor | None) -> None:
    """`eval_tokens.csv`: one row per scored token (window, position, target, target_gpt2
    (-1 for the shared "other" entry), nll, apps_<g> per group, ms of the batch-1 timing or
    empty, cost: layer applications with the rule's checks); the oracle also writes `oracle_nll.npy`, its NLL at every n [tokens, max_steps]."""
    target = rec["target"]
    gpt2 = target if vocab_to_gpt2 is None else vocab_to_gpt2.cpu().numpy()[target]
    task = None
    if "label" in rec:
        task = {"answer": rec["label"] > 0, "difficulty": rec["label"], "correct": rec["correct"]}
    token_files.write_tokens(run_dir / "eval_tokens.csv", rec["window"], rec["position"], target, gpt2,
                       rec["nll"], rec["apps"], rec["ms"], task=task, cost=rec.get("cost"))
    if "nll_by_n" in rec:
        token_files.save_array(run_dir / "oracle_nll.npy", rec["nll_by_n"])


def log_eval(ev: dict) -> None:
    ms = "—" if ev["ms_per_token"] is None else (f"{ev['ms_per_token']:.2f} "
                                                 f"[{ev['ms_per_token_min']:.2f}, {ev['ms_per_token_max']:.2f}]")
    log.info("eval (%s, tau=%s, max_steps=%s): ce %.4f [%.4f, %.4f], %s ms/token, applications %s, "
             "%.0f tokens/s at batch %d", ev["exit"], ev["tau"], ev["max_steps"], ev["ce"], *ev["ce_ci"], ms,
             [round(a, 2) for a in ev["applications_per_token"]], ev["tokens_per_s"], ev["batch_size"])
    if "answers" in ev:
        a = ev["answers"]
        log.info("answers: accuracy %.4f [%.4f, %.4f] over %d answers, %.2f layer applications each; exact %.4f "
                 "of %d instances; by difficulty %s", *a["accuracy"], a["tokens"], a["layer_applications"][0],
                 a.get("exact", [float("nan")])[0], a.get("instances", 0),
                 {d: round(v["accuracy"][0], 3) for d, v in a["by_difficulty"].items()})


# -------------------------------------------------------- after training
def evaluate_trained(ckpt: Path, cfg: DictConfig, policy: ExitPolicy, run_dir: Path) -> dict:
    """The `eval` block of `recdepth.train`: its checkpoint scored exactly as `evaluate`
    scores one, on a GPU when trainer.accelerator allows one and there is one. Eagerly,
    also after trainer.compile: token-by-token decoding changes the cache position on
    every call, which a compiled block would recompile for."""
    device = resolve_device("auto" if cfg.trainer.accelerator in ("auto", "gpu", "cuda") else "cpu")
    module, data = load_checkpoint(ckpt, device)
    dm = checkpoint_data(module, data, cfg.seed)
    n, split = cfg.eval.tokens + 1, OmegaConf.select(cfg, "eval.split") or "test"
    start = 0 if split == "test" else dm.region(split)[0]
    return run_eval(module.model, torch.as_tensor(dm.heldout_tokens(n, start)), policy, cfg, run_dir,
                    module.vocab_to_gpt2, labels=dm.heldout_labels(n, start), targets=dm.heldout_targets(n, start))
