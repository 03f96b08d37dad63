r"""Affine distribution shifts x ↦ Λx + δ: the map, ball projections, attacks, robust accuracy.

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

This module is framework-free (torch only, no flwr): the client loop of
:mod:`flowerdro.clients.robust` calls :func:`apply_affine` and
:func:`inner_objective`; the evaluation of any final model calls
:func:`worst_affine_shift`, :func:`pgd_l2_attack` and :func:`robust_accuracy` (or
:func:`evaluate_robustness` with a model name and saved arrays).

The three evaluations, on a test set with no shift applied:

* **clean** accuracy;
* **affine**: accuracy at the (Λ, δ) — one shift shared by the whole test set — found by
  projected gradient ascent on the mean loss over ‖Λ − I‖_F ≤ ε₁, ‖δ‖₂ ≤ ε₂;
* **pgd**: accuracy under per-sample ℓ₂ PGD perturbations of radius ε (Madry et al.).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

#: Default largest flattened input dimension d an affine shift may have (CIFAR-10: 3072).
DEFAULT_MAX_DIM = 3072
#: Evaluations :func:`robust_accuracy` knows.
ROBUST_KINDS = ("clean", "affine", "pgd", "fgm")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- sizes
def flat_dim(input_shape: Sequence[int]) -> int:
    """d = ∏ input_shape, the dimension Λ acts on."""
    if len(input_shape) == 0:
        raise ValueError("input_shape: an affine shift needs inputs with at least one feature dimension, got ()")
    d = int(math.prod(int(s) for s in input_shape))
    if d < 1:
        raise ValueError(f"input_shape: every dimension must be >= 1, got {tuple(input_shape)}")
    return d


@contextmanager
def _frozen_eval(model: nn.Module) -> Iterator[None]:
    """Attack the inputs of ``model``: eval mode and no parameter gradients, restored after."""
    was_training = model.training
    req = [p.requires_grad for p in model.parameters()]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, r in zip(model.parameters(), req, strict=True):
            p.requires_grad_(r)
        model.train(was_training)


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

    One client keeps (Λ, δ) in its state and, while training, about four more d×d
    buffers (the float copy, its gradient, the update), so the working memory is
    roughly 5·d²·4 bytes.
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
def identity_shift(d: int, *, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Λ, δ) = (I_d, 0): no shift, the initial state of every FedRobust client."""
    return torch.eye(d, dtype=dtype, device=device), torch.zeros(d, dtype=dtype, device=device)


def apply_affine(x: torch.Tensor, lam: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    r"""x ↦ Λ x + δ on the flattened input, returned in the input's shape.

    Parameters
    ----------
    x : torch.Tensor
        A batch of shape (n, *input_shape) with ∏ input_shape = d (e.g. (n, d) or
        (n, 1, 28, 28)).
    lam : torch.Tensor
        Λ, shape (d, d).
    delta : torch.Tensor
        δ, shape (d,).

    Returns
    -------
    torch.Tensor
        Rows x_j' = Λ x_j + δ, reshaped to ``x.shape`` (differentiable in x, Λ and δ).

    Raises
    ------
    ValueError
        If x has no batch dimension or Λ, δ do not match its flattened dimension d.
    """
    if x.dim() < 2:
        raise ValueError(f"x: expected a batch of shape (n, *input_shape), got shape {tuple(x.shape)}")
    d = flat_dim(x.shape[1:])
    if lam.dim() != 2 or tuple(lam.shape) != (d, d):
        raise ValueError(
            f"lam: Λ must be (d, d) = ({d}, {d}) for inputs of shape {tuple(x.shape[1:])}, got {tuple(lam.shape)}"
        )
    if tuple(delta.shape) != (d,):
        raise ValueError(f"delta: δ must be ({d},) for inputs of shape {tuple(x.shape[1:])}, got {tuple(delta.shape)}")
    flat = x.reshape(x.shape[0], d)
    return (flat @ lam.T + delta).reshape(x.shape)


# --------------------------------------------------------------------------- projections
def _check_eps(eps: float, name: str) -> float:
    eps = float(eps)
    if not eps >= 0 or not math.isfinite(eps):
        raise ValueError(f"{name}: the radius must be a finite number >= 0, got {eps}")
    return eps


def project_frobenius_ball(lam: torch.Tensor, eps: float) -> torch.Tensor:
    r"""Π onto {Λ : ‖Λ − I‖_F ≤ ε₁}: Λ ↦ I + (Λ − I)·min(1, ε₁ / ‖Λ − I‖_F).

    >>> project_frobenius_ball(torch.tensor([[4.0, 0.0], [0.0, 1.0]]), 1.0)
    tensor([[2., 0.],
            [0., 1.]])
    """
    eps = _check_eps(eps, "eps_lambda")
    if lam.dim() != 2 or lam.shape[0] != lam.shape[1]:
        raise ValueError(f"lam: Λ must be square, got shape {tuple(lam.shape)}")
    eye = torch.eye(lam.shape[0], dtype=lam.dtype, device=lam.device)
    dev = lam - eye
    norm = float(torch.linalg.norm(dev))
    if norm <= eps:
        return lam.clone()
    return eye + dev * (eps / norm)


def project_l2_ball(v: torch.Tensor, eps: float) -> torch.Tensor:
    r"""Π onto {δ : ‖δ‖₂ ≤ ε₂}: δ ↦ δ·min(1, ε₂ / ‖δ‖₂) (the whole tensor as one vector).

    >>> project_l2_ball(torch.tensor([3.0, 4.0]), 1.0)
    tensor([0.6000, 0.8000])
    """
    eps = _check_eps(eps, "eps_delta")
    norm = float(torch.linalg.norm(v))
    if norm <= eps:
        return v.clone()
    return v * (eps / norm)


def project_l2_ball_rows(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Π of every sample v_j (first dimension) onto its own ℓ₂ ball of radius ε."""
    eps = _check_eps(eps, "eps")
    norms = v.reshape(v.shape[0], -1).norm(dim=1).clamp_min(1e-12)
    factor = torch.clamp(eps / norms, max=1.0)
    return v * factor.reshape(-1, *([1] * (v.dim() - 1)))


# --------------------------------------------------------------------------- inner problem
def inner_objective(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, lam: torch.Tensor, delta: torch.Tensor,
    penalty: float, loss_fn: LossFn | None = None,
) -> torch.Tensor:
    r"""φ(w, Λ, δ) = (1/|B|) Σ_j ℓ(f_w(Λ x_j + δ), y_j) − λ‖Λ − I‖_F² − λ‖δ‖₂² (differentiable).

    The per-node term of problem (3) on a batch B; λ = ``penalty`` ≥ 0.
    """
    if penalty < 0:
        raise ValueError(f"affine-lambda: λ must be >= 0, got {penalty}")
    loss = (loss_fn or F.cross_entropy)(model(apply_affine(x, lam, delta)), y)
    eye = torch.eye(lam.shape[0], dtype=lam.dtype, device=lam.device)
    return loss - penalty * ((lam - eye) ** 2).sum() - penalty * (delta ** 2).sum()


def check_ascent_rates(adv_lr: float, penalty: float) -> None:
    r"""Refuse an ascent rate and penalty whose shift iteration cannot converge.

    Algorithm 1's ascent step on the shift is
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


def affine_ascent_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, lam: torch.Tensor, delta: torch.Tensor, *,
    adv_lr: float, penalty: float, loss_fn: LossFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One gradient ascent step of Algorithm 1 on (Λ, δ) with w fixed.

    .. math::

        \Lambda \leftarrow \Lambda + \eta_2 \big(\nabla_\Lambda \ell - 2\lambda(\Lambda - I)\big),
        \qquad
        \delta \leftarrow \delta + \eta_2 \big(\nabla_\delta \ell - 2\lambda\delta\big).

    Returns new (detached) tensors; ``model``'s gradients are left untouched.
    """
    if not adv_lr > 0:
        raise ValueError(f"adv-lr: η₂ must be > 0, got {adv_lr}")
    lam_v = lam.detach().clone().requires_grad_(True)
    delta_v = delta.detach().clone().requires_grad_(True)
    phi = inner_objective(model, x, y, lam_v, delta_v, penalty, loss_fn)
    g_lam, g_delta = torch.autograd.grad(phi, (lam_v, delta_v))
    return (lam.detach() + adv_lr * g_lam).detach(), (delta.detach() + adv_lr * g_delta).detach()


# --------------------------------------------------------------------------- attacks
def margin_loss(logits: torch.Tensor, target: torch.Tensor, cap: float = 5.0) -> torch.Tensor:
    r"""Mean capped margin (Carlini–Wagner style), an attack loss that does not go flat.

    .. math:: \frac{1}{|B|}\sum_{j \in B} \min\big(\max_{k \neq y_j} z_{jk} - z_{j y_j},\ \text{cap}\big)

    It is positive for a misclassified sample. Use it as ``loss_fn`` of
    :func:`worst_affine_shift` / :func:`robust_accuracy` when the model's outputs are close
    to uniform: there the cross-entropy hardly changes along the attack and its ascent
    understates how many predictions a shift can flip. The cap stops samples that are
    already misclassified by ``cap`` from pulling the shared shift further.

    >>> margin_loss(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), torch.tensor([0, 0]))
    tensor(1.)
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"logits, target: expected (n, classes) and (n,), got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    if not cap > 0:
        raise ValueError(f"cap: must be > 0, got {cap}")
    true = logits.gather(1, target[:, None]).squeeze(1)
    others = logits.masked_fill(F.one_hot(target, logits.shape[1]).bool(), float("-inf")).max(1).values
    return (others - true).clamp(max=cap).mean()


def _batched_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lam: torch.Tensor, delta: torch.Tensor,
                  loss_fn: LossFn, batch_size: int, *, grad: bool) -> tuple[float, torch.Tensor | None,
                                                                         torch.Tensor | None]:
    """Mean loss over all of (x, y) at (Λ, δ) and, with ``grad``, its gradient in Λ and δ."""
    n = int(y.shape[0])
    total = 0.0
    g_lam = torch.zeros_like(lam) if grad else None
    g_delta = torch.zeros_like(delta) if grad else None
    for s in range(0, n, batch_size):
        xb, yb = x[s:s + batch_size], y[s:s + batch_size]
        w = int(yb.shape[0]) / n
        if grad:
            lv = lam.detach().requires_grad_(True)
            dv = delta.detach().requires_grad_(True)
            loss = loss_fn(model(apply_affine(xb, lv, dv)), yb) * w
            gl, gd = torch.autograd.grad(loss, (lv, dv))
            g_lam += gl
            g_delta += gd
        else:
            with torch.no_grad():
                loss = loss_fn(model(apply_affine(xb, lam, delta)), yb) * w
        total += float(loss.detach())
    return total, g_lam, g_delta


def worst_affine_shift(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps_lambda: float, eps_delta: float, *,
    steps: int = 20, step_size: float | None = None, loss_fn: LossFn | None = None, batch_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    r"""The affine shift of largest mean loss, by projected (normalised) gradient ascent.

    Maximises L(Λ, δ) = (1/N) Σ_j ℓ(f_w(Λ x_j + δ), y_j) over ONE shift (Λ, δ) shared by
    the whole set, subject to ‖Λ − I‖_F ≤ ε₁ and ‖δ‖₂ ≤ ε₂. From (I, 0), for k = 1..K,

    .. math::

        \Lambda \leftarrow \Pi_{\varepsilon_1}\Big(\Lambda + \alpha\varepsilon_1
            \frac{\nabla_\Lambda L}{\lVert\nabla_\Lambda L\rVert_F}\Big), \qquad
        \delta \leftarrow \Pi_{\varepsilon_2}\Big(\delta + \alpha\varepsilon_2
            \frac{\nabla_\delta L}{\lVert\nabla_\delta L\rVert_2}\Big),

    with full-set gradients (the model is fixed, so the problem is deterministic) and α
    = ``step_size`` (default 2.5/K, as for ℓ₂ PGD). The iterate of largest loss is
    returned (so K more steps never make the attack weaker).

    Parameters
    ----------
    model : torch.nn.Module
        f_w, used in eval mode; its parameters get no gradient.
    x, y : torch.Tensor
        Inputs (n, *input_shape) and labels (targets for ``loss_fn``).
    eps_lambda, eps_delta : float
        Radii ε₁, ε₂ ≥ 0 (0 fixes that part of the shift at I or 0).
    steps : int (default: 20)
        K ≥ 0 ascent steps.
    step_size : float, optional
        α > 0, the step as a fraction of each radius.
    loss_fn : callable, optional
        ℓ (mean over a batch); cross-entropy when unset.
    batch_size : int (default: 1024)
        Evaluation chunk (memory only; the gradient is over the whole set).

    Returns
    -------
    (torch.Tensor, torch.Tensor, float)
        Λ (d, d), δ (d,) and the mean loss there.
    """
    eps_lambda, eps_delta = _check_eps(eps_lambda, "eps_lambda"), _check_eps(eps_delta, "eps_delta")
    if steps < 0:
        raise ValueError(f"steps: must be >= 0, got {steps}")
    alpha = 2.5 / max(steps, 1) if step_size is None else float(step_size)
    if not alpha > 0:
        raise ValueError(f"step_size: must be > 0, got {step_size}")
    if x.dim() < 2:
        raise ValueError(f"x: expected a batch of shape (n, *input_shape), got shape {tuple(x.shape)}")
    criterion = loss_fn or F.cross_entropy
    d = flat_dim(x.shape[1:])
    lam, delta = identity_shift(d, dtype=x.dtype, device=x.device)
    with _frozen_eval(model):
        best = (lam.clone(), delta.clone(), -math.inf)
        for k in range(steps + 1):
            loss, g_lam, g_delta = _batched_loss(model, x, y, lam, delta, criterion, batch_size, grad=k < steps)
            if loss > best[2]:
                best = (lam.clone(), delta.clone(), loss)
            if k == steps:
                break
            assert g_lam is not None and g_delta is not None
            if eps_lambda > 0:
                gn = float(torch.linalg.norm(g_lam))
                if gn > 0:
                    lam = project_frobenius_ball(lam + (alpha * eps_lambda / gn) * g_lam, eps_lambda)
            if eps_delta > 0:
                gn = float(torch.linalg.norm(g_delta))
                if gn > 0:
                    delta = project_l2_ball(delta + (alpha * eps_delta / gn) * g_delta, eps_delta)
    return best


def pgd_l2_attack(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, *, steps: int = 10,
    step_size: float | None = None, loss_fn: LossFn | None = None,
) -> torch.Tensor:
    r"""Per-sample ℓ₂ PGD: x_j + v_j with ‖v_j‖₂ ≤ ε maximising ℓ(f_w(x_j + v_j), y_j).

    From v = 0, K = ``steps`` times

    .. math:: v_j \leftarrow \Pi_{\varepsilon}\big(v_j + \alpha\, g_j / \lVert g_j\rVert_2\big),
        \quad g_j = \nabla_{x} \ell(f_w(x_j + v_j), y_j),

    with α = ``step_size`` (default 2.5ε/K, Madry et al.). K = 1 with α = ε is the
    fast gradient method (FGM). The model is used in eval mode and its gradients are not
    touched. No clipping to an input range (an affine shift does not clip either).

    Returns
    -------
    torch.Tensor
        The perturbed inputs x + v (detached), same shape as ``x``.
    """
    eps = _check_eps(eps, "adv-eps")
    if steps < 1:
        raise ValueError(f"pgd-steps: must be >= 1, got {steps}")
    alpha = 2.5 * eps / steps if step_size is None else float(step_size)
    if not alpha >= 0:
        raise ValueError(f"step_size: must be >= 0, got {step_size}")
    if eps == 0 or alpha == 0:
        return x.detach().clone()
    criterion = loss_fn or F.cross_entropy
    with _frozen_eval(model):
        v = torch.zeros_like(x)
        shape = (-1, *([1] * (x.dim() - 1)))
        for _ in range(steps):
            v.requires_grad_(True)
            # sum, not mean: every sample's gradient keeps its own scale (it is normalised anyway)
            loss = F.cross_entropy(model(x + v), y, reduction="sum") if loss_fn is None \
                else criterion(model(x + v), y) * int(y.shape[0])
            (g,) = torch.autograd.grad(loss, v)
            gn = g.reshape(g.shape[0], -1).norm(dim=1).clamp_min(1e-12).reshape(shape)
            v = project_l2_ball_rows(v.detach() + alpha * g / gn, eps)
    return (x + v).detach()


def fgm_l2_attack(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, *,
                  loss_fn: LossFn | None = None) -> torch.Tensor:
    r"""Fast gradient method in ℓ₂: x_j + ε g_j/‖g_j‖₂ (one PGD step of size ε, already in the ball)."""
    return pgd_l2_attack(model, x, y, eps, steps=1, step_size=_check_eps(eps, "adv-eps"), loss_fn=loss_fn)


# --------------------------------------------------------------------------- accuracy
@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2048) -> float:
    """Fraction of argmax predictions equal to y."""
    was_training = model.training
    model.eval()
    correct = 0
    for s in range(0, int(y.shape[0]), batch_size):
        correct += int((model(x[s:s + batch_size]).argmax(1) == y[s:s + batch_size]).sum())
    model.train(was_training)
    return correct / max(int(y.shape[0]), 1)


def robust_accuracy(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str = "clean", *, eps: float = 0.0,
    eps_lambda: float = 0.0, eps_delta: float = 0.0, steps: int | None = None, step_size: float | None = None,
    batch_size: int = 1024, loss_fn: LossFn | None = None,
) -> float:
    """Accuracy of ``model`` on (x, y): clean, under the worst affine shift, or under ℓ₂ PGD / FGM.

    Parameters
    ----------
    kind : {"clean", "affine", "pgd", "fgm"}
        ``affine``: at :func:`worst_affine_shift` with radii ``eps_lambda`` (ε₁ on
        ‖Λ − I‖_F) and ``eps_delta`` (ε₂ on ‖δ‖₂), ``steps`` (default 20) ascent steps;
        ``pgd``: per-sample :func:`pgd_l2_attack` of radius ``eps`` with ``steps``
        (default 10); ``fgm``: one step of size ``eps``.
    loss_fn : callable, optional
        The loss the attack ascends (mean over a batch): cross-entropy when unset, or e.g.
        :func:`margin_loss` for low-confidence models.
    """
    if kind not in ROBUST_KINDS:
        raise ValueError(f"kind: unknown evaluation {kind!r}; allowed: {', '.join(ROBUST_KINDS)}")
    if kind == "clean":
        return accuracy(model, x, y)
    if kind == "affine":
        lam, delta, _ = worst_affine_shift(model, x, y, eps_lambda, eps_delta, steps=20 if steps is None else steps,
                                           step_size=step_size, batch_size=batch_size, loss_fn=loss_fn)
        with torch.no_grad():
            return accuracy(model, apply_affine(x, lam, delta), y)
    correct = 0
    for s in range(0, int(y.shape[0]), batch_size):
        xb, yb = x[s:s + batch_size], y[s:s + batch_size]
        if kind == "fgm":
            xa = fgm_l2_attack(model, xb, yb, eps, loss_fn=loss_fn)
        else:
            xa = pgd_l2_attack(model, xb, yb, eps, steps=10 if steps is None else steps, step_size=step_size,
                               loss_fn=loss_fn)
        correct += round(accuracy(model, xa, yb) * int(yb.shape[0]))
    return correct / max(int(y.shape[0]), 1)


def load_model(model_name: str, arrays: Mapping[str, Any] | Any, input_shape: Sequence[int], num_classes: int,
               **model_kwargs: Any) -> nn.Module:
    """A zoo model holding ``arrays`` (a dict name → array, an ``.npz`` mapping or an ArrayRecord)."""
    from flowerdro.models import build_model

    model = build_model(model_name, tuple(input_shape), int(num_classes), **model_kwargs)
    if hasattr(arrays, "to_torch_state_dict"):  # a flwr ArrayRecord (duck-typed: no flwr import)
        state = arrays.to_torch_state_dict()
    else:
        state = {k: torch.as_tensor(np.asarray(arrays[k])) for k in arrays.keys()}
    model.load_state_dict(state, strict=True)
    return model


def evaluate_robustness(
    model_name: str, arrays: Mapping[str, Any] | Any, x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor, *,
    num_classes: int, affine: Sequence[tuple[float, float]] = (), pgd: Sequence[float] = (),
    affine_steps: int = 20, pgd_steps: int = 10, model_kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Clean, worst-affine and ℓ₂-PGD accuracy of a saved model of ANY strategy.

    Parameters
    ----------
    model_name : str
        Zoo name (``logreg``, ``mlp``, ``cnn_mnist``, …).
    arrays : mapping or ArrayRecord
        The weights (e.g. ``np.load("final_model.npz")`` or ``Result.arrays``).
    x, y : array
        Test inputs (n, *input_shape) with no shift applied, and labels.
    affine : sequence of (ε₁, ε₂)
        Radii pairs for the worst affine shift.
    pgd : sequence of ε
        ℓ₂ PGD radii.

    Returns
    -------
    dict
        ``clean``, ``affine@<ε₁>,<ε₂>`` and ``pgd@<ε>`` accuracies.
    """
    xt = torch.as_tensor(np.asarray(x), dtype=torch.float32, device=device)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.int64, device=device)
    model = load_model(model_name, arrays, xt.shape[1:], num_classes, **dict(model_kwargs or {})).to(device)
    out = {"clean": robust_accuracy(model, xt, yt, "clean")}
    for e1, e2 in affine:
        out[f"affine@{e1:g},{e2:g}"] = robust_accuracy(model, xt, yt, "affine", eps_lambda=e1, eps_delta=e2,
                                                       steps=affine_steps)
    for e in pgd:
        out[f"pgd@{e:g}"] = robust_accuracy(model, xt, yt, "pgd", eps=e, steps=pgd_steps)
    return out
