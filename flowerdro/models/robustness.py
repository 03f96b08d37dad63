r"""Robust accuracy of any trained model: clean, under the worst affine shift, under ℓ₂ PGD / FGM.

The evaluations of Reisizadeh, Farnia, Pedarsani, Jadbabaie, "Robust Federated Learning:
The Case of Affine Distribution Shifts", NeurIPS 2020 (https://arxiv.org/abs/2006.08907),
on a test set with no shift applied:

* **clean** accuracy;
* **affine**: accuracy at the (Λ, δ) — one shift shared by the whole test set — found by
  projected gradient ascent on the mean loss over ‖Λ − I‖_F ≤ ε₁, ‖δ‖₂ ≤ ε₂
  (:func:`worst_affine_shift`);
* **pgd** / **fgm**: accuracy under per-sample ℓ₂ perturbations of radius ε (Madry et al.).

:func:`evaluate_robustness` takes a model name and saved arrays, so it serves the final
model of any strategy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from flowerdro.core.affine import check_radius, flat_dim, project_frobenius_ball, project_l2_ball
from flowerdro.models.affine import (
    LossFn,
    apply_affine,
    fgm_l2_attack,
    frozen_eval,
    identity_shift,
    pgd_l2_attack,
)

__all__ = ["ROBUST_KINDS", "accuracy", "evaluate_robustness", "load_model", "robust_accuracy", "worst_affine_shift"]

#: Evaluations :func:`robust_accuracy` knows.
ROBUST_KINDS = ("clean", "affine", "pgd", "fgm")


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

    with full-set gradients (the model is fixed, so the problem is deterministic), α
    = ``step_size`` (default 2.5/K, as for ℓ₂ PGD) and the projections Π of
    :mod:`flowerdro.core.affine`. The iterate of largest loss is returned (so K more steps
    never make the attack weaker).

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
    eps_lambda, eps_delta = check_radius(eps_lambda, "eps_lambda"), check_radius(eps_delta, "eps_delta")
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
    eye = lam.clone()
    with frozen_eval(model):
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
                    lam = project_frobenius_ball(lam + (alpha * eps_lambda / gn) * g_lam, eps_lambda, eye)
            if eps_delta > 0:
                gn = float(torch.linalg.norm(g_delta))
                if gn > 0:
                    delta = project_l2_ball(delta + (alpha * eps_delta / gn) * g_delta, eps_delta)
    return best


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
        ``pgd``: per-sample :func:`~flowerdro.models.affine.pgd_l2_attack` of radius ``eps``
        with ``steps`` (default 10); ``fgm``: one step of size ``eps``.
    loss_fn : callable, optional
        The loss the attack ascends (mean over a batch): cross-entropy when unset, or e.g.
        :func:`~flowerdro.models.affine.margin_loss` for low-confidence models.
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
    from flowerdro.models.zoo import build_model

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
