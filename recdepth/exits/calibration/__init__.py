"""Calibrating an exit rule: the search, Learn then Test, and the splits of a checkpoint they run on."""
