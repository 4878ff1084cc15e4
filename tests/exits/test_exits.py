"""Independent tests for `recdepth.exits` (SPEC.md section 3, "Exit rules").

Everything expected here comes from SPEC section 3 alone: either from closed forms of
simple maps, from hand-built trajectories, or from `_ref_row`, a slow per-row reference
written in plain Python floats (float64):

* x^(0) is the loop's initial state, x^(n) the state after n applications,
  Delta^(j) = x^(j+1) - x^(j);
* after application n the rule's condition is checked if n >= max(min_steps, earliest n);
  the loop also stops at n = max_steps;
* the newest state x^(n) is returned and the cost of the row is n.

Rules (eps = 1e-6; SPEC sections 3 and 3b):

  fixed / none      n = max_steps
  stepnorm          ||Delta^(n-1)|| < tau                                   earliest 1
  stepnorm_rel      ||Delta^(n-1)|| / (||x^(n-1)|| + eps) < tau             earliest 1
  kl                KL(p^(n) || p^(n-1)) < tau, p = softmax(decode(x))      earliest 2
  accel             a^(n-1) < tau and a^(n-2) < tau, a^(j)=||D^(j)-D^(j-1)|| earliest 3
  accel_rel         same with a^(j) / (||D^(j)|| + ||D^(j-1)|| + eps)         earliest 3
  entropy_diff      |H(p^(n)) - H(p^(n-1))| < tau, H(p) = -sum p log p      earliest 2
  cosine            1 - cos(x^(n), x^(n-1)) < tau                           earliest 1
  argmax_stability  argmax p^(j) equal for j = n-k .. n (k = patience)      earliest k+1

(cosine of a zero state: recdepth's convention, docs/spec.md section 3b: two zero states
are at distance 0, a zero and a non-zero state at distance 1.) `tau`, `min_steps` and
`max_steps` may be one value per group; group g then runs under its own values.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from recdepth import exits

EPS = 1e-6
PATIENCE = 5  # argmax_stability's default k
EARLIEST = {"stepnorm": 1, "stepnorm_rel": 1, "kl": 2, "accel": 3, "accel_rel": 3, "entropy_diff": 2, "cosine": 1,
            "argmax_stability": PATIENCE + 1}
TAU_RULES = ["stepnorm", "stepnorm_rel", "kl", "accel", "accel_rel", "entropy_diff", "cosine"]
ALL_RULES = ["fixed", "none", *TAU_RULES, "argmax_stability"]
DTYPES = [torch.float32, torch.float64]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # tiny tensors: intra-op threads only add contention (and seconds) on a busy machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------------------
# plain-Python helpers (float64 python floats)
# --------------------------------------------------------------------------------------


def _norm(v):
    return math.sqrt(math.fsum(t * t for t in v))


def _sub(a, b):
    return [p - q for p, q in zip(a, b)]


def _log_softmax(z):
    m = max(z)
    lse = m + math.log(math.fsum(math.exp(t - m) for t in z))
    return [t - lse for t in z]


def _kl_new_old(z_new, z_old):
    """KL(p_new || p_old) = sum p_new (log p_new - log p_old)."""
    lp = _log_softmax(z_new)
    lq = _log_softmax(z_old)
    return math.fsum(math.exp(a) * (a - b) for a, b in zip(lp, lq))


def _entropy(z):
    """H(softmax(z)) = -sum p log p."""
    return -math.fsum(math.exp(a) * a for a in _log_softmax(z))


def _cos_dist(a, b):
    """1 - cos(a, b), written directly (dot / norms); zero states as in the docstring."""
    na, nb = _norm(a), _norm(b)
    if na == 0 or nb == 0:
        return 0.0 if na == nb else 1.0
    return 1.0 - math.fsum(p * q for p, q in zip(a, b)) / (na * nb)


def _argmax(z):
    """(index of the largest logit, its relative gap to the runner-up)."""
    order = sorted(range(len(z)), key=lambda i: -z[i])
    top, second = z[order[0]], z[order[1]]
    return order[0], (top - second) / max(abs(top), abs(second), 1e-300)


def _check(rule, n, X, tau, logits, patience=PATIENCE):
    """Evaluate the rule after application n on the row's states X[0..n].

    Returns (fires, margin) where margin is the relative distance of the deciding
    quantity (or quantities) from tau, used to guard the test against near-ties
    (argmax_stability: the smallest relative gap between the top two logits of the
    decodes it compares).
    """
    if rule == "argmax_stability":  # argmax p^(j) equal for j = n-k .. n
        tops = [_argmax(logits(j)) for j in range(n - patience, n + 1)]
        return len({t for t, _ in tops}) == 1, min(g for _, g in tops), [t for t, _ in tops]

    def delta(j):
        return _sub(X[j + 1], X[j])

    def accel(j):
        return _norm(_sub(delta(j), delta(j - 1)))

    def accel_rel(j):
        dj, dj1 = delta(j), delta(j - 1)
        return _norm(_sub(dj, dj1)) / (_norm(dj) + _norm(dj1) + EPS)

    if rule == "stepnorm":
        qs = [_norm(delta(n - 1))]
    elif rule == "stepnorm_rel":
        qs = [_norm(delta(n - 1)) / (_norm(X[n - 1]) + EPS)]
    elif rule == "kl":
        qs = [_kl_new_old(logits(n), logits(n - 1))]
    elif rule == "accel":
        qs = [accel(n - 1), accel(n - 2)]
    elif rule == "accel_rel":
        qs = [accel_rel(n - 1), accel_rel(n - 2)]
    elif rule == "entropy_diff":
        qs = [abs(_entropy(logits(n)) - _entropy(logits(n - 1)))]
    elif rule == "cosine":
        qs = [_cos_dist(X[n], X[n - 1])]
    else:  # pragma: no cover
        raise AssertionError(rule)
    margins = [abs(q - tau) / tau for q in qs]
    fires = all(q < tau for q in qs)
    if fires:
        margin = min(margins)
    else:  # the decision is safe if at least one quantity is safely >= tau
        margin = max(m for q, m in zip(qs, margins) if not q < tau)
    return fires, margin, qs


def _ref_row(state, rule, tau, min_steps, max_steps, logits=None, patience=PATIENCE):
    """Slow per-row reference. `state(k)` returns x^(k) (python floats) for this row.

    Returns (n, margins, quantities) -- margins of every check that could have stopped
    the loop early.
    """
    rule = "fixed" if rule == "none" else rule
    earliest = patience + 1 if rule == "argmax_stability" else EARLIEST.get(rule)
    margins, quants = [], []
    for n in range(1, max_steps + 1):
        if n == max_steps:
            return n, margins, quants
        if rule == "fixed" or n < max(min_steps, earliest):
            continue
        X = [state(k) for k in range(n + 1)]
        fires, margin, qs = _check(rule, n, X, tau, logits, patience)
        margins.append(margin)
        quants.append(qs)
        if fires:
            return n, margins, quants
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------------------
# a row-wise test map with varied dynamics (elementwise +,-,*,/ only, so the result of
# one row is bit-identical whether computed alone or inside the batch)
# --------------------------------------------------------------------------------------

D = 8  # 4 rotation planes

# (r, theta, g, scale of x0 - c, scale of c): x -> c + shrink_g(r * R(theta) (x - c))
ROWS = [
    (0.5, 0.0, 0.0, 2.0, 1.0),  # 0 plain contraction
    (0.8, 0.3, 0.0, 1.5, 2.0),  # 1 contracting spiral
    (0.9, 0.1, 0.0, 3.0, 1.0),  # 2 slow contracting spiral
    (0.95, 0.6, 0.0, 1.0, 3.0),  # 3
    (0.3, 1.0, 0.0, 2.5, 1.0),  # 4 fast contraction
    (0.7, 2.5, 0.0, 1.0, 0.5),  # 5 oscillating contraction
    (1.0, 0.05, 0.0, 1.0, 2.0),  # 6 pure rotation, small angle: stepnorm plateaus
    (1.0, 0.2, 0.0, 2.0, 1.0),  # 7 pure rotation
    (0.99, 0.1, 0.0, 1.0, 1.0),  # 8 very slow spiral
    (1.0, 0.0, 0.0, 1.0, 2.0),  # 9 identity: every step is zero
    (0.5, 0.7, 0.0, 0.0, 2.0),  # 10 starts at the fixed point: every step is zero
    (1.06, 0.4, 0.0, 1.0, 1.0),  # 11 expanding spiral: never converges
    (1.0, 1.5, 0.0, 1.0, 1.0),  # 12 large rotation: never converges
    (0.97, 0.02, 0.2, 1.5, 1.0),  # 13 nonlinear slow spiral
    (1.05, 0.3, 0.4, 2.0, 1.0),  # 14 nonlinear, limit-cycle like
    (0.85, 0.0, 0.5, 2.0, 1.0),  # 15 nonlinear contraction
    (0.6, 3.0, 0.0, 1.0, 1.0),  # 16 near-reversal
    (0.999, 0.001, 0.0, 1.0, 1.0),  # 17 almost identity
    (0.9, 0.9, 0.1, 1.0, 2.0),  # 18
    (0.75, 0.15, 0.0, 1e-3, 0.0),  # 19 tiny state near 0: eps matters for the _rel rules
    (0.6, 0.05, 0.0, 3e-6, 0.0),  # 20 tiny state near 0
    (0.4, 0.3, 0.0, 4.0, 0.0),  # 21 contraction to the origin
]
N = len(ROWS)


def _row_params(dtype):
    gen = torch.Generator().manual_seed(1234)
    x0 = torch.empty(N, D, dtype=torch.float64)
    c = torch.empty(N, D, dtype=torch.float64)
    r = torch.empty(N, 1, dtype=torch.float64)
    th = torch.empty(N, 1, dtype=torch.float64)
    g = torch.empty(N, 1, dtype=torch.float64)
    for i, (ri, ti, gi, sx, sc) in enumerate(ROWS):
        ci = torch.randn(D, generator=gen, dtype=torch.float64)
        ci = sc * ci / ci.norm()
        ui = torch.randn(D, generator=gen, dtype=torch.float64)
        ui = sx * ui / ui.norm()
        c[i] = ci
        x0[i] = ci + ui
        r[i], th[i], g[i] = ri, ti, gi
    cos, sin = torch.cos(th), torch.sin(th)
    return {
        "x0": x0.to(dtype),
        "c": c.to(dtype),
        "r": r.to(dtype),
        "cos": cos.to(dtype),
        "sin": sin.to(dtype),
        "g": g.to(dtype),
    }


class SpiralMap:
    """Row-wise map; asserts it is always called with the full batch it was built for."""

    def __init__(self, params, rows=None):
        self.p = {k: v for k, v in params.items() if k != "x0"}
        if rows is not None:
            self.p = {k: v[rows] for k, v in self.p.items()}
        self.n_rows = self.p["c"].shape[0]
        self.calls = 0

    def __call__(self, x):
        assert x.shape == (self.n_rows, D), f"f called with shape {tuple(x.shape)}"
        assert x.dtype == self.p["c"].dtype, f"f called with dtype {x.dtype}"
        self.calls += 1
        p = self.p
        u = x - p["c"]
        ue, uo = u[:, 0::2], u[:, 1::2]
        re = p["cos"] * ue - p["sin"] * uo
        ro = p["sin"] * ue + p["cos"] * uo
        re = p["r"] * re
        ro = p["r"] * ro
        te, to = re * re, ro * ro
        re = re - (p["g"] * (re * te)) / (1.0 + te)
        ro = ro - (p["g"] * (ro * to)) / (1.0 + to)
        return p["c"] + torch.stack([re, ro], dim=-1).reshape(x.shape[0], D)


V = 50


def _decode_weight():
    gen = torch.Generator().manual_seed(99)
    return torch.randn(D, V, generator=gen, dtype=torch.float64) * 1.5


def _make_decode(dtype):
    W = _decode_weight().to(dtype)

    def decode(x):
        return x @ W.to(x.dtype)

    return decode, W.to(torch.float64).tolist()


class _RowTrajectories:
    """Lazily computed per-row trajectories x^(k), each row iterated on its own."""

    def __init__(self, dtype):
        self.params = _row_params(dtype)
        self.maps = [SpiralMap(self.params, rows=slice(i, i + 1)) for i in range(N)]
        self.tensors = [[self.params["x0"][i : i + 1].clone()] for i in range(N)]
        self.lists = [[self.tensors[i][0][0].tolist()] for i in range(N)]
        _, self.W = _make_decode(dtype)
        self._logits = {}

    def state_tensor(self, i, k):
        while len(self.tensors[i]) <= k:
            nxt = self.maps[i](self.tensors[i][-1])
            self.tensors[i].append(nxt)
            self.lists[i].append(nxt[0].tolist())
        return self.tensors[i][k][0]

    def state(self, i):
        def s(k):
            self.state_tensor(i, k)
            return self.lists[i][k]

        return s

    def logits(self, i):
        def z(k):
            key = (i, k)
            if key not in self._logits:
                x = self.state(i)(k)
                self._logits[key] = [
                    math.fsum(x[a] * self.W[a][b] for a in range(D)) for b in range(V)
                ]
            return self._logits[key]

        return z


_TRAJ: dict = {}


def _traj(dtype) -> _RowTrajectories:
    if dtype not in _TRAJ:
        _TRAJ[dtype] = _RowTrajectories(dtype)
    return _TRAJ[dtype]


def _reference(dtype, rule, tau, min_steps, max_steps, patience=PATIENCE):
    T = _traj(dtype)
    ns, xs, margins = [], [], []
    for i in range(N):
        n, m, _ = _ref_row(T.state(i), rule, tau, min_steps, max_steps, logits=T.logits(i), patience=patience)
        ns.append(n)
        xs.append(T.state_tensor(i, n))
        margins.extend(m)
    return torch.tensor(ns), torch.stack(xs), margins


TAUS = {
    "fixed": [1e-3],
    "none": [1e-3],
    "stepnorm": [0.3, 3e-2, 1e-3, 1e-5],
    "stepnorm_rel": [0.2, 3e-2, 1e-3, 1e-5],
    "kl": [1e-1, 1e-2, 2e-3, 1e-4, 1e-6],
    "accel": [0.1, 5e-3, 1e-3, 1e-5],
    "accel_rel": [0.3, 0.1, 2e-2, 1e-3],
    "entropy_diff": [0.1, 1e-2, 1e-3, 1e-5],
    "cosine": [0.1, 1e-2, 1e-3, 5e-5, 1e-7],
    "argmax_stability": [None],  # ignores tau; tested at every k of PATIENCES (`_settings`)
}
PATIENCES = [1, 2, 3, 5]
# float32 KL cannot resolve values far below ~1e-5 (cancellation in log p - log q)
TAUS_F32 = {**TAUS, "kl": [1e-1, 1e-2, 2e-3]}
# a decision is only asserted when its deciding quantity is this far (relative) from tau
MIN_MARGIN = {torch.float64: 1e-7, torch.float32: 1e-3}
# ... and an argmax only when its top two logits are this far apart (relative): float32
# logits x @ W carry a relative error of about D * 2^-24 = 5e-7
MIN_GAP = {torch.float64: 1e-9, torch.float32: 1e-5}


def _min_margin(rule, dtype):
    return (MIN_GAP if rule == "argmax_stability" else MIN_MARGIN)[dtype]
STEP_LIMITS = [(0, 32), (0, 6), (2, 32), (5, 12), (4, 4), (0, 1), (1, 3), (3, 20)]


def _check_integer_n(n, rows):
    assert isinstance(n, torch.Tensor)
    assert n.shape == (rows,)
    assert not n.dtype.is_floating_point and not n.dtype.is_complex and n.dtype != torch.bool


def _run(rule, tau, min_steps, max_steps, x0, f, decode=None, patience=PATIENCE):
    policy = exits.build(rule, tau, min_steps=min_steps, max_steps=max_steps, patience=patience)
    return exits.iterate(f, x0, policy, decode=decode)


def _settings(rule, dtype):
    """(tau, patience) pairs a rule is tested at: its taus, or argmax_stability's k."""
    if rule == "argmax_stability":
        return [(None, k) for k in PATIENCES]
    return [(tau, PATIENCE) for tau in (TAUS_F32 if dtype == torch.float32 else TAUS)[rule]]


# --------------------------------------------------------------------------------------
# sanity of the test design itself (needs no implementation)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("rule", [*TAU_RULES, "argmax_stability"])
def test_reference_design_is_varied_and_tie_free(rule, dtype):
    seen = set()
    for min_steps, max_steps in STEP_LIMITS:
        for tau, k in _settings(rule, dtype):
            n, _, margins = _reference(dtype, rule, tau, min_steps, max_steps, k)
            if (min_steps, max_steps) == (0, 32):
                seen |= set(n.tolist())
                if rule == "argmax_stability":  # every k fires at its earliest n somewhere
                    assert k + 1 in n.tolist(), k
            if margins:
                assert min(margins) > _min_margin(rule, dtype), (rule, tau, k, min_steps, max_steps)
    # every rule fires at the earliest n, somewhere in the middle, and hits max_steps
    assert EARLIEST[rule] in seen and 32 in seen
    assert len(seen) >= 6, sorted(seen)


def test_reference_matches_closed_form_contraction():
    # x -> rho x, ||Delta^(j)|| = (1 - rho) rho^j ||x0||
    rho, s = 0.5, 3.0

    def state(k):
        return [s * rho**k, 0.0]

    for tau in [1.0, 0.1, 1e-3]:
        n, _, qs = _ref_row(state, "stepnorm", tau, 0, 32)
        assert qs[0][0] == pytest.approx((1 - rho) * s)
        expect = next(m for m in range(1, 33) if (1 - rho) * rho ** (m - 1) * s < tau)
        assert n == expect


# --------------------------------------------------------------------------------------
# iterate == slow reference, every rule x taus x step limits x dtypes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("limits", STEP_LIMITS, ids=lambda t: f"min{t[0]}-max{t[1]}")
@pytest.mark.parametrize("rule", ALL_RULES)
def test_iterate_matches_reference(rule, limits, dtype):
    min_steps, max_steps = limits
    T = _traj(dtype)
    decode, _ = _make_decode(dtype)
    for tau, k in _settings(rule, dtype):
        n_ref, x_ref, margins = _reference(dtype, rule, tau, min_steps, max_steps, k)
        if margins:
            assert min(margins) > _min_margin(rule, dtype), "test design: near-tie"
        x0 = T.params["x0"].clone()
        f = SpiralMap(T.params)
        x, n = _run(rule, tau, min_steps, max_steps, x0, f, decode=decode, patience=k)
        _check_integer_n(n, N)
        assert x.shape == (N, D) and x.dtype == dtype
        bad = [
            f"row {i}: expected n={int(a)}, got n={int(b)}"
            for i, (a, b) in enumerate(zip(n_ref.tolist(), n.tolist()))
            if a != b
        ]
        assert not bad, f"{rule} tau={tau} k={k} min={min_steps} max={max_steps} {dtype}: " + "; ".join(
            bad
        )
        if dtype == torch.float64:
            torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)
        else:
            torch.testing.assert_close(x, x_ref, rtol=1e-6, atol=1e-6)
        # f is only called while some row is still running, once per application
        assert f.calls == int(n_ref.max())
        # x0 is not modified
        assert torch.equal(x0, T.params["x0"])


def _observe_step_loop(rule, tau, min_steps, max_steps, x0, f, decode, patience):
    """A loop driven by `exits.observe_step` (the check the compiled whole-loop runs, with
    tensors for n and the limits) over the batch until every row has fired; (n per row)."""
    policy = exits.build(rule, tau, min_steps=min_steps, max_steps=max_steps, patience=patience)
    limits = torch.tensor([math.nan if tau is None else tau, min_steps, max_steps, patience], dtype=torch.float64)
    hist = exits.history0(policy, x0, _decode_weight().shape[1])
    x, n = x0, torch.zeros((), dtype=torch.long)
    n_row = torch.zeros(x0.shape[0], dtype=torch.long)
    active = torch.ones(x0.shape[0], dtype=torch.bool)
    while bool(active.any()):
        x_new = f(x)
        n = n + 1
        fired, hist = exits.observe_step(policy, n, x, x_new, hist, limits, decode)
        n_row += active
        active &= ~fired
        x = x_new
    return n_row


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("rule", ALL_RULES)
def test_observe_step_matches_reference(rule, dtype):
    """`observe_step` (tensors only, no branch on a value: what `LeanSteps.loop` compiles)
    exits every row where the slow reference does, at every τ (k) and step limit."""
    T = _traj(dtype)
    decode, _ = _make_decode(dtype)
    for min_steps, max_steps in STEP_LIMITS:
        for tau, k in _settings(rule, dtype):
            n_ref, _, _ = _reference(dtype, rule, tau, min_steps, max_steps, k)
            n = _observe_step_loop(rule, tau, min_steps, max_steps, T.params["x0"].clone(), SpiralMap(T.params),
                                   decode, k)
            assert n.tolist() == n_ref.tolist(), (rule, tau, k, min_steps, max_steps)


@pytest.mark.parametrize("rule", ALL_RULES)
def test_batch_equals_rows_alone(rule):
    """Each row gives the same (x, n) in the batch as when iterated alone (N = 1)."""
    dtype = torch.float64
    T = _traj(dtype)
    decode, _ = _make_decode(dtype)
    tau = TAUS[rule][1] if len(TAUS[rule]) > 1 else TAUS[rule][0]
    x_b, n_b = _run(rule, tau, 1, 20, T.params["x0"].clone(), SpiralMap(T.params), decode)
    for i in range(N):
        x_i, n_i = _run(
            rule,
            tau,
            1,
            20,
            T.params["x0"][i : i + 1].clone(),
            SpiralMap(T.params, rows=slice(i, i + 1)),
            decode,
        )
        _check_integer_n(n_i, 1)
        assert int(n_i[0]) == int(n_b[i]), f"row {i}"
        torch.testing.assert_close(x_i[0], x_b[i], rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------
# closed forms (no reference)
# --------------------------------------------------------------------------------------


class ScaleMap:
    """x -> rho_i * x (per-row scalar rho), counting calls."""

    def __init__(self, rho):
        self.rho = rho  # [N, 1]
        self.calls = 0

    def __call__(self, x):
        assert x.shape[0] == self.rho.shape[0]
        self.calls += 1
        return self.rho * x


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("name", ["fixed", "none"])
@pytest.mark.parametrize("limits", [(0, 1), (0, 7), (3, 7), (32, 32), (0, 32)])
def test_fixed_runs_exactly_max_steps(name, limits, dtype):
    min_steps, max_steps = limits
    T = _traj(dtype)
    x0 = T.params["x0"].clone()
    f = SpiralMap(T.params)
    x, n = _run(name, 1e-3, min_steps, max_steps, x0, f)
    _check_integer_n(n, N)
    assert n.tolist() == [max_steps] * N
    assert f.calls == max_steps
    g = SpiralMap(T.params)
    y = T.params["x0"].clone()
    for _ in range(max_steps):
        y = g(y)
    torch.testing.assert_close(x, y, rtol=0, atol=0)


RHOS = [0.5, 0.8, 0.9, 0.3, 0.95, 0.6]
NORMS = [3.7, 1.3, 0.45, 2.2, 5.1, 1e-6]


def _scale_setup(dtype, rhos=RHOS, norms=NORMS):
    gen = torch.Generator().manual_seed(7)
    x0 = torch.randn(len(rhos), 6, generator=gen, dtype=torch.float64)
    x0 = x0 / x0.norm(dim=1, keepdim=True) * torch.tensor(norms, dtype=torch.float64)[:, None]
    rho = torch.tensor(rhos, dtype=torch.float64)[:, None]
    return x0.to(dtype), rho.to(dtype)


def _closed_form_quantity(rule, rho, s, j):
    """The rule's check quantity at step index j for x -> rho x, ||x0|| = s."""
    if rule == "stepnorm":  # ||Delta^(j)||
        return (1 - rho) * rho**j * s
    if rule == "stepnorm_rel":  # ||Delta^(j)|| / (||x^(j)|| + eps)
        return (1 - rho) * rho**j * s / (rho**j * s + EPS)
    if rule == "accel":  # a^(j) = (1 - rho)^2 rho^(j-1) s
        return (1 - rho) ** 2 * rho ** (j - 1) * s
    if rule == "accel_rel":
        return (
            (1 - rho) ** 2 * rho ** (j - 1) * s / ((1 - rho) * rho ** (j - 1) * (1 + rho) * s + EPS)
        )
    raise AssertionError(rule)


def _closed_form_n(rule, rho, s, tau, min_steps, max_steps):
    start = max(min_steps, EARLIEST[rule])
    for n in range(start, max_steps):
        if rule in ("stepnorm", "stepnorm_rel"):
            q = [_closed_form_quantity(rule, rho, s, n - 1)]
        else:
            q = [
                _closed_form_quantity(rule, rho, s, n - 1),
                _closed_form_quantity(rule, rho, s, n - 2),
            ]
        for v in q:
            assert abs(v - tau) / tau > 1e-3, "test design: near-tie"
        if all(v < tau for v in q):
            return n
    return max_steps


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("rule", ["stepnorm", "stepnorm_rel", "accel", "accel_rel"])
@pytest.mark.parametrize("limits", [(0, 32), (4, 32), (0, 9), (6, 6)])
def test_closed_form_scaling_map(rule, limits, dtype):
    min_steps, max_steps = limits
    taus = {
        "stepnorm": [0.3, 1.1e-2, 7e-4, 3e-8],
        "stepnorm_rel": [0.6, 0.12, 3e-2, 1.3e-3],
        "accel": [0.3, 1.1e-2, 7e-4, 3e-8],
        "accel_rel": [0.45, 0.2, 0.15, 3e-2],
    }[rule]
    x0, rho = _scale_setup(dtype)
    for tau in taus:
        expect = [
            _closed_form_n(rule, r, s, tau, min_steps, max_steps) for r, s in zip(RHOS, NORMS)
        ]
        f = ScaleMap(rho)
        x, n = _run(rule, tau, min_steps, max_steps, x0.clone(), f)
        _check_integer_n(n, len(RHOS))
        assert n.tolist() == expect, f"{rule} tau={tau} limits={limits}"
        assert f.calls == max(expect)
        # newest state x^(n) = rho^n x0 is kept (not x^(n-1), not a later state)
        want = torch.stack([x0[i].double() * RHOS[i] ** expect[i] for i in range(len(RHOS))])
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(x.double(), want, rtol=tol, atol=tol * 1e-6)


def test_closed_form_stepnorm_explicit():
    """stepnorm on x -> rho x: n = smallest n >= 1 with (1 - rho) rho^(n-1) ||x0|| < tau,
    written out explicitly for a few rows."""
    rhos, norms = [0.5, 0.5, 0.8, 0.25], [3.0, 1.0, 1.0, 100.0]
    x0, rho = _scale_setup(torch.float64, rhos, norms)
    # row 0: steps 1.5, .75, .375, .1875, .09375 -> first < 0.1 is j=4 -> n=5
    # row 1: steps .5, .25, .125, .0625 -> j=3 -> n=4
    # row 2: steps .2, .16, .128, .1024, .08192 -> j=4 -> n=5
    # row 3: steps 75, 18.75, 4.6875, 1.171875, .29296875, .0732421875 -> j=5 -> n=6
    x, n = _run("stepnorm", 0.1, 0, 32, x0, ScaleMap(rho))
    assert n.tolist() == [5, 4, 5, 6]
    torch.testing.assert_close(x, x0 * torch.tensor([0.5**5, 0.5**4, 0.8**5, 0.25**6])[:, None])


def test_stepnorm_rel_uses_old_state_in_denominator():
    # x -> 0.5 x: ||D^(j)|| / ||x^(j)|| = 0.5 (spec), ||D^(j)|| / ||x^(j+1)|| = 1.0 (not spec)
    x0, rho = _scale_setup(torch.float64, [0.5, 0.5], [4.0, 2.0])
    x, n = _run("stepnorm_rel", 0.75, 0, 32, x0, ScaleMap(rho))
    assert n.tolist() == [1, 1]
    torch.testing.assert_close(x, 0.5 * x0)
    x, n = _run("stepnorm_rel", 0.75, 3, 32, x0, ScaleMap(rho))
    assert n.tolist() == [3, 3]


def test_stepnorm_rel_epsilon():
    # ||x0|| = 1e-6, rho = 0.5: ratio_j = 0.5 * 0.5^j e-6 / (0.5^j e-6 + 1e-6)
    #   = 0.25, 0.1667, 0.1, 0.0556, ...  -> first < 0.12 at j = 2 -> n = 3
    x0, rho = _scale_setup(torch.float64, [0.5], [1e-6])
    x, n = _run("stepnorm_rel", 0.12, 0, 32, x0, ScaleMap(rho))
    assert n.tolist() == [3]


def test_accel_rel_denominator_is_step_norms():
    # x -> 0.5 x: a^(j) / (||D^(j)|| + ||D^(j-1)||) = 1/3 ; an ||x||-based denominator gives 0.5
    x0, rho = _scale_setup(torch.float64, [0.5, 0.5], [4.0, 2.0])
    x, n = _run("accel_rel", 0.4, 0, 32, x0, ScaleMap(rho))
    assert n.tolist() == [3, 3]
    torch.testing.assert_close(x, 0.125 * x0)
    x, n = _run("accel_rel", 0.3, 0, 16, x0, ScaleMap(rho))
    assert n.tolist() == [16, 16]
    # later eps takes over: 0.25 q / (0.75 q + eps) < 0.3 <=> q = 0.5^(j-1) ||x0|| < 12 eps,
    # i.e. j >= 20 (||x0|| = 4) and j >= 19 (||x0|| = 2); two hits -> n = j + 2
    x, n = _run("accel_rel", 0.3, 0, 32, x0, ScaleMap(rho))
    assert n.tolist() == [22, 21]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("rule", ALL_RULES)
@pytest.mark.parametrize("limits", [(0, 32), (0, 1), (0, 2), (2, 10), (5, 10), (7, 7)])
def test_stationary_rows_fire_at_earliest(rule, limits, dtype):
    """Rows whose state never changes (identity map, or already at the fixed point):
    every rule fires at max(earliest n, min_steps), capped by max_steps."""
    min_steps, max_steps = limits
    x0, _ = _scale_setup(dtype)
    rho = torch.ones(x0.shape[0], 1, dtype=dtype)
    x0[-1] = 0.0  # a zero row: 0 / (0 + eps) for the relative rules
    decode, _ = _make_decode(dtype)
    f = ScaleMap(rho)
    x, n = _run(rule, 1e-4, min_steps, max_steps, x0[:, :6].clone(), f, decode=_pad_decode(decode))
    if rule in ("fixed", "none"):
        expect = max_steps
    else:
        expect = min(max(EARLIEST[rule], min_steps), max_steps)
    assert n.tolist() == [expect] * x0.shape[0]
    assert f.calls == expect
    torch.testing.assert_close(x, x0[:, :6], rtol=0, atol=0)


def _pad_decode(decode):
    def dec(x):  # [N, 6] -> logits via the [8, V] weight
        return decode(torch.cat([x, torch.zeros(x.shape[0], D - x.shape[1], dtype=x.dtype)], 1))

    return dec


@pytest.mark.parametrize("rule", TAU_RULES)
@pytest.mark.parametrize("limits", [(0, 32), (2, 9), (4, 4), (0, 1)])
def test_huge_tau_fires_at_earliest(rule, limits):
    """With tau far above every quantity, each row stops at max(earliest, min_steps)."""
    min_steps, max_steps = limits
    T = _traj(torch.float64)
    decode, _ = _make_decode(torch.float64)
    f = SpiralMap(T.params)
    x, n = _run(rule, 1e30, min_steps, max_steps, T.params["x0"].clone(), f, decode=decode)
    expect = min(max(EARLIEST[rule], min_steps), max_steps)
    assert n.tolist() == [expect] * N
    assert f.calls == expect
    y = T.params["x0"].clone()
    g = SpiralMap(T.params)
    for _ in range(expect):
        y = g(y)
    torch.testing.assert_close(x, y, rtol=0, atol=0)


# --------------------------------------------------------------------------------------
# rows stop being updated once fired
# --------------------------------------------------------------------------------------


def test_rows_freeze_at_their_own_n():
    # stepnorm on x -> rho x with very different rates: rows stop at very different n
    rhos, norms = [0.1, 0.5, 0.9, 1.0], [1.0, 1.0, 1.0, 1.0]
    x0, rho = _scale_setup(torch.float64, rhos, norms)
    rho[-1] = 1.2  # expanding, never fires
    f = ScaleMap(rho)
    x, n = _run("stepnorm", 1e-2, 0, 25, x0.clone(), f)
    # 0.9 * 0.1^(n-1) < 1e-2 -> n = 3 ; 0.5^n < 1e-2 -> n = 7 ;
    # 0.1 * 0.9^(n-1) < 1e-2 -> 0.9^(n-1) < 0.1 -> n - 1 = 22 -> n = 23 ; expanding: 25
    assert n.tolist() == [3, 7, 23, 25]
    assert f.calls == 25
    want = torch.stack([x0[0] * 0.1**3, x0[1] * 0.5**7, x0[2] * 0.9**23, x0[3] * 1.2**25])
    torch.testing.assert_close(x, want, rtol=1e-12, atol=0)

    f = ScaleMap(rho[:3].clone())
    x, n = _run("stepnorm", 1e-2, 0, 25, x0[:3].clone(), f)
    assert n.tolist() == [3, 7, 23]
    assert f.calls == 23  # the loop ends when the last row has fired


# --------------------------------------------------------------------------------------
# prescribed trajectories: x carries a step counter in its last coordinate
# --------------------------------------------------------------------------------------


class TableMap:
    """f(x)[i] = table[i, k + 1] where k = x[i, -1] (the counter coordinate)."""

    def __init__(self, table):
        self.table = table  # [N, K, d]
        self.calls = 0

    def __call__(self, x):
        assert x.shape == (self.table.shape[0], self.table.shape[2])
        self.calls += 1
        k = torch.round(x[:, -1]).long() + 1
        k = k.clamp(max=self.table.shape[1] - 1)
        return self.table[torch.arange(x.shape[0]), k]


def _accel_table(accels, steps=40):
    """1-D value with prescribed accelerations a^(j) (j = 1, 2, ...) plus a counter."""
    D_ = [0.0]
    sign = 1.0
    for a in accels:
        D_.append(D_[-1] + sign * a)
        sign = -sign
    while len(D_) < steps:
        D_.append(D_[-1] + sign * 1.0)
        sign = -sign
    val = [0.5]
    for d in D_[: steps - 1]:
        val.append(val[-1] + d)
    return [[v, float(k)] for k, v in enumerate(val)]


BIG, SMALL = 1.0, 1e-3
ACCEL_ROWS = [
    # accelerations a^(1), a^(2), ... (afterwards all 1.0); tau = 1e-2
    ([BIG, BIG, SMALL, BIG, BIG, SMALL, BIG, BIG, SMALL, BIG], 32),  # single dips only
    ([BIG, BIG, SMALL, SMALL, BIG], 5),  # a^3, a^4 small -> exit after application 5
    ([SMALL, BIG, SMALL, BIG, SMALL, SMALL, BIG], 7),  # a^5, a^6 -> 7
    ([SMALL, SMALL, BIG], 3),  # a^1, a^2 -> earliest n = 3
    ([BIG, SMALL, SMALL, BIG], 4),  # a^2, a^3 -> 4
    ([BIG, BIG, BIG, SMALL, SMALL, BIG], 6),  # a^4, a^5 -> 6
    ([SMALL, BIG, SMALL, BIG, SMALL, BIG, SMALL, BIG, SMALL, BIG, SMALL, BIG], 32),
]


@pytest.mark.parametrize("rule", ["accel", "accel_rel"])
def test_accel_two_hit(rule):
    table = torch.tensor([_accel_table(a) for a, _ in ACCEL_ROWS], dtype=torch.float64)
    expect = [e for _, e in ACCEL_ROWS]
    f = TableMap(table)
    x, n = _run(rule, 1e-2, 0, 32, table[:, 0].clone(), f)
    assert n.tolist() == expect
    torch.testing.assert_close(x, table[torch.arange(len(expect)), torch.tensor(expect)])
    assert f.calls == 32


@pytest.mark.parametrize("rule", ["accel", "accel_rel"])
def test_accel_two_hit_with_min_steps(rule):
    """SPEC: after application n the condition is a^(n-1) < tau and a^(n-2) < tau; with
    min_steps = 6 the first check is at n = 6 and uses a^(5) and a^(4)."""
    table = torch.tensor([_accel_table(a) for a, _ in ACCEL_ROWS], dtype=torch.float64)
    # rows: dips (3,6,9) single -> 32 ; (3,4) -> before min, a^5,a^4 big -> 32 ;
    # (5,6) -> 7 ; (1,2) -> 32 ; (2,3) -> 32 ; (4,5) -> exactly 6 ; alternating -> 32
    expect = [32, 32, 7, 32, 32, 6, 32]
    x, n = _run(rule, 1e-2, 6, 32, table[:, 0].clone(), TableMap(table))
    assert n.tolist() == expect


def test_accel_two_hit_table_is_what_it_claims():
    # guard for the construction above, computed with the plain-python reference helpers
    for accels, expect in ACCEL_ROWS:
        rows = _accel_table(accels)
        state = lambda k, rows=rows: rows[k]  # noqa: E731
        for j, a in enumerate(accels, start=1):
            d1 = _sub(rows[j + 1], rows[j])
            d0 = _sub(rows[j], rows[j - 1])
            assert _norm(_sub(d1, d0)) == pytest.approx(a)
        assert _ref_row(state, "accel", 1e-2, 0, 32)[0] == expect
        assert _ref_row(state, "accel_rel", 1e-2, 0, 32)[0] == expect


def _kl_rows():
    # state = [logit0, logit1, counter]; decode = first two coordinates
    lg = math.log
    u = [0.0, 0.0]
    peaked = [lg(0.95), lg(0.05)]
    rows = [
        [u, u, peaked],  # KL(new||old) = 0.495 < 0.65 < KL(old||new) = 0.830 -> n = 2
        [peaked, peaked, u],  # KL(new||old) = 0.830 > 0.65 -> not at 2; then still -> 3
        [u, u, [6.0, -6.0]],  # KL(p1||p0) = 0 but n = 1 is never checked; n=2: 0.69 -> n=3
        [u, [0.3, 0.0], [0.3, 0.0]],  # n = 2
    ]
    table = []
    for r in rows:
        r = r + [r[-1]] * (40 - len(r))
        table.append([[a, b, float(k)] for k, (a, b) in enumerate(r)])
    return torch.tensor(table, dtype=torch.float64), [2, 3, 3, 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_kl_direction_and_earliest(dtype):
    table, expect = _kl_rows()
    p_u = [0.5, 0.5]
    p_k = [0.95, 0.05]
    kl = lambda p, q: sum(a * math.log(a / b) for a, b in zip(p, q))  # noqa: E731
    assert kl(p_k, p_u) < 0.65 < kl(p_u, p_k)
    table = table.to(dtype)
    decode_calls = []

    def decode(x):
        decode_calls.append(x.shape)
        return x[:, :2] * 1.0

    x, n = _run("kl", 0.65, 0, 32, table[:, 0].clone(), TableMap(table), decode=decode)
    assert n.tolist() == expect
    torch.testing.assert_close(x, table[torch.arange(4), torch.tensor(expect)])
    # with min_steps = 3 the first row can no longer stop at 2, stops at 3 (KL = 0)
    x, n = _run("kl", 0.65, 3, 32, table[:, 0].clone(), TableMap(table), decode=decode)
    assert n.tolist() == [3, 3, 3, 3]


def test_kl_matches_reference_on_table():
    table, expect = _kl_rows()
    for i in range(table.shape[0]):
        rows = table[i].tolist()
        n, _, _ = _ref_row(
            lambda k, rows=rows: rows[k], "kl", 0.65, 0, 32, logits=lambda k, rows=rows: rows[k][:2]
        )
        assert n == expect[i]


# --------------------------------------------------------------------------------------
# argument validation
# --------------------------------------------------------------------------------------


def _one_line_value_error(fn, field):
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg.strip(), msg
    if isinstance(field, str):
        field = (field,)
    assert any(f in msg for f in field), f"message {msg!r} does not name {field}"


def test_unknown_name():
    _one_line_value_error(lambda: exits.build("entropy", 1e-3), "name")
    _one_line_value_error(lambda: exits.build("", 1e-3), "name")


@pytest.mark.parametrize("rule", TAU_RULES)
@pytest.mark.parametrize("tau", [0.0, -1e-3, float("nan"), -float("inf")])
def test_bad_tau(rule, tau):
    _one_line_value_error(lambda: exits.build(rule, tau), "tau")


@pytest.mark.parametrize("name", ["fixed", "none"])
def test_fixed_does_not_use_tau(name):
    """fixed (and its alias) accept any τ, also one no rule that reads τ would, and keep it
    only for the records: the loop runs to max_steps whatever it is."""
    T = _traj(torch.float64)
    for tau in (0.0, float("nan"), -1.0):
        policy = exits.build(name, tau, max_steps=3)
        assert policy.name == "fixed" and not policy.lists()
        _, n = exits.iterate(SpiralMap(T.params), T.params["x0"].clone(), policy)
        assert n.tolist() == [3] * len(n)


@pytest.mark.parametrize("rule", ALL_RULES)
def test_bad_steps(rule):
    _one_line_value_error(
        lambda: exits.build(rule, 1e-3, min_steps=5, max_steps=4), ("max_steps", "min_steps")
    )
    _one_line_value_error(lambda: exits.build(rule, 1e-3, min_steps=0, max_steps=0), "max_steps")
    _one_line_value_error(lambda: exits.build(rule, 1e-3, min_steps=0, max_steps=-3), "max_steps")


@pytest.mark.parametrize("rule", ALL_RULES)
def test_good_arguments_accepted(rule):
    """The boundary values are accepted and kept: max_steps = 1, min_steps = max_steps; the
    defaults are min_steps 0 and max_steps 32 (SPEC §3)."""
    for kw, (lo, hi) in [({}, (0, 32)), ({"min_steps": 0, "max_steps": 1}, (0, 1)),
                         ({"min_steps": 7, "max_steps": 7}, (7, 7))]:
        p = exits.build(rule, 1e-3, **kw)
        assert (p.min_steps, p.max_steps, p.name) == (lo, hi, exits.canonical(rule))
        assert p.tau == 1e-3


def test_kl_without_decode_is_rejected():
    T = _traj(torch.float64)
    policy = exits.build("kl", 1e-3, max_steps=5)
    with pytest.raises(ValueError, match=r"^exit\.name: rule 'kl' needs a decode function \(state -> logits\)$"):
        exits.iterate(SpiralMap(T.params), T.params["x0"].clone(), policy)


def test_default_steps():
    # defaults: min_steps = 0, max_steps = 32
    T = _traj(torch.float64)
    f = SpiralMap(T.params)
    x, n = exits.iterate(f, T.params["x0"].clone(), exits.build("fixed", 1e-3))
    assert n.tolist() == [32] * N
    x, n = exits.iterate(SpiralMap(T.params), T.params["x0"].clone(), exits.build("stepnorm", 1e30))
    assert n.tolist() == [1] * N


# --------------------------------------------------------------------------------------
# SPEC 3b rules: closed forms, scripted decodes, what they read
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("limits", [(0, 32), (4, 32), (0, 9), (6, 6)])
def test_cosine_closed_form_contraction(limits, dtype):
    """x^(j) = rho^j x0: for rho > 0 every state points along x0, cos = 1, 1 - cos = 0, so
    `cosine` fires at its earliest n = max(1, min_steps) for any tau > 0; for rho < 0
    consecutive states are opposite, cos = -1, 1 - cos = 2: never below tau < 2, so the
    loop runs to max_steps (and tau > 2 fires at the earliest n again)."""
    min_steps, max_steps = limits
    rhos = [0.5, 0.9, 0.3, -0.5, -0.9, 1.0]
    x0, rho = _scale_setup(dtype, rhos, [3.7, 1.3, 1e-6, 2.2, 5.1, 1.0])
    first = min(max(1, min_steps), max_steps)
    for tau, expect in [(1e-9 if dtype == torch.float64 else 1e-5, [first] * 3 + [max_steps] * 2 + [first]),
                        (1.5, [first] * 3 + [max_steps] * 2 + [first]), (2.5, [first] * 6)]:
        f = ScaleMap(rho)
        x, n = _run("cosine", tau, min_steps, max_steps, x0.clone(), f)
        assert n.tolist() == expect, tau
        want = torch.stack([x0[i].double() * rhos[i] ** expect[i] for i in range(len(rhos))])
        torch.testing.assert_close(x.double(), want, rtol=1e-5, atol=0)


class ConeMap:
    """x = (a, b, h) -> (rho (cos t a - sin t b), rho (sin t a + cos t b), h): a spiral in
    the (a, b) plane around the axis point (0, 0, h), per-row rho and t = theta."""

    def __init__(self, rho, theta, dtype):
        self.rho = torch.tensor(rho, dtype=dtype)
        self.c = torch.cos(torch.tensor(theta, dtype=torch.float64)).to(dtype)
        self.s = torch.sin(torch.tensor(theta, dtype=torch.float64)).to(dtype)
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        a, b, h = x.unbind(-1)
        return torch.stack([self.rho * (self.c * a - self.s * b), self.rho * (self.s * a + self.c * b), h], -1)


# (rho, theta, s = ||planar part of x0||, h = axis offset)
CONE_ROWS = [(0.5, 0.3, 1.0, 0.0), (0.9, 0.3, 1.0, 0.0), (1.0, 0.05, 2.0, 0.0), (0.8, 0.5, 1.0, 1.0),
             (0.9, 0.2, 2.0, 0.5), (0.95, 1.0, 1.0, 2.0), (0.7, 2.0, 3.0, 1.0), (1.0, 0.4, 1.0, 1.0)]


def _cone_distance(rho, theta, s, h, n):
    """1 - cos(x^(n), x^(n-1)) on the cone spiral, in closed form. The planar parts of
    consecutive states are rho^n s and rho^(n-1) s long and theta apart, the axis parts
    both h, so

        x^(n) . x^(n-1) = rho^(2n-1) s^2 cos(theta) + h^2,
        ||x^(j)||^2     = rho^(2j) s^2 + h^2,

    and 1 - cos = 1 - (rho^(2n-1) s^2 cos theta + h^2) / sqrt((rho^(2n) s^2 + h^2)(rho^(2n-2) s^2 + h^2)).
    With h = 0 (a spiral around the origin) it is 1 - cos(theta) at every n, whatever rho;
    with h > 0 and rho < 1 it falls to 0 as the spiral winds into the axis point."""
    a, b = rho ** (2 * n) * s * s, rho ** (2 * n - 2) * s * s
    return 1.0 - (rho ** (2 * n - 1) * s * s * math.cos(theta) + h * h) / math.sqrt((a + h * h) * (b + h * h))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("limits", [(0, 32), (3, 32), (0, 7)])
def test_cosine_closed_form_spiral(limits, dtype):
    min_steps, max_steps = limits
    # h = 0 rows: 1 - cos(theta) = 0.0447 (theta 0.3) and 0.00125 (theta 0.05) at every n
    assert _cone_distance(0.5, 0.3, 1.0, 0.0, 7) == pytest.approx(1 - math.cos(0.3), rel=1e-12)
    phi = torch.linspace(0.1, 2.0, len(CONE_ROWS), dtype=torch.float64)
    x0 = torch.stack([torch.tensor([s * math.cos(p), s * math.sin(p), h], dtype=torch.float64)
                      for (_, _, s, h), p in zip(CONE_ROWS, phi.tolist())]).to(dtype)
    for tau in [0.2, 0.05, 2e-2, 3e-3, 1e-3, 2e-4]:
        expect = []
        for rho, theta, s, h in CONE_ROWS:
            n_exp = max_steps
            for n in range(max(1, min_steps), max_steps):
                q = _cone_distance(rho, theta, s, h, n)
                assert abs(q - tau) / tau > 1e-2, "test design: near-tie"
                if q < tau:
                    n_exp = n
                    break
            expect.append(n_exp)
        f = ConeMap([r[0] for r in CONE_ROWS], [r[1] for r in CONE_ROWS], dtype)
        x, n = _run("cosine", tau, min_steps, max_steps, x0.clone(), f)
        assert n.tolist() == expect, tau
        assert f.calls == max(expect)
        if (min_steps, max_steps) == (0, 32) and tau == 3e-3:
            assert len(set(expect)) >= 5, expect  # the closed form exits at varied n


def _binary_entropy(a):
    """H(softmax([a, 0])) = -q log q - (1 - q) log(1 - q), q = 1 / (1 + e^-a)."""
    q = 1.0 / (1.0 + math.exp(-a))
    return -(q * math.log(q) + (1 - q) * math.log1p(-q))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("limits", [(0, 32), (5, 32), (0, 6)])
def test_entropy_diff_closed_form_contraction(limits, dtype):
    """x^(j) = rho^j x0 with x0 = (s, 0) decoded as logits (x_1, x_2): p^(j) =
    softmax(rho^j s, 0), H^(j) = h(rho^j s) with h the binary entropy above; `entropy_diff`
    fires at the first n >= max(2, min_steps) with |h(rho^n s) - h(rho^(n-1) s)| < tau.
    (As rho^j s -> 0, H -> log 2 and the changes shrink like rho^(2j).)"""
    min_steps, max_steps = limits
    rows = [(0.5, 3.0), (0.8, 2.0), (0.9, 5.0), (0.3, 1.0), (0.95, 0.5), (-0.7, 2.0)]
    x0 = torch.tensor([[s, 0.0] for _, s in rows], dtype=dtype)
    rho = torch.tensor([[r] for r, _ in rows], dtype=dtype)
    taus = [0.1, 1e-2, 1e-3] + ([1e-5] if dtype == torch.float64 else [])
    for tau in taus:
        expect = []
        for r, s in rows:
            n_exp = max_steps
            for n in range(max(2, min_steps), max_steps):
                q = abs(_binary_entropy(r**n * s) - _binary_entropy(r ** (n - 1) * s))
                assert abs(q - tau) / tau > 1e-2, "test design: near-tie"
                if q < tau:
                    n_exp = n
                    break
            expect.append(n_exp)
        x, n = _run("entropy_diff", tau, min_steps, max_steps, x0.clone(), ScaleMap(rho), decode=lambda x: x)
        assert n.tolist() == expect, tau


class CycleMap:
    """x -> rho * (x_3, x_1, x_2): the rotation by 120 degrees about the axis (1, 1, 1)
    (it permutes the coordinates cyclically), scaled by rho."""

    def __init__(self, rho=1.0):
        self.rho = rho
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return self.rho * x.roll(1, dims=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("limits", [(0, 32), (4, 32), (0, 9)])
def test_rotation_that_permutes_the_logits(limits, dtype):
    """Decode x as its own 3 logits and rotate by 120 degrees about (1, 1, 1): each p^(j)
    is p^(j-1) with its entries permuted cyclically. Closed forms, per rule:
    - entropy_diff: a permutation leaves the entropy unchanged, |dH| = 0 < tau for any
      tau > 0: fires at max(2, min_steps) -- although the distribution keeps changing;
    - kl: KL(P p || p) is one constant c > 0 at every n: fires at max(2, min_steps) if
      c < tau, else runs to max_steps;
    - argmax_stability: the largest logit moves to the next coordinate at every step, so
      the argmax is never the same twice in a row: max_steps for every k;
    - cosine: x . Px = ab + bc + ca for x = (a, b, c), ||Px|| = ||x||, so 1 - cos =
      1 - (ab + bc + ca) / (a^2 + b^2 + c^2) at every n (also with rho > 0)."""
    min_steps, max_steps = limits
    rows = [[2.0, 0.5, -1.0], [1.0, 0.0, 0.0], [3.0, 2.5, 2.0], [0.3, -0.2, 0.1]]
    x0 = torch.tensor(rows, dtype=dtype)
    first, last = max(2, min_steps), max_steps
    tiny = 1e-9 if dtype == torch.float64 else 1e-4
    x, n = _run("entropy_diff", tiny, min_steps, max_steps, x0.clone(), CycleMap(), decode=lambda x: x)
    assert n.tolist() == [first] * 4
    for k in (1, 2, 5):
        _, n = _run("argmax_stability", None, min_steps, max_steps, x0.clone(), CycleMap(), decode=lambda x: x,
                    patience=k)
        assert n.tolist() == [last] * 4
    kls = [_kl_new_old([r[2], r[0], r[1]], r) for r in rows]  # KL(P p || p), one value per row
    for tau in (0.05, 0.3, 0.5, 2.0):
        assert all(abs(c - tau) / tau > 1e-2 for c in kls)
        _, n = _run("kl", tau, min_steps, max_steps, x0.clone(), CycleMap(), decode=lambda x: x)
        assert n.tolist() == [first if c < tau else last for c in kls], (tau, kls)
    dist = [1 - (a * b + b * c + c * a) / (a * a + b * b + c * c) for a, b, c in rows]
    for rho in (1.0, 0.7):
        for tau in (0.02, 0.2, 1.1, 1.32, 1.6):
            assert all(abs(q - tau) / tau > 1e-2 for q in dist)
            _, n = _run("cosine", tau, min_steps, max_steps, x0.clone(), CycleMap(rho))
            assert n.tolist() == [min(max(1, min_steps), last) if q < tau else last for q in dist], (rho, tau, dist)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("limits", [(0, 32), (8, 32), (0, 5)])
def test_argmax_stability_closed_form_contraction(limits, dtype):
    """x^(j) = rho^j x0 decoded by a fixed linear map: logits rho^j W x0. For rho > 0 the
    argmax is that of W x0 at every j, so the rule fires at max(k + 1, min_steps); for
    rho < 0 the logits flip sign at every step and the argmax alternates between the
    largest and the smallest entry of W x0: never twice in a row, max_steps."""
    min_steps, max_steps = limits
    rhos = [0.5, 0.9, 1.0, -0.8, 0.3]
    x0, rho = _scale_setup(dtype, rhos, [3.0, 1.0, 2.0, 1.5, 1e-3])
    decode, _ = _make_decode(dtype)
    for k in (1, 2, 5):
        x, n = _run("argmax_stability", None, min_steps, max_steps, x0.clone(), ScaleMap(rho),
                    decode=_pad_decode(decode), patience=k)
        first = min(max(k + 1, min_steps), max_steps)
        assert n.tolist() == [first, first, first, max_steps, first], k


class PlaneMap:
    """x = (a, b) -> rho R(theta) (a, b), one rotation for every row."""

    def __init__(self, rho, theta):
        self.rho, self.c, self.s = rho, math.cos(theta), math.sin(theta)
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        a, b = x.unbind(-1)
        return self.rho * torch.stack([self.c * a - self.s * b, self.s * a + self.c * b], -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("rho", [1.0, 0.9])
def test_argmax_stability_closed_form_spiral(rho, dtype):
    """A (contracting) spiral decoded as the four logits (a, b, -a, -b) of x = (a, b): the
    argmax is the axis nearest to x's angle phi, index i = 0, 1, 2, 3 for phi within 45
    degrees of 0, 90, 180, 270 degrees (rho only scales the logits). Start at 4.5 degrees
    and turn by theta = 9 degrees per step: phi^(j) = 4.5 + 9 j, so p^(1..4) (13.5 ..
    40.5) have argmax 0, p^(5..14) (49.5 .. 130.5) argmax 1, p^(15..24) argmax 2, ...: runs
    of 4, then 10, 10, ... (no angle within 4.5 degrees of a sector boundary, no ties).
    The run length is r^(n) = n for n <= 4 and n - 4 for n = 5 .. 14; the rule fires at
    the first n with r^(n) >= k + 1:
      k = 1: r^(2) = 2                  -> n = 2
      k = 3: r^(4) = 4                  -> n = 4
      k = 4: n - 4 >= 5                 -> n = 9
      k = 9: n - 4 >= 10                -> n = 14
      k = 10: runs are at most 10 long  -> max_steps = 32
      k = 3, min_steps = 6: r^(6) = 2 (the run began at 5), so n - 4 >= 4 -> n = 8
    """
    deg = math.pi / 180
    x0 = torch.tensor([[math.cos(4.5 * deg), math.sin(4.5 * deg)]], dtype=dtype)

    def decode(x):
        return torch.cat([x, -x], -1)

    for k, min_steps, expect in [(1, 0, 2), (3, 0, 4), (4, 0, 9), (9, 0, 14), (10, 0, 32), (3, 6, 8)]:
        f = PlaneMap(rho, 9 * deg)
        x, n = _run("argmax_stability", None, min_steps, 32, x0.clone(), f, decode=decode, patience=k)
        assert n.tolist() == [expect], (k, min_steps)
        angle = math.atan2(float(x[0, 1]), float(x[0, 0])) / deg % 360
        assert angle == pytest.approx((4.5 + 9 * expect) % 360, abs=1e-3)  # the newest state is kept


def _argmax_rows():
    """state = [logit0, logit1, logit2, counter]; the decode is the first three coordinates,
    a one-hot of the scripted argmax a^(j) (j = 0 is x^(0), never checked). With k = 2 the
    rule fires at the first n >= 3 with a^(n-2) = a^(n-1) = a^(n)."""
    scripts = [
        ([1, 0, 0, 0, 0], 3),  # a^(1..3) = 0 -> earliest n = k + 1 = 3 (a^(0) is not looked at)
        ([0, 0, 1, 1, 1], 4),  # a^(2..4) = 1 -> 4
        ([0, 0, 1] * 13, 32),  # a^(1..) = 0 1 0 0 1 0 0 ...: runs of two at most -> max_steps
        ([0, 2, 2, 1, 1, 1], 5),  # a^(3..5) = 1 -> 5
        ([0, 0, 0, 1, 1, 2, 2, 2], 7),  # a^(1..2) = 0 is a run of 2, then 1 1, then 2 2 2 -> 7
        ([2, 1, 2, 1, 2, 0, 0, 0], 7),  # -> 7
    ]
    table = []
    for script, _ in scripts:
        script = script + [script[-1]] * (40 - len(script))
        table.append([[2.0 * (a == 0), 2.0 * (a == 1), 2.0 * (a == 2), float(j)] for j, a in enumerate(script)])
    return torch.tensor(table, dtype=torch.float64), [e for _, e in scripts]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_argmax_stability_on_a_scripted_decode(dtype):
    table, expect = _argmax_rows()
    table = table.to(dtype)
    calls = []

    def decode(x):
        calls.append(x.shape[0])
        return x[:, :3] * 1.0

    f = TableMap(table)
    x, n = _run("argmax_stability", None, 0, 32, table[:, 0].clone(), f, decode=decode, patience=2)
    assert n.tolist() == expect
    torch.testing.assert_close(x, table[torch.arange(len(expect)), torch.tensor(expect)])
    # one decode per application (O(d V) per check) but the 32nd: at max_steps the limit decides, no check runs
    assert f.calls == 32 and len(calls) == 31
    # min_steps = 5: the runs started before 5 count (history is kept below min_steps)
    _, n = _run("argmax_stability", None, 5, 32, table[:, 0].clone(), TableMap(table), decode=decode, patience=2)
    assert n.tolist() == [5, 5, 32, 5, 7, 7]
    # k = 1: the first repeat; k = 3 needs four equal argmaxes in a row
    _, n = _run("argmax_stability", None, 0, 32, table[:, 0].clone(), TableMap(table), decode=decode, patience=1)
    assert n.tolist() == [2, 3, 4, 2, 2, 6]
    _, n = _run("argmax_stability", None, 0, 32, table[:, 0].clone(), TableMap(table), decode=decode, patience=3)
    assert n.tolist() == [4, 5, 32, 6, 8, 8]


def test_argmax_scripted_table_matches_the_reference():
    table, expect = _argmax_rows()
    for k, want in [(2, expect), (1, [2, 3, 4, 2, 2, 6]), (3, [4, 5, 32, 6, 8, 8])]:
        for i in range(table.shape[0]):
            rows = table[i].tolist()
            n, _, _ = _ref_row(lambda j, rows=rows: rows[j], "argmax_stability", None, 0, 32,
                               logits=lambda j, rows=rows: rows[j][:3], patience=k)
            assert n == want[i], (k, i)


@pytest.mark.parametrize("rule", exits.names())
def test_which_rules_decode(rule):
    """kl, entropy_diff and argmax_stability decode the state at every check (O(d V)), after
    every application but the one at max_steps; the others never call decode (O(d)) and
    run without one."""
    decoding = {"kl", "entropy_diff", "argmax_stability"}
    T = _traj(torch.float64)
    if rule in ("gate", "halt"):  # a learned gate or halting head (tests/exits/test_gate.py, test_halt.py):
        d = T.params["x0"].shape[1]  # one group's, on this trajectory's width
        gate = (torch.linspace(-1, 1, d, dtype=torch.float64)[None], torch.zeros(1, dtype=torch.float64))
        policy = (exits.build(rule, 0.5, max_steps=7, gate=gate) if rule == "gate" else
                  dataclasses.replace(exits.build(rule, 0.5, max_steps=7), gate=gate)).group(0)
    else:
        policy = exits.build(rule, 1e-3, max_steps=7)
    assert policy.needs_decode == (rule in decoding) == exits.lookup(rule).decodes
    decode, _ = _make_decode(torch.float64)
    calls = []

    def counting(x):
        calls.append(1)
        return decode(x)

    f = SpiralMap(T.params)
    _, n = exits.iterate(f, T.params["x0"].clone(), policy, decode=counting)
    # every application is checked but one at max_steps, where the limit decides
    assert len(calls) == ((f.calls - int(n.max() == 7)) if rule in decoding else 0)
    if rule not in decoding:
        _, n2 = exits.iterate(SpiralMap(T.params), T.params["x0"].clone(), policy)
        assert torch.equal(n, n2)


@pytest.mark.parametrize("rule", [r for r in ALL_RULES if r != "argmax_stability"])
def test_patience_is_read_by_argmax_stability_only(rule):
    T = _traj(torch.float64)
    decode, _ = _make_decode(torch.float64)
    runs = [_run(rule, 1e-2, 0, 20, T.params["x0"].clone(), SpiralMap(T.params), decode, patience=k)[1]
            for k in (1, 5, 17)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


# --------------------------------------------------------------------------------------
# per-group values: group g runs under its own tau, min_steps, max_steps
# --------------------------------------------------------------------------------------


def test_per_group_thresholds_closed_form():
    """stepnorm on x -> x / 2 with ||x0|| = 1: ||Delta^(j)|| = 2^-(j+1), below 0.1 from
    j = 3 (n = 4), below 1e-2 from j = 6 (n = 7), below 1e-3 from j = 9 (n = 10). Three
    groups with tau = [0.1, 1e-2, 1e-3], min_steps = [5, 0, 0], max_steps = [32, 32, 8]:
    group 0 waits for min_steps (n = 5), group 1 fires at 7, group 2 stops at max_steps 8."""
    x0, rho = _scale_setup(torch.float64, [0.5, 0.5], [1.0, 1.0])
    policy = exits.build("stepnorm", [0.1, 1e-2, 1e-3], min_steps=[5, 0, 0], max_steps=[32, 32, 8])
    assert policy.n_groups == 3 and policy.max_steps_bound == 32
    got = [exits.iterate(ScaleMap(rho), x0.clone(), policy.group(g))[1].tolist() for g in range(3)]
    assert got == [[5, 5], [7, 7], [8, 8]]
    # the same values as one scalar each: every group alike
    one = exits.build("stepnorm", 1e-2, min_steps=0, max_steps=32)
    assert [exits.iterate(ScaleMap(rho), x0.clone(), one.group(g))[1].tolist() for g in range(3)] == [[7, 7]] * 3


@pytest.mark.parametrize("rule", ["fixed", *TAU_RULES, "argmax_stability"])
def test_per_group_thresholds_fire_per_group(rule):
    """Three groups, each with its own tau (where the rule reads one) and step limits:
    group g's applications are the slow reference's at group g's values, and the groups
    really exit at different n."""
    dtype = torch.float64
    T = _traj(dtype)
    decode, _ = _make_decode(dtype)
    taus = TAUS[rule][:3] if rule not in ("fixed", "argmax_stability") else None
    mins, maxs = [0, 4, 7], [32, 20, 12]
    policy = exits.build(rule, taus, min_steps=mins, max_steps=maxs, patience=2)
    ns = []
    for g in range(3):
        p = policy.group(g)
        assert (p.tau, p.min_steps, p.max_steps) == (None if taus is None else taus[g], mins[g], maxs[g])
        x, n = exits.iterate(SpiralMap(T.params), T.params["x0"].clone(), p, decode=decode)
        n_ref, x_ref, _ = _reference(dtype, rule, None if taus is None else taus[g], mins[g], maxs[g], 2)
        assert n.tolist() == n_ref.tolist(), g
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)
        ns.append(n.tolist())
    assert ns[0] != ns[1] != ns[2] != ns[0]


def test_a_per_group_policy_runs_no_loop_by_itself():
    T = _traj(torch.float64)
    policy = exits.build("stepnorm", [1e-2, 1e-3])
    _one_line_value_error(lambda: exits.iterate(SpiralMap(T.params), T.params["x0"].clone(), policy), "exit.tau")
    _one_line_value_error(lambda: policy.group(2), "exit.tau")
    assert policy.group(1).group(0) == policy.group(1)  # a one-value policy is its own group g
    assert exits.build("kl", 1e-3).group(7) == exits.build("kl", 1e-3)


@pytest.mark.parametrize("kw, field, text", [
    ({"tau": [1e-3, 1e-2]}, "exit.tau", "a list of 2 for 3 recurrence groups"),
    ({"max_steps": [4, 4, 4, 4]}, "exit.max_steps", "a list of 4 for 3 recurrence groups"),
    ({"tau": [1e-3, 1e-2, 1e-3], "min_steps": [0, 1]}, "exit.min_steps", "a list of 2, but exit.tau is a list of 3"),
    ({"tau": []}, "exit.tau", "got []"),
    ({"tau": [1e-3, -1.0, 1e-3]}, "exit.tau[1]", "> 0"),
    ({"tau": [1e-3, "x", 1e-3]}, "exit.tau[1]", "finite number"),
    ({"max_steps": [4, 0, 4]}, "exit.max_steps[1]", ">= 1"),
    ({"min_steps": [0, 5, 0], "max_steps": [4, 4, 4]}, "exit.max_steps", "4 (group 1) is smaller than exit.min_steps=5"),
    ({"min_steps": 5, "max_steps": [9, 4, 9]}, "exit.max_steps", "4 (group 1) is smaller than exit.min_steps=5"),
])
def test_bad_per_group_values(kw, field, text):
    args = {"tau": 1e-3, **kw}
    with pytest.raises(ValueError) as info:
        exits.build("stepnorm", groups=3, **args)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{field}: ") and text in msg, msg
    assert exits.build("stepnorm", [1e-3] * 3, groups=3).check_groups(3).n_groups == 3


def test_per_group_lists_against_the_model():
    _one_line_value_error(lambda: exits.build("kl", [1e-3], groups=0), "exit.tau")  # no groups: one value only
    p = exits.build("accel", 1e-3, max_steps=[3, 9])
    _one_line_value_error(lambda: p.check_groups(3), "exit.max_steps")
    assert p.check_groups(2) is p and exits.build("accel", 1e-3).check_groups(0).n_groups is None
    # rules that ignore tau ignore a list of it too (no length to check)
    assert exits.build("fixed", [1, 2], groups=3).lists() == {}
    assert exits.build("argmax_stability", [1, 2], max_steps=[4, 5, 6], groups=3).group(2).max_steps == 6


def test_the_oracle_takes_one_value():
    for kw in ({"tau": [1e-2, 1e-2]}, {"tau": 1e-2, "max_steps": [8, 8]}, {"tau": 1e-2, "min_steps": [0, 0]}):
        with pytest.raises(ValueError) as info:
            exits.build("oracle", **kw)
        assert "oracle takes one value" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("k", [0, -1, 2.5, True, "5", None])
def test_bad_patience(k):
    for rule in ("argmax_stability", "stepnorm"):  # typed for every rule, read by one
        _one_line_value_error(lambda rule=rule: exits.build(rule, 1e-3, patience=k), "exit.patience")


@pytest.mark.parametrize("rule", ["entropy_diff", "argmax_stability"])
def test_new_decoding_rules_without_decode_are_rejected(rule):
    T = _traj(torch.float64)
    with pytest.raises(ValueError, match=rule):
        exits.iterate(SpiralMap(T.params), T.params["x0"].clone(), exits.build(rule, 1e-3, max_steps=5))
