"""prefixsums: DeepThinking's prefix sums (Bansal et al. 2022, arXiv 2202.05826), the running
parity scored in place (docs/spec.md §6).

n bits b_0 .. b_{n-1} (n in `size`), one token each, ` a` for 0 and ` b` for 1 (letters: the
inputs and the answers are different symbols), then ` =`. The prediction made at bit i is
scored **in place** (task.py: in-place targets) against the running parity
p_i = b_0 xor ... xor b_i (` 0` / ` 1`), which the token after bit i carries as its scored
symbol (bit i + 1's token, or ` =` after the last bit); the prediction at ` =` (the
newline's) and the one before bit 0 are no answers. DeepThinking's targets are the same
running parities, one per bit; there the network sees all bits at once and is iterated a
fixed number of times, here a looped transformer reads them left to right.

Difficulty d_i = i + 1: p_i depends on every bit back to the first, so with sliding-window
attention of 2 (`model.attention_window=2`: information moves one position per layer
application) bit i needs about i + 1 applications, and a longer instance is a deeper one
(DeepThinking's "harder" is longer: 32 bits in training, up to 512 at test).

Per-step targets (`loss.steps=trajectory`, as roots' one hop per application): after loop
application t the prediction at bit i targets the parity of the last t + 1 bits,
b_{i-t} xor ... xor b_i, one more bit per application, and p_i itself from t = i on (the
window then reaches bit 0): the relay a window of 2 allows, stated so that the loss
teaches it one application at a time. The loss after the last application alone (or the
final target after every one) gives the relay no signal until it already works
(docs/results/extrapolation.md).

Records pack whole instances (`one_per_record` False), as carry.py's: an instance's first
bit follows EOT or the previous instance's newline, from which no parity arrives under
window 2, so instances sharing a record stay independent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from recdepth.data.tasks.task import DIGITS, NAMES, Instance, Task

BITS = tuple(NAMES[:2])  # b_i -> BITS[b_i]: ` a` = 0, ` b` = 1


@dataclass
class PrefixSums(Task):
    """`data=prefixsums`: bits in, the running parity of each prefix scored in place at its
    last bit; difficulty = the prefix's length."""

    name: str = "prefixsums"
    size: list[int] = field(default_factory=lambda: [8, 32])
    """Bits per instance, [lo, hi] inclusive, of train/validation/test (DeepThinking trains on 32)."""
    extrapolation: list[int] = field(default_factory=lambda: [33, 48])
    """Bits per instance of the extrapolation split, [lo, hi], above `size`."""

    def in_place(self) -> bool:
        return True  # the parities are scored at the bits, not written as tokens

    def step_width(self) -> int:
        return max(1, self.largest() - 2)  # p_i states i - 1 window parities; the longest is p_{n-1}

    def generate(self, rng: random.Random, sizes: tuple[int, int]) -> Instance:
        return prefix_sums(rng, sizes)


def prefix_sums(rng: random.Random, lengths: tuple[int, int]) -> Instance:
    """n in [lo, hi] uniform random bits, then ` =`; the token after bit i carries p_i (scored
    symbol), its difficulty i + 1 (label) and its per-step targets, the parities of bits
    i - t .. i for t = 1 .. i - 1 (`window_parities`)."""
    bits = [rng.randint(0, 1) for _ in range(rng.randint(*lengths))]
    out = [(BITS[bits[0]], 0, (), None)]
    for i in range(len(bits)):  # the token after bit i: bit i + 1's, or ` =` after the last
        sym = BITS[bits[i + 1]] if i + 1 < len(bits) else "="
        out.append((sym, i + 1, window_parities(bits, i), DIGITS[sum(bits[: i + 1]) % 2]))
    return out


def window_parities(bits: list[int], i: int) -> tuple[str, ...]:
    """The prediction at bit i after applications t = 1 .. i - 1: the parity of bits
    i - t .. i (from t = i on the window holds every bit: p_i, the final target)."""
    return tuple(DIGITS[sum(bits[i - t : i + 1]) % 2] for t in range(1, i))
