"""hops: pointer chasing / variable binding (docs/spec.md §6).

`chains` queried chains of assignments and `distractors` chains that are never queried,
all statements shuffled: ` c = 7 a = b b = c` (three tokens a statement), then one query
per queried chain, at its head: ` ? a 7`. Difficulty = the chain's length k (the hops from
the queried name to its value). Only the head of a chain is queried: a second answer from
the same chain would hand the first one's value to the model (x = y means x and y share
the value), a shortcut around the hops. The distractors close another shortcut: with
every chain queried, the last answer is the one value not yet given (measured: 76% at
every hop count and depth, docs/results/tasks.md). The sorted layout (experiment=hops) assigns
the first `names` names once each, in alphabetical order: the lookup is by position.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from recdepth.data.tasks.task import DIGITS, NAMES, Instance, Task

LAYOUTS = ("shuffled", "sorted")


@dataclass
class Hops(Task):
    """`data=hops`: pointer chasing, difficulty = the hops from the queried name to its value."""

    name: str = "hops"
    chains: int = 2
    """Queried chains per instance (each queried once, at its head)."""
    distractors: int = 2
    """Chains per instance that are never queried (in the sorted layout: at least this many),
    so no answer follows by elimination."""
    layout: str = "shuffled"
    """shuffled (the statements of `chains + distractors` chains in random order: the
    lookup is by content) | sorted (the `names` first names all assigned, one statement each,
    in alphabetical order, one instance per record: the lookup is by position; experiment=hops)."""
    names: int = 16
    """Sorted layout: the names of every instance (a..), partitioned into chains, all assigned."""

    def __post_init__(self):
        super().__post_init__()
        top = self.largest()
        if self.layout not in LAYOUTS:
            raise ValueError(f"data.task.layout: expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.layout == "sorted":
            if not (self.chains >= 1 and self.distractors >= 0 and (self.distractors + 1) * top <= self.names <= len(NAMES)):
                raise ValueError(f"data.task.names: {self.names} names cannot hold {self.distractors} distractor chains "
                                 f"and one queried chain of up to {top} names (expected chains >= 1 and (distractors + "
                                 f"1) * {top} <= names <= {len(NAMES)})")
        elif not (self.chains >= 1 and self.distractors >= 0 and (self.chains + self.distractors) * top <= len(NAMES)):
            raise ValueError(f"data.task.chains: {self.chains} queried and {self.distractors} distractor chains of up "
                             f"to {top} names need more than the {len(NAMES)} names there are (expected chains >= 1 and "
                             f"(chains + distractors) * size <= {len(NAMES)})")

    def generate(self, rng: random.Random, sizes: tuple[int, int]) -> Instance:
        if self.layout == "sorted":
            return hops_sorted(rng, sizes, self.chains, self.distractors, self.names)
        return hops(rng, sizes, self.chains, self.distractors)

    def one_per_record(self) -> bool:
        # The sorted layout gives every name's statement a fixed place: one instance a record,
        # right after its EOT, keeps that place fixed in the window too.
        return self.layout == "sorted"


def hops(rng: random.Random, k_range: tuple[int, int], chains: int, distractors: int = 0) -> Instance:
    """Chains of assignments ` x1 = x2 ... xk = v`, statements shuffled, then ` ? x1 v`
    for the head x1 of each of the first `chains` chains (difficulty k); the other
    `distractors` chains are not queried."""
    ks = [rng.randint(*k_range) for _ in range(chains + distractors)]
    names = rng.sample(NAMES, sum(ks))
    statements, queries, i = [], [], 0
    for c, k in enumerate(ks):
        chain, i = names[i : i + k], i + k
        value = rng.choice(DIGITS)
        statements += [(chain[j], chain[j + 1]) for j in range(k - 1)] + [(chain[-1], value)]
        if c < chains:
            queries.append((chain[0], value, k))
    rng.shuffle(statements)
    inst: Instance = []
    for x, y in statements:
        inst += [(x, 0), ("=", 0), (y, 0)]
    for x, value, k in queries:
        inst += [("?", 0), (x, 0), (value, k)]
    return inst


def hops_sorted(rng: random.Random, k_range: tuple[int, int], chains: int, distractors: int, names: int) -> Instance:
    """The first `names` names, shuffled and cut into chains of lengths drawn from k_range
    (the leftover, shorter than the range's low end, is one more chain), one statement per
    name in alphabetical order (` a = f b = 3 c = a ...`), then ` ? x v` for the heads x of
    up to `chains` chains of the range (difficulty k), leaving at least `distractors`
    chains unqueried. A name's statement sits at a fixed place in every instance, so the
    lookup is by position, which a layer learns directly; following the chain still takes
    one lookup per hop."""
    order = NAMES[:names]
    perm = rng.sample(order, names)
    target, full, i = {}, [], 0
    while i < names:
        k = rng.randint(*k_range)
        if i + k > names:
            k = names - i  # the leftover: shorter than k_range, never queried
        chain, i = perm[i : i + k], i + k
        value = rng.choice(DIGITS)
        for a, b in zip(chain, [*chain[1:], value]):
            target[a] = b
        if k >= k_range[0]:
            full.append((chain[0], value, k))
    leftover = 1 if sum(k for *_, k in full) < names else 0  # the short chain: one more distractor
    rng.shuffle(full)
    queried = full[: max(0, min(chains, len(full) + leftover - distractors))]
    inst: Instance = []
    for x in order:
        inst += [(x, 0), ("=", 0), (target[x], 0)]
    for x, value, k in queried:
        inst += [("?", 0), (x, 0), (value, k)]
    return inst
