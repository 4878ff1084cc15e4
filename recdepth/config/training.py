"""The config groups of how a training run runs and what it logs: `trainer` (the Lightning
Trainer), `optim`, `logger` (CSV, W&B) and `callbacks` (loop-geometry diagnostics), one
dataclass per group of `conf/`, every key typed, documented with its default and
range-checked in `__post_init__`. What a run computes (model, sampler, exit, data, eval)
is recdepth/config/groups.py; recdepth/config/schema.py composes both and re-exports
these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recdepth.analysis import diagnostics
from recdepth.core.checks import check_int, check_number, check_one_of

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
WANDB_MODES = ("auto", "online", "offline", "disabled")
STRATEGIES = ("auto", "ddp")  # recdepth/training/distributed.py


@dataclass
class TrainerConfig:
    """`trainer`: the Lightning Trainer (recdepth/train.py). conf/trainer/: default, gpu, ddp."""

    max_steps: int = 800
    """Optimiser steps (>= 1)."""
    val_check_interval: int = 200
    """Validate every this many steps, and at the end (>= 1)."""
    checkpoint_every: int = 200
    """Write checkpoints/last.ckpt every this many steps (>= 1; atomically)."""
    gradient_clip_val: float | None = 1.0
    """Gradient-norm clip (>= 0); null = none."""
    accelerator: str = "auto"
    """auto | cpu | gpu | cuda | mps (gpu and cuda need a CUDA device)."""
    devices: int | str = 1
    """Processes (CPU) or GPUs (>= 1, or auto); > 1 needs strategy=ddp (trainer=ddp)."""
    num_nodes: int = 1
    """Always 1: recdepth runs on one node."""
    strategy: str = "auto"
    """auto | ddp (recdepth/training/distributed.py)."""
    precision: str = "32-true"
    """32-true | bf16-mixed | 16-mixed | bf16-true | 64-true (fp32 is faster than bf16 autocast on CPU)."""
    compile: bool = False
    """torch.compile each block (GPU; on a CPU with a C++ compiler too: experiment=prefixsums
    trained 1.2x faster, docs/results/extrapolation.md)."""
    log_every_n_steps: int = 10
    """Log training metrics every this many steps (>= 1)."""
    enable_progress_bar: bool = True
    """Lightning's progress bar."""
    peak_flops: float | None = None
    """MFU denominator in FLOP/s (> 0); null = known GPU table or measured CPU matmul peak."""

    def __post_init__(self):
        for k in ("max_steps", "val_check_interval", "checkpoint_every", "log_every_n_steps"):
            check_int(f"trainer.{k}", getattr(self, k), 1)
        check_number("trainer.gradient_clip_val", self.gradient_clip_val, null=True)
        check_one_of("trainer.accelerator", self.accelerator, ACCELERATORS)
        check_one_of("trainer.precision", self.precision, PRECISIONS)
        check_one_of("trainer.strategy", self.strategy, STRATEGIES)
        if self.devices != "auto":
            check_int("trainer.devices", self.devices, 1)
        if self.num_nodes != 1:
            raise ValueError(f"trainer.num_nodes: recdepth runs on one node (got {self.num_nodes}); "
                             "use trainer=ddp with trainer.devices=<GPUs of the node>")
        if self.strategy == "auto" and self.devices not in (1, "auto"):
            raise ValueError(f"trainer.devices: {self.devices} processes need trainer.strategy=ddp (trainer=ddp)")
        check_number("trainer.peak_flops", self.peak_flops, strict=True, null=True)


@dataclass
class OptimConfig:
    """`optim`: nanoGPT's AdamW with linear warmup and cosine decay (recdepth/training/lit.py)."""

    lr: float = 1.0e-3
    """Peak learning rate (> 0)."""
    weight_decay: float = 0.1
    """AdamW weight decay (>= 0), on >= 2-D tensors only."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's two betas, each in [0, 1)."""
    eps: float = 1.0e-8
    """AdamW's epsilon (>= 0)."""
    warmup_steps: int = 40
    """Linear warmup steps (>= 0)."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at trainer.max_steps (in [0, 1])."""

    def __post_init__(self):
        check_number("optim.lr", self.lr, strict=True)
        check_number("optim.weight_decay", self.weight_decay)
        check_number("optim.eps", self.eps)
        if not (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)):
            raise ValueError(f"optim.betas: expected two numbers in [0, 1), got {list(self.betas)!r}")
        check_int("optim.warmup_steps", self.warmup_steps, 0)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio: expected a number in [0, 1], got {self.min_lr_ratio!r}")


@dataclass
class WandbConfig:
    """`logger.wandb`: Weights & Biases, beside the CSV logger (conf/logger/wandb.yaml)."""

    project: str = "recdepth"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); null = the account's default."""
    mode: str = "auto"
    """auto (online if an API key is configured and W&B starts within init_timeout, else
    offline) | online | offline | disabled."""
    init_timeout: float = 15.0
    """Seconds W&B may take to start an online run (W&B's own setting; auto then goes offline)."""
    tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""

    def __post_init__(self):
        check_one_of("logger.wandb.mode", self.mode, WANDB_MODES)
        check_number("logger.wandb.init_timeout", self.init_timeout, strict=True)


@dataclass
class LoggerConfig:
    """`logger`: metrics always go to <run_dir>/csv/metrics.csv. conf/logger/: csv, wandb."""

    wandb: WandbConfig | None = None
    """Also log to Weights & Biases (logger=wandb); null = CSV only."""


@dataclass
class LoopGeometryConfig:
    """What a loop-geometry measurement runs (recdepth/analysis/diagnostics.py, SPEC §2): the held-out
    batch, the loops, Fig. 1's sequence, the memory bound, the noise."""

    sequences: int = 4
    """Rows of the fixed held-out batch (>= 1; the first val tokens)."""
    seq_len: int | None = None
    """Tokens per row (2 .. the block size); null = the model's block size."""
    loops: int = 30
    """Applications of every group (>= 3; paper appendix: 30)."""
    pca_sequence: int = 0
    """The row Fig. 1 shows (0 .. sequences - 1)."""
    pca_tokens: int = 32
    """Its first tokens drawn in Fig. 1 (>= 1; one polyline each)."""
    max_state_bytes: int = 268435456
    """Memory bound for captured trajectories in bytes (>= 1; rows go in chunks)."""
    seed: int = 0
    """Initial-state noise of the diagnostics (the same at every checkpoint)."""
    figures: bool = True
    """Draw Figs. 1, 2, 3, 5 (at the end of training; after recdepth.diagnose)."""

    def __post_init__(self):
        prefix = "callbacks.loop_dynamics" if isinstance(self, LoopDynamicsConfig) else "loop_dynamics"
        check_int(f"{prefix}.sequences", self.sequences, 1)
        diagnostics.check_loop_dynamics(getattr(self, "every_n_steps", 1), self.loops, self.pca_sequence, self.sequences,
                             self.pca_tokens, self.max_state_bytes, prefix)


@dataclass
class LoopDynamicsConfig(LoopGeometryConfig):
    """`callbacks.loop_dynamics`: loop-geometry diagnostics at every checkpoint
    (recdepth/training/callbacks.py: LoopDynamics; conf/callbacks/loop_dynamics.yaml)."""

    every_n_steps: int = 200
    """Measure every this many steps (>= 1); the YAML ties it to trainer.checkpoint_every."""


@dataclass
class CallbacksConfig:
    """`callbacks`: conf/callbacks/: loop_dynamics (the default) | none (model=baseline's)."""

    loop_dynamics: LoopDynamicsConfig | None = None
    """Loop-geometry diagnostics; null = none (callbacks=none; a model without loops has nothing to measure)."""
