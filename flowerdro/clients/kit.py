r"""Every flowerdro strategy with the user's own model, data, loss and training function.

A Flower project keeps its model, its data loading and its ``train``/``test`` functions
and hands them to a :class:`ClientKit`; the kit serves every message type of every
flowerdro strategy (see :data:`ROUTES`) through flowerdro's own handlers, which then
build *the user's* model from *the user's* data:

.. code-block:: python

    from flowerdro.clients import ClientKit, add_routes

    kit = ClientKit(model_fn=Net, data_fn=load_data, loss_fn=torch.nn.CrossEntropyLoss(),
                    train_fn=lambda model, loader, a: train(model, loader, a.epochs, a.lr, a.device),
                    test_fn=test)
    app = kit.client_app()          # a new ClientApp, or add_routes(app, kit) on an existing one

What runs where:

* ``train`` and ``train.sgd`` (FedAvg, FedProx, q-FedAvg, the FedMGDA+ family) run the
  user's ``train_fn`` unchanged when one is given. The kit first measures the received
  model's loss F_i(w) on the local training data (``train_loss``, what q-FedAvg and
  FedMGDA+ need) and reports the user's own return value as ``train_loss_local``. For
  FedProx (a message with ``proximal-mu`` μ > 0) it adds the proximal gradient
  μ (w − w⁰) to every parameter's gradient through tensor hooks, so the user's loop
  minimises f_i(w) + (μ/2)‖w − w⁰‖² without any change (one ``backward`` per optimizer
  step assumed).
* Every other message type is an algorithm that defines the local loop (DRFA's snapshot
  after step t′, SCAFFOLD and SCAFF-PD's corrected gradients, FedRobust's adversary,
  DR-DSGD's tilted step, FGM/PGD): flowerdro runs the paper's loop on the user's model
  with the user's minibatch loss ``loss_fn(model(x), y)``.

The user's data is read once per partition into tensors (the algorithm-defined loops draw
seeded minibatches from them); the user's own loaders still go to ``train_fn`` and
``test_fn``.

Validation data (an evaluate message with ``eval-split = "validation"``, the tuning
advisor's search): ``data_fn`` may return ``(train, validation, test)``, and the
validation part is then evaluated as the test part is (``test_fn`` on the validation
loader). With ``(train, test)`` and run config ``validation-fraction`` v > 0 the kit holds
out a stratified v of the training tensors itself (seeded by ``data-seed``, else ``seed``),
but only where nothing of the user's reads the training loader or evaluates a loader: with
a ``train_fn`` or a ``test_fn`` it refuses and asks for ``(train, validation, test)``, since
the user's loader would still hold the validation rows. ``partition-id`` in the node config is optional: without it the node's id
stands for the partition (the server does the same), and ``data_fn`` is called with
``(node_id, 0)``.

Where things run (run-config ``device``, or ``ClientKit(device=...)``): with ``auto``
flowerdro's own loops and the received model's loss use CUDA when available, while
``train_fn`` and ``test_fn`` get the model on the device (and in the dtype) of the inputs
the user's loader yields, so CPU-only user code runs unchanged on a GPU machine; ``cpu``
puts everything on the CPU; ``cuda`` / ``cuda:N`` put everything there (the user's
functions then move their batches to ``args.device``). Whatever the user's functions do
with the model (move it to another device or dtype), the reply holds its weights on the
CPU in the dtypes the server sent.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.nn import functional as F

from flowerdro.buffers import to_array_record
from flowerdro.clients import handlers
from flowerdro.clients.config import Settings
from flowerdro.clients.mods import ModChain, ReportMods, is_update_mod, mod_name
from flowerdro.clients.routes import ROUTE_SPECS, handler
from flowerdro.clients.training import (
    LocalData,
    LossFn,
    batch_loss,
    evaluate_model,
    make_generator,
    minibatches,
    resolve_device,
)
from flowerdro.legacy_wire import FromLegacy
from flowerdro.protocol import USER_TRAIN_FN, check_device

__all__ = ["ROUTES", "USER_LOOP_ROUTES", "ClientKit", "TrainArgs", "add_routes"]

#: Message types whose local loop is the user's ``train_fn`` (when given).
USER_LOOP_ROUTES: tuple[str, ...] = ("train", "train.sgd")


#: Every message type a flowerdro strategy sends → flowerdro's handler of it
#: (:data:`flowerdro.clients.routes.ROUTE_SPECS`, each module imported on first call).
ROUTES: dict[str, Callable[[Message, Context], Message]] = {t: handler(t) for t in ROUTE_SPECS}


@dataclass(frozen=True)
class TrainArgs:
    """What the user's ``train_fn(model, train_loader, args)`` is told about this round.

    ``epochs`` is the first positive ``local-epochs`` of the message or the run config
    (1 when neither sets one); ``steps`` the local steps τ flowerdro's own loop would take;
    ``device`` the device the model is handed over on (see :class:`ClientKit`'s ``device``);
    ``config`` every setting (message config over run config).
    """

    lr: float
    epochs: float
    steps: int
    batch_size: int
    device: torch.device
    server_round: int
    seed: int
    partition_id: int
    config: Settings


def _is_plain_cross_entropy(loss_fn: Any) -> bool:
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


def _loop_placement(device: torch.device, data_dtype: torch.dtype) -> Placement:
    """Where flowerdro's own loops run on the user's model: the resolved ``device``, the data's dtype."""
    return Placement(device, data_dtype)


class _UserRuntime(handlers.ClientRuntime):
    """flowerdro's client runtime with the user's model factory and loss.

    ``data`` (and every model :meth:`new_model` builds) sit where flowerdro's own loops run;
    ``user`` is where the user's ``train_fn``/``test_fn`` get the model.
    """

    kit: ClientKit
    train_loader: Any
    test_loader: Any
    user: Placement
    device_setting: str
    validation_loader: Any

    def __init__(self, kit: ClientKit, partition_id: int, num_partitions: int, data: LocalData,
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
        return None if _is_plain_cross_entropy(self.kit.loss_fn) else self.kit.loss_fn

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


# --------------------------------------------------------------------------- data
def _tensor(values: Any) -> torch.Tensor:
    """A tensor of ``values`` (numpy arrays are copied, so read-only arrays are fine)."""
    return values if isinstance(values, torch.Tensor) else torch.from_numpy(np.array(values))


def _split_batch(batch: Any, keys: tuple[str, str] | None) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, Mapping):
        if keys is None:
            raise ValueError(f"data: your loader yields dicts with keys {sorted(batch)}; pass "
                             "batch_keys=(input key, label key) to ClientKit, e.g. ('img', 'label')")
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


def tensors_of(data: Any, what: str, keys: tuple[str, str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` from a pair of arrays/tensors or from a loader of batches; checked and concatenated.

    Inputs must be floating point; labels one value per example, integers (classification)
    or floats (regression). The errors say what was expected and what the data holds.
    """
    if isinstance(data, tuple | list) and len(data) == 2 and not isinstance(data[0], list | tuple | Mapping):
        xs, ys = [_tensor(data[0])], [_tensor(data[1])]
    else:
        xs, ys = [], []
        for batch in _ordered(data):
            x, y = _split_batch(batch, keys)
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


# --------------------------------------------------------------------------- the kit
@dataclass
class ClientKit:
    """The user's pieces, served to every flowerdro strategy.

    Parameters
    ----------
    model_fn : callable
        ``model_fn() -> torch.nn.Module``, a fresh model (e.g. the project's ``Net``).
    data_fn : callable
        ``data_fn(partition_id, num_partitions) -> (train, test)`` or ``(train, validation,
        test)``; each part is a loader of ``(x, y)`` batches or dict batches (see
        ``batch_keys``) or a pair ``(x, y)`` of tensors/arrays. Called once per partition
        and process. The validation part answers evaluate messages with ``eval-split =
        "validation"`` (see the module docstring for ``validation-fraction``).
    loss_fn : callable
        The minibatch loss ``loss_fn(model(x), y)`` → scalar mean loss (e.g.
        ``torch.nn.CrossEntropyLoss()``); the algorithm-defined loops minimise it.
    train_fn : callable, optional
        ``train_fn(model, train_loader, args: TrainArgs) -> float | None``: the project's
        own training for the algorithms that allow any local loop (:data:`USER_LOOP_ROUTES`);
        unset, flowerdro's SGD runs there too.
    test_fn : callable, optional
        ``test_fn(model, test_loader, device) -> (loss, accuracy)`` (accuracy a float or a
        dict holding ``test_accuracy_key``); unset, flowerdro evaluates ``loss_fn`` and
        the argmax accuracy on the test tensors.
    accuracy_metric, loss_metric : str
        The names of the evaluate reply's metrics (the server's ``accuracy-metric`` /
        ``loss-metric`` must be the same; the defaults are the server's).
    test_accuracy_key : str
        The entry of ``test_fn``'s metrics dict that is the accuracy.
    batch_keys : (str, str), optional
        Input and label keys of dict batches (e.g. ``("img", "label")``).
    task : {"classification", "regression"}
        Regression reports the loss only.
    device : str or torch.device, optional
        Where things run, as run-config ``device`` says it (``"auto"``, ``"cpu"``, ``"cuda"``,
        ``"cuda:N"`` or a ``torch.device``); unset, the run config's ``device`` (default
        ``auto``). ``auto``: flowerdro's own loops on CUDA when available, ``train_fn`` and
        ``test_fn`` given the model on the device and in the dtype of the inputs the
        loader yields; any other value: everything on that device. Refused where the
        device is absent, or where it differs from the run config's ``device``.
    """

    model_fn: Callable[[], nn.Module]
    data_fn: Callable[[int, int], tuple[Any, Any]]
    loss_fn: LossFn | None = None
    train_fn: Callable[[nn.Module, Any, TrainArgs], Any] | None = None
    test_fn: Callable[[nn.Module, Any, torch.device], tuple[float, Any]] | None = None
    accuracy_metric: str = "test_acc"
    loss_metric: str = "test_loss"
    test_accuracy_key: str = "accuracy"
    batch_keys: tuple[str, str] | None = None
    task: str = "classification"
    device: str | torch.device | None = None
    _runtimes: dict[tuple[Any, ...], _UserRuntime] = field(default_factory=dict, repr=False)
    _token: str = field(default_factory=lambda: uuid.uuid4().hex, repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the pieces and an identity token, not the runtimes (see :func:`_restore_kit`)."""
        pieces = {k: v for k, v in self.__dict__.items() if k not in ("_runtimes", "_token")}
        return _restore_kit, (self._token, pieces)

    def __post_init__(self) -> None:
        if not callable(self.model_fn):
            raise TypeError("model_fn: expected a callable returning a torch.nn.Module (e.g. your Net class)")
        if not callable(self.data_fn):
            raise TypeError("data_fn: expected a callable (partition_id, num_partitions) -> (train, test)")
        if self.loss_fn is None or not callable(self.loss_fn):
            raise ValueError("loss_fn: missing; flowerdro's algorithm-defined loops (DRFA, SCAFFOLD, SCAFF-PD, "
                             "FedRobust, DR-DSGD, FGM/PGD) minimise loss_fn(model(x), y): pass e.g. "
                             "torch.nn.CrossEntropyLoss()")
        if self.task not in ("classification", "regression"):
            raise ValueError(f"task: unknown task {self.task!r}; allowed: classification, regression")
        for name in ("accuracy_metric", "loss_metric"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}: expected a non-empty metric name, got {getattr(self, name)!r}")
        if self.device is not None:
            check_device(str(self.device) if isinstance(self.device, torch.device) else self.device)

    # ------------------------------------------------------------------ runtime
    def runtime(self, context: Context) -> _UserRuntime:
        """The node's runtime: the user's data as tensors (read once per partition and device) and model factory."""
        cfg = context.node_config
        if "partition-id" in cfg:
            pid, n = int(cfg["partition-id"]), int(cfg.get("num-partitions", 0))
        else:
            pid, n = int(context.node_id), 0
        setting = self._device_setting(context.run_config.get("device"))
        s = Settings(context.run_config)
        fraction = s.float("validation-fraction", 0.0, minimum=0.0)
        if fraction >= 1:
            raise ValueError(f"validation-fraction: must be < 1, got {fraction}")
        split_seed = s.int("data-seed", s.int("seed", 0))
        key: tuple[Any, ...] = (pid, n, setting) if fraction == 0 else (pid, n, setting, fraction, split_seed)
        if key not in self._runtimes:
            self._runtimes[key] = self._build(pid, n, setting, fraction, split_seed)
        return self._runtimes[key]

    def _device_setting(self, run_config_value: Any) -> str:
        """The ``device`` that applies: the kit's own when given, else the run config's (``auto`` unset).

        A kit built with one device under a run config that names another is refused: the
        user asked for two things and only one can hold.
        """
        asked = "auto" if run_config_value in (None, "") else check_device(run_config_value)
        if self.device is None:
            return asked
        own = check_device(str(self.device) if isinstance(self.device, torch.device) else self.device)
        if asked not in ("auto", own):
            raise ValueError(f"device: the ClientKit was built with device={own!r} but the run config sets "
                             f"device = {asked!r}; set one of them")
        return own

    def _build(self, pid: int, n: int, device_setting: str = "auto", fraction: float = 0.0,
               split_seed: int = 0) -> _UserRuntime:
        loaded = self.data_fn(pid, n)
        if not isinstance(loaded, tuple | list) or len(loaded) not in (2, 3):
            raise ValueError(f"data_fn: expected (train, test) or (train, validation, test), got "
                             f"{type(loaded).__name__}" + (f" of length {len(loaded)}"
                                                           if isinstance(loaded, tuple | list) else ""))
        train, validation, test = (loaded[0], None, loaded[1]) if len(loaded) == 2 else tuple(loaded)
        if validation is not None and fraction > 0:
            raise ValueError(f"validation-fraction: your data_fn returns its own validation data (train, validation, "
                             f"test); set validation-fraction = 0 (got {fraction}) or return (train, test)")
        if validation is None and fraction > 0 and (self.train_fn is not None or self.test_fn is not None):
            which = "train_fn trains on your train loader" if self.train_fn is not None else \
                "test_fn evaluates your own loaders"
            raise ValueError(f"validation-fraction: your {which}, which cannot see the rows held out of the "
                             "training tensors; return (train, validation, test) from data_fn instead and set "
                             "validation-fraction = 0")
        x_tr, y_tr = tensors_of(train, "train data", self.batch_keys)
        x_te, y_te = tensors_of(test, "test data", self.batch_keys)
        if x_te.shape[1:] != x_tr.shape[1:]:
            raise ValueError(f"test data: inputs of shape {tuple(x_te.shape[1:])} per example; the training "
                             f"inputs have {tuple(x_tr.shape[1:])}")
        x_va = y_va = None
        if validation is not None:
            x_va, y_va = tensors_of(validation, "validation data", self.batch_keys)
        elif fraction > 0:
            x_tr, y_tr, x_va, y_va = self._hold_out(x_tr, y_tr, fraction, split_seed, pid)
        if x_va is not None and x_va.shape[1:] != x_tr.shape[1:]:
            raise ValueError(f"validation data: inputs of shape {tuple(x_va.shape[1:])} per example; the training "
                             f"inputs have {tuple(x_tr.shape[1:])}")
        device = resolve_device(device_setting)
        # the user's functions: on the device and dtype of the inputs their loader yields, unless told otherwise
        user = Placement(x_tr.device if device_setting == "auto" else device, x_tr.dtype)
        loops = _loop_placement(device, x_tr.dtype)
        dtype = loops.dtype
        label = (lambda y: y.to(loops.device, torch.int64)) if self.task == "classification" else \
            (lambda y: y.to(loops.device, dtype))
        if self.task == "classification" and torch.is_floating_point(y_tr):
            raise ValueError(f"train data: labels have dtype {y_tr.dtype}; a classification task expects integer "
                             "class labels (task='regression' for float targets)")
        data = LocalData(x_tr.to(loops.device, dtype), label(y_tr), x_te.to(loops.device, dtype), label(y_te),
                         None if x_va is None else x_va.to(loops.device, dtype),
                         None if y_va is None else label(y_va))
        rt = _UserRuntime(self, pid, n, data, train, test, num_classes=0, user=user, device_setting=device_setting,
                          validation_loader=validation)
        rt.num_classes = self._check_model(rt)
        return rt

    def _hold_out(self, x: torch.Tensor, y: torch.Tensor, fraction: float, seed: int, pid: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_train, y_train, x_val, y_val): a stratified ``fraction`` of the rows held out, seeded by (seed, pid).

        The rows are split as flowerdro's own data sets split theirs
        (:func:`flowerdro.data.federated.validation_split`; random rows for regression).
        """
        from flowerdro.data.federated import validation_split

        labels = y.cpu().numpy() if self.task == "classification" else None
        train, val = validation_split(np.arange(int(y.shape[0])), labels, fraction, seed, pid)
        tr, va = torch.from_numpy(np.sort(train)), torch.from_numpy(np.sort(val))
        return x[tr], y[tr], x[va], y[va]

    def _check_model(self, rt: _UserRuntime) -> int:
        """Run the model on two examples: it must accept the inputs and fit the labels."""
        model = rt.new_model()
        x, y = rt.data.x_train[:2], rt.data.y_train[:2]
        try:
            with torch.no_grad():
                out = model(x)
        except Exception as exc:
            raise ValueError(f"data: your model could not run on inputs of shape {tuple(x.shape)} and dtype "
                             f"{x.dtype} from your data ({type(exc).__name__}: {exc})") from exc
        if self.task == "classification":
            if out.dim() != 2 or out.shape[0] != x.shape[0]:
                raise ValueError(f"model: a classification model must output (batch, classes), got "
                                 f"{tuple(out.shape)} for a batch of {x.shape[0]}")
            top = int(rt.data.y_train.max())
            if top >= out.shape[1] or int(rt.data.y_train.min()) < 0:
                raise ValueError(f"train data: labels in [{int(rt.data.y_train.min())}, {top}] but the model has "
                                 f"{out.shape[1]} outputs")
            try:
                float(self.loss_fn(out, y))  # type: ignore[misc]
            except Exception as exc:
                raise ValueError(f"loss_fn: failed on the model's output {tuple(out.shape)} and labels "
                                 f"{tuple(y.shape)} {y.dtype} ({type(exc).__name__}: {exc})") from exc
            return int(out.shape[1])
        return int(out.reshape(out.shape[0], -1).shape[1])

    # ------------------------------------------------------------------ serving
    def serve(self, message_type: str) -> Callable[[Message, Context], Message]:
        """The function that answers ``message_type`` with the user's pieces."""
        if message_type not in ROUTES:
            raise ValueError(f"message_type: unknown {message_type!r}; allowed: {', '.join(ROUTES)}")
        inner: Callable[[Message, Context], Message]
        if message_type == "evaluate":
            inner = self._evaluate
        elif message_type in USER_LOOP_ROUTES and self.train_fn is not None:
            inner = self._train_user_loop
        else:
            inner = ROUTES[message_type]
        return _KitHandler(self, inner)

    def client_app(self, mods: Sequence[Any] | None = None) -> ClientApp:
        """A new ClientApp serving every flowerdro message type (:data:`ROUTES`), with Flower ``mods``.

        Mods that act on a training reply's model (Flower's clipping mods, ``LocalDpMod``,
        ``secaggplus_mod``) wrap the training routes only (:mod:`flowerdro.clients.mods`).
        """
        return add_routes(ClientApp(), self, mods=mods)

    # ------------------------------------------------------------------ the user's loop
    def _train_user_loop(self, message: Message, context: Context) -> Message:
        """``train`` / ``train.sgd`` with the user's ``train_fn``: F_i(w) first, μ(w − w⁰) hooks for FedProx."""
        rt = self.runtime(context)
        s = handlers.settings_for(message, context)
        own = handlers.message_settings(message)
        received = handlers._received_arrays(message)
        model = rt.model_from(received)
        batch_size = s.int("batch-size", 32, minimum=1)
        seed, rnd = s.int("seed", 0), s.int("server-round", 0)
        if s.str("train-loss-on", "full", choices=("full", "batch")) == "full":
            before = evaluate_model(model, rt.data.x_train, rt.data.y_train, loss_fn=rt.loss_fn)[0]
        else:
            gen = make_generator(seed, rnd, rt.partition_id, handlers._SALT_TRAIN)
            idx = next(minibatches(rt.data.num_train, batch_size, gen, rt.data.x_train.device))
            before = batch_loss(model, rt.data.x_train, rt.data.y_train, idx, rt.loss_fn)
        attack, amount = handlers.attack_of(s, rt.partition_id)
        if attack == "loss-scale":
            raise ValueError(
                f"attack = \"loss-scale\" (partition {rt.partition_id} is in malicious-ids) multiplies the loss "
                "that flowerdro's own local loop minimises, and this client trains with its own train_fn, whose "
                "loss the kit cannot scale: use attack = \"update-scale\" (the update w - w0 times attack-scale), "
                "or give the kit a loss_fn and no train_fn")
        mu = own.float("proximal-mu", 0.0, minimum=0.0)
        model = rt.for_user(model)
        prox = _ProximalHooks(model, mu) if mu > 0 else None
        args = TrainArgs(lr=s.float("lr", 0.05, positive=True), epochs=_epochs(message, context),
                         steps=handlers._local_steps(s, rt.data.num_train, batch_size), batch_size=batch_size,
                         device=rt.user.device, server_round=rnd, seed=seed,
                         partition_id=rt.partition_id, config=s)
        try:
            out = rt.call_user("train_fn", self.train_fn, model, rt.train_loader, args)  # type: ignore[arg-type]
        finally:
            if prox is not None:
                prox.remove()
        if prox is not None:
            prox.check_kept(model)
        state = state_as_sent(model, received)
        if attack == "update-scale":
            state = handlers._scale_update(received, state, amount)
        elif attack == "bias":
            before += amount
        metrics: dict[str, Any] = {"num-examples": rt.data.num_train, "partition-id": rt.partition_id,
                                   "train_loss": float(before), "local-steps": args.steps, USER_TRAIN_FN: 1}
        own_loss = out.get("train_loss") if isinstance(out, Mapping) else out
        if isinstance(own_loss, int | float) and math.isfinite(float(own_loss)):
            metrics["train_loss_local"] = float(own_loss)
        return Message(content=RecordDict({"arrays": to_array_record(state), "metrics": MetricRecord(metrics)}),
                       reply_to=message)

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, message: Message, context: Context) -> Message:
        """Loss and accuracy on the user's test data (or validation data: ``eval-split``), under the server's
        metric names (the message's ``accuracy-metric`` / ``loss-metric``; the kit's own when it has none)."""
        rt = self.runtime(context)
        split = handlers.eval_split_of(message, context)
        own = handlers.message_settings(message)
        acc_name = own.str("accuracy-metric", self.accuracy_metric) or self.accuracy_metric
        loss_name = own.str("loss-metric", self.loss_metric) or self.loss_metric
        if self.test_fn is None:
            reply = handlers.evaluate_reply(message, context)
            m = dict(reply.content["metrics"])
            if rt.loss_fn is not None and self.task == "classification":  # a custom loss: argmax accuracy
                x, y = handlers.evaluation_split(rt, split)
                model = rt.model_from(handlers._received_arrays(message))
                with torch.no_grad():
                    pred = model(x).argmax(1) if y.shape[0] else None
                m["test_acc"] = float((pred == y).float().mean()) if pred is not None else 0.0
            values = {"num-examples": m["num-examples"], "partition-id": m["partition-id"],
                      loss_name: m["test_loss"]}
            if "test_acc" in m:
                values[acc_name] = m["test_acc"]
        else:
            _, y = handlers.evaluation_split(rt, split)
            loader = rt.validation_loader if split == "validation" else rt.test_loader
            model = rt.for_user(rt.model_from(handlers._received_arrays(message)))
            result = rt.call_user("test_fn", self.test_fn, model, loader, rt.user.device)
            if not isinstance(result, tuple | list) or len(result) != 2:
                raise ValueError(f"test_fn: expected (loss, accuracy or metrics dict), got {result!r}")
            loss, acc = result
            values = {"num-examples": int(y.shape[0]), "partition-id": rt.partition_id,
                      loss_name: float(loss)}
            if isinstance(acc, Mapping):
                if self.test_accuracy_key not in acc:
                    raise ValueError(f"test_accuracy_key: {self.test_accuracy_key!r} is not among test_fn's "
                                     f"metrics {sorted(acc)}")
                values.update({str(k): float(v) for k, v in acc.items()
                               if isinstance(v, int | float) and k != self.test_accuracy_key})
                acc = acc[self.test_accuracy_key]
            if self.task == "classification" and acc is not None:
                values[acc_name] = float(acc)
        return Message(content=RecordDict({"metrics": MetricRecord(values)}), reply_to=message)  # type: ignore[arg-type]


#: The kits unpickled in this process, by token (see :func:`_restore_kit`).
_RESTORED: dict[str, ClientKit] = {}


def _restore_kit(token: str, pieces: dict[str, Any]) -> ClientKit:
    """The kit ``token`` names: the one already unpickled in this process, else a new one.

    Flower's Ray simulation pickles the ClientApp with every message it hands an actor;
    without this, each message would meet a new kit with no runtimes and call the user's
    ``data_fn`` again.
    """
    kit = _RESTORED.get(token)
    if kit is None:
        kit = ClientKit.__new__(ClientKit)
        kit.__dict__.update(pieces, _runtimes={}, _token=token)
        _RESTORED[token] = kit
    return kit


@dataclass(frozen=True)
class _KitHandler:
    """``inner(message, context)`` with the kit's runtimes as the handlers' runtime provider.

    A module-level class (not a closure), so a pickled ClientApp holds a reference to it.
    """

    kit: ClientKit
    inner: Callable[[Message, Context], Message]

    def __call__(self, message: Message, context: Context) -> Message:
        token = handlers.RUNTIME_PROVIDER.set(self.kit.runtime)
        try:
            return self.inner(message, context)
        finally:
            handlers.RUNTIME_PROVIDER.reset(token)


def _epochs(message: Message, context: Context) -> float:
    """The first positive ``local-epochs`` of the message or the run config, else 1."""
    for layer in (message.content.config_records.get("config") or {}, context.run_config):
        value: Any = layer.get("local-epochs")
        if value not in (None, "") and float(value) > 0:
            return float(value)
    return 1.0


class _ProximalHooks:
    r"""FedProx's proximal term in the user's loop: ∇ ← ∇ + μ (w − w⁰) on every trainable parameter.

    w⁰ is each parameter's value when the hooks are registered (the received model). The
    user's function may move the model to another device or dtype (``model.to(...)``
    keeps the parameter objects and so the hooks); each hook takes w⁰ onto the
    parameter's device and dtype at use, copying it once per move, so the gradient it
    returns has the parameter's device and dtype.
    """

    def __init__(self, model: nn.Module, mu: float) -> None:
        self.mu = float(mu)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.anchors = [p.detach().clone() for p in self.params]
        self.handles = [p.register_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _hook(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def add_proximal(grad: torch.Tensor) -> torch.Tensor:
            p = self.params[i]
            anchor = self.anchors[i]
            if anchor.device != p.device or anchor.dtype != p.dtype:
                anchor = self.anchors[i] = anchor.to(device=p.device, dtype=p.dtype)
            return grad + self.mu * (p.detach() - anchor)

        return add_proximal

    def remove(self) -> None:
        """Unregister every hook."""
        for h in self.handles:
            h.remove()

    def check_kept(self, model: nn.Module) -> None:
        """Refuse a model whose parameters the user's function replaced: the proximal term could not apply.

        ``model.to()`` onto a device whose tensors cannot share the old ones' storage type
        (``meta``, some accelerators), ``load_state_dict(..., assign=True)`` or a replaced
        layer make new parameter objects without the hooks; their training was plain
        local training, not FedProx's.
        """
        current = {id(p) for p in model.parameters()}  # frozen or not: freezing layers is the user's choice
        if any(id(p) not in current for p in self.params):
            raise RuntimeError("proximal-mu: train_fn replaced the model's parameters (e.g. model.to() onto a "
                               "device type whose tensors torch cannot swap in place, load_state_dict(..., "
                               "assign=True), or a new layer), so the proximal term μ(w − w⁰) was not added to "
                               "their gradients; keep the parameters the model was handed with")


def add_routes(app: ClientApp, kit: ClientKit, *, replace: bool = False,
               mods: Sequence[Any] | None = None) -> ClientApp:
    """Register ``kit``'s handler of every flowerdro message type on ``app``, with Flower ``mods``.

    Routes the app already serves are kept (its own ``train`` / ``evaluate``) unless
    ``replace`` is True; keep your ``train`` route only if its reply's ``train_loss`` is
    the loss of the *received* model (q-FedAvg and FedMGDA+ read it so) and your
    ``evaluate`` route's metric names match the server's ``accuracy-metric``/``loss-metric``.
    ``mods`` wrap the kit's routes as ``ClientApp(mods=...)`` would, except that mods acting on
    a training reply's model wrap the training routes only (:class:`~flowerdro.clients.mods.ModChain`);
    the ``query.init`` reply names them for the server's checks. Returns ``app``.

    Raises
    ------
    ValueError
        ``app`` itself was built with such a mod (``ClientApp(mods=[LocalDpMod(...)])``):
        Flower would wrap the evaluate and query routes in it too, where it fails.
    """
    own = list(getattr(app, "_mods", []) or [])
    if bad := [mod_name(m) for m in own if is_update_mod(m)]:
        raise ValueError(f"mods: your ClientApp was built with {bad}, which Flower applies to every message type, "
                         "but evaluate and query replies carry no model for them; build the ClientApp without them "
                         "and pass them to add_routes(app, kit, mods=[...]) (or kit.client_app(mods=[...])), which "
                         "applies them to the training routes only")
    chain = ModChain(list(mods or []), extra_names=[mod_name(m) for m in own])
    registered = getattr(app, "_registered_funcs", {})
    for mtype in ROUTES:
        category, _, action = mtype.partition(".")
        full = f"{category}.{action or 'default'}"
        if full in registered:
            if not replace:
                continue
            del registered[full]
        handler_: Any = kit.serve(mtype)
        if mtype == "query.init":
            handler_ = ReportMods(handler_, chain)
        elif mtype in ("train", "evaluate"):  # also a LegacyStrategy's FitIns / EvaluateIns
            handler_ = FromLegacy(handler_, kit.serve)
        getattr(app, category)(action or "default", mods=chain.for_type(mtype))(handler_)
    return app

