"""Token caches and the LightningDataModule.

Every source is a stream of text documents. It is tokenized once with GPT-2 BPE
(`recdepth.tokenizer.gpt2`), an end-of-text token (EOT, 50256) is appended after *each*
document, and the resulting token stream is cut nanoGPT style: the first
`1 - val_fraction` of it is the train split, the tail is the val split. Both are stored as
flat uint16 files and opened as `np.memmap`, so training never holds the corpus in memory.

Sources
-------
  shakespeare  the corpus shipped in recdepth/assets/shakespeare.jsonl.xz (42 plays)
  fineweb      HuggingFaceFW/fineweb (config sample-10BT, split train), streamed from the
               hub up to `max_tokens` tokens (required, so a typo can't start a 10B-token
               download); or, with `path`, local parquet files with FineWeb's columns
               (a file, a directory of *.parquet, or a glob), fully offline
  files        your own files (`paths`: files, directories or globs): .txt (one file = one
               document), .jsonl/.json and .parquet (one row = one document, column
               `text_column`)
`max_tokens`, when set, cuts the token stream at exactly that many tokens (for any
source; the last document is usually cut mid-way).

Cache layout
------------
  <cache_dir>/tokens/<source>-<key[:16]>/
      train.bin    uint16 token ids of the train split
      val.bin      uint16 token ids of the val split
      vocab.npy    int64, compact id -> GPT-2 id, -1 for the shared "other" entry
                   (only with compact_vocab)
      meta.json    source, parameters, tokenizer id, content hash, counts, vocab info
  <cache_dir>/hf-datasets/   lock files of the `datasets` builders used for local files

`cache_dir` defaults to $RECDEPTH_CACHE, else ~/.cache/recdepth.

The key is the sha256 of: the cache format version, the source name, the source's
parameters that change the tokens (text_column, max_tokens, hub repo/config/split), the
tokenizer id, a content hash, val_fraction and compact_vocab. The content hash is
  shakespeare     sha256 of the asset's bytes
  local files     sha256 over every file's absolute path and bytes (files, fineweb+path)
  fineweb (hub)   sha256 of (repo, config, split, max_tokens) -- the hub has no content
                  hash we can read cheaply; the repo is not pinned to a revision
so editing a local file gives a new key and the corpus is re-tokenized.

Crash safety: a build first deletes meta.json, writes every other file under a temporary
name, moves it into place with os.replace, and writes meta.json last (also atomically).
A cache is used only if meta.json parses, carries the expected key, and the sizes of
train.bin / val.bin / vocab.npy agree with it; anything else is rebuilt (with a log
warning), never trusted.

Compact vocabulary
------------------
With `compact_vocab` (the default for shakespeare, off otherwise) the model's vocabulary is
the sorted set of GPT-2 ids that occur in the **train split** (the held-out text plays no
part in choosing it), plus one shared "other" entry, the last id, that stands for every
GPT-2 id outside that set (SPEC §4, vocabulary). The model's probability of "other" is
spread evenly over those n_other ids, so a held-out token the train split never saw is
scored log p(other) − log n_other and CE stays a cross-entropy over all 50257 GPT-2 ids
(`recdepth.model.token_nll`). Shakespeare's train split uses 19,194 of GPT-2's 50257 tokens, so
the embedding / unembedding shrink by 2.6x. The .bin files hold compact ids 0..V_c (V_c =
"other") and vocab.npy maps them back (-1 for "other"); `TokenDataModule.to_gpt2` /
`from_gpt2` convert either way (`from_gpt2` sends unseen ids to "other").
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import lzma
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from recdepth.tokenizer import EOT_ID, GPT2_VOCAB_SIZE, gpt2, tokenizer_id

log = logging.getLogger(__name__)

# Bump when the on-disk layout or the tokenization procedure changes: old caches then
# simply stop matching.
CACHE_FORMAT = 2  # 2: compact vocabulary from the train split only, plus "other"
SOURCES = ("shakespeare", "fineweb", "files")
FINEWEB_REPO = "HuggingFaceFW/fineweb"
FINEWEB_CONFIG = "sample-10BT"
FINEWEB_SPLIT = "train"
TEXT_EXTS = (".txt",)
JSON_EXTS = (".jsonl", ".json")
PARQUET_EXTS = (".parquet",)
FILE_EXTS = TEXT_EXTS + JSON_EXTS + PARQUET_EXTS
FILES_EXPECTED = "text/jsonl/parquet files"
FINEWEB_EXPECTED = "FineWeb parquet files"
# Documents are handed to encode_ordinary_batch in chunks of about this many characters
# (~1M tokens): big enough for its thread pool, small enough to keep memory flat.
CHUNK_CHARS = 1 << 22
CHUNK_DOCS = 4096
# Rows pulled from a `datasets` stream at a time.
ROW_BATCH = 1024


def default_cache_dir() -> Path:
    return Path(os.environ.get("RECDEPTH_CACHE") or "~/.cache/recdepth").expanduser()


# ---------------------------------------------------------------------------------------
# Document sources: each yields str documents.


def shakespeare_bytes() -> bytes:
    return resources.files("recdepth").joinpath("assets", "shakespeare.jsonl.xz").read_bytes()


def iter_shakespeare() -> Iterator[str]:
    """The 42 plays, one document each, in the asset's order."""
    for line in lzma.decompress(shakespeare_bytes()).decode("utf-8").splitlines():
        if line.strip():
            yield json.loads(line)["text"]


def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def expand_paths(
    patterns: Iterable[str | os.PathLike], field: str, exts: Sequence[str], expected: str
) -> list[Path]:
    """Files named by `patterns` (files, directories, globs), in order, without duplicates.

    Globs and directories expand in sorted order so the token stream doesn't depend on the
    filesystem's listing order. Every error is one line naming `field` and the path.
    """
    out: list[Path] = []
    for raw in patterns:
        pattern = os.path.expanduser(os.fspath(raw))
        if _has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        elif os.path.isdir(pattern):
            matches = sorted(
                str(p) for p in Path(pattern).iterdir() if p.is_file() and p.suffix.lower() in exts
            )
        elif os.path.isfile(pattern):
            matches = [pattern]
        else:
            matches = []
        if not matches:
            raise ValueError(f"{field}: no file matches {pattern!r} (expected {expected})")
        for m in matches:
            p = Path(m).resolve()
            if p.suffix.lower() not in exts:
                raise ValueError(
                    f"{field}: unsupported file type {str(p)!r} (expected {expected}: "
                    f"{', '.join(exts)})"
                )
            if p.stat().st_size == 0:
                raise ValueError(f"{field}: {str(p)!r} is empty (expected {expected})")
            if p not in out:
                out.append(p)
    return out


def hash_files(files: Sequence[Path]) -> str:
    """sha256 over each file's absolute path and bytes, in order."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f).encode("utf-8") + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def _rows_text(ds, text_column: str, where: str, field: str) -> Iterator[str]:
    """Documents of one `datasets` IterableDataset, checking the column exists."""
    cols = ds.column_names
    if cols is not None and text_column not in cols:
        raise ValueError(
            f"{field}: column {text_column!r} not in {where} (columns: {', '.join(cols)})"
        )
    for batch in ds.iter(batch_size=ROW_BATCH):
        if text_column not in batch:
            raise ValueError(
                f"{field}: column {text_column!r} not in {where} (columns: {', '.join(batch)})"
            )
        for text in batch[text_column]:
            if not isinstance(text, str):
                raise ValueError(
                    f"{field}: column {text_column!r} of {where} holds a "
                    f"{type(text).__name__}, expected str"
                )
            yield text


def _not_text(f: Path, encoding: str, e: UnicodeDecodeError) -> ValueError:
    return ValueError(
        f"data.encoding: {str(f)!r} is not {encoding} text (byte {e.start}: {e.reason}); "
        "pass its encoding, e.g. data.encoding=latin-1 (Gutenberg texts often are), "
        "or leave binary files out"
    )


def iter_local_files(
    files: Sequence[Path], text_column: str, hf_cache: Path | None, field: str,
    encoding: str = "utf-8",
) -> Iterator[str]:
    """Documents of local files, by extension. .txt files are read directly (the whole
    file is one document, decoded with `encoding`); json/jsonl (also decoded with
    `encoding`) and parquet (UTF-8 by its format) go through `datasets`' packaged builders
    in streaming mode, which need no network. A file that does not decode raises one line
    naming it and data.encoding."""
    import datasets

    kw = {"split": "train", "streaming": True}
    if hf_cache is not None:
        kw["cache_dir"] = str(hf_cache)  # keeps datasets' lock files out of ~/.cache
    for f in files:
        ext = f.suffix.lower()
        if ext in TEXT_EXTS:
            try:
                yield f.read_text(encoding=encoding)
            except UnicodeDecodeError as e:
                raise _not_text(f, encoding, e) from None
        elif ext in JSON_EXTS:
            ds = datasets.load_dataset("json", data_files=[str(f)], encoding=encoding, **kw)
            try:
                yield from _rows_text(ds, text_column, repr(str(f)), field)
            except UnicodeDecodeError as e:
                raise _not_text(f, encoding, e) from None
        else:
            import pyarrow.parquet as pq

            # Check the schema first: the parquet builder's `columns=` misbehaves on a
            # missing column instead of failing.
            names = pq.read_schema(f).names
            if text_column not in names:
                raise ValueError(
                    f"{field}: column {text_column!r} not in {str(f)!r} "
                    f"(columns: {', '.join(names)})"
                )
            ds = datasets.load_dataset("parquet", data_files=[str(f)], columns=[text_column], **kw)
            yield from _rows_text(ds, text_column, repr(str(f)), field)


def iter_fineweb_hub(
    dataset_name: str, dataset_config: str, text_column: str = "text"
) -> Iterator[str]:
    """FineWeb streamed from the Hugging Face hub (needs network). The caller stops
    consuming once it has max_tokens tokens, which ends the stream."""
    import datasets

    ds = datasets.load_dataset(
        dataset_name, name=dataset_config, split=FINEWEB_SPLIT, streaming=True
    )
    yield from _rows_text(ds, text_column, f"{dataset_name}/{dataset_config}", "data.text_column")


# ---------------------------------------------------------------------------------------
# What to tokenize, and its cache key.


@dataclass
class SourceSpec:
    """A resolved source: how to get its documents, and everything its tokens depend on."""

    source: str
    params: dict  # parameters that change the tokens (go into the key and meta.json)
    content_hash: str
    documents: Callable[[], Iterator[str]]
    max_tokens: int | None


def resolve_source(
    source: str,
    *,
    path: str | os.PathLike | None = None,
    paths: Sequence[str | os.PathLike] | str | None = None,
    text_column: str = "text",
    max_tokens: int | None = None,
    dataset_name: str = FINEWEB_REPO,
    dataset_config: str = FINEWEB_CONFIG,
    hf_cache: Path | None = None,
    encoding: str = "utf-8",
) -> SourceSpec:
    if max_tokens is not None and int(max_tokens) <= 0:
        raise ValueError(f"data.max_tokens: must be positive, got {max_tokens}")
    try:
        codec = codecs.lookup(encoding).name
    except (LookupError, TypeError):
        raise ValueError(f"data.encoding: unknown text encoding {encoding!r} (expected e.g. utf-8, latin-1, cp1252)") from None
    # the encoding changes the tokens of .txt/.json files; utf-8 (the default) stays out
    # of the key so caches made before the option existed remain valid
    enc = {} if codec == "utf-8" else {"encoding": codec}
    max_tokens = None if max_tokens is None else int(max_tokens)
    if source == "shakespeare":
        return SourceSpec(
            source,
            {"max_tokens": max_tokens},
            hashlib.sha256(shakespeare_bytes()).hexdigest(),
            iter_shakespeare,
            max_tokens,
        )
    if source == "fineweb":
        if path is not None:
            files = expand_paths([path], "data.path", PARQUET_EXTS, FINEWEB_EXPECTED)
            return SourceSpec(
                source,
                {"local": True, "text_column": text_column, "max_tokens": max_tokens},  # parquet: UTF-8
                hash_files(files),
                lambda: iter_local_files(files, text_column, hf_cache, "data.text_column"),
                max_tokens,
            )
        if max_tokens is None:
            raise ValueError(
                "data.max_tokens: required for source=fineweb from the hub "
                "(expected a token cap, e.g. 100000000; or set data.path to local parquet files)"
            )
        params = {
            "repo": dataset_name,
            "config": dataset_config,
            "split": FINEWEB_SPLIT,
            "text_column": text_column,
            "max_tokens": max_tokens,
        }
        content = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
        return SourceSpec(
            source,
            params,
            content,
            lambda: iter_fineweb_hub(dataset_name, dataset_config, text_column),
            max_tokens,
        )
    if source == "files":
        if paths is None or (not isinstance(paths, str | os.PathLike) and len(paths) == 0):
            raise ValueError(f"data.paths: required for source=files (expected {FILES_EXPECTED})")
        if isinstance(paths, str | os.PathLike):
            paths = [paths]
        files = expand_paths(list(paths), "data.paths", FILE_EXTS, FILES_EXPECTED)
        return SourceSpec(
            source,
            {"text_column": text_column, "max_tokens": max_tokens, **enc},
            hash_files(files),
            lambda: iter_local_files(files, text_column, hf_cache, "data.text_column", encoding),
            max_tokens,
        )
    raise ValueError(
        f"data.source: unknown source {source!r} (expected one of {', '.join(SOURCES)})"
    )


def cache_key(spec: SourceSpec, val_fraction: float, compact_vocab: bool) -> str:
    blob = {
        "format": CACHE_FORMAT,
        "source": spec.source,
        "params": spec.params,
        "tokenizer": tokenizer_id(),
        "content_hash": spec.content_hash,
        "val_fraction": float(val_fraction),
        "compact_vocab": bool(compact_vocab),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# Tokenizing.


def encode_documents(docs: Iterable[str], max_tokens: int | None = None) -> Iterator[np.ndarray]:
    """uint16 chunks of the token stream: each document's tokens followed by EOT, cut at
    exactly `max_tokens` tokens. Stops pulling documents once the cap is reached."""
    enc = gpt2()
    threads = max(1, min(8, os.cpu_count() or 1))
    emitted = 0

    def flush(batch: list[str]) -> np.ndarray:
        toks = enc.encode_ordinary_batch(batch, num_threads=threads)
        total = sum(len(t) + 1 for t in toks)
        out = np.empty(total, dtype=np.uint16)
        i = 0
        for t in toks:
            out[i : i + len(t)] = t
            out[i + len(t)] = EOT_ID
            i += len(t) + 1
        return out

    batch: list[str] = []
    chars = 0
    docs = iter(docs)
    try:
        while True:
            doc = next(docs, None)
            if doc is not None:
                batch.append(doc)
                chars += len(doc)
            if batch and (doc is None or chars >= CHUNK_CHARS or len(batch) >= CHUNK_DOCS):
                chunk = flush(batch)
                batch, chars = [], 0
                if max_tokens is not None and emitted + len(chunk) >= max_tokens:
                    yield chunk[: max_tokens - emitted]
                    return
                emitted += len(chunk)
                yield chunk
            if doc is None:
                return
    finally:
        close = getattr(docs, "close", None)
        if close is not None:
            close()  # ends a hub stream early


@dataclass
class TokenCache:
    """An opened cache directory."""

    path: Path
    meta: dict
    train: np.memmap
    val: np.memmap
    id_map: np.ndarray | None  # compact id -> GPT-2 id, or None
    built: bool  # True if this call tokenized the corpus, False if it reused the cache

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def n_other(self) -> int:
        """GPT-2 ids that share the "other" entry (0 without a compact vocabulary)."""
        return int(self.meta["n_other"])


def _open_cache(path: Path, key: str) -> tuple[TokenCache | None, str]:
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
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{meta_path} is unreadable ({type(e).__name__}: {e})"
    for name, n in (("train.bin", n_train), ("val.bin", n_val)):
        f = path / name
        if not f.exists() or f.stat().st_size != 2 * n:
            size = f.stat().st_size if f.exists() else "missing"
            return None, f"{f} has size {size}, meta.json says {2 * n} bytes"
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
    return TokenCache(path, meta, train, val, id_map, built=False), ""


def _build_cache(
    path: Path, key: str, spec: SourceSpec, val_fraction: float, compact_vocab: bool, progress: bool
) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # Invalidate first: from here until meta.json is rewritten, a crash leaves a cache
    # that _open_cache refuses.
    (path / "meta.json").unlink(missing_ok=True)
    tag = f".tmp-{os.getpid()}"
    tmp = {n: path / f"{n}{tag}" for n in ("tokens.bin", "val.bin", "vocab.npy", "meta.json")}
    t0 = time.time()
    try:
        counts = np.zeros(GPT2_VOCAB_SIZE, dtype=np.int64)
        n = 0
        with (
            open(tmp["tokens.bin"], "wb") as f,
            tqdm(
                desc=f"tokenizing {spec.source}",
                unit="tok",
                unit_scale=True,
                total=spec.max_tokens,
                disable=not progress,
            ) as bar,
        ):
            for chunk in encode_documents(spec.documents(), spec.max_tokens):
                f.write(chunk.tobytes())
                counts += np.bincount(chunk, minlength=GPT2_VOCAB_SIZE)
                n += len(chunk)
                bar.update(len(chunk))
        # nanoGPT's tail split: train = the first int(n * (1 - val_fraction)) tokens.
        n_train = int(n * (1.0 - val_fraction))
        n_val = n - n_train
        if n_train == 0 or n_val == 0:
            raise ValueError(
                f"data: source {spec.source!r} gave only {n} tokens, too few to split with "
                f"val_fraction={val_fraction}"
            )
        tokens = np.memmap(tmp["tokens.bin"], dtype=np.uint16, mode="r+", shape=(n,))
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
        meta = {
            "format": CACHE_FORMAT,
            "key": key,
            "source": spec.source,
            "params": spec.params,
            "tokenizer": tokenizer_id(),
            "content_hash": spec.content_hash,
            "val_fraction": float(val_fraction),
            "compact_vocab": bool(compact_vocab),
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
    finally:
        for f in tmp.values():
            f.unlink(missing_ok=True)
    log.info("tokenized %s: %d tokens in %.1fs -> %s", spec.source, n, time.time() - t0, path)


def prepare_tokens(
    source: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    val_fraction: float = 0.05,
    compact_vocab: bool | None = None,
    path: str | os.PathLike | None = None,
    paths: Sequence[str | os.PathLike] | str | None = None,
    text_column: str = "text",
    max_tokens: int | None = None,
    dataset_name: str = FINEWEB_REPO,
    dataset_config: str = FINEWEB_CONFIG,
    progress: bool = True,
    encoding: str = "utf-8",
) -> TokenCache:
    """Open the token cache of a source, tokenizing it first if there is no valid one.

    compact_vocab=None means: on for shakespeare, off for the other sources.
    """
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"data.val_fraction: must be in (0, 1), got {val_fraction}")
    if compact_vocab is None:
        compact_vocab = source == "shakespeare"
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    spec = resolve_source(
        source,
        path=path,
        paths=paths,
        text_column=text_column,
        max_tokens=max_tokens,
        dataset_name=dataset_name,
        dataset_config=dataset_config,
        hf_cache=root / "hf-datasets",
        encoding=encoding,
    )
    key = cache_key(spec, val_fraction, compact_vocab)
    cache_path = root / "tokens" / f"{source}-{key[:16]}"
    cache, why = _open_cache(cache_path, key)
    if cache is not None:
        return cache
    if cache_path.exists() and why != "no meta.json":
        log.warning("rebuilding token cache %s: %s", cache_path, why)
    _build_cache(cache_path, key, spec, float(val_fraction), compact_vocab, progress)
    cache, why = _open_cache(cache_path, key)
    if cache is None:  # only if something else wrote into the directory meanwhile
        raise RuntimeError(f"data: token cache {cache_path} is invalid right after building: {why}")
    cache.built = True
    return cache


# ---------------------------------------------------------------------------------------
# Windows.


class WindowBatches(Dataset):
    """Map-style dataset whose item k is batch k: the windows of block_size + 1 tokens
    starting at offsets[k*B : (k+1)*B], as (x, y) LongTensors [B, block_size], y = x
    shifted by one. Batches (not single windows) are the items so one fancy-index read
    of the memmap serves a whole batch, and skipping k batches is just slicing offsets.
    The memmap is reopened lazily in each worker instead of being pickled."""

    def __init__(
        self, file: Path, n_tokens: int, offsets: np.ndarray, block_size: int, batch_size: int
    ):
        self.file = Path(file)
        self.n_tokens = int(n_tokens)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self._tokens: np.memmap | None = None
        self._span = np.arange(self.block_size + 1, dtype=np.int64)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def __len__(self) -> int:
        return math.ceil(len(self.offsets) / self.batch_size)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= k < len(self):
            raise IndexError(k)
        if self._tokens is None:
            self._tokens = np.memmap(self.file, dtype=np.uint16, mode="r", shape=(self.n_tokens,))
        starts = self.offsets[k * self.batch_size : (k + 1) * self.batch_size]
        w = torch.from_numpy(self._tokens[starts[:, None] + self._span].astype(np.int64))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def draw_train_offsets(n_train: int, block_size: int, n_windows: int, seed: int) -> np.ndarray:
    """Start offsets of the training windows: uniform over every full window of the
    train split, drawn with numpy Generator(seed). Draws are sequential, so offset i
    depends only on (seed, i), not on how many are drawn."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_train - block_size, size=n_windows, dtype=np.int64)


class _FromStep(torch.utils.data.Sampler):
    """Batch indices start .. n-1; its length stays n (the epoch Lightning counts is the
    whole run: after a resume its progress counters already hold the first `start`)."""

    def __init__(self, n: int, start: int = 0):
        self.n, self.start = int(n), int(start)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.n))


class ResumableLoader(DataLoader):
    """The training DataLoader, with the `state_dict` / `load_state_dict` Lightning looks
    for on a loader: the state is the number of optimiser steps taken (one batch each),
    plus what fixes the order (seed, batch size, processes), which must match on resume."""

    def __init__(self, ds: WindowBatches, sampler: _FromStep, dm: TokenDataModule, **kw):
        super().__init__(ds, batch_size=None, sampler=sampler, **kw)  # items are whole batches
        self.dm = dm

    def _order(self) -> dict:
        return {"seed": self.dm.seed, "batch_size": self.dm.batch_size, "world_size": self.dm.shard()[1],
                "max_steps": self.dm.max_steps, "block_size": self.dm.block_size}

    def state_dict(self) -> dict:
        t = getattr(self.dm, "trainer", None)
        step = int(t.global_step) if t is not None else self.sampler.start
        return {"step": step, **self._order()}

    def load_state_dict(self, state: dict) -> None:
        now = self._order()
        diff = [f"{k}={state.get(k)!r} -> {v!r}" for k, v in now.items() if state.get(k) != v]
        if diff:
            raise ValueError(f"data: the checkpoint's data order differs from this run's ({', '.join(diff)}); "
                             "resume with the settings it was saved with")
        if not 0 <= state["step"] <= self.sampler.n:
            raise ValueError(f"data: checkpoint step {state['step']} outside [0, {self.sampler.n}]")
        self.sampler.start = int(state["step"])
        self.dm.start_step = int(state["step"])


class TokenDataModule(L.LightningDataModule):
    """Random train windows and consecutive val windows over a token cache.

    Train: max_steps batches of batch_size windows of block_size + 1 tokens at offsets
    `train_offsets` (a function of seed and window index). Val: the first `val_tokens`
    val tokens (all of them if None) cut into non-overlapping windows with stride
    block_size, in order; the leftover tail shorter than a window is dropped.

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
        # Batches to skip at the start of train_dataloader() (set before fit to resume).
        self.start_step = 0

        self.cache: TokenCache | None = None
        self.cache_path: Path | None = None
        self.vocab_size: int | None = None
        self.train_tokens: np.memmap | None = None
        self.val_tokens: np.memmap | None = None
        self.id_map: np.ndarray | None = None
        self.n_other = 0  # GPT-2 ids sharing the "other" entry (compact vocabulary)
        self.other_id: int | None = None  # the model id of "other"
        self.eot_id: int | None = None
        self.train_offsets: np.ndarray | None = None
        self.val_offsets: np.ndarray | None = None
        self._gpt2_to_compact: np.ndarray | None = None

    # -- building / opening -------------------------------------------------------------

    def _prepare(self) -> TokenCache:
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
        self.cache = cache
        self.cache_path = cache.path
        self.vocab_size = cache.vocab_size
        self.train_tokens = cache.train
        self.val_tokens = cache.val
        self.id_map = cache.id_map
        self.n_other = cache.n_other
        if self.id_map is not None:
            self.other_id = len(self.id_map) - 1
            inv = np.full(GPT2_VOCAB_SIZE, self.other_id, dtype=np.int64)
            inv[self.id_map[:-1]] = np.arange(self.other_id)
            self._gpt2_to_compact = inv
            self.eot_id = int(inv[EOT_ID]) if inv[EOT_ID] != self.other_id else None
        else:
            self.eot_id = EOT_ID
        self.train_offsets = draw_train_offsets(
            n_train, T, self.max_steps * self.batch_size, self.seed
        )
        # Window j covers val[j*T : j*T + T + 1]; its targets are val[j*T+1 : (j+1)*T+1].
        self.val_offsets = np.arange((n_val_used - 1) // T, dtype=np.int64) * T

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

    def train_dataset(self, rank: int | None = None, world_size: int | None = None) -> WindowBatches:
        """All max_steps batches one process trains on, in order.

        With W processes (DDP), step k's global batch is windows [k*W*B, (k+1)*W*B) of
        the seeded draw and rank r takes its r-th slice of B: W processes at batch_size B
        train on exactly the windows one process at batch_size W*B would."""
        cache = self._require_setup()
        r, W = self.shard() if rank is None else (int(rank), int(world_size or 1))
        if not 0 <= r < W:
            raise ValueError(f"data: rank {r} outside a world of {W} processes")
        B = self.batch_size
        offsets = self.train_offsets
        if W > 1:  # the draw is sequential: drawing more windows keeps the first ones
            offsets = draw_train_offsets(len(cache.train), self.block_size, self.max_steps * B * W, self.seed)
            offsets = offsets.reshape(self.max_steps, W, B)[:, r].reshape(-1)
        return WindowBatches(cache.path / "train.bin", len(cache.train), offsets, self.block_size, B)

    def val_dataset(self) -> WindowBatches:
        cache = self._require_setup()
        return WindowBatches(
            cache.path / "val.bin",
            len(cache.val),
            self.val_offsets,
            self.block_size,
            self.batch_size,
        )

    def _loader(self, ds: WindowBatches) -> DataLoader:
        # batch_size=None: the dataset already yields whole batches.
        return DataLoader(
            ds,
            batch_size=None,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self, start_step: int | None = None) -> ResumableLoader:
        """Batches in a fixed order, from start_step (default self.start_step) on. The
        loader is resumable: Lightning saves its state (the steps taken) in every
        checkpoint and hands it back on resume, so a resumed run sees exactly the batches
        it has not seen."""
        k = self.start_step if start_step is None else int(start_step)
        if not 0 <= k <= self.max_steps:
            raise ValueError(f"data: start_step={k} outside [0, max_steps={self.max_steps}]")
        ds = self.train_dataset()
        return ResumableLoader(ds, _FromStep(len(ds), k), self, num_workers=self.num_workers,
                               persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset())

    # -- evaluation helpers -------------------------------------------------------------

    def val_targets(self) -> np.ndarray:
        """The val tokens that val_dataloader scores as targets, in order (each once):
        val[1 : n_windows * block_size + 1]."""
        self._require_setup()
        return np.asarray(self.val_tokens[1 : len(self.val_offsets) * self.block_size + 1])

    def unigram_log_prior(self) -> np.ndarray:
        """log p(t) of the train split's add-one smoothed unigram over all 50257 GPT-2 ids,
        p(t) = (count_train(t) + 1) / (N + 50257), in the model vocabulary (float64 [V]):
        the "other" entry of a compact vocabulary gets the mass of the n_other ids it stands
        for (each unseen in train, so n_other / (N + 50257))."""
        self._require_setup()
        V = self.vocab_size
        counts = np.bincount(self.train_tokens, minlength=V).astype(np.float64) + 1.0
        if self.other_id is not None:
            counts[self.other_id] = self.n_other
        return np.log(counts) - np.log(len(self.train_tokens) + GPT2_VOCAB_SIZE)

    def unigram_ce(self) -> float:
        """Cross-entropy (nats/token, over all GPT-2 ids) of exactly the targets
        val_dataloader scores, under the train split's add-one smoothed unigram
        (`unigram_log_prior`; an "other" target is scored log p(other) − log n_other, as
        `recdepth.model.token_nll` scores the model). A baseline any model should beat."""
        V = self.vocab_size
        logp = self.unigram_log_prior()
        if self.other_id is not None and self.n_other > 1:
            logp = logp.copy()
            logp[self.other_id] -= math.log(self.n_other)
        targets = self.val_targets()
        return float(-(np.bincount(targets, minlength=V) @ logp) / len(targets))

    def heldout_tokens(self, n: int) -> np.ndarray:
        """The first n val tokens (model ids, int64), for token-by-token evaluation."""
        self._require_setup()
        if not 0 < n <= len(self.val_tokens):
            raise ValueError(
                f"data: heldout_tokens(n={n}) outside [1, {len(self.val_tokens)}] val tokens"
            )
        return np.asarray(self.val_tokens[:n], dtype=np.int64)

    def to_gpt2(self, ids):
        """Model ids -> GPT-2 ids (identity without a compact vocab; -1 for the shared
        "other" entry, which stands for many). numpy in, int64 numpy out; a torch tensor
        in, a LongTensor on the same device out."""
        self._require_setup()
        if torch.is_tensor(ids):
            ids = ids.long()
            return (
                ids if self.id_map is None else torch.as_tensor(self.id_map, device=ids.device)[ids]
            )
        ids = np.asarray(ids, dtype=np.int64)
        return ids if self.id_map is None else self.id_map[ids]

    def from_gpt2(self, ids):
        """GPT-2 ids -> model ids (an id the train split never saw -> "other");
        ValueError for an id outside GPT-2's vocabulary."""
        self._require_setup()
        is_tensor = torch.is_tensor(ids)
        arr = (
            ids.detach().cpu().numpy().astype(np.int64)
            if is_tensor
            else np.asarray(ids, dtype=np.int64)
        )
        bad = (arr < 0) | (arr >= GPT2_VOCAB_SIZE)
        if self._gpt2_to_compact is not None:
            out = np.where(bad, -1, self._gpt2_to_compact[np.clip(arr, 0, GPT2_VOCAB_SIZE - 1)])
            bad |= out < 0
        else:
            out = arr
        if bad.any():
            first = int(arr[bad].flat[0])
            raise ValueError(
                f"data: GPT-2 id {first} is not in the model vocabulary "
                f"({self.vocab_size} ids, compact={self.id_map is not None})"
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
