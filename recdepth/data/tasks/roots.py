"""roots: union-find's `find` on a forest (docs/spec.md §6).

A forest of `nodes` nodes (N), node i always named NAMES[i] (` a`, ` b`, ...): first its
parent table, token i the name of parent(i) (a root is its own parent), then ` ?` and
`queries` queries ` q r`, the query node q and its root r. One instance a record, right after
its EOT, so node i's entry sits at window position i + 1 in every record and a lookup is one
attention by position. Which nodes form which chain, in which order, is a random permutation
per instance (the layout gives nothing away: parent(i) is no function of i).

The forest is cut into chains whose lengths are drawn so the query depths cover `size`:
chains of lo + 1 .. hi + 1 nodes (the last one capped at what is left; a leftover shorter
than lo + 1 is one more chain, never queried), the last node of each its root. A query is a
node at hops h in [lo, hi] from its root: h drawn uniformly from the depths the forest still
has unqueried nodes at, then a node of that depth; queries are distinct nodes (a repeated
query would let the model copy an earlier answer), so a forest with fewer than `queries`
nodes in range (a deep extrapolation range, few nodes) has fewer queries. Deep queries are
the rarer ones (h hops need a chain of h + 1 nodes), as in the probe this task comes from:
at the defaults about 14% of the training queries are 0-3 hops each, 3% are 8; an
extrapolation instance holds 4.7 queries on average, 43% of them 9 hops, 8% 12.

Labels: the answer r is labelled h + 1, the hops from q to its root **plus one**, because a
label of 0 means "not an answer" in every task (recdepth/data/tasks/task.py); h + 1 is also
the number of table lookups `find` makes (it knows it has reached the root when parent(x) =
x). So a query that is its own root is difficulty 1, and difficulty d needs d - 1 hops.

Per-step targets (`steps`, docs/spec.md §6): after loop application t the target of the
answer is the node t hops up from q, parent^t(q), for t = 1 .. h (the root at t = h; after
that the root, the final target); a root queried (h = 0) has none. The longest is
`step_width()` = the largest hop count of any split. Applying `x -> parent(x)` at a root
changes nothing, so the loop's algorithm has a fixed point exactly when the answer is found.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from recdepth.core.checks import is_int
from recdepth.data.tasks.task import NAMES, Instance, Task


@dataclass
class Roots(Task):
    """`data=roots`: the root of a query node in a forest's parent table (union-find's
    `find`), difficulty = hops to the root + 1; per-step targets: the node t hops up."""

    name: str = "roots"
    size: list[int] = field(default_factory=lambda: [0, 8])
    """Hops from a query node to its root, [lo, hi] (lo >= 0), of train/validation/test."""
    extrapolation: list[int] = field(default_factory=lambda: [9, 12])
    """Hops of the extrapolation split's queries, [lo, hi], above `size`."""
    nodes: int = 24
    """N, the forest's nodes: the parent table's entries (at most 52, the names there are;
    at least the largest hop count + 1, the nodes of the longest chain)."""
    queries: int = 8
    """Queries per instance (distinct nodes; fewer where the forest has fewer in range), 1..nodes."""

    def __post_init__(self):
        super().__post_init__()
        if not (is_int(self.nodes) and 1 <= self.nodes <= len(NAMES)):
            raise ValueError(f"data.task.nodes: expected an integer in 1..{len(NAMES)} (one name per node), "
                             f"got {self.nodes!r}")
        for key in ("size", "extrapolation"):
            hi = getattr(self, key)[1]
            if hi > self.nodes - 1:
                raise ValueError(f"data.task.{key}: {hi} hops need a chain of {hi + 1} nodes, more than "
                                 f"data.task.nodes={self.nodes} (expected hops <= nodes - 1)")
        if not (is_int(self.queries) and 1 <= self.queries <= self.nodes):
            raise ValueError(f"data.task.queries: expected an integer in 1..data.task.nodes={self.nodes}, "
                             f"got {self.queries!r}")

    def min_size(self) -> int:
        return 0  # a query may be a root: 0 hops

    def step_width(self) -> int:
        return self.largest()  # a query h hops deep states h steps

    def one_per_record(self) -> bool:
        return True  # node i's entry at position i + 1 of every record: the lookup is by position

    def generate(self, rng: random.Random, sizes: tuple[int, int]) -> Instance:
        return roots(rng, sizes, self.nodes, self.queries)


def forest(rng: random.Random, hops: tuple[int, int], n: int) -> list[int]:
    """parent[i] of n nodes: a random permutation of the nodes cut into chains of
    lo + 1 .. hi + 1 nodes (the last capped at the nodes left; a leftover shorter than lo + 1
    is a chain of its own), each chain's last node its root (its own parent)."""
    lo, hi = hops
    perm = rng.sample(range(n), n)
    parent, i = [0] * n, 0
    while i < n:
        left = n - i
        k = left if left < lo + 1 else min(rng.randint(lo + 1, hi + 1), left)
        chain, i = perm[i : i + k], i + k
        for a, b in zip(chain, [*chain[1:], chain[-1]], strict=True):
            parent[a] = b
    return parent


def path_up(parent: list[int], x: int) -> list[int]:
    """parent(x), parent(parent(x)), ... up to the root: the nodes 1, 2, ..., h hops up ([] at a root)."""
    out = []
    while parent[x] != x:
        x = parent[x]
        out.append(x)
    return out


def roots(rng: random.Random, hops: tuple[int, int], n: int, queries: int) -> Instance:
    """The parent table of a forest of n nodes (`forest`), ` ?`, then up to `queries`
    distinct query nodes h in [lo, hi] hops from their roots, each followed by its root
    (label h + 1, steps: the nodes 1..h hops up)."""
    lo, hi = hops
    parent = forest(rng, hops, n)
    up = [path_up(parent, x) for x in range(n)]
    by_depth: dict[int, list[int]] = {}
    for x in range(n):
        if lo <= len(up[x]) <= hi:
            by_depth.setdefault(len(up[x]), []).append(x)
    inst: Instance = [(NAMES[p], 0, ()) for p in parent]
    inst.append(("?", 0, ()))
    for _ in range(queries):
        if not by_depth:
            break
        h = rng.choice(sorted(by_depth))
        q = by_depth[h].pop(rng.randrange(len(by_depth[h])))
        if not by_depth[h]:
            del by_depth[h]
        root = up[q][-1] if up[q] else q
        inst += [(NAMES[q], 0, ()), (NAMES[root], h + 1, tuple(NAMES[a] for a in up[q]))]
    return inst
