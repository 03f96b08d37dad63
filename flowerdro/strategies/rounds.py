"""The round in progress: its number, its grid, what each phase sent, and what the round has produced.

A round opens with the first of Flower's methods that names it (``configure_train``, or
``configure_evaluate`` when another loop skips training) and closes in
``aggregate_evaluate`` (or when the next round opens, or the run finishes).
:class:`Round` holds what lives between those calls; :class:`RunState` what lives
between runs of one strategy object.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.strategies.replies import Expected, RunFailedError

__all__ = ["Round", "RunState", "end_at_privacy_budget"]


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
