"""recdepth's glue: data, tokenizer, Lightning module and callbacks, the config schema,
run files, checkpoints and figures; imports the core, never the commands. The module map
is in recdepth/__init__.py."""
