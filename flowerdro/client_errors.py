"""A client error travels once, in the reply: the outermost mod of every flowerdro route.

Flower's simulation engine logs an exception that escapes a ClientApp twice per client
and message (its backend's error line with Ray's remote traceback, then the worker's own
traceback, which quotes Ray's again), and the text it sends the server names the Ray
actor's process, so no two clients' errors read alike. :func:`reply_errors` catches the
exception where flowerdro's routes are called and answers with an error reply instead
(``ErrorCode.CLIENT_APP_RAISED_EXCEPTION``) whose reason is the exception's type and
message followed by the frames that locate it (:func:`describe`): the same text on every
client that fails alike, so the server (:mod:`flowerdro.strategies.messaging`) logs it
once, naming the node and the partition, and stops a run in which every client fails
alike. Nothing is logged on the client: in a deployment the server's log names the node.

It sits below both sides of the wire that answer a message: flowerdro's client routes
(:mod:`flowerdro.clients.mods` puts :func:`reply_errors` outside every route) and the
legacy format (:func:`flowerdro.legacy_wire.serve_ins` answers a failed FitIns with
:func:`error_reply`); it needs nothing of flowerdro but Flower.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

from flwr.app import Context, Error, Message
from flwr.common.constant import ErrorCode

__all__ = ["FRAMES", "describe", "error_reply", "reply_errors"]

#: At most this many frames of each exception in the chain go into a reply (the innermost ones).
FRAMES = 5


#: flowerdro's modules that only route a message to its handler (their frames locate nothing).
ROUTING = ("flowerdro/client_errors.py", "flowerdro/clients/mods.py", "flowerdro/clients/routes.py",
           "flowerdro/legacy_wire.py", "flowerdro/legacy.py")


def _skipped(frame: traceback.FrameSummary) -> bool:
    """Whether a frame says nothing of where an error is: an installed library's (Flower, torch, ...) or
    one of flowerdro's routing frames (:data:`ROUTING`, and the ``__call__`` of a route)."""
    name = frame.filename.replace("\\", "/")
    return ("site-packages" in name or "dist-packages" in name or name.startswith("<frozen")
            or name.endswith(ROUTING) or (frame.name == "__call__" and "/flowerdro/" in name))


def _frames(exc: BaseException, limit: int) -> list[str]:
    """The innermost ``limit`` frames of ``exc`` that locate it (:func:`_skipped`), and the frame that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    kept = [f for i, f in enumerate(frames) if i == len(frames) - 1 or not _skipped(f)]
    return [f'  File "{f.filename}", line {f.lineno}, in {f.name}' + (f"\n    {f.line}" if f.line else "")
            for f in kept[-limit:]]


def describe(exc: BaseException, frames: int = FRAMES) -> str:
    """``"<Type>: <message>"``, then the frames that locate it (the cause's first, as Python prints them).

    The first line is the error as a user reads it. The frames (file, line, function,
    source; installed libraries' and flowerdro's routing frames left out, but for the one
    that raised) say where it happened, and hold no process id or address, so two clients that fail alike send the
    same text.
    """
    chain = [exc]
    while len(chain) < 3:
        nxt = chain[-1].__cause__ or (None if chain[-1].__suppress_context__ else chain[-1].__context__)
        if nxt is None or nxt in chain:
            break
        chain.append(nxt)
    lines = [f"{type(exc).__name__}: {exc}", "client-side traceback (most recent call last):"]
    for i, e in enumerate(reversed(chain)):
        lines.extend(_frames(e, frames))
        if i < len(chain) - 1:
            lines.append(f"{type(e).__name__}: {e}\n(which caused the error above)")
    return "\n".join(lines)


def error_reply(message: Message, exc: BaseException) -> Message:
    """The error reply to ``message`` for ``exc`` (:func:`describe` as its reason)."""
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=describe(exc)), reply_to=message)


def reply_errors(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """A Flower mod: ``call_next(message, context)``, or the error reply to the exception it raised."""
    try:
        return call_next(message, context)
    except Exception as exc:  # noqa: BLE001 - every error becomes the reply; the server judges it
        return error_reply(message, exc)
