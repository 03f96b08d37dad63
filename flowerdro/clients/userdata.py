"""The user's data, as a :class:`~flowerdro.clients.kit.ClientKit` reads it.

Two steps: :func:`call_data_fn` calls the project's ``data_fn`` with what its signature
asks for (the partition, the number of partitions, and by name ``batch_size``,
``context`` or ``run_config``), so an unchanged ``load_data(partition_id,
num_partitions, batch_size)`` of Flower's quickstarts can be passed as it is; then
:func:`tensors_of` turns each part (a loader of ``(x, y)`` or dict batches, or a pair of
arrays) into one checked ``(x, y)`` pair of tensors for flowerdro's own loops. The user's
loaders themselves still go to the user's ``train_fn`` and ``test_fn``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Context

from flowerdro.clients.config import Settings

__all__ = ["DATA_FN_EXTRAS", "call_data_fn", "data_fn_extras", "hold_out", "split_parts", "tensors_of"]

#: Parameters of ``data_fn`` after ``(partition_id, num_partitions)`` that the kit fills, by name:
#: the run config's ``batch-size``, the node's Context, the run config.
DATA_FN_EXTRAS: tuple[str, ...] = ("batch_size", "context", "run_config")

#: The batch size a ``data_fn`` gets when neither the run config nor its own default sets one
#: (flowerdro's loops use the same default).
DEFAULT_BATCH_SIZE = 32

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def data_fn_extras(data_fn: Callable[..., Any]) -> dict[str, Any]:
    """The parameters of ``data_fn`` beyond ``(partition_id, num_partitions)`` that the kit fills.

    Returns ``{name: default}`` (``inspect.Parameter.empty`` when it has none) for each of
    :data:`DATA_FN_EXTRAS` it takes; empty for a function without a readable signature.

    Raises
    ------
    TypeError
        ``data_fn`` takes fewer than two positional parameters, or a further parameter
        without a default that the kit cannot fill (naming it and the allowed names).
    """
    try:
        params = list(inspect.signature(data_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: called with the two numbers
        return {}
    positional = [p for p in params if p.kind in _POSITIONAL]
    if len(positional) < 2 and not any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        raise TypeError(f"data_fn: expected data_fn(partition_id, num_partitions, ...), got parameters "
                        f"{[p.name for p in params]}")
    extras: dict[str, Any] = {}
    for p in positional[2:] + [p for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY]:
        if p.name in DATA_FN_EXTRAS and p.kind != inspect.Parameter.POSITIONAL_ONLY:
            extras[p.name] = p.default
        elif p.default is inspect.Parameter.empty:
            raise TypeError(f"data_fn: parameter {p.name!r} has no default and the kit cannot fill it; after "
                            "(partition_id, num_partitions) it fills, by name, batch_size (run-config batch-size), "
                            "context (the node's Context) and run_config (the run config)")
    return extras


def call_data_fn(data_fn: Callable[..., Any], partition_id: int, num_partitions: int, context: Context) -> Any:
    """``data_fn(partition_id, num_partitions, **extras)`` with the extras its signature names.

    ``batch_size`` gets run-config ``batch-size`` (else the parameter's own default, else
    :data:`DEFAULT_BATCH_SIZE`), ``context`` the node's Context, ``run_config`` the run config.
    """
    kwargs: dict[str, Any] = {}
    for name, default in data_fn_extras(data_fn).items():
        if name == "batch_size":
            fallback = DEFAULT_BATCH_SIZE if default is inspect.Parameter.empty else default
            kwargs[name] = Settings(context.run_config).int("batch-size", fallback, minimum=1)
        elif name == "context":
            kwargs[name] = context
        else:
            kwargs[name] = dict(context.run_config)
    return data_fn(partition_id, num_partitions, **kwargs)


def split_parts(loaded: Any) -> tuple[Any, Any, Any]:
    """``(train, validation or None, test)`` of what ``data_fn`` returned (two or three parts)."""
    if not isinstance(loaded, tuple | list) or len(loaded) not in (2, 3):
        raise ValueError(f"data_fn: expected (train, test) or (train, validation, test), got "
                         f"{type(loaded).__name__}" + (f" of length {len(loaded)}"
                                                       if isinstance(loaded, tuple | list) else ""))
    return (loaded[0], None, loaded[1]) if len(loaded) == 2 else (loaded[0], loaded[1], loaded[2])


def _tensor(values: Any) -> torch.Tensor:
    """A tensor of ``values`` (numpy arrays are copied, so read-only arrays are fine)."""
    return values if isinstance(values, torch.Tensor) else torch.from_numpy(np.array(values))


def _suggested_keys(batch: Mapping[str, Any]) -> str:
    """A ``batch_keys`` guess for a dict batch: its first floating entry, then its first integer one."""
    floats = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and torch.is_floating_point(v)]
    ints = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and not torch.is_floating_point(v)]
    return repr((floats[0], ints[0])) if floats and ints else "('img', 'label')"


def _split_batch(batch: Any, keys: tuple[str, str] | None, owner: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, Mapping):
        if keys is None:
            raise ValueError(f"data: your loader yields dicts with keys {sorted(batch)}; pass "
                             f"batch_keys=(input key, label key) to {owner}, e.g. batch_keys={_suggested_keys(batch)}")
        for k in keys:
            if k not in batch:
                raise ValueError(f"batch_keys: key {k!r} not in your loader's batches (keys: {sorted(batch)})")
        return _tensor(batch[keys[0]]), _tensor(batch[keys[1]])
    if isinstance(batch, list | tuple) and len(batch) == 2:
        return _tensor(batch[0]), _tensor(batch[1])
    raise ValueError(f"data: expected batches (inputs, labels) or dicts, got {type(batch).__name__}"
                     + (f" of length {len(batch)}" if isinstance(batch, list | tuple) else ""))


def _ordered(loader: Any) -> Iterable[Any]:
    """The loader's batches in dataset order (a shuffling DataLoader is re-read unshuffled)."""
    from torch.utils.data import DataLoader

    if isinstance(loader, DataLoader) and loader.batch_size is not None:
        return DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False,
                          collate_fn=loader.collate_fn)
    return loader


def tensors_of(data: Any, what: str, keys: tuple[str, str] | None = None, owner: str = "ClientKit"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` from a pair of arrays/tensors or from a loader of batches; checked and concatenated.

    Inputs must be floating point; labels one value per example, integers (classification)
    or floats (regression). Dict batches need ``keys`` (input key, label key); ``owner``
    names the class that takes them in the error. The errors say what was expected and
    what the data holds.
    """
    if isinstance(data, tuple | list) and len(data) == 2 and not isinstance(data[0], list | tuple | Mapping):
        xs, ys = [_tensor(data[0])], [_tensor(data[1])]
    else:
        xs, ys = [], []
        for batch in _ordered(data):
            x, y = _split_batch(batch, keys, owner)
            xs.append(x)
            ys.append(y)
        if not xs:
            raise ValueError(f"{what}: the loader yielded no batch")
    for x, y in zip(xs, ys, strict=True):
        if x.shape[1:] != xs[0].shape[1:]:
            raise ValueError(f"{what}: inputs of shapes {tuple(xs[0].shape[1:])} and {tuple(x.shape[1:])} "
                             "per example; every example must have the same shape")
        if x.shape[0] != y.reshape(-1).shape[0] or y.dim() > 1 and y.shape[1:] != (1,):
            raise ValueError(f"{what}: a batch has {x.shape[0]} inputs but labels of shape {tuple(y.shape)}; "
                             "expected one label per example")
    x, y = torch.cat(xs), torch.cat([t.reshape(-1) for t in ys])
    if not torch.is_floating_point(x):
        raise ValueError(f"{what}: inputs have dtype {x.dtype}; expected floating point (e.g. images scaled "
                         "to [0, 1] by your transform)")
    if torch.is_complex(y) or y.dtype == torch.bool:
        raise ValueError(f"{what}: labels have dtype {y.dtype}; expected integer classes or float targets")
    return x, y


def hold_out(x: torch.Tensor, y: torch.Tensor, fraction: float, seed: int, partition_id: int, task: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_val, y_val): a stratified ``fraction`` of the rows held out, seeded by (seed, pid).

    The rows are split as flowerdro's own data sets split theirs
    (:func:`flowerdro.data.federated.validation_split`; random rows for regression).
    """
    from flowerdro.data.federated import validation_split

    labels = y.cpu().numpy() if task == "classification" else None
    train, val = validation_split(np.arange(int(y.shape[0])), labels, fraction, seed, partition_id)
    tr, va = torch.from_numpy(np.sort(train)), torch.from_numpy(np.sort(val))
    return x[tr], y[tr], x[va], y[va]
