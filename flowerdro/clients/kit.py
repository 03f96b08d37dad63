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
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable, Mapping
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
from flowerdro.clients.routes import ROUTE_SPECS, handler
from flowerdro.clients.training import (
    LocalData,
    LossFn,
    batch_loss,
    default_device,
    evaluate_model,
    make_generator,
    minibatches,
)

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


class _UserRuntime(handlers.ClientRuntime):
    """flowerdro's client runtime with the user's model factory and loss."""

    kit: ClientKit
    train_loader: Any
    test_loader: Any
    validation_loader: Any

    def __init__(self, kit: ClientKit, partition_id: int, num_partitions: int, data: LocalData,
                 train_loader: Any, test_loader: Any, num_classes: int, validation_loader: Any = None) -> None:
        super().__init__(partition_id=partition_id, num_partitions=num_partitions, data=data,
                         input_shape=tuple(data.x_train.shape[1:]), num_classes=num_classes, model_name="user",
                         model_kwargs=(), task=kit.task)
        self.kit, self.train_loader, self.test_loader = kit, train_loader, test_loader
        self.validation_loader = validation_loader

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
    device : torch.device, optional
        Where data and model live (default: CUDA when available).
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
    device: torch.device | None = None
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

    # ------------------------------------------------------------------ runtime
    def runtime(self, context: Context) -> _UserRuntime:
        """The node's runtime: the user's data as tensors (read once per partition) and model factory."""
        cfg = context.node_config
        if "partition-id" in cfg:
            pid, n = int(cfg["partition-id"]), int(cfg.get("num-partitions", 0))
        else:
            pid, n = int(context.node_id), 0
        s = Settings(context.run_config)
        fraction = s.float("validation-fraction", 0.0, minimum=0.0)
        if fraction >= 1:
            raise ValueError(f"validation-fraction: must be < 1, got {fraction}")
        split_seed = s.int("data-seed", s.int("seed", 0))
        key: tuple[Any, ...] = (pid, n) if fraction == 0 else (pid, n, fraction, split_seed)
        if key not in self._runtimes:
            self._runtimes[key] = self._build(pid, n, fraction, split_seed)
        return self._runtimes[key]

    def _build(self, pid: int, n: int, fraction: float = 0.0, split_seed: int = 0) -> _UserRuntime:
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
        device = self.device or default_device()
        dtype = x_tr.dtype
        label = (lambda y: y.to(device, torch.int64)) if self.task == "classification" else \
            (lambda y: y.to(device, dtype))
        if self.task == "classification" and torch.is_floating_point(y_tr):
            raise ValueError(f"train data: labels have dtype {y_tr.dtype}; a classification task expects integer "
                             "class labels (task='regression' for float targets)")
        data = LocalData(x_tr.to(device, dtype), label(y_tr), x_te.to(device, dtype), label(y_te),
                         None if x_va is None else x_va.to(device, dtype), None if y_va is None else label(y_va))
        rt = _UserRuntime(self, pid, n, data, train, test, num_classes=0, validation_loader=validation)
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

    def client_app(self) -> ClientApp:
        """A new ClientApp serving every flowerdro message type (:data:`ROUTES`)."""
        return add_routes(ClientApp(), self)

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
        mu = own.float("proximal-mu", 0.0, minimum=0.0)
        hooks = _proximal_hooks(model, mu) if mu > 0 else []
        args = TrainArgs(lr=s.float("lr", 0.05, positive=True), epochs=_epochs(message, context),
                         steps=handlers._local_steps(s, rt.data.num_train, batch_size), batch_size=batch_size,
                         device=rt.data.x_train.device, server_round=rnd, seed=seed,
                         partition_id=rt.partition_id, config=s)
        try:
            out = self.train_fn(model, rt.train_loader, args)  # type: ignore[misc]
        finally:
            for h in hooks:
                h.remove()
        state = {k: v.detach() for k, v in model.state_dict().items()}
        attack, amount = handlers.attack_of(s, rt.partition_id)
        if attack == "scale":
            state = handlers._scale_update(received, state, amount)
        elif attack == "bias":
            before += amount
        metrics: dict[str, Any] = {"num-examples": rt.data.num_train, "partition-id": rt.partition_id,
                                   "train_loss": float(before), "local-steps": args.steps}
        own_loss = out.get("train_loss") if isinstance(out, Mapping) else out
        if isinstance(own_loss, int | float) and math.isfinite(float(own_loss)):
            metrics["train_loss_local"] = float(own_loss)
        return Message(content=RecordDict({"arrays": to_array_record(state), "metrics": MetricRecord(metrics)}),
                       reply_to=message)

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, message: Message, context: Context) -> Message:
        """Loss and accuracy on the user's test data (or validation data: ``eval-split``), under the kit's metric names."""
        rt = self.runtime(context)
        split = handlers.eval_split_of(message, context)
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
                      self.loss_metric: m["test_loss"]}
            if "test_acc" in m:
                values[self.accuracy_metric] = m["test_acc"]
        else:
            _, y = handlers.evaluation_split(rt, split)
            loader = rt.validation_loader if split == "validation" else rt.test_loader
            model = rt.model_from(handlers._received_arrays(message))
            result = self.test_fn(model, loader, rt.data.x_train.device)
            if not isinstance(result, tuple | list) or len(result) != 2:
                raise ValueError(f"test_fn: expected (loss, accuracy or metrics dict), got {result!r}")
            loss, acc = result
            values = {"num-examples": int(y.shape[0]), "partition-id": rt.partition_id,
                      self.loss_metric: float(loss)}
            if isinstance(acc, Mapping):
                if self.test_accuracy_key not in acc:
                    raise ValueError(f"test_accuracy_key: {self.test_accuracy_key!r} is not among test_fn's "
                                     f"metrics {sorted(acc)}")
                values.update({str(k): float(v) for k, v in acc.items()
                               if isinstance(v, int | float) and k != self.test_accuracy_key})
                acc = acc[self.test_accuracy_key]
            if self.task == "classification" and acc is not None:
                values[self.accuracy_metric] = float(acc)
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


def _proximal_hooks(model: nn.Module, mu: float) -> list[Any]:
    """Add μ (w − w⁰) to each parameter's gradient (w⁰: the parameters now): FedProx's proximal term."""
    hooks = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        anchor = p.detach().clone()
        hooks.append(p.register_hook(lambda g, p=p, a=anchor: g + mu * (p.detach() - a)))
    return hooks


def add_routes(app: ClientApp, kit: ClientKit, *, replace: bool = False) -> ClientApp:
    """Register ``kit``'s handler of every flowerdro message type on ``app``.

    Routes the app already serves are kept (its own ``train`` / ``evaluate``) unless
    ``replace`` is True; keep your ``train`` route only if its reply's ``train_loss`` is
    the loss of the *received* model (q-FedAvg and FedMGDA+ read it so) and your
    ``evaluate`` route's metric names match the server's ``accuracy-metric``/``loss-metric``.
    Returns ``app``.
    """
    registered = getattr(app, "_registered_funcs", {})
    for mtype in ROUTES:
        category, _, action = mtype.partition(".")
        full = f"{category}.{action or 'default'}"
        if full in registered:
            if not replace:
                continue
            del registered[full]
        getattr(app, category)(action or "default")(kit.serve(mtype))
    return app

