"""FedMGDA+ server maths: the min-norm convex combination of client updates.

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

The quadratic programme is solved *exactly* (up to floating-point rounding) by
:func:`min_norm_weights`: a primal-dual active-set pass (a few Cholesky solves) settles
well-conditioned and duplicated problems; on low-rank Gram matrices (m ≤ 200) two more
passes guess the optimal face and then solve it exactly: a Mehrotra interior-point
method in the low-rank factor space (first under an ε-box) and the primal-dual
iteration on a slightly proximal (strongly convex) version of the problem (first on the
plain simplex); otherwise an inertia-controlling primal active-set method,
which only ever factorises affinely independent faces and steps along zero-curvature
directions to the next bound, finishes from a vertex; a KKT check certifies the answer. Singular Gram matrices (duplicated, zero or exactly opposite
updates, rank-deficient sets with m > d) need no regularisation.

This module is framework-free: numpy and scipy, torch only as an optional matmul backend.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
from scipy.linalg import lapack

__all__ = [
    "combine_rows",
    "fedmgda_lr",
    "gram_matrix",
    "mgda_direction",
    "min_norm_weights",
    "normalize_updates",
]

Update = Sequence[np.ndarray]
Updates = Sequence[Update] | np.ndarray

# Tolerances on the *scaled* problem (G / max_i G_ii, so every |G_ij| ≤ 1 and every
# gradient entry (Gλ)_i has modulus ≤ 1 on the simplex).
_TOL_MULT = 1e-14  # a bound multiplier of the wrong sign by more than this is a violation
_TOL_RANK = 1e-10  # pivoted Cholesky: Schur pivots of Ĥ below this are affinely dependent
_TOL_CURV = 1e-14  # curvature along a freeing direction d below this·(1+‖d‖₁)² is zero
_TOL_SAFE = 1e-14  # safe face steps: Schur pivots of Ĥ below this are affinely dependent
_TOL_KKT = 1e-9  # final certificate (scaled units); larger means a genuine failure
_PDAS_MAX_ITER = 7
_REG_DELTA = 1e-9  # proximal weight δ of the low-rank pass (scaled units)
_REG_MAX_ITER = 16
# ... and runs only up to this m: its dense face factorisations cost O(m³) each, the
# active-set finish O(m·rank) per step; measured, the pass stops paying off near m = 250
_REG_MAX_M = 200
_REG_STALL = 0.9  # ... and gives up when the violations shrink less than this in 3 steps
_PDAS_MAX_DEPENDENT = 0.6  # _pdas leaves faces with more dependent coordinates to the next pass
_REFINE_MAX = 3  # extra Newton steps on one face (iterative refinement) when g_F is not flat
_IPM_MAX_ITER = 30  # interior-point pass: iterations ...
_IPM_MAX_TRIES = 4  # ... and exact-face guesses before it gives way to the active-set method
_IPM_MAX_REPAIR = 3  # single-coordinate corrections of one guessed face
_IPM_Z0 = 0.1  # initial multipliers, times the gradient spread (0.1-0.3 took ~12% fewer
# Cholesky factorisations than 1 on 40 random tight-box low-rank instances)
_AFF_MAX_ITER = 8  # affine-minimum pass: iterations; ...
_AFF_MIN_FREE = 1.6  # ... it gives up when its first step leaves fewer than this·k free
_AFF_SKIP_BOX = 0.5  # skipped (see _solve_qp) when the box's half width Σ(hi − lo)/2 is ...
_AFF_SKIP_RANK = 0.15  # ... at most this and the rank of Ĥ at least this·m (and m ≥ 20)
_IPM_FIRST_M = 20  # from this m on the interior-point pass runs (first under an ε-box)


# ---------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------
def _validate_gram(gram: np.ndarray) -> np.ndarray:
    """A float64 copy of ``gram`` after the checks of :func:`min_norm_weights`.

    Fast path (the usual input, an exactly symmetric finite matrix): one comparison with
    the transpose and one sum, whose result is finite exactly when no entry is NaN or
    infinite (up to an overflow of the sum, which falls through to the full check). For a
    positive semi-definite matrix max |G_ij| = max G_ii, so the diagonal test below
    compares against the largest |G_ij| as well.
    """
    G = np.asarray(gram)
    if G.ndim != 2 or G.shape[0] != G.shape[1] or G.shape[0] == 0:
        raise ValueError(f"gram: must be a non-empty square 2-D array, got shape {G.shape}")
    if G.dtype.kind not in "fiu":
        raise ValueError(f"gram: must be a real numeric array, got dtype {G.dtype}")
    G = G.astype(np.float64, copy=False)
    if math.isfinite(float(np.add.reduce(G, axis=None))) and (G == G.T).all():
        G = G.copy()
        diag = G.diagonal()
        amax = max(float(diag.max()), -float(diag.min()))
    else:
        amax = float(np.abs(G).max())  # NaN or inf anywhere makes this non-finite
        if not math.isfinite(amax):
            raise ValueError("gram: all entries must be finite (no NaN or inf)")
        D = G - G.T
        asym = float(np.abs(D, out=D).max())
        if asym > 1e-8 * max(amax, 1e-300):
            raise ValueError(
                f"gram: must be symmetric, max |G - G^T| = {asym:.3e} exceeds 1e-8 * max |G|"
            )
        G = G + G.T
        G *= 0.5
    dmin = float(G.diagonal().min())
    if dmin < -1e-10 * max(amax, 1e-300):
        raise ValueError(
            f"gram: must be positive semi-definite, found diagonal entry {dmin:.3e} < 0"
        )
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


# ---------------------------------------------------------------------------------------
# the QP solver
# ---------------------------------------------------------------------------------------
# Notation (scaled problem): H = G / max_i G_ii, so |H_ij| ≤ 1; g = Hx; on the feasible set
# {Σx = 1} the objective xᵀHx equals xᵀĤx − 1 with Ĥ = H + 11ᵀ, and Ĥ_FF is positive
# definite exactly when the reduced Hessian of the face F (Zᵀ H_FF Z, Z a basis of 1^⊥) is,
# i.e. when the points of F are affinely independent. Ĥ_FF is what gets factorised.
# state_i: −1 at the lower bound, +1 at the upper bound, 0 free.


_ONES = np.ones(256)


def _ones(n: int) -> np.ndarray:
    """A read-only-by-convention view of n ones (sums as dot products: x.dot(1) is
    several times faster than x.sum() on the short vectors of this solver)."""
    global _ONES
    if n > _ONES.size:
        _ONES = np.ones(max(n, 2 * _ONES.size))
    return _ONES[:n]


def _face_step(L: np.ndarray, b: np.ndarray, r: float) -> tuple[np.ndarray, float]:
    """(x_F, θ): x_F = α z − y with Ĥ_FF y = b, Ĥ_FF z = 1, α = (Σy + r)/Σz, θ = α − r.

    ``L`` is the Cholesky factor of Ĥ_FF. The minimiser of λᵀHλ on a face F with the bound
    coordinates fixed: with b = H_FB λ_B and r = 1 − Σλ_B, x_F solves H_FF x_F + b = θ1
    and Σx_F = r (Ĥ_FF x_F = α1 − b, and Ĥ = H + 11ᵀ adds (Σx_F)1 = r1 to H_FF x_F), so θ
    is the common gradient value (Hλ)_i on F, obtained without another product.
    """
    n = b.size
    rhs = np.empty((n, 2), order="F")
    rhs[:, 0] = b
    rhs[:, 1] = 1.0
    sol, _info = lapack.dpotrs(L, rhs, lower=1, overwrite_b=1)
    y = sol[:, 0]
    z = sol[:, 1]
    one = _ones(n)
    alpha = (float(y.dot(one)) + r) / float(z.dot(one))
    z *= alpha
    z -= y
    return z, alpha - r


def _face_factor(
    Hh: np.ndarray, fi: np.ndarray, pivoted: bool = False, full: list | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cholesky of Ĥ_FF: (L, independent indices in factor order, dependent indices).

    Plain ``dpotrf`` first (unless ``pivoted``); if it fails or a pivot L_ii² is below
    ``_TOL_RANK`` (absolute; Ĥ_ii ∈ [1, 2], so it is relative as well), pivoted
    ``dpstrf``, which stops when the largest remaining pivot is below ``_TOL_RANK``; its
    leading block is the Cholesky factor of Ĥ on the
    independent indices. When F is every coordinate and ``full`` is a list, the pivoted
    factorisation (factor, permutation, rank) is also appended to it, for
    :func:`_low_rank_factor` and later faces to reuse; if the list already holds it (so
    plain ``dpotrf`` failed on it before), it is reused instead of computed again.
    """
    whole = fi.size == Hh.shape[0]
    if whole and full:
        c, piv, k = full[0]
        return c[:k, :k], fi.take(piv[:k]), fi.take(piv[k:])
    # symmetric: the transpose is a Fortran-order view (dpotrf copies it once)
    A = Hh.T if whole else Hh.take(fi, 0).take(fi, 1).T
    if not pivoted:
        c, info = lapack.dpotrf(A, lower=1, clean=0)
        if info == 0:
            # Schur pivots L_ii² of Ĥ (whose diagonal lies in [1, 2]) against the same
            # absolute tolerance as dpstrf's
            if float(c.diagonal().min()) ** 2 > _TOL_RANK:
                return c, fi, fi[:0]
    c, piv, k, _info = lapack.dpstrf(A, tol=_TOL_RANK, lower=1)
    piv = piv[: fi.size] - 1
    if full is not None and whole:
        full.append((c, piv, k))  # V̂ is assembled only if it is needed
    return c[:k, :k], fi.take(piv[:k]), fi.take(piv[k:])


def _pdas(
    H: np.ndarray, Hh: np.ndarray, lo: np.ndarray, hi: np.ndarray, c: np.ndarray,
    full: list | None = None,
) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    """Primal-dual active-set (semismooth Newton) pass: a fast guess of the optimal face.

    Each iteration fixes the coordinates of the current lower/upper sets at their bounds,
    minimises λᵀHλ exactly over the remaining affine face (one Cholesky factorisation of
    Ĥ_FF), then moves every free coordinate that left the box onto its bound and frees
    every bound coordinate with a wrong-signed multiplier. Free coordinates that are
    affinely dependent on the others (found by the pivoted factorisation) are parked at
    their previous values inside the box (the centre c at first): the face minimum is
    reached without them, and at it their gradients equal the others'. Converged when the
    sets repeat. Not guaranteed in general, so it gives up on a repeated state, on a
    singular face without progress, on a face with more than ``_PDAS_MAX_DEPENDENT`` of its
    coordinates dependent (low rank: parking there rarely converges, and
    :func:`_pdas_low_rank` does better) and after ``_PDAS_MAX_ITER`` iterations; the caller verifies any answer. Returns
    (x, state, converged, singular), singular when it met a singular face.
    """
    m = H.shape[0]
    one = _ones(m)
    state = np.zeros(m)
    x = c.copy()
    seen: set[bytes] = set()
    prev = m + 1
    pivoted = singular = False
    for _ in range(_PDAS_MAX_ITER):
        key = state.tobytes()
        if key in seen:
            break
        seen.add(key)
        fi = (state == 0).nonzero()[0]
        if fi.size == 0:
            break
        # once a face was singular (duplicated or dependent updates), go to the pivoted
        # factorisation directly: the faces that follow mostly keep the dependent pairs
        L, fi, dep = _face_factor(Hh, fi, pivoted, full)
        pivoted = dep.size > 0
        singular = singular or pivoted
        if dep.size > _PDAS_MAX_DEPENDENT * (fi.size + dep.size):
            return x, state, False, True  # low rank: :func:`_pdas_low_rank` does better
        park = x.take(dep).clip(lo.take(dep), hi.take(dep)) if dep.size else None
        x = np.where(state < 0.0, lo, hi)
        x[fi] = 0.0
        if park is not None:
            x[dep] = park
        # x is zero on F here: (Hx)_F is H_FB x_B
        x[fi], th = _face_step(L, (H @ x).take(fi), 1.0 - float(x.dot(one)))
        s = H @ x
        s -= th
        # bound coordinates with a wrong-signed multiplier (state·s > 0) are freed, free
        # ones outside the box go to the bound they crossed (bound ones sit on theirs)
        new = np.where(state * s > _TOL_MULT, 0.0, state)
        new[x < lo] = -1.0
        new[x > hi] = 1.0
        changes = int(np.count_nonzero(new != state))
        if changes == 0:
            return x, state, True, False
        if dep.size and changes >= prev:
            break  # a singular face and no progress: leave it to the exact method
        prev = changes
        state = new
    return x, state, False, singular


def _pdas_low_rank(
    H: np.ndarray, Hh: np.ndarray, lo: np.ndarray, hi: np.ndarray, c: np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Primal-dual active-set pass for a low-rank H: a proximal guess, then an exact face.

    The sets are found on the strongly convex problem min λᵀHλ + δ‖λ − c‖² (δ =
    ``_REG_DELTA``), whose face matrices Ĥ_FF + δI are positive definite, by the
    iterations of :func:`_pdas`, damped from the third on: only the more violated half of
    the violations (wrong-signed bound multipliers, free coordinates outside the box)
    change sets, since the plain iteration oscillates on tight boxes. At most
    ``_REG_MAX_ITER`` iterations; it gives up on a repeated or empty free set and when the
    number of violations did not fall below ``_REG_STALL`` times its value three
    iterations earlier (converging runs shrink it geometrically). Its solution λ_δ
    approaches the optimal λ nearest to c as δ → 0. The answer is then the *exact*
    minimiser of λᵀHλ on the face found: the pivoted Cholesky factor of Ĥ_FF splits F into
    affinely independent coordinates I and dependent ones D, D stays at λ_δ (inside the
    box), and I solves the face equations H_I λ = θ1, Σλ = 1 exactly (the gradient on D
    then equals θ too, D being affine combinations of I).
    Returns (x, state, ok); ok is False when a step failed or x_I left the box, and the
    caller verifies any answer.
    """
    m = H.shape[0]
    one = _ones(m)
    Hd = Hh.copy()
    Hd.flat[:: m + 1] += _REG_DELTA
    dc = _REG_DELTA * c
    state = np.zeros(m)
    seen: set[bytes] = set()
    x = c
    changes: list[int] = []
    for it in range(_REG_MAX_ITER):
        key = state.tobytes()
        fi = (state == 0).nonzero()[0]
        if key in seen or fi.size == 0:
            return x, state, False
        seen.add(key)
        A = Hd.T if fi.size == m else Hd.take(fi, 0).take(fi, 1).T
        L, info = lapack.dpotrf(A, lower=1, clean=0)
        if info != 0:
            return x, state, False
        x = np.where(state < 0.0, lo, hi)
        x[fi] = 0.0
        x[fi], th = _face_step(L, (H @ x).take(fi) - dc.take(fi), 1.0 - float(x.dot(one)))
        s = H @ x + _REG_DELTA * (x - c)
        s -= th
        # violations: bound coordinates with a wrong-signed multiplier, free ones outside
        # the box; the first two steps change all of them (plain PDAS), later steps only
        # the more violated half (damping: plain PDAS oscillates on tight boxes)
        v = np.where(state != 0.0, state * s - _TOL_MULT, np.maximum(lo - x, x - hi))
        cand = (v > 0.0).nonzero()[0]
        changes.append(cand.size)
        if cand.size == 0:
            break
        if it >= 3 and cand.size > _REG_STALL * changes[-4]:
            return x, state, False  # the violations stall (tight boxes): give way
        if it >= 2 and cand.size > 1:
            cand = cand.take(np.argsort(-v.take(cand), kind="stable")[: (cand.size + 1) // 2])
        new = state.copy()
        sc = state.take(cand)
        new[cand] = np.where(sc != 0.0, 0.0, np.where(x.take(cand) < lo.take(cand), -1.0, 1.0))
        state = new
    else:
        return x, state, False
    # the exact face solve, dependent coordinates parked at λ_δ
    xe, ind, _th = _face_solution(H, Hh, lo, hi, state, x, pivoted=True)
    xi = xe.take(ind)
    if not (np.all(xi >= lo.take(ind)) and np.all(xi <= hi.take(ind))):
        return x, state, False
    return xe, state, True


@functools.lru_cache(maxsize=4)
def _lower_mask(n: int) -> np.ndarray:
    """The n × n boolean mask of the lower triangle, diagonal included, transposed:
    entry (j, i) is i ≥ j (read-only; cached, as it costs more than applying it)."""
    mask = np.arange(n) >= np.arange(n)[:, None]
    mask.setflags(write=False)
    return mask


def _low_rank_factor(
    A: np.ndarray, done: tuple[np.ndarray, np.ndarray, int] | None = None
) -> np.ndarray:
    """V (m × r) with VVᵀ = A up to the pivoted-Cholesky truncation (pivots < ``_TOL_RANK``).

    ``dpstrf`` factorises P A Pᵀ = L Lᵀ and stops at numerical rank r; the rows of the
    leading r columns of L, put back in the original order, are V. ``done`` is an earlier
    factorisation of A (factor, 0-based permutation, rank), as :func:`_face_factor` keeps it.
    """
    if done is None:
        c, piv, k, _info = lapack.dpstrf(A, tol=_TOL_RANK, lower=1)
        piv = piv - 1
    else:
        c, piv, k = done
    n = A.shape[0]
    # c is in Fortran order, so the columns of L are the contiguous rows of cᵀ; above the
    # diagonal c holds leftovers of A, which the mask removes (np.tril is slower)
    Vt = np.empty((k, n))
    Vt[:, piv] = np.asfortranarray(c).T[:k] * _lower_mask(n)[:k]
    return Vt.T


def _shared_factor(Hh: np.ndarray, full: list) -> np.ndarray:
    """V̂ of :func:`_low_rank_factor` from ``full[0]``, kept as ``full[1]`` for the next pass."""
    if len(full) < 2:
        full.append(_low_rank_factor(Hh, full[0]))
    return full[1]


def _face_solution(
    H: np.ndarray, Hh: np.ndarray, lo: np.ndarray, hi: np.ndarray, state: np.ndarray,
    park: np.ndarray, pivoted: bool = False, full: list | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """λ on the face ``state`` (F = its zeros, non-empty): the minimiser of λᵀHλ there.

    Bound coordinates sit on their bounds. :func:`_face_factor` splits F into affinely
    independent coordinates I and dependent ones D; D stays at ``park`` (clipped into the
    box) and I solves the face equations H_I λ = θ1, Σλ = 1 exactly (the gradient on D
    then equals θ too, D being affine combinations of I). λ_I may leave the box; the
    callers check. ``full`` is passed on to :func:`_face_factor`. Returns (λ, I, θ), θ the
    gradient value on the face (:func:`_face_step`).
    """
    fi = (state == 0.0).nonzero()[0]
    Lf, ind, dep = _face_factor(Hh, fi, pivoted, full)
    xe = np.where(state < 0.0, lo, hi)
    xe[fi] = 0.0
    if dep.size:
        xe[dep] = park.take(dep).clip(lo.take(dep), hi.take(dep))
    xe[ind], th = _face_step(Lf, (H @ xe).take(ind), 1.0 - float(xe.dot(_ones(xe.size))))
    return xe, ind, th


def _face_repair(
    H: np.ndarray, Hh: np.ndarray, lo: np.ndarray, hi: np.ndarray, state: np.ndarray,
    park: np.ndarray, full: list | None = None,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Exact minimiser of λᵀHλ on a guessed face, corrected one coordinate at a time.

    The face ``state`` is solved exactly by :func:`_face_solution` (dependent free
    coordinates parked at ``park``). If the answer violates the KKT conditions, the worst violation is
    corrected and the face solved again, at most ``_IPM_MAX_REPAIR`` times: a free
    coordinate outside its box first (it goes to the bound it crossed), otherwise the
    bound coordinate with the most wrong-signed multiplier g_i − θ (it is freed); it gives
    up as soon as the violations outnumber the corrections left. Returns (λ, state, ok);
    ok means no free coordinate is outside its box and no multiplier is wrong-signed by
    more than 10 ``_TOL_MULT`` (the caller's KKT check certifies the answer). ``full``
    holds the factorisation of the whole Ĥ when one was computed (:func:`_face_factor`).
    """
    state = state.copy()
    xe = np.where(state < 0.0, lo, hi)
    for repair in range(_IPM_MAX_REPAIR + 1):
        free = state == 0.0
        if not np.count_nonzero(free):
            return xe, state, False
        xe, _ind, th = _face_solution(H, Hh, lo, hi, state, park, full=full)
        out = np.maximum(lo - xe, xe - hi)
        out *= free
        viol = H @ xe
        viol -= th
        viol *= state
        bad = int(np.count_nonzero(out > 0.0)) + int(np.count_nonzero(viol > _TOL_MULT * 10))
        if bad == 0:  # the caller's KKT check certifies the answer
            return xe, state, True
        if bad > _IPM_MAX_REPAIR - repair:
            break  # more violations than corrections left: a wrong guess, give up early
        j = int(out.argmax())
        if out[j] > 0.0:
            state[j] = -1.0 if xe[j] < lo[j] else 1.0
        else:
            state[int(viol.argmax())] = 0.0
    return xe, state, False


def _separates(a: np.ndarray, va: np.ndarray, ustar: np.ndarray, lo: np.ndarray,
               hi: np.ndarray) -> bool:
    """Farkas test: aᵀu* > max (V̂a)ᵀλ over {lo ≤ λ ≤ hi, Σλ = 1} (``va`` = V̂a), by a margin.

    True proves that no λ in the box-simplex has V̂ᵀλ = u* (aᵀV̂ᵀλ = aᵀu* would exceed its
    maximum). The maximum is bounded above first by cheap relaxations, (V̂a)ᵀlo plus the
    remaining mass r = 1 − Σlo times max V̂a (no upper bounds), or plus Σ (hi − lo)(V̂a)⁺
    (no sum constraint); only if neither settles it is it computed exactly by
    :func:`_lmo_vertex` (fill the largest entries first).
    """
    target = float(a.dot(ustar))
    margin = 1e-9 * math.sqrt(float(a.dot(a))) * (math.sqrt(float(ustar.dot(ustar))) + 2.0)
    base = float(va.dot(lo))
    rest = 1.0 - float(lo.dot(_ones(lo.size)))
    bound = base + rest * float(va.max())
    if target - bound > margin:
        return True
    unbounded = int(np.count_nonzero(np.isinf(hi)))
    if unbounded == hi.size:
        return False  # the first bound is the maximum when no coordinate has an upper bound
    if unbounded == 0:
        bound = base + float(np.maximum(va, 0.0).dot(hi - lo))
        if target - bound > margin:
            return True
    return target - float(va.dot(_lmo_vertex(-va, lo, hi)[0])) > margin


def _affine_pass(
    H: np.ndarray, Hh: np.ndarray, lo: np.ndarray, hi: np.ndarray, c: np.ndarray, full: list
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Low-rank pass for the common case where the affine minimum lies in the box.

    With Ĥ = V̂V̂ᵀ (rank k, the pivoted factor in ``full``) and Σλ = 1, λᵀHλ = ‖V̂ᵀλ‖² − 1.
    The ones vector lies in the range of V̂ (Ĥ = H + 11ᵀ), say 1 = V̂t, so Σλ = tᵀV̂ᵀλ,
    and the smallest ‖u‖ with u = V̂ᵀλ, Σλ = 1 is u* = t/‖t‖²: the minimum of λᵀHλ on
    the affine hull. If some feasible λ has V̂ᵀλ = u*, every such λ is optimal (Hλ =
    V̂u* − 1 = (1/‖t‖² − 1)1 is constant, so no bound multiplier is needed). This pass
    looks for the one nearest c: the strongly convex problem min ½‖λ − c‖² over
    {V̂ᵀλ = u*, lo ≤ λ ≤ hi}, by primal-dual active-set iterations whose face systems are
    k × k (Gram matrix V̂_FᵀV̂_F of the free rows): λ_F = c_F + V̂_F a, with bound multipliers
    ν = λ − c − V̂a (≥ 0 at lower, ≤ 0 at upper bounds). It gives up as soon as the affine
    minimum is out of reach: when the first multiplier a separates u* from the image of
    the box-simplex (aᵀu* > max (V̂a)ᵀλ over it, a Farkas certificate, :func:`_separates`;
    on 3,000 stress instances of three families it settled 1,059 of the 1,284 failures
    there), when the first step leaves fewer than ``_AFF_MIN_FREE``·k coordinates free
    (125 more; no success had fewer than 1.5k), when the free rows cannot span (fewer than k, or a
    singular Gram matrix: the optimum then lies on a smaller face), on a repeated set and
    after ``_AFF_MAX_ITER`` iterations. Its answer stands if the gradient is flat on the
    face to ``_TOL_MULT`` (on 328 stress instances the largest spread was 2e-15);
    otherwise, as the normal equations square the conditioning, the face is solved again
    exactly by :func:`_face_solution`. Returns (λ, state, ok); the caller's KKT check
    certifies the answer.
    """
    m = H.shape[0]
    cf, piv, k = full[0]
    state = np.zeros(m)
    if k >= m:
        return c, state, False
    V = _shared_factor(Hh, full)
    Vt = V.T
    # 1 = V̂t: the leading k pivot rows of V̂ are the triangular L_11
    t, info = lapack.dtrtrs(cf[:k, :k], _ones(k), lower=1)
    if info != 0:
        return c, state, False
    ustar = t / float(t.dot(t))
    seen = {state.tobytes()}
    x = c
    fi = VF = None
    for it in range(_AFF_MAX_ITER):
        if it == 0:  # every coordinate free
            x = c.copy()
            VF = V
        else:
            key = state.tobytes()
            fi = (state == 0.0).nonzero()[0]
            if key in seen or fi.size < k:
                return x, state, False
            seen.add(key)
            x = np.where(state < 0.0, lo, hi)
            x[fi] = c.take(fi)  # x = (λ_B, c_F)
            VF = V.take(fi, 0)
        M = np.dot(VF.T, VF)
        L, info = lapack.dpotrf(M, lower=1, clean=0)
        if info != 0 or float(L.diagonal().min()) ** 2 <= _TOL_RANK * float(M.diagonal().max()):
            return x, state, False
        a, _info = lapack.dpotrs(L, ustar - np.dot(Vt, x), lower=1)
        va = np.dot(V, a)
        if it == 0:
            if _separates(a, va, ustar, lo, hi):
                return x, state, False
            x += va
        else:
            x[fi] += va.take(fi)
        nu = x - c
        nu -= va
        new = np.where(state * nu > _TOL_MULT, 0.0, state)
        new[x < lo] = -1.0
        new[x > hi] = 1.0
        if it == 0 and np.count_nonzero(new == 0.0) < _AFF_MIN_FREE * k:
            return x, new, False
        if not np.count_nonzero(new != state):
            break
        state = new
    else:
        return x, state, False
    if _kkt_error(H, x, state) <= _TOL_MULT:
        return x, state, True  # the normal equations were accurate enough
    xe, ind, _th = _face_solution(H, Hh, lo, hi, state, x, pivoted=True, full=full)
    xi = xe.take(ind)
    if np.count_nonzero(xi < lo.take(ind)) or np.count_nonzero(xi > hi.take(ind)):
        return x, state, False
    return xe, state, True


def _ipm_face(
    H: np.ndarray, Hh: np.ndarray, lo: np.ndarray, hi: np.ndarray, full: list | None = None,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Interior-point pass: identify the optimal face, then solve it exactly.

    Mehrotra's predictor-corrector method on ½λᵀHλ over {lo ≤ λ ≤ hi, Σλ = 1} with
    slacks s = (λ − lo, hi − λ) > 0 and bound multipliers z = (z_lo, z_hi) > 0 (an
    infinite upper bound is replaced by 2, which λ ≤ 1 never reaches). Each iteration
    solves the Newton system (H + D) dλ − 1 dθ = b, 1ᵀdλ = r_p, D = z_lo/s_lo + z_hi/s_hi,
    with Ĥ = H + 11ᵀ = VVᵀ in factored form (:func:`_low_rank_factor`, rank k; on
    Σλ = 1 the objective only shifts by ½, and θ by 1) by the Woodbury
    identity (VVᵀ + D)⁻¹ = D⁻¹ − D⁻¹V (I_k + VᵀD⁻¹V)⁻¹ VᵀD⁻¹: one k × k Cholesky
    factorisation and two solves (predictor, corrector) per iteration. The iteration count
    does not grow with m or with the size of the optimal face, unlike the active-set
    finish, whose steps each add or drop one coordinate.

    Face identification (Tapia indicators): a slack that the predictor step would cut by
    more than half while its multiplier keeps more than half marks an active bound; the
    other coordinates are free. Once this guess changes in at most two coordinates from
    one iteration to the next, or has no more free coordinates
    than a non-degenerate optimal face can have (rank + 1), :func:`_face_repair` solves the
    guessed face exactly, with up to ``_IPM_MAX_REPAIR`` single-coordinate corrections; a
    failed guess lets the iterations go on, up to ``_IPM_MAX_TRIES`` guesses and
    ``_IPM_MAX_ITER`` iterations. ``full`` holds the pivoted factorisation of Ĥ
    that :func:`_pdas` already computed, if any (it is computed and kept there otherwise,
    and the face solves reuse it when the guessed face is every coordinate). Returns (λ, state, ok); the caller's KKT check
    certifies the answer.
    """
    m = H.shape[0]
    if full is None:
        full = []
    if not full:  # the pivoted factorisation of the whole Ĥ, kept for the face solves
        _face_factor(Hh, np.arange(m), True, full)
    V = _shared_factor(Hh, full)
    k = V.shape[1]
    Vt = np.ascontiguousarray(V.T)
    dot = np.dot  # np.dot dispatches faster than @ on these small operands
    m2 = 2 * m
    hb = np.minimum(hi, 2.0)
    w = hb - lo
    v = np.empty(2 * m2)  # (s_lo, s_hi, z_lo, z_hi)
    s, z = v[:m2], v[m2:]
    sl = s[:m]  # = λ − lo: λ itself is never stored
    one = _ones(m)
    sl[:] = ((1.0 - float(lo.dot(one))) / float(w.dot(one))) * w
    np.subtract(w, sl, out=s[m:])
    ulo = dot(Vt, lo)
    B = np.empty((2, m))  # right-hand sides as rows: (predictor θ − g, 1)
    B[1] = 1.0
    g = dot(V, dot(Vt, sl) + ulo)
    th = float(g.dot(one)) / m
    z.fill(_IPM_Z0 * max(1e-2, float(np.abs(g - th).max())))
    dv = np.empty(2 * m2)
    ds, dz = dv[:m2], dv[m2:]
    dx = ds[:m]
    ratio = np.empty(2 * m2)
    rs, rz = ratio[:m2], ratio[m2:]
    r2 = ratio.reshape(2, m2)
    v2, dv2 = v.reshape(2, m2), dv.reshape(2, m2)
    step = np.empty((2, 1))  # (α_p, α_d)
    minimum = np.minimum.reduce
    eye = np.zeros((k, k))
    eye.flat[:: k + 1] = 1.0
    inv = 1.0 / m2
    rsum = 1.0 - float(lo.dot(one))  # Σλ = 1  ⇔  Σ s_lo = 1 − Σ lo
    prev: np.ndarray | None = None
    tries = 0
    state = np.zeros(m)
    for it in range(_IPM_MAX_ITER):
        # the residual of the dual equation, g − z_lo + z_hi − θ, never needs forming:
        # eliminating dz from the Newton system leaves the right-hand side θ − g plus the
        # complementarity terms (z_lo and z_hi cancel)
        np.subtract(th, g, out=B[0])
        rp = rsum - float(sl.dot(one))
        mu = float(dot(s, z)) * inv
        zs = z / s
        Di = zs[:m] + zs[m:]
        np.divide(1.0, Di, out=Di)
        np.negative(zs, out=zs)  # from here zs = −z/s
        VDt = Vt * Di  # Vᵀ D⁻¹ (k × m)
        C = dot(VDt, V)
        C += eye
        Lc, info = lapack.dpotrf(C, lower=1, clean=0)
        if info != 0:
            break
        # predictor (affine scaling, target μ = 0): (Ĥ + D) dλ − dθ 1 = θ − g
        W = B * Di  # D⁻¹ (b, 1), as rows
        t, _info = lapack.dpotrs(Lc, dot(VDt, B.T), lower=1)
        W -= dot(t.T, VDt)
        y, zz = W[0], W[1]
        sy, szz = dot(W, one).tolist()
        np.multiply(zz, (rp - sy) / szz, out=dx)
        dx += y
        np.negative(dx, out=ds[m:])
        np.multiply(zs, ds, out=dz)
        dz -= z  # dz = −z − (z/s)·ds
        np.divide(dv, v, out=ratio)
        if it >= 2:
            # Tapia: active where s_aff/s < ½ and z_aff/z > ½ (the lower bounds first)
            act = rs < -0.5
            act &= rz > -0.5
            # guess when it has settled, or when its free set is no larger than a
            # non-degenerate optimal face can be (rank + 1 affinely independent points)
            if prev is not None and (
                int(np.count_nonzero(act != prev)) <= 2
                or m - int(np.count_nonzero(act)) <= k
            ):
                tries += 1
                new = act[m:] * 1.0
                new -= act[:m]
                xe, st, ok = _face_repair(H, Hh, lo, hi, new, sl + lo, full)
                if ok:
                    return xe, st, True
                if tries >= _IPM_MAX_TRIES:
                    break
            prev = act
        tp, td = minimum(r2, axis=1)
        ap = 1.0 if tp >= -1.0 else -1.0 / tp
        ad = 1.0 if td >= -1.0 else -1.0 / td
        mu_aff = (
            mu * m2 + ad * float(dot(s, dz)) + ap * float(dot(ds, z))
            + ap * ad * float(dot(ds, dz))
        ) * inv
        smu = (mu_aff / mu) ** 3 * mu
        # corrector: complementarity target σμ and the second-order term ds∘dz enter as
        # q = (ds∘dz − σμ)/s; right-hand side θ − g + q_hi − q_lo
        q = ds * dz
        q -= smu
        q /= s
        b = q[m:] - q[:m]
        b += B[0]
        b *= Di
        t, _info = lapack.dpotrs(Lc, dot(Vt, b), lower=1)
        b -= dot(t, VDt)
        dth = (rp - float(b.dot(one))) / szz
        b += dth * zz
        ds[:m] = b
        np.negative(b, out=ds[m:])
        np.multiply(zs, ds, out=dz)
        dz -= z
        dz -= q  # dz = −z − q − (z/s)·ds
        np.divide(dv, v, out=ratio)
        tp, td = minimum(r2, axis=1)
        step[0, 0] = 0.995 if tp >= -1.0 else -0.995 / tp
        step[1, 0] = ad = 0.995 if td >= -1.0 else -0.995 / td
        dv2 *= step
        v2 += dv2  # s += α_p ds, z += α_d dz
        th += ad * dth
        g = dot(V, dot(Vt, sl) + ulo)
    return sl + lo, state, False

def _lmo_vertex(g: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A vertex minimising gᵀλ over {lo ≤ λ ≤ hi, Σλ = 1}: fill the smallest g_i first.

    Starting from λ = lo, the remaining mass 1 − Σlo goes to the coordinates in increasing
    order of g (stable sort, so ties go to the smaller index), each up to its upper bound;
    the coordinate that takes the last piece is the one free coordinate of the vertex.
    """
    m = g.size
    x = lo.copy()
    state = np.full(m, -1.0)
    rest = 1.0 - float(lo.sum())
    order = np.argsort(g, kind="stable")
    csum = np.cumsum((hi - lo)[order])
    k = min(int(np.searchsorted(csum, rest, side="left")), m - 1)
    full = order[:k]
    x[full] = hi[full]
    state[full] = 1
    j = int(order[k])
    x[j] = min(lo[j] + (rest - (float(csum[k - 1]) if k else 0.0)), hi[j])
    state[j] = 0
    return x, state


class _Face:
    """Inverse of the bordered face matrix K_F = [[0, 1ᵀ], [1, H_FF]] for the free list F.

    K_F is non-singular exactly when the points of F are affinely independent. Its inverse
    is kept in a preallocated buffer (border first, then F in list order) and updated as
    coordinates enter and leave: adding j borders it with the Schur complement
    κ = H_jj − k_jᵀ K_F⁻¹ k_j, k_j = (1, H_Fj); removing the coordinate in position k is
    the rank-one downdate K⁻¹ − K⁻¹_{:q} K⁻¹_{q:}/K⁻¹_qq (q = k + 1) followed by moving the
    last position into q. Both are O(|F|²).
    """

    def __init__(self, H: np.ndarray, fi: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        m = H.shape[0]
        self.H = H
        self.lo_all, self.hi_all = lo, hi
        self.buf = np.empty((m + 1, m + 1))
        self.idx = np.empty(m, dtype=np.intp)
        self.lo = np.empty(m)  # lo and hi of F, in the order of idx (for the ratio tests)
        self.hi = np.empty(m)
        self.f = fi.size
        self.idx[: self.f] = fi
        self.lo[: self.f] = lo.take(fi)
        self.hi[: self.f] = hi.take(fi)
        self.valid = True
        self.refactor()

    def refactor(self) -> None:
        """Recompute K_F⁻¹ from scratch (clears the rounding the updates accumulated)."""
        f = self.f
        fi = self.idx[:f]
        K = np.empty((f + 1, f + 1))
        K[0, 0] = 0.0
        K[0, 1:] = 1.0
        K[1:, 0] = 1.0
        K[1:, 1:] = self.H.take(fi, 0).take(fi, 1)
        lu, piv, _info = lapack.dgetrf(K)
        inv, _info = lapack.dgetri(lu, piv)
        self.buf[: f + 1, : f + 1] = inv
        self.valid = True

    def add(self, j: int, u: np.ndarray, kappa: float) -> None:
        """Append j, given u = K_F⁻¹ k_j and its Schur complement κ.

        A κ at rounding level means the enlarged face is numerically singular: j is
        appended but the inverse is marked invalid (the caller then takes safe steps).
        """
        n = self.f + 1
        B = self.buf
        self.idx[self.f] = j
        self.lo[self.f] = self.lo_all[j]
        self.hi[self.f] = self.hi_all[j]
        if n == 1:  # F = {j}: K⁻¹ = [[−H_jj, 1], [1, 0]]
            B[:2, :2] = ((-self.H[j, j], 1.0), (1.0, 0.0))
            self.valid = True
            self.f = 1
            return
        if not self.valid or kappa <= _TOL_CURV:
            self.valid = False
            self.f = n
            return
        w = u / kappa
        B[:n, :n] += np.multiply.outer(u, w)
        w *= -1.0
        B[:n, n] = w
        B[n, :n] = w
        B[n, n] = 1.0 / kappa
        self.f = n

    def remove(self, k: int) -> None:
        """Drop the coordinate in position k of F."""
        n = self.f + 1
        q = k + 1
        last = n - 1
        self.idx[k] = self.idx[last - 1]
        self.lo[k] = self.lo[last - 1]
        self.hi[k] = self.hi[last - 1]
        self.f -= 1
        if not self.valid or self.f == 0:
            return
        B = self.buf
        col = B[:n, q].copy()
        B[:n, :n] -= np.multiply.outer(col, col / col[q])
        if q != last:
            B[q, :last] = B[last, :last]
            B[:last, q] = B[:last, last]
            B[q, q] = B[last, last]


def _safe_face_step(
    Hh: np.ndarray, fi: np.ndarray, gF: np.ndarray
) -> tuple[np.ndarray, bool]:
    """Backward-stable face step by a fresh pivoted Cholesky factorisation of Ĥ_FF.

    Returns (p, is_ray). If Ĥ_FF has full numerical rank, p is the Newton step to the face
    minimiser, p = −Ĥ_FF⁻¹ g_F + ν Ĥ_FF⁻¹1 with Σp = 0. Otherwise a coordinate q is
    (numerically) affinely dependent on the others, and p is the null direction
    n = e_q − Ĥ_{F₁F₁}⁻¹ Ĥ_{F₁q} (Σn = 0, curvature nᵀHn below ``_TOL_SAFE``), oriented so
    that gᵀn ≤ 0: moving along it changes the objective only by that curvature, and the
    ratio test takes it to a bound, which removes the dependency.
    """
    c, piv, k, _info = lapack.dpstrf(Hh.take(fi, 0).take(fi, 1), tol=_TOL_SAFE, lower=1)
    piv = piv[: fi.size] - 1
    L = c[:k, :k]
    if k == fi.size:
        rhs = np.empty((k, 2))
        rhs[:, 0] = gF[piv]
        rhs[:, 1] = 1.0
        sol, _info = lapack.dpotrs(L, rhs, lower=1)
        y, z = sol[:, 0], sol[:, 1]
        p = np.empty(k)
        p[piv] = (float(y.sum()) / float(z.sum())) * z - y
        return p, False
    ind, q = piv[:k], int(piv[k])
    w, _info = lapack.dpotrs(L, Hh[fi[ind], fi[q]], lower=1)
    p = np.zeros(fi.size)
    p[q] = 1.0
    p[ind] = -w
    if float(gF @ p) > 0.0:
        p = -p
    return p, True


def _ratio_test(
    x: np.ndarray, p: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[float, int]:
    """Largest α ≥ 0 with lo ≤ x + αp ≤ hi, and the (first) blocking position."""
    t = np.empty(p.size)
    t.fill(np.inf)
    np.divide(np.where(p < 0.0, lo, hi) - x, p, out=t, where=p != 0.0)
    k = int(t.argmin())
    return max(float(t[k]), 0.0), k


def _ratio_fast(
    x: np.ndarray, p: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[float, int]:
    """:func:`_ratio_test` in five numpy calls (needs ``np.errstate(divide, invalid)``).

    Division by p_i = 0 gives +inf when x_i is inside its box; a NaN (p_i = 0 with x_i on
    the bound) or a negative ratio (x_i outside its box by rounding) falls back to
    :func:`_ratio_test`, so both return the same answer.
    """
    t = np.where(p < 0.0, lo, hi)
    t -= x
    t /= p
    k = int(t.argmin())
    tk = float(t[k])
    if tk >= 0.0:  # False for NaN
        return tk, k
    return _ratio_test(x, p, lo, hi)


def _active_set(
    H: np.ndarray,
    Hh: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    x: np.ndarray,
    state: np.ndarray,
    bland: bool = False,
) -> bool:
    """Inertia-controlling primal active-set method from a feasible x (in place).

    Requires the free set F = {i : state_i = 0} to be non-empty and affinely independent
    (K_F non-singular), which a vertex (one free coordinate) always is; it stays so, so
    only non-singular systems are ever solved, however singular H is (Gill, Murray,
    Saunders & Wright, "Inertia-controlling methods for general quadratic programming",
    SIAM Review 33, 1991; Nocedal & Wright, §16.5). One iteration either

    * (not at the minimiser of the face) takes the Newton step to the face minimiser,
      (ν, p) = −K_F⁻¹ (0, g_F), cut at the first bound it crosses (that coordinate joins
      the bound set); or
    * (at the face minimiser, g_F = θ1) checks the bound multipliers s_i = g_i − θ
      (≥ 0 at lower, ≤ 0 at upper bounds) and frees the most violated j (the first
      violated one with ``bland``). Moving x_j off its bound by t while keeping g_F flat
      on F is the direction d = (±1 at j, ∓u_F on F), u = K_F⁻¹ (1, H_Fj); along it the
      slope is −|s_j| and the curvature is the Schur complement κ = H_jj − (1, H_Fj)ᵀu
      ≥ 0. If κ > 0 the line minimum t* = |s_j|/κ is the minimiser of the enlarged face
      and j joins F unless a bound comes first; if κ = 0 (j affinely dependent on F) the
      objective decreases linearly and the step runs to the first bound, which is exact,
      and the blocking coordinate leaves F, so F stays independent.

    Every step decreases the objective or (degenerate, zero step) changes the sets; the
    method stops at a KKT point, a global minimiser of the convex problem. When a full
    Newton step leaves g_F visibly non-flat (an ill-conditioned face), the step is redone
    with :func:`_safe_face_step`. Returns False if it did not stop within its iteration
    budget (the caller restarts it with Bland's rule).
    """
    m = H.shape[0]
    face = _Face(H, (state == 0).nonzero()[0], lo, hi)
    B = face.buf
    idx = face.idx
    flo, fhi = face.lo, face.hi
    kvec = np.ones(m + 1)  # k_j = (1, H_Fj) of the entering coordinate
    g = H @ x
    at_min = face.f == 1
    refine = 0
    for _ in range(20 * m + 200):
        f = face.f
        Fi = idx[:f]
        if not at_min and f == 1:  # a single free coordinate is its face's minimiser
            if not face.valid:
                face.refactor()
            at_min = True
        if not at_min:
            HF = H.take(Fi, 0)
            gF = HF @ x  # fresh: repeated steps are iterative refinement
            ray = False
            if refine or not face.valid:
                p, ray = _safe_face_step(Hh, Fi, gF)
                if not ray and not face.valid:
                    face.refactor()
            else:
                p = B[1 : f + 1, 1 : f + 1] @ gF
                p *= -1.0
            alpha, k = _ratio_fast(x.take(Fi), p, flo[:f], fhi[:f])
            full = alpha >= 1.0 and not ray
            up = bool(p[k] > 0.0)  # the direction of the blocking coordinate (before scaling)
            if not full:
                p *= alpha
            x[Fi] += p
            g += p @ HF
            if full:
                gF = g.take(Fi)
                refine += 1
                at_min = float(gF.max() - gF.min()) <= _TOL_MULT or refine > _REFINE_MAX
                if at_min:
                    refine = 0
            else:
                _to_bound(x, state, int(Fi[k]), up, lo, hi)
                face.remove(k)
                refine = 0
                at_min = face.f == 1 and face.valid
            continue
        viol = g - g[idx[0]]  # s = g − θ (g is flat on F); violation s·state > 0
        viol *= state
        if bland:
            cand = (viol > _TOL_MULT).nonzero()[0]
            j = int(cand[0]) if cand.size else 0
        else:
            j = int(viol.argmax())
        vj = float(viol[j])  # = |s_j| when positive
        if vj <= _TOL_MULT:
            g = H @ x  # confirm with a fresh gradient (the updated one drifts)
            s = g - float(g.take(Fi).sum()) / f
            s *= state
            if float(s.max()) <= _TOL_MULT:
                return True
            continue
        sign = -state[j]  # +1: j leaves its lower bound upwards, −1: its upper bound downwards
        n = f + 1
        kj = kvec[:n]
        H[j].take(Fi, out=kj[1:])
        u = B[:n, :n] @ kj
        kappa = float(H[j, j]) - float(kj @ u)
        d = np.empty(n)  # the move of (F, j) per unit move of x_j off its bound
        dF = d[:f]
        np.multiply(u[1:], -sign, out=dF)
        d[f] = sign
        size = 2.0 + float(np.add.reduce(np.abs(dF)))  # 1 + ‖d‖₁
        t_star = vj / kappa if kappa > _TOL_CURV * size * size else math.inf
        t_max, k = _ratio_fast(x.take(Fi), dF, flo[:f], fhi[:f])
        if hi[j] - lo[j] < t_max:
            t_max, k = float(hi[j] - lo[j]), -1
        step = min(t_star, t_max)
        up = k >= 0 and bool(dF[k] > 0.0)  # the blocking coordinate's direction (before scaling)
        idx[f] = j  # F and j together, for one gather
        S = idx[:n]
        d *= step
        x[S] += d
        g += d @ H.take(S, 0)
        if t_star <= t_max:  # reached the minimiser of the enlarged face
            face.add(j, u, kappa)
            state[j] = 0.0
            continue
        if k < 0:
            # j crossed its box: it moves to the other bound and F is unchanged; d kept g_F
            # flat, so F is still at its face minimiser (at_min stays True)
            _to_bound(x, state, j, sign > 0.0, lo, hi)
            continue
        at_min = False
        _to_bound(x, state, int(Fi[k]), up, lo, hi)
        face.remove(k)
        f = face.f
        kj = kvec[: f + 1]
        H[j].take(idx[:f], out=kj[1:])
        u = B[: f + 1, : f + 1] @ kj
        face.add(j, u, float(H[j, j]) - float(kj @ u))
        state[j] = 0.0
    return False


def _to_bound(
    x: np.ndarray, state: np.ndarray, i: int, up: bool, lo: np.ndarray, hi: np.ndarray
) -> None:
    """Put coordinate i on its upper (``up``) or lower bound."""
    if up:
        x[i] = hi[i]
        state[i] = 1.0
    else:
        x[i] = lo[i]
        state[i] = -1.0



def _polish(H: np.ndarray, Hh: np.ndarray, lo: np.ndarray, hi: np.ndarray,
            x: np.ndarray, state: np.ndarray) -> None:
    """Re-solve the final face from scratch (one Cholesky) to remove accumulated rounding.

    The fresh face solution replaces x_F when it stays inside the box (up to rounding, which
    is clipped); otherwise x is left as it is.
    """
    fi = (state == 0).nonzero()[0]
    if fi.size < 2:
        return
    c, info = lapack.dpotrf(Hh.take(fi, 0).take(fi, 1), lower=1, clean=0)
    if info != 0:
        return
    xb = x.copy()
    xb[fi] = 0.0
    rhs = np.empty((fi.size, 2))
    rhs[:, 0] = -(H.take(fi, 0) @ xb)
    rhs[:, 1] = 1.0
    sol, _info = lapack.dpotrs(c, rhs, lower=1)
    y, z = sol[:, 0], sol[:, 1]
    xf = y - ((float(y.sum()) - (1.0 - float(xb.sum()))) / float(z.sum())) * z
    lof, hif = lo[fi], hi[fi]
    if np.all(np.isfinite(xf)) and np.all(xf >= lof - 1e-13) and np.all(xf <= hif + 1e-13):
        x[fi] = np.clip(xf, lof, hif)


def _fix_sum(x: np.ndarray, state: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """Move the rounding drift of Σx into the largest free coordinate (clipped to its box).

    One correction: what remains is below half the float spacing at that coordinate.
    Returns the final Σx, summed exactly (``math.fsum``).
    """
    total = math.fsum(x.tolist())
    if total == 1.0:
        return total
    free = (state == 0).nonzero()[0]
    if free.size == 0:
        return total
    j = int(free[x.take(free).argmax()])
    x[j] = min(max(float(x[j]) + (1.0 - total), float(lo[j])), float(hi[j]))
    return math.fsum(x.tolist())


def _feasible(x: np.ndarray, total: float, lo: np.ndarray, hi: np.ndarray) -> bool:
    """Σx = 1 to 1e-13 (``total`` summed exactly) and lo ≤ x ≤ hi exactly."""
    return abs(total - 1.0) <= 1e-13 and not (np.count_nonzero(x < lo) or np.count_nonzero(x > hi))


def _kkt_error(H: np.ndarray, x: np.ndarray, state: np.ndarray) -> float:
    """Largest KKT violation: spread of g = Hx on F plus wrong-signed bound multipliers."""
    g = H @ x
    gf = g[state == 0.0]
    s = g - float(gf.dot(_ones(gf.size))) / gf.size
    s *= state
    return max(float(gf.max() - gf.min()), float(s.max()))


def _solve_qp(H: np.ndarray, lo: np.ndarray, hi: np.ndarray, c: np.ndarray) -> np.ndarray:
    """min xᵀHx over {lo ≤ x ≤ hi, Σx = 1} for a scaled PSD H (max H_ii = 1), c feasible.

    :func:`_pdas` first; if it met singular faces without converging, then
    :func:`_affine_pass` (when _pdas left the pivoted factor of the whole Ĥ) and, for
    m ≤ 200, :func:`_ipm_face` and :func:`_pdas_low_rank`, in this order under an ε-box,
    else the other way round, until one converges (below m = ``_IPM_FIRST_M`` not the
    interior-point pass);
    when none gives a point that passes the KKT check,
    :func:`_active_set` from the vertex that minimises the linearisation at c (restarted
    with Bland's rule if it ever runs out of iterations), then :func:`_polish`. The answer
    is checked for feasibility and the KKT conditions before it is returned.
    """
    Hh = H + 1.0
    full: list = []  # the pivoted factor of Ĥ when _pdas computed one
    x, state, converged, singular = _pdas(H, Hh, lo, hi, c, full)
    m = H.shape[0]
    box = not np.isinf(hi).all()
    if singular and not converged and full and not (
        box and m >= _IPM_FIRST_M and full[0][2] >= _AFF_SKIP_RANK * m
        and float(np.add.reduce(np.minimum(hi, 1.0) - lo)) <= 2.0 * _AFF_SKIP_BOX
    ):
        # the affine-minimum pass first, at any m: it settles about half the low-rank
        # inputs at k × k cost and mostly gives up after one iteration otherwise (placed
        # after the interior-point pass, 400 tight-box stress instances took 12% longer).
        # Skipped when the box is tight for the rank (total width Σ(hi − lo) ≤ 1, i.e.
        # ε ≤ 0.5/m around an inner centre, and rank ≥ 0.15m, m ≥ 20): there the affine
        # minimum was in reach for 1.2%, 0.4% and 8.3% of the ipm, mid and mixed stress
        # instances (500, 229 and 169 calls), so the attempt costs more than it saves
        x, state, converged = _affine_pass(H, Hh, lo, hi, c, full)
    if singular and not converged and m <= _REG_MAX_M:
        # low rank: the proximal pass is the cheaper one on the plain simplex and for small
        # m; under an ε-box its sets often oscillate (on random tight-box instances at
        # m = 20-60 it found the face on as few as 1 of 4 for some (m, rank)), while the
        # interior-point pass found it on all of them, so it goes first there
        if m < _IPM_FIRST_M:  # its fixed cost exceeds the active-set finish there
            passes: tuple = (_pdas_low_rank,)
        elif box:
            passes = (_ipm_face, _pdas_low_rank)
        else:
            passes = (_pdas_low_rank, _ipm_face)
        for low_rank_pass in passes:
            if low_rank_pass is _ipm_face:
                x, state, converged = _ipm_face(H, Hh, lo, hi, full)
            else:
                x, state, converged = _pdas_low_rank(H, Hh, lo, hi, c)
            if converged:
                break
    err = math.inf
    if converged:
        total = _fix_sum(x, state, lo, hi)
        err = _kkt_error(H, x, state)
    if err > _TOL_MULT * 10:
        x, state = _lmo_vertex(H @ c, lo, hi)
        with np.errstate(divide="ignore", invalid="ignore"):  # for _ratio_fast
            for bland in (False, True, True):
                if _active_set(H, Hh, lo, hi, x, state, bland):
                    break
        # the polished face solution replaces the active-set answer only if it is no
        # worse: with free coordinates sitting on a bound (degenerate faces) its clipping
        # can cost feasibility of Σλ = 1 beyond rounding
        x0 = x.copy()
        total0 = _fix_sum(x0, state, lo, hi)
        err0 = _kkt_error(H, x0, state)
        _polish(H, Hh, lo, hi, x, state)
        total = _fix_sum(x, state, lo, hi)
        err = _kkt_error(H, x, state)
        if (_feasible(x0, total0, lo, hi), -err0) > (_feasible(x, total, lo, hi), -err):
            x, total, err = x0, total0, err0
    infeasible = not _feasible(x, total, lo, hi)
    if err > _TOL_KKT or infeasible:
        raise RuntimeError(
            f"min_norm_weights: KKT check failed (residual {err:.3e} in units of max G_ii, "
            f"feasible: {not infeasible}); is gram positive semi-definite?"
        )
    return x


def min_norm_weights(
    gram: np.ndarray,
    eps: float | None = None,
    center: np.ndarray | Sequence[float] | None = None,
) -> np.ndarray:
    r"""Exact minimiser of λᵀGλ over the simplex intersected with an ∞-norm box.

    Solves the convex quadratic programme

    .. math::

        \min_{λ ∈ ℝ^m} λᵀ G λ \quad \text{s.t.} \quad Σ_i λ_i = 1,\;
        \max(0, c_i − ε) ≤ λ_i ≤ \min(1, c_i + ε),

    which is the FedMGDA+ weight problem (min-norm point of the convex hull of the
    updates when ``G`` is their Gram matrix). ``G`` only needs to be positive
    *semi*-definite: rank-deficient, duplicated, zero and exactly opposite updates are
    handled. The answer is exact up to rounding, certified by a KKT check
    (Gλ)_i = θ on free coordinates, (Gλ)_i ≥ θ at lower and ≤ θ at upper bounds.

    Algorithm (on G scaled to max G_ii = 1): a primal-dual active-set pass (a few
    Cholesky solves of face systems; affinely dependent coordinates are parked inside the
    box) settles well-conditioned and duplicated problems. If it met singular faces and did
    not converge (low-rank G), an affine-minimum pass looks for the feasible λ nearest c
    that attains the minimum of λᵀGλ over the whole affine hull Σλ = 1 (with
    G + 11ᵀ = V̂V̂ᵀ of rank k, a projection onto {V̂ᵀλ = u*} by active-set iterations on
    k × k systems; a Farkas certificate stops it early when no such λ exists; skipped
    under a box too tight for the rank). Then, for m ≤ 200, two passes guess the optimal
    face and solve it exactly: a Mehrotra predictor-corrector interior-point method on
    G = VVᵀ (pivoted Cholesky factor V, Woodbury solves of size rank(G), about 5–8
    iterations whatever the face), whose Tapia indicators give the face, corrected
    coordinate by coordinate; and the same primal-dual iteration on λᵀGλ + δ‖λ − c‖²
    (δ = 1e-9, positive definite faces), the affinely dependent coordinates parked at the
    proximal solution. Under an ε-box the interior-point pass comes next, otherwise the
    proximal one; below m = 20 the interior-point pass does not run. If
    none converges, or an answer fails the KKT check, an inertia-controlling primal
    active-set method starts
    from the vertex that minimises the linearisation at c: it keeps the free set affinely
    independent, so it factorises only non-singular systems (an inverse updated in
    O(|F|²) per step), and when freeing a coordinate meets zero curvature it steps to the
    next bound, which is exact for a positive semi-definite G. A final Cholesky solve on
    the optimal face removes accumulated rounding. When the minimiser is not unique
    (singular G), one of them is returned, deterministically (same input, same output).

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
        λ of shape (m,), float64, with Σλ = 1 (to rounding) and bounds satisfied exactly.

    Raises
    ------
    ValueError
        If ``gram`` is not square, symmetric, finite, or has a negative diagonal; if
        ``center`` is not on the simplex; if ``eps`` is not in [0, 1].

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
    if m == 1 or e == 0.0:
        return c.copy()
    scale = float(G.diagonal().max())
    if scale <= 0.0:  # PSD with zero diagonal: G = 0, every feasible point is optimal
        return c.copy()
    G *= 1.0 / scale
    if e is None:
        lo = np.zeros(m)
        hi = np.full(m, np.inf)
    else:
        lo = np.maximum(0.0, c - e)
        hi = np.minimum(1.0, c + e)
        hi[hi >= 1.0] = np.inf  # λ_i ≤ 1 is implied by λ ≥ 0 and Σλ = 1
    return _solve_qp(G, lo, hi, c)


# ---------------------------------------------------------------------------------------
# updates → matrix, Gram, normalisation, direction
# ---------------------------------------------------------------------------------------
def _check_updates(
    updates: Updates, float_mask: Sequence[bool] | None
) -> tuple[list[list[np.ndarray]] | None, np.ndarray | None, list[bool]]:
    """Validate ``updates``; return (layers, None, mask) for lists or (None, matrix, []) for 2-D."""
    if isinstance(updates, np.ndarray):
        if updates.ndim != 2 or updates.shape[0] == 0:
            raise ValueError(
                f"updates: a 2-D array of shape (m, d) with m >= 1 is expected, got {updates.shape}"
            )
        if not np.issubdtype(updates.dtype, np.floating):
            raise ValueError(
                f"updates: a 2-D array must have a floating dtype, got {updates.dtype}"
            )
        if float_mask is not None:
            raise ValueError("float_mask: only applies to updates given as lists of layers")
        return None, updates, []
    layers = [[np.asarray(a) for a in u] for u in updates]
    if len(layers) == 0:
        raise ValueError("updates: at least one client update is required (m >= 1)")
    ref = layers[0]
    if len(ref) == 0:
        raise ValueError("updates: each update must contain at least one array")
    for i, u in enumerate(layers):
        if len(u) != len(ref):
            raise ValueError(f"updates: update {i} has {len(u)} arrays, update 0 has {len(ref)}")
        for k, (a, r) in enumerate(zip(u, ref, strict=True)):
            if a.shape != r.shape:
                raise ValueError(
                    f"updates: array {k} of update {i} has shape {a.shape}, update 0 has {r.shape}"
                )
            if not np.issubdtype(a.dtype, np.number) or np.iscomplexobj(a):
                raise ValueError(
                    f"updates: array {k} of update {i} is not real numeric ({a.dtype})"
                )
    if float_mask is None:
        mask = [bool(np.issubdtype(a.dtype, np.floating)) for a in ref]
    else:
        mask = [bool(b) for b in float_mask]
        if len(mask) != len(ref):
            raise ValueError(
                f"float_mask: must have one entry per array ({len(ref)}), got {len(mask)}"
            )
    return layers, None, mask


def _stack(layers: list[list[np.ndarray]], mask: list[bool]) -> np.ndarray:
    """One (m × d) copy of the masked layers, in their common floating dtype (≥ float32)."""
    ref = layers[0]
    idx = [k for k, f in enumerate(mask) if f]
    d = sum(int(ref[k].size) for k in idx)
    dtype = np.result_type(np.float32, *[ref[k].dtype for k in idx]) if idx else np.float64
    if not np.issubdtype(dtype, np.floating):
        dtype = np.dtype(np.float64)
    X = np.empty((len(layers), d), dtype=dtype)
    for i, u in enumerate(layers):
        off = 0
        for k in idx:
            n = int(u[k].size)
            X[i, off : off + n] = u[k].reshape(-1)
            off += n
    return X


_TORCH_MIN_SIZE = 1 << 22  # m·d above which "auto" uses torch on CUDA when present
_BLOCK_COLS = 1 << 16  # columns per block of the blocked CPU products
PRECISIONS = ("float64", "float32")


def _check_backend_precision(backend: str, precision: str) -> None:
    if backend not in ("auto", "numpy", "torch"):
        raise ValueError(f"backend: must be 'auto', 'numpy' or 'torch', got {backend!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: must be 'float64' or 'float32', got {precision!r}")


def _psd_repair(G: np.ndarray) -> np.ndarray:
    """Clip the (rounding-size) negative eigenvalues of a symmetric G to 0 (one m×m eigh)."""
    w, V = np.linalg.eigh(G)
    if w[0] >= 0.0:
        return G
    w = np.maximum(w, 0.0)
    out = (V * w) @ V.T
    return 0.5 * (out + out.T)


def _gram_of_matrix(X: np.ndarray, backend: str, precision: str = "float64") -> np.ndarray:
    """G = X Xᵀ in float64 (see :func:`gram_matrix` for the backends and precisions)."""
    _check_backend_precision(backend, precision)
    m, d = X.shape
    import torch

    use_cuda = backend in ("torch", "auto") and torch.cuda.is_available()
    if backend == "auto" and m * d < _TORCH_MIN_SIZE:
        use_cuda = False
    if use_cuda:
        t = torch.from_numpy(np.ascontiguousarray(X)).to("cuda")
        t = t.to(torch.float64) if precision == "float64" else t.to(torch.float32)
        G = (t @ t.T).to(torch.float64).cpu().numpy()
    elif backend == "numpy":
        if X.dtype == np.float64 and precision == "float64":
            G = X @ X.T
        else:  # column blocks: float64 products, or float32 products summed in float64
            G = np.zeros((m, m))
            work = np.float64 if precision == "float64" else np.float32
            for j in range(0, d, _BLOCK_COLS):
                B = X[:, j : j + _BLOCK_COLS].astype(work, copy=False)
                G += (B @ B.T).astype(np.float64, copy=False)
    else:
        # CPU through torch's matmul (no OpenBLAS thread oversubscription on a loaded box), in
        # column blocks: float64 products ("float64"; one converted block of extra memory) or
        # float32 products summed in float64 ("float32").
        T = torch.from_numpy(np.ascontiguousarray(X))
        acc = torch.zeros((m, m), dtype=torch.float64)
        for j in range(0, d, _BLOCK_COLS):
            B = T[:, j : j + _BLOCK_COLS]
            if precision == "float64":
                B = B.to(torch.float64)
                acc.addmm_(B, B.T)
            else:
                B = B.to(torch.float32)
                acc += (B @ B.T).to(torch.float64)
        G = acc.numpy()
    G = 0.5 * (G + G.T)
    if precision == "float32" and m > 1:
        G = _psd_repair(G)
    return G


def combine_rows(X: np.ndarray, coef: np.ndarray | Sequence[float]) -> np.ndarray:
    r"""The weighted sum of the rows of X, ``Σ_i coef_i X_i``, in X's dtype.

    One matrix-vector product through torch on the CPU (no OpenBLAS thread
    oversubscription on a busy machine); the weights are cast to X's dtype.

    Parameters
    ----------
    X : np.ndarray of shape (m, d)
        Floating rows (e.g. stacked client updates).
    coef : array of shape (m,)
        Weights (e.g. λ_i/‖g_i‖).

    Returns
    -------
    np.ndarray of shape (d,)

    Examples
    --------
    >>> combine_rows(np.array([[1.0, 2.0], [3.0, 4.0]]), [0.5, 0.5])
    array([2., 3.])
    """
    import torch

    X = np.asarray(X)
    c = np.asarray(coef, dtype=np.float64)
    if X.ndim != 2 or c.shape != (X.shape[0],):
        raise ValueError(f"coef: must have shape ({X.shape[0] if X.ndim == 2 else '?'},) to match X rows, "
                         f"got {c.shape} for X of shape {X.shape}")
    if X.shape[1] == 0:
        return np.zeros(0, dtype=X.dtype)
    T = torch.from_numpy(np.ascontiguousarray(X))
    return (torch.from_numpy(c.astype(X.dtype)) @ T).numpy()


def gram_matrix(
    updates: Updates,
    *,
    float_mask: Sequence[bool] | None = None,
    backend: Literal["auto", "numpy", "torch"] = "auto",
    precision: Literal["float64", "float32"] = "float64",
) -> np.ndarray:
    r"""Gram matrix of per-client updates, G_ij = ⟨g_i, g_j⟩.

    The updates are stacked once into an (m × d) matrix X (no copy when ``updates`` is
    already a 2-D array; one copy in the layers' own floating dtype otherwise) and
    G = X Xᵀ is formed by matrix products over column blocks of 2¹⁶ columns, so the only
    extra memory is one block. ``precision="float64"`` (default) multiplies each block in
    float64; ``precision="float32"`` multiplies each block in float32 and sums the block
    products in float64 (relative error ≈ 1e-7 of max G_ii, the size of float32 rounding
    of the updates themselves; 4–5× faster on the CPU) and then clips the rounding-size
    negative eigenvalues of G to zero, so the result stays positive semi-definite.
    Backends: ``"numpy"`` (numpy's BLAS), ``"torch"`` (torch's matmul: the GPU when there
    is one, else the CPU, where it also avoids OpenBLAS thread oversubscription on a busy
    machine) and ``"auto"`` (torch; on the GPU for m·d ≥ 2²²). The result is
    symmetrised, (G + Gᵀ)/2.

    Parameters
    ----------
    updates : list of list of np.ndarray, or np.ndarray of shape (m, d)
        One update per client: the model's layers (same shapes for every client), or a
        floating 2-D array whose rows are the flattened updates.
    float_mask : sequence of bool or None (default: None)
        Which layers enter the inner product; ``None`` means the floating-point layers
        (integer buffers such as BatchNorm's ``num_batches_tracked`` are left out).
    backend : {"auto", "numpy", "torch"} (default: "auto")
        Matmul backend.
    precision : {"float64", "float32"} (default: "float64")
        Arithmetic of the block products (the block sums are always float64).

    Returns
    -------
    np.ndarray
        Symmetric PSD matrix of shape (m, m), float64.

    Examples
    --------
    >>> gram_matrix(np.array([[1.0, 0.0], [1.0, 1.0]]))
    array([[1., 1.],
           [1., 2.]])
    """
    layers, X, mask = _check_updates(updates, float_mask)
    if X is None:
        assert layers is not None
        X = _stack(layers, mask)
    return _gram_of_matrix(X, backend, precision)


def normalize_updates(
    updates: Updates, float_mask: Sequence[bool] | None = None
) -> tuple[list[list[np.ndarray]] | np.ndarray, np.ndarray]:
    r"""Scale each update to unit ℓ2 norm over its floating-point parameters.

    .. math::

        ĝ_i = g_i / ‖g_i‖_2 \quad (‖g_i‖ > 0), \qquad ĝ_i = g_i = 0 \quad (‖g_i‖ = 0),

    where ‖g_i‖² sums the squares of the masked (by default: floating) layers only, in
    float64. Unmasked layers (integer buffers such as ``num_batches_tracked``) are neither
    counted nor scaled: the same array objects are returned. A zero update stays zero, so
    no NaN appears. Floating layers keep their dtype.

    Parameters
    ----------
    updates : list of list of np.ndarray, or np.ndarray of shape (m, d)
        One update per client (layers of equal shapes), or a floating 2-D array.
    float_mask : sequence of bool or None (default: None)
        One flag per layer, True for layers that are normalised; ``None`` means
        ``np.issubdtype(layer.dtype, np.floating)``. Not allowed with a 2-D array.

    Returns
    -------
    normalized : list of list of np.ndarray, or np.ndarray
        Same structure as ``updates``.
    norms : np.ndarray
        ‖g_i‖ of shape (m,), float64 (0 for zero updates).

    Examples
    --------
    >>> u, n = normalize_updates(np.array([[3.0, 4.0], [0.0, 0.0]]))
    >>> u, n
    (array([[0.6, 0.8],
           [0. , 0. ]]), array([5., 0.]))
    """
    layers, X, mask = _check_updates(updates, float_mask)
    if X is not None:
        X64 = X.astype(np.float64, copy=False)
        norms = np.sqrt(np.einsum("ij,ij->i", X64, X64))
        inv = np.where(norms > 0.0, 1.0 / np.where(norms > 0.0, norms, 1.0), 1.0)
        return (X * inv[:, None]).astype(X.dtype, copy=False), norms
    assert layers is not None
    norms = np.zeros(len(layers))
    for i, u in enumerate(layers):
        sq = 0.0
        for a, f in zip(u, mask, strict=True):
            if f:
                v = a.reshape(-1).astype(np.float64, copy=False)
                sq += float(np.dot(v, v))
        norms[i] = math.sqrt(sq)
    if not np.all(np.isfinite(norms)):
        raise ValueError("updates: contain non-finite values (NaN or inf)")
    out: list[list[np.ndarray]] = []
    for u, n in zip(layers, norms, strict=True):
        s = 1.0 / n if n > 0.0 else 1.0
        out.append(
            [(a * s).astype(a.dtype, copy=False) if f else a for a, f in zip(u, mask, strict=True)]
        )
    return out, norms


def mgda_direction(
    updates: Updates,
    eps: float | None = None,
    center: np.ndarray | Sequence[float] | None = None,
    normalize: bool = True,
    *,
    float_mask: Sequence[bool] | None = None,
    backend: Literal["auto", "numpy", "torch"] = "auto",
    precision: Literal["float64", "float32"] = "float64",
) -> tuple[list[np.ndarray] | np.ndarray, np.ndarray]:
    r"""FedMGDA+ server direction: normalise, Gram, solve the ε-box QP, combine.

    .. math::

        ĝ_i = g_i/‖g_i‖,\quad G_{ij} = ⟨ĝ_i, ĝ_j⟩,\quad
        λ = \operatorname{argmin}_{λ∈Δ,\ ‖λ−c‖_∞≤ε} λᵀGλ,\quad d = Σ_i λ_i ĝ_i.

    The updates are stacked once (no copy for a 2-D array); the Gram matrix of the raw
    updates gives the norms ‖g_i‖ = √G_ii and the normalised Gram D⁻¹GD⁻¹ (D = diag‖g_i‖,
    zero updates get weight 0 in the combination), so the normalised updates are never
    materialised. The direction is one matrix-vector product (λ_i/‖g_i‖)ᵀX in the dtype of
    the stacked updates. Unmasked (integer) layers are combined unnormalised, Σλ_i g_i,
    rounded back to their integer dtype. The global step is then x ← x − η_t d.

    Parameters
    ----------
    updates : list of list of np.ndarray, or np.ndarray of shape (m, d)
        One update per client (g_i = x − x_i, the client's model change with sign such
        that the server subtracts it).
    eps : float or None (default: None)
        Box radius ε ∈ [0, 1] (None: no box, plain MGDA; 0: FedAvg of the normalised
        updates with weights ``center``).
    center : array of shape (m,) or None (default: None)
        Box centre on the simplex (e.g. data-size weights); None means uniform.
    normalize : bool (default: True)
        Normalise the updates first (FedMGDA+); False uses the raw updates.
    float_mask : sequence of bool or None (default: None)
        Layers that count as parameters (default: the floating layers).
    backend : {"auto", "numpy", "torch"} (default: "auto")
        Matmul backend of the Gram matrix, see :func:`gram_matrix`.
    precision : {"float64", "float32"} (default: "float64")
        Arithmetic of the Gram matrix's block products, see :func:`gram_matrix`.

    Returns
    -------
    direction : list of np.ndarray, or np.ndarray of shape (d,)
        d in the structure of one update (layer shapes and dtypes kept).
    lam : np.ndarray
        The weights λ of shape (m,).

    Examples
    --------
    >>> d, lam = mgda_direction(np.array([[2.0, 0.0], [0.0, 1.0]]))
    >>> d.round(6), lam.round(6)
    (array([0.5, 0.5]), array([0.5, 0.5]))
    """
    layers, X, mask = _check_updates(updates, float_mask)
    if not isinstance(normalize, bool | np.bool_):
        raise ValueError(f"normalize: must be a bool, got {normalize!r}")
    if X is None:
        assert layers is not None
        X = _stack(layers, mask)
    G = _gram_of_matrix(X, backend, precision)
    if not np.all(np.isfinite(G)):
        raise ValueError("updates: contain non-finite values (NaN or inf)")
    m = G.shape[0]
    if normalize:
        norms = np.sqrt(np.maximum(np.diag(G), 0.0))
        w = np.zeros(m)
        w[norms > 0.0] = 1.0 / norms[norms > 0.0]
        Gn = G * np.outer(w, w)
        Gn[np.diag_indices(m)] = (norms > 0.0).astype(np.float64)
    else:
        w = np.ones(m)
        Gn = G
    lam = min_norm_weights(Gn, eps=eps, center=center)
    coef = lam * w
    flat = combine_rows(X, coef)
    if layers is None:
        return flat, lam
    out: list[np.ndarray] = []
    off = 0
    for k, (a, f) in enumerate(zip(layers[0], mask, strict=True)):
        if f:
            n = int(a.size)
            piece = flat[off : off + n].reshape(a.shape)
            dt = a.dtype if np.issubdtype(a.dtype, np.floating) else X.dtype
            out.append(piece.astype(dt, copy=False))
            off += n
        else:
            acc = np.zeros(a.shape, dtype=np.float64)
            for li, u in zip(lam, layers, strict=True):
                acc += li * u[k]
            out.append(
                np.rint(acc).astype(a.dtype)
                if not np.issubdtype(a.dtype, np.floating)
                else acc.astype(a.dtype)
            )
    return out, lam


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
    if (
        isinstance(num_rounds, bool)
        or not isinstance(num_rounds, int | np.integer)
        or num_rounds < 1
    ):
        raise ValueError(f"num_rounds: must be an integer >= 1, got {num_rounds!r}")
    if not (isinstance(decay, int | float | np.floating) and 0.0 < float(decay) <= 1.0):
        raise ValueError(f"decay: must be in (0, 1], got {decay!r}")
    if not (
        isinstance(base_lr, int | float | np.floating)
        and math.isfinite(float(base_lr))
        and float(base_lr) > 0.0
    ):
        raise ValueError(f"base_lr: must be a finite float > 0, got {base_lr!r}")
    if isinstance(every, bool) or not isinstance(every, int | np.integer) or every < 1:
        raise ValueError(f"every: must be an integer >= 1, got {every!r}")
    beta = float(decay) ** (float(every) / int(num_rounds))
    return float(base_lr) * beta ** (int(round) // int(every))
