"""data=mazes (recdepth/data/tasks/mazes.py): DeepThinking's mazes, the start-to-end path marked
in place on the grid. Every path, label and per-step target is checked by solvers written here
from the task's statement, on the grids read back from the tokens: the path by a breadth-first
search from start to end, the rounds by dead-end filling applied round by round to the whole
grid (the generator peels leaves with a queue), never by the generator's own code."""

from collections import deque

import numpy as np
import pytest

from recdepth.config.schema import data_config
from recdepth.data import tasks
from recdepth.data.datamodule import TokenDataModule
from tests.data.helpers import assert_splits_disjoint, in_place_split, symbols_of

COUNTS = dict(train_records=24, test_records=12, validation_records=12, extrapolation_records=0)
N = 9  # size 7: 4 x 4 rooms, a 9 x 9 grid


def data_module(tmp_path, **kw) -> TokenDataModule:
    data = {"source": "task", **COUNTS, "loss": "answers", "cache_dir": str(tmp_path / "cache"),
            "task": {"name": "mazes", "size": [7, 7], "extrapolation": [9, 9]}, **kw}
    dm = TokenDataModule(data_config(data), N * N + 2, 4, 6)
    dm.setup()
    return dm


def grids(syms: list[str], n: int) -> list[tuple[int, list[str]]]:
    """(first position, the n x n cells row-major) of each maze in a stream: EOT, n² cells, newline."""
    out = []
    for p, s in enumerate(syms):
        if s == "<eot>" and p + n * n + 1 < len(syms) and syms[p + n * n + 1] == "\n":
            out.append((p + 1, syms[p + 1 : p + 1 + n * n]))
    return out


def neighbours(c: int, n: int) -> list[int]:
    y, x = divmod(c, n)
    return [(y + dy) * n + x + dx for dy, dx in ((0, -1), (0, 1), (-1, 0), (1, 0)) if 0 <= y + dy < n and 0 <= x + dx < n]


def bfs_path(cells: list[str], n: int) -> set[int]:
    start, end = cells.index("s"), cells.index("e")
    prev = {start: None}
    q = deque([start])
    while q:
        c = q.popleft()
        for d in neighbours(c, n):
            if cells[d] != "w" and d not in prev:
                prev[d] = c
                q.append(d)
    path, c = set(), end
    while c is not None:
        path.add(c)
        c = prev[c]
    return path


def filling(cells: list[str], n: int) -> tuple[dict[int, int], list[set[int]]]:
    """Dead-end filling round by round on the whole grid: {cell: round filled} and the open set
    after each round (index 0: before any)."""
    open_ = {c for c in range(n * n) if cells[c] != "w"}
    states, fill, r = [set(open_)], {}, 0
    while True:
        r += 1
        now = {c for c in open_ if cells[c] not in "se" and sum(d in open_ for d in neighbours(c, n)) <= 1}
        if not now:
            return fill, states
        fill.update({c: r for c in now})
        open_ -= now
        states.append(set(open_))


def test_mazes_is_one_file_registered_by_its_folder():
    t = tasks.lookup("mazes")()
    assert (t.size, t.extrapolation) == ([9, 9], [13, 13]) and t.in_place() and t.one_per_record()
    assert t.grid_side("train") == 11 and t.grid_side("extrapolation") == 15 and t.step_width() == 46
    assert tasks.lookup("prefixsums")().grid_side("train") is None


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_mazes_records_agree_with_a_search_and_round_by_round_filling(tmp_path, split):
    dm = data_module(tmp_path)
    toks, labs, scored = in_place_split(dm, split)
    syms, scored_syms = symbols_of(dm.vocab, toks), symbols_of(dm.vocab, scored)
    mazes = grids(syms, N)
    assert len(mazes) == COUNTS[f"{split}_records"]
    lengths = set()
    for first, cells in mazes:
        assert set(cells) <= set("wose") and cells.count("s") == cells.count("e") == 1
        assert all(cells[c] == "w" for c in range(N * N) if c // N in (0, N - 1) or c % N in (0, N - 1))
        open_ = [c for c in range(N * N) if cells[c] != "w"]
        edges = sum(cells[d] != "w" for c in open_ for d in neighbours(c, N)) // 2
        assert len(open_) == 2 * 4 * 4 - 1 and edges == len(open_) - 1  # every room, a tree (a perfect maze)
        path = bfs_path(cells, N)
        fill, states = filling(cells, N)
        assert states[-1] == path  # dead-end filling leaves the path
        last = max(1, max(fill.values(), default=1))
        lengths.add(len(path))
        for c in range(N * N - 1):  # the token after cell c carries its answer; the last cell is a wall
            p = first + c + 1
            assert scored_syms[p] == ("1" if c in path else "0"), (first, c)
            assert labs[p] == (1 if cells[c] == "w" else fill.get(c, last)), (first, c)
        assert labs[first] == 0 and labs[first + N * N] == 0  # the EOT's and the first cell's: no answer
    assert len(lengths) > 3  # paths of many lengths


def test_mazes_per_step_targets_are_the_filling_rounds(tmp_path):
    """After application t a cell's target is whether it is still open after t rounds of
    dead-end filling (an empty slot where that is its final answer)."""
    dm = data_module(tmp_path)
    toks = np.asarray(dm.cache.train)
    steps = np.asarray(dm.cache.train_steps, dtype=np.int64)
    syms = symbols_of(dm.vocab, toks)
    assert steps.shape == (len(toks), 2 * 4 * 4 - 4)
    checked = 0
    for first, cells in grids(syms, N):
        fill, states = filling(cells, N)
        final = states[-1]
        for c in range(N * N - 1):
            row = steps[first + c + 1]
            got = [symbols_of(dm.vocab, [t])[0] for t in row if t != tasks.NO_STEP]
            want = []
            for t in range(1, len(states)):
                if (c in states[t]) != (c in final):  # the target after t differs from the final answer
                    want = [("1" if c in states[u] else "0") for u in range(1, t + 1)]
            assert got == want, (first, c)
            checked += len(want)
    assert checked > 100


def test_the_extrapolation_split_is_scored_on_final_answers_and_may_be_empty(tmp_path):
    dm = data_module(tmp_path)
    with pytest.raises(ValueError, match=r"^data\.extrapolation_records: this task's data holds no extrapolation split "
                                         r"\(0 records\); evaluate a checkpoint's with eval\.task"):
        dm.region("extrapolation")
    big = tasks.lookup("mazes")(size=[7, 7], extrapolation=[11, 11])
    inst = big.generate(__import__("random").Random(0), (11, 11))
    assert len(inst) == 13 * 13 and all(tok[2] == () for tok in inst)  # no per-step targets beyond `size`
    assert max(tok[1] for tok in inst) > 1


def test_mazes_splits_share_no_instance():
    assert_splits_disjoint(tasks.lookup("mazes")(size=[3, 3], extrapolation=[5, 5]))


def test_branching_grows_trees_with_four_way_rooms_and_leaves_the_extrapolation_split_depth_first():
    """data.task.branching: a random stacked room carves instead of the newest. The mazes stay
    trees over every room (counted here from the grid); 3 x 3-room mazes get the room open on
    all four sides that depth-first ones never have; the extrapolation split's are unchanged."""
    import random

    from recdepth.data.tasks.mazes import carve

    def four_way_rooms(g):
        return sum(all(g[y + dy][x + dx] != "w" for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)))
                   for y in range(1, len(g), 2) for x in range(1, len(g), 2))

    counts = {}
    for b in (0.0, 1.0):
        rng, n = random.Random(3), 0
        for _ in range(600):
            g = carve(rng, 3, b)
            cells = [(y, x) for y in range(7) for x in range(7) if g[y][x] != "w"]
            edges = sum(g[y][x + 1] != "w" for y, x in cells) + sum(g[y + 1][x] != "w" for y, x in cells)
            assert len(cells) == 2 * 9 - 1 and edges == len(cells) - 1  # 9 rooms, 8 passages: a spanning tree
            n += four_way_rooms(g) > 0
        counts[b] = n
    assert counts[0.0] == 0 and counts[1.0] >= 20  # about 9% of them at branching 1
    dfs, grown = (tasks.lookup("mazes")(size=[5, 5], extrapolation=[9, 9], branching=b) for b in (0.0, 1.0))
    for sizes, same in (((9, 9), True), ((5, 5), False)):
        a, c = (t.generate(random.Random(7), sizes) for t in (dfs, grown))
        assert (a == c) is same


@pytest.mark.parametrize("field, value, message", [
    ("branching", 1.5, r"^data\.task\.branching: expected a probability in \[0, 1\], got 1\.5$"),
    ("size", [9, 11], r"^data\.task\.size: one odd maze size a split, \[s, s\] .*got \[9, 11\]$"),
    ("size", [8, 8], r"^data\.task\.size: one odd maze size a split"),
    ("extrapolation", [15, 17], r"^data\.task\.extrapolation: one odd maze size a split"),
    ("size", [1, 1], r"^data\.task\.size: expected \[lo, hi\] with 3 <= lo <= hi"),
])
def test_bad_maze_sizes_are_one_line(field, value, message):
    with pytest.raises(ValueError, match=message):
        tasks.lookup("mazes")(**{field: value})


def test_experiment_mazes_composes_and_a_grid_model_checks_its_data_in_one_line():
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.config.schema import validated

    over = ["experiment=mazes", "run_dir=/tmp/unused"]
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        run = validated(compose("config", overrides=over))
        wrong_block = compose("config", overrides=[*over, "data.task.size=[7,7]", "data.task.extrapolation=[9,9]"])
        no_grid = compose("config", overrides=["experiment=prefixsums", "model.attention=grid", "model.position=none",
                                               "model.attention_window=null", "run_dir=/tmp/unused"])
        part_grid = compose("config", overrides=[*over, "eval.tokens=6500"])
    assert (run.model.attention, run.model.position, run.data.task.grid_side("train")) == ("grid", "none", 7)
    assert run.model.shape()["block_size"] == 7 * 7 + 2 and run.eval.tokens == run.data.test_records * 51
    assert run.data.extrapolation_records == 0 and run.eval.regime == "parallel"
    with pytest.raises(ValueError, match=r"^model\.block_size: data\.task\.size=\[7, 7\] writes 9 x 9 grids, which grid "
                                         r"attention reads from windows of N² \+ 2 = 83 tokens, got 51$"):
        validated(wrong_block)
    with pytest.raises(ValueError, match=r"^model\.attention: grid reads each window as one N x N grid, and "
                                         r"data=\w+ writes no grids \(data=mazes does\)$"):
        validated(no_grid)
    with pytest.raises(ValueError, match=r"^eval\.tokens: a grid model scores whole grids of 51 tokens, expected a "
                                         r"multiple of 51, got 6500$"):  # refused before training, not after it
        validated(part_grid)
