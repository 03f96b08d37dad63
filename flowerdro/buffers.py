"""Flower ``Array`` buffers without needless copies (shared by the server and the clients).

:func:`array_view` reads an ``Array`` as a numpy view of its buffer; :func:`to_array` and
:func:`to_array_record` write one with a single copy of the values.

Kept apart from :mod:`flowerdro.strategies` so that a ClientApp process reads its received
arrays without importing the strategies.
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

__all__ = ["array_view", "to_array", "to_array_record"]

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


@functools.lru_cache(maxsize=4096)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` version 1.0 header of a C-ordered array (depends on dtype and shape only)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                  "fortran_order": False, "shape": shape})
    return header.getvalue()


def to_array(values: Any) -> Array:
    """A numpy array (or a torch tensor) as a Flower ``Array`` holding its ``.npy`` bytes.

    The bytes are exactly those of ``Array(ndarray)`` (``np.save`` of the C-ordered array:
    a version 1.0 header padded to 64 bytes, then the values), written with one copy of
    the values of a C-contiguous array instead of three (``np.save`` writes chunks into a ``BytesIO`` whose
    ``getvalue`` copies again). A torch tensor is detached and moved to the CPU first.
    """
    if hasattr(values, "detach"):  # a torch tensor, without importing torch here
        values = values.detach().cpu().numpy()
    a = np.asarray(values)
    if a.dtype.hasobject or not a.flags.c_contiguous:
        # np.save writes a Fortran-ordered array in Fortran order and refuses objects
        return Array(a)
    data = b"".join((_npy_header(a.dtype, a.shape), memoryview(a).cast("B") if a.size else b""))
    return Array(dtype=str(a.dtype), shape=tuple(int(n) for n in a.shape), stype=SType.NUMPY, data=data)


def to_array_record(arrays: Mapping[str, Any]) -> ArrayRecord:
    """An ``ArrayRecord`` of ``arrays`` (names to numpy arrays or torch tensors, order kept).

    Same record as ``ArrayRecord(arrays)`` for a torch ``state_dict`` or a dict of numpy
    arrays, built with :func:`to_array`.
    """
    return ArrayRecord({str(k): to_array(v) for k, v in arrays.items()})
