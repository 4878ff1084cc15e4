"""Reading documents with `datasets`, in streaming mode (nothing is copied, and a capped
stream stops being read once the tokenizer has enough): local files named by paths,
directories or globs (`expand_paths`, hashed by `hash_files`), their rows' text column
(`rows_text`), and local .txt/.jsonl/.json/.parquet files as documents
(`iter_local_files`). Text and JSON files are decoded with `encoding` (default UTF-8); one
that does not decode stops with one line naming it and data.encoding. The sources
(recdepth/data/sources/) read their documents with these.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

TEXT_EXTS = (".txt",)
JSON_EXTS = (".jsonl", ".json")
PARQUET_EXTS = (".parquet",)
FILE_EXTS = TEXT_EXTS + JSON_EXTS + PARQUET_EXTS
# Rows pulled from a `datasets` stream at a time.
ROW_BATCH = 1024


def stream_kw(hf_cache: Path | None) -> dict:
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


def rows_text(ds, text_column: str, where: str, field: str) -> Iterator[str]:
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

    kw = stream_kw(hf_cache)
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
                    yield from rows_text(ds, text_column, where, field)
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
            yield from rows_text(ds, text_column, where, field)
