"""Affine shifts and attacks on torch models, the robust evaluations and the FedRobust / adversarial local loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from flowerdro.clients.robust import adversarial_local, fedrobust_local
from flowerdro.clients.training import LocalData, make_generator, minibatches
from flowerdro.core.affine import (
    affine_state_bytes,
    check_affine_dim,
    project_frobenius_ball,
    project_l2_ball,
)
from flowerdro.models.affine import (
    affine_ascent_step,
    apply_affine,
    fgm_l2_attack,
    inner_objective,
    margin_loss,
    pgd_l2_attack,
    project_l2_ball_rows,
)
from flowerdro.models.robustness import evaluate_robustness, robust_accuracy, worst_affine_shift

DT = torch.float64


def _linear(w: np.ndarray, b: np.ndarray | None = None) -> nn.Linear:
    """A linear classifier with weights W (classes × d) and bias b."""
    lin = nn.Linear(w.shape[1], w.shape[0], dtype=DT)
    with torch.no_grad():
        lin.weight.copy_(torch.as_tensor(w))
        lin.bias.copy_(torch.as_tensor(np.zeros(w.shape[0]) if b is None else b))
    return lin


class _Flat(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.flatten(1))


# --------------------------------------------------------------------------- the map and sizes
def test_apply_affine_matches_numpy_on_image_shaped_batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 1, 2, 3))
    lam, delta = rng.normal(size=(6, 6)), rng.normal(size=6)
    out = apply_affine(torch.as_tensor(x), torch.as_tensor(lam), torch.as_tensor(delta))
    expected = (x.reshape(5, 6) @ lam.T + delta).reshape(5, 1, 2, 3)
    assert out.shape == (5, 1, 2, 3)
    # float64 6×6 matmul plus a shift: rounding ≈ 6·eps ≈ 1e-15 relative; 1e-12 leaves margin
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12)


@pytest.mark.parametrize("x_shape,lam_shape,delta_shape,match", [
    ((4, 3), (2, 2), (3,), "lam"),
    ((4, 3), (3, 3), (2,), "delta"),
    ((3,), (3, 3), (3,), "batch"),
    ((4, 2, 2), (4, 3), (4,), "lam"),
])
def test_apply_affine_rejects_shapes_it_cannot_apply_to(x_shape, lam_shape, delta_shape, match):
    with pytest.raises(ValueError, match=match):
        apply_affine(torch.zeros(x_shape), torch.zeros(lam_shape), torch.zeros(delta_shape))


def test_memory_of_one_shift_and_the_dimension_limit():
    # (d² + d)·4 bytes: MNIST 784² + 784 = 615 440 floats, CIFAR-10 3072² + 3072 = 9 440 256.
    assert affine_state_bytes(784) == 615_440 * 4
    assert affine_state_bytes(3072) == 9_440_256 * 4
    check_affine_dim(784, 784)
    with pytest.raises(ValueError, match=r"affine-max-dim.*d = 3072.*37\.8 MB"):
        check_affine_dim(3072, 1024)
    with pytest.raises(ValueError, match="affine-max-dim"):
        check_affine_dim(10, 0)


# --------------------------------------------------------------------------- projections
def test_ball_projections_apply_to_tensors_by_hand():
    # Λ − I = [[3, 0], [0, 4]] has ‖·‖_F = 5; radius 1 scales it by 1/5 (the core's arithmetic on
    # tensors, with the tensor identity passed in); inside the ball: unchanged to the bit.
    lam = torch.tensor([[4.0, 0.0], [0.0, 5.0]])
    out = project_frobenius_ball(lam, 1.0, torch.eye(2))
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), [[1.6, 0.0], [0.0, 1.8]])
    assert torch.equal(project_frobenius_ball(lam, 6.0, torch.eye(2)), lam)
    # float32 tensors: each result is within u ≈ 6e-8 relative of the decimal, inside the default
    # rtol 1e-7
    np.testing.assert_allclose(project_l2_ball(torch.tensor([3.0, 4.0]), 2.0).numpy(), [1.2, 1.6])
    rows = torch.tensor([[3.0, 4.0], [0.0, 0.5], [0.0, 0.0]])
    np.testing.assert_allclose(project_l2_ball_rows(rows, 1.0).numpy(), [[0.6, 0.8], [0.0, 0.5], [0.0, 0.0]])


@pytest.mark.parametrize("fn", [lambda: project_frobenius_ball(np.eye(2), -0.1),
                                lambda: project_l2_ball(np.zeros(2), -1.0),
                                lambda: project_l2_ball_rows(torch.zeros(2, 2), -1.0),
                                lambda: pgd_l2_attack(nn.Linear(2, 2), torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), -1.0),
                                lambda: worst_affine_shift(nn.Linear(2, 2), torch.zeros(1, 2),
                                                           torch.zeros(1, dtype=torch.long), -1.0, 1.0)])
def test_negative_radius_is_an_error(fn):
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        fn()


# --------------------------------------------------------------------------- worst affine shift, linear model
def test_worst_shift_of_a_binary_linear_model_matches_the_closed_form():
    # Two classes, logits Wx + b: the cross-entropy of label y is softplus(−vᵀx' − c) with
    # v = W_y − W_other. For one example, vᵀ(Λx + δ) = vᵀx + vᵀEx + vᵀδ (E = Λ − I) is
    # smallest on ‖E‖_F ≤ ε₁, ‖δ‖ ≤ ε₂ at E* = −ε₁ v xᵀ/(‖v‖‖x‖), δ* = −ε₂ v/‖v‖.
    rng = np.random.default_rng(1)
    d = 5
    w, b = rng.normal(size=(2, d)), rng.normal(size=2)
    x, y = rng.normal(size=(1, d)), 1
    model = _linear(w, b)
    e1, e2 = 0.7, 0.4
    lam, delta, loss = worst_affine_shift(model, torch.as_tensor(x), torch.tensor([y]), e1, e2, steps=40)
    v = w[y] - w[1 - y]
    e_star = -e1 * np.outer(v, x[0]) / (np.linalg.norm(v) * np.linalg.norm(x))
    delta_star = -e2 * v / np.linalg.norm(v)
    # the loss is monotone in vᵀ(Ex + δ), so projected ascent lands on (E*, δ*) up to float64
    # rounding
    # (≈1e-15); atol 1e-8 and, for the softplus of the margin, rel 1e-10 leave ample room
    np.testing.assert_allclose(lam.numpy() - np.eye(d), e_star, atol=1e-8)
    np.testing.assert_allclose(delta.numpy(), delta_star, atol=1e-8)
    margin = v @ (x[0] + e_star @ x[0] + delta_star) + b[y] - b[1 - y]
    assert loss == pytest.approx(math.log1p(math.exp(-margin)), rel=1e-10)


def test_margin_loss_by_hand_and_its_cap():
    z = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]], dtype=DT)
    y = torch.tensor([0, 0])
    # margins max_{k≠y} z_k − z_y: 1 − 2 = −1 and 3 − 0 = 3
    assert float(margin_loss(z, y)) == pytest.approx(1.0)
    assert float(margin_loss(z, y, cap=2.0)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="cap"):
        margin_loss(z, y, cap=0.0)
    with pytest.raises(ValueError, match="logits, target"):
        margin_loss(z, torch.tensor([0]))


def test_worst_shift_under_the_margin_loss_matches_the_closed_form():
    # Binary linear model, one example: the margin loss is −(vᵀx' + c), decreasing in the same
    # vᵀx' as the cross-entropy, so the worst shift is the same (E*, δ*) and the loss is −margin.
    rng = np.random.default_rng(5)
    d = 4
    w, b = rng.normal(size=(2, d)), rng.normal(size=2)
    x, y = rng.normal(size=(1, d)), 0
    e1, e2 = 0.3, 0.2
    lam, delta, loss = worst_affine_shift(_linear(w, b), torch.as_tensor(x), torch.tensor([y]), e1, e2, steps=40,
                                          loss_fn=lambda z, t: margin_loss(z, t, cap=1e6))
    v = w[y] - w[1 - y]
    e_star = -e1 * np.outer(v, x[0]) / (np.linalg.norm(v) * np.linalg.norm(x))
    delta_star = -e2 * v / np.linalg.norm(v)
    # as above: float64 rounding (≈1e-15) once the ascent reaches (E*, δ*); 1e-8 and rel 1e-10 leave
    # ample room
    np.testing.assert_allclose(lam.numpy() - np.eye(d), e_star, atol=1e-8)
    np.testing.assert_allclose(delta.numpy(), delta_star, atol=1e-8)
    margin = v @ (x[0] + e_star @ x[0] + delta_star) + b[y] - b[1 - y]
    assert loss == pytest.approx(-margin, rel=1e-10)


def test_robust_accuracy_passes_the_attack_loss_through():
    # δ only, one label, binary linear model: under either loss the worst δ is −ε v/‖v‖ for the
    # whole set, so the accuracy is that of the predictions at x_j − ε v/‖v‖, computed directly.
    rng = np.random.default_rng(6)
    d, n, eps = 3, 40, 1.0
    w = rng.normal(size=(2, d))
    x = rng.normal(size=(n, d))
    y = torch.zeros(n, dtype=torch.long)
    v = w[0] - w[1]
    expected = float(np.mean((x - eps * v / np.linalg.norm(v)) @ v > 0))
    for loss_fn in (None, margin_loss):
        acc = robust_accuracy(_linear(w), torch.as_tensor(x), y, "affine", eps_lambda=0.0, eps_delta=eps,
                              steps=20, loss_fn=loss_fn)
        # accuracy is a count over n from the same decisions: default approx only absorbs the
        # float64 division
        assert acc == pytest.approx(expected)


def test_worst_delta_for_many_examples_of_one_label_is_minus_eps_v_over_norm():
    # Only δ free (ε₁ = 0): every term is decreasing in vᵀδ, so δ* = −ε v/‖v‖ for the whole set.
    rng = np.random.default_rng(2)
    d, n = 4, 30
    w = rng.normal(size=(2, d))
    x = torch.as_tensor(rng.normal(size=(n, d)))
    y = torch.zeros(n, dtype=torch.long)
    lam, delta, _ = worst_affine_shift(_linear(w), x, y, 0.0, 1.5, steps=20)
    v = w[0] - w[1]
    # constant gradient direction: δ lands on −ε v/‖v‖ up to float64 rounding (≈1e-15); 1e-8 is
    # ample
    np.testing.assert_allclose(delta.numpy(), -1.5 * v / np.linalg.norm(v), atol=1e-8)
    np.testing.assert_allclose(lam.numpy(), np.eye(d))


def test_worst_shift_beats_a_brute_force_search_on_a_tiny_three_class_problem():
    # The mean cross-entropy of a linear model is convex in (Λ, δ), so its maximum over the
    # two balls sits on the product of the two spheres: sample that product densely.
    rng = np.random.default_rng(3)
    d, n, k = 2, 12, 3
    w = rng.normal(size=(k, d))
    x = rng.normal(size=(n, d))
    y = rng.integers(0, k, size=n)
    e1, e2 = 0.5, 0.3
    model = _linear(w)
    _, _, pga_loss = worst_affine_shift(model, torch.as_tensor(x), torch.as_tensor(y), e1, e2, steps=200,
                                        step_size=0.02)
    m = 60_000
    e = rng.normal(size=(m, d * d))
    e *= e1 / np.linalg.norm(e, axis=1, keepdims=True)
    dl = rng.normal(size=(m, d))
    dl *= e2 / np.linalg.norm(dl, axis=1, keepdims=True)
    shifted = x[None] + np.einsum("mij,nj->mni", e.reshape(m, d, d), x) + dl[:, None, :]
    logits = shifted @ w.T
    lse = np.log(np.exp(logits).sum(-1))
    losses = (lse - np.take_along_axis(logits, y[None, :, None], axis=-1)[..., 0]).mean(1)
    assert pga_loss >= losses.max() - 1e-4
    assert pga_loss <= losses.max() + 0.05  # and it is a feasible point, not an overshoot


def test_worst_affine_accuracy_is_never_above_clean_and_zero_radius_is_clean():
    rng = np.random.default_rng(4)
    x = torch.as_tensor(rng.normal(size=(60, 3)))
    y = torch.as_tensor(rng.integers(0, 3, size=60))
    model = _linear(rng.normal(size=(3, 3)))
    clean = robust_accuracy(model, x, y, "clean")
    assert robust_accuracy(model, x, y, "affine", eps_lambda=0.0, eps_delta=0.0) == clean
    assert robust_accuracy(model, x, y, "affine", eps_lambda=0.5, eps_delta=0.5) <= clean
    with pytest.raises(ValueError, match="kind"):
        robust_accuracy(model, x, y, "linf")


# --------------------------------------------------------------------------- per-sample ℓ₂ attacks, linear model
@pytest.mark.parametrize("attack", ["pgd", "fgm"])
def test_l2_attacks_on_a_binary_linear_model_match_the_closed_form(attack):
    # Per example the worst ℓ₂ perturbation of radius ε is −ε v_j/‖v_j‖, v_j = W_{y_j} − W_{other}.
    rng = np.random.default_rng(5)
    w = rng.normal(size=(2, 6))
    x = torch.as_tensor(rng.normal(size=(8, 6)))
    y = torch.as_tensor(rng.integers(0, 2, size=8))
    model = _linear(w)
    eps = 0.8
    xa = pgd_l2_attack(model, x, y, eps, steps=10) if attack == "pgd" else fgm_l2_attack(model, x, y, eps)
    v = w[y.numpy()] - w[1 - y.numpy()]
    expected = x.numpy() - eps * v / np.linalg.norm(v, axis=1, keepdims=True)
    # linear model: constant gradient direction, so the attack lands on x − εv/‖v‖ up to float64
    # rounding (≈1e-15)
    np.testing.assert_allclose(xa.numpy(), expected, atol=1e-8)
    assert not any(p.grad is not None for p in model.parameters())


# --------------------------------------------------------------------------- local GDA
def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 8, dtype=DT), nn.Tanh(), nn.Linear(8, 3, dtype=DT))


def _data(n: int = 40, seed: int = 0) -> LocalData:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2, 3))
    y = rng.integers(0, 3, size=n)
    return LocalData.from_numpy(x, y, x, y, torch.device("cpu"), dtype=torch.float64)


def _squared_loss_problem(seed: int = 11):
    """A one-output linear model f(x) = wᵀx + b, its data, and a shift (Λ, δ) off the identity."""
    rng = np.random.default_rng(seed)
    n, d = 7, 4
    x, y = rng.normal(size=(n, d)), rng.normal(size=(n, 1))
    w, b = rng.normal(size=d), rng.normal()
    lam, delta = np.eye(d) + 0.1 * rng.normal(size=(d, d)), 0.2 * rng.normal(size=d)
    model = nn.Linear(d, 1, dtype=DT)
    with torch.no_grad():
        model.weight.copy_(torch.as_tensor(w[None, :]))
        model.bias.fill_(b)
    return model, x, y, w, b, lam, delta


def _squared_loss_gradients(x, y, w, b, lam, delta):
    """Residuals r_j = wᵀ(Λx_j + δ) + b − y_j of ℓ = (1/n)Σ r_j² and its gradients, by hand.

    ∇_Λ ℓ = (2/n) Σ_j r_j w x_jᵀ, ∇_δ ℓ = (2/n) Σ_j r_j w, ∇_w ℓ = (2/n) Σ_j r_j (Λx_j + δ),
    ∂ℓ/∂b = (2/n) Σ_j r_j.
    """
    n = x.shape[0]
    shifted = x @ lam.T + delta
    r = shifted @ w + b - y[:, 0]
    return r, 2 / n * np.outer(w, r @ x), 2 / n * r.sum() * w, 2 / n * r @ shifted, 2 / n * r.sum()


def test_inner_objective_and_one_ascent_step_of_a_linear_model_with_squared_loss_by_hand():
    model, x, y, w, b, lam, delta = _squared_loss_problem()
    eta, pen = 0.05, 0.3
    r, g_lam, g_delta, _, _ = _squared_loss_gradients(x, y, w, b, lam, delta)
    phi = np.mean(r ** 2) - pen * np.sum((lam - np.eye(4)) ** 2) - pen * np.sum(delta ** 2)
    args = (model, torch.as_tensor(x), torch.as_tensor(y), torch.as_tensor(lam), torch.as_tensor(delta))
    # float64 mean of 7 squares and two penalties: rounding ≈ 10·eps ≈ 2e-15 relative; 1e-13 leaves
    # margin
    assert float(inner_objective(*args, pen, loss_fn=F.mse_loss).detach()) == pytest.approx(phi, rel=1e-13)
    new_lam, new_delta = affine_ascent_step(*args, adv_lr=eta, penalty=pen, loss_fn=F.mse_loss)
    # float64 sums of a handful of O(1) products: agreement to ~1e-15, asserted at 1e-12
    np.testing.assert_allclose(new_lam.numpy(), lam + eta * (g_lam - 2 * pen * (lam - np.eye(4))), atol=1e-12)
    np.testing.assert_allclose(new_delta.numpy(), delta + eta * (g_delta - 2 * pen * delta), atol=1e-12)
    assert not any(p.grad is not None for p in model.parameters())


def test_one_fedrobust_iteration_of_a_linear_model_with_squared_loss_by_hand():
    # τ = 1 on the full batch: w, b descend and (Λ, δ) ascend from the same point.
    model, x, y, w, b, lam, delta = _squared_loss_problem(12)
    eta1, eta2, pen = 0.1, 0.05, 0.3
    _, g_lam, g_delta, g_w, g_b = _squared_loss_gradients(x, y, w, b, lam, delta)
    data = LocalData.from_numpy(x, y, x, y, torch.device("cpu"), dtype=DT)
    res, new_lam, new_delta = fedrobust_local(model, data, torch.as_tensor(lam), torch.as_tensor(delta), steps=1,
                                              lr=eta1, adv_lr=eta2, penalty=pen, batch_size=len(x),
                                              generator=make_generator(0), loss_fn=F.mse_loss)
    # float64, a handful of O(1) terms: 1e-12 leaves three orders of magnitude of room
    np.testing.assert_allclose(new_lam.numpy(), lam + eta2 * (g_lam - 2 * pen * (lam - np.eye(4))), atol=1e-12)
    np.testing.assert_allclose(new_delta.numpy(), delta + eta2 * (g_delta - 2 * pen * delta), atol=1e-12)
    np.testing.assert_allclose(res.state["weight"].numpy()[0], w - eta1 * g_w, atol=1e-12)
    assert float(res.state["bias"][0]) == pytest.approx(b - eta1 * g_b, abs=1e-12)


def test_fedrobust_local_step_is_simultaneous_descent_ascent_at_the_current_point():
    # τ = 2 by hand: at each step both gradients are taken at (w, Λ, δ) before either moves.
    data = _data()
    rng = np.random.default_rng(7)
    lam0 = torch.eye(6, dtype=DT) + 0.05 * torch.as_tensor(rng.normal(size=(6, 6)))
    delta0 = 0.1 * torch.as_tensor(rng.normal(size=6))
    eta1, eta2, pen, bs = 0.1, 0.07, 0.3, 8
    model = _mlp()
    lam0_copy = lam0.clone()
    res, lam, delta = fedrobust_local(model, data, lam0, delta0, steps=2, lr=eta1, adv_lr=eta2, penalty=pen,
                                      batch_size=bs, generator=make_generator(1, 2, 3))
    ref = _mlp()
    batches = minibatches(data.num_train, bs, make_generator(1, 2, 3), torch.device("cpu"))
    lam_r, delta_r = lam0.clone(), delta0.clone()
    for _ in range(2):
        idx = next(batches)
        xb, yb = data.x_train[idx], data.y_train[idx]
        new_lam, new_delta = affine_ascent_step(ref, xb, yb, lam_r, delta_r, adv_lr=eta2, penalty=pen)
        ref.zero_grad()
        F.cross_entropy(ref(apply_affine(xb, lam_r, delta_r)), yb).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= eta1 * p.grad
        lam_r, delta_r = new_lam, new_delta
    # float64 MLP, the same steps in the same order: only summation order differs, ≈1e-16 on O(1)
    # values
    np.testing.assert_allclose(lam.numpy(), lam_r.numpy(), atol=1e-12)
    np.testing.assert_allclose(delta.numpy(), delta_r.numpy(), atol=1e-12)
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(res.state[k].numpy(), v.numpy(), atol=1e-12)
    assert torch.equal(lam0, lam0_copy) and not torch.equal(lam, lam0)  # input untouched, output moved


@pytest.mark.parametrize("kwargs,match", [
    ({"penalty": -0.1}, "affine-lambda"),
    ({"steps": 0}, "local-steps"),
    ({"lr": 0.0}, "lr"),
    ({"adv_lr": -1.0}, "adv-lr"),
    ({"adv_lr": 0.5, "penalty": 2.0}, "λη₂ < 1"),  # factor 1 − 2λη₂ = −1: no decay
])
def test_fedrobust_local_rejects_bad_settings(kwargs, match):
    args = {"steps": 1, "lr": 0.1, "adv_lr": 0.1, "penalty": 0.1, "batch_size": 4, "generator": make_generator(0)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fedrobust_local(_mlp(), _data(), torch.eye(6, dtype=DT), torch.zeros(6, dtype=DT), **args)


def test_fedrobust_local_rejects_a_shift_of_the_wrong_dimension():
    with pytest.raises(ValueError, match="lam, delta"):
        fedrobust_local(_mlp(), _data(), torch.eye(5), torch.zeros(5), steps=1, lr=0.1, adv_lr=0.1, penalty=0.1,
                        batch_size=4, generator=make_generator(0))


def test_adversarial_training_with_zero_radius_is_plain_sgd():
    data = _data()
    a, b = _mlp(), _mlp()
    res = adversarial_local(a, data, kind="pgd", eps=0.0, steps=3, lr=0.1, batch_size=8,
                            generator=make_generator(4))
    batches = minibatches(data.num_train, 8, make_generator(4), torch.device("cpu"))
    for _ in range(3):
        idx = next(batches)
        b.zero_grad()
        F.cross_entropy(b(data.x_train[idx]), data.y_train[idx]).backward()
        with torch.no_grad():
            for p in b.parameters():
                p -= 0.1 * p.grad
    for k, v in b.state_dict().items():
        # float64 MLP, the same SGD steps in the same order: only summation order differs, ≈1e-16 on
        # O(1) values
        np.testing.assert_allclose(res.state[k].numpy(), v.numpy(), atol=1e-12)
    with pytest.raises(ValueError, match="adv-eps"):
        adversarial_local(_mlp(), data, kind="fgm", eps=-1.0, steps=1, lr=0.1, batch_size=4,
                          generator=make_generator(0))
    with pytest.raises(ValueError, match="local-steps"):
        adversarial_local(_mlp(), data, kind="fgm", eps=1.0, steps=0, lr=0.1, batch_size=4,
                          generator=make_generator(0))


# --------------------------------------------------------------------------- any strategy's saved model
def test_evaluate_robustness_from_saved_arrays():
    rng = np.random.default_rng(8)
    w = rng.normal(size=(2, 4)).astype(np.float32)
    arrays = {"linear.weight": w, "linear.bias": np.zeros(2, np.float32)}
    x = rng.normal(size=(50, 4)).astype(np.float32)
    y = rng.integers(0, 2, size=50)
    out = evaluate_robustness("logreg", arrays, x, y, num_classes=2, affine=[(0.0, 0.0), (0.5, 1.0)],
                              pgd=[0.5, 2.0])
    clean = float(np.mean((x @ w.T).argmax(1) == y))
    # accuracies are counts over 50 from the same per-sample decisions: default approx only absorbs
    # the division
    assert out["clean"] == pytest.approx(clean)
    assert out["affine@0,0"] == pytest.approx(clean)
    # per-sample closed form for a binary linear model: correct iff margin > ε‖v‖
    v = w[y] - w[1 - y]
    margins = np.einsum("nd,nd->n", x, v)
    for eps in (0.5, 2.0):
        expected = float(np.mean(margins > eps * np.linalg.norm(v, axis=1)))
        assert out[f"pgd@{eps:g}"] == pytest.approx(expected)
    assert out["affine@0.5,1"] <= clean


def test_shift_ascent_contracts_by_one_minus_two_lambda_eta_and_unstable_rates_are_refused():
    # a model whose output ignores its input: ∇_Λℓ = ∇_δℓ = 0, so one ascent step is exactly
    # Λ − I ← (1 − 2λη₂)(Λ − I), δ ← (1 − 2λη₂)δ (here 1 − 2·1·0.3 = 0.4)
    from flowerdro.core.affine import check_ascent_rates

    class Constant(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.1], dtype=DT))

        def forward(self, x):  # noqa: D102
            return self.b.expand(x.shape[0], 3)

    x = torch.randn(4, 6, dtype=DT, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0])
    lam = torch.eye(6, dtype=DT) + 0.5 * torch.ones(6, 6, dtype=DT)
    delta = torch.full((6,), 2.0, dtype=DT)
    eta, pen = 0.3, 1.0  # factor 1 − 2·1·0.3 = 0.4
    new_lam, new_delta = affine_ascent_step(Constant(), x, y, lam, delta, adv_lr=eta, penalty=pen)
    np.testing.assert_allclose((new_lam - torch.eye(6, dtype=DT)).numpy(), 0.4 * 0.5 * np.ones((6, 6)), atol=1e-14)
    np.testing.assert_allclose(new_delta.numpy(), np.full(6, 0.8), atol=1e-14)
    check_ascent_rates(0.999, 1.0)  # factor −0.998: decays
    for eta, pen in ((1.0, 1.0), (0.5, 3.0), (0.05, 30.0)):
        with pytest.raises(ValueError, match="adv-lr, affine-lambda"):
            check_ascent_rates(eta, pen)
