r"""FedMGDA+, FedMGDA, FedAvg-n and MGDA-Prox as a Flower Message-API strategy.

Z. Hu, K. Shaloudegi, G. Zhang, Y. Yu, "Federated Learning Meets Multi-objective
Optimization", IEEE Transactions on Network Science and Engineering, 2022,
https://arxiv.org/abs/2006.11489 (Algorithm 1: FedMGDA+).

Every client's loss f_i is one objective; the server looks for a common descent direction
of the sampled objectives, the min-norm element of the convex hull of their updates,
within ε of the FedAvg weights λ₀. One round t (paper symbols; the code's names in
brackets):

1. Sample I_t: a fraction p of the connected nodes [``fraction_train``], uniformly
   without replacement, from the strategy's seeded generator.
2. ``train.sgd`` to I_t with w_t: k local epochs [``local_epochs``] (or τ steps
   [``local_steps``]) of SGD with batch b [``batch_size``] and step η_l [``lr``]; MGDA-Prox
   adds (μ/2)‖w − w_t‖² to the local objective [``proximal_mu``]. Reply: w_i.
3. g_i = w_t − w_i over the trainable parameters (buffers are not updates, see below), and

   .. math::

       ĝ_i = g_i / ‖g_i‖ \;(ĝ_i = 0 \text{ if } g_i = 0), \qquad G_{ij} = ⟨ĝ_i, ĝ_j⟩,

       λ^* = \operatorname{argmin}_{λ ∈ Δ_m,\ ‖λ − λ_0‖_∞ ≤ ε} λᵀ G λ,
       \qquad d_t = Σ_i λ^*_i ĝ_i,

       w_{t+1} = w_t − η_t d_t, \qquad η_t = η_0 β^{⌊t/P⌋},\ β = \text{decay}^{P/T}.

   λ₀ is uniform (1/m) or proportional to the participants' data sizes
   [``lambda_init`` = ``"uniform"`` / ``"size"``], restricted to I_t and renormalised.
   The step is :class:`flowerdro.core.mgda_step.StreamingServerStep` (QP:
   :func:`flowerdro.core.mgda.min_norm_weights`), the rate
   :func:`flowerdro.core.mgda.fedmgda_lr` (t = server round − 1, so rounds 1..P use η₀;
   P = 100 in the paper [``lr_decay_every``]; T is the run's number of rounds, kept in
   ``self.state``).

The family (registry names):

* ``"fedmgda+"``: normalised updates, ε ∈ [0, 1] (default 0.1).
* ``"fedavg-n"``: ε = 0, so λ* = λ₀ and d_t = Σ λ₀_i ĝ_i: FedAvg on normalised updates
  (λ₀ = data sizes, as FedAvg).
* ``"fedmgda"``: *vanilla* MGDA in FL (the paper's FedMGDA, §3 before the "+" changes):
  **no** normalisation and **no** ε-box (λ ∈ Δ_m only), d_t = Σ λ*_i g_i on the raw
  updates, w_{t+1} = w_t − η_t d_t with η₀ = 1 and no decay by default, so that
  w_{t+1} = Σ λ*_i w_i is a convex combination of the local models.
* ``"mgda-prox"``: FedMGDA+ whose clients add the proximal term μ (default 0.1).
* ``"fedavg-mgda"``: FedAvg through this step: raw updates, ε = 0, λ₀ = data sizes, η = 1,
  so w_{t+1} = Σ λ₀_i w_i; it gives FedAvg the family's ``track_improvement``.

The registry fixes what defines each variant (ε, η₀ and decay of the vanilla ones, λ₀ of
the FedAvg ones, μ = 0 for all but MGDA-Prox); the run config cannot change those.

Choices documented here
-----------------------
* Zero updates: a client with g_i = 0 keeps ĝ_i = 0 (no NaN). MGDA then may put all
  weight on it (its min norm is 0) and the model does not move: a client at a stationary
  point makes w_t Pareto-stationary for the sampled objectives. All g_i = 0 gives G = 0,
  λ* = λ₀ and w_{t+1} = w_t.
* Buffers: an array is a *buffer*, not an update, when it is not floating-point or its
  key's last dotted component is a torch normalisation buffer (:data:`~flowerdro.core.layers.BUFFER_NAMES`:
  ``running_mean``, ``running_var``, ``num_batches_tracked``; the clients send their
  ``state_dict`` keys). Buffers are never normalised nor stepped: w_{t+1} takes their
  λ*-weighted average over the participants, Σλ*_i b_i (rounded for integer arrays).
* Failed replies are dropped (see :class:`~flowerdro.strategies.base.FairStrategy`); λ₀
  is restricted to the clients that answered. Nobody answering keeps w_t.
* The step is built while the replies arrive (:meth:`FairStrategy.communicate_stream
  <flowerdro.strategies.base.FairStrategy.communicate_stream>`): the messages are cut
  into chunks of :attr:`FedMGDA.stream_chunk` in the order they were sent, and a chunk's
  valid replies are added to the step at once (updates and Gram rows) as soon as each of
  its messages has a reply or a failure, so after the last reply only the last chunk's
  Gram rows, the m × m solve and the combination remain. Adding in message order, in
  chunks fixed by it, gives the same bits whatever order the replies arrive in (a
  deployment's replies race; the Gram products' rounding depends on the batch shapes).
* The Gram matrix of float32 models is built with float32 block products summed in
  float64 (``gram_precision="auto"``): its error (≈1e-7 of max G_ii) is below the float32
  rounding of the updates themselves; its rounding-size negative eigenvalues are clipped
  to 0 before the solve. float64 models use float64 throughout.
* Fairness during training (``track_improvement``, off by default): after the step the
  participants get ``query.loss`` (``loss-on = "full"``) at w_{t+1}; "before" is the
  ``train_loss`` of their train reply (the loss of the received w_t on all local training
  data, the same code path) or a second ``query.loss`` at w_t: with
  ``improvement_before="query"``, and always when ``train-loss-on = "batch"`` (then
  ``train_loss`` is a first-minibatch loss, not the full-data loss "after" measures). The round logs ``improved_fraction`` = #{i: f_i(w_{t+1}) ≤
  f_i(w_t)} / #answers. A bias attacker adds the same bias to both losses.
* The method never reads a reported loss to update the model, so a client's loss-bias
  attack has no effect on it; normalisation removes any positive scaling of an update
  (``attack = "update-scale"``). A ``loss-scale`` attacker (the paper's §6.2.2) takes s
  times larger local steps, which for more than one step is not a multiple of its honest
  update.

Message protocol
----------------
``train.sgd`` — content ``arrays`` (w_t), ``config``: the clients' local-training
settings (``lr``, ``local-steps`` / ``local-epochs``, ``batch-size``, …), ``server-round``,
``seed``, ``proximal-mu`` μ (MGDA-Prox only). Reply: ``arrays`` (w_i), ``metrics`` with
``num-examples`` (local training-set size), ``partition-id``, ``train_loss`` (f_i(w_t) on
all local training data), ``train_loss_local``, ``local-steps``.
``query.loss`` (only with ``track_improvement``) — content ``arrays`` (w_{t+1}, or w_t),
``config``: ``loss-on = "full"``, ``server-round``, ``seed``. Reply: ``metrics`` with
``loss``, ``num-examples``, ``partition-id``. Run-config keys: :class:`FedMGDASettings`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.core.layers import BUFFER_NAMES, update_mask
from flowerdro.core.mgda import fedmgda_lr
from flowerdro.core.mgda_step import GRAM_PRECISIONS, StreamingServerStep
from flowerdro.privacy import LOCAL_DP
from flowerdro.protocol import NUM_EXAMPLES, PARTITION_ID
from flowerdro.settings import Knob, Settings, setting
from flowerdro.strategies.arrays import array_view, numpy_to_arrays
from flowerdro.strategies.base import FairStrategy
from flowerdro.strategies.records import mean_of_metric_records
from flowerdro.strategies.replies import metrics_of

__all__ = ["BUFFER_NAMES", "FedMGDA", "FedMGDASettings", "ReplyStream", "VanillaFedMGDA", "improved_fraction",
           "update_mask"]

LAMBDA_INITS: tuple[str, ...] = ("uniform", "size")
IMPROVEMENT_BEFORE: tuple[str, ...] = ("train-loss", "query")
TRAIN_TYPE, QUERY_TYPE = "train.sgd", "query.loss"


@dataclass(frozen=True)
class FedMGDASettings(Settings):
    """FedMGDA+ and its family (Hu et al. 2022); the variants fix some fields (registry)."""

    eps: float | None = setting(0.1, "ε, radius of the box ‖λ − λ₀‖∞ ≤ ε around the FedAvg weights "
                                     "(0: FedAvg-n, 1: MGDA; fedmgda: no box)", ge=0, le=1,
                                knob=Knob(0.01, 1.0, "log"))
    global_lr: float = setting(1.0, "η₀, the server's step size", gt=0)
    lr_decay: float = setting(1.0, "total decay of η_t over the run: η_t = η₀β^⌊t/P⌋, β = decay^(P/T) "
                                   "(1: constant)", gt=0, le=1)
    lr_decay_every: int = setting(100, "P, the decay period of η_t in rounds", ge=1)
    lambda_init: str = setting("uniform", "λ₀, the centre of the box: uniform or proportional to the "
                                          "participants' data sizes", choices=LAMBDA_INITS)
    proximal_mu: float = setting(0.1, "μ of the proximal term (μ/2)‖w − w_t‖² the clients add (mgda-prox "
                                      "only; 0 for the others)", ge=0, knob=Knob(1e-3, 1.0, "log"))
    track_improvement: bool = setting(False, "query the participants' full training loss at w_{t+1} and log "
                                             "the fraction that did not increase")
    improvement_before: str = setting("train-loss", "where f_i(w_t) comes from: the train reply's train_loss "
                                                    "or a second query.loss (always the query when "
                                                    "train-loss-on = batch)", choices=IMPROVEMENT_BEFORE)
    gram_precision: str = setting("auto", "arithmetic of the Gram products, summed in float64 (auto: the "
                                          "model's float dtype)", choices=GRAM_PRECISIONS)


def _center(lambda_init: str, sizes: Sequence[float]) -> np.ndarray:
    m = len(sizes)
    n = np.asarray(sizes, dtype=np.float64)
    if lambda_init == "uniform" or not np.all(np.isfinite(n)) or np.any(n < 0) or n.sum() <= 0:
        return np.full(m, 1.0 / m)
    return n / n.sum()


def improved_fraction(before: dict[int, float], after: dict[int, float]) -> float | None:
    """Fraction of partitions with f_i(w_{t+1}) ≤ f_i(w_t), over those with both losses."""
    common = [p for p in after if p in before]
    if not common:
        return None
    return float(np.mean([after[p] <= before[p] for p in common]))


class ReplyStream:
    """A :class:`~flowerdro.core.mgda_step.StreamingServerStep` fed with reply Messages.

    Parameters
    ----------
    arrays : ArrayRecord
        w_t (the model the replies' updates are relative to); its keys give the buffers.
    capacity : int
        The most replies that will be added (the number of messages sent).
    normalize, gram_precision
        As in :class:`~flowerdro.core.mgda_step.StreamingServerStep`.
    """

    def __init__(self, arrays: ArrayRecord, capacity: int, *, normalize: bool = True,
                 gram_precision: str = "auto") -> None:
        self.keys = list(arrays.keys())
        w = [arrays[k].numpy() for k in self.keys]
        self.step = StreamingServerStep(w, capacity, updates=update_mask(self.keys, w), normalize=normalize,
                                        gram_precision=gram_precision)
        self.partition_ids: list[int] = []
        self.sizes: list[float] = []
        self.metrics: list[MetricRecord] = []

    def add(self, replies: Sequence[Message]) -> None:
        """Add the models w_i of validated ``replies`` (read as views of their buffers, no copy)."""
        locs, mrs = [], []
        for r in replies:
            rec = r.content.array_records.get("arrays") or next(iter(r.content.array_records.values()))
            locs.append([array_view(rec[k]) for k in self.keys])
            mrs.append(metrics_of(r))
        self.step.add(locs)
        self.metrics.extend(mrs)
        self.partition_ids.extend(int(mr[PARTITION_ID]) for mr in mrs)
        self.sizes.extend(float(mr[NUM_EXAMPLES]) for mr in mrs)


class FedMGDA(FairStrategy):
    r"""FedMGDA+, FedAvg-n and MGDA-Prox: the step on normalised updates (module docstring).

    Settings: :class:`FedMGDASettings` (``self.config``), the loop's and the clients' local
    training. ``self.state["num_rounds"]`` is T of the rate schedule (set at the start of a
    run, checkpointed with the server state).
    """

    name: ClassVar[str] = "fedmgda+"
    settings_class: ClassVar[type[Settings]] = FedMGDASettings
    #: Whether the updates are normalised (what tells vanilla FedMGDA apart).
    normalize: ClassVar[bool] = True
    #: Messages per chunk of the streamed step (module docstring).
    stream_chunk: ClassVar[int] = 16

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state: dict[str, Any] = {"num_rounds": None}
        self._extras: dict[str, Any] = {}
        self._streamed: tuple[ReplyStream, list[int], float] | None = None
        self._config = ConfigRecord()

    def settings(self) -> dict[str, Any]:
        """The base settings and whether the updates are normalised (fixed by the variant)."""
        return {**super().settings(), "normalize": self.normalize}

    def on_start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None) -> None:
        """T of the rate schedule is the run's number of rounds (unknown: the schedule counts the rounds so far)."""
        self.state = {"num_rounds": None if num_rounds is None else int(num_rounds)}

    # ------------------------------------------------------------------ schedule and configs
    def global_rate(self, server_round: int) -> float:
        """η_t for server round t (1-based): :func:`fedmgda_lr` (t − 1, T, decay, η₀, every=P)."""
        total = self.state.get("num_rounds") or max(int(server_round), 1)
        return fedmgda_lr(max(int(server_round) - 1, 0), int(total), self.config.lr_decay, self.config.global_lr,
                          every=self.config.lr_decay_every)

    def train_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        """The clients' local-training config, with ``proximal-mu`` μ when it is > 0 (MGDA-Prox)."""
        cfg = super().train_config(config, server_round)
        if self.config.proximal_mu > 0:
            cfg["proximal-mu"] = float(self.config.proximal_mu)
        return cfg

    def query_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        """The ``query.loss`` config: full local training loss."""
        return ConfigRecord({"seed": config["seed"] if "seed" in config else self.loop.seed,
                             "server-round": int(server_round), "loss-on": "full"})

    # ------------------------------------------------------------------ the round
    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> Iterable[Message]:
        """Sample a fraction p of the nodes (seeded) and send them ``train.sgd`` with w_t."""
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        self._extras = {}
        self._streamed = None
        self._config = ConfigRecord(dict(config))
        content = RecordDict({"arrays": arrays, "config": self.train_config(config, server_round)})
        return self.build_messages(chosen, content, TRAIN_TYPE)

    @property
    def train_required_metrics(self) -> tuple[str, ...]:  # type: ignore[override]
        """``train_loss`` when the improvement is tracked from the training replies."""
        return ("train_loss",) if self.config.track_improvement and not self._before_by_query() else ()

    def train_step(self, server_round: int, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The step on the valid replies (built while they arrived when :meth:`start` streamed them), then,
        when tracked, ``query.loss`` before/after for the improved fraction."""
        streamed, self._streamed = self._streamed, None
        if not replies:
            log(WARNING, "[%s] round %d: no valid training reply; model unchanged", self.run_name, server_round)
            return None, None
        arrays = self.current_arrays
        if arrays is None:
            raise RuntimeError("current_arrays: aggregate_train needs the global model w_t; call configure_train "
                               "first (or set strategy.current_arrays)")
        ids = [id(r) for r in replies]
        if streamed is not None and streamed[1] == ids:
            stream, last = streamed[0], streamed[2]
        else:
            stream = self.start_stream(arrays, len(replies))
            last = time.perf_counter()
            stream.add(replies)
        new_arrays, metrics = self.finish_stream(server_round, stream)
        self._extras["server_step_s"] = round(time.perf_counter() - last, 6)
        if self.config.track_improvement:
            frac = self._track(self.grid, server_round, arrays, new_arrays, self._config, replies)
            if frac is not None:
                metrics["improved_fraction"] = frac
        return new_arrays, metrics

    def unprotected(self, mechanism: str) -> str | None:
        """The min-norm step reads every sampled client's update (normalised by its own norm)."""
        if mechanism == LOCAL_DP:
            if self.config.track_improvement:
                return ("per-client losses before and after the step (track-improvement: query.loss or "
                        "train_loss), read by partition")
            return None
        scaled = "normalised by its own norm ‖g_i‖ and weighted" if self.normalize else "weighted"
        return (f"each sampled client's update g_i ({scaled} by the min-norm QP over the updates' Gram matrix), so "
                "the aggregate is not a mean of clipped updates and a secure sum cannot give it")

    # ------------------------------------------------------------------ the step as replies arrive
    def start_stream(self, arrays: ArrayRecord, capacity: int) -> ReplyStream:
        """A :class:`ReplyStream` for w_t = ``arrays`` and up to ``capacity`` replies."""
        return ReplyStream(arrays, capacity, normalize=self.normalize, gram_precision=self.config.gram_precision)

    def finish_stream(self, server_round: int, stream: ReplyStream) -> tuple[ArrayRecord, MetricRecord]:
        """λ*, w_{t+1} and the round's metrics from a stream holding every valid reply."""
        eta = self.global_rate(server_round)
        step = stream.step.finish(eps=self.config.eps, global_lr=eta,
                                  center=_center(self.config.lambda_init, stream.sizes))
        pids = stream.partition_ids
        self._extras.update({
            "lambda": {str(p): float(v) for p, v in zip(pids, step.lam, strict=True)},
            "update_norms": {str(p): float(v) for p, v in zip(pids, step.norms, strict=True)},
            "direction_norm": step.direction_norm,
            "global_lr": eta,
        })
        metrics = mean_of_metric_records(stream.metrics)
        metrics["direction_norm"] = step.direction_norm
        metrics["global_lr"] = eta
        metrics["lambda_max"] = float(step.lam.max())
        return numpy_to_arrays(stream.keys, step.arrays), metrics

    def exchange_train(self, grid: Grid, messages: list[Message]) -> list[Message]:
        """Send ``train.sgd`` and add each chunk of valid replies to the step as soon as the chunk is complete.

        Only when this strategy's own :meth:`start` drives it without a wrapper (a wrapper
        may change the replies before :meth:`train_step`); otherwise the base's delivery.
        """
        expected = self.round.expected.get("train")
        arrays = self.current_arrays
        if self.outer is not None or expected is None or not messages or arrays is None:
            return super().exchange_train(grid, messages)
        stream = self.start_stream(arrays, len(messages))
        last = [time.perf_counter()]
        position = {int(m.metadata.dst_node_id): i for i, m in enumerate(messages)}
        waiting: dict[int, Message] = {}  # message position -> valid reply not yet added
        added = [0]  # messages before this position are in the stream (or failed)

        def drain(final: bool) -> None:
            failed = {position.get(f.node_id) for f in self.comm.log.of_round() if f.phase == "train"}
            while added[0] < len(messages):
                chunk = range(added[0], min(added[0] + self.stream_chunk, len(messages)))
                if not final and not all(i in waiting or i in failed for i in chunk):
                    return
                batch = [waiting.pop(i) for i in chunk if i in waiting]
                if batch:
                    last[0] = time.perf_counter()
                    stream.add(batch)
                added[0] = chunk.stop

        def on_replies(batch: list[Message]) -> None:
            waiting.update({position[int(r.metadata.src_node_id)]: r for r in batch})
            drain(final=False)

        replies = self.communicate_stream(grid, messages, on_replies, phase="train", reference=arrays,
                                          required_metrics=expected.required_metrics)
        drain(final=True)
        expected.judged = True
        self.data_sizes.note("train", replies, self.partition)
        replies = sorted(replies, key=lambda r: position[int(r.metadata.src_node_id)])
        self._streamed = (stream, [id(r) for r in replies], last[0])
        return replies

    def _before_by_query(self) -> bool:
        """Whether f_i(w_t) needs a ``query.loss``: asked for, or the train reply's ``train_loss``
        is not the full-data loss that "after" measures (``train-loss-on = "batch"``)."""
        return self.config.improvement_before == "query" or self.training.train_loss_on != "full"

    def _losses(self, grid: Grid, node_ids: list[int], arrays: ArrayRecord, config: ConfigRecord,
                server_round: int, phase: str) -> dict[int, float]:
        content = RecordDict({"arrays": arrays, "config": self.query_config(config, server_round)})
        replies = self.communicate(grid, self.build_messages(node_ids, content, QUERY_TYPE), phase=phase,
                                   required_metrics=("loss",))
        return {int(metrics_of(r)[PARTITION_ID]): float(metrics_of(r)["loss"]) for r in replies}

    def _track(self, grid: Grid, server_round: int, old: ArrayRecord, new: ArrayRecord, config: ConfigRecord,
               replies: list[Message]) -> float | None:
        nodes = [int(r.metadata.src_node_id) for r in replies]
        if self._before_by_query():
            before = self._losses(grid, nodes, old, config, server_round, "improvement-before")
        else:
            before = {int(metrics_of(r)[PARTITION_ID]): float(metrics_of(r)["train_loss"]) for r in replies}
        after = self._losses(grid, nodes, new, config, server_round, "improvement-after")
        frac = improved_fraction(before, after)
        self._extras["improved_fraction"] = frac
        self._extras["loss_change"] = {str(p): after[p] - before[p] for p in sorted(after) if p in before}
        return frac

    def round_extras(self) -> dict[str, Any]:
        """λ* and ‖g_i‖ keyed by partition id, ‖d_t‖, η_t, and the improved fraction when tracked."""
        return dict(self._extras)


class VanillaFedMGDA(FedMGDA):
    """FedMGDA and FedAvg-MGDA: the same step on the raw updates (ĝ_i = g_i)."""

    name: ClassVar[str] = "fedmgda"
    normalize: ClassVar[bool] = False
