r"""FedRobust (FLRA) and the distributed FGM / PGD adversarial-training baselines.

Reisizadeh, Farnia, Pedarsani, Jadbabaie, "Robust Federated Learning: The Case of Affine
Distribution Shifts", NeurIPS 2020, https://arxiv.org/abs/2006.08907.

FedRobust solves problem (3),

.. math::

    \min_w \max_{(\Lambda_i, \delta_i)_{i=1}^n} \frac{1}{nm} \sum_{i=1}^n \sum_{j=1}^m
        \ell\big(f_w(\Lambda_i x_{ij} + \delta_i), y_{ij}\big)
        - \lambda \lVert \Lambda_i - I \rVert_F^2 - \lambda \lVert \delta_i \rVert_2^2,

by local gradient descent-ascent (Algorithm 1): every sampled node i runs τ iterations
of one stochastic descent step on w (rate η₁) and one stochastic ascent step on its own
(Λ_i, δ_i) (rate η₂), both at the current point; every τ iterations the server averages
the w's only,

.. math:: w^{k+1} = \sum_{i \in S_k} \frac{m_i}{\sum_{j \in S_k} m_j} w_i^{k,\tau}.

(Λ_i, δ_i) stay on the node, in ``context.state`` (see
:mod:`flowerdro.clients.robust`), across rounds; the server never sees them.

Messages: ``train.fedrobust`` with config ``lr`` η₁, ``adv-lr`` η₂, ``affine-lambda`` λ,
``local-steps`` τ, ``batch-size`` (and ``server-round``, ``seed``); reply ``arrays`` +
``metrics`` (``lambda-dev-fro``, ``delta-norm`` besides the usual keys).
:class:`AdversarialTraining` sends ``train.fgm`` / ``train.pgd`` with ``adv-eps`` ε,
``pgd-steps`` K, ``pgd-step-size`` α and averages like FedAvg (the paper's distributed
FGM and PGD adversarial training).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from flowerdro.core.affine import check_ascent_rates
from flowerdro.strategies.base import FairStrategy

#: Message type of FedRobust's local GDA.
TRAIN_FEDROBUST = "train.fedrobust"
#: Message type of the state query (‖Λ_i − I‖_F, ‖δ_i‖₂).
QUERY_AFFINE_STATE = "query.affine_state"
#: Metrics of a ``query.affine_state`` reply kept by :meth:`FedRobust.query_affine_state`.
_STATE_KEYS = ("lambda-dev-fro", "delta-norm", "affine-rounds")


def _positive(value: float | None, key: str) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{key}: must be > 0, got {value}")


class FedRobust(FairStrategy):
    r"""FedRobust: local GDA on (w, Λ_i, δ_i); the server averages w only.

    Parameters
    ----------
    local_steps : int (default: 10)
        τ ≥ 1, local iterations per round.
    adv_lr : float (default: 0.01)
        η₂ > 0, the ascent rate on (Λ_i, δ_i).
    affine_lambda : float (default: 1.0)
        λ ≥ 0, the penalty λ‖Λ_i − I‖_F² + λ‖δ_i‖₂² on the shift.
    lr : float, optional
        η₁ > 0, the descent rate on w (unset: the client's run config ``lr``).
    batch_size : int, optional
        Minibatch size (unset: the client's run config ``batch-size``).
    affine_max_dim : int, optional
        Largest flattened input dimension d a client accepts (unset: the client's default
        3072, i.e. CIFAR-10); forwarded as ``affine-max-dim``.
    **kwargs
        :class:`~flowerdro.strategies.base.FairStrategy` settings (fraction_train, seed, …).
    """

    name = "fedrobust"

    def __init__(
        self,
        *,
        local_steps: int = 10,
        adv_lr: float = 0.01,
        affine_lambda: float = 1.0,
        lr: float | None = None,
        batch_size: int | None = None,
        affine_max_dim: int | None = None,
        **kwargs: Any,
    ) -> None:
        if local_steps < 1:
            raise ValueError(f"local-steps: τ must be >= 1, got {local_steps}")
        _positive(adv_lr, "adv-lr")
        _positive(lr, "lr")
        check_ascent_rates(adv_lr, affine_lambda)
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch-size: must be >= 1, got {batch_size}")
        if affine_max_dim is not None and affine_max_dim < 1:
            raise ValueError(f"affine-max-dim: must be >= 1, got {affine_max_dim}")
        super().__init__(**kwargs)
        self.local_steps = int(local_steps)
        self.adv_lr = float(adv_lr)
        self.affine_lambda = float(affine_lambda)
        #: partition id → the node's stored shift, read back after the last round.
        self.affine_state: dict[str, dict[str, float]] = {}
        self.lr = lr
        self.batch_size = batch_size
        self.affine_max_dim = affine_max_dim

    def settings(self) -> dict[str, Any]:  # noqa: D102
        out = super().settings()
        out.update({"local_steps": self.local_steps, "lr": self.lr, "adv_lr": self.adv_lr,
                    "affine_lambda": self.affine_lambda, "batch_size": self.batch_size})
        return out

    def client_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        """The round's ``train.fedrobust`` config: run-config keys plus η₁, η₂, λ, τ."""
        config["server-round"] = server_round
        config["local-steps"] = self.local_steps
        config["adv-lr"] = self.adv_lr
        config["affine-lambda"] = self.affine_lambda
        if self.lr is not None:
            config["lr"] = float(self.lr)
        if self.batch_size is not None:
            config["batch-size"] = int(self.batch_size)
        if self.affine_max_dim is not None:
            config["affine-max-dim"] = int(self.affine_max_dim)
        config.pop("local-epochs", None)  # τ is the number of GDA iterations
        return config

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send w and the GDA settings to a seeded sample of nodes (``train.fedrobust``)."""
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        content = RecordDict({"arrays": arrays, "config": self.client_config(config, server_round)})
        return self.build_messages(chosen, content, TRAIN_FEDROBUST)

    # aggregate_train: FairStrategy's default, the num-examples-weighted average of w.

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              **kwargs: Any) -> Result:
        """Run the rounds (:meth:`FairStrategy.start`), then read every node's shift back.

        After the last round every node answers ``query.affine_state`` (the node's stored
        ‖Λ_i − I‖_F, ‖δ_i‖₂ and the number of rounds it trained); the answers are kept in
        :attr:`affine_state` and written to ``<output_dir>/affine_state.json``. A node that
        fails the query is counted under ``affine-state`` like any other failure.
        """
        result = super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, **kwargs)
        self.affine_state = self.query_affine_state(grid)
        if self.output_dir is not None:
            (self.output_dir / "affine_state.json").write_text(json.dumps(self.affine_state, indent=2))
        return result

    def query_affine_state(self, grid: Grid) -> dict[str, dict[str, float]]:
        """``query.affine_state`` to every node: partition id → ‖Λ_i − I‖_F, ‖δ_i‖₂, rounds trained."""
        content = RecordDict({"config": ConfigRecord({})})
        replies = self.communicate(grid, self.build_messages(self.nodes(grid), content, QUERY_AFFINE_STATE),
                                   phase="affine-state", required_metrics=_STATE_KEYS)
        out = {}
        for reply in replies:
            m = reply.content["metrics"]
            out[str(int(m["partition-id"]))] = {k: float(m[k]) for k in _STATE_KEYS}
        return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


class AdversarialTraining(FairStrategy):
    r"""Distributed FGM / PGD adversarial training: FedAvg over ℓ₂-adversarial local SGD.

    Each sampled node takes τ SGD steps on minibatches replaced by their per-sample ℓ₂
    attack of radius ε (FGM: x + ε∇ₓℓ/‖∇ₓℓ‖; PGD: K projected steps of size α); the
    server averages the models weighted by ``num-examples``.

    Parameters
    ----------
    kind : {"fgm", "pgd"}
        The attack used in training (message type ``train.<kind>``).
    adv_eps : float (default: 1.0)
        ε ≥ 0, the ℓ₂ radius.
    pgd_steps : int (default: 10)
        K ≥ 1 (PGD only).
    pgd_step_size : float, optional
        α > 0 (PGD only; default 2.5ε/K on the client).
    local_steps : int, optional
        τ ≥ 1 (unset: the run config's ``local-steps``).
    lr, batch_size : optional
        Forwarded when set (else the client's run config).
    **kwargs
        :class:`~flowerdro.strategies.base.FairStrategy` settings.
    """

    def __init__(
        self,
        kind: str,
        *,
        adv_eps: float = 1.0,
        pgd_steps: int = 10,
        pgd_step_size: float | None = None,
        local_steps: int | None = None,
        lr: float | None = None,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kind not in ("fgm", "pgd"):
            raise ValueError(f"kind: unknown adversarial training {kind!r}; allowed: fgm, pgd")
        if not adv_eps >= 0:
            raise ValueError(f"adv-eps: ε must be >= 0, got {adv_eps}")
        if pgd_steps < 1:
            raise ValueError(f"pgd-steps: must be >= 1, got {pgd_steps}")
        _positive(pgd_step_size, "pgd-step-size")
        _positive(lr, "lr")
        if local_steps is not None and local_steps < 1:
            raise ValueError(f"local-steps: τ must be >= 1, got {local_steps}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch-size: must be >= 1, got {batch_size}")
        self.name = f"fedavg-{kind}"
        super().__init__(**kwargs)
        self.kind = kind
        self.adv_eps = float(adv_eps)
        self.pgd_steps = int(pgd_steps)
        self.pgd_step_size = pgd_step_size
        self.local_steps = local_steps
        self.lr = lr
        self.batch_size = batch_size

    def settings(self) -> dict[str, Any]:  # noqa: D102
        out = super().settings()
        out.update({"kind": self.kind, "adv_eps": self.adv_eps, "local_steps": self.local_steps, "lr": self.lr})
        if self.kind == "pgd":
            out.update({"pgd_steps": self.pgd_steps, "pgd_step_size": self.pgd_step_size})
        return out

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the model and ε (K, α) to a seeded sample of nodes (``train.fgm`` / ``train.pgd``)."""
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        config["server-round"] = server_round
        config["adv-eps"] = self.adv_eps
        if self.kind == "pgd":
            config["pgd-steps"] = self.pgd_steps
            if self.pgd_step_size is not None:
                config["pgd-step-size"] = float(self.pgd_step_size)
        if self.local_steps is not None:
            config["local-steps"] = int(self.local_steps)
            config.pop("local-epochs", None)
        if self.lr is not None:
            config["lr"] = float(self.lr)
        if self.batch_size is not None:
            config["batch-size"] = int(self.batch_size)
        content = RecordDict({"arrays": arrays, "config": config})
        return self.build_messages(chosen, content, f"train.{self.kind}")
