"""modsum: ` 3 1 4 = 8` (docs/spec.md §6).

k digits and their sum modulo `modulus` (a state carried along the sequence, as in ACT's
parity; here one answer after the k terms, so no earlier answer gives a running total
away). Difficulty = k.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from recdepth.data.tasks.task import Instance, Task


@dataclass
class Modsum(Task):
    """`data=modsum`: a sum modulo `modulus`, difficulty = the number of terms."""

    name: str = "modsum"
    modulus: int = 10
    """The modulus of the sum (2..10: the answer is one digit)."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.modulus, bool) or not isinstance(self.modulus, int) or not 2 <= self.modulus <= 10:
            raise ValueError(f"data.task.modulus: expected an integer in 2..10 (one-digit answers), got {self.modulus!r}")

    def generate(self, rng: random.Random, sizes: tuple[int, int]) -> Instance:
        return modsum(rng, sizes, self.modulus)


def modsum(rng: random.Random, k_range: tuple[int, int], modulus: int) -> Instance:
    """k digits d_1 .. d_k (each below the modulus), then ` = (Σ d) mod modulus` (difficulty k)."""
    k = rng.randint(*k_range)
    ds = [rng.randrange(modulus) for _ in range(k)]
    return [(str(d), 0) for d in ds] + [("=", 0), (str(sum(ds) % modulus), k)]
