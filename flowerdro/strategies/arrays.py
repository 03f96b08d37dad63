"""Model arrays on the server: Flower ``ArrayRecord`` ↔ numpy, checks, sizes, ``.npz`` files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from flowerdro.buffers import array_view, to_array


def record_bytes(content: RecordDict) -> int:
    """Bytes of all arrays in a RecordDict (serialised size of each Array's buffer)."""
    total = 0
    for rec in content.values():
        if isinstance(rec, ArrayRecord):
            for arr in rec.values():
                total += len(arr.data)
    return total


def arrays_to_numpy(arrays: ArrayRecord) -> list[np.ndarray]:
    """The arrays of a record as numpy arrays, in key order."""
    return [arrays[k].numpy() for k in arrays.keys()]


def numpy_to_arrays(keys: Sequence[str], values: Sequence[np.ndarray]) -> ArrayRecord:
    """An ArrayRecord with ``keys`` mapped to ``values`` (order kept)."""
    return ArrayRecord({k: to_array(v) for k, v in zip(keys, values, strict=True)})


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


def save_arrays(path: str | Path | IO[bytes], arrays: ArrayRecord) -> None:
    """Save an ArrayRecord as ``.npz`` (one entry per key, key order kept) to a path or an open binary file."""
    np.savez(path, **{k: arrays[k].numpy() for k in arrays.keys()})


def load_arrays(path: str | Path) -> ArrayRecord:
    """The ArrayRecord saved by :func:`save_arrays`."""
    with np.load(path) as data:
        return numpy_to_arrays(list(data.files), [data[k] for k in data.files])
