"""Unit tests of flowerdro.data that need no data files (synthetic, tiny hand-made arrays)."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile

os.environ["HF_HUB_OFFLINE"] = "1"  # the hub is unreachable: fail fast, never retry

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    PathologicalPartitioner,
    ShardPartitioner,
)

from flowerdro.data import (
    ClientData,
    DataConfig,
    DatasetNotFoundError,
    RawDataset,
    clear_cache,
    get_client_data,
    leaf_synthetic,
    load_federated,
    parse_idx,
    read_idx,
    robust_regression_problem,
)
from flowerdro.data import federated as federated_mod
from flowerdro.data import partition as part_mod
from flowerdro.data.partition import (
    cap_indices,
    label_mix_test,
    partition_labels,
    reduce_clients,
    stratified_split,
)

# 10 classes with uneven counts 30, 31, ..., 39 (345 rows), in a shuffled order
LABELS = np.random.default_rng(7).permutation(np.repeat(np.arange(10), np.arange(30, 40)))


def _assert_disjoint(parts: list[np.ndarray]) -> np.ndarray:
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "partitions overlap"
    return allidx


# --------------------------------------------------------------------------- IDX


def _idx_bytes(arr: np.ndarray, type_code: int, be_dtype: str) -> bytes:
    header = struct.pack(">BBBB", 0, 0, type_code, arr.ndim)
    header += struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(be_dtype).tobytes()


def test_parse_idx_uint8_images_gzip(tmp_path: Path) -> None:
    # Prepare: 2 images of 3 x 4, values 0..23, written by hand as gzip IDX (magic 0x803)
    images = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    raw = bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4]) + bytes(range(24))
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(raw))
    # Execute
    out = read_idx(path)
    # Assert
    assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, images)


def test_parse_idx_labels_and_int32() -> None:
    labels = parse_idx(bytes([0, 0, 8, 1, 0, 0, 0, 5, 9, 0, 3, 3, 1]))  # magic 0x801
    assert labels.tolist() == [9, 0, 3, 3, 1]
    big = np.array([[1, -2], [70000, 3]], dtype=np.int64)
    out = parse_idx(_idx_bytes(big, 0x0C, ">i4"))
    assert out.dtype == np.int32 and out.dtype.byteorder in ("=", "<", "|")
    np.testing.assert_array_equal(out, big)


@pytest.mark.parametrize(
    "raw, match",
    [
        (bytes([1, 0, 8, 1, 0, 0, 0, 1, 5]), "magic"),
        (bytes([0, 0, 7, 1, 0, 0, 0, 1, 5]), "magic"),
        (bytes([0, 0, 8, 1, 0, 0, 0, 3, 5]), "length"),
        (bytes([0, 0, 8, 2, 0, 0]), "truncated"),
    ],
)
def test_parse_idx_rejects_bad_files(raw: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_idx(raw)


# --------------------------------------------------------------------------- partitions


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_iid_and_dirichlet_are_disjoint_and_cover(scheme: str) -> None:
    parts = partition_labels(LABELS, scheme, 7, seed=3, dirichlet_alpha=0.5)
    allidx = _assert_disjoint(parts)
    np.testing.assert_array_equal(np.sort(allidx), np.arange(len(LABELS)))
    if scheme == "iid":
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1  # 345 / 7 -> 50 or 49
        assert sorted(sizes) == [49] * 6 + [51] or max(sizes) - min(sizes) <= 1


def test_iid_label_mix_is_close_to_global() -> None:
    # 3450 rows, 2 clients of 1725: client 0's count of class c is hypergeometric with
    # mean n_c / 2 and sd sqrt(n_c · 1/4 · (1 - n_c / n) · n / (n - 1)) (~9 rows)
    labels = np.tile(LABELS, 10)
    parts = partition_labels(labels, "iid", 2, seed=0)
    counts = np.bincount(labels[parts[0]], minlength=10)
    n_c, n = np.bincount(labels), len(labels)
    sd = np.sqrt(n_c * 0.25 * (1 - n_c / n) * n / (n - 1))
    assert np.all(np.abs(counts - n_c / 2) < 4.5 * sd)


def test_dirichlet_small_alpha_concentrates_labels() -> None:
    # alpha -> 0: each class goes almost entirely to one client; alpha large: even split
    labels = np.tile(LABELS, 10)
    skewed = partition_labels(labels, "dirichlet", 5, seed=1, dirichlet_alpha=0.05)
    even = partition_labels(labels, "dirichlet", 5, seed=1, dirichlet_alpha=1000.0)

    def top_share(parts: list[np.ndarray]) -> float:
        table = np.stack([np.bincount(labels[p], minlength=10) for p in parts])  # N x C
        return float(np.mean(table.max(axis=0) / table.sum(axis=0)))

    assert top_share(skewed) > 0.7
    # α = 1000: each share is 0.2 ± 0.006 (Dirichlet sd √(0.16/5001)), the max of 5 about 1.2 sd
    # above,
    # plus ≤ 1/300 from splitting ~350 rows per class: ≈ 0.21, well inside 0.05
    assert abs(top_share(even) - 0.2) < 0.05


def test_shards_each_client_has_exactly_s_whole_shards() -> None:
    n_clients, s = 5, 3
    parts = partition_labels(LABELS, "shards", n_clients, seed=11, shards_per_client=s)
    _assert_disjoint(parts)
    shard_size = len(LABELS) // (n_clients * s)  # floor(345 / 15) = 23
    assert shard_size == 23
    # positions in the (stable) label-sorted order; shard j = sorted positions [23j, 23j+23)
    rank = np.empty(len(LABELS), dtype=np.int64)
    rank[np.argsort(LABELS, kind="stable")] = np.arange(len(LABELS))
    used = set()
    for p in parts:
        assert len(p) == s * shard_size
        shards = np.unique(rank[p] // shard_size)
        assert len(shards) == s
        for j in shards:  # each shard is whole
            assert np.sum(rank[p] // shard_size == j) == shard_size
        used |= set(shards.tolist())
    assert len(used) == n_clients * s


def test_shards_cover_when_divisible() -> None:
    labels = LABELS[:300]
    parts = partition_labels(labels, "shards", 5, seed=0, shards_per_client=2)
    allidx = _assert_disjoint(parts)
    np.testing.assert_array_equal(np.sort(allidx), np.arange(300))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_at_most_k_labels(k: int) -> None:
    parts = partition_labels(LABELS, "pathological", 12, seed=5, classes_per_client=k)
    _assert_disjoint(parts)
    for i, p in enumerate(parts):
        present = np.unique(LABELS[p])
        assert 1 <= len(present) <= k
        assert i % 10 in present  # first-deterministic: client i holds label i mod C


def test_one_class_client_i_holds_all_of_class_i() -> None:
    parts = partition_labels(LABELS, "one-class", 4, seed=0)
    for i, p in enumerate(parts):
        np.testing.assert_array_equal(np.sort(p), np.flatnonzero(LABELS == i))


def test_one_class_empty_class_raises() -> None:
    with pytest.raises(ValueError, match="class 2"):
        partition_labels(np.array([0, 1, 3, 3]), "one-class", 3, seed=0)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards", "pathological"])
def test_partitions_are_deterministic_per_seed(scheme: str) -> None:
    a = partition_labels(LABELS, scheme, 6, seed=2)
    b = partition_labels(LABELS, scheme, 6, seed=2)
    c = partition_labels(LABELS, scheme, 6, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize(
    "make",
    [
        lambda: DirichletPartitioner(
            num_partitions=4, partition_by="label", alpha=0.5, min_partition_size=5, seed=4
        ),
        lambda: ShardPartitioner(
            num_partitions=4, partition_by="label", num_shards_per_partition=2, seed=4
        ),
        lambda: PathologicalPartitioner(
            num_partitions=4, partition_by="label", num_classes_per_partition=2, seed=4
        ),
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_fast_index_read_matches_public_load_partition(make) -> None:  # type: ignore[no-untyped-def]
    # the shortcut through _partition_id_to_indices must give what load_partition gives
    fast, slow = make(), make()
    fast.dataset = part_mod._label_dataset(LABELS)
    slow.dataset = part_mod._label_dataset(LABELS)
    got = part_mod._read_partitions(fast, 4)
    want = part_mod._read_partitions_public(slow, 4)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_partition_rejects_too_many_clients() -> None:
    with pytest.raises(ValueError, match="num-partitions"):
        partition_labels(LABELS[:5], "iid", 6, seed=0)
    with pytest.raises(ValueError, match="shards-per-client"):
        partition_labels(LABELS[:20], "shards", 5, seed=0, shards_per_client=5)
    with pytest.raises(ValueError, match="partition must be one of"):
        partition_labels(LABELS, "natural", 2, seed=0)


# --------------------------------------------------------------------------- modifiers


def test_reduce_clients_exact_count_and_sizes() -> None:
    # Prepare: 10 clients of 100, 100, ..., 100 + one of 3 rows
    parts = [np.arange(100 * i, 100 * i + 100) for i in range(9)] + [np.arange(900, 903)]
    # Execute: f = 0.3 -> round(3.0) = 3 clients keep round(0.3 * n)
    out, chosen = reduce_clients(parts, 0.3, 0.3, np.random.default_rng(0))
    # Assert
    assert len(chosen) == 3 and len(set(chosen.tolist())) == 3
    for i, (old, new) in enumerate(zip(parts, out, strict=True)):
        if i in chosen:
            assert len(new) == max(1, round(0.3 * len(old)))  # 30, or 1 for the 3-row client
            assert set(new.tolist()) <= set(old.tolist())
            assert len(np.unique(new)) == len(new)
        else:
            np.testing.assert_array_equal(new, old)


def test_reduce_clients_rounding_and_minimum() -> None:
    parts = [np.arange(5) + 10 * i for i in range(7)]
    out, chosen = reduce_clients(parts, 0.5, 0.01, np.random.default_rng(1))
    assert len(chosen) == round(0.5 * 7) == 4
    assert sorted(len(p) for p in out) == [1, 1, 1, 1, 5, 5, 5]


def test_cap_indices() -> None:
    idx = np.arange(50, 80)
    capped = cap_indices(idx, 7, np.random.default_rng(0))
    assert len(capped) == 7 and set(capped.tolist()) <= set(idx.tolist())
    assert cap_indices(idx, 0, np.random.default_rng(0)) is idx
    assert cap_indices(idx, 100, np.random.default_rng(0)) is idx


def test_stratified_split_hand_example() -> None:
    # counts 10, 5, 1 and f = 0.2: t = round(3.2) = 3; shares 1.875, 0.9375, 0.1875 ->
    # floors 1, 0, 0, the 2 largest remainders (0.9375, 0.875) add one to classes 1 and 0
    labels = np.array([0] * 10 + [1] * 5 + [2] * 1)
    idx = np.arange(16)
    train, test = stratified_split(idx, labels, 0.2, np.random.default_rng(0))
    assert np.bincount(labels[test], minlength=3).tolist() == [2, 1, 0]
    assert np.bincount(labels[train], minlength=3).tolist() == [8, 4, 1]
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), idx)


def test_stratified_split_keeps_a_train_row_per_class() -> None:
    # 2 rows of each of 3 classes, f = 0.9: t = round(5.4) = 5 > 3 spare rows
    labels = np.repeat([0, 1, 2], 2)
    train, test = stratified_split(np.arange(6), labels, 0.9, np.random.default_rng(0))
    assert len(test) == 5 and len(train) == 1
    small_train, small_test = stratified_split(np.arange(2), labels, 0.2, np.random.default_rng(0))
    assert len(small_train) == 1 and len(small_test) == 1
    with pytest.raises(ValueError, match="cannot be split"):
        stratified_split(np.arange(1), labels, 0.2, np.random.default_rng(0))


def test_label_mix_test_hand_example() -> None:
    # client: 30 of class 0, 10 of class 1 -> 8 test rows = 6 + 2; classes 2 absent
    train_labels = np.array([0] * 30 + [1] * 10)
    global_test = np.array([0] * 50 + [1] * 50 + [2] * 50)
    picked = label_mix_test(train_labels, global_test, 8, np.random.default_rng(0))
    assert np.bincount(global_test[picked], minlength=3).tolist() == [6, 2, 0]
    assert len(np.unique(picked)) == 8  # without replacement


def test_label_mix_test_minimum_one_and_replacement() -> None:
    train_labels = np.array([0] * 99 + [1])
    global_test = np.array([0] * 100 + [1])  # class 1 has a single test row
    picked = label_mix_test(train_labels, global_test, 3, np.random.default_rng(0))
    counts = np.bincount(global_test[picked], minlength=2)
    assert counts.tolist() == [3, 1]  # 2.97 -> 3 rows of class 0; class 1 at least one
    many = label_mix_test(np.array([1, 1]), global_test, 4, np.random.default_rng(0))
    assert many.tolist() == [100] * 4  # only one row of class 1 exists: drawn with replacement
    with pytest.raises(ValueError, match="class 5"):
        label_mix_test(np.array([5]), global_test, 1, np.random.default_rng(0))


# --------------------------------------------------------------------------- synthetic


def test_leaf_synthetic_shapes_labels_and_sizes() -> None:
    clients = leaf_synthetic(30, alpha=1.0, beta=1.0, dim=12, num_classes=5, seed=4)
    assert len(clients) == 30
    for c in clients:
        assert c.x.dtype == np.float32 and c.x.shape[1] == 12
        assert c.y.dtype == np.int64 and c.y.shape == (c.x.shape[0],)
        assert 50 <= len(c.y) <= 1000
        assert c.y.min() >= 0 and c.y.max() < 5
        # y = argmax(W x + b), recomputed from the returned parameters
        pred = np.argmax(c.x.astype(np.float64) @ c.weights.T + c.bias, axis=1)
        assert np.mean(pred == c.y) > 0.99
    sizes = [len(c.y) for c in clients]
    assert len(set(sizes)) > 5  # lognormal sizes differ
    again = leaf_synthetic(30, alpha=1.0, beta=1.0, dim=12, num_classes=5, seed=4)
    np.testing.assert_array_equal(again[3].x, clients[3].x)


def test_leaf_synthetic_iid_shares_the_model_and_covariance() -> None:
    clients = leaf_synthetic(10, dim=6, num_classes=4, iid=True, seed=0)
    for c in clients[1:]:
        np.testing.assert_array_equal(c.weights, clients[0].weights)
        np.testing.assert_array_equal(c.bias, clients[0].bias)
        np.testing.assert_array_equal(c.mean, np.zeros(6))
    x = np.concatenate([c.x for c in clients]).astype(np.float64)
    assert len(x) >= 500
    var = x.var(axis=0)
    expected = np.arange(1, 7) ** -1.2  # Σ_jj = j^-1.2
    # sampling error: the variance of n ≥ 500 Gaussian draws has relative std √(2/n) ≤ 0.063; 0.2 ≈ 3σ
    np.testing.assert_allclose(var, expected, rtol=0.2)
    noniid = leaf_synthetic(2, dim=6, num_classes=4, seed=0)
    assert not np.array_equal(noniid[0].weights, noniid[1].weights)


def test_leaf_synthetic_alpha_zero_gives_unit_model_spread() -> None:
    # α = 0: u_k = 0, so W entries ~ N(0, 1) for every client
    clients = leaf_synthetic(20, alpha=0.0, beta=0.0, dim=50, num_classes=10, seed=1)
    w = np.concatenate([c.weights.ravel() for c in clients])
    # 10 000 iid N(0, 1) draws: sd of the mean 0.01 and of the std ≈ 1/√(2n) = 0.007, so 0.05 is ≥ 5
    # sd
    assert abs(w.mean()) < 0.05 and abs(w.std() - 1.0) < 0.05


def test_robust_regression_exact_targets_and_shifts() -> None:
    problem = robust_regression_problem(
        4, dim=5, samples_per_client=30, scale=2.0, shift_sigma=0.5, seed=3
    )
    for i, (a, y) in enumerate(zip(problem.features, problem.targets, strict=True)):
        assert a.shape == (30, 5) and y.shape == (30,)
        # float64 5-term dot products of O(1) values: rounding ≈ 1e-15; 1e-12 leaves margin
        np.testing.assert_allclose(y, a @ (problem.x_hat + problem.shifts[i]), rtol=0, atol=1e-12)
        # y is exactly linear in a: least squares recovers x̂ + δ_i
        sol, *_ = np.linalg.lstsq(a, y, rcond=None)
        np.testing.assert_allclose(sol, problem.x_hat + problem.shifts[i], atol=1e-9)
    assert len({tuple(np.round(d, 12)) for d in problem.shifts}) == 4  # δ_i differ


def test_robust_regression_statistics() -> None:
    problem = robust_regression_problem(
        50, dim=400, samples_per_client=50, scale=3.0, shift_sigma=0.2, seed=0
    )
    assert abs(problem.x_hat.std() - 3.0) < 0.3  # 400 draws: sd of the estimate ~ 0.11
    assert abs(problem.shifts.std() - 0.2) < 0.01  # 20000 draws
    a = np.concatenate(problem.features)
    # 10⁶ iid N(0, 1) features: sd of the mean 1e-3 and of the std 7e-4, so 0.01 is ≥ 10 sd
    assert abs(a.mean()) < 0.01 and abs(a.std() - 1.0) < 0.01
    no_shift = robust_regression_problem(3, dim=4, samples_per_client=5, shift_sigma=0.0, seed=1)
    np.testing.assert_array_equal(no_shift.shifts, np.zeros((3, 4)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_clients": 0}, "num_clients"),
        ({"dim": 0}, "dim"),
        ({"samples_per_client": 0}, "samples_per_client"),
        ({"scale": -1.0}, "scale"),
        ({"shift_sigma": -0.1}, "shift_sigma"),
    ],
)
def test_robust_regression_validation(kwargs: dict, match: str) -> None:
    args = {"num_clients": 2, "dim": 3, "samples_per_client": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        robust_regression_problem(**args)


# --------------------------------------------------------------------------- DataConfig


def test_from_run_config_reads_kebab_keys_and_ignores_others() -> None:
    cfg = DataConfig.from_run_config(
        {
            "dataset": "fashion_mnist",
            "partition": "dirichlet",
            "num-partitions": 12,
            "seed": 5,
            "data-seed": 9,
            "dirichlet-alpha": 0.1,
            "reduce-fraction": 0.3,
            "reduce-keep": 0.3,
            "test-mode": "label-mix",
            "test-fraction": 0.25,
            "samples-per-client": 100,
            "synthetic-iid": "true",
            "lr": 0.01,
            "strategies": "fedavg,qfedavg",
        }
    )
    assert cfg == DataConfig(
        dataset="fashion_mnist",
        partition="dirichlet",
        num_partitions=12,
        seed=9,
        dirichlet_alpha=0.1,
        reduce_fraction=0.3,
        reduce_keep=0.3,
        test_mode="label-mix",
        test_fraction=0.25,
        samples_per_client=100,
        synthetic_iid=True,
    )
    assert hash(cfg) == hash(replace(cfg))
    assert DataConfig.from_run_config({"seed": 4}).seed == 4
    assert DataConfig.from_run_config({"num-partitions": 5}, num_partitions=7).num_partitions == 7
    assert DataConfig.from_run_config({}) == DataConfig()
    assert isinstance(DataConfig.from_run_config({"reduce-keep": 1}).reduce_keep, float)


@pytest.mark.parametrize(
    "run_config, match",
    [
        (
            {"dataset": "imagenet"},
            r"dataset: unknown value 'imagenet'; allowed: synthetic, fashion_mnist, mnist, adult, cifar10",
        ),
        ({"partition": "weird"}, r"partition: unknown value 'weird'; allowed: natural, iid, dirichlet"),
        ({"dataset": "mnist", "partition": "natural"}, r"allowed: iid, dirichlet"),
        ({"dataset": "mnist", "partition": "domain"}, r"not available for dataset 'mnist'"),
        ({"partition": "iid"}, r"synthetic-iid"),
        ({"num-partitions": 0}, r"num-partitions: must be >= 1"),
        ({"num-partitions": 2.5}, r"num-partitions: expected an integer"),
        ({"num-partitions": True}, r"num-partitions: expected an integer"),
        (
            {"dataset": "adult", "partition": "domain", "num-partitions": 3},
            r"num-partitions: must be 2",
        ),
        ({"dataset": "adult", "num-partitions": 4}, r"num-partitions: must be 2"),
        ({"seed": -1}, r"data-seed: must be >= 0"),
        ({"dirichlet-alpha": 0}, r"dirichlet-alpha: must be > 0"),
        ({"dirichlet-alpha": -1.0}, r"dirichlet-alpha: must be > 0"),
        ({"dirichlet-alpha": float("nan")}, r"dirichlet-alpha: expected a finite number"),
        ({"shards-per-client": 0}, r"shards-per-client: must be >= 1"),
        ({"classes-per-client": 0}, r"classes-per-client: must be >= 1"),
        (
            {
                "dataset": "adult",
                "partition": "pathological",
                "num-partitions": 2,
                "classes-per-client": 3,
            },
            r"classes-per-client: must be in \[1, 2\]",
        ),
        (
            {"dataset": "mnist", "partition": "one-class", "num-partitions": 11},
            r"num-partitions: .* got 11 > 10",
        ),
        (
            {"partition": "natural", "synthetic-classes": 3, "dataset": "adult"},
            r"num-partitions: must be 2",
        ),
        ({"reduce-fraction": 1.5}, r"reduce-fraction: must be <= 1"),
        ({"reduce-fraction": -0.1}, r"reduce-fraction: must be >= 0"),
        ({"reduce-keep": 0.0}, r"reduce-keep: must be > 0"),
        ({"reduce-keep": 1.2}, r"reduce-keep: must be <= 1"),
        ({"test-mode": "global"}, r"test-mode: unknown value 'global'; allowed: split, label-mix"),
        ({"test-mode": "label-mix"}, r"allowed for synthetic: split"),
        ({"test-fraction": 0.0}, r"test-fraction: must be > 0"),
        ({"test-fraction": 1.0}, r"test-fraction: must be < 1"),
        ({"samples-per-client": -5}, r"samples-per-client: must be >= 0"),
        ({"synthetic-alpha": -1}, r"synthetic-alpha: must be >= 0"),
        ({"synthetic-beta": -1}, r"synthetic-beta: must be >= 0"),
        ({"synthetic-dim": 0}, r"synthetic-dim: must be >= 1"),
        ({"synthetic-classes": 1}, r"synthetic-classes: must be >= 2"),
        ({"synthetic-iid": "maybe"}, r"synthetic-iid: expected true or false"),
        ({"data-dir": 3}, r"data-dir: expected a string"),
        ({"partition": "one-class", "synthetic-classes": 4, "num-partitions": 5}, r"not available"),
    ],
)
def test_from_run_config_validation(run_config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataConfig.from_run_config(run_config)


def test_one_class_error_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"num-partitions: partition 'one-class' needs .* got 3 > 2"):
        DataConfig(dataset="adult", partition="one-class", num_partitions=3)


# --------------------------------------------------------------------------- federated (synthetic)

SYN = DataConfig(num_partitions=8, seed=1, synthetic_dim=10, synthetic_classes=4)


def test_load_federated_synthetic_shapes_and_split() -> None:
    clients = load_federated(SYN)
    assert len(clients) == 8
    for i, c in enumerate(clients):
        assert isinstance(c, ClientData) and c.partition_id == i
        assert c.x_train.dtype == np.float32 and c.x_test.dtype == np.float32
        assert c.y_train.dtype == np.int64 and c.y_test.dtype == np.int64
        assert c.input_shape == (10,) and c.x_test.shape[1:] == (10,)
        assert c.num_classes == 4
        n = c.num_train + c.num_test
        assert c.num_test == round(0.2 * n)  # stratified split keeps round(f·n) for testing
        assert not c.x_train.flags.writeable
    assert load_federated(SYN)[0] is clients[0]  # cached
    assert get_client_data(SYN, 5) is clients[5]


def test_load_federated_is_deterministic_across_cache_clears() -> None:
    first = load_federated(SYN)
    clear_cache()
    second = load_federated(SYN)
    assert first[2] is not second[2]
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a.x_train, b.x_train)
        np.testing.assert_array_equal(a.y_test, b.y_test)
    other = load_federated(replace(SYN, seed=2))
    assert not np.array_equal(other[0].x_train[:5], first[0].x_train[:5])


def test_synthetic_reduce_and_cap() -> None:
    base = load_federated(replace(SYN, num_partitions=20))
    reduced = load_federated(replace(SYN, num_partitions=20, reduce_fraction=0.3, reduce_keep=0.3))
    shrunk = [i for i in range(20) if reduced[i].num_train < base[i].num_train]
    assert len(shrunk) == 6  # round(0.3 · 20)
    for i in range(20):
        np.testing.assert_array_equal(reduced[i].y_test, base[i].y_test)  # test sets untouched
        if i in shrunk:
            assert reduced[i].num_train == max(1, round(0.3 * base[i].num_train))
        else:
            np.testing.assert_array_equal(reduced[i].x_train, base[i].x_train)
    capped = load_federated(replace(SYN, num_partitions=20, samples_per_client=40))
    for i in range(20):
        assert capped[i].num_train == min(40, base[i].num_train)
        if base[i].num_train > 40:
            # ratio f / (1 - f) kept: 10 rows, plus at most one per class whose share
            # rounds to 0 (every class of the uncapped test set stays represented)
            classes = len(np.unique(base[i].y_test))
            assert 10 <= capped[i].num_test <= 10 + classes
            assert set(capped[i].y_test.tolist()) == set(base[i].y_test.tolist())


def test_get_client_data_rejects_bad_ids() -> None:
    for bad in (-1, 8, 100):
        with pytest.raises(ValueError, match=r"partition_id must be in \[0, 8\)"):
            get_client_data(SYN, bad)
    with pytest.raises(ValueError, match="partition_id must be an int"):
        get_client_data(SYN, "1")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- federated (fake raw)


@pytest.fixture()
def fake_raw(monkeypatch: pytest.MonkeyPatch) -> RawDataset:
    """A 4-class image-like RawDataset of 400 train / 200 test rows, in place of the files."""
    rng = np.random.default_rng(0)
    y_train = np.repeat(np.arange(4), [160, 120, 80, 40])
    y_test = np.repeat(np.arange(4), 50)
    raw = RawDataset(
        name="mnist",
        x_train=rng.integers(0, 256, (400, 1, 2, 2), dtype=np.uint8),
        y_train=rng.permutation(y_train),
        x_test=rng.integers(0, 256, (200, 1, 2, 2), dtype=np.uint8),
        y_test=y_test,
        num_classes=4,
        source="fake",
    )
    monkeypatch.setattr(federated_mod, "load_raw", lambda name, data_dir: raw)
    clear_cache()
    yield raw
    clear_cache()


def test_label_mix_test_sets_follow_train_mix(fake_raw: RawDataset) -> None:
    cfg = DataConfig(
        dataset="mnist", partition="dirichlet", num_partitions=4, test_mode="label-mix", seed=3
    )
    for c in load_federated(cfg):
        m = max(1, round(0.25 * c.num_train))  # f / (1 - f) · n_train with f = 0.2
        p_train = np.bincount(c.y_train, minlength=4) / c.num_train
        test_counts = np.bincount(c.y_test, minlength=4)
        present = p_train > 0
        assert np.all(test_counts[~present] == 0)
        # largest remainder: each class within one row of its exact share p_c · m, min 1
        exact = p_train[present] * m
        got = test_counts[present]
        assert np.all((np.abs(got - exact) < 1) | (got == 1))
        assert abs(c.num_test - m) <= int(np.sum(exact < 1))
        # pixels scaled to [0, 1], and equal to some global test image / 255
        assert c.x_test.min() >= 0 and c.x_test.max() <= 1
        assert c.input_shape == (1, 2, 2)


def test_one_class_label_mix_uses_whole_test_class(fake_raw: RawDataset) -> None:
    cfg = DataConfig(
        dataset="mnist", partition="one-class", num_partitions=4, test_mode="label-mix"
    )
    for i, c in enumerate(load_federated(cfg)):
        assert set(c.y_train.tolist()) == {i} and c.num_train == [160, 120, 80, 40][i]
        assert set(c.y_test.tolist()) == {i} and c.num_test == 50
        # float32 pixels / 255 vs the float64 quotient: one float32 rounding, u ≈ 6e-8 < 1e-6
        np.testing.assert_allclose(
            c.x_test, fake_raw.x_test[fake_raw.y_test == i] / 255.0, rtol=1e-6
        )  # one float32 rounding (≤ 6e-8 relative)


def test_split_mode_test_set_comes_from_own_partition(fake_raw: RawDataset) -> None:
    cfg = DataConfig(dataset="mnist", partition="one-class", num_partitions=3, test_mode="split")
    for i, c in enumerate(load_federated(cfg)):
        n = [160, 120, 80][i]
        assert c.num_test == round(0.2 * n) and c.num_train == n - c.num_test
        assert set(c.y_test.tolist()) == {i}
        # every test image is one of the client's own training-split images, none in train
        own = {bytes(r) for r in fake_raw.x_train[fake_raw.y_train == i]}
        assert all(bytes((x * 255).round().astype(np.uint8)) in own for x in c.x_test)


# --------------------------------------------------------------------------- missing data


def test_missing_data_dir_raises_dataset_not_found(tmp_path: Path) -> None:
    clear_cache()
    missing = tmp_path / "nowhere"
    cfg = DataConfig(
        dataset="fashion_mnist", partition="iid", num_partitions=2, data_dir=str(missing)
    )
    with pytest.raises(DatasetNotFoundError) as info:
        load_federated(cfg)
    msg = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert "'fashion_mnist'" in msg
    assert str(missing) in msg and "does not exist" in msg
    assert "train-images-idx3-ubyte.gz" in msg
    assert "FLOWERDRO_DATA" in msg and "data-dir" in msg
    assert "zalando-datasets/fashion_mnist" in msg and "HF_HUB_OFFLINE" in msg


def test_no_dir_at_all_mentions_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_cache()
    monkeypatch.delenv("FLOWERDRO_DATA", raising=False)
    monkeypatch.setattr("flowerdro.data.sources.checkout_data_dirs", lambda: [])
    with pytest.raises(DatasetNotFoundError, match="FLOWERDRO_DATA is not set"):
        load_federated(DataConfig(dataset="adult", partition="domain", num_partitions=2))


def test_env_var_dir_is_searched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_cache()
    monkeypatch.setenv("FLOWERDRO_DATA", str(tmp_path))
    with pytest.raises(DatasetNotFoundError) as info:
        load_federated(DataConfig(dataset="mnist", partition="iid", num_partitions=2))
    assert str(tmp_path / "mnist") in str(info.value) and "from FLOWERDRO_DATA" in str(info.value)


def test_md5_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    clear_cache()
    folder = tmp_path / "mnist"
    folder.mkdir()
    tiny_images = bytes([0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0])
    tiny_labels = bytes([0, 0, 8, 1, 0, 0, 0, 1, 0])
    for name in ("train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz"):
        (folder / name).write_bytes(gzip.compress(tiny_images))
    for name in ("train-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (folder / name).write_bytes(gzip.compress(tiny_labels))
    cfg = DataConfig(dataset="mnist", partition="iid", num_partitions=1, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="MD5 mismatch for .*train-images-idx3-ubyte.gz"):
        load_federated(cfg)


def _fake_cifar_tar() -> tuple[bytes, np.ndarray]:
    """A cifar-10-python.tar.gz look-alike: 6 batches of 2 images (3072 bytes, R then G then B)."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (12, 3072), dtype=np.uint8)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        for b, name in enumerate(names):
            payload = pickle.dumps({b"data": rows[2 * b : 2 * b + 2], b"labels": [b, 9 - b]})
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue(), rows


def test_cifar_batches_layout() -> None:
    from flowerdro.data.sources import _cifar_batches

    data, rows = _fake_cifar_tar()
    raw = _cifar_batches(data)
    assert raw.x_train.shape == (10, 3, 32, 32) and raw.x_test.shape == (2, 3, 32, 32)
    assert raw.y_train.tolist() == [0, 9, 1, 8, 2, 7, 3, 6, 4, 5] and raw.y_test.tolist() == [5, 4]
    # channel c, pixel (r, k) of image 0 is byte 1024 c + 32 r + k of its row
    assert raw.x_train[0, 1, 2, 3] == rows[0, 1024 + 64 + 3]
    np.testing.assert_array_equal(raw.x_test[1].ravel(), rows[11])


def test_cifar_md5_checked_before_extracting(tmp_path: Path) -> None:
    clear_cache()
    (tmp_path / "cifar10").mkdir()
    data, _ = _fake_cifar_tar()  # a valid tar, but not the official file
    (tmp_path / "cifar10" / "cifar-10-python.tar.gz").write_bytes(data)
    cfg = DataConfig(dataset="cifar10", partition="iid", num_partitions=2, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="MD5 mismatch .*c58f30108f718f92721af3b95e74349a"):
        load_federated(cfg)


def test_checkout_sibling_shared_data_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowerdro.data.sources import candidate_dirs

    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "repo").mkdir()
    monkeypatch.delenv("FLOWERDRO_DATA", raising=False)
    monkeypatch.chdir(tmp_path / "repo")
    dirs = [d for d, _ in candidate_dirs("")]
    assert (tmp_path / "shared" / "data").resolve() in dirs
    # an explicit data-dir or FLOWERDRO_DATA wins over the fallback
    assert candidate_dirs(str(tmp_path)) == [(tmp_path.resolve(), "data-dir")]
