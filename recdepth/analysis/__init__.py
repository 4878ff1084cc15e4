"""Analysis: loop geometry, diagnostics, statistics, the frontier and its tables and figures."""
