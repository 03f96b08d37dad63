r"""Trainable parameters and buffers of a model seen as a list of named arrays.

The server sees a model as named arrays (the clients' ``state_dict`` keys). Some of them
are not parameters but *buffers*: BatchNorm's running statistics and its integer batch
counter, or any other non-trainable state. Every strategy aggregates them the same way:

* an array is a buffer when it is not floating-point or its key's last dotted component
  is a torch normalisation buffer (:data:`BUFFER_NAMES`; :func:`update_mask`);
* a buffer of the new model is the weighted mean of the participants' buffers, with the
  weights the strategy combines their models with (examples for FedAvg, a_i for DRFA,
  λ for SCAFF-PD, λ* for FedMGDA+, W's row for DR-DSGD's gossip):
  :math:`b = \sum_i w_i b_i / \sum_i w_i` (:func:`mean_buffers`), never a server step
  (global learning rates, q-FedAvg's 1/h, extrapolations act on the parameters only);
* every array keeps its dtype; integer arrays are rounded to the nearest integer, not
  truncated (:func:`cast_layer`), so a batch counter of 30 averaged to 29.999999999999996
  stays 30.

numpy only (no flwr, no torch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

__all__ = ["BUFFER_NAMES", "cast_layer", "mean_buffers", "update_mask"]

#: Last dotted components of the state_dict keys that are buffers, not trainable parameters.
BUFFER_NAMES: frozenset[str] = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def update_mask(keys: Sequence[str], arrays: Sequence[np.ndarray]) -> list[bool]:
    """Which arrays are updates: floating-point and not named as a buffer (:data:`BUFFER_NAMES`).

    Parameters
    ----------
    keys : sequence of str
        The arrays' keys (the clients' ``state_dict`` keys, e.g. ``"1.running_mean"``).
    arrays : sequence of np.ndarray
        The arrays, in the same order.

    Returns
    -------
    list of bool
        True for a trainable parameter (an update), False for a buffer.

    Examples
    --------
    >>> update_mask(["fc.weight", "bn.running_mean", "bn.num_batches_tracked"],
    ...             [np.zeros(2, np.float32), np.zeros(2, np.float32), np.zeros((), np.int64)])
    [True, False, False]
    """
    return [bool(np.issubdtype(np.asarray(a).dtype, np.floating)) and k.rsplit(".", 1)[-1] not in BUFFER_NAMES
            for k, a in zip(keys, arrays, strict=True)]


def cast_layer(values: ArrayLike, dtype: DTypeLike) -> np.ndarray:
    """``values`` (computed in float64) as ``dtype``: rounded to the nearest integer for integer dtypes.

    ``astype`` truncates toward zero, so an average that lands a rounding error below an
    integer would lose one; booleans are ``values >= 0.5``. Floating dtypes are a plain
    cast.

    Parameters
    ----------
    values : array_like
        The new layer, usually float64.
    dtype : dtype
        The layer's dtype in the model.

    Returns
    -------
    numpy.ndarray
        The layer in ``dtype``.

    Examples
    --------
    >>> cast_layer(np.array([29.999999999999996, 2.5, -0.6]), np.int64)
    array([30,  2, -1])
    """
    target = np.dtype(dtype)
    arr = np.asarray(values)
    if target == np.bool_:
        return np.asarray(arr >= 0.5)
    if np.issubdtype(target, np.integer) and not np.issubdtype(arr.dtype, np.integer):
        return np.rint(arr).astype(target)
    return arr.astype(target, copy=False)


def mean_buffers(
    layers: Sequence[np.ndarray],
    mask: Sequence[bool],
    models: Mapping[Any, Sequence[ArrayLike]],
    weights: Mapping[Any, float],
) -> list[np.ndarray]:
    r"""``layers`` with every buffer replaced by the participants' weighted mean.

    For each array j with ``mask[j] = False``:
    :math:`b_j = \sum_i w_i\, b_{ij} / \sum_i w_i` over the participants i of ``weights``
    (summed in float64 in the order of ``weights``), cast to the dtype of ``layers[j]``
    with :func:`cast_layer`. Arrays with ``mask[j] = True`` (the parameters) are returned
    as they are.

    Parameters
    ----------
    layers : sequence of numpy.ndarray
        The new model as the strategy computed it (its buffers are replaced).
    mask : sequence of bool
        :func:`update_mask` of the model: True for a parameter, False for a buffer.
    models : mapping
        Participant → its model's arrays (same order and shapes as ``layers``).
    weights : mapping
        Participant → w_i ≥ 0, the weight the strategy combines its model with. Only the
        participants listed here count; their weights need not sum to 1.

    Returns
    -------
    list of numpy.ndarray
        The layers, buffers replaced.

    Raises
    ------
    ValueError
        If ``mask`` does not have one entry per layer, a weight is negative or not finite,
        or the weights sum to 0 while the model has buffers.

    Examples
    --------
    >>> out = mean_buffers([np.zeros(1), np.zeros((), np.int64)], [True, False],
    ...                    {0: [np.ones(1), np.array(10)], 1: [np.ones(1), np.array(31)]}, {0: 1.0, 1: 2.0})
    >>> out[1]
    array(24)
    """
    if len(mask) != len(layers):
        raise ValueError(f"mask: expected one entry per layer ({len(layers)}), got {len(mask)}")
    out = list(layers)
    buffers = [j for j, is_update in enumerate(mask) if not is_update]
    if not buffers:
        return out
    w = {i: float(v) for i, v in weights.items()}
    if any(not np.isfinite(v) or v < 0 for v in w.values()):
        raise ValueError(f"weights: must be finite and >= 0, got {w}")
    total = sum(w.values())
    if total <= 0:
        raise ValueError(f"weights: the participants' weights sum to {total}; the buffers' mean needs a "
                         "positive total")
    for j in buffers:
        acc = np.zeros(np.shape(layers[j]), dtype=np.float64)
        for i, wi in w.items():
            acc += wi * np.asarray(models[i][j], dtype=np.float64)
        out[j] = cast_layer(acc / total, np.asarray(layers[j]).dtype)
    return out
