"""Model arrays on the server: Flower ``ArrayRecord`` ↔ numpy, checks, sizes, averages."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flwr.app import ArrayRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flowerdro.buffers import array_view, to_array
from flowerdro.core.layers import mean_buffers, update_mask


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


def record_weight(content: RecordDict, key: str) -> float:
    """The weight ``key`` (``num-examples``) of a reply's first MetricRecord, as Flower's FedAvg reads it."""
    metrics = next(iter(content.metric_records.values()))
    return float(metrics[key])  # type: ignore[arg-type]


def average_arrays(contents: Sequence[RecordDict], weight_key: str) -> ArrayRecord:
    r"""FedAvg of the replies' models: Σ_i n_i w_i / Σ_i n_i, every array in its dtype.

    The parameters are Flower's own ``aggregate_arrayrecords`` (n_i = the reply's
    ``weight_key`` metric); the buffers (:func:`~flowerdro.core.layers.update_mask`:
    running statistics, integer counters) take the same weighted mean in float64 and keep
    their dtype, integers rounded (Flower's sum would turn an int64 counter into float64).

    Parameters
    ----------
    contents : sequence of RecordDict
        The replies' contents, each with one ArrayRecord and one MetricRecord.
    weight_key : str
        The metric that weights each reply (``num-examples``).

    Returns
    -------
    ArrayRecord
        The average, with the keys of the replies' ArrayRecord.
    """
    mean = aggregate_arrayrecords(list(contents), weight_key)
    models = [next(iter(c.array_records.values())) for c in contents]
    keys = list(models[0].keys())
    first = [array_view(models[0][k]) for k in keys]
    mask = update_mask(keys, first)
    if all(mask):
        return mean
    layers = [array_view(mean[k]) if m else first[j] for j, (k, m) in enumerate(zip(keys, mask, strict=True))]
    new = mean_buffers(layers, mask, {i: [array_view(r[k]) for k in keys] for i, r in enumerate(models)},
                       {i: record_weight(c, weight_key) for i, c in enumerate(contents)})
    return numpy_to_arrays(keys, new)


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
