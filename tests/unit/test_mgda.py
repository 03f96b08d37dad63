"""Tests of flowerdro.core.mgda (FedMGDA+ server maths).

The QP answers are checked against independent solves: cvxpy (OSQP with solution
polishing, which returns active-set-exact solutions, or CLARABEL as a fallback) and a
Frank-Wolfe duality certificate computed with scipy's HiGHS LP solver,
f(λ) − f* ≤ ∇f(λ)ᵀλ − min_{y∈P} ∇f(λ)ᵀy.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy.optimize import linprog

from flowerdro.core.mgda import fedmgda_lr, min_norm_weights, project_box_simplex

#: the reference solves these tests compare against (cvxpy is a dev extra)
cp = pytest.importorskip("cvxpy", reason="cvxpy (the dev extra) gives the reference solves")

# The solver's accuracy contract: f(λ) − f* ≤ ABS·max(1, max G_ii) + REL·f. Clarabel stops at
# a relative gap of 1e-12 on G / max G_ii, and the exact face solve that follows leaves only
# the rounding of an m × m least-squares solve (≈ 1e-16·cond); the contract leaves four
# orders of magnitude for ill-conditioned faces.
REL = 1e-7
ABS = 1e-8


# --------------------------------------------------------------------------- helpers
def _bounds(m: int, eps: float | None, center: np.ndarray | None):
    c = np.full(m, 1.0 / m) if center is None else np.asarray(center, dtype=float)
    if eps is None:
        return c, np.zeros(m), np.ones(m)
    return c, np.maximum(0.0, c - eps), np.minimum(1.0, c + eps)


def _cvxpy_reference(G: np.ndarray, eps: float | None, center: np.ndarray | None):
    """(λ, exact) from cvxpy; exact=True when OSQP's polished solution was accepted."""
    m = G.shape[0]
    c, lo, hi = _bounds(m, eps, center)
    lam = cp.Variable(m)
    cons = [cp.sum(lam) == 1, lam >= lo, lam <= hi]
    prob = cp.Problem(cp.Minimize(cp.quad_form(lam, cp.psd_wrap(G))), cons)
    # reference solves pushed near float64 limits, orders of magnitude tighter than the contract
    # REL/ABS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prob.solve(solver="OSQP", eps_abs=1e-12, eps_rel=1e-12, polish=True, max_iter=200_000)
    if prob.status == cp.OPTIMAL and prob.solver_stats.extra_stats is not None:
        polished = getattr(prob.solver_stats.extra_stats.info, "status_polish", 0) == 1
        if polished:
            return np.asarray(lam.value), True
    # fallback: Clarabel at gaps of 1e-10, still two orders tighter than REL/ABS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prob.solve(solver="CLARABEL", tol_gap_abs=1e-10, tol_gap_rel=1e-10, tol_feas=1e-10)
    return np.asarray(lam.value), False


def _fw_gap(G: np.ndarray, lam: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """Frank-Wolfe gap ∇f(λ)ᵀ(λ − y*), an upper bound on f(λ) − f*, via HiGHS."""
    grad = 2.0 * G @ lam
    res = linprog(
        grad,
        A_eq=np.ones((1, lam.size)),
        b_eq=[1.0],
        bounds=list(zip(lo, hi, strict=True)),
        method="highs",
    )
    assert res.status == 0
    return float(grad @ lam - res.fun)


def _check_solution(G, eps, center):
    m = G.shape[0]
    lam = min_norm_weights(G, eps=eps, center=center)
    _, lo, hi = _bounds(m, eps, center)
    # constraints
    assert lam.shape == (m,)
    assert abs(lam.sum() - 1.0) <= 1e-12
    assert np.all(lam >= lo - 1e-12)
    assert np.all(lam <= hi + 1e-12)
    # objective against cvxpy
    scale = max(1.0, float(np.max(np.diag(G))))
    f = float(lam @ G @ lam)
    ref, exact = _cvxpy_reference(G, eps, center)
    f_ref = float(ref @ G @ ref)
    tol = REL * abs(f_ref) + ABS * scale
    assert f <= f_ref + tol, (f, f_ref)  # never worse than cvxpy
    if exact:
        assert f >= f_ref - tol, (f, f_ref)  # and the same optimum as the polished solve
    # duality certificate, independent of both solvers
    assert _fw_gap(G, lam, lo, hi) <= REL * abs(f) + ABS * scale
    # determinism
    assert np.array_equal(lam, min_norm_weights(G, eps=eps, center=center))
    return lam


def _unit_rows(V: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(V, axis=1, keepdims=True)
    return V / np.where(n > 0, n, 1.0)


def _make_gram(kind: str, m: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "random_psd":
        V = _unit_rows(rng.standard_normal((m, 2 * m)))
    elif kind == "rank1":
        V = rng.standard_normal((m, 1))
    elif kind == "rank2":
        V = rng.standard_normal((m, 2))
    elif kind == "duplicated":
        base = _unit_rows(rng.standard_normal((m // 2, 3)))
        V = np.concatenate([base, base, base[:1]])[:m]
    elif kind == "zero":
        return np.zeros((m, m))
    elif kind == "opposite":
        base = _unit_rows(rng.standard_normal((m // 2, m)))
        V = np.concatenate([base, -base, base[:1]])[:m]
    elif kind == "ill_conditioned":
        V = _unit_rows(rng.standard_normal((m, m))) * np.logspace(0, -7, m)[:, None]
    elif kind == "adversarial":
        # zero rows, nearly parallel rows, a dominant row and an m > d block
        V = rng.standard_normal((m, 3))
        V[1] = 0.0
        V[2] = V[3] * (1 + 1e-9)
        V[4] = 1e3 * V[5]
        V = V / np.max(np.linalg.norm(V, axis=1))
    else:  # pragma: no cover
        raise AssertionError(kind)
    return V @ V.T


KINDS = [
    "random_psd",
    "rank1",
    "rank2",
    "duplicated",
    "zero",
    "opposite",
    "ill_conditioned",
    "adversarial",
]
EPSS = [None, 0.0, 0.01, 0.5, 1.0]


# --------------------------------------------------------------------------- QP vs cvxpy
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("eps", EPSS)
@pytest.mark.parametrize("centered", [False, True])
def test_min_norm_weights_matches_cvxpy(kind, eps, centered):
    # Prepare
    rng = np.random.default_rng([KINDS.index(kind), EPSS.index(eps), int(centered)])
    m = 12
    G = _make_gram(kind, m, rng)
    center = rng.dirichlet(np.full(m, 2.0)) if centered else None
    # Execute / Assert
    _check_solution(G, eps, center)


@pytest.mark.parametrize("seed", range(6))
def test_min_norm_weights_random_sizes(seed):
    rng = np.random.default_rng(100 + seed)
    m = int(rng.integers(2, 60))
    d = int(rng.choice([1, 2, m // 3 + 1, 2 * m]))
    V = rng.standard_normal((m, d)) * rng.uniform(0.5, 2.0)
    G = V @ V.T
    eps = [None, 0.003, 0.05, 0.2, 0.7, 1.0][seed]
    center = rng.dirichlet(np.full(m, 0.5)) if seed % 2 else None
    _check_solution(G, eps, center)


def test_min_norm_weights_m100_against_cvxpy():
    rng = np.random.default_rng(11)
    V = _unit_rows(rng.standard_normal((100, 40)))  # m > d: rank 40
    G = V @ V.T
    for eps in (None, 0.005, 0.05):
        _check_solution(G, eps, None)


@pytest.mark.parametrize("seed", range(3))
def test_rank_deficient_tight_box(seed):
    # m = 100 unit updates of rank m/10 with the box ε = 0.5/m around the uniform weights
    # (and a tighter and a looser box)
    rng = np.random.default_rng(200 + seed)
    V = _unit_rows(rng.standard_normal((100, 10)))
    G = V @ V.T
    for eps in (0.005, 0.002, 0.02):
        lam = _check_solution(G, eps, None)
        assert np.max(np.abs(lam - 0.01)) <= eps + 1e-15


@pytest.mark.parametrize("eps", [None, 0.008, 0.05])
@pytest.mark.parametrize("centered", [False, True])
def test_duplicated_rows_with_box(eps, centered):
    # every update sent twice (bit-identical rows of G), plus a few near-duplicates
    rng = np.random.default_rng([7, int(centered)])
    base = _unit_rows(rng.standard_normal((30, 45)))
    V = np.concatenate([base, base])
    V[-3:] += 1e-9 * rng.standard_normal((3, 45))
    G = V @ V.T
    center = rng.dirichlet(np.full(60, 3.0)) if centered else None
    _check_solution(G, eps, center)


@pytest.mark.parametrize("eps", [None, 1.0, 0.5, 0.02])
def test_origin_in_hull_gives_zero(eps):
    # 40 unit vectors in R^3, every direction with its opposite: the origin is in the hull
    # (the uniform weights cancel in pairs, and they lie in every box), so the minimum is 0
    # whatever ε, with many minimisers (G has rank 3)
    rng = np.random.default_rng(3)
    half = _unit_rows(rng.standard_normal((20, 3)))
    V = np.concatenate([half, -half])
    G = V @ V.T
    lam = _check_solution(G, eps, None)
    # exact face solve: f = ‖λᵀV‖² is rounding-level (≈ eps·m·max G_ii ≈ 1e-14), so ‖λᵀV‖ ≤ √1e-14 =
    # 1e-7
    assert float(lam @ G @ lam) <= 1e-14
    assert np.max(np.abs(lam @ V)) <= 1e-7


def _random_instance(seed: int):
    """A random (G, ε, centre) from a mix of full-rank, duplicated, low-rank, opposite and
    zero, ill-conditioned, near-duplicate and integer-grid (exact ties) update sets."""
    rng = np.random.default_rng(seed)
    m = int(rng.choice([2, 3, 5, 8, 12, 20, 40, 60]))
    kind = int(rng.integers(0, 7))
    if kind == 0:
        V = rng.standard_normal((m, int(rng.integers(1, 2 * m + 1))))
    elif kind == 1:
        base = rng.standard_normal((max(1, m // 2), int(rng.integers(1, m + 2))))
        V = base[rng.integers(0, base.shape[0], m)]
    elif kind == 2:
        V = rng.standard_normal((m, max(1, m // 10)))
    elif kind == 3:
        base = rng.standard_normal((max(1, m // 2), int(rng.integers(1, m + 2))))
        V = np.concatenate([base, -base, np.zeros((m, base.shape[1]))])[:m]
    elif kind == 4:
        V = rng.standard_normal((m, m)) * np.logspace(0, -rng.uniform(2, 8), m)[:, None]
    elif kind == 5:
        base = rng.standard_normal((max(1, m // 3), 5))
        V = base[rng.integers(0, base.shape[0], m)] + 1e-9 * rng.standard_normal((m, 5))
    else:
        V = rng.integers(-2, 3, size=(m, int(rng.integers(1, 4)))).astype(float)
    if rng.random() < 0.7:
        V = _unit_rows(V)
    eps = [None, 1e-4, 0.5 / m, 0.01, 0.05, 0.2, 1.0][int(rng.integers(0, 7))]
    center = rng.dirichlet(np.full(m, rng.choice([0.3, 1.0, 5.0]))) if rng.random() < 0.4 else None
    return V @ V.T, eps, center


def test_random_instances_certified_by_frank_wolfe_gap():
    # many random instances, each certified independently of any QP solver: feasibility,
    # the Frank-Wolfe duality gap (an LP over the box-simplex, HiGHS) and determinism
    for seed in range(60):
        G, eps, center = _random_instance(1000 + seed)
        m = G.shape[0]
        _, lo, hi = _bounds(m, eps, center)
        lam = min_norm_weights(G, eps, center)
        # float64 sum of m entries: within m·eps of 1
        assert abs(lam.sum() - 1.0) <= 1e-12, seed
        assert np.all(lam >= lo - 1e-12) and np.all(lam <= hi + 1e-12), seed
        scale = max(1.0, float(np.max(np.diag(G))))
        f = float(lam @ G @ lam)
        assert _fw_gap(G, lam, lo, hi) <= REL * abs(f) + ABS * scale, seed
        assert np.array_equal(lam, min_norm_weights(G, eps, center)), seed


def test_opposite_gradients_reach_zero():
    g = np.array([[1.0, 2.0, -0.5]])
    V = np.concatenate([g, -g, 2 * g])
    lam = min_norm_weights(V @ V.T)
    # origin in the hull of a rank-one G of O(1) entries: f and λᵀV are 0 up to float64 rounding
    # (≈1e-16)
    assert abs(lam @ (V @ V.T) @ lam) <= 1e-12
    assert np.allclose(lam @ V, 0.0, atol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_two_vector_closed_form(seed):
    # λ₁ = clip((g₂·g₂ − g₁·g₂)/‖g₁ − g₂‖², 0, 1), λ₂ = 1 − λ₁
    rng = np.random.default_rng(seed)
    g1, g2 = rng.standard_normal((2, 4))
    if seed == 3:
        g2 = 3.0 * g1  # clipped: all weight on the shorter vector
    G = np.array([[g1 @ g1, g1 @ g2], [g1 @ g2, g2 @ g2]])
    lam1 = float(np.clip((g2 @ g2 - g1 @ g2) / ((g1 - g2) @ (g1 - g2)), 0.0, 1.0))
    lam = min_norm_weights(G)
    np.testing.assert_allclose(lam, [lam1, 1.0 - lam1], rtol=0, atol=1e-13)


def test_two_vector_closed_form_with_box():
    # with eps the 1-D answer is the clip of the closed form to [0.5 − ε, 0.5 + ε]
    g1, g2 = np.array([1.0, 0.0]), np.array([0.0, 3.0])
    G = np.array([[g1 @ g1, g1 @ g2], [g1 @ g2, g2 @ g2]])
    lam1 = (g2 @ g2 - g1 @ g2) / ((g1 - g2) @ (g1 - g2))  # 0.9
    for eps in (0.1, 0.3, 0.45):
        lam = min_norm_weights(G, eps=eps)
        assert lam[0] == pytest.approx(min(lam1, 0.5 + eps), abs=1e-14)


def test_eps_zero_returns_center_and_zero_gram_is_feasible():
    rng = np.random.default_rng(0)
    c = rng.dirichlet(np.ones(5))
    G = _make_gram("random_psd", 5, rng)
    np.testing.assert_array_equal(min_norm_weights(G, eps=0.0, center=c), c / c.sum())
    lam = min_norm_weights(np.zeros((5, 5)), eps=0.2, center=c)
    # float64 sum of 5 entries: within 5·eps of 1
    assert abs(lam.sum() - 1) <= 1e-12 and np.all(lam >= 0)


def test_uniform_box_is_fedavg_like_when_tight():
    # eps tiny: λ stays within eps of 1/m and still minimises the objective
    rng = np.random.default_rng(3)
    G = _make_gram("rank2", 30, rng)
    lam = _check_solution(G, 1e-4, None)
    assert np.max(np.abs(lam - 1 / 30)) <= 1e-4 + 1e-15


def test_single_client():
    np.testing.assert_array_equal(min_norm_weights(np.array([[2.0]])), [1.0])


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"gram": np.ones((2, 3))}, "gram"),
        ({"gram": np.array([[1.0, 0.5], [0.0, 1.0]])}, "gram"),
        ({"gram": np.array([[1.0, np.nan], [np.nan, 1.0]])}, "gram"),
        ({"gram": np.array([[-1.0, 0.0], [0.0, 1.0]])}, "gram"),
        ({"gram": np.eye(2), "eps": 1.5}, "eps"),
        ({"gram": np.eye(2), "eps": -0.1}, "eps"),
        ({"gram": np.eye(2), "eps": float("nan")}, "eps"),
        ({"gram": np.eye(2), "center": [0.5, 0.6]}, "center"),
        ({"gram": np.eye(2), "center": [1.2, -0.2]}, "center"),
        ({"gram": np.eye(2), "center": [1.0]}, "center"),
    ],
)
def test_min_norm_weights_errors_name_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        min_norm_weights(**kwargs)


def test_fedmgda_lr():
    beta = 0.1 ** (100 / 1000)
    assert fedmgda_lr(0, 1000, 0.1) == 1.0
    assert fedmgda_lr(99, 1000, 0.1) == 1.0
    # β^(t/T) by float64 power here and in the code: a few ulps; default approx (rel 1e-6) is ample
    assert fedmgda_lr(100, 1000, 0.1, base_lr=2.0) == pytest.approx(2.0 * beta)
    assert fedmgda_lr(1000, 1000, 0.1) == pytest.approx(0.1)
    assert fedmgda_lr(550, 1000, 1.0) == 1.0
    for kwargs, name in [
        ({"round": -1, "num_rounds": 10, "decay": 0.5}, "round"),
        ({"round": 1, "num_rounds": 0, "decay": 0.5}, "num_rounds"),
        ({"round": 1, "num_rounds": 10, "decay": 0.0}, "decay"),
        ({"round": 1, "num_rounds": 10, "decay": 1.5}, "decay"),
        ({"round": 1, "num_rounds": 10, "decay": 0.5, "base_lr": 0.0}, "base_lr"),
    ]:
        with pytest.raises(ValueError, match=rf"^{name}:"):
            fedmgda_lr(**kwargs)


def test_nearly_symmetric_gram_is_symmetrised_and_left_untouched():
    rng = np.random.default_rng(1)
    V = _unit_rows(rng.standard_normal((6, 4)))
    G = V @ V.T
    Gs = G.copy()
    Gs[0, 1] += 1e-12  # inside the 1e-8 relative tolerance
    lam = _check_solution(G, None, None)
    near = min_norm_weights(Gs)  # G has rank 4 < m = 6: λ* need not be unique, f* is
    assert near @ G @ near == pytest.approx(lam @ G @ lam, rel=REL, abs=ABS)
    assert np.array_equal(G, V @ V.T)  # the caller's matrix is left untouched


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gram_is_rejected(bad):
    G = np.eye(3)
    G[1, 2] = G[2, 1] = bad
    with pytest.raises(ValueError, match="gram: all entries must be finite"):
        min_norm_weights(G)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("eps", [None, 0.0, 1e-12, 0.3, 1.0])
def test_tiny_problems(m, eps):
    rng = np.random.default_rng([m, 0 if eps is None else int(eps * 1e3) + 1])
    V = rng.standard_normal((m, 3))
    G = V @ V.T
    center = rng.dirichlet(np.ones(m))
    for c in (None, center):
        lam = _check_solution(G, eps, c)
        if m == 1:
            assert lam.tolist() == [1.0]


@pytest.mark.parametrize("eps", [0.0, 1e-12, 1.0])
def test_box_at_its_limits(eps):
    # ε = 0 returns the centre, ε = 1e-12 pins every weight to within 1e-12 of it, ε = 1
    # is the unboxed problem
    rng = np.random.default_rng(5)
    V = _unit_rows(rng.standard_normal((30, 4)))
    G = V @ V.T
    center = rng.dirichlet(np.full(30, 2.0))
    lam = _check_solution(G, eps, center)
    assert np.max(np.abs(lam - center)) <= eps + 1e-15
    if eps == 1.0:
        free = min_norm_weights(G)
        assert lam @ G @ lam == pytest.approx(free @ G @ free, rel=REL, abs=ABS)


@pytest.mark.parametrize("seed", range(4))
def test_near_ties(seed):
    # every update equal to one direction up to 1e-7 (all gradients nearly tied), and an
    # integer grid of updates (exact ties between many coordinates)
    rng = np.random.default_rng(seed)
    V = np.ones((25, 4)) + 1e-7 * rng.standard_normal((25, 4))
    for eps in (None, 0.01, 0.5 / 25):
        _check_solution(V @ V.T, eps, None)
    W = rng.integers(-2, 3, size=(25, 2)).astype(float)
    for eps in (None, 0.01, 0.5 / 25):
        _check_solution(W @ W.T, eps, rng.dirichlet(np.ones(25)))


def _low_rank_gram(seed: int, m: int, r: int) -> np.ndarray:
    V = _unit_rows(np.random.default_rng(seed).standard_normal((m, r)))
    return V @ V.T


@pytest.mark.parametrize("m, r", [(100, 10), (60, 5), (40, 2), (100, 30), (200, 20), (30, 29)])
@pytest.mark.parametrize("eps_m", [None, 0.5, 2.0, 10.0])  # ε = eps_m / m
def test_low_rank_gram_with_boxes(m, r, eps_m):
    # m unit updates of rank r (the origin is in or near the hull), from no box down to the
    # tight box ε = 0.5/m around the uniform weights
    eps = None if eps_m is None else eps_m / m
    _check_solution(_low_rank_gram(m + r, m, r), eps, None)


@pytest.mark.parametrize("eps", [None, 0.0, 1e-12, 0.02, 1.0])
@pytest.mark.parametrize("centered", [False, True])
def test_low_rank_with_ties_and_box_limits(eps, centered):
    # rank-2 integer updates (many exactly tied gradients and duplicated rows) at m = 30,
    # and the box at its limits; checked against cvxpy and the Frank-Wolfe certificate
    rng = np.random.default_rng([9, int(centered)])
    W = rng.integers(-2, 3, size=(30, 2)).astype(float)
    center = rng.dirichlet(np.ones(30)) if centered else None
    _check_solution(W @ W.T, eps, center)
    _check_solution(_low_rank_gram(5, 30, 3), eps, center)


def test_tight_box_with_opposite_and_duplicated_updates():
    # m = 72 unit updates of rank 33, a quarter of them exactly opposite to another quarter,
    # ε = 5/m around a random centre with zeros: the origin is in the hull (optimal value 0)
    rng = np.random.default_rng(91101)
    m = int(rng.integers(20, 201))
    r = int(rng.integers(1, max(2, m // 2)))
    V = _unit_rows(rng.standard_normal((m, r)))
    if rng.random() < 0.2:
        V[m // 2 :] = V[: m - m // 2]
    if rng.random() < 0.1:
        V[: m // 4] = -V[m // 4 : 2 * (m // 4)]
    eps = float(rng.choice([0.2, 0.5, 1.0, 2.0, 5.0, 20.0])) / m
    center = None
    if rng.random() < 0.4:
        center = rng.dirichlet(np.full(m, rng.choice([0.3, 1.0, 5.0])))
        if rng.random() < 0.3:
            center[rng.integers(0, m, max(1, m // 4))] = 0.0
            center /= center.sum()
    G = V @ V.T
    # 5/72 by one float64 division: ≤ 1 ulp; default approx is ample
    assert G.shape == (72, 72) and eps == pytest.approx(5.0 / 72)
    lam = _check_solution(G, eps, center)
    assert lam @ G @ lam <= ABS


@pytest.mark.parametrize("seed", range(20))
def test_projection_onto_box_simplex_against_cvxpy(seed):
    # the Euclidean projection onto {Σx = 1, lo ≤ x ≤ hi}, against cvxpy's; its bounds hold
    # exactly and Σx = 1 to m ulps
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 40))
    c = rng.dirichlet(np.ones(m))
    eps = float(rng.choice([1e-3, 0.05, 0.3, 1.0]))
    lo, hi = np.maximum(0.0, c - eps), np.minimum(1.0, c + eps)
    y = c + rng.standard_normal(m) * float(rng.choice([1e-9, 0.1, 3.0]))
    x = project_box_simplex(y, lo, hi)
    assert np.all(x >= lo) and np.all(x <= hi) and abs(x.sum() - 1.0) <= m * 2.3e-16
    z = cp.Variable(m)
    cp.Problem(cp.Minimize(cp.sum_squares(z - y)), [cp.sum(z) == 1, z >= lo, z <= hi]).solve(
        solver="CLARABEL", tol_gap_abs=1e-12, tol_gap_rel=1e-12, tol_feas=1e-12)
    # the projection is unique; Clarabel's answer is accurate to about √1e-12 = 1e-6·‖y‖ scale
    np.testing.assert_allclose(x, z.value, atol=1e-6 * max(1.0, float(np.abs(y).max())))
