"""The round every flowerdro strategy shares, carried by Flower's own Strategy methods.

:class:`FairStrategy` is a :class:`flwr.serverapp.strategy.Strategy` whose round is
exactly Flower's four methods, each a few lines that call named collaborators:

* ``configure_train`` — the drivers are checked (:class:`~flowerdro.strategies.guard.PrivacyGuard`),
  the round opens (:class:`~flowerdro.strategies.rounds.Round`), the algorithm's training
  messages are made (:meth:`~flowerdro.strategies.hooks.AlgorithmHooks.train_messages`,
  after any exchange it needs first, made through the grid the method receives: DRFA's
  discovery, SCAFF-PD's loss/gradient query);
* ``aggregate_train`` — the replies are judged (:class:`~flowerdro.strategies.replies.Judge`:
  errors, timeouts and invalid replies are failures, never crashes) and screened by the
  privacy checks, then the algorithm's server step runs
  (:meth:`~flowerdro.strategies.hooks.AlgorithmHooks.train_step`, which may make its own
  exchanges after the training, such as DRFA's loss query at w(t′));
* ``configure_evaluate`` / ``aggregate_evaluate`` — every client (or a seeded sample)
  tests the model on its own test set; the results are kept per partition
  (:class:`~flowerdro.strategies.records.ClientResults`), the round's record is written
  and handed to the observers (:class:`~flowerdro.strategies.observers.Observers`), and a
  run that cannot go on fails loudly (:class:`~flowerdro.strategies.replies.RunHealth`).

Whatever drives a strategy the Flower way therefore runs the algorithm itself: its own
:meth:`FairStrategy.start` (pushes and pulls replies promptly, resumes from a checkpoint),
Flower's ``Strategy.start``, a Flower DP wrapper around it, or a user's loop. Sampling
(the :class:`~flowerdro.strategies.roster.Roster`: nodes in partition order, drawn from
the strategy's own ``numpy.random.Generator``), the exchanges
(:class:`~flowerdro.strategies.messaging.Communicator`) and the checkpoint's content
(:mod:`~flowerdro.strategies.server_state`) are the collaborators' too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from flowerdro.protocol import NUM_EXAMPLES, TrainingSettings
from flowerdro.settings import Settings
from flowerdro.strategies.guard import PrivacyGuard
from flowerdro.strategies.hooks import AlgorithmHooks
from flowerdro.strategies.loop import EmptySettings, LoopSettings, split_settings
from flowerdro.strategies.messaging import Communicator
from flowerdro.strategies.observers import Observers, StopRun
from flowerdro.strategies.records import (
    ClientResults,
    DataSizes,
    RoundRecorder,
    mean_of_metric_records,
    round_line,
)
from flowerdro.strategies.replies import Expected, RunFailedError, RunHealth, metrics_of
from flowerdro.strategies.rounds import Round, RunState, ServerEvaluation, run_rounds
from flowerdro.strategies.settings_log import sent_training_note, settings_lines

__all__ = ["FairStrategy", "LoopSettings", "RunFailedError", "StopRun"]


class FairStrategy(AlgorithmHooks, Strategy):
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

    settings_class: ClassVar[type[Settings]] = EmptySettings

    def __init__(self, config: Settings | None = None, *, loop: LoopSettings | None = None,
                 training: TrainingSettings | None = None, run_name: str | None = None, **fields_: Any) -> None:
        self.config, self.loop, self.training = split_settings(self.settings_class, config, loop, training, fields_)
        self.run_name = run_name or self.name
        self.rng = np.random.default_rng(self.loop.seed)
        self.comm = Communicator(self.run_name)
        self.guard = PrivacyGuard(self)
        self.results = ClientResults(self.loop.accuracy_metric, self.loop.loss_metric)
        self.recorder = RoundRecorder(self.run_name, self.comm, self.results)
        self.health = RunHealth(self.run_name, self.loop.max_failed_rounds)
        self.observers = Observers()
        self.round, self.run_state = Round(), RunState()
        self.data_sizes = DataSizes()
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
        #: Seconds to wait for ``min-available-nodes`` nodes to connect.
        self.wait_timeout = 120.0

    # ------------------------------------------------------------------ Flower's summary
    def summary(self) -> None:
        """Log the settings as a small tree (the drivers are checked first: a DP wrapper is refused here)."""
        self.guard.observe()
        for line in settings_lines(self):
            log(INFO, "\t%s", line)

    # ------------------------------------------------------------------ Flower's Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Open round ``server_round`` and return the algorithm's training messages.

        :meth:`train_messages` decides them (and may first exchange messages through
        ``grid``); the replies they owe are remembered for :meth:`aggregate_train`.
        """
        self.guard.observe()
        self.guard.observe_config(config)
        self._open_round(server_round, grid, arrays)
        self.guard.check_model(arrays)
        self.current_arrays = arrays
        messages = list(self.train_messages(server_round, arrays, config, grid))
        if not self.run_state.training_noted and (note := sent_training_note(self, messages, config)) is not None:
            log(INFO, note)
        self.run_state.training_noted = True
        self.round.expected["train"] = Expected("train", messages, arrays, self.train_array_keys,
                                                tuple(self.train_required_metrics))
        self.round.train_aggregated = False
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Judge the training replies, then the algorithm's server step on the valid ones (:meth:`train_step`).

        Returns the new model (None: unchanged) and the aggregated training metrics.
        """
        self.guard.observe()
        expected = self.round.expected.pop("train", None) or Expected(
            "train", [], self.current_arrays, self.train_array_keys, tuple(self.train_required_metrics))
        valid = self.accept(expected, replies)
        self.round.train_aggregated = True
        new, metrics = self.train_step(server_round, valid)
        if new is not None:
            self.round.model = new  # the round's model, until a wrapper's (noised) one reaches configure_evaluate
        self.round.train_metrics = metrics
        return new, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Ask (a seeded sample of) the clients to test :meth:`evaluation_arrays` on their own test sets.

        ``arrays`` is the model after the round (a DP wrapper's noise included). Returns
        no message when evaluation is not due this round (``evaluate-every``).
        """
        self.guard.observe()
        self._open_round(server_round, grid, arrays)
        self.round.model = arrays
        due = self.loop.fraction_evaluate > 0 and (
            server_round % self.loop.evaluate_every == 0 or server_round == self.num_rounds)
        cfg = ConfigRecord({**dict(config), "server-round": int(server_round),
                            "accuracy-metric": self.loop.accuracy_metric, "loss-metric": self.loop.loss_metric})
        messages = list(self.evaluate_messages(server_round, arrays, cfg, grid)) if due else []
        self.round.expected["evaluate"] = Expected("evaluate", messages, None, (), (self.eval_metric,))
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Keep every client's metrics per partition, summarise them, and close the round.

        Returns the fairness numbers (``acc_mean``, ``acc_worst``, ``acc_worst20``, …) and,
        under the clients' own names, the example-weighted mean of every metric the
        replies carry (what Flower's FedAvg reports, e.g. ``accuracy``, ``val_loss``).
        Closing the round writes its record, tells the observers, and raises
        :class:`RunFailedError` when the run has failed for ``max-failed-rounds`` rounds.
        """
        self.guard.observe()
        expected = self.round.expected.pop("evaluate", None) or Expected("evaluate", [], None, (),
                                                                         (self.eval_metric,))
        asked = list(expected.messages)
        valid = self.accept(expected, replies)
        metrics = self.results.update(valid, self.comm.roster.node_to_partition) if valid else None
        out = None
        if metrics is not None:
            out = MetricRecord({**dict(metrics), **dict(mean_of_metric_records([metrics_of(r) for r in valid]))})
            out.pop(NUM_EXAMPLES, None)
        missing = self.recorder.missing(self.grid, asked, valid, self.evaluates_everyone) if asked else None
        self._close_round(metrics, missing, evaluated=bool(asked), valid_evaluations=len(valid))
        return out

    def accept(self, expected: Expected, replies: Iterable[Message]) -> list[Message]:
        """The valid replies of a phase (:meth:`Communicator.accept
        <flowerdro.strategies.messaging.Communicator.accept>`), client-side clipping checked."""
        judged = expected.judged
        valid = self.comm.accept(expected, list(replies))
        if not judged:
            valid = self.guard.screen(expected, valid, self.comm.judge)
            self.data_sizes.note(expected.phase, valid, self.partition)
        return valid

    # ------------------------------------------------------------------ the round's bookkeeping
    def _open_round(self, server_round: int, grid: Grid, arrays: ArrayRecord) -> None:
        """Start the run (first call) and round ``server_round`` (closing a previous round left open)."""
        if self.round.open and server_round != self.round.number:
            self._close_round(None, None, evaluated=False, valid_evaluations=0)
        self.round.grid = grid
        if not self.run_state.open:
            self._begin_run(grid, arrays, self.num_rounds)
        if not self.round.open:
            self.round.begin(server_round, grid)
            self.comm.begin_round(server_round)

    def _begin_run(self, grid: Grid, arrays: ArrayRecord, num_rounds: int | None,
                   resume: Mapping[str, Any] | None = None) -> ArrayRecord:
        """Reset the algorithm (or restore a checkpoint) and tell the observers the run starts."""
        self.run_state.open, self.run_state.ended = True, False
        self.on_start(grid, arrays, num_rounds)
        if resume is not None:
            arrays = self.restore(resume)
            log(INFO, "[%s] resuming after round %d", self.run_name, self.round.number)
        self.observers.notify(self, "on_start", num_rounds)
        return arrays

    def _close_round(self, eval_metrics: MetricRecord | None, missing: Mapping[str, str] | None, *,
                     evaluated: bool, valid_evaluations: int) -> None:
        """Write the round's record, tell the observers, and fail the run loudly when it cannot go on."""
        rnd, this = self.round.number, self.round
        this.open = False
        if this.model is not None:  # the model after this round (what a checkpoint and on_end hold)
            self.current_arrays = this.model
        pending = this.expected.pop("train", None)
        lost = pending is not None and bool(pending.messages) and not this.train_aggregated
        for m in pending.messages if lost else ():
            self.comm.judge.fail("train", int(m.metadata.dst_node_id), "not-aggregated",
                                 f"{self.guard.names()} did not hand the training replies to aggregate_train (an "
                                 "error reply, or fewer replies than it expects)")
        self.health.after_round(trained=not (lost or self.comm.log.no_train_reply()), evaluated=evaluated,
                                valid_evaluations=valid_evaluations)
        record = self.recorder.record(rnd, this.seconds(), this.train_metrics, eval_metrics, missing,
                                      self.round_extras())
        if self.guard.drivers and (dp := self.guard.record()) is not None:
            record["dp"] = dp
        self.history.append(record)
        log(INFO, round_line(record, self.num_rounds or rnd))
        if (line := self.data_sizes.line_once(getattr(self.training, "batch_size", None))) is not None:
            log(INFO, "[%s] %s", self.run_name, line)
        try:
            self.observers.notify(self, "on_round", record)
        except StopRun as stop:
            if not self.run_state.driving:
                raise
            log(INFO, "[%s] stopped after round %d by an observer: %s", self.run_name, rnd, stop.reason or "StopRun")
            self.run_state.stopped = True
            return
        self.health.check(rnd, self.failures)
        if self.num_rounds is not None and rnd >= self.num_rounds and not self.run_state.driving:
            self.finish()

    def finish(self, arrays: ArrayRecord | None = None) -> ArrayRecord | None:
        """End the run: the model it returns (:meth:`output_arrays`), handed to the observers' ``on_end``.

        Called by :meth:`start`, and after round ``num_rounds`` when another loop drives
        the strategy; call it yourself after a loop of your own that did not say how many
        rounds it runs. Returns the final model (None when no round has run).
        """
        if self.round.open:
            self._close_round(None, None, evaluated=False, valid_evaluations=0)
        arrays = arrays if arrays is not None else self.current_arrays
        if self.run_state.ended or arrays is None:
            return None if arrays is None else self.output_arrays(arrays)
        self.run_state.ended, self.run_state.open = True, False
        final = self.output_arrays(arrays)
        log(INFO, "[%s] finished %d rounds (%d dropped replies)", self.run_name, self.round.number,
            len(self.failures))
        self.observers.notify(self, "on_end", final)
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
        new, metrics = outer.aggregate_train(server_round, self.exchange_train(grid, messages))
        if new is None:
            log(WARNING, "[%s] round %d: no new model; the model stays as it was", self.run_name, server_round)
        return (new if new is not None else arrays), metrics

    def evaluate_round(self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
                       ) -> MetricRecord | None:
        """One evaluation phase through the Strategy methods: ``configure_evaluate``, delivery,
        ``aggregate_evaluate`` (which closes the round)."""
        outer = self.outer or self
        messages = list(outer.configure_evaluate(server_round, arrays, config, grid))
        expected = self.round.expected.get("evaluate") or Expected("evaluate", messages)
        return outer.aggregate_evaluate(server_round, self.accept(expected, self.comm.exchange(grid, messages)))

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              resume: Mapping[str, Any] | None = None) -> Result:
        """Run ``num_rounds`` rounds through Flower's four Strategy methods (the wrapper's, if :attr:`outer`).

        Each round: ``configure_train``, the replies pulled as soon as they arrive,
        ``aggregate_train``, ``configure_evaluate``, ``aggregate_evaluate`` (which writes
        the round's record). With ``resume`` (a checkpoint saved by :meth:`server_state`),
        the run continues after the checkpoint's round with the server state it held, so
        the rounds that follow are those of an uninterrupted run. ``evaluate_fn(round,
        arrays)`` (a server-side evaluation) runs on the initial model as round 0, then
        after every round, as in Flower's ``Strategy.start`` (a resumed run skips round 0).
        Raises :class:`RunFailedError` when ``max-failed-rounds`` rounds in a row bring no
        valid training reply or no valid evaluation (the error names the most frequent
        reason and, when the clients lack a message type, how to add it), or when every
        client fails alike. Under a central-DP wrapper whose accountant has a
        ``max_epsilon`` (``dp-max-epsilon``), a round that would exceed it ends the run
        after the round before it, as an early stop (logged; the final model is that round's).
        """
        if num_rounds < 1:
            raise ValueError(f"num-rounds: must be >= 1, got {num_rounds}")
        if not timeout > 0:
            raise ValueError(f"round-timeout: must be > 0, got {timeout}")
        self.comm.transport.timeout, self.num_rounds = float(timeout), int(num_rounds)
        log(INFO, "Starting %s (%d rounds)", self.run_name, num_rounds)
        (self.outer or self).summary()
        self.health.failed_in_row = self.health.eval_failed_in_row = 0
        self.round.grid = grid
        arrays = self._begin_run(grid, initial_arrays, num_rounds, resume)
        first = self.round.number + 1 if resume is not None else 1
        result, t_run = Result(), time.time()
        evaluation = ServerEvaluation(evaluate_fn, result, self.run_name)
        self.run_state.driving, self.run_state.stopped = True, False
        try:
            evaluation.initial(arrays, resumed=resume is not None)  # round 0, as Flower's Strategy.start does
            arrays = run_rounds(self, grid, arrays, range(first, num_rounds + 1), train_config or ConfigRecord(),
                                evaluate_config or ConfigRecord(), evaluation)
            result.arrays = self.finish(arrays)
        except BaseException as exc:
            self.observers.notify(self, "on_error", exc)  # e.g. the RunWriter releases its folder's lock
            if isinstance(exc, RunFailedError):  # a reported failure, not a bug: its message says all, so the
                raise exc.with_traceback(None) from exc.__cause__  # traceback starts here, not in the reply checks
            raise
        finally:
            self.run_state.driving = False
        log(INFO, "[%s] %d rounds in %.1f s", self.run_name, num_rounds - first + 1, time.time() - t_run)
        return result
