"""The round in progress: its number, its grid, what each phase sent, and what the round has produced.

A round opens with the first of Flower's methods that names it (``configure_train``, or
``configure_evaluate`` when another loop skips training) and closes in
``aggregate_evaluate`` (or when the next round opens, or the run finishes).
:class:`Round` holds what lives between those calls; :class:`RunState` what lives
between runs of one strategy object.

:func:`run_rounds` is the loop of :meth:`FairStrategy.start
<flowerdro.strategies.base.FairStrategy.start>`: each round through the strategy's
Strategy methods, a server-side ``evaluate_fn`` after it (:class:`ServerEvaluation`), and
the two early ends (an observer's :class:`~flowerdro.strategies.observers.StopRun`, a
privacy budget spent: :func:`end_at_privacy_budget`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import Result

from flowerdro.strategies.replies import Expected, RunFailedError

__all__ = ["Round", "RunState", "ServerEvaluation", "end_at_privacy_budget", "run_rounds"]


@dataclass
class Round:
    """The current round: its number, grid and start time, the phases sent, the round's results."""

    #: The round's number (the latest one opened; 0 before the first).
    number: int = 0
    #: Whether the round is open (its record not written yet).
    open: bool = False
    #: The grid the round's messages go through.
    grid: Grid | None = None
    #: Wall time the round opened (its record's ``time_s`` is measured from it).
    started: float = 0.0
    #: Phase → what it sent and what a valid reply holds, until its replies are judged.
    expected: dict[str, Expected] = field(default_factory=dict)
    #: The aggregated training metrics.
    train_metrics: MetricRecord | None = None
    #: The model after the round (until a wrapper's noised one reaches ``configure_evaluate``).
    model: ArrayRecord | None = None
    #: Whether the training replies reached ``aggregate_train``.
    train_aggregated: bool = False

    def begin(self, number: int, grid: Grid) -> None:
        """Open round ``number``."""
        self.number, self.grid, self.open, self.started = int(number), grid, True, time.time()
        self.expected, self.train_metrics, self.model, self.train_aggregated = {}, None, None, False

    def seconds(self) -> float:
        """Wall seconds since the round opened."""
        return time.time() - self.started


@dataclass
class RunState:
    """Where a strategy's run stands: started, driven by :meth:`~flowerdro.strategies.base.FairStrategy.start`,
    stopped by an observer, ended."""

    open: bool = False
    ended: bool = False
    driving: bool = False
    stopped: bool = False
    #: Whether the first training messages were checked against the settings (the settings log's note).
    training_noted: bool = False


def end_at_privacy_budget(strategy: Any, server_round: int, exc: Exception) -> None:
    """Round ``server_round`` would spend more than ``dp-max-epsilon``: end the run after the round before.

    The DP wrapper refuses the round in ``configure_train``, before any message, so the
    round is dropped, not recorded, and the run ends as an early stop (final model,
    ``on_end``). Raises :class:`~flowerdro.strategies.replies.RunFailedError` when no
    round has trained.
    """
    if not strategy.history:
        raise RunFailedError(f"[{strategy.run_name}] dp-max-epsilon: round {server_round}, the run's first, would "
                             f"already exceed the privacy budget ({exc}); nothing trained. Raise dp-max-epsilon "
                             "or dp-noise-multiplier") from exc
    strategy.round.open, strategy.round.number = False, server_round - 1
    log(WARNING, "[%s] stopped after round %d of %s: round %d would exceed the privacy budget dp-max-epsilon "
        "(%s)", strategy.run_name, server_round - 1, strategy.num_rounds, server_round, exc)


@dataclass
class ServerEvaluation:
    """A server-side ``evaluate_fn(round, arrays)``, called as Flower's ``Strategy.start`` calls it.

    On the initial model as round 0 (not when a run resumes), then after every round on
    the model the strategy evaluates; each answer that is not None goes into
    ``result.evaluate_metrics_serverapp`` under its round.
    """

    fn: Callable[[int, ArrayRecord], MetricRecord | None] | None
    result: Result
    run_name: str

    def initial(self, arrays: ArrayRecord, *, resumed: bool) -> None:
        """Evaluate the initial model as round 0 (logged), unless the run resumes."""
        if self.fn is None or resumed:
            return
        if (res := self.fn(0, arrays)) is not None:
            self.result.evaluate_metrics_serverapp[0] = res
        log(INFO, "[%s] initial global evaluation: %s", self.run_name, res)

    def after(self, server_round: int, arrays: ArrayRecord) -> None:
        """Evaluate ``arrays``, the model the strategy evaluates after round ``server_round``."""
        if self.fn is not None and (res := self.fn(server_round, arrays)) is not None:
            self.result.evaluate_metrics_serverapp[server_round] = res


def run_rounds(strategy: Any, grid: Grid, arrays: ArrayRecord, rounds: range, train_config: ConfigRecord,
               evaluate_config: ConfigRecord, evaluation: ServerEvaluation) -> ArrayRecord:
    """The rounds ``rounds`` of ``strategy`` (a FairStrategy), each through its Strategy methods.

    Each round: :meth:`train_round` (``configure_train``, the replies, ``aggregate_train``)
    with a copy of ``train_config``, :meth:`evaluate_round` (``configure_evaluate``, the
    replies, ``aggregate_evaluate``, which closes the round) with a copy of
    ``evaluate_config``, then, when there is an ``evaluate_fn``, ``evaluation.after`` on
    :meth:`evaluation_arrays`; the metrics go into ``evaluation.result``. Ends early after
    the round an observer stopped the run in, or before a round the DP wrapper's
    accountant refuses (:func:`end_at_privacy_budget`).

    Returns
    -------
    ArrayRecord
        The model the run ends with (the latest round's; the strategy's current model after
        an early end).
    """
    result = evaluation.result
    for rnd in rounds:
        try:
            arrays, train_metrics = strategy.train_round(rnd, grid, arrays, ConfigRecord(dict(train_config)))
        except PrivacyBudgetExhausted as exc:  # the DP wrapper's accountant refused round rnd's release
            end_at_privacy_budget(strategy, rnd, exc)
            return strategy.current_arrays if strategy.current_arrays is not None else arrays
        result.arrays = arrays
        if train_metrics is not None:
            result.train_metrics_clientapp[rnd] = train_metrics
        eval_metrics = strategy.evaluate_round(rnd, grid, arrays, ConfigRecord(dict(evaluate_config)))
        if eval_metrics is not None:
            result.evaluate_metrics_clientapp[rnd] = eval_metrics
        if evaluation.fn is not None:  # the model the strategy evaluates (DRFA's average: work) only when asked
            evaluation.after(rnd, strategy.evaluation_arrays(arrays))
        if strategy.run_state.stopped:
            return strategy.current_arrays if strategy.current_arrays is not None else arrays
    return arrays
