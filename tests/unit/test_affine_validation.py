"""The validation split of scripts/repro_fedrobust.py (``--eval-split validation``) and its seed statistics.

FedRobust's λ and η₂ are tuned on training-split images that no node trains on. These
tests check that the drawn images are disjoint from every node's training set by a way
other than the script's digests (exact row bytes, and exact array comparison), on the
real MNIST files (skipped when absent), and check the mean ± std over seeds by hand.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # the hub is unreachable: fail fast, never retry

import numpy as np
import pytest

from flowerdro.data import DataConfig, load_federated, load_raw
from flowerdro.data.sources import to_float32

ROOT = Path(__file__).resolve().parents[2]
# the setting of conf/fedrobust_mnist_cnn_n10*.toml (10 nodes, IID, test-fraction 0.2, cap 5000)
RC = {"dataset": "mnist", "partition": "iid", "samples-per-client": 5000,
      "affine-shift-lambda-std": 0.00255, "affine-shift-delta-std": 0.0357}


def _script():
    spec = importlib.util.spec_from_file_location("repro_fedrobust", ROOT / "scripts" / "repro_fedrobust.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["repro_fedrobust"] = module
    spec.loader.exec_module(module)
    return module


def _data_dir() -> Path:
    for c in (os.environ.get("FLOWERDRO_DATA", ""), str(ROOT.parent / "shared" / "data")):
        if c and (Path(c) / "mnist" / "train-images-idx3-ubyte.gz").exists():
            return Path(c)
    pytest.skip("MNIST files not found: set FLOWERDRO_DATA or place them at ../shared/data/mnist")


def test_validation_images_are_in_no_nodes_training_set():
    data = str(_data_dir())
    rc = {**RC, "data-dir": data}
    idx = _script().validation_indices(rc, 10, 500)
    assert idx.shape == (500,) and len(np.unique(idx)) == 500
    raw = load_raw("mnist", data)
    val = to_float32(raw.x_train[idx])
    # the nodes' training sets as the clients hold them (shifted), and unshifted
    shifted = load_federated(DataConfig.from_run_config({**rc, "num-partitions": 10, "data-seed": 0}))
    plain = load_federated(DataConfig.from_run_config(
        {**rc, "num-partitions": 10, "data-seed": 0, "affine-shift-lambda-std": 0.0, "affine-shift-delta-std": 0.0}))
    for a, b in zip(plain, shifted, strict=True):
        np.testing.assert_array_equal(a.y_train, b.y_train)  # same images, the shift only moves them
    train_rows = {row.tobytes() for c in plain for row in c.x_train}
    assert sum(len(c.y_train) for c in plain) == 48_000  # 10 × (6000 − 20% held out); the cap 5000 is not reached
    assert not any(row.tobytes() in train_rows for row in val)
    # exact comparison against one node, without bytes or hashes
    node0 = plain[0].x_train.reshape(len(plain[0].x_train), -1)
    for chunk in np.array_split(val.reshape(500, -1), 10):
        assert not (chunk[:, None, :] == node0[None, :, :]).all(axis=2).any()
    # the draw is seeded, and every drawn image is a held-out row of some node's local test set
    np.testing.assert_array_equal(idx, _script().validation_indices(rc, 10, 500))
    held_out = {row.tobytes() for c in plain for row in c.x_test}
    assert all(row.tobytes() in held_out for row in val)


def test_validation_split_errors_name_the_parameter():
    data = str(_data_dir())
    script = _script()
    with pytest.raises(ValueError, match="eval-samples"):
        script.validation_indices({**RC, "data-dir": data}, 10, 0)
    with pytest.raises(ValueError, match="eval-samples"):
        script.validation_indices({**RC, "data-dir": data}, 10, 12_001)  # 60,000 − 48,000 held out at most


def test_seed_statistics_are_the_mean_and_sample_std():
    script = _script()
    per_seed = {0: {"clean": 0.5, "affine_delta": {1.0: 0.2}, "by_attack": {"ce": {"pgd": {0.5: 0.4}}}},
                1: {"clean": 0.7, "affine_delta": {1.0: 0.4}, "by_attack": {"ce": {"pgd": {0.5: 0.8}}}},
                2: {"clean": 0.9, "affine_delta": {1.0: 0.9}, "by_attack": {"ce": {"pgd": {0.5: 0.6}}}}}
    agg = script.aggregate_seeds(per_seed)
    assert agg["n_seeds"] == 3
    assert agg["clean"] == pytest.approx(0.7) and agg["clean_std"] == pytest.approx(0.2)  # sqrt((.04+0+.04)/2)
    assert agg["affine_delta"][1.0] == pytest.approx(0.5)
    assert agg["affine_delta_std"][1.0] == pytest.approx(np.sqrt((0.09 + 0.01 + 0.16) / 2))
    assert agg["by_attack"]["ce"]["pgd"][0.5] == pytest.approx(0.6)
    assert agg["by_attack"]["ce"]["pgd_std"][0.5] == pytest.approx(0.2)
    one = script.aggregate_seeds({3: {"clean": 0.25}})
    assert one["clean"] == 0.25 and one["clean_std"] == 0.0
