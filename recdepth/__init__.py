"""recdepth: recurrent-depth ("looped") GPT-2 — training, loop geometry, early exit.

One folder per feature: model/, exits/, decode/, data/, training/, analysis/, config/,
cli/, integrations/, and the commands at the top of recdepth/ (`python -m
recdepth.<command>`, or `recdepth <command>`). The map of every module, and the layer
each is in (imports point down only, with no cycle), is docs/layout.md, checked against
the tree by tests/test_layers.py.
"""

__version__ = "0.1.0"
