"""Build every client's local train and test set from a `DataConfig` (cached per process).

Pipeline, for each client i (every random step has its own seeded stream, so e.g.
changing `test_fraction` does not change which clients are reduced):

1. **partition** the global training split (see `flowerdro.data.partition`), or
   generate the client (``synthetic``), or take its domain (``adult`` ``domain`` /
   ``natural``: client 0 = ``education == "Doctorate"``, client 1 = the rest);
2. **test set**, of the client's own distribution:

   * ``split``: a stratified ``test_fraction`` of the client's partition is held out;
   * ``label-mix``: the whole partition trains; the test set is drawn from the global
     test split with the partition's label proportions and
     ``round(f / (1 − f) · n_train)`` rows (at least one per present class). For
     ``one-class`` the test set is the *whole* global test set of the client's class
     (DRFA's setting: each client is tested on its own class);
   * ``domain`` (adult): the test rows of the client's domain, whichever test mode;
   * ``synthetic``: always ``split`` (there is no global test split; ``label-mix`` is
     rejected);
   * ``robust_regression`` (SCAFF-PD §6.1): client i gets m_i + m_test rows of
     a ~ N(0, I_d), y = ⟨a, x̂ + δ_i⟩ from
     :func:`~flowerdro.data.synthetic.robust_regression_problem` (one draw of all
     n = m_i + m_test rows per client); the first m_i rows (``samples_per_client``, 0 →
     100) train, the other m_test = round(f/(1 − f)·m_i) test. Targets are float32, the
     ``num_classes`` is 1 and steps 3–4 do not apply;

3. **cap** (``samples_per_client`` > 0): the training set becomes a random subset of that
   size; a ``split`` test set is subsampled (keeping its label mix) to keep the ratio
   f / (1 − f); ``label-mix`` sizes follow the capped training set;
4. **validation** (``validation_fraction`` v > 0): a stratified v of the client's training
   rows (``round(v·n)`` rows, at least one, with the label mix of the rest;
   ``robust_regression``: a seeded random v of its rows) become its validation set, from
   the stream (seed, 6, i); training sees only the other rows. Without it (v = 0, the
   default) nothing changes and the client has no validation set;
5. **reduce**: round(reduce_fraction · N) clients keep ``max(1, round(reduce_keep · n))``
   random rows of their training set; test and validation sets are left whole, so a
   reduced client is still evaluated on its full distribution;
6. **affine shift** (``affine_shift_lambda_std`` / ``affine_shift_delta_std`` > 0): client
   i's train, validation and test inputs become Λ_i x + δ_i on the flattened input, Λ_i = I + s_Λ G_i,
   δ_i = s_δ g_i with standard Gaussian G_i, g_i from its own seeded stream (FedRobust's
   per-node affine distribution shifts, see `affine_shift_client`).

Arrays in a `ClientData` are read-only (they are shared through the cache); copy before
modifying in place (``torch.tensor(x)`` copies, ``torch.from_numpy`` warns).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from flowerdro.data.config import REGRESSION_DEFAULT_SAMPLES, DataConfig
from flowerdro.data.partition import (
    cap_indices,
    label_mix_test,
    partition_labels,
    reduce_clients,
    stratified_split,
)
from flowerdro.data.sources import RawDataset, load_raw, to_float32
from flowerdro.data.synthetic import leaf_synthetic, robust_regression_problem

# independent random streams, seeded by (cfg.seed, stream id)
_STREAM_SPLIT, _STREAM_CAP, _STREAM_REDUCE, _STREAM_TEST, _STREAM_AFFINE = 1, 2, 3, 4, 5
_STREAM_VALIDATION = 6


class SplitSizes:
    """``num_train``, ``num_test`` and ``num_val`` of a client's data: the lengths of its labels.

    Shared by the numpy :class:`ClientData` and the torch
    :class:`flowerdro.clients.training.LocalData`.
    """

    y_train: Any
    y_test: Any
    y_val: Any

    @property
    def num_val(self) -> int:
        """Number of validation examples (0 without a validation set)."""
        return 0 if self.y_val is None else int(self.y_val.shape[0])

    @property
    def num_train(self) -> int:
        """Number of training examples."""
        return int(self.y_train.shape[0])

    @property
    def num_test(self) -> int:
        """Number of test examples."""
        return int(self.y_test.shape[0])


@dataclass(frozen=True)
class ClientData(SplitSizes):
    """One client's local data.

    Attributes
    ----------
    partition_id : int
        Client index in ``[0, num_partitions)``.
    x_train, x_test : np.ndarray
        float32 inputs: images (n, C, H, W) in [0, 1] (MNIST family (n, 1, 28, 28),
        CIFAR-10 (n, 3, 32, 32)); tabular / synthetic (n, d).
    y_train, y_test : np.ndarray
        int64 labels in ``0 .. num_classes - 1`` (float32 targets for a regression data
        set such as ``robust_regression``).
    num_classes : int
        Number of classes of the data set (not only those the client holds).
    input_shape : tuple[int, ...]
        Shape of one example, ``x_train.shape[1:]``.
    x_val, y_val : np.ndarray or None
        The validation set held out of the training rows (``validation_fraction`` > 0),
        else None.
    """

    partition_id: int
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    x_val: np.ndarray | None = None
    y_val: np.ndarray | None = None


def _rng(seed: int, stream: int, client: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, stream, client])


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _make_client(
    pid: int,
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_te: np.ndarray,
    y_te: np.ndarray,
    num_classes: int,
    x_val: np.ndarray | None = None,
    y_val: np.ndarray | None = None,
) -> ClientData:
    x_tr, x_te = to_float32(x_tr), to_float32(x_te)
    has_val = x_val is not None and y_val is not None
    return ClientData(
        partition_id=pid,
        x_train=_readonly(x_tr),
        y_train=_readonly(y_tr.astype(np.int64)),
        x_test=_readonly(x_te),
        y_test=_readonly(y_te.astype(np.int64)),
        num_classes=num_classes,
        input_shape=tuple(int(s) for s in x_tr.shape[1:]),
        x_val=_readonly(to_float32(x_val)) if has_val else None,
        y_val=_readonly(y_val.astype(np.int64)) if has_val else None,
    )


def validation_split(
    train: np.ndarray, labels: np.ndarray | None, fraction: float, seed: int, pid: int
) -> tuple[np.ndarray, np.ndarray]:
    """Client ``pid``'s training rows ``train`` split into (training, validation) rows.

    ``round(v·n)`` of the n rows (clipped to [1, n − 1]), v = ``fraction``, go to
    validation: stratified by ``labels`` (each class with two or more rows in both parts
    where the count allows, see :func:`~flowerdro.data.partition.stratified_split`), or a
    seeded random subset when ``labels`` is None (regression). The random stream is
    (``seed``, 6, ``pid``), ``seed`` the data seed: the split is the same for every run
    seed, and independent of the other steps' streams. Raises ValueError naming
    ``validation-fraction`` when the client has fewer than two training rows.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"validation-fraction: must be in (0, 1) to split, got {fraction}")
    n = len(train)
    if n < 2:
        raise ValueError(f"validation-fraction: client {pid} has {n} training example(s), too few to hold out "
                         "a validation set; lower num-partitions or set validation-fraction = 0")
    rng = _rng(seed, _STREAM_VALIDATION, pid)
    if labels is None:
        k = int(np.clip(round(fraction * n), 1, n - 1))
        perm = rng.permutation(n)
        return np.sort(train[perm[k:]]), np.sort(train[perm[:k]])
    return stratified_split(train, labels, fraction, rng)


def _test_size(n_train: int, test_fraction: float) -> int:
    """Test rows matching a train set of `n_train`: round(f / (1 − f) · n), at least 1."""
    return max(1, int(round(test_fraction / (1.0 - test_fraction) * n_train)))


def _cap_split(
    train: np.ndarray, test: np.ndarray, labels: np.ndarray, cfg: DataConfig, pid: int
) -> tuple[np.ndarray, np.ndarray]:
    """Cap a split client's train set and subsample its test set to keep the ratio."""
    if cfg.samples_per_client == 0 or len(train) <= cfg.samples_per_client:
        return train, test
    rng = _rng(cfg.seed, _STREAM_CAP, pid)
    train = cap_indices(train, cfg.samples_per_client, rng)
    m = _test_size(len(train), cfg.test_fraction)
    if m < len(test):
        test = test[label_mix_test(labels[test], labels[test], m, rng)]
    return train, test


def _synthetic_clients(cfg: DataConfig) -> tuple[list[tuple[np.ndarray, ...]], int]:
    generated = leaf_synthetic(
        cfg.num_partitions,
        alpha=cfg.synthetic_alpha,
        beta=cfg.synthetic_beta,
        dim=cfg.synthetic_dim,
        num_classes=cfg.synthetic_classes,
        iid=cfg.synthetic_iid,
        seed=cfg.seed,
    )
    out = []
    for pid, client in enumerate(generated):
        rows = np.arange(len(client.y))
        train, test = stratified_split(
            rows, client.y, cfg.test_fraction, _rng(cfg.seed, _STREAM_SPLIT, pid)
        )
        train, test = _cap_split(train, test, client.y, cfg, pid)
        out.append((client.x, client.y, train, client.x, client.y, test))
    return out, cfg.synthetic_classes


def _labelled_clients(cfg: DataConfig) -> tuple[list[tuple[np.ndarray, ...]], int]:
    raw: RawDataset = load_raw(cfg.dataset, cfg.data_dir)
    out = []
    if cfg.partition in ("domain", "natural"):  # adult PhD / non-PhD (validated in DataConfig)
        assert raw.group_train is not None and raw.group_test is not None
        for pid in range(2):
            train = np.flatnonzero(raw.group_train == pid)
            train = _rng(cfg.seed, _STREAM_SPLIT, pid).permutation(train)
            train = cap_indices(train, cfg.samples_per_client, _rng(cfg.seed, _STREAM_CAP, pid))
            test = np.flatnonzero(raw.group_test == pid)
            out.append((raw.x_train, raw.y_train, train, raw.x_test, raw.y_test, test))
        return out, raw.num_classes

    parts = partition_labels(
        raw.y_train,
        cfg.partition,
        cfg.num_partitions,
        cfg.seed,
        dirichlet_alpha=cfg.dirichlet_alpha,
        shards_per_client=cfg.shards_per_client,
        classes_per_client=cfg.classes_per_client,
    )
    for pid, part in enumerate(parts):
        if cfg.test_mode == "split":
            train, test = stratified_split(
                part, raw.y_train, cfg.test_fraction, _rng(cfg.seed, _STREAM_SPLIT, pid)
            )
            train, test = _cap_split(train, test, raw.y_train, cfg, pid)
            out.append((raw.x_train, raw.y_train, train, raw.x_train, raw.y_train, test))
            continue
        train = cap_indices(part, cfg.samples_per_client, _rng(cfg.seed, _STREAM_CAP, pid))
        if cfg.partition == "one-class":
            test = np.flatnonzero(raw.y_test == pid)
        else:
            size = _test_size(len(train), cfg.test_fraction)
            test = label_mix_test(
                raw.y_train[train], raw.y_test, size, _rng(cfg.seed, _STREAM_TEST, pid)
            )
        out.append((raw.x_train, raw.y_train, train, raw.x_test, raw.y_test, test))
    return out, raw.num_classes


def _regression_clients(cfg: DataConfig) -> tuple[ClientData, ...]:
    """SCAFF-PD §6.1 robust-regression clients (float32 x and y; first m_i rows train)."""
    m = cfg.samples_per_client or REGRESSION_DEFAULT_SAMPLES
    m_test = _test_size(m, cfg.test_fraction)
    if cfg.validation_fraction > 0 and m < 2:
        raise ValueError(f"validation-fraction: {m} training row(s) per client are too few to hold out a "
                         "validation set; raise samples-per-client or set validation-fraction = 0")
    problem = robust_regression_problem(
        cfg.num_partitions,
        cfg.regression_dim,
        m + m_test,
        scale=cfg.regression_scale,
        shift_sigma=cfg.regression_shift,
        seed=cfg.seed,
    )
    clients = []
    for pid, (a, y) in enumerate(zip(problem.features, problem.targets, strict=True)):
        x32, y32 = a.astype(np.float32), y.astype(np.float32)
        train, val = np.arange(m), None
        if cfg.validation_fraction > 0:
            train, val = validation_split(train, None, cfg.validation_fraction, cfg.seed, pid)
        clients.append(
            ClientData(
                partition_id=pid,
                x_train=_readonly(x32[train]),
                y_train=_readonly(y32[train]),
                x_test=_readonly(x32[m:]),
                y_test=_readonly(y32[m:]),
                num_classes=1,
                input_shape=(cfg.regression_dim,),
                x_val=None if val is None else _readonly(x32[val]),
                y_val=None if val is None else _readonly(y32[val]),
            )
        )
    return tuple(clients)


def affine_shift_client(client: ClientData, cfg: DataConfig) -> ClientData:
    """Client i's inputs (train and test) under its own seeded shift x ↦ Λ_i x + δ_i.

    Λ_i = I + s_Λ·G_i and δ_i = s_δ·g_i on the flattened input (d features), with G_i
    (d×d) and g_i (d) standard Gaussian from the stream (seed, 5, i); s_Λ =
    ``affine_shift_lambda_std``, s_δ = ``affine_shift_delta_std`` (FedRobust, Reisizadeh et
    al. 2020). Labels are unchanged.
    """
    s_lam, s_delta = cfg.affine_shift_lambda_std, cfg.affine_shift_delta_std
    if s_lam == 0 and s_delta == 0:
        return client
    d = int(np.prod(client.input_shape))
    rng = _rng(cfg.seed, _STREAM_AFFINE, client.partition_id)
    lam_dev = (s_lam * rng.standard_normal((d, d))).astype(np.float32) if s_lam > 0 else None
    delta = (s_delta * rng.standard_normal(d)).astype(np.float32)

    def shift(x: np.ndarray) -> np.ndarray:
        flat = x.reshape(x.shape[0], d).astype(x.dtype, copy=True)
        if lam_dev is not None:
            flat = flat + flat @ lam_dev.T
        return _readonly((flat + delta.astype(x.dtype)).reshape(x.shape))

    return replace(client, x_train=shift(client.x_train), x_test=shift(client.x_test),
                   x_val=None if client.x_val is None else shift(client.x_val))


@functools.lru_cache(maxsize=2)  # one image data set in float32 is ~200 MB
def _load_federated_cached(cfg: DataConfig) -> tuple[ClientData, ...]:
    clients = _build_clients(cfg)
    if cfg.affine_shift_lambda_std > 0 or cfg.affine_shift_delta_std > 0:
        clients = tuple(affine_shift_client(c, cfg) for c in clients)
    return clients


def _build_clients(cfg: DataConfig) -> tuple[ClientData, ...]:
    if cfg.is_regression:
        return _regression_clients(cfg)
    if cfg.dataset == "synthetic":
        specs, num_classes = _synthetic_clients(cfg)
    else:
        specs, num_classes = _labelled_clients(cfg)
    train_parts = [spec[2] for spec in specs]
    val_parts: list[np.ndarray | None] = [None] * len(specs)
    if cfg.validation_fraction > 0:
        for pid, spec in enumerate(specs):
            train_parts[pid], val_parts[pid] = validation_split(spec[2], spec[1], cfg.validation_fraction,
                                                                cfg.seed, pid)
    if cfg.reduce_fraction > 0 and cfg.reduce_keep < 1:
        train_parts, _ = reduce_clients(
            train_parts, cfg.reduce_fraction, cfg.reduce_keep, _rng(cfg.seed, _STREAM_REDUCE)
        )
    clients = []
    for pid, ((x_tr, y_tr, _, x_te, y_te, test), train, val) in enumerate(
        zip(specs, train_parts, val_parts, strict=True)
    ):
        if len(train) == 0 or len(test) == 0:
            raise ValueError(
                f"client {pid} got {len(train)} training and {len(test)} test examples; "
                f"lower num-partitions ({cfg.num_partitions}) or change the partition"
            )
        clients.append(
            _make_client(pid, x_tr[train], y_tr[train], x_te[test], y_te[test], num_classes,
                         None if val is None else x_tr[val], None if val is None else y_tr[val])
        )
    return tuple(clients)


def load_federated(cfg: DataConfig) -> list[ClientData]:
    """Every client's local data for `cfg` (built once per process and configuration).

    Parameters
    ----------
    cfg : DataConfig
        Validated configuration (hashable: the cache key).

    Returns
    -------
    list[ClientData]
        ``num_partitions`` clients, client i at position i (a fresh list; the
        `ClientData` records and their read-only arrays are shared).

    Raises
    ------
    DatasetNotFoundError
        If the data set is neither local nor reachable on the hub.
    ValueError
        If the configuration cannot be realised on this data set (e.g. a client ends
        up empty).
    """
    if not isinstance(cfg, DataConfig):
        raise ValueError(f"cfg must be a DataConfig, got {type(cfg).__name__}")
    return list(_load_federated_cached(cfg))


def get_client_data(cfg: DataConfig, partition_id: int) -> ClientData:
    """The local data of one client.

    Parameters
    ----------
    cfg : DataConfig
        Configuration.
    partition_id : int
        Client index in ``[0, cfg.num_partitions)``.

    Returns
    -------
    ClientData
        That client's train and test sets.

    Raises
    ------
    ValueError
        If `partition_id` is outside ``[0, num_partitions)``.
    """
    if isinstance(partition_id, bool) or not isinstance(partition_id, int | np.integer):
        raise ValueError(
            f"partition_id must be an int in [0, {cfg.num_partitions}), got {partition_id!r}"
        )
    if not 0 <= partition_id < cfg.num_partitions:
        raise ValueError(
            f"partition_id must be in [0, {cfg.num_partitions}) (num-partitions), got {partition_id}"
        )
    return load_federated(cfg)[int(partition_id)]


def clear_cache() -> None:
    """Forget the cached federated data and parsed raw arrays (frees their memory)."""
    from flowerdro.data.sources import _load_raw_cached

    _load_federated_cached.cache_clear()
    _load_raw_cached.cache_clear()
