"""fineweb: HuggingFaceFW/fineweb (config sample-10BT, split train), streamed from the hub
up to `max_tokens` tokens (required, so a typo can't start a 10B-token download); or, with
`path`, local parquet files with FineWeb's columns (a file, a directory of *.parquet, or a
glob), fully offline. The paper's data (experiment=paper)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from recdepth.data.sources.reading import (
    PARQUET_EXTS,
    expand_paths,
    hash_files,
    iter_local_files,
    rows_text,
)
from recdepth.data.sources.source import TextSource
from recdepth.data.token_cache import SourceSpec

FINEWEB_SPLIT = "train"
FINEWEB_EXPECTED = "FineWeb parquet files"


@dataclass
class FinewebData(TextSource):
    """`data=fineweb`: FineWeb streamed through `datasets` up to max_tokens, or local parquet
    files with FineWeb's columns (data.path=/data/fineweb/*.parquet)."""

    source: str = "fineweb"
    max_tokens: int | None = 300_000_000
    """Cut the token stream at this many tokens (>= 1; the paper's budget: 300M); null = all,
    local files only (required from the hub)."""
    val_fraction: float = 0.005
    val_tokens: int | None = 65536
    compact_vocab: bool = False
    path: str | None = None
    """Local parquet files with FineWeb's columns (a file, directory or glob); null streams
    `dataset_name` from the hub."""
    dataset_name: str = "HuggingFaceFW/fineweb"
    """From the hub: the dataset repository."""
    dataset_config: str = "sample-10BT"
    """From the hub: its config."""
    text_column: str = "text"
    """The column holding a row's text."""

    def __post_init__(self):
        super().__post_init__()
        if self.path is None and self.max_tokens is None:
            raise ValueError("data.max_tokens: required for data=fineweb from the hub (a token cap, e.g. "
                             "100000000; or set data.path to local parquet files)")

    def documents(self, hf_cache: Path | None = None) -> SourceSpec:
        """The content hash: local files, sha256 over every file's absolute path and bytes
        (editing one changes it); the hub, sha256 of (repo, config, split, text column,
        max_tokens) -- the hub has no content hash we can read cheaply; the repo is not
        pinned to a revision."""
        col, cap = self.text_column, self.max_tokens
        if self.path is not None:
            files = expand_paths([self.path], "data.path", PARQUET_EXTS, FINEWEB_EXPECTED)
            return SourceSpec(self.source, {"local": True, "text_column": col, "max_tokens": cap},  # parquet: UTF-8
                              hash_files(files), lambda: iter_local_files(files, col, hf_cache, "data.text_column"),
                              cap)
        params = {"repo": self.dataset_name, "config": self.dataset_config, "split": FINEWEB_SPLIT,
                  "text_column": col, "max_tokens": cap}
        content = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
        return SourceSpec(self.source, params, content,
                          lambda: iter_fineweb_hub(self.dataset_name, self.dataset_config, col), cap)


def iter_fineweb_hub(dataset_name: str, dataset_config: str, text_column: str = "text") -> Iterator[str]:
    """FineWeb streamed from the Hugging Face hub (needs network). The caller stops
    consuming once it has max_tokens tokens, which ends the stream."""
    import datasets

    ds = datasets.load_dataset(dataset_name, name=dataset_config, split=FINEWEB_SPLIT, streaming=True)
    yield from rows_text(ds, text_column, f"{dataset_name}/{dataset_config}", "data.text_column")
