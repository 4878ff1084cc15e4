"""The `recdepth bench` subcommands' code (`python -m recdepth.bench <what>`)."""
