"""The LightningDataModule: random train windows and consecutive val windows over a token
cache.

Where the rest lives: `recdepth.glue.documents` (the sources and their documents),
`recdepth.glue.tokens` (tokenizing into the token cache), `recdepth.glue.vocab` (the model's
vocabulary over GPT-2's, the unigram baseline), `recdepth.glue.windows` (window batches, the
training order, the resumable loader).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from recdepth.core.tasks import TaskSpec, check_loss
from recdepth.glue.documents import FINEWEB_CONFIG, FINEWEB_REPO, SOURCES
from recdepth.glue.tokens import TokenCache, prepare_task_tokens, prepare_tokens
from recdepth.glue.vocab import Vocab
from recdepth.glue.windows import ResumableLoader, TrainOrder, WindowBatches


class TokenDataModule(L.LightningDataModule):
    """Random train windows and consecutive val windows over a token cache.

    Train: max_steps batches of batch_size windows of block_size + 1 tokens at offsets
    `train_offsets` (`windows.TrainOrder`: batch k is a function of seed and k). Val: the
    first `val_tokens` val tokens (all of them if None) cut into non-overlapping windows
    with stride block_size, in order; the leftover tail shorter than a window is dropped.

    After setup, `vocab` maps model ids to GPT-2 ids and back (`recdepth.glue.vocab`);
    vocab_size, id_map, n_other, other_id and eot_id are its, for the model's config.

    Note: the constructor argument `val_tokens` (the cap, kept as `val_token_cap`) and
    the attribute `val_tokens` (the val split memmap, set by setup) are different things.
    """

    def __init__(
        self,
        source: str,
        block_size: int,
        batch_size: int,
        max_steps: int,
        seed: int = 1337,
        val_fraction: float = 0.05,
        val_tokens: int | None = 65536,
        compact_vocab: bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        path: str | os.PathLike | None = None,
        paths: Sequence[str | os.PathLike] | str | None = None,
        text_column: str = "text",
        max_tokens: int | None = None,
        num_workers: int = 0,
        dataset_name: str = FINEWEB_REPO,
        dataset_config: str = FINEWEB_CONFIG,
        encoding: str = "utf-8",
        task: str = "hops",
        size: Sequence[int] = (1, 4),
        extrapolation: Sequence[int] = (5, 8),
        chains: int = 2,
        distractors: int = 2,
        layout: str = "shuffled",
        names: int = 16,
        nines: float = 0.25,
        modulus: int = 10,
        train_records: int = 20000,
        test_records: int = 256,
        validation_records: int = 256,
        extrapolation_records: int = 256,
        instance_seed: int = 0,
        loss: str = "all",
    ):
        super().__init__()
        if source not in SOURCES:
            raise ValueError(
                f"data.source: unknown source {source!r} (expected one of {', '.join(SOURCES)})"
            )
        for name, value, lo in (
            ("block_size", block_size, 1),
            ("batch_size", batch_size, 1),
            ("max_steps", max_steps, 0),
            ("num_workers", num_workers, 0),
        ):
            if int(value) < lo:
                raise ValueError(f"data.{name}: must be >= {lo}, got {value}")
        if val_tokens is not None and int(val_tokens) < 1:
            raise ValueError(f"data.val_tokens: must be positive or None, got {val_tokens}")
        self.source = source
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self.max_steps = int(max_steps)
        self.seed = int(seed)
        self.val_fraction = float(val_fraction)
        self.val_token_cap = None if val_tokens is None else int(val_tokens)
        self.compact_vocab = compact_vocab
        self.cache_dir = cache_dir
        self.path = path
        # Hydra hands lists over as ListConfig; plain lists hash and pickle predictably.
        self.paths = (
            [paths]
            if isinstance(paths, str | os.PathLike)
            else (None if paths is None else [os.fspath(p) for p in paths])
        )
        self.text_column = text_column
        self.max_tokens = max_tokens
        self.num_workers = int(num_workers)
        self.dataset_name = dataset_name
        self.dataset_config = dataset_config
        self.encoding = encoding
        # source=task: the generated task (recdepth.core.tasks), its record counts per split and
        # which targets the training loss counts (answers | all)
        self.task_spec = (TaskSpec(task, tuple(int(v) for v in size), tuple(int(v) for v in extrapolation),
                                   chains=int(chains), distractors=int(distractors), layout=str(layout),
                                   names=int(names), nines=float(nines), modulus=int(modulus))
                          if source == "task" else None)
        self.records = {"train": int(train_records), "test": int(test_records),
                        "validation": int(validation_records), "extrapolation": int(extrapolation_records)}
        self.instance_seed = int(instance_seed)
        check_loss(source, loss)
        self.loss = loss
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

    # -- building / opening -------------------------------------------------------------

    def _prepare(self) -> TokenCache:
        if self.task_spec is not None:
            return prepare_task_tokens(self.task_spec, self.block_size, self.records, self.instance_seed,
                                       self.cache_dir)
        return prepare_tokens(
            self.source,
            cache_dir=self.cache_dir,
            val_fraction=self.val_fraction,
            compact_vocab=self.compact_vocab,
            path=self.path,
            paths=self.paths,
            text_column=self.text_column,
            max_tokens=self.max_tokens,
            dataset_name=self.dataset_name,
            dataset_config=self.dataset_config,
            encoding=self.encoding,
        )

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
                             self.batch_size, self._labels_file("train"))

    def val_dataset(self) -> WindowBatches:
        cache = self._require_setup()
        return WindowBatches(cache.path / "val.bin", len(cache.val), self.val_offsets, self.block_size,
                             self.batch_size, self._labels_file("val"))

    def _labels_file(self, split: str) -> Path | None:
        """The labels that mask the loss to answers (data.loss=answers), else None."""
        return self.cache_path / f"{split}.labels.bin" if self.loss == "answers" else None

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
        val[1 : n_windows * block_size + 1]."""
        self._require_setup()
        first = int(self.val_offsets[0]) if len(self.val_offsets) else 0
        return np.asarray(self.val_tokens[first + 1 : first + len(self.val_offsets) * self.block_size + 1])

    def unigram_log_prior(self) -> np.ndarray:
        """log p(t) of the train split's add-one smoothed unigram over all 50257 GPT-2 ids,
        in the model vocabulary (`Vocab.unigram_log_prior`)."""
        self._require_setup()
        return self.vocab.unigram_log_prior(self.train_tokens)

    def unigram_ce(self) -> float:
        """Cross-entropy (nats/token, over all GPT-2 ids) of exactly the targets
        val_dataloader scores, under the train split's add-one smoothed unigram
        (`Vocab.unigram_ce`). A baseline any model should beat. With data.loss=answers,
        the unigram of the train split's answers on the val targets that are answers (what
        val/ce then scores)."""
        cache = self._require_setup()
        if self.loss == "answers":
            first = int(self.val_offsets[0]) if len(self.val_offsets) else 0
            n = len(self.val_offsets) * self.block_size
            answer = np.asarray(cache.val_labels[first + 1 : first + n + 1]) > 0
            train = np.asarray(self.train_tokens)[np.asarray(cache.train_labels) > 0]
            return self.vocab.unigram_ce(train, self.val_targets()[answer])
        return self.vocab.unigram_ce(self.train_tokens, self.val_targets())

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

    def region(self, name: str) -> tuple[int, int]:
        """A task's val-split region (test, validation, extrapolation): (first token, tokens)."""
        regions = self._require_setup().regions
        if name not in regions:
            raise ValueError(f"data: the {name!r} split exists for data=task only (this data is {self.source})")
        first, n = regions[name]
        return int(first), int(n)

    def decode(self, ids) -> str:
        """Model ids -> text ("other" shows as U+FFFD, the replacement character)."""
        self._require_setup()
        return self.vocab.decode(ids)
