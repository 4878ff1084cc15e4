"""The parallel regime (docs/spec.md §4): every position of an instance loops at once, as in
training, and an exit rule stops positions or the whole instance.

Token-by-token decoding (recdepth/decode/engine.py) hands each token the earlier ones
finished; here every position of the instance runs application j together, each reading the
others' states at j − 1, as the training pass does. The rule is read per position:

    level=token     a position stops when its rule fires and keeps its state, which the
                    others go on reading (the Universal Transformer's halting: a halted
                    position's state is copied forward); with `wake`, a stopped position
                    starts again after an application in which a position in its attention
                    window changed (what it reads moved, so its state would have), and its
                    rule decides again
    level=sequence  the instance stops after the first application at which every position's
                    rule fires together (every position's check says "done" at once); no
                    position stops before

`ParallelRun.apps` counts each position's applications (its own loop), `steps` the
applications the instance ran (the parallel pass's depth: its slowest position, or where the
sequence stopped). A parallel pass computes every position at every one of its steps, so its
compute is `steps` × positions; a position's `apps` is what its own state took.

One recurrence group (the tasks' models: prelude, one looped group, coda); a decoding rule
decodes every position through the coda in one parallel pass (exit.decode=coda) or through
the head (head). Noise, where state_init draws it, is drawn for a whole instance at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from recdepth.decode.state_decode import decode_mode
from recdepth.exits.policy import ORACLE, ExitPolicy
from recdepth.model.looped import LoopedGPT

LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class ParallelRun:
    """What `parallel_exit` gives for a batch of B instances of T positions."""

    logits: Tensor
    """[B, T, V]: the output of each position's last state."""
    apps: Tensor
    """[B, T] long: the applications each position's state took."""
    steps: Tensor
    """[B] long: the applications the instance's parallel pass ran."""


def check_regime(model: LoopedGPT, regime: str, n_tokens: int, oracle: bool = False) -> None:
    """A grid model (model.attention=grid: a cell reads the cells after it too) has no
    token-by-token decoding: the parallel regime only, no `oracle` (it decodes token by
    token), and whole grids (`n_tokens` scored, a multiple of the block), one line otherwise."""
    if model.cfg.attention != "grid":
        return
    if oracle:
        raise ValueError("exit.name: 'oracle' decodes token by token, which a grid model (model.attention=grid) "
                         "cannot; its bound is the fixed grid (make frontier: hydra.sweeper.oracle=[])")
    if regime != "parallel":
        raise ValueError(f"eval.regime: a grid model (model.attention=grid) reads every cell at once, so it decodes "
                         f"with eval.regime=parallel only, got {regime!r}")
    if n_tokens % (T := model.cfg.block_size):
        raise ValueError(f"eval.tokens: a grid model scores whole grids of {T} tokens (its block here), expected a "
                         f"multiple of {T}, got {n_tokens}")


def check_parallel(model: LoopedGPT, policy: ExitPolicy, level: str, wake: bool) -> None:
    """The parallel regime's settings, one line naming the field each."""
    if wake and model.cfg.attention == "grid":
        raise ValueError("eval.wake: a stopped position wakes when its attention window changes, and a grid "
                         "model's neighbourhood is no window (model.attention=grid)")
    if level not in LEVELS:
        raise ValueError(f"eval.exit_level: expected one of {', '.join(LEVELS)}, got {level!r}")
    if wake and level != "token":
        raise ValueError("eval.wake: a stopped position wakes at level=token only (level=sequence stops every "
                         "position together)")
    if model.n_groups != 1:
        raise ValueError(f"eval.regime: the parallel regime loops one recurrence group, the model has {model.n_groups}")
    if policy.name == ORACLE:
        raise ValueError("exit.name: 'oracle' reads the target, so no loop can run it (the parallel regime neither)")


def window_changed(active: Tensor, window: int | None) -> Tensor:
    """[B, T] bool: whether a position in each position's attention window other than itself
    (positions p − W + 1 .. p − 1; every earlier one with W None) is in `active` [B, T]."""
    c = torch.cumsum(active.long(), 1)
    before = torch.nn.functional.pad(c, (1, 0))[:, :-1]  # active among 0 .. p − 1
    if window is None:
        return before > 0
    lo = torch.nn.functional.pad(c, (window, 0))[:, : c.shape[1]]  # active among 0 .. p − W
    return before - lo > 0


@torch.no_grad()
def parallel_exit(model: LoopedGPT, idx: Tensor, policy: ExitPolicy, level: str = "token", wake: bool = False,
                  generator: torch.Generator | None = None, row_seeds: Sequence[int] | None = None) -> ParallelRun:
    """The instances idx [B, T] through `model` in the parallel regime under `policy` (module
    docstring). At most `policy.max_steps` applications; a position whose rule never fires
    stops there. Initial-state noise: instance b's from a generator seeded with row_seeds[b]
    alone (so a batch gives each instance its result alone), else from `generator`."""
    check_parallel(model, policy, level, wake)
    policy = policy.with_head(model).group(0)
    B, T = idx.shape
    plan = list(model.plan)
    k = next(j for j, (kind, _) in enumerate(plan) if kind == "group")
    x = model.embed(idx)
    for _, i in plan[:k]:
        x = model.h[i](x)
    after = plan[k + 1 :]
    e_proj = model.adapters[0].input(x)
    s = model.initial_state(x, generator, row_seeds)

    def decode(rows: Tensor) -> Tensor:  # [B·T, d] -> [B·T, V]: every position at once
        if decode_mode(model, policy) == "head":
            return model.decode_logits(rows)
        return model.decode_after(after, 0, rows.view(B, T, -1)).flatten(0, 1)

    monitor = policy.monitor(s.flatten(0, 1), decode if policy.needs_decode else None)
    active = torch.ones(B, T, dtype=torch.bool, device=idx.device)
    apps = torch.zeros(B, T, dtype=torch.long, device=idx.device)
    steps = torch.zeros(B, dtype=torch.long, device=idx.device)
    running = torch.ones(B, dtype=torch.bool, device=idx.device)  # instances still looping
    window = model.cfg.attention_window
    for _ in range(policy.max_steps):
        new = model.apply_group(0, s, e_proj)
        s = torch.where(active[..., None], new, s)
        apps += active
        steps += running
        fired = monitor.observe(s.flatten(0, 1), active.flatten()).view(B, T)
        if level == "sequence":
            done = running & fired.all(1)
            running = running & ~done
            active = active & running[:, None]
        else:
            woken = ~active & window_changed(active, window) if wake else None
            active = active & ~fired
            if woken is not None:
                active = active | (woken & running[:, None])
            running = active.any(1)
        if not bool(running.any()):
            break
    logits = model.decode_after(after, 0, s)
    return ParallelRun(logits, apps, steps)
