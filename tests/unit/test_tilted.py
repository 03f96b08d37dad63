"""Tests for flowerdro.core.tilted: DR-DSGD's exponential step weight exp(ℓ/μ)/μ."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy.special import softmax

from flowerdro.core.tilted import (
    DEFAULT_LOG_CAP,
    TiltScale,
    log_cap_from_max_weight,
    log_tilt_weight,
    relative_tilt_weights,
    tilt_step,
    tilt_step_scale,
    tilted_risk,
)

LOSSES = [-30.0, -2.5, 0.0, 1e-8, 0.3, 1.0, 2.302585, 7.0, 25.0, 48.0, 120.0]
MUS = [0.05, 0.3, 1.0, 2.0, 6.0, 50.0]


def _direct(loss: float, mu: float) -> float | None:
    """exp(ℓ/μ)/μ straight from the paper's formula; None where it overflows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with np.errstate(over="ignore"):
            value = float(np.exp(np.float64(loss) / mu) / mu)
    return value if math.isfinite(value) else None


# (ℓ, μ) pairs where the direct formula is finite and below the cap, and where it is not.
BELOW_CAP = [
    (loss, mu)
    for loss in LOSSES
    for mu in MUS
    if (d := _direct(loss, mu)) is not None and d < math.exp(DEFAULT_LOG_CAP)
]
ABOVE_CAP = [(loss, mu) for loss in LOSSES for mu in MUS if (loss, mu) not in BELOW_CAP]


@pytest.mark.parametrize(("loss", "mu"), BELOW_CAP)
def test_tilt_step_scale_matches_direct_formula_below_cap(loss, mu):
    direct = _direct(loss, mu)
    # float64 exp(x) with x = ℓ/μ rounded: relative error ≈ |x|·eps ≤ 600·2.2e-16 ≈ 1.3e-13 < 1e-12
    assert tilt_step_scale(loss, mu) == pytest.approx(direct, rel=1e-12, abs=0.0)
    assert not tilt_step(loss, mu).capped
    if direct > 0:
        # its log then has absolute error ≈ 1.3e-13 < 1e-12
        assert log_tilt_weight(loss, mu) == pytest.approx(math.log(direct), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(("loss", "mu"), ABOVE_CAP)
def test_tilt_step_scale_is_cap_where_direct_is_too_large(loss, mu):
    step = tilt_step(loss, mu)
    assert step.capped and step.scale == math.exp(DEFAULT_LOG_CAP)
    # the same float64 expression ℓ/μ − log μ: ≤ a few ulps; rel 1e-15
    assert step.log_weight == pytest.approx(loss / mu - math.log(mu), rel=1e-15)


def test_direct_formula_cases_cover_both_regimes():
    # guard against the grids above being (nearly) empty, and cover real overflow
    assert len(BELOW_CAP) >= 40
    assert len(ABOVE_CAP) >= 5
    assert any(_direct(loss, mu) is None for loss, mu in ABOVE_CAP)


def test_large_log_cap_matches_direct_near_float64_limit():
    # ℓ/μ = 650: exp(650)/2 is finite in float64 and below exp(700)
    assert tilt_step_scale(1300.0, 2.0, log_cap=700.0) == pytest.approx(
        math.exp(650.0) / 2.0, rel=1e-12
    )


@pytest.mark.parametrize(("loss", "mu"), [(1e4, 1.0), (1e6, 0.01), (5e4, 5.0), (1e300, 1e-3)])
def test_huge_loss_stays_finite_and_is_capped(loss, mu):
    step = tilt_step(loss, mu)
    assert isinstance(step, TiltScale)
    assert math.isfinite(step.scale)
    # exp(cap) of the same float64 cap: ≤ 1 ulp; log-weight as above
    assert step.scale == pytest.approx(math.exp(DEFAULT_LOG_CAP), rel=1e-15)
    assert step.capped
    assert step.log_weight == pytest.approx(loss / mu - math.log(mu), rel=1e-15)
    assert tilt_step_scale(loss, mu) == step.scale


def test_log_weight_ten_thousand():
    # loss/μ = 1e4 exactly: log(h/μ) = 1e4 - log 1 = 1e4, scale = e^50 ≈ 5.1847e21
    assert log_tilt_weight(1e4, 1.0) == 1e4
    assert tilt_step_scale(1e4, 1.0) == pytest.approx(5.184705528587072e21, rel=1e-14)


def test_custom_cap_and_not_capped_flag():
    step = tilt_step(3.0, 1.0, log_cap=2.0)
    # exp(2) and e in float64: ≤ 1 ulp; default approx (rel 1e-6) is ample
    assert step == TiltScale(scale=pytest.approx(math.exp(2.0)), log_weight=3.0, capped=True)
    step = tilt_step(1.0, 1.0, log_cap=2.0)
    assert step.scale == pytest.approx(math.e) and not step.capped
    assert tilt_step_scale(0.0, 1.0, log_cap=0.0) == 1.0


def test_very_negative_loss_underflows_to_zero_not_error():
    assert tilt_step_scale(-1e4, 1.0) == 0.0


def test_scale_is_monotone_in_loss():
    # strictly increasing below the cap (30 / 0.7 ≈ 43 < 50), then flat at e^50
    values = [tilt_step_scale(x, 0.7) for x in np.linspace(-5, 30, 50)]
    assert all(b > a for a, b in zip(values, values[1:], strict=False))
    values = [tilt_step_scale(x, 0.7) for x in np.linspace(-5, 100, 200)]
    assert all(b >= a for a, b in zip(values, values[1:], strict=False))


def test_accepts_numpy_scalars():
    # float32 loss input: the result may carry float32 rounding, u ≈ 6e-8 relative, hence rel 1e-7
    assert tilt_step_scale(np.float32(1.5), np.float64(2.0)) == pytest.approx(
        math.exp(0.75) / 2.0, rel=1e-7
    )  # 1.5 is exact in float32 and the arithmetic is float64: a few ulps ≈ 1e-15 are expected
    assert log_tilt_weight(np.array(2.0), 1) == 2.0


@pytest.mark.parametrize("mu", [0.0, -1.0, float("nan"), float("inf"), None, "1", True])
def test_bad_mu_rejected(mu):
    with pytest.raises(ValueError, match="mu"):
        tilt_step_scale(1.0, mu)
    with pytest.raises(ValueError, match="mu"):
        log_tilt_weight(1.0, mu)
    with pytest.raises(ValueError, match="mu"):
        relative_tilt_weights([1.0, 2.0], mu)


@pytest.mark.parametrize(
    "loss", [float("nan"), float("inf"), -float("inf"), None, "1.0", [1.0, 2.0]]
)
def test_bad_loss_rejected(loss):
    with pytest.raises(ValueError, match="loss"):
        tilt_step_scale(loss, 1.0)


def test_nan_loss_message():
    with pytest.raises(ValueError, match="NaN"):
        log_tilt_weight(float("nan"), 1.0)


@pytest.mark.parametrize("log_cap", [-710.0, 710.0, float("nan"), float("inf"), "50"])
def test_bad_log_cap_rejected(log_cap):
    with pytest.raises(ValueError, match="log_cap"):
        tilt_step_scale(1.0, 1.0, log_cap=log_cap)


@pytest.mark.parametrize("max_weight", [0.05, 0.5, 1.0, 2.0, 10.0])
@pytest.mark.parametrize(("loss", "mu"), [(0.1, 2.0), (1.0, 2.0), (2.3, 2.0), (6.0, 2.0), (3.0, 6.0)])
def test_max_tilt_weight_is_min_of_direct_formula_and_cap(loss, mu, max_weight):
    # min(exp(ℓ/μ)/μ, M) straight from the formula, against the log-domain cap c = log M
    direct = math.exp(loss / mu) / mu
    step = tilt_step(loss, mu, log_cap=log_cap_from_max_weight(max_weight))
    assert step.scale == pytest.approx(min(direct, max_weight), rel=1e-12)
    assert step.capped == (direct > max_weight)
    assert step.log_weight == pytest.approx(math.log(direct), rel=1e-12)  # never capped


def test_max_tilt_weight_below_one_is_a_negative_log_cap():
    assert log_cap_from_max_weight(1.0) == 0.0
    # float64 log of exact inputs: ≤ 1 ulp (rel 1e-15); the cap 0.25 = exp(−log 4): a few ulps
    assert log_cap_from_max_weight(0.25) == pytest.approx(-math.log(4.0), rel=1e-15)
    assert tilt_step_scale(100.0, 1.0, log_cap=log_cap_from_max_weight(0.25)) == pytest.approx(0.25)


@pytest.mark.parametrize("max_weight", [0.0, -1.0, float("nan"), float("inf"), "1", True, None, 1e-310])
def test_bad_max_tilt_weight_rejected(max_weight):
    with pytest.raises(ValueError, match="max-tilt-weight"):
        log_cap_from_max_weight(max_weight)


# ----------------------------------------------------------------------------------------
# relative weights and tilted risk
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mu", [0.01, 0.5, 1.0, 3.0, 100.0])
def test_relative_weights_match_scipy_softmax(mu):
    rng = np.random.default_rng(0)
    losses = rng.uniform(0.0, 5.0, size=17)
    p = relative_tilt_weights(losses, mu)
    # float64 softmax two ways, |ℓ/μ| ≤ 500: relative error ≈ 500·eps ≈ 1e-13 < 1e-12; atol 1e-300
    # only admits underflow
    np.testing.assert_allclose(p, softmax(losses / mu), rtol=1e-12, atol=1e-300)
    assert p.dtype == np.float64
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(p >= 0)


def test_relative_weights_huge_losses_and_ratio_to_log_weights():
    losses = np.array([1e4, 1e4 + 1.0, 1e4 - 2.0])
    p = relative_tilt_weights(losses, 1.0)
    # 1e4 + k is exact in float64, so the shifted arguments are [0, 1, −2]: softmax to a few ulps
    np.testing.assert_allclose(p, softmax([0.0, 1.0, -2.0]), rtol=1e-12)
    # uncapped log-weights preserve the relative weighting even though every scale is capped
    steps = [tilt_step(x, 1.0) for x in losses]
    assert all(s.capped for s in steps)
    assert p[1] / p[0] == pytest.approx(
        math.exp(steps[1].log_weight - steps[0].log_weight), rel=1e-12
    )


def test_relative_weights_limits():
    losses = [0.2, 1.0, 0.7]
    # μ = 1e8: the weights differ from 1/3 by ≈ |ℓ − ℓ̄|/(3μ) ≈ 1.3e-9 < 1e-8;
    # μ = 1e-4: the other weights are exp(−3000) = 0 in float64, so only rounding of the 1 remains
    np.testing.assert_allclose(relative_tilt_weights(losses, 1e8), np.full(3, 1 / 3), atol=1e-8)
    np.testing.assert_allclose(relative_tilt_weights(losses, 1e-4), [0.0, 1.0, 0.0], atol=1e-12)
    np.testing.assert_array_equal(relative_tilt_weights([3.0], 1.0), [1.0])


@pytest.mark.parametrize(
    "losses", [[], [[1.0, 2.0]], [1.0, float("nan")], [float("inf"), 1.0], ["a", "b"]]
)
def test_relative_weights_bad_losses(losses):
    with pytest.raises(ValueError, match="losses"):
        relative_tilt_weights(losses, 1.0)


def test_tilted_risk_matches_direct_and_bounds():
    rng = np.random.default_rng(1)
    f = rng.uniform(0.0, 3.0, size=9)
    for mu in (0.2, 1.0, 5.0):
        direct = mu * math.log(float(np.mean(np.exp(f / mu))))
        # float64 log-mean-exp of f/μ ≤ 15: relative rounding ≈ 15·eps ≪ 1e-12
        assert tilted_risk(f, mu) == pytest.approx(direct, rel=1e-12)
        assert f.mean() - 1e-12 <= tilted_risk(f, mu) <= f.max() + 1e-12
    # huge losses: R = 1e4 + log((1 + e) / 2) with μ = 1, no overflow
    assert tilted_risk([1e4, 1e4 + 1.0], 1.0) == pytest.approx(
        1e4 + math.log((1.0 + math.e) / 2.0), rel=1e-14
    )
    with pytest.raises(ValueError, match="mu"):
        tilted_risk([1.0], 0.0)


def test_tilted_risk_and_weights_solve_the_kl_regularised_worst_case():
    # max_{p in simplex} sum p_i f_i - mu KL(p || uniform), solved by cvxpy: the value is
    # tilted_risk and the maximiser relative_tilt_weights.
    cp = pytest.importorskip("cvxpy")
    from flowerdro.experiments.references import solve_tightly

    rng = np.random.default_rng(22)
    for k in range(25):
        n = int(rng.integers(1, 25))
        f = rng.normal(size=n) * [0.1, 1.0, 5.0][k % 3]
        mu = float(10 ** rng.uniform(-0.5, 1))
        p = cp.Variable(n)
        kl = cp.sum(-cp.entr(p)) + np.log(n) * cp.sum(p)
        prob = cp.Problem(cp.Maximize(f @ p - mu * kl), [p >= 0, cp.sum(p) == 1])
        status = solve_tightly(prob, (1e-12, 1e-11, 1e-10, 1e-9))
        if status is None:
            pytest.skip(f"no suitable cvxpy solver among {cp.installed_solvers()}")
        assert status == cp.OPTIMAL
        value, weights = tilted_risk(f, mu), relative_tilt_weights(f, mu)
        # cvxpy's optimal value to its tolerances (1e-12 .. 1e-9, relative), with margin.
        assert abs(value - prob.value) <= 1e-7 * max(1.0, abs(prob.value))
        # Clarabel's exponential-cone solutions are only good to a few 1e-6 here (the
        # weights span e^-30 .. 1), so the solution check is loose and is backed by an exact
        # KKT check: f_i - mu (log(K p_i) + 1) is the same for every i (float64 rounding of
        # terms of size max|f|, hence 1e-12 times that scale).
        np.testing.assert_allclose(weights, p.value, atol=1e-5, rtol=0)
        pos = weights > 1e-250
        resid = f[pos] - mu * (np.log(n * weights[pos]) + 1.0)
        assert np.ptp(resid) <= 1e-12 * (1.0 + np.abs(f).max())
        # The value is attained at the weights (numpy evaluation of the objective).
        attained = f @ weights - mu * np.sum(weights * np.log(n * weights))
        assert abs(attained - value) <= 1e-12 * max(1.0, abs(value))
