"""Text in and out of a model for generation: the opened model with its codec (`load_model`:
a recdepth checkpoint's GPT-2 BPE mapped into its compact vocabulary, `TextCodec`, or an
hf= directory's tokenizer.json, `HFCodec`), the prompt as ids (`prompt_of`), each token's
own text (`pieces`), and `Stream`, which writes the text to stdout as tokens come.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from recdepth.app.checkpoints import open_model
from recdepth.config.schema import GenerateConfig
from recdepth.data.tokenizer import gpt2
from recdepth.data.vocabulary import Vocab
from recdepth.decode.generation import TokenRecord
from recdepth.integrations.hf import HFTokenizer
from recdepth.model.looped import LoopedGPT

log = logging.getLogger("recdepth.generate")


# ------------------------------------------------------------------ loading
class TextCodec:
    """Text <-> model ids: GPT-2 BPE and the model's vocabulary over GPT-2's (`Vocab`)."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab

    def encode(self, text: str) -> tuple[list[int], int]:
        """Model ids of `text`, and how many of them are the "other" entry (GPT-2 tokens
        outside a compact vocabulary)."""
        ids = self.vocab.from_gpt2(np.asarray(gpt2().encode(text, allowed_special="all"), dtype=np.int64))
        other = self.vocab.other_id
        return ids.tolist(), 0 if other is None else int((ids == other).sum())

    def decode(self, ids: list[int]) -> str:
        return self.vocab.decode(ids)

    def to_gpt2(self, ids: list[int]) -> list[int]:
        return self.vocab.to_gpt2(np.asarray(ids, dtype=np.int64)).tolist()


@dataclass
class Loaded:
    """A model ready to generate: `codec` None when no tokenizer is at hand (ids only)."""

    model: LoopedGPT
    codec: TextCodec | HFCodec | None
    info: dict


class HFCodec:
    """Text <-> ids through a checkpoint directory's tokenizer.json (`recdepth.integrations.hf.HFTokenizer`);
    its ids are the model's, so there are no GPT-2 ids to report."""

    def __init__(self, tok: HFTokenizer):
        self.tok = tok

    def encode(self, text: str) -> tuple[list[int], int]:
        return self.tok.encode(text), 0

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def to_gpt2(self, ids: list[int]) -> None:
        return None


def load_model(run: GenerateConfig, device: torch.device) -> Loaded:
    """The model (in run.dtype, `checkpoints.open_model`) and its text codec: GPT-2 BPE through
    a training checkpoint's vocabulary map (no corpus is read), or an hf directory's
    tokenizer.json (none: no codec, prompt_ids only)."""
    opened = open_model(run, device)
    model = opened.model
    info = {"source": opened.kind, "path": opened.source, "params": model.num_params(), "groups": model.cfg.groups,
            "block_size": model.cfg.block_size, "vocab_size": model.cfg.vocab_size,
            "compact_vocab": opened.vocab_to_gpt2 is not None}
    if opened.kind == "hf":
        info["tokenizer"] = opened.tokenizer is not None
    return Loaded(model, codec_of(opened), info)


def codec_of(opened) -> TextCodec | HFCodec | None:
    """The text codec of an opened model (`checkpoints.open_model`): an hf directory's
    tokenizer.json (None without one), or GPT-2 BPE through a training checkpoint's
    vocabulary map (no corpus is read)."""
    if opened.kind == "hf":
        return None if opened.tokenizer is None else HFCodec(opened.tokenizer)
    m, model = opened.vocab_to_gpt2, opened.model
    vocab = Vocab(None if m is None else m.cpu().numpy().astype(np.int64), model.cfg.n_other)
    if vocab.size != model.cfg.vocab_size:
        raise ValueError(f"ckpt: {opened.source}: its vocabulary map has {vocab.size} ids, its model "
                         f"{model.cfg.vocab_size}")
    return TextCodec(vocab)


def prompt_of(run: GenerateConfig, loaded: Loaded) -> tuple[list[int], str | None]:
    """The prompt's model ids and its text (None for prompt_ids without a tokenizer)."""
    V = loaded.model.cfg.vocab_size
    if run.prompt_ids is not None:
        ids = list(run.prompt_ids)
        bad = [i for i in ids if i >= V]
        if bad:
            raise ValueError(f"prompt_ids: id {bad[0]} is outside the model's vocabulary 0..{V - 1}")
        return ids, None if loaded.codec is None else loaded.codec.decode(ids)
    if loaded.codec is None:
        raise ValueError("prompt: this checkpoint comes without a tokenizer; pass prompt_ids=[...] instead")
    ids, n_other = loaded.codec.encode(run.prompt)
    if not ids:
        raise ValueError(f"prompt: {run.prompt!r} encodes to no tokens")
    if n_other:
        log.info("prompt: %d of its %d tokens are outside the checkpoint's compact vocabulary and map to its "
                 "\"other\" entry (the model sees them as one unknown token)", n_other, len(ids))
    return ids, run.prompt


# ------------------------------------------------------------------ output
class Stream:
    """Prints the generated text to stdout as it comes (whole characters only: a token
    that ends inside a UTF-8 character waits for the next), and on stderr a token counter
    when stdout does not show the text on the same terminal."""

    def __init__(self, codec: TextCodec | None, total: int, enabled: bool):
        self.codec, self.total, self.enabled = codec, total, enabled
        self.ids: list[int] = []
        self.shown = 0
        self.t0 = time.perf_counter()
        self.counter = sys.stderr.isatty() and not (enabled and sys.stdout.isatty())

    def __call__(self, row: int, rec: TokenRecord) -> None:
        self.ids.append(rec.token)
        if self.enabled:
            text = self.codec.decode(self.ids) if self.codec is not None else " ".join(map(str, self.ids)) + " "
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[self.shown :])
                sys.stdout.flush()
                self.shown = len(text)
        if self.counter:
            rate = len(self.ids) / max(time.perf_counter() - self.t0, 1e-9)
            sys.stderr.write(f"\r{len(self.ids)}/{self.total} tokens, {rate:.1f} tokens/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            text = self.codec.decode(self.ids) if self.codec is not None else ""
            sys.stdout.write(text[self.shown :] + "\n")
            sys.stdout.flush()
        if self.counter:
            sys.stderr.write("\n")


def pieces(loaded: Loaded, ids: list[int]) -> list[str]:
    """The text of each token alone (its id in angle brackets without a tokenizer)."""
    if loaded.codec is None:
        return [f"<{i}>" for i in ids]
    return [loaded.codec.decode([i]) for i in ids]
