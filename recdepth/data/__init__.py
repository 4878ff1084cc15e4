"""The data: where a run's tokens come from, and how they reach the model.

  sources/      one file per data source (shakespeare, fineweb, files, task), each its config
                (`data=<source>`, `data.*`) and how it makes its token cache
  tasks/        one file per generated task (hops, addition, modsum, roots), each its config
                (`data=<task>`, `data.task.*`) and its generator; the core layer (torch and
                numpy only)
  config.py     a stored data config read back (an older run's flat form upgraded)
  tokenizer.py  GPT-2 BPE, offline
  token_cache.py  documents tokenized into a token cache; a task's records, labels and
                per-step targets
  vocabulary.py the model's vocabulary over GPT-2's
  windows.py    window batches, the training order, the resumable loader
  datamodule.py the LightningDataModule

A source or a task of your own is one file with one class: see sources/source.py and
tasks/task.py. This package's own module imports nothing, so the core can import the
tasks without the glue.
"""
