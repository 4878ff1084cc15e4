"""The exit rules, one class each: the built-in ones in builtin.py (its docstring tables
them), a rule of your own in a file of its own in this folder. This package imports every
module of its folder (`import_folder`), so defining the class in such a file registers it
(`exit=<name>`) with no import written anywhere else (docs/contributing.md, "Add an exit rule").
"""

from recdepth.core.registry import import_folder
from recdepth.exits.rules.builtin import (
    PATIENCE,
    argmax_run,
    entropy,
    entropy_change,
    kl_divergence,
    log_probs,
)

__all__ = ["PATIENCE", "argmax_run", "entropy", "entropy_change", "kl_divergence", "log_probs"]

import_folder(__name__, __path__)  # a rule file of one's own, beside the built-in ones
