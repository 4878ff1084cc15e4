"""A registry of named extension points: the exit rules (recdepth/exits/rule.py), the tasks
(recdepth/data/tasks/task.py) and the data sources (recdepth/data/sources/source.py). Each
base class registers its subclasses as they are defined (`__init_subclass__`), so adding
one is writing its class; commands list and look them up here by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """name -> entry, in the order of registration. `field` is the config key that names an
    entry (e.g. "exit.name") and `what` what an entry is ("exit rule"): the one-line errors
    name both."""

    def __init__(self, field: str, what: str):
        super().__init__()
        self.field, self.what = field, what
        self._owners: dict[str, str] = {}  # name -> the defining class's module.qualname

    def register(self, name, entry: T, owner: type) -> None:
        """Add `entry` under `name` (an identifier), `owner` the class that names it. A name
        is one class's: another class claiming it is a one-line error naming both (the same
        class defined again, a module re-run, replaces its entry)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"{owner.__qualname__}: a {self.what} needs a name, an identifier (got {name!r})")
        here, taken = f"{owner.__module__}.{owner.__qualname__}", self._owners.get(name)
        if taken is not None and taken != here:
            raise ValueError(f"{here}: the {self.what} name {name!r} ({self.field}) is taken by {taken}; "
                             "give the class another name")
        self._owners[name] = here
        self[name] = entry

    def names(self) -> tuple[str, ...]:
        """Every registered name, in the order of registration."""
        return tuple(self)

    def lookup(self, name: str) -> T:
        """The entry registered under `name`; a one-line ValueError naming `field` otherwise."""
        if name not in self:
            raise ValueError(f"{self.field}: unknown {self.what} {name!r} (expected one of {', '.join(self)})")
        return self[name]

    def name_of(self, entry) -> str | None:
        """The name `entry` is registered under (None if it is not)."""
        return next((n for n, e in self.items() if e is entry), None)

    def __copy__(self) -> Registry[T]:  # a test's scoped copy (monkeypatch) keeps the methods
        new = Registry(self.field, self.what)
        new.update(self)
        new._owners.update(self._owners)
        return new


def import_folder(package: str, path: Iterable[str]) -> None:
    """Import every module in a package's folder (`package`: its dotted name, `path`: its
    `__path__`), so that a file dropped there defining an extension (a rule in exits/rules/,
    a task in data/tasks/, a source in data/sources/) registers it with no import written
    anywhere else."""
    for m in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if not m.name.startswith("_"):
            importlib.import_module(f"{package}.{m.name}")
