r"""Affine distribution shifts x ↦ Λx + δ: the shape check of the map, the ball projections, FedRobust's ascent step.

Reisizadeh, Farnia, Pedarsani, Jadbabaie, "Robust Federated Learning: The Case of Affine
Distribution Shifts", NeurIPS 2020, https://arxiv.org/abs/2006.08907 (FedRobust / FLRA).

The paper models the data of node i as an affine transformation of a common
distribution, x ↦ Λ_i x + δ_i, and trains against the worst such shift,

.. math::

    \min_w \max_{(\Lambda_i, \delta_i)} \frac{1}{nm} \sum_{i=1}^n \sum_{j=1}^m
        \ell\big(f_w(\Lambda_i x_{ij} + \delta_i), y_{ij}\big)
        - \lambda \lVert \Lambda_i - I \rVert_F^2 - \lambda \lVert \delta_i \rVert_2^2

(its problem (3)). Λ acts on the *flattened* input: for inputs of shape (C, H, W) it is a
d×d matrix with d = C·H·W, so one (Λ, δ) holds d² + d numbers
(:func:`affine_state_bytes`: 2.46 MB in float32 for MNIST, d = 784; 37.76 MB for
CIFAR-10, d = 3072). :func:`check_affine_dim` refuses a dimension above a limit.

This module is the arithmetic only (numpy): the shape check of the map, the projections onto the balls
‖Λ − I‖_F ≤ ε₁ and ‖δ‖₂ ≤ ε₂, and the ascent step on (Λ, δ) given the loss gradients.
:func:`affine_ascent_update`, :func:`project_frobenius_ball` and :func:`project_l2_ball`
use nothing but arithmetic on their arguments, so the torch code of
:mod:`flowerdro.models.affine` (the differentiable map, the gradients, the attacks) calls them
on tensors too, passing its own identity matrix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Default largest flattened input dimension d an affine shift may have (CIFAR-10: 3072).
DEFAULT_MAX_DIM = 3072

#: A numpy array, or any array type with the same arithmetic (a torch.Tensor).
Arr = Any


# --------------------------------------------------------------------------- sizes
def flat_dim(input_shape: Sequence[int]) -> int:
    """d = ∏ input_shape, the dimension Λ acts on.

    Raises
    ------
    ValueError
        If ``input_shape`` is empty or holds a dimension below 1.
    """
    if len(input_shape) == 0:
        raise ValueError("input_shape: an affine shift needs inputs with at least one feature dimension, got ()")
    d = int(math.prod(int(s) for s in input_shape))
    if d < 1:
        raise ValueError(f"input_shape: every dimension must be >= 1, got {tuple(input_shape)}")
    return d


def affine_state_bytes(d: int, bytes_per_value: int = 4) -> int:
    """Bytes of one (Λ, δ): (d² + d)·``bytes_per_value`` (float32: 4).

    >>> affine_state_bytes(784)  # MNIST
    2461760
    >>> affine_state_bytes(3072)  # CIFAR-10
    37761024
    """
    return (d * d + d) * int(bytes_per_value)


def check_affine_dim(d: int, max_dim: int = DEFAULT_MAX_DIM) -> None:
    """Raise a ValueError naming the memory when d > ``max_dim`` (run config ``affine-max-dim``).

    One client holds (Λ, δ) and, while training, about four more d×d buffers (the float
    copy, its gradient, the update), so the working memory is roughly 5·d²·4 bytes.
    """
    if max_dim < 1:
        raise ValueError(f"affine-max-dim: must be >= 1, got {max_dim}")
    if d > max_dim:
        mb = affine_state_bytes(d) / 1e6
        raise ValueError(
            f"affine-max-dim: the flattened input has d = {d} features, so one affine shift "
            f"(Λ: d×d, δ: d) needs {mb:.1f} MB per client in float32 (about {5 * mb:.0f} MB while "
            f"training), above the limit d <= {max_dim}; raise 'affine-max-dim' if the client "
            f"has the memory, or use a smaller input"
        )


# --------------------------------------------------------------------------- the map
def check_shift_shapes(x_shape: Sequence[int], lam_shape: Sequence[int], delta_shape: Sequence[int]) -> int:
    """d for a batch of shape ``x_shape``, after checking Λ is (d, d) and δ is (d,).

    Raises
    ------
    ValueError
        Naming ``x``, ``lam`` or ``delta``, whichever does not fit.
    """
    x_shape, lam_shape, delta_shape = tuple(x_shape), tuple(lam_shape), tuple(delta_shape)
    if len(x_shape) < 2:
        raise ValueError(f"x: expected a batch of shape (n, *input_shape), got shape {x_shape}")
    d = flat_dim(x_shape[1:])
    if lam_shape != (d, d):
        raise ValueError(f"lam: Λ must be (d, d) = ({d}, {d}) for inputs of shape {x_shape[1:]}, got {lam_shape}")
    if delta_shape != (d,):
        raise ValueError(f"delta: δ must be ({d},) for inputs of shape {x_shape[1:]}, got {delta_shape}")
    return d


# --------------------------------------------------------------------------- projections
def check_radius(eps: float, name: str) -> float:
    """``eps`` as a float, or a ValueError naming ``name`` unless it is finite and >= 0."""
    eps = float(eps)
    if not eps >= 0 or not math.isfinite(eps):
        raise ValueError(f"{name}: the radius must be a finite number >= 0, got {eps}")
    return eps


def _norm(v: Any) -> float:
    """‖v‖ (Frobenius / ℓ₂ over all entries) by arithmetic alone."""
    return math.sqrt(float((v * v).sum()))


def project_frobenius_ball(lam: Arr, eps: float, eye: Arr | None = None) -> Arr:
    r"""Π onto {Λ : ‖Λ − I‖_F ≤ ε₁}: Λ ↦ I + (Λ − I)·min(1, ε₁ / ‖Λ − I‖_F).

    ``eye`` is the identity in ``lam``'s array type (default: a numpy identity). A Λ
    already inside the ball is returned as a copy, unchanged to the bit.

    >>> project_frobenius_ball(np.array([[4.0, 0.0], [0.0, 1.0]]), 1.0)
    array([[2., 0.],
           [0., 1.]])
    """
    eps = check_radius(eps, "eps_lambda")
    shape = tuple(lam.shape)
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(f"lam: Λ must be square, got shape {shape}")
    eye = np.eye(shape[0], dtype=lam.dtype) if eye is None else eye
    dev = lam - eye
    norm = _norm(dev)
    if norm <= eps:
        return lam * 1
    return eye + dev * (eps / norm)


def project_l2_ball(v: Arr, eps: float) -> Arr:
    r"""Π onto {δ : ‖δ‖₂ ≤ ε₂}: δ ↦ δ·min(1, ε₂ / ‖δ‖₂) (the whole array as one vector).

    >>> project_l2_ball(np.array([3.0, 4.0]), 1.0)
    array([0.6, 0.8])
    """
    eps = check_radius(eps, "eps_delta")
    norm = _norm(v)
    if norm <= eps:
        return v * 1
    return v * (eps / norm)


# --------------------------------------------------------------------------- the ascent step
def check_ascent_rates(adv_lr: float, penalty: float) -> None:
    r"""Refuse an ascent rate and penalty whose shift iteration cannot converge.

    Algorithm 1's ascent step on the shift (:func:`affine_ascent_update`) is
    Λ − I ← (1 − 2λη₂)(Λ − I) + η₂∇_Λℓ (and the same for δ), a linear recursion whose
    factor 1 − 2λη₂ must lie in (−1, 1] for the shift to stay bounded; with λ ≥ 0, η₂ > 0
    that is λη₂ < 1. (At λη₂ = 1/2 the penalty cancels the previous shift in every step.)

    Raises
    ------
    ValueError
        If η₂ ≤ 0, λ < 0 or λη₂ ≥ 1.
    """
    if not adv_lr > 0:
        raise ValueError(f"adv-lr: η₂ must be > 0, got {adv_lr}")
    if not penalty >= 0:
        raise ValueError(f"affine-lambda: λ must be >= 0, got {penalty}")
    if adv_lr * penalty >= 1.0:
        raise ValueError(
            f"adv-lr, affine-lambda: the shift ascent multiplies Λ − I and δ by 1 − 2λη₂ = "
            f"{1.0 - 2.0 * penalty * adv_lr:g} per step and diverges unless λη₂ < 1; got "
            f"η₂ = {adv_lr:g}, λ = {penalty:g} (λη₂ = {adv_lr * penalty:g}): lower adv-lr below "
            f"{1.0 / penalty:g}"
        )


def affine_ascent_update(lam: Arr, delta: Arr, g_lam: Arr, g_delta: Arr, *, adv_lr: float, penalty: float,
                         eye: Arr | None = None) -> tuple[Arr, Arr]:
    r"""One gradient ascent step of Algorithm 1 on (Λ, δ), given the loss gradients at (Λ, δ).

    With g_Λ = ∇_Λ (1/|B|)Σ_j ℓ(f_w(Λx_j + δ), y_j) and g_δ likewise, the ascent on the
    penalised objective φ = mean loss − λ‖Λ − I‖_F² − λ‖δ‖₂² is

    .. math::

        \Lambda \leftarrow \Lambda + \eta_2 \big(g_\Lambda - 2\lambda(\Lambda - I)\big),
        \qquad
        \delta \leftarrow \delta + \eta_2 \big(g_\delta - 2\lambda\delta\big).

    Parameters
    ----------
    lam, delta : array
        Λ (d, d) and δ (d,).
    g_lam, g_delta : array
        The loss gradients in Λ and δ (same shapes).
    adv_lr : float
        η₂ > 0.
    penalty : float
        λ ≥ 0.
    eye : array, optional
        I_d in the arrays' type (default: a numpy identity of ``lam``'s dtype).

    Returns
    -------
    (array, array)
        The new Λ and δ (new arrays; the inputs are not modified).
    """
    eye = np.eye(lam.shape[0], dtype=lam.dtype) if eye is None else eye
    new_lam = lam + adv_lr * (g_lam - 2.0 * penalty * (lam - eye))
    new_delta = delta + adv_lr * (g_delta - 2.0 * penalty * delta)
    return new_lam, new_delta


def shift_norms(lam: np.ndarray, delta: np.ndarray) -> tuple[float, float]:
    """(‖Λ − I‖_F, ‖δ‖₂) of a stored shift (computed in float64)."""
    lam64 = np.asarray(lam, dtype=np.float64)
    dev = lam64 - np.eye(lam64.shape[0])
    return float(np.linalg.norm(dev)), float(np.linalg.norm(np.asarray(delta, dtype=np.float64)))
