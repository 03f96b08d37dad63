"""The node-local partition cache: a fresh process reads back exactly the partition it would build."""

from __future__ import annotations

import numpy as np

from flowerdro.data import DataConfig, get_client_data
from flowerdro.data.node_cache import CACHE_ENV, cache_path, cached_client_data


def _cfg(seed: int = 0) -> DataConfig:
    return DataConfig(dataset="synthetic", partition="natural", num_partitions=4, seed=seed, synthetic_dim=7,
                      synthetic_classes=3)


def _same(a, b) -> bool:
    return (all(np.array_equal(getattr(a, f), getattr(b, f)) and getattr(a, f).dtype == getattr(b, f).dtype
                for f in ("x_train", "y_train", "x_test", "y_test"))
            and a.num_classes == b.num_classes and a.input_shape == b.input_shape and a.partition_id == b.partition_id)


def test_first_call_writes_the_partition_and_later_calls_read_the_same_arrays(tmp_path):
    cfg = _cfg()
    built = cached_client_data(cfg, 2, tmp_path)
    path = cache_path(tmp_path, cfg, 2)
    assert path.is_file()
    read = cached_client_data(cfg, 2, tmp_path)
    assert _same(read, get_client_data(cfg, 2)) and _same(read, built)
    assert not read.x_train.flags.writeable  # as the in-memory cache's arrays


def test_another_configuration_gets_another_file(tmp_path):
    assert cache_path(tmp_path, _cfg(0), 1) != cache_path(tmp_path, _cfg(1), 1)
    assert cache_path(tmp_path, _cfg(0), 1) != cache_path(tmp_path, _cfg(0), 2)


def test_an_unreadable_file_is_rebuilt(tmp_path):
    cfg = _cfg()
    path = cache_path(tmp_path, cfg, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half a file")
    assert _same(cached_client_data(cfg, 0, tmp_path), get_client_data(cfg, 0))
    with np.load(path) as z:  # replaced by a whole file
        assert "x_train" in z


def test_the_environment_variable_names_the_folder_and_no_folder_means_no_cache(tmp_path, monkeypatch):
    cfg = _cfg()
    monkeypatch.delenv(CACHE_ENV, raising=False)
    cached_client_data(cfg, 3)
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    cached_client_data(cfg, 3)
    assert cache_path(tmp_path, cfg, 3).is_file()


def test_a_client_with_the_node_config_key_fills_the_cache(tmp_path, synth_rc, monkeypatch):
    from collections import OrderedDict

    from flwr.app import Context, RecordDict

    from flowerdro.clients import handlers
    from flowerdro.clients.handlers import get_runtime

    # a fresh process: no runtime of this partition built by an earlier test
    monkeypatch.setattr(handlers, "_RUNTIMES", OrderedDict())
    monkeypatch.setattr(handlers, "_LATEST", {})

    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 1, "num-partitions": 3,
                                                    "data-cache": str(tmp_path)}, state=RecordDict(), run_config=synth_rc)
    rt = get_runtime(ctx)
    cfg = DataConfig.from_run_config(synth_rc, num_partitions=3)
    assert cache_path(tmp_path, cfg, 1).is_file()
    assert np.array_equal(rt.data.x_train.cpu().numpy(), get_client_data(cfg, 1).x_train)
