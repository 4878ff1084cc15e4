"""The model's vocabulary over GPT-2's: maps either way, the unigram prior, decoding.

With a compact vocabulary (`compact_vocab`, the default for shakespeare) the model's
vocabulary is the sorted set of GPT-2 ids that occur in the **train split** (the held-out
text plays no part in choosing it), plus one shared "other" entry, the last id, that
stands for every GPT-2 id outside that set (SPEC §4, vocabulary). The model's
probability of "other" is spread evenly over those n_other ids, so a held-out token the
train split never saw is scored log p(other) − log n_other and CE stays a cross-entropy
over all 50257 GPT-2 ids (`recdepth.model.looped.token_nll`). Shakespeare's train split uses
19,194 of GPT-2's 50257 tokens, so the embedding / unembedding shrink by 2.6x. The token
cache's vocab.npy (`recdepth.data.token_cache`) is `id_map`: compact id -> GPT-2 id, -1 for
"other". Without a compact vocabulary the model's ids are GPT-2's.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from recdepth.data.tokenizer import EOT_ID, GPT2_VOCAB_SIZE, gpt2


class Vocab:
    """The model ids of a token cache: `id_map` (compact id -> GPT-2 id, -1 for "other"),
    or None for GPT-2's own ids; `n_other` GPT-2 ids share "other"."""

    def __init__(self, id_map: np.ndarray | None, n_other: int = 0):
        self.id_map = id_map
        self.n_other = int(n_other)
        self.other_id: int | None = None  # the model id of "other"
        self._from_gpt2: np.ndarray | None = None
        if id_map is None:
            self.size = GPT2_VOCAB_SIZE
            self.eot_id: int | None = EOT_ID
        else:
            self.size = len(id_map)
            self.other_id = len(id_map) - 1
            inv = np.full(GPT2_VOCAB_SIZE, self.other_id, dtype=np.int64)
            inv[id_map[:-1]] = np.arange(self.other_id)
            self._from_gpt2 = inv
            self.eot_id = int(inv[EOT_ID]) if inv[EOT_ID] != self.other_id else None

    def to_gpt2(self, ids):
        """Model ids -> GPT-2 ids (identity without a compact vocab; -1 for the shared
        "other" entry, which stands for many). numpy in, int64 numpy out; a torch tensor
        in, a LongTensor on the same device out."""
        if torch.is_tensor(ids):
            ids = ids.long()
            if self.id_map is None:
                return ids
            return torch.as_tensor(self.id_map, device=ids.device)[ids]
        ids = np.asarray(ids, dtype=np.int64)
        return ids if self.id_map is None else self.id_map[ids]

    def from_gpt2(self, ids):
        """GPT-2 ids -> model ids (an id the train split never saw -> "other");
        ValueError for an id outside GPT-2's vocabulary."""
        is_tensor = torch.is_tensor(ids)
        arr = ids.detach().cpu().numpy() if is_tensor else ids
        arr = np.asarray(arr, dtype=np.int64)
        bad = (arr < 0) | (arr >= GPT2_VOCAB_SIZE)
        if self._from_gpt2 is not None:
            out = np.where(bad, -1, self._from_gpt2[np.clip(arr, 0, GPT2_VOCAB_SIZE - 1)])
            bad |= out < 0
        else:
            out = arr
        if bad.any():
            first = int(arr[bad].flat[0])
            raise ValueError(
                f"data: GPT-2 id {first} is not in the model vocabulary "
                f"({self.size} ids, compact={self.id_map is not None})"
            )
        return torch.as_tensor(out, device=ids.device) if is_tensor else out

    def decode(self, ids) -> str:
        """Model ids -> text ("other" shows as U+FFFD, the replacement character)."""
        parts, run = [], []
        for t in np.asarray(self.to_gpt2(np.asarray(ids))).tolist():
            if t < 0:
                parts.append(gpt2().decode(run) + "\ufffd")
                run = []
            else:
                run.append(t)
        return "".join(parts) + gpt2().decode(run)

    def unigram_log_prior(self, train: np.ndarray) -> np.ndarray:
        """log p(t) of the add-one smoothed unigram of `train` (model ids) over all 50257
        GPT-2 ids, p(t) = (count(t) + 1) / (N + 50257), in the model vocabulary (float64
        [size]): "other" gets the mass of the n_other ids it stands for (each unseen in
        train, so n_other / (N + 50257))."""
        counts = np.bincount(train, minlength=self.size).astype(np.float64) + 1.0
        if self.other_id is not None:
            counts[self.other_id] = self.n_other
        return np.log(counts) - np.log(len(train) + GPT2_VOCAB_SIZE)

    def unigram_ce(self, train: np.ndarray, targets: np.ndarray) -> float:
        """Cross-entropy (nats/token, over all GPT-2 ids) of `targets` under the unigram of
        `train` (`unigram_log_prior`; an "other" target is scored log p(other) − log
        n_other, as `recdepth.model.looped.token_nll` scores the model)."""
        logp = self.unigram_log_prior(train)
        if self.other_id is not None and self.n_other > 1:
            logp[self.other_id] -= math.log(self.n_other)
        return float(-(np.bincount(targets, minlength=self.size) @ logp) / len(targets))
