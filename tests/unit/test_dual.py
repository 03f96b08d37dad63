"""Tests for flowerdro.core.dual against cvxpy solves, closed forms and hand examples."""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import pytest

from flowerdro.core.drfa import dual_ascent
from flowerdro.core.dual import (
    chi2_divergence,
    kl_divergence,
    kl_dro_value,
    kl_dro_weights,
    scaffpd_dual_step,
    scaffpd_extrapolate,
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


def _close_max(ours_obj: float, ref_obj: float, ours: np.ndarray, ref: np.ndarray) -> None:
    """For a maximisation: ours at least as good as cvxpy and equal to OBJ_RTOL."""
    tol = OBJ_RTOL * max(1.0, abs(ref_obj))
    assert ours_obj >= ref_obj - tol
    assert abs(ours_obj - ref_obj) <= tol
    np.testing.assert_allclose(ours, ref, atol=SOL_ATOL, rtol=0)


def _random_case(rng: np.random.Generator, k: int):
    n = int(rng.integers(2, 25))
    lam = rng.dirichlet(np.full(n, [0.2, 1.0, 5.0][k % 3]))
    v = rng.exponential(size=n) * [0.1, 1.0, 10.0][k % 3]
    tau = int(rng.integers(1, 20))
    gamma = float(10 ** rng.uniform(-3, 0))
    return lam, v, tau, gamma


# ------------------------------------------------------------------------ SCAFF-PD
def test_scaffpd_extrapolate_hand_example() -> None:
    np.testing.assert_allclose(scaffpd_extrapolate([1.0, 2.0], [0.0, 4.0], 0.5), [1.5, 1.0])
    np.testing.assert_allclose(scaffpd_extrapolate([1.0, 2.0], [0.0, 4.0], 0.0), [1.0, 2.0])
    with pytest.raises(ValueError, match=r"theta must be >= 0"):
        scaffpd_extrapolate([1.0], [1.0], -0.1)
    with pytest.raises(ValueError, match="loss_prev must have the same length as loss_now"):
        scaffpd_extrapolate([1.0, 2.0], [1.0], 0.5)


@pytest.mark.parametrize("objective", ["afl", "cvar", "chi2"])
def test_scaffpd_dual_step_matches_cvxpy(objective) -> None:
    # argmin_lam psi(lam) - <s, lam> + 1/(2 sigma) ||lam - lam_r||^2 over Lambda.
    rng = np.random.default_rng({"afl": 18, "cvar": 19, "chi2": 20}[objective])
    for k in range(N_RANDOM):
        lam_r, s, _, _ = _random_case(rng, k)
        n = lam_r.size
        sigma = float(10 ** rng.uniform(-3, 1))
        rho = float(10 ** rng.uniform(-2, 1)) if objective == "chi2" else 0.0
        alpha = float(rng.uniform(0.05, 1.0)) if objective == "cvar" else None
        ours = scaffpd_dual_step(lam_r, s, sigma, objective, rho=rho, alpha=alpha)

        x = cp.Variable(n)
        cons = [x >= 0, cp.sum(x) == 1]
        if objective == "cvar":
            cons.append(x <= 1.0 / (alpha * n))
        psi = rho / (2 * n) * cp.sum_squares(n * x - 1) if objective == "chi2" else 0
        _solve(cp.Problem(cp.Minimize(psi - s @ x + cp.sum_squares(x - lam_r) / (2 * sigma)), cons))

        def neg_obj(z, s=s, lam_r=lam_r, sigma=sigma, rho=rho, n=n):
            psi = rho / (2 * n) * np.sum((n * z - 1) ** 2)
            return -(psi - s @ z + np.sum((z - lam_r) ** 2) / (2 * sigma))

        _on_simplex(ours)
        if objective == "cvar":
            assert ours.max() <= 1.0 / (alpha * n) + CON_ATOL
        _close_max(neg_obj(ours), neg_obj(x.value), ours, x.value)


def test_scaffpd_dual_step_special_cases() -> None:
    rng = np.random.default_rng(21)
    for k in range(N_RANDOM):
        lam, s, _, _ = _random_case(rng, k)
        n = lam.size
        afl = scaffpd_dual_step(lam, s, 0.3, "afl")
        # chi2 with rho = 0 is AFL; CVaR with alpha = 1/N has cap 1, i.e. AFL too.
        np.testing.assert_array_equal(scaffpd_dual_step(lam, s, 0.3, "chi2", rho=0.0), afl)
        np.testing.assert_allclose(scaffpd_dual_step(lam, s, 0.3, "cvar", alpha=1.0 / n), afl)
        # CVaR with alpha = 1: the set is {uniform}.
        np.testing.assert_allclose(
            scaffpd_dual_step(lam, s, 0.3, "cvar", alpha=1.0), np.full(n, 1.0 / n)
        )
        # AFL step is the DRFA ascent with tau gamma = sigma.
        np.testing.assert_allclose(afl, dual_ascent(lam, s, 1, 0.3), atol=1e-15)
    # By hand: (0.5, 0.5) + 0.2 (1, 0) = (0.6, 0.5) -> (0.55, 0.45).
    np.testing.assert_allclose(scaffpd_dual_step([0.5, 0.5], [1.0, 0.0], 0.1, "afl"), [0.55, 0.45])
    # chi2, N = 2, sigma = rho = 1: (y + 1)/3 with y = (1.5, 0.5) -> (5/6, 1/2) -> (2/3, 1/3).
    np.testing.assert_allclose(
        scaffpd_dual_step([0.5, 0.5], [1.0, 0.0], 1.0, "chi2", rho=1.0), [2 / 3, 1 / 3]
    )


def test_scaffpd_dual_step_rejects_bad_input() -> None:
    lam, s = [0.5, 0.5], [1.0, 0.0]
    with pytest.raises(ValueError, match=r"objective must be one of 'chi2', 'afl', 'cvar'"):
        scaffpd_dual_step(lam, s, 0.1, "kl")
    with pytest.raises(ValueError, match=r"sigma must be > 0"):
        scaffpd_dual_step(lam, s, 0.0, "afl")
    with pytest.raises(ValueError, match=r"rho must be >= 0"):
        scaffpd_dual_step(lam, s, 0.1, "chi2", rho=-1.0)
    with pytest.raises(ValueError, match=r"alpha must be given for objective='cvar'"):
        scaffpd_dual_step(lam, s, 0.1, "cvar")
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        scaffpd_dual_step(lam, s, 0.1, "cvar", alpha=1.5)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        scaffpd_dual_step(lam, s, 0.1, "cvar", alpha=0.0)
    with pytest.raises(ValueError, match="s must have the same length as lam"):
        scaffpd_dual_step(lam, [1.0, 2.0, 3.0], 0.1, "afl")


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
