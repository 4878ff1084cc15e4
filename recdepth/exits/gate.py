"""The learned exit gate (SPEC §3c): the halting family's `correct` head (label `margin`)
fitted after the fact on a frozen checkpoint, one Linear(d -> 1) per recurrence group on the
loop's state, from states and losses of the checkpoint's train split. Trained with the loop,
the same head is `halt=correct halt.label=margin` (recdepth/training/halting.py); both are
read by the halting rule's `direct` reading (recdepth/exits/rules/builtin.py: `Halt`, and
`Gate`, which reads this file's head). The gate keeps the complementary sign: its q is the
probability that continuing still helps, q = 1 − λ, so its weights are the head's negated.

With N = max_steps and x_g^(n) group g's state after n applications:

    label     y_g^(n) = [ nll_g(n) − nll_g(N) > margin ]                  (`gate_labels`)
              nll_g(n): the token's NLL when group g stops after n applications and
              every other group runs N
    gate      q_g^(n) = σ(w_g · x_g^(n) + b_g)                             (`gate_probability`)
              the predicted probability that continuing still lowers the loss
    fit       logistic regression of y on x, one per group                 (`fit_gate`)
    rule      exit after application n when q_g^(n) < τ   (recdepth/exits/rules/builtin.py, rule `gate`)

DEVIATION from the issue's wording ("whether one more application still lowers the
loss by more than a margin"): the label compares with the full depth N, not with n + 1.
A single step's gain on a looping or spiralling state is mostly oscillation (the loss
goes up and down by more than it drifts), so "one more step helps" is close to a coin
flip at every n; the gain still available up to N is what exiting gives up.

The data come either from the parallel forward pass with every other group at N
(`collect_gate_data`, gate.states=parallel), or, the default, from the states the decoding
engine visits (`recdepth.decode.gate_states.decoding_gate_data`, gate.states=decode): in the
parallel pass a token at application n attends to the earlier tokens at application n, in
decoding to their cached last application, so the parallel states are not the ones the
gate meets at evaluation.

Core: torch only. The gate file is written by `python -m recdepth.train_gate` and read by
`load_gate` (a dict saved with torch.save; see `save_gate`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from recdepth.model.looped import LoopedGPT, halt_logit

FORMAT = "recdepth-gate"
VERSION = 1


def margin_labels(nll: Tensor, margin: float, dim: int = 0) -> Tensor:
    """The halting family's `margin` label, one definition for the head trained with the loop
    and the gate: along `dim` (entry n − 1: the loss after n applications, the last entry N's),

        y^(n) = [ nll(n) − nll(N) <= margin ]    (bool; 1 = halting after n gives up at most
                                                  `margin` nats against full depth)"""
    return nll - nll.narrow(dim, nll.shape[dim] - 1, 1) <= margin


def gate_labels(nll_by_n: Tensor, margin: float) -> Tensor:
    """Continue labels from a token's NLL at every depth of one group.

    nll_by_n [..., N]: entry n − 1 is the NLL when the group stops after n applications
    (every other group at N). Returns [..., N − 1] bool, entry n − 1 (n = 1 .. N − 1):

        y^(n) = [ nll(n) − nll(N) > margin ]

    1 = "continue": running on to the full depth N still lowers the loss by more than
    `margin` (nats): the negation of `margin_labels`. (Not "one more application": see the
    module docstring.)"""
    return ~margin_labels(nll_by_n, margin, dim=-1)[..., :-1]


def gate_probability(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """q = σ(w · x + b) over the last axis of x [..., d] (weight [d], bias scalar): the
    gate's predicted probability that continuing still helps, the halting head's 1 − λ
    with λ = σ(−(w · x + b)) (`looped.halt_logit`, a per-row sum: a row's q does not depend on
    the rows beside it)."""
    return torch.sigmoid(halt_logit(x, weight, bias, normed=False))


def class_weights(labels: Tensor) -> Tensor:
    """Per-example weights that give both classes the same total weight: M / (2 k) on each
    of the k positives and M / (2 (M − k)) on each negative (sum M, as unweighted); all
    ones when only one class is present. (scikit-learn's class_weight="balanced".)"""
    y = labels.reshape(-1).to(torch.float64)
    M, k = float(y.numel()), float(y.sum())
    if k in (0.0, M):
        return torch.ones_like(y)
    return torch.full_like(y, M / (2 * (M - k))).masked_fill(y > 0.5, M / (2 * k))


def fit_gate(features: Tensor, labels: Tensor, steps: int = 100,
             weight_decay: float = 1e-4, balance: bool = False) -> tuple[Tensor, Tensor, dict]:
    """Logistic regression of `labels` [M] (bool) on `features` [M, d], full batch, L-BFGS
    from zero (deterministic; no seed needed).

    The features are standardised inside, z = (x − μ) / σ (σ = std + 1e-6): minimises
    the (with `balance`: `class_weights`-weighted) mean BCE(v · z + c, y) + weight_decay/2 · ‖v‖²,
    then folds the standardisation back,

        w = v / σ,   b = c − Σ v μ / σ,

    so that w · x + b = v · z + c on the raw state. `balance` matters where one label
    dominates (most states say "stop"): unweighted, the fit can sit near the base rate
    and its q never crosses a τ in the middle. Returns (w [d], b [], stats) in float32,
    stats = {accuracy, balanced_accuracy, log_loss, label_rate} on the training data
    (log_loss unweighted). With one
    class only (every label equal) the gate is constant: w = 0, b = the add-½ log-odds
    of the labels (a logistic fit would drive b to ±∞)."""
    X = features.detach().to(torch.float64).reshape(-1, features.shape[-1])
    y = labels.detach().reshape(-1).to(torch.float64)
    if X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise ValueError(f"fit_gate: {X.shape[0]} feature rows for {y.shape[0]} labels")
    M, d = X.shape
    k = float(y.sum())
    if k in (0.0, float(M)):
        w, b = torch.zeros(d, dtype=torch.float64), torch.tensor(math.log((k + 0.5) / (M - k + 0.5)))
    else:
        mu, sd = X.mean(0), X.std(0) + 1e-6
        Z = (X - mu) / sd
        v = torch.zeros(d, dtype=torch.float64, requires_grad=True)
        wts = class_weights(y) if balance else None
        # the base rate (balanced: the classes weigh the same, log-odds 0)
        c = torch.tensor(0.0 if balance else math.log(k / (M - k)), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([v, c], lr=1.0, max_iter=steps, tolerance_grad=1e-9, tolerance_change=1e-12,
                                history_size=20, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(Z @ v + c, y, weight=wts) + 0.5 * weight_decay * (v * v).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        v, c = v.detach(), c.detach()
        w, b = v / sd, c - (v * mu / sd).sum()
    z = X @ w + b
    hit = (z > 0) == (y > 0.5)
    pos, neg = y > 0.5, y <= 0.5
    recall = [float(hit[m].double().mean()) for m in (pos, neg) if bool(m.any())]
    stats = {"accuracy": float(hit.double().mean()), "balanced_accuracy": sum(recall) / len(recall),
             "log_loss": float(F.binary_cross_entropy_with_logits(z, y)),
             "label_rate": k / M}
    return w.float(), b.float(), stats


def check_gate_setting(model: LoopedGPT, max_steps: int) -> tuple[int, int]:
    """(N, G): the gate's max_steps (>= 2: it decides between 1 and N) and the model's
    recurrence groups (>= 1), or a one-line error naming the field."""
    N = int(max_steps)
    if N < 2:
        raise ValueError(f"gate.max_steps: expected an integer >= 2 (a gate decides between 1 and N), got {N}")
    if model.n_groups == 0:
        raise ValueError("gate: the model has no recurrence groups (nothing to gate)")
    return N, model.n_groups


@torch.no_grad()
def collect_gate_data(model: LoopedGPT, windows: Iterable[Tensor], max_steps: int,
                      generator_seed: int = 0, scored: Iterable[Tensor] | None = None) -> list[tuple[Tensor, Tensor]]:
    """States and depth-wise NLLs of every group on token windows, for `fit_gate`.

    `windows`: batches [B, T + 1] of token ids (inputs [:, :-1], targets [:, 1:]; with
    `scored`, batches of the same shape of a task's scored stream, the targets are its
    [:, 1:]: in-place targets, data=carry). For each
    batch, the parallel forward pass runs with every group at N = max_steps; then, for each
    group g and n = 1 .. N − 1, the rest of the pass is run again from x_g^(n) (every later
    group at N), giving nll_g(n) per token. Every variant uses the noise of the N-run:
    the generator is seeded with `generator_seed` at the start of each batch, and the
    layers before group g and its first n applications are exactly the N-run's, so they
    are not run again (this equals `model(idx, loops=[N, .., n, .., N])` with the generator
    reseeded before it; tests/exits/test_gate.py checks it).

    Returns per group g (features [K, N − 1, d], nll_by_n [K, N]) over the K scored
    tokens: features[:, n − 1] = x_g^(n), nll_by_n[:, n − 1] = nll_g(n); labels follow
    with `gate_labels(nll_by_n, margin)`. float32, on the CPU."""
    N, G = check_gate_setting(model, max_steps)
    feats: list[list[Tensor]] = [[] for _ in range(G)]
    nlls: list[list[Tensor]] = [[] for _ in range(G)]
    windows = list(windows)
    scored = windows if scored is None else list(scored)
    if len(scored) != len(windows) or any(a.shape != b.shape for a, b in zip(windows, scored, strict=True)):
        raise ValueError("collect_gate_data: scored must be batches of the windows' shapes")
    for w, y in zip(windows, scored, strict=True):
        idx, targets = w[:, :-1], y[:, 1:].to(w.device)
        gen = torch.Generator(device=idx.device).manual_seed(int(generator_seed))
        # the N-run, step by step: each group's input, initial state and trajectory
        x = model.embed(idx)
        steps: list[tuple[str, int, Tensor | None, list[Tensor] | None]] = []  # (kind, i, s0, trajectory)
        for kind, i in model.plan:
            if kind == "layer":
                x = model.h[i](x)
                steps.append((kind, i, None, None))
            else:
                s0, traj = model.initial_state(x, gen), []
                e_proj = model.adapters[i].input(x)
                s = s0
                for _ in range(N):
                    s = model.apply_group(i, s, e_proj)
                    traj.append(s)
                steps.append((kind, i, s0, traj))
                x = model.leave_group(i, s)
        nll_N = model.nll(model.decode_logits(x), targets)
        for k, (kind, g, _, traj) in enumerate(steps):
            if kind != "group":
                continue
            by_n = []
            for n in range(1, N):
                by_n.append(_finish(model, steps[k + 1 :], traj[n - 1], targets))
            by_n.append(nll_N)
            nlls[g].append(torch.stack(by_n, -1).reshape(-1, N).float().cpu())
            feats[g].append(torch.stack(traj[: N - 1], -2).reshape(-1, N - 1, x.shape[-1]).float().cpu())
    return [(torch.cat(feats[g]), torch.cat(nlls[g])) for g in range(G)]


def _finish(model: LoopedGPT, rest: list, x: Tensor, targets: Tensor) -> Tensor:
    """The per-token NLL of the pass continued from hidden state x through the plan steps
    `rest`, every group at its N-run length from its N-run initial state s0."""
    for kind, i, s0, traj in rest:
        if kind == "layer":
            x = model.h[i](x)
        else:
            e_proj, s = model.adapters[i].input(x), s0
            for _ in range(len(traj)):
                s = model.apply_group(i, s, e_proj)
            x = model.leave_group(i, s)
    return model.nll(model.decode_logits(x), targets)


# ---------------------------------------------------------------- the gate file
def save_gate(path: str | Path, weight: Tensor, bias: Tensor, meta: dict) -> None:
    """Write a gate file: a dict {format, version, weight [G, d], bias [G], **meta} (torch.save)."""
    torch.save({"format": FORMAT, "version": VERSION, "weight": weight.detach().float().cpu(),
                "bias": bias.detach().float().cpu(), **meta}, str(path))


def load_gate(path: str | Path) -> tuple[Tensor, Tensor, dict]:
    """(weight [G, d], bias [G], the rest of the file) of a gate file written by `save_gate`;
    anything else is a one-line ValueError naming exit.gate and the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"exit.gate: no gate file at {path} (train one with python -m recdepth.train_gate "
                         "ckpt=<path>)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise ValueError(f"exit.gate: {path} is not a readable gate file ({type(e).__name__}: {first})") from None
    if not (isinstance(obj, dict) and obj.get("format") == FORMAT):
        raise ValueError(f"exit.gate: {path} is not a gate file (no format={FORMAT!r}; written by "
                         "python -m recdepth.train_gate)")
    w, b = obj.get("weight"), obj.get("bias")
    if not (isinstance(w, Tensor) and isinstance(b, Tensor) and w.dim() == 2 and b.shape == (w.shape[0],)
            and w.is_floating_point() and b.is_floating_point()):
        raise ValueError(f"exit.gate: {path}: expected weight [G, d] and bias [G] float tensors")
    return w, b, {k: v for k, v in obj.items() if k not in ("weight", "bias")}
