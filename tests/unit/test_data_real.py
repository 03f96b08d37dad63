"""Tests of flowerdro.data on the real data files in ../shared/data (skipped when absent).

The data folder is ``Path(__file__).resolve().parents[3] / "shared" / "data"`` (the
checkout sits beside ``shared/``) or the environment variable ``FLOWERDRO_DATA``.
Expected numbers come from the data sets' documentation (shared/data/README.md) or are
recomputed from the raw text with the standard library, not from our loader.
"""

from __future__ import annotations

import csv
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # the hub is unreachable: fail fast, never retry

from pathlib import Path

import numpy as np
import pytest

from flowerdro.data import DataConfig, load_federated, load_raw
from flowerdro.data.sources import ADULT_COLUMNS, ADULT_NUMERICAL

pytestmark = pytest.mark.data


def _data_dir() -> Path | None:
    candidates = [
        os.environ.get("FLOWERDRO_DATA", ""),
        str(Path(__file__).resolve().parents[3] / "shared" / "data"),
    ]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    return None


DATA = _data_dir()


def _need(*parts: str) -> Path:
    if DATA is None:
        pytest.skip("real data folder not found: set FLOWERDRO_DATA or place it at ../shared/data")
    path = DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data file {path} not found (see shared/data/README.md)")
    return path


def _adult_rows(path: Path, skip_first: bool) -> list[list[str]]:
    """Rows of a raw UCI Adult file read with csv, independently of the loader."""
    with path.open(newline="") as fh:
        rows = [[v.strip() for v in r] for r in csv.reader(fh) if r and any(v.strip() for v in r)]
    return rows[1:] if skip_first else rows


# --------------------------------------------------------------------------- MNIST family


def test_fashion_mnist_shapes_and_label_counts() -> None:
    _need("fashion_mnist", "train-images-idx3-ubyte.gz")
    raw = load_raw("fashion_mnist", str(DATA))
    assert raw.x_train.shape == (60_000, 1, 28, 28) and raw.x_train.dtype == np.uint8
    assert raw.x_test.shape == (10_000, 1, 28, 28)
    assert np.bincount(raw.y_train).tolist() == [6000] * 10  # README: 6,000 per class
    assert np.bincount(raw.y_test).tolist() == [1000] * 10
    assert raw.y_train.dtype == np.int64


def test_mnist_label_counts_match_readme() -> None:
    _need("mnist", "train-labels-idx1-ubyte.gz")
    raw = load_raw("mnist", str(DATA))
    assert np.bincount(raw.y_train).tolist() == [
        5923,
        6742,
        5958,
        6131,
        5842,
        5421,
        5918,
        6265,
        5851,
        5949,
    ]
    assert np.bincount(raw.y_test).tolist() == [
        980,
        1135,
        1032,
        1010,
        982,
        892,
        958,
        1028,
        974,
        1009,
    ]


def test_files_directly_in_the_folder_are_found() -> None:
    folder = _need("fashion_mnist")
    raw = load_raw("fashion_mnist", str(folder))  # <dir>/train-images-... without the subfolder
    assert raw.source == str(folder.resolve()) and raw.x_train.shape[0] == 60_000


def test_fashion_mnist_one_class_label_mix() -> None:
    _need("fashion_mnist", "train-images-idx3-ubyte.gz")
    cfg = DataConfig(
        dataset="fashion_mnist",
        partition="one-class",
        num_partitions=10,
        test_mode="label-mix",
        data_dir=str(DATA),
    )
    clients = load_federated(cfg)
    raw = load_raw("fashion_mnist", str(DATA))
    for i, c in enumerate(clients):
        assert c.x_train.shape == (6000, 1, 28, 28) and c.x_train.dtype == np.float32
        assert set(np.unique(c.y_train).tolist()) == {i}
        assert c.num_test == 1000 and set(np.unique(c.y_test).tolist()) == {i}
        assert c.input_shape == (1, 28, 28)
    # pixel scaling: the first test image of class 3 equals the raw image / 255
    first = np.flatnonzero(raw.y_test == 3)[0]
    np.testing.assert_allclose(clients[3].x_test[0], raw.x_test[first] / 255.0, rtol=1e-6)  # one float32 rounding
    assert 0.0 <= clients[0].x_train.min() and clients[0].x_train.max() <= 1.0


def test_fashion_mnist_one_class_split_and_reduce() -> None:
    _need("fashion_mnist", "train-images-idx3-ubyte.gz")
    cfg = DataConfig(
        dataset="fashion_mnist",
        partition="one-class",
        num_partitions=10,
        data_dir=str(DATA),
        reduce_fraction=0.3,
        reduce_keep=0.3,
    )
    clients = load_federated(cfg)
    sizes = sorted(c.num_train for c in clients)
    assert sizes == [1440] * 3 + [4800] * 7  # split 4800 / 1200; 3 clients keep 0.3 · 4800
    for i, c in enumerate(clients):
        assert c.num_test == 1200 and set(np.unique(c.y_test).tolist()) == {i}


# --------------------------------------------------------------------------- Adult


def test_adult_row_counts_domains_and_labels() -> None:
    data, test = _need("adult", "adult.data"), _need("adult", "adult.test")
    raw = load_raw("adult", str(DATA))
    rows_train, rows_test = _adult_rows(data, False), _adult_rows(test, True)
    assert len(rows_train) == raw.x_train.shape[0] == 32_561
    assert len(rows_test) == raw.x_test.shape[0] == 16_281
    assert int(np.sum(raw.group_train == 0)) == 413  # README: Doctorate rows
    assert int(np.sum(raw.group_test == 0)) == 181
    income = ADULT_COLUMNS.index("income")
    assert int(raw.y_train.sum()) == sum(r[income] == ">50K" for r in rows_train)
    assert int(raw.y_test.sum()) == sum(r[income] == ">50K." for r in rows_test)


def test_adult_features_one_hot_and_standardised() -> None:
    data, test = _need("adult", "adult.data"), _need("adult", "adult.test")
    raw = load_raw("adult", str(DATA))
    names = list(raw.feature_names)
    assert raw.x_train.shape[1] == raw.x_test.shape[1] == len(names)
    # numericals: mean 0, std 1 on train
    num = raw.x_train[:, : len(ADULT_NUMERICAL)].astype(np.float64)
    # float32 storage of standardised values (|z| ≲ 10): rounding ≲ 6e-7 each, averaged
    np.testing.assert_allclose(num.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(num.std(axis=0), 1.0, atol=1e-5)
    # age column de-standardised matches the raw ages of the first rows
    ages = np.array([float(r[0]) for r in _adult_rows(data, False)])
    # float32 z-scores times std ≈ 13.6: ≲ 10·6e-8·13.6 ≈ 1e-5 years; 1e-3 is a loose bound
    np.testing.assert_allclose(raw.x_train[:, 0] * ages.std() + ages.mean(), ages, atol=1e-3)
    # each categorical block is one-hot; '?' is its own category with the raw count
    for col in ("workclass", "education", "native-country"):
        block = [j for j, n in enumerate(names) if n.startswith(col + "=")]
        assert np.all(raw.x_train[:, block].sum(axis=1) == 1)
        assert np.all(raw.x_test[:, block].sum(axis=1) == 1)
    q = names.index("workclass=?")
    wc = ADULT_COLUMNS.index("workclass")
    assert int(raw.x_train[:, q].sum()) == sum(r[wc] == "?" for r in _adult_rows(data, False))
    assert int(raw.x_test[:, q].sum()) == sum(r[wc] == "?" for r in _adult_rows(test, True))


def test_adult_domain_partition() -> None:
    _need("adult", "adult.data")
    for partition in ("domain", "natural"):
        clients = load_federated(
            DataConfig(dataset="adult", partition=partition, num_partitions=2, data_dir=str(DATA))
        )
        assert [c.num_train for c in clients] == [413, 32_561 - 413]
        assert [c.num_test for c in clients] == [181, 16_281 - 181]
        doc = [
            j
            for j, n in enumerate(load_raw("adult", str(DATA)).feature_names)
            if n == "education=Doctorate"
        ][0]
        assert np.all(clients[0].x_train[:, doc] == 1) and np.all(clients[0].x_test[:, doc] == 1)
        assert np.all(clients[1].x_train[:, doc] == 0) and np.all(clients[1].x_test[:, doc] == 0)
        n_features = len(load_raw("adult", str(DATA)).feature_names)
        assert clients[0].num_classes == 2 and clients[0].input_shape == (n_features,)
