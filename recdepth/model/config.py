"""The looped GPT-2's configuration (SPEC §1, §1b): size presets, `GPTConfig` with a docstring
per field, and the checks it runs at construction (`check_architecture`, `validate_groups`),
which the run config's schema (recdepth/config/groups.py) also runs before any data is
read. The network it configures is recdepth/model/looped.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from recdepth.core.checks import is_int, is_number

# Size presets. `cpu` trains in minutes on a 2-core laptop; `paper` is the paper's GPT-2;
# `tiny` is for tests (seconds); `huginn-0125` is Huginn-0125's published shape
# (recpre/raven_config_minimal.py: RavenConfig defaults; 2 + 4 + 2 layers, with
# groups [[2, 3, 4, 5]]). A preset may also set intermediate_size.
SIZES: dict[str, dict[str, int]] = {
    "cpu": dict(n_layer=12, n_head=4, n_embd=128, block_size=128),
    "paper": dict(n_layer=12, n_head=12, n_embd=768, block_size=512),
    "tiny": dict(n_layer=8, n_head=4, n_embd=64, block_size=64),
    "huginn-0125": dict(n_layer=8, n_head=55, n_embd=5280, block_size=4096, intermediate_size=17920),
}
STATE_INITS = ("normal", "zero", "input")
HALT_HEADS = ("state", "normed")  # what a halting head reads (GPTConfig.halt_head)
HALT_READINGS = ("sum", "cdf", "direct")  # how exit=halt reads it (GPTConfig.halt_reading)
POSITIONS = ("learned", "rope", "none")
ATTENTIONS = ("causal", "grid")  # GPTConfig.attention
MLPS = ("silu", "gated_silu")
# The architecture options beyond the shape, with the defaults that are the GPT-2 model
# of SPEC §1 (GPTConfig documents each). intermediate_size belongs with the shape (a
# size preset may set it).
OPTION_DEFAULTS: dict[str, object] = dict(position="learned", rope_base=10000.0, mlp="silu", qk_bias=False,
                                          scale_embeddings=False, latent_norm=False, norm_eps=1e-6,
                                          attention_window=None, attention="causal")


def shape_of(size: str, **overrides) -> dict:
    """A size preset's fields with the overrides that are not None on top."""
    if size not in SIZES:
        raise ValueError(f"model.size: unknown size {size!r} (expected one of {', '.join(SIZES)})")
    return {**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}


@dataclass
class GPTConfig:
    """Architecture of a looped GPT-2. Validated at construction."""

    n_layer: int = 12
    """Number of distinct layers L (numbered 0..L-1, like nanoGPT's h.0 .. h.{L-1})."""
    n_head: int = 12
    """Attention heads per layer; must divide n_embd."""
    n_embd: int = 768
    """Model width d."""
    block_size: int = 512
    """Context length (learned absolute position embeddings)."""
    vocab_size: int = 50257
    """Real vocabulary size (GPT-2's 50257, or a compact corpus vocabulary plus its
    shared "other" entry)."""
    n_other: int = 0
    """Tokenizer ids that share the model's last logit, the "other" entry of a compact
    vocabulary (SPEC §4, vocabulary): p(id) = p(other) / n_other for each of them, so the
    loss stays a cross-entropy over the full tokenizer vocabulary (`token_nll`). 0 = no
    shared entry (every tokenizer id has its own logit)."""
    groups: list[list[int]] = field(default_factory=lambda: [[4], [5, 6], [7]])
    """Recurrence groups: disjoint, contiguous, in-range, ordered runs of layer indices."""
    mean_recurrence: float = 12.0
    """r, the mean number of applications per group; sets L_eff of the init (SPEC §1)."""
    state_init: str = "normal"
    """Initial recurrent state: `normal` (fresh truncated Gaussian noise, Huginn),
    `zero`, or `input` (s = e_g)."""
    state_std: float = math.sqrt(2 / 5)
    """Per-coordinate std of the `normal` initial state (Huginn: sqrt(2/5), cut at 3 std)."""
    logit_bias: bool = True
    """Add a learned bias to the logits, initialised to the train split's log unigram
    prior (`LoopedGPT.init_logit_bias`). DEVIATION from SPEC §1 (tied head, no bias): with
    the sandwich norm and no bias, a small model fits token frequencies by growing a
    constant direction in its last layer, whose post-sum norm then squashes every token's
    state onto that direction (pairwise cosine 0.96 at layer 11) and starves the layers
    below of gradient; on Shakespeare it stayed at the unigram CE for 1000 steps. With
    the prior in the bias it learns at once (val CE 5.29 vs 6.30 after 200 steps).
    `logit_bias: false` is SPEC's model exactly."""
    pad_vocab_multiple: int = 64
    """The embedding/LM-head rows are padded up to a multiple of this (speed); padded
    logits are masked to -inf so they never take probability mass."""
    # --- Huginn's architecture options (docs/spec.md §1b); the defaults are SPEC §1's model
    position: str = "learned"
    """Positions: `learned` (GPT-2's absolute embedding `wpe`, SPEC §1), `rope` (rotary
    embedding of q and k in every attention, adjacent pairs, `apply_rope`; no `wpe`; Huginn)
    or `none` (no position at all: attention reads its keys as a set; `attention: grid`)."""
    rope_base: float = 10000.0
    """RoPE's base b (> 1): pair i turns by angle p·b^(−2i/head_dim) at position p
    (Huginn-0125: 50000). Read only with position=rope."""
    mlp: str = "silu"
    """`silu`: proj(SiLU(fc(x))) (SPEC §1); `gated_silu`: proj(SiLU(a) ⊙ b) with
    [a, b] = fc(x) split in halves (`gated_silu`; Huginn's GatedMLP)."""
    intermediate_size: int | None = None
    """The MLP's hidden width I (fc: d -> I, or d -> 2I gated; proj: I -> d). None: 4d for
    `silu`, and for `gated_silu` 8d/3 rounded up to a multiple of 64 (about the 4d MLP's
    parameter count, LLaMA's rule). Huginn-0125: 17920."""
    qk_bias: bool = False
    """A learned bias on queries and keys, per head and channel, added before the rotation
    (`add_qk_bias`; Huginn). Starts at zero; never weight-decayed."""
    scale_embeddings: bool = False
    """Multiply the input embeddings (the token's, plus the learned position's where there is
    one) by sqrt(n_embd) after the lookup (Huginn's emb_scale), so that they start at about
    the size of a block's output (std sqrt(2/5)) rather than 1/sqrt(d) of it. The `normal`
    initial state is unaffected (its std is `state_std` either way)."""
    latent_norm: bool = False
    """Apply the final norm `ln_f` to each recurrence group's final state as it leaves the
    loop, before the layer after the group (`LoopedGPT.leave_group`; Huginn's iterate_forward
    returns ln_f(x)). It is the same `ln_f` (one weight) that normalises before the LM head;
    with several groups every group's exit passes through it."""
    norm_eps: float = 1e-6
    """ε of every RMSNorm (> 0)."""
    attention_window: int | None = None
    """Sliding-window attention in every layer: position p attends to positions
    p − W + 1 .. p only (W >= 1; None: every earlier position, SPEC §1). With W = 2
    information moves one position per layer application, so a looped group propagates it
    one position per application (the carry task of docs/tasks.md)."""
    attention: str = "causal"
    """`causal` (each position reads itself and earlier ones, SPEC §1) or `grid`: each window
    is one N × N grid (its EOT, the N² cells row by row, its newline: N² + 2 positions), and a
    cell reads itself and its four grid neighbours only, in both directions; the EOT and the
    newline read themselves (`grid_attention`: a gather of 5 keys a position, not a dense
    mask, so a 15,000-cell grid costs 5 keys a cell). N is read off each window's length, so
    one model reads grids of any size (DeepThinking's mazes, data=mazes). Needs
    position=none and no attention_window; the parallel pass only (training,
    eval.regime=parallel): a cell reads cells after it, so there is no token-by-token decoding."""
    # --- a halting head trained with the loop (`halt.*`, recdepth/training/halting.py)
    halt_head: str | None = None
    """None (no head), or what the halting heads read: `state` (their recurrence group's state
    x^(n)) or `normed` (x^(n) / rms(x^(n)), no weight). One head per group, Linear(d -> G) as a
    whole, λ_n = σ(w_g · f(x^(n)) + b_g) (`looped.halt_logit`)."""
    halt_bias: float = -3.0
    """The head's initial bias b (λ ≈ σ(−3) ≈ 0.05 at the start: a zero or positive bias traps
    ACT runs, arXiv 2604.21999)."""
    halt_reading: str = "cdf"
    """How `exit=halt` reads the head, set by the loss that trained it: `sum` (ACT: halt once
    1 − Σ_{j≤n} λ_j < τ), `cdf` (PonderNet, Ouro: ∏_{j≤n} (1 − λ_j) < τ) or `direct` (correct:
    1 − λ_n < τ)."""

    def __post_init__(self):
        self.groups = check_architecture(self.n_layer, self.n_head, self.n_embd, self.block_size, self.groups,
                                         self.state_init, self.intermediate_size,
                                         **{k: getattr(self, k) for k in OPTION_DEFAULTS})
        for name in ("vocab_size", "pad_vocab_multiple"):
            _check_positive(name, getattr(self, name))
        if isinstance(self.n_other, bool) or not isinstance(self.n_other, int) or self.n_other < 0:
            raise ValueError(f"model.n_other: expected an integer >= 0, got {self.n_other!r}")
        if not (isinstance(self.mean_recurrence, (int, float)) and self.mean_recurrence >= 1):
            raise ValueError(f"model.mean_recurrence: expected a number >= 1, got {self.mean_recurrence!r}")
        check_halt_head(self.halt_head, self.halt_bias, self.halt_reading, len(self.groups))

    @property
    def other_id(self) -> int | None:
        """The model id of the shared "other" entry (the last one), or None without it."""
        return self.vocab_size - 1 if self.n_other else None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width I (`intermediate_size`, or its default)."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        if self.mlp == "gated_silu":
            third = -(-8 * self.n_embd // 3)  # ceil(8d/3)
            return -(-third // 64) * 64
        return 4 * self.n_embd

    @property
    def emb_scale(self) -> float:
        """The factor on input embeddings: sqrt(n_embd) with scale_embeddings, else 1."""
        return math.sqrt(self.n_embd) if self.scale_embeddings else 1.0

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def effective_depth(self) -> float:
        """L_eff: layer applications per forward pass at the mean recurrence (SPEC §1)."""
        looped = sum(len(g) for g in self.groups)
        return (self.n_layer - looped) + self.mean_recurrence * looped

    @classmethod
    def from_size(cls, size: str, **overrides) -> GPTConfig:
        return cls(**shape_of(size, **overrides))

    def to_dict(self) -> dict:
        return asdict(self)


def _check_positive(name: str, v) -> None:
    if not is_int(v) or v < 1:
        raise ValueError(f"model.{name}: expected a positive integer, got {v!r}")


def check_architecture(n_layer: int, n_head: int, n_embd: int, block_size: int, groups,
                       state_init: str, intermediate_size: int | None = None, *, position: str = "learned",
                       rope_base: float = 10000.0, mlp: str = "silu", qk_bias: bool = False,
                       scale_embeddings: bool = False, latent_norm: bool = False,
                       norm_eps: float = 1e-6, attention_window: int | None = None,
                       attention: str = "causal") -> list[list[int]]:
    """The fields of a GPTConfig that do not depend on the data (shape, recurrence groups,
    initial state, architecture options), checked with one line naming the field each;
    returns the groups as lists of ints. GPTConfig checks itself with it, and the run
    config's schema (recdepth/config/schema.py) checks `model` with it before any data is read."""
    for name, v in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd), ("block_size", block_size)):
        _check_positive(name, v)
    if n_embd % n_head:
        raise ValueError(f"model.n_embd: {n_embd} is not divisible by model.n_head={n_head}")
    if state_init not in STATE_INITS:
        raise ValueError(f"model.state_init: unknown {state_init!r} (expected one of {', '.join(STATE_INITS)})")
    if intermediate_size is not None:
        _check_positive("intermediate_size", intermediate_size)
    if position not in POSITIONS:
        raise ValueError(f"model.position: unknown {position!r} (expected one of {', '.join(POSITIONS)})")
    if not is_number(rope_base) or rope_base <= 1:
        raise ValueError(f"model.rope_base: expected a finite number > 1, got {rope_base!r}")
    if position == "rope" and (n_embd // n_head) % 2:
        raise ValueError(f"model.position: rope rotates pairs of channels, but the head dimension "
                         f"n_embd/n_head = {n_embd // n_head} is odd")
    if mlp not in MLPS:
        raise ValueError(f"model.mlp: unknown {mlp!r} (expected one of {', '.join(MLPS)})")
    for name, v in (("qk_bias", qk_bias), ("scale_embeddings", scale_embeddings), ("latent_norm", latent_norm)):
        if not isinstance(v, bool):
            raise ValueError(f"model.{name}: expected true or false, got {v!r}")
    if not is_number(norm_eps) or norm_eps <= 0:
        raise ValueError(f"model.norm_eps: expected a finite number > 0, got {norm_eps!r}")
    if attention_window is not None and (isinstance(attention_window, bool) or not isinstance(attention_window, int)
                                         or attention_window < 1):
        raise ValueError(f"model.attention_window: expected null or an integer >= 1 (positions attended, the "
                         f"token's own included), got {attention_window!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"model.attention: unknown {attention!r} (expected one of {', '.join(ATTENTIONS)})")
    if attention == "grid" and (position != "none" or attention_window is not None):
        raise ValueError(f"model.attention: grid reads a cell's four neighbours as a set, the same at every grid size, "
                         f"so it needs model.position=none and model.attention_window=null (got position={position}, "
                         f"attention_window={attention_window})")
    return validate_groups(groups, n_layer)


def check_halt_head(head: str | None, bias: float, reading: str, n_groups: int) -> None:
    """The halting head's fields (one line naming `halt.*`, where a run sets them)."""
    if head is None:
        return
    if head not in HALT_HEADS:
        raise ValueError(f"halt.input: unknown {head!r} (expected one of {', '.join(HALT_HEADS)})")
    if not is_number(bias):
        raise ValueError(f"halt.init_bias: expected a finite number, got {bias!r}")
    if reading not in HALT_READINGS:
        raise ValueError(f"halt.reading: unknown {reading!r} (expected one of {', '.join(HALT_READINGS)})")
    if n_groups < 1:
        raise ValueError("halt.loss: a halting head reads a recurrence group's state, and this model has none")


def validate_groups(groups, n_layer: int) -> list[list[int]]:
    """Check SPEC §1's rules for recurrence groups; return them as lists of ints."""
    if groups is None:
        return []
    try:
        groups = [[int(layer) for layer in g] for g in groups]
    except TypeError:
        raise ValueError(f"model.groups: expected a list of lists of layer indices, got {groups!r}") from None
    seen: set[int] = set()
    last = -1
    for g in groups:
        if not g:
            raise ValueError(f"model.groups: empty group in {groups}")
        for layer in g:
            if not 0 <= layer < n_layer:
                raise ValueError(
                    f"model.groups: layer {layer} in group {g} is out of range 0..{n_layer - 1}"
                )
            if layer in seen:
                raise ValueError(f"model.groups: layer {layer} appears in more than one group ({groups})")
            seen.add(layer)
        if g != list(range(g[0], g[0] + len(g))):
            raise ValueError(f"model.groups: group {g} is not a contiguous increasing run of layers")
        if g[0] <= last:
            raise ValueError(f"model.groups: groups must be listed in layer order, got {groups}")
        last = g[-1]
    return groups
