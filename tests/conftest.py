"""Shared fixtures of the CLI tests."""

import os
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
