"""Tests for flowerdro.core.dual against cvxpy solves, closed forms and hand examples."""

from __future__ import annotations

import itertools

import cvxpy as cp
import numpy as np
import pytest

from flowerdro.core.dual import (
    chi2_divergence,
    drfa_dual_ascent,
    drfa_loss_vector,
    drfa_prox_step,
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


# ----------------------------------------------------------------------- loss vector
def test_drfa_loss_vector_hand_example() -> None:
    # N = 4, m = 3, client 1 drawn twice: v_1 = (4/3)(0.5 + 0.5), v_3 = (4/3) 2.
    np.testing.assert_allclose(
        drfa_loss_vector(4, [1, 3, 1], [0.5, 2.0, 0.5]), [0.0, 4 / 3, 0.0, 8 / 3]
    )
    np.testing.assert_allclose(drfa_loss_vector(1, [0], [0.7]), [0.7])


def test_drfa_loss_vector_is_unbiased_by_enumeration() -> None:
    # E_U[v] over all N^m equally likely ordered draws equals the full loss vector.
    rng = np.random.default_rng(10)
    for n, m in [(3, 2), (4, 3), (2, 4), (5, 1)]:
        f = rng.exponential(size=n)
        mean = np.zeros(n)
        for draw in itertools.product(range(n), repeat=m):
            mean += drfa_loss_vector(n, list(draw), f[list(draw)])
        np.testing.assert_allclose(mean / n**m, f, rtol=1e-12)


def test_drfa_loss_vector_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_clients must be an integer >= 1"):
        drfa_loss_vector(0, [0], [1.0])
    with pytest.raises(ValueError, match="num_clients must be an integer >= 1"):
        drfa_loss_vector(2.5, [0], [1.0])
    with pytest.raises(ValueError, match=r"sampled_ids must be in \[0, num_clients\)"):
        drfa_loss_vector(3, [0, 3], [1.0, 1.0])
    with pytest.raises(ValueError, match="sampled_ids must be a non-empty"):
        drfa_loss_vector(3, [], [])
    with pytest.raises(ValueError, match="losses must have one entry per sampled id"):
        drfa_loss_vector(3, [0, 1], [1.0])
    with pytest.raises(ValueError, match="losses must be finite"):
        drfa_loss_vector(3, [0], [np.nan])


# ---------------------------------------------------------------------- dual ascent
def test_drfa_dual_ascent_matches_cvxpy() -> None:
    # argmax_u <tau gamma v, u> - 1/2 ||u - lam||^2 over the simplex (or capped simplex).
    rng = np.random.default_rng(11)
    for k in range(N_RANDOM):
        lam, v, tau, gamma = _random_case(rng, k)
        n = lam.size
        cap = None if k % 2 else 1.0 / (float(rng.uniform(0.1, 1.0)) * n)
        ours = drfa_dual_ascent(lam, v, tau, gamma, cap=cap)
        u = cp.Variable(n)
        cons = [u >= 0, cp.sum(u) == 1] + ([] if cap is None else [u <= cap])
        prob = cp.Problem(cp.Maximize(tau * gamma * v @ u - 0.5 * cp.sum_squares(u - lam)), cons)
        _solve(prob)

        def obj(x, lam=lam, v=v, tau=tau, gamma=gamma):
            return tau * gamma * v @ x - 0.5 * np.sum((x - lam) ** 2)

        _on_simplex(ours)
        if cap is not None:
            assert ours.max() <= cap + CON_ATOL
        _close_max(obj(ours), obj(u.value), ours, u.value)


def test_drfa_dual_ascent_hand_example_and_fixed_point() -> None:
    # (0.5, 0.5) + 1 * 0.2 * (1, 0) = (0.7, 0.5); theta = 0.1.
    np.testing.assert_allclose(drfa_dual_ascent([0.5, 0.5], [1.0, 0.0], 1, 0.2), [0.6, 0.4])
    # Equal losses move nothing.
    lam = np.array([0.2, 0.3, 0.5])
    np.testing.assert_allclose(drfa_dual_ascent(lam, np.full(3, 7.0), 5, 0.1), lam, atol=1e-15)
    # Huge losses: all mass on the worst client.
    np.testing.assert_allclose(drfa_dual_ascent(lam, [1e12, 0.0, 0.0], 1, 1.0), [1.0, 0.0, 0.0])


def test_drfa_dual_ascent_rejects_bad_input() -> None:
    lam, v = [0.5, 0.5], [1.0, 0.0]
    with pytest.raises(ValueError, match=r"tau must be >= 1"):
        drfa_dual_ascent(lam, v, 0.5, 0.1)
    with pytest.raises(ValueError, match=r"gamma must be > 0"):
        drfa_dual_ascent(lam, v, 1, 0.0)
    with pytest.raises(ValueError, match=r"gamma must be a finite real number"):
        drfa_dual_ascent(lam, v, 1, np.inf)
    with pytest.raises(ValueError, match="lam must lie on the probability simplex"):
        drfa_dual_ascent([0.7, 0.7], v, 1, 0.1)
    with pytest.raises(ValueError, match="v must have the same length as lam"):
        drfa_dual_ascent(lam, [1.0], 1, 0.1)
    with pytest.raises(ValueError, match=r"cap must satisfy cap\*N >= 1"):
        drfa_dual_ascent(lam, v, 1, 0.1, cap=0.2)


# ------------------------------------------------------------------------ DRFA-Prox
def _cvx_prox(lam, v, tau, gamma, regularizer, rho):
    """max_u tau g(u) - 1/(2 gamma) ||lam + gamma tau v - u||^2 over the simplex, by cvxpy."""
    n = lam.size
    y = lam + gamma * tau * v
    u = cp.Variable(n)
    if regularizer == "l2":
        g = -(rho / 2) * cp.sum_squares(u - 1.0 / n)
    elif regularizer == "chi2":
        g = -rho * cp.sum_squares(n * u - 1) / (2 * n)
    else:  # sum u_i log(N u_i) = -sum entr(u) + log(N) sum u
        g = -rho * (cp.sum(-cp.entr(u)) + np.log(n) * cp.sum(u))
    prob = cp.Problem(
        cp.Maximize(tau * g - cp.sum_squares(y - u) / (2 * gamma)), [u >= 0, cp.sum(u) == 1]
    )
    _solve(prob)
    return np.asarray(u.value)


def _prox_objective(x, lam, v, tau, gamma, regularizer, rho):
    """The DRFA-Prox objective evaluated in numpy (0 log 0 = 0)."""
    n = x.size
    x = np.maximum(x, 0.0)
    if regularizer == "l2":
        g = -(rho / 2) * np.sum((x - 1.0 / n) ** 2)
    elif regularizer == "chi2":
        g = -rho * np.sum((n * x - 1) ** 2) / (2 * n)
    else:
        g = -rho * np.sum(np.where(x > 0, x * np.log(np.where(x > 0, n * x, 1.0)), 0.0))
    return tau * g - np.sum((lam + gamma * tau * v - x) ** 2) / (2 * gamma)


@pytest.mark.parametrize("regularizer", ["l2", "chi2", "kl"])
def test_drfa_prox_step_matches_cvxpy(regularizer) -> None:
    rng = np.random.default_rng({"l2": 12, "chi2": 13, "kl": 14}[regularizer])
    for k in range(N_RANDOM):
        lam, v, tau, gamma = _random_case(rng, k)
        rho = float(10 ** rng.uniform(-2, 1))
        ours = drfa_prox_step(lam, v, tau, gamma, regularizer, rho)
        ref = _cvx_prox(lam, v, tau, gamma, regularizer, rho)
        _on_simplex(ours)
        args = (lam, v, tau, gamma, regularizer, rho)
        _close_max(_prox_objective(ours, *args), _prox_objective(ref, *args), ours, ref)


def test_drfa_prox_step_closed_forms_by_hand() -> None:
    # l2: y = (1.5, 0.5), kappa = 1 -> (y + 0.5)/2 = (1, 0.5) -> project -> (0.75, 0.25).
    np.testing.assert_allclose(
        drfa_prox_step([0.5, 0.5], [1.0, 0.0], 1, 1.0, "l2", 1.0), [0.75, 0.25]
    )
    # chi2 with N = 2 is l2 with 2 rho: (y + 1)/3 = (5/6, 1/2) -> project -> (2/3, 1/3).
    np.testing.assert_allclose(
        drfa_prox_step([0.5, 0.5], [1.0, 0.0], 1, 1.0, "chi2", 1.0), [2 / 3, 1 / 3]
    )
    # KL, N = 2, symmetric y: the uniform point is stationary.
    np.testing.assert_allclose(
        drfa_prox_step([0.5, 0.5], [3.0, 3.0], 2, 0.1, "kl", 5.0), [0.5, 0.5], atol=1e-15
    )


@pytest.mark.parametrize("regularizer", ["l2", "chi2", "kl"])
def test_drfa_prox_step_rho_zero_is_plain_ascent(regularizer) -> None:
    rng = np.random.default_rng(15)
    for k in range(N_RANDOM):
        lam, v, tau, gamma = _random_case(rng, k)
        np.testing.assert_array_equal(
            drfa_prox_step(lam, v, tau, gamma, regularizer, 0.0),
            drfa_dual_ascent(lam, v, tau, gamma),
        )


@pytest.mark.parametrize("regularizer", ["l2", "chi2", "kl"])
def test_drfa_prox_step_limits_in_rho(regularizer) -> None:
    rng = np.random.default_rng(16)
    for k in range(N_RANDOM):
        lam, v, tau, gamma = _random_case(rng, k)
        n = lam.size
        # Huge rho: the regulariser pins the uniform point.
        np.testing.assert_allclose(
            drfa_prox_step(lam, v, tau, gamma, regularizer, 1e12), np.full(n, 1.0 / n), atol=1e-9
        )
        np.testing.assert_allclose(
            drfa_prox_step(lam, v, tau, gamma, regularizer, 1e300), np.full(n, 1.0 / n), atol=1e-9
        )
        # Tiny rho: the plain ascent step (KL moves it by O(kappa log(1/kappa))).
        np.testing.assert_allclose(
            drfa_prox_step(lam, v, tau, gamma, regularizer, 1e-14),
            drfa_dual_ascent(lam, v, tau, gamma),
            atol=1e-9,
        )
        tiny = drfa_prox_step(lam, v, tau, gamma, regularizer, 1e-305)
        np.testing.assert_allclose(tiny, drfa_dual_ascent(lam, v, tau, gamma), atol=1e-12)


def test_drfa_prox_step_kl_kkt_conditions() -> None:
    # Optimality of min_u kappa sum u log(N u) + 1/2 ||u - y||^2 over the simplex
    # (kappa = gamma tau rho): u > 0, sum u = 1 and the stationarity residual
    # kappa (log(N u_i) + 1) + u_i - y_i equals the same -nu for every i.
    rng = np.random.default_rng(17)
    for k in range(N_RANDOM):
        n = int(rng.integers(2, 40))
        lam = rng.dirichlet(np.ones(n))
        v = rng.normal(size=n) * [0.1, 1.0, 10.0][k % 3]
        tau = int(rng.integers(1, 10))
        gamma = float(10 ** rng.uniform(-3, 0))
        rho = float(10 ** rng.uniform(-4, 6))
        u = drfa_prox_step(lam, v, tau, gamma, "kl", rho)
        kappa = gamma * tau * rho
        y = lam + gamma * tau * v
        assert abs(u.sum() - 1.0) <= 1e-12
        if kappa >= 1e-2:  # otherwise entries may underflow to 0 (exp(-1/kappa))
            assert u.min() > 0.0
        pos = u > 1e-250
        resid = kappa * (np.log(n * u[pos]) + 1.0) + u[pos] - y[pos]
        scale = 1.0 + kappa + np.abs(y).max()
        assert np.ptp(resid) <= 1e-10 * scale, (kappa, np.ptp(resid))
        # An entry that underflowed to u_i < 1e-250 must satisfy the same stationarity
        # equation with log(N u_i) < log(N 1e-250), i.e. y_i lies far below the others.
        if (~pos).any():
            bound = kappa * (np.log(n * 1e-250) + 1.0) + 1e-250 - resid.mean()
            assert np.all(y[~pos] <= bound + 1e-10 * scale)


def test_drfa_prox_step_rejects_bad_input() -> None:
    lam, v = [0.5, 0.5], [1.0, 0.0]
    with pytest.raises(ValueError, match=r"rho must be >= 0"):
        drfa_prox_step(lam, v, 1, 0.1, "kl", -1.0)
    with pytest.raises(ValueError, match=r"gamma must be > 0"):
        drfa_prox_step(lam, v, 1, -0.1, "kl", 1.0)
    with pytest.raises(ValueError, match=r"tau must be >= 1"):
        drfa_prox_step(lam, v, 0, 0.1, "kl", 1.0)
    with pytest.raises(ValueError, match=r"regularizer must be one of 'kl', 'chi2', 'l2'"):
        drfa_prox_step(lam, v, 1, 0.1, "entropy", 1.0)
    with pytest.raises(ValueError, match="lam must lie on the probability simplex"):
        drfa_prox_step([1.0, 1.0], v, 1, 0.1, "l2", 1.0)


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
