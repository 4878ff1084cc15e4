"""Adding an exit rule is one class (recdepth/exits/rule.py): a rule defined here, in this file
and nowhere else, is an `exit=<name>` option, checks its τ with its own one-line error,
decides in the eager monitor as in the loop compiled whole (records identical), and joins
the frontier's default grid and the report's calibrated rules."""

import copy
import math

import pytest
import torch

from recdepth import exits
from recdepth.analysis import geometry as geo
from recdepth.decode import engine as D
from recdepth.decode import scoring as S
from recdepth.decode.settings import DecodeSettings
from recdepth.exits import rule as rule_module
from recdepth.model.looped import GPTConfig, LoopedGPT


@pytest.fixture
def step_ratio(monkeypatch):
    """A rule with a history: exit once a step is below τ times the loop's first step,
    ‖Δ^(n−1)‖ < τ ‖Δ^(0)‖ (earliest n = 2). Registered for this test only."""
    monkeypatch.setattr(rule_module, "_REGISTRY", copy.copy(rule_module._REGISTRY))

    class StepRatio(exits.ExitRule):
        name = "step_ratio"
        earliest = 2
        default_tau = 0.5
        frontier = (0.3, 0.6)

        def history0(self, x0, vocab):
            return x0.new_zeros(x0.shape[0]), x0.new_zeros(x0.shape[0])  # ‖Δ^(0)‖, ‖Δ^(n−1)‖

        def advance(self, s):
            norm = geo.step_norm(s.x_new - s.x_prev)
            first = torch.where(s.old[0] > 0, s.old[0], norm)  # the placeholder 0 until n = 1
            return first, norm

        def fires(self, s, new):
            return new[1] < s.tau * new[0]

        def check_tau(self, where, tau):
            if not (isinstance(tau, float | int) and 0 < tau < 1):
                raise ValueError(f"{where}: expected a ratio in (0, 1) for rule 'step_ratio', got {tau!r}")
            return float(tau)

    return StepRatio


def test_a_rule_is_registered_by_its_class_and_decides_as_its_definition_says(step_ratio):
    assert "step_ratio" in exits.names() and exits.lookup("step_ratio").earliest == 2
    # the eager monitor on a contracting map x -> A x: the step norms shrink by |λ| each
    # application, so n = the first n >= 2 with ‖Δ^(n−1)‖ < τ ‖Δ^(0)‖, computed here by hand
    A = torch.tensor([[0.8, -0.3], [0.3, 0.8]], dtype=torch.float64)  # |λ| = sqrt(0.73)
    x0 = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, -1.0]], dtype=torch.float64)
    for tau in (0.3, 0.5, 0.9):
        _, n = exits.iterate(lambda x: x @ A.T, x0, exits.build("step_ratio", tau, max_steps=30))
        want = next(k for k in range(2, 31) if math.sqrt(0.73) ** (k - 1) < tau)
        assert n.tolist() == [want] * 3, tau
    with pytest.raises(ValueError, match=r"^exit\.tau: expected a ratio in \(0, 1\) for rule 'step_ratio', got 1\.5$"):
        exits.build("step_ratio", 1.5)
    with pytest.raises(TypeError, match="reserved"):
        type("Oracle", (exits.ExitRule,), {"name": "oracle"})


def test_a_rule_defined_in_a_test_is_an_exit_option_and_in_the_default_grids(step_ratio):
    from recdepth.cli.runner import compose_job
    from recdepth.config.frontier_grid import FrontierSweeperConf, settings
    from recdepth.config.schema import ReportSettings, validated

    cfg = compose_job("evaluate", ["exit=step_ratio", "ckpt=x", "run_dir=/tmp/unused"])
    assert (cfg.exit.name, cfg.exit.tau) == ("step_ratio", 0.5)
    assert validated(cfg).exit.name == "step_ratio"
    with pytest.raises(ValueError, match=r"^exit\.tau: expected a ratio in \(0, 1\)"):
        validated(compose_job("evaluate", ["exit=step_ratio", "exit.tau=2.0", "ckpt=x", "run_dir=/tmp/unused"]))
    grid = FrontierSweeperConf()
    assert grid.rules["step_ratio"] == [0.3, 0.6]
    assert [s.exit for s in settings(grid) if s.exit["name"] == "step_ratio"] == [
        {"name": "step_ratio", "tau": 0.3}, {"name": "step_ratio", "tau": 0.6}]
    report = ReportSettings()
    assert "step_ratio" in report.calibrate and "step_ratio" not in report.rules  # no report grid of its own


def test_a_rule_defined_in_a_test_runs_alike_eager_and_compiled_as_one_graph(step_ratio):
    """The decoding engine's eager lean step (ExitMonitor) against the compiled batch-1 loop
    (torch.while_loop with `observe_step`): applications identical, NLL within float32 rounding,
    and the depth really varies."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=20, vocab_size=40, groups=[[1]], state_init="normal")
    m = LoopedGPT(cfg).eval()
    policy = exits.build("step_ratio", 0.6, max_steps=12)
    tokens = torch.randint(0, 40, (40,), generator=torch.Generator().manual_seed(3))
    recs, calls = [], []
    for step in ("lean", "compiled"):
        lean = D.lean_steps(m, step)
        real = lean.loop
        lean.loop = lambda *a, real=real, step=step: calls.append(step) or real(*a)
        _, rec = S.evaluate_exit(m, tokens, policy, 16, DecodeSettings(batch_size=1, latency_tokens=0, warmup_tokens=0,
                                                                       seed=5, backend=step))
        del lean.loop
        recs.append(rec)
    eager, compiled = recs
    assert calls.count("lean") == 0 and calls.count("compiled") >= 16  # the loop as one graph at every token
    assert (eager["apps"] == compiled["apps"]).all()
    assert abs(eager["nll"] - compiled["nll"]).max() <= 1e-5
    assert len(set(eager["apps"].ravel().tolist())) > 1 and eager["apps"].min() >= 2
