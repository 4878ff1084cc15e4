"""Opening a trained model for the entry points that work on one (evaluate, calibrate,
report, train_gate, diagnose, generate): a recdepth training checkpoint (Lightning's
`last.ckpt`, which carries its data config and compact vocabulary) or, for evaluate,
diagnose and generate, a Hugging Face recurrent-depth checkpoint directory (`hf=`, Huginn's
format, recdepth/integrations/hf.py); its held-out tokens and its text encoding (`open_model`).
"""

from __future__ import annotations

import dataclasses
import pickle
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import Tensor

from recdepth.config.schema import data_config
from recdepth.data import sources
from recdepth.data.config import upgrade
from recdepth.data.sources import DataConfig, ShakespeareData, TextSource
from recdepth.integrations.hf import HFTokenizer, load_hf
from recdepth.model.looped import LoopedGPT
from recdepth.training.lit import LoopedLM


def resolve_device(name: str) -> torch.device:
    """The torch device of a validated `device` (auto | cpu | cuda | cuda:<n>)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_checkpoint(path: str | Path, device: torch.device) -> tuple[LoopedLM, dict]:
    """The LoopedLM of a training checkpoint (in eval mode, with `checkpoint_step`, the
    global step it was saved at) and the data config it was trained on (a plain dict in
    today's form: an older checkpoint's flat one upgraded, `recdepth.data.config.upgrade`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ckpt: no checkpoint file at {path}")
    try:  # weights_only: tensors and plain containers only; a pickle that would run code is refused
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        glob = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if glob:
            raise ValueError(f"ckpt: {path} would import {glob.group(1)} when unpickled; refused "
                             "(recdepth loads checkpoints with weights_only=True)") from None
        raise ValueError(f"ckpt: {path} is not a readable Lightning checkpoint (not a torch file?)") from None
    except Exception as e:  # not a torch file, truncated, ...
        raise ValueError(f"ckpt: {path} is not a readable Lightning checkpoint ({type(e).__name__}: {e})") from None
    if "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise ValueError(f"ckpt: {path} is not a recdepth training checkpoint (no state_dict/hyper_parameters)")
    data = ckpt.get("data_config")
    if data is None:  # checkpoints written before the data config travelled with them
        cfg_file = path.parent.parent / "config.yaml"
        if not cfg_file.is_file():
            raise ValueError(f"ckpt: {path} carries no data config and there is no {cfg_file} beside it")
        data = OmegaConf.to_container(OmegaConf.load(cfg_file).data, resolve=True)
    data = upgrade(data)
    try:
        module = LoopedLM.load_from_checkpoint(path, map_location=device, weights_only=True)
    except RuntimeError as e:  # weights that do not fit the model their hyper_parameters describe
        lines = [ln.strip() for ln in str(e).splitlines()]
        detail = next((ln for ln in lines if ln.startswith(("size mismatch", "Missing key", "Unexpected key"))), None)
        if detail is None:
            raise
        raise ValueError(f"ckpt: {path}: its weights do not fit the model its hyper_parameters describe "
                         f"({detail[:200]})") from e
    module.checkpoint_step = int(ckpt.get("global_step", 0))  # the optimiser step it was saved at
    return module.to(device).eval(), data


HEAD_FIELDS = ("halt_head", "halt_bias", "halt_reading")  # the halting head's (GPTConfig), which init_from may add


def start_from(module: LoopedLM, path: str | Path) -> None:
    """Load the weights of the training checkpoint at `path` into `module` (halt.init_from: a
    halting head trained on top of a trained model). The two models must be one network but
    for the halting head: a head the checkpoint has is loaded, one it lacks keeps its
    initialisation. Anything else is a one-line ValueError naming halt.init_from."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"halt.init_from: no checkpoint file at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        theirs, weights = dict(ckpt["hyper_parameters"]["model"]), ckpt["state_dict"]
    except Exception as e:
        raise ValueError(f"halt.init_from: {path} is not a recdepth training checkpoint ({type(e).__name__})") from None
    ours = module.config.to_dict()
    differ = sorted(k for k in ours if k not in HEAD_FIELDS and theirs.get(k, ours[k]) != ours[k])
    if differ:
        k = differ[0]
        raise ValueError(f"halt.init_from: {path} is another model (model.{k}: {theirs[k]!r} there, {ours[k]!r} "
                         "here); the run's model and data must be the checkpoint's")
    weights = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    if module.model.halt is not None:
        for k, v in module.model.halt.state_dict().items():
            weights.setdefault(f"halt.{k}", v)
    missing, unexpected = module.model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"halt.init_from: {path}: its weights do not fit the run's model "
                         f"({'missing ' + missing[0] if missing else 'unexpected ' + unexpected[0]})")


def eval_defaults(path: str | Path) -> dict[str, dict]:
    """The settings a task checkpoint carries for its evaluation: {"eval": its experiment's
    eval.tokens, context_steps, cache and regime (`eval_config`), "frontier": the frontier grid its
    experiment chose (`frontier_config`: fixed, warm_start, oracle)}; empty blocks for a checkpoint
    without them (not a task's, from before they travelled) or anything unreadable (the job
    then says why)."""
    try:
        ckpt = torch.load(Path(path), map_location="cpu", weights_only=True, mmap=True)
        return {"eval": dict(ckpt.get("eval_config") or {}), "frontier": dict(ckpt.get("frontier_config") or {})}
    except Exception:
        return {"eval": {}, "frontier": {}}


def has_halting_head(path: str | Path) -> bool:
    """Whether the training checkpoint at `path` has a halting head (its model config's
    halt_head); False for anything that is not a readable checkpoint (the job then says why)."""
    try:
        ckpt = torch.load(Path(path), map_location="cpu", weights_only=True, mmap=True)
        return ckpt["hyper_parameters"]["model"].get("halt_head") is not None
    except Exception:
        return False


def heldout_tokens(module: LoopedLM, data: dict, n: int, seed: int, start: int = 0) -> torch.Tensor:
    """n tokens of the checkpoint's val split from offset `start` (default: the first n, the
    test split), in the model's vocabulary."""
    return torch.as_tensor(checkpoint_data(module, data, seed).heldout_tokens(n, start))


EVAL_TASK_RECORDS = {"train_records": 512, "validation_records": 16, "test_records": 16}
EVAL_EXTRAPOLATION_RECORDS = 128  # eval.task's split where the checkpoint's data had none (data=mazes)


def with_task(model: LoopedGPT, data: dict, fields: dict) -> dict:
    """A task checkpoint's data config with its data.task `fields` set anew for its
    extrapolation split alone (`eval.task`; `TaskData.extrapolation_task`), the model's block
    grown to the split's longest instance (`grow_block`: EOT, the instance, its newline; one
    line for learned positions). The
    longest is measured on instances drawn at the split's largest size (carry, prefixsums:
    one length per size)."""
    if data.get("source") != "task":
        raise ValueError(f"eval.task: sets a task's fields, and this checkpoint was trained on "
                         f"data.source={data.get('source')!r}")
    known = {f.name for f in dataclasses.fields(data_config(data).task)} - {"name"}
    for k in fields:
        if k not in known:
            raise ValueError(f"eval.task.{k}: task {data['task'].get('name')} has no such field (its fields: "
                             f"{', '.join(sorted(known))})")
    out = {**data, "extrapolation_task": {**(data.get("extrapolation_task") or {}), **fields}}
    # the evaluated split is the extrapolation one: the others are written in the grown block
    # only to fix the vocabulary (checked against the checkpoint's in checkpoint_data), so a
    # few records do (a task's per-step targets would otherwise fill gigabytes)
    out.update({k: min(int(data[k]), n) for k, n in EVAL_TASK_RECORDS.items() if k in data})
    if not int(data.get("extrapolation_records", 1)):  # none at training (mazes): the split's default
        out["extrapolation_records"] = EVAL_EXTRAPOLATION_RECORDS
    try:
        task = data_config(out).split_task()
    except (ValueError, TypeError) as e:  # the task's own one-line check, named as the command line set it
        raise ValueError(str(e).replace("data.task.", "eval.task.").replace("data.extrapolation_task.", "eval.task.")
                         ) from None
    _, hi = task.sizes("extrapolation")
    rng = random.Random("recdepth/eval.task")
    longest = max(len(task.generate(rng, (hi, hi))) for _ in range(32))
    model.grow_block(longest + 2, "eval.task")
    return out


def checkpoint_data(module: LoopedLM, data: dict, seed: int):
    """The set-up TokenDataModule of a checkpoint's data config (a plain dict of any form:
    `schema.data_config` types it), with its train and val splits in records of the model's
    block (grown by `with_task`), checked to have the checkpoint's vocabulary."""
    from recdepth.data.datamodule import TokenDataModule

    dm = TokenDataModule(data_config(data), block_size=module.model.cfg.block_size, batch_size=1, max_steps=1,
                         seed=seed)
    dm.prepare_data()
    dm.setup()
    ours = None if dm.id_map is None else torch.as_tensor(dm.id_map)
    theirs = module.vocab_to_gpt2
    if (ours is None) != (theirs is None) or (ours is not None and not torch.equal(ours.cpu(), theirs.cpu())):
        raise ValueError("ckpt: the checkpoint's vocabulary does not match its data's (the corpus changed since training?)")
    return dm




# ------------------------------------------------------------- any trained model
@dataclass
class Opened:
    """A trained model opened for an entry point, from a training checkpoint (`ckpt=`) or a
    Hugging Face checkpoint directory (`hf=`)."""

    model: LoopedGPT
    source: str
    """The resolved path of the checkpoint file or directory."""
    kind: str
    """"ckpt" or "hf"."""
    step: int
    """The optimiser step the weights were saved at (0 for an hf directory: not recorded)."""
    heldout: Callable[[int, int], Tensor]
    """(n, start) -> n held-out model ids from offset start of the held-out split."""
    decode: Callable[[Sequence[int]], str]
    tokenizer: HFTokenizer | None
    """hf only: the directory's tokenizer.json (None without one, and for a training checkpoint,
    whose text is GPT-2 BPE through `vocab_to_gpt2`)."""
    vocab_to_gpt2: Tensor | None
    """Compact model ids -> GPT-2 ids (a compact-vocabulary checkpoint), else None."""
    labels: Callable[[int, int], np.ndarray | None] = lambda n, start=0: None
    """(n, start) -> the task labels of those held-out tokens (0 = not an answer, d >= 1 =
    an answer of difficulty d; `data.TokenDataModule.heldout_labels`), None for text."""
    region: Callable[[str], tuple[int, int]] | None = None
    """A task's val-split region by name (test, validation, extrapolation): (first token,
    tokens) (`data.TokenDataModule.region`); None for an hf= model."""
    bos: int | None = None
    """hf only: the tokenizer's beginning-of-sequence id (tokenizer_config.json's `bos_token`),
    which every window of the held-out text starts with (docs/spec.md §4); None without one."""
    train: Callable[[], tuple[np.ndarray, np.ndarray | None]] | None = None
    """() -> the train split's tokens and a task's labels of them (None for text): a
    checkpoint's own train split, or for an hf= model the head of `data` (everything
    before the held-out tail) under its tokenizer."""
    regions: Callable[[], dict] = lambda: {}
    """() -> a task's val-split regions by name ({} for text and an hf= model)."""
    heldout_size: Callable[[], int] = lambda: 0
    """() -> the held-out split's length in tokens (what `heldout` may read)."""
    targets: Callable[[int, int], np.ndarray | None] = lambda n, start=0: None
    """(n, start) -> the scored stream of those held-out tokens (a task with in-place targets,
    data=carry: `data.TokenDataModule.heldout_targets`), None where the next token is the target."""
    train_targets: Callable[[], np.ndarray | None] = lambda: None
    """() -> the train split's scored stream (in-place targets, aligned with `train`'s tokens),
    None where the next token is the target."""


def open_model(job, device: torch.device) -> Opened:
    """The model of a validated `ModelJob` (recdepth/config/schema.py): job.ckpt or job.hf, in
    job.dtype, on `device`, with its held-out tokens and its decoding (the data module of a
    checkpoint is set up only when they are asked for)."""
    dtype = getattr(torch, job.dtype)
    if job.ckpt is not None:
        module, data = load_checkpoint(job.ckpt, device)
        module.model.to(dtype)
        fields = getattr(getattr(job, "eval", None), "task", None) or getattr(job, "task", None)
        if fields:
            data = with_task(module.model, data, dict(fields))
        dm = None

        def datamodule():
            nonlocal dm
            dm = dm or checkpoint_data(module, data, job.seed)
            return dm

        return Opened(module.model, str(Path(job.ckpt).resolve()), "ckpt", module.checkpoint_step,
                      lambda n, start=0: torch.as_tensor(datamodule().heldout_tokens(n, start)),
                      lambda ids: datamodule().decode(list(ids)), None, module.vocab_to_gpt2,
                      lambda n, start=0: datamodule().heldout_labels(n, start),
                      lambda name: datamodule().region(name),
                      train=lambda: (datamodule().train_tokens, datamodule().cache.train_labels),
                      regions=lambda: datamodule().cache.regions or {},
                      heldout_size=lambda: len(datamodule().val_tokens),
                      targets=lambda n, start=0: datamodule().heldout_targets(n, start),
                      train_targets=lambda: datamodule().cache.train_targets)

    model, info = load_hf(job.hf, device, dtype)
    tok = HFTokenizer(job.hf) if (Path(job.hf) / "tokenizer.json").is_file() else None
    if tok is not None and tok.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"hf: {job.hf}/tokenizer.json has {tok.vocab_size} tokens, more than the model's "
                         f"vocab_size {model.cfg.vocab_size}")
    bos = None if tok is None else tok.bos_id
    parts = None

    def split() -> tuple[np.ndarray, np.ndarray]:
        nonlocal parts
        if tok is None:
            raise FileNotFoundError(f"hf: {job.hf} has no tokenizer.json to tokenize data with")
        if parts is None:
            parts = split_stream(tok, job.data if job.data is not None else ShakespeareData())
        return parts

    def heldout(n: int, start: int = 0) -> Tensor:
        stream = split()[1]
        if not (0 < n and 0 <= start and start + n <= len(stream)):
            raise ValueError(f"data: {n} held-out tokens from offset {start} asked of a held-out split of "
                             f"{len(stream)} tokens (more text, or a larger data.val_fraction)")
        return torch.as_tensor(stream[start : start + n])

    return Opened(model, str(Path(job.hf).resolve()), "hf", 0, heldout,
                  tok.decode if tok is not None else lambda ids: " ".join(str(int(i)) for i in ids), tok, None, bos=bos,
                  train=lambda: (split()[0], None), heldout_size=lambda: len(split()[1]))


def split_stream(tok: HFTokenizer, data: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """The train and held-out splits of `data`'s documents under a checkpoint directory's
    tokenizer: the documents' token stream (each followed by the end-of-document id, when
    the tokenizer names one) cut before its last `data.val_fraction` — the same cut as a
    training run's (recdepth/data/token_cache.py). Tokenized in memory; no token cache (the
    tokenizer is not GPT-2's). A source of documents only (`TextSource`)."""
    if not isinstance(data, TextSource):
        text = [n for n in sources.names() if issubclass(sources.lookup(n), TextSource)]
        raise ValueError(f"data: hf= scores documents (data={' | '.join(text)}), not data={data.source}")
    spec = data.documents()
    ids = tok.stream(spec.documents())
    if data.max_tokens is not None:
        ids = ids[: data.max_tokens]
    n_val = int(round(len(ids) * data.val_fraction))
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]
