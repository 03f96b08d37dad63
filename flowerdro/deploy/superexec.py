"""``flower-superexec`` whose ClientApp processes are forks of itself, flwr already imported.

Flower 1.41's subprocess executor starts a new ``flwr-clientapp`` process for every task
(every message), and that process spends most of its start importing flwr. Started as
``python -m flowerdro.deploy.superexec <flower-superexec arguments>``, the SuperExec imports
``flwr-clientapp``'s code once and runs each task in a ``fork()`` of itself with the
arguments Flower would have given the command; the child runs Flower's own
``flwr_clientapp()`` and exits with its exit code. Nothing else changes: the task's token,
its Runtime API address, the parent-pid watch and the output are Flower's.

``python -m flowerdro.deploy.supernode --fork-clientapp ...`` makes the SuperNode start its
SuperExec this way. It refuses to start (exit code 2, saying why) when the installed
Flower's subprocess executor no longer starts ``flwr-clientapp`` through
``subprocess.Popen`` in the two places this patch replaces.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from flowerdro.deploy.lifetime import guard_fork_child, guard_superexec

__all__ = ["fork_task", "patch_executor"]

_COMMAND = "flwr-clientapp"


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def fork_task(args: Sequence[str], *, quiet: bool = False) -> int:
    """Run ``flwr-clientapp ARGS`` in a fork of this process; return the child's pid.

    The child resets SIGTERM/SIGINT to their defaults, points stdout and stderr at
    ``/dev/null`` when ``quiet``, runs ``flwr_clientapp()`` with ``sys.argv = args`` and leaves
    with ``os._exit`` (no handler of the parent runs in it). A thread of the parent reaps it.
    """
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            guard_fork_child(args)  # ends with the SuperExec (kill -9 included) and on SIGTERM
            if quiet:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
            sys.argv = list(args)
            flwr_clientapp()
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # noqa: BLE001  # reported, then the child exits non-zero
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True, name=f"reap-{pid}").start()
    return pid


class _Subprocess:
    """``subprocess`` as the executor sees it: ``Popen`` of ``flwr-clientapp`` forks instead."""

    def Popen(self, args: Sequence[str], **kwargs: Any) -> Any:  # noqa: N802 - the name it replaces
        if args and args[0] == _COMMAND:
            quiet = kwargs.get("stdout") is subprocess.DEVNULL
            return fork_task(args, quiet=quiet)
        return subprocess.Popen(args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def patch_executor() -> None:
    """Make Flower's subprocess executor fork ``flwr-clientapp`` tasks from this process.

    Raises
    ------
    RuntimeError
        The installed Flower's executor does not start ``flwr-clientapp`` as this patch expects.
    """
    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND
    from flwr.supercore.superexec.executor import subprocess_executor as se

    src = inspect.getsource(se.SubprocessExecutor.launch)
    if _COMMAND not in TASK_TYPE_TO_COMMAND.values() or src.count("subprocess.Popen(") != 2 \
            or se.subprocess is not subprocess:
        raise RuntimeError("flwr.supercore.superexec.executor.subprocess_executor no longer starts "
                           f"{_COMMAND!r} through subprocess.Popen as expected: the patch does not apply")
    se.subprocess = _Subprocess()


def main(argv: list[str] | None = None) -> int:
    """Patch the executor, import ``flwr-clientapp``'s code, then run ``flower-superexec ARGS``."""
    guard_superexec(sys.argv[1:] if argv is None else argv)  # ends with its SuperNode (kill -9 included), on SIGTERM
    try:
        patch_executor()
    except RuntimeError as exc:
        print(f"flowerdro.deploy.superexec: {exc}", file=sys.stderr)
        return 2
    import flwr.supernode.cli.flwr_clientapp  # noqa: F401  # imported once, inherited by every fork
    from flwr.supercore.cli import flower_superexec

    sys.argv = ["flower-superexec", *(sys.argv[1:] if argv is None else argv)]
    return flower_superexec() or 0


if __name__ == "__main__":
    sys.exit(main())
