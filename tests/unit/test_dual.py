"""Tests for flowerdro.core.dual against cvxpy solves, closed forms and hand examples."""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import pytest

from flowerdro.core.dual import (
    chi2_divergence,
    kl_divergence,
    kl_dro_value,
    kl_dro_weights,
)
from flowerdro.experiments.references import solve_tightly

N_RANDOM = 25
SOL_ATOL = 1e-6  # cvxpy is an interior-point approximation
OBJ_RTOL = 1e-7
CON_ATOL = 1e-9


def _solve(prob: cp.Problem) -> None:
    """Solve to tight tolerances, relaxing them only if the solver cannot reach them."""
    status = solve_tightly(prob, (1e-12, 1e-11, 1e-10, 1e-9))
    if status is None:
        pytest.skip(f"no suitable cvxpy solver among {cp.installed_solvers()}")
    assert status == cp.OPTIMAL, f"cvxpy did not reach an optimal solution: {status}"


def _on_simplex(p: np.ndarray) -> None:
    assert p.min() >= -CON_ATOL
    assert abs(p.sum() - 1.0) <= CON_ATOL


# ---------------------------------------------------------------- KL-regularised DRO
def test_kl_dro_value_and_weights_match_cvxpy() -> None:
    # max_{lam in simplex} sum lam_i f_i - mu KL(lam || uniform).
    rng = np.random.default_rng(22)
    for k in range(N_RANDOM):
        n = int(rng.integers(1, 25))
        f = rng.normal(size=n) * [0.1, 1.0, 5.0][k % 3]
        mu = float(10 ** rng.uniform(-0.5, 1))
        lam = cp.Variable(n)
        kl = cp.sum(-cp.entr(lam)) + np.log(n) * cp.sum(lam)
        prob = cp.Problem(cp.Maximize(f @ lam - mu * kl), [lam >= 0, cp.sum(lam) == 1])
        _solve(prob)
        value, weights = kl_dro_value(f, mu), kl_dro_weights(f, mu)
        _on_simplex(weights)
        assert abs(value - prob.value) <= OBJ_RTOL * max(1.0, abs(prob.value))
        # Clarabel's exponential-cone solutions are only good to a few 1e-6 here (the
        # weights span e^-30 .. 1), so the solution check is looser than elsewhere and is
        # backed by an exact KKT check: f_i - mu (log(K lam_i) + 1) is the same for all i.
        np.testing.assert_allclose(weights, lam.value, atol=1e-5, rtol=0)
        pos = weights > 1e-250
        resid = f[pos] - mu * (np.log(n * weights[pos]) + 1.0)
        assert np.ptp(resid) <= 1e-12 * (1.0 + np.abs(f).max())
        # The value is attained at the weights (numpy evaluation of the objective).
        attained = f @ weights - mu * np.sum(weights * np.log(n * weights))
        assert abs(attained - value) <= 1e-12 * max(1.0, abs(value))


def test_kl_dro_value_limits_and_stability() -> None:
    f = np.array([1.0, 2.0, 4.0])
    np.testing.assert_allclose(kl_dro_value(f, 1e8), f.mean(), rtol=1e-7)
    np.testing.assert_allclose(kl_dro_value(f, 1e-3), 4.0 - 1e-3 * np.log(3), rtol=1e-12)
    # exp(1e4 / 1e-2) overflows if formed directly.
    big = np.array([1e4, 1e4 - 1.0, 0.0])
    assert np.isfinite(kl_dro_value(big, 1e-2))
    np.testing.assert_allclose(kl_dro_value(big, 1e-2), 1e4 - 1e-2 * np.log(3), rtol=1e-14)
    np.testing.assert_allclose(kl_dro_weights(big, 1e-2), [1.0, 0.0, 0.0], atol=1e-40)
    # Hand example: softmax of (0, log 3) is (1/4, 3/4); value = log((1 + 3)/2) = log 2.
    np.testing.assert_allclose(kl_dro_weights([0.0, np.log(3.0)], 1.0), [0.25, 0.75])
    np.testing.assert_allclose(kl_dro_value([0.0, np.log(3.0)], 1.0), np.log(2.0))
    with pytest.raises(ValueError, match=r"mu must be > 0"):
        kl_dro_value(f, 0.0)
    with pytest.raises(ValueError, match=r"mu must be > 0"):
        kl_dro_weights(f, -1.0)
    with pytest.raises(ValueError, match="losses must be finite"):
        kl_dro_value([np.inf], 1.0)


def test_divergences_hand_examples() -> None:
    np.testing.assert_allclose(kl_divergence([1.0, 0.0]), np.log(2.0))
    np.testing.assert_allclose(kl_divergence([0.5, 0.5]), 0.0, atol=1e-16)
    np.testing.assert_allclose(
        kl_divergence([0.25, 0.75], [0.5, 0.5]),
        0.25 * np.log(0.5) + 0.75 * np.log(1.5),
    )
    assert kl_divergence([0.5, 0.5], [1.0, 0.0]) == np.inf
    # chi2(u) = 1/(2N) sum (N u - 1)^2: (1, 0) -> (1 + 1)/4.
    assert chi2_divergence([1.0, 0.0]) == 0.5
    np.testing.assert_allclose(
        chi2_divergence([0.2, 0.3, 0.5], np.full(3, 1 / 3)), chi2_divergence([0.2, 0.3, 0.5])
    )
    with pytest.raises(ValueError, match="p must lie on the probability simplex"):
        chi2_divergence([0.5, 0.6])
    with pytest.raises(ValueError, match="q must have every entry > 0"):
        chi2_divergence([0.5, 0.5], [1.0, 0.0])
