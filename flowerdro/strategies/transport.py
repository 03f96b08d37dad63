"""Messages out, replies back: pushing, pulling, the round's deadline and its traffic.

:class:`Transport` pushes a phase's messages once and pulls the outstanding replies itself
(soon after replies arrive, backing off while none do) instead of Flower's
fixed-interval ``send_and_receive``; :meth:`Transport.stream` hands each pull's replies
to the caller while the others are still out. What a reply is worth is not decided
here (:class:`~flowerdro.strategies.replies.Judge`). A grid with its own ``clock()`` and
``sleep(seconds)`` (the in-process grid, whose time is simulated) is timed by them, any
other by wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.deploy.grid import pull_replies
from flowerdro.strategies.arrays import record_bytes

__all__ = ["Traffic", "Transport", "build_messages", "initial_arrays"]


@dataclass
class Traffic:
    """Bytes of the arrays sent and received in the current round."""

    bytes_sent: int = 0
    bytes_received: int = 0


def build_messages(node_ids: Iterable[int], content: RecordDict | Callable[[int], RecordDict],
                   message_type: str) -> list[Message]:
    """One message per node; ``content`` may be a function node id → RecordDict."""
    out = []
    for nid in node_ids:
        rec = content(nid) if callable(content) else content
        out.append(Message(content=rec, dst_node_id=int(nid), message_type=message_type))
    return out


class Transport:
    """Push messages, pull their replies until all came or the timeout passed.

    Parameters
    ----------
    timeout : float (default: 3600.0)
        Seconds to wait for the replies of one exchange.
    pull_interval : float (default: 0.05)
        Seconds :meth:`stream` sleeps after a pull that brought nothing.
    reply_poll : float (default: 0.01)
        Seconds :meth:`exchange` waits between two pulls of the replies (Flower's own
        ``send_and_receive`` waits 0.1 s in a simulation and 3 s in a deployment, which a
        round pays about half of per message phase after the last reply has arrived).
    reply_poll_max : float (default: 0.05)
        The longest wait between two pulls: it doubles from ``reply_poll`` after each pull
        that brought nothing, so outstanding replies are asked for at most 20 times a second
        through a long round, and a reply waits at most 0.05 s to be seen.
    """

    def __init__(self, *, timeout: float = 3600.0, pull_interval: float = 0.05, reply_poll: float = 0.01,
                 reply_poll_max: float = 0.05) -> None:
        self.timeout = float(timeout)
        self.pull_interval = float(pull_interval)
        self.reply_poll = float(reply_poll)
        self.reply_poll_max = float(reply_poll_max)
        self.traffic = Traffic()

    def begin_round(self) -> None:
        """Start counting the round's bytes."""
        self.traffic.bytes_sent = self.traffic.bytes_received = 0

    def exchange(self, grid: Grid, messages: Sequence[Message]) -> list[Message]:
        """Push ``messages`` and pull their replies (errors included) until all came or the timeout passed.

        A grid with its own ``clock()`` (the in-process grid, whose time is simulated) or
        whose ``push_messages`` raises ``NotImplementedError`` answers through its own
        ``send_and_receive``; any other is pulled :attr:`reply_poll` seconds after a pull
        that brought replies, the wait doubling after each pull that brought nothing, up to
        :attr:`reply_poll_max` (:func:`~flowerdro.deploy.grid.pull_replies`).
        """
        messages = list(messages)
        if not messages:
            return []
        self.traffic.bytes_sent += sum(record_bytes(m.content) for m in messages)
        if hasattr(grid, "clock"):
            return list(grid.send_and_receive(messages, timeout=self.timeout))
        try:
            pending = {str(i) for i in grid.push_messages(messages) if i}
        except NotImplementedError:
            return list(grid.send_and_receive(messages, timeout=self.timeout))
        return pull_replies(grid, pending, self.timeout, interval=self.reply_poll, max_interval=self.reply_poll_max)

    def push(self, grid: Grid, messages: Sequence[Message]) -> tuple[dict[str, int], list[int]] | None:
        """Push ``messages`` once: (message id → node of the pushed ones, nodes whose push failed).

        None when the grid cannot push (its ``push_messages`` raises ``NotImplementedError``).
        """
        try:
            ids = list(grid.push_messages(messages))
        except NotImplementedError:
            return None
        self.traffic.bytes_sent += sum(record_bytes(m.content) for m in messages)
        if len(ids) == len(messages):  # Flower keeps the order and puts None where a push failed
            pairs = list(zip(ids, messages, strict=True))
        else:
            pushed = {str(i) for i in ids if i}
            pairs = [(m.metadata.message_id if m.metadata.message_id in pushed else None, m) for m in messages]
        pending = {str(mid): int(m.metadata.dst_node_id) for mid, m in pairs if mid}
        return pending, [int(m.metadata.dst_node_id) for mid, m in pairs if not mid]

    def stream(self, grid: Grid, pending: dict[str, int], on_pull: Callable[[list[tuple[Message, int]]], None]
               ) -> list[int]:
        """Pull the replies of ``pending`` (message id → node) until all have come or the timeout passed.

        Each pull's replies go to ``on_pull`` as (reply, node) pairs; ``pending`` loses the
        answered messages. A pull that brought nothing is followed by a sleep of
        :attr:`pull_interval`; a reply that arrives after the deadline is not handed on. The
        time ``on_pull`` takes counts against the timeout. Returns the nodes still silent
        at the deadline.
        """
        clock, sleep = getattr(grid, "clock", time.monotonic), getattr(grid, "sleep", time.sleep)
        deadline = clock() + self.timeout
        while pending:
            replies = list(grid.pull_messages(list(pending)))
            if clock() > deadline:  # these came too late
                break
            batch = [(r, pending.pop(str(r.metadata.reply_to_message_id))) for r in replies
                     if str(r.metadata.reply_to_message_id) in pending]
            if batch:
                on_pull(batch)
            now = clock()
            if not pending or now >= deadline:
                break
            if not replies:
                sleep(min(self.pull_interval, deadline - now))
        return list(pending.values())


def initial_arrays(grid: Grid, run_config: Mapping[str, Any], timeout: float) -> ArrayRecord:
    """Ask a client for the seeded initial model (``query.init``; up to three clients are tried)."""
    start = time.monotonic()
    while not (nodes := sorted(grid.get_node_ids())):
        if time.monotonic() - start > 120:
            raise RuntimeError("no client node connected within 120 s; cannot get the initial model")
        time.sleep(1.0)
    cfg = ConfigRecord({"seed": int(run_config.get("seed", 0))})
    reasons: list[str] = []
    for nid in nodes[:3]:
        msg = Message(content=RecordDict({"config": cfg}), dst_node_id=nid, message_type="query.init")
        replies = list(grid.send_and_receive([msg], timeout=timeout))
        for reply in replies:
            if not reply.has_error() and "arrays" in reply.content.array_records:
                return reply.content.array_records["arrays"]
            if reply.has_error():
                reason = str(reply.error.reason)
                log(WARNING, "query.init failed on node %d: %s", nid,
                    "the same error as above" if reason in reasons else reason)
                reasons.append(reason)
        if not replies:
            reasons.append(f"node {nid} did not answer within {timeout:.0f} s")
    first = reasons[0].partition("\n")[0] if reasons else "no reply"
    raise RuntimeError("could not get initial model weights from any client (query.init failed); "
                       f"first reason: {first}" + (" (the client-side traceback is in the log above)"
                                                   if reasons and "\n" in reasons[0] else ""))
