"""The per-client affine-shift partition modifier (``affine-shift-lambda-std`` / ``-delta-std``)."""

from __future__ import annotations

import numpy as np
import pytest

from flowerdro.data import DataConfig, load_federated

BASE = {"dataset": "synthetic", "partition": "natural", "num-partitions": 3, "synthetic-dim": 5,
        "synthetic-classes": 3, "seed": 7}


def test_each_client_gets_its_own_seeded_shift_of_train_and_test_inputs():
    plain = load_federated(DataConfig.from_run_config(BASE))
    cfg = DataConfig.from_run_config({**BASE, "affine-shift-lambda-std": 0.2, "affine-shift-delta-std": 0.5})
    shifted = load_federated(cfg)
    for pid, (a, b) in enumerate(zip(plain, shifted, strict=True)):
        # Recompute Λ_i = I + s_Λ G_i, δ_i = s_δ g_i from the documented stream (seed, 5, i).
        rng = np.random.default_rng([7, 5, pid])
        lam = np.eye(5) + 0.2 * rng.standard_normal((5, 5))
        delta = 0.5 * rng.standard_normal(5)
        # float32 inputs of size ≲ 5: the stored shift rounds each entry once (≈ 3e-7) after a float64
        # 5-term product; 1e-5 leaves ~30 ulps
        np.testing.assert_allclose(b.x_train, a.x_train @ lam.T + delta, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b.x_test, a.x_test @ lam.T + delta, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(b.y_train, a.y_train)
        assert not b.x_train.flags.writeable
    # different clients, different shifts
    d0 = shifted[0].x_train[:3] - plain[0].x_train[:3]
    d1 = shifted[1].x_train[:3] - plain[1].x_train[:3]
    assert not np.allclose(d0, d1)


def test_zero_scales_leave_the_data_alone_and_negative_scales_are_errors():
    plain = load_federated(DataConfig.from_run_config(BASE))
    same = load_federated(DataConfig.from_run_config({**BASE, "affine-shift-lambda-std": 0.0}))
    np.testing.assert_array_equal(plain[1].x_train, same[1].x_train)
    with pytest.raises(ValueError, match="affine-shift-lambda-std"):
        DataConfig.from_run_config({**BASE, "affine-shift-lambda-std": -0.1})
    with pytest.raises(ValueError, match="affine-shift-delta-std"):
        DataConfig.from_run_config({**BASE, "affine-shift-delta-std": -1})


def test_only_delta_shift_on_image_shaped_mnist(data_dir):
    if not (data_dir / "mnist").is_dir():
        pytest.skip(f"MNIST is not in {data_dir} (only the data sets copied there are)")
    rc = {"dataset": "mnist", "partition": "iid", "num-partitions": 2, "samples-per-client": 50,
          "data-dir": str(data_dir)}
    plain = load_federated(DataConfig.from_run_config(rc))
    shifted = load_federated(DataConfig.from_run_config({**rc, "affine-shift-delta-std": 0.1}))
    delta = 0.1 * np.random.default_rng([0, 5, 1]).standard_normal(784)
    assert shifted[1].x_train.shape == (50, 1, 28, 28)
    np.testing.assert_allclose(shifted[1].x_train.reshape(50, -1), plain[1].x_train.reshape(50, -1) + delta,
                               atol=1e-6)  # float32 of values ≤ ~1.5: one rounding ≤ 1e-7
