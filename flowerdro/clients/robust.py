r"""Client side of FedRobust and of the FGM / PGD adversarial-training baselines.

Reisizadeh, Farnia, Pedarsani, Jadbabaie, "Robust Federated Learning: The Case of Affine
Distribution Shifts", NeurIPS 2020, https://arxiv.org/abs/2006.08907 (Algorithm 1 and
the baselines of §5).

Plain training functions (:func:`fedrobust_local`, :func:`adversarial_local`) and the
handlers that wrap them for any ClientApp (``apps/client_app.py`` routes to them):

``train.fedrobust``
    Content ``arrays`` (w), optionally ``affine`` (the partition's shift: an ArrayRecord
    {``lambda``: d×d, ``delta``: d}, float32; absent: (I, 0), the partition's first round)
    and ``config``: ``lr`` η₁ > 0, ``adv-lr`` η₂ > 0, ``affine-lambda`` λ ≥ 0,
    ``local-steps`` τ ≥ 1, ``batch-size``, ``seed``, ``server-round``, ``affine-rounds``
    (rounds the shift has seen); ``affine-max-dim`` (message or run config, default 3072)
    bounds the flattened input dimension d. The node keeps nothing: the server stores every
    partition's (Λ_i, δ_i), so a restarted node continues from its partition's shift.
    For t = 1..τ, with a minibatch B_t and φ_B(w, Λ, δ) = (1/|B|) Σ_{j∈B}
    ℓ(f_w(Λx_j + δ), y_j) − λ‖Λ − I‖_F² − λ‖δ‖₂², both gradients at the current point:

    .. math::

        w &\leftarrow w - \eta_1 \nabla_w \varphi_B(w, \Lambda_i, \delta_i), \\
        (\Lambda_i, \delta_i) &\leftarrow (\Lambda_i, \delta_i)
            + \eta_2 \nabla_{(\Lambda, \delta)} \varphi_B(w, \Lambda_i, \delta_i).

    Reply: ``arrays`` (w after τ steps), ``affine`` (Λ_i, δ_i after τ steps, float32) and
    ``metrics`` {``num-examples``, ``partition-id``, ``train_loss`` (the received w's loss on
    the unshifted local data: ``train-loss-on``), ``train_loss_local`` (mean shifted
    minibatch loss), ``local-steps``, ``lambda-dev-fro`` = ‖Λ_i − I‖_F, ``delta-norm`` =
    ‖δ_i‖₂ (after the steps), ``affine-rounds`` (the received count + 1)}.

``train.fgm`` / ``train.pgd`` (distributed adversarial training)
    Content ``arrays`` and ``config``: ``lr``, ``local-steps``, ``batch-size``, ``seed``,
    ``server-round``, ``adv-eps`` ε ≥ 0, ``pgd-steps`` K ≥ 1 (PGD, default 10),
    ``pgd-step-size`` α (PGD, default 2.5ε/K). Each local step replaces the minibatch by
    its per-sample ℓ₂ attack (FGM: x + ε g/‖g‖; PGD: K projected steps of size α) and
    takes an SGD step on it. Reply: ``arrays`` and ``metrics`` {``num-examples``,
    ``partition-id``, ``train_loss`` (the received model's loss on the clean local data),
    ``train_loss_local`` (mean adversarial minibatch loss), ``local-steps``}.
    Nothing is kept in ``context.state``.

``query.affine_state``
    No content needed. Reply ``metrics`` {``num-examples``, ``partition-id``, ``affine-dim``
    d}: the server asks a node it does not know yet which partition it serves before
    sending it that partition's shift.

Memory and traffic: (Λ_i, δ_i) holds (d² + d) float32 values, 2.46 MB for MNIST (d = 784)
and 37.8 MB for CIFAR-10 (d = 3072), sent each way with every ``train.fedrobust``
message; a d above ``affine-max-dim`` is refused with an error reply.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from torch import nn
from torch.nn import functional as F

from flowerdro.buffers import to_array_record
from flowerdro.clients.handlers import (
    ClientRuntime,
    get_runtime,
    received_model_loss,
    settings_for,
    train_metrics,
)
from flowerdro.clients.training import (
    LocalData,
    LossFn,
    TrainResult,
    check_loop_args,
    clone_state,
    host_values,
    make_generator,
    minibatches,
    seeded_global_rng,
)
from flowerdro.core.affine import (
    DEFAULT_MAX_DIM,
    affine_ascent_update,
    check_affine_dim,
    check_ascent_rates,
    flat_dim,
)
from flowerdro.models.affine import apply_affine, identity_shift, pgd_l2_attack

#: Message content: the partition's shift (ArrayRecord ``affine`` {``lambda``, ``delta``}) both
#: ways, and the number of FedRobust rounds it has seen (config ``affine-rounds``).
AFFINE_RECORD, AFFINE_ROUNDS = "affine", "affine-rounds"
#: Adversarial-training variants (message types ``train.fgm`` / ``train.pgd``).
ADVERSARIAL_KINDS = ("fgm", "pgd")
#: Salts of the random streams (apart from handlers' 11, 23 and SCAFF-PD's 37, 41, 43).
_SALT_FEDROBUST, _SALT_ADV = 53, 59


# --------------------------------------------------------------------------- state
@dataclass
class AffineState:
    """A partition's affine shift (Λ_i, δ_i) and how many FedRobust rounds have updated it."""

    lam: torch.Tensor
    delta: torch.Tensor
    rounds: int = 0

    @property
    def lambda_dev_fro(self) -> float:
        """‖Λ_i − I‖_F."""
        eye = torch.eye(self.lam.shape[0], dtype=self.lam.dtype, device=self.lam.device)
        return float(torch.linalg.norm(self.lam - eye))

    @property
    def delta_norm(self) -> float:
        """‖δ_i‖₂."""
        return float(torch.linalg.norm(self.delta))


def shift_from_message(message: Message, d: int, *, device: torch.device | None = None,
                       dtype: torch.dtype = torch.float32) -> AffineState:
    """(Λ_i, δ_i) and the round count the server sent (``(I, 0)``, 0 rounds, when it sent none).

    Raises a ValueError when the shift does not have dimension d (it belongs to inputs of
    another shape).
    """
    rec = message.content.array_records.get(AFFINE_RECORD)
    cfg = message.content.config_records.get("config")
    rounds = int(cfg[AFFINE_ROUNDS]) if cfg is not None and AFFINE_ROUNDS in cfg else 0
    if rec is None:
        lam, delta = identity_shift(d, dtype=dtype, device=device)
        return AffineState(lam, delta, 0)
    if "lambda" not in rec or "delta" not in rec:
        raise ValueError(f"message: the ArrayRecord '{AFFINE_RECORD}' needs 'lambda' and 'delta', "
                         f"got {sorted(rec.keys())}")
    lam_np, delta_np = rec["lambda"].numpy(), rec["delta"].numpy()
    if lam_np.shape != (d, d) or delta_np.shape != (d,):
        raise ValueError(f"message['{AFFINE_RECORD}']: Λ {lam_np.shape} / δ {delta_np.shape} do not fit inputs "
                         f"with d = {d} features")
    return AffineState(torch.tensor(lam_np, dtype=dtype, device=device),
                       torch.tensor(delta_np, dtype=dtype, device=device), rounds)


def shift_record(state: AffineState) -> ArrayRecord:
    """(Λ_i, δ_i) as the reply's ArrayRecord ``affine`` (float32)."""
    return ArrayRecord({
        "lambda": Array(np.ascontiguousarray(state.lam.detach().cpu().numpy().astype(np.float32))),
        "delta": Array(np.ascontiguousarray(state.delta.detach().cpu().numpy().astype(np.float32))),
    })


# --------------------------------------------------------------------------- training loops
def fedrobust_local(
    model: nn.Module, data: LocalData, lam: torch.Tensor, delta: torch.Tensor, *, steps: int, lr: float,
    adv_lr: float, penalty: float, batch_size: int, generator: torch.Generator, loss_fn: LossFn | None = None,
) -> tuple[TrainResult, torch.Tensor, torch.Tensor]:
    r"""τ iterations of Algorithm 1 on one node: descent on w, ascent on (Λ_i, δ_i).

    For t = 1..τ with minibatch B_t (gradients of φ at the *same* point (w, Λ, δ)):

    .. math::

        g_w, g_\Lambda, g_\delta &= \nabla \tfrac{1}{|B_t|}\textstyle\sum_{j\in B_t}
            \ell(f_w(\Lambda x_j + \delta), y_j), \\
        w &\leftarrow w - \eta_1 g_w, \\
        \Lambda &\leftarrow \Lambda + \eta_2 \big(g_\Lambda - 2\lambda(\Lambda - I)\big), \\
        \delta &\leftarrow \delta + \eta_2 \big(g_\delta - 2\lambda\delta\big).

    Parameters
    ----------
    model : torch.nn.Module
        f_w (updated in place).
    data : LocalData
        The node's training data (x of shape (n, *input_shape), d = ∏ input_shape).
    lam, delta : torch.Tensor
        Λ_i (d, d) and δ_i (d,) at the start (not modified).
    steps : int
        τ ≥ 1.
    lr, adv_lr : float
        η₁ > 0, η₂ > 0.
    penalty : float
        λ ≥ 0.
    batch_size : int
        Minibatch size ≥ 1.
    generator : torch.Generator
        Minibatch order.
    loss_fn : callable, optional
        ℓ; cross-entropy when unset.

    Returns
    -------
    (TrainResult, torch.Tensor, torch.Tensor)
        The model state and statistics, Λ_i and δ_i after τ steps.
    """
    check_loop_args(steps, lr, batch_size)
    check_ascent_rates(adv_lr, penalty)
    d = flat_dim(data.x_train.shape[1:])
    if tuple(lam.shape) != (d, d) or tuple(delta.shape) != (d,):
        raise ValueError(f"lam, delta: (Λ, δ) must be ({d}, {d}) and ({d},) for inputs of shape "
                         f"{tuple(data.x_train.shape[1:])}, got {tuple(lam.shape)} and {tuple(delta.shape)}")
    criterion = loss_fn or F.cross_entropy
    dev, dt = data.x_train.device, data.x_train.dtype
    lam = lam.detach().to(dev, dt).clone()
    delta = delta.detach().to(dev, dt).clone()
    eye = torch.eye(d, dtype=dt, device=dev)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = minibatches(data.num_train, batch_size, generator, dev)
    losses: list[torch.Tensor] = []  # on the device: no host round-trip per step
    with seeded_global_rng(generator, dev):  # dropout layers draw from it
        model.train()
        for _ in range(steps):
            idx = next(batches)
            model.zero_grad(set_to_none=True)
            lam.requires_grad_(True)
            delta.requires_grad_(True)
            loss = criterion(model(apply_affine(data.x_train[idx], lam, delta)), data.y_train[idx])
            loss.backward()
            losses.append(loss.detach())
            with torch.no_grad():
                g_lam, g_delta = lam.grad, delta.grad
                assert g_lam is not None and g_delta is not None
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-lr)
                new_lam, new_delta = affine_ascent_update(lam, delta, g_lam, g_delta, adv_lr=adv_lr,
                                                          penalty=penalty, eye=eye)
            lam, delta = new_lam.detach(), new_delta.detach()
    res = TrainResult(state=clone_state(model), steps=steps, num_examples=data.num_train,
                      loss_before=float("nan"), mean_batch_loss=sum(host_values(losses)) / steps)
    return res, lam, delta


def adversarial_local(
    model: nn.Module, data: LocalData, *, kind: str, eps: float, steps: int, lr: float, batch_size: int,
    generator: torch.Generator, attack_steps: int = 10, attack_step_size: float | None = None,
    loss_fn: LossFn | None = None,
) -> TrainResult:
    r"""τ SGD steps on per-sample ℓ₂ adversarial minibatches (FGM or PGD adversarial training).

    For t = 1..τ: x̃_j = x_j + v_j with v_j from :func:`~flowerdro.models.affine.pgd_l2_attack`
    at the current w (FGM: one step of size ε; PGD: K = ``attack_steps`` projected steps of
    size α = ``attack_step_size``, default 2.5ε/K), then w ← w − η ∇_w (1/|B|) Σ ℓ(f_w(x̃_j), y_j).
    The attack ascends the same loss ℓ = ``loss_fn`` the step descends (cross-entropy when
    unset, MSE on a regression task).
    """
    check_loop_args(steps, lr, batch_size)
    if kind not in ADVERSARIAL_KINDS:
        raise ValueError(f"kind: unknown adversarial training {kind!r}; allowed: {', '.join(ADVERSARIAL_KINDS)}")
    if not eps >= 0:
        raise ValueError(f"adv-eps: ε must be >= 0, got {eps}")
    if attack_steps < 1:
        raise ValueError(f"pgd-steps: must be >= 1, got {attack_steps}")
    criterion = loss_fn or F.cross_entropy
    params = [p for p in model.parameters() if p.requires_grad]
    batches = minibatches(data.num_train, batch_size, generator, data.x_train.device)
    losses: list[torch.Tensor] = []  # on the device: no host round-trip per step
    with seeded_global_rng(generator, data.x_train.device):  # dropout layers draw from it
        for _ in range(steps):
            idx = next(batches)
            xb, yb = data.x_train[idx], data.y_train[idx]
            if kind == "fgm":
                xa = pgd_l2_attack(model, xb, yb, eps, steps=1, step_size=eps, loss_fn=loss_fn)
            else:
                xa = pgd_l2_attack(model, xb, yb, eps, steps=attack_steps, step_size=attack_step_size,
                                   loss_fn=loss_fn)
            model.train()
            model.zero_grad(set_to_none=True)
            loss = criterion(model(xa), yb)
            loss.backward()
            losses.append(loss.detach())
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-lr)
    return TrainResult(state=clone_state(model), steps=steps, num_examples=data.num_train,
                       loss_before=float("nan"), mean_batch_loss=sum(host_values(losses)) / steps)


# --------------------------------------------------------------------------- handlers
def _received(message: Message) -> ArrayRecord:
    rec = message.content.array_records.get("arrays")
    if rec is None:
        raise ValueError(f"message: expected an ArrayRecord 'arrays' with the model ({message.metadata.message_type})")
    return rec


def _affine_dim(rt: ClientRuntime, context: Context, message: Message) -> int:
    s = settings_for(message, context)
    d = flat_dim(rt.input_shape)
    check_affine_dim(d, s.int("affine-max-dim", DEFAULT_MAX_DIM, minimum=1))
    return d


def fedrobust_train_reply(message: Message, context: Context) -> Message:
    """``train.fedrobust``: τ GDA steps from the received w and the received (Λ_i, δ_i); reply both."""
    rt = get_runtime(context)
    s = settings_for(message, context)
    steps = s.int("local-steps", 10, minimum=1)
    lr = s.float("lr", 0.05, positive=True)
    adv_lr = s.float("adv-lr", 0.01, positive=True)
    penalty = s.float("affine-lambda", 1.0, minimum=0.0)
    batch_size = s.int("batch-size", 32, minimum=1)
    d = _affine_dim(rt, context, message)
    model = rt.model_from(_received(message))
    state = shift_from_message(message, d, device=rt.data.x_train.device, dtype=rt.data.x_train.dtype)
    gen = make_generator(s.int("seed", 0), s.int("server-round", 0), rt.partition_id, _SALT_FEDROBUST)
    before = received_model_loss(rt, model, s, _SALT_FEDROBUST)  # on the unshifted data
    res, lam, delta = fedrobust_local(model, rt.data, state.lam, state.delta, steps=steps, lr=lr, adv_lr=adv_lr,
                                      penalty=penalty, batch_size=batch_size, generator=gen, loss_fn=rt.loss_fn)
    if not (torch.isfinite(lam).all() and torch.isfinite(delta).all()):
        raise FloatingPointError("fedrobust: (Λ_i, δ_i) became NaN/Inf; lower adv-lr")
    new_state = AffineState(lam, delta, state.rounds + 1)
    metrics = train_metrics(rt, res, train_loss=before, **{"lambda-dev-fro": new_state.lambda_dev_fro,
                                                            "delta-norm": new_state.delta_norm,
                                                            "affine-rounds": new_state.rounds})
    content = RecordDict({"arrays": to_array_record(res.state), AFFINE_RECORD: shift_record(new_state), "metrics": metrics})
    return Message(content=content, reply_to=message)


def adversarial_train_reply(message: Message, context: Context, kind: str) -> Message:
    """``train.fgm`` / ``train.pgd``: τ SGD steps on ℓ₂-adversarial minibatches of radius ε."""
    if kind not in ADVERSARIAL_KINDS:
        raise ValueError(f"kind: unknown adversarial training {kind!r}; allowed: {', '.join(ADVERSARIAL_KINDS)}")
    rt = get_runtime(context)
    s = settings_for(message, context)
    model = rt.model_from(_received(message))
    gen = make_generator(s.int("seed", 0), s.int("server-round", 0), rt.partition_id, _SALT_ADV)
    step_size = s.float("pgd-step-size", 0.0, minimum=0.0) if s.has("pgd-step-size") else None
    before = received_model_loss(rt, model, s, _SALT_ADV)  # on the clean data
    res = adversarial_local(
        model, rt.data, kind=kind, eps=s.float("adv-eps", 1.0, minimum=0.0),
        steps=s.int("local-steps", 10, minimum=1), lr=s.float("lr", 0.05, positive=True),
        batch_size=s.int("batch-size", 32, minimum=1), generator=gen,
        attack_steps=s.int("pgd-steps", 10, minimum=1), attack_step_size=step_size or None, loss_fn=rt.loss_fn,
    )
    return Message(content=RecordDict({"arrays": to_array_record(res.state),
                                       "metrics": train_metrics(rt, res, train_loss=before)}), reply_to=message)


def affine_state_reply(message: Message, context: Context) -> Message:
    """``query.affine_state``: which partition this node serves and the dimension d of its shift.

    The server keeps every partition's (Λ_i, δ_i); it asks a node it has not heard from
    (a restarted SuperNode has a new node id) before sending it a partition's shift.
    """
    rt = get_runtime(context)
    metrics = MetricRecord({
        "num-examples": rt.data.num_train,
        "partition-id": rt.partition_id,
        "affine-dim": flat_dim(rt.input_shape),
    })
    return Message(content=RecordDict({"metrics": metrics}), reply_to=message)
