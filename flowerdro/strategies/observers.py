"""Who follows a run: observers told when it starts, after every round, when it ends or fails.

An observer is any object with some of ``on_start(strategy, num_rounds)``,
``on_round(strategy, record)``, ``on_end(strategy, final_arrays)`` and
``on_error(strategy, exception)``: a :class:`~flowerdro.runs.output.RunWriter` (the run's
files), a tracker (:mod:`flowerdro.trackers`), an early-stopping rule that raises
:class:`StopRun`, or a plain function of the record (:class:`RoundCallback`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Observers", "RoundCallback", "StopRun"]


class StopRun(Exception):
    """Raised by an observer's ``on_round`` to end a run after that round (early stopping).

    Under :meth:`FairStrategy.start <flowerdro.strategies.base.FairStrategy.start>` (behind
    the experiments runner and the ``flwr run`` ServerApp) it is the run's end: the round's
    record stands, the model of that round is the run's final model (``output_arrays``),
    the observers get ``on_end``. Under another loop (Flower's ``Strategy.start``, a
    user's) it propagates to that loop's caller.

    Parameters
    ----------
    reason : str
        Why the run stops (logged).
    """

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


class RoundCallback:
    """An observer that calls ``fn(record)`` after every round."""

    def __init__(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self.fn = fn

    def on_round(self, strategy: Any, record: dict[str, Any]) -> None:  # noqa: D102
        self.fn(record)


class Observers:
    """The observers of one strategy's runs, told in the order they were added."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, observer: Any) -> None:
        """Follow the runs with ``observer`` (see the module docstring for what it may define)."""
        self.items.append(observer)

    def notify(self, strategy: Any, event: str, *args: Any) -> None:
        """Call ``event(strategy, *args)`` of every observer that defines it."""
        for obs in self.items:
            method = getattr(obs, event, None)
            if method is not None:
                method(strategy, *args)

    def of_type(self, cls: type) -> Any | None:
        """The first observer that is a ``cls`` (None when there is none)."""
        return next((o for o in self.items if isinstance(o, cls)), None)
