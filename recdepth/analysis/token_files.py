"""Per-token records as files: eval_tokens.csv (one row per scored token: window, position,
target and its GPT-2 id, NLL, applications per group, the batch-1 ms, and on a task the
answer, difficulty and correct columns), written and read back (`write_tokens`,
`read_tokens`), and the oracle's NLL at every depth as .npy (`save_array`). The
statistics over these records are recdepth/analysis/stats.py.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

TOKEN_COLUMNS = ("window", "position", "target", "target_gpt2", "nll")  # then apps_0.., then ms


TASK_COLUMNS = ("answer", "difficulty", "correct")  # after ms, on a task (docs/spec.md §6)


def write_tokens(path: str | os.PathLike, window, position, target, target_gpt2, nll, apps, ms=None,
                 task: Mapping[str, Sequence[int]] | None = None, cost=None) -> None:
    """Write a per-token record (eval_tokens.csv): header window, position, target,
    target_gpt2, nll, apps_0 .. apps_{G−1}, ms, with `cost` the token's cost (layer
    applications plus its rule's checks, docs/spec.md §4b), and on a task answer (0/1),
    difficulty (0 for a non-answer) and correct (argmax = target, 0/1) from `task`; one
    row per token; ms empty where not timed (NaN or ms=None). Floats are written with repr
    precision (read back bit-equal); atomically (a temporary file beside it, then os.replace)."""
    path = Path(path)
    nll = np.asarray(nll, dtype=float)
    n = len(nll)
    apps = np.asarray(apps).reshape(n, -1) if n else np.asarray(apps).reshape(0, -1)
    ms = np.full(n, np.nan) if ms is None else np.asarray(ms, dtype=float)
    cols = [np.asarray(v) for v in (window, position, target, target_gpt2)]
    costs = [] if cost is None else [np.asarray(cost, dtype=float)]
    extra = [] if task is None else [np.asarray(task[c]).astype(np.int64) for c in TASK_COLUMNS]
    if any(len(v) != n for v in (*cols, ms, *costs, *extra)) or len(apps) != n:
        raise ValueError(f"write_tokens {path}: columns of unequal length")
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([*TOKEN_COLUMNS, *[f"apps_{g}" for g in range(apps.shape[1])], "ms",
                        *(("cost",) if costs else ()), *(TASK_COLUMNS if extra else ())])
            for i in range(n):
                w.writerow([*[int(v[i]) for v in cols], repr(float(nll[i])), *[int(a) for a in apps[i]],
                            "" if math.isnan(ms[i]) else repr(float(ms[i])), *[repr(float(c[i])) for c in costs],
                            *[int(v[i]) for v in extra]])
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_tokens(path: str | os.PathLike) -> dict:
    """Read a per-token record written by `write_tokens`: a dict of arrays window,
    position, target, target_gpt2 (int64), nll (float), apps [tokens, groups] (int64, the
    apps_<g> columns in order of g), ms (float, NaN where empty), and cost (float) where
    the file has it (files written before checks were priced do not). A missing column or a
    malformed row raises a one-line ValueError naming the file."""
    path = Path(path)
    with open(path, newline="") as f:
        r = csv.reader(f)
        head = next(r, None)
        rows = list(r)
    if head is None:
        raise ValueError(f"{path}: empty file, expected an eval_tokens.csv header")
    head = [h.strip() for h in head]
    for c in (*TOKEN_COLUMNS, "ms"):
        if c not in head:
            raise ValueError(f"{path}: no column {c!r} (expected an eval_tokens.csv written by recdepth)")
    col = {c: i for i, c in enumerate(head)}
    G = sum(1 for h in head if h.startswith("apps_"))
    for g in range(G):
        if f"apps_{g}" not in col:
            raise ValueError(f"{path}: no column 'apps_{g}' (apps columns must be apps_0 .. apps_{G - 1})")
    g_cols = [col[f"apps_{g}"] for g in range(G)]
    out = {c: np.empty(len(rows), dtype=np.int64) for c in TOKEN_COLUMNS[:4]}
    out["nll"], out["ms"] = np.empty(len(rows)), np.empty(len(rows))
    out["apps"] = np.empty((len(rows), G), dtype=np.int64)
    task = [c for c in TASK_COLUMNS if c in col]
    for c in task:
        out[c] = np.empty(len(rows), dtype=np.int64)
    if "cost" in col:
        out["cost"] = np.empty(len(rows))
    for i, x in enumerate(rows):
        try:
            if len(x) != len(head):
                raise ValueError(f"{len(x)} fields, header has {len(head)}")
            for c in TOKEN_COLUMNS[:4]:
                out[c][i] = int(x[col[c]])
            out["nll"][i] = float(x[col["nll"]])
            out["apps"][i] = [int(x[j]) for j in g_cols]
            out["ms"][i] = float(x[col["ms"]]) if x[col["ms"]].strip() else math.nan
            for c in task:
                out[c][i] = int(x[col[c]])
            if "cost" in col:
                out["cost"][i] = float(x[col["cost"]])
        except ValueError as e:
            raise ValueError(f"{path}: data row {i + 1}: {e}".replace("\n", " ")) from None
    return out


def save_array(path: str | os.PathLike, a: np.ndarray) -> None:
    """np.save, atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, a)
    os.replace(tmp, path)
