"""carry: binary addition, least significant bit first, the sum bits in place (docs/spec.md §6).

Two addends a, b of n bits (n in `size`). Bit pair i, (a_i, b_i), is one token, NAMES[a_i +
2 b_i] (` a` ` b` ` c` ` d` = 00, 10, 01, 11), least significant first, then ` =`. The
answers are **in place** (task.py: in-place targets): the prediction made at pair i is
scored against the sum bit s_i = a_i xor b_i xor carry_i (` 0` / ` 1`), which the token after
pair i carries as its scored symbol (pair i + 1's token, or ` =` after the last pair, the
slot the last bit needs inside the instance); the prediction at ` =` targets the newline
and is no answer, neither is the one before pair 0. Interleaving the sum bits as next tokens
would hand the model the carry under teacher forcing; in place, the input stream holds the
addends only, and the model must carry itself.

Difficulty d_i = the positions back to the pair that decides carry_i: the last j < i with
a_j == b_j (a generate 11 or kill 00 pair: carry_{j+1} = a_j), i - j; or i + 1, the start
(carry 0). With sliding-window attention of 2 (`model.attention_window=2`) information moves
one position per layer application, so bit i needs about d_i applications. A pair propagates
the carry (a_i != b_i) with probability `propagate` (0.75), so chains are long: d is about
geometric, P(d > k) = propagate^k below the start.

Records pack whole instances (`one_per_record` False): nothing here is by absolute position,
and an instance's first pair follows EOT or the previous instance's newline, from which
no carry arrives (under window 2 pair 0 sees only that token), so instances sharing a record
stay independent; packing puts ~4 instances in a 64-token window instead of one, and places
them at every offset of a record.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from recdepth.data.tasks.task import DIGITS, NAMES, Instance, Task

PAIRS = tuple(NAMES[:4])  # (a_i, b_i) -> PAIRS[a_i + 2 * b_i]: a = 00, b = 10, c = 01, d = 11


@dataclass
class Carry(Task):
    """`data=carry`: binary addition least significant bit first, each sum bit scored in place
    at its bit pair; difficulty = the positions back to the pair that decides its carry."""

    name: str = "carry"
    size: list[int] = field(default_factory=lambda: [8, 16])
    """Bits per addend, [lo, hi] inclusive, of train/validation/test."""
    extrapolation: list[int] = field(default_factory=lambda: [17, 24])
    """Bits per addend of the extrapolation split, [lo, hi], above `size`."""
    propagate: float = 0.75
    """P(a_i != b_i), a pair that propagates the carry, in (0, 1); the rest generate (11) or
    kill (00) it, alike."""
    ripple: float = 0.0
    """P(an instance ripples), in [0, 1]: its first pair generates the carry (11) and every
    later pair propagates it, so the carry travels through every bit (d_i = i): the longest
    chain an addition of its size has. 0 (training's): none does."""

    def __post_init__(self):
        super().__post_init__()
        for name, lo_open in (("propagate", True), ("ripple", False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (0 < v < 1 if lo_open else 0 <= v <= 1):
                raise ValueError(f"data.task.{name}: expected a probability in {'(0, 1)' if lo_open else '[0, 1]'}, "
                                 f"got {v!r}")
            setattr(self, name, float(v))

    def in_place(self) -> bool:
        return True  # the sum bits are scored at the pairs, not written as tokens

    def generate(self, rng: random.Random, sizes: tuple[int, int]) -> Instance:
        return carry(rng, sizes, self.propagate, self.ripple)


def add(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    """The sum bits s_i and their difficulties d_i of two addends, least significant first."""
    carry, last, s, d = 0, -1, [], []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        s.append(x ^ y ^ carry)
        d.append(i - last)  # i + 1 while no pair has decided the carry (last = -1: the start)
        carry = (x & y) | (carry & (x ^ y))
        if x == y:
            last = i
    return s, d


def carry(rng: random.Random, bits: tuple[int, int], propagate: float, ripple: float = 0.0) -> Instance:
    """n in [lo, hi] bit pairs, pair i propagating with probability `propagate` (else 00 or
    11 alike), then ` =`; the token after pair i carries s_i (scored symbol) and d_i (label).
    With probability `ripple` the instance ripples instead: pair 0 is 11, every later pair
    propagates (its bits drawn at random). With ripple 0 no draw is spent on it, so the
    instances are those of a task without the option."""
    n = rng.randint(*bits)
    rippling = ripple > 0 and rng.random() < ripple
    a, b = [], []
    for i in range(n):
        x = 1 if rippling and i == 0 else rng.randint(0, 1)
        a.append(x)
        b.append(x if rippling and i == 0 else 1 - x if rippling or rng.random() < propagate else x)
    s, d = add(a, b)
    syms = [PAIRS[x + 2 * y] for x, y in zip(a, b, strict=True)] + ["="]
    return [(sym, 0 if i == 0 else d[i - 1], (), None if i == 0 else DIGITS[s[i - 1]]) for i, sym in enumerate(syms)]
