"""The round every flowerdro strategy shares, carried by Flower's own Strategy methods.

:class:`FairStrategy` is a :class:`flwr.serverapp.strategy.Strategy` whose round is
exactly Flower's four methods:

* ``configure_train`` — the algorithm's training messages (:meth:`FairStrategy.train_messages`),
  after any exchange it needs first, made through the grid the method receives (DRFA's
  discovery, SCAFF-PD's loss/gradient query);
* ``aggregate_train`` — the replies are judged (errors, timeouts and invalid replies are
  failures, never crashes), then the algorithm's server step
  (:meth:`FairStrategy.train_step`), which may make its own exchanges after the
  training (DRFA's loss query at w(t′)) through the same grid;
* ``configure_evaluate`` / ``aggregate_evaluate`` — every client (or a seeded sample)
  tests the model on its own test set; the results are kept per partition, summarised
  as fairness numbers, and the round's record is written and handed to the observers.

Whatever drives a strategy the Flower way therefore runs the algorithm itself: its own
:meth:`FairStrategy.start` (pushes and pulls replies promptly, resumes from a checkpoint),
Flower's ``Strategy.start``, a Flower DP wrapper around it, or a user's loop. What Flower's
loop lacks is added around those methods: seeded node sampling from the strategy's own
``numpy.random.Generator`` (nodes in partition order, so a seed gives the same clients on
every run), the node ↔ partition map, failure handling, a round record per round
(``add_observer``: a :class:`~flowerdro.runs.output.RunWriter` writes the files),
and a run that fails loudly: :class:`RunFailedError` after ``max-failed-rounds`` rounds
in a row without a valid training reply, or without a single valid evaluation.

A wrapper that calls these methods is identified when it first does
(:mod:`flowerdro.privacy`): a Flower DP wrapper around a strategy whose replies carry
what it cannot protect (per-client losses, control variates, …) is refused before the
first message, naming what is unprotected.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import Result, Strategy

from flowerdro.protocol import CLIPPING_KEY, NUM_EXAMPLES, USER_TRAIN_FN, TrainingSettings
from flowerdro.settings import Settings, setting
from flowerdro.strategies.arrays import array_view, arrays_to_numpy, average_arrays, numpy_to_arrays  # noqa: F401
from flowerdro.strategies.messaging import (
    Communicator,
    Expected,
    Failure,
    RunFailedError,
    failed_rounds_reason,
    metrics_of,
    missing_route_hint,
    most_frequent_reason,
)
from flowerdro.strategies.records import (
    ClientResults,
    data_sizes_line,
    mean_of_metric_records,
    missing_partitions,
    round_line,
    round_record,
)
from flowerdro.strategies.server_state import ServerState
from flowerdro.strategies.settings_log import sent_training_note, settings_lines

__all__ = ["FairStrategy", "LoopSettings", "RunFailedError", "StopRun"]


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
                                        "without a valid training reply, or without a valid evaluation", ge=1)
    accuracy_metric: str = setting("test_acc", "the evaluate replies' accuracy metric (fairness numbers); "
                                               "sent to the clients with every evaluate message")
    loss_metric: str = setting("test_loss", "the evaluate replies' loss metric; sent with every evaluate message")
    eval_metric: str | None = setting(None, "the metric every evaluate reply must carry (unset: "
                                            "accuracy-metric, or loss-metric on a regression data set)")


class StopRun(Exception):
    """Raised by an observer's ``on_round`` to end a run after that round (early stopping).

    Under :meth:`FairStrategy.start` (behind the experiments runner and the ``flwr run``
    ServerApp) it is the run's end: the round's record stands, the model of that round is
    the run's final model (``output_arrays``), the observers get ``on_end``. Under another
    loop (Flower's ``Strategy.start``, a user's) it propagates to that loop's caller.

    Parameters
    ----------
    reason : str
        Why the run stops (logged).
    """

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class EmptySettings(Settings):
    """Settings of a strategy that has none of its own."""


#: Keys of an evaluate message's config that name the reply's metrics (the server's choice wins on the client).
EVAL_METRIC_KEYS = ("accuracy-metric", "loss-metric")


class FairStrategy(ServerState, Strategy):
    """Base of flowerdro strategies: the round in Flower's methods, seeded sampling, per-client metrics.

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
    #: The ArrayRecords every training reply must hold, with the model's keys and shapes.
    train_array_keys: ClassVar[tuple[str, ...]] = ("arrays",)
    #: Metrics every training reply must carry besides ``num-examples``.
    train_required_metrics: ClassVar[tuple[str, ...]] = ()

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
        #: Rounds the run will have (set by :meth:`start`, or from ``num-rounds`` by ``build_strategy``);
        #: a run driven by someone else's loop ends (``on_end``) after this round.
        self.num_rounds: int | None = None
        #: The strategy whose Strategy methods :meth:`start` calls: a wrapper around this one
        #: (e.g. :func:`flowerdro.privacy.central_dp`), or None for this strategy itself.
        self.outer: Strategy | None = None
        #: Who calls this strategy's methods (a DP wrapper, a SecAgg+ workflow), once identified.
        self.callers: list[Any] = []
        self.wait_timeout = 120.0
        self._observers: list[Any] = []
        self._round = 0
        self._failed_in_row = 0
        self._eval_failed_in_row = 0
        self._grid: Grid | None = None
        self._expected: dict[str, Expected] = {}
        self._round_open = False
        self._run_open = False
        self._ended = False
        self._train_metrics: MetricRecord | None = None
        self._last_model: ArrayRecord | None = None
        self._train_aggregated = False
        self._t0 = 0.0
        self._sizes_logged = False
        #: Partition → ``num-examples`` of its latest training and evaluation replies (its data's sizes).
        self.data_sizes: dict[str, dict[int, int]] = {"train": {}, "evaluate": {}}
        #: Whether a client reported training with its own ``train_fn`` (the kit's user loop).
        self.user_train_fn = False

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
        """Log the settings as a small tree (the caller is identified first: a DP wrapper is checked here)."""
        self._identify_caller(sys._getframe(1))
        for line in settings_lines(self):
            log(INFO, "\t%s", line)

    def add_observer(self, observer: Any) -> None:
        """Follow the run: ``observer`` may define ``on_start(strategy, num_rounds)``,
        ``on_round(strategy, record)``, ``on_end(strategy, final_arrays)`` and
        ``on_error(strategy, exception)`` (a run that :meth:`start` drives raised)."""
        self._observers.append(observer)

    def add_round_callback(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(record)`` after every round (progress bars, early stopping, tests)."""
        self.add_observer(_RoundCallback(fn))

    def _notify(self, event: str, *args: Any) -> None:
        for obs in self._observers:
            method = getattr(obs, event, None)
            if method is not None:
                method(self, *args)

    # ------------------------------------------------------------------ privacy
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

    def _identify_caller(self, frame: Any) -> None:
        """Check, once, the object whose method called this one (a wrapper or a workflow)."""
        caller = frame.f_locals.get("self") if frame is not None else None
        if caller is None or caller is self or any(c is caller for c in self.callers):
            return
        from flowerdro.privacy import check_caller

        if check_caller(self, caller):
            self.callers.append(caller)

    # ------------------------------------------------------------------ nodes and sampling
    def nodes(self, grid: Grid) -> list[int]:
        """Connected node ids in partition order (:meth:`Communicator.roster`), at least ``min-available-nodes``.

        A node heard from for the first time is asked its partition and what it runs
        (the roll call); its mods are checked against this strategy (:mod:`flowerdro.privacy`).
        """
        nodes = self.comm.roster(grid, self.loop.min_available_nodes, self.wait_timeout)
        if self.comm.client_info:
            from flowerdro.privacy import check_client_mods

            check_client_mods(self, self.comm.client_info)
        return nodes

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
        """An extra exchange of the algorithm: send, receive, judge (see :meth:`Communicator.send`)."""
        return self.comm.send(grid, messages, **kwargs)

    def communicate_stream(self, grid: Grid, messages: Sequence[Message],
                           on_replies: Callable[[list[Message]], None], **kwargs: Any) -> list[Message]:
        """Stream replies through the communicator (see :meth:`Communicator.stream`)."""
        return self.comm.stream(grid, messages, on_replies, **kwargs)

    build_messages = staticmethod(Communicator.build_messages)

    @property
    def grid(self) -> Grid:
        """The grid of the current round (the one ``configure_train`` received)."""
        if self._grid is None:
            raise RuntimeError(f"{self.name}: no grid yet; call configure_train(server_round, arrays, config, grid) "
                               "first")
        return self._grid

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
        if self.callers:
            from flowerdro.privacy import client_clipping

            if (clipping := client_clipping(self)) is not None:
                cfg[CLIPPING_KEY] = clipping  # which of Flower's clipping mods the clients apply
        return cfg

    # ------------------------------------------------------------------ Flower's Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Open round ``server_round`` and return the algorithm's training messages.

        :meth:`train_messages` decides them (and may first exchange messages through
        ``grid``); the replies they owe are remembered for :meth:`aggregate_train`.
        """
        self._identify_caller(sys._getframe(1))
        self._open_round(server_round, grid, arrays)
        if self.callers:
            from flowerdro.privacy import check_integer_arrays

            check_integer_arrays(self, arrays)
        self.current_arrays = arrays
        messages = list(self.train_messages(server_round, arrays, config, grid))
        if not self._training_noted and (note := sent_training_note(self, messages, config)) is not None:
            log(INFO, note)
        self._training_noted = True
        self._expected["train"] = Expected("train", messages, arrays, self.train_array_keys,
                                           tuple(self.train_required_metrics))
        self._train_aggregated = False
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Judge the training replies, then the algorithm's server step on the valid ones (:meth:`train_step`).

        Returns the new model (None: unchanged) and the aggregated training metrics.
        """
        self._identify_caller(sys._getframe(1))
        expected = self._expected.pop("train", None) or Expected(
            "train", [], self.current_arrays, self.train_array_keys, tuple(self.train_required_metrics))
        valid = self.accept(expected, replies)
        self._train_aggregated = True
        new, metrics = self.train_step(server_round, valid)
        if new is not None:
            self._last_model = new  # the round's model, until a wrapper's (noised) one reaches configure_evaluate
        self._train_metrics = metrics
        return new, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Ask (a seeded sample of) the clients to test :meth:`evaluation_arrays` on their own test sets.

        ``arrays`` is the model after the round (a DP wrapper's noise included). Returns
        no message when evaluation is not due this round (``evaluate-every``).
        """
        self._identify_caller(sys._getframe(1))
        self._open_round(server_round, grid, arrays)
        self._last_model = arrays
        due = self.loop.fraction_evaluate > 0 and (
            server_round % self.loop.evaluate_every == 0 or server_round == self.num_rounds)
        cfg = ConfigRecord({**dict(config), "server-round": int(server_round),
                            "accuracy-metric": self.loop.accuracy_metric, "loss-metric": self.loop.loss_metric})
        messages = list(self.evaluate_messages(server_round, arrays, cfg, grid)) if due else []
        self._expected["evaluate"] = Expected("evaluate", messages, None, (), (self.eval_metric,))
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Keep every client's metrics per partition, summarise them, and close the round.

        Returns the fairness numbers (``acc_mean``, ``acc_worst``, ``acc_worst20``, …) and,
        under the clients' own names, the example-weighted mean of every metric the
        replies carry (what Flower's FedAvg reports, e.g. ``accuracy``, ``val_loss``).
        Closing the round writes its record, tells the observers, and raises
        :class:`RunFailedError` when the run has failed for ``max-failed-rounds`` rounds.
        """
        self._identify_caller(sys._getframe(1))
        expected = self._expected.pop("evaluate", None) or Expected("evaluate", [], None, (), (self.eval_metric,))
        asked = list(expected.messages)
        valid = self.accept(expected, replies)
        metrics = self.results.update(valid, self.comm.node_to_partition) if valid else None
        out = None
        if metrics is not None:
            out = MetricRecord({**dict(metrics), **dict(mean_of_metric_records([metrics_of(r) for r in valid]))})
            out.pop(NUM_EXAMPLES, None)
        missing = self._missing(asked, valid) if asked else None
        self._close_round(metrics, missing, evaluated=bool(asked), valid_evaluations=len(valid))
        return out

    def initialize_parameters(self, client_manager: Any) -> None:
        """Refuse Flower's legacy ``Server`` loop, naming the adapter that runs this strategy there."""
        raise TypeError(f"{self.name}: a Message-API strategy cannot be the strategy of a legacy "
                        "ServerAppComponents; use flowerdro.legacy.LegacyStrategy"
                        f"('{self.name}', run_config, num_rounds=...) there (see the README, "
                        "'Use flowerdro in your own Flower project')")

    # ------------------------------------------------------------------ hooks for subclasses
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
        return self.accept(self._expected.get("train") or Expected("train", messages), self.comm.exchange(grid, messages))

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

    # ------------------------------------------------------------------ replies
    def accept(self, expected: Expected, replies: Iterable[Message]) -> list[Message]:
        """The valid replies of a phase (:meth:`Communicator.accept`), client-side clipping checked."""
        judged = expected.judged
        valid = self.comm.accept(expected, replies)
        if judged:
            return valid
        if expected.phase == "train" and valid:
            from flowerdro.privacy import check_client_clipping

            valid = check_client_clipping(self, expected, valid)
        self.note_valid(expected.phase, valid)
        return valid

    def note_valid(self, phase: str, valid: Sequence[Message]) -> None:
        """Remember each partition's ``num-examples`` of a training or evaluate phase (its data's size)."""
        sizes = self.data_sizes.get(phase)
        if sizes is None:
            return
        for r in valid:
            mr = metrics_of(r)
            pid = self.partition(int(r.metadata.src_node_id))
            if pid is not None and NUM_EXAMPLES in mr:
                sizes[pid] = int(mr[NUM_EXAMPLES])
            if mr.get(USER_TRAIN_FN):
                self.user_train_fn = True

    # ------------------------------------------------------------------ the round's bookkeeping
    def _open_round(self, server_round: int, grid: Grid, arrays: ArrayRecord) -> None:
        """Start the run (first call) and round ``server_round`` (closing a previous round left open)."""
        if self._round_open and server_round != self._round:
            self._close_round(None, None, evaluated=False, valid_evaluations=0)
        self._grid = grid
        if not self._run_open:
            self._begin_run(grid, arrays, self.num_rounds)
        if not self._round_open:
            self._round = int(server_round)
            self.comm.begin_round(server_round)
            self._t0 = time.time()
            self._train_metrics = None
            self._last_model = None
            self._train_aggregated = False
            self._expected = {}
            self._round_open = True

    def _begin_run(self, grid: Grid, arrays: ArrayRecord, num_rounds: int | None,
                   resume: Mapping[str, Any] | None = None) -> ArrayRecord:
        """Reset the algorithm (or restore a checkpoint) and tell the observers the run starts."""
        self._run_open, self._ended = True, False
        self.on_start(grid, arrays, num_rounds)
        if resume is not None:
            arrays = self.restore(resume)
            self._failed_in_row = int(resume["failed_in_row"])
            self._eval_failed_in_row = int(resume.get("eval_failed_in_row", 0))
            log(INFO, "[%s] resuming after round %d", self.run_name, self._round)
        self._notify("on_start", num_rounds)
        return arrays

    def _close_round(self, eval_metrics: MetricRecord | None, missing: Mapping[str, str] | None, *,
                     evaluated: bool, valid_evaluations: int) -> None:
        """Write the round's record, tell the observers, and fail the run loudly when it cannot go on."""
        rnd = self._round
        self._round_open = False
        if self._last_model is not None:  # the model after this round (what a checkpoint and on_end hold)
            self.current_arrays = self._last_model
        pending = self._expected.pop("train", None)
        if pending is not None and pending.messages and not self._train_aggregated:
            who = ", ".join(type(c).__name__ for c in self.callers) or "the caller"
            for m in pending.messages:
                self.comm._fail("train", int(m.metadata.dst_node_id), "not-aggregated",
                                f"{who} did not hand the training replies to aggregate_train (an error reply, or "
                                "fewer replies than it expects)")
        no_train = (pending is not None and pending.messages and not self._train_aggregated) or \
            self.comm.no_train_reply()
        self._failed_in_row = self._failed_in_row + 1 if no_train else 0
        if evaluated:
            self._eval_failed_in_row = 0 if valid_evaluations else self._eval_failed_in_row + 1
        record = round_record(self, rnd, time.time() - self._t0, self._train_metrics, eval_metrics, missing)
        if self.callers:
            from flowerdro.privacy import privacy_record

            if (dp := privacy_record(self)) is not None:
                record["dp"] = dp
        self.history.append(record)
        log(INFO, round_line(record, self.num_rounds or rnd))
        if not self._sizes_logged and (line := data_sizes_line(self)) is not None:
            log(INFO, "[%s] %s", self.run_name, line)
            self._sizes_logged = True
        try:
            self._notify("on_round", record)
        except StopRun as stop:
            if not self._driving:
                raise
            log(INFO, "[%s] stopped after round %d by an observer: %s", self.run_name, rnd, stop.reason or "StopRun")
            self._stopped = True
            return
        self._fail_if_stuck()
        if self.num_rounds is not None and rnd >= self.num_rounds and not self._driving:
            self.finish()

    _driving = False
    _stopped = False
    _training_noted = False  # the first training messages were checked against the settings

    def _fail_if_stuck(self) -> None:
        """Raise :class:`RunFailedError` after ``max-failed-rounds`` rounds without training or evaluation."""
        limit = self.loop.max_failed_rounds
        if self._failed_in_row >= limit:
            reason = failed_rounds_reason(self.failures, self._round, self._failed_in_row)
            hint = missing_route_hint(reason)
            raise RunFailedError(
                f"[{self.run_name}] no valid training reply in {self._failed_in_row} rounds in a row "
                f"(max-failed-rounds = {limit}); most frequent reason: {reason}" + (f"\n=> {hint}" if hint else ""))
        if self._eval_failed_in_row >= limit:
            fails = [f for f in self.failures if f.phase == "evaluate"
                     and f.round > self._round - self._eval_failed_in_row]
            reason = most_frequent_reason(fails) or "unknown"
            hint = missing_route_hint(reason)
            raise RunFailedError(
                f"[{self.run_name}] no client evaluation succeeded in {self._eval_failed_in_row} evaluated rounds in "
                f"a row (max-failed-rounds = {limit}), so the run has no fairness number; most frequent reason: "
                f"{reason}" + (f"\n=> {hint}" if hint else ""))

    def _end_at_privacy_budget(self, server_round: int, exc: Exception) -> None:
        """Round ``server_round`` would spend more than ``dp-max-epsilon``: end the run after the round before.

        The DP wrapper refuses the round in ``configure_train``, before any message, so the
        round is dropped, not recorded, and the run ends as an early stop (final model,
        ``on_end``). Raises :class:`RunFailedError` when no round has trained.
        """
        if not self.history:
            raise RunFailedError(f"[{self.run_name}] dp-max-epsilon: round {server_round}, the run's first, would "
                                 f"already exceed the privacy budget ({exc}); nothing trained. Raise dp-max-epsilon "
                                 "or dp-noise-multiplier") from exc
        self._round_open, self._round = False, server_round - 1
        log(WARNING, "[%s] stopped after round %d of %s: round %d would exceed the privacy budget dp-max-epsilon "
            "(%s)", self.run_name, server_round - 1, self.num_rounds, server_round, exc)

    def _missing(self, asked: list[Message], valid: list[Message]) -> dict[str, str]:
        """Partition → why it did not report this round's evaluation (see :func:`missing_partitions`).

        When every client was meant to evaluate, every partition known to the run is
        accounted for: one whose node has left is ``node gone``, one whose node came back
        after the evaluate messages were sent is ``joined late``.
        """
        asked_parts = {self.partition(int(m.metadata.dst_node_id)) for m in asked}
        nodes = [int(n) for n in self.grid.get_node_ids()]
        self.comm.roll_call(self.grid, nodes)  # a node that came back during the round says its partition
        nodes = [n for n in nodes if n not in self.comm.refused]
        connected = set(self.comm.nodes_of(nodes))
        full = self.loop.fraction_evaluate >= 1.0 and self.num_evaluate_nodes(len(nodes)) >= len(nodes)
        known = self.comm.partitions_seen | set(self.comm.node_to_partition.values())
        gone = sorted(known - connected) if full else []
        late = sorted((known & connected) - asked_parts) if full else []
        reported = [self.partition(int(r.metadata.src_node_id)) for r in valid]
        fails = [f for f in self.comm.failures_of_round() if f.phase == "evaluate"]
        return missing_partitions([p for p in asked_parts if p is not None], [p for p in reported if p is not None],
                                  fails, gone, late)

    def finish(self, arrays: ArrayRecord | None = None) -> ArrayRecord | None:
        """End the run: the model it returns (:meth:`output_arrays`), handed to the observers' ``on_end``.

        Called by :meth:`start`, and after round ``num_rounds`` when another loop drives
        the strategy; call it yourself after a loop of your own that did not say how many
        rounds it runs. Returns the final model (None when no round has run).
        """
        if self._round_open:
            self._close_round(None, None, evaluated=False, valid_evaluations=0)
        arrays = arrays if arrays is not None else self.current_arrays
        if self._ended or arrays is None:
            return None if arrays is None else self.output_arrays(arrays)
        self._ended, self._run_open = True, False
        final = self.output_arrays(arrays)
        log(INFO, "[%s] finished %d rounds (%d dropped replies)", self.run_name, self._round, len(self.failures))
        self._notify("on_end", final)
        return final

    # ------------------------------------------------------------------ the loop
    def train_round(self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
                    ) -> tuple[ArrayRecord, MetricRecord | None]:
        """One training phase through the Strategy methods (the wrapper's, when :attr:`outer` is set).

        ``configure_train``, delivery (:meth:`exchange_train`), ``aggregate_train``;
        returns the new model (``arrays`` when unchanged) and the training metrics.
        """
        outer = self.outer or self
        messages = list(outer.configure_train(server_round, arrays, config, grid))
        replies = self.exchange_train(grid, messages)
        new, metrics = outer.aggregate_train(server_round, replies)
        if new is None:
            log(WARNING, "[%s] round %d: no new model; the model stays as it was", self.run_name, server_round)
        return (new if new is not None else arrays), metrics

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
        """Run ``num_rounds`` rounds through Flower's four Strategy methods (the wrapper's, if :attr:`outer`).

        Each round: ``configure_train``, the replies pulled as soon as they arrive,
        ``aggregate_train``, ``configure_evaluate``, ``aggregate_evaluate`` (which writes
        the round's record). With ``resume`` (a checkpoint saved by :meth:`server_state`),
        the run continues after the checkpoint's round with the server state it held, so
        the rounds that follow are those of an uninterrupted run. ``evaluate_fn(round,
        arrays)`` (a server-side evaluation) runs on the initial model as round 0, then
        after every round, as in Flower's ``Strategy.start`` (a resumed run skips round 0).
        Raises
        :class:`RunFailedError` when ``max-failed-rounds`` rounds in a row bring no valid
        training reply or no valid evaluation (the error names the most frequent reason
        and, when the clients lack a message type, how to add it), or when every client
        fails alike. Under a central-DP wrapper whose accountant has a ``max_epsilon``
        (``dp-max-epsilon``), a round that would exceed it ends the run after the round
        before it, as an early stop (logged; the final model is that round's).
        """
        if num_rounds < 1:
            raise ValueError(f"num-rounds: must be >= 1, got {num_rounds}")
        if not timeout > 0:
            raise ValueError(f"round-timeout: must be > 0, got {timeout}")
        self.comm.timeout = float(timeout)
        self.num_rounds = int(num_rounds)
        outer = self.outer or self
        log(INFO, "Starting %s (%d rounds)", self.run_name, num_rounds)
        outer.summary()
        self._failed_in_row = self._eval_failed_in_row = 0
        self._grid = grid
        arrays = self._begin_run(grid, initial_arrays, num_rounds, resume)
        first = self._round + 1 if resume is not None else 1
        result, t_run = Result(), time.time()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        self._driving, self._stopped = True, False
        try:
            if evaluate_fn is not None and resume is None:  # the initial model, as Flower's Strategy.start does
                if (res := evaluate_fn(0, arrays)) is not None:
                    result.evaluate_metrics_serverapp[0] = res
                log(INFO, "[%s] initial global evaluation: %s", self.run_name, res)
            for rnd in range(first, num_rounds + 1):
                try:
                    arrays, train_metrics = self.train_round(rnd, grid, arrays, ConfigRecord(dict(train_config)))
                except PrivacyBudgetExhausted as exc:  # the DP wrapper's accountant refused round rnd's release
                    self._end_at_privacy_budget(rnd, exc)
                    arrays = self.current_arrays if self.current_arrays is not None else arrays
                    break
                result.arrays = arrays
                if train_metrics is not None:
                    result.train_metrics_clientapp[rnd] = train_metrics
                messages = list(outer.configure_evaluate(rnd, arrays, ConfigRecord(dict(evaluate_config)), grid))
                expected = self._expected.get("evaluate") or Expected("evaluate", messages)
                replies = self.accept(expected, self.comm.exchange(grid, messages))
                eval_metrics = outer.aggregate_evaluate(rnd, replies)
                if eval_metrics is not None:
                    result.evaluate_metrics_clientapp[rnd] = eval_metrics
                if evaluate_fn is not None and (res := evaluate_fn(rnd, self.evaluation_arrays(arrays))) is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
                if self._stopped:
                    arrays = self.current_arrays if self.current_arrays is not None else arrays
                    break
            result.arrays = self.finish(arrays)
        except BaseException as exc:
            self._notify("on_error", exc)  # e.g. the RunWriter releases its folder's lock
            if isinstance(exc, RunFailedError):  # a reported failure, not a bug: its message says all, so the
                raise exc.with_traceback(None) from exc.__cause__  # traceback starts here, not in the reply checks
            raise
        finally:
            self._driving = False
        log(INFO, "[%s] %d rounds in %.1f s", self.run_name, num_rounds - first + 1, time.time() - t_run)
        return result


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
