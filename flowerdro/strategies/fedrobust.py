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
(Λ_i, δ_i) (rate η₂, :func:`flowerdro.core.affine.affine_ascent_update`), both at the
current point; every τ iterations the server averages the w's only,

.. math:: w^{k+1} = \sum_{i \in S_k} \frac{m_i}{\sum_{j \in S_k} m_j} w_i^{k,\tau}.

Each partition's (Λ_i, δ_i) is kept by the server, keyed by partition id (not node id),
in ``self.state``: it travels to the node with each ``train.fedrobust`` message and comes
back updated in the reply, so a SuperNode that restarts (new node id, same partition)
continues from its partition's shift, and a checkpoint holds every shift. The price is
the shift's size, (d² + d)·4 bytes each way per sampled client and round
(:func:`flowerdro.core.affine.affine_state_bytes`: 2.46 MB for MNIST, 37.8 MB for
CIFAR-10). Before sending a shift to a node it has not heard from, while it stores a
shift that no connected node is known to serve, the server asks that node which
partition it serves (``query.affine_state``). A reply whose round count shows it was
trained from another shift than the stored one is dropped, so a stored shift is never
overwritten by one that restarted from (I, 0).

Messages: ``train.fedrobust`` (content ``arrays`` w, ``affine`` (Λ_i, δ_i) once the
partition has one, ``config`` with the clients' training settings, ``adv-lr`` η₂,
``affine-lambda`` λ, ``affine-max-dim``, ``affine-rounds``); reply ``arrays``, ``affine``
and ``metrics`` (``lambda-dev-fro``, ``delta-norm``, ``affine-rounds`` besides the usual
keys). :class:`FedAvgFGM` / :class:`FedAvgPGD` send ``train.fgm`` / ``train.pgd`` with
``adv-eps`` ε (and ``pgd-steps`` K, ``pgd-step-size`` α) and average like FedAvg (the
paper's distributed FGM and PGD adversarial training).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.core.affine import DEFAULT_MAX_DIM, check_ascent_rates, shift_norms
from flowerdro.protocol import NUM_EXAMPLES
from flowerdro.settings import Knob, Settings, setting
from flowerdro.strategies.arrays import average_arrays
from flowerdro.strategies.base import FairStrategy
from flowerdro.strategies.baselines import UNIFORM_WEIGHT, FedAvgSettings, _MeanOfModels
from flowerdro.strategies.records import mean_of_metric_records
from flowerdro.strategies.replies import metrics_of

__all__ = ["AdversarialTraining", "FGMSettings", "FedAvgFGM", "FedAvgPGD", "FedRobust", "FedRobustSettings",
           "PGDSettings"]

#: Message type of FedRobust's local GDA.
TRAIN_FEDROBUST = "train.fedrobust"
#: Message type asking a node which partition it serves (and its input dimension d).
QUERY_AFFINE_STATE = "query.affine_state"
#: The shift's ArrayRecord and its round count in the config, both ways.
AFFINE_RECORD, AFFINE_ROUNDS = "affine", "affine-rounds"


@dataclass(frozen=True)
class FedRobustSettings(Settings):
    """FedRobust (Reisizadeh et al. 2020, Algorithm 1); τ, η₁ and the batch size are the clients'."""

    # knob ranges: every corner keeps λη₂ < 1 (at most 1.6 · 0.6 = 0.96)
    adv_lr: float = setting(0.01, "η₂, the ascent rate on each client's affine shift (Λ_i, δ_i)", gt=0,
                            knob=Knob(1e-3, 0.6, "log"))
    affine_lambda: float = setting(1.0, "λ, the penalty λ‖Λ_i − I‖_F² + λ‖δ_i‖₂² on the shift (λη₂ < 1)", ge=0,
                                   knob=Knob(0.1, 1.6, "log"))
    affine_max_dim: int = setting(DEFAULT_MAX_DIM, "largest flattened input dimension d a client accepts "
                                                   "(Λ_i is d×d)", ge=1)

    def check(self) -> None:
        """The shift ascent contracts only when λη₂ < 1 (:func:`~flowerdro.core.affine.check_ascent_rates`)."""
        check_ascent_rates(self.adv_lr, self.affine_lambda)


class FedRobust(FairStrategy):
    r"""FedRobust: local GDA on (w, Λ_i, δ_i); the server averages w and stores each (Λ_i, δ_i).

    ``self.state["shifts"]`` maps a partition id to {``lambda``: Λ_i (d, d), ``delta``: δ_i
    (d,), ``rounds``: the rounds it has been updated in} (float32 arrays, as the clients
    send them).
    """

    name: ClassVar[str] = "fedrobust"
    settings_class: ClassVar[type[Settings]] = FedRobustSettings
    config: FedRobustSettings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state: dict[str, Any] = {"shifts": {}}

    def on_start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None) -> None:
        """Every partition starts at (I, 0): no stored shifts."""
        self.state = {"shifts": {}}

    def client_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        """The round's ``train.fedrobust`` config: the clients' training settings plus η₂, λ and the d limit."""
        cfg = self.train_config(config, server_round)
        cfg["adv-lr"] = self.config.adv_lr
        cfg["affine-lambda"] = self.config.affine_lambda
        cfg["affine-max-dim"] = self.config.affine_max_dim
        cfg.pop("local-epochs", None)  # τ is the number of GDA iterations
        return cfg

    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> list[Message]:
        """Sample; send w with each partition's stored shift (``train.fedrobust``)."""
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        self._identify(grid, nodes, chosen)
        cfg = self.client_config(config, server_round)
        return self.build_messages(chosen, lambda nid: self._content(nid, arrays, cfg), TRAIN_FEDROBUST)

    def train_step(self, server_round: int, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Store the returned shifts (Λ_i, δ_i) by partition; the example-weighted average of the w's."""
        replies = [r for r in replies if self._store(r)]
        if not replies:
            log(WARNING, "[%s] round %d: no valid training reply; model unchanged", self.run_name, server_round)
            return None, None
        # the base's FedAvg over the models only (not the shifts)
        models = [RecordDict({"arrays": r.content["arrays"], "metrics": metrics_of(r)}) for r in replies]
        return average_arrays(models, NUM_EXAMPLES), mean_of_metric_records([metrics_of(r) for r in replies])

    def unprotected(self, mechanism: str) -> str | None:
        """Each reply carries the client's adversarial affine parameters, stored by partition on the server."""
        return "per-client affine parameters (Λ_i, δ_i), returned with every reply and stored by partition"

    def shift_summary(self) -> dict[str, dict[str, float]]:
        """Partition id → ‖Λ_i − I‖_F, ‖δ_i‖₂ and the rounds of its stored shift."""
        out = {}
        for pid, s in sorted(self.state["shifts"].items()):
            lam_dev, delta_norm = shift_norms(s["lambda"], s["delta"])
            out[str(pid)] = {"lambda-dev-fro": lam_dev, "delta-norm": delta_norm, "affine-rounds": float(s["rounds"])}
        return out

    def output_files(self) -> dict[str, Any]:
        """``affine_state.json``: :meth:`shift_summary` after the last round."""
        return {"affine_state.json": self.shift_summary()}

    # ------------------------------------------------------------------ the shifts
    def _identify(self, grid: Grid, nodes: Sequence[int], chosen: Sequence[int]) -> None:
        """Ask the chosen nodes of unknown partition which one they serve, if a stored shift lacks its node."""
        served = set(self.comm.roster.nodes_of(nodes))
        orphans = set(self.state["shifts"]) - served
        unknown = [n for n in chosen if self.partition(n) is None]
        if orphans and unknown:
            content = RecordDict({"config": ConfigRecord({})})
            self.communicate(grid, self.build_messages(unknown, content, QUERY_AFFINE_STATE), phase="affine-state")

    def _content(self, node_id: int, arrays: ArrayRecord, cfg: ConfigRecord) -> RecordDict:
        """w, the node's partition's shift (when stored) and the config with its round count."""
        stored = self.state["shifts"].get(self.partition(node_id))
        node_cfg = ConfigRecord({**dict(cfg), AFFINE_ROUNDS: 0 if stored is None else int(stored["rounds"])})
        content = RecordDict({"arrays": arrays, "config": node_cfg})
        if stored is not None:
            content[AFFINE_RECORD] = ArrayRecord({"lambda": Array(stored["lambda"]), "delta": Array(stored["delta"])})
        return content

    def _store(self, reply: Message) -> bool:
        """Store the reply's shift as its partition's (False, with a failure, when it cannot be kept)."""
        nid = int(reply.metadata.src_node_id)
        pid = self.partition(nid)
        stored = self.state["shifts"].get(pid)
        rounds = 0 if stored is None else int(stored["rounds"])
        rec = reply.content.array_records.get(AFFINE_RECORD)
        if rec is None or "lambda" not in rec or "delta" not in rec:
            return self._reject(nid, "bad-arrays", f"ArrayRecord '{AFFINE_RECORD}' with 'lambda' and 'delta' missing")
        lam, delta = rec["lambda"].numpy(), rec["delta"].numpy()
        d = delta.shape[0] if delta.ndim == 1 else -1
        if lam.shape != (d, d) or (stored is not None and stored["delta"].shape != (d,)):
            return self._reject(nid, "bad-arrays", f"shift of shapes Λ {lam.shape}, δ {delta.shape} does not fit "
                                                   f"the partition's d")
        if not (np.isfinite(lam).all() and np.isfinite(delta).all()):
            return self._reject(nid, "nonfinite", "the shift (Λ_i, δ_i) holds NaN/Inf")
        got = metrics_of(reply).get(AFFINE_ROUNDS)
        if not isinstance(got, int | float) or int(got) != rounds + 1:
            return self._reject(nid, "stale-shift", f"affine-rounds {got} in the reply, expected {rounds + 1}: the "
                                                    f"node trained from another shift than partition {pid}'s")
        self.state["shifts"][pid] = {"lambda": np.array(lam, dtype=np.float32), "delta": np.array(delta, np.float32),
                                     "rounds": rounds + 1}
        return True

    def _reject(self, node_id: int, kind: str, reason: str) -> bool:
        """Count a reply that passed the communicator's checks but not the shift's as a train failure."""
        self.comm.judge.retract("train", node_id, kind, reason)
        return False


# --------------------------------------------------------------------------- adversarial training
@dataclass(frozen=True)
class FGMSettings(FedAvgSettings):
    """Distributed FGM adversarial training: one ℓ₂ step of size ε per minibatch."""

    adv_eps: float = setting(1.0, "ε, the ℓ₂ radius of the per-sample attack", ge=0, knob=Knob(0.1, 3.0, "log"))


@dataclass(frozen=True)
class PGDSettings(FGMSettings):
    """Distributed PGD adversarial training: K projected ℓ₂ steps of size α per minibatch."""

    pgd_steps: int = setting(10, "K, projected steps of the attack", ge=1)
    pgd_step_size: float | None = setting(None, "α, the attack's step (unset: 2.5ε/K on the client)", gt=0)


class AdversarialTraining(_MeanOfModels, FairStrategy):
    r"""Distributed ℓ₂ adversarial training: FedAvg over local SGD on attacked minibatches.

    Each sampled node takes τ SGD steps on minibatches replaced by their per-sample ℓ₂
    attack of radius ε (FGM: x + ε∇ₓℓ/‖∇ₓℓ‖; PGD: K projected steps of size α); the
    server averages the models weighted by ``num-examples`` (the base's aggregation).
    Subclasses fix the attack (:attr:`kind`).
    """

    #: The attack used in training (message type ``train.<kind>``).
    kind: ClassVar[str] = ""
    config: FGMSettings

    def train_step(self, server_round: int, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The mean of the models, weighted by ``num-examples`` (or equally with ``weighting = "uniform"``)."""
        if not replies or not self.uniform_mean():
            return super().train_step(server_round, replies)
        models = [RecordDict({"arrays": r.content["arrays"], "metrics": MetricRecord({UNIFORM_WEIGHT: 1.0})})
                  for r in replies]
        return (average_arrays(models, UNIFORM_WEIGHT),
                mean_of_metric_records([metrics_of(r) for r in replies]))

    def attack_config(self) -> dict[str, Any]:
        """The attack's keys of the training config."""
        return {"adv-eps": self.config.adv_eps}

    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> list[Message]:
        """Send the model, the training settings and the attack's to a seeded sample (``train.<kind>``)."""
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        cfg = self.train_config(config, server_round)
        cfg.update(self.attack_config())
        content = RecordDict({"arrays": arrays, "config": cfg})
        return self.build_messages(chosen, content, f"train.{self.kind}")


class FedAvgFGM(AdversarialTraining):
    """FedAvg over FGM adversarial training (the paper's distributed FGM baseline)."""

    name: ClassVar[str] = "fedavg-fgm"
    kind: ClassVar[str] = "fgm"
    settings_class: ClassVar[type[Settings]] = FGMSettings


class FedAvgPGD(AdversarialTraining):
    """FedAvg over PGD adversarial training (the paper's distributed PGD baseline)."""

    name: ClassVar[str] = "fedavg-pgd"
    kind: ClassVar[str] = "pgd"
    settings_class: ClassVar[type[Settings]] = PGDSettings
    config: PGDSettings

    def attack_config(self) -> dict[str, Any]:  # noqa: D102
        out = {**super().attack_config(), "pgd-steps": self.config.pgd_steps}
        if self.config.pgd_step_size is not None:
            out["pgd-step-size"] = self.config.pgd_step_size
        return out

