"""`DecodeSettings`: how the decoding engine and the scoring built on it decode tokens, in
one frozen object validated once (SPEC §4; docs/spec.md §4 for the recdepth options).

The engine (`recdepth.decode.engine`), scoring (`recdepth.decode.scoring`) and generation
(`recdepth.decode.generation`) take it instead of loose keyword arguments, and read the fast
path they run from its `backend` by name (`engine.lean_steps`). The commands build it from
the run config's `eval` block (`recdepth.app.jobs.decode_settings`); the rule's own
choices (exit.decode, exit.kl_direction) stay with the exit policy.

Defaults are the reference pass a library caller gets: `Block.forward`, one window at a
time, no latency repeats. What a command runs by default is the `eval` block's
(`recdepth.config.groups.EvalConfig`, e.g. `backend: lean`, 16 windows a batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from recdepth.core.checks import check_bool, check_int
from recdepth.decode.kv_cache import check_cache

BACKENDS = ("module", "lean", "compiled")  # how a token's layers are computed (`engine.lean_steps`)
REGIMES = ("sequential", "parallel")  # token by token (the engine) | every position at once (decode/parallel.py)
EXIT_LEVELS = ("token", "sequence")  # the parallel regime's: a position stops, or the whole instance
AUTO = "auto"  # latency_backend: the compiled backend where it is measured to pay (`scoring.latency_backend_for`)


@dataclass(frozen=True)
class DecodeSettings:
    """How tokens are decoded and scored. Every field is checked at construction, with a
    one-line error naming it as the run config does (`eval.<field>`)."""

    cache: str = "latest"
    """K/V of looped layers: latest (one entry per position, SPEC §4) | per_step (one per
    application; speculative decoding needs it)."""
    copy_forward: bool = False
    """A position the exit rule stopped after n applications runs one more whose only effect is
    its cache entry: later tokens read it, at every deeper application, through its final
    state x^(n) (the Universal Transformer's copy forward) instead of the input of its last
    application; the extra application is counted in its cost (docs/spec.md §4)."""
    regime: str = "sequential"
    """sequential: token by token with a K/V cache, each token after the earlier ones are done
    (SPEC §4, the engine) | parallel: every position of a window loops at once, as in training
    (recdepth/decode/parallel.py; one recurrence group; the module backend)."""
    exit_level: str = "token"
    """The parallel regime's: token (a position stops when its rule fires, keeping its state)
    | sequence (the window stops when every position's rule fires together)."""
    wake: bool = False
    """The parallel regime at exit_level=token: a stopped position starts again after an
    application in which a position in its attention window changed."""
    warm_start: bool = False
    """Continuous compute: each group's loop for a token starts from the state it ended with
    for the previous token of the window (the first token: the initial state)."""
    backend: str = "module"
    """How a token's layers are computed: module (`Block.forward`, the reference) | lean
    (`recdepth.decode.lean_step`, eager) | compiled (lean under torch.compile)."""
    seed: int = 0
    """Noise key of the initial states (`engine.noise_seed`)."""
    bos: int | None = None
    """A BOS id (an hf= model's tokenizer): every window starts with it at position 0."""
    context_steps: int | None = None
    """A task's non-answer positions loop exactly this many applications, the rule deciding
    at answer positions only (docs/spec.md §6); None: the rule decides everywhere."""
    batch_size: int = 1
    """Windows (rows) decoded side by side in a batched pass; each row is its batch-1 result."""
    warmup_tokens: int = 8
    """Untimed decode steps before a timed pass."""
    latency_tokens: int | None = None
    """The first this many tokens timed again at batch 1 (None: every scored token)."""
    repeats: int = 1
    """Timed passes; latency is their median."""
    latency_backend: str | None = None
    """The backend of the batch-1 timed passes: None = `backend`, one of `BACKENDS`, or auto
    (`scoring.latency_backend_for`)."""
    answers: bool | None = None
    """A task's answer tokens only (None: whenever there are answer labels)."""
    compact: bool = True
    """Once some rows exit, run the layers on the rows still looping only (wall-clock
    saved); False computes every row and masks (the same records)."""
    share_first: bool = True
    """The oracle's rows of a window loop the first group once (`engine.loop_shared`);
    False loops every row (the same records; the reference it is tested against)."""

    def __post_init__(self):
        check_cache(self.cache)
        if self.backend not in BACKENDS:
            raise ValueError(f"eval.backend: expected one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.latency_backend is not None and self.latency_backend != AUTO and self.latency_backend not in BACKENDS:
            raise ValueError(f"eval.latency_backend: expected null, {AUTO} or one of {', '.join(BACKENDS)}, "
                             f"got {self.latency_backend!r}")
        for field in ("copy_forward", "wake", "warm_start", "compact", "share_first"):
            check_bool(f"eval.{field}", getattr(self, field))
        if self.regime not in REGIMES:
            raise ValueError(f"eval.regime: expected one of {', '.join(REGIMES)}, got {self.regime!r}")
        if self.exit_level not in EXIT_LEVELS:
            raise ValueError(f"eval.exit_level: expected one of {', '.join(EXIT_LEVELS)}, got {self.exit_level!r}")
        if self.regime == "sequential" and (self.exit_level != "token" or self.wake):
            raise ValueError("eval.exit_level / eval.wake: the parallel regime's, set eval.regime=parallel")
        if self.wake and self.exit_level == "sequence":
            raise ValueError("eval.wake: a stopped position wakes at eval.exit_level=token only (sequence stops every "
                             "position together)")
        if self.regime == "parallel":
            for field, off in (("warm_start", False), ("copy_forward", False), ("context_steps", None), ("bos", None)):
                if getattr(self, field) != off:
                    raise ValueError(f"eval.{field}: not with eval.regime=parallel (every position loops at once "
                                     f"from its initial state and keeps its last state in view; set it to "
                                     f"{str(off).lower() if off is not None else 'null'})")
        check_bool("eval.answers", self.answers, null=True)
        check_int("eval.seed", self.seed, -(2**63))
        check_int("eval.bos", self.bos, 0, null=True)
        check_int("eval.context_steps", self.context_steps, 1, null=True)
        check_int("eval.batch_size", self.batch_size, 1)
        check_int("eval.warmup_tokens", self.warmup_tokens, 0)
        check_int("eval.latency_tokens", self.latency_tokens, 0, null=True)
        check_int("eval.repeats", self.repeats, 1)

    def replace(self, **changes) -> DecodeSettings:
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)
