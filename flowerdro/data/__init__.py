"""Federated data sets for flowerdro: loading, partitioning and per-client test sets.

The rest of the package uses::

    from flowerdro.data import DataConfig, ClientData, get_client_data, load_federated

`DataConfig.from_run_config(context.run_config)` reads the run config;
`get_client_data(cfg, partition_id)` gives one client's train / test arrays (built once
per process by `load_federated`). Data sets: LEAF's Synthetic(α, β) (generated, the
offline default), Fashion-MNIST, MNIST, Adult and CIFAR-10, from ``data-dir`` /
``$FLOWERDRO_DATA`` or else the Hugging Face hub (`DatasetNotFoundError` when neither
works). `robust_regression_problem` generates SCAFF-PD's §6.1 regression clients.
"""

from flowerdro.data.config import DATASETS, PARTITIONS, TEST_MODES, DataConfig
from flowerdro.data.federated import ClientData, clear_cache, get_client_data, load_federated
from flowerdro.data.idx import parse_idx, read_idx
from flowerdro.data.sources import DatasetNotFoundError, RawDataset, load_raw
from flowerdro.data.synthetic import (
    RobustRegressionProblem,
    leaf_synthetic,
    robust_regression_problem,
)

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "TEST_MODES",
    "ClientData",
    "DataConfig",
    "DatasetNotFoundError",
    "RawDataset",
    "RobustRegressionProblem",
    "clear_cache",
    "get_client_data",
    "leaf_synthetic",
    "load_federated",
    "load_raw",
    "parse_idx",
    "read_idx",
    "robust_regression_problem",
]
