"""flowerdro.core.scaffpd against cvxpy solves, hand-worked examples and the step conditions of the paper."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flowerdro.core.scaffpd import (
    auto_theta,
    dual_step,
    dual_step_on,
    extrapolate,
    local_direction,
    next_steps,
    primal_step,
    weighted_sum,
)
from flowerdro.experiments.references import solve_tightly

# float64 results of a handful of operations on O(1) numbers: a few ulps (2.2e-16 each)
EXACT = 1e-13


def _random_case(rng: np.random.Generator, k: int) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(2, 25))
    lam = rng.dirichlet(np.full(n, [0.2, 1.0, 5.0][k % 3]))
    s = rng.exponential(size=n) * [0.1, 1.0, 10.0][k % 3]
    return lam, s


# ------------------------------------------------------------------ s^r
def test_extrapolate_hand_example() -> None:
    # (1 + 0.5)(1, 2) − 0.5 (0, 4) = (1.5, 1)
    np.testing.assert_allclose(extrapolate([1.0, 2.0], [0.0, 4.0], 0.5), [1.5, 1.0], rtol=0, atol=EXACT)
    np.testing.assert_array_equal(extrapolate([1.0, 2.0], [0.0, 4.0], 0.0), [1.0, 2.0])
    with pytest.raises(ValueError, match="theta: must be >= 0"):
        extrapolate([1.0], [1.0], -0.1)
    with pytest.raises(ValueError, match="loss_prev: expected length 2"):
        extrapolate([1.0, 2.0], [1.0], 0.5)


# ------------------------------------------------------------------ λ step
@pytest.mark.parametrize("objective", ["afl", "cvar", "chi2"])
def test_dual_step_matches_cvxpy(objective: str) -> None:
    cp = pytest.importorskip("cvxpy")
    rng = np.random.default_rng({"afl": 18, "cvar": 19, "chi2": 20}[objective])
    for k in range(20):
        lam_r, s = _random_case(rng, k)
        n = lam_r.size
        sigma = float(10 ** rng.uniform(-3, 1))
        rho = float(10 ** rng.uniform(-2, 1)) if objective == "chi2" else 0.0
        alpha = float(rng.uniform(0.05, 1.0)) if objective == "cvar" else None
        ours = dual_step(lam_r, s, sigma, objective, rho=rho, alpha=alpha)
        # argmin_λ ψ(λ) − ⟨s, λ⟩ + ‖λ − λ^r‖²/(2σ) over Λ
        x = cp.Variable(n)
        cons = [x >= 0, cp.sum(x) == 1] + ([x <= 1.0 / (alpha * n)] if objective == "cvar" else [])
        psi = rho / (2 * n) * cp.sum_squares(n * x - 1) if objective == "chi2" else 0
        status = solve_tightly(cp.Problem(cp.Minimize(psi - s @ x + cp.sum_squares(x - lam_r) / (2 * sigma)), cons))
        if status is None:
            pytest.skip("no cvxpy solver installed")
        assert status == cp.OPTIMAL
        # the problem is 1/σ-strongly convex, so an interior-point solution at gap ~1e-10
        # lies within ~sqrt(2σ·1e-10) of the minimiser: 1e-6 covers σ ≤ 10 with margin
        np.testing.assert_allclose(ours, x.value, atol=1e-6, rtol=0)
        assert ours.min() >= 0 and abs(ours.sum() - 1) <= EXACT
        if objective == "cvar":
            assert ours.max() <= 1.0 / (alpha * n) + EXACT


def test_dual_step_hand_examples_and_special_cases() -> None:
    # AFL: (0.5, 0.5) + 0.1 (1, 0) = (0.6, 0.5), shifted by −0.05 onto the simplex
    np.testing.assert_allclose(dual_step([0.5, 0.5], [1.0, 0.0], 0.1, "afl"), [0.55, 0.45], atol=EXACT)
    # χ², N = 2, σ = ρ = 1: (y + 1)/3 with y = (1.5, 0.5) → (5/6, 1/2), shifted by −1/6
    np.testing.assert_allclose(dual_step([0.5, 0.5], [1.0, 0.0], 1.0, "chi2", rho=1.0), [2 / 3, 1 / 3],
                               atol=EXACT)
    rng = np.random.default_rng(21)
    for k in range(20):
        lam, s = _random_case(rng, k)
        n = lam.size
        afl = dual_step(lam, s, 0.3, "afl")
        np.testing.assert_array_equal(dual_step(lam, s, 0.3, "chi2", rho=0.0), afl)  # ρ = 0 is AFL
        np.testing.assert_allclose(dual_step(lam, s, 0.3, "cvar", alpha=1.0 / n), afl, atol=EXACT)  # cap 1
        np.testing.assert_allclose(dual_step(lam, s, 0.3, "cvar", alpha=1.0), np.full(n, 1 / n), atol=EXACT)


@pytest.mark.parametrize("kwargs,match", [
    ({"objective": "kl"}, "objective: unknown objective 'kl'; allowed: chi2, afl, cvar"),
    ({"sigma": 0.0}, "sigma: must be > 0"),
    ({"objective": "chi2", "rho": -1.0}, "rho: must be >= 0"),
    ({"objective": "cvar"}, r"alpha: objective 'cvar' needs α in \(0, 1\]"),
    ({"objective": "cvar", "alpha": 1.5}, r"alpha: objective 'cvar' needs α in \(0, 1\]"),
    ({"lam": [1.0, 1.0]}, "lam: must lie on the simplex"),
    ({"s": [1.0, 2.0, 3.0]}, "s: expected length 2"),
])
def test_dual_step_rejects_bad_input(kwargs: dict, match: str) -> None:
    args = {"lam": [0.5, 0.5], "s": [1.0, 0.0], "sigma": 0.1, "objective": "afl", **kwargs}
    with pytest.raises(ValueError, match=match):
        dual_step(**args)


def test_dual_step_on_a_subset_moves_only_its_mass() -> None:
    lam = np.array([0.1, 0.2, 0.3, 0.4])
    # K = {1, 3}: M = 0.6, λ_K/M = (1/3, 2/3); AFL step with σ = 0.3, s = (1, 0):
    # (1/3 + 0.3, 2/3) shifted by −0.15 → (0.48333…, 0.51666…), times M
    full, sub = dual_step_on(lam, [1, 3], [1.0, 0.0], 0.3, "afl")
    np.testing.assert_allclose(sub, [1 / 3 + 0.15, 2 / 3 - 0.15], atol=EXACT)
    np.testing.assert_allclose(full, [0.1, 0.6 * (1 / 3 + 0.15), 0.3, 0.6 * (2 / 3 - 0.15)], atol=EXACT)
    # K = every client: the plain step
    np.testing.assert_allclose(dual_step_on(lam, range(4), [1.0, 0, 0, 2], 0.3, "afl")[0],
                               dual_step(lam, [1.0, 0, 0, 2], 0.3, "afl"), atol=EXACT)
    # K with no mass: λ kept, the weights over K start from uniform
    full, sub = dual_step_on([0.0, 1.0], [0], [5.0], 0.3, "afl")
    np.testing.assert_array_equal(full, [0.0, 1.0])
    np.testing.assert_array_equal(sub, [1.0])


# ------------------------------------------------------------------ primal step
def test_primal_step_with_tau_eta_j_is_the_weighted_average_of_local_models() -> None:
    rng = np.random.default_rng(3)
    x = [rng.normal(size=(2, 3)), rng.normal(size=4)]
    us = [[rng.normal(size=(2, 3)), rng.normal(size=4)] for _ in range(3)]
    lam = np.array([0.2, 0.5, 0.3])
    lr, steps = 0.05, 4
    direction = weighted_sum(lam, [local_direction(x, u, lr, steps) for u in us])
    new = primal_step(x, direction, lr * steps)
    for k in range(2):  # x − η_l J Σλ_i (x − u_i)/(η_l J) = Σλ_i u_i
        np.testing.assert_allclose(new[k], sum(w * u[k] for w, u in zip(lam, us, strict=True)), atol=EXACT)


# ------------------------------------------------------------------ step sizes
def test_rule_51_hand_worked_schedule() -> None:
    # τ_0 = 1, γ_0 = 2 (σ_0 = 2), μ_x = 3:
    # r = 1: γ = 2·(1 + 3) = 8, τ = 1·√(2/8) = 1/2, σ = 8/2 = 4, θ = 2/4
    # r = 2: γ = 8·(1 + 3/2) = 20, τ = (1/2)√(8/20) = 1/√10, σ = 20/√10 = 2√10, θ = 4/(2√10)
    tau, sigma, gamma, theta = next_steps(1.0, 2.0, 2.0, 3.0)
    assert (tau, sigma, gamma, theta) == pytest.approx((0.5, 4.0, 8.0, 0.5), rel=EXACT)
    tau, sigma, gamma, theta = next_steps(tau, sigma, gamma, 3.0)
    assert (tau, sigma, gamma, theta) == pytest.approx((1 / math.sqrt(10), 2 * math.sqrt(10), 20.0,
                                                        2 / math.sqrt(10)), rel=EXACT)
    # μ_x = 0: constant steps and θ = 1
    assert next_steps(0.7, 0.2, 0.2 / 0.7, 0.0) == pytest.approx((0.7, 0.2, 0.2 / 0.7, 1.0), rel=EXACT)


def test_rule_51_meets_the_step_conditions_with_equality() -> None:
    # Hamedani & Aybat's conditions with weights t_r = σ_r: σ_r(1/τ_r + μ_x) ≥ σ_{r+1}/τ_{r+1}
    # and θ_{r+1}σ_{r+1} = σ_r; the schedule is tight in the first and keeps σ_rτ_r constant.
    rng = np.random.default_rng(5)
    for _ in range(20):
        tau, gamma, mu = (float(10 ** rng.uniform(-2, 1)) for _ in range(3))
        sigma = gamma * tau
        product = sigma * tau
        for _ in range(30):
            tau1, sigma1, gamma1, theta1 = next_steps(tau, sigma, gamma, mu)
            # relative rounding of ~10 chained float64 operations per round over 30 rounds
            assert sigma * (1 / tau + mu) == pytest.approx(sigma1 / tau1, rel=1e-12)
            assert theta1 * sigma1 == pytest.approx(sigma, rel=1e-12)
            assert sigma1 * tau1 == pytest.approx(product, rel=1e-12)
            assert tau1 < tau and sigma1 > sigma and 0 < theta1 < 1
            tau, sigma, gamma = tau1, sigma1, gamma1


def test_auto_theta_is_the_smallest_theta_meeting_both_conditions() -> None:
    # μ_x = 1, τ = 1: 1/(1 + 1) = 1/2; μ_y = ρN = 0.5, σ = 0.2: 1/(1 + 0.1) = 10/11
    assert auto_theta(1.0, 0.5, tau=1.0, sigma=0.2) == pytest.approx(10 / 11, rel=EXACT)
    assert auto_theta(0.0, 0.5, tau=1.0, sigma=0.2) == 1.0  # no strong convexity in x
    assert auto_theta(1.0, 0.0, tau=1.0, sigma=0.2) == 1.0  # AFL / CVaR: none in λ
    rng = np.random.default_rng(7)
    for _ in range(50):
        mx, my, tau, sigma = (float(10 ** rng.uniform(-3, 2)) for _ in range(4))
        theta = auto_theta(mx, my, tau, sigma)
        a, b = theta * (1 + mx * tau), theta * (1 + my * sigma)
        assert a >= 1 - EXACT and b >= 1 - EXACT  # θ(1 + μ_xτ) ≥ 1 and θ(1 + μ_yσ) ≥ 1 ...
        assert min(a, b) == pytest.approx(1.0, rel=EXACT)  # ... with equality in one: the smallest such θ
