"""An exchange with the clients: messages out through the transport, valid replies back through the judge.

:class:`Communicator` is where a strategy's messages leave and its replies come back, made
of three parts with one job each: the :class:`~flowerdro.strategies.roster.Roster` (who is
connected, which partition each node serves), the
:class:`~flowerdro.strategies.transport.Transport` (push, pull, the deadline, the bytes)
and the :class:`~flowerdro.strategies.replies.Judge` (a reply is valid, or a
:class:`~flowerdro.strategies.replies.Failure` in the :class:`~flowerdro.strategies.replies.FailureLog`).

Transport and judging are separate steps, so that whoever drives a strategy (its own
:meth:`~flowerdro.strategies.base.FairStrategy.start`, Flower's ``Strategy.start``, a
DP wrapper, a user's loop) gets the same checks: :meth:`Communicator.exchange` pushes
messages and pulls the raw replies; :meth:`Communicator.accept` judges the replies of one
phase against what it sent (an :class:`~flowerdro.strategies.replies.Expected`); the
valid replies come back in message order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from flowerdro.strategies.replies import Expected, FailureLog, Judge
from flowerdro.strategies.roster import Roster
from flowerdro.strategies.transport import Transport, build_messages

__all__ = ["Communicator"]


class Communicator:
    """Messages out, valid replies back; the roster, the transport and the judge of one strategy.

    Parameters
    ----------
    run_name : str
        Label in log lines.
    **transport
        Options of the :class:`~flowerdro.strategies.transport.Transport` (``timeout``,
        ``pull_interval``, ``reply_poll``, ``reply_poll_max``).
    """

    build_messages = staticmethod(build_messages)

    def __init__(self, run_name: str, **transport: float) -> None:
        self.roster = Roster(run_name)
        self.transport = Transport(**transport)
        self.log = FailureLog(run_name)
        self.judge = Judge(self.roster, self.transport.traffic, self.log)

    def begin_round(self, server_round: int) -> None:
        """Start the round's failure and byte counts."""
        self.log.begin_round(server_round)
        self.transport.begin_round()

    def nodes(self, grid: Grid, min_nodes: int, wait_timeout: float) -> list[int]:
        """Connected node ids in partition order (:meth:`Roster.connected <flowerdro.strategies.roster.Roster.connected>`)."""
        return self.roster.connected(grid, min_nodes, wait_timeout, self.transport.timeout)

    def exchange(self, grid: Grid, messages: Sequence[Message]) -> list[Message]:
        """Push ``messages`` and pull their replies (errors included) until all came or the timeout passed."""
        return self.transport.exchange(grid, messages)

    def accept(self, expected: Expected, replies: Sequence[Message]) -> list[Message]:
        """The valid replies of one phase, in message order (:meth:`Judge.accept <flowerdro.strategies.replies.Judge.accept>`)."""
        return self.judge.accept(expected, replies, self.transport.timeout)

    def send(self, grid: Grid, messages: Sequence[Message], *, phase: str, reference: ArrayRecord | None = None,
             array_keys: Sequence[str] = ("arrays",), required_metrics: Sequence[str] = ()) -> list[Message]:
        """Send ``messages``, wait for the replies, and return the valid ones in message order.

        :meth:`exchange` then :meth:`accept`. Returning the replies in the order of
        ``messages`` (not of arrival) makes every aggregation sum in the same order on
        every run.
        """
        expected = Expected(phase, list(messages), reference, tuple(array_keys), tuple(required_metrics))
        return self.accept(expected, self.exchange(grid, expected.messages))

    def stream(self, grid: Grid, messages: Sequence[Message], on_replies: Callable[[list[Message]], None], *,
               phase: str, reference: ArrayRecord | None = None, array_keys: Sequence[str] = ("arrays",),
               required_metrics: Sequence[str] = ()) -> list[Message]:
        """Like :meth:`send`, but hand each pull's valid replies to ``on_replies`` as they arrive.

        The messages are pushed once; the outstanding ones are pulled until all have
        answered or the timeout has passed (:meth:`Transport.stream
        <flowerdro.strategies.transport.Transport.stream>`); a node silent at the deadline
        counts as a timeout. A grid that cannot push is served by one :meth:`send`.
        Returns every valid reply in arrival order.
        """
        messages = list(messages)
        if not messages:
            return []
        expected = Expected(phase, messages, reference, tuple(array_keys), tuple(required_metrics), judged=True)
        before = len(self.log.failures)
        pushed = self.transport.push(grid, messages)
        if pushed is None:
            valid = self.send(grid, messages, phase=phase, reference=reference, array_keys=array_keys,
                              required_metrics=required_metrics)
            if valid:
                on_replies(valid)
            return valid
        pending, not_pushed = pushed
        for nid in not_pushed:
            self.judge.fail(phase, nid, "error", "the grid could not push the message")
        valid: list[Message] = []

        def on_pull(batch: list[tuple[Message, int]]) -> None:
            good = [reply for reply, nid in batch if self.judge.accept_one(reply, nid, expected)]
            if good:
                valid.extend(good)
                on_replies(good)

        silent = self.transport.stream(grid, pending, on_pull)
        self.judge.timeouts(phase, silent, self.transport.timeout)
        self.log.summarise(phase, self.log.failures[before:], asked=len(messages), valid=len(valid))
        return valid
