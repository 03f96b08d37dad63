"""DR-DSGD's exponential (tilted) loss weight, computed safely in the log domain.

DR-DSGD (Ben Issaid, Elgabli and Bennis, "DR-DSGD: A Distributionally Robust
Decentralized Learning Algorithm over Graphs", TMLR 2022,
https://openreview.net/forum?id=VcXNAr5Rur) solves the KL-regularised DRO problem

    min_θ  (1/K) Σ_i exp(f_i(θ)/μ),

whose local stochastic step at device i is

    θ_i^{t+½} = θ_i^t − η · (h_i / μ) · g_i(θ_i^t),   h_i = exp(ℓ_i / μ),

with ℓ_i the mean minibatch loss and μ > 0 the regulariser (small μ → more robust,
μ → ∞ recovers DSGD up to a constant). The multiplier h_i/μ = exp(ℓ_i/μ − log μ)
overflows float64 as soon as ℓ_i/μ ≳ 709.8, so everything here is computed from the
log-weight log(h_i/μ) and capped (see :data:`DEFAULT_LOG_CAP`).

Framework-free (numpy / scipy only); never imports flwr.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from scipy.special import logsumexp

__all__ = [
    "DEFAULT_LOG_CAP",
    "MAX_LOG_CAP",
    "MIN_LOG_CAP",
    "TiltScale",
    "log_cap_from_max_weight",
    "log_tilt_weight",
    "relative_tilt_weights",
    "tilt_step",
    "tilt_step_scale",
    "tilted_risk",
]

#: Default cap on log(h/μ): the step multiplier h/μ never exceeds exp(50) ≈ 5.18e21.
#:
#: Why 50: in the regimes of the paper (cross-entropy losses of a few nats, μ of order
#: 1–10) log(h/μ) = ℓ/μ − log μ stays far below 50, so the cap never changes a step there;
#: it only acts as an overflow guard when a device's loss explodes or μ is tiny. Model
#: parameters and gradients are float32 in torch (max ≈ 3.4e38 ≈ exp(88.7)); with the
#: multiplier at most exp(50) the product η·(h/μ)·g stays finite for |η·g| up to
#: ≈ 6.6e16, whereas an uncapped float64 multiplier (up to 1.8e308) would turn the float32
#: update into inf/NaN and poison every neighbour at the next gossip step.
DEFAULT_LOG_CAP: float = 50.0

#: Largest allowed log cap: exp(709) ≈ 8.2e307 is still a finite float64.
MAX_LOG_CAP: float = 709.0

#: Smallest allowed log cap: exp(−709) ≈ 1.2e−308 is still a normal float64 > 0.
#:
#: A cap below :data:`DEFAULT_LOG_CAP` that actually binds (c < ℓ/μ − log μ for some
#: device, e.g. c = 0, a multiplier of at most 1) is a safeguard of ours and a departure
#: from the paper, which uses h/μ uncapped: it bounds the effective step η·min(h/μ, e^c)
#: and removes the extra weight of devices whose loss is above μ(c + log μ).
MIN_LOG_CAP: float = -709.0


class TiltScale(NamedTuple):
    """Result of :func:`tilt_step`.

    Attributes
    ----------
    scale : float
        The step multiplier min(h/μ, exp(log_cap)) actually used.
    log_weight : float
        The uncapped log(h/μ) = ℓ/μ − log μ; finite for any finite ℓ, so relative
        weights across devices (:func:`relative_tilt_weights`) stay exact even when
        several devices hit the cap.
    capped : bool
        True if the cap was active (log_weight > log_cap).
    """

    scale: float
    log_weight: float
    capped: bool


def _check_mu(mu: Any) -> float:
    if isinstance(mu, bool) or isinstance(mu, str | bytes):
        raise ValueError(f"mu must be a finite real number > 0, got {mu!r}")
    try:
        mu_f = float(mu)
    except (TypeError, ValueError):
        raise ValueError(f"mu must be a finite real number > 0, got {mu!r}") from None
    if not math.isfinite(mu_f) or mu_f <= 0.0:
        raise ValueError(f"mu must be a finite real number > 0, got {mu_f}")
    return mu_f


def _check_loss(loss: Any) -> float:
    if isinstance(loss, bool) or isinstance(loss, str | bytes):
        raise ValueError(f"loss must be a finite real number, got {loss!r}")
    try:
        loss_f = float(loss)
    except (TypeError, ValueError):
        raise ValueError(f"loss must be a finite real number (a scalar), got {loss!r}") from None
    if math.isnan(loss_f):
        raise ValueError("loss must be a finite real number, got NaN")
    if not math.isfinite(loss_f):
        raise ValueError(f"loss must be a finite real number, got {loss_f}")
    return loss_f


def _check_log_cap(log_cap: Any) -> float:
    allowed = f"[{MIN_LOG_CAP}, {MAX_LOG_CAP}]"
    if isinstance(log_cap, bool) or isinstance(log_cap, str | bytes):
        raise ValueError(f"log_cap must be a real number in {allowed}, got {log_cap!r}")
    try:
        cap = float(log_cap)
    except (TypeError, ValueError):
        raise ValueError(f"log_cap must be a real number in {allowed}, got {log_cap!r}") from None
    if not MIN_LOG_CAP <= cap <= MAX_LOG_CAP:  # also rejects NaN
        raise ValueError(f"log_cap must be a real number in {allowed}, got {cap}")
    return cap


def log_cap_from_max_weight(max_tilt_weight: Any) -> float:
    """The log cap c = log M of a cap M on the step multiplier h/μ itself.

    .. math::

        \\min\\big(\\tfrac{h}{\\mu}, M\\big) = \\exp\\big(\\min(\\tfrac{\\ell}{\\mu} - \\log\\mu,\\; \\log M)\\big),

    so ``tilt_step(loss, mu, log_cap=log_cap_from_max_weight(M)).scale`` never exceeds M.
    A binding M (e.g. M = 1, never a larger step than DSGD's) departs from the paper; see
    :data:`MIN_LOG_CAP`.

    Parameters
    ----------
    max_tilt_weight : float
        M, with e^−709 ≤ M ≤ e^709 (any M in [1e−300, 1e300] is fine).

    Returns
    -------
    float
        log M.

    Raises
    ------
    ValueError
        If M is not a finite real number > 0 or log M lies outside [−709, 709].

    Examples
    --------
    >>> log_cap_from_max_weight(1.0)
    0.0
    """
    bad = f"max-tilt-weight must be a finite real number > 0 (the cap on h/mu), got {max_tilt_weight!r}"
    if isinstance(max_tilt_weight, bool) or isinstance(max_tilt_weight, str | bytes):
        raise ValueError(bad)
    try:
        m = float(max_tilt_weight)
    except (TypeError, ValueError):
        raise ValueError(bad) from None
    if not math.isfinite(m) or m <= 0.0:
        raise ValueError(bad)
    cap = math.log(m)
    if not MIN_LOG_CAP <= cap <= MAX_LOG_CAP:
        raise ValueError(
            f"max-tilt-weight must lie in [exp({MIN_LOG_CAP}), exp({MAX_LOG_CAP})], got {m!r}"
        )
    return cap


def _check_losses(losses: Any) -> np.ndarray:
    arr = np.asarray(losses)
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
        raise ValueError(f"losses must be real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if arr.ndim != 1 or arr.size < 1:
        raise ValueError(
            f"losses must be a 1-D sequence with at least one entry, got shape {arr.shape}"
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError("losses must all be finite (no NaN or inf)")
    return arr


def log_tilt_weight(loss: float, mu: float) -> float:
    """Logarithm of DR-DSGD's step multiplier h/μ.

    .. math::

        \\log\\frac{h}{\\mu} = \\frac{\\ell}{\\mu} - \\log\\mu,\\qquad h = e^{\\ell/\\mu},

    in float64; finite for every finite ℓ and μ > 0.

    Parameters
    ----------
    loss : float
        ℓ, the mean minibatch loss at θ_i^t (any finite real; a 0-d array or tensor
        with ``float()`` works too).
    mu : float
        μ > 0, the DRO regulariser.

    Returns
    -------
    float
        ℓ/μ − log μ.

    Raises
    ------
    ValueError
        If mu is not a finite number > 0, or loss is NaN / infinite / not a scalar.

    Examples
    --------
    >>> log_tilt_weight(2.0, 1.0)
    2.0
    """
    mu_f = _check_mu(mu)
    loss_f = _check_loss(loss)
    return loss_f / mu_f - math.log(mu_f)


def tilt_step(loss: float, mu: float, *, log_cap: float = DEFAULT_LOG_CAP) -> TiltScale:
    """DR-DSGD step multiplier with its log-domain value and whether it was capped.

    .. math::

        s = \\exp\\big(\\min(\\tfrac{\\ell}{\\mu} - \\log\\mu,\\; c)\\big)
          = \\min\\big(\\tfrac{e^{\\ell/\\mu}}{\\mu},\\; e^{c}\\big),

    with c = ``log_cap``. The cap bounds the effective step η·h/μ ≤ η·e^c of the local
    update θ ← θ − η (h/μ) g; it does not bound the log-weight, which is returned
    uncapped so that the relative weighting of devices (exp(ℓ_i/μ) / Σ_j exp(ℓ_j/μ))
    can still be computed exactly (see :func:`relative_tilt_weights`) and logged.

    Parameters
    ----------
    loss : float
        ℓ, the mean minibatch loss (finite).
    mu : float
        μ > 0.
    log_cap : float (default: DEFAULT_LOG_CAP = 50.0)
        c ∈ [−709, 709]: the multiplier never exceeds e^c (e^50 ≈ 5.18e21). A binding
        cap (c < 50 in practice) departs from the paper, see :data:`MIN_LOG_CAP`.

    Returns
    -------
    TiltScale
        ``(scale, log_weight, capped)``.

    Raises
    ------
    ValueError
        As :func:`log_tilt_weight`, or log_cap outside [−709, 709].

    Examples
    --------
    >>> tilt_step(1e4, 1.0)
    TiltScale(scale=5.184705528587072e+21, log_weight=10000.0, capped=True)
    """
    cap = _check_log_cap(log_cap)
    log_w = log_tilt_weight(loss, mu)
    capped = log_w > cap
    scale = math.exp(cap if capped else log_w)
    return TiltScale(scale=scale, log_weight=log_w, capped=capped)


def tilt_step_scale(loss: float, mu: float, *, log_cap: float = DEFAULT_LOG_CAP) -> float:
    """DR-DSGD's step multiplier h/μ = exp(ℓ/μ)/μ, overflow-safe and capped.

    .. math::

        \\frac{h}{\\mu} = \\exp\\Big(\\min\\big(\\tfrac{\\ell}{\\mu} - \\log\\mu,\\; c\\big)\\Big),

    so the local step is θ_i^{t+½} = θ_i^t − η · tilt_step_scale(ℓ_i, μ) · g_i(θ_i^t).
    Equal (to rounding) to the direct formula exp(ℓ/μ)/μ whenever that is finite and
    below e^c; never overflows (ℓ/μ = 1e4 gives e^c). The cap c = ``log_cap`` bounds the
    effective step size η·h/μ ≤ η·e^c; see :data:`DEFAULT_LOG_CAP` for why c = 50. Use
    :func:`tilt_step` to also get the uncapped log-weight, which preserves the relative
    weighting across devices when the cap is hit.

    Parameters
    ----------
    loss : float
        ℓ, the mean minibatch loss (finite).
    mu : float
        μ > 0.
    log_cap : float (default: DEFAULT_LOG_CAP = 50.0)
        c ∈ [−709, 709].

    Returns
    -------
    float
        min(exp(ℓ/μ)/μ, e^c), a finite float >= 0.

    Raises
    ------
    ValueError
        If mu <= 0 or not finite, loss is NaN or infinite, or log_cap is outside [−709, 709].

    Examples
    --------
    >>> round(tilt_step_scale(1.0, 2.0), 6)  # exp(0.5) / 2
    0.824361
    """
    return tilt_step(loss, mu, log_cap=log_cap).scale


def relative_tilt_weights(losses: Any, mu: float) -> np.ndarray:
    """Normalised tilt weights of K devices, a stable softmax of ℓ/μ.

    .. math::

        p_i = \\frac{e^{f_i/\\mu}}{\\sum_{j=1}^{K} e^{f_j/\\mu}}
            = \\operatorname{softmax}(f/\\mu)_i,

    the worst-case distribution over devices of the KL-regularised DRO problem (the
    relative weight each device's gradient gets in DR-DSGD). Computed as
    exp(f_i/μ − max_j f_j/μ) / Σ_j exp(f_j/μ − max_j f_j/μ), so it never overflows.

    Parameters
    ----------
    losses : array_like
        f = (f_1, …, f_K), finite, K >= 1.
    mu : float
        μ > 0.

    Returns
    -------
    numpy.ndarray
        Float64 vector p on the simplex (p >= 0, Σ p = 1).

    Raises
    ------
    ValueError
        If losses is not a non-empty 1-D array of finite reals, or mu is not > 0.

    Examples
    --------
    >>> relative_tilt_weights([0.0, 0.0], 1.0).tolist()
    [0.5, 0.5]
    """
    mu_f = _check_mu(mu)
    z = _check_losses(losses) / mu_f
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def tilted_risk(losses: Any, mu: float) -> float:
    """The DRO objective value μ log((1/K) Σ_i exp(f_i/μ)) in a stable form.

    .. math::

        R_\\mu(f) = \\mu \\log\\Big(\\frac{1}{K}\\sum_{i=1}^{K} e^{f_i/\\mu}\\Big)
                  = \\max_{p \\in \\Delta_K} \\; \\sum_i p_i f_i - \\mu\\,\\mathrm{KL}(p \\,\\|\\, \\mathbf{1}/K),

    a monotone transform of DR-DSGD's objective (1/K) Σ_i exp(f_i/μ), expressed in loss
    units. It lies between the mean loss (μ → ∞) and the worst loss (μ → 0).

    Parameters
    ----------
    losses : array_like
        f = (f_1, …, f_K), finite, K >= 1.
    mu : float
        μ > 0.

    Returns
    -------
    float
        R_μ(f), with mean(f) <= R_μ(f) <= max(f).

    Raises
    ------
    ValueError
        If losses is not a non-empty 1-D array of finite reals, or mu is not > 0.

    Examples
    --------
    >>> tilted_risk([1.0, 1.0], 0.5)
    1.0
    """
    mu_f = _check_mu(mu)
    f = _check_losses(losses)
    return float(mu_f * (logsumexp(f / mu_f) - math.log(f.size)))
