r"""DRFA, DRFA-Prox and AFL as a Flower Message-API strategy.

Distributionally Robust Federated Averaging — Y. Deng, M. M. Kamani, M. Mahdavi,
"Distributionally Robust Federated Averaging", NeurIPS 2020,
https://arxiv.org/abs/2102.12660 (Algorithm 1: DRFA; Algorithm 2: DRFA-Prox).
Agnostic Federated Learning — M. Mohri, G. Sivek, A. T. Suresh, ICML 2019,
https://arxiv.org/abs/1902.00146 (AFL = DRFA with τ = 1; "afl-full" with every client in
every round).

Objective, over N clients with losses f_i and mixing weights λ on the simplex Δ:

.. math::

    \min_w \max_{\lambda \in \Delta} \sum_i \lambda_i f_i(w) \;(+\, g(\lambda)
    \text{ for DRFA-Prox}).

One communication round s (paper symbols; settings in brackets; the server's arithmetic
is in :mod:`flowerdro.core.drfa`):

1. D(s): m clients [``clients-per-round``] drawn with probabilities λ(s) (with
   replacement by default) and one snapshot step t′ ~ U{1, …, τ} [``snapshot``].
2. ``train.drfa`` to each distinct client of D(s): τ local SGD steps [``local-steps``]
   from w̄(s); the reply carries w_k and the snapshot w_k(t′).
3. w̄(s+1) = w̄(s) + Σ_k a_k (w_k − w̄(s)), w(t′) likewise, with the unbiased weights of
   :func:`~flowerdro.core.drfa.aggregation_weights` (the mean over the draws in the paper;
   a client drawn twice counts twice).
4. U: m clients drawn uniformly with replacement; ``query.loss`` sends them w(t′).
5. v_i = (N/m) Σ_{k∈U} 1[k = i] f_i(w(t′)); λ(s+1) = Π_Δ(λ(s) + τγv) (DRFA), or the
   prox step argmax_{u∈Δ} τ g(u) − (1/2γ)‖λ(s) + γτv − u‖² (DRFA-Prox, [``regularizer``]
   g = −ρ·KL, −ρ·χ² or −(ρ/2)‖u − 1/N‖²); then optionally λ ← floor_simplex(λ, λ_min)
   [``lambda-floor``] and γ ← γ·decay [``dual-lr-decay``].

With ``output-model = "average"`` a run returns ŵ = the mean of the server iterates
w̄(s) (the paper averages every local step's virtual iterate; the server sees w̄(s) only).

Choices
-------
* γ [``dual-lr``]: unset, γ = 1/(2τNF) with F = 10 (public step: 1/(2mF);
  :func:`~flowerdro.core.drfa.default_dual_lr`), fixed when N becomes known: for losses
  below F no λ step moves an entry of λ by 1/2 or more, whatever N, m and τ (so λ(0)
  uniform never lands on one client in one round), and λ_i drifts by 5 % of 1/N per round
  per unit of loss above the mean. A given value is used as is.
* Without replacement, D(s) is drawn successively by λ and averaged with Des Raj's
  ordered weights, which are unbiased for Σ_i λ_i w_i (the plain mean over such a sample
  is not: λ = (0.7, 0.1, 0.1, 0.1), m = 2 gives the mean the weights (7/15, 8/45, 8/45,
  8/45)). At most #{i: λ_i > 0} clients are drawn.
* ``client-sampling = "uniform"`` (public code): D(s) uniform, update weights λ_k N/m.
* ``dual-step-scale = "public"``: the λ step without Algorithm 1's factor τN/m′ (the
  default γ follows the scale).
* Node ↔ partition: λ is keyed by partition id. Whenever a connected node's partition is
  unknown (and, for ``lambda-init = "size"``, before λ(0) for every node whose
  training-set size is unknown) the strategy sends ``query.loss`` at the current model to
  those nodes (phase ``"discover"``; ``loss-on = "full"`` for the sizes, so
  ``num-examples`` is the training-set size). N is
  ``num-partitions`` when given, else the partitions discovered in round 1; a partition
  discovered later joins with weight 1/(N+1) (the others scaled by N/(N+1)).
* Failures: a failed ``train.drfa`` reply is left out and the weights renormalised over
  the draws that answered. A round without a valid train reply keeps w̄(s), takes no λ
  step, does not decay γ and does not enter ŵ: it is as if it had not happened, except
  for its draws of the generator. A failed ``query.loss`` reply is left out of v, built
  from the m′ answers with the factor N/m′ (unbiased when failures do not depend on the
  client; a client that always fails only loses weight, which the records show under
  ``failures``); without any, the λ step (and the decay of γ) is skipped but the new
  model still enters ŵ. γ therefore decays once per λ step taken.
* A sampled partition with no connected node is skipped like a failed reply.

Messages: see docs/protocol.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.core.drfa import (
    DUAL_STEP_SCALES,
    REGULARIZERS,
    aggregation_weights,
    combine_models,
    default_dual_lr,
    dual_step,
    sample_by_lambda,
    sample_snapshot_steps,
    sample_uniform,
)
from flowerdro.core.layers import cast_layer
from flowerdro.core.simplex import admit_partitions, floor_simplex, lambda_entropy
from flowerdro.protocol import NUM_EXAMPLES, PARTITION_ID
from flowerdro.runs.codec import register_state
from flowerdro.settings import Knob, Settings, setting
from flowerdro.strategies.arrays import arrays_to_numpy, numpy_to_arrays
from flowerdro.strategies.base import FairStrategy
from flowerdro.strategies.records import mean_of_metric_records
from flowerdro.strategies.replies import metrics_of

__all__ = ["DRFA", "DRFAProx", "DRFAProxSettings", "DRFASettings", "DRFAState"]

TRAIN_TYPE, QUERY_TYPE = "train.drfa", "query.loss"


@dataclass(frozen=True)
class DRFASettings(Settings):
    """DRFA and AFL (Deng, Kamani, Mahdavi 2020; Mohri, Sivek, Suresh 2019)."""

    clients_per_round: int | None = setting(None, "m, clients drawn per round (unset: fraction-train·N, at "
                                                  "least min-train-nodes)", ge=1)
    dual_lr: float | None = setting(None, "γ, the dual step size (unset: 1/(2τN·10), so that no λ step moves "
                                          "an entry of λ by 1/2 or more for losses below 10)", gt=0,
                                    knob=Knob(1e-4, 1.0, "log"))
    sample_with_replacement: bool = setting(True, "draw D(s) with replacement (the paper); without, the "
                                                  "average uses Des Raj's unbiased weights")
    client_sampling: str = setting("lambda", "D(s) drawn by λ and averaged (lambda), or drawn uniformly with "
                                             "updates weighted by λ_k·N/m (uniform)", choices=("lambda", "uniform"))
    snapshot: str = setting("shared", "one snapshot step t′ for all sampled clients, or one each",
                            choices=("shared", "per-client"))
    dual_lr_decay: float = setting(1.0, "γ ← γ·decay after every λ step", gt=0, le=1)
    lambda_floor: float = setting(0.0, "λ_min ≤ 1/N: every λ_i is kept ≥ λ_min (0: off)", ge=0, le=1,
                                  knob=Knob(1e-4, 1e-2, "log"))  # λ_min ≤ 1/N: fits N ≤ 100 clients
    dual_step_scale: str = setting("paper", "the λ step with Algorithm 1's factor τN/m′ (paper) or without it "
                                            "(public; the default dual-lr is then 1/(2m·10))",
                                   choices=DUAL_STEP_SCALES)
    lambda_init: str = setting("uniform", "λ(0) uniform or proportional to the clients' training-set sizes",
                               choices=("uniform", "size"))
    output_model: str = setting("last", "the model a run returns: w̄(S) or the average ŵ of the server iterates",
                                choices=("last", "average"))
    evaluate_model: str = setting("last", "the model the clients evaluate each round: w̄(s) or ŵ",
                                  choices=("last", "average"))
    query_loss_on: str = setting("batch", "f_i(w(t′)) on one minibatch (the paper) or all local training data",
                                 key="loss-on", choices=("batch", "full"))
    full_participation: bool = setting(False, "every client trains and reports its loss every round (afl-full)")
    num_partitions: int | None = setting(None, "N when known in advance (unset: the partitions discovered in "
                                               "round 1)", ge=1)

    def check(self) -> None:
        """Checks that need N, when ``num-partitions`` gives it."""
        if self.num_partitions is not None:
            self.check_clients(self.num_partitions)

    def check_clients(self, n: int) -> None:
        """m ≤ N without replacement and λ_min ≤ 1/N, for N = ``n`` clients."""
        m = self.clients_per_round
        if m is not None and m > n and not (self.sample_with_replacement or self.full_participation):
            raise ValueError(f"clients-per-round: m = {m} > N = {n} clients without replacement; set "
                             f"sample-with-replacement = true or clients-per-round <= {n}")
        if self.lambda_floor * n > 1.0 + 1e-12:
            raise ValueError(f"lambda-floor: must be in [0, 1/N] = [0, {1.0 / n:.6g}] with N = {n}, "
                             f"got {self.lambda_floor}")


@dataclass(frozen=True)
class DRFAProxSettings(DRFASettings):
    """DRFA-Prox (Deng, Kamani, Mahdavi 2020, Algorithm 2): DRFA with a regulariser g(λ)."""

    regularizer: str = setting("kl", "g(λ) = −ρ·KL(λ‖uniform), −ρ·χ²(λ) or −(ρ/2)‖λ − uniform‖²",
                               choices=REGULARIZERS)
    rho: float = setting(0.1, "ρ, the strength of the regulariser", ge=0, knob=Knob(1e-3, 10.0, "log"))


@register_state
@dataclass
class DRFAState:
    """Everything DRFA keeps between rounds (checkpointed by the base class).

    Attributes
    ----------
    partitions : list of int
        Known partition ids, sorted; entry k of λ belongs to ``partitions[k]``.
    lam : numpy.ndarray
        λ(s), aligned with ``partitions``.
    dual_lr : float or None
        The current γ (None until N is known).
    sizes : dict
        Partition id → training-set size (``num-examples``), as learned.
    average : list of numpy.ndarray or None
        ŵ, the running mean of the server iterates (float64).
    num_averaged : int
        Number of iterates in ``average``.
    """

    partitions: list[int] = field(default_factory=list)
    lam: np.ndarray = field(default_factory=lambda: np.zeros(0))
    dual_lr: float | None = None
    sizes: dict[int, int] = field(default_factory=dict)
    average: list[np.ndarray] | None = None
    num_averaged: int = 0

    def index(self) -> dict[int, int]:
        """Partition id → its entry of λ."""
        return {p: k for k, p in enumerate(self.partitions)}

    def add_to_average(self, arrays: list[np.ndarray]) -> None:
        """ŵ ← ŵ + (w̄ − ŵ)/k with k the number of iterates so far."""
        cur = [np.asarray(a, dtype=np.float64) for a in arrays]
        self.num_averaged += 1
        if self.average is None:
            self.average = cur
        else:
            self.average = [a + (c - a) / self.num_averaged for a, c in zip(self.average, cur, strict=True)]


@dataclass
class _RoundPlan:
    """What the training phase of a round decided, for its server step."""

    arrays: ArrayRecord
    config: ConfigRecord
    draws: np.ndarray
    node_of: dict[int, int]


class DRFA(FairStrategy):
    """DRFA and AFL: λ-sampled local training, a loss query at the snapshot, the λ step.

    See the module docstring for the round, the choices and the failure rules; the
    settings are :class:`DRFASettings` (τ, η and the batch size are the clients'
    ``local-steps``, ``lr`` and ``batch-size``).
    """

    name: ClassVar[str] = "drfa"
    settings_class: ClassVar[type[Settings]] = DRFASettings
    config: DRFASettings

    train_array_keys: ClassVar[tuple[str, ...]] = ("arrays", "snapshot")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = DRFAState()
        self._extras: dict[str, Any] = {}
        self._plan: _RoundPlan | None = None

    def on_start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None) -> None:
        """A fresh λ, γ and ŵ."""
        self.state = DRFAState()
        self._extras = {}
        self._plan = None

    def unprotected(self, mechanism: str) -> str | None:
        """DRFA's λ step reads every queried client's loss f_i(w(t′)) (``query.loss``), by partition."""
        return ("per-client losses f_i(w(t′)) for the λ step (query.loss), read by partition, and each sampled "
                "client's model and snapshot w_k(t′) (train.drfa), weighted by λ")

    def regularizer(self) -> tuple[str, float]:
        """The regulariser g and its ρ (none for DRFA and AFL)."""
        return "none", 0.0

    def settings(self) -> dict[str, Any]:
        """The base's settings and the regulariser of the λ step (``"none"`` for DRFA and AFL)."""
        out = super().settings()
        out["regularizer"], out["rho"] = self.regularizer()
        return out

    def num_sampled(self, n: int) -> int:
        """m for N = ``n`` clients: ``clients-per-round``, else the loop's fraction rule (N with full participation)."""
        if self.config.full_participation:
            return n
        m = self.config.clients_per_round
        return m if m is not None else self.num_train_nodes(n)

    @property
    def lam(self) -> dict[int, float]:
        """λ(s) as {partition id: weight}."""
        return {p: float(v) for p, v in zip(self.state.partitions, self.state.lam, strict=True)}

    # ------------------------------------------------------------------ partitions and λ
    def _sync_partitions(self) -> None:
        """Initialise λ once partitions are known; admit partitions discovered later."""
        st, cfg = self.state, self.config
        known = set(self.comm.roster.node_to_partition.values())
        if st.partitions:
            new = sorted(known - set(st.partitions))
            if new:
                st.partitions, st.lam = admit_partitions(st.partitions, st.lam, new)
                log(INFO, "[%s] partitions %s joined: N = %d", self.run_name, new, len(st.partitions))
                cfg.check_clients(len(st.partitions))
                if cfg.lambda_floor > 0:
                    st.lam = floor_simplex(st.lam, cfg.lambda_floor)
            return
        pids = set(range(cfg.num_partitions)) if cfg.num_partitions is not None else known
        if known - pids:
            log(WARNING, "[%s] partitions %s are outside num-partitions = %s; added", self.run_name,
                sorted(known - pids), cfg.num_partitions)
        if not pids | known:
            return
        st.partitions = sorted(pids | known)
        n = len(st.partitions)
        cfg.check_clients(n)
        if cfg.lambda_init == "size" and st.sizes:
            mean = float(np.mean(list(st.sizes.values())))
            w = np.array([float(st.sizes.get(p, mean)) for p in st.partitions])
            lam = w / w.sum()
        else:
            lam = np.full(n, 1.0 / n)
        st.lam = floor_simplex(lam, cfg.lambda_floor) if cfg.lambda_floor > 0 else lam
        st.dual_lr = cfg.dual_lr if cfg.dual_lr is not None else default_dual_lr(
            n, self.num_sampled(n), tau=self.training.local_steps, scale=cfg.dual_step_scale)
        log(INFO, "[%s] λ initialised (%s) over N = %d partitions, γ = %.6g", self.run_name, cfg.lambda_init, n,
            st.dual_lr)

    def _discover(self, grid: Grid, arrays: ArrayRecord, nodes: list[int], config: ConfigRecord, rnd: int) -> None:
        """``query.loss`` to connected nodes whose partition is unknown, or, before λ(0) with
        ``lambda-init = "size"``, whose training-set size is unknown (learns the map and sizes)."""
        part, st = self.comm.roster.node_to_partition, self.state
        sizes = self.config.lambda_init == "size" and not st.partitions
        ask = [n for n in nodes if int(n) not in part or (sizes and part[int(n)] not in st.sizes)]
        if not ask:
            return
        cfg = self._query_config(config, rnd)
        cfg["loss-on"] = "full" if sizes else "batch"
        msgs = self.build_messages(ask, RecordDict({"arrays": arrays, "config": cfg}), QUERY_TYPE)
        for reply in self.communicate(grid, msgs, phase="discover"):
            if sizes:
                mr = metrics_of(reply)
                st.sizes[int(mr[PARTITION_ID])] = int(mr[NUM_EXAMPLES])

    # ------------------------------------------------------------------ messages
    def _train_config(self, config: ConfigRecord, rnd: int, t_prime: int) -> ConfigRecord:
        cfg = self.train_config(config, rnd)
        cfg["local-steps"] = self.training.local_steps
        cfg["local-epochs"] = 0.0  # τ is exact: steps, never epochs
        cfg["snapshot-step"] = int(t_prime)
        return cfg

    def _query_config(self, config: ConfigRecord, rnd: int) -> ConfigRecord:
        cfg = ConfigRecord({"batch-size": self.training.batch_size, "seed": self.loop.seed})
        cfg.update({k: config[k] for k in ("batch-size", "seed") if k in config})
        cfg["server-round"] = rnd
        cfg["loss-on"] = self.config.query_loss_on
        return cfg

    # ------------------------------------------------------------------ one round
    def _draw(self, n: int) -> np.ndarray:
        """D(s) as indices of λ, in the order drawn."""
        cfg = self.config
        if cfg.full_participation:
            return np.arange(n, dtype=np.int64)
        m = self.num_sampled(n)
        if cfg.client_sampling == "lambda":
            return sample_by_lambda(self.rng, self.state.lam, m, replace=cfg.sample_with_replacement)
        return sample_uniform(self.rng, n, m, replace=cfg.sample_with_replacement)

    def _design(self) -> str:
        """How D(s) was drawn (see :func:`flowerdro.core.drfa.aggregation_weights`)."""
        if self.config.full_participation:
            return "full"
        if self.config.client_sampling == "uniform":
            return "uniform"
        return "lambda" if self.config.sample_with_replacement else "lambda-successive"

    def _skip(self, rnd: int, reason: str) -> tuple[None, None]:
        """A round without a new model: w̄, λ, γ and ŵ stay as they are."""
        log(WARNING, "[%s] round %d: %s; model kept, λ step skipped", self.run_name, rnd, reason)
        self._extras["dual_step"] = f"skipped: {reason}"
        if self.state.dual_lr is not None:
            self._extras["dual_lr"] = self.state.dual_lr
        return None, None

    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> list[Message]:
        """Steps 1–2: discover unknown nodes, draw D(s) and t′, ``train.drfa`` to each distinct client drawn."""
        st, rnd = self.state, server_round
        nodes = self.nodes(grid)
        self._extras = {}
        self._plan = None
        self._discover(grid, arrays, nodes, config, rnd)
        self._sync_partitions()
        if not st.partitions:
            self._skip(rnd, "no partition known")
            return []
        connected = set(nodes)
        node_of = {pid: nid for nid, pid in self.comm.roster.node_to_partition.items() if nid in connected}

        # 1. D(s) and t′
        draws = self._draw(len(st.partitions))
        distinct = sorted(set(int(i) for i in draws))
        t_primes = sample_snapshot_steps(self.rng, self.training.local_steps, len(distinct), mode=self.config.snapshot)
        t_of = dict(zip(distinct, (int(t) for t in t_primes), strict=True))
        absent = [st.partitions[i] for i in distinct if st.partitions[i] not in node_of]
        targets = {node_of[st.partitions[i]]: i for i in distinct if st.partitions[i] in node_of}
        self._extras.update({
            "sampled": [st.partitions[i] for i in draws],
            "snapshot_step": (int(t_primes[0]) if self.config.snapshot == "shared" and len(t_primes)
                              else {str(st.partitions[i]): t for i, t in t_of.items()}),
        })
        if absent:
            log(WARNING, "[%s] round %d: sampled partitions %s have no connected node; skipped",
                self.run_name, rnd, absent)
            self._extras["absent"] = absent
        self._plan = _RoundPlan(arrays, ConfigRecord(dict(config)), draws, node_of)

        # 2. train.drfa to each distinct sampled client
        return self.build_messages(list(targets), lambda nid: RecordDict(
            {"arrays": arrays, "config": self._train_config(config, rnd, t_of[targets[nid]])}), TRAIN_TYPE)

    def train_step(self, server_round: int, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Steps 3–5: w̄(s+1) and w(t′) from the replies, the loss query at w(t′) on U, the λ step."""
        st, rnd, plan = self.state, server_round, self._plan
        if plan is None:
            return None, None
        self._plan = None
        arrays, config = plan.arrays, plan.config
        n, index_of = len(st.partitions), st.index()
        finals: dict[int, list[np.ndarray]] = {}
        snaps: dict[int, list[np.ndarray]] = {}
        for r in replies:
            mr = metrics_of(r)
            pid = int(mr[PARTITION_ID])
            if pid in index_of:
                st.sizes[pid] = int(mr[NUM_EXAMPLES])
                finals[index_of[pid]] = arrays_to_numpy(r.content["arrays"])
                snaps[index_of[pid]] = arrays_to_numpy(r.content["snapshot"])
        coefs = aggregation_weights(plan.draws, finals.keys(), st.lam, design=self._design())
        if not coefs:
            return self._skip(rnd, "no valid train.drfa reply")

        # 3. w̄(s+1) and w(t′); w̄(s+1) enters ŵ
        keys, base = list(arrays.keys()), arrays_to_numpy(arrays)
        new_list = combine_models(base, finals, coefs)
        new_arrays = numpy_to_arrays(keys, new_list)
        snap_arrays = numpy_to_arrays(keys, combine_models(base, snaps, coefs))
        st.add_to_average(new_list)

        # 4. U and the loss query at w(t′)
        queried = np.arange(n, dtype=np.int64) if self.config.full_participation else sample_uniform(
            self.rng, n, self.num_sampled(n), replace=True)
        self._extras["queried"] = [st.partitions[i] for i in queried]
        loss_of = self._query(self.grid, snap_arrays, config, rnd, queried, plan.node_of)

        # 5. the λ step, then γ's decay
        ids = [int(i) for i in queried if int(i) in loss_of]
        self._extras["dual_lr"] = st.dual_lr
        if ids:
            reg, rho = self.regularizer()
            st.lam = dual_step(st.lam, ids, [loss_of[i] for i in ids], tau=self.training.local_steps,
                               gamma=st.dual_lr, regularizer=reg, rho=rho, floor=self.config.lambda_floor,
                               scale=self.config.dual_step_scale)
            st.dual_lr *= self.config.dual_lr_decay
            self._extras["dual_step"] = f"{len(ids)}/{len(queried)} losses"
            self._extras["query_loss"] = {str(st.partitions[i]): loss_of[i] for i in sorted(loss_of)}
        else:
            log(WARNING, "[%s] round %d: no valid query.loss reply; λ step skipped", self.run_name, rnd)
            self._extras["dual_step"] = "skipped: no loss reply"
        return new_arrays, mean_of_metric_records([metrics_of(r) for r in replies])

    def _query(self, grid: Grid, snap_arrays: ArrayRecord, config: ConfigRecord, rnd: int,
               queried: np.ndarray, node_of: dict[int, int]) -> dict[int, float]:
        """``query.loss`` at w(t′) to the distinct clients of U; λ index → f_i(w(t′)) of the replies."""
        st = self.state
        index_of = st.index()
        targets = [node_of[st.partitions[i]] for i in sorted(set(int(k) for k in queried))
                   if st.partitions[i] in node_of]
        content = RecordDict({"arrays": snap_arrays, "config": self._query_config(config, rnd)})
        replies = self.communicate(grid, self.build_messages(targets, content, QUERY_TYPE), phase="query",
                                   required_metrics=("loss",))
        loss_of = {}
        for r in replies:
            mr = metrics_of(r)
            if int(mr[PARTITION_ID]) in index_of:
                loss_of[index_of[int(mr[PARTITION_ID])]] = float(mr["loss"])
        return loss_of

    # ------------------------------------------------------------------ base hooks
    def averaged_arrays(self, like: ArrayRecord) -> ArrayRecord:
        """ŵ with the keys and dtypes of ``like`` (``like`` itself before any iterate)."""
        if self.state.average is None:
            return like
        dtypes = [a.dtype for a in arrays_to_numpy(like)]
        return numpy_to_arrays(list(like.keys()),
                               [cast_layer(a, d) for a, d in zip(self.state.average, dtypes, strict=True)])

    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """w̄(s), or ŵ with ``evaluate-model = "average"``."""
        return self.averaged_arrays(arrays) if self.config.evaluate_model == "average" else arrays

    def output_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """w̄(S), or ŵ with ``output-model = "average"``."""
        return self.averaged_arrays(arrays) if self.config.output_model == "average" else arrays

    def round_extras(self) -> dict[str, Any]:
        """λ keyed by partition id (as strings, like ``client_acc``), its entropy, γ and the draws."""
        out: dict[str, Any] = {"lambda": {str(p): v for p, v in self.lam.items()},
                               "lambda_entropy": lambda_entropy(self.state.lam)}
        out.update(self._extras)
        return out


class DRFAProx(DRFA):
    """DRFA-Prox: DRFA whose λ step is the proximal step of a regulariser g (Algorithm 2)."""

    name: ClassVar[str] = "drfa-prox"
    settings_class: ClassVar[type[Settings]] = DRFAProxSettings
    config: DRFAProxSettings

    def regularizer(self) -> tuple[str, float]:
        """g and ρ from the settings."""
        return self.config.regularizer, self.config.rho
