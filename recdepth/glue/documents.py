"""Document sources: every source is a stream of text documents, read with `datasets`.

  shakespeare  the corpus shipped in recdepth/assets/shakespeare.jsonl.xz (42 plays), read
               with the `json` builder
  fineweb      HuggingFaceFW/fineweb (config sample-10BT, split train), streamed from the
               hub up to `max_tokens` tokens (required, so a typo can't start a 10B-token
               download); or, with `path`, local parquet files with FineWeb's columns
               (a file, a directory of *.parquet, or a glob), fully offline
  files        your own files (`paths`: files, directories or globs): .txt (one file = one
               document, the `text` builder with sample_by="document"), .jsonl/.json and
               .parquet (one row = one document, column `text_column`)

Every builder runs in streaming mode: nothing is copied, and a capped stream stops being
read once the tokenizer has enough. Text and JSON files are decoded with `encoding`
(default UTF-8); one that does not decode stops with one line naming it and
data.encoding. `resolve_source` turns a source and its options into a `SourceSpec`: the
documents, and what its token cache key is made of.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from recdepth.glue.schema import SOURCES

FINEWEB_REPO = "HuggingFaceFW/fineweb"
FINEWEB_CONFIG = "sample-10BT"
FINEWEB_SPLIT = "train"
TEXT_EXTS = (".txt",)
JSON_EXTS = (".jsonl", ".json")
PARQUET_EXTS = (".parquet",)
FILE_EXTS = TEXT_EXTS + JSON_EXTS + PARQUET_EXTS
FILES_EXPECTED = "text/jsonl/parquet files"
FINEWEB_EXPECTED = "FineWeb parquet files"
# Rows pulled from a `datasets` stream at a time.
ROW_BATCH = 1024


def shakespeare_file():
    return resources.files("recdepth").joinpath("assets", "shakespeare.jsonl.xz")


def shakespeare_bytes() -> bytes:
    return shakespeare_file().read_bytes()


def iter_shakespeare(hf_cache: Path | None = None) -> Iterator[str]:
    """The 42 plays, one document each, in the asset's order."""
    import datasets

    with resources.as_file(shakespeare_file()) as f:
        ds = datasets.load_dataset("json", data_files=[str(f)], **_stream_kw(hf_cache))
        yield from _rows_text(ds, "text", repr(str(f)), "data.source")


def _stream_kw(hf_cache: Path | None) -> dict:
    kw = {"split": "train", "streaming": True}
    if hf_cache is not None:
        kw["cache_dir"] = str(hf_cache)  # keeps datasets' lock files out of ~/.cache
    return kw


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


def _builder(f: Path) -> str:
    ext = f.suffix.lower()
    return "text" if ext in TEXT_EXTS else "json" if ext in JSON_EXTS else "parquet"


def iter_local_files(
    files: Sequence[Path], text_column: str, hf_cache: Path | None, field: str,
    encoding: str = "utf-8",
) -> Iterator[str]:
    """Documents of local files, in order, through `datasets`' packaged builders in
    streaming mode (no network): a run of consecutive .txt files is one `text` load with
    sample_by="document" (one row per file, decoded with `encoding`); each json/jsonl
    file (decoded with `encoding`) and parquet file (UTF-8 by its format) is its own
    load, so a missing column names its file. A file that does not decode raises one
    line naming it and data.encoding."""
    import datasets

    kw = _stream_kw(hf_cache)
    for builder, run in itertools.groupby(files, key=_builder):
        run = list(run)
        if builder == "text":
            ds = datasets.load_dataset(
                "text", data_files=[str(f) for f in run], sample_by="document",
                encoding=encoding, **kw,
            )
            done = 0  # one row per file, in order: the file being read is run[done]
            try:
                for row in ds:
                    yield row["text"]
                    done += 1
            except UnicodeDecodeError as e:
                raise _not_text(run[done], encoding, e) from None
            continue
        for f in run:
            where = repr(str(f))
            if builder == "json":
                ds = datasets.load_dataset("json", data_files=[str(f)], encoding=encoding, **kw)
                try:
                    yield from _rows_text(ds, text_column, where, field)
                except UnicodeDecodeError as e:
                    raise _not_text(f, encoding, e) from None
                continue
            import pyarrow.parquet as pq

            # Check the schema first: the parquet builder's `columns=` misbehaves on a
            # missing column instead of failing.
            names = pq.read_schema(f).names
            if text_column not in names:
                raise ValueError(
                    f"{field}: column {text_column!r} not in {where} (columns: {', '.join(names)})"
                )
            ds = datasets.load_dataset("parquet", data_files=[str(f)], columns=[text_column], **kw)
            yield from _rows_text(ds, text_column, where, field)


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
    """The documents of `source` and what its tokens depend on. The content hash is
      shakespeare     sha256 of the asset's bytes
      local files     sha256 over every file's absolute path and bytes (files, fineweb+path)
      fineweb (hub)   sha256 of (repo, config, split, max_tokens) -- the hub has no content
                      hash we can read cheaply; the repo is not pinned to a revision
    so editing a local file changes it. Errors are one line naming the data.* key."""
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
            lambda: iter_shakespeare(hf_cache),
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
