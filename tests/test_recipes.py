"""docs/contributing.md's recipes as a newcomer follows them, on a copy of the package: a rule,
a task and a source are each one new file in their folder (a halting loss one class added to
recdepth/training/halting.py), no other file edited; the real command, in a subprocess,
selects them by name; and the default suite still collects with them present.

(The recipes' own tests, which check each extension's decisions by hand, define their class
inside the test file: tests/exits/test_exit_rule.py, tests/data/test_tasks.py,
tests/data/test_data.py, tests/training/test_halting.py.)"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

RULE = '''\
"""exit=step_ratio: exit once a step is below τ times the loop's first step."""
import torch

from recdepth.analysis import geometry as geo
from recdepth.exits import ExitRule


class StepRatio(ExitRule):
    name = "step_ratio"
    earliest = 2
    default_tau = 0.5

    def history0(self, x0, vocab):
        return x0.new_zeros(x0.shape[0]), x0.new_zeros(x0.shape[0])  # ‖Δ^(0)‖, ‖Δ^(n−1)‖

    def advance(self, s):
        norm = geo.step_norm(s.x_new - s.x_prev)
        return torch.where(s.old[0] > 0, s.old[0], norm), norm

    def fires(self, s, new):
        return new[1] < s.tau * new[0]
'''

TASK = '''\
"""data=parity: k bits and their parity, ` 1 0 1 = 0` (difficulty k)."""
from dataclasses import dataclass

from recdepth.data.tasks import Task


@dataclass
class Parity(Task):
    name: str = "parity"
    ones: float = 0.5
    """The probability of a 1."""

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.ones <= 1:
            raise ValueError(f"data.task.ones: expected a probability in [0, 1], got {self.ones!r}")

    def generate(self, rng, sizes):
        bits = [int(rng.random() < self.ones) for _ in range(rng.randint(*sizes))]
        return [(str(b), 0) for b in bits] + [("=", 0), (str(sum(bits) % 2), len(bits))]
'''

SOURCE = '''\
"""data=generated: a few documents of numbered sentences."""
from dataclasses import dataclass

from recdepth.data.sources import TextSource
from recdepth.data.token_cache import SourceSpec


@dataclass
class Generated(TextSource):
    source: str = "generated"
    documents_n: int = 6
    """How many generated documents (>= 1)."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.documents_n, bool) or not isinstance(self.documents_n, int) or self.documents_n < 1:
            raise ValueError(f"data.documents_n: expected an integer >= 1, got {self.documents_n!r}")

    def documents(self, hf_cache=None):
        texts = [" ".join(f"Line {i} of document {d} says {i * d % 7}." for i in range(300))
                 for d in range(self.documents_n)]
        return SourceSpec(self.source, {"documents_n": self.documents_n}, "generated-v1", lambda: iter(texts),
                          self.max_tokens)
'''

HALT = '''

class ExpectedDepth(HaltingLoss):
    """halt=expected_depth: Σ p_n L_n + β Σ p_n n (the expected depth as the ponder cost)."""

    name = "expected_depth"
    reading = "cdf"

    def per_token(self, h, s):
        p = halting_distribution(h.z).exp()
        n = torch.arange(1, p.shape[0] + 1, dtype=p.dtype).view(-1, 1, 1)
        return (p * h.nll).sum(0) + s.beta * (p * n).sum(0)
'''

RUN = ["debug=tiny", "callbacks=none", "trainer.max_steps=2", "eval.tokens=64", "eval.latency_tokens=0"]


@pytest.fixture(scope="module")
def newcomer(env, tmp_path_factory):
    """A copy of the package with the four extensions written in, as the recipes say, and
    the environment that imports it ahead of this checkout."""
    root = tmp_path_factory.mktemp("newcomer")
    pkg = root / "recdepth"
    shutil.copytree(REPO / "recdepth", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "exits" / "rules" / "step_ratio.py").write_text(RULE)
    (pkg / "data" / "tasks" / "parity.py").write_text(TASK)
    (pkg / "data" / "sources" / "generated.py").write_text(SOURCE)
    with open(pkg / "training" / "halting.py", "a") as f:
        f.write(HALT)
    e = dict(env)
    e["PYTHONPATH"] = os.pathsep.join([str(root), e["PYTHONPATH"]])
    return root, e


def train(root, env, args):
    p = subprocess.run([sys.executable, "-m", "recdepth.train", *RUN, *args], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((root / args[-1].split("=", 1)[1] / "metrics.json").read_text())


def test_a_new_rule_task_and_halting_loss_are_selected_by_name(newcomer):
    """`exit=step_ratio data=parity halt=expected_depth`: the three files found with no import
    written anywhere; the run trains on parity's records and evaluates under step_ratio."""
    root, env = newcomer
    m = train(root, env, ["model=single", "exit=step_ratio", "data=parity", "data.task.size=[2,5]",
                          "data.task.extrapolation=[6,7]", "data.train_records=300", "data.test_records=8",
                          "data.validation_records=8", "data.extrapolation_records=8", "halt=expected_depth",
                          "run_dir=run_rule"])
    text = (root / "run_rule" / "config.yaml").read_text()
    assert "name: step_ratio" in text and "name: parity" in text and "loss: expected_depth" in text, text
    assert m["eval"]["exit"] == "step_ratio" and m["eval"]["tau"] == 0.5  # the rule's own default τ
    assert 2 <= m["eval"]["mean_applications"] <= 32  # step_ratio fires from n = 2 on, at most max_steps
    assert m["eval"]["answers"]["tokens"] > 0  # parity's answers, scored


def test_a_new_source_is_selected_by_name(newcomer):
    root, env = newcomer
    train(root, env, ["data=generated", "data.documents_n=3", "run_dir=run_source"])
    assert "source: generated" in (root / "run_source" / "config.yaml").read_text()


def test_the_default_suite_collects_with_the_newcomers_files(newcomer):
    """No test module asserts a hand-kept list of what is registered at import or collection."""
    root, env = newcomer
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        str(REPO / "tests")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, textwrap.shorten(p.stdout[-3000:] + p.stderr[-2000:], 3000)
    assert " collected" in p.stdout and "error" not in p.stdout.splitlines()[-1], p.stdout[-500:]
