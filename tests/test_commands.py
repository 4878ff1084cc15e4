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


def _help_case(name: str):
    """Each Hydra command's help composes every config group (5-10 s here): train's and
    evaluate's run by default, the others' with `make test-slow` (docs/results/test-suite.md)."""
    hydra = commands.COMMANDS[name][0] not in commands.ARGPARSE
    return pytest.param(name, marks=pytest.mark.slow) if hydra and name not in ("train", "evaluate") else name


@pytest.mark.parametrize("name", [_help_case(n) for n in sorted(commands.COMMANDS)])
def test_every_command_has_its_help(name, monkeypatch, capsys):
    """`recdepth <command> --help` prints the command's own help and exits 0: Hydra's for
    the config commands (with the config groups), argparse's for bench and figures,
    lm_eval's for lm-eval."""
    monkeypatch.setattr(sys, "argv", ["recdepth", name, "--help"])
    try:
        commands.main()
    except SystemExit as e:
        assert e.code in (0, None), (name, e.code)
    out = capsys.readouterr().out
    module = commands.COMMANDS[name][0]
    if module in commands.ARGPARSE:
        assert "usage:" in out and "-h, --help" in out, out[:300]
    else:  # Hydra's help lists the config groups the command composes
        assert "== Config groups ==" in out or "Powered by Hydra" in out, out[:300]


def test_recdepth_train_composes_the_config_python_dash_m_recdepth_train_does(tmp_path, cli_here):
    args = ["experiment=hops", "exit.tau=0.01", "--cfg", "job"]
    code_a, err_a, a = cli_here("recdepth.commands", ["train", *args], tmp_path)  # the console script
    code_b, err_b, b = cli_here("recdepth.train", args, tmp_path)
    assert code_a == code_b == 0, err_a + err_b
    assert a == b and "layout: sorted" in a and "tau: 0.01" in a


ENTRIES = ["train", "evaluate", "calibrate", "report", "generate", "diagnose", "train_gate"]


@pytest.mark.parametrize("name", ENTRIES)
def test_every_entry_point_runs_through_the_one_runner(name):
    """Each entry point's Hydra task is cli.task's, bound at <module>._task, so pickle (and
    submitit's cloudpickle) carry it by reference, not by value."""
    import importlib
    import pickle

    mod = importlib.import_module(f"recdepth.{name}")
    assert mod._task.__qualname__ == "_task" and mod._task.__module__ == f"recdepth.{name}"
    assert pickle.loads(pickle.dumps(mod._task)) is mod._task
    src = Path(mod.__file__).read_text()
    assert "@hydra.main" not in src and "already holds" not in src and "config.yaml\").write_text" not in src


def test_runner_refuses_a_held_result_and_a_missing_run_dir(tmp_path):
    from omegaconf import OmegaConf

    from recdepth.cli import runner as cli

    run = tmp_path / "run"
    cli.start_job(run, OmegaConf.create({"a": 1, "run_dir": str(run)}))
    assert OmegaConf.load(run / "config.yaml") == OmegaConf.create({"a": 1, "run_dir": str(run)})
    cli.refuse(run, "metrics.json")  # nothing held: no error
    (run / "metrics.json").write_text("{}")
    with pytest.raises(FileExistsError, match=rf"^run_dir: {run} already holds metrics.json; choose a new run_dir$"):
        cli.refuse(run, "gate.pt", "metrics.json")
    with pytest.raises(FileExistsError, match="already holds a report;"):
        cli.refuse(run, "metrics.json", what="a report")
    cfg = OmegaConf.create({"run_dir": "${hydra:runtime.output_dir}"})
    with pytest.raises(ValueError, match=r"^run_dir: set run_dir=<directory> when calling evaluate\(cfg\) outside Hydra$"):
        cli.job_dir(cfg, "evaluate")


def test_debug_tiny_trains_and_evaluates_through_the_console_script(tmp_path, cli_here):
    """`recdepth train debug=tiny`, then `recdepth evaluate` on its checkpoint (the console
    script's dispatch and the real mains, in process): the evaluation scores the training
    run's test split exactly as the training run's own eval block did."""
    import json

    run = tmp_path / "run"
    code, err, _ = cli_here("recdepth.commands", ["train", "debug=tiny", "callbacks=none", "exit=accel",
                                                  f"run_dir={run}"], tmp_path)
    assert code == 0, err[-3000:]
    trained = json.loads((run / "metrics.json").read_text())
    ckpt = run / "train" / "checkpoints" / "last.ckpt"
    code, err, _ = cli_here("recdepth.commands", ["evaluate", f"ckpt={ckpt}", "exit=accel", "eval.tokens=6",
                                                  "eval.warmup_tokens=1", f"run_dir={tmp_path / 'ev'}"], tmp_path)
    assert code == 0, err[-3000:]
    ev = json.loads((tmp_path / "ev" / "metrics.json").read_text())["eval"]
    assert ev["ce"] == pytest.approx(trained["eval"]["ce"], rel=1e-9)
    assert ev["applications_per_token"] == trained["eval"]["applications_per_token"]
