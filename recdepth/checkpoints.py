"""Opening a trained model for the entry points that work on one (evaluate, calibrate,
report, train_gate, diagnose, generate): a recdepth training checkpoint (Lightning's
`last.ckpt`, which carries its data config and compact vocabulary), its held-out tokens,
and its text encoding.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch
from omegaconf import OmegaConf

from recdepth.lit import LoopedLM


def resolve_device(name: str) -> torch.device:
    """The torch device of a validated `device` (auto | cpu | cuda | cuda:<n>)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_checkpoint(path: str | Path, device: torch.device) -> tuple[LoopedLM, dict]:
    """The LoopedLM of a training checkpoint (in eval mode, with `checkpoint_step`, the
    global step it was saved at) and the data config it was trained on."""
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


def heldout_tokens(module: LoopedLM, data: dict, n: int, seed: int, start: int = 0) -> torch.Tensor:
    """n tokens of the checkpoint's val split from offset `start` (default: the first n, the
    test split), in the model's vocabulary."""
    return torch.as_tensor(checkpoint_data(module, data, seed).heldout_tokens(n, start))


def checkpoint_data(module: LoopedLM, data: dict, seed: int):
    """The set-up TokenDataModule of a checkpoint's data config (its train and val splits),
    checked to have the checkpoint's vocabulary."""
    from recdepth.data import TokenDataModule

    d = dict(data)
    if isinstance(d.get("paths"), str):
        d["paths"] = [d["paths"]]
    dm = TokenDataModule(block_size=module.config.block_size, batch_size=1, max_steps=1, seed=seed, **d)
    dm.prepare_data()
    dm.setup()
    ours = None if dm.id_map is None else torch.as_tensor(dm.id_map)
    theirs = module.vocab_to_gpt2
    if (ours is None) != (theirs is None) or (ours is not None and not torch.equal(ours.cpu(), theirs.cpu())):
        raise ValueError("ckpt: the checkpoint's vocabulary does not match its data's (the corpus changed since training?)")
    return dm


