"""`recdepth <command> ...`: one front door to every entry point (the `recdepth` console
script; `python -m recdepth` is the same).

    recdepth --help                      the commands, a line each
    recdepth train model=grouped exit=accel
    recdepth frontier ckpt=<CKPT> hydra.sweep.dir=<OUT>
    recdepth bench exits --ckpt <CKPT>

A command runs its entry point's own `main` with the rest of the command line, so
`recdepth X args` is `python -m recdepth.X args` (Hydra overrides, `--multirun`, `--cfg job`,
argparse options alike), and both forms stay. `frontier` is `recdepth.evaluate --multirun
hydra/sweeper=frontier` (make frontier). Entry points are imported by name only when their
command runs, so `recdepth --help` does not load torch.
"""

from __future__ import annotations

import difflib
import importlib
import sys

# command: (module, arguments put before the user's, one line of help)
COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "train": ("recdepth.train", (), "train a looped GPT-2 (or reuse its finished training), then evaluate it"),
    "evaluate": ("recdepth.evaluate", (), "one checkpoint (ckpt= or hf=) under one exit rule, token by token"),
    "frontier": ("recdepth.evaluate", ("--multirun", "hydra/sweeper=frontier"),
                 "the exit frontier of a checkpoint: fixed depths, rules, oracle, verdicts"),
    "calibrate": ("recdepth.calibrate", (), "search a rule's thresholds for a CE or cost target, then test once"),
    "report": ("recdepth.report", (), "every exit rule on one frontier, calibrated and not, and the gate"),
    "generate": ("recdepth.generate", (), "generate under an exit rule and show how deep each token looped"),
    "diagnose": ("recdepth.diagnose", (), "the loop geometry of one model (the paper's Figs. 1, 2, 3, 5)"),
    "train-gate": ("recdepth.train_gate", (), "fit the learned exit gate of a checkpoint (gate.pt)"),
    "bench": ("recdepth.bench", (), "benchmarks: train, callbacks, exits, huginn, speculative, ltt, intervals"),
    "figures": ("recdepth.figures", (), "redraw a training run's figures from its diagnostics"),
    "lm-eval": ("recdepth.harness", (), "lm-evaluation-harness with --model recdepth (needs the [eval] extra)"),
}
# Entry points whose main parses argparse options (main(argv)); the others are Hydra mains
# that read sys.argv.
ARGPARSE = {"recdepth.bench", "recdepth.figures", "recdepth.harness"}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: recdepth <command> [overrides or options ...]", "",
             "Hydra overrides (key=value, --multirun, --cfg job) or a command's options follow it;",
             "`recdepth <command> --help` tells more. `python -m recdepth.<module> ...` is the same.", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, _, text) in COMMANDS.items()]
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[str, list[str]]:
    """(module, its argv) of `recdepth <command> args` (argv not empty); an unknown command
    is one line on stderr and exit status 2."""
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        near = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean {near[0]}?" if near else f"expected one of {', '.join(COMMANDS)}"
        print(f"recdepth: error: unknown command {name!r} ({hint})", file=sys.stderr)
        raise SystemExit(2)
    module, prefix, _ = COMMANDS[name]
    return module, [*prefix, *rest]


def main(argv: list[str] | None = None) -> int:
    """Run `recdepth <command> ...`; 0 on success (an entry point's failure exits on its own)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if not argv:
        print(usage(), file=sys.stderr)
        raise SystemExit(2)
    module, args = resolve(argv)
    entry = importlib.import_module(module)
    if module in ARGPARSE:
        entry.main(args)
    else:
        sys.argv = [f"recdepth {argv[0]}", *args]  # a Hydra main parses sys.argv
        entry.main()
    return 0
