"""Tokenizing a source into its token cache, nanoGPT style.

The documents of a source (recdepth/data/sources/: a `SourceSpec`) are tokenized with GPT-2 BPE
(`recdepth.data.tokenizer.gpt2`) by `datasets`' `Dataset.map` (batched), an end-of-text token
(EOT, 50256) after *each* document, and written once into one flat uint16 memmap, the way
nanoGPT's prepare scripts do. The stream is then cut: the first `1 - val_fraction` of it
is the train split, the tail is the val split. `max_tokens`, when set, cuts the token
stream at exactly that many tokens (the last document is usually cut mid-way).

The documents are mapped in consecutive blocks (the first of about 1M tokens, each next
one twice as large up to 32x), each block one `Dataset.map` with an explicit
`new_fingerprint` made of the cache key and the block's index, cached by `datasets` as
`<cache_dir>/hf-datasets/tokenized/<source>-<key[:16]>/<fingerprint>.arrow`. Blocks stop
as soon as they hold `max_tokens` tokens (a capped hub stream is abandoned there), and a
build that crashed resumes at the first block it had not mapped. The block files are
deleted once the token cache is complete: the cache holds the same tokens.

Cache layout
------------
  <cache_dir>/tokens/<source>-<key[:16]>/
      train.bin    uint16 token ids of the train split
      val.bin      uint16 token ids of the val split
      vocab.npy    int64, compact id -> GPT-2 id, -1 for the shared "other" entry
                   (only with compact_vocab; `recdepth.data.vocabulary` reads it)
      meta.json    source, parameters, tokenizer id, content hash, counts, vocab info
  <cache_dir>/hf-datasets/   `datasets`' lock files and the map cache of unfinished builds

`cache_dir` defaults to $RECDEPTH_CACHE, else ~/.cache/recdepth. The key is the sha256 of:
the cache format version, the source name, the source's parameters that change the
tokens, the tokenizer id, the source's content hash (its `SourceSpec`),
val_fraction and compact_vocab: editing a local file gives a new key.

Crash safety: a build first deletes meta.json, writes every other file under a temporary
name, moves it into place with os.replace, and writes meta.json last (also atomically).
A cache is used only if meta.json parses, carries the expected key, and the sizes of
train.bin / val.bin / vocab.npy agree with it; anything else is rebuilt (with a log
warning), never trusted.

Compact vocabulary: with `compact_vocab` (the default for shakespeare) the .bin files hold
compact ids 0..V_c: the sorted GPT-2 ids of the train split, then V_c = "other" for every
other GPT-2 id; vocab.npy maps them back (`recdepth.data.vocabulary` explains the scoring).

A generated task's cache (`prepare_task_tokens`) holds its records (recdepth/data/tasks/)
and their per-token labels beside the tokens (train.labels.bin, val.labels.bin, uint16), and
for a task with per-step targets those too (train.steps.bin, val.steps.bin: uint16, S =
meta.json's `step_width` per token, compact ids like the tokens, NO_STEP where none), and for
a task with in-place targets its scored stream (train.targets.bin, val.targets.bin: uint16,
compact ids, the tokens with each scored symbol in place of its token; meta.json's
`targets`: true).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from recdepth.data import tasks
from recdepth.data.tokenizer import EOT_ID, GPT2_VOCAB_SIZE, gpt2, tokenizer_id

log = logging.getLogger(__name__)

# Bump when the on-disk layout or the tokenization procedure changes: old caches then
# simply stop matching.
CACHE_FORMAT = 2  # 2: compact vocabulary from the train split only, plus "other"
# Block k of documents holds up to min(2**k, BLOCK_GROWTH) * (BLOCK_CHARS characters or
# BLOCK_DOCS documents): about 1M tokens first (a capped stream stops early), up to
# ~128M characters later (few cache files, bounded memory).
BLOCK_CHARS = 1 << 22
BLOCK_DOCS = 4096
BLOCK_GROWTH = 32
THREADS = max(1, min(8, os.cpu_count() or 1))  # encode_ordinary_batch's thread pool
WRITE_ROWS = 4096  # tokenized documents copied into the memmap at a time


def default_cache_dir() -> Path:
    return Path(os.environ.get("RECDEPTH_CACHE") or "~/.cache/recdepth").expanduser()


@dataclass
class SourceSpec:
    """A resolved source (a text source's `documents`, recdepth/data/sources/): how to get
    its documents, and everything its tokens depend on."""

    source: str
    params: dict  # parameters that change the tokens (go into the key and meta.json)
    content_hash: str
    documents: Callable[[], Iterator[str]]
    max_tokens: int | None


def key_fields(spec: SourceSpec, val_fraction: float, compact_vocab: bool) -> dict:
    """What a token cache's content depends on: hashed into its key, recorded in meta.json."""
    return {
        "format": CACHE_FORMAT,
        "source": spec.source,
        "params": spec.params,
        "tokenizer": tokenizer_id(),
        "content_hash": spec.content_hash,
        "val_fraction": float(val_fraction),
        "compact_vocab": bool(compact_vocab),
    }


def cache_key(spec: SourceSpec, val_fraction: float, compact_vocab: bool) -> str:
    blob = key_fields(spec, val_fraction, compact_vocab)
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


@dataclass
class TokenCache:
    """An opened cache directory."""

    path: Path
    meta: dict
    train: np.memmap
    val: np.memmap
    id_map: np.ndarray | None  # compact id -> GPT-2 id, or None
    built: bool  # True if this call tokenized the corpus, False if it reused the cache
    # a task cache (`prepare_task_tokens`) only: per-token labels aligned with train / val
    # (0 = not an answer, d >= 1 = an answer of difficulty d)
    train_labels: np.memmap | None = None
    val_labels: np.memmap | None = None
    # a task with per-step targets only: [tokens, step_width] model ids aligned with train /
    # val, column t - 1 the token's target after loop application t (tasks.NO_STEP: none)
    train_steps: np.memmap | None = None
    val_steps: np.memmap | None = None
    # a task with in-place targets only: the scored stream aligned with train / val (the
    # tokens, each scored symbol in place of its token): what each prediction is scored against
    train_targets: np.memmap | None = None
    val_targets: np.memmap | None = None

    @property
    def step_width(self) -> int:
        """S, the per-step targets kept per token (0: none; a task's `step_width()`)."""
        return int(self.meta.get("step_width", 0))

    @property
    def regions(self) -> dict[str, list[int]]:
        """A task cache's val-split regions, name -> [first token, tokens] (test first, at
        0); {} for text, whose whole val split is one stream."""
        return dict(self.meta.get("regions", {}))

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def n_other(self) -> int:
        """GPT-2 ids that share the "other" entry (0 without a compact vocabulary)."""
        return int(self.meta["n_other"])


def open_cache(path: Path, key: str) -> tuple[TokenCache | None, str]:
    """The cache at `path` if it is complete and matches `key`, else (None, why not)."""
    meta_path = path / "meta.json"
    if not meta_path.exists():
        return None, "no meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("key") != key or meta.get("format") != CACHE_FORMAT:
            return None, f"{meta_path} belongs to another key or format"
        n_train, n_val, vocab_size = (
            int(meta["n_train"]),
            int(meta["n_val"]),
            int(meta["vocab_size"]),
        )
        compact = bool(meta["compact_vocab"])
        int(meta["n_other"])
        width = int(meta.get("step_width", 0))  # a task's per-step targets per token (0: none)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{meta_path} is unreadable ({type(e).__name__}: {e})"
    labelled = bool(meta.get("labels", False))
    in_place = bool(meta.get("targets", False))  # a task's scored stream (in-place targets)
    files = [("train.bin", n_train, 2), ("val.bin", n_val, 2)]
    if labelled:
        label_bytes = np.dtype(tasks.LABEL_DTYPE).itemsize
        files += [("train.labels.bin", n_train, label_bytes), ("val.labels.bin", n_val, label_bytes)]
    if in_place:
        files += [("train.targets.bin", n_train, 2), ("val.targets.bin", n_val, 2)]
    if width:
        files += [("train.steps.bin", n_train, 2 * width), ("val.steps.bin", n_val, 2 * width)]
    for name, n, item in files:
        f = path / name
        if not f.exists() or f.stat().st_size != item * n:
            size = f.stat().st_size if f.exists() else "missing"
            return None, f"{f} has size {size}, meta.json says {item * n} bytes"
    id_map = None
    if compact:
        try:
            id_map = np.load(path / "vocab.npy")
        except (OSError, ValueError) as e:
            return None, f"{path / 'vocab.npy'} is unreadable ({e})"
        if id_map.shape != (vocab_size,):
            return None, f"{path / 'vocab.npy'} has {id_map.shape} entries, meta says {vocab_size}"
    train = np.memmap(path / "train.bin", dtype=np.uint16, mode="r", shape=(n_train,))
    val = np.memmap(path / "val.bin", dtype=np.uint16, mode="r", shape=(n_val,))
    cache = TokenCache(path, meta, train, val, id_map, built=False)
    if labelled:
        cache.train_labels = np.memmap(path / "train.labels.bin", dtype=tasks.LABEL_DTYPE, mode="r", shape=(n_train,))
        cache.val_labels = np.memmap(path / "val.labels.bin", dtype=tasks.LABEL_DTYPE, mode="r", shape=(n_val,))
    if width:
        cache.train_steps = np.memmap(path / "train.steps.bin", dtype=np.uint16, mode="r", shape=(n_train, width))
        cache.val_steps = np.memmap(path / "val.steps.bin", dtype=np.uint16, mode="r", shape=(n_val, width))
    if in_place:
        cache.train_targets = np.memmap(path / "train.targets.bin", dtype=np.uint16, mode="r", shape=(n_train,))
        cache.val_targets = np.memmap(path / "val.targets.bin", dtype=np.uint16, mode="r", shape=(n_val,))
    return cache, ""


# ---------------------------------------------------------------------------------------
# Tokenizing: Dataset.map over blocks of documents, then one flat uint16 memmap.


def tokenize_batch(batch: dict) -> dict:
    """The `Dataset.map` function: each document's GPT-2 ids followed by EOT, and their
    number."""
    ids = gpt2().encode_ordinary_batch(batch["text"], num_threads=THREADS)
    for t in ids:
        t.append(EOT_ID)
    return {"ids": ids, "len": [len(t) for t in ids]}


def document_blocks(docs: Iterator[str]) -> Iterator[list[str]]:
    """Consecutive blocks of the documents, sized as BLOCK_* says. A block's bounds depend
    only on the documents, so block k of a source is always the same text. Closing this
    generator closes `docs` (which ends a hub stream)."""
    try:
        k, block, chars = 0, [], 0
        for doc in docs:
            block.append(doc)
            chars += len(doc)
            g = min(1 << k, BLOCK_GROWTH)
            if chars >= g * BLOCK_CHARS or len(block) >= g * BLOCK_DOCS:
                yield block
                k, block, chars = k + 1, [], 0
        if block:
            yield block
    finally:
        close = getattr(docs, "close", None)
        if close is not None:
            close()


def tokenized_blocks(spec: SourceSpec, key: str, blocks_dir: Path) -> tuple[list, int]:
    """`Dataset`s of (ids, len), one per block, in order, until they hold spec.max_tokens
    tokens (all documents without a cap), and the number of tokens they hold. Block k is
    cached under the fingerprint <key[:40]>-<k>: an existing one is loaded, not tokenized
    again."""
    import datasets
    import pyarrow.compute as pc

    features = datasets.Features(
        {"ids": datasets.Sequence(datasets.Value("uint16")), "len": datasets.Value("int64")}
    )
    out, n = [], 0
    blocks = document_blocks(iter(spec.documents()))
    try:
        for k, docs in enumerate(blocks):
            fingerprint = f"{key[:40]}-{k:05d}"
            blocks_dir.mkdir(parents=True, exist_ok=True)
            ds = datasets.Dataset.from_dict({"text": docs}).map(
                tokenize_batch,
                batched=True,
                remove_columns=["text"],
                features=features,
                new_fingerprint=fingerprint,
                cache_file_name=str(blocks_dir / f"{fingerprint}.arrow"),
                desc=f"tokenizing {spec.source} (block {k})",
            )
            out.append(ds)
            n += pc.sum(ds.data.column("len")).as_py() or 0
            if spec.max_tokens is not None and n >= spec.max_tokens:
                break
    finally:
        blocks.close()
    return out, n


def block_tokens(blocks: Sequence) -> Iterator[np.ndarray]:
    """The token stream of tokenized blocks, as uint16 chunks, in order."""
    for ds in blocks:
        for batch in ds.with_format("arrow").iter(batch_size=WRITE_ROWS):
            yield batch.column("ids").combine_chunks().flatten().to_numpy()


def build_cache(
    path: Path, key: str, spec: SourceSpec, val_fraction: float, compact_vocab: bool,
    progress: bool, blocks_dir: Path,
) -> None:
    import datasets

    path.mkdir(parents=True, exist_ok=True)
    # Invalidate first: from here until meta.json is rewritten, a crash leaves a cache
    # that open_cache refuses.
    (path / "meta.json").unlink(missing_ok=True)
    tag = f".tmp-{os.getpid()}"
    tmp = {n: path / f"{n}{tag}" for n in ("tokens.bin", "val.bin", "vocab.npy", "meta.json")}
    t0 = time.time()
    bars = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        blocks, n = tokenized_blocks(spec, key, blocks_dir)
        if spec.max_tokens is not None:
            n = min(n, spec.max_tokens)
        # nanoGPT's tail split: train = the first int(n * (1 - val_fraction)) tokens.
        n_train = int(n * (1.0 - val_fraction))
        n_val = n - n_train
        if n_train == 0 or n_val == 0:
            raise ValueError(
                f"data: source {spec.source!r} gave only {n} tokens, too few to split with "
                f"val_fraction={val_fraction}"
            )
        tokens = np.memmap(tmp["tokens.bin"], dtype=np.uint16, mode="w+", shape=(n,))
        counts = np.zeros(GPT2_VOCAB_SIZE, dtype=np.int64)
        i = 0
        for chunk in block_tokens(blocks):
            chunk = chunk[: n - i]
            tokens[i : i + len(chunk)] = chunk
            counts += np.bincount(chunk, minlength=GPT2_VOCAB_SIZE)
            i += len(chunk)
            if i == n:
                break
        n_other = val_other = 0
        if compact_vocab:
            # The train split alone chooses the vocabulary; everything else is "other".
            train_counts = np.zeros(GPT2_VOCAB_SIZE, dtype=np.int64)
            step = 1 << 24
            for i in range(0, n_train, step):
                train_counts += np.bincount(tokens[i : min(i + step, n_train)], minlength=GPT2_VOCAB_SIZE)
            vocab = np.flatnonzero(train_counts)  # sorted GPT-2 ids of the train split
            other = len(vocab)
            n_other = GPT2_VOCAB_SIZE - len(vocab)
            val_other = int(n - n_train - (counts - train_counts)[vocab].sum())
            lut = np.full(GPT2_VOCAB_SIZE, other, dtype=np.uint16)
            lut[vocab] = np.arange(len(vocab), dtype=np.uint16)
            for i in range(0, n, step):  # remap in place, in bounded-memory chunks
                tokens[i : i + step] = lut[tokens[i : i + step]]
            with open(tmp["vocab.npy"], "wb") as fh:
                np.save(fh, np.append(vocab, -1).astype(np.int64))
            vocab_size = len(vocab) + 1
        else:
            vocab_size = GPT2_VOCAB_SIZE
        tokens[n_train:].tofile(tmp["val.bin"])
        tokens.flush()
        del tokens
        os.truncate(tmp["tokens.bin"], 2 * n_train)  # what is left is exactly the train split

        os.replace(tmp["tokens.bin"], path / "train.bin")
        os.replace(tmp["val.bin"], path / "val.bin")
        if compact_vocab:
            os.replace(tmp["vocab.npy"], path / "vocab.npy")
        else:
            (path / "vocab.npy").unlink(missing_ok=True)
        fields = key_fields(spec, val_fraction, compact_vocab)
        meta = {
            "format": fields.pop("format"),
            "key": key,
            **fields,
            "n_tokens": n,
            "n_train": n_train,
            "n_val": n_val,
            "dtype": "uint16",
            "vocab_size": vocab_size,
            "n_other": n_other,
            "val_other_tokens": val_other,
            "gpt2_vocab_size": GPT2_VOCAB_SIZE,
            "eot_gpt2_id": EOT_ID,
            "n_eot": int(counts[EOT_ID]),
            "gpt2_ids_used": int(np.count_nonzero(counts)),
            "build_seconds": round(time.time() - t0, 3),
        }
        tmp["meta.json"].write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp["meta.json"], path / "meta.json")
        for ds in blocks:  # the cache holds these tokens now
            for f in ds.cache_files:
                Path(f["filename"]).unlink(missing_ok=True)
        try:
            blocks_dir.rmdir()
        except OSError:
            pass
    finally:
        for f in tmp.values():
            f.unlink(missing_ok=True)
        if bars and not progress:
            datasets.enable_progress_bars()
    log.info("tokenized %s: %d tokens in %.1fs -> %s", spec.source, n, time.time() - t0, path)


def prepare_tokens(
    resolve: Callable[[Path], SourceSpec],
    *,
    cache_dir: str | os.PathLike | None = None,
    val_fraction: float = 0.05,
    compact_vocab: bool = False,
    progress: bool = True,
) -> TokenCache:
    """Open the token cache of a source, tokenizing it first if there is no valid one.

    `resolve(hf_cache)` is the source's `SourceSpec` (a text source's `documents`,
    recdepth/data/sources/source.py; `hf_cache` is where `datasets` keeps its lock files).
    """
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"data.val_fraction: must be in (0, 1), got {val_fraction}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    spec = resolve(root / "hf-datasets")
    key = cache_key(spec, val_fraction, compact_vocab)
    name = f"{spec.source}-{key[:16]}"
    cache_path = root / "tokens" / name
    cache, why = open_cache(cache_path, key)
    if cache is not None:
        return cache
    if cache_path.exists() and why != "no meta.json":
        log.warning("rebuilding token cache %s: %s", cache_path, why)
    blocks_dir = root / "hf-datasets" / "tokenized" / name
    build_cache(cache_path, key, spec, float(val_fraction), compact_vocab, progress, blocks_dir)
    cache, why = open_cache(cache_path, key)
    if cache is None:  # only if something else wrote into the directory meanwhile
        raise RuntimeError(f"data: token cache {cache_path} is invalid right after building: {why}")
    cache.built = True
    return cache


# ---------------------------------------------------------------------------------------
# Task caches: generated records (recdepth/data/tasks/) with their per-token labels.
TASK_REGIONS = ("test", "validation", "extrapolation")


def task_key_fields(task: tasks.Task, length: int, counts: dict[str, int], seed: int,
                    extrapolation: tasks.Task | None = None) -> dict:
    """What a task cache's content depends on: hashed into its key, recorded in meta.json."""
    out = {"format": CACHE_FORMAT, "source": "task", "task_version": tasks.TASK_VERSION,
           "tokenizer": tokenizer_id(), "task": json.loads(json.dumps(asdict(task))),
           "length": int(length), "records": dict(counts), "instance_seed": int(seed), "compact_vocab": True}
    if extrapolation is not None:
        out["extrapolation_task"] = json.loads(json.dumps(asdict(extrapolation)))
    return out


def prepare_task_tokens(task: tasks.Task, length: int, counts: dict[str, int], seed: int = 0,
                        cache_dir: str | os.PathLike | None = None,
                        extrapolation: tasks.Task | None = None) -> TokenCache:
    """Open the token cache of a generated task, building it first if there is no valid one.
    `extrapolation` (a task of the same name): the task the extrapolation split is drawn from
    instead of `task` (`TaskData.extrapolation_task`).

    train.bin holds counts["train"] records of `length` tokens (`tasks.records`) and a final
    EOT (the last record's last target); val.bin holds the test, validation and extrapolation
    records, each region followed by one EOT, so a region starts right after the previous
    one's last target: test at 0 (`recdepth.evaluate`'s split), validation at
    test + 1 (where `recdepth.calibrate` starts when eval.tokens is the test region's size).
    `train.labels.bin` / `val.labels.bin` (uint16, `tasks.LABEL_DTYPE`) label every token (0 = not an answer,
    d >= 1 = answer of difficulty d). A task with per-step targets (`task.step_width()` =
    S > 0) adds `train.steps.bin` / `val.steps.bin` (uint16, [tokens, S] row-major): token
    i's target after loop application t at column t - 1, in the cache's ids like the
    tokens, `tasks.NO_STEP` where it has none (past its last step: its own id). A task with
    in-place targets (`task.in_place()`) adds `train.targets.bin` / `val.targets.bin`
    (uint16, the cache's ids), the scored stream: the tokens, each scored symbol in place of
    its token (meta.json's `targets`: true). The vocabulary is compact: the symbols the train
    split uses (its tokens and its scored symbols), EOT among them, plus "other"."""
    for split in ("train", *TASK_REGIONS):
        least = int(split != "extrapolation")  # 0 extrapolation records: an empty region
        if int(counts.get(split, 0)) < least:
            raise ValueError(f"data.{split}_records: expected a number of records >= {least}, got {counts.get(split)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    fields = task_key_fields(task, length, counts, seed, extrapolation)
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    path = root / "tokens" / f"task-{task.name}-{key[:16]}"
    cache, why = open_cache(path, key)
    if cache is not None:
        return cache
    if path.exists() and why != "no meta.json":
        log.warning("rebuilding token cache %s: %s", path, why)
    t0 = time.time()
    ids = tasks.symbol_ids(gpt2().encode_ordinary)
    # an extrapolation task with larger sizes may state more per-step targets: every split is
    # written at the widest, the narrower ones' extra columns without a target
    width = max(task.step_width(), 0 if extrapolation is None else extrapolation.step_width())
    in_place = task.in_place()

    def widened(part: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        if not width or part[2].shape[1] == width:
            return part
        pad = np.full((len(part[2]), width - part[2].shape[1]), tasks.NO_STEP, dtype=np.uint16)
        return (*part[:2], np.concatenate([part[2], pad], axis=1), *part[3:])

    # the EOT closing each split / region: its label 0, no per-step target, scored as itself
    tail = (np.array([EOT_ID], dtype=np.uint16), np.zeros(1, dtype=tasks.LABEL_DTYPE))
    tail += (np.full((1, width), tasks.NO_STEP, dtype=np.uint16),) if width else ()
    tail += (np.array([EOT_ID], dtype=np.uint16),) if in_place else ()
    streams, regions = {}, {}
    tr = widened(tasks.records(task, "train", seed, int(counts["train"]), length, ids, EOT_ID))
    streams["train"] = tuple(np.concatenate([a, b]) for a, b in zip(tr, tail[: len(tr)], strict=True))
    parts, start = [], 0
    for name in TASK_REGIONS:
        drawn = extrapolation if name == "extrapolation" and extrapolation is not None else task
        part = widened(tasks.records(drawn, name, seed, int(counts[name]), length, ids, EOT_ID))
        regions[name] = [start, len(part[0])]
        parts.append(tuple(np.concatenate([a, b]) for a, b in zip(part, tail[: len(part)], strict=True)))
        start += len(part[0]) + 1
    streams["val"] = tuple(np.concatenate(x) for x in zip(*parts, strict=True))
    # the train split chooses the vocabulary: its tokens and, in place, the symbols scored
    vocab = np.unique(np.concatenate([streams["train"][0], streams["train"][-1]]) if in_place else streams["train"][0])
    lut = np.full(GPT2_VOCAB_SIZE, len(vocab), dtype=np.uint16)
    lut[vocab] = np.arange(len(vocab), dtype=np.uint16)

    def compact_steps(st: np.ndarray) -> np.ndarray:  # GPT-2 ids -> the cache's, NO_STEP kept
        return np.where(st == tasks.NO_STEP, st, lut[np.minimum(st, GPT2_VOCAB_SIZE - 1)]).astype(np.uint16)

    path.mkdir(parents=True, exist_ok=True)
    (path / "meta.json").unlink(missing_ok=True)
    tag = f".tmp-{os.getpid()}"
    written = []
    try:
        for split, (t, lab, *more) in streams.items():
            files = [(f"{split}.bin", lut[t]), (f"{split}.labels.bin", lab)]
            files += [(f"{split}.steps.bin", compact_steps(more[0]))] if width else []
            files += [(f"{split}.targets.bin", lut[more[-1]])] if in_place else []
            for name, arr in files:
                arr.tofile(path / f"{name}{tag}")
                written.append(name)
        with open(path / f"vocab.npy{tag}", "wb") as fh:
            np.save(fh, np.append(vocab, -1).astype(np.int64))
        written.append("vocab.npy")
        for name in written:
            os.replace(path / f"{name}{tag}", path / name)
        fields = dict(fields)
        meta = {"format": fields.pop("format"), "key": key, **fields,
                "n_tokens": sum(len(arrays[0]) for arrays in streams.values()), "n_train": len(streams["train"][0]),
                "n_val": len(streams["val"][0]), "dtype": "uint16", "vocab_size": len(vocab) + 1,
                "n_other": GPT2_VOCAB_SIZE - len(vocab), "val_other_tokens": int((lut[streams["val"][0]] == len(vocab)).sum()),
                "gpt2_vocab_size": GPT2_VOCAB_SIZE, "eot_gpt2_id": EOT_ID, "labels": True, "regions": regions,
                "answers": {s: int((arrays[1] > 0).sum()) for s, arrays in streams.items()},
                "step_width": width, **({"targets": True} if in_place else {}),
                "build_seconds": round(time.time() - t0, 3)}
        (path / f"meta.json{tag}").write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(path / f"meta.json{tag}", path / "meta.json")
    finally:
        for f in path.glob(f"*{tag}"):
            f.unlink(missing_ok=True)
    log.info("generated task %s: %d records of %d tokens in %.1fs -> %s", task.name, sum(counts.values()), length,
             time.time() - t0, path)
    cache, why = open_cache(path, key)
    if cache is None:
        raise RuntimeError(f"data: task cache {path} is invalid right after building: {why}")
    cache.built = True
    return cache
