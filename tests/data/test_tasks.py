"""data=<task>: generated algorithmic tasks (recdepth/data/tasks/, docs/spec.md §6).

Each task's answers are checked by a solver written here from the task's statement (it
parses the decoded text), never by the generator's own arithmetic; the labels are followed
from the generator through the cache, the training windows and eval_tokens.csv."""

import copy
import csv
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from recdepth.analysis import stats
from recdepth.config.schema import data_config
from recdepth.data import tasks
from recdepth.data.datamodule import TokenDataModule
from recdepth.data.tasks import task as task_module
from recdepth.data.tokenizer import EOT_ID, gpt2
from recdepth.data.vocabulary import Vocab
from tests.helpers import run

COUNTS = dict(train_records=300, test_records=8, validation_records=8, extrapolation_records=8)
BUILTIN = ("hops", "addition", "modsum")  # the shipped tasks (a test may register more)
DATA_KEYS = ("loss", "val_tokens", "instance_seed", *COUNTS)  # data.*; every other option is data.task.*


def small(task: str, **kw) -> dict:
    size = {"hops": ([1, 4], [5, 6]), "addition": ([1, 4], [5, 6]), "modsum": ([1, 6], [7, 9])}[task]
    return dict(name=task, size=size[0], extrapolation=size[1], **kw)


def task_data(tmp_path, task: str, **kw) -> dict:
    """The plain data config of `task` at test sizes: data.* keys of `kw` beside, the task's options under data.task."""
    top = {k: v for k, v in kw.items() if k in DATA_KEYS}
    opts = {k: v for k, v in kw.items() if k not in DATA_KEYS}
    return {"source": "task", **COUNTS, "loss": "answers", "cache_dir": str(tmp_path / "cache"), **top,
            "task": small(task, **opts)}


def data_module(tmp_path, task, block_size=128, **kw) -> TokenDataModule:
    dm = TokenDataModule(data_config(task_data(tmp_path, task, **kw)), block_size, 4, 10)
    dm.setup()
    return dm


def spec_of(name: str, **kw) -> tasks.Task:
    """A task's config object (the old TaskSpec), sizes as tuples or lists."""
    return tasks.lookup(name)(**kw)


# ------------------------------------------------------------------ independent solvers
def carry_in_determined(a: list[int], b: list[int], lo: int, hi: int) -> bool:
    """Is the carry out of columns lo..hi-1 (0 = units) the same for carry-in 0 and 1?"""
    outs = set()
    for cin in (0, 1):
        c = cin
        for j in range(lo, hi):
            c = (a[j] + b[j] + c) // 10
        outs.add(c)
    return len(outs) == 1


def solve(task: str, text: str, modulus: int = 10) -> list[tuple[str, int]]:
    """(answer, difficulty) of each answer token of one instance's text, in order."""
    s = text.split()
    if task == "hops":
        q = s.index("?")
        assign = {s[i]: s[i + 2] for i in range(0, q, 3)}
        assert all(s[i + 1] == "=" for i in range(0, q, 3))
        out = []
        for i in range(q, len(s), 3):
            x, k = s[i + 1], 0
            while not x.isdigit():
                x, k = assign[x], k + 1
            out.append((x, k))
        return out
    if task == "addition":
        plus, eq = s.index("+"), s.index("=")
        a = [int(c) for c in s[:plus]][::-1]  # units first
        b = [int(c) for c in s[plus + 1 : eq]][::-1]
        n = len(a)
        total = str(int("".join(s[:plus])) + int("".join(s[plus + 1 : eq]))).zfill(n + 1)
        out = []
        for col in range(n, -1, -1):  # most significant first, as written
            # the fewest lower columns that fix the carry into `col`, whatever lies below them
            m = next(m for m in range(col + 1) if m == col or carry_in_determined(a, b, col - m, col))
            out.append((total[n - col], 1 + m))
        return out
    eq = s.index("=")
    return [(str(sum(int(c) for c in s[:eq]) % modulus), eq)]


def instances_of(dm: TokenDataModule, tokens: np.ndarray, labels: np.ndarray):
    """Split a record stream into instances (newline-terminated): (text, [(answer, label)])."""
    v = Vocab(dm.cache.id_map, dm.cache.n_other)
    gpt = v.to_gpt2(tokens)
    enc = gpt2()
    cur, ans = [], []
    for t, lab in zip(gpt.tolist(), labels.tolist(), strict=True):
        if t == EOT_ID:
            continue
        s = enc.decode([t])
        if s == "\n":
            yield "".join(cur), ans
            cur, ans = [], []
            continue
        cur.append(s)
        if lab:
            ans.append((s.strip(), lab))


# hops in the sorted layout: 12 names hold one queried chain and one distractor of up to 6
SORTED = dict(layout="sorted", names=12, chains=3, distractors=1)
VARIANTS = [(t, {}) for t in BUILTIN] + [("hops", SORTED)]


def test_the_builtin_tasks_are_registered():
    assert set(BUILTIN) <= set(tasks.names())


@pytest.mark.parametrize("task, kw", VARIANTS, ids=[*BUILTIN, "hops-sorted"])
@pytest.mark.parametrize("split", ["train", "test", "validation", "extrapolation"])
def test_answers_and_difficulties_agree_with_an_independent_solver(tmp_path, task, kw, split):
    dm = data_module(tmp_path, task, **kw)
    if split == "train":
        toks, labs = np.asarray(dm.cache.train), np.asarray(dm.cache.train_labels)
    else:
        first, n = dm.region(split)
        toks, labs = dm.heldout_tokens(n, first), dm.heldout_labels(n, first)
    seen = 0
    for text, ans in instances_of(dm, toks, labs):
        assert ans == solve(task, text), text
        seen += len(ans)
    assert seen == int((labs > 0).sum()) >= 8  # 8 records, each with at least one instance and answer
    lo, hi = (dm.data.task.extrapolation if split == "extrapolation" else dm.data.task.size)
    sizes = {d for _, d in (a for text, ans in instances_of(dm, toks, labs) for a in ans)}
    if task != "addition":  # hops and modsum: difficulty = the instance's size
        assert sizes <= set(range(lo, hi + 1)) and len(sizes) > 1


@pytest.mark.parametrize("task, kw", [("hops", {"chains": 2}), ("addition", {}), ("modsum", {})]
                         + [("hops", dict(SORTED, names=6))], ids=[*BUILTIN, "hops-sorted"])
def test_generators_are_deterministic_and_splits_share_no_instance(task, kw):
    spec = spec_of(task, size=(1, 2), extrapolation=(3, 3), **kw)
    ids = tasks.symbol_ids(gpt2().encode_ordinary)
    a = tasks.records(spec, "train", 0, 50, 64, ids, EOT_ID)
    b = tasks.records(spec, "train", 0, 50, 64, ids, EOT_ID)
    c = tasks.records(spec, "train", 1, 50, 64, ids, EOT_ID)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])

    def take(split, n):
        it = tasks.instances(spec, split, 0)
        return {" ".join(s for s, _ in next(it)) for _ in range(n)}

    # a small instance space (sizes 1-2): without the hash split, train would hold all of test
    train, val, test = take("train", 3000), take("validation", 300), take("test", 300)
    assert not (train & test) and not (train & val) and not (val & test)
    assert len(test) >= 5  # modsum at sizes 1-2 has 110 instances, ~10% of them test's


@pytest.mark.parametrize("split", ["train", "extrapolation"])
def test_sorted_hops_layout(tmp_path, split):
    """Every record holds one instance right after its EOT: the `names` first names, each
    assigned once, in alphabetical order (so a name's statement has a fixed place), then
    queries of chain heads, leaving at least `distractors` chains unqueried."""
    dm = data_module(tmp_path, "hops", block_size=64, **SORTED)
    T, names = dm.block_size, tasks.NAMES[:SORTED["names"]]
    if split == "train":
        toks, labs = np.asarray(dm.cache.train), np.asarray(dm.cache.train_labels)
    else:
        first, n = dm.region(split)
        toks, labs = dm.heldout_tokens(n, first), dm.heldout_labels(n, first)
    eot = dm.vocab.from_gpt2(np.array([EOT_ID]))[0]
    records = [toks[i : i + T] for i in range(0, len(toks) - T + 1, T)]
    assert len(records) >= 8 and all(r[0] == eot and r[1] != eot for r in records)
    found = list(instances_of(dm, toks, labs))
    assert len(found) == len(records)  # one instance a record
    for text, ans in found:
        s = text.split()
        q = s.index("?")
        assert s[0:q:3] == names  # each name once, in order, at a fixed place
        targets = s[2:q:3]
        heads = [x for x in names if x not in targets]  # a chain per head
        queried = s[q + 1 :: 3]
        assert set(queried) <= set(heads) and len(queried) == len(ans) >= 1
        assert len(heads) - len(queried) >= SORTED["distractors"]


def test_labels_stay_aligned_through_cache_and_training_windows(tmp_path):
    dm = data_module(tmp_path, "addition")
    T = dm.block_size
    # every training window is one whole record: it starts with EOT, at a multiple of T
    assert (dm.train_offsets % T == 0).all() and (np.asarray(dm.cache.train)[dm.train_offsets] ==
                                                   dm.vocab.from_gpt2(np.array([EOT_ID]))[0]).all()
    x, y = dm.train_dataset()[0]
    starts = dm.train_offsets[: len(x)]
    lab = np.asarray(dm.cache.train_labels)
    for r, s in enumerate(starts):
        want = np.asarray(dm.cache.train[s + 1 : s + T + 1], dtype=np.int64)
        answer = lab[s + 1 : s + T + 1] > 0
        # answers-only loss: the answers are the targets, every other target is -1
        assert np.array_equal(y[r].numpy(), np.where(answer, want, -1))
    # loss=all keeps every target
    dm_all = data_module(tmp_path, "addition", loss="all")
    assert (dm_all.train_dataset()[0][1] >= 0).all()
    # training's validation reads the validation region, not the test split
    first, _ = dm.region("validation")
    assert dm.val_offsets[0] == first and (np.diff(dm.val_offsets) == T).all()


def test_answer_scoring_against_a_hand_computed_example():
    # two windows; labels: 0 = not an answer; difficulties 1 and 2
    rec = {"window": np.array([0, 0, 0, 1, 1, 1]), "correct": np.array([1, 0, 1, 0, 1, 1], bool),
           "nll": np.array([0.1, 2.0, 0.3, 1.5, 0.2, 9.0])}
    labels = np.array([1, 2, 0, 2, 1, 0])
    cost = np.array([4.0, 8.0, 6.0, 12.0, 4.0, 1.0])
    a = tasks.score_answers(rec, labels, cost, resamples=200)
    # answers: tokens 0, 1, 3, 4: correct 1, 0, 0, 1
    assert a["tokens"] == 4 and a["accuracy"][0] == pytest.approx(0.5)
    assert a["nll"][0] == pytest.approx((0.1 + 2.0 + 1.5 + 0.2) / 4)
    assert a["layer_applications"][0] == pytest.approx((4 + 8 + 12 + 4) / 4)
    d1, d2 = a["by_difficulty"]["1"], a["by_difficulty"]["2"]
    assert (d1["tokens"], d1["accuracy"][0], d1["layer_applications"]) == (2, 1.0, 4.0)
    assert (d2["tokens"], d2["accuracy"][0], d2["layer_applications"]) == (2, 0.0, 10.0)
    # costs 4, 8, 12, 4 vs difficulties 1, 2, 2, 1: average ranks (1.5, 3, 4, 1.5) and
    # (1.5, 3.5, 3.5, 1.5), centred (-1, .5, 1.5, -1) and (-1, 1, 1, -1): 4 / sqrt(4.5 * 4)
    assert a["spearman_applications_difficulty"][0] == pytest.approx(4 / np.sqrt(18))


def test_spearman_matches_pearson_of_ranks_by_hand():
    x, y = np.array([1.0, 2.0, 2.0, 5.0]), np.array([3.0, 1.0, 4.0, 2.0])
    # average ranks: x -> 1, 2.5, 2.5, 4; y -> 3, 1, 4, 2
    rx, ry = np.array([1, 2.5, 2.5, 4]), np.array([3, 1, 4, 2.0])
    assert np.array_equal(tasks.average_ranks(x), rx)
    assert tasks.spearman(x, y) == pytest.approx(np.corrcoef(rx, ry)[0, 1])


@pytest.mark.parametrize("kw, field", [
    ({"task": {"name": "sorting"}}, "data.task.name"),
    ({"task": {"size": [3, 2]}}, "data.task.size"),
    ({"task": {"size": [0, 2]}}, "data.task.size"),
    ({"task": {"extrapolation": [2, 6]}}, "data.task.extrapolation"),
    ({"task": {"chains": 2, "distractors": 5, "extrapolation": [5, 8]}}, "data.task.chains"),
    ({"train_records": 0}, "data.train_records"),
    ({"task": {"layout": "random"}}, "data.task.layout"),
    ({"task": {"layout": "sorted", "names": 15, "distractors": 1, "extrapolation": [5, 8]}}, "data.task.names"),
    ({"task": {"layout": "sorted", "names": 60}}, "data.task.names"),
    ({"task": {"name": "modsum", "modulus": 11}}, "data.task.modulus"),
    ({"task": {"name": "addition", "nines": 1.0}}, "data.task.nines"),
    ({"task": {"name": "modsum", "chains": 2}}, "data.task.chains"),  # another task's option
])
def test_bad_task_config_is_one_line_naming_the_field(kw, field):
    with pytest.raises(ValueError, match="^" + field.replace(".", r"\.") + ": ") as e:
        data_config({"source": "task", **kw})
    assert "\n" not in str(e.value)


def test_answer_scoring_needs_labels():
    """Only a task's data has answer labels: data.loss is a key of data=<task> alone, refused
    for a text source in one line naming it."""
    with pytest.raises(ValueError, match=r"^data\.loss: no such key in data") as e:
        data_config({"source": "shakespeare", "loss": "answers"})
    assert "\n" not in str(e.value)
    from recdepth.decode.scoring import score_task
    from recdepth.decode.settings import DecodeSettings
    with pytest.raises(ValueError, match=r"eval\.answers: true"):
        score_task(None, None, {}, {}, None, DecodeSettings(answers=True))


def test_eval_ranges_stay_inside_a_task_split(tmp_path):
    dm = data_module(tmp_path, "modsum")
    _, n = dm.region("test")
    dm.heldout_tokens(n + 1)  # the test split and the EOT after it
    with pytest.raises(ValueError, match="run past the task's test split"):
        dm.heldout_tokens(n + 2)


def test_instance_too_long_for_the_window_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"data\.block_size: a hops instance of \d+ tokens"):
        data_module(tmp_path, "hops", block_size=16)


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_debug_task_through_train_evaluate_and_frontier(tmp_path, env, ckpt_env, cli_here):
    """A debug-size task through the real CLI: train (answers-only loss), its evaluation,
    recdepth.evaluate on the checkpoint and the frontier sweep, all scoring answer tokens."""
    rd = tmp_path / "job"
    args = ["debug=tiny", "data=task", "data.task.chains=1", "data.task.distractors=1", *[f"data.{k}={v}" for k, v in COUNTS.items()],
            "eval.tokens=512", "eval.latency_tokens=4", "callbacks=none", f"run_dir={rd}"]
    run(args, cwd=tmp_path, env=env)
    m = json.loads((rd / "metrics.json").read_text())
    ev = m["eval"]
    rows = list(csv.DictReader(open(rd / "eval_tokens.csv")))
    assert ev["scored"] == "answers" and ev["tokens"] == len(rows) == ev["answers"]["tokens"] > 0
    assert all(r["answer"] == "1" and int(r["difficulty"]) >= 1 for r in rows)
    acc = np.mean([int(r["correct"]) for r in rows])
    assert ev["answers"]["accuracy"][0] == pytest.approx(acc)
    assert ev["ce"] == pytest.approx(np.mean([float(r["nll"]) for r in rows]))
    # the labels in the csv are the cache's, at each target position (position + 1)
    ckpt = rd / "train" / "checkpoints" / "last.ckpt"
    from recdepth.app.checkpoints import checkpoint_data, load_checkpoint

    module, data = load_checkpoint(ckpt, torch.device("cpu"))
    labels = checkpoint_data(module, data, 0).heldout_labels(513)
    assert [int(r["difficulty"]) for r in rows] == [int(labels[int(r["position"]) + 1]) for r in rows]
    assert int((labels[1:] > 0).sum()) == len(rows)
    sweep = tmp_path / "frontier"
    q = subprocess.run(
        [sys.executable, "-m", "recdepth.evaluate", "--multirun", "hydra/sweeper=frontier", f"ckpt={ckpt}",
         f"hydra.sweep.dir={sweep}", "eval.tokens=512", "eval.latency_tokens=2", "eval.repeats=1",
         "eval.warmup_tokens=1", "hydra.sweeper.fixed=[1,2]", "hydra.sweeper.rules.accel=[0.5]",
         "hydra.sweeper.rules.stepnorm=[]", "hydra.sweeper.rules.kl=[]", "hydra.sweeper.oracle=[0.01]",
         "hydra.sweeper.warm_start=false", "exit.max_steps=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-3000:]
    jobs = list(csv.DictReader(open(sweep / "sweep_results.csv")))
    assert all(r["status"] == "ok" for r in jobs) and len(jobs) == 4
    for r in jobs:
        t = list(csv.DictReader(open(sweep / r["job"] / "eval_tokens.csv")))
        assert len(t) == len(rows) and [x["position"] for x in t] == [x["position"] for x in rows]
    assert (sweep / "frontier.csv").is_file()
    # accuracy as the quality axis: each row's "ce" is its error rate on the answers
    acc = list(csv.DictReader(open(sweep / "frontier_accuracy.csv")))
    assert [r["exit"] for r in acc] == ["accel", "oracle"]
    for r in acc:
        t = list(csv.DictReader(open(sweep / r["job"] / "eval_tokens.csv")))
        assert float(r["ce"]) == pytest.approx(1 - np.mean([int(x["correct"]) for x in t]))
    assert "error [95% CI]" in (sweep / "frontier_accuracy.md").read_text()
    # by difficulty: each fixed job's accuracy at difficulty d is its csv's mean over those answers
    diff = {r["job"]: r for r in csv.DictReader(open(sweep / "difficulty.csv"))}
    for r in jobs:
        t = list(csv.DictReader(open(sweep / r["job"] / "eval_tokens.csv")))
        for d in {x["difficulty"] for x in t}:
            want = np.mean([int(x["correct"]) for x in t if x["difficulty"] == d])
            assert float(diff[r["job"]][f"accuracy_d{d}"]) == pytest.approx(want)
    assert "| fixed n |" in (sweep / "difficulty.md").read_text()
    # fig_difficulty.png is the figure task_tables draws from these jobs (drawn again here,
    # compared pixel for pixel), and it plots difficulty.csv: per difficulty d, a curve of the
    # fixed jobs' (layer applications, accuracy at d), and the other jobs as points
    from recdepth.analysis import task_tables
    from recdepth.analysis.frontier import collect
    from tests.drawn import curves, png_shows

    fig = task_tables.figure(task_tables.tables(task_tables.answers_of(sweep, collect(sweep)))[0])
    assert png_shows(fig, sweep / "fig_difficulty.png")
    ds = sorted(int(k[len("accuracy_d"):]) for k in next(iter(diff.values())) if k.startswith("accuracy_d"))
    drawn = curves(fig.axes[0])
    assert len(ds) >= 2 and set(drawn) == {f"difficulty {d} (fixed n)" for d in ds}
    fixed = sorted((r for r in diff.values() if r["exit"] == "fixed"), key=lambda r: int(r["max_steps"]))
    for d in ds:
        np.testing.assert_allclose(drawn[f"difficulty {d} (fixed n)"],
                                   [(float(r["layer_applications"]), float(r[f"accuracy_d{d}"])) for r in fixed
                                    if r[f"accuracy_d{d}"] != ""])
    points = sorted(tuple(xy) for c in fig.axes[0].collections for xy in c.get_offsets())
    np.testing.assert_allclose(points, sorted((float(r[f"layer_applications_d{d}"]), float(r[f"accuracy_d{d}"]))
                                              for r in diff.values() if r["exit"] != "fixed" for d in ds
                                              if r[f"accuracy_d{d}"] != ""))
    import matplotlib.pyplot as plt

    plt.close(fig)
    # calibrate on the task: it reads the validation split's answers, and the test split's
    # answers score the result; eval.tokens must be the test split's size
    test_size = COUNTS["test_records"] * 128
    cal = [sys.executable, "-m", "recdepth.calibrate", f"ckpt={ckpt}", "exit=accel", "target.layer_applications=20",
           "calibration.tokens=512", "calibration.max_evals=3", "eval.latency_tokens=2", "eval.repeats=1",
           "exit.max_steps=2"]
    code, err, _ = cli_here("recdepth.calibrate", [*cal[3:], "eval.tokens=512", f"run_dir={tmp_path / 'bad'}"], tmp_path)
    assert code != 0 and f"set eval.tokens={test_size}" in err
    q = subprocess.run([*cal, f"eval.tokens={test_size}", f"run_dir={tmp_path / 'cal'}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-3000:]
    t = list(csv.DictReader(open(tmp_path / "cal" / "eval_tokens.csv")))
    assert t and all(r["answer"] == "1" for r in t)
    # the loop geometry by difficulty: per d, the step norms of the positions that predict answers of d
    q = subprocess.run([sys.executable, "-m", "recdepth.diagnose", f"ckpt={ckpt}", f"run_dir={tmp_path / 'geo'}",
                        "loop_dynamics.loops=4", "loop_dynamics.sequences=4", "loop_dynamics.figures=false"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-3000:]
    geo = json.loads((tmp_path / "geo" / "metrics.json").read_text())["by_difficulty"]
    assert set(geo) == {"4", "5-6", "7"}
    for g in geo.values():
        assert g and all(len(v["step_norm"]) == 3 and len(v["step_cosine"]) == 2 and v["tokens"] > 0
                         for v in g.values())
    # the learned gate on the task: fitted on the decoding engine's states at answer targets only,
    # of whole train records (offsets multiples of the block size)
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.train_gate import train_gate, train_offsets

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        gcfg = compose("train_gate", overrides=[f"ckpt={ckpt}", "gate.tokens=384", "gate.max_steps=3",
                                                "gate.steps=20", "device=cpu", f"run_dir={tmp_path / 'gate'}"])
    meta = train_gate(gcfg)
    dm = checkpoint_data(module, data, gcfg.seed)
    offsets = train_offsets(len(dm.train_tokens), 384, 128, gcfg.seed, align=128)
    assert len(offsets) == 3 and all(o % 128 == 0 for o in offsets)
    want = sum(int((np.asarray(dm.cache.train_labels[o + 1 : o + 129]) > 0).sum()) for o in offsets)
    assert meta["answers"] and meta["states"] == "decode" and meta["balance"] and meta["examples"] == want > 0


def test_bootstrap_units_are_windows_in_the_answers_block():
    rng = np.random.default_rng(0)
    rec = {"window": np.repeat(np.arange(20), 5), "correct": rng.random(100) < 0.5, "nll": rng.random(100)}
    labels = np.tile([1, 2, 3, 1, 2], 20)
    a = tasks.score_answers(rec, labels, np.ones(100), resamples=300)
    m, lo, hi = stats.mean_ci(rec["correct"].astype(float), stats.Bootstrap(rec["window"], 300))
    assert a["accuracy"] == pytest.approx([m, lo, hi])
    assert a["windows"] == 20


@pytest.mark.parametrize("name", BUILTIN)
def test_each_task_has_an_experiment_whose_evaluation_is_its_test_split(name):
    """experiment=<task> composes and validates; eval.tokens is the whole test split, which
    is what recdepth.calibrate needs on a task (calibration starts at the validation split)."""
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.config.schema import validated
    from recdepth.model.config import shape_of

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={name}", "run_dir=/tmp/unused"])
    run = validated(cfg)
    T = shape_of(run.model.size, block_size=run.model.block_size)["block_size"]
    assert run.data.source == "task" and run.data.task.name == name and run.data.loss == "answers"
    assert cfg.eval.tokens == run.data.test_records * T
    lo, hi = run.data.task.extrapolation
    assert lo > run.data.task.size[1]


def test_unigram_baseline_of_an_answers_loss_counts_answers_only(tmp_path):
    """With data.loss=answers, val/ce scores the validation split's answers, so its unigram
    baseline is the train answers' add-one unigram over GPT-2's 50257 ids on those answers."""
    dm = data_module(tmp_path, "modsum")
    first, n = dm.region("validation")
    lab = dm.heldout_labels(n + 1, first)[1:]
    targets = dm.vocab.to_gpt2(dm.heldout_tokens(n + 1, first)[1:][lab > 0])
    train = dm.vocab.to_gpt2(np.asarray(dm.cache.train)[np.asarray(dm.cache.train_labels) > 0])
    counts = np.bincount(train, minlength=50257)
    want = -np.mean(np.log((counts[targets] + 1) / (len(train) + 50257)))
    assert dm.unigram_ce() == pytest.approx(want)
    assert set(targets.tolist()) <= set(dm.vocab.to_gpt2(np.arange(dm.vocab.size - 1)).tolist())


def test_geometry_by_difficulty_averages_the_positions_of_each_difficulty():
    import torch

    from recdepth.analysis.diagnostics import by_difficulty

    g = torch.Generator().manual_seed(0)
    sn, cos = torch.rand(3, 10, generator=g), torch.rand(2, 10, generator=g)
    labels = torch.tensor([0, 1, 2, 0, 2, 2, 1, 0, 0, 3])
    out = by_difficulty(sn, cos, labels)
    assert set(out) == {"1", "2", "3"}
    for d, cols in (("1", [1, 6]), ("2", [2, 4, 5]), ("3", [9])):
        assert out[d]["tokens"] == len(cols)
        for k in range(3):
            assert out[d]["step_norm"][k] == pytest.approx(sum(sn[k, c].item() for c in cols) / len(cols))
        for k in range(2):
            assert out[d]["step_cosine"][k] == pytest.approx(sum(cos[k, c].item() for c in cols) / len(cols))


def test_a_split_without_any_instance_is_one_line_not_a_hang():
    # modsum of one term mod 2 has two instances, " 0 = 0" and " 1 = 1": neither hashes into test's buckets
    spec = spec_of("modsum", size=(1, 1), extrapolation=(2, 2), modulus=2)
    assert not {tasks.bucket([(str(d), 0), ("=", 0), (str(d), 1)]) for d in (0, 1)} & set(tasks.BUCKETS["test"])
    ids = tasks.symbol_ids(gpt2().encode_ordinary)
    with pytest.raises(ValueError, match=r"data\.task\.size: the test split finds no instance") as e:
        tasks.records(spec, "test", 0, 1, 64, ids, EOT_ID)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ a task of one's own
@pytest.fixture
def parity(monkeypatch):
    """A task defined here and nowhere else, one class: k bits and their parity, ` 1 0 1 = 0`
    (difficulty k), with one option of its own. Registered for this test only."""
    monkeypatch.setattr(task_module, "_REGISTRY", copy.copy(task_module._REGISTRY))
    from dataclasses import dataclass

    @dataclass
    class Parity(tasks.Task):
        name: str = "parity"
        ones: float = 0.5
        """The probability of a 1."""

        def __post_init__(self):
            super().__post_init__()
            if not 0 <= self.ones <= 1:
                raise ValueError(f"data.task.ones: expected a probability in [0, 1], got {self.ones!r}")

        def generate(self, rng, sizes):
            bits = [int(rng.random() < self.ones) for _ in range(rng.randint(*sizes))]
            return [(str(b), 0) for b in bits] + [("=", 0), (str(sum(bits) % 2), len(bits))]

    return Parity


def test_a_task_is_one_class_selectable_by_its_name(parity, tmp_path):
    """Adding a task is one class (recdepth/data/tasks/task.py): defined, it is registered,
    `data=parity` selects it through Hydra with `data.task.*` its options (checked in one
    line naming the field), and its records hold its instances with their difficulties."""
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir, data_module
    from recdepth.config.schema import register_configs, validated

    assert "parity" in tasks.names() and tasks.lookup("parity") is parity
    register_configs()  # what each command does before it composes (recdepth/cli/runner.py)
    over = ["data=parity", "data.task.ones=0.25", "data.task.size=[2,5]", "data.task.extrapolation=[6,7]",
            f"data.cache_dir={tmp_path}", *[f"data.{k}={v}" for k, v in COUNTS.items()], "run_dir=/tmp/unused"]
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        run = validated(compose("config", overrides=over))
        bad = compose("config", overrides=["data=parity", "data.task.ones=2", "run_dir=/tmp/unused"])
        with pytest.raises(Exception) as e:
            compose("config", overrides=["data=parity", "data.task.chains=2", "run_dir=/tmp/unused"])
    assert type(run.data.task) is parity and run.data.task.ones == 0.25 and run.data.source == "task"
    with pytest.raises(ValueError, match=r"^data\.task\.ones: expected a probability in \[0, 1\], got 2") as v:
        validated(bad)
    assert "\n" not in str(v.value)
    from recdepth.config.schema import config_error

    assert config_error(e.value).startswith("data.task.chains: no such key in data.task")
    # the stored config (a checkpoint's data_config) reads back as the task
    from dataclasses import asdict

    assert data_config(asdict(run.data)) == run.data
    # its records: every instance's answer is its bits' parity, labelled with the bit count
    dm = data_module(run, block_size=32)
    dm.setup()
    for split in ("train", "extrapolation"):
        if split == "train":
            toks, labs = np.asarray(dm.cache.train), np.asarray(dm.cache.train_labels)
        else:
            first, n = dm.region(split)
            toks, labs = dm.heldout_tokens(n, first), dm.heldout_labels(n, first)
        seen = set()
        for text, ans in instances_of(dm, toks, labs):
            bits = text.split()[:-2]
            assert text.split()[-2] == "=" and ans == [(str(sum(map(int, bits)) % 2), len(bits))]
            seen.add(len(bits))
        lo, hi = run.data.task.sizes(split)
        assert seen == set(range(lo, hi + 1))
