"""The looped GPT-2 of SPEC §1, in one file (nanoGPT lineage).

Over 600 lines: the whole model is kept readable in one file, as nanoGPT's model.py is: the
block's math (written once, for every path), the attention with its sliding window or its
grid, the recurrence, the per-step objective's forward with the halting head's inputs (the
losses themselves: recdepth/training/halting.py), how each parameter starts (`INIT`) and the
FLOP count belong together.

A GPT-2-style decoder (learned absolute positions, tied embeddings, SiLU MLP, sandwich
RMSNorm as in Huginn) in which some contiguous runs of layers — *recurrence groups* —
are applied several times. The paper's pattern is groups = [[4], [5, 6], [7]]; the
Huginn shape (prelude / one recurrent core / coda) is the case of a single group.

Huginn's own architecture (Geiping et al. 2025, seal-rg/recurrent-pretraining) is a set
of options of the same model (docs/spec.md §1b): rotary positions (`position: rope`,
`apply_rope`), a gated SiLU MLP (`mlp: gated_silu`, `gated_silu`), a learned bias on q
and k before the rotation (`qk_bias`, `add_qk_bias`), embeddings scaled by sqrt(d)
(`scale_embeddings`) and the final norm applied to the latent as it leaves the loop
(`latent_norm`, `LoopedGPT.leave_group`). Every option defaults to the GPT-2 model
above, which they leave bit-identical. recdepth/integrations/hf.py reads and writes Huginn's Hugging
Face checkpoints.

One application of group g (layers l_1..l_m), SPEC §1:

    u      = adapter_g(concat(s, e_g))          # Linear(2d -> d, bias=False)
    s_next = layer_{l_m}( ... layer_{l_1}(u) ... )

where e_g is the hidden state entering the group (fixed across applications) and s the
recurrent state, initialised from noise. The adapter is split into its two halves,
W_s s + W_e e_g, so that W_e e_g is computed once per forward pass instead of once per
application (the same function; it saves half the adapter's work and a concat per step).

The configuration (size presets, `GPTConfig` and its checks) is recdepth/model/config.py;
`GPTConfig` is importable from here too, beside the model it configures.

The same blocks serve three paths: the parallel forward (training and validation), the
token-by-token forward with a KV cache (`recdepth.decode.engine`), and trajectory capture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from recdepth.model.config import GPTConfig  # its fields and checks: model_config.py


def token_nll(logits: Tensor, targets: Tensor, other_id: int | None = None, n_other: int = 0) -> Tensor:
    """Per-token negative log-likelihood over the full tokenizer vocabulary (SPEC §4,
    vocabulary): −log softmax(logits)[target], plus log(n_other) where the target is the
    shared "other" entry `other_id`, whose probability is spread evenly over the n_other
    tokenizer ids it stands for. logits [..., V_padded], targets [...] -> [...], in float32
    at least. A target of -1 is not scored (nll 0): a task's non-answer tokens under the
    answers-only loss (`windows.WindowBatches`)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none",
                          ignore_index=-1)
    nll = nll.view(targets.shape)
    if other_id is not None and n_other > 1:
        nll = nll + (targets == other_id).to(nll.dtype) * math.log(n_other)
    return nll


# ------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_angles(positions: Tensor, head_dim: int, base: float) -> Tensor:
    """RoPE's angles θ[p, i] = p · base^(−2i/head_dim), i = 0 .. head_dim/2 − 1, for the
    given positions: [len(positions), head_dim/2], float32 (docs/spec.md §1b; reference:
    recpre/raven_modeling_minimal.py, `precompute_freqs_cis`, whose operations and float32
    precision these follow, so the angles at large positions round as Huginn's did)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return torch.outer(positions.to(torch.float32), inv_freq.to(positions.device))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each ADJACENT channel pair (x[2i], x[2i+1]) of x [..., T, head_dim] by the
    angle θ[t, i] whose cosine and sine are cos, sin [T, head_dim/2]:

        (a, b) -> (a cos θ − b sin θ,  b cos θ + a sin θ)

    i.e. the complex product (a + ib)·e^{iθ}; interleaved pairs, not GPT-NeoX's halves.
    Computed in float32 at least (float64 stays float64), returned in x's dtype
    (docs/spec.md §1b; reference: recpre/raven_modeling_minimal.py,
    `apply_rotary_emb_complex_like`)."""
    dt = torch.promote_types(x.dtype, torch.float32)
    pairs = x.to(dt).unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos.to(dt), sin.to(dt)
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2).to(x.dtype)


class Rotary:
    """cos/sin of `rope_angles` for positions 0 .. block_size − 1, computed once on the CPU
    (as Huginn's buffer is) and kept per device; not a module buffer, so casting the model
    (`.half()`, `.double()`) never rounds the table and it is not part of the state dict."""

    def __init__(self, head_dim: int, block_size: int, base: float):
        self.head_dim, self.block_size, self.base = head_dim, block_size, base
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def extend(self, block_size: int) -> None:
        """Positions 0 .. block_size − 1 from now on (the tables are computed again when asked)."""
        self.block_size = block_size
        self._tables.clear()

    def __call__(self, pos0: int, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos, sin [T, head_dim/2] of positions pos0 .. pos0 + T − 1."""
        table = self._tables.get(device)
        if table is None:
            theta = rope_angles(torch.arange(self.block_size), self.head_dim, self.base)
            table = self._tables[device] = (theta.cos().to(device), theta.sin().to(device))
        return table[0][pos0 : pos0 + T], table[1][pos0 : pos0 + T]


def add_qk_bias(q: Tensor, k: Tensor, qk_bias: Tensor) -> tuple[Tensor, Tensor]:
    """q + qk_bias[0], k + qk_bias[1] for q, k [B, T, n_head, head_dim] and qk_bias
    [2, 1, n_head, head_dim] (a bias per head and channel, the same at every position),
    BEFORE the rotary embedding (docs/spec.md §1b; reference:
    recpre/raven_modeling_minimal.py, `CausalSelfAttention.forward`)."""
    return (q + qk_bias[0]).to(q.dtype), (k + qk_bias[1]).to(k.dtype)


class CausalSelfAttention(nn.Module):
    """The attention's parameters (the q/k/v and output projections, Huginn's q/k bias) and
    `attend`, the attention proper over a decoding cache or the parallel pass; the block's
    math around it is `qkv_of` and `block_out`."""

    def __init__(self, cfg: GPTConfig, rotary: Rotary | None = None):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)  # [q; k; v] rows, head-major within each
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, cfg.n_head, cfg.head_dim)) if cfg.qk_bias else None
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.rotary = rotary  # shared by every layer (position=rope), else None
        self.window = cfg.attention_window  # sliding-window attention: the last W positions, or None
        self.grid = cfg.attention == "grid"  # a cell and its four grid neighbours (`grid_attention`)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache=None, pos: int = 0, rows: Tensor | None = None) -> Tensor:
        """softmax(q kᵀ / sqrt(hd)) v, causal (a grid model: over each cell's grid neighbours,
        `grid_attention`, the parallel pass only), for q, k, v [B, H, T, hd] of positions pos ..
        pos + T − 1, each query reading positions `first(p)` .. p (`window_mask`). cache:
        None (the parallel pass) or one layer's decoding cache (recdepth/decode/kv_cache.py),
        which this chunk's k/v are written to and the attended k/v read from."""
        W = self.window
        if self.grid:
            if cache is not None:
                raise ValueError(GRID_PARALLEL_ONLY)
            return grid_attention(q, k, v)
        if cache is None:
            if W is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(0, q.shape[2], 0, W, q.device))
        T = q.shape[2]
        cache.write(pos, k, v, rows)
        if T > 1:  # a chunk: T new tokens at positions pos..pos+T-1, each attending up to its own
            # position (recdepth/decode/generation.py's verify pass; its chunk caches write all T entries)
            ck, cv = cache.read(pos + T - 1)
            return F.scaled_dot_product_attention(q, ck, cv, attn_mask=window_mask(pos, T, 0, W, q.device))
        ck, cv = cache.read(pos)  # one new token at position `pos`, attending to positions first(pos)..pos
        lo = first(pos, W)
        ck, cv = ck[:, :, lo:], cv[:, :, lo:]
        if rows is None or rows.dtype == torch.bool:
            return F.scaled_dot_product_attention(q, ck, cv)
        return attend_rows(q, ck, cv, rows)


# The one-line refusal of every token-by-token path on a grid model (Block.attend with a cache,
# the lean decode step, which computes attention without Block.attend).
GRID_PARALLEL_ONLY = ("model.attention: a grid model's cells read cells after them, so it runs the parallel pass "
                      "only (training, eval.regime=parallel), not token-by-token decoding")


def window_grid_side(T: int) -> int:
    """N of a grid model's window of T = N² + 2 positions (its EOT, N × N cells, its newline);
    a window of another length is a one-line error (`GPTConfig.attention`)."""
    n = math.isqrt(max(T - 2, 0))
    if T < 3 or n * n != T - 2:
        raise ValueError(f"model.attention: grid reads each window as EOT, an N x N grid and a newline (N² + 2 "
                         f"tokens), got a window of {T} (model.block_size must be N² + 2 for the task's N)")
    return n


_GRID_NEIGHBOURS: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}


def grid_neighbours(T: int, device) -> tuple[Tensor, Tensor]:
    """Which positions each position of a grid window reads: index [T, 5] (itself, then the
    cell to its left, right, above, below, row-major from position 1) and valid [T, 5] (a
    neighbour inside the grid; the EOT at 0 and the newline at T − 1 read themselves only)."""
    key = (T, str(device))
    if key not in _GRID_NEIGHBOURS:
        n = window_grid_side(T)
        p = torch.arange(T)
        c = p - 1  # the cell's index, row-major
        row, col = c.div(n, rounding_mode="floor"), c.remainder(n)
        cell = (p >= 1) & (p <= n * n)
        index = torch.stack([p, p - 1, p + 1, p - n, p + n], dim=1)
        valid = torch.stack([torch.ones_like(cell), cell & (col > 0), cell & (col < n - 1), cell & (row > 0),
                             cell & (row < n - 1)], dim=1)
        index = torch.where(valid, index, p[:, None])  # an invalid slot points at the position itself, masked
        _GRID_NEIGHBOURS[key] = (index.to(device), valid.to(device))
    return _GRID_NEIGHBOURS[key]


def grid_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q kᵀ / sqrt(hd)) v over each position's grid neighbours (`grid_neighbours`) for
    q, k, v [B, H, T, hd]: the 5 keys of each query gathered ([B, H, T, 5, hd]), so memory and
    work grow with T, not T² (a dense mask over a 15,000-cell grid would hold 2.25e8 entries
    a head). Equal to scaled_dot_product_attention with the neighbour mask (tests/model/)."""
    index, valid = grid_neighbours(q.shape[2], q.device)
    kn, vn = k[:, :, index], v[:, :, index]  # [B, H, T, 5, hd]
    scores = (q.unsqueeze(3) * kn).sum(-1) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return (weights.unsqueeze(-1) * vn).sum(3)


def first(pos: int, window: int | None) -> int:
    """The first position a query at `pos` attends to: 0, or pos − W + 1 under a window W."""
    return 0 if window is None else max(0, pos - window + 1)


def window_mask(pos: int, T: int, lo: int, window: int | None, device) -> Tensor:
    """[T, pos + T − lo] bool: may the query at position pos + i read the key at position
    lo + j (j <= i + pos − lo, and within the window)."""
    q = torch.arange(pos, pos + T, device=device)[:, None]
    k = torch.arange(lo, pos + T, device=device)
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    return mask


def attend_rows(q: Tensor, ck: Tensor, cv: Tensor, rows: Tensor) -> Tensor:
    """One token's attention in a compacted batch: q [b, H, 1, hd] holds the cache rows
    `rows` (an index into ck, cv [B, H, n, hd]) only. Under half the rows: over a copy of
    their entries; else over the full cache (no copy of it) with zero queries in the other
    rows, keeping the listed rows' output (the faster of the two at each fraction, measured
    on the oracle: docs/results/decode-speed.md)."""
    if 2 * rows.numel() < ck.shape[0]:
        return F.scaled_dot_product_attention(q, ck.index_select(0, rows), cv.index_select(0, rows))
    qf = q.new_zeros((ck.shape[0], *q.shape[1:]))
    qf[rows] = q
    return F.scaled_dot_product_attention(qf, ck, cv)[rows]


def gated_silu(h: Tensor) -> Tensor:
    """SiLU(a) ⊙ b for h = [a, b] split into halves along the last dimension (the first
    half gated by SiLU, the second linear) (docs/spec.md §1b; reference:
    recpre/raven_modeling_minimal.py, `GatedMLP.forward`)."""
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


class MLP(nn.Module):
    """The MLP's parameters: proj(SiLU(fc(x))) (SPEC §1), or with mlp=gated_silu
    proj(gated_silu(fc(x))), fc then d -> 2I (the math: `block_out`)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gated = cfg.mlp == "gated_silu"
        hidden = cfg.mlp_hidden
        self.fc = nn.Linear(cfg.n_embd, (2 if self.gated else 1) * hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=False)


# The block's math, once: `Block.forward` (every path through the model) and the lean
# one-token step (recdepth/decode/lean_step.py) both call `qkv_of` and `block_out` with a
# block's `BlockWeights`; only the attention between them differs by path (a parallel pass,
# a decoding cache, a loop compiled whole).
class BlockWeights(NamedTuple):
    """The tensors of one block (`Block.weights()`), by name."""

    norm1: Tensor
    qkv: Tensor
    qk_bias: Tensor | None
    proj: Tensor
    norm2: Tensor
    norm3: Tensor
    fc: Tensor
    mlp_proj: Tensor
    norm4: Tensor


# Largest weight (elements) whose one-row product `linear` writes out for the compiler: 1 MiB
# of float32 (measured to pay at d = 128 and to lose at d = 768: docs/results/decode-speed.md).
FUSED_MATVEC_MAX = 1 << 18


def linear(x: Tensor, w: Tensor) -> Tensor:
    """`F.linear(x, w)` (no bias). Compiled, for one row and a small w, written as a product
    and a sum over d: inductor then fuses the matrix-vector product into the layer's one
    kernel, where an `mm` is an external call that first copies its [1, d] operand (inductor
    gives the size-1 dimension stride 0, which BLAS refuses). Eager, and for more rows or a
    larger w, `F.linear`."""
    if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1 and w.numel() <= FUSED_MATVEC_MAX:
        return (x.unsqueeze(-2) * w).sum(-1)
    return F.linear(x, w)


def qkv_of(x: Tensor, w: BlockWeights, n_head: int, eps: float,
           rope: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The attention's inputs q, k, v [B, H, T, hd] of x [B, T, d]: norm1, the one q/k/v
    projection, Huginn's q/k bias, then the rotation by `rope` = (cos, sin) [T, hd/2] of the
    positions (position=rope; None: learned positions, added at the embedding)."""
    B, T, C = x.shape
    h = F.rms_norm(x, (C,), w.norm1, eps)
    q, k, v = linear(h, w.qkv).view(B, T, 3, n_head, C // n_head).unbind(2)  # each [B, T, H, hd]
    if w.qk_bias is not None:
        q, k = add_qk_bias(q, k, w.qk_bias)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return q, k, v


def block_out(x: Tensor, y: Tensor, w: BlockWeights, eps: float, gated: bool) -> Tensor:
    """The rest of the block from the attention's output y [B, H, T, hd] (SPEC §1's sandwich):
    x = norm2(proj(y) + x);  x = norm4(mlp(norm3(x)) + x)."""
    B, T, C = x.shape
    x = F.rms_norm(linear(y.transpose(1, 2).reshape(B, T, C), w.proj) + x, (C,), w.norm2, eps)
    h = linear(F.rms_norm(x, (C,), w.norm3, eps), w.fc)
    h = gated_silu(h) if gated else F.silu(h)
    return F.rms_norm(linear(h, w.mlp_proj) + x, (C,), w.norm4, eps)


class Block(nn.Module):
    """Sandwich-normalised layer (SPEC §1):
    x = norm2(attn(norm1(x)) + x);  x = norm4(mlp(norm3(x)) + x)."""

    def __init__(self, cfg: GPTConfig, rotary: Rotary | None = None):
        super().__init__()
        d, eps = cfg.n_embd, cfg.norm_eps
        self.norm1, self.norm2 = RMSNorm(d, eps), RMSNorm(d, eps)
        self.norm3, self.norm4 = RMSNorm(d, eps), RMSNorm(d, eps)
        self.attn = CausalSelfAttention(cfg, rotary)
        self.mlp = MLP(cfg)
        self.eps = eps

    def weights(self) -> BlockWeights:
        a = self.attn
        return BlockWeights(self.norm1.weight, a.qkv.weight, a.qk_bias, a.proj.weight, self.norm2.weight,
                            self.norm3.weight, self.mlp.fc.weight, self.mlp.proj.weight, self.norm4.weight)

    def forward(self, x: Tensor, cache=None, pos: int = 0, rows: Tensor | None = None) -> Tensor:
        """x [B, T, d] at positions pos .. pos + T − 1; `cache`, `rows`: `CausalSelfAttention.attend`."""
        w = self.weights()
        rope = None if self.attn.rotary is None else self.attn.rotary(pos, x.shape[1], x.device)
        q, k, v = qkv_of(x, w, self.attn.n_head, self.eps, rope)
        return block_out(x, self.attn.attend(q, k, v, cache, pos, rows), w, self.eps, self.mlp.gated)


class Adapter(nn.Module):
    """Looped-input projection Linear(2d -> d, bias=False) applied to concat(s, e),
    stored as its two d x d halves: adapter(concat(s, e)) = W_s s + W_e e."""

    def __init__(self, d: int):
        super().__init__()
        self.state = nn.Linear(d, d, bias=False)  # W_s
        self.input = nn.Linear(d, d, bias=False)  # W_e

    def weight(self) -> Tensor:
        """The full [d, 2d] matrix of Linear(2d -> d) on concat(s, e)."""
        return torch.cat([self.state.weight, self.input.weight], dim=1)


def halt_logit(x: Tensor, weight: Tensor, bias: Tensor, normed: bool, eps: float = 1e-6) -> Tensor:
    """A halting head's logit z = w · f(x) + b over the last axis of x [..., d] (weight [d],
    bias []), f(x) = x (`halt_head: state`) or x / rms(x) (`normed`, no weight, ε = 1e-6 fixed:
    the exit rule reads the head without the model's config); λ = σ(z).
    The one definition the training pass (`LoopedGPT.forward`) and the exit rule `halt`
    (recdepth/exits/rules/builtin.py) read. A per-row sum, not a matmul: a row's z does not depend
    on the rows beside it (as the gate's, recdepth/exits/gate.py)."""
    if normed:
        x = F.rms_norm(x, (x.shape[-1],), None, eps)
    return (x * weight).sum(-1) + bias


# -------------------------------------------------------------------------- model
# How `LoopedGPT.reset_parameters` starts each parameter, by its name with the layer indices
# taken out: every parameter is named here, so a new one is a choice, not a silent default
# (docs/contributing.md, "Change the block"). sigma: truncated normal at σ; out: at σ_out (the
# output projections); fc: the MLP's input (gated_silu: half at σ, half at σ_out); ones,
# zeros; halt: the halting head (weight 0, bias halt_bias).
INIT = {
    "wte.weight": "sigma", "wpe.weight": "sigma", "h.attn.qkv.weight": "sigma",
    "adapters.input.weight": "sigma", "adapters.state.weight": "sigma",
    "h.attn.proj.weight": "out", "h.mlp.proj.weight": "out", "h.mlp.fc.weight": "fc",
    "h.norm1.weight": "ones", "h.norm2.weight": "ones", "h.norm3.weight": "ones", "h.norm4.weight": "ones",
    "ln_f.weight": "ones", "h.attn.qk_bias": "zeros", "lm_bias": "zeros",
    "halt.weight": "halt", "halt.bias": "halt",
}


def init_of(name: str) -> str:
    """How `reset_parameters` starts the parameter `name` (a state-dict name): its entry in
    `INIT`; a parameter INIT does not name is a one-line error."""
    key = ".".join(part for part in name.split(".") if not part.isdigit())
    if key not in INIT:
        raise ValueError(f"LoopedGPT.reset_parameters: parameter {name!r} has no initialisation; add {key!r} to "
                         "INIT in recdepth/model/looped.py (docs/contributing.md, 'Change the block')")
    return INIT[key]


class LoopedGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.n_embd
        self.wte = nn.Embedding(cfg.padded_vocab_size, d)
        self.wpe = nn.Embedding(cfg.block_size, d) if cfg.position == "learned" else None
        rotary = Rotary(cfg.head_dim, cfg.block_size, cfg.rope_base) if cfg.position == "rope" else None
        self.h = nn.ModuleList(Block(cfg, rotary) for _ in range(cfg.n_layer))
        self.adapters = nn.ModuleList(Adapter(d) for _ in cfg.groups)
        self.ln_f = RMSNorm(d, cfg.norm_eps)
        self.lm_bias = nn.Parameter(torch.zeros(cfg.padded_vocab_size)) if cfg.logit_bias else None
        # one halting head per recurrence group, on its state: weight [G, d], bias [G], the shape
        # of a gate (recdepth/exits/gate.py), which exit=halt reads it as
        self.halt = nn.Linear(d, len(cfg.groups)) if cfg.halt_head is not None else None
        # Execution plan: ("layer", l) runs layer l once, ("group", g) loops group g.
        starts = {g[0]: i for i, g in enumerate(cfg.groups)}
        looped = {layer for g in cfg.groups for layer in g}
        self.plan: list[tuple[str, int]] = []
        for layer in range(cfg.n_layer):
            if layer in starts:
                self.plan.append(("group", starts[layer]))
            elif layer not in looped:
                self.plan.append(("layer", layer))
        self.reset_parameters()

    @property
    def n_groups(self) -> int:
        return len(self.cfg.groups)

    # ---------------------------------------- Huginn's names (one recurrence group)
    def _single_group(self, what: str) -> list[int]:
        if self.n_groups != 1:
            raise ValueError(f"model.groups: {what} is defined for exactly one recurrence group (Huginn's "
                             f"prelude / core / coda), this model has {self.n_groups}: {self.cfg.groups}")
        return self.cfg.groups[0]

    @property
    def prelude(self) -> list[int]:
        """Indices of the layers before the one recurrence group (Huginn's prelude)."""
        return list(range(self._single_group("prelude")[0]))

    @property
    def core(self) -> list[int]:
        """Indices of the layers of the one recurrence group (Huginn's recurrent core block)."""
        return list(self._single_group("core"))

    @property
    def coda(self) -> list[int]:
        """Indices of the layers after the one recurrence group (Huginn's coda)."""
        return list(range(self._single_group("coda")[-1] + 1, self.cfg.n_layer))

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Huginn's "takase" init (SPEC §1): truncated normal at ±3σ, σ = sqrt(2/(5d)) for
        embeddings, qkv, adapters and MLP input; σ/sqrt(2·L_eff) for the output
        projections of attention and MLP; norm weights 1. With mlp=gated_silu the linear
        half of fc takes σ/sqrt(2·L_eff) too, and qk_bias starts at 0 (Huginn's
        `init_glu`, `_init_weights`; docs/spec.md §1b)."""
        sigma = math.sqrt(2 / (5 * self.cfg.n_embd))
        sigma_out = sigma / math.sqrt(2 * self.cfg.effective_depth)
        for name, p in self.named_parameters():
            how = init_of(name)
            if how == "halt":  # the halting head starts at λ = σ(halt_bias) everywhere
                nn.init.constant_(p, self.cfg.halt_bias if name == "halt.bias" else 0.0)
            elif how == "zeros":
                nn.init.zeros_(p)
            elif how == "ones":
                nn.init.ones_(p)
            elif how == "fc" and self.cfg.mlp == "gated_silu":
                # Huginn's init_glu: the SiLU half at σ, the linear half at σ_out
                for half, s in zip(p.chunk(2, dim=0), (sigma, sigma_out)):
                    nn.init.trunc_normal_(half, mean=0.0, std=s, a=-3 * s, b=3 * s)
            else:
                s = sigma_out if how == "out" else sigma
                nn.init.trunc_normal_(p, mean=0.0, std=s, a=-3 * s, b=3 * s)

    def grow_block(self, block_size: int, key: str = "eval.task") -> None:
        """Read windows of up to `block_size` tokens, more than the model was built for (longer
        task instances than it trained on): rotary angles are computed for any position, so
        a `rope` model only extends its table; learned positions (`wpe`) end at their table
        and refuse in one line naming `key`. Smaller or equal: nothing changes."""
        if block_size <= self.cfg.block_size:
            return
        if self.wpe is not None:
            raise ValueError(f"{key}: these instances need windows of {block_size} tokens, and this model's learned "
                             f"positions end at block_size={self.cfg.block_size} (a model with position=rope reads "
                             "any length)")
        self.cfg.block_size = block_size
        rotary = self.h[0].attn.rotary if len(self.h) else None
        if rotary is not None:
            rotary.extend(block_size)

    @torch.no_grad()
    def init_logit_bias(self, log_prior: Tensor) -> None:
        """Start the logit bias at a log unigram prior [vocab_size] (see GPTConfig.logit_bias):
        the untrained model then predicts token frequencies, so no layer has to learn them."""
        if self.lm_bias is None:
            raise ValueError("init_logit_bias: the model was built with logit_bias=False")
        if log_prior.shape != (self.cfg.vocab_size,):
            raise ValueError(f"init_logit_bias: expected a prior of shape ({self.cfg.vocab_size},), got {tuple(log_prior.shape)}")
        self.lm_bias.zero_()
        self.lm_bias[: self.cfg.vocab_size] = log_prior.to(self.lm_bias)

    # ------------------------------------------------------------- the loop
    def initial_state(self, e: Tensor, generator: torch.Generator | None = None,
                      row_seeds: Sequence[int] | None = None) -> Tensor:
        """s^(init) for a group entered with hidden state e (SPEC §1).

        With `row_seeds` (one per row of e), row b's noise is drawn from a generator seeded
        with row_seeds[b] alone, so it does not depend on which rows share the batch (SPEC
        §4, noise and batches); otherwise the whole tensor is drawn from `generator`."""
        if self.cfg.state_init == "zero":
            return torch.zeros_like(e)
        if self.cfg.state_init == "input":
            return e
        std = self.cfg.state_std
        s = torch.empty_like(e)
        if row_seeds is None:
            return nn.init.trunc_normal_(s, 0.0, std, -3 * std, 3 * std, generator=generator)
        if len(row_seeds) != e.shape[0]:
            raise ValueError(f"initial_state: {len(row_seeds)} row seeds for {e.shape[0]} rows")
        g = torch.Generator(device=e.device)
        drawn: dict[int, int] = {}  # seed -> the row that drew it
        for b, seed in enumerate(row_seeds):
            if seed in drawn:  # the same seed draws the same noise (the oracle's rows of a window)
                s[b] = s[drawn[seed]]
                continue
            drawn[seed] = b
            nn.init.trunc_normal_(s[b], 0.0, std, -3 * std, 3 * std, generator=g.manual_seed(seed))
        return s

    def apply_group(self, g: int, s: Tensor, e_proj: Tensor, cache=None, pos: int = 0, rows=None) -> Tensor:
        """One application of group g (SPEC §1); `e_proj` = W_e e_g, computed once per pass."""
        u = self.adapters[g].state(s) + e_proj
        for layer in self.cfg.groups[g]:
            u = self.h[layer](u, None if cache is None else cache[layer], pos, rows)
        return u

    def run_group(
        self,
        g: int,
        e: Tensor,
        n: int,
        backprop_depth: int | None = None,
        generator: torch.Generator | None = None,
        record: list[Tensor] | None = None,
        graded: list[tuple[int, Tensor]] | None = None,
    ) -> Tensor:
        """Apply group g n times from a fresh initial state; return the final state.

        Truncated backprop: only the last `backprop_depth` applications carry gradient,
        the first n - k run under no_grad (the gradient still reaches e through the
        adapter of every graded application). `record`, if given, receives every state
        x^(0) .. x^(n-1) the group computes (the trajectory of SPEC §2); `graded`, if
        given, (t, state after application t) of the applications that carry gradient
        (the per-step losses' inputs, recdepth/training/objective.py).
        """
        if n < 1:
            raise ValueError(f"loops: group {g} needs at least 1 application, got {n}")
        e_proj = self.adapters[g].input(e)
        s = self.initial_state(e, generator)
        free = 0 if backprop_depth is None or not torch.is_grad_enabled() else max(n - backprop_depth, 0)
        if free:
            with torch.no_grad():
                e_free = e_proj.detach()
                for _ in range(free):
                    s = self.apply_group(g, s, e_free)
                    if record is not None:
                        record.append(s)
        for t in range(free + 1, n + 1):
            s = self.apply_group(g, s, e_proj)
            if record is not None:
                record.append(s)
            if graded is not None:
                graded.append((t, s))
        return s

    def leave_group(self, g: int, s: Tensor) -> Tensor:
        """What group g passes on from its final state s: ln_f(s) with `latent_norm`
        (Huginn: `iterate_forward` returns ln_f(x); docs/spec.md §1b), else s itself. The
        one place this happens: the parallel forward and token-by-token decoding
        (recdepth/decode/engine.py: decode_step) both call it. The group's trajectory (its
        recorded states, the exit rules' inputs) is the states before it."""
        return self.ln_f(s) if self.cfg.latent_norm else s

    # --------------------------------------------------------------- forward
    def decode_logits(self, x: Tensor) -> Tensor:
        """The decoding head: final norm + tied LM head (+ logit bias), padded entries
        masked to -inf."""
        logits = F.linear(self.ln_f(x), self.wte.weight, self.lm_bias)
        if self.cfg.padded_vocab_size != self.cfg.vocab_size:
            logits[..., self.cfg.vocab_size :] = float("-inf")
        return logits

    def nll(self, logits: Tensor, targets: Tensor) -> Tensor:
        """`token_nll` with this model's "other" entry."""
        return token_nll(logits, targets, self.cfg.other_id, self.cfg.n_other)

    def embed(self, idx: Tensor, pos0: int = 0) -> Tensor:
        """Input embeddings of idx [B, T] at positions pos0 .. pos0 + T − 1: wte(idx), plus
        wpe(position) with learned positions (rope rotates q and k in the attention instead),
        the sum times sqrt(n_embd) with scale_embeddings (Huginn: `RavenForCausalLM.forward`,
        input_embeds * emb_scale; docs/spec.md §1b). Huginn has no wpe; recdepth scales it
        with the tokens because scaling the tokens alone leaves the positions at 1/sqrt(d) of
        their size, too small to look anything up by (roots: docs/results/roots.md)."""
        T = idx.shape[1]
        if pos0 + T > self.cfg.block_size:
            raise ValueError(f"sequence of length {pos0 + T} exceeds model.block_size={self.cfg.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(pos0, pos0 + T, device=idx.device))
        return x * self.cfg.emb_scale if self.cfg.scale_embeddings else x

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        loops: Sequence[int] | None = None,
        backprop_depth: int | None = None,
        generator: torch.Generator | None = None,
        trace: list[tuple[str, int, list[Tensor]]] | None = None,
        objective=None,
        step_targets: Tensor | None = None,
        mix: dict[str, float] | None = None,
        halting=None,
        halt_through_state: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """Parallel forward over [B, T] token ids with `loops[g]` applications of group g
        (default: round(mean_recurrence)). Returns (logits, mean cross-entropy or None).

        `objective` (recdepth/training/objective.py, with its `mix` of objectives at this
        step and the data's `step_targets` [B, T, S]): the loss it says, from the logits
        after each graded application of the last recurrence group (each run through the
        layers after the group and the head); without one, or `last` alone, the loss after
        the last application.

        `halting` (with targets; a model with a halting head, `halt_head`): a function of the
        keywords of `HaltInputs` (recdepth/training/halting.py) returning a halting loss,
        added to the loss. On one group it sees every application n = 1 .. N: the head's
        logit z_n, the NLL of the final targets decoded after n (the applications outside the
        backprop window decoded without gradient, their states detached), whether that argmax
        is the target, and the NLL of the output decoded from a mixture of the states (ACT).
        With several groups (`sampled`), one group drawn uniformly (from `generator`), and of
        it each row's one application n drawn uniformly from 1 .. N and the last, N: the rest
        of the pass run again from x^(n) without gradient (the later groups at this pass's
        counts) gives L_n. (The drawn group's term estimates the mean over groups.) With
        `halt_through_state` false the head reads the states detached (`halt.through_state`).

        `trace`, if given, receives the hidden states in depth order, one entry per step of
        the plan: ("layer", l, [output of layer l]) or ("group", g, [x_g^(0) .. x_g^(n-1)]),
        the group's trajectory (SPEC §2). It holds references to tensors the forward
        computes anyway, so recording changes nothing the model returns."""
        loops = self.default_loops() if loops is None else list(loops)
        if len(loops) != self.n_groups:
            raise ValueError(f"loops: expected {self.n_groups} loop counts (one per group), got {loops}")
        mix = None if objective is None else (mix or {objective.steps: 1.0})
        per_step = targets is not None and mix is not None and any(w and k != "last" for k, w in mix.items())
        if per_step and not self.n_groups:
            raise ValueError("loss.steps: a per-step objective needs a recurrence group (model=baseline has none)")
        last_group = max((k for k, (kind, _) in enumerate(self.plan) if kind == "group"), default=-1)
        halt = halting is not None and targets is not None
        if halt and self.halt is None:
            raise ValueError("halt.loss: this model has no halting head (model config halt_head is null)")
        graded: list[tuple[int, Tensor]] = []
        states: dict[int, list[Tensor]] = {}  # plan index k of a group -> its states x^(1) .. x^(N) (halting)
        noise: dict[int, Tensor] = {}  # plan index k of a group -> the generator's state as it entered (halting)
        x = self.embed(idx)
        for k, (kind, i) in enumerate(self.plan):
            rec = None if trace is None else []
            if kind == "layer":
                x = self.h[i](x)
                if rec is not None:
                    rec.append(x)
            else:
                if halt and rec is None:
                    rec = []
                if halt and generator is not None and self.n_groups > 1:  # an earlier group's L_n replays it
                    noise[k] = generator.get_state()
                x = self.leave_group(i, self.run_group(i, x, loops[i], backprop_depth, generator, rec,
                                                       graded if per_step and k == last_group else None))
                if halt:
                    states[k] = rec
            if trace is not None:
                trace.append((kind, i, rec))
        logits = self.decode_logits(x)
        loss = None
        if targets is None:
            return logits, loss
        decoded: dict[int, Tensor] = {}  # t -> the logits after application t of the last group
        if per_step or halt:
            g, after, n_last = self.plan[last_group][1], self.plan[last_group + 1 :], loops[self.plan[last_group][1]]

            def after_step(t: int, s: Tensor) -> Tensor:
                if t not in decoded:
                    decoded[t] = logits if t == n_last else self.decode_after(after, g, s)
                return decoded[t]
        if not per_step:  # mean token_nll over the scored targets (-1: not scored)
            scored = (targets >= 0).sum().clamp(min=1)
            loss = self.nll(logits, targets).sum() / scored
        else:
            loss = objective.loss(mix, logits, [(t, after_step(t, s)) for t, s in graded], targets, step_targets,
                                  self.nll)
        if halt and len(states) == 1:
            loss = loss + self._halting_loss(halting, states[last_group], after_step, targets, halt_through_state)
        elif halt:  # several groups: one drawn group's term at one drawn application a row (docs/spec.md §1d)
            groups = list(states)
            k = groups[int(torch.randint(len(groups), (1,), generator=generator,
                                         device="cpu" if generator is None else generator.device))]
            loss = loss + self._sampled_halting_loss(halting, k, states[k], logits, targets, loops, generator, noise,
                                                     halt_through_state)
        return logits, loss

    def _sampled_halting_loss(self, halting, k: int, states: list[Tensor], logits: Tensor, targets: Tensor,
                              loops: Sequence[int], generator: torch.Generator | None,
                              noise: dict[int, Tensor], through: bool = True) -> Tensor:
        """`forward`'s halting term of a group (plan index k) of a multi-group model over its states x^(1) ..
        x^(N): each row's drawn application n and the last, N (`HaltInputs.sampled`); L_n from
        the rest of the pass run again from x^(n) without gradient (each later group's initial
        noise the pass's own, replayed from `noise`), L_N from the pass's `logits`."""
        g, N, B = self.plan[k][1], len(states), targets.shape[0]
        dev = targets.device
        n = torch.randint(0, N, (B,), generator=generator, device=dev if generator is None else generator.device)
        x_n = torch.stack(states)[n.to(dev), torch.arange(B, device=dev)]  # [B, T, d]: row b's x^(n_b + 1)
        with torch.no_grad():
            x = self.leave_group(g, x_n)
            for j, (kind, i) in enumerate(self.plan[k + 1 :], k + 1):
                if kind == "layer":
                    x = self.h[i](x)
                    continue
                replay = None
                if j in noise:
                    replay = torch.Generator(device=generator.device)
                    replay.set_state(noise[j])
                x = self.leave_group(i, self.run_group(i, x, loops[i], generator=replay))
            both = torch.stack([self.decode_logits(x), logits.detach()])  # [2, B, T, V]: after n, after N
        nll = self.nll(both, targets.expand(both.shape[:-1]))
        right = (both.argmax(-1) == targets) & (targets >= 0)
        w, b, normed = self.halt.weight[g], self.halt.bias[g], self.cfg.halt_head == "normed"
        z = torch.stack([halt_logit(s if through else s.detach(), w, b, normed) for s in (x_n, states[-1])])
        z = z.to(torch.promote_types(z.dtype, torch.float32))

        def mixture(p: Tensor) -> Tensor:
            raise ValueError("halt.loss: a multi-group model's halting term has one drawn application per token, "
                             "not the states a mixture needs")

        return halting(z=z, nll=nll, right=right, scored=targets >= 0, mixture=mixture, sampled=True)

    def _halting_loss(self, halting, states: list[Tensor], after_step, targets: Tensor, through: bool = True) -> Tensor:
        """`forward`'s halting term of the one recurrence group over its states x^(1) .. x^(N),
        `after_step(t, x)` the logits decoded after application t."""
        steps = []
        for t, s in enumerate(states, 1):
            if s.requires_grad or not torch.is_grad_enabled():
                steps.append(after_step(t, s))
            else:  # outside the backprop window: its loss is a number the head's weights are fitted to
                with torch.no_grad():
                    steps.append(after_step(t, s))
        stacked = torch.stack(steps)  # [N, B, T, V]
        nll = self.nll(stacked, targets.expand(stacked.shape[:-1]))
        right = (stacked.argmax(-1) == targets) & (targets >= 0)
        last = max(k for k, (kind, _) in enumerate(self.plan) if kind == "group")
        g, after = self.plan[last][1], self.plan[last + 1 :]
        w, b = self.halt.weight[g], self.halt.bias[g]
        z = torch.stack([halt_logit(s if through else s.detach(), w, b, self.cfg.halt_head == "normed") for s in states])
        xs = torch.stack(states)

        def mixture(p: Tensor) -> Tensor:  # ACT: the output decoded from Σ_n p_n x^(n)
            return self.nll(self.decode_after(after, g, (p.unsqueeze(-1).to(xs.dtype) * xs).sum(0)), targets)

        z = z.to(torch.promote_types(z.dtype, torch.float32))
        return halting(z=z, nll=nll, right=right, scored=targets >= 0, mixture=mixture)

    def decode_after(self, after: Sequence[tuple[str, int]], g: int, s: Tensor) -> Tensor:
        """The logits of group g's state s passed on (`leave_group`) through the layers `after` it."""
        return self.decode_logits(self._run_layers(after, self.leave_group(g, s)))

    def _run_layers(self, plan: Sequence[tuple[str, int]], x: Tensor) -> Tensor:
        for _, i in plan:  # layers only: nothing follows the last group but layers
            x = self.h[i](x)
        return x

    def default_loops(self) -> list[int]:
        return [round(self.cfg.mean_recurrence)] * self.n_groups

    # ----------------------------------------------------------------- FLOPs
    def flops_per_token(self, loops: Sequence[int], seq_len: int, backprop_depth: int | None, train: bool) -> float:
        """FLOPs per token of one pass that ran `loops[g]` applications of group g.

        Matmul FLOPs (2 per multiply-add) of every layer application actually run, plus
        attention (nanoGPT's 2·2·T·d per layer application, forward) and the LM head.
        Training counts 3x (forward + backward) for graded work and 1x for the
        applications that truncated backprop ran under no_grad. Element-wise work (norms,
        activations, RoPE, biases) is not counted. Under a sliding window W the attention
        reads min(T, W) positions.
        """
        d, layer = self.cfg.n_embd, self.layer_flops(seq_len)
        fwd_graded = (self.cfg.n_layer - sum(len(g) for g in self.cfg.groups)) * layer
        fwd_graded += self.head_flops()
        fwd_free = 0.0
        for g, n in zip(self.cfg.groups, loops):
            app = len(g) * layer + 2 * d * d  # layers + W_s s
            fwd_graded += 2 * d * d  # W_e e, once per pass
            k = n if (backprop_depth is None or not train) else min(n, backprop_depth)
            fwd_graded += k * app
            fwd_free += (n - k) * app
        return (3 * fwd_graded + fwd_free) if train else (fwd_graded + fwd_free)

    def layer_flops(self, seq_len: int | None = None) -> float:
        """Forward FLOPs of one layer application for one token: its matmuls, 2 per
        multiply-add (qkv 3d², proj d², the MLP's fc and proj: 8d² at I = 4d), plus with
        `seq_len` the attention over min(seq_len, window) positions (nanoGPT's 2·2·T·d).
        `layer_flops()` (no attention) is the unit of an exit check's price in layer
        equivalents (docs/spec.md §4b)."""
        d = self.cfg.n_embd
        mlp = (3 if self.cfg.mlp == "gated_silu" else 2) * d * self.cfg.mlp_hidden  # fc d->(2)I, proj I->d
        flops = 2 * (4 * d * d + mlp)
        if seq_len is not None:
            T = seq_len if self.cfg.attention_window is None else min(seq_len, self.cfg.attention_window)
            flops += 4 * T * d
        return float(flops)

    def head_flops(self) -> float:
        """Forward FLOPs of the LM head for one token: 2·d·V over the padded vocabulary (the
        final norm and the logit bias are element-wise, not counted, as in `flops_per_token`)."""
        return float(2 * self.cfg.n_embd * self.cfg.padded_vocab_size)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
