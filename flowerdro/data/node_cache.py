"""A node-local cache of prepared partitions: a fresh ClientApp process loads one ``.npz``.

In a deployment, Flower 1.41 starts a new ``flwr-clientapp`` process for every message, so
without a cache each message reads the whole data set and partitions it again. With a
cache folder (SuperNode ``--node-config "... data-cache=/path"``, or the environment
variable ``FLOWERDRO_DATA_CACHE``) the first process of a node writes its partition to
``<folder>/<config key>/partition-<id>.npz`` and every later one reads only that file. The
key is a hash of the whole :class:`~flowerdro.data.DataConfig` (data set, partition, seeds,
number of partitions, …), so a changed configuration never reads a stale partition.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from flowerdro.data.config import DataConfig
from flowerdro.data.federated import ClientData, get_client_data

__all__ = ["CACHE_ENV", "cache_path", "cached_client_data"]

#: Environment variable naming the cache folder when the node config does not.
CACHE_ENV = "FLOWERDRO_DATA_CACHE"

_FIELDS = ("x_train", "y_train", "x_test", "y_test")
#: The validation set's arrays, stored only when the client has one (``validation-fraction`` > 0).
_VAL_FIELDS = ("x_val", "y_val")


def cache_path(cache_dir: str | Path, cfg: DataConfig, partition_id: int) -> Path:
    """Where partition ``partition_id`` of ``cfg`` is cached: ``<dir>/<sha256(repr(cfg))[:16]>/partition-<id>.npz``."""
    key = hashlib.sha256(repr(cfg).encode()).hexdigest()[:16]
    return Path(cache_dir) / key / f"partition-{int(partition_id)}.npz"


def cached_client_data(cfg: DataConfig, partition_id: int, cache_dir: str | Path | None = None) -> ClientData:
    """One client's data, from the node-local cache when it holds it (else built and stored).

    ``cache_dir`` None or empty means :data:`CACHE_ENV`, and no cache when that is unset
    too. A file that cannot be read (partly written, another version) is rebuilt. Files
    are written to a temporary name and renamed, so concurrent processes never read half a
    file. Returns the same arrays as :func:`~flowerdro.data.get_client_data` (read-only).
    """
    folder = cache_dir or os.environ.get(CACHE_ENV, "")
    if not folder:
        return get_client_data(cfg, partition_id)
    path = cache_path(folder, cfg, partition_id)
    if path.is_file():
        try:
            with np.load(path) as z:
                arrays = {name: z[name] for name in _FIELDS}
                if cfg.validation_fraction > 0:
                    arrays.update({name: z[name] for name in _VAL_FIELDS})
                num_classes, shape = int(z["num_classes"]), tuple(int(v) for v in z["input_shape"])
            for a in arrays.values():
                a.flags.writeable = False
            return ClientData(int(partition_id), num_classes=num_classes, input_shape=shape, **arrays)
        except (OSError, ValueError, KeyError):
            pass  # unreadable: rebuilt below
    cd = get_client_data(cfg, partition_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as fh:
            names = _FIELDS + (_VAL_FIELDS if cd.x_val is not None else ())
            np.savez(fh, **{name: getattr(cd, name) for name in names}, num_classes=np.int64(cd.num_classes),
                     input_shape=np.asarray(cd.input_shape, dtype=np.int64))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return cd
