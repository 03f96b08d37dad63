"""The KL-regularised worst case over client mixtures, divergences, and the argument checks of core/.

* KL-regularised DRO (DR-DSGD) — I. Issaid, A. Elgabli, M. Bennis, "DR-DSGD: A
  Distributionally Robust Decentralized Learning Algorithm over Graphs", TMLR 2022,
  https://arxiv.org/abs/2208.13810 (closed-form inner maximum, a log-sum-exp).
* The KL and χ² divergences of the DRO regularisers.

The λ steps of the algorithms are in :mod:`flowerdro.core.drfa` (DRFA, DRFA-Prox, AFL)
and :mod:`flowerdro.core.scaffpd`; the former shares the argument checks below.

Notation: N clients, λ ∈ Δ = {λ ≥ 0, Σλ_i = 1}, ρ the regulariser strength, μ the KL
temperature.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import logsumexp, softmax, xlogy

from flowerdro.core.simplex import _as_vector

__all__ = [
    "chi2_divergence",
    "kl_divergence",
    "kl_dro_value",
    "kl_dro_weights",
]


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
    ``"chi2"`` option of :func:`flowerdro.core.drfa.prox_step` (which is :math:`\rho\,\chi^2`).

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
