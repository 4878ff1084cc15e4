"""The value checks that configs and settings run when they are built: one definition each
of "an integer", "a finite number", "one of these", "true or false". A failed check raises
a one-line ValueError that starts with the field's full name (`eval.context_steps: expected
...`), which is what the commands print (docs/config.md).

Core: the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def is_int(v) -> bool:
    """An int that is not a bool (YAML's true is an int to Python)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def check_int(name: str, v, lo: int, null: bool = False) -> int | None:
    """v, if it is an integer >= lo (or None where `null`); else the one-line error naming `name`."""
    if v is None and null:
        return v
    if not is_int(v) or v < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}{' or null' if null else ''}, got {v!r}")
    return v


def check_number(name: str, v, lo: float = 0.0, strict: bool = False, null: bool = False) -> float | None:
    """v, if it is a finite number >= lo (> lo if `strict`), or None where `null`; else the
    one-line error naming `name`."""
    if v is None and null:
        return v
    if not is_number(v) or not (v > lo if strict else v >= lo):
        raise ValueError(f"{name}: expected a finite number {'>' if strict else '>='} {lo:g}"
                         f"{' or null' if null else ''}, got {v!r}")
    return v


def check_one_of(name: str, v, choices: Iterable[str]) -> str:
    """v, if it is one of `choices`; else the one-line error naming `name` and listing them."""
    choices = tuple(choices)
    if v not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {v!r}")
    return v


def check_bool(name: str, v, null: bool = False) -> bool | None:
    """v, if it is true or false (or None where `null`); else the one-line error naming `name`."""
    if not (isinstance(v, bool) or (null and v is None)):
        raise ValueError(f"{name}: expected {'null, ' if null else ''}true or false, got {v!r}")
    return v
