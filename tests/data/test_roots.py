"""data=roots (recdepth/data/tasks/roots.py) and per-step targets through the token pipeline.

Every root, hop count and per-step target is checked by a solver written here from the
task's statement (it reads the decoded parent table and walks it), never by the generator's
own code; the per-step targets are followed from the generator through the cache, the
windows and the batches, decoded back to symbols and solved again. The built-in tasks
without per-step targets keep their records and their (x, y) batches."""

import hashlib
import pickle
import string

import numpy as np
import pytest
import torch

from recdepth.config.schema import data_config
from recdepth.data import tasks
from recdepth.data.datamodule import TokenDataModule
from recdepth.data.tokenizer import EOT_ID, gpt2
from tests.data.helpers import assert_splits_disjoint, symbols_of

LETTERS = string.ascii_lowercase + string.ascii_uppercase  # node i's name: the i-th letter
COUNTS = dict(train_records=64, test_records=32, validation_records=32, extrapolation_records=32)
SPLITS = ("train", "validation", "test", "extrapolation")
T = 64  # block_size: one roots instance (24 + 1 + 16 + 1 tokens) after its EOT


def roots_data(tmp_path, loss="answers", **task) -> dict:
    return {"source": "task", **COUNTS, "loss": loss, "cache_dir": str(tmp_path / "cache"),
            "task": {"name": "roots", **task}}


def data_module(tmp_path, block_size=T, batch_size=4, **kw) -> TokenDataModule:
    dm = TokenDataModule(data_config(roots_data(tmp_path, **kw)), block_size, batch_size, 6)
    dm.setup()
    return dm


# ------------------------------------------------------------------ the independent solver
def walk(table: list[str], q: str) -> list[str]:
    """The names 1, 2, ..., h hops up from q to its root in a parent table (entry i: the
    parent of the node named LETTERS[i]); [] when q is a root."""
    up, x = [], q
    while table[LETTERS.index(x)] != x:
        x = table[LETTERS.index(x)]
        up.append(x)
        assert len(up) <= len(table), "a cycle: not a forest"
    return up


def solve(symbols: list[str], nodes: int) -> list[tuple[int, str, list[str]]]:
    """One instance's symbols -> (index of the answer, its root, the path up) per query."""
    table, sep = symbols[:nodes], symbols[nodes]
    assert sep == "?" and len(symbols) % 2 == 1
    out = []
    for i in range(nodes + 1, len(symbols), 2):
        path = walk(table, symbols[i])
        out.append((i + 1, path[-1] if path else symbols[i], path))
    return out


def split_arrays(dm: TokenDataModule, split: str):
    """(tokens, labels, steps with -1 for none) of one split, model ids."""
    if split == "train":
        steps = np.asarray(dm.cache.train_steps, dtype=np.int64)
        return (np.asarray(dm.cache.train), np.asarray(dm.cache.train_labels),
                np.where(steps == tasks.NO_STEP, -1, steps))
    first, n = dm.region(split)
    return dm.heldout_tokens(n, first), dm.heldout_labels(n, first), dm.heldout_steps(n, first)


# ------------------------------------------------------------------ the task
def test_roots_is_registered_with_per_step_targets_and_the_others_have_none():
    assert "roots" in tasks.names() and tasks.lookup("roots") is tasks.Roots
    r = tasks.Roots()
    assert (r.size, r.extrapolation, r.nodes, r.queries) == ([0, 8], [9, 12], 24, 8)
    assert r.one_per_record() and r.has_step_targets() and r.step_width() == 12  # the deepest query's hops
    for name in ("hops", "addition", "modsum"):
        t = tasks.lookup(name)()
        assert t.step_width() == 0 and not t.has_step_targets()
        assert data_config({"source": "task", "task": {"name": name}}).step_width() == 0
    assert data_config({"source": "shakespeare"}).step_width() == 0
    assert data_config({"source": "task", "task": {"name": "roots"}}).step_width() == 12


@pytest.mark.parametrize("split", SPLITS)
def test_roots_records_agree_with_an_independent_solver(tmp_path, split):
    """Every record: EOT, then one instance (node i's parent at position i + 1, ` ?`, the
    queries ` q r`, a newline), the rest EOT; every answer the query's root, labelled with
    its hops + 1, its per-step targets the nodes 1..h hops up; no other token labelled or
    with a per-step target; hops within the split's range, every hop count of it present."""
    dm = data_module(tmp_path)
    toks, labs, steps = split_arrays(dm, split)
    N, S = 24, dm.step_width
    assert S == 12 and steps.shape == (len(toks), S)
    lo, hi = dm.data.task.sizes(split)
    v = dm.vocab
    syms = symbols_of(v, toks)
    seen_hops, answers = set(), 0
    for r in range(len(toks) // T):
        rec = syms[r * T : (r + 1) * T]
        end = rec.index("\n")
        assert rec[0] == "<eot>" and all(s == "<eot>" for s in rec[end + 1 :])  # one instance a record
        inst = rec[1:end]
        got = set(np.flatnonzero(labs[r * T : (r + 1) * T][1:end]).tolist())  # the answers' places in inst
        want = solve(inst, N)
        assert 1 <= len(want) <= 8 and got == {i for i, _, _ in want}
        assert len({inst[i - 1] for i, _, _ in want}) == len(want)  # distinct query nodes
        for i, root, path in want:
            p = r * T + 1 + i  # the answer's place in the stream
            assert inst[i] == root and labs[p] == len(path) + 1
            assert lo <= len(path) <= hi
            seen_hops.add(len(path))
            z = steps[p]
            assert symbols_of(v, z[: len(path)]) == path and (z[len(path) :] == -1).all()
            answers += 1
        others = np.ones(T, bool)
        others[[1 + i for i, _, _ in want]] = False
        assert (labs[r * T : (r + 1) * T][others] == 0).all() and (steps[r * T : (r + 1) * T][others] == -1).all()
    assert answers == int((labs > 0).sum()) and len(toks) % T in (0, 1)
    assert seen_hops == set(range(lo, hi + 1)), seen_hops
    if split == "extrapolation":  # deeper than any query of the training range
        assert min(seen_hops) > dm.data.task.size[1]


def test_the_layout_gives_nothing_away():
    """Which nodes chain to which is a fresh permutation each instance: parent(i) is no
    function of i (no node has one parent more than a fraction of the time, chains do not
    run i -> i + 1), and the roots sit anywhere."""
    task = tasks.Roots()
    it = tasks.instances(task, "train", 0)
    parents = np.array([[LETTERS.index(s[0]) for s in next(it)[:24]] for _ in range(400)])
    for i, col in enumerate(parents.T):  # node i's parent, when not itself: any other node alike
        counts = np.bincount(col[col != i], minlength=24)
        assert counts[i] == 0 and counts.max() < 0.1 * len(parents) and (counts > 0).sum() == 23
    assert (parents[:, :-1] == np.arange(1, 24)).mean() < 0.15
    is_root = parents == np.arange(24)
    assert is_root.any(axis=0).all() and is_root.mean(axis=0).max() < 0.5


def test_roots_generator_is_deterministic_and_its_splits_share_no_instance():
    spec = tasks.Roots(size=[0, 8], extrapolation=[9, 12])
    ids = tasks.symbol_ids(gpt2().encode_ordinary)
    a = tasks.records(spec, "train", 0, 20, T, ids, EOT_ID)
    b = tasks.records(spec, "train", 0, 20, T, ids, EOT_ID)
    c = tasks.records(spec, "train", 1, 20, T, ids, EOT_ID)
    assert len(a) == 3 and a[2].shape == (20 * T, 12) and a[2].dtype == np.uint16
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    # a small instance space (4 nodes, 0-1 hops, one query): without the hash split, train
    # would hold all of test
    assert_splits_disjoint(tasks.Roots(size=[0, 1], extrapolation=[2, 3], nodes=4, queries=1))


@pytest.mark.parametrize("task, field", [
    ({"nodes": 53}, "data.task.nodes"),
    ({"nodes": 0}, "data.task.nodes"),
    ({"nodes": 8}, "data.task.size"),  # 8 hops need 9 nodes
    ({"nodes": 12}, "data.task.extrapolation"),  # 12 hops need 13
    ({"queries": 0}, "data.task.queries"),
    ({"queries": 25}, "data.task.queries"),
    ({"size": [-1, 3]}, "data.task.size"),
    ({"size": [3, 2]}, "data.task.size"),
    ({"extrapolation": [5, 9]}, "data.task.extrapolation"),  # not above size = [0, 8]
    ({"extrapolation": [8, 10]}, "data.task.extrapolation"),
    ({"chains": 2}, "data.task.chains"),  # another task's option
])
def test_bad_roots_config_is_one_line_naming_the_field(task, field):
    with pytest.raises(ValueError, match="^" + field.replace(".", r"\.") + ": ") as e:
        data_config({"source": "task", "task": {"name": "roots", **task}})
    assert "\n" not in str(e.value)


def test_hops_start_at_zero_for_roots_only():
    tasks.Roots(size=[0, 0], extrapolation=[1, 2], nodes=3, queries=1)
    with pytest.raises(ValueError, match=r"^data\.task\.size: expected \[lo, hi\] with 1 <= lo"):
        data_config({"source": "task", "task": {"name": "modsum", "size": [0, 3]}})


# ------------------------------------------------------------------ through cache, windows and batches
def check_batch(dm: TokenDataModule, batch, answers_only: bool = True) -> int:
    """Decode each row of a batch (x, y, z) back to symbols, solve its instance again, and
    check y and z at every position against the solution: returns the answers seen."""
    x, y, z = batch
    B, Tx = x.shape
    assert y.shape == (B, Tx) and z.shape == (B, Tx, dm.step_width) and z.dtype == torch.int64
    assert ((z == -1) | (z >= 0)).all() and (z[y < 0] == -1).all()  # where y is -1, z is too
    seen = 0
    for b in range(B):
        syms = symbols_of(dm.vocab, x[b])
        end = syms.index("\n")
        inst = syms[1:end]
        want = {1 + i: (root, path) for i, root, path in solve(inst, 24)}  # the answer's place in the window
        for p in range(Tx):
            answer = want.get(p + 1)  # the prediction at p targets token p + 1
            if answer is None:
                assert (z[b, p] == -1).all()
                if answers_only:
                    assert y[b, p] == -1
                continue
            root, path = answer
            assert symbols_of(dm.vocab, [y[b, p]]) == [root]
            assert symbols_of(dm.vocab, z[b, p, : len(path)]) == path and (z[b, p, len(path) :] == -1).all()
            seen += 1
    return seen


def test_per_step_targets_stay_aligned_through_cache_windows_and_batches(tmp_path):
    dm = data_module(tmp_path)
    assert dm.has_step_targets and dm.step_width == dm.cache.step_width == 12
    assert dm.cache.meta["step_width"] == 12
    assert (dm.cache.path / "train.steps.bin").stat().st_size == 2 * 12 * len(dm.cache.train)
    seen = 0
    for k in range(3):
        seen += check_batch(dm, dm.train_dataset()[k])
    for batch in dm.val_dataloader():  # training's validation: the validation region's records
        assert len(batch) == 3
        seen += check_batch(dm, batch)
    assert seen > 0
    # the resumable loader, a DataLoader worker's pickled copy: the same batches
    loader = list(dm.train_dataloader(start_step=1))
    assert all(torch.equal(a, b) for a, b in zip(loader[0], dm.train_dataset()[1], strict=True))
    ds = pickle.loads(pickle.dumps(dm.train_dataset()))
    assert all(torch.equal(a, b) for a, b in zip(ds[2], dm.train_dataset()[2], strict=True))
    # data.loss=all keeps every target; z is still set at the answers only
    dm_all = data_module(tmp_path, loss="all")
    x, y, z = dm_all.train_dataset()[0]
    assert (y >= 0).all() and check_batch(dm_all, (x, y, z), answers_only=False) > 0
    # the held-out accessor: the targets of the tokens, shifted as the labels are
    first, n = dm.region("test")
    hs, hl = dm.heldout_steps(n, first), dm.heldout_labels(n, first)
    assert hs.shape == (n, 12) and np.array_equal((hs >= 0).any(axis=1), hl > 1)  # a root queried (label 1): none


def test_a_damaged_steps_file_is_rebuilt_not_trusted(tmp_path):
    dm = data_module(tmp_path)
    f = dm.cache.path / "val.steps.bin"
    want = f.read_bytes()
    with open(f, "r+b") as fh:
        fh.truncate(len(want) - 2)
    again = data_module(tmp_path)
    assert again.cache.built and again.cache.path == dm.cache.path and f.read_bytes() == want


def test_a_task_stating_too_many_steps_is_refused():
    spec = tasks.Roots(size=[4, 8])
    spec.step_width = lambda: 3  # fewer than its 4-8 hop queries state
    with pytest.raises(ValueError, match=r"^data\.task: a roots token states \d+ per-step targets, more than"):
        tasks.records(spec, "train", 0, 4, T, tasks.symbol_ids(gpt2().encode_ordinary), EOT_ID)


# ------------------------------------------------------------------ the other tasks unchanged
# sha256 (first 16 hex digits) of 16 records of 128 tokens and their labels per split, seed 0,
# as the generators wrote them before per-step targets existed: a change here changes every
# cache of the task (bump tasks.TASK_VERSION and update these with it).
DIGESTS = {"hops": "451be57e924b70a1", "hops-sorted": "a5ece9b3ccd42a2c", "addition": "ce1ebd6921102e79",
           "modsum": "1fccdf71da166100"}
SPECS = {"hops": dict(size=(1, 4), extrapolation=(5, 6)),
         "hops-sorted": dict(size=(1, 4), extrapolation=(5, 6), layout="sorted", names=12, chains=3, distractors=1),
         "addition": dict(size=(1, 4), extrapolation=(5, 6)), "modsum": dict(size=(1, 6), extrapolation=(7, 9))}


@pytest.mark.parametrize("name", list(SPECS))
def test_the_other_tasks_write_what_they_wrote_and_batch_as_x_y(name, tmp_path):
    spec = tasks.lookup(name.split("-")[0])(**SPECS[name])
    ids = tasks.symbol_ids(gpt2().encode_ordinary)
    h = hashlib.sha256()
    for split in tasks.SPLITS:
        out = tasks.records(spec, split, 0, 16, 128, ids, EOT_ID)
        assert len(out) == 2  # tokens, labels: no per-step targets
        h.update(out[0].tobytes())
        # the labels as the one byte each they were when these digests were taken (TASK_VERSION
        # 4 stores two): the values are what the digest checks, and every one here is < 256
        assert out[1].dtype == tasks.LABEL_DTYPE and int(out[1].max()) < 256
        h.update(out[1].astype(np.uint8).tobytes())
    assert h.hexdigest()[:16] == DIGESTS[name]
    if name != "modsum":
        return
    dm = TokenDataModule(data_config({"source": "task", **COUNTS, "cache_dir": str(tmp_path),
                                      "task": {"name": "modsum", "size": [1, 6], "extrapolation": [7, 9]}}), 128, 4, 4)
    dm.setup()
    assert dm.step_width == dm.cache.step_width == 0 and not dm.has_step_targets
    assert dm.cache.train_steps is None and not list(dm.cache.path.glob("*.steps.bin"))
    assert dm.heldout_steps(8) is None
    assert len(dm.train_dataset()[0]) == 2 and all(len(b) == 2 for b in dm.val_dataloader())


# ------------------------------------------------------------------ the config
def test_data_roots_composes_and_validates(tmp_path):
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.config.schema import validated

    over = ["data=roots", "debug=tiny", "run_dir=/tmp/unused"]
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        run = validated(compose("config", overrides=[*over, "data.task.nodes=20", "data.task.queries=4"]))
        bad = compose("config", overrides=[*over, "data.task.nodes=60"])
    assert run.data.source == "task" and type(run.data.task) is tasks.Roots
    assert (run.data.task.nodes, run.data.task.queries, run.data.step_width()) == (20, 4, 12)
    with pytest.raises(ValueError, match=r"^data\.task\.nodes: expected an integer in 1\.\.52") as e:
        validated(bad)
    assert "\n" not in str(e.value)
    # the stored config (a checkpoint's data_config) reads back as the task
    from dataclasses import asdict

    assert data_config(asdict(run.data)) == run.data
