"""Zero-copy numpy views of Flower ``Array`` buffers (shared by the server and the clients).

Kept apart from :mod:`flowerdro.strategies` so that a ClientApp process reads its received
arrays without importing the strategies.
"""

from __future__ import annotations

import math
import re

import numpy as np
from flwr.app import Array
from flwr.common.constant import SType

__all__ = ["array_view"]

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
