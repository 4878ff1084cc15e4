"""`python -m recdepth <command> ...`: the `recdepth` console script (recdepth/commands.py)."""

from recdepth.commands import main

raise SystemExit(main())
