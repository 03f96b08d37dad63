r"""Affine shifts and ℓ₂ attacks on torch models: the map, FedRobust's inner objective, PGD / FGM.

The torch side of :mod:`flowerdro.core.affine` (Reisizadeh, Farnia, Pedarsani, Jadbabaie,
NeurIPS 2020, https://arxiv.org/abs/2006.08907): :func:`apply_affine` x ↦ Λx + δ on a
batch of tensors (differentiable in x, Λ and δ), the per-node objective φ of problem (3)
(:func:`inner_objective`), one ascent step on (Λ, δ) by autograd
(:func:`affine_ascent_step`, whose arithmetic is :func:`flowerdro.core.affine.affine_ascent_update`),
and the per-sample ℓ₂ attacks of the adversarial-training baselines (:func:`pgd_l2_attack`,
:func:`fgm_l2_attack`). The training loops of :mod:`flowerdro.clients.robust` and the
evaluations of :mod:`flowerdro.models.robustness` call these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from flowerdro.core.affine import affine_ascent_update, check_radius, check_shift_shapes

__all__ = [
    "LossFn",
    "affine_ascent_step",
    "apply_affine",
    "fgm_l2_attack",
    "frozen_eval",
    "identity_shift",
    "inner_objective",
    "margin_loss",
    "pgd_l2_attack",
    "project_l2_ball_rows",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@contextmanager
def frozen_eval(model: nn.Module) -> Iterator[None]:
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


def identity_shift(d: int, *, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Λ, δ) = (I_d, 0) as tensors: no shift."""
    return torch.eye(d, dtype=dtype, device=device), torch.zeros(d, dtype=dtype, device=device)


def apply_affine(x: torch.Tensor, lam: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    r"""x ↦ Λ x + δ on the flattened input, returned in the input's shape (differentiable).

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
        Rows x_j' = Λ x_j + δ, reshaped to ``x.shape``.

    Raises
    ------
    ValueError
        If x has no batch dimension or Λ, δ do not match its flattened dimension d.
    """
    d = check_shift_shapes(x.shape, lam.shape, delta.shape)
    flat = x.reshape(x.shape[0], d)
    return (flat @ lam.T + delta).reshape(x.shape)


def project_l2_ball_rows(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Π of every sample v_j (first dimension) onto its own ℓ₂ ball: v_j ↦ v_j·min(1, ε/‖v_j‖₂)."""
    eps = check_radius(eps, "eps")
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


def affine_ascent_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, lam: torch.Tensor, delta: torch.Tensor, *,
    adv_lr: float, penalty: float, loss_fn: LossFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One gradient ascent step of Algorithm 1 on (Λ, δ) with w fixed.

    The loss gradients g_Λ, g_δ of (1/|B|) Σ_j ℓ(f_w(Λx_j + δ), y_j) by autograd, then
    :func:`~flowerdro.core.affine.affine_ascent_update`:
    Λ ← Λ + η₂(g_Λ − 2λ(Λ − I)), δ ← δ + η₂(g_δ − 2λδ).

    Returns new (detached) tensors; ``model``'s gradients are left untouched.
    """
    if not adv_lr > 0:
        raise ValueError(f"adv-lr: η₂ must be > 0, got {adv_lr}")
    if penalty < 0:
        raise ValueError(f"affine-lambda: λ must be >= 0, got {penalty}")
    lam_v = lam.detach().clone().requires_grad_(True)
    delta_v = delta.detach().clone().requires_grad_(True)
    loss = (loss_fn or F.cross_entropy)(model(apply_affine(x, lam_v, delta_v)), y)
    # a model that ignores its input has zero gradient in (Λ, δ), not none
    g_lam, g_delta = torch.autograd.grad(loss, (lam_v, delta_v), allow_unused=True, materialize_grads=True)
    eye = torch.eye(lam.shape[0], dtype=lam.dtype, device=lam.device)
    new_lam, new_delta = affine_ascent_update(lam.detach(), delta.detach(), g_lam, g_delta, adv_lr=adv_lr,
                                              penalty=penalty, eye=eye)
    return new_lam.detach(), new_delta.detach()


# --------------------------------------------------------------------------- attacks
def margin_loss(logits: torch.Tensor, target: torch.Tensor, cap: float = 5.0) -> torch.Tensor:
    r"""Mean capped margin (Carlini–Wagner style), an attack loss that does not go flat.

    .. math:: \frac{1}{|B|}\sum_{j \in B} \min\big(\max_{k \neq y_j} z_{jk} - z_{j y_j},\ \text{cap}\big)

    It is positive for a misclassified sample. Use it as ``loss_fn`` of the evaluations in
    :mod:`flowerdro.models.robustness` when the model's outputs are close to uniform: there
    the cross-entropy hardly changes along the attack and its ascent understates how many
    predictions a shift can flip. The cap stops samples that are already misclassified by
    ``cap`` from pulling the shared shift further.

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
    eps = check_radius(eps, "adv-eps")
    if steps < 1:
        raise ValueError(f"pgd-steps: must be >= 1, got {steps}")
    alpha = 2.5 * eps / steps if step_size is None else float(step_size)
    if not alpha >= 0:
        raise ValueError(f"step_size: must be >= 0, got {step_size}")
    if eps == 0 or alpha == 0:
        return x.detach().clone()
    criterion = loss_fn or F.cross_entropy
    with frozen_eval(model):
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
    return pgd_l2_attack(model, x, y, eps, steps=1, step_size=check_radius(eps, "adv-eps"), loss_fn=loss_fn)
