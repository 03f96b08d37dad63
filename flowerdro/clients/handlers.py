"""Message → local computation → reply, usable from any ClientApp.

Each ``handle_*`` function takes the received :class:`flwr.app.Message` and the node's
:class:`flwr.app.Context` and returns the reply Message. ``apps/client_app.py`` only routes
message types to them, so a foreign ClientApp can register the same functions, or call
the plain training functions of :mod:`flowerdro.clients.training` itself.

Replies always carry one MetricRecord ``metrics`` with ``num-examples`` and
``partition-id``; training replies carry one ArrayRecord ``arrays`` (plus extra records
only when the message asks for them), so Flower's built-in strategies see exactly what
they expect. See docs/protocol.md for every message type.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from flowerdro.buffers import array_view, to_array_record
from flowerdro.clients.config import Settings
from flowerdro.clients.training import (
    LOSS_BEFORE_ON,
    LocalData,
    LossFn,
    TrainResult,
    batch_loss,
    evaluate_model,
    local_sgd,
    loss_function,
    make_generator,
    minibatches,
    resolve_device,
    scaled_loss,
    steps_from_epochs,
)
from flowerdro.data import DataConfig
from flowerdro.data.node_cache import cached_client_data
from flowerdro.models import build_model
from flowerdro.protocol import ATTACKS, EVAL_SPLITS
from flowerdro.validation import check_node_config, roll_call_reply

#: Salts that keep the random streams of different phases apart.
_SALT_TRAIN, _SALT_QUERY = 11, 23


@dataclass
class ClientRuntime:
    """What a client keeps in memory between rounds: its data on the device and model spec."""

    partition_id: int
    num_partitions: int
    data: LocalData
    input_shape: tuple[int, ...]
    num_classes: int
    model_name: str
    model_kwargs: tuple[tuple[str, Any], ...]
    task: str = "classification"

    @property
    def loss_fn(self) -> LossFn | None:
        """The training loss: None (cross-entropy, the default of the training loops) or MSE."""
        return None if self.task == "classification" else loss_function(self.task)

    def new_model(self, seed: int | None = None) -> nn.Module:
        """A fresh model on the data's device and dtype (seeded weights when ``seed`` is given)."""
        model = build_model(
            self.model_name, self.input_shape, self.num_classes, seed=seed, **dict(self.model_kwargs)
        )
        return model.to(device=self.data.x_train.device, dtype=self.data.x_train.dtype)

    def model_from(self, arrays: ArrayRecord) -> nn.Module:
        """A model holding the received weights (error on mismatched keys or shapes).

        The module is built once per model spec, device and dtype in each thread and
        reused: every call overwrites all of its parameters and buffers with ``arrays``
        (``load_state_dict(strict=True)``) and clears the gradients, so the result equals a
        freshly built model loaded with the same weights. One call's model is valid until
        the next call in the same thread (a handler uses one model at a time).
        """
        x = self.data.x_train
        spec = (self.model_name, self.input_shape, self.num_classes, self.model_kwargs, str(x.device), x.dtype)
        models = _MODELS.__dict__.setdefault("by_spec", {})
        entry = models.get(spec)
        if entry is None:
            model = self.new_model()
            entry = models[spec] = (model, list(model.state_dict(keep_vars=True).items()))
        model, slots = entry
        if not _copy_into(slots, arrays):  # keys or shapes differ: load_state_dict names the mismatch
            model.load_state_dict(_torch_state(arrays, x.device), strict=True)
        model.zero_grad(set_to_none=True)
        return model


#: One reusable module per model spec and thread (see :meth:`ClientRuntime.model_from`).
_MODELS = threading.local()


def _copy_into(slots: list[tuple[str, torch.Tensor]], arrays: ArrayRecord) -> bool:
    """Copy ``arrays`` into the module's parameters and buffers ``slots`` (its ``state_dict(keep_vars=True)``).

    Does what ``load_state_dict`` does (``tensor.copy_(value)`` without autograd) when the
    keys, in order, and the shapes match exactly, without its walk over the modules;
    returns False, copying nothing, otherwise.
    """
    if list(arrays.keys()) != [k for k, _ in slots]:
        return False
    values = [array_view(arrays[k]) for k, _ in slots]
    if any(tuple(v.shape) != tuple(t.shape) for v, (_, t) in zip(values, slots, strict=True)):
        return False
    with torch.no_grad():
        for v, (_, t) in zip(values, slots, strict=True):
            t.copy_(torch.from_numpy(np.array(v)))
    return True


def _torch_state(arrays: ArrayRecord, device: torch.device) -> dict[str, torch.Tensor]:
    """The arrays of a record as torch tensors on ``device``, read from their buffers without parsing.

    The values are copied once (``np.array`` of the buffer view): ``load_state_dict`` copies
    them again into the module, so no tensor here outlives the call.
    """
    return {k: torch.from_numpy(np.array(array_view(arrays[k]))).to(device) for k in arrays.keys()}


def partition_of(context: Context) -> tuple[int, int]:
    """Partition id and count of this node from its node config (simulation or ``--node-config``)."""
    node = check_node_config(context.node_config)
    if node.partition_id is None or node.num_partitions is None:
        raise ValueError(
            "node-config: this ClientApp needs 'partition-id' and 'num-partitions' "
            "(simulation sets them; in a deployment start the SuperNode with "
            '--node-config "partition-id=0 num-partitions=2")'
        )
    return node.partition_id, node.num_partitions


#: Run-config ``precision`` values: the dtype of the client's data and model.
PRECISIONS = {"float32": torch.float32, "float64": torch.float64}


#: Client runtimes per run and data configuration (at most two kept: a new run's replace an old run's).
_RUNTIMES: OrderedDict[tuple[int, DataConfig], dict[tuple[Any, ...], ClientRuntime]] = OrderedDict()
#: The latest runtime of each (run, partition, count, data cache) with the run config it was built from.
_LATEST: dict[tuple[int, int, int, str], tuple[dict[str, Any], ClientRuntime]] = {}


def _runtime_cached(
    data_cfg: DataConfig, partition_id: int, model_name: str, model_kwargs: tuple[tuple[str, Any], ...], device: str,
    precision: str = "float32", data_cache: str = "", run_id: int = 0,
) -> ClientRuntime:
    key = (partition_id, model_name, model_kwargs, device, precision)
    slot = (int(run_id), data_cfg)
    runtimes = _RUNTIMES.get(slot)
    if runtimes is not None and key in runtimes:
        _RUNTIMES.move_to_end(slot)
        return runtimes[key]
    cd = cached_client_data(data_cfg, partition_id, data_cache)
    data = LocalData.from_numpy(cd.x_train, cd.y_train, cd.x_test, cd.y_test, torch.device(device),
                                dtype=PRECISIONS[precision], x_val=cd.x_val, y_val=cd.y_val)
    rt = ClientRuntime(
        partition_id=partition_id,
        num_partitions=data_cfg.num_partitions,
        data=data,
        input_shape=tuple(cd.input_shape),
        num_classes=int(cd.num_classes),
        model_name=model_name,
        model_kwargs=model_kwargs,
        task="regression" if data_cfg.is_regression else "classification",
    )
    _RUNTIMES.setdefault(slot, {})[key] = rt
    _RUNTIMES.move_to_end(slot)
    while len(_RUNTIMES) > 2:
        _RUNTIMES.popitem(last=False)
        _LATEST.clear()
    return rt


#: While a :class:`flowerdro.clients.kit.ClientKit` serves a message, the runtime built from
#: the user's model, data and loss (every handler then trains the user's model).
RUNTIME_PROVIDER: ContextVar[Callable[[Context], ClientRuntime] | None] = ContextVar(
    "flowerdro_runtime_provider", default=None)


def get_runtime(context: Context) -> ClientRuntime:
    """The node's data and model spec, loaded once per process and reused every round.

    Inside a :class:`flowerdro.clients.kit.ClientKit` route the runtime is the user's (their
    model factory, data and loss); otherwise flowerdro's own model and data set.

    Run-config ``device`` says where the data and the model live (``auto``, the default:
    CUDA when available; ``cpu``; ``cuda`` or ``cuda:N``, refused where absent: see
    :func:`~flowerdro.clients.training.resolve_device`). Run-config ``precision``
    (``"float32"``, default, or ``"float64"``) sets the dtype of the data and the model
    (float64 for high-accuracy optimisation tests such as SCAFF-PD's robust regression). A
    regression data set (``robust-regression``) trains with the MSE loss and its evaluation
    reports ``test_loss`` only. A node whose run config equals the one of its previous
    message gets its runtime back without reading the settings again. Runtimes are kept
    per Flower run (``context.run_id``): a second run in the same process builds its own
    from the data cache (:func:`flowerdro.data.get_client_data` keeps the read-only arrays
    of a data configuration, which hold nothing of a run).
    Node config ``data-cache`` (a folder; else the environment variable
    ``FLOWERDRO_DATA_CACHE``) keeps the prepared partition on the node, so a fresh process
    reads one file instead of the whole data set (see :mod:`flowerdro.data.node_cache`).
    """
    provider = RUNTIME_PROVIDER.get()
    if provider is not None:
        return provider(context)
    pid, n = partition_of(context)
    cache = str(context.node_config.get("data-cache", ""))
    run = int(context.run_id)
    latest = _LATEST.get((run, pid, n, cache))
    if latest is not None and latest[0] == context.run_config:
        return latest[1]
    s = Settings(context.run_config)
    data_cfg = DataConfig.from_run_config(context.run_config, num_partitions=n)
    kwargs: tuple[tuple[str, Any], ...] = (("hidden", str(s.raw("hidden", "128,64"))),)
    precision = s.str("precision", "float32", choices=tuple(PRECISIONS))
    _set_threads(s.int("threads", 1, minimum=0))
    device = resolve_device(s.raw("device", "auto"))
    rt = _runtime_cached(data_cfg, pid, s.str("model", "logreg"), kwargs, str(device), precision, cache, run)
    _LATEST[(run, pid, n, cache)] = (dict(context.run_config), rt)
    return rt


def _set_threads(threads: int) -> None:
    """Use ``threads`` torch threads (0: leave torch's default of one per core).

    A reduction split over more threads sums in another order, so a full-data loss or
    gradient can differ in its last bit with the core count; one thread per client makes
    a seed's results the same on every machine.
    """
    import torch

    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def settings_for(message: Message, context: Context) -> Settings:
    """Message config (``config`` ConfigRecord) over the run config."""
    cfg = _config_of(message)
    return Settings(dict(cfg) if cfg is not None else {}, context.run_config)


def _config_of(message: Message) -> ConfigRecord | None:
    """The message's ConfigRecord ``config`` (read directly: ``config_records`` builds a view per access)."""
    cfg = message.content.get("config")
    return cfg if isinstance(cfg, ConfigRecord) else None


def message_settings(message: Message) -> Settings:
    """Only the message's own config, for the keys only a strategy may set (``proximal-mu``, ``snapshot-step``).

    They say which algorithm runs, so a run-config default would leak into other strategies.
    """
    cfg = _config_of(message)
    return Settings(dict(cfg) if cfg is not None else {})


def _received_arrays(message: Message) -> ArrayRecord:
    rec = message.content.get("arrays")
    if not isinstance(rec, ArrayRecord):
        if len(message.content.array_records) == 1:
            return next(iter(message.content.array_records.values()))
        raise ValueError("message: expected an ArrayRecord under 'arrays' with the model weights")
    return rec


def _local_steps(s: Settings, num_train: int, batch_size: int) -> int:
    """τ from the first layer that sets ``local-steps`` or ``local-epochs`` (epochs when > 0).

    A message that sets ``local-steps`` (an algorithm's τ) is never overridden by a
    ``local-epochs`` of the node's run config.
    """
    layer = s.first_layer("local-steps", "local-epochs")
    if layer.has("local-epochs") and float(layer.raw("local-epochs")) > 0:
        return steps_from_epochs(layer.float("local-epochs", 1.0, positive=True), num_train, batch_size)
    return layer.int("local-steps", 10, minimum=1)


# --------------------------------------------------------------------------- attacks
def attack_of(s: Settings, partition_id: int) -> tuple[str, float]:
    """The attack this client runs (``"none"`` unless its id is in ``malicious-ids``).

    ``attack = "bias"`` adds b = ``attack-bias`` to every loss it reports.
    ``attack = "loss-scale"`` (FedMGDA+ §6.2.2) replaces its loss f_i by s·f_i, s =
    ``attack-scale``: it trains on s·f_i (every local gradient is s times the honest one at
    the same point) and reports s·f_i. ``attack = "update-scale"`` trains honestly and sends
    w + s·(w_i − w) instead of w_i. For one full-batch SGD step the two scalings give the same
    model; with several steps they differ (the loss-scaled steps move further and see
    gradients at other points).
    """
    if partition_id not in s.int_list("malicious-ids"):
        return "none", 0.0
    kind = s.str("attack", "none", choices=ATTACKS)
    if kind == "bias":
        return kind, s.float("attack-bias", 0.0)
    if kind in ("loss-scale", "update-scale"):
        return kind, s.float("attack-scale", 1.0)
    return "none", 0.0


def _scale_update(received: ArrayRecord, local: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    base = received.to_torch_state_dict()
    out = {}
    for k, v in local.items():
        if torch.is_floating_point(v):
            b = base[k].to(v.device, v.dtype)
            out[k] = b + factor * (v - b)
        else:
            out[k] = v
    return out


# --------------------------------------------------------------------------- handlers
def received_model_loss(rt: ClientRuntime, model: nn.Module, s: Settings, salt: int) -> float:
    """F_i(w): the loss of the received model on the local training data, a training reply's ``train_loss``.

    ``train-loss-on`` (message over run config) says where: ``"full"`` (default) all local
    training data; ``"batch"`` the first minibatch the local loop of stream ``salt`` draws
    (drawn from a generator of its own, so the loop's stream is untouched). No gradient;
    the model's train/eval mode is left as it was.
    """
    was_training = model.training
    try:
        if s.str("train-loss-on", "full", choices=LOSS_BEFORE_ON[:2]) == "full":
            return evaluate_model(model, rt.data.x_train, rt.data.y_train, loss_fn=rt.loss_fn)[0]
        gen = make_generator(s.int("seed", 0), s.int("server-round", 0), rt.partition_id, salt)
        idx = next(minibatches(rt.data.num_train, s.int("batch-size", 32, minimum=1), gen, rt.data.x_train.device))
        return batch_loss(model, rt.data.x_train, rt.data.y_train, idx, rt.loss_fn)
    finally:
        model.train(was_training)


def train_metrics(
    rt: ClientRuntime, res: TrainResult, *, train_loss: float | None = None, **extra: float | int
) -> MetricRecord:
    """The metrics of a local-training reply.

    ``num-examples``, ``partition-id``, ``train_loss`` (the received model's loss, when
    given), ``train_loss_local`` (mean minibatch loss during the steps), ``local-steps``,
    then ``extra``.
    """
    before = {} if train_loss is None else {"train_loss": float(train_loss)}
    return MetricRecord({"num-examples": res.num_examples, "partition-id": rt.partition_id, **before,
                         "train_loss_local": float(res.mean_batch_loss), "local-steps": res.steps, **extra})


def train_reply(
    message: Message, context: Context, *, with_snapshot: bool = False
) -> Message:
    """Local SGD from the received model; reply with the final model and metrics.

    Config keys (message over run config): ``lr`` η, ``local-steps`` τ (or ``local-epochs``),
    ``batch-size``, ``proximal-mu`` μ (FedProx), ``snapshot-step`` t′ (DRFA), ``seed``,
    ``server-round``, ``train-loss-on`` (``full``, the default, or ``batch``). Metrics:
    ``num-examples``, ``partition-id``, ``train_loss`` (loss of the *received* model on all
    local training data, as q-FedAvg and FedMGDA+'s improvement tracking need; with
    ``train-loss-on = "batch"`` on the first minibatch only, which saves one forward pass over
    the local data per round), ``train_loss_local`` (mean minibatch loss during the steps),
    ``local-steps``. A malicious client (``malicious-ids``) runs its ``attack``
    (:func:`attack_of`).
    """
    rt = get_runtime(context)
    s = settings_for(message, context)
    batch_size = s.int("batch-size", 32, minimum=1)
    steps = _local_steps(s, rt.data.num_train, batch_size)
    own = message_settings(message)
    snapshot_step = own.int("snapshot-step", 0, minimum=0) if with_snapshot else 0
    received = _received_arrays(message)
    model = rt.model_from(received)
    gen = make_generator(s.int("seed", 0), s.int("server-round", 0), rt.partition_id, _SALT_TRAIN)
    attack, amount = attack_of(s, rt.partition_id)
    loss_fn = scaled_loss(rt.loss_fn, amount) if attack == "loss-scale" else rt.loss_fn
    res = local_sgd(
        model,
        rt.data,
        steps=steps,
        lr=s.float("lr", 0.05, positive=True),
        batch_size=batch_size,
        generator=gen,
        proximal_mu=own.float("proximal-mu", 0.0, minimum=0.0),
        snapshot_step=snapshot_step or None,
        weight_decay=s.float("weight-decay", 0.0, minimum=0.0),
        loss_before_on=s.str("train-loss-on", "full", choices=LOSS_BEFORE_ON[:2]),
        loss_fn=loss_fn,
    )
    state = res.state
    loss_before = res.loss_before
    if attack == "update-scale":
        state = _scale_update(received, state, amount)
    elif attack == "bias":
        loss_before += amount
    content = RecordDict({"arrays": to_array_record(state), "metrics": train_metrics(rt, res, train_loss=loss_before)})
    if with_snapshot and res.snapshot is not None:
        snap = res.snapshot if attack != "update-scale" else _scale_update(received, res.snapshot, amount)
        content["snapshot"] = to_array_record(snap)
    return Message(content=content, reply_to=message)


def eval_split_of(message: Message, context: Context) -> str:
    """The split an evaluate message asks for: ``eval-split`` of its config, else of the run config, else ``test``."""
    return settings_for(message, context).str("eval-split", "test", choices=EVAL_SPLITS)


def evaluation_split(rt: ClientRuntime, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and labels an evaluation on ``split`` reads: the one place that hands them out.

    ``"test"``: the client's test set. ``"validation"``: the rows held out of its training
    data (``validation-fraction`` > 0, or a ClientKit's own validation data); a client
    without them refuses, naming the keys, rather than answer on another split.
    """
    if split == "test":
        return rt.data.x_test, rt.data.y_test
    if split != "validation":
        raise ValueError(f"eval-split: unknown split {split!r}; allowed: {', '.join(EVAL_SPLITS)}")
    if rt.data.x_val is None or rt.data.y_val is None:
        raise ValueError("eval-split: 'validation' asks for a validation set, and this client has none; set "
                         "validation-fraction > 0 in the run config (a ClientKit: or return (train, validation, "
                         "test) from data_fn)")
    return rt.data.x_val, rt.data.y_val


def evaluate_reply(message: Message, context: Context, *, named: bool = False) -> Message:
    """Loss and accuracy of the received model on this client's own test set (or validation set).

    Config (message over run config): ``eval-split``, ``"test"`` (default) or
    ``"validation"`` (:func:`evaluation_split`). Metrics: ``num-examples`` (examples of that
    split), ``partition-id``, ``test_loss``, ``test_acc`` (under these names whichever the
    split; ``test_acc`` only for classification, a regression task reports ``test_loss``,
    the MSE). With ``named`` (flowerdro's ClientApp), the loss and accuracy carry the names
    the message's config asks for (``loss-metric``, ``accuracy-metric``: the server's).
    """
    rt = get_runtime(context)
    x, y = evaluation_split(rt, eval_split_of(message, context))
    model = rt.model_from(_received_arrays(message))
    loss, acc = evaluate_model(model, x, y, loss_fn=rt.loss_fn)
    values: dict[str, Any] = {
        "num-examples": int(y.shape[0]),
        "partition-id": rt.partition_id,
        "test_loss": float(loss),
    }
    if rt.task == "classification":
        values["test_acc"] = float(acc)
    if named:
        own = message_settings(message)
        names = {"test_loss": own.str("loss-metric", "test_loss"), "test_acc": own.str("accuracy-metric", "test_acc")}
        values = {names.get(k, k) or k: v for k, v in values.items()}
    metrics = MetricRecord(values)
    return Message(content=RecordDict({"metrics": metrics}), reply_to=message)


def loss_reply(message: Message, context: Context) -> Message:
    """Loss of the received model on one local minibatch or on all local training data.

    Config: ``loss-on`` ("batch" or "full"), ``batch-size``, ``seed``, ``server-round``.
    Metrics: ``loss``, ``num-examples``, ``partition-id``. A ``bias`` attacker adds its bias,
    a ``loss-scale`` attacker multiplies the loss by its factor.
    """
    rt = get_runtime(context)
    s = settings_for(message, context)
    model = rt.model_from(_received_arrays(message))
    mode = s.str("loss-on", "batch", choices=("batch", "full"))
    if mode == "full":
        loss, _ = evaluate_model(model, rt.data.x_train, rt.data.y_train, loss_fn=rt.loss_fn)
        n = rt.data.num_train
    else:
        gen = make_generator(s.int("seed", 0), s.int("server-round", 0), rt.partition_id, _SALT_QUERY)
        idx = next(minibatches(rt.data.num_train, s.int("batch-size", 32, minimum=1), gen, rt.data.x_train.device))
        loss, n = batch_loss(model, rt.data.x_train, rt.data.y_train, idx, rt.loss_fn), int(idx.shape[0])
    attack, amount = attack_of(s, rt.partition_id)
    if attack == "bias":
        loss += amount
    elif attack == "loss-scale":
        loss *= amount
    metrics = MetricRecord({"loss": float(loss), "num-examples": n, "partition-id": rt.partition_id})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=message)


def init_reply(message: Message, context: Context) -> Message:
    """A freshly initialised model (weights seeded by ``model-seed``, else ``seed``).

    Lets the server get initial weights without loading any data itself (deployments).
    With ``weights = false`` in the message's config the reply holds only the metrics
    (partition id, number of partitions, examples and classes): the server's roll call. A
    node whose ``partition-id`` or ``num-partitions`` is not an integer, or whose
    ``partition-id`` lies outside ``0..num-partitions − 1``, answers the roll call with the
    raw values and nothing else (:func:`flowerdro.validation.roll_call_reply`), so the
    server refuses it naming the key and the value.
    """
    s = settings_for(message, context)
    if not s.bool("weights", True) and (early := roll_call_reply(message, context)) is not None:
        return early
    rt = get_runtime(context)
    metrics = MetricRecord({"num-examples": rt.data.num_train, "partition-id": rt.partition_id,
                            "num-partitions": rt.num_partitions, "num-classes": rt.num_classes})
    content = RecordDict({"metrics": metrics})
    if s.bool("weights", True):
        content["arrays"] = to_array_record(rt.new_model(seed=s.int("model-seed", s.int("seed", 0))).state_dict())
    return Message(content=content, reply_to=message)
