"""flowerdro.core.drfa: DRFA's sampling, aggregation and λ step against enumeration, cvxpy and hand examples."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from flowerdro.core.drfa import (
    aggregation_weights,
    combine_models,
    dual_ascent,
    dual_step,
    loss_vector,
    prox_step,
    sample_by_lambda,
    sample_snapshot_steps,
)
from flowerdro.core.simplex import project_simplex
from flowerdro.experiments.references import solve_tightly

#: the reference solves these tests compare against (cvxpy is a dev extra)
cp = pytest.importorskip("cvxpy", reason="cvxpy (the dev extra) gives the reference solves")

N_RANDOM = 25
# cvxpy is solved to gaps of 1e-12 where it can reach them: an interior-point solution of a
# strongly convex problem is accurate to about √gap ≈ 1e-6, its objective to about the gap
# (OBJ_RTOL 1e-7 leaves margin); our own iterates are float64 and meet the constraints to
# n·eps ≈ 1e-14, far inside CON_ATOL.
SOL_ATOL = 1e-6
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
def test_loss_vector_hand_example() -> None:
    # N = 4, m = 3, client 1 drawn twice: v_1 = (4/3)(0.5 + 0.5), v_3 = (4/3) 2.
    np.testing.assert_allclose(
        loss_vector(4, [1, 3, 1], [0.5, 2.0, 0.5]), [0.0, 4 / 3, 0.0, 8 / 3]
    )
    np.testing.assert_allclose(loss_vector(1, [0], [0.7]), [0.7])


def test_loss_vector_is_unbiased_by_enumeration() -> None:
    # E_U[v] over all N^m equally likely ordered draws equals the full loss vector.
    rng = np.random.default_rng(10)
    for n, m in [(3, 2), (4, 3), (2, 4), (5, 1)]:
        f = rng.exponential(size=n)
        mean = np.zeros(n)
        for draw in itertools.product(range(n), repeat=m):
            mean += loss_vector(n, list(draw), f[list(draw)])
        np.testing.assert_allclose(mean / n**m, f, rtol=1e-12)  # sums of ≤ 64 float64 terms


def test_loss_vector_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_clients must be an integer >= 1"):
        loss_vector(0, [0], [1.0])
    with pytest.raises(ValueError, match="num_clients must be an integer >= 1"):
        loss_vector(2.5, [0], [1.0])
    with pytest.raises(ValueError, match=r"sampled_ids must be in \[0, num_clients\)"):
        loss_vector(3, [0, 3], [1.0, 1.0])
    with pytest.raises(ValueError, match="sampled_ids must be a non-empty"):
        loss_vector(3, [], [])
    with pytest.raises(ValueError, match="losses must have one entry per sampled id"):
        loss_vector(3, [0, 1], [1.0])
    with pytest.raises(ValueError, match="losses must be finite"):
        loss_vector(3, [0], [np.nan])


# ---------------------------------------------------------------------- dual ascent
def test_dual_ascent_matches_cvxpy() -> None:
    # argmax_u <tau gamma v, u> - 1/2 ||u - lam||^2 over the simplex.
    rng = np.random.default_rng(11)
    for k in range(N_RANDOM):
        lam, v, tau, gamma = _random_case(rng, k)
        n = lam.size
        ours = dual_ascent(lam, v, tau, gamma)
        u = cp.Variable(n)
        prob = cp.Problem(cp.Maximize(tau * gamma * v @ u - 0.5 * cp.sum_squares(u - lam)), [u >= 0, cp.sum(u) == 1])
        _solve(prob)

        def obj(x, lam=lam, v=v, tau=tau, gamma=gamma):
            return tau * gamma * v @ x - 0.5 * np.sum((x - lam) ** 2)

        _on_simplex(ours)
        _close_max(obj(ours), obj(u.value), ours, u.value)


def test_dual_ascent_hand_example_and_fixed_point() -> None:
    # (0.5, 0.5) + 1 * 0.2 * (1, 0) = (0.7, 0.5); theta = 0.1.
    np.testing.assert_allclose(dual_ascent([0.5, 0.5], [1.0, 0.0], 1, 0.2), [0.6, 0.4])
    # Equal losses move nothing.
    lam = np.array([0.2, 0.3, 0.5])
    np.testing.assert_allclose(dual_ascent(lam, np.full(3, 7.0), 5, 0.1), lam, atol=1e-15)  # float64 rounding of numbers of size ~1
    # Huge losses: all mass on the worst client.
    np.testing.assert_allclose(dual_ascent(lam, [1e12, 0.0, 0.0], 1, 1.0), [1.0, 0.0, 0.0])


def test_dual_ascent_rejects_bad_input() -> None:
    lam, v = [0.5, 0.5], [1.0, 0.0]
    with pytest.raises(ValueError, match=r"tau must be >= 1"):
        dual_ascent(lam, v, 0.5, 0.1)
    with pytest.raises(ValueError, match=r"gamma must be > 0"):
        dual_ascent(lam, v, 1, 0.0)
    with pytest.raises(ValueError, match=r"gamma must be a finite real number"):
        dual_ascent(lam, v, 1, np.inf)
    with pytest.raises(ValueError, match="lam must lie on the probability simplex"):
        dual_ascent([0.7, 0.7], v, 1, 0.1)
    with pytest.raises(ValueError, match="v must have the same length as lam"):
        dual_ascent(lam, [1.0], 1, 0.1)


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
def test_prox_step_matches_cvxpy(regularizer) -> None:
    rng = np.random.default_rng({"l2": 12, "chi2": 13, "kl": 14}[regularizer])
    for k in range(N_RANDOM):
        lam, v, tau, gamma = _random_case(rng, k)
        rho = float(10 ** rng.uniform(-2, 1))
        ours = prox_step(lam, v, tau, gamma, regularizer, rho)
        ref = _cvx_prox(lam, v, tau, gamma, regularizer, rho)
        _on_simplex(ours)
        args = (lam, v, tau, gamma, regularizer, rho)
        _close_max(_prox_objective(ours, *args), _prox_objective(ref, *args), ours, ref)


def test_prox_step_closed_forms_by_hand() -> None:
    # l2: y = (1.5, 0.5), kappa = 1 -> (y + 0.5)/2 = (1, 0.5) -> project -> (0.75, 0.25).
    np.testing.assert_allclose(
        prox_step([0.5, 0.5], [1.0, 0.0], 1, 1.0, "l2", 1.0), [0.75, 0.25]
    )
    # chi2 with N = 2 is l2 with 2 rho: (y + 1)/3 = (5/6, 1/2) -> project -> (2/3, 1/3).
    np.testing.assert_allclose(
        prox_step([0.5, 0.5], [1.0, 0.0], 1, 1.0, "chi2", 1.0), [2 / 3, 1 / 3]
    )
    # KL, N = 2, symmetric y: the uniform point is stationary.
    np.testing.assert_allclose(
        prox_step([0.5, 0.5], [3.0, 3.0], 2, 0.1, "kl", 5.0), [0.5, 0.5], atol=1e-15  # float64 rounding of numbers of size ~1
    )


@pytest.mark.parametrize("regularizer", ["l2", "chi2", "kl"])
def test_prox_step_rho_zero_is_plain_ascent(regularizer) -> None:
    rng = np.random.default_rng(15)
    for k in range(N_RANDOM):
        lam, v, tau, gamma = _random_case(rng, k)
        np.testing.assert_array_equal(
            prox_step(lam, v, tau, gamma, regularizer, 0.0),
            dual_ascent(lam, v, tau, gamma),
        )


@pytest.mark.parametrize("regularizer", ["l2", "chi2", "kl"])
def test_prox_step_limits_in_rho(regularizer) -> None:
    rng = np.random.default_rng(16)
    for k in range(N_RANDOM):
        lam, v, tau, gamma = _random_case(rng, k)
        n = lam.size
        # Huge rho: the regulariser pins the uniform point.
        np.testing.assert_allclose(
            prox_step(lam, v, tau, gamma, regularizer, 1e12), np.full(n, 1.0 / n), atol=1e-9  # the step moves λ by O(1/ρ)
        )
        np.testing.assert_allclose(
            prox_step(lam, v, tau, gamma, regularizer, 1e300), np.full(n, 1.0 / n), atol=1e-9  # the step moves λ by O(1/ρ)
        )
        # Tiny rho: the plain ascent step (KL moves it by O(kappa log(1/kappa))).
        np.testing.assert_allclose(
            prox_step(lam, v, tau, gamma, regularizer, 1e-14),
            dual_ascent(lam, v, tau, gamma),
            atol=1e-9,  # KL moves the step by O(κ log(1/κ)) with κ ~ 1e-14
        )
        tiny = prox_step(lam, v, tau, gamma, regularizer, 1e-305)
        np.testing.assert_allclose(tiny, dual_ascent(lam, v, tau, gamma), atol=1e-12)  # KL's effect is below float64 resolution at ρ = 1e-305


def test_prox_step_kl_kkt_conditions() -> None:
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
        u = prox_step(lam, v, tau, gamma, "kl", rho)
        kappa = gamma * tau * rho
        y = lam + gamma * tau * v
        # float64 sum of ≤ 40 entries: within n·eps ≈ 1e-14 of 1
        assert abs(u.sum() - 1.0) <= 1e-12
        if kappa >= 1e-2:  # otherwise entries may underflow to 0 (exp(-1/kappa))
            assert u.min() > 0.0
        pos = u > 1e-250
        # the KL prox is solved to float64 accuracy: the residual's spread is rounding of terms of
        # size `scale`
        # (≈1e-15·scale, times the log's conditioning); 1e-10·scale leaves margin for tiny u_i
        resid = kappa * (np.log(n * u[pos]) + 1.0) + u[pos] - y[pos]
        scale = 1.0 + kappa + np.abs(y).max()
        assert np.ptp(resid) <= 1e-10 * scale, (kappa, np.ptp(resid))
        # An entry that underflowed to u_i < 1e-250 must satisfy the same stationarity
        # equation with log(N u_i) < log(N 1e-250), i.e. y_i lies far below the others.
        if (~pos).any():
            bound = kappa * (np.log(n * 1e-250) + 1.0) + 1e-250 - resid.mean()
            # the same 1e-10·scale margin over float64 rounding as the residual spread above
            assert np.all(y[~pos] <= bound + 1e-10 * scale)


def test_prox_step_rejects_bad_input() -> None:
    lam, v = [0.5, 0.5], [1.0, 0.0]
    with pytest.raises(ValueError, match=r"rho must be >= 0"):
        prox_step(lam, v, 1, 0.1, "kl", -1.0)
    with pytest.raises(ValueError, match=r"gamma must be > 0"):
        prox_step(lam, v, 1, -0.1, "kl", 1.0)
    with pytest.raises(ValueError, match=r"tau must be >= 1"):
        prox_step(lam, v, 0, 0.1, "kl", 1.0)
    with pytest.raises(ValueError, match=r"regularizer must be one of 'kl', 'chi2', 'l2'"):
        prox_step(lam, v, 1, 0.1, "entropy", 1.0)
    with pytest.raises(ValueError, match="lam must lie on the probability simplex"):
        prox_step([1.0, 1.0], v, 1, 0.1, "l2", 1.0)



# ----------------------------------------------------------------------- the λ step
def test_tau_v_is_unbiased_for_the_sum_of_lambda_gradients_over_the_local_steps():
    # A fixed loss table F[t, i] = f_i(w(t)) for t = 1..τ; ∇_λ F(w(t), λ) = F[t]. Exact
    # expectation over t′ ~ U{1..τ} and the N^m equally likely ordered draws of U.
    rng = np.random.default_rng(0)
    n, m, tau = 4, 2, 3
    table = rng.uniform(0.0, 3.0, size=(tau, n))
    mean = np.zeros(n)
    for tp in range(1, tau + 1):
        for u in itertools.product(range(n), repeat=m):
            mean += tau * loss_vector(n, list(u), table[tp - 1, list(u)]) / (tau * n**m)
    np.testing.assert_allclose(mean, table.sum(axis=0), rtol=1e-13)  # a few float64 roundings per term


def test_dual_step_is_projected_ascent_with_hand_computed_v():
    # In the interior of the simplex Π_Δ(y) = y − (Σy − 1)/N, so λ⁺ = λ + τγ(v − mean(v)).
    lam = np.array([0.3, 0.2, 0.25, 0.25])
    ids, losses = [1, 3, 1], [0.6, 1.5, 0.6]
    v = np.zeros(4)
    v[1], v[3] = 2 * 0.6 * 4 / 3, 1.5 * 4 / 3
    tau, gamma = 4, 0.01
    expected = lam + tau * gamma * (v - v.mean())
    np.testing.assert_allclose(dual_step(lam, ids, losses, tau=tau, gamma=gamma), expected, atol=1e-15)  # float64 rounding of numbers of size ~1


@pytest.mark.parametrize("reg", ["none", "kl", "chi2", "l2"])
def test_dual_step_stays_on_the_simplex(reg):
    rng = np.random.default_rng(1)
    lam = np.full(20, 1 / 20)
    for _ in range(200):
        ids = rng.integers(0, 20, size=5)
        lam = dual_step(lam, ids, rng.uniform(0, 50, size=5), tau=10, gamma=0.5, regularizer=reg, rho=0.3)
        # 200 float64 steps on a 20-entry simplex, each renormalised: drift ≈ n·eps per step; 1e-9
        # is ample
        assert lam.min() >= 0.0 and lam.sum() == pytest.approx(1.0, abs=1e-9)


def test_dual_step_l2_prox_matches_closed_form():
    # g(u) = −(ρ/2)‖u − 1/N‖²: λ⁺ = Π_Δ((λ + γτv + γτρ/N) / (1 + γτρ)).
    lam, ids, losses = np.array([0.1, 0.6, 0.3]), [0, 2], [2.0, 1.0]
    v = np.array([2.0 * 1.5, 0.0, 1.0 * 1.5])
    k = 0.2 * 3 * 0.5
    expected = project_simplex((lam + 0.2 * 3 * v + k / 3) / (1 + k))
    got = dual_step(lam, ids, losses, tau=3, gamma=0.2, regularizer="l2", rho=0.5)
    np.testing.assert_allclose(got, expected, atol=1e-15)  # float64 rounding of numbers of size ~1


def test_lambda_floor_keeps_simplex_and_floor():
    rng = np.random.default_rng(2)
    lam, floor = np.full(10, 0.1), 1e-2
    for _ in range(100):
        ids = rng.integers(0, 10, size=3)
        lam = dual_step(lam, ids, rng.uniform(0, 100, size=3), tau=10, gamma=1.0, floor=floor)
        # float64 floor projection: floor kept and sum 1 up to n·eps (≈1e-15)
        assert lam.min() >= floor - 1e-12 and lam.sum() == pytest.approx(1.0, abs=1e-12)
    # without the floor the same updates drive entries to exactly zero
    assert dual_step(np.full(10, 0.1), [0], [100.0], tau=10, gamma=1.0).min() == 0.0


def test_public_dual_step_scale_drops_tau_n_over_m():
    # public step: λ + γ Σ_{k∈U′} 1[k=i] f_i (duplicates counted), projected; worked by hand
    lam = np.array([0.25, 0.25, 0.25, 0.25])
    got = dual_step(lam, [1, 1, 3], [0.2, 0.2, 0.1], tau=10, gamma=0.5, scale="public")
    # raw = λ + 0.5·(0, 0.4, 0, 0.1) = (0.25, 0.45, 0.25, 0.30), sum 1.25 → shift by 0.0625
    np.testing.assert_allclose(got, [0.1875, 0.3875, 0.1875, 0.2375], atol=1e-15)  # values exact in binary, a few roundings
    # the paper's step on the same input is τN/m′ = 10·4/3 times larger before projecting
    paper = dual_step(lam, [1, 1, 3], [0.2, 0.2, 0.1], tau=10, gamma=0.5 * 3 / 40)
    np.testing.assert_allclose(paper, got, atol=1e-15)  # float64 rounding of numbers of size ~1
    # prox variant: the paper's prox step with τ = 1 and the vector u_i = Σ 1[k=i] f_i
    rng = np.random.default_rng(5)
    lam = rng.dirichlet(np.ones(6))
    ids, losses = [0, 2, 2, 5], rng.uniform(0, 3, size=4)
    u = np.zeros(6)
    np.add.at(u, ids, losses)
    got = dual_step(lam, ids, losses, tau=7, gamma=0.3, regularizer="kl", rho=0.2, scale="public")
    np.testing.assert_allclose(got, prox_step(lam, u, 1, 0.3, "kl", 0.2), atol=1e-12)  # the root find's relative accuracy (a few eps) on entries ≤ 1
    with pytest.raises(ValueError, match="scale"):
        dual_step(lam, ids, losses, tau=1, gamma=0.1, scale="nope")


# ---------------------------------------------------------------------- default γ
# (see tests/unit/test_drfa_default_step.py)


# --------------------------------------------------------------------------- sampling
def test_sampling_by_lambda_is_repeatable_and_matches_lambda():
    lam = np.array([0.05, 0.4, 0.0, 0.25, 0.3])
    a = sample_by_lambda(np.random.default_rng(7), lam, 20_000)
    b = sample_by_lambda(np.random.default_rng(7), lam, 20_000)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, sample_by_lambda(np.random.default_rng(8), lam, 20_000))
    counts = np.bincount(a, minlength=5)
    assert counts[2] == 0  # λ_i = 0 is never drawn
    keep = lam > 0
    _, p = stats.chisquare(counts[keep], lam[keep] * counts.sum())
    assert p > 1e-3


def test_sampling_without_replacement_is_distinct_and_bounded_by_support():
    rng = np.random.default_rng(0)
    d = sample_by_lambda(rng, np.array([0.5, 0.0, 0.5, 0.0]), 3, replace=False)
    assert sorted(d.tolist()) == [0, 2]
    d = sample_by_lambda(rng, np.full(6, 1 / 6), 4, replace=False)
    assert len(set(d.tolist())) == 4


def test_snapshot_steps_shared_and_per_client():
    rng = np.random.default_rng(5)
    shared = sample_snapshot_steps(rng, 10, 6, mode="shared")
    assert len(set(shared.tolist())) == 1 and 1 <= shared[0] <= 10
    per = np.concatenate([sample_snapshot_steps(rng, 4, 50, mode="per-client") for _ in range(20)])
    assert set(per.tolist()) == {1, 2, 3, 4}


# ------------------------------------------------------------------------ aggregation
def _successive(lam, m):
    """Every ordered draw of m distinct clients by successive sampling, with its exact probability."""
    for seq in itertools.permutations(range(len(lam)), m):
        p, used = Fraction(1), Fraction(0)
        for i in seq:
            p *= lam[i] / (1 - used)
            used += lam[i]
        yield seq, p


def _expected_weights(draws_with_prob, lam, design):
    """E[a] over the enumerated draws (exact probabilities, float64 weights)."""
    mean = np.zeros(len(lam))
    lam_f = np.array([float(x) for x in lam])
    for seq, p in draws_with_prob:
        for i, a in aggregation_weights(seq, set(seq), lam_f, design=design).items():
            mean[i] += float(p) * a
    return mean


LAMBDAS = [  # (λ as fractions, m)
    ((Fraction(7, 10), Fraction(1, 10), Fraction(1, 10), Fraction(1, 10)), 2),
    ((Fraction(1, 2), Fraction(1, 4), Fraction(1, 8), Fraction(1, 16), Fraction(1, 16)), 3),
    ((Fraction(2, 5), Fraction(3, 10), Fraction(1, 5), Fraction(1, 10)), 3),
    ((Fraction(9, 10), Fraction(1, 20), Fraction(1, 20)), 2),
]


def test_uniform_mean_over_a_sample_without_replacement_is_biased():
    # Why the mean is not used without replacement: over all ordered draws of 2 of 4 with
    # λ = (0.7, 0.1, 0.1, 0.1), client 0 is in D(s) with probability 0.7 + 3·0.1·(0.7/0.9)
    # = 14/15, so the mean weighs it 7/15 (and each other client 8/45), not 0.7.
    lam, m = LAMBDAS[0]
    weight = [Fraction(0)] * 4
    for seq, p in _successive(lam, m):
        for i in seq:
            weight[i] += p / m
    assert weight == [Fraction(7, 15), Fraction(8, 45), Fraction(8, 45), Fraction(8, 45)]


@pytest.mark.parametrize("lam,m", LAMBDAS)
def test_successive_sampling_weights_are_unbiased_by_enumeration(lam, m):
    # Exact expectation over every ordered draw: E[a_i] = λ_i, so E[Σ a_i w_i] = Σ λ_i w_i.
    mean = _expected_weights(_successive(lam, m), lam, "lambda-successive")
    np.testing.assert_allclose(mean, [float(x) for x in lam], rtol=0, atol=1e-15)  # float64 sums of ≤ 60 terms
    for seq, _ in _successive(lam, m):
        a = aggregation_weights(seq, set(seq), np.array([float(x) for x in lam]), design="lambda-successive")
        assert min(a.values()) >= 0 and sum(a.values()) == pytest.approx(1.0, abs=1e-15)


def test_successive_sampling_weights_by_hand():
    # λ = (0.7, 0.1, 0.1, 0.1), draws (1, 0): t_1 = w_1, t_2 = 0.1 w_1 + 0.9 w_0 → (0.45, 0.55).
    lam = np.array([0.7, 0.1, 0.1, 0.1])
    a = aggregation_weights([1, 0], {0, 1}, lam, design="lambda-successive")
    assert a == pytest.approx({0: 0.45, 1: 0.55}, abs=1e-15)
    # client 0 failed: client 1 alone carries the update
    assert aggregation_weights([1, 0], {1}, lam, design="lambda-successive") == {1: 1.0}


def test_numpys_draw_order_is_successive_sampling():
    # The ordered estimator needs the order of the draws: numpy's choice(replace=False, p)
    # gives ordered pairs with the successive-sampling probabilities.
    lam, m = LAMBDAS[0]
    probs = dict(_successive(lam, m))
    rng = np.random.default_rng(1)
    lam_f = np.array([float(x) for x in lam])
    counts = dict.fromkeys(probs, 0)
    reps = 20_000
    for _ in range(reps):
        counts[tuple(int(i) for i in sample_by_lambda(rng, lam_f, m, replace=False))] += 1
    keys = sorted(probs)
    _, p = stats.chisquare([counts[k] for k in keys], [float(probs[k]) * reps for k in keys])
    assert p > 1e-3


@pytest.mark.parametrize("lam,m", LAMBDAS)
def test_uniform_sampling_weights_are_unbiased_by_enumeration(lam, m):
    n = len(lam)
    # without replacement: every ordered draw of m distinct clients is equally likely
    perms = list(itertools.permutations(range(n), m))
    mean = _expected_weights(((s, Fraction(1, len(perms))) for s in perms), lam, "uniform")
    np.testing.assert_allclose(mean, [float(x) for x in lam], rtol=0, atol=1e-15)  # float64 sums of ≤ 60 terms
    # with replacement: the N^m ordered draws
    mean = _expected_weights(((s, Fraction(1, n**m)) for s in itertools.product(range(n), repeat=m)), lam, "uniform")
    np.testing.assert_allclose(mean, [float(x) for x in lam], rtol=0, atol=1e-14)  # float64 sums of ≤ 125 terms


@pytest.mark.parametrize("lam,m", LAMBDAS)
def test_lambda_sampling_with_replacement_weights_are_unbiased_by_enumeration(lam, m):
    def draws():
        for seq in itertools.product(range(len(lam)), repeat=m):
            p = Fraction(1)
            for i in seq:
                p *= lam[i]
            yield seq, p

    mean = _expected_weights(draws(), lam, "lambda")
    np.testing.assert_allclose(mean, [float(x) for x in lam], rtol=0, atol=1e-15)  # float64 sums of ≤ 125 terms


def test_aggregation_weights_by_hand():
    lam = np.array([0.5, 0.25, 0.25])
    # client 0 drawn twice, client 2 once, client 1 once but its reply failed
    assert aggregation_weights([0, 2, 0, 1], {0, 2}, lam) == {0: 2 / 3, 2: 1 / 3}
    assert aggregation_weights([0, 2, 0, 1], {0, 2}, lam, design="uniform") == {0: 2 * 0.5 * 3 / 3,
                                                                                2: 0.25 * 3 / 3}
    assert aggregation_weights([0, 1, 2], {0, 1}, lam, design="full") == {0: 0.5 / 0.75, 1: 0.25 / 0.75}
    assert aggregation_weights([0, 1], set(), lam) == {}
    with pytest.raises(ValueError, match="design"):
        aggregation_weights([0], {0}, lam, design="poisson")


def test_combine_models_by_hand():
    base = [np.array([1.0, 2.0], dtype=np.float32)]
    models = {0: [np.array([3.0, 2.0])], 4: [np.array([1.0, 6.0])]}
    out = combine_models(base, models, {0: 0.5, 4: 0.25})
    np.testing.assert_array_equal(out[0], [2.0, 3.0])
    assert out[0].dtype == np.float32
