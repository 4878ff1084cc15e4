"""The package's imports point one way: core (torch and numpy only) <- glue (Lightning,
Hydra config, data, files, figures) <- commands, with no cycle anywhere, function-local
imports included. Which layer a package is in is the table `LAYERS` (package -> layer);
a module at the top of recdepth/ is a command (so `python -m recdepth.<command>` names each
one). A package's __init__.py is a module of its own (its name is the package's), so an
import of the package's API counts as an import of that module.
Parsed from the source, so a lazy import inside a function counts like a module-level one."""

import ast
import re
import sys
from pathlib import Path

import pytest

import recdepth

PKG = Path(recdepth.__file__).parent
ORDER = ("core", "glue", "entry")  # lowest first
LAYERS = {  # package, subpackage or module under recdepth/ -> its layer, the longest match decides;
    # a module at the top of recdepth/ is "entry". A feature folder may hold two layers.
    "core": "core",  # what the folders share: the registry of extension points, the value checks, the runtime
    "model": "core",  # the looped GPT-2 and its config
    "analysis": "core",  # loop geometry, diagnostics, exit statistics
    "analysis.token_files": "glue",  # eval_tokens.csv
    "analysis.frontier": "glue",  # a sweep's tables and the frontier statistics over its files
    "analysis.task_tables": "glue",  # a task's sweep by difficulty
    "analysis.plots": "glue",  # figures (matplotlib)
    "data": "glue",  # data sources, token caches, the data module
    "data.sources": "glue",  # one file per data source
    "data.tasks": "core",  # the generated tasks' math
    "exits": "core",  # exit rules, policies, monitors, the gate, calibration's math
    "decode": "core",  # the decoding engine, the lean step, its settings, scoring, generation, the gate's states
    "decode.depth_view": "glue",  # a generation's depth as files
    "training": "glue",  # Lightning: the module, callbacks, runs, DDP
    "training.sampler": "core",  # loop-count samplers
    "training.objective": "core",  # where the loss is taken along the loop
    "training.halting": "core",  # the halting losses (halt.*)
    "integrations": "glue",  # Hugging Face checkpoints (Huginn's format)
    "config": "glue",  # the Hydra config schema, the frontier's grid and the objects built from them
    "app": "glue",  # what the commands share: opening checkpoints, evaluation jobs, calibration, lm-eval
    "cli": "glue",  # the commands' runner
    "benchmarks": "entry",  # the bench command's subcommands
}
# The folders in the order they stand, lowest first: a module imports from its own folder and
# the folders before it only (test_no_import_goes_up_the_folder_order). The features, then the
# config that builds them, then what drives them for the commands, then the commands.
FOLDERS = ("core", "model", "analysis", "data", "exits", "decode", "training", "integrations", "config", "app",
           "cli", "benchmarks", "entry")
CORE_THIRD_PARTY = {"torch", "numpy"}
LONG = 600  # a module over this many lines says why in its docstring ("Over 600 lines: ...")


def modules() -> list[str]:
    """Every module as its dotted name under recdepth ("core.model", "glue.schema", "train"),
    a package's __init__.py as the package ("exits")."""
    found = [p.relative_to(PKG).with_suffix("") for p in PKG.rglob("*.py") if "conf" not in p.relative_to(PKG).parts]
    found = [p.parent if p.name == "__init__" else p for p in found]
    return sorted(".".join(p.parts) for p in found if p.parts)


def layer_of(m: str) -> str:
    parts = m.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in LAYERS:
            return LAYERS[".".join(parts[:k])]
    assert len(parts) == 1 and not (PKG / m).is_dir(), f"recdepth/{parts[0]}/: a package missing from LAYERS"
    return "entry"


def source(m: str) -> Path:
    path = PKG.joinpath(*m.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imports(name: str) -> tuple[set[str], set[str]]:
    """(recdepth modules, top-level third-party packages) imported anywhere in a module."""
    tree = ast.parse(source(name).read_text())
    known = set(modules())
    inner, outer = set(), set()

    def add(dotted: str, names=()):  # "core.model", or a package and the names taken from it
        if dotted in known:
            inner.add(dotted)
        for a in names:
            sub = f"{dotted}.{a}" if dotted else a
            if sub in known:
                inner.add(sub)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "recdepth":
                    add(".".join(parts[1:]))
                else:
                    outer.add(parts[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"recdepth/{name}: relative import (write from recdepth.<layer>.<module>)")
            parts = node.module.split(".")
            if parts[0] == "recdepth":
                add(".".join(parts[1:]), [a.name for a in node.names])
            else:
                outer.add(parts[0])
    inner.discard(name)  # an entry point running its importable self under __main__
    return inner, outer


def graph() -> dict[str, set[str]]:
    return {m: imports(m)[0] for m in modules()}


EXTENSION_FOLDERS = ("exits/rules/", "data/tasks/", "data/sources/")  # folders whose files register themselves


def test_every_package_has_a_layer_and_the_module_map_is_the_tree():
    """docs/layout.md is the one map of the package: every module is in it (as
    `<package>/<module>.py`, or `<module>.py` for a command) but a file of one's own in an
    extension folder, and every module it names exists."""
    assert {layer_of(m) for m in modules()} == set(ORDER)
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists() and p.name != "conf"}
    tops = {k.split(".")[0] for k in LAYERS}
    assert packages == tops, f"packages without a layer, or layers without a package: {packages ^ tops}"
    doc = (PKG.parent / "docs" / "layout.md").read_text()
    files = {"/".join(m.split(".")) + ".py" for m in modules() if m not in packages and not (PKG / m.replace(".", "/")).is_dir()}
    # a newcomer's rule, task or source is a file in an extension folder (every file there is
    # imported: core/registry.py import_folder) and needs no line here
    missing = sorted(f for f in files if not re.search(rf"(^|\s){re.escape(f)}\s", doc, re.M)
                     and not f.startswith(EXTENSION_FOLDERS))
    assert not missing, f"modules missing from the module map in docs/layout.md: {missing}"
    named = set(re.findall(r"^\s+([\w/]+\.py)\s", doc, re.M))
    stale = sorted(n for n in named if not (PKG / n).exists())
    assert not stale, f"docs/layout.md names modules that do not exist: {stale}"
    for package in {m for m in modules() if (PKG / m.replace(".", "/")).is_dir()}:
        assert source(package).read_text().strip().startswith('"""'), f"recdepth/{package}/__init__.py: a docstring"


def test_no_import_points_up():
    rank = {k: i for i, k in enumerate(ORDER)}
    bad = [f"{m} ({layer_of(m)}) imports {d} ({layer_of(d)})"
           for m, deps in graph().items() for d in deps if rank[layer_of(d)] > rank[layer_of(m)]]
    assert not bad, "upward imports: " + "; ".join(bad)


def folder_of(m: str) -> str:
    """The folder a module stands in (a module at the top of recdepth/: "entry")."""
    top = m.split(".")[0]
    return top if (PKG / top).is_dir() else "entry"


def against_order(g: dict[str, set[str]]) -> list[str]:
    """The imports in `g` (module -> what it imports) from a folder later in FOLDERS."""
    rank = {f: i for i, f in enumerate(FOLDERS)}
    return sorted(f"{m} ({folder_of(m)}) imports {d} ({folder_of(d)})" for m, deps in g.items() for d in deps
                  if rank[folder_of(d)] > rank[folder_of(m)])


def test_no_import_goes_up_the_folder_order():
    assert {folder_of(m) for m in modules()} == set(FOLDERS), "a folder missing from FOLDERS, or one that is gone"
    bad = against_order(graph())
    assert not bad, "imports against the folders' order: " + "; ".join(bad)


def test_the_folder_order_check_sees_an_import_against_it():
    """A model module importing the decoder (above it) is reported; the same import the other way is not."""
    g = {"model.looped": {"decode.engine", "core.checks"}, "decode.engine": {"model.looped", "exits.policy"}}
    assert against_order(g) == ["model.looped (model) imports decode.engine (decode)"]


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


def test_imports_are_seen_inside_functions_in_every_spelling(tmp_path, monkeypatch):
    """A function-local import counts (the back edges of cycles used to hide there), and
    `from recdepth.analysis import stats` names the module as `from recdepth.analysis.stats import x` does."""
    (tmp_path / "lazy.py").write_text("def f():\n    from recdepth.train import train\n    import recdepth.sweep\n"
                                      "    from recdepth.analysis import stats\n    from recdepth.config.schema import X\n")
    monkeypatch.setattr(sys.modules[__name__], "source", lambda m: tmp_path / f"{m}.py")
    # `from recdepth.analysis import stats` runs recdepth/analysis/__init__.py too: the package's module "analysis"
    assert imports("lazy")[0] == {"train", "sweep", "analysis", "analysis.stats", "config.schema"}


@pytest.mark.parametrize("m", [m for m in modules() if layer_of(m) == "core"])
def test_core_imports_only_torch_and_numpy(m):
    outer = imports(m)[1] - set(sys.stdlib_module_names) - {"__future__"}
    assert outer <= CORE_THIRD_PARTY, f"recdepth/{m}.py (core) imports {sorted(outer - CORE_THIRD_PARTY)}"


def test_a_long_module_says_why():
    """Modules are split by feature, not by size; one over LONG lines gives its reason in its
    docstring, as a line starting "Over 600 lines:"."""
    long = {m: n for m in modules() if (n := len(source(m).read_text().splitlines())) > LONG
            and "Over 600 lines:" not in (ast.get_docstring(ast.parse(source(m).read_text())) or "")}
    assert not long, f"modules over {LONG} lines without a reason in their docstring: {long}"


# A command runs another only as a step of its own job; library code lives in the feature folders.
COMMAND_STEPS = {
    "__main__": {"commands"},  # `python -m recdepth` is the console script
    "bench": {"benchmarks", "benchmarks.decode", "benchmarks.speculative", "benchmarks.sweeps",  # its subcommands
              "train"},  # `bench train` times the training command itself
    "report": {"evaluate",  # each setting of the report's frontier is a recdepth.evaluate job
               "sweep",  # the report's frontier is summarized as a sweep's
               "train_gate"},  # with report.gate=null the report fits the gate as train_gate does
}


def test_commands_import_no_library_code_from_other_commands():
    bad = {m: sorted(e) for m, deps in graph().items() if layer_of(m) == "entry"
           and (e := {d for d in deps if layer_of(d) == "entry"} - COMMAND_STEPS.get(m, set()))}
    assert not bad, f"commands importing other commands (move the shared code into a feature folder): {bad}"
