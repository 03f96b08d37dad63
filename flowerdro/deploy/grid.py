"""A Grid whose ``send_and_receive`` pulls the replies every ``interval`` seconds.

Flower 1.41's deployment grid (``flwr.superlink.grid.http_grid``) sleeps 3 s after every
pull in ``send_and_receive``, so every message phase of a round waits up to 3 s after its
last reply has reached the SuperLink. :class:`PromptGrid` wraps any Grid and runs the same
loop (push once, pull the outstanding replies until all answered or the timeout passed)
with a short sleep; a pull is one request to the SuperLink's ServerAppIo API. The sleep
doubles after every pull that brought nothing, up to ``max_interval``, and drops back to
``interval`` when replies arrive, so a long round does not keep the SuperLink busy with
pulls of thousands of outstanding ids.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

__all__ = ["ForwardingGrid", "PromptGrid", "pull_replies"]


def pull_replies(
    grid: Grid, message_ids: Iterable[str], timeout: float | None, *, interval: float, max_interval: float
) -> list[Message]:
    """Pull the replies to ``message_ids`` until all have come or ``timeout`` seconds passed.

    After a pull that brought replies the next comes ``interval`` seconds later; after one
    that brought nothing the wait doubles, up to ``max_interval``. ``timeout=None`` waits
    for every reply. Replies are returned in arrival order.
    """
    pending = {str(i) for i in message_ids if i}
    end = time.monotonic() + (timeout if timeout is not None else 0.0)
    replies: list[Message] = []
    sleep = interval
    while pending and (timeout is None or time.monotonic() < end):
        got = list(grid.pull_messages(sorted(pending)))
        replies.extend(got)
        pending.difference_update(str(m.metadata.reply_to_message_id) for m in got)
        sleep = interval if got else min(2 * sleep, max_interval)
        if pending:
            time.sleep(sleep if timeout is None else max(0.0, min(sleep, end - time.monotonic())))
    return replies


class ForwardingGrid(Grid):
    """A Grid that forwards every call to the ``grid`` it wraps (subclasses override some)."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def set_run(self, run_id: int) -> None:  # noqa: D102
        self._grid.set_run(run_id)

    @property
    def run(self) -> Any:  # noqa: D102
        return self._grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # noqa: D102
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterable[Message]:  # noqa: D102
        return self._grid.send_and_receive(messages, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        """Anything else the wrapped grid offers (``close``, ``_is_connected`` ...)."""
        return getattr(self._grid, name)


class PromptGrid(ForwardingGrid):
    """Delegate to ``grid``; ``send_and_receive`` polls every ``interval`` seconds.

    Parameters
    ----------
    grid : Grid
        The grid the ServerApp was given.
    interval : float (default: 0.05)
        Seconds slept after a pull that brought replies and left others outstanding.
    max_interval : float (default: 1.0)
        The longest sleep: after a pull that brought nothing the sleep doubles, up to this.
    """

    def __init__(self, grid: Grid, interval: float = 0.05, max_interval: float = 1.0) -> None:
        if not interval > 0:
            raise ValueError(f"PromptGrid: interval must be > 0 seconds, got {interval!r}")
        if not max_interval >= interval:
            raise ValueError(f"PromptGrid: max_interval must be >= interval ({interval}), got {max_interval!r}")
        super().__init__(grid)
        self.interval, self.max_interval = float(interval), float(max_interval)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``, then pull until every one is answered or ``timeout`` seconds passed.

        ``timeout=None`` waits for every reply. Replies come back in arrival order.
        """
        ids = [str(i) for i in self.push_messages(messages) if i]
        return pull_replies(self._grid, ids, timeout, interval=self.interval, max_interval=self.max_interval)
