r"""The server steps of SCAFF-PD as pure functions of arrays (numpy only).

Y. Yu, S. P. Karimireddy, Y. Ma, M. I. Jordan, "Scaff-PD: Communication Efficient Fair
and Robust Federated Learning", 2023, https://arxiv.org/abs/2307.13381 (Algorithm 1:
accelerated primal-dual server loop; Conditions 5.1 and 5.2: step sizes).

Problem, over N clients with losses f_i and weights λ ∈ Λ:

.. math::

    \min_x \max_{\lambda \in \Lambda}\ \sum_i \lambda_i f_i(x) - \psi(\lambda),

with ``"chi2"``: ψ(λ) = (ρ/2N) Σ_i (Nλ_i − 1)², Λ = Δ_N; ``"afl"``: ψ = 0, Λ = Δ_N;
``"cvar"``: ψ = 0, Λ = {λ ∈ Δ_N : λ_i ≤ 1/(αN)}.

One round r uses, in this order: :func:`extrapolate` (s^r), :func:`dual_step` or
:func:`dual_step_on` (λ^{r+1}), :func:`weighted_sum` (c^r = Σ_i λ_i^{r+1} c_i),
:func:`local_direction` (Δu_i) and :func:`primal_step` (x^{r+1}); the step sizes come
from :func:`auto_theta` (rule 5.2) or :func:`next_steps` (rule 5.1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from flowerdro.core.simplex import _as_vector, project_capped_simplex, project_simplex

__all__ = [
    "OBJECTIVES",
    "StepSizes",
    "auto_theta",
    "dual_step",
    "dual_step_on",
    "extrapolate",
    "local_direction",
    "next_steps",
    "primal_step",
    "weighted_sum",
]

#: The DRO objectives (ψ, Λ) SCAFF-PD supports.
OBJECTIVES: tuple[str, ...] = ("chi2", "afl", "cvar")

# λ comes from earlier rounds and floating-point projections: "on the simplex" is checked
# to this absolute tolerance, far above the float64 rounding of a sum of N ≤ 1e6 terms.
_SIMPLEX_ATOL = 1e-6
# Below this total weight the active clients are treated as having none (1e-300 is far
# above the float64 underflow threshold 2.2e-308 and below any weight a step can produce).
_TINY_MASS = 1e-300

StepSizes = tuple[float, float, float, float]


def _number(x: float, name: str, *, positive: bool) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float | np.floating | np.integer) or not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number, got {x!r}")
    if (x <= 0) if positive else (x < 0):
        raise ValueError(f"{name}: must be {'> 0' if positive else '>= 0'}, got {x!r}")
    return float(x)


def extrapolate(loss_now: ArrayLike, loss_prev: ArrayLike, theta: float) -> np.ndarray:
    r"""The extrapolated loss vector of Algorithm 1.

    .. math::

        s^{r} = (1 + \theta_r)\, L^{r} - \theta_r\, L^{r-1},

    with L^r = (f_1(x^r), …, f_N(x^r)) the clients' losses at the current model and
    L^{r−1} those of the previous round (L^{−1} = L^0: no extrapolation in round 0).

    Parameters
    ----------
    loss_now, loss_prev : array_like, shape (N,)
        L^r and L^{r−1}, finite.
    theta : float
        θ_r ≥ 0.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        s^r.

    Examples
    --------
    >>> extrapolate([1.0, 2.0], [0.0, 4.0], theta=0.5)
    array([1.5, 1. ])
    """
    now, prev = _as_vector(loss_now, "loss_now"), _as_vector(loss_prev, "loss_prev")
    if now.shape != prev.shape:
        raise ValueError(f"loss_prev: expected length {now.size} (as loss_now), got {prev.size}")
    th = _number(theta, "theta", positive=False)
    return (1.0 + th) * now - th * prev


def dual_step(lam: ArrayLike, s: ArrayLike, sigma: float, objective: str, rho: float = 0.0,
              alpha: float | None = None) -> np.ndarray:
    r"""The exact proximal dual step of Algorithm 1.

    .. math::

        \lambda^{r+1} = \arg\min_{\lambda \in \Lambda}\ \psi(\lambda)
            - \langle s^r, \lambda\rangle + \frac{1}{2\sigma_r}\|\lambda - \lambda^r\|_2^2,

    per ``objective``: ``"afl"``: λ^{r+1} = Π_Δ(λ^r + σ s^r); ``"cvar"``:
    λ^{r+1} = Π_Λ(λ^r + σ s^r) on the simplex capped at 1/(αN); ``"chi2"``: ψ(λ) =
    (ρN/2)‖λ − 1/N‖², and completing the square,
    λ^{r+1} = Π_Δ((λ^r + σ s^r + σρ)/(1 + σρN)).

    Parameters
    ----------
    lam : array_like, shape (N,)
        λ^r on the simplex (to 1e-6).
    s : array_like, shape (N,)
        s^r (:func:`extrapolate`).
    sigma : float
        σ_r > 0.
    objective : {"chi2", "afl", "cvar"}
        ψ and Λ.
    rho : float, default 0.0
        ρ ≥ 0 (``"chi2"`` only).
    alpha : float, optional
        α ∈ (0, 1] (required by ``"cvar"``).

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        λ^{r+1}.

    Examples
    --------
    >>> dual_step([0.5, 0.5], [1.0, 0.0], sigma=0.2, objective="afl")
    array([0.6, 0.4])
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: unknown objective {objective!r}; allowed: {', '.join(OBJECTIVES)}")
    lam_arr, s_arr = _as_vector(lam, "lam"), _as_vector(s, "s")
    if lam_arr.shape != s_arr.shape:
        raise ValueError(f"s: expected length {lam_arr.size} (as lam), got {s_arr.size}")
    if np.any(lam_arr < -_SIMPLEX_ATOL) or abs(lam_arr.sum() - 1.0) > _SIMPLEX_ATOL:
        raise ValueError(f"lam: must lie on the simplex (to {_SIMPLEX_ATOL:g}), sums to {lam_arr.sum()!r}")
    sigma_f = _number(sigma, "sigma", positive=True)
    rho_f = _number(rho, "rho", positive=False)
    n = lam_arr.size
    y = lam_arr + sigma_f * s_arr
    if objective == "afl":
        return project_simplex(y)
    if objective == "cvar":
        if alpha is None or not 0.0 < _number(alpha, "alpha", positive=True) <= 1.0:
            raise ValueError(f"alpha: objective 'cvar' needs α in (0, 1], got {alpha!r}")
        return project_capped_simplex(y, 1.0 / (float(alpha) * n))
    return project_simplex((y + sigma_f * rho_f) / (1.0 + sigma_f * rho_f * n))


def dual_step_on(lam: ArrayLike, active: Sequence[int], s: ArrayLike, sigma: float, objective: str,
                 rho: float = 0.0, alpha: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    r"""The dual step on the clients K whose loss is known; the others keep their weight.

    With M = Σ_{i∈K} λ_i^r, λ_K^{r+1} = M · :func:`dual_step`(λ_K^r/M, s_K) (ψ and Λ over
    the |K| clients) and λ_i^{r+1} = λ_i^r for i ∉ K. When K is every client this is
    :func:`dual_step`. When M = 0 the step starts from the uniform weights over K and λ
    is kept.

    Parameters
    ----------
    lam : array_like, shape (N,)
        λ^r.
    active : sequence of int
        Positions of K in ``lam``, in the order of ``s``.
    s : array_like, shape (|K|,)
        s^r over K.
    sigma, objective, rho, alpha
        As in :func:`dual_step`.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        λ^{r+1} over all N clients (summing to 1) and λ_K^{r+1}/M, the new weights
        renormalised over K (the weights of c^r and of the primal step).
    """
    lam_arr = _as_vector(lam, "lam")
    idx = np.asarray(active, dtype=int)
    mass = float(lam_arr[idx].sum())
    sub = lam_arr[idx] / mass if mass > _TINY_MASS else np.full(len(idx), 1.0 / len(idx))
    new_sub = dual_step(sub, s, sigma, objective, rho=rho, alpha=alpha)
    out = lam_arr.copy()
    out[idx] = new_sub * (mass if mass > _TINY_MASS else 0.0)
    return out / out.sum(), new_sub


def weighted_sum(weights: Sequence[float], vectors: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    r"""Σ_i w_i v_i, layer by layer (c^r = Σ_i λ_i^{r+1} c_i, or Σ_i λ_i^{r+1} Δu_i).

    Parameters
    ----------
    weights : sequence of float
        w_i, one per client.
    vectors : sequence of sequences of numpy.ndarray
        v_i as a list of layers (the same shapes for every i).

    Returns
    -------
    list of numpy.ndarray
        The weighted sum per layer, summed in the order of ``weights``.
    """
    if len(weights) != len(vectors) or not vectors:
        raise ValueError(f"weights: expected one weight per vector ({len(vectors)}), got {len(weights)}")
    out = []
    for k in range(len(vectors[0])):
        acc = weights[0] * vectors[0][k]  # accumulated in place, in the order of ``weights``
        for w, v in zip(weights[1:], vectors[1:], strict=True):
            acc += w * v[k]
        out.append(acc)
    return out


def local_direction(x: Sequence[np.ndarray], u: Sequence[np.ndarray], lr: float, steps: int) -> list[np.ndarray]:
    r"""Δu_i = (x^r − u_J^i)/(η_l J), client i's averaged corrected gradient over its J local steps.

    Parameters
    ----------
    x : sequence of numpy.ndarray
        x^r (float64 layers).
    u : sequence of numpy.ndarray
        u_J^i, the client's model after J steps of size η_l.
    lr : float
        η_l > 0.
    steps : int
        J ≥ 1.

    Returns
    -------
    list of numpy.ndarray
        Δu_i per layer, float64.
    """
    scale = 1.0 / (_number(lr, "lr", positive=True) * steps)
    return [(xk - uk.astype(np.float64)) * scale for xk, uk in zip(x, u, strict=True)]


def primal_step(x: Sequence[np.ndarray], direction: Sequence[np.ndarray], tau: float) -> list[np.ndarray]:
    r"""x^{r+1} = x^r − τ_r Σ_i λ_i^{r+1} Δu_i, with ``direction`` = Σ_i λ_i^{r+1} Δu_i.

    With τ_r = η_l J this is x^{r+1} = Σ_i λ_i^{r+1} u_J^i, the λ-weighted average of the
    local models.

    Parameters
    ----------
    x, direction : sequence of numpy.ndarray
        x^r and the weighted direction, layer by layer.
    tau : float
        τ_r > 0.

    Returns
    -------
    list of numpy.ndarray
        x^{r+1} per layer.
    """
    t = _number(tau, "tau", positive=True)
    return [xk - t * dk for xk, dk in zip(x, direction, strict=True)]


def auto_theta(mu_x: float, mu_y: float, tau: float, sigma: float) -> float:
    r"""θ of rule 5.2 (constant steps) from the strong convexity moduli.

    .. math::

        \theta = \max\Big(\frac{1}{1 + \mu_x \tau}, \frac{1}{1 + \mu_y \sigma}\Big)
        \quad (\mu_x > 0,\ \mu_y > 0), \qquad \theta = 1 \text{ otherwise},

    the smallest θ with θ(1 + μ_x τ) ≥ 1 and θ(1 + μ_y σ) ≥ 1 (the linear rate θ^r of
    accelerated primal-dual on a strongly-convex–strongly-concave problem). μ_y = ρN for
    the χ² penalty, 0 for AFL and CVaR.

    Parameters
    ----------
    mu_x, mu_y : float
        μ_x ≥ 0 and μ_y ≥ 0.
    tau, sigma : float
        τ > 0 and σ > 0.

    Returns
    -------
    float
        θ ∈ (0, 1].

    Examples
    --------
    >>> auto_theta(1.0, 0.5, tau=1.0, sigma=0.2)  # max(1/2, 1/1.1)
    0.9090909090909091
    """
    mx, my = _number(mu_x, "mu_x", positive=False), _number(mu_y, "mu_y", positive=False)
    t, s = _number(tau, "tau", positive=True), _number(sigma, "sigma", positive=True)
    if mx > 0 and my > 0:
        return max(1.0 / (1.0 + mx * t), 1.0 / (1.0 + my * s))
    return 1.0


def next_steps(tau: float, sigma: float, gamma: float, mu_x: float) -> StepSizes:
    r"""Rule 5.1 (strongly-convex–concave): the step sizes of round r + 1 from those of round r.

    .. math::

        \gamma_{r+1} = \gamma_r(1 + \mu_x\tau_r),\quad
        \tau_{r+1} = \tau_r\sqrt{\gamma_r/\gamma_{r+1}},\quad
        \sigma_{r+1} = \gamma_{r+1}\tau_{r+1},\quad
        \theta_{r+1} = \sigma_r/\sigma_{r+1}

    (Chambolle & Pock 2011, Alg. 2; Hamedani & Aybat 2021). It keeps σ_r τ_r = γ_0 τ_0²
    and meets the step conditions with equality: σ_r(1/τ_r + μ_x) = σ_{r+1}/τ_{r+1} and
    θ_{r+1} σ_{r+1} = σ_r. With μ_x = 0 the steps are constant and θ = 1.

    Parameters
    ----------
    tau, sigma, gamma : float
        τ_r > 0, σ_r > 0, γ_r > 0.
    mu_x : float
        μ_x ≥ 0.

    Returns
    -------
    (float, float, float, float)
        τ_{r+1}, σ_{r+1}, γ_{r+1}, θ_{r+1}.

    Examples
    --------
    >>> next_steps(1.0, 2.0, 2.0, mu_x=3.0)  # τ = 1/√4, γ = 2·4, σ = 8/2, θ = 2/4
    (0.5, 4.0, 8.0, 0.5)
    """
    gamma_next = gamma * (1.0 + _number(mu_x, "mu_x", positive=False) * tau)
    tau_next = tau * math.sqrt(gamma / gamma_next)
    sigma_next = gamma_next * tau_next
    return tau_next, sigma_next, gamma_next, sigma / sigma_next
