"""`recdepth <command> ...` (recdepth/commands.py): one console script for every entry point."""

import subprocess
import sys
import types
from pathlib import Path

import pytest
import tomllib

from recdepth import commands


def py(*args, cwd=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_help_lists_every_command_with_one_line_and_loads_no_torch():
    p = py("-c", "import sys; from recdepth import commands; commands.main(['--help']); "
                 "assert 'torch' not in sys.modules, 'recdepth --help imported torch'")
    assert p.returncode == 0, p.stderr
    listed = {line.split()[0]: line for line in p.stdout.splitlines() if line.startswith("  ")}
    assert set(listed) == set(commands.COMMANDS) >= {"train", "evaluate", "frontier", "calibrate", "report",
                                                     "generate", "diagnose", "train-gate", "bench", "figures"}
    assert all(len(line.split()) > 2 for line in listed.values())  # a description on the same line


def test_python_dash_m_recdepth_is_the_console_script():
    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["recdepth"] == "recdepth.commands:main"
    assert py("-m", "recdepth", "--help").stdout == py("-c", "from recdepth import commands; "
                                                             "commands.main(['--help'])").stdout


@pytest.mark.parametrize("argv, want", [(["trian"], "unknown command 'trian' (did you mean train?)"),
                                        (["sweep"], "unknown command 'sweep' (expected one of train, ")])
def test_unknown_command_is_one_line_naming_it(argv, want):
    p = py("-m", "recdepth", *argv)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and want in p.stderr


def test_no_command_prints_usage_and_fails():
    p = py("-m", "recdepth")
    assert p.returncode == 2 and "usage: recdepth <command>" in p.stderr


@pytest.mark.parametrize("argv, module, want", [
    (["train", "model=grouped", "--multirun", "exit.tau=1,2"], "recdepth.train",
     ["recdepth train", "model=grouped", "--multirun", "exit.tau=1,2"]),
    (["frontier", "ckpt=x"], "recdepth.evaluate", ["recdepth frontier", "--multirun", "hydra/sweeper=frontier", "ckpt=x"]),
    (["train-gate", "ckpt=x"], "recdepth.train_gate", ["recdepth train-gate", "ckpt=x"]),
    (["bench", "exits", "--ckpt", "x"], "recdepth.bench", ["exits", "--ckpt", "x"]),
    (["figures", "run"], "recdepth.figures", ["run"]),
])
def test_a_command_runs_its_entry_point_with_the_rest_of_the_line(monkeypatch, argv, module, want):
    seen = {}

    def fake(name):
        def main(args=None):
            seen.update(name=name, argv=list(args) if args is not None else list(sys.argv))
        return types.SimpleNamespace(main=main)

    monkeypatch.setattr(commands.importlib, "import_module", fake)
    monkeypatch.setattr(sys, "argv", ["recdepth", *argv])
    assert commands.main() == 0
    assert seen == {"name": module, "argv": want}


def test_recdepth_train_composes_the_config_python_dash_m_recdepth_train_does(tmp_path):
    args = ["experiment=hops", "exit.tau=0.01", "--cfg", "job"]
    a = py("-m", "recdepth", "train", *args, cwd=tmp_path)
    b = py("-m", "recdepth.train", *args, cwd=tmp_path)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and "layout: sorted" in a.stdout and "tau: 0.01" in a.stdout
