"""Every process flowerdro starts on a node ends with the node, and on SIGTERM.

A SuperNode started through :mod:`flowerdro.deploy.supernode` runs flowerdro's forking
SuperExec (:mod:`flowerdro.deploy.superexec`), which forks one process per ClientApp task,
and a ClientApp may start the node's worker (:mod:`flowerdro.deploy.worker`). Each of
them must go when the process that started it goes, however it goes (``kill -9``
included), and when it is asked to (SIGTERM): otherwise it lives on, re-parented to
PID 1, holding its memory.

* :func:`die_with_parent`: the kernel sends SIGKILL when the parent dies
  (``prctl(PR_SET_PDEATHSIG)`` through :mod:`ctypes`, Linux), the parent's death before
  that call is caught by comparing the parent id, and a watcher thread ends the process
  when the parent's process-file descriptor (``pidfd_open``) says it exited, or, without
  one, when ``getppid()`` changes (every other Unix).
* :func:`watch_process`: the watcher alone, for a process that is not its watched one's
  child (the worker outlives the ClientApp task that started it and watches the SuperExec).
* :func:`exit_on_sigterm`: SIGTERM is blocked in every thread and taken by a thread of
  its own (``sigwait``), so that nothing a library installs later (Flower replaces the
  handlers of SIGTERM and SIGINT with a graceful exit that can wait forever on a lock
  copied by ``fork``) keeps it from acting: it starts the process's own graceful exit
  (SIGINT, which Flower's handler turns into its exit) and ends the process after
  ``grace`` seconds if it is still there. A process started from a task (``fork``, or
  ``subprocess`` with ``exec``) inherits the blocked SIGTERM: the worker takes it with a
  thread of its own (:func:`guard_worker`); a process a user's ClientApp starts must unblock
  it (``signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})``) to be ended by it.

Why not a library: ``prctl(PR_SET_PDEATHSIG)`` is one C call (``python-prctl`` wraps it
but needs a compiler and libcap), and the rest is the standard library's.

:func:`guard_superexec`, :func:`guard_fork_child` and :func:`guard_worker` are the one-line
calls of the three entry points.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["EXIT_PARENT_GONE", "die_with_parent", "exit_on_sigterm", "guard_fork_child", "guard_superexec",
           "guard_worker", "parent_pid_argument", "set_parent_death_signal", "watch_process"]

#: Exit code of a process ended because the process it belongs to is gone.
EXIT_PARENT_GONE = 1
#: Exit code after SIGTERM (128 + 15, as a shell reports it).
EXIT_TERMINATED = 128 + signal.SIGTERM
#: ``PR_SET_PDEATHSIG`` of ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1
#: Seconds between two looks at the parent id where no pidfd exists.
POLL = 0.2


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent (the thread that forked it) ends.

    Returns False where there is no ``prctl`` (other systems): the caller relies on the
    watcher of :func:`die_with_parent` there.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit(code: int) -> None:
    """Leave at once (no handler, no lock: a process whose owner is gone may hold copied locks)."""
    os._exit(code)


def _wait_gone(pid: int, is_parent: bool) -> None:
    """Return when process ``pid`` has exited (or, for the parent, when this process was re-parented)."""
    fd = None
    try:
        fd = os.pidfd_open(pid)  # type: ignore[attr-defined]  # Linux >= 5.3
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        return
    while True:
        if is_parent and os.getppid() != pid:
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(POLL)


def watch_process(pid: int, *, is_parent: bool = False, on_gone: Callable[[], None] | None = None) -> threading.Thread:
    """End this process (``on_gone``, default: exit :data:`EXIT_PARENT_GONE`) once process ``pid`` has exited.

    A daemon thread waits on ``pid``'s process-file descriptor (Linux), else looks every
    :data:`POLL` seconds; a ``pid`` that is gone already ends the process at once.
    """
    action = on_gone or (lambda: _exit(EXIT_PARENT_GONE))

    def run() -> None:
        _wait_gone(pid, is_parent)
        action()

    thread = threading.Thread(target=run, daemon=True, name=f"flowerdro-watch-{pid}")
    thread.start()
    return thread


def die_with_parent(parent_pid: int | None = None) -> None:
    """End this process when its parent ends (see the module docstring).

    Parameters
    ----------
    parent_pid : int, optional
        The process this one belongs to (default: its parent now): watched until it
        exits. When it is gone already (it died before this call, and this process was
        re-parented), this process exits at once.
    """
    set_parent_death_signal(signal.SIGKILL)
    pid = os.getppid() if parent_pid is None else int(parent_pid)
    watch_process(pid, is_parent=pid == os.getppid())


def exit_on_sigterm(graceful: Callable[[], None] | None = None, *, grace: float = 3.0) -> threading.Thread:
    """Make SIGTERM end this process whatever handler a library installs later.

    Blocks SIGTERM in the calling thread (call it from the main thread before any other
    thread starts: threads inherit the mask) and starts a thread that waits for it; then
    ``graceful()`` runs (default: nothing) and the process exits with
    :data:`EXIT_TERMINATED` after ``grace`` seconds if it is still there (at once without
    ``graceful``).
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def run() -> None:
        signal.sigwait({signal.SIGTERM})
        if graceful is not None:
            try:
                graceful()
            except Exception:  # noqa: BLE001, S110  # the deadline below ends the process anyway
                pass
            time.sleep(grace)
        _exit(EXIT_TERMINATED)

    thread = threading.Thread(target=run, daemon=True, name="flowerdro-sigterm")
    thread.start()
    return thread


def _interrupt() -> None:
    """The process's graceful exit: SIGINT to itself (Flower's handlers turn it into their exit)."""
    os.kill(os.getpid(), signal.SIGINT)


def parent_pid_argument(argv: Sequence[str]) -> int | None:
    """The value of ``--parent-pid`` in ``argv`` (``--parent-pid N`` or ``--parent-pid=N``), None when absent."""
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--parent-pid" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--parent-pid="):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            return int(value)
        except ValueError:
            return None
    return None


def guard_superexec(argv: Sequence[str], *, grace: float = 3.0) -> None:
    """The SuperExec: ends with the SuperNode that started it (``--parent-pid``, else its parent), and on SIGTERM.

    SIGTERM starts Flower's graceful exit (through SIGINT) and ends the process after
    ``grace`` seconds; its forks end with it (:func:`guard_fork_child`).
    """
    exit_on_sigterm(_interrupt, grace=grace)  # first: the watcher thread then inherits the blocked SIGTERM
    die_with_parent(parent_pid_argument(argv))


def guard_fork_child(args: Sequence[str] = (), *, grace: float = 3.0) -> None:
    """A task process forked from the SuperExec: ends with the SuperExec, and on SIGTERM.

    ``args`` are the task's ``flwr-clientapp`` arguments, whose ``--parent-pid`` names the
    SuperExec (default: the parent now). Threads do not survive ``fork``: the child arms
    its own death signal, watcher and SIGTERM thread (SIGTERM is blocked already: the
    child inherits the SuperExec's mask).
    """
    exit_on_sigterm(_interrupt, grace=grace)
    die_with_parent(parent_pid_argument(args))


def guard_worker(watch_pid: int) -> None:
    """The node's worker: ends when the SuperExec ``watch_pid`` is gone (when > 0), and at once on SIGTERM.

    The worker holds nothing that needs saving (each message's Context goes back with its
    reply), so SIGTERM ends it at once; a socket it leaves is removed by the next worker.
    """
    exit_on_sigterm()
    if watch_pid > 0:
        watch_process(watch_pid)
