"""FedMGDA+ server maths: the min-norm convex combination of client updates, and the rate.

Hu, Shaloudegi, Zhang, Yu, "Federated Learning Meets Multi-objective Optimization",
IEEE Transactions on Network Science and Engineering, 2022 (arXiv:2006.11489).

Each round the server receives one update g_i per sampled client, normalises it
(ĝ_i = g_i / ‖g_i‖), and looks for the common descent direction of smallest norm in the
convex hull of the normalised updates, with the weights kept within ε of a centre c
(uniform 1/m by default, so ε = 0 is FedAvg on normalised updates and ε = 1 is the
unrestricted MGDA step):

    λ* = argmin_λ  λᵀ G λ   s.t.  λ ∈ Δ_m = {λ ≥ 0, Σ_i λ_i = 1},  ‖λ − c‖_∞ ≤ ε,

    d  = Σ_i λ*_i ĝ_i,     G_ij = ⟨ĝ_i, ĝ_j⟩,

and the global model moves by x ← x − η_t d with the decaying rate of :func:`fedmgda_lr`.
:func:`min_norm_weights` solves the quadratic programme with the Clarabel interior-point
solver, then solves the optimal face's equality-constrained problem exactly and projects
onto the feasible set (see its docstring). The update matrix, the Gram matrix and the
step are in :mod:`flowerdro.core.mgda_step`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import clarabel
import numpy as np
from scipy import sparse

__all__ = ["fedmgda_lr", "min_norm_weights", "project_box_simplex"]

#: Clarabel's gap and feasibility tolerances on the scaled problem (max G_ii = 1).
_TOL = 1e-12
#: Clarabel's static regularisation of its KKT systems (its default 1e-8 stalls, "almost
#: solved" 1e-8 away from the optimum, on Gram matrices with eigenvalues from 1 down to 1e-16).
_STATIC_REG = 1e-12
#: A weight within this of a bound (scaled units) is taken as active when the face is solved.
_ACTIVE = 1e-9


def _validate_gram(gram: np.ndarray) -> np.ndarray:
    """A symmetric float64 copy of ``gram`` after the checks of :func:`min_norm_weights`."""
    G = np.asarray(gram)
    if G.ndim != 2 or G.shape[0] != G.shape[1] or G.shape[0] == 0:
        raise ValueError(f"gram: must be a non-empty square 2-D array, got shape {G.shape}")
    if G.dtype.kind not in "fiu":
        raise ValueError(f"gram: must be a real numeric array, got dtype {G.dtype}")
    G = G.astype(np.float64)
    amax = float(np.abs(G).max())
    if not math.isfinite(amax):
        raise ValueError("gram: all entries must be finite (no NaN or inf)")
    asym = float(np.abs(G - G.T).max())
    if asym > 1e-8 * max(amax, 1e-300):
        raise ValueError(f"gram: must be symmetric, max |G - G^T| = {asym:.3e} exceeds 1e-8 * max |G|")
    G = 0.5 * (G + G.T)
    dmin = float(G.diagonal().min())
    if dmin < -1e-10 * max(amax, 1e-300):
        raise ValueError(f"gram: must be positive semi-definite, found diagonal entry {dmin:.3e} < 0")
    return G


def _validate_center(center: np.ndarray | Sequence[float] | None, m: int) -> np.ndarray:
    if center is None:
        return np.full(m, 1.0 / m)
    c = np.asarray(center, dtype=np.float64)
    if c.shape != (m,):
        raise ValueError(f"center: must have shape ({m},) to match gram, got {c.shape}")
    if not np.all(np.isfinite(c)):
        raise ValueError("center: all entries must be finite")
    if np.any(c < 0.0):
        raise ValueError(f"center: must lie on the simplex (entries >= 0), min is {c.min():.3e}")
    total = float(c.sum())
    if abs(total - 1.0) > 1e-9:
        raise ValueError(f"center: must lie on the simplex (sum 1 within 1e-9), sum is {total!r}")
    return c / total


def _validate_eps(eps: float | None) -> float | None:
    if eps is None:
        return None
    try:
        e = float(eps)
    except (TypeError, ValueError) as err:
        raise ValueError(f"eps: must be a float in [0, 1] or None, got {eps!r}") from err
    if not (0.0 <= e <= 1.0):  # also rejects NaN
        raise ValueError(f"eps: must be in [0, 1] or None, got {eps!r}")
    return e


def project_box_simplex(y: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    r"""Euclidean projection of y onto {x : Σx = 1, lo ≤ x ≤ hi} (assumed non-empty).

    .. math::  x_i = \operatorname{clip}(y_i − τ, lo_i, hi_i), \quad Σ_i x_i(τ) = 1,

    τ found by bisection on the non-increasing piecewise-linear Σ x(τ) (bracketed by
    max(y − lo), where every x_i = lo_i, and min(y − hi), where every x_i = hi_i); the
    rounding left in Σx goes to the coordinate with the most room, so Σx = 1 to a few ulps
    and the bounds hold exactly.

    Parameters
    ----------
    y : np.ndarray of shape (m,)
        The point to project.
    lo, hi : np.ndarray of shape (m,)
        Bounds with lo ≤ hi and Σlo ≤ 1 ≤ Σhi.

    Returns
    -------
    np.ndarray
        argmin_x ‖x − y‖ over {Σx = 1, lo ≤ x ≤ hi}, float64.
    """
    y = np.asarray(y, dtype=np.float64)
    a, b = float(np.min(y - hi)), float(np.max(y - lo))
    for _ in range(200):  # Σx(a) ≥ 1 ≥ Σx(b); 200 halvings reach adjacent floats
        mid = 0.5 * (a + b)
        if mid in (a, b):
            break
        if np.clip(y - mid, lo, hi).sum() >= 1.0:
            a = mid
        else:
            b = mid
    x = np.clip(y - a, lo, hi)
    r = 1.0 - math.fsum(x.tolist())
    j = int(np.argmax(hi - x if r > 0 else x - lo))
    x[j] = min(max(x[j] + r, lo[j]), hi[j])
    return x


def _face_solution(H: np.ndarray, x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
    """The exact minimiser of xᵀHx on the face of x (coordinates near a bound fixed there).

    Solves the KKT system [[H_FF, 1], [1ᵀ, 0]] [x_F; −θ] = [−H_FB x_B; 1 − Σx_B] by least
    squares (it is consistent for a PSD H, also when H_FF is singular); None when the
    answer leaves the box. With no free coordinate the face is the vertex itself.
    """
    at_lo, at_hi = x <= lo + _ACTIVE, x >= hi - _ACTIVE
    free = ~(at_lo | at_hi)
    k = int(free.sum())
    xb = np.where(at_lo, lo, np.where(at_hi, hi, 0.0))
    if k == 0:  # a vertex of the box-simplex
        return xb
    K = np.zeros((k + 1, k + 1))
    K[:k, :k] = H[np.ix_(free, free)]
    K[:k, k] = K[k, :k] = 1.0
    rhs = np.append(-H[free] @ xb, 1.0 - xb.sum())
    sol = np.linalg.lstsq(K, rhs, rcond=None)[0]
    out = xb.copy()
    out[free] = sol[:k]
    if not np.all(np.isfinite(out)) or np.any(out < lo - _ACTIVE) or np.any(out > hi + _ACTIVE):
        return None
    return out


def min_norm_weights(
    gram: np.ndarray,
    eps: float | None = None,
    center: np.ndarray | Sequence[float] | None = None,
) -> np.ndarray:
    r"""Minimiser of λᵀGλ over the simplex intersected with an ∞-norm box around ``center``.

    .. math::

        \min_{λ ∈ ℝ^m} λᵀ G λ \quad \text{s.t.} \quad Σ_i λ_i = 1,\;
        \max(0, c_i − ε) ≤ λ_i ≤ \min(1, c_i + ε),

    the FedMGDA+ weight problem (the min-norm point of the convex hull of the updates when
    ``G`` is their Gram matrix). On H = G / max_i G_ii: Clarabel (an interior-point method,
    gap and feasibility tolerances 1e-12) solves the QP; the face of its answer (weights
    within 1e-9 of a bound fixed there) is then solved exactly as an equality-constrained
    least-squares KKT system, kept when it stays in the box and is no worse; a Euclidean
    projection onto {Σλ = 1, lo ≤ λ ≤ hi} removes the rest of the rounding. ``G`` only
    needs to be positive *semi*-definite (rank-deficient, duplicated, zero and opposite
    updates included). When the minimiser is not unique one of them is returned,
    deterministically.

    Parameters
    ----------
    gram : np.ndarray
        Symmetric PSD matrix G of shape (m, m), m ≥ 1, finite entries. Symmetry is
        checked to 1e-8 relative and then enforced by (G + Gᵀ)/2.
    eps : float or None (default: None)
        Box radius ε ∈ [0, 1] around ``center``. ``None`` means no box (plain MGDA);
        ``0`` returns ``center``; ``1`` is equivalent to no box.
    center : array of shape (m,) or None (default: None)
        Box centre c on the simplex (c ≥ 0, Σc = 1 within 1e-9; it is renormalised).
        ``None`` means uniform 1/m.

    Returns
    -------
    np.ndarray
        λ of shape (m,), float64: Σλ = 1 to rounding, the bounds hold exactly.

    Raises
    ------
    ValueError
        If ``gram`` is not square, symmetric, finite, or has a negative diagonal; if
        ``center`` is not on the simplex; if ``eps`` is not in [0, 1].
    RuntimeError
        If Clarabel reports neither a solution nor an almost-solution.

    Examples
    --------
    >>> import numpy as np
    >>> min_norm_weights(np.array([[1.0, -1.0], [-1.0, 1.0]])).round(6)
    array([0.5, 0.5])
    >>> min_norm_weights(np.array([[4.0, 0.0], [0.0, 1.0]])).round(6)
    array([0.2, 0.8])
    """
    G = _validate_gram(gram)
    m = G.shape[0]
    c = _validate_center(center, m)
    e = _validate_eps(eps)
    scale = float(G.diagonal().max())
    if m == 1 or e == 0.0 or scale <= 0.0:  # one point, or G = 0: every feasible λ is optimal
        return c.copy()
    H = G / scale
    lo = np.zeros(m) if e is None else np.maximum(0.0, c - e)
    hi = np.ones(m) if e is None else np.minimum(1.0, c + e)
    upper = hi < 1.0  # λ_i ≤ 1 is implied by λ ≥ 0 and Σλ = 1
    eye = sparse.identity(m, format="csc")
    A = sparse.vstack([sparse.csc_matrix(np.ones((1, m))), eye[upper], -eye], format="csc")
    b = np.concatenate([[1.0], hi[upper], -lo])
    settings = clarabel.DefaultSettings()
    settings.verbose = False
    settings.tol_gap_abs = settings.tol_gap_rel = settings.tol_feas = _TOL
    settings.static_regularization_constant = _STATIC_REG
    settings.max_threads = 1  # deterministic, and no thread start-up for an m × m problem
    solver = clarabel.DefaultSolver(sparse.csc_matrix(np.triu(2.0 * H)), np.zeros(m), A, b,
                                    [clarabel.ZeroConeT(1), clarabel.NonnegativeConeT(A.shape[0] - 1)], settings)
    sol = solver.solve()
    if sol.status not in (clarabel.SolverStatus.Solved, clarabel.SolverStatus.AlmostSolved):
        raise RuntimeError(f"min_norm_weights: Clarabel returned {sol.status}; is gram positive semi-definite?")
    x = project_box_simplex(np.asarray(sol.x), lo, hi)
    face = _face_solution(H, x, lo, hi)
    if face is not None:
        face = project_box_simplex(face, lo, hi)
        if face @ H @ face <= x @ H @ x:
            x = face
    return x


def fedmgda_lr(
    round: int, num_rounds: int, decay: float, base_lr: float = 1.0, *, every: int = 100
) -> float:
    r"""FedMGDA+ global step size with stepwise decay.

    .. math::

        η_t = η_0 \, β^{\lfloor t/P \rfloor}, \qquad β = \text{decay}^{P/T},

    with period P = ``every`` (100, the paper's), so the rate shrinks by β every P rounds
    and reaches ≈ η_0·decay after T rounds (Hu et al., Section 5: "global learning rate
    decayed by a factor every 100 rounds").

    Parameters
    ----------
    round : int
        Current round t ≥ 0 (0- or 1-based, the formula is the same).
    num_rounds : int
        Total number of rounds T ≥ 1.
    decay : float
        Total decay factor in (0, 1]; 1 means a constant rate.
    base_lr : float (default: 1.0)
        η_0 > 0.
    every : int (default: 100)
        Decay period P ≥ 1 in rounds.

    Returns
    -------
    float
        η_t.

    Examples
    --------
    >>> fedmgda_lr(250, 1000, 0.1)  # β = 0.1**0.1, two decays
    0.6309573444801932
    """
    if isinstance(round, bool) or not isinstance(round, int | np.integer) or round < 0:
        raise ValueError(f"round: must be an integer >= 0, got {round!r}")
    if isinstance(num_rounds, bool) or not isinstance(num_rounds, int | np.integer) or num_rounds < 1:
        raise ValueError(f"num_rounds: must be an integer >= 1, got {num_rounds!r}")
    if not (isinstance(decay, int | float | np.floating) and 0.0 < float(decay) <= 1.0):
        raise ValueError(f"decay: must be in (0, 1], got {decay!r}")
    if not (isinstance(base_lr, int | float | np.floating) and math.isfinite(float(base_lr)) and float(base_lr) > 0.0):
        raise ValueError(f"base_lr: must be a finite float > 0, got {base_lr!r}")
    if isinstance(every, bool) or not isinstance(every, int | np.integer) or every < 1:
        raise ValueError(f"every: must be an integer >= 1, got {every!r}")
    beta = float(decay) ** (float(every) / int(num_rounds))
    return float(base_lr) * beta ** (int(round) // int(every))
