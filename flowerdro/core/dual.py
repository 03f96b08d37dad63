"""Updates of the mixing weights λ (the dual variable of distributionally robust FL).

The server of a distributionally robust federated algorithm solves
``min_x max_{λ ∈ Λ} Σ_i λ_i f_i(x) - ψ(λ)`` over N clients. This module holds the
λ-updates of the supported papers as pure functions of arrays (numpy/scipy only, never
flwr):

* DRFA and DRFA-Prox — Y. Deng, M. M. Kamani, M. Mahdavi, "Distributionally Robust
  Federated Averaging", NeurIPS 2020, https://arxiv.org/abs/2102.12660
  (Algorithm 1: projected ascent; Algorithm 2: proximal ascent on a regularised
  objective). AFL (Mohri et al., 2019) is DRFA without regulariser.
* KL-regularised DRO (DR-DSGD) — I. Issaid, A. Elgabli, M. Bennis, "DR-DSGD: A
  Distributionally Robust Decentralized Learning Algorithm over Graphs", TMLR 2022,
  https://arxiv.org/abs/2208.13810 (closed-form inner maximum, a log-sum-exp).

Notation: N clients, λ ∈ Δ = {λ ≥ 0, Σλ_i = 1}, τ local steps, γ the dual step size,
ρ the regulariser strength, μ the KL temperature.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import brentq
from scipy.special import logsumexp, softmax, wrightomega, xlogy

from flowerdro.core.simplex import _as_vector, project_capped_simplex, project_simplex

__all__ = [
    "DRFA_REGULARIZERS",
    "chi2_divergence",
    "drfa_dual_ascent",
    "drfa_loss_vector",
    "drfa_prox_step",
    "kl_divergence",
    "kl_dro_value",
    "kl_dro_weights",
]

DRFA_REGULARIZERS: tuple[str, ...] = ("kl", "chi2", "l2")

# Tolerance for "λ is a point of the simplex" on inputs (λ comes from earlier rounds
# and from floating-point projections, so exact equality is not expected).
_SIMPLEX_ATOL = 1e-6


# --------------------------------------------------------------------------- validation
_vector = _as_vector  # one validator for all of core/: finite, non-empty, 1-D float64


def _simplex_point(x: ArrayLike, name: str) -> np.ndarray:
    arr = _vector(x, name)
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


def _one_of(value: str, allowed: tuple[str, ...], name: str) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


def _simplex_and_vector(lam: ArrayLike, v: ArrayLike, v_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate a point λ of the simplex and a finite vector of the same length."""
    lam_arr = _simplex_point(lam, "lam")
    v_arr = _vector(v, v_name)
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


# ----------------------------------------------------------------------------- DRFA
def drfa_loss_vector(
    num_clients: int, sampled_ids: Sequence[int] | ArrayLike, losses: ArrayLike
) -> np.ndarray:
    r"""Unbiased estimate of the loss vector for the DRFA dual step.

    DRFA (Deng et al., 2020, Algorithm 1) evaluates the losses at the snapshot model
    :math:`w^{(t')}` on a set :math:`U` of :math:`m` clients drawn uniformly with
    replacement and forms

    .. math::

        v_i = \frac{N}{m} \sum_{k=1}^{m} \mathbb{1}[U_k = i]\, f_i(w^{(t')}),

    i.e. :math:`v_i = (N/m) f_i` for every draw of client :math:`i` (a client drawn
    twice counts twice) and :math:`v_i = 0` for clients not drawn, so that
    :math:`\mathbb{E}[v] = (f_1, \dots, f_N)`.

    Parameters
    ----------
    num_clients : int
        N, the number of clients; ``>= 1``.
    sampled_ids : sequence of int, length m
        The drawn client indices, each in ``[0, N)``; duplicates allowed; ``m >= 1``.
    losses : array_like, shape (m,)
        ``losses[k]`` is :math:`f_{U_k}` at the snapshot, aligned with ``sampled_ids``.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        The vector :math:`v`.

    Raises
    ------
    ValueError
        If ``num_clients < 1``, ``sampled_ids`` is empty or has an id outside
        ``[0, num_clients)``, or ``losses`` is not finite or not of length m.

    Examples
    --------
    >>> drfa_loss_vector(4, [1, 3, 1], [0.5, 2.0, 0.5])
    array([0.        , 1.33333333, 0.        , 2.66666667])
    """
    if isinstance(num_clients, bool) or int(num_clients) != num_clients:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    n = int(num_clients)
    if n < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    ids_raw = np.asarray(sampled_ids)
    if ids_raw.ndim != 1 or ids_raw.size == 0:
        raise ValueError(
            f"sampled_ids must be a non-empty one-dimensional sequence of ints, got "
            f"shape {ids_raw.shape}"
        )
    if not (
        np.issubdtype(ids_raw.dtype, np.integer)
        or (np.issubdtype(ids_raw.dtype, np.floating) and np.all(ids_raw == np.round(ids_raw)))
    ):
        raise ValueError(f"sampled_ids must hold integers in [0, {n}), got {ids_raw!r}")
    ids = ids_raw.astype(np.int64)
    if ids.min() < 0 or ids.max() >= n:
        raise ValueError(
            f"sampled_ids must be in [0, num_clients) = [0, {n}), got min {ids.min()} "
            f"and max {ids.max()}"
        )
    f = _vector(losses, "losses")
    if f.size != ids.size:
        raise ValueError(f"losses must have one entry per sampled id (m={ids.size}), got {f.size}")
    v = np.zeros(n)
    np.add.at(v, ids, f)
    return v * (n / ids.size)


def drfa_dual_ascent(
    lam: ArrayLike,
    v: ArrayLike,
    tau: float,
    gamma: float,
    cap: float | None = None,
) -> np.ndarray:
    r"""DRFA projected dual ascent (Deng et al., 2020, Algorithm 1, line 12).

    .. math::

        \lambda^{(s+1)} = \Pi_\Lambda\big(\lambda^{(s)} + \tau\gamma\, v\big),

    where :math:`v` is the loss vector from :func:`drfa_loss_vector`, :math:`\tau` the
    number of local steps per round (the snapshot covers the whole round, hence the
    factor :math:`\tau`), :math:`\gamma` the dual step size and :math:`\Pi_\Lambda` the
    Euclidean projection onto :math:`\Lambda = \Delta` (AFL/DRFA), or onto the capped
    simplex :math:`\{\lambda \in \Delta: \lambda_i \le c\}` when ``cap`` is given
    (CVaR with :math:`c = 1/(\alpha N)`).

    Parameters
    ----------
    lam : array_like, shape (N,)
        Current :math:`\lambda^{(s)}`, a point of the simplex (tolerance 1e-6).
    v : array_like, shape (N,)
        Loss vector :math:`v`, finite.
    tau : float
        :math:`\tau \ge 1`, local steps per round.
    gamma : float
        :math:`\gamma > 0`, dual step size.
    cap : float or None, default None
        Optional cap :math:`c` with :math:`cN \ge 1`; ``None`` means the plain simplex.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        :math:`\lambda^{(s+1)}`.

    Raises
    ------
    ValueError
        If ``lam`` is not on the simplex, ``v`` has another length or is not finite,
        ``tau < 1``, ``gamma <= 0``, or ``cap`` is outside ``[1/N, inf)``.

    Examples
    --------
    >>> drfa_dual_ascent([0.5, 0.5], [1.0, 0.0], tau=1, gamma=0.2)
    array([0.6, 0.4])
    """
    lam_arr, v_arr = _simplex_and_vector(lam, v, "v")
    tau_f = _local_steps(tau, "tau")
    gamma_f = _positive(gamma, "gamma")
    y = lam_arr + tau_f * gamma_f * v_arr
    if cap is None:
        return project_simplex(y)
    return project_capped_simplex(y, cap)


def _kl_prox(y: np.ndarray, kappa: float) -> np.ndarray:
    r"""Solve :math:`\min_{u \in \Delta} \kappa \sum_i u_i \log(N u_i) + \tfrac12\|u - y\|^2`.

    Stationarity: :math:`\kappa(\log(N u_i) + 1) + u_i - y_i + \nu = 0`, i.e.
    :math:`u_i/\kappa + \log(u_i/\kappa) = y_i/\kappa - \mu` for a scalar :math:`\mu`
    (absorbing :math:`\nu`, :math:`\log N`, :math:`\log\kappa`), so
    :math:`u_i(\mu) = \kappa\,\omega(y_i/\kappa - \mu)` with the Wright omega function
    :math:`\omega(x) = W_0(e^x)` (:math:`\omega + \log\omega = x`), evaluated without
    forming :math:`e^x`. :math:`\sum_i u_i(\mu)` is decreasing in :math:`\mu`; with
    :math:`\max_i y_i = 0` (a shift of :math:`y` only shifts :math:`\mu`) the entry of
    the largest :math:`y_i` lies in :math:`[1/N, 1]`, which brackets
    :math:`\mu \in [\log\kappa - 1/\kappa,\ \log(N\kappa) - 1/(N\kappa)]`.
    """
    n = y.size
    if n == 1:
        return np.ones(1)
    w = y - y.max()
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        x = w / kappa  # may be -inf for tiny κ; ω(-inf) = 0
    x = np.where(np.isnan(x), -np.inf, x)

    def excess(mu: float) -> float:
        return float(kappa * wrightomega(x - mu).sum() - 1.0)

    lo = np.log(kappa) - 1.0 / kappa
    hi = np.log(n) + np.log(kappa) - 1.0 / n / kappa
    # Widen by a few ulps so rounding in the bracket never excludes the root.
    pad = 8.0 * np.finfo(np.float64).eps * max(abs(lo), abs(hi), 1.0)
    lo, hi = lo - pad, hi + pad
    f_lo, f_hi = excess(lo), excess(hi)
    if f_lo <= 0.0:
        mu = lo
    elif f_hi >= 0.0:
        mu = hi
    else:
        mu = _kl_newton(x, kappa, lo, hi)
        if mu is None:  # safeguard: Newton did not settle, fall back to the bracketed solve
            mu = brentq(excess, lo, hi, xtol=1e-300, rtol=4 * np.finfo(np.float64).eps, maxiter=500)
    u = kappa * wrightomega(x - mu)
    return u / u.sum()


def _kl_newton(x: np.ndarray, kappa: float, lo: float, hi: float, max_iter: int = 60) -> float | None:
    r"""Root of :math:`e(\mu) = \kappa\sum_i \omega(x_i - \mu) - 1` by Newton from the left.

    :math:`e` is convex and decreasing in :math:`\mu` (ω is convex and increasing), so
    Newton steps started where :math:`e > 0` increase monotonically to the root without
    overshooting; ω'(z) = ω/(1 + ω) gives the derivative. Each step costs one ω evaluation
    over the N entries (a bracketed solve needs 30–40). Returns None if it does not settle.
    """
    mu = lo
    eps = np.finfo(np.float64).eps
    for _ in range(max_iter):
        om = wrightomega(x - mu)
        e = kappa * om.sum() - 1.0
        slope = kappa * float((om / (1.0 + om)).sum())
        if e <= 0.0 or slope <= 0.0:
            return mu
        step = e / slope
        new = mu + step
        if not lo <= new <= hi:
            return None
        if step <= 4.0 * eps * max(1.0, abs(mu)):
            return new
        mu = new
    return None


def drfa_prox_step(
    lam: ArrayLike,
    v: ArrayLike,
    tau: float,
    gamma: float,
    regularizer: str,
    rho: float,
) -> np.ndarray:
    r"""DRFA-Prox dual step (Deng et al., 2020, Algorithm 2).

    For the regularised objective :math:`\min_w \max_{\lambda\in\Delta}
    \sum_i \lambda_i f_i(w) + g(\lambda)` the dual update is the proximal ascent step

    .. math::

        \lambda^{(s+1)} = \arg\max_{u \in \Delta}\ \tau\, g(u)
            - \frac{1}{2\gamma}\big\|\lambda^{(s)} + \gamma\tau v - u\big\|_2^2 ,

    with :math:`y = \lambda^{(s)} + \gamma\tau v` and regulariser :math:`g`:

    * ``"l2"``: :math:`g(u) = -\frac{\rho}{2}\|u - \tfrac1N\mathbf 1\|^2`. The objective
      is a quadratic, so
      :math:`\lambda^{(s+1)} = \Pi_\Delta\big((y + \gamma\tau\rho/N)/(1 + \gamma\tau\rho)\big)`.
    * ``"chi2"``: :math:`g(u) = -\rho\,\chi^2(u)`,
      :math:`\chi^2(u) = \frac{1}{2N}\sum_i (N u_i - 1)^2 = \frac N2\|u - \tfrac1N\|^2`,
      i.e. ``"l2"`` with :math:`\rho N`:
      :math:`\lambda^{(s+1)} = \Pi_\Delta\big((y + \gamma\tau\rho)/(1 + \gamma\tau\rho N)\big)`.
    * ``"kl"``: :math:`g(u) = -\rho\,\mathrm{KL}(u\,\|\,\tfrac1N\mathbf 1) =
      -\rho\sum_i u_i\log(N u_i)`. With :math:`\kappa = \gamma\tau\rho` the solution is
      interior and satisfies :math:`\kappa(\log(N u_i) + 1) + u_i - y_i = -\nu` for all
      :math:`i`, so :math:`u_i = \kappa\, W_0\!\big(e^{(y_i - \nu)/\kappa - 1}/(N\kappa)\big)`
      (Lambert W, computed as the Wright omega function in the log domain), with the
      scalar :math:`\nu` found by a bracketed root find (``brentq``) on
      :math:`\sum_i u_i(\nu) = 1`. Stable for tiny and huge :math:`\rho`.

    :math:`\rho = 0` gives the plain ascent :func:`drfa_dual_ascent`.

    Parameters
    ----------
    lam : array_like, shape (N,)
        Current :math:`\lambda^{(s)}`, a point of the simplex (tolerance 1e-6).
    v : array_like, shape (N,)
        Loss vector (see :func:`drfa_loss_vector`).
    tau : float
        :math:`\tau \ge 1`, local steps per round.
    gamma : float
        :math:`\gamma > 0`, dual step size.
    regularizer : {"kl", "chi2", "l2"}
        The regulariser :math:`g`.
    rho : float
        :math:`\rho \ge 0`, regularisation strength.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        :math:`\lambda^{(s+1)}`.

    Raises
    ------
    ValueError
        If ``rho < 0``, ``gamma <= 0``, ``tau < 1``, ``regularizer`` is not one of
        ``"kl"``, ``"chi2"``, ``"l2"``, or ``lam``/``v`` are invalid.

    Examples
    --------
    >>> drfa_prox_step([0.5, 0.5], [1.0, 0.0], tau=1, gamma=1.0, regularizer="l2", rho=1.0)
    array([0.75, 0.25])
    """
    _one_of(regularizer, DRFA_REGULARIZERS, "regularizer")
    rho_f = _nonnegative(rho, "rho")
    lam_arr, v_arr = _simplex_and_vector(lam, v, "v")
    tau_f = _local_steps(tau, "tau")
    gamma_f = _positive(gamma, "gamma")
    if rho_f == 0.0:
        return drfa_dual_ascent(lam_arr, v_arr, tau_f, gamma_f)
    n = lam_arr.size
    y = lam_arr + gamma_f * tau_f * v_arr
    kappa = gamma_f * tau_f * rho_f
    if regularizer == "l2":
        return project_simplex((y + kappa / n) / (1.0 + kappa))
    if regularizer == "chi2":
        return project_simplex((y + kappa) / (1.0 + kappa * n))
    if not np.isfinite(kappa):
        return np.full(n, 1.0 / n)
    if kappa < 1e-300:  # 1/κ overflows; the KL term is below float resolution
        return project_simplex(y)
    return _kl_prox(y, kappa)


# ------------------------------------------------------------------ KL-regularised DRO
def _mu(mu: float) -> float:
    return _positive(mu, "mu")


def kl_dro_value(losses: ArrayLike, mu: float) -> float:
    r"""Value of the KL-regularised worst case over client mixtures.

    .. math::

        \max_{\lambda\in\Delta} \sum_{i=1}^K \lambda_i f_i
            - \mu\,\mathrm{KL}(\lambda\,\|\,\tfrac1K\mathbf 1)
        = \mu \log\Big(\frac1K \sum_{i=1}^K e^{f_i/\mu}\Big),

    computed as :math:`\mu(\operatorname{logsumexp}(f/\mu) - \log K)`, which never
    overflows. It lies between the mean (:math:`\mu\to\infty`) and the maximum
    (:math:`\mu\to 0`) of the losses. This is the DR-DSGD objective (Issaid et al.,
    2022).

    Parameters
    ----------
    losses : array_like, shape (K,)
        Client losses :math:`f_i`, finite.
    mu : float
        Temperature :math:`\mu > 0`.

    Returns
    -------
    float
        The value above.

    Raises
    ------
    ValueError
        If ``losses`` is empty or not finite, or ``mu <= 0``.

    Examples
    --------
    >>> round(kl_dro_value([1.0, 1.0], mu=0.5), 12)
    1.0
    """
    f = _vector(losses, "losses")
    m = _mu(mu)
    return float(m * (logsumexp(f / m) - np.log(f.size)))


def kl_dro_weights(losses: ArrayLike, mu: float) -> np.ndarray:
    r"""Maximiser of the KL-regularised worst case over client mixtures.

    .. math::

        \lambda^\star = \arg\max_{\lambda\in\Delta} \sum_i \lambda_i f_i
            - \mu\,\mathrm{KL}(\lambda\,\|\,\tfrac1K\mathbf 1),
        \qquad \lambda^\star_i = \frac{e^{f_i/\mu}}{\sum_j e^{f_j/\mu}},

    a softmax of :math:`f/\mu` (computed stably). At :math:`\lambda^\star` the
    objective equals :func:`kl_dro_value`, and :math:`\lambda^\star_i` is the gradient
    of that value with respect to :math:`f_i`, which is why DR-DSGD weighs client
    :math:`i`'s gradient by :math:`e^{f_i/\mu}`.

    Parameters
    ----------
    losses : array_like, shape (K,)
        Client losses :math:`f_i`, finite.
    mu : float
        Temperature :math:`\mu > 0`.

    Returns
    -------
    numpy.ndarray, shape (K,), float64
        :math:`\lambda^\star`, a point of the simplex.

    Raises
    ------
    ValueError
        If ``losses`` is empty or not finite, or ``mu <= 0``.

    Examples
    --------
    >>> kl_dro_weights([0.0, np.log(3.0)], mu=1.0)
    array([0.25, 0.75])
    """
    f = _vector(losses, "losses")
    m = _mu(mu)
    return softmax(f / m)


# ---------------------------------------------------------------------- divergences
def kl_divergence(p: ArrayLike, q: ArrayLike | None = None) -> float:
    r"""Kullback-Leibler divergence :math:`\mathrm{KL}(p\,\|\,q) = \sum_i p_i \log(p_i/q_i)`.

    Uses :math:`0 \log 0 = 0`. With ``q=None``, :math:`q` is uniform and
    :math:`\mathrm{KL}(p\,\|\,\tfrac1N) = \sum_i p_i \log(N p_i)`.

    Parameters
    ----------
    p : array_like, shape (N,)
        A point of the simplex (tolerance 1e-6).
    q : array_like of shape (N,) or None, default None
        A point of the simplex with :math:`q_i > 0` wherever :math:`p_i > 0`;
        ``None`` means uniform.

    Returns
    -------
    float
        :math:`\mathrm{KL}(p\,\|\,q) \ge 0`; ``inf`` if :math:`p_i > 0 = q_i` somewhere.

    Raises
    ------
    ValueError
        If ``p`` or ``q`` is not on the simplex or their lengths differ.

    Examples
    --------
    >>> round(kl_divergence([1.0, 0.0]), 12) == round(float(np.log(2.0)), 12)
    True
    """
    p_arr = _simplex_point(p, "p")
    if q is None:
        q_arr = np.full(p_arr.size, 1.0 / p_arr.size)
    else:
        q_arr = _simplex_point(q, "q")
        _same_length(q_arr, "q", p_arr, "p")
    p_arr = np.maximum(p_arr, 0.0)
    q_arr = np.maximum(q_arr, 0.0)
    if np.any((p_arr > 0) & (q_arr == 0)):
        return float("inf")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(p_arr > 0, p_arr / np.where(q_arr > 0, q_arr, 1.0), 1.0)
    return float(np.sum(xlogy(p_arr, ratio)))


def chi2_divergence(p: ArrayLike, q: ArrayLike | None = None) -> float:
    r"""The (halved) :math:`\chi^2` divergence used as DRO regulariser.

    .. math::

        \chi^2(p\,\|\,q) = \frac12 \sum_i \frac{(p_i - q_i)^2}{q_i},
        \qquad \chi^2(p\,\|\,\tfrac1N) = \frac{1}{2N}\sum_i (N p_i - 1)^2 ,

    i.e. half of Pearson's :math:`\chi^2`, matching the regulariser
    :math:`\psi(\lambda) = \frac{\rho}{2N}\sum_i (N\lambda_i - 1)^2` of SCAFF-PD and the
    ``"chi2"`` option of :func:`drfa_prox_step` (which is :math:`\rho\,\chi^2`).

    Parameters
    ----------
    p : array_like, shape (N,)
        A point of the simplex (tolerance 1e-6).
    q : array_like of shape (N,) or None, default None
        A point of the simplex with all :math:`q_i > 0`; ``None`` means uniform.

    Returns
    -------
    float
        The divergence, ``>= 0``.

    Raises
    ------
    ValueError
        If ``p`` or ``q`` is not on the simplex, ``q`` has a zero entry, or the lengths
        differ.

    Examples
    --------
    >>> chi2_divergence([1.0, 0.0])
    0.5
    """
    p_arr = _simplex_point(p, "p")
    n = p_arr.size
    if q is None:
        return float(np.sum((n * p_arr - 1.0) ** 2) / (2.0 * n))
    q_arr = _simplex_point(q, "q")
    _same_length(q_arr, "q", p_arr, "p")
    if np.any(q_arr <= 0.0):
        raise ValueError("q must have every entry > 0 for the chi-square divergence")
    return float(0.5 * np.sum((p_arr - q_arr) ** 2 / q_arr))
