"""The round loop every flowerdro strategy shares (Flower Message API).

:class:`FairStrategy` extends :class:`flwr.serverapp.strategy.Strategy` with what the
algorithms of this package need and Flower's loop does not give: seeded node sampling
from the strategy's own ``numpy.random.Generator`` (node ids sorted first, so a seed
gives the same clients on every run); per-client evaluation kept per partition with its
fairness summary; failure handling (:mod:`~flowerdro.strategies.messaging`); and a run
that fails loudly when no valid training reply arrives for ``max-failed-rounds`` rounds
in a row, instead of "completing" with nothing trained.

Each round: :meth:`FairStrategy.train_round` (one ``configure_train`` /
``aggregate_train`` phase by default; two-phase algorithms override it and talk to the
clients through :meth:`FairStrategy.communicate`), then an evaluation of (a sample of)
the clients, then a round record handed to the observers (``add_observer``: a
:class:`~flowerdro.strategies.output.RunWriter` writes the files, the driver prints).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from flowerdro.protocol import NUM_EXAMPLES, TrainingSettings
from flowerdro.settings import Settings, setting
from flowerdro.strategies.arrays import array_view, arrays_to_numpy, average_arrays, numpy_to_arrays  # noqa: F401
from flowerdro.strategies.checkpoint import ServerState
from flowerdro.strategies.messaging import (
    Communicator,
    Failure,
    failed_rounds_reason,
    metrics_of,
    missing_route_hint,
)
from flowerdro.strategies.records import (
    ClientResults,
    mean_of_metric_records,
    missing_partitions,
    round_line,
    round_record,
)

__all__ = ["FairStrategy", "LoopSettings", "RunFailedError"]


@dataclass(frozen=True)
class LoopSettings(Settings):
    """Settings of the round loop every strategy shares."""

    fraction_train: float = setting(1.0, "fraction of the connected clients sampled for training", gt=0, le=1)
    min_train_nodes: int = setting(1, "at least this many clients are sampled for training", ge=1)
    fraction_evaluate: float = setting(1.0, "fraction of the clients asked to evaluate (0: none)", ge=0, le=1)
    evaluate_sample: int = setting(300, "at most this many clients evaluate per round, a seeded sample "
                                        "(0: no cap; the fairness numbers' *_n say how many reported)", ge=0)
    evaluate_every: int = setting(1, "evaluate every k rounds (and always after the last)", ge=1)
    min_available_nodes: int = setting(1, "wait for this many connected clients before a round", ge=1)
    seed: int = setting(0, "seed of sampling, client minibatches and the initial model")
    checkpoint_every: int = setting(0, "save the server state every k rounds (0: never)", ge=0)
    max_failed_rounds: int = setting(3, "stop the run with an error after this many rounds in a row "
                                        "without a valid training reply", ge=1)
    accuracy_metric: str = setting("test_acc", "the evaluate replies' accuracy metric (fairness numbers)")
    loss_metric: str = setting("test_loss", "the evaluate replies' loss metric")
    eval_metric: str | None = setting(None, "the metric every evaluate reply must carry (unset: "
                                            "accuracy-metric, or loss-metric on a regression data set)")


class RunFailedError(RuntimeError):
    """A run that cannot train: no valid training reply for ``max-failed-rounds`` rounds."""


@dataclass(frozen=True)
class EmptySettings(Settings):
    """Settings of a strategy that has none of its own."""


class FairStrategy(ServerState, Strategy):
    """Base of flowerdro strategies: seeded sampling, per-client metrics, failures, loud failure.

    Parameters
    ----------
    config : Settings, optional
        The algorithm's settings (an instance of the class's ``settings_class``).
    loop : LoopSettings, optional
        The round loop's settings.
    training : TrainingSettings, optional
        The clients' local work sent in every training message.
    run_name : str, optional
        Label in logs and file names (default: the strategy's ``name``).
    **fields
        Fields of any of the three settings objects, by name (``DRFA(dual_lr=0.1, seed=1)``);
        validated where they are declared.
    """

    #: Short name used in logs and the registry.
    name: ClassVar[str] = "fair-base"
    #: The algorithm's settings dataclass.
    settings_class: ClassVar[type[Settings]] = EmptySettings

    def __init__(
        self,
        config: Settings | None = None,
        *,
        loop: LoopSettings | None = None,
        training: TrainingSettings | None = None,
        run_name: str | None = None,
        **fields_: Any,
    ) -> None:
        self.config, self.loop, self.training = _split(self.settings_class, config, loop, training, fields_)
        self.run_name = run_name or self.name
        self.rng = np.random.default_rng(self.loop.seed)
        self.comm = Communicator(self.run_name)
        self.results = ClientResults(self.loop.accuracy_metric, self.loop.loss_metric)
        self.history: list[dict[str, Any]] = []
        #: The malicious clients' attack (NodeSettings.attack_record; set by build_strategy), in settings().
        self.attack: dict[str, Any] = {}
        self.current_arrays: ArrayRecord | None = None
        self.wait_timeout = 120.0
        self._observers: list[Any] = []
        self._round = 0

    # ------------------------------------------------------------------ settings and observers
    @property
    def eval_metric(self) -> str:
        """The metric every evaluate reply must carry."""
        return self.loop.eval_metric or self.loop.accuracy_metric

    def settings(self) -> dict[str, Any]:
        """Every setting of the run (algorithm, loop, local training, the attack if any) for logs and results."""
        out = {"strategy": self.name}
        for obj in (self.config, self.loop, self.training):
            out.update({f.name: getattr(obj, f.name) for f in fields(obj)})
        out.update(self.attack)
        return out

    def summary(self) -> None:
        """Log the settings as a small tree."""
        items = list(self.settings().items())
        log(INFO, "\t├──> %s settings:", self.run_name)
        for i, (k, v) in enumerate(items):
            log(INFO, "\t│\t%s── %s: %s", "└" if i == len(items) - 1 else "├", k, v)

    def add_observer(self, observer: Any) -> None:
        """Follow the run: ``observer`` may define ``on_start(strategy, num_rounds)``,
        ``on_round(strategy, record)`` and ``on_end(strategy, final_arrays)``."""
        self._observers.append(observer)

    def add_round_callback(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(record)`` after every round (progress bars, early stopping, tests)."""
        self.add_observer(_RoundCallback(fn))

    def _notify(self, event: str, *args: Any) -> None:
        for obs in self._observers:
            method = getattr(obs, event, None)
            if method is not None:
                method(self, *args)

    # ------------------------------------------------------------------ nodes and sampling
    def nodes(self, grid: Grid) -> list[int]:
        """Connected node ids in partition order (:meth:`Communicator.roster`), at least ``min-available-nodes``."""
        return self.comm.roster(grid, self.loop.min_available_nodes, self.wait_timeout)

    def num_train_nodes(self, num_nodes: int) -> int:
        """How many nodes to sample: ``max(min-train-nodes, round(fraction-train·N))``, at most N."""
        return int(min(num_nodes, max(self.loop.min_train_nodes, round(self.loop.fraction_train * num_nodes))))

    def num_evaluate_nodes(self, num_nodes: int) -> int:
        """How many nodes evaluate: ``min(max(1, round(fraction-evaluate·N)), evaluate-sample)``.

        ``evaluate-sample = 0`` lifts the cap (every node with ``fraction-evaluate = 1``).
        """
        k = max(1, round(self.loop.fraction_evaluate * num_nodes))
        return min(k, self.loop.evaluate_sample) if self.loop.evaluate_sample > 0 else k

    def sample(self, node_ids: Sequence[int], k: int, *, p: np.ndarray | None = None,
               replace: bool = False) -> list[int]:
        """Draw ``k`` node ids from the strategy's generator (with probabilities ``p`` when given)."""
        if k > len(node_ids) and not replace:
            raise ValueError(f"k: cannot sample {k} of {len(node_ids)} nodes without replacement")
        idx = self.rng.choice(len(node_ids), size=k, replace=replace, p=p)
        return [int(node_ids[i]) for i in np.atleast_1d(idx)]

    def communicate(self, grid: Grid, messages: Sequence[Message], **kwargs: Any) -> list[Message]:
        """Send and receive through the communicator (see :meth:`Communicator.send`)."""
        return self.comm.send(grid, messages, **kwargs)

    def communicate_stream(self, grid: Grid, messages: Sequence[Message],
                           on_replies: Callable[[list[Message]], None], **kwargs: Any) -> list[Message]:
        """Stream replies through the communicator (see :meth:`Communicator.stream`)."""
        return self.comm.stream(grid, messages, on_replies, **kwargs)

    build_messages = staticmethod(Communicator.build_messages)

    def partition(self, node_id: int) -> int | None:
        """Partition id of a node, once one of its replies has told us."""
        return self.comm.partition(node_id)

    @property
    def failures(self) -> list[Failure]:
        """Every dropped reply of the run so far."""
        return self.comm.failures

    @property
    def client_metrics(self) -> dict[int, dict[str, float]]:
        """Partition id → metrics of its latest evaluation."""
        return self.results.latest

    def train_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        """The clients' config of a training message: the local-training settings, then ``config``."""
        cfg = ConfigRecord({k: v for k, v in self.training.to_config().items() if not isinstance(v, list)})
        cfg.update({"seed": self.loop.seed, **dict(config), "server-round": int(server_round)})
        return cfg

    # ------------------------------------------------------------------ Flower's Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Default: send the global model to a seeded sample of nodes (``train``)."""
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        content = RecordDict({"arrays": arrays, "config": self.train_config(config, server_round)})
        return self.build_messages(chosen, content, MessageType.TRAIN)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Default: average the models weighted by ``num-examples`` (FedAvg; buffers keep their dtype)."""
        contents = [m.content for m in replies]
        if not contents:
            return None, None
        return (average_arrays(contents, NUM_EXAMPLES),
                mean_of_metric_records([metrics_of(m) for m in replies]))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Ask (a fraction of) all nodes to evaluate ``arrays`` on their own test sets."""
        if self.loop.fraction_evaluate == 0.0:
            return []
        nodes = self.nodes(grid)
        k = self.num_evaluate_nodes(len(nodes))
        chosen = nodes if k >= len(nodes) else sorted(self.sample(nodes, k))
        content = RecordDict({"arrays": arrays, "config": ConfigRecord({**dict(config),
                                                                        "server-round": server_round})})
        return self.build_messages(chosen, content, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Keep every client's metrics per partition and summarise them (fairness numbers)."""
        return self.results.update(replies, self.comm.node_to_partition)

    def initialize_parameters(self, client_manager: Any) -> None:
        """Refuse Flower's legacy ``Server`` loop, naming the adapter that runs this strategy there."""
        raise TypeError(f"{self.name}: a Message-API strategy cannot be the strategy of a legacy "
                        "ServerAppComponents; use flowerdro.legacy.LegacyStrategy"
                        f"('{self.name}', run_config, num_rounds=...) there (see the README, "
                        "'Use flowerdro in your own Flower project')")

    # ------------------------------------------------------------------ hooks for subclasses
    def on_start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int) -> None:
        """Reset the algorithm's state before the first round (nothing by default)."""

    def train_round(self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
                    ) -> tuple[ArrayRecord, MetricRecord | None]:
        """One round of training; returns the new global model (default: one train phase)."""
        messages = list(self.configure_train(server_round, arrays, ConfigRecord(dict(config)), grid))
        replies = self.communicate(grid, messages, phase="train", reference=arrays)
        if not replies:
            log(WARNING, "[%s] round %d: no valid training reply; model unchanged", self.run_name, server_round)
            return arrays, None
        new_arrays, metrics = self.aggregate_train(server_round, replies)
        return (new_arrays if new_arrays is not None else arrays), metrics

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

    # ------------------------------------------------------------------ the loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        resume: Mapping[str, Any] | None = None,
    ) -> Result:
        """Run ``num_rounds`` rounds: train (one or more phases), evaluate the clients, record.

        With ``resume`` (a checkpoint saved by :meth:`server_state`), the run continues
        after the checkpoint's round with the server state it held, so the rounds that
        follow are those of an uninterrupted run. Raises :class:`RunFailedError` when
        ``max-failed-rounds`` rounds in a row bring no valid training reply (the error
        names the most frequent reason and, when the clients lack a message type, how to
        add it).
        """
        if num_rounds < 1:
            raise ValueError(f"num-rounds: must be >= 1, got {num_rounds}")
        if not timeout > 0:
            raise ValueError(f"round-timeout: must be > 0, got {timeout}")
        self.comm.timeout = float(timeout)
        log(INFO, "Starting %s (%d rounds)", self.run_name, num_rounds)
        self.summary()
        self.on_start(grid, initial_arrays, num_rounds)
        result, arrays, t_run, failed_in_row, first = Result(), initial_arrays, time.time(), 0, 1
        if resume is not None:
            arrays, failed_in_row = self.restore(resume), int(resume["failed_in_row"])
            first = self._round + 1
            log(INFO, "[%s] resuming after round %d", self.run_name, self._round)
        self._notify("on_start", num_rounds)
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        self._failed_in_row = failed_in_row
        for rnd in range(first, num_rounds + 1):
            self._round = rnd
            self.comm.begin_round(rnd)
            t0 = time.time()
            arrays, train_metrics = self.train_round(rnd, grid, arrays, ConfigRecord(dict(train_config)))
            self.current_arrays = result.arrays = arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            self._failed_in_row = failed_in_row = failed_in_row + 1 if self.comm.no_train_reply() else 0
            eval_metrics, missing = None, None
            if rnd % self.loop.evaluate_every == 0 or rnd == num_rounds:
                eval_metrics, missing = self._evaluate(rnd, grid, arrays, evaluate_config)
                if eval_metrics is not None:
                    result.evaluate_metrics_clientapp[rnd] = eval_metrics
            if evaluate_fn is not None and (res := evaluate_fn(rnd, self.evaluation_arrays(arrays))) is not None:
                result.evaluate_metrics_serverapp[rnd] = res
            record = round_record(self, rnd, time.time() - t0, train_metrics, eval_metrics, missing)
            self.history.append(record)
            log(INFO, round_line(record, num_rounds))
            self._notify("on_round", record)
            if failed_in_row >= self.loop.max_failed_rounds:
                reason = failed_rounds_reason(self.failures, self._round, failed_in_row)
                hint = missing_route_hint(reason)
                raise RunFailedError(
                    f"[{self.run_name}] no valid training reply in {failed_in_row} rounds in a row "
                    f"(max-failed-rounds = {self.loop.max_failed_rounds}); most frequent reason: {reason}"
                    + (f"\n=> {hint}" if hint else ""))
        final = result.arrays = self.output_arrays(arrays)
        log(INFO, "[%s] finished %d rounds in %.1f s (%d dropped replies)", self.run_name, num_rounds,
            time.time() - t_run, len(self.failures))
        self._notify("on_end", final)
        return result

    def _evaluate(self, rnd: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
                  ) -> tuple[MetricRecord | None, dict[str, str]]:
        msgs = list(self.configure_evaluate(rnd, self.evaluation_arrays(arrays), ConfigRecord(dict(config)), grid))
        if not msgs:
            return None, {}
        replies = self.communicate(grid, msgs, phase="evaluate", required_metrics=(self.eval_metric,))
        metrics = self.aggregate_evaluate(rnd, replies)
        asked = {self.partition(int(m.metadata.dst_node_id)) for m in msgs}
        nodes = self.nodes(grid)
        connected = set(self.comm.nodes_of(nodes))
        full = len(msgs) >= len(nodes)
        gone = sorted(self.comm.partitions_seen - connected) if full else []
        reported = [self.partition(int(r.metadata.src_node_id)) for r in replies]
        fails = [f for f in self.comm.failures_of_round() if f.phase == "evaluate"]
        return metrics, missing_partitions([p for p in asked if p is not None], reported, fails, gone)


class _RoundCallback:
    """An observer that calls ``fn(record)`` after every round."""

    def __init__(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self.fn = fn

    def on_round(self, strategy: FairStrategy, record: dict[str, Any]) -> None:  # noqa: D102
        self.fn(record)


def _split(settings_class: type[Settings], config: Settings | None, loop: LoopSettings | None,
           training: TrainingSettings | None, fields_: dict[str, Any]
           ) -> tuple[Settings, LoopSettings, TrainingSettings]:
    """Distribute field overrides by name over the algorithm, loop and training settings."""
    groups: list[tuple[type[Settings], Settings | None]] = [
        (settings_class, config), (LoopSettings, loop), (TrainingSettings, training)]
    out = []
    left = dict(fields_)
    for cls, obj in groups:
        names = {f.name for f in fields(cls)}
        mine = {k: left.pop(k) for k in list(left) if k in names}
        if obj is None:
            obj = cls(**mine)
        elif mine:
            from dataclasses import replace

            obj = replace(obj, **mine)
        out.append(obj)
    if left:
        raise TypeError(f"{settings_class.__name__}: unknown settings {sorted(left)}")
    return out[0], out[1], out[2]  # type: ignore[return-value]
