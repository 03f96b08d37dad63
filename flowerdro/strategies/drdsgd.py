"""DR-DSGD and DSGD: decentralised SGD over a graph, with the gossip relayed by the server.

Ben Issaid, Elgabli and Bennis, "DR-DSGD: A Distributionally Robust Decentralized
Learning Algorithm over Graphs", TMLR 2022, https://openreview.net/forum?id=VcXNAr5Rur.

DR-DSGD minimises (1/K) Σ_i exp(f_i(θ)/μ), a monotone transform of the KL-regularised
DRO problem min_θ max_{λ∈Δ} Σ_i λ_i f_i(θ) − μ·KL(λ ‖ 1/K). Each of the K devices
keeps its own model θ_i; at iteration t every device i

1. takes a local tilted SGD step (client side, :mod:`flowerdro.clients.drdsgd`)

       θ_i^{t+½} = θ_i^t − η · (h_i/μ) · g_i(θ_i^t),   h_i = exp(ℓ_i(θ_i^t)/μ),

   with g_i a minibatch gradient (batch B); DSGD uses h_i/μ = 1;
2. gossips with its neighbours in the graph G_t (server side, here)

       θ_i^{t+1} = Σ_j W_ij θ_j^{t+½},

   with the Metropolis mixing matrix W = ``metropolis_weights(G)``
   (:mod:`flowerdro.core.graphs`).

Flower is a star network, so this strategy *relays* the gossip: the server holds the K
device models and W, sends every node *its own* θ_i in ``train.drdsgd`` (or
``train.dsgd``), and mixes the returned half-step models with W. Nothing is averaged
globally except the reported θ̄ = (1/K) Σ_i θ_i. By default (``eval_model="own"``) each
node is evaluated on its own model θ_i; with ``eval_model="average"`` every node evaluates
the consensus average θ̄ on its own test set instead (reporting only: θ̄ is never sent in
a train message). A node whose reply is dropped (error, timeout, NaN, wrong shape) keeps
θ_i^{t+½} = θ_i^t, i.e. it is mixed as if it had not moved.

The step multiplier h_i/μ is used as the paper states it; the clients only cap it at
e^50 as an overflow guard that does not bind in the paper's regimes. ``max_tilt_weight``
M (or ``log_cap`` c = log M) caps it lower, min(h_i/μ, M); a cap that binds is a
safeguard of ours against the divergence of small μ, not part of the paper.

In a peer-to-peer deployment the same iteration exchanges, over every edge (i, j) of
G_t, θ_i^{t+½} from i to j and θ_j^{t+½} from j to i (2·|E_t| model transfers per
iteration, logged as ``transfers``); each node needs only its row W_i· (its own degree
and its neighbours' degrees). The relay sends K models down and K up instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from flowerdro.core.graphs import (
    TOPOLOGIES,
    GraphSchedule,
    consensus_distance,
    edges_used,
    mix,
    spectral_gap_rho,
)
from flowerdro.core.tilted import (
    DEFAULT_LOG_CAP,
    MAX_LOG_CAP,
    MIN_LOG_CAP,
    log_cap_from_max_weight,
)
from flowerdro.strategies.base import (
    NUM_EXAMPLES,
    FairStrategy,
    arrays_to_numpy,
    numpy_to_arrays,
)

#: Message types of the train phase (the ClientApp routes both to the same handler).
TRAIN_DRDSGD, TRAIN_DSGD = "train.drdsgd", "train.dsgd"

#: Which model a device evaluates: its own θ_i, or the consensus average θ̄.
EVAL_MODELS = ("own", "average")

Layers = list[np.ndarray]


class DRDSGD(FairStrategy):
    """DR-DSGD (``robust=True``) or DSGD (``robust=False``) with a server-relayed gossip.

    Per iteration t (= server round t + 1, one train phase):

    * send node i its own θ_i^t in ``train.drdsgd`` / ``train.dsgd`` with config
      ``lr`` η, ``batch-size`` B, ``local-steps`` (1 in the paper), ``mu`` μ,
      ``tilt-log-cap`` c, ``seed``, ``server-round``;
    * receive θ_i^{t+½} = θ_i^t − η (h_i/μ) g_i(θ_i^t) (DSGD: h_i/μ = 1); a dropped
      reply leaves θ_i^{t+½} = θ_i^t;
    * mix θ_i^{t+1} = Σ_j W_ij θ_j^{t+½} with W = W_t of :class:`GraphSchedule`.

    Row i of W is the i-th node in order of partition id (learned from the first
    replies; a node whose partition is still unknown then comes last, by node id).

    Parameters
    ----------
    mu : float (default: 6.0)
        μ > 0, the KL regulariser (smaller is more robust). Ignored by DSGD.
    robust : bool (default: True)
        DR-DSGD (True) or DSGD (False).
    topology : str (default: "erdos_renyi")
        ``erdos_renyi``, ``ring``, ``grid``, ``geometric`` or ``complete``.
    p : float, optional
        Edge probability of ``erdos_renyi`` in (0, 1] (default 0.3 for that topology).
    radius : float, optional
        Radius of ``geometric`` in (0, √2] (default 0.5 for that topology).
    rows : int, optional
        Rows of ``grid`` (default: the most square factorisation of K).
    resample : bool (default: False)
        Draw a new random graph at every iteration (the paper's Remark 4).
    graph_seed : int, optional
        Seed of the random graph(s), ≥ 0 (default: ``seed``).
    num_nodes : int, optional
        K. When given, the graph is built (and validated) at construction and the round
        loop waits for K nodes; otherwise K is the number of connected nodes at round 1.
    local_steps : int (default: 1)
        Local steps per iteration (the paper takes one).
    log_cap : float (default: DEFAULT_LOG_CAP = 50.0)
        c ∈ [−709, 709]: clients cap h/μ at e^c. The default is an overflow guard that
        does not bind in the paper's regimes; a smaller c departs from the paper.
    max_tilt_weight : float, optional
        M > 0: cap h/μ at M itself (sets c = log M; give either this or ``log_cap``).
        Not in the paper: a safeguard against the runaway of small μ (a device whose loss
        rises takes a larger step). M = 1 never steps further than DSGD.
    eval_model : str (default: "own")
        ``own``: device i evaluates its own θ_i (rewards personalised models when the
        test sets have the devices' label mixes); ``average``: every device evaluates the
        consensus average θ̄ = (1/K) Σ_j θ_j on its own test set.
    **kwargs
        Passed to :class:`FairStrategy` (``fraction_train`` must stay 1: every device
        steps at every iteration).

    Raises
    ------
    ValueError
        μ ≤ 0, an unknown topology, p outside (0, 1], radius outside (0, √2], K too small
        for the topology, a disconnected graph, fraction_train < 1, a bad log_cap /
        max_tilt_weight or both given, an unknown eval_model.
    """

    name = "drdsgd"

    def __init__(
        self,
        *,
        mu: float = 6.0,
        robust: bool = True,
        topology: str = "erdos_renyi",
        p: float | None = None,
        radius: float | None = None,
        rows: int | None = None,
        resample: bool = False,
        graph_seed: int | None = None,
        num_nodes: int | None = None,
        local_steps: int = 1,
        log_cap: float = DEFAULT_LOG_CAP,
        max_tilt_weight: float | None = None,
        eval_model: str = "own",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.robust = bool(robust)
        self.name = "drdsgd" if self.robust else "dsgd"
        self.run_name = kwargs.get("run_name") or self.name
        if self.fraction_train != 1.0:
            raise ValueError(
                f"fraction-train: {self.name} steps every device at every iteration; must be 1, "
                f"got {self.fraction_train}"
            )
        if (
            isinstance(mu, bool)
            or not isinstance(mu, int | float)
            or not math.isfinite(mu)
            or mu <= 0
        ):
            raise ValueError(f"mu: must be a finite number > 0, got {mu!r}")
        if topology not in TOPOLOGIES:
            raise ValueError(
                f"topology: unknown topology {topology!r}; allowed: {', '.join(sorted(TOPOLOGIES))}"
            )
        if topology == "erdos_renyi":
            p = 0.3 if p is None else float(p)
            if not 0.0 < p <= 1.0:
                raise ValueError(
                    f"graph-p: the Erdős–Rényi edge probability must be in (0, 1], got {p}"
                )
        if topology == "geometric":
            radius = 0.5 if radius is None else float(radius)
            if not 0.0 < radius <= math.sqrt(2.0):
                raise ValueError(f"graph-radius: must be in (0, √2], got {radius}")
        if local_steps < 1:
            raise ValueError(f"local-steps: must be >= 1, got {local_steps}")
        if max_tilt_weight is not None:
            if float(log_cap) != DEFAULT_LOG_CAP:
                raise ValueError(
                    "max-tilt-weight: give either max-tilt-weight M or tilt-log-cap c = log M, "
                    f"not both (got M={max_tilt_weight}, c={log_cap})"
                )
            log_cap = log_cap_from_max_weight(max_tilt_weight)
        if not MIN_LOG_CAP <= float(log_cap) <= MAX_LOG_CAP:
            raise ValueError(
                f"tilt-log-cap: must be in [{MIN_LOG_CAP}, {MAX_LOG_CAP}], got {log_cap}"
            )
        if eval_model not in EVAL_MODELS:
            raise ValueError(
                f"eval-model: unknown value {eval_model!r}; allowed: {', '.join(EVAL_MODELS)}"
            )
        graph_seed = self.seed if graph_seed is None else int(graph_seed)
        if graph_seed < 0:
            raise ValueError(f"graph-seed: must be >= 0, got {graph_seed}")
        self.mu = float(mu)
        self.topology = topology
        self.graph_params: dict[str, Any] = {
            k: v for k, v in (("p", p), ("radius", radius), ("rows", rows)) if v is not None
        }
        self.resample = bool(resample)
        self.graph_seed = graph_seed
        self.local_steps = int(local_steps)
        self.log_cap = float(log_cap)
        self.eval_model = eval_model
        if self.robust and self.log_cap < DEFAULT_LOG_CAP:
            log(
                WARNING,
                "[%s] h/mu capped at %.4g (tilt-log-cap %.4g): a safeguard, not in the paper",
                self.run_name,
                math.exp(self.log_cap),
                self.log_cap,
            )
        self.num_nodes: int | None = None
        self.schedule: GraphSchedule | None = None
        if num_nodes is not None:
            self._build_schedule(int(num_nodes))
            self.min_available_nodes = max(self.min_available_nodes, int(num_nodes))
        self._reset_state()

    # ------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        #: θ_i per node id (layer lists in the order of ``self.keys``).
        self.models: dict[int, Layers] | None = None
        self.keys: list[str] = []
        #: node ids in row order of W (fixed at the first mix).
        self.order: list[int] | None = None
        self.W: np.ndarray | None = None
        self._gram_sum: np.ndarray | None = None
        self._iterations = 0
        self._extras: dict[str, Any] = {}

    def _build_schedule(self, num_nodes: int) -> None:
        try:
            self.schedule = GraphSchedule(
                self.topology,
                num_nodes,
                base_seed=self.graph_seed,
                resample=self.resample,
                params=dict(self.graph_params),
            )
        except ValueError as exc:
            keys = {"p": "graph-p", "radius": "graph-radius", "rows": "graph-rows"}
            given = ", ".join(f"{keys[k]}={v}" for k, v in self.graph_params.items())
            raise ValueError(
                f"topology: cannot build a {self.topology!r} graph on K={num_nodes} devices "
                f"(num-partitions / connected nodes{', ' + given if given else ''}): {exc}"
            ) from None
        self.num_nodes = num_nodes

    def mixing_matrix(self, t: int) -> np.ndarray:
        """W_t, the (K, K) Metropolis mixing matrix of iteration t ≥ 0 (rows in ``self.order``)."""
        if self.schedule is None:
            raise RuntimeError(
                "mixing_matrix: K is not known yet (no round has run and num_nodes was not given)"
            )
        return self.schedule.mixing_matrix(t)

    def settings(self) -> dict[str, Any]:  # noqa: D102
        out = super().settings()
        out.update(
            {
                "algorithm": "DR-DSGD" if self.robust else "DSGD",
                "mu": self.mu if self.robust else None,
                "topology": self.topology,
                **{f"graph_{k}": v for k, v in self.graph_params.items()},
                "graph_resample": self.resample,
                "graph_seed": self.graph_seed,
                "num_nodes": self.num_nodes,
                "local_steps": self.local_steps,
                "tilt_log_cap": self.log_cap if self.robust else None,
                "max_tilt_weight": math.exp(self.log_cap) if self.robust else None,
                "tilt_cap_departs_from_paper": self.robust and self.log_cap < DEFAULT_LOG_CAP,
                "eval_model": self.eval_model,
            }
        )
        if self.schedule is not None and not self.resample:
            out["rho"] = spectral_gap_rho(self.schedule.mixing_matrix(0))
        return out

    # ------------------------------------------------------------------ the round
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Any = None,
    ) -> Result:
        """Run ``num_rounds`` iterations from θ_i^0 = ``initial_arrays`` on every device."""
        self._reset_state()
        return super().start(
            grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn
        )

    def _init_models(self, grid: Grid, arrays: ArrayRecord) -> None:
        nodes = self.nodes(grid)
        if self.schedule is None:
            self._build_schedule(len(nodes))
        assert self.num_nodes is not None
        if len(nodes) != self.num_nodes:
            raise ValueError(
                f"num-partitions: the graph has K={self.num_nodes} devices but {len(nodes)} nodes are "
                "connected; DR-DSGD needs exactly one node per device"
            )
        self.keys = list(arrays.keys())
        theta0 = arrays_to_numpy(arrays)
        self.models = {nid: [a.copy() for a in theta0] for nid in nodes}

    def _fix_order(self) -> list[int]:
        assert self.models is not None
        known = {nid: pid for nid, pid in self.node_to_partition.items() if nid in self.models}
        return sorted(
            self.models, key=lambda nid: (0, known[nid], nid) if nid in known else (1, 0, nid)
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per device with its own θ_i^t (type ``train.drdsgd`` / ``train.dsgd``)."""
        assert self.models is not None
        connected = set(self.nodes(grid))
        config["server-round"] = server_round
        config["local-steps"] = self.local_steps
        if self.robust:
            config["mu"] = self.mu
            config["tilt-log-cap"] = self.log_cap
        mtype = TRAIN_DRDSGD if self.robust else TRAIN_DSGD
        targets = [nid for nid in sorted(self.models) if nid in connected]

        def content(nid: int) -> RecordDict:
            return RecordDict(
                {
                    "arrays": numpy_to_arrays(self.keys, self.models[nid]),  # type: ignore[index]
                    "config": ConfigRecord(dict(config)),
                }
            )

        return self.build_messages(targets, content, mtype)

    def train_round(
        self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
    ) -> tuple[ArrayRecord, MetricRecord | None]:
        """Local steps on every device, then one gossip step; returns θ̄ (for reporting only).

        θ_i^{t+½} from the valid replies (θ_i^t for a dropped one), then
        θ_i^{t+1} = Σ_j W_ij θ_j^{t+½}.
        """
        if self.models is None:
            self._init_models(grid, arrays)
        assert self.models is not None
        t = server_round - 1
        messages = list(
            self.configure_train(server_round, arrays, ConfigRecord(dict(config)), grid)
        )
        reference = numpy_to_arrays(self.keys, next(iter(self.models.values())))
        replies = self.communicate(
            grid,
            messages,
            phase="train",
            reference=reference,
            required_metrics=("train_loss", "log_tilt_weight"),
        )
        half: dict[int, Layers] = {
            nid: model for nid, model in self.models.items()
        }  # θ_i^t by default
        per_node: dict[int, dict[str, float]] = {}
        for reply in replies:
            nid = int(reply.metadata.src_node_id)
            if nid not in self.models:
                continue
            rec = reply.content.array_records["arrays"]
            half[nid] = [np.asarray(rec[k].numpy()) for k in self.keys]
            mr = reply.content.metric_records.get("metrics") or next(
                iter(reply.content.metric_records.values())
            )
            per_node[nid] = {k: float(v) for k, v in mr.items() if isinstance(v, int | float)}
        if len(replies) < len(self.models):
            log(
                INFO,
                "[%s] iteration %d: %d of %d devices kept θ_i^t (no valid reply)",
                self.run_name,
                server_round,
                len(self.models) - len(per_node),
                len(self.models),
            )
        if self.order is None:
            self.order = self._fix_order()
        W = self.mixing_matrix(t)
        mixed = mix([half[nid] for nid in self.order], W)
        for nid, model in zip(self.order, mixed, strict=True):
            self.models[nid] = model
        self.W = W
        gram = W.T @ W
        self._gram_sum = gram if self._gram_sum is None else self._gram_sum + gram
        self._iterations += 1
        self._extras = self._compute_extras(W, per_node)
        metrics = self._train_metrics(per_node)
        return self.average_model(), metrics

    def _train_metrics(self, per_node: dict[int, dict[str, float]]) -> MetricRecord | None:
        if not per_node:
            return None
        vals = list(per_node.values())
        out = {
            "train_loss": float(np.mean([v["train_loss"] for v in vals])),
            "train_loss_worst": float(np.max([v["train_loss"] for v in vals])),
            "log_tilt_weight_max": float(np.max([v["log_tilt_weight"] for v in vals])),
            "tilt_capped": float(sum(v.get("tilt_capped", 0.0) for v in vals)),
            "devices_stepped": float(len(vals)),
            NUM_EXAMPLES: float(sum(v[NUM_EXAMPLES] for v in vals)),
        }
        return MetricRecord(out)

    def _compute_extras(
        self, W: np.ndarray, per_node: dict[int, dict[str, float]]
    ) -> dict[str, Any]:
        assert self.models is not None and self.order is not None
        K = len(self.order)
        out: dict[str, Any] = {
            "consensus_distance": consensus_distance([self.models[nid] for nid in self.order]),
            "transfers": 2 * edges_used(W),
            "rho": spectral_gap_rho(W),
        }
        if self.resample and self._gram_sum is not None:
            mean_gram = self._gram_sum / self._iterations
            out["rho_expected"] = float(np.linalg.norm(mean_gram - np.full((K, K), 1.0 / K), ord=2))

        def key(nid: int) -> str:
            pid = self.partition(nid)
            return str(pid) if pid is not None else f"node{nid}"

        def by_partition(item: tuple[int, Any]) -> tuple[int, int]:
            pid = self.partition(item[0])
            return (pid if pid is not None else K + item[0], item[0])

        nodes = sorted(per_node.items(), key=by_partition)
        if self.robust:
            out["log_tilt_weight"] = {key(n): round(v["log_tilt_weight"], 6) for n, v in nodes}
        out["train_loss_device"] = {key(n): round(v["train_loss"], 6) for n, v in nodes}
        capped = [key(n) for n, v in nodes if v.get("tilt_capped", 0) > 0]
        if capped:
            out["tilt_capped_devices"] = capped
        return out

    def round_extras(self) -> dict[str, Any]:
        """Consensus distance Ξ, model transfers 2|E_t|, ρ of W_t, per-device log(h_i/μ)."""
        return dict(self._extras)

    # ------------------------------------------------------------------ models out
    def average_model(self) -> ArrayRecord:
        """θ̄ = (1/K) Σ_i θ_i (reporting only; DR-DSGD never broadcasts it)."""
        assert self.models is not None
        models = list(self.models.values())
        avg = []
        for layer in range(len(self.keys)):
            stack = np.stack([m[layer] for m in models]).astype(np.float64)
            mean = stack.mean(axis=0)
            dtype = models[0][layer].dtype
            avg.append(
                np.rint(mean).astype(dtype)
                if np.issubdtype(dtype, np.integer)
                else mean.astype(dtype)
            )
        return numpy_to_arrays(self.keys, avg)

    def device_model(self, partition_id: int) -> ArrayRecord:
        """θ_i of the device holding ``partition_id``."""
        assert self.models is not None
        for nid, pid in self.node_to_partition.items():
            if pid == partition_id and nid in self.models:
                return numpy_to_arrays(self.keys, self.models[nid])
        raise KeyError(f"partition-id: no device with partition {partition_id} is known")

    def output_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """θ̄, the average of the device models (for reporting)."""
        if self.models is None:
            return arrays
        if self.output_dir is not None:
            try:
                np.savez(
                    self.output_dir / "device_models.npz",
                    **{
                        f"{self.partition(nid) if self.partition(nid) is not None else f'node{nid}'}/{k}": a
                        for nid, layers in self.models.items()
                        for k, a in zip(self.keys, layers, strict=True)
                    },
                )
            except OSError as exc:  # saving must never fail a run
                log(WARNING, "[%s] could not save the device models: %s", self.run_name, exc)
        return self.average_model()

    # ------------------------------------------------------------------ evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Every device evaluates θ_i (``eval_model="own"``) or θ̄ (``"average"``) on its own test set.

        θ̄ = (1/K) Σ_j θ_j^t over all K devices (:meth:`average_model`), the same for every
        device; messages of type ``evaluate``.
        """
        if self.fraction_evaluate == 0.0 or self.models is None:
            return []
        average = (
            arrays_to_numpy(self.average_model()) if self.eval_model == "average" else None
        )
        connected = set(self.nodes(grid))
        nodes = [nid for nid in sorted(self.models) if nid in connected]
        k = max(1, round(self.fraction_evaluate * len(nodes)))
        chosen = nodes if k >= len(nodes) else sorted(self.sample(nodes, k))
        config["server-round"] = server_round

        def content(nid: int) -> RecordDict:
            layers = average if average is not None else self.models[nid]  # type: ignore[index]
            return RecordDict(
                {
                    "arrays": numpy_to_arrays(self.keys, layers),
                    "config": ConfigRecord(dict(config)),
                }
            )

        return self.build_messages(chosen, content, MessageType.EVALUATE)


def drdsgd(**kwargs: Any) -> DRDSGD:
    """DR-DSGD: tilted local steps (h/μ) + Metropolis gossip."""
    return DRDSGD(robust=True, **kwargs)


def dsgd(**kwargs: Any) -> DRDSGD:
    """DSGD: plain local SGD steps + Metropolis gossip (DR-DSGD with h/μ = 1)."""
    kwargs.pop("mu", None)
    kwargs.pop("log_cap", None)
    kwargs.pop("max_tilt_weight", None)
    return DRDSGD(robust=False, **kwargs)


__all__ = ["DRDSGD", "EVAL_MODELS", "TRAIN_DRDSGD", "TRAIN_DSGD", "drdsgd", "dsgd"]
