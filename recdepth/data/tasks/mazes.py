"""mazes: DeepThinking's mazes (Bansal et al. 2022, arXiv 2202.05826), the path from start to
end marked in place on the maze's grid (docs/spec.md §6).

A maze of size s (odd, DeepThinking's name: 9 in training, up to 59 at test) has
r = (s + 1) / 2 rooms a side, carved by a depth-first search from the start room (as their
make_mazes.py: every room reached once, so the open cells form a tree and the path between
two rooms is unique). It is written as its grid of N × N cells, N = 2r + 1 = s + 2 (rooms,
the passages between them, walls, and the outer wall), row by row, one token a cell:
` w` wall, ` o` open, ` s` start, ` e` end (start and end two distinct rooms drawn
uniformly). DeepThinking draws the same grid as an image, each cell 2 × 2 pixels with a
border of 3 (24 × 24 pixels at s = 9, 124 × 124 = 15,376 at s = 59).

The target of each cell is ` 1` on the path from start to end, ` 0` off it (every wall),
scored in place (task.py: in-place targets) at the token after the cell, so a maze's answers
are one run and `exact` is the whole solution right, as DeepThinking scores every pixel. The
last cell, the outer wall's corner, has no token after it and is not scored (a wall).

A model reads a maze under grid attention (`model.attention=grid`, position=none): each
cell reads itself and its four neighbours per layer application, so one application is one
round of **dead-end filling**: an open cell other than start and end whose open neighbours
are at most one is filled (becomes a wall), all cells at once. On a tree the cells left
open when no cell fills are the path. Difficulty of a cell: 1 for a wall (its input says
it), the round it is filled in for a dead end, and for a path cell the maze's last round F
(a path cell is told from a dead end only when no dead end is left; at least 1). Per-step
targets (`loss.steps=trajectory`): after application t < f a dead-end cell filled at round
f is still open (` 1`), from t = f on its final ` 0`; a path cell is ` 1` throughout. They are stated for the training sizes
(`size`) only: the extrapolation split's mazes are scored on their final answers, so its
widest maze (F up to ~2r²) does not size every split's per-step files.

One maze a record (`one_per_record`): the window is the grid (its EOT, the N² cells, its
newline), which grid attention reads as an N × N grid; model.block_size = N² + 2 (123 at
s = 9), and every split has one size (`size` and `extrapolation` are [s, s]).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from recdepth.core.checks import is_number
from recdepth.data.tasks.task import DIGITS, Instance, Task

WALL, OPEN, START, END = "w", "o", "s", "e"


@dataclass
class Mazes(Task):
    """`data=mazes`: a maze's grid in, the start-to-end path marked on its open cells in place."""

    name: str = "mazes"
    size: list[int] = field(default_factory=lambda: [9, 9])
    """Maze size s of train/validation/test, [s, s] (odd, >= 3; DeepThinking trains on 9: 5 × 5
    rooms, an 11 × 11 grid)."""
    extrapolation: list[int] = field(default_factory=lambda: [13, 13])
    """Maze size of the extrapolation split, [s, s], above `size` (DeepThinking tests up to 59)."""
    branching: float = 0.0
    """In [0, 1]: mazes of the `size` splits grow, at each step with this probability, from a
    random room already carved instead of the newest (the growing-tree algorithm; 0 = the
    depth-first search, DeepThinking's). Depth-first mazes of 3 × 3 rooms never have a room
    open on all four sides, which 59 × 59 ones do; the extrapolation split stays depth-first."""

    def __post_init__(self):
        super().__post_init__()
        if not is_number(self.branching) or not 0 <= self.branching <= 1:
            raise ValueError(f"data.task.branching: expected a probability in [0, 1], got {self.branching!r}")
        for key in ("size", "extrapolation"):
            lo, hi = getattr(self, key)
            if lo != hi or lo % 2 == 0:
                raise ValueError(f"data.task.{key}: one odd maze size a split, [s, s] (a grid model reads every window "
                                 f"as one N x N grid, N = s + 2), got [{lo}, {hi}]")

    def min_size(self) -> int:
        return 3  # two rooms a side: start and end distinct

    def in_place(self) -> bool:
        return True

    def one_per_record(self) -> bool:
        return True  # the window is the grid

    def step_width(self) -> int:
        r = (self.size[1] + 1) // 2
        return 2 * r * r - 4  # f - 1 < open cells (2r² - 1) minus start and end

    def grid_side(self, split: str) -> int:
        """N, the grid side of the split's mazes (a window of N² + 2 tokens)."""
        return self.sizes(split)[0] + 2

    def generate(self, rng: random.Random, sizes: tuple[int, int]) -> Instance:
        trained = sizes[1] <= self.size[1]  # per-step targets and branching for the training sizes only
        grid = carve(rng, (sizes[0] + 1) // 2, self.branching if trained else 0.0)
        fill, last = dead_end_rounds(grid)
        n = len(grid)
        cells = [c for row in grid for c in row]
        out = []
        for j, sym in enumerate(cells):
            if j == 0:
                out.append((sym, 0, (), None))
                continue
            if cells[j - 1] == WALL:
                out.append((sym, 1, (), DIGITS[0]))
                continue
            f = fill.get(divmod(j - 1, n))
            steps = ("1",) * (f - 1) if f is not None and trained else ()
            out.append((sym, last if f is None else f, steps, DIGITS[0] if f is not None else DIGITS[1]))
        return out


def carve(rng: random.Random, rooms: int, branching: float = 0.0) -> list[list[str]]:
    """A maze of rooms × rooms rooms as its (2·rooms + 1)² grid: a depth-first search from
    the start room knocks down the wall to a random unvisited neighbour, backtracking at dead
    ends; start and end are two distinct rooms drawn uniformly. With `branching` > 0 each
    step carves, with that probability, from a random room of the search's stack instead of
    its top (the growing tree; a room leaves the stack when it has no unvisited neighbour)."""
    n = 2 * rooms + 1
    grid = [[WALL] * n for _ in range(n)]
    start, end = rng.sample(range(rooms * rooms), 2)
    sy, sx = divmod(start, rooms)
    seen = {(sy, sx)}
    stack = [(sy, sx)]
    grid[2 * sy + 1][2 * sx + 1] = OPEN
    while stack:  # at branching 0 no draw is added: the depth-first mazes stay those of every earlier version
        k = len(stack) - 1 if branching == 0 or rng.random() >= branching else rng.randrange(len(stack))
        y, x = stack[k]
        nbrs = [(y + dy, x + dx) for dy, dx in ((0, -1), (0, 1), (1, 0), (-1, 0))
                if 0 <= y + dy < rooms and 0 <= x + dx < rooms and (y + dy, x + dx) not in seen]
        if not nbrs:
            stack.pop(k)
            continue
        ny, nx = rng.choice(nbrs)
        grid[y + ny + 1][x + nx + 1] = OPEN  # the wall between (y, x) and (ny, nx)
        grid[2 * ny + 1][2 * nx + 1] = OPEN
        seen.add((ny, nx))
        stack.append((ny, nx))
    ey, ex = divmod(end, rooms)
    grid[2 * sy + 1][2 * sx + 1], grid[2 * ey + 1][2 * ex + 1] = START, END
    return grid


def dead_end_rounds(grid: list[list[str]]) -> tuple[dict[tuple[int, int], int], int]:
    """({open cell: the round dead-end filling fills it in}, F = the last round, at least 1)
    for a maze whose open cells form a tree: each round fills, at once, every open cell but
    start and end with at most one open neighbour. Peeled from the leaves, each round from the
    neighbours of the last (each cell visited once); tests/data/test_mazes.py checks it against the round-by-round rule."""
    n = len(grid)
    open_ = {(y, x) for y in range(n) for x in range(n) if grid[y][x] != WALL}
    ends = {(y, x) for (y, x) in open_ if grid[y][x] in (START, END)}

    def nbrs(c):
        y, x = c
        return [d for d in ((y, x - 1), (y, x + 1), (y - 1, x), (y + 1, x)) if d in open_]

    degree = {c: len(nbrs(c)) for c in open_}
    fill: dict[tuple[int, int], int] = {}
    frontier = {c for c in open_ if c not in ends and degree[c] <= 1}
    r = 0
    while frontier:  # round r fills the frontier; a neighbour left with <= 1 open joins the next
        r += 1
        fill.update(dict.fromkeys(frontier, r))
        following = set()
        for c in frontier:
            for d in nbrs(c):
                if d not in fill:
                    degree[d] -= 1  # degrees only fall, so the check after the last decrement decides
                    if d not in ends and degree[d] <= 1:
                        following.add(d)
        frontier = following
    return fill, max(r, 1)
