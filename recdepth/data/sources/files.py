"""files: your own files (`paths`: files, directories or globs): .txt (one file = one
document, `datasets`' `text` builder with sample_by="document"), .jsonl/.json and
.parquet (one row = one document, column `text_column`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recdepth.data.sources.reading import FILE_EXTS, expand_paths, hash_files, iter_local_files
from recdepth.data.sources.source import TextSource, check_encoding
from recdepth.data.token_cache import SourceSpec

FILES_EXPECTED = "text/jsonl/parquet files"


@dataclass
class FilesData(TextSource):
    """`data=files data.paths='[/data/*.txt, /data/more.jsonl]'`: your own text."""

    source: str = "files"
    val_tokens: int | None = 65536
    compact_vocab: bool = False
    paths: Any = None
    """Required: a file, directory or glob, or a list of them (.txt = one document per file;
    .jsonl/.json/.parquet = one document per row)."""
    text_column: str = "text"
    """.jsonl/.json/.parquet: the column holding a row's text."""
    encoding: str = "utf-8"
    """The encoding of .txt/.json/.jsonl files (parquet is always UTF-8)."""

    def __post_init__(self):
        super().__post_init__()
        p = self.paths
        if isinstance(p, str | Path):
            p = [p]
        if not p or not isinstance(p, list | tuple) or not all(isinstance(x, str | Path) and str(x) for x in p):
            raise ValueError(f"data.paths: required for data=files (expected {FILES_EXPECTED}: a file, directory or "
                             f"glob, or a list of them), got {self.paths!r}")
        self.paths = [str(x) for x in p]
        check_encoding(self.encoding)

    def documents(self, hf_cache: Path | None = None) -> SourceSpec:
        """The content hash: sha256 over every file's absolute path and bytes (editing a file changes it)."""
        codec = check_encoding(self.encoding)
        # the encoding changes the tokens of .txt/.json files; utf-8 (the default) stays out
        # of the key so caches made before the option existed remain valid
        enc = {} if codec == "utf-8" else {"encoding": codec}
        files = expand_paths(self.paths, "data.paths", FILE_EXTS, FILES_EXPECTED)
        col, encoding = self.text_column, self.encoding
        return SourceSpec(self.source, {"text_column": col, "max_tokens": self.max_tokens, **enc}, hash_files(files),
                          lambda: iter_local_files(files, col, hf_cache, "data.text_column", encoding),
                          self.max_tokens)
