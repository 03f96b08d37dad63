r"""Client side of SCAFF-PD and of the SCAFFOLD baseline: handlers for any ClientApp.

SCAFF-PD — Y. Yu, S. P. Karimireddy, Y. Ma, M. I. Jordan, "Scaff-PD: Communication
Efficient Fair and Robust Federated Learning", 2023, https://arxiv.org/abs/2307.13381
(Algorithms 1 and 2). SCAFFOLD — S. P. Karimireddy, S. Kale, M. Mohri, S. J. Reddi,
S. U. Stich, A. T. Suresh, "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, https://arxiv.org/abs/1910.06378 (Algorithm 1, option II).

Three message types (``apps/client_app.py`` routes them here):

``query.loss_grad`` (SCAFF-PD phase 1)
    Content ``arrays`` (x^r) and ``config``: ``grad-on`` (``"full"``: all local training
    data, default; ``"batch"``: one seeded minibatch of ``batch-size``), ``batch-size``,
    ``seed``, ``server-round``; ``weight-decay`` μ_x (message or run config) adds
    (μ_x/2)‖x‖² to f_i. Reply: ``metrics`` {``loss`` = f_i(x^r), ``num-examples``,
    ``partition-id``} and ArrayRecord ``grad`` = c_i = ∇f_i(x^r) (same keys and shapes as
    the model; zeros for non-trainable buffers). The client keeps c_i in
    ``context.state["scaffpd.grad"]`` (and the round in ``"scaffpd.meta"``) for phase 2.

``train.scaffpd`` (SCAFF-PD phase 2)
    Content ``arrays`` (x^r), ``control`` (c^r = Σ_j λ_j^{r+1} c_j) and ``config``:
    ``lr`` η_l, ``local-steps`` J, ``batch-size``, ``seed``, ``server-round``. From u_0 = x^r,
    J steps of

    .. math:: u_{t+1} = u_t - \eta_l\,\big(g_i(u_t) - c_i + c^r\big),

    with g_i a minibatch gradient of f_i (full batch when ``batch-size`` ≥ m_i). Reply:
    ``arrays`` = u_J and ``metrics`` {``num-examples``, ``partition-id``, ``train_loss``
    (f_i(x^r), the received model's loss: ``train-loss-on``), ``train_loss_local``, ``local-steps``};
    the server forms
    Δu_i = (x^r − u_J)/(η_l J). Fails (an error reply) when the client holds no c_i of this
    ``server-round`` (its phase-1 reply never happened).

``train.scaffold`` (SCAFFOLD)
    Content ``arrays`` (x), ``control`` (the correction c − c_i: the server keeps c and
    every c_i) and ``config``: ``lr`` η_l, ``local-steps`` K, ``batch-size``, ``seed``,
    ``server-round``. K steps of y ← y − η_l (g_i(y) − c_i + c), then option II

    .. math:: c_i^+ = c_i - c + \frac{x - y_K}{K\,\eta_l}.

    The client keeps nothing between rounds. Reply: ``arrays`` = y_K, ``control`` = c_i^+
    (zeros for non-trainable buffers), ``metrics`` {``num-examples``, ``partition-id``,
    ``train_loss`` (f_i(x), the received model's loss), ``train_loss_local``, ``local-steps``}.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from flowerdro.buffers import array_view, to_array, to_array_record
from flowerdro.clients.config import Settings
from flowerdro.clients.handlers import ClientRuntime, get_runtime, message_settings, settings_for
from flowerdro.clients.training import (
    full_gradient,
    local_sgd,
    make_generator,
    minibatches,
)

#: ``context.state`` keys.
STATE_GRAD, STATE_META = "scaffpd.grad", "scaffpd.meta"
#: ``context.state`` key of SCAFFOLD's c_i when the client keeps it (``control-variates-on = "client"``).
STATE_SCAFFOLD_CONTROL = "scaffold.control"
#: Values of the ``grad-on`` config key.
GRAD_ON = ("full", "batch")
#: Salts of the random streams (kept apart from handlers' train/query salts 11, 23).
_SALT_GRAD, _SALT_SCAFFPD, _SALT_SCAFFOLD = 37, 41, 43


# --------------------------------------------------------------------------- helpers
def _array(message: Message, key: str) -> ArrayRecord:
    rec = message.content.array_records.get(key)
    if rec is None:
        raise ValueError(f"message: expected an ArrayRecord '{key}' ({message.metadata.message_type})")
    return rec


def _param_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _record_like(model: nn.Module, values: dict[str, torch.Tensor]) -> ArrayRecord:
    """An ArrayRecord with every key of the model's state dict: ``values`` where given, else zeros."""
    out = {}
    for k, v in model.state_dict().items():
        t = values.get(k)
        arr = (t if t is not None else torch.zeros_like(v)).detach().cpu().numpy()
        out[k] = to_array(arr)
    return ArrayRecord(out)


def _tensors(rec: ArrayRecord, model: nn.Module, what: str) -> dict[str, torch.Tensor]:
    """The record's arrays for the model's trainable parameters (on its device and dtype)."""
    params = dict(model.named_parameters())
    out = {}
    for name in _param_names(model):
        if name not in rec:
            raise ValueError(f"{what}: array '{name}' missing")
        t = torch.from_numpy(np.array(array_view(rec[name])))  # a copy: the view is read-only
        p = params[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{what}: array '{name}' has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        out[name] = t.to(device=p.device, dtype=p.dtype)
    return out


def _sq_norm(model: nn.Module) -> float:
    return float(sum(float((p.detach() ** 2).sum()) for p in model.parameters() if p.requires_grad))


def loss_and_gradient(
    rt: ClientRuntime, model: nn.Module, *, grad_on: str, batch_size: int, weight_decay: float,
    generator: torch.Generator,
) -> tuple[float, dict[str, torch.Tensor], int]:
    r"""f_i(x) and ∇f_i(x), with f_i(x) = (1/n) Σ_j ℓ(x; ξ_j) + (μ_x/2)‖x‖².

    Parameters
    ----------
    rt : ClientRuntime
        The client's data and loss (cross-entropy, or MSE for regression).
    model : torch.nn.Module
        Holds x.
    grad_on : {"full", "batch"}
        All local training data (deterministic) or one minibatch of ``batch_size``.
    batch_size : int
        Minibatch size for ``"batch"``.
    weight_decay : float
        μ_x ≥ 0.
    generator : torch.Generator
        Minibatch draw.

    Returns
    -------
    (float, dict, int)
        The loss, the gradient per trainable parameter name, and the examples used.
    """
    if grad_on not in GRAD_ON:
        raise ValueError(f"grad-on: unknown value {grad_on!r}; allowed: {', '.join(GRAD_ON)}")
    x, y = rt.data.x_train, rt.data.y_train
    if grad_on == "batch":
        idx = next(minibatches(rt.data.num_train, batch_size, generator, x.device))
        x, y = x[idx], y[idx]
    loss, grads = full_gradient(model, x, y, loss_fn=rt.loss_fn)
    names = _param_names(model)
    params = dict(model.named_parameters())
    out = {}
    for name, g in zip(names, grads, strict=True):
        out[name] = g + weight_decay * params[name].detach() if weight_decay else g
    if weight_decay:
        loss += 0.5 * weight_decay * _sq_norm(model)
    return float(loss), out, int(y.shape[0])


def _corrected_sgd(
    rt: ClientRuntime, model: nn.Module, s: Settings, correction: dict[str, torch.Tensor], salt: int,
) -> tuple[dict[str, torch.Tensor], float, int, float, int, float]:
    """J steps of u ← u − η (g_i(u) + correction) (+ weight decay).

    Returns the final state, the mean minibatch loss, the examples, η, J and the received
    model's loss (``train-loss-on``: all local data or the first minibatch).
    """
    steps = s.int("local-steps", 10, minimum=1)
    lr = s.float("lr", 0.05, positive=True)
    params = dict(model.named_parameters())

    def hook(m: nn.Module, t: int) -> None:
        for name, delta in correction.items():
            p = params[name]
            if p.grad is None:
                p.grad = delta.clone()
            else:
                p.grad.add_(delta)

    gen = make_generator(s.int("seed", 0), s.int("server-round", 0), rt.partition_id, salt)
    res = local_sgd(
        model, rt.data, steps=steps, lr=lr, batch_size=s.int("batch-size", 32, minimum=1), generator=gen,
        weight_decay=s.float("weight-decay", 0.0, minimum=0.0), grad_hook=hook,
        loss_before_on=s.str("train-loss-on", "full", choices=("full", "batch")), loss_fn=rt.loss_fn,
    )
    return res.state, res.mean_batch_loss, res.num_examples, lr, steps, res.loss_before


def _metrics(rt: ClientRuntime, n: int, **extra: float | int) -> MetricRecord:
    return MetricRecord({"num-examples": n, "partition-id": rt.partition_id, **extra})


# --------------------------------------------------------------------------- handlers
def loss_grad_reply(message: Message, context: Context) -> Message:
    """SCAFF-PD phase 1: L_i = f_i(x^r) and c_i = ∇f_i(x^r); keep c_i in ``context.state``."""
    rt = get_runtime(context)
    s = settings_for(message, context)
    model = rt.model_from(_array(message, "arrays"))
    rnd = s.int("server-round", 0)
    gen = make_generator(s.int("seed", 0), rnd, rt.partition_id, _SALT_GRAD)
    loss, grad, n = loss_and_gradient(
        rt, model, grad_on=s.str("grad-on", "full", choices=GRAD_ON), batch_size=s.int("batch-size", 32, minimum=1),
        weight_decay=s.float("weight-decay", 0.0, minimum=0.0), generator=gen,
    )
    record = _record_like(model, grad)
    context.state[STATE_GRAD] = record
    context.state[STATE_META] = ConfigRecord({"server-round": rnd})
    content = RecordDict({"grad": record, "metrics": _metrics(rt, n, loss=loss)})
    return Message(content=content, reply_to=message)


def scaffpd_train_reply(message: Message, context: Context) -> Message:
    """SCAFF-PD phase 2: J steps of u ← u − η_l (g_i(u) − c_i + c^r) from x^r; reply u_J."""
    rt = get_runtime(context)
    s = settings_for(message, context)
    rnd = s.int("server-round", 0)
    if STATE_GRAD not in context.state.array_records or STATE_META not in context.state.config_records:
        raise ValueError("train.scaffpd: this client holds no c_i; send query.loss_grad first")
    stored = int(context.state.config_records[STATE_META]["server-round"])
    if stored != rnd:
        raise ValueError(f"train.scaffpd: the client's c_i is from round {stored}, not round {rnd}")
    model = rt.model_from(_array(message, "arrays"))
    c_global = _tensors(_array(message, "control"), model, "control")
    c_local = _tensors(context.state.array_records[STATE_GRAD], model, "stored c_i")
    correction = {k: c_global[k] - c_local[k] for k in c_global}
    state, mean_loss, n, _, steps, before = _corrected_sgd(rt, model, s, correction, _SALT_SCAFFPD)
    content = RecordDict({
        "arrays": to_array_record(state),
        "metrics": _metrics(rt, n, train_loss=float(before), train_loss_local=float(mean_loss),
                            **{"local-steps": steps}),
    })
    return Message(content=content, reply_to=message)


def scaffold_train_reply(message: Message, context: Context) -> Message:
    """SCAFFOLD: K local steps corrected by c − c_i; option II.

    With the server keeping c_i (the default) the message's ``control`` is c − c_i and
    the reply's ``control`` is c_i⁺. With ``control-on = "client"`` in the config the
    message's ``control`` is c, the client keeps c_i in ``context.state`` (zero at first),
    and replies Δc_i = c_i⁺ − c_i, so the server needs only the sum of the replies (what
    secure aggregation gives it).
    """
    rt = get_runtime(context)
    s = settings_for(message, context)
    model = rt.model_from(_array(message, "arrays"))
    on_client = message_settings(message).str("control-on", "server", choices=("server", "client")) == "client"
    received = _tensors(_array(message, "control"), model, "control")
    c_i: dict[str, torch.Tensor] = {}
    if on_client:
        stored = context.state.array_records.get(STATE_SCAFFOLD_CONTROL)
        c_i = _tensors(stored, model, "stored c_i") if stored is not None else \
            {k: torch.zeros_like(v) for k, v in received.items()}
        correction = {k: received[k] - c_i[k] for k in received}
    else:
        correction = received
    x = {k: v.detach().clone() for k, v in model.named_parameters()}
    state, mean_loss, n, lr, steps, before = _corrected_sgd(rt, model, s, correction, _SALT_SCAFFOLD)
    # c_i⁺ = c_i − c + (x − y_K)/(K η_l) = (x − y_K)/(K η_l) − (c − c_i)
    c_new = {k: (x[k] - state[k]) / (steps * lr) - correction[k] for k in correction}
    if on_client:
        context.state[STATE_SCAFFOLD_CONTROL] = _record_like(model, c_new)
        sent = {k: c_new[k] - c_i[k] for k in c_new}
    else:
        sent = c_new
    content = RecordDict({
        "arrays": to_array_record(state),
        "control": _record_like(model, sent),
        "metrics": _metrics(rt, n, train_loss=float(before), train_loss_local=float(mean_loss),
                            **{"local-steps": steps}),
    })
    return Message(content=content, reply_to=message)


__all__ = [
    "GRAD_ON",
    "STATE_GRAD",
    "STATE_META",
    "STATE_SCAFFOLD_CONTROL",
    "loss_and_gradient",
    "loss_grad_reply",
    "scaffold_train_reply",
    "scaffpd_train_reply",
]
