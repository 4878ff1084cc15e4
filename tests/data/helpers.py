"""Helpers the generated tasks' tests share (tests/data/test_roots.py, test_carry.py)."""

import numpy as np

from recdepth.data import tasks
from recdepth.data.tokenizer import EOT_ID, gpt2
from recdepth.data.vocabulary import Vocab


def symbols_of(vocab: Vocab, ids) -> list[str]:
    """Model ids -> their text, stripped (EOT as "<eot>", newline as "\\n")."""
    enc = gpt2()
    return ["<eot>" if t == EOT_ID else ("\n" if enc.decode([t]) == "\n" else enc.decode([t]).strip())
            for t in vocab.to_gpt2(np.asarray(ids)).tolist()]


def assert_splits_disjoint(small: tasks.Task) -> None:
    """Draws of a task with a small instance space share no instance between any two splits
    (the hash split), and the test split is not empty."""
    def take(split, n):
        it = tasks.instances(small, split, 0)
        return {" ".join(tok[0] for tok in next(it)) for _ in range(n)}

    train, val, test, extra = take("train", 3000), take("validation", 300), take("test", 300), take("extrapolation", 300)
    assert not (train & test) and not (train & val) and not (val & test)
    assert not (extra & (train | val | test))
    assert len(test) >= 3


def in_place_split(dm, split: str):
    """(tokens, labels, scored stream) of one split of a task with in-place targets, model ids."""
    if split == "train":
        return np.asarray(dm.cache.train), np.asarray(dm.cache.train_labels), np.asarray(dm.cache.train_targets)
    first, n = dm.region(split)
    return dm.heldout_tokens(n, first), dm.heldout_labels(n, first), dm.heldout_targets(n, first)


def in_place_expected(syms: list[str], inputs, solve):
    """From a stream's symbols alone, for a task whose instances are runs of `inputs` symbols
    then ` =` and a newline, each answer scored in place at the token after its input: each
    position's expected scored symbol (None where the target is the token itself), its label,
    and each instance's size. `solve(run)` gives (answer, difficulty) for every input of a run
    (the test's own solver of the task's statement)."""
    want: list[str | None] = [None] * len(syms)
    labels, sizes, i = [0] * len(syms), [], 0
    while i < len(syms):
        if syms[i] in inputs:
            assert syms[i - 1] in ("<eot>", "\n"), "an instance starts after EOT or a newline (nothing arrives)"
            j = i
            while syms[j] in inputs:
                j += 1
            assert syms[j] == "=" and syms[j + 1] == "\n"
            for k, (answer, d) in enumerate(solve(syms[i:j])):
                want[i + k + 1], labels[i + k + 1] = str(answer), d  # the token after input k carries answer k
            sizes.append(j - i)
            i = j + 2
        else:
            assert syms[i] in ("<eot>", "\n"), syms[i]
            i += 1
    return want, labels, sizes
