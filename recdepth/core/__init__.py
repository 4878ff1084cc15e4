"""recdepth's core: the math of looped transformers, exits and decoding (torch and numpy
only; nothing here imports Lightning, Hydra or anything above it). The module map is in
recdepth/__init__.py."""
