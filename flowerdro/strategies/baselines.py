"""Flower's own FedAvg, FedProx and q-FedAvg, run inside the flowerdro round loop.

:class:`FlowerBaseline` keeps Flower's strategy for what it decides (the messages it sends
and how it aggregates) and adds what :class:`~flowerdro.strategies.base.FairStrategy` owns:
seeded sampling (Flower samples with the global ``random``), failure handling before
aggregation, per-client evaluation and the results log. The inner strategy sees a view of
the grid that contains exactly the nodes we sampled, so its own sampling step selects
all of them.

References: McMahan et al. 2017 (FedAvg), Li et al. 2020 (FedProx),
Li, Sanjabi, Beirami, Smith 2020 (q-FedAvg, q-FFL).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, QFedAvg, Strategy

from flowerdro.strategies.base import FairStrategy


class _NodeSubsetGrid(Grid):
    """A Grid that exposes only ``node_ids`` and forwards everything else."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid, self._ids = grid, list(node_ids)

    def set_run(self, run: Any) -> None:  # noqa: D102
        self._grid.set_run(run)

    @property
    def run(self) -> Any:  # noqa: D102
        return self._grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # noqa: D102
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return list(self._ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:  # noqa: D102
        return self._grid.send_and_receive(messages, timeout=timeout)


class FlowerBaseline(FairStrategy):
    """Run one of Flower's Message-API strategies with flowerdro's loop and metrics.

    Parameters
    ----------
    inner : flwr.serverapp.strategy.Strategy
        A Flower strategy built with ``fraction_train=1.0`` and ``min_*_nodes=1``
        (our loop decides who is sampled).
    name : str
        Label for logs and results.
    **kwargs
        Passed to :class:`FairStrategy` (fraction_train, seed, output_dir, …).
    """

    def __init__(self, inner: Strategy, name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = inner
        self.name = name
        self.run_name = kwargs.get("run_name") or name

    def settings(self) -> dict[str, Any]:  # noqa: D102
        out = super().settings()
        out["inner"] = type(self.inner).__name__
        for key in ("q", "client_learning_rate", "proximal_mu"):
            if hasattr(self.inner, key):
                out[key] = getattr(self.inner, key)
        return out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Seeded sample, then Flower's own ``configure_train`` on exactly that sample.

        Flower shuffles the nodes it is given (an unseeded ``random.sample``); the messages
        are put back in the seeded sample's order, so the replies, and the float sums of
        the aggregation, come in the same order on every run with the same seed.
        """
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        position = {int(n): i for i, n in enumerate(chosen)}
        messages = list(self.inner.configure_train(server_round, arrays, config, _NodeSubsetGrid(grid, chosen)))
        return sorted(messages, key=lambda m: position[int(m.metadata.dst_node_id)])

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's own aggregation over the replies that passed our checks."""
        return self.inner.aggregate_train(server_round, list(replies))


def fedavg(**kwargs: Any) -> FlowerBaseline:
    """Flower's FedAvg (example-weighted model average)."""
    return FlowerBaseline(_quiet(FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)),
                          "fedavg", **kwargs)


def fedprox(proximal_mu: float, **kwargs: Any) -> FlowerBaseline:
    """Flower's FedProx: clients add (μ/2)‖w − w_global‖² to their local objective."""
    if proximal_mu < 0:
        raise ValueError(f"proximal-mu: must be >= 0, got {proximal_mu}")
    inner = FedProx(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1, proximal_mu=proximal_mu)
    return FlowerBaseline(_quiet(inner), "fedprox", **kwargs)


def qfedavg(q: float, client_learning_rate: float, **kwargs: Any) -> FlowerBaseline:
    """Flower's q-FedAvg (q-FFL): updates weighted by F_k^q, L = 1/η (needs ``train_loss``)."""
    if q < 0:
        raise ValueError(f"q: must be >= 0, got {q}")
    if not client_learning_rate > 0:
        raise ValueError(f"lr: q-FedAvg needs the client learning rate > 0, got {client_learning_rate}")
    inner = QFedAvg(client_learning_rate=client_learning_rate, q=q, fraction_train=1.0,
                    min_train_nodes=1, min_available_nodes=1)
    return FlowerBaseline(_quiet(inner), "qfedavg", **kwargs)


def _quiet(strategy: Strategy) -> Strategy:
    return strategy
