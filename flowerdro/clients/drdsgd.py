"""Client side of DR-DSGD and DSGD: one tilted (or plain) local SGD step per iteration.

DR-DSGD (Ben Issaid, Elgabli and Bennis, "DR-DSGD: A Distributionally Robust
Decentralized Learning Algorithm over Graphs", TMLR 2022,
https://openreview.net/forum?id=VcXNAr5Rur) minimises (1/K) Σ_i exp(f_i(θ)/μ). At
iteration t device i takes the local half step

    θ_i^{t+½} = θ_i^t − η · (h_i / μ) · g_i(θ_i^t),   h_i = exp(ℓ_i(θ_i^t) / μ),

with g_i the gradient of the mean loss ℓ_i (the task's: cross-entropy, or MSE on a
regression data set) on a minibatch of size B, before the gossip
step θ_i^{t+1} = Σ_j W_ij θ_j^{t+½} (done by the server relay, see
:mod:`flowerdro.strategies.drdsgd`). DSGD is the same step with h_i/μ replaced by 1.
h_i/μ is computed in the log domain, float64, and capped at exp(``tilt-log-cap``)
(:func:`flowerdro.core.tilted.tilt_step`), so it never overflows and the uncapped
log-weight log(h_i/μ) = ℓ_i/μ − log μ is still reported exactly.

:func:`drdsgd_local_step` is the plain function (torch model + tensors); a foreign
ClientApp may call it directly. :func:`drdsgd_reply` turns a ``train.drdsgd`` /
``train.dsgd`` message into it and back into a reply.

Message config keys (message over run config): ``lr`` η, ``batch-size`` B,
``local-steps`` (default 1, the paper's single step per iteration), ``seed``,
``server-round``; message only: ``mu`` μ > 0 (required by ``train.drdsgd``),
``tilt-log-cap`` c ∈ [−709, 709] (default 50; the strategy sends log M when its
``max-tilt-weight`` M is set, a departure from the paper). Reply: ``arrays`` θ_i^{t+½} and ``metrics`` with
``num-examples``, ``partition-id``, ``train_loss`` (ℓ_i of the first step: the loss of the
received θ_i^t on its first minibatch, the loss the tilted step weights), ``train_loss_local``
(mean minibatch loss over the local steps; the same with one step), ``log_tilt_weight`` (mean
over the local steps of log of the multiplier used uncapped: ℓ/μ − log μ for DR-DSGD,
0 for DSGD), ``tilt_capped`` (how many steps hit the cap), ``local-steps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from torch import nn

from flowerdro.buffers import to_array_record
from flowerdro.clients.handlers import get_runtime, message_settings, settings_for
from flowerdro.clients.training import LocalData, LossFn, StateDict, local_sgd, make_generator
from flowerdro.core.tilted import DEFAULT_LOG_CAP, MIN_LOG_CAP, tilt_step

#: Salt that keeps DR-DSGD's minibatch stream apart from the other phases'.
SALT_DRDSGD = 37

@dataclass
class DRDSGDStepResult:
    """Outcome of :func:`drdsgd_local_step`.

    Attributes
    ----------
    state : dict of str to torch.Tensor
        θ_i^{t+½}, the model after the local step(s).
    losses : list of float
        ℓ_i of every local step (mean minibatch loss before that step).
    log_weights : list of float
        log of the multiplier of every step before the cap: ℓ/μ − log μ (DR-DSGD) or 0 (DSGD).
    scales : list of float
        The multiplier actually used: min(h/μ, e^c) (DR-DSGD) or 1 (DSGD).
    capped : int
        Number of steps whose multiplier hit the cap e^c.
    num_examples : int
        Local training examples.
    """

    state: StateDict
    losses: list[float]
    log_weights: list[float]
    scales: list[float]
    capped: int
    num_examples: int

    @property
    def mean_loss(self) -> float:
        """Mean minibatch loss over the local steps."""
        return float(sum(self.losses) / len(self.losses))

    @property
    def mean_log_weight(self) -> float:
        """Mean uncapped log-multiplier over the local steps."""
        return float(sum(self.log_weights) / len(self.log_weights))


def drdsgd_local_step(
    model: nn.Module,
    data: LocalData,
    *,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    mu: float | None,
    robust: bool = True,
    steps: int = 1,
    log_cap: float = DEFAULT_LOG_CAP,
    weight_decay: float = 0.0,
    loss_fn: LossFn | None = None,
) -> DRDSGDStepResult:
    """DR-DSGD (or DSGD) local step(s) of one device, in place on ``model``.

    For s = 1..S (S = ``steps``, 1 in the paper) with a fresh minibatch of size B:

        θ ← θ − η · m(ℓ) · ∇ℓ_B(θ),   m(ℓ) = min(exp(ℓ/μ − log μ), e^c)  (DR-DSGD)
                                      m(ℓ) = 1                            (DSGD),

    where ℓ = ℓ_B(θ) is the mean minibatch loss at the current θ, so with S = 1 this is
    θ_i^{t+½} = θ_i^t − η (h_i/μ) g_i(θ_i^t), h_i = exp(ℓ_i/μ). The multiplier is built
    in float64 from its logarithm (:func:`flowerdro.core.tilted.tilt_step`) and capped at
    e^c, c = ``log_cap``.

    Parameters
    ----------
    model : torch.nn.Module
        θ_i^t on entry, θ_i^{t+½} on return.
    data : LocalData
        The device's training data.
    lr : float
        η > 0.
    batch_size : int
        B ≥ 1 (clipped to the local data size).
    generator : torch.Generator
        Source of the minibatch order.
    mu : float or None
        μ > 0 (DR-DSGD); ignored when ``robust`` is False.
    robust : bool (default: True)
        DR-DSGD (True) or DSGD (False).
    steps : int (default: 1)
        Local steps S ≥ 1 per iteration.
    log_cap : float (default: DEFAULT_LOG_CAP = 50.0)
        c ∈ [−709, 709]: the multiplier never exceeds e^c. The default is an overflow
        guard that does not bind in the paper's regimes; a binding cap (e.g. c = 0, the
        strategy option ``max-tilt-weight`` = 1) is a departure from the paper.
    weight_decay : float (default: 0.0)
        Optional ℓ2 term, not scaled by the multiplier.
    loss_fn : callable, optional
        ℓ(output, target) → mean loss; cross-entropy when unset
        (:func:`~flowerdro.clients.training.mse_loss` for a regression task).

    Returns
    -------
    DRDSGDStepResult
        θ_i^{t+½}, the per-step losses, log-weights, multipliers and the cap count.

    Raises
    ------
    ValueError
        mu ≤ 0 or missing for DR-DSGD, or a bad lr / batch size / step count.
    """
    if robust:
        if mu is None:
            raise ValueError(
                "mu: DR-DSGD needs the DRO regulariser mu > 0 (message config key 'mu')"
            )
        tilt_step(0.0, mu, log_cap=log_cap)  # validates mu and log_cap up front
    losses: list[float] = []
    log_weights: list[float] = []
    scales: list[float] = []
    capped = 0

    def scale(loss: float) -> float:
        nonlocal capped
        losses.append(float(loss))
        if not robust:
            log_weights.append(0.0)
            scales.append(1.0)
            return 1.0
        ts = tilt_step(loss, mu, log_cap=log_cap)  # type: ignore[arg-type]
        log_weights.append(ts.log_weight)
        scales.append(ts.scale)
        capped += int(ts.capped)
        return ts.scale

    res = local_sgd(
        model,
        data,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        generator=generator,
        weight_decay=weight_decay,
        step_scale=scale,
        loss_before_on="none",
        loss_fn=loss_fn,
    )
    return DRDSGDStepResult(
        state=res.state,
        losses=losses,
        log_weights=log_weights,
        scales=scales,
        capped=capped,
        num_examples=res.num_examples,
    )


def drdsgd_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """The minibatch stream of device ``partition_id`` at iteration ``server_round``."""
    return make_generator(seed, server_round, partition_id, SALT_DRDSGD)


def drdsgd_reply(message: Message, context: Context, *, robust: bool | None = None) -> Message:
    """Handle ``train.drdsgd`` (robust) or ``train.dsgd``: one local step from the received θ_i.

    ``robust`` defaults to what the message type says (``train.drdsgd`` → True).
    See the module docstring for the config and reply keys.
    """
    if robust is None:
        robust = message.metadata.message_type != "train.dsgd"
    rt = get_runtime(context)
    s = settings_for(message, context)
    own = message_settings(message)
    mu = own.float("mu", 0.0) if robust else None
    if robust and not (mu is not None and mu > 0):
        raise ValueError(
            f"mu: train.drdsgd needs 'mu' > 0 in the message config, got {own.raw('mu')!r}"
        )
    arrays = message.content.array_records.get("arrays")
    if arrays is None:
        raise ValueError("message: expected an ArrayRecord 'arrays' with this device's model θ_i")
    model = rt.model_from(arrays)
    res = drdsgd_local_step(
        model,
        rt.data,
        lr=s.float("lr", 0.05, positive=True),
        batch_size=s.int("batch-size", 32, minimum=1),
        generator=drdsgd_generator(s.int("seed", 0), s.int("server-round", 0), rt.partition_id),
        mu=mu,
        robust=robust,
        steps=s.int("local-steps", 1, minimum=1),
        log_cap=own.float("tilt-log-cap", DEFAULT_LOG_CAP, minimum=MIN_LOG_CAP),
        weight_decay=s.float("weight-decay", 0.0, minimum=0.0),
        loss_fn=rt.loss_fn,
    )
    metrics = MetricRecord(
        {
            "num-examples": res.num_examples,
            "partition-id": rt.partition_id,
            "train_loss": res.losses[0],
            "train_loss_local": res.mean_loss,
            "log_tilt_weight": res.mean_log_weight,
            "tilt_capped": int(res.capped),
            "local-steps": len(res.losses),
        }
    )
    content = RecordDict({"arrays": to_array_record(res.state), "metrics": metrics})
    return Message(content=content, reply_to=message)
