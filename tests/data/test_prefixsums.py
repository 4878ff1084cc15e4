"""data=prefixsums (recdepth/data/tasks/prefixsums.py): DeepThinking's prefix sums with the
running parity scored in place. Every parity and difficulty is checked by a solver written
here from the task's statement (the bits read back from the decoded tokens, the parity of
each prefix counted as the number of ones modulo 2), never by the generator's own code, on
every split, through the token cache and the data module."""

import numpy as np
import pytest

from recdepth.config.schema import data_config
from recdepth.data import tasks
from recdepth.data.datamodule import TokenDataModule
from recdepth.data.tasks.prefixsums import prefix_sums
from recdepth.data.tokenizer import EOT_ID, gpt2
from tests.data.helpers import assert_splits_disjoint, in_place_expected, in_place_split, symbols_of

COUNTS = dict(train_records=40, test_records=16, validation_records=16, extrapolation_records=16)
SPLITS = ("train", "validation", "test", "extrapolation")
BIT = {"a": 0, "b": 1}  # the task's statement: ` a` is a 0, ` b` a 1


def data_module(tmp_path) -> TokenDataModule:
    data = {"source": "task", **COUNTS, "loss": "answers", "cache_dir": str(tmp_path / "cache"),
            "task": {"name": "prefixsums", "size": [4, 20], "extrapolation": [21, 30]}}
    dm = TokenDataModule(data_config(data), 64, 4, 6)
    dm.setup()
    return dm


def solve(run: list[str]) -> list[tuple[int, int]]:
    """(parity of the prefix ending at bit k, its length k + 1) for every bit of a run."""
    bits = [BIT[s] for s in run]
    return [(sum(bits[: k + 1]) % 2, k + 1) for k in range(len(bits))]


def expected(syms: list[str]):
    """Each position's in-place target, its label and each instance's bit count, from the symbols alone."""
    return in_place_expected(syms, BIT, solve)


def test_prefixsums_is_one_file_registered_by_its_folder():
    t = tasks.lookup("prefixsums")()
    assert t.name == "prefixsums" and (t.size, t.extrapolation) == ([8, 32], [33, 48])
    assert t.in_place() and not t.one_per_record() and t.has_step_targets() and t.step_width() == 46


@pytest.mark.parametrize("split", SPLITS)
def test_prefixsums_records_agree_with_an_independent_running_parity(tmp_path, split):
    dm = data_module(tmp_path)
    toks, labs, scored = in_place_split(dm, split)
    syms, scored_syms = symbols_of(dm.vocab, toks), symbols_of(dm.vocab, scored)
    want, want_labels, sizes = expected(syms)
    for p, w in enumerate(want):
        assert scored_syms[p] == (syms[p] if w is None else w), p
    assert labs.tolist() == want_labels
    lo, hi = dm.data.task.sizes(split)
    assert lo <= min(sizes) and max(sizes) <= hi and len(set(sizes)) > 1
    assert int((labs > 0).sum()) == sum(sizes) and set(scored_syms) - set(syms) <= {"0", "1"}
    ones = [s for s in syms if s in BIT]
    assert 0.4 < ones.count("b") / len(ones) < 0.6  # uniform bits


@pytest.mark.parametrize("split", ["train", "test"])
def test_prefixsums_per_step_targets_are_the_window_parities(tmp_path, split):
    """After application t the prediction at bit k targets the parity of its last t + 1 bits
    (t = 1 .. k - 1; from t = k on the final p_k): counted here right to left from the
    decoded bits, one bit added per application; every other slot is empty."""
    dm = data_module(tmp_path)
    toks, _, _ = in_place_split(dm, split)
    if split == "train":
        steps = np.asarray(dm.cache.train_steps, dtype=np.int64)
        steps = np.where(steps == tasks.NO_STEP, -1, steps)
    else:
        steps = dm.heldout_steps(*reversed(dm.region(split)))
    syms = symbols_of(dm.vocab, toks)
    assert steps.shape == (len(toks), 28)  # step_width: the largest size (30) - 2
    want: dict[tuple[int, int], str] = {}
    i = 0
    while i < len(syms):
        if syms[i] in BIT:
            j = i
            while syms[j] in BIT:
                j += 1
            bits = [BIT[x] for x in syms[i:j]]
            for k in range(len(bits)):
                acc = bits[k]
                for t in range(1, k):  # add bit k - t
                    acc ^= bits[k - t]
                    want[(i + k + 1, t - 1)] = str(acc)
            i = j
        else:
            i += 1
    set_ = list(zip(*np.nonzero(steps >= 0), strict=True))
    assert sorted((int(p), int(t)) for p, t in set_) == sorted(want) and len(want) > 100
    got = symbols_of(dm.vocab, [steps[p, t] for p, t in sorted(want)])
    assert got == [want[k] for k in sorted(want)]


def test_prefixsums_splits_share_no_instance():
    assert_splits_disjoint(tasks.lookup("prefixsums")(size=[3, 6], extrapolation=[7, 8]))


def test_difficulties_above_one_byte_are_stored_as_they_are(tmp_path):
    """A 300-bit instance's bit k has difficulty k + 1 up to 300: the cache and the data module
    hand back every one (one-byte labels stopped at 255, merging d = 255 .. 300), counted
    here from the decoded bits."""
    data = {"source": "task", "train_records": 4, "test_records": 1, "validation_records": 1,
            "extrapolation_records": 2, "loss": "answers", "cache_dir": str(tmp_path / "cache"),
            "task": {"name": "prefixsums", "size": [4, 20], "extrapolation": [290, 300]}}
    dm = TokenDataModule(data_config(data), 320, 1, 1)
    dm.setup()
    toks, labs, _ = in_place_split(dm, "extrapolation")
    _, want_labels, sizes = expected(symbols_of(dm.vocab, toks))
    assert labs.tolist() == want_labels and min(sizes) >= 290
    assert int(labs.max()) == max(sizes) > 255 and int((labs > 255).sum()) == sum(s - 255 for s in sizes)
    spec = tasks.lookup("prefixsums")(size=[4, 8])  # a generator writing a label past two bytes
    spec.generate = lambda rng, sizes: [(s, lab and 70000, st, sc) for s, lab, st, sc in prefix_sums(rng, sizes)]
    with pytest.raises(ValueError, match=r"^data\.task: a prefixsums token's label is 70000, expected 0 \(no answer\) "
                                         r"or a difficulty 1 \.\. 65535$"):
        tasks.records(spec, "train", 0, 1, 16, tasks.symbol_ids(gpt2().encode_ordinary), EOT_ID)
