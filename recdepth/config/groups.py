"""The config groups of what a run computes: one dataclass per group of `conf/` (model,
sampler, exit, eval; data: one per source, each beside its source in recdepth/data/sources/,
re-exported here), every key typed, documented with its default and range-checked
in `__post_init__` with the core classes' own checks. How a training run runs and what it
logs (trainer, optim, logger, callbacks) is recdepth/config/training.py; the roots
that compose them, one per command, and `validated` are recdepth/config/schema.py, which
re-exports these names.
"""


from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from recdepth import exits
from recdepth.core.checks import check_int, check_number, check_one_of
from recdepth.data.sources import DataConfig  # noqa: F401  (the `data` group: one class per source)
from recdepth.decode.settings import DecodeSettings
from recdepth.model.config import OPTION_DEFAULTS, check_architecture, shape_of
from recdepth.training import halting, objective, sampler

CALIBRATION_METHODS = ("empirical", "ltt")



# ------------------------------------------------------------------ groups
@dataclass
class ModelConfig:
    """`model`: the looped GPT-2 (recdepth/model/looped.py). conf/model/: baseline, grouped, single,
    huginn (Huginn's architecture, docs/spec.md §1b)."""

    name: str = "grouped"
    """A label for the run's records (baseline | grouped | single | huginn, or your own); the
    architecture is the fields below, so it is not part of the training identity."""
    size: str = "cpu"
    """Size preset: cpu (12L, 4H, d=128, block 128), paper (12L, 12H, d=768, block 512),
    tiny (8L, 4H, d=64, block 64; tests) or huginn-0125 (8L, 55H, d=5280, block 4096,
    intermediate_size 17920)."""
    groups: list[list[int]] = field(default_factory=lambda: [[4], [5, 6], [7]])
    """Recurrence groups: disjoint, contiguous, ordered runs of layer indices; [] = no loops."""
    n_layer: int | None = None
    """Layers; null takes the size preset's (so do the four below)."""
    n_head: int | None = None
    """Attention heads per layer; must divide n_embd."""
    n_embd: int | None = None
    """Model width d."""
    block_size: int | None = None
    """Context length in tokens."""
    intermediate_size: int | None = None
    """The MLP's hidden width; null: the preset's, else 4d (silu) or 8d/3 rounded up to a
    multiple of 64 (gated_silu)."""
    state_init: str = "normal"
    """Initial recurrent state: normal (Huginn noise) | zero | input."""
    logit_bias: bool = True
    """LM-head bias initialised to the log unigram prior (deviation from SPEC §1; false = SPEC)."""
    position: str = "learned"
    """Positions: learned (GPT-2's absolute embedding) | rope (rotary, Huginn) | none (attention=grid)."""
    rope_base: float = 10000.0
    """RoPE's base (> 1; Huginn-0125: 50000); read with position=rope only."""
    mlp: str = "silu"
    """silu (proj(SiLU(fc x))) | gated_silu (Huginn's GatedMLP: proj(SiLU(a) * b), [a, b] = fc x)."""
    qk_bias: bool = False
    """A learned bias on q and k before the rotation (Huginn)."""
    scale_embeddings: bool = False
    """Input embeddings (token + learned position) times sqrt(n_embd) (Huginn's, for tokens)."""
    latent_norm: bool = False
    """The final norm applied to each recurrence group's final state as it leaves the loop (Huginn)."""
    norm_eps: float = 1.0e-6
    """ε of every RMSNorm (> 0)."""
    attention_window: int | None = None
    """Sliding-window attention: each position attends to the last W positions, its own
    included (null: all earlier ones, SPEC §1)."""
    attention: str = "causal"
    """causal (SPEC §1) | grid: each window one N × N grid (EOT, N² cells row by row, newline),
    a cell reading itself and its four neighbours (data=mazes; needs position=none)."""

    def shape(self) -> dict:
        """n_layer, n_head, n_embd, block_size (and intermediate_size where the preset or
        this config sets it): the size preset with the fields set here on top."""
        return shape_of(self.size, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                        block_size=self.block_size, intermediate_size=self.intermediate_size)

    def options(self) -> dict:
        """The architecture options beyond the shape (recdepth/model/config.py: OPTION_DEFAULTS)."""
        return {k: getattr(self, k) for k in OPTION_DEFAULTS}

    def __post_init__(self):
        self.groups = check_architecture(**self.shape(), groups=self.groups, state_init=self.state_init,
                                         **self.options())


@dataclass
class SamplerConfig:
    """`sampler`: loop counts during training (recdepth/training/sampler.py). conf/sampler/."""

    name: str = "lognormal_poisson"
    """lognormal_poisson (Geiping et al.: n = Poisson(LogNormal) + 1 per group per step) | fixed (n = mean)."""
    mean: float = 12.0
    """r, the mean recurrence (paper: 12; >= 1, an integer for fixed). Validation uses n = round(mean)."""
    sigma: float = 0.5
    """The lognormal's σ (>= 0; fixed ignores it)."""
    backprop_depth: int | None = 8
    """k: applications per group that carry gradient (Huginn: 8; >= 1); null = all."""

    def __post_init__(self):
        sampler.check_args(self.name, self.mean, self.sigma, self.backprop_depth)


@dataclass
class LossConfig:
    """`loss`: where the training loss is taken along the loop (recdepth/training/objective.py,
    docs/spec.md §1c). Validation's val_ce is always the loss after the last application."""

    steps: str = objective.Objective.steps
    """last (after the last application; Geiping et al.) | all (the final target after every
    graded application of the last recurrence group) | trajectory (after application t, the
    data's per-step target: a task that states them, e.g. data=roots)."""
    weights: str = objective.Objective.weights
    """How the per-step losses are averaged over applications t: uniform | linear (∝ t)."""
    anneal_to: str | None = objective.Objective.anneal_to
    """null, or the objective (last | all | trajectory) the loss anneals to: (1 − λ)·L(steps)
    + λ·L(anneal_to), λ rising linearly from 0 at anneal_start to 1 at anneal_end."""
    anneal_start: float = objective.Objective.anneal_start
    """Where the anneal starts, a fraction of trainer.max_steps in [0, 1]."""
    anneal_end: float = objective.Objective.anneal_end
    """Where it ends (λ = 1 from here), a fraction in [anneal_start, 1]."""

    def __post_init__(self):
        objective.check(self.steps, self.weights, self.anneal_to, self.anneal_start, self.anneal_end)


@dataclass
class HaltConfig:
    """`halt`: a halting head trained with the loop (recdepth/training/halting.py, docs/spec.md
    §1d; read at evaluation by exit=halt). conf/halt/: none (the default), act, pondernet,
    entropy, correct; with several recurrence groups (a head each) correct alone, its label
    right or margin (`halting.check_groups`)."""

    loss: str = "none"
    """none (no head) | act | pondernet | entropy | correct (a registered halting loss)."""
    input: str = "state"
    """What the head reads: state (x^(n)) | normed (x^(n) / rms(x^(n)))."""
    init_bias: float = -3.0
    """The head's initial bias (λ ≈ 0.05 at the start; a bias >= 0 traps ACT, arXiv 2604.21999)."""
    beta: float = halting.HaltSettings.beta
    """The halting term's weight (>= 0): ACT's ponder cost, PonderNet's KL, Ouro's entropy
    bonus; correct ignores it."""
    prior: float = halting.HaltSettings.prior
    """PonderNet's geometric prior λ_p, in (0, 1) (its mean depth is 1/λ_p)."""
    epsilon: float = halting.HaltSettings.epsilon
    """ACT's ε, in (0, 1): a token halts once its halting sum reaches 1 − ε."""
    label: str = halting.HaltSettings.label
    """correct's label: right (the argmax after n is the target) | margin (L_n − L_N <= margin)
    | improvement (L_n − L_{n+1} <= margin, Ouro's stage II)."""
    margin: float = halting.HaltSettings.margin
    """Nats (>= 0), for label=margin and improvement."""
    init_from: str | None = None
    """A training checkpoint (last.ckpt) whose weights the run starts from; with `freeze` the
    second stage on a frozen model (Ouro's stage II, the post-hoc gate's setting)."""
    freeze: bool = False
    """Train the halting head only, every other weight as `init_from` left it (needs init_from)."""
    through_state: bool = True
    """Whether the halting loss reaches the model through the states the head reads (true:
    the state is trained to tell the head, as in ACT and PonderNet; false: the head's input
    is detached, and the halting loss moves the model only through its L_n, if it has any)."""

    def settings(self) -> halting.HaltSettings:
        """The numbers the loss reads."""
        return halting.HaltSettings(beta=self.beta, prior=self.prior, epsilon=self.epsilon, label=self.label,
                                    margin=self.margin)

    @property
    def on(self) -> bool:
        return self.loss != "none"

    def __post_init__(self):
        if self.on:
            halting.lookup(self.loss)
        check_one_of("halt.input", self.input, halting.INPUTS)
        check_number("halt.init_bias", self.init_bias, lo=-math.inf)
        self.settings()
        for name in ("freeze", "through_state"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"halt.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.freeze and not self.init_from:
            raise ValueError("halt.freeze: true needs halt.init_from=<a training checkpoint> (the frozen model)")
        if self.init_from is not None and not self.on:
            raise ValueError("halt.init_from: set for halt.loss=none (nothing to train on top of the checkpoint)")


@dataclass
class ExitConfig:
    """`exit`: the exit rule of the evaluation (recdepth/exits/, SPEC §3, §3b); `exit=<rule>` selects a registered rule.
    `tau`, `min_steps` and `max_steps` take one value or a list of one per recurrence group
    (`exit.tau=[1e-3,1e-2,1e-3]`), which OmegaConf cannot type (a union of a number and a
    list): they are `Any` here and checked by `exits.build`, their length against the
    model's groups by `TrainConfig` (and, for a checkpoint, by the evaluation)."""

    name: str = exits.DEFAULT_RULE
    """A registered rule (the built-in ones: recdepth/exits/rules/builtin.py; or one of your own), none
    (fixed) or oracle (evaluation only). `exit=<name>` sets it with the rule's own default τ."""
    tau: Any = exits.lookup(exits.DEFAULT_RULE).default_tau
    """Threshold τ (finite, > 0; gate: a probability in (0, 1); the oracle's ε >= 0), one or
    one per group; fixed, none and argmax_stability ignore it."""
    min_steps: Any = 0
    """No exit before this many applications (>= 0), one or one per group."""
    max_steps: Any = 32
    """Always exit after this many applications (>= 1, >= min_steps), one or one per group."""
    patience: int = 5
    """k of argmax_stability (>= 1): exit once the decoded argmax is the same for k + 1
    applications in a row; the other rules do not read it."""
    gate: str | None = None
    """exit=gate only, required there: the gate.pt written by `python -m recdepth.train_gate`
    (read by `config.exit_policy`); the other rules do not read it."""
    decode: str = "auto"
    """What the rules that decode a state (kl, entropy_diff, argmax_stability) decode it with:
    head (final norm + LM head on the state) | coda (the state as it leaves the loop, then
    the layers after it, then norm + head: Huginn's predict_from_latents; one recurrence
    group only) | auto (coda for a model with one group and a layer after it, else head)."""
    kl_direction: str = "auto"
    """exit=kl: new_old = KL(p^(n) ‖ p^(n−1)) (the paper's) | old_new = KL(p^(n−1) ‖ p^(n))
    (Huginn's code) | auto (old_new for an hf= model, new_old otherwise)."""
    calibrated_on: list[int] | None = None
    """The val-split token range [first, last] this exit was calibrated on (written by
    recdepth.calibrate into exit_overrides.txt); an evaluation whose test range (val tokens
    0 .. eval.tokens) overlaps it is refused. null: not calibrated."""

    def __post_init__(self):
        # the gate file is read (and required) where the policy is built: config.exit_policy
        exits.validate(self.name, self.tau, self.min_steps, self.max_steps, self.patience, decode=self.decode,
                       kl_direction=self.kl_direction)
        c = self.calibrated_on
        if c is not None and (len(c) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in c)
                              or not 0 <= c[0] <= c[1]):
            raise ValueError(f"exit.calibrated_on: expected [first, last] val-token offsets with 0 <= first <= last, "
                             f"got {list(c)}")


@dataclass
class DecodeConfig:
    """How tokens are decoded, the same knobs under the same names in every command:
    `eval.cache`, `eval.warm_start`, `eval.backend` (recdepth.generate reads only these)."""

    cache: str = DecodeSettings.cache
    """K/V of looped layers: latest (SPEC §4) | per_step (one entry per application; needed
    by speculative decoding)."""
    copy_forward: bool = DecodeSettings.copy_forward
    """A position the exit rule stopped after n applications runs one more that only writes
    its K/V, so later tokens read its final state at every deeper application (the Universal
    Transformer's copy forward; counted in its cost). Default false: a stopped position offers
    the input of its last application (Huginn's)."""
    warm_start: bool = DecodeSettings.warm_start
    """Continuous compute (SPEC §4): each group's loop for a token starts from the state it
    ended with for the previous token of the window (the first token: the usual initial state)."""
    backend: str = "lean"
    """How a token's layers are computed (recdepth/decode/lean_step.py): lean (fewer operators,
    eager) | module (Block.forward, the reference) | compiled (lean under torch.compile;
    seconds to compile). Equal up to float rounding; their speed by model size:
    docs/results/decode-speed.md (`recdepth bench decode`)."""
    from_checkpoint: list[str] = field(default_factory=list)
    """Set by the command, not by you: the keys of this block it took from a task checkpoint
    (`EVAL_FROM_CHECKPOINT`, where the command line set none)."""

    def __post_init__(self):
        self.settings()  # validated once, by the object the engine reads

    def settings(self, **more) -> DecodeSettings:
        """These fields (and `more`: the seed, a BOS id) as the engine's `DecodeSettings`."""
        return DecodeSettings(cache=self.cache, copy_forward=self.copy_forward, warm_start=self.warm_start,
                              backend=self.backend, **more)


# The eval keys a task's checkpoint carries (its experiment's choices: conf/experiment/) and the
# evaluation commands (evaluate, calibrate, report, train-gate, make frontier) take as their
# defaults on it; a value on the command line wins (recdepth.cli.runner.checkpoint_eval).
EVAL_FROM_CHECKPOINT = ("tokens", "context_steps", "cache", "regime")


@dataclass
class EvalConfig(DecodeConfig):
    """`eval`: the exit evaluation (recdepth/decode/scoring.py, SPEC §4): how tokens are decoded
    (`DecodeConfig`) and what is scored and timed."""

    tokens: int = 4096
    """Held-out next-token predictions scored token by token (eval_tokens.csv); after
    training, 0 skips the evaluation (>= 0; recdepth.evaluate needs >= 1)."""
    batch_size: int = 16
    """Held-out windows decoded side by side for quality/cost (>= 1; each row = its batch-1 result)."""
    latency_tokens: int = 256
    """The first this many tokens timed again at batch 1 (ms/token; >= 0) ..."""
    repeats: int = 3
    """... this many times (>= 1): median and min-max."""
    latency_backend: str | None = "auto"
    """How those batch-1 latency passes compute a token's layers: null = as eval.backend,
    module | lean | compiled, or auto (the default) = compiled where it is measured to pay,
    else as eval.backend: a process timing at least 8 settings (a sweep's shared pass: `make
    frontier`, the report) on a CPU with a C++ compiler (`scoring.latency_backend_for`). The
    quality pass keeps eval.backend; the two are equal up to float rounding, and each job's
    `batch_check` counts timed tokens whose applications differ. Its first calls (the compile)
    run in the untimed warm-up; what it saves: docs/results/sweep-time.md."""
    warmup_tokens: int = DecodeSettings.warmup_tokens
    """Untimed decode steps before timing starts (>= 0)."""
    answers: bool | None = DecodeSettings.answers
    """Score a task's answer tokens only (docs/spec.md §6): null = yes on data=task (the
    only data with answers), true = required, false = every token (labels kept)."""
    split: str = "test"
    """The held-out split scored: test | extrapolation (data=task: harder instances than
    any trained on; recdepth.evaluate only)."""
    task: dict[str, Any] = field(default_factory=dict)
    """A task checkpoint with eval.split=extrapolation: fields of its data.task set anew for
    the evaluated data, given as `+eval.task.<field>=<value>` (Hydra's + adds a key), e.g.
    `+eval.task.extrapolation=[256,256]` (256-bit additions) or `+eval.task.ripple=1` (carry:
    one carry through every bit). The evaluated model's block grows to the longest instance's
    need where its positions allow (rope); learned positions refuse in one line. Empty: the
    checkpoint's."""
    regime: str = DecodeSettings.regime
    """sequential (token by token with a K/V cache, SPEC §4) | parallel (every position of a
    window loops at once, as in training; docs/exits.md)."""
    exit_level: str = DecodeSettings.exit_level
    """With regime=parallel: token (a position stops when its rule fires and keeps its
    state, which the others read) | sequence (the window stops when every position's rule
    fires together)."""
    wake: bool = DecodeSettings.wake
    """With regime=parallel, exit_level=token: a stopped position starts again after an
    application in which a position in its attention window changed."""
    context_steps: int | None = DecodeSettings.context_steps
    """A task (docs/spec.md §6): positions whose target is not an answer (the statements,
    operands, terms: the prompt) loop exactly this many applications and the exit rule
    decides at answer positions only; null: the rule decides at every position."""

    def __post_init__(self):
        super().__post_init__()
        check_one_of("eval.split", self.split, ("test", "extrapolation"))
        if self.task and self.split != "extrapolation":
            raise ValueError("eval.task: sets the extrapolation split's instances anew; add eval.split=extrapolation")
        check_int("eval.tokens", self.tokens, 0)

    def settings(self, **more) -> DecodeSettings:
        """The eval block as the engine's `DecodeSettings` (`more`: the seed, a BOS id)."""
        return DecodeSettings(cache=self.cache, copy_forward=self.copy_forward, warm_start=self.warm_start,
                              backend=self.backend, context_steps=self.context_steps, batch_size=self.batch_size,
                              warmup_tokens=self.warmup_tokens, latency_tokens=self.latency_tokens,
                              repeats=self.repeats, latency_backend=self.latency_backend, answers=self.answers,
                              regime=self.regime, exit_level=self.exit_level, wake=self.wake, **more)
