"""``flower-supernode`` with a shorter idle poll: ``python -m flowerdro.deploy.supernode --poll S -- ARGS``.

Flower 1.41's SuperNode sleeps a fixed 3 s after every pull from the SuperLink that
brought no message (``flwr/supernode/start_client_internal.py``), and it pushes a finished
reply only in the loop turn after such a sleep; so every message phase waits up to 3 s for
the message and up to 3 s more before its reply leaves the node. This launcher runs the
same ``flower-supernode`` entry point with ``ARGS`` unchanged, after replacing that one
sleep by ``S`` seconds (each pull is one request to the SuperLink's Fleet API).

With ``--fork-clientapp`` the SuperNode also starts its SuperExec as
``python -m flowerdro.deploy.superexec`` (:mod:`flowerdro.deploy.superexec`: every
``flwr-clientapp`` task process is a fork of the SuperExec, flwr already imported).

It refuses to start (exit code 2, saying why) when the installed Flower is not 1.41.x or its
SuperNode loop does not contain exactly one ``time.sleep(3)`` (or, with ``--fork-clientapp``,
one ``["flower-superexec"]`` command): the patch then no longer matches the code it was
written for.
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import time
from typing import Any

__all__ = ["FLOWER_SERIES", "patch_idle_sleep", "patch_superexec_command"]

#: The Flower release series whose SuperNode loop this patch was checked against.
FLOWER_SERIES = "1.41."
_IDLE_SLEEP = "time.sleep(3)"


class _Time:
    """The ``time`` module as seen by the SuperNode loop: ``sleep(3)`` becomes ``sleep(poll)``."""

    def __init__(self, poll: float) -> None:
        self.poll = poll

    def sleep(self, seconds: float) -> None:  # noqa: D102
        time.sleep(self.poll if seconds == 3 else seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def patch_idle_sleep(poll: float) -> None:
    """Make the SuperNode's idle sleep ``poll`` seconds instead of 3.

    Raises
    ------
    ValueError
        ``poll`` is not in (0, 3].
    RuntimeError
        The installed Flower is not 1.41.x, or its SuperNode loop no longer holds exactly
        one ``time.sleep(3)``.
    """
    if not 0 < poll <= 3:
        raise ValueError(f"--poll: seconds in (0, 3], got {poll!r}")
    import flwr
    from flwr.supernode import start_client_internal as sci

    version = getattr(flwr, "__version__", "?")
    if not version.startswith(FLOWER_SERIES):
        raise RuntimeError(f"flowerdro.deploy.supernode patches Flower {FLOWER_SERIES}x; installed: {version}")
    count = inspect.getsource(sci).count(_IDLE_SLEEP)
    if count != 1 or sci.time is not time:
        raise RuntimeError(f"flwr.supernode.start_client_internal holds {count} × {_IDLE_SLEEP!r} "
                           "(1 expected): the SuperNode loop changed, the patch does not apply")
    sci.time = _Time(poll)


class _Subprocess:
    """``subprocess`` as the SuperNode sees it: ``flower-superexec`` becomes ``python -m flowerdro.deploy.superexec``."""

    def Popen(self, args: list[str], **kwargs: Any) -> Any:  # noqa: N802 - the name it replaces
        if args and args[0] == "flower-superexec":
            args = [sys.executable, "-m", "flowerdro.deploy.superexec", *args[1:]]
        return subprocess.Popen(args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def patch_superexec_command() -> None:
    """Make the SuperNode start ``python -m flowerdro.deploy.superexec`` for its SuperExec.

    Raises
    ------
    RuntimeError
        The SuperNode no longer starts ``flower-superexec`` through ``subprocess.Popen``, or
        the SuperExec's executor does not match :func:`flowerdro.deploy.superexec.patch_executor`.
    """
    from flwr.supernode import start_client_internal as sci

    from flowerdro.deploy.superexec import patch_executor

    count = inspect.getsource(sci).count('command = ["flower-superexec"]')
    if count != 1 or sci.subprocess is not subprocess:
        raise RuntimeError(f"flwr.supernode.start_client_internal holds {count} × 'command = [\"flower-superexec\"]' "
                           "(1 expected): the patch does not apply")
    patch_executor()  # checked here so that the SuperNode refuses to start, not its SuperExec
    sci.subprocess = _Subprocess()


def main(argv: list[str] | None = None) -> int:
    """Patch the idle sleep, then run ``flower-supernode`` with the arguments after ``--``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(prog="python -m flowerdro.deploy.supernode",
                                 description="flower-supernode with a shorter idle poll",
                                 epilog="example: python -m flowerdro.deploy.supernode --poll 0.1 -- "
                                        "--insecure --superlink 127.0.0.1:9092")
    ap.add_argument("--poll", type=float, default=0.1, help="seconds between pulls when idle (Flower: 3)")
    ap.add_argument("--fork-clientapp", action="store_true",
                    help="run each flwr-clientapp task as a fork of the SuperExec (flowerdro.deploy.superexec)")
    args = ap.parse_args(argv[:cut])
    try:
        patch_idle_sleep(args.poll)
        if args.fork_clientapp:
            patch_superexec_command()
    except (ValueError, RuntimeError) as exc:
        print(f"flowerdro.deploy.supernode: {exc}", file=sys.stderr)
        return 2
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *argv[cut + 1:]]
    return flower_supernode() or 0


if __name__ == "__main__":
    sys.exit(main())
