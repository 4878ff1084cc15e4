"""recdepth: recurrent-depth ("looped") GPT-2 — training, loop geometry, early exit.

The map of the package, every module with what it holds, is docs/layout.md (checked
against the tree by tests/test_layers.py): the core (recdepth/core/, recdepth/exits/,
recdepth/data/tasks/), the glue (recdepth/glue/, recdepth/data/) and the commands at the
top of recdepth/ (`python -m recdepth.<command>`, or `recdepth <command>`). Imports point
down only, with no cycle.
"""

__version__ = "0.1.0"
