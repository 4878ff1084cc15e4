"""Exit rules: when may a looped group stop, per token (SPEC §3, §3b, §3c).

    rule.py      `ExitRule`, the one class a rule is (its metadata and its check over
                 tensors), and the registry: defining a subclass registers it
    rules.py     the built-in rules, one class each (`names()` lists every registered rule)
    policy.py    `ExitPolicy`: a rule with its numbers (τ, min/max steps, per group), validated
                 by `build` / `validate`; the oracle bound's name
    monitor.py   running a policy over a loop: `ExitMonitor` (eager), `observe_step` (the same
                 check for a loop compiled whole), `iterate` (the reference loop)

The names below are the package's API (`from recdepth import exits; exits.build(...)`).
"""

# first: a rule file in exits/rules/ (imported while this package loads) may import these from here
from recdepth.exits.rule import ALIASES, ExitRule, Step, canonical, grid, is_rule, lookup, names

# isort: split
from recdepth.exits.monitor import ExitMonitor, history0, iterate, observe_step
from recdepth.exits.policy import (
    DECODES,
    DEFAULT_RULE,
    KL_DIRECTIONS,
    ORACLE,
    ORACLE_EPSILON,
    PATIENCE,
    PER_GROUP,
    ExitPolicy,
    build,
    validate,
)
from recdepth.exits.rules import argmax_run, entropy, entropy_change, kl_divergence, log_probs

__all__ = ["ALIASES", "DECODES", "DEFAULT_RULE", "KL_DIRECTIONS", "ORACLE", "ORACLE_EPSILON", "PATIENCE", "PER_GROUP", "ExitMonitor", "ExitPolicy",
           "ExitRule", "Step", "argmax_run", "build", "canonical", "entropy", "entropy_change", "grid", "history0",
           "is_rule", "iterate", "kl_divergence", "log_probs", "lookup", "names", "observe_step", "validate"]
