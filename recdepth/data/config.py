"""A data config read back from a file (a checkpoint's `data_config`, a run's config.yaml,
a DDP rank's): `upgrade` turns the flat form recdepth wrote before the per-source configs
into today's nested one, and `node` gives the typed OmegaConf node of the classes a plain
data config names (its source; a task's `data.task.name`), which the config merges onto
(recdepth/config/schema.py: `validated`, `data_config`). Every reader of a stored config goes
through `node` (so through `upgrade`); the training identity too (recdepth/training/runs.py).
"""

from __future__ import annotations

import dataclasses
import json

from omegaconf import DictConfig, OmegaConf

from recdepth.data import sources, tasks

# The flat `data` of recdepth 0.1.0 before the per-source configs, a retired format: one
# dataclass for every source, the generated task's keys beside the text sources' (`data.task`
# was the task's name), with these defaults; a source's unread keys had to keep them. Its
# keys that are a task's options now live under `data.task`.
FLAT_DEFAULTS = {"source": "shakespeare", "path": None, "paths": None, "text_column": "text", "encoding": "utf-8",
                 "max_tokens": None, "dataset_name": "HuggingFaceFW/fineweb", "dataset_config": "sample-10BT",
                 "val_fraction": 0.05, "val_tokens": 32768, "compact_vocab": True, "cache_dir": None,
                 "num_workers": 0, "task": "hops", "size": [1, 4], "extrapolation": [5, 8], "chains": 2,
                 "distractors": 2, "layout": "shuffled", "names": 16, "nines": 0.25, "modulus": 10,
                 "train_records": 20000, "test_records": 256, "validation_records": 256, "extrapolation_records": 256,
                 "instance_seed": 0, "loss": "all"}
FLAT_TASK_OPTIONS = ("size", "extrapolation", "chains", "distractors", "layout", "names", "nines", "modulus")


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def is_flat(d: dict) -> bool:
    """Whether `d` is a data config of the flat form: a task named by a string (`task: hops`)
    or without `data.task`; a text source holding keys of the flat form it does not have
    (another source's, a task's, `loss`) at the flat form's defaults, as the flat schema
    required of a key its source did not read."""
    source = d.get("source")
    if source == "task":
        return not isinstance(d.get("task"), dict)
    return source in sources.names() and bool(_unread(d, source))


def _unread(d: dict, source: str) -> set[str]:
    """The keys of `d` its text source does not have that hold the flat form's defaults."""
    return {k for k in set(d) - _fields(sources.lookup(source)) if k in FLAT_DEFAULTS and d[k] == FLAT_DEFAULTS[k]}


def upgrade(d: dict) -> dict:
    """A data config of the flat form (`is_flat`) in today's nested form; any other returned
    as it is (a copy). The flat form held every source's keys, the unread ones at their
    defaults (the schema refused any other value), so:

      data=shakespeare|fineweb|files  the keys of other sources and the task's are dropped
                                      (at the flat defaults: another value stays, for the
                                      schema to refuse, naming it); `compact_vocab: null`
                                      ("on for shakespeare only") becomes true or false
      data=task                       `task: <name>` becomes `task: {name: <name>}`, and the
                                      task's options (size, extrapolation, chains,
                                      distractors, layout, names, nines, modulus) move into
                                      it, those of other tasks dropped; the text sources'
                                      keys are dropped

    The values kept are the same, so the same data comes out (the same tokens, the same
    records). The training identity (recdepth/training/runs.py: `what_trains`) hashes the
    data config in this form: for the text sources the keys and values it hashes are the
    ones it hashed before (the identity of a run on shakespeare, fineweb or files is
    unchanged), for a task it hashes the nested form, so a task run trained before this
    form has another identity than the same run now: it is not reused (trained again),
    while its checkpoint still opens (`ckpt=`) and evaluates as before."""
    d = json.loads(json.dumps(d, default=str))
    source = d.get("source")
    if source != "task" and d.get("compact_vocab", False) is None:
        d["compact_vocab"] = source == "shakespeare"
    if not is_flat(d):
        return d
    cls = sources.lookup(source)
    if source != "task":
        unread = _unread(d, source)
        return {k: v for k, v in d.items() if k not in unread}
    name = d.get("task") or "hops"
    task_fields = _fields(tasks.lookup(name))
    task = {"name": name, **{k: d[k] for k in FLAT_TASK_OPTIONS if k in d and k in task_fields}}
    out = {k: v for k, v in d.items() if k in _fields(cls) and k != "task"}
    out["task"] = task
    return out


def node(d: dict) -> DictConfig:
    """The typed node a plain data config `d` (any form: `upgrade` first) merges onto: its
    source's class (a task's: with `task` of the class data.task.name names). One line
    naming data.source (or data.task.name) for a source (task) that is not registered."""
    d = upgrade(d)
    if "source" not in d:
        raise ValueError(f"data.source: required (one of {', '.join(sources.names())})")
    return sources.lookup(d["source"]).node(d)


def check_choice(cfg: DictConfig) -> None:
    """A composed `data` node names the source (and task) it was composed as: `data.source`
    or `data.task.name` set to another one is refused in one line (select it with data=<name>)
    rather than read as the other one with this one's values."""
    for where, n, field, registered in (("data.source", cfg, "source", sources.names),
                                        ("data.task.name", cfg.get("task"), "name", tasks.names)):
        own = OmegaConf.get_type(n) if isinstance(n, DictConfig) else None
        fields = {f.name: f for f in dataclasses.fields(own)} if dataclasses.is_dataclass(own) else {}
        mine = fields[field].default if field in fields else None
        if isinstance(mine, str) and mine in registered() and n.get(field) != mine:
            raise ValueError(f"{where}: the config was composed as data={mine}, "
                             f"got {n.get(field)!r} (select another with data=<source or task>: "
                             f"{', '.join([*sources.names(), *tasks.names()])})")
