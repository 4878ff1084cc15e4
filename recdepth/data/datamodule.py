"""The LightningDataModule: random train windows and consecutive val windows over a token
cache, built from the validated data config (`data`: a source of recdepth/data/sources/).

Where the rest lives: recdepth/data/sources/ (the sources, their configs and documents),
recdepth/data/tasks/ (the generated tasks), `recdepth.data.token_cache` (tokenizing into
the token cache), `recdepth.data.vocabulary` (the model's vocabulary over GPT-2's, the
unigram baseline), `recdepth.data.windows` (window batches, the training order, the
resumable loader).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from recdepth.data.sources import DataConfig
from recdepth.data.tasks import NO_STEP
from recdepth.data.token_cache import TokenCache
from recdepth.data.vocabulary import Vocab
from recdepth.data.windows import ResumableLoader, TrainOrder, WindowBatches


class TokenDataModule(L.LightningDataModule):
    """Random train windows and consecutive val windows over a token cache.

    Its data are `data`, the validated data config (recdepth/data/sources/: a source with
    its options; `recdepth.config.schema.data_config` types a plain dict); the windows are
    the run's: block_size, batch_size, max_steps and seed (the training order's).

    Train: max_steps batches of batch_size windows of block_size + 1 tokens at offsets
    `train_offsets` (`windows.TrainOrder`: batch k is a function of seed and k). Val: the
    first `data.val_tokens` val tokens (all of them if None) cut into non-overlapping
    windows with stride block_size, in order; the leftover tail shorter than a window is
    dropped. A task validates on its validation region, one record per window.

    After setup, `vocab` maps model ids to GPT-2 ids and back (`recdepth.data.vocabulary`);
    vocab_size, id_map, n_other, other_id and eot_id are its, for the model's config.
    The attribute `val_tokens` is the val split memmap (set by setup), not the config's cap.

    Batches are (x, y) (`windows.WindowBatches`); over a task with per-step targets they are
    (x, y, z), z [B, T, S] with S = `step_width` (0: no per-step targets, `has_step_targets`
    False; known before setup from the config, `data.step_width()`). Over a task with
    in-place targets (a scored stream in its cache, `has_scored_stream`) y is the scored
    stream's, and `heldout_targets` gives it for the held-out tokens.
    """

    def __init__(self, data: DataConfig, block_size: int, batch_size: int, max_steps: int, seed: int = 1337):
        super().__init__()
        if not isinstance(data, DataConfig):
            raise TypeError(f"data: expected a validated data config (a DataConfig), got {type(data).__name__} "
                            "(recdepth.config.schema.data_config types a plain dict)")
        for name, value, lo in (
            ("block_size", block_size, 1),
            ("batch_size", batch_size, 1),
            ("max_steps", max_steps, 0),
        ):
            if int(value) < lo:
                raise ValueError(f"data.{name}: must be >= {lo}, got {value}")
        self.data = data
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self.max_steps = int(max_steps)
        self.seed = int(seed)
        self.val_token_cap = data.val_tokens
        self.num_workers = int(data.num_workers)
        # Batches to skip at the start of train_dataloader() (set before fit to resume).
        self.start_step = 0

        self.cache: TokenCache | None = None
        self.cache_path: Path | None = None
        self.vocab: Vocab | None = None
        self.vocab_size: int | None = None
        self.train_tokens: np.memmap | None = None
        self.val_tokens: np.memmap | None = None
        self.id_map: np.ndarray | None = None
        self.n_other = 0  # GPT-2 ids sharing the "other" entry (compact vocabulary)
        self.other_id: int | None = None  # the model id of "other"
        self.eot_id: int | None = None
        self.train_offsets: np.ndarray | None = None
        self.val_offsets: np.ndarray | None = None
        # S, the per-step targets of each token (a batch's z is [B, T, S]); 0: none, batches (x, y)
        self.step_width = int(data.step_width())

    @property
    def has_step_targets(self) -> bool:
        """Whether the batches carry per-step targets (x, y, z) (`loss.steps=trajectory` needs them)."""
        return self.step_width > 0

    @property
    def has_scored_stream(self) -> bool:
        """Whether the cache holds a scored stream (a task with in-place targets, data=carry):
        y and every evaluation score against it instead of the next token."""
        return self._require_setup().train_targets is not None

    # -- building / opening -------------------------------------------------------------

    def _prepare(self) -> TokenCache:
        return self.data.prepare(self.block_size)

    def prepare_data(self) -> None:
        self._prepare()

    def setup(self, stage: str | None = None) -> None:
        if self.cache is not None:
            return
        cache = self._prepare()
        T = self.block_size
        n_train, n_val = len(cache.train), len(cache.val)
        if n_train < T + 1:
            raise ValueError(
                f"data: block_size={T} is longer than the train split ({n_train} tokens); "
                f"need at least block_size+1"
            )
        n_val_used = n_val if self.val_token_cap is None else min(n_val, self.val_token_cap)
        if n_val_used < T + 1:
            capped = (
                "" if n_val_used == n_val else f", capped by data.val_tokens={self.val_token_cap}"
            )
            raise ValueError(
                f"data: block_size={T} is longer than the val split ({n_val_used} tokens{capped}); "
                f"need at least block_size+1"
            )
        if cache.step_width != self.step_width:  # only if a cache's meta.json disagrees with its task
            raise ValueError(f"data: the token cache {cache.path} holds {cache.step_width} per-step targets a token, "
                             f"the task states {self.step_width}")
        self.cache, self.cache_path = cache, cache.path
        self.train_tokens, self.val_tokens = cache.train, cache.val
        v = self.vocab = Vocab(cache.id_map, cache.n_other)
        self.vocab_size, self.id_map, self.n_other, self.other_id, self.eot_id = (
            v.size, v.id_map, v.n_other, v.other_id, v.eot_id
        )
        self.train_offsets = self.train_order(world_size=1).offsets()
        # Window j covers val[j*T : j*T + T + 1]; its targets are val[j*T+1 : (j+1)*T+1].
        # A task validates on its validation region (the test region comes first, for
        # the evaluations), one record per window.
        first = 0
        if cache.regions:
            first, n = cache.regions["validation"]
            n_val_used = n + 1 if self.val_token_cap is None else min(n + 1, self.val_token_cap)
        self.val_offsets = first + np.arange((n_val_used - 1) // T, dtype=np.int64) * T

    def _require_setup(self) -> TokenCache:
        if self.cache is None:
            self.setup()
        assert self.cache is not None
        return self.cache

    # -- loaders ------------------------------------------------------------------------

    def shard(self) -> tuple[int, int]:
        """(rank, world size) of the process this data module feeds: the Trainer's under
        DDP, (0, 1) otherwise."""
        t = getattr(self, "trainer", None)
        return (int(t.global_rank), int(t.world_size)) if t is not None else (0, 1)

    def train_order(self, world_size: int | None = None) -> TrainOrder:
        """The training order over this cache's train split, for `world_size` processes
        (default: this process's world)."""
        W = self.shard()[1] if world_size is None else int(world_size)
        cache = self._require_setup()
        return TrainOrder(len(cache.train), self.block_size, self.batch_size, self.max_steps, self.seed, W,
                          align=self.block_size if cache.regions else 1)

    def train_dataset(self, rank: int | None = None, world_size: int | None = None) -> WindowBatches:
        """All max_steps batches one process trains on, in order (`TrainOrder`: with W
        processes rank r takes the r-th slice of each global batch of W*batch_size)."""
        cache = self._require_setup()
        r, W = self.shard() if rank is None else (int(rank), int(world_size or 1))
        if not 0 <= r < W:
            raise ValueError(f"data: rank {r} outside a world of {W} processes")
        offsets = self.train_offsets if W == 1 else self.train_order(W).offsets(r)
        return WindowBatches(cache.path / "train.bin", len(cache.train), offsets, self.block_size,
                             self.batch_size, self._labels_file("train"), *self._steps_file("train"),
                             targets=self._targets_file("train"))

    def val_dataset(self) -> WindowBatches:
        cache = self._require_setup()
        return WindowBatches(cache.path / "val.bin", len(cache.val), self.val_offsets, self.block_size,
                             self.batch_size, self._labels_file("val"), *self._steps_file("val"),
                             targets=self._targets_file("val"))

    def _labels_file(self, split: str) -> Path | None:
        """The labels that mask the loss to answers (data.loss=answers), else None."""
        return self.cache_path / f"{split}.labels.bin" if self.data.answers_only() else None

    def _steps_file(self, split: str) -> tuple[Path | None, int]:
        """The per-step targets and their width S (None, 0 without them)."""
        return (self.cache_path / f"{split}.steps.bin", self.step_width) if self.step_width else (None, 0)

    def _targets_file(self, split: str) -> Path | None:
        """The scored stream y is read from (a task with in-place targets), else None."""
        return self.cache_path / f"{split}.targets.bin" if self.cache.train_targets is not None else None

    def _scored(self, split: str) -> np.memmap:
        """What the predictions of a split are scored against: its scored stream, else its tokens."""
        cache = self._require_setup()
        stream = cache.train_targets if split == "train" else cache.val_targets
        if stream is not None:
            return stream
        return self.train_tokens if split == "train" else self.val_tokens

    def train_dataloader(self, start_step: int | None = None) -> ResumableLoader:
        """Batches in a fixed order, from start_step (default self.start_step) on. The
        loader is resumable: Lightning saves its state (the steps taken) in every
        checkpoint and hands it back on resume, so a resumed run sees exactly the batches
        it has not seen."""
        k = self.start_step if start_step is None else int(start_step)
        if not 0 <= k <= self.max_steps:
            raise ValueError(f"data: start_step={k} outside [0, max_steps={self.max_steps}]")
        return ResumableLoader(self.train_dataset(), self.train_order(), k, self,
                               num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        # batch_size=None: the dataset already yields whole batches.
        return DataLoader(self.val_dataset(), batch_size=None, shuffle=False,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    # -- evaluation helpers -------------------------------------------------------------

    def val_targets(self) -> np.ndarray:
        """The val tokens that val_dataloader scores as targets, in order (each once):
        val[1 : n_windows * block_size + 1] (of the scored stream, where the data has one)."""
        self._require_setup()
        first = int(self.val_offsets[0]) if len(self.val_offsets) else 0
        return np.asarray(self._scored("val")[first + 1 : first + len(self.val_offsets) * self.block_size + 1])

    def unigram_log_prior(self) -> np.ndarray:
        """log p(t) of the train split's add-one smoothed unigram over all 50257 GPT-2 ids,
        in the model vocabulary (`Vocab.unigram_log_prior`); of its scored stream, where the
        data has one (what the predictions target)."""
        self._require_setup()
        return self.vocab.unigram_log_prior(self._scored("train"))

    def unigram_ce(self) -> float:
        """Cross-entropy (nats/token, over all GPT-2 ids) of exactly the targets
        val_dataloader scores, under the train split's add-one smoothed unigram
        (`Vocab.unigram_ce`). A baseline any model should beat. With data.loss=answers,
        the unigram of the train split's answers on the val targets that are answers (what
        val/ce then scores)."""
        cache = self._require_setup()
        if self.data.answers_only():
            first = int(self.val_offsets[0]) if len(self.val_offsets) else 0
            n = len(self.val_offsets) * self.block_size
            answer = np.asarray(cache.val_labels[first + 1 : first + n + 1]) > 0
            train = np.asarray(self._scored("train"))[np.asarray(cache.train_labels) > 0]
            return self.vocab.unigram_ce(train, self.val_targets()[answer])
        return self.vocab.unigram_ce(self._scored("train"), self.val_targets())

    def heldout_tokens(self, n: int, start: int = 0) -> np.ndarray:
        """n val tokens from offset `start` (model ids, int64), for token-by-token evaluation:
        the test split is the first ones, the calibration split (recdepth.calibrate) follows it."""
        self._require_setup()
        if not (0 < n and 0 <= start and start + n <= len(self.val_tokens)):
            raise ValueError(
                f"data: heldout_tokens(n={n}, start={start}) outside the {len(self.val_tokens)} val tokens"
            )
        for name, (first, size) in self._require_setup().regions.items():
            # a task's range must stay inside one region (and the EOT after it)
            if first <= start <= first + size and start + n > first + size + 1:
                raise ValueError(f"data: {n} held-out tokens from offset {start} run past the task's {name} split "
                                 f"(val tokens [{first}, {first + size}], data.{name}_records x block_size; "
                                 f"eval.tokens / calibration.tokens too large?)")
        return np.asarray(self.val_tokens[start : start + n], dtype=np.int64)

    def heldout_labels(self, n: int, start: int = 0) -> np.ndarray | None:
        """The labels of `heldout_tokens(n, start)` (0 = not an answer, d >= 1 = an answer of
        difficulty d), or None for text, which has none."""
        cache = self._require_setup()
        self.heldout_tokens(n, start)  # the same range checks
        return None if cache.val_labels is None else np.asarray(cache.val_labels[start : start + n], dtype=np.int64)

    def heldout_steps(self, n: int, start: int = 0) -> np.ndarray | None:
        """The per-step targets of `heldout_tokens(n, start)`, int64 [n, S] model ids: row i,
        column t - 1 the target of token start + i after loop application t, -1 where it has
        none (its own id from there); None for data without per-step targets. Like the
        labels they belong to the tokens: the prediction at position p targets token p + 1's."""
        cache = self._require_setup()
        self.heldout_tokens(n, start)  # the same range checks
        if cache.val_steps is None:
            return None
        z = np.asarray(cache.val_steps[start : start + n], dtype=np.int64)
        return np.where(z == NO_STEP, -1, z)

    def heldout_targets(self, n: int, start: int = 0) -> np.ndarray | None:
        """The scored stream of `heldout_tokens(n, start)` (model ids, int64: the tokens, each
        scored symbol in place of its token; the prediction at position p is scored against
        entry p + 1), or None for data without in-place targets (scored against the tokens)."""
        cache = self._require_setup()
        self.heldout_tokens(n, start)  # the same range checks
        return None if cache.val_targets is None else np.asarray(cache.val_targets[start : start + n], dtype=np.int64)

    def region(self, name: str) -> tuple[int, int]:
        """A task's val-split region (test, validation, extrapolation): (first token, tokens)."""
        regions = self._require_setup().regions
        if name not in regions:
            raise ValueError(f"data: the {name!r} split exists for a task's data only (this data is "
                             f"data={self.data.source})")
        first, n = regions[name]
        if not n:
            raise ValueError(f"data.{name}_records: this task's data holds no {name} split (0 records); evaluate a "
                             f"checkpoint's with eval.task, e.g. +eval.task.extrapolation=[lo,hi]")
        return int(first), int(n)

    def decode(self, ids) -> str:
        """Model ids -> text ("other" shows as U+FFFD, the replacement character)."""
        self._require_setup()
        return self.vocab.decode(ids)
