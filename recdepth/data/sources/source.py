"""What a data source is: `DataConfig`, the one class a source is (its config, the `data`
group, and how it makes its token cache), `TextSource` for the sources of documents, and
the registry of sources.

A source is one dataclass subclass in a file of its own (the built-in ones beside this
one: shakespeare.py, fineweb.py, files.py, task.py): the field `source` with the source's
name as its default, its options as fields (each with a docstring; `data.<field>`), their
checks in `__post_init__` (one line naming the dotted field), and `prepare`, which opens
(building it first if need be) its token cache (recdepth/data/token_cache.py). Defining
the subclass registers it: `data=<name>` selects it (recdepth/config/schema.py stores one
`data` option per registered source), and a stored config naming it (`data.source`) reads
back as it. A key of another source is no key of this one: OmegaConf refuses it while
composing, in one line naming it.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from recdepth.core.checks import check_int
from recdepth.core.registry import Registry
from recdepth.data.token_cache import SourceSpec, TokenCache, prepare_tokens

_REGISTRY: Registry[type[DataConfig]] = Registry("data.source", "source")  # name -> the source's class


@dataclass
class DataConfig:
    """`data`: where the tokens come from (`data=<source>`; a generated task: `data=<task>`).
    What every source has; each source's class adds its own keys."""

    source: str = ""
    """The source (set by `data=<source>`; a stored config names its source here)."""
    val_tokens: int | None = 32768
    """Cap on the val tokens scored at each validation (>= 1); null = all."""
    cache_dir: str | None = None
    """Token caches; null = $RECDEPTH_CACHE or ~/.cache/recdepth."""
    num_workers: int = 0
    """DataLoader worker processes (>= 0)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("source")
        if name is None:  # an intermediate class (TextSource): no source of its own
            return
        _REGISTRY.register(name, cls, cls)  # the default of its field `source`

    def __post_init__(self):
        own = _REGISTRY.name_of(type(self))
        if own is None:
            raise TypeError(f"{type(self).__qualname__}: not a registered data source (subclass DataConfig with a "
                            "source)")
        if self.source != own:
            raise ValueError(f"data.source: this is data={own}'s config, got {self.source!r} (select a source with "
                             f"data=<source>: {', '.join(_REGISTRY)}; a task with data=<task>)")
        check_int("data.val_tokens", self.val_tokens, 1, null=True)
        check_int("data.num_workers", self.num_workers, 0)

    @classmethod
    def node(cls, d: dict) -> DictConfig:
        """The typed OmegaConf node that the plain data config `d` (of this source) merges
        onto: this class's (a source whose fields are of several classes, a task's, picks
        them by `d`)."""
        return OmegaConf.structured(cls)

    def answers_only(self) -> bool:
        """Whether the training loss counts answer tokens only (a task's data.loss=answers)."""
        return False

    def step_width(self) -> int:
        """S, the per-step targets the batches carry for each token (a batch is then (x, y, z),
        z [B, T, S]; recdepth/data/windows.py); 0, the default: none, batches are (x, y).
        Known from the config alone, before any cache is built."""
        return 0

    def prepare(self, block_size: int, progress: bool = True) -> TokenCache:
        """The source's token cache (built first if there is no valid one); `block_size`:
        the windows' length (a task's records are one window each)."""
        raise NotImplementedError


@dataclass
class TextSource(DataConfig):
    """A source of text documents, tokenized with GPT-2 BPE into a token cache whose tail
    is the val split. A subclass writes `documents`."""

    max_tokens: int | None = None
    """Cut the token stream at this many tokens (>= 1); null = all."""
    val_fraction: float = 0.05
    """The tail of the token stream held out for validation and evaluation, in (0, 1)."""
    compact_vocab: bool = True
    """Vocabulary = the GPT-2 tokens the train split uses, plus one "other" entry (mapped back
    to GPT-2 ids, recdepth/data/vocabulary.py); false = GPT-2's 50257."""

    def __post_init__(self):
        super().__post_init__()
        check_int("data.max_tokens", self.max_tokens, 1, null=True)
        v = self.val_fraction
        if isinstance(v, bool) or not (isinstance(v, float | int) and 0 < v < 1):
            raise ValueError(f"data.val_fraction: expected a number in (0, 1), got {v!r}")
        if not isinstance(self.compact_vocab, bool):
            raise ValueError(f"data.compact_vocab: expected true or false, got {self.compact_vocab!r}")

    def documents(self, hf_cache: Path | None = None) -> SourceSpec:
        """The documents and what the tokens depend on (`SourceSpec`); `hf_cache`: where
        `datasets` keeps its lock files. Errors are one line naming the data.* key."""
        raise NotImplementedError

    def prepare(self, block_size: int, progress: bool = True) -> TokenCache:
        return prepare_tokens(self.documents, cache_dir=self.cache_dir, val_fraction=self.val_fraction,
                              compact_vocab=self.compact_vocab, progress=progress)


def check_encoding(encoding) -> str:
    """The codec's canonical name; one line naming data.encoding for an unknown one."""
    try:
        return codecs.lookup(encoding).name
    except (LookupError, TypeError):
        raise ValueError(f"data.encoding: unknown text encoding {encoding!r} (expected e.g. utf-8, latin-1, "
                         "cp1252)") from None


def names() -> tuple[str, ...]:
    """Every registered source's name, in the order the sources were defined."""
    return _REGISTRY.names()


def lookup(name: str) -> type[DataConfig]:
    """The source class registered under `name`; a one-line ValueError naming data.source otherwise."""
    return _REGISTRY.lookup(name)
