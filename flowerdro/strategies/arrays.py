"""Model arrays on the server: Flower ``ArrayRecord`` ↔ numpy, checks, sizes, ``.npz`` files."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.common.constant import SType


def record_bytes(content: RecordDict) -> int:
    """Bytes of all arrays in a RecordDict (serialised size of each Array's buffer)."""
    total = 0
    for rec in content.array_records.values():
        for arr in rec.values():
            total += len(arr.data)
    return total


_NPY_MAGIC = b"\x93NUMPY"
_NPY_DESCR = re.compile(rb"'descr':\s*'([^']+)'")


def array_view(array: Array) -> np.ndarray:
    """A Flower ``Array`` as a read-only numpy view of its serialised buffer (no copy).

    ``Array.data`` holds the ``.npy`` bytes of a C-ordered array: magic, version, header
    length, a header naming dtype and order, then the values. The view skips the header
    with ``np.frombuffer`` instead of ``np.load`` (which parses the header with
    ``ast.literal_eval`` and copies the values); anything else (Fortran order, structured
    dtypes, another serialisation) goes through ``Array.numpy()``. Same values, dtype
    and shape as ``Array.numpy()``.
    """
    data = array.data
    if array.stype == SType.NUMPY and data[:6] == _NPY_MAGIC and data[6] in (1, 2, 3):
        start = 10 if data[6] == 1 else 12
        end = start + int.from_bytes(data[8:start], "little")
        header = data[start:end]
        descr = _NPY_DESCR.search(header)
        shape = tuple(int(n) for n in array.shape)
        if descr is not None and b"'fortran_order': False" in header:
            dtype = np.dtype(descr.group(1).decode("ascii"))
            count = math.prod(shape)
            if not dtype.hasobject and len(data) - end == count * dtype.itemsize:
                return np.frombuffer(data, dtype=dtype, count=count, offset=end).reshape(shape)
    return array.numpy()


def arrays_to_numpy(arrays: ArrayRecord) -> list[np.ndarray]:
    """The arrays of a record as numpy arrays, in key order."""
    return [arrays[k].numpy() for k in arrays.keys()]


def numpy_to_arrays(keys: Sequence[str], values: Sequence[np.ndarray]) -> ArrayRecord:
    """An ArrayRecord with ``keys`` mapped to ``values`` (order kept)."""
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(keys, values, strict=True)})


def check_arrays(reference: ArrayRecord, candidate: ArrayRecord) -> str | None:
    """Why ``candidate`` cannot stand in for ``reference`` (keys, shapes, finiteness), or None."""
    ref_keys, cand_keys = list(reference.keys()), list(candidate.keys())
    if ref_keys != cand_keys:
        return f"array keys {cand_keys[:3]}... differ from the model's {ref_keys[:3]}..."
    for k in ref_keys:
        r, c = reference[k], candidate[k]
        if tuple(r.shape) != tuple(c.shape):
            return f"array '{k}' has shape {tuple(c.shape)}, expected {tuple(r.shape)}"
        a = array_view(c)
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
            return f"array '{k}' holds NaN or Inf"
    return None


def save_arrays(path: str | Path, arrays: ArrayRecord) -> None:
    """Save an ArrayRecord as ``.npz`` (one entry per key, key order kept)."""
    np.savez(path, **{k: arrays[k].numpy() for k in arrays.keys()})


def load_arrays(path: str | Path) -> ArrayRecord:
    """The ArrayRecord saved by :func:`save_arrays`."""
    with np.load(path) as data:
        return numpy_to_arrays(list(data.files), [data[k] for k in data.files])
