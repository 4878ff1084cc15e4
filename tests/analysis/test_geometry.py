"""Loop-geometry quantities (SPEC §2, paper eqs. 1, 2, 5, 6) against independent computations."""

import math

import pytest
import torch

from recdepth.analysis import geometry as geo


def spiral(rho: float, theta: float, K: int, d: int = 6, tokens: int = 3) -> torch.Tensor:
    """x^(k) = ρ^k R(θ)^k x0, rotating in the first two coordinates: [K+1, tokens, d]."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(tokens, d, generator=g, dtype=torch.float64)
    x0[:, 2:] = 0
    c, s = math.cos(theta), math.sin(theta)
    R = torch.eye(d, dtype=torch.float64)
    R[:2, :2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    states, x = [x0], x0
    for _ in range(K):
        x = rho * x @ R.T
        states.append(x)
    return torch.stack(states)


@pytest.mark.parametrize("rho, theta", [(0.8, 0.3), (0.5, 1.2), (0.95, 2.5), (1.0, 0.7)])
def test_rotation_contraction_closed_forms(rho, theta):
    traj = spiral(rho, theta, K=12)
    norms = geo.step_norms(traj)  # [12, tokens]
    torch.testing.assert_close(norms[1:] / norms[:-1], torch.full_like(norms[1:], rho))
    cos = geo.step_cosines(traj)  # [11, tokens]
    torch.testing.assert_close(cos, torch.full_like(cos, math.cos(theta)))
    acc = geo.accelerations(traj)  # [11, tokens]
    gain = math.sqrt(rho**2 - 2 * rho * math.cos(theta) + 1)  # |ρ e^{iθ} − 1|
    torch.testing.assert_close(acc, gain * norms[:-1])
    rel = geo.relative_acceleration(geo.steps(traj)[1:], geo.steps(traj)[:-1], eps=0.0)
    torch.testing.assert_close(rel, torch.full_like(rel, gain / (1 + rho)))


def test_drift_to_loop_ratio_closed_form():
    rho, K = 0.7, 8
    traj_g = spiral(rho, 0.4, K=K)
    c = geo.step_norms(traj_g)[0]  # ‖Δ^(0)‖ per token
    mean_step = c * (1 - rho**K) / (K * (1 - rho))  # geometric series
    jump = torch.zeros_like(traj_g[-1])
    jump[:, 3] = 5.0  # the next group starts 5 away, orthogonally
    traj_next = torch.stack([traj_g[-1] + jump, traj_g[-1] + 2 * jump])
    torch.testing.assert_close(geo.drift_to_loop_ratio(traj_g, traj_next), 5.0 / mean_step)


def test_against_a_float64_loop_from_the_definitions():
    g = torch.Generator().manual_seed(1)
    traj = torch.randn(7, 2, 3, 5, generator=g, dtype=torch.float64)  # [K+1, B, T, d]
    nxt = torch.randn(4, 2, 3, 5, generator=g, dtype=torch.float64)
    K = traj.shape[0] - 1
    for b in range(2):
        for t in range(3):
            xs = [[float(v) for v in traj[k, b, t]] for k in range(K + 1)]
            D = [[xs[k + 1][i] - xs[k][i] for i in range(5)] for k in range(K)]
            nrm = [math.sqrt(sum(v * v for v in dk)) for dk in D]
            for k in range(K):
                assert geo.step_norms(traj)[k, b, t].item() == pytest.approx(nrm[k], rel=1e-12)
            for k in range(1, K):
                dot = sum(D[k][i] * D[k - 1][i] for i in range(5))
                assert geo.step_cosines(traj)[k - 1, b, t].item() == pytest.approx(
                    dot / (nrm[k] * nrm[k - 1]), rel=1e-12)
                acc = math.sqrt(sum((D[k][i] - D[k - 1][i]) ** 2 for i in range(5)))
                assert geo.accelerations(traj)[k - 1, b, t].item() == pytest.approx(acc, rel=1e-12)
            drift = math.sqrt(sum((float(nxt[0, b, t, i]) - xs[K][i]) ** 2 for i in range(5)))
            assert geo.drift_to_loop_ratio(traj, nxt)[b, t].item() == pytest.approx(
                drift / (sum(nrm) / K), rel=1e-12)


def test_zero_step_has_cosine_zero_not_nan():
    traj = torch.zeros(4, 2, 3, dtype=torch.float64)
    assert torch.equal(geo.step_cosines(traj), torch.zeros(2, 2, dtype=torch.float64))


def test_state_cosine_distance():
    """1 − cos∠(x, y) (the `cosine` exit, docs/spec.md §3b): closed forms, a float64 loop
    from the definition, the zero-state conventions, and float32 near cos = 1, where the
    direct 1 − x·y/(‖x‖‖y‖) cancels."""
    x = torch.tensor([[3.0, 4.0], [1.0, 0.0], [1.0, 0.0], [2.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([[6.0, 8.0], [0.0, 2.0], [-3.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(geo.state_cosine_distance(x, y),
                               torch.tensor([0.0, 1.0, 2.0, 1 - math.cos(math.pi / 4)], dtype=torch.float64))
    # the planar spiral of the tests above: consecutive states are θ apart, 1 − cos θ (x0 has no other part)
    traj = spiral(0.8, 0.3, K=5)
    torch.testing.assert_close(geo.state_cosine_distance(traj[1:], traj[:-1]),
                               torch.full((5, 3), 1 - math.cos(0.3), dtype=torch.float64))
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 7, 5, generator=g, dtype=torch.float64)
    for i in range(7):
        u, v = a[i].tolist(), b[i].tolist()
        ref = 1 - sum(p * q for p, q in zip(u, v)) / math.sqrt(sum(p * p for p in u) * sum(q * q for q in v))
        assert geo.state_cosine_distance(a[i], b[i]).item() == pytest.approx(ref, rel=1e-12)
    z = torch.zeros(2, 3, dtype=torch.float64)
    assert geo.state_cosine_distance(z, z).tolist() == [0.0, 0.0]  # two zero states: no movement
    assert geo.state_cosine_distance(z, x[:2, :1].expand(2, 3)).tolist() == [1.0, 1.0]  # no direction: cos 0
    assert geo.state_cosine_distance(x[:2, :1].expand(2, 3), z).tolist() == [1.0, 1.0]
    # float32, angle 1e-4 apart: 1 − cos = 5e-9, far below float32's spacing near 1 (6e-8)
    t = 1e-4
    p = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float32)
    q = torch.tensor([[math.cos(t), math.sin(t), 0.0]], dtype=torch.float32)
    assert geo.state_cosine_distance(p, q).item() == pytest.approx(1 - math.cos(t), rel=1e-3)
