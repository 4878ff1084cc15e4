"""The package's imports point one way: core (torch and numpy only) <- Lightning glue <-
entry points, with no cycle anywhere, function-local imports included. Parsed from the
source, so a lazy import inside a function counts like a module-level one."""

import ast
import sys
from pathlib import Path

import pytest

import recdepth

PKG = Path(recdepth.__file__).parent

# The layers, lowest first (recdepth/__init__.py lists them in the same order).
LAYERS = {
    "core": {"model", "geometry", "sampler", "gate", "gate_states", "exits", "stats", "decoding", "diagnostics", "runtime",
             "calibration", "generation", "ltt", "tasks", "lean_step"},
    "glue": {"tokenizer", "documents", "tokens", "vocab", "windows", "data", "lit", "callbacks", "plots",
             "distributed", "schema", "runs", "config", "cli", "hf", "checkpoints"},
    "entry": {"train", "evaluate", "train_gate", "calibrate", "report", "diagnose", "generate", "figures", "bench",
              "sweep", "task_tables", "commands", "__main__", "bench_decode", "bench_speculative", "bench_sweeps"},
}
RANK = {m: i for i, layer in enumerate(LAYERS.values()) for m in layer}
CORE_THIRD_PARTY = {"torch", "numpy"}


def modules() -> list[str]:
    return sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")


def imports(name: str) -> tuple[set[str], set[str]]:
    """(recdepth modules, top-level third-party packages) imported anywhere in a module."""
    tree = ast.parse((PKG / f"{name}.py").read_text())
    inner, outer = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "recdepth":
                    if len(parts) > 1:
                        inner.add(parts[1])
                else:
                    outer.add(parts[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                inner.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            elif node.module.split(".")[0] == "recdepth":
                parts = node.module.split(".")
                inner.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names if a.name in RANK])
            else:
                outer.add(node.module.split(".")[0])
    inner.discard(name)  # an entry point running its importable self under __main__
    return inner, outer


def graph() -> dict[str, set[str]]:
    return {m: imports(m)[0] - {"__version__"} for m in modules()}


def test_every_module_has_a_layer_and_is_in_the_module_map():
    doc = recdepth.__doc__
    for m in modules():
        assert m in RANK, f"recdepth/{m}.py: assign it a layer in tests/test_layers.py (core, glue, entry)"
        assert f"{m}.py" in doc, f"recdepth/{m}.py is missing from the module map in recdepth/__init__.py"


def test_no_import_points_up():
    bad = [f"{m} ({layer_of(m)}) imports {d} ({layer_of(d)})"
           for m, deps in graph().items() for d in deps if RANK[d] > RANK[m]]
    assert not bad, "upward imports: " + "; ".join(bad)


def layer_of(m: str) -> str:
    return next(k for k, v in LAYERS.items() if m in v)


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


def test_imports_are_seen_inside_functions(tmp_path, monkeypatch):
    """A function-local import counts (the back edges of cycles used to hide there)."""
    (tmp_path / "lazy.py").write_text("def f():\n    from recdepth.train import train\n    import recdepth.sweep\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path)
    assert imports("lazy")[0] == {"train", "sweep"}


@pytest.mark.parametrize("m", sorted(LAYERS["core"]))
def test_core_imports_only_torch_and_numpy(m):
    outer = imports(m)[1] - set(sys.stdlib_module_names) - {"__future__"}
    assert outer <= CORE_THIRD_PARTY, f"recdepth/{m}.py (core) imports {sorted(outer - CORE_THIRD_PARTY)}"
