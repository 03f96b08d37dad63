r"""The two routes where a :class:`~flowerdro.clients.kit.ClientKit` runs the user's own functions.

:func:`train_user_loop` answers ``train`` / ``train.sgd`` (FedAvg, FedProx, q-FedAvg, the
FedMGDA+ family) with the user's ``train_fn``: it first measures the received model's loss
F_i(w) on the local training data (``train_loss``, what q-FedAvg and FedMGDA+ read), then
hands the model, the user's training loader and a :class:`TrainArgs` to ``train_fn``
(under FedProx with the proximal gradient μ (w − w⁰) added to every parameter's gradient
by :class:`ProximalHooks`), and reports the function's own return value as
``train_loss_local``. :func:`evaluate_user` answers ``evaluate`` with the user's
``test_fn`` (or the kit's loss and argmax accuracy) under the server's metric names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from torch import nn

from flowerdro.buffers import to_array_record
from flowerdro.clients import handlers
from flowerdro.clients.config import Settings
from flowerdro.protocol import USER_TRAIN_FN

__all__ = ["ProximalHooks", "TrainArgs", "epochs_of", "evaluate_user", "train_user_loop"]


@dataclass(frozen=True)
class TrainArgs:
    """What the user's ``train_fn(model, train_loader, args)`` is told about this round.

    ``lr`` is the message's ``lr`` (a ``train_config`` passed to ``strategy.start`` sets it),
    else the run config's, else 0.05. ``epochs`` is the first positive ``local-epochs`` of
    the message or the run config (1 when neither sets one), an ``int`` when it is a whole
    number (``for _ in range(args.epochs)`` works), else a float. ``steps`` is the local
    steps τ flowerdro's own loop would take; ``device`` the device the model is handed over
    on (see :class:`~flowerdro.clients.kit.ClientKit`'s ``device``); ``config`` every
    setting (message config over run config).
    """

    lr: float
    epochs: int | float
    steps: int
    batch_size: int
    device: torch.device
    server_round: int
    seed: int
    partition_id: int
    config: Settings


def epochs_of(message: Message, context: Context) -> int | float:
    """The first positive ``local-epochs`` of the message or the run config, else 1; an int when whole."""
    for layer in (message.content.config_records.get("config") or {}, context.run_config):
        value: Any = layer.get("local-epochs")
        if value not in (None, "") and float(value) > 0:
            epochs = float(value)
            return int(epochs) if epochs.is_integer() else epochs
    return 1


def train_user_loop(kit: Any, message: Message, context: Context) -> Message:
    """``train`` / ``train.sgd`` with the kit's ``train_fn``: F_i(w) first, μ(w − w⁰) hooks for FedProx.

    Reply metrics: ``num-examples``, ``partition-id``, ``train_loss`` (F_i(w) of the
    received model), ``train_loss_local`` (the mean loss ``train_fn`` returned, when it
    returned a finite number or a dict holding ``train_loss``), ``local-steps`` and
    ``user-train-fn`` = 1 (the server then says in its log that the clients trained with
    their own function).
    """
    from flowerdro.clients.userruntime import state_as_sent

    rt = kit.runtime(context)
    s = handlers.settings_for(message, context)
    own = handlers.message_settings(message)
    received = handlers._received_arrays(message)
    model = rt.model_from(received)
    batch_size = s.int("batch-size", 32, minimum=1)
    before = handlers.received_model_loss(rt, model, s, handlers._SALT_TRAIN)
    attack, amount = handlers.attack_of(s, rt.partition_id)
    if attack == "loss-scale":
        raise ValueError(
            f"attack = \"loss-scale\" (partition {rt.partition_id} is in malicious-ids) multiplies the loss "
            "that flowerdro's own local loop minimises, and this client trains with its own train_fn, whose "
            "loss the kit cannot scale: use attack = \"update-scale\" (the update w - w0 times attack-scale), "
            "or give the kit a loss_fn and no train_fn")
    mu = own.float("proximal-mu", 0.0, minimum=0.0)
    model = rt.for_user(model)
    prox = ProximalHooks(model, mu) if mu > 0 else None
    args = TrainArgs(lr=s.float("lr", 0.05, positive=True), epochs=epochs_of(message, context),
                     steps=handlers._local_steps(s, rt.data.num_train, batch_size), batch_size=batch_size,
                     device=rt.user.device, server_round=s.int("server-round", 0), seed=s.int("seed", 0),
                     partition_id=rt.partition_id, config=s)
    try:
        out = rt.call_user("train_fn", kit.train_fn, model, rt.train_loader, args)
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


def accuracy_key(metrics: Mapping[str, Any], explicit: str | None, server_name: str, owner: str) -> str:
    """The entry of ``test_fn``'s metrics dict that is the accuracy.

    ``explicit`` (the kit's ``test_accuracy_key``) when set; else the server's
    ``accuracy-metric`` when the dict holds it, else ``accuracy``. So a metric name set
    once in the run config reaches the client too.
    """
    candidates = [explicit] if explicit else list(dict.fromkeys([server_name, "accuracy"]))
    for key in candidates:
        if key in metrics:
            return key
    raise ValueError(f"test_accuracy_key: none of {candidates} is among your test function's metrics "
                     f"{sorted(metrics)}; set accuracy-metric in the run config to the name your function "
                     f"returns, or pass test_accuracy_key=... to {owner}")


def evaluate_user(kit: Any, message: Message, context: Context) -> Message:
    """Loss and accuracy on the user's test data (or validation data: ``eval-split``), under the server's names.

    The names are the message's ``accuracy-metric`` / ``loss-metric`` (the kit's own when it
    has none). With a ``test_fn`` returning ``(loss, metrics dict)`` the dict's other
    numbers are reported under their own names, its accuracy (:func:`accuracy_key`) under
    the server's.
    """
    rt = kit.runtime(context)
    split = handlers.eval_split_of(message, context)
    own = handlers.message_settings(message)
    acc_name = own.str("accuracy-metric", kit.accuracy_metric) or kit.accuracy_metric
    loss_name = own.str("loss-metric", kit.loss_metric) or kit.loss_metric
    if kit.test_fn is None:
        reply = handlers.evaluate_reply(message, context)
        m = dict(reply.content["metrics"])
        if rt.loss_fn is not None and kit.task == "classification":  # a custom loss: argmax accuracy
            x, y = handlers.evaluation_split(rt, split)
            model = rt.model_from(handlers._received_arrays(message))
            with torch.no_grad():
                pred = model(x).argmax(1) if y.shape[0] else None
            m["test_acc"] = float((pred == y).float().mean()) if pred is not None else 0.0
        values = {"num-examples": m["num-examples"], "partition-id": m["partition-id"], loss_name: m["test_loss"]}
        if "test_acc" in m:
            values[acc_name] = m["test_acc"]
    else:
        _, y = handlers.evaluation_split(rt, split)
        loader = rt.validation_loader if split == "validation" else rt.test_loader
        model = rt.for_user(rt.model_from(handlers._received_arrays(message)))
        result = rt.call_user("test_fn", kit.test_fn, model, loader, rt.user.device)
        if not isinstance(result, tuple | list) or len(result) != 2:
            raise ValueError(f"test_fn: expected (loss, accuracy or metrics dict), got {result!r}")
        loss, acc = result
        values = {"num-examples": int(y.shape[0]), "partition-id": rt.partition_id, loss_name: float(loss)}
        if isinstance(acc, Mapping):
            key = accuracy_key(acc, kit.test_accuracy_key, acc_name, kit._owner)
            values.update({str(k): float(v) for k, v in acc.items() if isinstance(v, int | float) and k != key})
            acc = acc[key]
        if kit.task == "classification" and acc is not None:
            values[acc_name] = float(acc)
    return Message(content=RecordDict({"metrics": MetricRecord(values)}), reply_to=message)  # type: ignore[arg-type]


class ProximalHooks:
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
