"""Processes flowerdro starts end with the process they belong to and on SIGTERM (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowerdro.deploy.lifetime import EXIT_TERMINATED, parent_pid_argument

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process checks read /proc (Linux)")


def _python(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, **kwargs)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


#: The child's guard, by variant: the full one; the watcher alone on a pidfd; the watcher polling getppid().
GUARDS = {
    "death-signal": "from flowerdro.deploy.lifetime import die_with_parent; die_with_parent()",
    "pidfd": "import os; from flowerdro.deploy.lifetime import watch_process; watch_process(os.getppid(), is_parent=True)",
    "polling": ("import os; del os.pidfd_open; from flowerdro.deploy.lifetime import watch_process; "
                "watch_process(os.getppid(), is_parent=True)"),
}


@pytest.mark.parametrize("variant", sorted(GUARDS))
def test_a_child_ends_within_a_second_of_its_parents_kill_9(variant):
    child = f"{GUARDS[variant]}; print('ready', flush=True); import time; time.sleep(60)"
    parent = _python(
        "import subprocess, sys, time, os\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True)\n"
        "assert c.stdout.readline().strip() == 'ready'\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(60)\n")
    try:
        child_pid = int(parent.stdout.readline())
        assert _running(child_pid)
        parent.kill()  # SIGKILL: no handler of the parent runs
        parent.wait(timeout=10)
        assert _gone_within(child_pid, 2.0), f"child {child_pid} outlived its parent ({variant})"
    finally:
        parent.kill()
        parent.wait(timeout=10)


def test_sigterm_ends_the_process_whatever_handler_a_library_installs_later():
    code = ("import signal, time\n"
            "from flowerdro.deploy.lifetime import exit_on_sigterm\n"
            "exit_on_sigterm()\n"
            "signal.signal(signal.SIGTERM, lambda *a: time.sleep(600))  # a library's handler that never returns\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = _python(code)
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == EXIT_TERMINATED
        assert time.monotonic() - t0 < 2.0
    finally:
        proc.kill()


def test_sigterm_runs_the_graceful_exit_first_and_ends_the_process_after_the_grace():
    code = ("import os, signal, sys, time\n"
            "from flowerdro.deploy.lifetime import exit_on_sigterm\n"
            "exit_on_sigterm(lambda: print('graceful', flush=True), grace=0.5)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = _python(code)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "graceful"
        assert proc.wait(timeout=5) == EXIT_TERMINATED
    finally:
        proc.kill()


def test_a_watched_process_that_died_unreaped_counts_as_gone():
    """A dead SuperExec stays a zombie until its SuperNode reaps it: ``kill(pid, 0)`` still succeeds on it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    while _running(dead.pid):
        time.sleep(0.02)
    assert Path(f"/proc/{dead.pid}").exists()  # a zombie, not reaped (no wait() yet)
    watcher = _python(f"from flowerdro.deploy.lifetime import watch_process; import time; "
                      f"watch_process({dead.pid}); time.sleep(60)")
    try:
        assert watcher.wait(timeout=5) == 1
    finally:
        watcher.kill()
        dead.wait()


def test_the_parent_pid_argument_is_read_in_both_forms():
    assert parent_pid_argument(["--insecure", "--parent-pid", "42"]) == 42
    assert parent_pid_argument(["--parent-pid=7", "--x"]) == 7
    assert parent_pid_argument(["--parent-pid"]) is None
    assert parent_pid_argument(["--parent-pid", "x"]) is None
