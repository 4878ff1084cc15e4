"""shakespeare: the corpus shipped in recdepth/assets/shakespeare.jsonl.xz (42 plays, ~1.57M
GPT-2 tokens), read with `datasets`' `json` builder; the default run's data."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from recdepth.data.sources.reading import rows_text, stream_kw
from recdepth.data.sources.source import TextSource
from recdepth.data.token_cache import SourceSpec


@dataclass
class ShakespeareData(TextSource):
    """`data=shakespeare`: Shakespeare's plays (Gutenberg text, shipped with recdepth)."""

    source: str = "shakespeare"

    def documents(self, hf_cache: Path | None = None) -> SourceSpec:
        # content hash: sha256 of the asset's bytes
        return SourceSpec(self.source, {"max_tokens": self.max_tokens}, hashlib.sha256(shakespeare_bytes()).hexdigest(),
                          lambda: iter_shakespeare(hf_cache), self.max_tokens)


def shakespeare_file():
    return resources.files("recdepth").joinpath("assets", "shakespeare.jsonl.xz")


def shakespeare_bytes() -> bytes:
    return shakespeare_file().read_bytes()


def iter_shakespeare(hf_cache: Path | None = None) -> Iterator[str]:
    """The 42 plays, one document each, in the asset's order."""
    import datasets

    with resources.as_file(shakespeare_file()) as f:
        ds = datasets.load_dataset("json", data_files=[str(f)], **stream_kw(hf_cache))
        yield from rows_text(ds, "text", repr(str(f)), "data.source")
