"""The runtime a :class:`~flowerdro.clients.kit.ClientKit` serves a node with: the user's model on the user's data.

:class:`UserRuntime` is flowerdro's :class:`~flowerdro.clients.handlers.ClientRuntime` with
the user's model factory and loss, so every handler trains the user's model. It holds two
placements (:class:`Placement`): where flowerdro's own loops run (the data's device and
dtype) and where the user's ``train_fn``/``test_fn`` get the model. :func:`check_state_dict`
and :func:`state_as_sent` keep the exchange with the server exact: the received arrays must
match the user's model, and the reply holds the weights on the CPU in the dtypes the
server sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn
from torch.nn import functional as F

from flowerdro.clients import handlers
from flowerdro.clients.training import LocalData, LossFn

__all__ = ["Placement", "UserRuntime", "check_model", "check_state_dict", "is_plain_cross_entropy",
           "loop_placement", "state_as_sent"]


def is_plain_cross_entropy(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` is exactly the mean cross-entropy flowerdro's loops use by default."""
    if loss_fn is F.cross_entropy:
        return True
    return (isinstance(loss_fn, nn.CrossEntropyLoss) and loss_fn.weight is None and loss_fn.reduction == "mean"
            and loss_fn.ignore_index == -100 and loss_fn.label_smoothing == 0.0)


@dataclass(frozen=True)
class Placement:
    """A device and a floating-point dtype: where a model's parameters live."""

    device: torch.device
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.device} ({str(self.dtype).removeprefix('torch.')})"


def loop_placement(device: torch.device, data_dtype: torch.dtype) -> Placement:
    """Where flowerdro's own loops run on the user's model: the resolved ``device``, the data's dtype."""
    return Placement(device, data_dtype)


class UserRuntime(handlers.ClientRuntime):
    """flowerdro's client runtime with the user's model factory and loss.

    ``data`` (and every model :meth:`new_model` builds) sit where flowerdro's own loops run;
    ``user`` is where the user's ``train_fn``/``test_fn`` get the model.
    """

    kit: Any  # the ClientKit (model_fn, loss_fn, task)
    train_loader: Any
    test_loader: Any
    user: Placement
    device_setting: str
    validation_loader: Any

    def __init__(self, kit: Any, partition_id: int, num_partitions: int, data: LocalData,
                 train_loader: Any, test_loader: Any, num_classes: int, user: Placement,
                 device_setting: str, validation_loader: Any = None) -> None:
        super().__init__(partition_id=partition_id, num_partitions=num_partitions, data=data,
                         input_shape=tuple(data.x_train.shape[1:]), num_classes=num_classes, model_name="user",
                         model_kwargs=(), task=kit.task)
        self.kit, self.train_loader, self.test_loader = kit, train_loader, test_loader
        self.user, self.device_setting = user, device_setting
        self.validation_loader = validation_loader

    def for_user(self, model: nn.Module) -> nn.Module:
        """``model`` moved to where the user's functions run (nothing happens when it is there)."""
        return model.to(device=self.user.device, dtype=self.user.dtype)

    def call_user(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; a device or dtype mismatch inside it is re-raised naming the placement and the key."""
        try:
            return fn(*args)
        except RuntimeError as exc:
            if not _is_placement_error(exc):
                raise
            raise RuntimeError(
                f"{name}: your function failed with the model handed to it on {self.user} ({exc}). Run-config "
                f"device = {self.device_setting!r}: with 'auto' your functions get the model on the device and "
                "dtype of the inputs your loader yields; with 'cpu', 'cuda' or 'cuda:N' on that device, and "
                "they must move their batches to args.device (train_fn) or the device argument (test_fn)"
            ) from exc

    @property
    def loss_fn(self) -> LossFn | None:
        """The user's loss (None when it is plain cross-entropy: flowerdro's loops then run unchanged)."""
        return None if is_plain_cross_entropy(self.kit.loss_fn) else self.kit.loss_fn

    def new_model(self, seed: int | None = None) -> nn.Module:
        """``model_fn()`` on the data's device and dtype (weights drawn under ``torch.manual_seed(seed)``)."""
        if seed is None:
            model = self.kit.model_fn()
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(seed))
                model = self.kit.model_fn()
        return model.to(device=self.data.x_train.device, dtype=self.data.x_train.dtype)

    def model_from(self, arrays: ArrayRecord) -> nn.Module:
        """The user's model holding the received weights; an error naming every mismatched key."""
        model = self.new_model()
        check_state_dict(model, arrays)
        state = arrays.to_torch_state_dict()
        model.load_state_dict({k: v.to(self.data.x_train.device) for k, v in state.items()}, strict=True)
        return model


def _is_placement_error(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's complaint about tensors on different devices or of different dtypes."""
    text = str(exc)
    if re.search(r"\b(input|weight|bias) type .* should be the same", text, re.IGNORECASE):  # convolutions
        return True
    return any(part in text for part in ("same device", "same dtype", "expected scalar type", "expected device",
                                         "different from other tensors", "has changed the type of value"))


def _sent_dtype(array: Any) -> torch.dtype:
    """The torch dtype of a received Flower ``Array``."""
    return torch.from_numpy(np.empty(0, dtype=np.dtype(array.dtype))).dtype


def state_as_sent(model: nn.Module, received: ArrayRecord) -> dict[str, torch.Tensor]:
    """The model's weights on the CPU, each in the dtype of the array the server sent under its name.

    The user's function may leave the model on another device or in another dtype; the
    reply must hold what the server's aggregation expects.
    """
    return {k: v.detach().to(device="cpu", dtype=_sent_dtype(received[k]) if k in received else v.dtype)
            for k, v in model.state_dict().items()}


def check_state_dict(model: nn.Module, arrays: ArrayRecord) -> None:
    """Raise a ValueError naming the keys and shapes where ``arrays`` and ``model.state_dict()`` differ."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(arrays[k].shape) for k in arrays.keys()}
    missing, extra = sorted(set(own) - set(got)), sorted(set(got) - set(own))
    shapes = [f"{k}: server {got[k]}, model {own[k]}" for k in own if k in got and got[k] != own[k]]
    if missing or extra or shapes:
        parts = ([f"missing from the server's arrays: {missing}"] if missing else []) + \
                ([f"not in your model: {extra}"] if extra else []) + \
                ([f"shapes differ: {'; '.join(shapes)}"] if shapes else [])
        raise ValueError("model: the server's arrays do not match your model_fn()'s state_dict ("
                         + "; ".join(parts) + "). The server must start from your model: let it ask a client "
                         "(query.init) or pass ArrayRecord(Net().state_dict()) as the initial arrays")


def check_model(rt: UserRuntime) -> int:
    """Run the user's model on two training examples: it must accept the inputs and fit the labels.

    Returns the number of outputs per example (the classes of a classification model).
    """
    model = rt.new_model()
    x, y = rt.data.x_train[:2], rt.data.y_train[:2]
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as exc:
        raise ValueError(f"data: your model could not run on inputs of shape {tuple(x.shape)} and dtype "
                         f"{x.dtype} from your data ({type(exc).__name__}: {exc})") from exc
    if rt.kit.task == "classification":
        if out.dim() != 2 or out.shape[0] != x.shape[0]:
            raise ValueError(f"model: a classification model must output (batch, classes), got "
                             f"{tuple(out.shape)} for a batch of {x.shape[0]}")
        top = int(rt.data.y_train.max())
        if top >= out.shape[1] or int(rt.data.y_train.min()) < 0:
            raise ValueError(f"train data: labels in [{int(rt.data.y_train.min())}, {top}] but the model has "
                             f"{out.shape[1]} outputs")
        try:
            float(rt.kit.loss_fn(out, y))  # type: ignore[misc]
        except Exception as exc:
            raise ValueError(f"loss_fn: failed on the model's output {tuple(out.shape)} and labels "
                             f"{tuple(y.shape)} {y.dtype} ({type(exc).__name__}: {exc})") from exc
        return int(out.shape[1])
    return int(out.reshape(out.shape[0], -1).shape[1])
