"""Exact Euclidean projections onto the probability simplex and its subsets.

These are the feasible sets of the mixing weights λ in distributionally robust
federated learning:

* the probability simplex ``Δ = {p ∈ R^N : p ≥ 0, Σ_i p_i = 1}`` (AFL, DRFA, SCAFF-PD);
* the capped simplex ``{p ∈ Δ : p_i ≤ 1/(αN)}`` (CVaR at level α);
* the simplex intersected with a box ``{p : Σ_i p_i = 1, l ≤ p ≤ u}``.

All projections are exact (up to floating-point rounding), run in O(N log N) and work
in float64. References: J. Duchi, S. Shalev-Shwartz, Y. Singer, T. Chandra, "Efficient
projections onto the l1-ball for learning in high dimensions", ICML 2008; M. Held,
P. Wolfe, H. Crowder, "Validation of subgradient optimization", Math. Prog. 1974.

This module is framework-free (numpy only) and never imports flwr.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "admit_partitions",
    "floor_simplex",
    "lambda_entropy",
    "project_capped_simplex",
    "project_simplex",
    "project_simplex_box",
]

# Relative slack allowed when checking that a set is non-empty (Σl ≤ 1 ≤ Σu, cap·N ≥ 1),
# so that e.g. cap = 1/(αN) with α = 1, whose product with N rounds to 1 - 1e-16,
# is accepted.
_FEAS_RTOL = 1e-12


def _as_vector(x: ArrayLike, name: str) -> np.ndarray:
    """Return ``x`` as a finite, non-empty, one-dimensional float64 array.

    Raises
    ------
    ValueError
        If ``x`` is not one-dimensional, is empty, or holds NaN or ±Inf; the message
        names the parameter ``name``.
    """
    arr = np.array(x, dtype=np.float64, copy=True)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a one-dimensional array, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must be non-empty (length N >= 1), got length 0")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite (no NaN or Inf), got {arr!r}")
    return arr


# ------------------------------------------------------------ argument checks of core/
# Tolerance for "λ is a point of the simplex" on inputs (λ comes from earlier rounds
# and from floating-point projections, so exact equality is not expected).
_SIMPLEX_ATOL = 1e-6


def _simplex_point(x: ArrayLike, name: str) -> np.ndarray:
    arr = _as_vector(x, name)
    if arr.min() < -_SIMPLEX_ATOL or abs(arr.sum() - 1.0) > _SIMPLEX_ATOL:
        raise ValueError(
            f"{name} must lie on the probability simplex (entries >= 0 and sum 1, "
            f"tolerance {_SIMPLEX_ATOL}), got min {arr.min()} and sum {arr.sum()}"
        )
    return arr


def _same_length(x: np.ndarray, name: str, ref: np.ndarray, ref_name: str) -> None:
    if x.shape != ref.shape:
        raise ValueError(
            f"{name} must have the same length as {ref_name} (N={ref.size}), got {x.size}"
        )


def _simplex_and_vector(lam: ArrayLike, v: ArrayLike, v_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate a point λ of the simplex and a finite vector of the same length."""
    lam_arr = _simplex_point(lam, "lam")
    v_arr = _as_vector(v, v_name)
    _same_length(v_arr, v_name, lam_arr, "lam")
    return lam_arr, v_arr


def _real(x: float, name: str, allowed: str) -> float:
    try:
        val = float(x)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a real number in {allowed}, got {x!r}") from exc
    if not np.isfinite(val):
        raise ValueError(f"{name} must be a finite real number in {allowed}, got {x!r}")
    return val


def _positive(x: float, name: str) -> float:
    val = _real(x, name, "(0, inf)")
    if val <= 0.0:
        raise ValueError(f"{name} must be > 0 (allowed range (0, inf)), got {x!r}")
    return val


def _nonnegative(x: float, name: str) -> float:
    val = _real(x, name, "[0, inf)")
    if val < 0.0:
        raise ValueError(f"{name} must be >= 0 (allowed range [0, inf)), got {x!r}")
    return val


def _local_steps(x: float, name: str = "tau") -> float:
    val = _real(x, name, "[1, inf)")
    if val < 1.0:
        raise ValueError(f"{name} must be >= 1 (allowed range [1, inf)), got {x!r}")
    return val


def _shift_by_max(v: np.ndarray) -> np.ndarray:
    """Return ``v - max(v)`` without overflow warnings.

    The projections are invariant to adding a constant to every entry of ``v`` (the
    constant is absorbed by the threshold τ), so shifting by the maximum keeps every
    intermediate quantity of order one near the active entries, even for inputs of
    magnitude 1e300. A difference that overflows becomes ``-inf`` and is clipped by the
    callers.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return v - v.max()


def project_simplex(v: ArrayLike) -> np.ndarray:
    r"""Euclidean projection onto the probability simplex.

    Solves

    .. math::

        \Pi_\Delta(v) = \arg\min_{p \in \mathbb{R}^N} \|p - v\|_2^2
        \quad\text{s.t.}\quad p \ge 0,\ \textstyle\sum_i p_i = 1,

    whose solution is :math:`p_i = \max(v_i - \theta, 0)` with the threshold
    :math:`\theta` chosen so that :math:`\sum_i p_i = 1`. With :math:`u` the entries of
    :math:`v` sorted in decreasing order,
    :math:`\rho = \max\{j : u_j - (\sum_{r \le j} u_r - 1)/j > 0\}` and
    :math:`\theta = (\sum_{r \le \rho} u_r - 1)/\rho` (Duchi et al., 2008, Fig. 1).
    Cost O(N log N).

    The input is first shifted by its maximum (the projection is invariant to adding a
    constant to every entry), so entries of magnitude up to ~1e308 do not overflow.

    Parameters
    ----------
    v : array_like, shape (N,)
        Point to project; finite, N >= 1.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        The projection :math:`\Pi_\Delta(v)`: non-negative, sums to one.

    Raises
    ------
    ValueError
        If ``v`` is empty, not one-dimensional, or contains NaN/Inf.

    Examples
    --------
    >>> project_simplex([0.0, 1.0, 1.5])
    array([0.  , 0.25, 0.75])
    """
    v = _as_vector(v, "v")
    n = v.size
    if n == 1:
        return np.ones(1)
    w = _shift_by_max(v)
    # θ lies in [max(v) - 1, max(v)], i.e. [-1, 0] after the shift, so entries below -1
    # are zero in the projection and never enter the support; clipping them to -2 keeps
    # that true and removes any -inf produced by an overflowing shift.
    np.maximum(w, -2.0, out=w)
    u = np.sort(w)[::-1]
    cssv = np.cumsum(u) - 1.0
    ind = np.arange(1, n + 1)
    support = u - cssv / ind > 0
    rho = int(np.nonzero(support)[0][-1]) + 1
    theta = cssv[rho - 1] / rho
    return np.maximum(w - theta, 0.0)


def _box_bounds(bound: ArrayLike, n: int, name: str, allow_posinf: bool) -> np.ndarray:
    """Broadcast a scalar or length-N bound to a float64 vector and validate it."""
    arr = np.array(bound, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(n, float(arr))
    elif arr.ndim != 1 or arr.size != n:
        raise ValueError(
            f"{name} must be a scalar or a one-dimensional array of length N={n}, "
            f"got shape {arr.shape}"
        )
    else:
        arr = arr.copy()
    if np.any(np.isnan(arr)):
        raise ValueError(f"{name} must not contain NaN")
    if allow_posinf:
        if np.any(arr == -np.inf):
            raise ValueError(f"{name} must be > -inf")
    elif not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite")
    return arr


def project_simplex_box(v: ArrayLike, lower: ArrayLike = 0.0, upper: ArrayLike = 1.0) -> np.ndarray:
    r"""Euclidean projection onto the simplex intersected with a box.

    Solves

    .. math::

        \arg\min_{p \in \mathbb{R}^N} \|p - v\|_2^2
        \quad\text{s.t.}\quad \textstyle\sum_i p_i = 1,\quad l \le p \le u .

    The KKT conditions give :math:`p_i(\tau) = \mathrm{clip}(v_i - \tau, l_i, u_i)`
    for a scalar multiplier :math:`\tau`. The map
    :math:`f(\tau) = \sum_i p_i(\tau)` is continuous, non-increasing and piecewise
    linear with breakpoints :math:`v_i - u_i` and :math:`v_i - l_i`; a binary search
    over the sorted breakpoints finds the linear piece on which :math:`f(\tau) = 1`,
    and :math:`\tau` is then solved in closed form from the sets of entries at the
    lower bound (:math:`L`), at the upper bound (:math:`U`) and free (:math:`F`):
    :math:`\tau = (\sum_{F} v_i + \sum_{U} u_i + \sum_{L} l_i - 1)/|F|`.
    Cost O(N log N). :math:`f` is evaluated entry by entry (never as a difference of
    cumulative sums), so there is no cancellation between entries of very different
    magnitude.

    Parameters
    ----------
    v : array_like, shape (N,)
        Point to project; finite, N >= 1.
    lower : float or array_like of shape (N,), default 0.0
        Lower bounds :math:`l`, finite.
    upper : float or array_like of shape (N,), default 1.0
        Upper bounds :math:`u`, with :math:`l \le u` entrywise; ``+inf`` allowed.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        The projection; sums to one and satisfies ``lower <= p <= upper``.

    Raises
    ------
    ValueError
        If ``v`` is empty, not one-dimensional or not finite; if ``lower``/``upper``
        have the wrong shape, are NaN, or ``lower > upper`` somewhere; or if the set is
        empty (``sum(lower) > 1`` or ``sum(upper) < 1``).

    Examples
    --------
    >>> project_simplex_box([1.0, 0.0, 0.0], lower=0.0, upper=0.5)
    array([0.5 , 0.25, 0.25])
    """
    v = _as_vector(v, "v")
    n = v.size
    lo = _box_bounds(lower, n, "lower", allow_posinf=False)
    hi = _box_bounds(upper, n, "upper", allow_posinf=True)
    if np.any(lo > hi):
        bad = int(np.argmax(lo > hi))
        raise ValueError(
            f"lower must be <= upper entrywise, got lower[{bad}]={lo[bad]} > upper[{bad}]={hi[bad]}"
        )
    sum_lo = float(lo.sum())
    if sum_lo > 1.0 + _FEAS_RTOL * max(1.0, float(np.abs(lo).sum())):
        raise ValueError(f"the set is empty: sum(lower) must be <= 1, got sum(lower)={sum_lo}")
    # Σ p = 1 and p ≥ l imply p_i ≤ 1 - Σ_{j≠i} l_j: tighten (possibly infinite) upper
    # bounds to this implied value, which leaves the set, hence the projection, unchanged.
    hi = np.minimum(hi, 1.0 - (sum_lo - lo))
    hi = np.maximum(hi, lo)
    sum_hi = float(hi.sum())
    if sum_hi < 1.0 - _FEAS_RTOL * max(1.0, float(np.abs(hi).sum())):
        raise ValueError(f"the set is empty: sum(upper) must be >= 1, got sum(upper)={sum_hi}")

    w = _shift_by_max(v)
    if not np.all(np.isfinite(w)):
        # The range of v exceeds the float64 range and v - max(v) overflowed to -inf.
        # Such entries lie below every breakpoint of the finite entries by more than
        # any box width, so they can only leave their lower bound once every finite
        # entry is at its upper bound. Move them to just below the finite breakpoints,
        # keeping their differences (finite, as they are all near the bottom of the
        # range); this keeps the order of all breakpoints and hence the projection.
        fin = np.isfinite(w)
        width = float(np.max(hi - lo))
        anchor = float(np.min(w[fin] - hi[fin])) - 2.0 * width - 2.0
        off = v[~fin] - v[~fin].min()
        with np.errstate(over="ignore"):
            w[~fin] = anchor - (off.max() - off)
        np.maximum(w, -np.finfo(np.float64).max, out=w)

    # Entries far from the threshold τ lose the O(1) resolution their breakpoints
    # need (e.g. w_i - u_i rounds to w_i when |w_i| ~ 1e20). Re-centring w on the
    # threshold found so far and searching again makes the entries near the solution
    # O(1) again; entries still far away are saturated at a bound either way.
    big = np.finfo(np.float64).max
    near = 2.0 * (1.0 + float(np.max(hi - lo)))
    for _ in range(4):
        tau = _box_threshold(w, lo, hi)
        if abs(tau) <= near:
            break
        with np.errstate(over="ignore", invalid="ignore"):
            w = np.clip(w - tau, -big, big)
    else:
        tau = _box_threshold(w, lo, hi)
    return np.clip(w - tau, lo, hi)


def _box_threshold(w: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """Return τ with Σ_i clip(w_i - τ, lo_i, hi_i) = 1 (breakpoint binary search)."""

    def total(tau: float) -> float:
        with np.errstate(over="ignore", invalid="ignore"):
            return float(np.clip(w - tau, lo, hi).sum())

    a = w - hi  # for τ ≤ a_i the entry is at its upper bound
    b = w - lo  # for τ ≥ b_i the entry is at its lower bound
    t = np.unique(np.concatenate([a, b]))  # ascending, f non-increasing along t
    if total(t[-1]) >= 1.0:  # only when Σl = 1: every entry at its lower bound
        return float(t[-1])
    if total(t[0]) <= 1.0:  # Σu = 1 (every entry at its upper bound), or lost resolution
        return float(t[0])
    # Invariant: f(t[i]) > 1 > f(t[j]).
    i, j = 0, t.size - 1
    while j - i > 1:
        mid = (i + j) // 2
        f_mid = total(t[mid])
        if f_mid == 1.0:
            return float(t[mid])
        if f_mid > 1.0:
            i = mid
        else:
            j = mid
    t_lo, t_hi = t[i], t[j]
    at_upper = a >= t_hi
    at_lower = b <= t_lo
    free = ~(at_upper | at_lower)
    n_free = int(free.sum())
    if n_free == 0:  # f is constant on the piece; cannot happen in exact arithmetic
        return float(t_lo)
    tau = (w[free].sum() + hi[at_upper].sum() + lo[at_lower].sum() - 1.0) / n_free
    return float(min(max(tau, t_lo), t_hi))


def project_capped_simplex(v: ArrayLike, cap: float) -> np.ndarray:
    r"""Euclidean projection onto the capped simplex (the CVaR uncertainty set).

    Solves

    .. math::

        \arg\min_{p} \|p - v\|_2^2
        \quad\text{s.t.}\quad p \in \Delta,\ p_i \le c \ \ \forall i,

    with cap :math:`c = 1/(\alpha N)` for CVaR at level :math:`\alpha \in (0, 1]`.
    The solution is :math:`p_i = \mathrm{clip}(v_i - \tau, 0, c)` with the scalar
    :math:`\tau` found exactly by the breakpoint search of
    :func:`project_simplex_box` (box :math:`[0, c]`). For :math:`c \ge 1` the cap is
    inactive and this is :func:`project_simplex`; for :math:`cN = 1` the set is the
    single point :math:`(1/N, \dots, 1/N)`.

    Parameters
    ----------
    v : array_like, shape (N,)
        Point to project; finite, N >= 1.
    cap : float
        Upper bound :math:`c` on every entry; requires :math:`c > 0` and
        :math:`cN \ge 1` (otherwise the set is empty).

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        The projection: in the simplex with every entry ``<= cap``.

    Raises
    ------
    ValueError
        If ``cap`` is not a finite number > 0, if ``cap * N < 1``, or if ``v`` is
        invalid.

    Examples
    --------
    >>> project_capped_simplex([3.0, 0.0, 0.0, 0.0], cap=0.5)
    array([0.5       , 0.16666667, 0.16666667, 0.16666667])
    """
    v = _as_vector(v, "v")
    n = v.size
    try:
        c = float(cap)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cap must be a real number in [1/N, inf), got {cap!r}") from exc
    if np.isnan(c) or c <= 0.0:
        raise ValueError(f"cap must be > 0 (and cap*N >= 1), got cap={cap!r}")
    if c * n < 1.0 - _FEAS_RTOL:
        raise ValueError(
            f"cap must satisfy cap*N >= 1 for a non-empty set, got cap={c} with N={n} "
            f"(cap*N={c * n}); allowed range is [1/N, inf) = [{1.0 / n}, inf)"
        )
    if c >= 1.0:
        return project_simplex(v)
    if c * n <= 1.0 + _FEAS_RTOL:
        return np.full(n, 1.0 / n)
    return project_simplex_box(v, 0.0, c)


def floor_simplex(lam: ArrayLike, floor: float) -> np.ndarray:
    r"""Raise small mixing weights to a floor and renormalise, exactly.

    Returns the fixed point of the map "raise every entry below ``floor`` to ``floor``,
    then divide by the sum", which is

    .. math::

        p_i = \max(\text{floor},\ c\,\lambda_i), \qquad
        c > 0 \text{ such that } \textstyle\sum_i p_i = 1 .

    Entries that end above the floor keep their ratios from :math:`\lambda`
    (they are all scaled by the same :math:`c`); every other entry equals ``floor``.
    :math:`c` is found exactly: with :math:`\lambda` sorted in decreasing order and
    :math:`k` entries scaled, :math:`c = (1 - (N-k)\,\text{floor}) / \sum_{r \le k}
    \lambda_{(r)}`, taking the :math:`k` for which
    :math:`c\lambda_{(k)} \ge \text{floor} \ge c\lambda_{(k+1)}` (the map
    :math:`c \mapsto \sum_i \max(\text{floor}, c\lambda_i)` is increasing).
    The naive single pass (raise, then renormalise once) can push raised entries back
    under the floor; this solution cannot: the result is on the simplex and every entry
    is ``>= floor``. Cost O(N log N).

    Parameters
    ----------
    lam : array_like, shape (N,)
        Non-negative weights with a positive sum (normally a point of the simplex;
        otherwise it is first divided by its sum, which does not change the result).
    floor : float
        Minimum weight; allowed range ``0 <= floor <= 1/N``. ``floor = 0`` returns
        ``lam / sum(lam)``; ``floor = 1/N`` returns the uniform vector.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        A point of the simplex with every entry ``>= floor``.

    Raises
    ------
    ValueError
        If ``floor`` is outside ``[0, 1/N]`` (``floor * N > 1``) or not finite, or if
        ``lam`` is empty, not finite, has a negative entry or sums to zero.

    Examples
    --------
    >>> floor_simplex([0.9, 0.1, 0.0], floor=0.1)
    array([0.8, 0.1, 0.1])
    """
    lam = _as_vector(lam, "lam")
    n = lam.size
    if np.any(lam < 0.0):
        raise ValueError(f"lam must be non-negative (entries >= 0), got min {lam.min()}")
    total = float(lam.sum())
    if not total > 0.0:
        raise ValueError("lam must have a positive sum, got sum(lam)=0")
    try:
        fl = float(floor)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"floor must be a real number in [0, 1/N], got {floor!r}") from exc
    if not np.isfinite(fl) or fl < 0.0:
        raise ValueError(f"floor must be in [0, 1/N] = [0, {1.0 / n}], got floor={floor!r}")
    if fl * n > 1.0 + _FEAS_RTOL:
        raise ValueError(
            f"floor must satisfy floor*N <= 1, i.e. floor in [0, 1/N] = [0, {1.0 / n}], "
            f"got floor={fl} with N={n}"
        )
    lam = lam / total
    if fl == 0.0:
        return lam
    if fl * n >= 1.0 - _FEAS_RTOL:
        return np.full(n, 1.0 / n)
    order = np.argsort(-lam, kind="stable")
    s = lam[order]
    csum = np.cumsum(s)
    k = np.arange(1, n + 1)
    # Candidate scale with the top-k entries scaled and the others at the floor.
    with np.errstate(divide="ignore", invalid="ignore"):
        c = (1.0 - (n - k) * fl) / csum
    # The right k is the largest with c_k λ_(k) ≥ floor (the top entry always works,
    # because floor < 1/N ≤ λ_(1) implies c_1 λ_(1) = 1 - (N-1) floor > floor).
    ok = (csum > 0) & (c * s >= fl)
    kk = int(np.nonzero(ok)[0][-1])
    scale = c[kk]
    out = np.maximum(fl, scale * lam)
    # Renormalise away the last rounding error without moving anything below the floor.
    above = out > fl
    excess = out.sum() - 1.0
    if above.any() and excess != 0.0:
        out[above] -= excess * out[above] / out[above].sum()
        np.maximum(out, fl, out=out)
    return out


def admit_partitions(partitions: Sequence[int], lam: ArrayLike, new: Iterable[int]) -> tuple[list[int], np.ndarray]:
    """Add partitions heard from for the first time to λ, keeping λ on the simplex.

    Each newcomer, taken in increasing id order, gets weight 1/(N+1) and the existing
    weights are scaled by N/(N+1); the result is sorted by partition id.
    """
    parts, weights = list(partitions), np.asarray(lam, dtype=np.float64)
    for pid in sorted(new):
        n = len(parts)
        weights = np.append(weights * n / (n + 1), 1.0 / (n + 1))
        parts.append(int(pid))
    order = np.argsort(parts)
    return [parts[k] for k in order], weights[order]


def lambda_entropy(lam: np.ndarray) -> float:
    """Shannon entropy −Σ λ_i log λ_i (nats; 0 log 0 = 0); log N for uniform λ."""
    p = np.asarray(lam, dtype=np.float64)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())
