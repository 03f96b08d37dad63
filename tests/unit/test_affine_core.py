"""flowerdro.core.affine (numpy): the ball projections and the ascent step, by hand."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from flowerdro.core.affine import (
    affine_ascent_update,
    check_ascent_rates,
    project_frobenius_ball,
    project_l2_ball,
    shift_norms,
)


def test_core_affine_imports_no_torch():
    code = "import sys, flowerdro.core.affine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_frobenius_projection_by_hand():
    # Λ − I = [[3, 0], [0, 4]]: ‖·‖_F = 5, so radius 1 scales it by 1/5 and radius 2.5 by 1/2.
    lam = np.array([[4.0, 0.0], [0.0, 5.0]])
    np.testing.assert_allclose(project_frobenius_ball(lam, 1.0), [[1.6, 0.0], [0.0, 1.8]], rtol=1e-15)
    np.testing.assert_allclose(project_frobenius_ball(lam, 2.5), [[2.5, 0.0], [0.0, 3.0]], rtol=1e-15)
    np.testing.assert_array_equal(project_frobenius_ball(lam, 0.0), np.eye(2))
    inside = project_frobenius_ball(lam, 6.0)
    np.testing.assert_array_equal(inside, lam)
    assert inside is not lam
    # an off-diagonal deviation [[0, 1], [1, 0]] (norm √2) at radius 1: entries 1/√2
    np.testing.assert_allclose(project_frobenius_ball(np.array([[1.0, 1.0], [1.0, 1.0]]), 1.0),
                               [[1.0, 2 ** -0.5], [2 ** -0.5, 1.0]], rtol=1e-15)
    with pytest.raises(ValueError, match="square"):
        project_frobenius_ball(np.ones((2, 3)), 1.0)


def test_l2_projection_by_hand():
    # float64: one scaling of exact inputs, ≤ 1 ulp (1.1e-16 relative) per operation; rtol 1e-15 = a
    # few ulps
    np.testing.assert_allclose(project_l2_ball(np.array([3.0, 4.0]), 2.0), [1.2, 1.6], rtol=1e-15)
    np.testing.assert_array_equal(project_l2_ball(np.array([0.3, 0.4]), 2.0), [0.3, 0.4])
    np.testing.assert_array_equal(project_l2_ball(np.array([3.0, 4.0]), 0.0), [0.0, 0.0])
    with pytest.raises(ValueError, match="eps_delta"):
        project_l2_ball(np.zeros(2), float("nan"))


def test_ascent_update_by_hand_on_a_two_dimensional_shift():
    # Λ = [[2, 0], [1, 1]], δ = (1, −1), g_Λ = [[1, 2], [3, 4]], g_δ = (0.5, 0.5), η₂ = 0.1, λ = 2:
    # Λ' = Λ + 0.1·(g_Λ − 4(Λ − I)) = [[2 + 0.1(1 − 4), 0.2], [1 + 0.1(3 − 4), 1.4]]
    # δ' = δ + 0.1·(g_δ − 4δ) = (1 + 0.1(0.5 − 4), −1 + 0.1(0.5 + 4))
    lam, delta = np.array([[2.0, 0.0], [1.0, 1.0]]), np.array([1.0, -1.0])
    g_lam, g_delta = np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([0.5, 0.5])
    new_lam, new_delta = affine_ascent_update(lam, delta, g_lam, g_delta, adv_lr=0.1, penalty=2.0)
    # float64, three operations on O(1) numbers: a few ulps (2.2e-16); rtol 1e-14 leaves margin
    np.testing.assert_allclose(new_lam, [[1.7, 0.2], [0.9, 1.4]], rtol=1e-14)
    np.testing.assert_allclose(new_delta, [0.65, -0.55], rtol=1e-14)
    np.testing.assert_array_equal(lam, [[2.0, 0.0], [1.0, 1.0]])  # inputs untouched


def test_ascent_with_zero_gradient_is_the_contraction_one_minus_two_lambda_eta():
    # g = 0: Λ − I and δ are multiplied by 1 − 2λη₂ per step, k steps: (1 − 2λη₂)^k.
    rng = np.random.default_rng(3)
    lam, delta = np.eye(3) + rng.normal(size=(3, 3)), rng.normal(size=3)
    l0, d0 = lam - np.eye(3), delta.copy()
    for _ in range(5):
        lam, delta = affine_ascent_update(lam, delta, np.zeros((3, 3)), np.zeros(3), adv_lr=0.2, penalty=1.5)
    np.testing.assert_allclose(lam - np.eye(3), 0.4 ** 5 * l0, rtol=1e-12)  # 1 − 2·1.5·0.2 = 0.4
    np.testing.assert_allclose(delta, 0.4 ** 5 * d0, rtol=1e-12)
    with pytest.raises(ValueError, match="λη₂ < 1"):
        check_ascent_rates(0.5, 2.0)


def test_identity_and_norms():
    assert shift_norms(np.eye(3, dtype=np.float32), np.zeros(3, dtype=np.float32)) == (0.0, 0.0)
    assert shift_norms(np.array([[4.0, 0.0], [0.0, 5.0]]), np.array([3.0, 4.0])) == (5.0, 5.0)
