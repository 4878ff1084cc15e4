"""Loop-geometry diagnostics of a model (SPEC §2; paper §2–3, Figs. 1, 2, 3 and 5).

`loop_dynamics(model, batch)` runs every recurrence group for a fixed number of
applications (paper appendix: 30) on a fixed held-out batch, captures the trajectories,
and returns, as a JSON-ready dict:

- per group and per step k, the mean and standard deviation over tokens (every position
  of every row; population std, the paper's 1σ bands) of the step norm ‖Δ^(k)‖ (k = 0..K−1),
  the consecutive-step cosine (k = 1..K−1) and the acceleration (eq. 5), K = loops − 1;
- per group, the state norms ‖x^(k)‖ and the rounding floor eps·mean‖x‖ of the dtype:
  a step below a few times the floor is rounding noise, and the cosine of consecutive
  differences of white noise is −1/2 (Δ^(k) and Δ^(k−1) share the middle state with
  opposite signs), so cosines there say nothing about the loop;
- per group boundary g → g+1, the drift-to-loop ratio (eq. 2) over tokens: mean, std and
  quartiles, plus its numerator and denominator averaged separately;
- for one sequence, the 2-D PCA of every hidden state over depth and loop steps (Fig. 1).

All quantities come from `recdepth.analysis.geometry` (the same functions the exit rules use).

Memory: a captured trajectory holds loops × rows × T × d floats per group, so the batch
goes through in chunks of rows sized to `max_state_bytes` (default 256 MiB; the
paper-size model at 30 loops needs 141 MiB per 512-token row). Noise for the initial
states comes from a generator seeded per call, never from the global RNG, so running
diagnostics does not change what training draws next.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from recdepth.analysis import geometry as geo
from recdepth.model.looped import LoopedGPT

FORMAT = "recdepth.loop_dynamics/1"
DEFAULT_LOOPS = 30  # paper appendix: diagnostics at a fixed 30 loops
DEFAULT_MAX_STATE_BYTES = 256 * 2**20
FLOOR_FACTOR = 10  # a mean step under 10x the rounding floor is flagged as near it


def group_name(layers: Sequence[int]) -> str:
    """The paper's names for groups: "4", "5-6"."""
    return str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


@torch.no_grad()
def capture(model: LoopedGPT, idx: Tensor, loops: Sequence[int],
            generator: torch.Generator | None = None) -> list[tuple[str, int, Tensor]]:
    """Every hidden state of a forward pass over idx [B, T], in depth order:
    ("layer", l, [1, B, T, d]) for a layer run once, ("group", g, [n_g, B, T, d]) for the
    trajectory x_g^(0..n_g−1) of a group run n_g times (SPEC §2)."""
    trace: list = []
    model(idx, loops=loops, generator=generator, trace=trace)
    return [(kind, i, torch.stack(states)) for kind, i, states in trace]


def rows_per_pass(model: LoopedGPT, seq_len: int, loops: Sequence[int], max_state_bytes: int) -> int:
    """How many rows of seq_len tokens fit a capture under max_state_bytes (at least 1)."""
    cfg = model.cfg
    n_states = sum(loops) + cfg.n_layer - sum(len(g) for g in cfg.groups)
    elem = next(model.parameters()).element_size()
    return max(1, max_state_bytes // (n_states * seq_len * cfg.n_embd * elem))


def pca_2d(points: Tensor) -> tuple[Tensor, Tensor]:
    """Project points [N, d] on their first two principal components (fit on these points,
    float64). Returns (coordinates [N, 2], explained-variance ratios [2]). Each axis's
    sign is fixed so its largest-magnitude loading is positive, so refits are comparable."""
    x = points.double()
    x = x - x.mean(0)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    vh = vh[:2]
    sign = torch.sign(vh.gather(1, vh.abs().argmax(1, keepdim=True)))
    vh = vh * torch.where(sign == 0, 1.0, sign)
    var = s**2
    return x @ vh.T, (var[:2] / var.sum().clamp_min(torch.finfo(var.dtype).tiny))


def mean_std(values: Tensor, dim: int = -1) -> dict[str, list[float]]:
    """Mean and population standard deviation over `dim`, float64, as lists."""
    v = values.double()
    return {"mean": v.mean(dim).tolist(), "std": v.std(dim, correction=0).tolist()}


def _pca_entry(trace: list[tuple[str, int, Tensor]], row: int, tokens: int, names: list[str]) -> dict:
    """Fig. 1's data: one sequence's states over depth and loop steps, PCA-projected."""
    stages, states = [], []
    for kind, i, st in trace:
        stages.append({"kind": kind, "index": i, "states": st.shape[0],
                       "label": f"layer {i}" if kind == "layer" else f"group {names[i]}"})
        states.append(st[:, row, :tokens])  # [n, tokens, d]
    union = torch.cat(states)  # [S, tokens, d]: every state of every token of the sequence
    S, n_tok, d = union.shape
    xy, ratio = pca_2d(union.reshape(S * n_tok, d))
    return {"stages": stages, "explained_variance": ratio.tolist(),
            "xy": [[[round(float(a), 5), round(float(b), 5)] for a, b in tok] for tok in xy.view(S, n_tok, 2)]}


@torch.no_grad()
def loop_dynamics(
    model: LoopedGPT,
    batch: Tensor,
    loops: int = DEFAULT_LOOPS,
    seed: int = 0,
    pca_sequence: int = 0,
    pca_tokens: int = 32,
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
    labels: Tensor | None = None,
) -> dict:
    """Loop geometry of `model` on the token ids `batch` [B, T] with `loops` applications
    of every group (see the module docstring for what is returned). With a task's `labels`
    [B, T] (the label of each position's target: 0 = not an answer, d >= 1 = an answer of
    difficulty d; docs/spec.md §6), each group also gets `by_difficulty`: per d, the mean
    step norm and consecutive-step cosine at every k over the positions predicting an
    answer of difficulty d."""
    if model.n_groups == 0:
        raise ValueError("loop_dynamics: the model has no recurrence groups (model.groups is empty)")
    if loops < 3:
        raise ValueError(f"loop_dynamics: loops must be >= 3 (two steps make one cosine), got {loops}")
    if batch.dim() != 2:
        raise ValueError(f"loop_dynamics: batch must be token ids [B, T], got shape {tuple(batch.shape)}")
    B, T = batch.shape
    if labels is not None and tuple(labels.shape) != (B, T):
        raise ValueError(f"loop_dynamics: labels must be [B, T] = {[B, T]}, got {list(labels.shape)}")
    if not 0 <= pca_sequence < B:
        raise ValueError(f"loop_dynamics: pca_sequence={pca_sequence} outside the batch's 0..{B - 1}")
    cfg = model.cfg
    G = model.n_groups
    names = [group_name(g) for g in cfg.groups]
    device = next(model.parameters()).device
    batch = batch.to(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    n = [loops] * G
    chunk = min(B, rows_per_pass(model, T, n, max_state_bytes))

    norms: list[list[Tensor]] = [[] for _ in range(G)]  # per group: [K, tokens] per chunk
    cosines: list[list[Tensor]] = [[] for _ in range(G)]
    accels: list[list[Tensor]] = [[] for _ in range(G)]
    xnorms: list[list[Tensor]] = [[] for _ in range(G)]
    dlr: list[list[Tensor]] = [[] for _ in range(G - 1)]  # per boundary: [tokens] per chunk
    drift: list[list[Tensor]] = [[] for _ in range(G - 1)]
    pca = None
    was_training = model.training
    model.eval()
    try:
        for r0 in range(0, B, chunk):
            trace = capture(model, batch[r0 : r0 + chunk], n, generator)
            trajs = [st for kind, _, st in trace if kind == "group"]  # [n, b, T, d] each
            for g, traj in enumerate(trajs):
                norms[g].append(geo.step_norms(traj).flatten(1))  # [K, rows * T], row-major like labels
                cosines[g].append(geo.step_cosines(traj).flatten(1))
                accels[g].append(geo.accelerations(traj).flatten(1))
                xnorms[g].append(geo.state_norms(traj).flatten(1))
            for g in range(G - 1):
                dlr[g].append(geo.drift_to_loop_ratio(trajs[g], trajs[g + 1]).flatten())
                drift[g].append(geo.step_norm(geo.step(trajs[g][-1], trajs[g + 1][0])).flatten())
            if r0 <= pca_sequence < r0 + chunk:
                pca = _pca_entry(trace, pca_sequence - r0, min(pca_tokens, T), names)
                pca.update(sequence=pca_sequence, token_ids=batch[pca_sequence, : min(pca_tokens, T)].tolist())
            del trace, trajs
    finally:
        model.train(was_training)

    eps = torch.finfo(next(model.parameters()).dtype).eps
    groups = []
    sns = [torch.cat(norms[g], 1) for g in range(G)]  # [K, tokens] per group
    for g in range(G):
        sn, xn = sns[g], torch.cat(xnorms[g], 1)
        floor = eps * xn.double().mean().item()
        noisy = [k for k, v in enumerate(sn.double().mean(1).tolist()) if v < FLOOR_FACTOR * floor]
        groups.append({
            "name": names[g], "layers": list(cfg.groups[g]),
            "step_norm": mean_std(sn), "step_cosine": mean_std(torch.cat(cosines[g], 1)),
            "acceleration": mean_std(torch.cat(accels[g], 1)), "state_norm": mean_std(xn),
            "rounding_floor": floor, "first_k_near_floor": noisy[0] if noisy else None,
        })
        if labels is not None:
            groups[-1]["by_difficulty"] = by_difficulty(sn, torch.cat(cosines[g], 1), labels.flatten())
    boundaries = []
    for g in range(G - 1):
        r = torch.cat(dlr[g]).double()
        q = torch.quantile(r, torch.tensor([0.25, 0.5, 0.75], dtype=r.dtype, device=r.device)).tolist()
        boundaries.append({
            "name": f"{names[g]}→{names[g + 1]}", "from": g, "to": g + 1,
            "mean": r.mean().item(), "std": r.std(correction=0).item(),
            "q25": q[0], "median": q[1], "q75": q[2],
            "drift_mean": torch.cat(drift[g]).double().mean().item(),
            "loop_step_mean": sns[g].double().mean().item(),
        })
    return {
        "format": FORMAT, "loops": loops, "steps": loops - 1, "seed": seed,
        "batch": {"sequences": B, "seq_len": T, "tokens": B * T, "rows_per_pass": chunk},
        "groups": groups, "dlr": boundaries, "pca": pca,
    }


def by_difficulty(step_norms: Tensor, cosines: Tensor, labels: Tensor) -> dict[str, dict]:
    """Mean step norm [K] and consecutive-step cosine [K − 1] per answer difficulty d over
    the tokens whose label is d (step_norms [K, tokens], cosines [K − 1, tokens], labels
    [tokens]; 0 = not an answer, left out)."""
    labels = labels.to(step_norms.device)
    out = {}
    for d in sorted(set(labels[labels > 0].tolist())):
        sel = labels == d
        out[str(int(d))] = {"tokens": int(sel.sum()), "step_norm": step_norms[:, sel].double().mean(1).tolist(),
                            "step_cosine": cosines[:, sel].double().mean(1).tolist()}
    return out


def summary_scalars(d: dict) -> dict[str, float]:
    """A few scalars per diagnostics dict, for loggers: per group the first and last step
    norms, their ratio (how much the steps shrink over the loops), the cosine at the last
    step and its mean over the second half of the loops; per boundary the mean and median
    DLR. Keys are flat, e.g. `geometry/g5-6/step_norm_last`, `geometry/dlr/4_to_5-6_mean`."""
    out: dict[str, float] = {}
    for grp in d["groups"]:
        p = f"geometry/g{grp['name']}"
        sn, cs = grp["step_norm"]["mean"], grp["step_cosine"]["mean"]
        out[f"{p}/step_norm_first"] = sn[0]
        out[f"{p}/step_norm_last"] = sn[-1]
        out[f"{p}/step_norm_ratio"] = sn[-1] / sn[0] if sn[0] > 0 else math.nan
        out[f"{p}/cosine_last"] = cs[-1]
        out[f"{p}/cosine_tail_mean"] = sum(cs[len(cs) // 2 :]) / len(cs[len(cs) // 2 :])
    for b in d["dlr"]:
        key = f"geometry/dlr/{d['groups'][b['from']]['name']}_to_{d['groups'][b['to']]['name']}"
        out[f"{key}_mean"] = b["mean"]
        out[f"{key}_median"] = b["median"]
    return out


# --------------------------------------------------------------------- files
def diagnostics_path(run_dir: str | Path, step: int) -> Path:
    """Where the diagnostics of global step `step` live: `<run_dir>/diagnostics/step_<step>.json`."""
    return Path(run_dir) / "diagnostics" / f"step_{step}.json"


def measure(model: LoopedGPT, batch: Tensor, run_dir: str | Path, step: int,
            decode: Callable[[list[int]], str] | None = None, **kw) -> dict:
    """`loop_dynamics(model, batch, **kw)` at global step `step`, written atomically to
    `diagnostics_path(run_dir, step)` (with its wall time and, given `decode`, Fig. 1's text)
    and returned. The training callback and `recdepth.diagnose` both measure through it."""
    t0 = time.perf_counter()
    d = loop_dynamics(model, batch, **kw)
    d["global_step"] = step
    d["seconds"] = time.perf_counter() - t0
    if decode is not None and d["pca"] is not None:
        d["pca"]["text"] = decode(d["pca"]["token_ids"])
    path = diagnostics_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(d) + "\n")
    os.replace(tmp, path)
    return d


def diagnostics_files(run_dir: str | Path) -> list[Path]:
    """`<run_dir>/diagnostics/step_<n>.json`, ordered by n."""
    files = [p for p in Path(run_dir).glob("diagnostics/step_*.json") if p.stem[5:].isdigit()]
    return sorted(files, key=lambda p: int(p.stem[5:]))


def load_diagnostics(run_dir: str | Path) -> list[dict]:
    """Every diagnostics dict of a run, oldest checkpoint first; a clear error otherwise."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run_dir: {run_dir} is not a directory")
    files = diagnostics_files(run_dir)
    if not files:
        raise FileNotFoundError(f"run_dir: no diagnostics/step_*.json in {run_dir} "
                                "(written during training by callbacks=loop_dynamics)")
    out = []
    for f in files:
        try:
            d = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: not readable JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{f}: expected a recdepth diagnostics file (format {FORMAT!r})")
        out.append(d)
    return out


def check_loop_dynamics(every_n_steps: int, loops: int, pca_sequence: int, rows: int, pca_tokens: int,
               max_state_bytes: int, prefix: str = "callbacks.loop_dynamics") -> None:
    """LoopDynamics' settings for a batch of `rows` sequences, checked with one line naming
    the field each (`<prefix>.<field>`; recdepth/training/callbacks.py's LoopDynamics, the schema's
    `callbacks.loop_dynamics` and recdepth.diagnose's `loop_dynamics`)."""
    checks = [
        (every_n_steps >= 1, "every_n_steps", f">= 1, got {every_n_steps}"),
        (loops >= 3, "loops", f">= 3 (two steps make one cosine), got {loops}"),
        (0 <= pca_sequence < rows, "pca_sequence", f"a row of the batch (0..{rows - 1}), got {pca_sequence}"),
        (pca_tokens >= 1, "pca_tokens", f">= 1, got {pca_tokens}"),
        (max_state_bytes >= 1, "max_state_bytes", f">= 1, got {max_state_bytes}"),
    ]
    for ok, field, expected in checks:
        if not ok:
            raise ValueError(f"{prefix}.{field}: expected {expected}")
