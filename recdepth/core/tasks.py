"""Algorithmic tasks with known per-token difficulty (docs/spec.md §6): the test bed of
adaptive computation (ACT, PonderNet, looped transformers), generated, never downloaded.

Every task writes instances as runs of single GPT-2 tokens (" a", " 7", " =", ...), so the
token pipeline (`recdepth.glue.tokens`: compact vocabulary, cache, windows) carries them like
text, and labels each token: 0 = not an answer, d >= 1 = an answer of difficulty d.

    hops      pointer chasing / variable binding. `chains` queried chains of assignments and
              `distractors` chains that are never queried, all statements shuffled:
              ` c = 7 a = b b = c` (three tokens a statement), then one query per queried
              chain, at its head: ` ? a 7`. Difficulty = the chain's length k (the hops from
              the queried name to its value). Only the head of a chain is queried: a second
              answer from the same chain would hand the first one's value to the model (x = y
              means x and y share the value), a shortcut around the hops. The distractors
              close another shortcut: with every chain queried, the last answer is the one
              value not yet given (measured: 76% at every hop count and depth, docs/results.md).
    addition  ` 3 4 7 + 5 6 9 = 0 9 1 6`: two n-digit addends (leading zeros allowed) and
              their n + 1 digit sum, all most significant digit first, so an answer digit
              is written before the lower digits that decide its carry. Difficulty of the
              digit in column i = the columns it depends on: its own, and the lower
              columns down to the first whose digit sum is not 9 (that column decides the
              carry; a 9 passes the carry below it on), or down to the units. A carry
              chain of length L makes the digit above it difficulty L + 1. Column pairs
              summing to 9 are drawn with probability `nines` so long chains occur.
    modsum    ` 3 1 4 = 8`: k digits and their sum modulo `modulus` (a state carried along
              the sequence, as in ACT's parity; here one answer after the k terms, so no
              earlier answer gives a running total away). Difficulty = k.

Splits: train, validation, test and extrapolation are drawn from disjoint seeds, and an
instance belongs to exactly one of train / validation / test by a hash of its tokens
(`bucket`), so no instance is in two splits, also where the instance space is small (all
2-digit additions). The extrapolation split draws sizes from `extrapolation` (larger than
`size`: more hops, digits, terms) and takes test's hash buckets.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from recdepth.core import stats

TASKS = ("hops", "addition", "modsum")
LAYOUTS = ("shuffled", "sorted")
SPLITS = ("train", "validation", "test", "extrapolation")
# Hash buckets (of 100) of each split: test 0-9, validation 10-19, train 20-99.
BUCKETS = {"test": range(0, 10), "validation": range(10, 20), "train": range(20, 100),
           "extrapolation": range(0, 10)}
NAMES = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
DIGITS = [str(d) for d in range(10)]
# Bump when a generator changes what it writes: old task caches then stop matching.
TASK_VERSION = 2  # 2: hops' unqueried distractor chains

MAX_REDRAWS = 10_000
Instance = list[tuple[str, int]]  # (symbol, label): label 0 = not an answer, d >= 1 = difficulty


@dataclass(frozen=True)
class TaskSpec:
    """What a task's instances are. Validated at construction; every error names its data.* key."""

    task: str = "hops"
    """hops | addition | modsum."""
    size: tuple[int, int] = (1, 4)
    """Instance sizes of train/validation/test, [lo, hi] inclusive: a hops chain's length,
    an addend's digits, a modsum's terms."""
    extrapolation: tuple[int, int] = (5, 8)
    """Instance sizes of the extrapolation split, [lo, hi], above `size`."""
    chains: int = 2
    """hops: queried chains per instance (each queried once, at its head)."""
    distractors: int = 2
    """hops: chains per instance that are never queried (in the sorted layout: at least this many)."""
    layout: str = "shuffled"
    """hops: shuffled (the statements of `chains + distractors` chains in random order: the
    lookup is by content) | sorted (the `names` first names all assigned, one statement each,
    in alphabetical order, one instance per record: the lookup is by position)."""
    names: int = 16
    """hops, sorted layout: the names of every instance (a..), partitioned into chains."""
    nines: float = 0.25
    """addition: probability that a column's digit pair sums to 9 (passes a carry on)."""
    modulus: int = 10
    """modsum: the modulus of the sum (2..10: the answer is one digit)."""

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"data.task: unknown task {self.task!r} (expected one of {', '.join(TASKS)})")
        for key, (lo, hi) in (("size", self.size), ("extrapolation", self.extrapolation)):
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"data.{key}: expected [lo, hi] with 1 <= lo <= hi, got [{lo}, {hi}]")
        if self.extrapolation[0] <= self.size[1]:
            raise ValueError(f"data.extrapolation: sizes must exceed the training range data.size="
                             f"{list(self.size)}, got {list(self.extrapolation)}")
        top = max(self.size[1], self.extrapolation[1])
        if self.layout not in LAYOUTS:
            raise ValueError(f"data.layout: expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.task == "hops" and self.layout == "sorted":
            if not (self.chains >= 1 and self.distractors >= 0 and (self.distractors + 1) * top <= self.names <= len(NAMES)):
                raise ValueError(f"data.names: {self.names} names cannot hold {self.distractors} distractor chains and one "
                                 f"queried chain of up to {top} names (expected chains >= 1 and (distractors + 1) * "
                                 f"{top} <= names <= {len(NAMES)})")
        elif self.task == "hops" and not (self.chains >= 1 and self.distractors >= 0
                                        and (self.chains + self.distractors) * top <= len(NAMES)):
            raise ValueError(f"data.chains: {self.chains} queried and {self.distractors} distractor chains of up to "
                             f"{top} names need more than the {len(NAMES)} names there are (expected chains >= 1 and "
                             f"(chains + distractors) * size <= {len(NAMES)})")
        if not 0.0 <= self.nines < 1.0:
            raise ValueError(f"data.nines: expected a probability in [0, 1), got {self.nines}")
        if not 2 <= self.modulus <= 10:
            raise ValueError(f"data.modulus: expected 2..10 (one-digit answers), got {self.modulus}")

    def sizes(self, split: str) -> tuple[int, int]:
        return self.extrapolation if split == "extrapolation" else self.size


LOSSES = ("all", "answers")


def check_loss(source: str, loss: str) -> None:
    """data.loss: `answers` needs a task's labels."""
    if loss not in LOSSES:
        raise ValueError(f"data.loss: expected one of {', '.join(LOSSES)}, got {loss!r}")
    if loss == "answers" and source != "task":
        raise ValueError(f"data.loss: answers needs per-token answer labels, which only data=task has "
                         f"(data={source} is text: use data.loss=all)")


# ------------------------------------------------------------------ generators
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


def modsum(rng: random.Random, k_range: tuple[int, int], modulus: int) -> Instance:
    """k digits d_1 .. d_k (each below the modulus), then ` = (Σ d) mod modulus` (difficulty k)."""
    k = rng.randint(*k_range)
    ds = [rng.randrange(modulus) for _ in range(k)]
    return [(str(d), 0) for d in ds] + [("=", 0), (str(sum(ds) % modulus), k)]


def generator(spec: TaskSpec, split: str) -> Callable[[random.Random], Instance]:
    lo_hi = spec.sizes(split)
    if spec.task == "hops" and spec.layout == "sorted":
        return lambda rng: hops_sorted(rng, lo_hi, spec.chains, spec.distractors, spec.names)
    if spec.task == "hops":
        return lambda rng: hops(rng, lo_hi, spec.chains, spec.distractors)
    if spec.task == "addition":
        return lambda rng: addition(rng, lo_hi, spec.nines)
    return lambda rng: modsum(rng, lo_hi, spec.modulus)


def bucket(inst: Instance) -> int:
    """The instance's hash bucket 0..99 (over its symbols only): which split may hold it."""
    h = hashlib.blake2b(" ".join(s for s, _ in inst).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % 100


def instances(spec: TaskSpec, split: str, seed: int):
    """The split's instances, in order, forever: deterministic from (task, split, seed);
    an instance outside the split's hash buckets is drawn again."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
    rng = random.Random(f"recdepth-task/{spec.task}/{split}/{seed}")
    make, keep = generator(spec, split), BUCKETS[split]
    misses = 0
    while True:
        inst = make(rng)
        if bucket(inst) in keep:
            misses = 0
            yield inst
        else:
            misses += 1
            if misses > MAX_REDRAWS:  # ~10% of instances qualify: this many misses means none does
                key = "extrapolation" if split == "extrapolation" else "size"
                raise ValueError(f"data.{key}: the {split} split finds no instance at sizes {list(spec.sizes(split))} "
                                 f"({MAX_REDRAWS} draws in a row outside its hash buckets: too few distinct instances; "
                                 "widen the range)")


# ------------------------------------------------------------------ records
def symbol_ids(encode: Callable[[str], list[int]]) -> dict[str, int]:
    """Each symbol's GPT-2 id (" a", " 7", " =", ...; newline ends an instance), checked to be one token."""
    ids = {}
    for s in [*NAMES, *DIGITS, "=", "?", "+", "\n"]:
        t = encode(s if s == "\n" else " " + s)
        if len(t) != 1:
            raise AssertionError(f"task symbol {s!r} is {len(t)} GPT-2 tokens, expected 1")
        ids[s] = t[0]
    return ids


def records(spec: TaskSpec, split: str, seed: int, n_records: int, length: int, ids: dict[str, int],
            eot: int) -> tuple[np.ndarray, np.ndarray]:
    """n_records records of `length` tokens: EOT, then whole instances (each ending in a
    newline) packed greedily, the rest EOT. Returns GPT-2 ids and labels (uint8), both
    [n_records * length]. A record is one training/evaluation window's inputs: windows of
    block_size = length tokens at multiples of length see one record each, from its EOT."""
    # The sorted hops layout gives every name's statement a fixed place: one instance a record,
    # right after its EOT, keeps that place fixed in the window too.
    one_each = spec.task == "hops" and spec.layout == "sorted"
    tokens = np.full((n_records, length), eot, dtype=np.uint16)
    labels = np.zeros((n_records, length), dtype=np.uint8)
    it = instances(spec, split, seed)
    pending = None
    for r in range(n_records):
        pos = 1
        while True:
            inst = pending if pending is not None else next(it)
            pending = None
            n = len(inst) + 1
            if n > length - 1:
                raise ValueError(f"data.block_size: a {spec.task} instance of {n} tokens (size "
                                 f"{list(spec.sizes(split))}) does not fit a window of {length} tokens after its EOT")
            if pos + n > length or (one_each and pos > 1):
                pending = inst
                break
            for j, (s, lab) in enumerate(inst):
                tokens[r, pos + j] = ids[s]
                labels[r, pos + j] = min(lab, 255)
            tokens[r, pos + n - 1] = ids["\n"]
            pos += n
    return tokens.reshape(-1), labels.reshape(-1)


# ------------------------------------------------------------------ scoring
def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of x, ties sharing their mean rank (Spearman's convention)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return sums[inv] / counts[inv]


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks (NaN when
    either side is constant)."""
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


def score_answers(rec: dict, labels: np.ndarray, cost_per_token: np.ndarray, resamples: int = 1000,
                  seed: int = 0) -> dict:
    """The `answers` block of an evaluation on a task (docs/spec.md §6): over the scored
    tokens that are answers (labels > 0; `labels` aligned with rec's targets), accuracy
    (argmax = target), NLL and layer applications per answer token, overall and per
    difficulty, each with a 95% bootstrap interval over windows (a window is one record of
    whole instances drawn independently), and Spearman's correlation of applications with
    difficulty (its interval from the same window resamples)."""
    answer = np.asarray(labels) > 0
    if not answer.any():
        raise ValueError("answers: no answer tokens among the scored tokens (eval.tokens too small?)")
    diff = np.asarray(labels)[answer]
    ok = np.asarray(rec["correct"], dtype=float)[answer]
    nll = np.asarray(rec["nll"], dtype=float)[answer]
    cost = np.asarray(cost_per_token, dtype=float)[answer]
    windows = np.asarray(rec["window"])[answer]
    boot = stats.Bootstrap(windows, resamples, seed)

    def ci(x):
        m, lo, hi = stats.mean_ci(x, boot)
        return [m, lo, hi]

    out = {"tokens": int(answer.sum()), "windows": boot.n_units, "accuracy": ci(ok), "nll": ci(nll),
           "layer_applications": ci(cost), "by_difficulty": {}}
    for d in np.unique(diff).tolist():
        sel = diff == d
        b = stats.Bootstrap(windows[sel], resamples, seed)
        out["by_difficulty"][str(int(d))] = {
            "tokens": int(sel.sum()), "accuracy": [*stats.mean_ci(ok[sel], b)],
            "nll": float(nll[sel].mean()), "layer_applications": float(cost[sel].mean())}
    rho = spearman(cost, diff)
    rs = []
    if np.isfinite(rho):
        rng_idx = stats.bootstrap_indices(boot.n_units, resamples, seed)
        members = [np.flatnonzero(boot.inverse == u) for u in range(boot.n_units)]
        for r in range(min(resamples, 200)):  # ranks per resample: 200 keep this to a second
            idx = np.concatenate([members[u] for u in rng_idx[r]])
            rs.append(spearman(cost[idx], diff[idx]))
    lo, hi = stats.interval(np.asarray(rs)) if rs else (float("nan"), float("nan"))
    out["spearman_applications_difficulty"] = [rho, lo, hi]
    return out
