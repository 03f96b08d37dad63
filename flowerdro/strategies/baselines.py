"""Flower's own FedAvg, FedProx and q-FedAvg, run inside the flowerdro round loop.

:class:`FlowerBaseline` keeps Flower's strategy for what it decides (the messages it sends
and how it aggregates) and adds what :class:`~flowerdro.strategies.base.FairStrategy` owns:
seeded sampling (Flower samples with the global ``random``), failure handling before
aggregation, per-client evaluation and the results log. The inner strategy sees a view of
the grid that contains exactly the nodes we sampled, so its own sampling step selects
all of them. Two things are made tolerant before Flower aggregates: the replies' metrics
are cut to the keys every reply holds (Flower refuses replies whose metric keys differ,
so one client with an extra metric would abort the round), and the new model keeps the
dtypes of the model it replaces (q-FedAvg's arithmetic would otherwise turn a float32
model into float64). Buffers (BatchNorm's running statistics and counter) are averaged
over the examples, as FedAvg does, apart from Flower's aggregation
(:func:`aggregate_apart_from_buffers`): q-FedAvg's step acts on the parameters only, and an
integer counter stays an integer.

References: McMahan et al. 2017 (FedAvg), Li et al. 2020 (FedProx),
Li, Sanjabi, Beirami, Smith 2020 (q-FedAvg, q-FFL).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, QFedAvg, Strategy

from flowerdro.core.layers import mean_buffers, update_mask
from flowerdro.deploy.grid import ForwardingGrid
from flowerdro.protocol import IDENTIFIER_METRICS, NUM_EXAMPLES
from flowerdro.settings import Knob, Settings, setting
from flowerdro.strategies.arrays import array_view, numpy_to_arrays, record_weight
from flowerdro.strategies.base import FairStrategy
from flowerdro.strategies.replies import metrics_of

__all__ = ["FedAvgBaseline", "FedAvgSettings", "FedProxBaseline", "FedProxSettings", "FlowerBaseline",
           "QFedAvgBaseline", "QFedAvgSettings", "UNIFORM_WEIGHT", "aggregate_apart_from_buffers"]


class _NodeSubsetGrid(ForwardingGrid):
    """A Grid that exposes only ``node_ids`` and forwards everything else."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        super().__init__(grid)
        self._ids = list(node_ids)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return list(self._ids)


class FlowerBaseline(FairStrategy):
    """Run one of Flower's Message-API strategies with flowerdro's loop and metrics.

    Subclasses say which Flower strategy (:meth:`make_inner`) from their settings.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inner = self.make_inner()
        self._global: ArrayRecord | None = None

    def make_inner(self) -> Strategy:
        """Flower's strategy, built to sample every node it is shown (our loop samples)."""
        raise NotImplementedError

    @property
    def weight_key(self) -> str:
        """The metric Flower's aggregation weights by: ``num-examples``, or 1 for every reply (uniform)."""
        return UNIFORM_WEIGHT if getattr(self.config, "weighting", "num-examples") == "uniform" else NUM_EXAMPLES

    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> Iterable[Message]:
        """Seeded sample, then Flower's own ``configure_train`` on exactly that sample.

        Flower shuffles the nodes it is given (an unseeded ``random.sample``); the messages
        are put back in the seeded sample's order, so the replies, and the float sums of
        the aggregation, come in the same order on every run with the same seed.
        """
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        position = {int(n): i for i, n in enumerate(chosen)}
        self._global = arrays
        messages = list(self.inner.configure_train(server_round, arrays, self.train_config(config, server_round),
                                                   _NodeSubsetGrid(grid, chosen)))
        return sorted(messages, key=lambda m: position[int(m.metadata.dst_node_id)])

    def train_step(self, server_round: int, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's own aggregation over the replies that passed our checks.

        The metrics are cut to the keys all replies share first, without the identifiers
        (``partition-id``, ``user-train-fn``: an average of them means nothing), and the
        result keeps the dtypes of the model sent this round.
        """
        if not replies:
            return None, None
        common = set.intersection(*(set(metrics_of(r).keys()) for r in replies)) if replies else set()
        common -= set(IDENTIFIER_METRICS)  # a partition id is not a metric to average
        uniform = self.weight_key == UNIFORM_WEIGHT
        for r in replies:
            mr = metrics_of(r)
            if set(mr.keys()) != common or uniform:
                name = "metrics" if "metrics" in r.content.metric_records else next(iter(r.content.metric_records))
                kept = {k: mr[k] for k in mr.keys() if k in common}
                if uniform:
                    kept[UNIFORM_WEIGHT] = 1.0
                r.content.metric_records[name] = MetricRecord(kept)
        arrays, metrics = aggregate_apart_from_buffers(self.inner, server_round, replies, self._global)
        if arrays is not None and self._global is not None:
            arrays = ArrayRecord({k: _as_dtype(arrays[k], self._global[k]) for k in arrays.keys()})
        return arrays, metrics


def aggregate_apart_from_buffers(inner: Strategy, server_round: int, replies: list[Message],
                                 reference: ArrayRecord | None) -> tuple[ArrayRecord | None, MetricRecord | None]:
    r"""Flower's ``aggregate_train`` on the parameters; the buffers averaged over the examples.

    The buffers of the model (:func:`~flowerdro.core.layers.update_mask`: BatchNorm's
    running statistics and integer counter, any non-floating array) are taken out of the
    replies, and out of q-FedAvg's copy of the global model (``current_arrays``), while
    ``inner`` aggregates: q-FedAvg's step w − Σ_k Δ_k / Σ_k h_k and its ‖w − w_k‖² in h_k
    see the parameters only, and Flower's arithmetic is left as it is. Each buffer of the
    new model is then FedAvg's Σ_k n_k b_k / Σ_k n_k (n_k = the reply's weighting metric,
    ``num-examples``), in its own dtype, integers rounded. The replies are given back as
    they came. A model without buffers goes to ``inner`` unchanged.

    Parameters
    ----------
    inner : flwr.serverapp.strategy.Strategy
        Flower's FedAvg, FedProx or QFedAvg (configured this round).
    server_round : int
        The round.
    replies : list of Message
        The valid train replies, each with one ArrayRecord and one MetricRecord.
    reference : ArrayRecord or None
        The model sent this round (its keys and dtypes tell the buffers).

    Returns
    -------
    tuple
        The new model (``None`` when ``inner`` found no valid reply) and the metrics.
    """
    keys = list(reference.keys()) if reference is not None else []
    mask = update_mask(keys, [array_view(reference[k]) for k in keys]) if reference is not None else []
    buffers = {k for k, update in zip(keys, mask, strict=True) if not update}
    if not buffers or not replies:
        return inner.aggregate_train(server_round, replies)

    def parameters(rec: ArrayRecord) -> ArrayRecord:
        return ArrayRecord({k: rec[k] for k in rec.keys() if k not in buffers})

    models = [(r.content.array_records, next(iter(r.content.array_records))) for r in replies]
    originals = [records[name] for records, name in models]
    global_copy = getattr(inner, "current_arrays", None)  # q-FedAvg's w, compared with each w_k
    try:
        for (records, name), rec in zip(models, originals, strict=True):
            records[name] = parameters(rec)
        if isinstance(global_copy, ArrayRecord):
            inner.current_arrays = parameters(global_copy)  # type: ignore[attr-defined]
        arrays, metrics = inner.aggregate_train(server_round, replies)
    finally:
        for (records, name), rec in zip(models, originals, strict=True):
            records[name] = rec
        if isinstance(global_copy, ArrayRecord):
            inner.current_arrays = global_copy  # type: ignore[attr-defined]
    if arrays is None:
        return None, metrics
    weight_key = getattr(inner, "weighted_by_key", NUM_EXAMPLES)
    layers = [array_view(arrays[k]) if k not in buffers else array_view(reference[k]) for k in keys]
    new = mean_buffers(layers, mask, {i: [array_view(rec[k]) for k in keys] for i, rec in enumerate(originals)},
                       {i: record_weight(r.content, weight_key) for i, r in enumerate(replies)})
    return numpy_to_arrays(keys, new), metrics


def _as_dtype(new: Array, like: Array) -> Array:
    """``new`` with the dtype of ``like`` (unchanged when they already agree)."""
    target = array_view(like).dtype
    values = array_view(new)
    return new if values.dtype == target else Array(np.asarray(values, dtype=target))


#: The reply metric the Flower baselines weight by with ``weighting = "uniform"`` (set to 1 on every valid reply).
UNIFORM_WEIGHT = "uniform-weight"
#: Values of ``weighting``.
WEIGHTINGS: tuple[str, ...] = ("num-examples", "uniform")


@dataclass(frozen=True)
class FedAvgSettings(Settings):
    """FedAvg (McMahan et al. 2017) and the strategies that average like it."""

    weighting: str = setting("num-examples", "the average's weights: the clients' num-examples (FedAvg), or equal "
                                             "(uniform: what central-DP accounting assumes)", choices=WEIGHTINGS)


class _MeanOfModels:
    """A strategy whose server step is a weighted mean of the models: it composes with every privacy piece."""

    config: FedAvgSettings

    def unprotected(self, mechanism: str) -> str | None:
        """Nothing: the replies' model is all the server step reads."""
        return None

    def uniform_mean(self) -> bool:
        """With ``weighting = "uniform"``."""
        return self.config.weighting == "uniform"


class FedAvgBaseline(_MeanOfModels, FlowerBaseline):
    """Flower's FedAvg: the example-weighted (or uniform) average of the clients' models."""

    name: ClassVar[str] = "fedavg"
    settings_class: ClassVar[type[Settings]] = FedAvgSettings

    def make_inner(self) -> Strategy:  # noqa: D102
        return FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1, weighted_by_key=self.weight_key)


@dataclass(frozen=True)
class FedProxSettings(FedAvgSettings):
    """FedProx (Li et al. 2020)."""

    proximal_mu: float = setting(0.1, "μ of the proximal term (μ/2)‖w − w_global‖² in the clients' loss", ge=0,
                                 knob=Knob(1e-3, 1.0, "log"))


class FedProxBaseline(_MeanOfModels, FlowerBaseline):
    """Flower's FedProx: clients add (μ/2)‖w − w_global‖² to their local objective."""

    name: ClassVar[str] = "fedprox"
    settings_class: ClassVar[type[Settings]] = FedProxSettings

    def make_inner(self) -> Strategy:  # noqa: D102
        return FedProx(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1,
                       proximal_mu=self.config.proximal_mu, weighted_by_key=self.weight_key)


@dataclass(frozen=True)
class QFedAvgSettings(Settings):
    """q-FedAvg (Li, Sanjabi, Beirami, Smith 2020)."""

    q: float = setting(0.2, "q of q-FFL: updates weighted by F_k^q (0: FedAvg-like)", ge=0,
                       knob=Knob(0.01, 10.0, "log"))


class QFedAvgBaseline(FlowerBaseline):
    """Flower's q-FedAvg: updates weighted by F_k^q, L = 1/η (η = the clients' ``lr``).

    Needs ``train_loss`` = the loss of the *received* model in every train reply
    (flowerdro's clients measure it before training).
    """

    name: ClassVar[str] = "qfedavg"
    settings_class: ClassVar[type[Settings]] = QFedAvgSettings

    def unprotected(self, mechanism: str) -> str | None:
        """q-FedAvg weights each update by the client's own loss F_k^q."""
        return ("per-client losses F_k (train_loss) that weight each update Δ_k by F_k^q and scale the step by "
                "Σ h_k, so the aggregate is neither a mean of clipped updates nor a sum the clients can mask")

    def make_inner(self) -> Strategy:  # noqa: D102
        return QFedAvg(client_learning_rate=self.training.lr, q=self.config.q, fraction_train=1.0,
                       min_train_nodes=1, min_available_nodes=1)
