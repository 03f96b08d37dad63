"""DR-DSGD and DSGD: decentralised SGD over a graph, with the gossip relayed by the server.

Ben Issaid, Elgabli and Bennis, "DR-DSGD: A Distributionally Robust Decentralized
Learning Algorithm over Graphs", TMLR 2022, https://openreview.net/forum?id=VcXNAr5Rur.

DR-DSGD minimises (1/K) Σ_i exp(f_i(θ)/μ), a monotone transform of the KL-regularised
DRO problem min_θ max_{λ∈Δ} Σ_i λ_i f_i(θ) − μ·KL(λ ‖ 1/K). Each of the K devices
keeps its own model θ_i; at iteration t every device i (Alg. 2)

1. takes a local tilted SGD step (client side, :mod:`flowerdro.clients.drdsgd`)

       θ_i^{t+½} = θ_i^t − η · (h_i/μ) · g_i(θ_i^t),   h_i = exp(ℓ_i(θ_i^t)/μ),

   with g_i a minibatch gradient (batch B); DSGD uses h_i/μ = 1;
2. gossips with its neighbours in the graph G_t (server side, here)

       θ_i^{t+1} = Σ_j W_ij θ_j^{t+½},

   with the Metropolis mixing matrix W_t of G_t (:mod:`flowerdro.core.gossip`; the graphs
   come from :mod:`flowerdro.core.graphs`).

The paper takes one local step per gossip step; ``steps-per-gossip`` says how many, and
the clients' ``local-steps`` (τ of the other algorithms of a comparison) never applies.

Flower is a star network, so this strategy *relays* the gossip: the server holds the K
device models, keyed by partition id (a node that restarts with a new node id takes its
partition's place), sends every node *its own* θ_i in ``train.drdsgd`` (or
``train.dsgd``), and mixes the returned half-step models with W_t. Nothing is averaged
globally except the reported θ̄ = (1/K) Σ_i θ_i. By default (``eval-model = "own"``) each
node is evaluated on its own model θ_i; with ``"average"`` every node evaluates θ̄ on its
own test set instead (reporting only: θ̄ is never sent in a train message). A device whose
reply is dropped (error, timeout, NaN, wrong shape, node gone) keeps θ_i^{t+½} = θ_i^t,
i.e. it is mixed as if it had not moved. The device models keep the dtype of the initial
model whatever dtype the clients reply with.

The step multiplier h_i/μ is used as the paper states it; the clients only cap it at
e^50 as an overflow guard that does not bind in the paper's regimes. ``max-tilt-weight``
M (or ``tilt-log-cap`` c = log M) caps it lower, min(h_i/μ, M); a cap that binds is a
safeguard of ours against the divergence of small μ, not part of the paper.

In a peer-to-peer deployment the same iteration exchanges, over every edge (i, j) of
G_t, θ_i^{t+½} from i to j and θ_j^{t+½} from j to i (2·|E_t| model transfers per
iteration, logged as ``transfers``); each node needs only its row W_i· (its own degree
and its neighbours' degrees). The relay sends K models down and K up instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.core.gossip import (
    average_models,
    consensus_distance,
    edges_used,
    mix,
    spectral_gap_rho,
)
from flowerdro.core.graphs import TOPOLOGIES, GraphSchedule
from flowerdro.core.tilted import DEFAULT_LOG_CAP, MAX_LOG_CAP, MIN_LOG_CAP, log_cap_from_max_weight
from flowerdro.privacy import LOCAL_DP
from flowerdro.protocol import NUM_EXAMPLES
from flowerdro.runs.codec import register_state
from flowerdro.settings import Knob, Settings, setting
from flowerdro.strategies.arrays import arrays_to_numpy, numpy_to_arrays
from flowerdro.strategies.base import FairStrategy
from flowerdro.strategies.replies import metrics_of

__all__ = ["DRDSGD", "DSGD", "EVAL_MODELS", "TRAIN_DRDSGD", "TRAIN_DSGD", "DRDSGDSettings", "GossipSettings",
           "GossipState"]

#: Message types of the train phase (the ClientApp routes both to the same handler).
TRAIN_DRDSGD, TRAIN_DSGD = "train.drdsgd", "train.dsgd"

#: Which model a device evaluates: its own θ_i, or the consensus average θ̄.
EVAL_MODELS = ("own", "average")

Layers = list[np.ndarray]


@dataclass(frozen=True)
class GossipSettings(Settings):
    """DSGD: the graph, the local steps per gossip step and the evaluated model."""

    topology: str = setting("erdos_renyi", "the communication graph G_t", choices=tuple(TOPOLOGIES))
    graph_p: float = setting(0.3, "edge probability of erdos_renyi (resampled until connected)", gt=0, le=1)
    graph_radius: float = setting(0.5, "connection radius of geometric (points in the unit square)", gt=0,
                                  le=math.sqrt(2.0))
    graph_rows: int = setting(0, "rows of grid (0: the most square factorisation of K)", ge=0)
    graph_resample: bool = setting(False, "draw a new random graph at every iteration (the paper's Remark 4)")
    graph_seed: int | None = setting(None, "seed of the random graph(s) (unset: seed)", ge=0)
    num_partitions: int | None = setting(None, "K, the devices of the graph (unset: the nodes connected at "
                                               "the first round)", ge=1)
    steps_per_gossip: int = setting(1, "local SGD steps between two gossip steps (the paper: 1); "
                                       "local-steps does not apply", ge=1)
    eval_model: str = setting("own", "the model each device evaluates: its own θ_i, or the average θ̄",
                              choices=EVAL_MODELS)

    def graph_params(self) -> dict[str, Any]:
        """The keyword arguments of :func:`flowerdro.core.graphs.make_graph` for this topology."""
        if self.topology == "erdos_renyi":
            return {"p": self.graph_p}
        if self.topology == "geometric":
            return {"radius": self.graph_radius}
        return {"rows": self.graph_rows} if self.topology == "grid" and self.graph_rows else {}


@dataclass(frozen=True)
class DRDSGDSettings(GossipSettings):
    """DR-DSGD: DSGD's settings and the tilted step's μ and cap."""

    mu: float = setting(6.0, "μ, the KL regulariser of the DRO problem (smaller: more robust)", gt=0,
                        knob=Knob(1.0, 20.0, "log"))
    tilt_log_cap: float = setting(DEFAULT_LOG_CAP, "c: the clients cap the step multiplier h/μ at e^c (50: an "
                                                   "overflow guard that does not bind in the paper's regimes)",
                                  ge=MIN_LOG_CAP, le=MAX_LOG_CAP)
    max_tilt_weight: float | None = setting(None, "M: cap h/μ at M itself (c = log M; a safeguard, not in the "
                                                  "paper)", gt=0)

    def check(self) -> None:
        """``max-tilt-weight`` and ``tilt-log-cap`` are two ways to give one cap: not both."""
        if self.max_tilt_weight is not None:
            if self.tilt_log_cap != DEFAULT_LOG_CAP:
                raise ValueError("max-tilt-weight: give either max-tilt-weight M or tilt-log-cap c = log M, not "
                                 f"both (got M={self.max_tilt_weight}, c={self.tilt_log_cap})")
            log_cap_from_max_weight(self.max_tilt_weight)

    @property
    def log_cap(self) -> float:
        """c, the cap on log(h/μ) the clients apply: log M when M is given, else ``tilt-log-cap``."""
        if self.max_tilt_weight is not None:
            return log_cap_from_max_weight(self.max_tilt_weight)
        return self.tilt_log_cap


@register_state
@dataclass
class GossipState:
    """What the relay keeps between iterations (checkpointed by ``server_state``).

    ``models`` holds θ_i by partition id, ``order`` the partition ids in row order of W
    (sorted; fixed at the first iteration), ``gram_sum`` Σ_t W_tᵀW_t over the
    ``iterations`` so far (for ρ of a resampled graph). The graphs themselves are a pure
    function of (graph seed, t) and are rebuilt, not stored.
    """

    keys: list[str] = field(default_factory=list)
    models: dict[int, Layers] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    gram_sum: np.ndarray | None = None
    iterations: int = 0


class DRDSGD(FairStrategy):
    """DR-DSGD with a server-relayed gossip (DSGD: :class:`DSGD`).

    Per iteration t (= server round t + 1, one train phase):

    * send device i its own θ_i^t in ``train.drdsgd`` with ``local-steps`` =
      ``steps-per-gossip`` (1 in the paper), ``mu`` μ and ``tilt-log-cap`` c;
    * receive θ_i^{t+½} = θ_i^t − η (h_i/μ) g_i(θ_i^t); a dropped reply leaves θ_i^{t+½} = θ_i^t;
    * mix θ_i^{t+1} = Σ_j W_ij θ_j^{t+½} with W = W_t of :class:`GraphSchedule` (row i: the
      i-th partition id in increasing order).

    Every device steps at every iteration: ``fraction-train`` must be 1 (the registry pins it).
    """

    name: ClassVar[str] = "drdsgd"
    settings_class: ClassVar[type[Settings]] = DRDSGDSettings
    #: Tilted steps (True) or plain SGD steps (False, DSGD).
    robust: ClassVar[bool] = True
    config: GossipSettings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.loop.fraction_train != 1.0:
            raise ValueError(f"fraction-train: {self.name} steps every device at every iteration; must be 1, "
                             f"got {self.loop.fraction_train}")
        self.training = replace(self.training, local_steps=self.config.steps_per_gossip, local_epochs=0.0)
        self.graph_seed = self.loop.seed if self.config.graph_seed is None else self.config.graph_seed
        self._schedule: GraphSchedule | None = None
        if self.config.num_partitions is not None:
            self._schedule_for(self.config.num_partitions)  # a graph that cannot be built fails here
        if self.robust and self.tilt.log_cap < DEFAULT_LOG_CAP:
            log(WARNING, "[%s] h/mu capped at %.4g (tilt-log-cap %.4g): a safeguard, not in the paper",
                self.run_name, math.exp(self.tilt.log_cap), self.tilt.log_cap)
        self.state = GossipState()
        self._extras: dict[str, Any] = {}
        self._plan: tuple[Any, ...] | None = None

    @property
    def tilt(self) -> DRDSGDSettings:
        """The tilted step's settings μ and cap (DR-DSGD only)."""
        if not isinstance(self.config, DRDSGDSettings):
            raise AttributeError(f"{self.name} takes no tilted steps")
        return self.config

    # ------------------------------------------------------------------ graph
    def _schedule_for(self, num_devices: int) -> GraphSchedule:
        if self._schedule is None or self._schedule.num_nodes != num_devices:
            try:
                self._schedule = GraphSchedule(self.config.topology, num_devices, base_seed=self.graph_seed,
                                               resample=self.config.graph_resample,
                                               params=self.config.graph_params())
            except ValueError as exc:
                raise ValueError(f"topology: cannot build a {self.config.topology!r} graph on K={num_devices} "
                                 f"devices (num-partitions / connected nodes; graph-p, graph-radius, graph-rows):"
                                 f" {exc}") from None
        return self._schedule

    def mixing_matrix(self, t: int) -> np.ndarray:
        """W_t, the (K, K) Metropolis mixing matrix of iteration t ≥ 0 (rows in ``state.order``)."""
        num = len(self.state.order) or self.config.num_partitions
        if not num:
            raise RuntimeError("mixing_matrix: K is not known yet (no round has run and num-partitions is unset)")
        return self._schedule_for(num).mixing_matrix(t)

    def settings(self) -> dict[str, Any]:
        """The settings, the variant, the caps in effect and ρ of a fixed graph."""
        out = super().settings()
        out["algorithm"] = "DR-DSGD" if self.robust else "DSGD"
        out["graph_seed"] = self.graph_seed
        if self.robust:
            out["tilt_log_cap"] = self.tilt.log_cap
            out["max_tilt_weight"] = math.exp(self.tilt.log_cap)
            out["tilt_cap_departs_from_paper"] = self.tilt.log_cap < DEFAULT_LOG_CAP
        if self._schedule is not None and not self.config.graph_resample:
            out["rho"] = spectral_gap_rho(self._schedule.mixing_matrix(0))
        return out

    # ------------------------------------------------------------------ the round
    def on_start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None) -> None:
        """θ_i^0 = ``initial_arrays`` on every device (set at the first round, when K is known)."""
        self.state = GossipState()

    train_required_metrics: ClassVar[tuple[str, ...]] = ("train_loss", "log_tilt_weight")

    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> list[Message]:
        """Every device its own θ_i^t (θ^0 = ``arrays`` at the first iteration) in ``train.drdsgd``."""
        first = not self.state.models
        targets = self._first_targets(grid, arrays) if first else self._targets(grid)
        st = self.state
        cfg = self._message_config(config, server_round)
        mtype = TRAIN_DRDSGD if self.robust else TRAIN_DSGD
        theta0 = arrays_to_numpy(arrays) if first else None
        self._plan = (first, list(targets), theta0)
        return self.build_messages(targets, lambda nid: RecordDict({
            "arrays": numpy_to_arrays(st.keys, theta0 if theta0 is not None else st.models[targets[nid]]),
            "config": ConfigRecord(dict(cfg))}), mtype)

    def train_step(self, server_round: int, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One gossip step θ_i^{t+1} = Σ_j W_ij θ_j^{t+½}; returns θ̄ (for reporting only)."""
        if self._plan is None:
            return None, None
        first, targets, theta0 = self._plan
        self._plan = None
        st = self.state
        if first:
            self._fix_devices(self.grid, targets, theta0)  # type: ignore[arg-type]
        half = dict(st.models)  # θ_i^t for a device without a valid reply
        per_device: dict[int, dict[str, float]] = {}
        for reply in replies:
            pid = self._device_of(int(reply.metadata.src_node_id))
            if pid not in st.models:
                continue
            rec = reply.content.array_records["arrays"]
            half[pid] = [np.asarray(rec[k].numpy(), dtype=a.dtype) for k, a in zip(st.keys, st.models[pid],
                                                                                     strict=True)]
            per_device[pid] = {k: float(v) for k, v in metrics_of(reply).items() if isinstance(v, int | float)}
        if len(per_device) < len(st.order):
            log(INFO, "[%s] iteration %d: %d of %d devices kept θ_i^t (no valid reply)", self.run_name,
                server_round, len(st.order) - len(per_device), len(st.order))
        W = self.mixing_matrix(server_round - 1)
        st.models = dict(zip(st.order, mix([half[p] for p in st.order], W), strict=True))
        st.gram_sum = W.T @ W if st.gram_sum is None else st.gram_sum + W.T @ W
        st.iterations += 1
        self._extras = self._compute_extras(W, per_device)
        return self.average_model(), self._train_metrics_of(per_device)

    def unprotected(self, mechanism: str) -> str | None:
        """The server keeps every device's own model θ_i and mixes them per node: there is no one aggregate."""
        if mechanism == LOCAL_DP:
            return None
        return ("each device's own model θ_i^{t+½}, kept by the server per device and mixed row by row with W "
                "(there is no single aggregate for the mechanism to noise or to sum)")

    def _message_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        cfg = self.train_config(config, server_round)
        cfg["local-steps"] = self.config.steps_per_gossip  # whatever the run's local-steps says
        cfg.pop("local-epochs", None)
        if self.robust:
            cfg["mu"] = self.tilt.mu
            cfg["tilt-log-cap"] = self.tilt.log_cap
        return cfg

    def _device_of(self, node_id: int) -> int:
        """The device (partition id) a node serves; a node that never said stands for its node id."""
        pid = self.partition(node_id)
        return node_id if pid is None else pid

    def _first_targets(self, grid: Grid, arrays: ArrayRecord) -> dict[int, int]:
        """Every connected node gets θ^0 (their partitions are learned from the replies)."""
        want = self.config.num_partitions
        start = time.monotonic()
        nodes = self.nodes(grid)
        while want is not None and len(nodes) < want and time.monotonic() - start < self.wait_timeout:
            time.sleep(1.0)
            nodes = self.nodes(grid)
        if want is not None and len(nodes) != want:
            raise ValueError(f"num-partitions: the graph has K={want} devices but {len(nodes)} nodes are connected;"
                             f" {self.name} needs exactly one node per device")
        self._schedule_for(len(nodes))
        self.state.keys = list(arrays.keys())
        return {nid: -1 for nid in nodes}

    def _fix_devices(self, grid: Grid, nodes: list[int], theta0: Layers) -> None:
        """After the first replies: ask the silent nodes their partition, and put θ^0 on every device."""
        self._discover(grid, [n for n in nodes if self.partition(n) is None])
        self.state.order = sorted(self._device_of(n) for n in nodes)
        self.state.models = {p: [a.copy() for a in theta0] for p in self.state.order}

    def _targets(self, grid: Grid) -> dict[int, int]:
        """Node id → device for every connected node that serves a device (new nodes asked first)."""
        connected = self.nodes(grid)
        self._discover(grid, [n for n in connected if self.partition(n) is None])
        out: dict[int, int] = {}
        for nid in connected:
            pid = self.partition(nid)
            if pid is not None and pid in self.state.models:
                out[nid] = pid
        return out

    def _discover(self, grid: Grid, node_ids: list[int]) -> None:
        """Learn the partition of nodes never heard from (a restarted node) with ``query.init``."""
        if node_ids:
            msgs = self.build_messages(node_ids, RecordDict({"config": ConfigRecord({"seed": self.loop.seed})}),
                                       "query.init")
            self.communicate(grid, msgs, phase="query")

    def _train_metrics_of(self, per_device: dict[int, dict[str, float]]) -> MetricRecord | None:
        if not per_device:
            return None
        vals = list(per_device.values())
        return MetricRecord({
            "train_loss": float(np.mean([v["train_loss"] for v in vals])),
            "train_loss_worst": float(np.max([v["train_loss"] for v in vals])),
            "log_tilt_weight_max": float(np.max([v["log_tilt_weight"] for v in vals])),
            "tilt_capped": float(sum(v.get("tilt_capped", 0.0) for v in vals)),
            "devices_stepped": float(len(vals)),
            NUM_EXAMPLES: float(sum(v[NUM_EXAMPLES] for v in vals)),
        })

    def _compute_extras(self, W: np.ndarray, per_device: dict[int, dict[str, float]]) -> dict[str, Any]:
        st = self.state
        K = len(st.order)
        out: dict[str, Any] = {
            "consensus_distance": consensus_distance([st.models[p] for p in st.order]),
            "transfers": 2 * edges_used(W),
            "rho": spectral_gap_rho(W),
        }
        if self.config.graph_resample and st.gram_sum is not None:
            mean_gram = st.gram_sum / st.iterations
            out["rho_expected"] = float(np.linalg.norm(mean_gram - np.full((K, K), 1.0 / K), ord=2))
        devices = sorted(per_device.items())
        if self.robust:
            out["log_tilt_weight"] = {str(p): round(v["log_tilt_weight"], 6) for p, v in devices}
        out["train_loss_device"] = {str(p): round(v["train_loss"], 6) for p, v in devices}
        capped = [str(p) for p, v in devices if v.get("tilt_capped", 0) > 0]
        if capped:
            out["tilt_capped_devices"] = capped
        return out

    def round_extras(self) -> dict[str, Any]:
        """Consensus distance Ξ, model transfers 2|E_t|, ρ of W_t, per-device log(h_i/μ)."""
        return dict(self._extras)

    # ------------------------------------------------------------------ models out
    def average_model(self) -> ArrayRecord:
        """θ̄ = (1/K) Σ_i θ_i (reporting only; DR-DSGD never broadcasts it)."""
        return numpy_to_arrays(self.state.keys, average_models([self.state.models[p] for p in self.state.order]))

    def device_model(self, partition_id: int) -> ArrayRecord:
        """θ_i of the device holding ``partition_id``."""
        if partition_id not in self.state.models:
            raise KeyError(f"partition-id: no device with partition {partition_id} is known")
        return numpy_to_arrays(self.state.keys, self.state.models[partition_id])

    def output_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """θ̄, the average of the device models (for reporting)."""
        return self.average_model() if self.state.models else arrays

    def output_files(self) -> dict[str, Any]:
        """``device_models.npz``: every θ_i, as ``"<partition>/<layer>"`` entries."""
        return {"device_models.npz": {f"{p}/{k}": a for p in self.state.order
                                      for k, a in zip(self.state.keys, self.state.models[p], strict=True)}}

    # ------------------------------------------------------------------ evaluation
    def evaluate_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                          ) -> Iterable[Message]:
        """Every device evaluates θ_i (``eval-model = "own"``) or θ̄ (``"average"``) on its own test set.

        θ̄ = (1/K) Σ_j θ_j^t over all K devices (:meth:`average_model`), the same for every
        device; messages of type ``evaluate``.
        """
        st = self.state
        if not st.models:
            return []
        average = arrays_to_numpy(self.average_model()) if self.config.eval_model == "average" else None
        nodes = [nid for nid in self.nodes(grid) if self.partition(nid) in st.models]
        k = max(1, round(self.loop.fraction_evaluate * len(nodes)))
        chosen = nodes if k >= len(nodes) else sorted(self.sample(nodes, k))
        cfg = config

        def content(nid: int) -> RecordDict:
            layers = average if average is not None else st.models[self.partition(nid)]  # type: ignore[index]
            return RecordDict({"arrays": numpy_to_arrays(st.keys, layers), "config": ConfigRecord(dict(cfg))})

        return self.build_messages(chosen, content, MessageType.EVALUATE)


class DSGD(DRDSGD):
    """DSGD: plain local SGD steps + Metropolis gossip (DR-DSGD with h/μ = 1), messages ``train.dsgd``."""

    name: ClassVar[str] = "dsgd"
    settings_class: ClassVar[type[Settings]] = GossipSettings
    robust: ClassVar[bool] = False
