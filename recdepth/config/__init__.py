"""The run config: the schema (one dataclass per group, defaults only there) and the objects built from it."""
