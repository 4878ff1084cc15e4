"""Shared fixtures of the CLI tests."""

import importlib
import logging
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    """The environment of a CLI subprocess: this checkout's code, a token cache of the
    session's own, W&B offline with no key (nothing may reach the network)."""
    e = dict(os.environ)
    e["RECDEPTH_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")])
    e["WANDB_MODE"] = "offline"
    e.pop("WANDB_API_KEY", None)
    return e


@pytest.fixture
def cli_here(env, monkeypatch, capsys):
    """`python -m <module> <args...>` run in this process: the module's own `main()` with
    sys.argv, the working directory and the CLI environment a subprocess gets, without the
    ~4 s a fresh interpreter spends importing torch and Lightning. For error paths; a few
    tests keep a real subprocess (exit status and stderr of the interpreter itself).
    Returns (exit status, stderr, stdout): a `SystemExit("error: ...")` counts as status 1
    with its message on stderr, as the interpreter prints it."""
    def call(module: str, args, cwd) -> tuple[int, str, str]:
        mod = importlib.import_module(module)
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level  # Hydra configures logging for its job
        code, msg = 0, ""
        with monkeypatch.context() as m:
            m.chdir(cwd)
            for k in ("RECDEPTH_CACHE", "WANDB_MODE"):
                m.setenv(k, env[k])
            m.delenv("WANDB_API_KEY", raising=False)
            m.setattr(sys, "argv", [module, *map(str, args)])
            try:
                mod.main()
            except SystemExit as e:
                code, msg = (1, f"{e.code}\n") if isinstance(e.code, str) else (e.code or 0, "")
            finally:
                root.handlers[:] = handlers
                root.setLevel(level)
        captured = capsys.readouterr()
        return code, captured.err + msg, captured.out
    return call


@pytest.fixture(scope="module")
def ckpt_env(env):
    """The CLI tests' token cache and W&B offline for in-process tests of a module (the
    tokens of `tiny_ckpt`'s data are then found, not tokenized again)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECDEPTH_CACHE", env["RECDEPTH_CACHE"])
        mp.setenv("WANDB_MODE", "offline")
        yield


@pytest.fixture(scope="session")
def tiny_ckpt(env, tmp_path_factory):
    """A checkpoint of `debug=tiny`, trained in-process once a session with the CLI tests'
    token cache (use it with `ckpt_env`)."""
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.train import train

    d = tmp_path_factory.mktemp("tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECDEPTH_CACHE", env["RECDEPTH_CACHE"])
        mp.setenv("WANDB_MODE", "offline")
        with initialize_config_dir(conf_dir(), version_base="1.3"):
            cfg = compose("config", overrides=["debug=tiny", f"runs_dir={d / 'runs'}", f"run_dir={d / 'run'}",
                                               "eval.tokens=0", "callbacks=none", "logger=csv"])
        train(cfg)
    return d / "run" / "train" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is several times faster than two on a busy 2-core machine
    (a module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
