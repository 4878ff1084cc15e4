"""The config schema: every key of `conf/`, typed, documented and range-checked, in one place.

One dataclass per config group (recdepth/config/groups.py and schema_training.py; re-exported here), and a
root per command, registered in Hydra's ConfigStore: `TrainConfig` (conf/config.yaml, `python -m recdepth.train`),
`EvaluateConfig` (conf/evaluate.yaml, `python -m recdepth.evaluate`),
`TrainGateConfig` (conf/train_gate.yaml, `python -m recdepth.train_gate`) and
`GenerateConfig` (conf/generate.yaml, `python -m recdepth.generate`), besides the calibrate
and report roots. The YAML files name their root first in their defaults lists, so the groups
compose onto it: a group file sets values; the keys and their types are the schema's.

Every failure is one line naming the dotted field (`trainer.max_steps: expected an
integer >= 1, got 0`), from two checks:
1. types and keys, while Hydra composes (`seed=abc`, a typo'd key): OmegaConf refuses them
   and `config_error` condenses its report (recdepth/cli/runner.py prints that line);
2. `validated(cfg)`, called by the entry points before any work, also on a config that
   did not come through Hydra (a DDP rank's config.yaml, a test's dict): it builds the
   dataclasses, whose `__post_init__` checks ranges and dependent fields with the core
   classes' own checks (`model.check_architecture`, `sampler.check_args`, `exits.build`,
   ...), so each message is written once; then whether this machine can run it.
What needs the data or the file system (a glob matching nothing, a missing checkpoint) is checked where it is read.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from recdepth import exits
from recdepth.config.frontier_grid import FrontierChoice, FrontierGrid, FrontierSweeperConf
from recdepth.config.groups import (
    CALIBRATION_METHODS,
    DataConfig,
    DecodeConfig,
    EvalConfig,
    ExitConfig,
    HaltConfig,
    LossConfig,
    ModelConfig,
    SamplerConfig,
    check_int,
    check_number,
    check_one_of,
)
from recdepth.config.training import (
    CallbacksConfig,
    LoggerConfig,
    LoopGeometryConfig,
    OptimConfig,
    TrainerConfig,
)
from recdepth.data import config as data_config_io
from recdepth.data import sources, tasks
from recdepth.decode import generation
from recdepth.decode.kv_cache import check_cache
from recdepth.exits.calibration import ltt, search
from recdepth.training import halting


# -------------------------------------------------------------------- roots
@dataclass
class TrainConfig:
    """conf/config.yaml: a training run, `python -m recdepth.train`."""

    seed: int = 1337
    """Seed of everything trained (>= 0): weights, data order, loop counts, noise."""
    batch_size: int = 8
    """Sequences per optimiser step, per device (>= 1)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    """Where the training loss is taken along the loop (`loss.steps`: last | all | trajectory)."""
    halt: HaltConfig = field(default_factory=HaltConfig)
    """A halting head trained with the loop (`halt=<loss>`: act | pondernet | entropy | correct)."""
    exit: ExitConfig = field(default_factory=ExitConfig)
    data: DataConfig = field(default=MISSING, metadata={"required": "select one with data=<source or task>"})
    """The data: one source's config (recdepth/data/sources/), `data=<source>` or `data=<task>`
    (conf/config.yaml: data=shakespeare)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    frontier: FrontierChoice = field(default_factory=FrontierChoice)
    """The exit frontier's grid a task's checkpoints carry (`make frontier`, `recdepth report` on
    them); null fields: those commands' own defaults."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    run_dir: str = "${hydra:runtime.output_dir}"
    """The run's directory (Hydra's output dir; set it when calling train(cfg) outside Hydra)."""
    runs_dir: str = "outputs/runs"
    """Training runs, one directory per training identity, `<runs_dir>/<identity>/`
    (recdepth/training/runs.py): a finished one is reused, an interrupted one resumed."""

    def __post_init__(self):
        check_int("seed", self.seed, 0)
        check_int("batch_size", self.batch_size, 1)
        if "trajectory" in {self.loss.steps, self.loss.anneal_to} and not self.data.step_width():
            raise ValueError(f"loss.steps: trajectory needs per-step targets, and data={self.data.source} has none "
                             "(a task that states them, e.g. data=roots; else loss.steps=all or last)")
        if self.halt.on:
            halting.check_groups(self.halt.loss, self.halt.label, len(self.model.groups))
        if self.model.attention == "grid":
            self._check_grid()
        e = self.exit  # per-group values: one per recurrence group of the model
        exits.validate(e.name, e.tau, e.min_steps, e.max_steps, e.patience, groups=len(self.model.groups),
                       decode=e.decode, kl_direction=e.kl_direction)
        c = self.callbacks.loop_dynamics
        if c is not None:
            if not self.model.groups:
                raise ValueError(f"callbacks.loop_dynamics: model={self.model.name} has no recurrence groups "
                                 "(no loops to measure); use callbacks=none")
            block = self.model.shape()["block_size"]
            if c.seq_len is not None and not 2 <= c.seq_len <= block:
                raise ValueError(f"callbacks.loop_dynamics.seq_len: expected 2..{block} (the block size), "
                                 f"got {c.seq_len}")

    def _check_grid(self) -> None:
        """model.attention=grid reads each window as one N x N grid: the task's (one line otherwise)."""
        task = getattr(self.data, "task", None)
        if (side := None if task is None else task.grid_side("train")) is None:
            raise ValueError(f"model.attention: grid reads each window as one N x N grid, and data={self.data.source} "
                             "writes no grids (data=mazes does)")
        block, need = self.model.shape()["block_size"], side * side + 2
        if block != need:
            raise ValueError(f"model.block_size: data.task.size={list(task.size)} writes {side} x {side} grids, which "
                             f"grid attention reads from windows of N² + 2 = {need} tokens, got {block}")
        if (c := self.callbacks.loop_dynamics) is not None and c.seq_len not in (None, block):
            raise ValueError(f"callbacks.loop_dynamics.seq_len: a grid model reads whole grids, {block} tokens, got {c.seq_len}")
        if self.eval.tokens % block:  # the run's own evaluation, after training: refused before it
            raise ValueError(f"eval.tokens: a grid model scores whole grids of {block} tokens, expected a multiple of {block}, got {self.eval.tokens}")


def _device(v: str) -> None:
    if not (v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v)):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:<n>, got {v!r}")


@dataclass
class JobKeys:
    """The keys every entry point that works on a trained model shares."""

    seed: int = 1337
    """Initial-state noise of the loops (train_gate: also the train windows it draws) (>= 0)."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:<n>."""
    run_dir: str = "${hydra:runtime.output_dir}"
    """Where the job writes (Hydra's output dir)."""

    def __post_init__(self):
        check_int("seed", self.seed, 0)
        _device(self.device)
        if isinstance(getattr(self, "eval", None), EvalConfig) and self.eval.tokens < 1:
            raise ValueError(f"eval.tokens: expected an integer >= 1 (tokens to score), got {self.eval.tokens}")


DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelJob(JobKeys):
    """An entry point that works on a trained model given as a recdepth training checkpoint
    (`ckpt=`) or a Hugging Face recurrent-depth checkpoint directory (`hf=`, Huginn's
    format: recdepth/integrations/hf.py, docs/huginn.md): every command but train. An hf= model's
    splits come from `data` under its own tokenizer: the held-out tail (test, then
    calibration), the head the train split (train_gate)."""

    ckpt: str | None = None
    """<run_dir>/train/checkpoints/last.ckpt of a training run; or give hf."""
    hf: str | None = None
    """A Huginn checkpoint directory (config.json, *.safetensors, tokenizer.json); or give ckpt."""
    data: DataConfig | None = None
    """hf only: the documents to score or measure, tokenized with the directory's tokenizer.json
    (their held-out tail, data.val_fraction); null = data=shakespeare. A training checkpoint
    carries its own."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16: the parameters' dtype (bfloat16 halves a large model's memory)."""

    def __post_init__(self):
        if (self.ckpt is None) == (self.hf is None):
            raise ValueError("ckpt: give exactly one of ckpt=<training checkpoint> or hf=<Hugging Face "
                             f"checkpoint directory>, got {'both' if self.ckpt else 'neither'}")
        if self.ckpt is not None and self.data is not None:
            raise ValueError("data: a training checkpoint carries its own data config; data= is read with hf=<dir> only")
        check_one_of("dtype", self.dtype, DTYPES)
        super().__post_init__()


@dataclass
class EvaluateConfig(ModelJob):
    """conf/evaluate.yaml: a checkpoint under an exit rule, `python -m recdepth.evaluate`."""

    exit: ExitConfig = field(default_factory=ExitConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class DiagnoseConfig(ModelJob):
    """conf/diagnose.yaml: the loop geometry of one checkpoint, `python -m recdepth.diagnose`."""

    loop_dynamics: LoopGeometryConfig = field(default_factory=LoopGeometryConfig)
    split: str = "test"
    """A task checkpoint's held-out region the windows come from: test | extrapolation."""
    task: dict[str, Any] = field(default_factory=dict)
    """With split=extrapolation: the task's fields set anew for that split, `+task.<field>=<value>`
    (as recdepth.evaluate's eval.task: longer instances, the block grown where positions are rope)."""

    def __post_init__(self):
        super().__post_init__()
        check_one_of("split", self.split, ("test", "extrapolation"))
        if self.task and self.split != "extrapolation":
            raise ValueError("task: sets the extrapolation split's instances anew; add split=extrapolation")


GATE_STATES = ("decode", "parallel")


@dataclass
class GateConfig:
    """`gate`: fitting the learned exit gate on a checkpoint (recdepth/exits/gate.py, SPEC §3c)."""

    tokens: int = 512
    """Train-split tokens whose states and losses are collected (>= 1; whole windows of
    the block size, so rounded up to a multiple of it)."""
    max_steps: int = 32
    """N: the gate's depth (>= 2); labels compare each n < N with N (use the evaluation's exit.max_steps)."""
    margin: float = 0.01
    """Label 1 ("continue") where the NLL at n exceeds the NLL at N by more than this (nats, >= 0)."""
    steps: int = 100
    """L-BFGS iterations of each group's logistic fit (>= 1)."""
    weight_decay: float = 1.0e-4
    """L2 penalty on the standardised weights (>= 0)."""
    batch_size: int = 8
    """Windows per forward pass of states=parallel (>= 1; states=decode decodes one window at a
    time as max_steps rows)."""
    states: str = "decode"
    """Where the features come from: decode (the states the decoding engine visits, each
    depth n a row reading the history of depth N; recdepth/decode/gate_states.py) | parallel (the
    parallel forward pass, application n reading the other tokens at n; the gate of version 1)."""
    cache: str = "latest"
    """states=decode: the K/V cache of the decode the states and losses come from, latest |
    per_step; fit the gate under the eval.cache it will be evaluated with (carry's bits are
    found at n = 1 under latest, where each position reads its neighbours' final states)."""
    balance: bool = True
    """Weight the two labels' classes equally in the fit (most states say "stop")."""
    answers: bool | None = None
    """A task (data=task): fit on answer targets only (null = yes for a task; false = every target)."""

    def __post_init__(self):
        for k, lo in (("tokens", 1), ("max_steps", 2), ("steps", 1), ("batch_size", 1)):
            check_int(f"gate.{k}", getattr(self, k), lo)
        check_number("gate.margin", self.margin)
        check_number("gate.weight_decay", self.weight_decay)
        if self.states not in GATE_STATES:
            raise ValueError(f"gate.states: expected one of {', '.join(GATE_STATES)}, got {self.states!r}")
        check_cache(self.cache, "gate.cache")


@dataclass
class TrainGateConfig(ModelJob):
    """conf/train_gate.yaml: fit the exit gate of a checkpoint, `python -m recdepth.train_gate`."""

    gate: GateConfig = field(default_factory=GateConfig)


@dataclass
class TargetConfig:
    """`target` of recdepth.calibrate: set exactly one (recdepth/exits/calibration/search.py, docs/spec.md §4c)."""

    max_ce_increase: float | None = None
    """CE at most this many nats above fixed at exit.max_steps (>= 0); minimise layer applications."""
    layer_applications: float | None = None
    """Mean layer applications per token at most this (> 0: Σ_g |g| · applications_g + the
    layers outside the loops, docs/spec.md §4b; fixed-4 on the default model costs 24); minimise CE."""
    max_accuracy_drop: float | None = None
    """A task's answer accuracy at most this far below fixed at exit.max_steps (a fraction in
    [0, 1): 0.01 = one point), with calibration.method=ltt; minimise layer applications."""

    def __post_init__(self):
        for kind in search.TARGETS:
            if getattr(self, kind) is not None:
                search.Target(kind, getattr(self, kind))


@dataclass
class CalibrationConfig:
    """`calibration`: the split and the search of recdepth.calibrate."""

    tokens: int | None = None
    """Calibration tokens, taken from the val split right after the test split's eval.tokens + 1
    (>= 1; on a task, its validation split). null: sized to the target (`app.calibration.calibration_size`):
    2048 for the empirical search; for ltt four times the windows a zero loss needs to certify
    the target (`ltt.units_needed`), or all there are, refused in one line below once that."""
    per_group: bool = True
    """Search one value per recurrence group (false: one value for all groups)."""
    max_evals: int = 32
    """At most this many settings decoded on the calibration split (>= 2)."""
    batch_size: int = 16
    """Calibration windows decoded side by side (>= 1; each row = its batch-1 result)."""
    method: str = "empirical"
    """empirical: the search of docs/spec.md §4c, the best setting on the calibration split (no
    guarantee) | ltt: Learn then Test (§4e, recdepth/exits/calibration/ltt.py), a setting whose risk is at most
    the target with probability >= 1 − calibration.epsilon (target.max_ce_increase only)."""
    epsilon: float = 0.05
    """ltt: the chance, over the draw of the calibration windows, that the certified setting's
    risk exceeds the target (in (0, 1))."""
    loss_bound: float = ltt.DEFAULT_LOSS_BOUND
    """ltt: each window's mean NLL increase over full depth is clipped to [0, loss_bound] nats
    (> 0; the guarantee is on the clipped loss, and must exceed target.max_ce_increase)."""
    shared_rows: int = 64
    """Settings decoded as one batch of settings × windows of about this many rows (each
    record as decoded alone): ltt, the path's next settings (a few past the stop decoded
    unread); empirical, those that do not depend on each other (both ends of the
    bisection, a round of per-group moves); 0: one by one (>= 0)."""

    def __post_init__(self):
        if self.tokens is not None:
            check_int("calibration.tokens", self.tokens, 1)
        check_int("calibration.shared_rows", self.shared_rows, 0)
        check_int("calibration.max_evals", self.max_evals, 2)
        check_int("calibration.batch_size", self.batch_size, 1)
        check_one_of("calibration.method", self.method, CALIBRATION_METHODS)
        e = self.epsilon
        if isinstance(e, bool) or not isinstance(e, int | float) or not 0 < e < 1:
            raise ValueError(f"calibration.epsilon: expected a number in (0, 1), got {e!r}")
        check_number("calibration.loss_bound", self.loss_bound, strict=True)


@dataclass
class CalibrateConfig(ModelJob):
    """conf/calibrate.yaml: `python -m recdepth.calibrate`, an evaluation whose exit is
    calibrated to `target` on the calibration split first (`eval` is the test split's)."""

    exit: ExitConfig = field(default_factory=ExitConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


@dataclass
class ReportSettings(FrontierGrid):
    """`report`: what recdepth.report scores (recdepth/report.py): a frontier's grid (the
    fields of `FrontierGrid`, recdepth/config/frontier_grid.py, with the report's own defaults:
    every threshold rule, argmax_stability and the gate), each rule calibrated to two targets."""

    rules: dict[str, list[float]] = field(default_factory=lambda: exits.grid("report"))
    """Each threshold rule at each τ of its grid (drop one with report.rules.<rule>=[]). Default:
    each rule's own report grid (`ExitRule.report`: every threshold rule)."""
    patience: list[int] = field(default_factory=lambda: [1, 2, 5])
    """argmax_stability at each k."""
    gate_tau: list[float] = field(default_factory=lambda: [0.3, 0.5, 0.7])
    """The learned gate at each probability τ ([] leaves the gate's grid out)."""
    max_steps: int = 32
    """exit.max_steps of every rule, the oracle's N and the calibration's reference (>= 1)."""
    shared_rows: int = 64
    """Every scored setting (the grid and the calibrated answers) is decoded as one batch of
    settings × windows, this many rows a batch (`jobs.decode_shared`; each setting's
    records are its own), as is each calibration search's round of independent settings
    (`app.calibration.calibrate_policy`); 0: setting by setting."""
    calibrate: list[str] = field(default_factory=lambda: [n for n in exits.names() if exits.lookup(n).calibrated])
    """The rules calibrated per group to each target (fixed: one max_steps per group). Default:
    every rule (`ExitRule.calibrated`)."""
    max_ce_increase: float = 0.01
    """Target 1: CE at most this many nats above fixed at max_steps (>= 0)."""
    layer_applications: float = 24.0
    """Target 2: at most this many layer applications per token (> 0; 24 = fixed-4 on the
    default grouped model: 8 layers outside the loops + 4 × (1 + 2 + 1))."""
    gate: str | None = None
    """A gate.pt of recdepth.train_gate; null trains one on the train split (`gate` settings)."""
    from_checkpoint: list[str] = field(default_factory=list)
    """Set by the command, not by you: the grid keys it took from a task checkpoint
    (`frontier_grid.FRONTIER_FROM_CHECKPOINT`, where the command line set none)."""

    where: ClassVar[str] = "report"

    def check(self) -> None:
        super().check()
        check_int("report.max_steps", self.max_steps, 1)
        check_int("report.shared_rows", self.shared_rows, 0)
        for rule in self.calibrate:
            if not exits.is_rule(rule):
                raise ValueError(f"report.calibrate: unknown exit rule {rule!r} (expected any of {', '.join(exits.names())})")
        search.Target("max_ce_increase", self.max_ce_increase)
        search.Target("layer_applications", self.layer_applications)


@dataclass
class ReportConfig(ModelJob):
    """conf/report.yaml: `python -m recdepth.report`, every exit rule on one checkpoint."""

    eval: EvalConfig = field(default_factory=lambda: EvalConfig(latency_tokens=128, repeats=1))
    """The test split and how each setting is scored on it (as recdepth.evaluate; latency timed
    once over 128 tokens: ~60 jobs)."""
    calibration: CalibrationConfig = field(default_factory=lambda: CalibrationConfig(max_evals=20))
    """As recdepth.calibrate's, at most 20 decodes per search (bisection + one round of moves)."""
    report: ReportSettings = field(default_factory=ReportSettings)
    gate: GateConfig = field(default_factory=GateConfig)
    """How the gate is fitted when report.gate is null (as recdepth.train_gate; gate.max_steps is report.max_steps)."""


@dataclass
class SpeculativeConfig:
    """`speculative` of recdepth.generate: self-speculative decoding (recdepth/decode/generation.py,
    docs/spec.md §4d); off while draft_steps is null."""

    draft_steps: int | None = None
    """Draft with this many applications per group (exit=fixed; >= 1), verify with the exit
    rule; null = ordinary greedy decoding. Needs eval.cache=per_step."""
    lookahead: int = 8
    """Tokens drafted per verify pass (>= 1)."""
    compare: bool = True
    """Also decode greedily token by token (cache=per_step) in the same run: check that the
    tokens are the same and time both."""

    def __post_init__(self):
        check_int("speculative.draft_steps", self.draft_steps, 1, null=True)
        check_int("speculative.lookahead", self.lookahead, 1)


@dataclass
class GenerateConfig(ModelJob):
    """conf/generate.yaml: `python -m recdepth.generate`, greedy generation from a prompt
    under an exit rule, with per-token depth (recdepth/decode/generation.py, docs/spec.md §4d)."""

    prompt: str | None = None
    """The prompt text (this or prompt_ids)."""
    prompt_ids: list[int] | None = None
    """The prompt as model ids, for a checkpoint whose tokenizer is not at hand (this or prompt)."""
    max_new_tokens: int = 64
    """Tokens to generate (>= 1); fewer if the model's block_size comes first."""
    eval: DecodeConfig = field(default_factory=DecodeConfig)
    """How tokens are decoded (eval.cache, eval.warm_start, eval.backend: the knobs of every
    command's eval block). eval.warm_start is greedy only: a parallel verify pass cannot know
    the previous token's final state."""
    exit: ExitConfig = field(default_factory=ExitConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    stream: bool = True
    """Print the generated text to stdout as the tokens come."""

    def __post_init__(self):
        super().__post_init__()
        if self.eval.warm_start and self.speculative.draft_steps is not None:
            raise ValueError("eval.warm_start: not with speculative decoding (the verify pass runs the drafted positions "
                             "in parallel, so a position cannot start from the previous one's final state)")
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("prompt: set exactly one of prompt=<text> or prompt_ids=[<model ids>], got "
                             f"{'both' if self.prompt is not None else 'neither'}")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt: empty (generation needs at least one prompt token)")
        if self.prompt_ids is not None:
            if not self.prompt_ids:
                raise ValueError("prompt_ids: empty (generation needs at least one prompt token)")
            for i in self.prompt_ids:
                check_int("prompt_ids[]", i, 0)
        check_int("max_new_tokens", self.max_new_tokens, 1)
        if self.speculative.draft_steps is not None:
            generation.check_speculative(self.eval.cache, self.speculative.draft_steps, self.speculative.lookahead,
                                         self.eval.copy_forward)


# The names conf/config.yaml, conf/evaluate.yaml, conf/calibrate.yaml, conf/report.yaml,
# conf/train_gate.yaml and conf/generate.yaml give their schema in their defaults lists.
ROOTS = {"train_schema": TrainConfig, "evaluate_schema": EvaluateConfig, "calibrate_schema": CalibrateConfig,
         "report_schema": ReportConfig, "train_gate_schema": TrainGateConfig, "diagnose_schema": DiagnoseConfig,
         "generate_schema": GenerateConfig}


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore: the roots, hydra/sweeper=frontier, the
    `exit` group, one option per registered exit rule (`exit=<name>`: the rule with its
    default τ), its alias `none` and the oracle, and the `data` group, one option per
    registered source and per registered task. Called on import and again by each command
    before it composes (`recdepth.cli.runner`), so a rule (a source, a task) defined after this
    module was imported is an `exit=` (`data=`) option too, and a rule in the frontier's and
    the report's default grids."""
    cs = ConfigStore.instance()
    for name, root in ROOTS.items():
        cs.store(name=name, node=root)
    # hydra/sweeper=frontier (`make frontier`): the grid's defaults are FrontierGrid's
    cs.store(group="hydra/sweeper", name="frontier", node=FrontierSweeperConf)
    options = {n: exits.lookup(n).default_tau for n in exits.names()}
    options |= {a: None for a in exits.ALIASES} | {exits.ORACLE: exits.ORACLE_EPSILON}
    for name, tau in options.items():
        cs.store(group="exit", name=name, node=ExitConfig(name=name, tau=tau))
    # `halt`: none, and one option per registered halting loss (recdepth/training/halting.py)
    for name in ("none", *halting.names()):
        cs.store(group="halt", name=name, node=HaltConfig(loss=name))
    # `data`: one option per registered source (`data=<source>`, recdepth/data/sources/) and
    # per registered task (`data=<task>`: the task source with that task, recdepth/data/tasks/)
    for name in sources.names():
        cs.store(group="data", name=name, node=sources.lookup(name))
    for name in tasks.names():
        if name in sources.names():
            raise ValueError(f"data.task.name: task {name!r} has a data source's name (data={name} selects the source)")
        cs.store(group="data", name=name, node=data_config_io.node({"source": "task", "task": {"name": name}}))


register_configs()


# ---------------------------------------------------------------- validation
def validated(cfg: DictConfig | dict):
    """The typed config of a composed one, checked before any work (one line naming the
    field on the first failure). A config Hydra composed onto one of `ROOTS` gives that
    root; any other (a loaded <run_dir>/config.yaml, a dict) a TrainConfig."""
    root = OmegaConf.get_type(cfg) if isinstance(cfg, DictConfig) else None
    if root not in ROOTS.values():
        root = TrainConfig
    if isinstance(cfg, DictConfig):  # as plain data: a key added with `+key=...` is refused too
        if isinstance(cfg.get("data"), DictConfig):
            data_config_io.check_choice(cfg.data)
        cfg = OmegaConf.to_container(cfg)
    try:
        base = OmegaConf.structured(root)
        if isinstance(cfg.get("data"), dict):  # typed by the source (and task) it names; an old flat one upgraded
            cfg = {**cfg, "data": data_config_io.upgrade(cfg["data"])}
            base.data = data_config_io.node(cfg["data"])
        run = OmegaConf.to_object(OmegaConf.merge(base, cfg))
    except OmegaConfBaseException as e:
        raise ValueError(config_error(e)) from None
    if isinstance(run, TrainConfig):
        check_machine(run.trainer)
    return run


@dataclass
class _Data:
    data: DataConfig = MISSING


def data_config(d: dict | DictConfig) -> DataConfig:
    """The typed, checked data config of a plain one (a checkpoint's `data_config`, a
    stored config.yaml's `data`; the flat form of older runs upgraded,
    `recdepth.data.config.upgrade`), with the one-line errors of `validated`."""
    if isinstance(d, DictConfig):
        d = OmegaConf.to_container(d, resolve=True)
    d = data_config_io.upgrade(d)
    try:
        base = OmegaConf.structured(_Data)
        base.data = data_config_io.node(d)
        return OmegaConf.to_object(OmegaConf.merge(base, {"data": d})).data
    except OmegaConfBaseException as e:
        raise ValueError(config_error(e)) from None


def check_machine(t: TrainerConfig) -> None:
    """Whether this machine can run the trainer config (how the process was started, e.g.
    ddp under torchrun, is recdepth/training/distributed.py's check when it builds the strategy)."""
    if t.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.accelerator: {t.accelerator} asked for, but torch {torch.__version__} sees no CUDA "
                         "device (CPU build, or CUDA_VISIBLE_DEVICES empty?); on a CPU leave trainer=default")


_CONVERTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def config_error(e: BaseException) -> str | None:
    """One line naming the field for an error OmegaConf raised about a config (a wrong
    type, an unknown key, a missing value), also when Hydra's composition wrapped it;
    None for any other error."""
    while e is not None and not isinstance(e, OmegaConfBaseException):
        e = e.__cause__
    if e is None:
        return None
    key = e.full_key or ""
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0].strip()
    parent = e.object_type if dataclasses.is_dataclass(e.object_type) else None
    if isinstance(e, MissingMandatoryValue):
        f = _field_of(parent, key)
        hint = f.metadata.get("required") if f is not None else None
        return f"{key}: required" + (f", {hint}" if hint else "")
    if isinstance(e, ConfigKeyError | ConfigAttributeError):
        where, _, name = key.rpartition(".")
        fields = [f.name for f in dataclasses.fields(parent)] if parent is not None else []
        near = difflib.get_close_matches(name, fields, n=1)
        return (f"{key}: no such key in {where or 'the config'}" +
                (f" (did you mean {near[0]}?)" if near else f" (its keys: {', '.join(fields)})" if fields else ""))
    if isinstance(e, ValidationError):
        m = re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", msg)
        if m and m.group(2) in _CONVERTED:
            return f"{key}: expected {_CONVERTED[m.group(2)]}, got {m.group(1)!r}"
    return f"{key}: {msg}" if key else msg


def _field_of(parent, key: str):
    if parent is None:
        return None
    name = key.rsplit(".", 1)[-1]
    return next((f for f in dataclasses.fields(parent) if f.name == name), None)
