"""Tests for flowerdro.core.simplex against cvxpy solves, closed forms and hand examples."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import brentq

from flowerdro.core.simplex import (
    floor_simplex,
    project_capped_simplex,
    project_simplex,
    project_simplex_box,
)
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
    status = solve_tightly(prob, (1e-12, 1e-11, 1e-10))
    if status is None:
        pytest.skip(f"no suitable cvxpy solver among {cp.installed_solvers()}")
    assert status == cp.OPTIMAL, f"cvxpy did not reach an optimal solution: {status}"


def cvx_project_box(v: np.ndarray, lower=None, upper=None) -> np.ndarray:
    """argmin ||p - v||^2 s.t. sum p = 1, lower <= p <= upper, solved by cvxpy."""
    n = v.size
    p = cp.Variable(n)
    cons = [cp.sum(p) == 1]
    if lower is not None:
        cons.append(p >= lower)
    if upper is not None:
        up = np.broadcast_to(np.asarray(upper, dtype=float), (n,))
        finite = np.isfinite(up)
        if finite.any():
            cons.append(p[np.nonzero(finite)[0]] <= up[finite])
    _solve(cp.Problem(cp.Minimize(cp.sum_squares(p - v)), cons))
    return np.asarray(p.value)


def _check_against(p: np.ndarray, ref: np.ndarray, v: np.ndarray) -> None:
    """Solution close to the reference, objective at least as good (to OBJ_RTOL)."""
    obj, obj_ref = np.sum((p - v) ** 2), np.sum((ref - v) ** 2)
    assert obj <= obj_ref + OBJ_RTOL * max(1.0, obj_ref)
    assert abs(obj - obj_ref) <= OBJ_RTOL * max(1.0, obj_ref)
    np.testing.assert_allclose(p, ref, atol=SOL_ATOL, rtol=0)


def _random_vector(rng: np.random.Generator, k: int) -> np.ndarray:
    n = int(rng.integers(1, 30))
    scale = [0.1, 1.0, 10.0][k % 3]
    v = rng.normal(size=n) * scale + rng.normal()
    if k % 5 == 0 and n > 2:  # ties
        v[: n // 2] = v[0]
    return v


# ---------------------------------------------------------------------- project_simplex
def test_project_simplex_matches_cvxpy() -> None:
    rng = np.random.default_rng(0)
    for k in range(N_RANDOM):
        v = _random_vector(rng, k)
        p = project_simplex(v)
        assert p.dtype == np.float64 and p.shape == v.shape
        assert p.min() >= 0.0
        assert abs(p.sum() - 1.0) <= CON_ATOL
        _check_against(p, cvx_project_box(v, lower=0.0), v)


def test_project_simplex_kkt_single_threshold() -> None:
    # Closed form: p_i = max(v_i - theta, 0) for one theta; check on the support.
    rng = np.random.default_rng(1)
    for _ in range(N_RANDOM):
        v = rng.normal(size=int(rng.integers(2, 50)))
        p = project_simplex(v)
        theta = v[p > 0] - p[p > 0]
        # θ = v_i − p_i is the same shift up to float64 rounding of values |v| ≲ 4: a few ulps ≪
        # 1e-12
        assert np.ptp(theta) <= 1e-12
        assert np.all(v[p == 0] <= theta[0] + 1e-12)


@pytest.mark.parametrize(
    ("v", "expected"),
    [
        ([0.0, 1.0, 1.5], [0.0, 0.25, 0.75]),  # theta = 0.75 by hand
        ([3.0], [1.0]),  # N = 1
        ([-7.0], [1.0]),
        ([1.0, 1.0, 1.0], [1 / 3, 1 / 3, 1 / 3]),  # ties
        ([2.0, 2.0, 0.0], [0.5, 0.5, 0.0]),  # tie at the top
        ([-5.0, -3.0, -3.5], [0.0, 0.75, 0.25]),  # all negative: theta = -3.75
        ([1e12, 1e12 - 0.5, 0.0], [0.75, 0.25, 0.0]),
        ([1e300, -1e300, 5e299], [1.0, 0.0, 0.0]),
        ([1e300, 1e300], [0.5, 0.5]),
        ([1.7e308, -1.7e308], [1.0, 0.0]),  # v - max(v) overflows
        ([-1e300, -1e300, -1e300], [1 / 3, 1 / 3, 1 / 3]),
    ],
)
def test_project_simplex_hand_examples(v, expected) -> None:
    # short decimals vs float64 arithmetic on values ≤ 1: ≤ a few ulps (1.1e-16)
    np.testing.assert_allclose(project_simplex(v), expected, atol=1e-15)


def test_project_simplex_fixed_point_and_shift_invariance() -> None:
    rng = np.random.default_rng(2)
    for k in range(N_RANDOM):
        n = int(rng.integers(1, 30))
        lam = rng.dirichlet(np.full(n, 0.3 if k % 2 else 2.0))
        # on the simplex already: unchanged up to 1 ulp; +123 adds rounding 123·eps ≈ 3e-14 per
        # entry, so 1e-12
        np.testing.assert_allclose(project_simplex(lam), lam, atol=1e-15)
        v = rng.normal(size=n)
        np.testing.assert_allclose(project_simplex(v + 123.0), project_simplex(v), atol=1e-12)


@pytest.mark.parametrize("bad", [[], [1.0, np.nan], [np.inf, 0.0], [[1.0, 0.0]]])
def test_project_simplex_rejects_bad_input(bad) -> None:
    with pytest.raises(ValueError, match="v must"):
        project_simplex(bad)


# ------------------------------------------------------------------ project_simplex_box
def _random_box(rng: np.random.Generator, n: int, k: int):
    kind = k % 4
    if kind == 0:  # scalar bounds
        lower = float(rng.uniform(0, 1 / n))
        upper = float(rng.uniform(1 / n, 1.0))
    elif kind == 1:  # arrays in [0, 1]
        lower = rng.uniform(0, 1 / n, size=n) * rng.uniform(0, 1)
        upper = np.maximum(lower, rng.uniform(0, 3 / n, size=n))
        upper[0] = max(upper[0], 1.0 - (upper.sum() - upper[0]))  # ensure sum(upper) >= 1
    elif kind == 2:  # negative lower bounds allowed
        lower = rng.uniform(-1, 1 / n, size=n)
        upper = lower + rng.uniform(0, 2, size=n)
        upper[0] = max(upper[0], 1.0 - (upper.sum() - upper[0]))
    else:  # infinite upper bounds
        lower = rng.uniform(0, 1 / n, size=n)
        upper = np.where(rng.uniform(size=n) < 0.5, np.inf, lower + rng.uniform(0, 1, size=n))
        upper[0] = np.inf
    return lower, upper


def test_project_simplex_box_matches_cvxpy() -> None:
    rng = np.random.default_rng(3)
    for k in range(N_RANDOM):
        n = int(rng.integers(1, 30))
        v = rng.normal(size=n) * 2.0
        lower, upper = _random_box(rng, n, k)
        p = project_simplex_box(v, lower, upper)
        lo = np.broadcast_to(lower, (n,))
        hi = np.broadcast_to(upper, (n,))
        assert abs(p.sum() - 1.0) <= CON_ATOL
        assert np.all(p >= lo - CON_ATOL) and np.all(p <= hi + CON_ATOL)
        _check_against(p, cvx_project_box(v, lower=lo, upper=hi), v)


def test_project_simplex_box_defaults_equal_simplex() -> None:
    rng = np.random.default_rng(4)
    for _ in range(N_RANDOM):
        v = rng.normal(size=int(rng.integers(1, 40))) * 3
        # two exact algorithms in float64 on |v| ≲ 10, n ≤ 40: sorting/threshold rounding ≈ n·10·eps
        # ≈ 1e-13
        np.testing.assert_allclose(project_simplex_box(v), project_simplex(v), atol=1e-13)


def test_project_simplex_box_hand_examples() -> None:
    # v = (1, 0, 0), box [0, 0.5]: first entry capped, rest share 0.5 equally.
    np.testing.assert_allclose(project_simplex_box([1.0, 0.0, 0.0], 0.0, 0.5), [0.5, 0.25, 0.25])
    # sum(lower) = 1: the set is the single point lower.
    np.testing.assert_allclose(
        project_simplex_box([5.0, -2.0, 1.0], [0.2, 0.3, 0.5], 1.0), [0.2, 0.3, 0.5]
    )
    # sum(upper) = 1: the set is the single point upper.
    np.testing.assert_allclose(
        project_simplex_box([5.0, -2.0, 1.0], 0.0, [0.2, 0.3, 0.5]), [0.2, 0.3, 0.5]
    )


def test_project_simplex_box_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="sum\\(lower\\) must be <= 1"):
        project_simplex_box([0.0, 0.0], 0.6, 1.0)
    with pytest.raises(ValueError, match="sum\\(upper\\) must be >= 1"):
        project_simplex_box([0.0, 0.0], 0.0, 0.4)
    with pytest.raises(ValueError, match="lower must be <= upper"):
        project_simplex_box([0.0, 0.0], [0.5, 0.5], [0.4, 1.0])
    with pytest.raises(ValueError, match="lower must be a scalar"):
        project_simplex_box([0.0, 0.0], [0.0, 0.0, 0.0], 1.0)
    with pytest.raises(ValueError, match="upper must not contain NaN"):
        project_simplex_box([0.0, 0.0], 0.0, np.nan)
    with pytest.raises(ValueError, match="lower must be finite"):
        project_simplex_box([0.0, 0.0], -np.inf, 1.0)
    with pytest.raises(ValueError, match="v must be finite"):
        project_simplex_box([0.0, np.nan], 0.0, 1.0)


# -------------------------------------------------------------- project_capped_simplex
def test_project_capped_simplex_matches_cvxpy() -> None:
    rng = np.random.default_rng(5)
    for k in range(N_RANDOM):
        n = int(rng.integers(2, 30))
        v = rng.normal(size=n) * [0.1, 1.0, 10.0][k % 3]
        alpha = float(rng.uniform(0.05, 1.0))
        cap = 1.0 / (alpha * n)
        p = project_capped_simplex(v, cap)
        assert abs(p.sum() - 1.0) <= CON_ATOL
        assert p.min() >= 0.0 and p.max() <= cap + CON_ATOL
        _check_against(p, cvx_project_box(v, lower=0.0, upper=min(cap, 1.0)), v)


def test_project_capped_simplex_special_caps() -> None:
    rng = np.random.default_rng(6)
    for _ in range(N_RANDOM):
        n = int(rng.integers(1, 30))
        v = rng.normal(size=n) * 5
        # cap = 1/N (alpha = 1): the set is {uniform}.
        np.testing.assert_allclose(project_capped_simplex(v, 1.0 / n), np.full(n, 1.0 / n))
        np.testing.assert_allclose(project_capped_simplex(v, 1.0 / (1.0 * n)), 1.0 / n)
        # cap >= 1: the cap is inactive.
        np.testing.assert_allclose(project_capped_simplex(v, 1.0), project_simplex(v))
        np.testing.assert_allclose(project_capped_simplex(v, np.inf), project_simplex(v))


@pytest.mark.parametrize(
    ("v", "cap", "expected"),
    [
        ([3.0, 0.0, 0.0, 0.0], 0.5, [0.5, 1 / 6, 1 / 6, 1 / 6]),
        ([1e12, 0.0, 0.0, 0.0], 0.3, [0.3, 7 / 30, 7 / 30, 7 / 30]),
        ([0.0, 0.0, 0.0, -1e20], 0.3, [0.3, 0.3, 0.3, 0.1]),  # cap forces mass far down
        ([1e300, -1e300, 3e299, 0.0], 0.3, [0.3, 0.1, 0.3, 0.3]),
        ([1.7e308, -1.7e308, -1.6e308], 0.4, [0.4, 0.2, 0.4]),  # range overflows float64
        ([-1e300, -1e300, -1e300], 0.5, [1 / 3, 1 / 3, 1 / 3]),
        ([0.3, 0.3, 0.3, 0.1], 0.3, [0.3, 0.3, 0.3, 0.1]),  # already feasible: fixed point
    ],
)
def test_project_capped_simplex_hand_examples(v, cap, expected) -> None:
    np.testing.assert_allclose(project_capped_simplex(v, cap), expected, atol=1e-12)


def test_project_capped_simplex_rejects_bad_cap() -> None:
    with pytest.raises(ValueError, match="cap must satisfy cap\\*N >= 1"):
        project_capped_simplex([0.0, 1.0, 2.0], 0.3)
    with pytest.raises(ValueError, match="cap must be > 0"):
        project_capped_simplex([0.0, 1.0], 0.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        project_capped_simplex([0.0, 1.0], -1.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        project_capped_simplex([0.0, 1.0], np.nan)
    with pytest.raises(ValueError, match="cap must be a real number"):
        project_capped_simplex([0.0, 1.0], "big")
    with pytest.raises(ValueError, match="v must be non-empty"):
        project_capped_simplex([], 1.0)


# ------------------------------------------------------------------------ floor_simplex
def _floor_by_root_find(lam: np.ndarray, floor: float) -> np.ndarray:
    """Independent solve of sum_i max(floor, c lam_i) = 1 for c by brentq."""
    lam = lam / lam.sum()
    c = brentq(lambda c: np.maximum(floor, c * lam).sum() - 1.0, 0.0, 1.0, xtol=1e-16)
    return np.maximum(floor, c * lam)


def _floor_by_iteration(lam: np.ndarray, floor: float, iters: int = 20_000) -> np.ndarray:
    """The naive 'raise to the floor, renormalise' map, iterated to its fixed point."""
    p = lam / lam.sum()
    for _ in range(iters):
        q = np.maximum(p, floor)
        q /= q.sum()
        # stop once nothing moves at float64 resolution of entries ≲ 0.1 (ulp ≈ 1.4e-17)
        if np.max(np.abs(q - p)) < 1e-17:
            break
        p = q
    return q


def test_floor_simplex_matches_independent_solutions() -> None:
    rng = np.random.default_rng(7)
    for k in range(N_RANDOM):
        n = int(rng.integers(1, 30))
        lam = rng.dirichlet(np.full(n, [0.1, 0.5, 2.0][k % 3]))
        if k % 4 == 0 and n > 1:
            lam[rng.integers(n)] = 0.0
            lam /= lam.sum()
        floor = float(rng.uniform(0.0, 1.0 / n))
        p = floor_simplex(lam, floor)
        # Guarantees: on the simplex and every entry >= floor.
        assert abs(p.sum() - 1.0) <= 1e-12
        assert np.all(p >= floor)
        # Entries above the floor keep their ratios from lam.
        above = p > floor * (1 + 1e-9)
        if above.sum() > 1:
            ratio = p[above] / lam[above]
            assert np.ptp(ratio) <= 1e-9 * ratio.max()
        # brentq to xtol 1e-16 gives the exact scaling to float64 accuracy (1e-12 leaves margin);
        # the
        # fixed-point iteration converges linearly and stops at its iteration cap, hence 1e-10
        np.testing.assert_allclose(p, _floor_by_root_find(lam, floor), atol=1e-12)
        np.testing.assert_allclose(p, _floor_by_iteration(lam, floor), atol=1e-10)


def test_floor_simplex_hand_examples() -> None:
    # Single naive pass would give (0.97, .2, .2, .2)/1.57, putting 0.127 < 0.2.
    naive = np.maximum([0.97, 0.01, 0.01, 0.01], 0.2)
    naive /= naive.sum()
    assert naive.min() < 0.2
    np.testing.assert_allclose(floor_simplex([0.97, 0.01, 0.01, 0.01], 0.2), [0.4, 0.2, 0.2, 0.2])
    # c = 0.8 / 0.9 keeps 0.9 -> 0.8 and pushes 0.1 -> 0.0889 < 0.1 onto the floor.
    np.testing.assert_allclose(floor_simplex([0.9, 0.1, 0.0], 0.1), [0.8, 0.1, 0.1])
    # Two entries scaled: c = (1 - 0.1) / 0.9 = 1, nothing else changes.
    np.testing.assert_allclose(floor_simplex([0.6, 0.3, 0.1], 0.1), [0.6, 0.3, 0.1])
    np.testing.assert_allclose(floor_simplex([1.0], 0.5), [1.0])


def test_floor_simplex_limits() -> None:
    rng = np.random.default_rng(8)
    for _ in range(N_RANDOM):
        n = int(rng.integers(1, 20))
        lam = rng.dirichlet(np.ones(n))
        # floor 0: unchanged up to 1 ulp of values ≤ 1; floor 1/n: uniform up to a few ulps, inside
        # default rtol 1e-7
        np.testing.assert_allclose(floor_simplex(lam, 0.0), lam, atol=1e-15)
        np.testing.assert_allclose(floor_simplex(lam, 1.0 / n), np.full(n, 1.0 / n))
        # Unnormalised input gives the same answer.
        np.testing.assert_allclose(floor_simplex(3.0 * lam, 0.5 / n), floor_simplex(lam, 0.5 / n))


def test_floor_simplex_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="floor must satisfy floor\\*N <= 1"):
        floor_simplex([0.5, 0.5], 0.6)
    with pytest.raises(ValueError, match="floor must be in \\[0, 1/N\\]"):
        floor_simplex([0.5, 0.5], -0.1)
    with pytest.raises(ValueError, match="floor must be in \\[0, 1/N\\]"):
        floor_simplex([0.5, 0.5], np.nan)
    with pytest.raises(ValueError, match="lam must be non-negative"):
        floor_simplex([1.5, -0.5], 0.1)
    with pytest.raises(ValueError, match="lam must have a positive sum"):
        floor_simplex([0.0, 0.0], 0.1)
    with pytest.raises(ValueError, match="lam must be finite"):
        floor_simplex([np.inf, 0.0], 0.1)
