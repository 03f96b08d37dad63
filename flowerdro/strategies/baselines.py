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
model into float64).

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

from flowerdro.deploy.grid import ForwardingGrid
from flowerdro.protocol import NUM_EXAMPLES
from flowerdro.settings import Knob, Settings, setting
from flowerdro.strategies.arrays import array_view
from flowerdro.strategies.base import FairStrategy
from flowerdro.strategies.messaging import metrics_of

__all__ = ["FedAvgBaseline", "FedAvgSettings", "FedProxBaseline", "FedProxSettings", "FlowerBaseline",
           "QFedAvgBaseline", "QFedAvgSettings", "UNIFORM_WEIGHT"]


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

        The metrics are cut to the keys all replies share first, and the result keeps the
        dtypes of the model sent this round.
        """
        if not replies:
            return None, None
        common = set.intersection(*(set(metrics_of(r).keys()) for r in replies)) if replies else set()
        uniform = self.weight_key == UNIFORM_WEIGHT
        for r in replies:
            mr = metrics_of(r)
            if set(mr.keys()) != common or uniform:
                name = "metrics" if "metrics" in r.content.metric_records else next(iter(r.content.metric_records))
                kept = {k: mr[k] for k in mr.keys() if k in common}
                if uniform:
                    kept[UNIFORM_WEIGHT] = 1.0
                r.content.metric_records[name] = MetricRecord(kept)
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        if arrays is not None and self._global is not None:
            arrays = ArrayRecord({k: _as_dtype(arrays[k], self._global[k]) for k in arrays.keys()})
        return arrays, metrics


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
