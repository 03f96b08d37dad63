"""flowerdro.buffers: the one-copy ``Array`` writer gives Flower's own bytes, and the view reads them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from flowerdro.buffers import array_view, to_array, to_array_record


@pytest.mark.parametrize("value", [
    np.arange(12, dtype=np.float32).reshape(3, 4), np.array(2.5), np.zeros((0, 3), np.float16),
    np.array([1, -2, 3], dtype=">i8"), np.array([True, False]), np.arange(6.0).reshape(2, 3).T,  # Fortran order
    np.arange(10.0)[::3],  # strided, neither C nor Fortran contiguous
    np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
])
def test_to_array_writes_the_bytes_of_flowers_array(value):
    ours, flowers = to_array(value), Array(value)
    assert (ours.dtype, ours.shape, ours.stype) == (flowers.dtype, flowers.shape, flowers.stype)
    assert ours.data == flowers.data  # np.save's .npy bytes, header and values
    np.testing.assert_array_equal(array_view(ours), value)


def test_to_array_record_of_a_state_dict_equals_flowers_record():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))  # 0-d num_batches_tracked
    ours, flowers = to_array_record(model.state_dict()), ArrayRecord(model.state_dict())
    assert list(ours.keys()) == list(flowers.keys())
    for k in flowers.keys():
        assert ours[k].shape == flowers[k].shape and ours[k].data == flowers[k].data
