"""The algorithm's side of a strategy: the hooks it overrides (defaults: FedAvg) and the tools it calls.

Also the strategy's accessors that are no part of the round: its observers
(:meth:`AlgorithmHooks.add_observer`), its results (``failures``, ``client_metrics``) and
its checkpoint's content (:meth:`AlgorithmHooks.server_state`, :meth:`AlgorithmHooks.restore`).

:class:`AlgorithmHooks` is what an algorithm module sees of
:class:`~flowerdro.strategies.base.FairStrategy`: its settings (``config``, ``loop``,
``training``), its declarations (``name``, ``settings_class``, the reply records it needs,
what a privacy mechanism cannot protect), the hooks the round calls (:meth:`on_start`,
:meth:`train_messages`, :meth:`train_step`, :meth:`exchange_train`,
:meth:`evaluate_messages`, :meth:`evaluation_arrays`, :meth:`output_arrays`,
:meth:`round_extras`, :meth:`output_files`) and the tools it calls while doing so
(:meth:`nodes`, :meth:`sample`, :meth:`build_messages`, :meth:`communicate`,
:meth:`communicate_stream`, :meth:`partition`, :meth:`train_config`, :attr:`grid`).
The defaults make FedAvg: the global model to a seeded sample, the example-weighted
average of the valid replies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from flowerdro.protocol import CLIPPING_KEY, NUM_EXAMPLES
from flowerdro.settings import Settings
from flowerdro.strategies import roster, server_state
from flowerdro.strategies.arrays import average_arrays
from flowerdro.strategies.observers import Observers, RoundCallback
from flowerdro.strategies.records import mean_of_metric_records
from flowerdro.strategies.replies import Expected, Failure, metrics_of
from flowerdro.strategies.transport import build_messages

if TYPE_CHECKING:
    from flowerdro.protocol import TrainingSettings
    from flowerdro.strategies.guard import PrivacyGuard
    from flowerdro.strategies.loop import LoopSettings
    from flowerdro.strategies.messaging import Communicator
    from flowerdro.strategies.records import ClientResults
    from flowerdro.strategies.rounds import Round

__all__ = ["AlgorithmHooks"]


class AlgorithmHooks:
    """The hooks an algorithm overrides and the tools it uses (see the module docstring)."""

    #: Short name used in logs and the registry.
    name: ClassVar[str] = "fair-base"
    #: The algorithm's settings dataclass.
    settings_class: ClassVar[type[Settings]]
    #: The ArrayRecords every training reply must hold, with the model's keys and shapes.
    train_array_keys: ClassVar[tuple[str, ...]] = ("arrays",)
    #: Metrics every training reply must carry besides ``num-examples``.
    train_required_metrics: ClassVar[tuple[str, ...]] = ()

    # set by FairStrategy
    config: Any
    loop: LoopSettings
    training: TrainingSettings
    rng: np.random.Generator
    comm: Communicator
    guard: PrivacyGuard
    round: Round
    current_arrays: ArrayRecord | None
    wait_timeout: float
    attack: dict[str, Any]
    observers: Observers
    results: ClientResults
    history: list[dict[str, Any]]
    accept: Callable[[Expected, Iterable[Message]], list[Message]]

    build_messages = staticmethod(build_messages)

    # ------------------------------------------------------------------ declarations
    def unprotected(self, mechanism: str) -> str | None:
        """What this strategy's clients send that ``mechanism`` cannot protect (None: it composes).

        ``mechanism`` is one of :data:`flowerdro.privacy.MECHANISMS` (central DP, local DP,
        SecAgg+). Every algorithm declares it; a subclass that does not is refused under
        each of them (a protection is never assumed).
        """
        return (f"whatever its server step reads from the replies: {type(self).__name__} does not declare it "
                "(override unprotected())")

    def uniform_mean(self) -> bool:
        """Whether the server step is the uniform mean of the clients' models (what DP accounting assumes)."""
        return False

    def initialize_parameters(self, client_manager: Any) -> None:
        """Refuse Flower's legacy ``Server`` loop, naming the adapter that runs this strategy there."""
        raise TypeError(f"{self.name}: a Message-API strategy cannot be the strategy of a legacy "
                        "ServerAppComponents; use flowerdro.legacy.LegacyStrategy"
                        f"('{self.name}', run_config, num_rounds=...) there (see the README, "
                        "'Use flowerdro in your own Flower project')")

    # ------------------------------------------------------------------ settings
    @property
    def eval_metric(self) -> str:
        """The metric every evaluate reply must carry."""
        return self.loop.eval_metric or self.loop.accuracy_metric

    def settings(self) -> dict[str, Any]:
        """Every setting of the run (algorithm, loop, local training, the attack if any) for logs and results."""
        out = {"strategy": self.name}
        for obj in (self.config, self.loop, self.training):
            out.update({f.name: getattr(obj, f.name) for f in fields(obj)})
        return {**out, **self.attack}

    # ------------------------------------------------------------------ observers, results, checkpoints
    def add_observer(self, observer: Any) -> None:
        """Follow the run: ``observer`` may define ``on_start(strategy, num_rounds)``,
        ``on_round(strategy, record)``, ``on_end(strategy, final_arrays)`` and
        ``on_error(strategy, exception)`` (a run that :meth:`start` drives raised)."""
        self.observers.add(observer)

    def add_round_callback(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(record)`` after every round (progress bars, early stopping, tests)."""
        self.add_observer(RoundCallback(fn))

    @property
    def failures(self) -> list[Failure]:
        """Every dropped reply of the run so far."""
        return self.comm.log.failures

    @property
    def client_metrics(self) -> dict[int, dict[str, float]]:
        """Partition id → metrics of its latest evaluation."""
        return self.results.latest

    def server_state(self) -> dict[str, Any]:
        """Everything the server needs to continue the run after the current round (a checkpoint's content)."""
        return server_state.server_state(self)

    def restore(self, checkpoint: Mapping[str, Any]) -> ArrayRecord:
        """Put the server back in the state of ``checkpoint``; returns the global model."""
        return server_state.restore(self, checkpoint)

    # ------------------------------------------------------------------ tools
    @property
    def grid(self) -> Grid:
        """The grid of the current round (the one ``configure_train`` received)."""
        if self.round.grid is None:
            raise RuntimeError(f"{self.name}: no grid yet; call configure_train(server_round, arrays, config, grid) "
                               "first")
        return self.round.grid

    def nodes(self, grid: Grid) -> list[int]:
        """Connected node ids in partition order (:meth:`Roster.connected
        <flowerdro.strategies.roster.Roster.connected>`), at least ``min-available-nodes``.

        A node heard from for the first time is asked its partition and what it runs
        (the roll call); its mods are checked against this strategy (:mod:`flowerdro.privacy`).
        """
        nodes = self.comm.nodes(grid, self.loop.min_available_nodes, self.wait_timeout)
        self.guard.check_clients(self.comm.roster.client_info)
        return nodes

    def num_train_nodes(self, num_nodes: int) -> int:
        """How many nodes to sample: ``max(min-train-nodes, round(fraction-train·N))``, at most N."""
        return roster.num_train_nodes(num_nodes, self.loop.fraction_train, self.loop.min_train_nodes)

    def evaluates_everyone(self, num_nodes: int) -> bool:
        """Whether every one of ``num_nodes`` connected nodes is asked to evaluate."""
        return self.loop.fraction_evaluate >= 1.0 and self.num_evaluate_nodes(num_nodes) >= num_nodes

    def num_evaluate_nodes(self, num_nodes: int) -> int:
        """How many nodes evaluate: ``min(max(1, round(fraction-evaluate·N)), evaluate-sample)``.

        ``evaluate-sample = 0`` lifts the cap (every node with ``fraction-evaluate = 1``).
        """
        return roster.num_evaluate_nodes(num_nodes, self.loop.fraction_evaluate, self.loop.evaluate_sample)

    def sample(self, node_ids: Sequence[int], k: int, *, p: np.ndarray | None = None,
               replace: bool = False) -> list[int]:
        """Draw ``k`` node ids from the strategy's generator (with probabilities ``p`` when given)."""
        return roster.sample(self.rng, node_ids, k, p=p, replace=replace)

    def partition(self, node_id: int) -> int | None:
        """Partition id of a node, once one of its replies has told us."""
        return self.comm.roster.partition(node_id)

    def communicate(self, grid: Grid, messages: Sequence[Message], **kwargs: Any) -> list[Message]:
        """An extra exchange of the algorithm: send, receive, judge (see :meth:`Communicator.send
        <flowerdro.strategies.messaging.Communicator.send>`)."""
        return self.comm.send(grid, messages, **kwargs)

    def communicate_stream(self, grid: Grid, messages: Sequence[Message],
                           on_replies: Callable[[list[Message]], None], **kwargs: Any) -> list[Message]:
        """Stream replies as they arrive (see :meth:`Communicator.stream
        <flowerdro.strategies.messaging.Communicator.stream>`)."""
        return self.comm.stream(grid, messages, on_replies, **kwargs)

    def train_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        """The clients' config of a training message: the local-training settings, then ``config``."""
        cfg = ConfigRecord({k: v for k, v in self.training.to_config().items() if not isinstance(v, list)})
        cfg.update({"seed": self.loop.seed, **dict(config), "server-round": int(server_round)})
        if (clipping := self.guard.client_clipping()) is not None:
            cfg[CLIPPING_KEY] = clipping  # which of Flower's clipping mods the clients apply
        return cfg

    # ------------------------------------------------------------------ hooks
    def on_start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None) -> None:
        """Reset the algorithm's state before the first round (nothing by default)."""

    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> Iterable[Message]:
        """The round's training messages; default: the global model to a seeded sample (``train``)."""
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        content = RecordDict({"arrays": arrays, "config": self.train_config(config, server_round)})
        return self.build_messages(chosen, content, MessageType.TRAIN)

    def train_step(self, server_round: int, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The server step on the round's valid training replies; default: FedAvg.

        w ← Σ_i n_i w_i / Σ_i n_i over the replies (n_i = ``num-examples``; buffers keep
        their dtype, :func:`~flowerdro.strategies.arrays.average_arrays`); None when no
        reply is valid (the model stays as it is).
        """
        if not replies:
            return None, None
        return (average_arrays([r.content for r in replies], NUM_EXAMPLES),
                mean_of_metric_records([metrics_of(r) for r in replies]))

    def exchange_train(self, grid: Grid, messages: list[Message]) -> list[Message]:
        """How :meth:`start` delivers the training messages: push, pull, judge (FedMGDA+ streams)."""
        expected = self.round.expected.get("train") or Expected("train", messages)
        return self.accept(expected, self.comm.exchange(grid, messages))

    def evaluate_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                          grid: Grid) -> Iterable[Message]:
        """Evaluate messages: :meth:`evaluation_arrays` to every node, or a seeded sample of them."""
        nodes = self.nodes(grid)
        k = self.num_evaluate_nodes(len(nodes))
        chosen = nodes if k >= len(nodes) else sorted(self.sample(nodes, k))
        content = RecordDict({"arrays": self.evaluation_arrays(arrays), "config": config})
        return self.build_messages(chosen, content, MessageType.EVALUATE)

    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model clients evaluate (e.g. DRFA's averaged iterate); default: ``arrays``."""
        return arrays

    def output_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model a run returns; default: the last global model."""
        return arrays

    def round_extras(self) -> dict[str, Any]:
        """Extra per-round fields for the record (e.g. λ keyed by partition id)."""
        return {}

    def output_files(self) -> dict[str, Any]:
        """Files a run leaves besides its records, by name: a dict is written as JSON, a mapping
        of arrays as ``.npz`` (e.g. DR-DSGD's device models); none by default."""
        return {}
