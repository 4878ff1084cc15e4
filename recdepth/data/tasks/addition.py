"""addition: ` 3 4 7 + 5 6 9 = 0 9 1 6` (docs/spec.md §6).

Two n-digit addends (leading zeros allowed) and their n + 1 digit sum, all most
significant digit first, so an answer digit is written before the lower digits that
decide its carry. Difficulty of the digit in column i = the columns it depends on: its
own, and the lower columns down to the first whose digit sum is not 9 (that column
decides the carry; a 9 passes the carry below it on), or down to the units. A carry chain
of length L makes the digit above it difficulty L + 1. Column pairs summing to 9 are
drawn with probability `nines` so long chains occur.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from recdepth.data.tasks.task import Instance, Task


@dataclass
class Addition(Task):
    """`data=addition`: multi-digit addition, difficulty = the carry lookback of an answer digit."""

    name: str = "addition"
    nines: float = 0.25
    """Probability that a column's digit pair sums to 9 (passes a carry on), in [0, 1)."""

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.nines, int | float) and not isinstance(self.nines, bool) and 0.0 <= self.nines < 1.0):
            raise ValueError(f"data.task.nines: expected a probability in [0, 1), got {self.nines!r}")

    def generate(self, rng: random.Random, sizes: tuple[int, int]) -> Instance:
        return addition(rng, sizes, self.nines)


def carry_difficulty(column_sums: list[int]) -> list[int]:
    """Per column i = 0 (units) .. n (the final carry): 1 + the lower columns the digit of
    column i depends on (down to the first column below i whose sum is not 9, inclusive,
    or down to the units)."""
    out = []
    for i in range(len(column_sums) + 1):
        j, n = i - 1, 0
        while j >= 0:
            n += 1
            if column_sums[j] != 9:
                break
            j -= 1
        out.append(1 + n)
    return out


def addition(rng: random.Random, n_range: tuple[int, int], nines: float) -> Instance:
    """` a + b = c`, n-digit addends and the (n + 1)-digit sum, most significant first."""
    n = rng.randint(*n_range)
    a, b = [], []  # column 0 = units
    for _ in range(n):
        if rng.random() < nines:
            x = rng.randrange(10)
            a.append(x), b.append(9 - x)
        else:
            a.append(rng.randrange(10)), b.append(rng.randrange(10))
    sums = [x + y for x, y in zip(a, b, strict=True)]
    c = sum(v * 10**i for i, v in enumerate(sums))
    digits = [int(ch) for ch in str(c).zfill(n + 1)][::-1]  # column 0 first
    diff = carry_difficulty(sums)
    inst: Instance = [(str(x), 0) for x in a[::-1]] + [("+", 0)] + [(str(y), 0) for y in b[::-1]] + [("=", 0)]
    inst += [(str(digits[i]), diff[i]) for i in range(n, -1, -1)]
    return inst
