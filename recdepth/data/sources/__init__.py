"""Data sources: one class each, its config (the `data` group) and how it makes its token
cache.

  source.py       `DataConfig`, the one class a source is; `TextSource` (documents into a
                  token cache); the registry (`names`, `lookup`)
  reading.py      reading documents with `datasets`: local files, globs, columns, encodings
  shakespeare.py  the shipped corpus (the default run's data)
  fineweb.py      FineWeb from the hub or local parquet files (the paper's data)
  files.py        your own .txt/.jsonl/.json/.parquet files
  task.py         a generated task (recdepth/data/tasks/): `data=<task>`, `data.task.*`

A source of your own is one file in this folder: a dataclass subclass of `TextSource` (or
`DataConfig`) with its name as the default of `source`. This package imports every module
of its folder (`import_folder`), so the file registers its source, and `data=<name>`
selects it.
"""

from recdepth.core.registry import import_folder
from recdepth.data.sources.files import FilesData
from recdepth.data.sources.fineweb import FinewebData
from recdepth.data.sources.shakespeare import ShakespeareData
from recdepth.data.sources.source import DataConfig, TextSource, lookup, names
from recdepth.data.sources.task import TaskData

__all__ = ["DataConfig", "FilesData", "FinewebData", "ShakespeareData", "TaskData", "TextSource", "lookup", "names"]

import_folder(__name__, __path__)  # a source file of one's own, beside the built-in ones
