"""The states the learned exit gate (SPEC §3c, recdepth/exits/gate.py) is fitted on: those the
decoding engine visits.

`recdepth.exits.gate.collect_gate_data` takes its states from the parallel forward pass, where
the token at application n attends to every earlier token at application n. Decoding does
not work that way: a token's loop attends to the cached K/V of the earlier tokens after
their last application (SPEC §4, cache=latest), so at small n the parallel pass shows the
gate states it never meets at evaluation. Here the states come from the decoding engine
itself, as the oracle does (`recdepth.decode.scoring.evaluate_oracle`): each window is decoded
as N rows side by side, row n stopping after n applications, every row reading the
history of row N (exit=fixed at N). Row n's final loop state at position t is x^(n)
as decoding meets it after n applications, and its target NLL is nll(n): the features
and the NLLs `gate_labels` turns into labels.

With more than one recurrence group, row n stops every group after n applications (the
oracle's uniform depth), so group g's label reads the loss with every group at n, not
with the others at N as in the parallel collector.

Core: torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recdepth.core.progress import Progress
from recdepth.decode.engine import REFERENCE, decode_windows
from recdepth.decode.settings import DecodeSettings
from recdepth.exits.gate import check_gate_setting
from recdepth.exits.policy import build
from recdepth.model.looped import LoopedGPT


@torch.no_grad()
def decoding_gate_data(model: LoopedGPT, windows: Tensor, max_steps: int, settings: DecodeSettings = REFERENCE,
                       keep: Tensor | None = None, targets: Tensor | None = None) -> list[tuple[Tensor, Tensor]]:
    """Per group g (features [K, N − 1, d], nll_by_n [K, N]) over the K kept targets of
    `windows` [W, T + 1] (token ids; each row is decoded as a fresh window, inputs
    [:, :-1], targets [:, 1:]): features[:, n − 1] = the group's final state after n
    applications in decoding, nll_by_n[:, n − 1] = the target's NLL there, N = max_steps.
    `keep` [W, T] (bool) selects the targets (a task's answers); default all. `targets`
    [W, T + 1]: a task's scored stream aligned with `windows` (in-place targets, data=carry),
    which the NLLs are taken against in place of the next token. Each window decodes as N rows
    side by side, with the noise of sequence w (`RowNoise` key w)."""
    N, G = check_gate_setting(model, max_steps)
    W, T1 = windows.shape
    T = T1 - 1
    if keep is None:
        keep = torch.ones(W, T, dtype=torch.bool)
    if tuple(keep.shape) != (W, T):
        raise ValueError(f"decoding_gate_data: keep of shape {tuple(keep.shape)} for {W} windows of {T} targets")
    if targets is not None and tuple(targets.shape) != (W, T1):
        raise ValueError(f"decoding_gate_data: targets of shape {tuple(targets.shape)} for {W} windows of {T1} tokens")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    fixed = build("fixed", None, max_steps=N)
    limit = torch.arange(1, N + 1, device=device)  # row n − 1 stops after n applications
    feats: list[list[Tensor]] = [[] for _ in range(G)]
    nlls: list[Tensor] = []
    progress = Progress(f"decoding the gate's states ({N} depths a window)", W)
    for w in range(W):
        progress.update(0)
        trace: list[Tensor] = []
        nll, _, _, _ = decode_windows(model, windows[w].to(device=device, dtype=torch.long), [(0, T)], fixed,
                                      settings, reps=N, limit=limit, first_window=w, trace=trace,
                                      targets=None if targets is None else targets[w])
        st = torch.stack(trace, 1)                       # [n, position, group, d]
        nlls.append(nll.T[keep[w]].float())              # [K_w, N]
        for g in range(G):
            feats[g].append(st[: N - 1, :, g].transpose(0, 1)[keep[w]])  # [K_w, N − 1, d]
        progress.update()
    progress.close()
    model.train(was_training)
    nll_by_n = torch.cat(nlls)
    return [(torch.cat(feats[g]), nll_by_n) for g in range(G)]
