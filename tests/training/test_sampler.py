"""Loop sampler statistics (SPEC §1): lognormal-Poisson with one draw per group."""

import math

import numpy as np
import pytest
import torch

from recdepth.training.sampler import LoopSampler, lognormal_poisson


def draws(r=12.0, sigma=0.5, groups=3, steps=20000, seed=0):
    s = LoopSampler("lognormal_poisson", groups, r, sigma, backprop_depth=8, seed=seed)
    return np.array([s.sample() for _ in range(steps)])


def test_mean_and_variance_match_the_closed_form():
    """τ ~ LogNormal(log r − σ²/2, σ) has E[τ] = r and Var[τ] = r²(e^{σ²} − 1);
    n = Poisson(τ) + 1 has E[n] = r + 1 and Var[n] = E[τ] + Var[τ]."""
    r, sigma = 12.0, 0.5
    n = draws(r, sigma).ravel()
    var = r + r**2 * (math.exp(sigma**2) - 1)
    se = math.sqrt(var / n.size)
    assert abs(n.mean() - (r + 1)) < 5 * se
    assert n.var() == pytest.approx(var, rel=0.05)
    assert n.min() >= 1


def test_one_independent_draw_per_group():
    d = draws(steps=5000)
    assert d.shape == (5000, 3)
    # Groups differ within a step (independent draws), and are uncorrelated across groups.
    assert (d[:, 0] != d[:, 1]).mean() > 0.8
    assert abs(np.corrcoef(d[:, 0], d[:, 2])[0, 1]) < 0.05


def test_reproducible_from_seed_and_state():
    a, b, c = draws(steps=50, seed=1), draws(steps=50, seed=1), draws(steps=50, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    s = LoopSampler("lognormal_poisson", 3, 12, seed=5)
    for _ in range(10):
        s.sample()
    state = s.state_dict()
    nxt = [s.sample() for _ in range(5)]
    s2 = LoopSampler("lognormal_poisson", 3, 12, seed=99)
    s2.load_state_dict(state)
    assert [s2.sample() for _ in range(5)] == nxt


def test_small_sigma_concentrates_on_poisson():
    g = torch.Generator().manual_seed(0)
    n = np.array([lognormal_poisson(6.0, 1e-6, g) for _ in range(20000)])
    assert n.mean() == pytest.approx(7.0, abs=0.06) and n.var() == pytest.approx(6.0, rel=0.05)


def test_fixed_sampler():
    s = LoopSampler("fixed", 2, 7, sigma=0.0, backprop_depth=None)
    assert s.sample() == [7, 7]


@pytest.mark.parametrize("kw, field", [
    (dict(name="uniform"), "sampler.name"), (dict(mean=0.5), "sampler.mean"),
    (dict(sigma=-1.0), "sampler.sigma"), (dict(backprop_depth=0), "sampler.backprop_depth"),
    (dict(name="fixed", mean=2.5), "sampler.mean"),
])
def test_bad_sampler_fields(kw, field):
    args = dict(name="lognormal_poisson", n_groups=3, mean=12, sigma=0.5, backprop_depth=8)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        LoopSampler(**args)
