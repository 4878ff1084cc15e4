"""The frontier's verdicts (recdepth/analysis/frontier.py)."""

import pytest

from recdepth.analysis.frontier import holm_verdict, verdict


@pytest.mark.parametrize("lo, hi, want", [
    (-7.0e-8, -1.5e-9, "not resolved"),   # float rounding: one setting decoded in two batch shapes
    (2.0e-9, 4.0e-7, "not resolved"),
    (-1.0e-3, -1.0e-4, "beats the fixed frontier"),
    (1.0e-5, 3.0e-3, "worse than the fixed frontier"),
    (-1.0e-3, 2.0e-3, "not resolved"),
    (float("nan"), 1.0, "not resolved"),
])
def test_a_verdict_needs_an_interval_beyond_float_rounding(lo, hi, want):
    assert verdict(lo, hi) == want


@pytest.mark.parametrize("d, p, want", [(-3.0e-8, 0.001, "not resolved"), (-5.0e-4, 0.001, "beats the fixed frontier"),
                                        (5.0e-4, 0.001, "worse than the fixed frontier"), (-5.0e-4, 0.2, "not resolved")])
def test_holm_verdict_needs_the_adjusted_p_and_more_than_rounding(d, p, want):
    assert holm_verdict(d, p) == want
