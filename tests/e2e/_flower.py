"""Helpers shared by the e2e tests that start real Flower processes.

Each test gets its own FLWR_HOME and free ports; processes are started in their own
session (process group) so that `stop` also ends the SuperExec and app subprocesses
they spawn.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flower_env(home: Path) -> dict[str, str]:
    """Environment for Flower processes: own FLWR_HOME, no runtime installs, offline hub."""
    env = os.environ.copy()
    env.update({
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    })
    return env


def json_out(stdout: str) -> dict[str, Any]:
    """The JSON object a `flwr ... --format json` command printed (log lines before it skipped)."""
    start = stdout.find("{")
    if start < 0:
        raise ValueError(f"stdout holds no JSON object: {stdout[-2000:]!r}")
    return json.loads(stdout[start:])


def flwr(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the `flwr` CLI with ``args`` and capture its output."""
    return subprocess.run([str(BIN / "flwr"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def start(cmd: list[str], env: dict[str, str], log: IO[str]) -> subprocess.Popen:
    """Start a Flower process in its own process group, stdout and stderr into ``log``."""
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(procs: list[subprocess.Popen], timeout: float = 15) -> None:
    """SIGTERM each process group started by `start`, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # children (SuperExec, app subprocesses) may outlive the leader
        _signal_group(p, signal.SIGKILL)
        p.wait(timeout=10)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def wait_run(run_id: str, env: dict[str, str], timeout: float,
             ready: Callable[[], bool] | None = None) -> str:
    """Poll `flwr ls --run-id` until the run's status starts with ``finished``; return it.

    Each `flwr ls` is a new process that imports Flower (about a second of CPU): with
    ``ready`` (e.g. the run's last output file exists) the status is asked when ``ready()``
    turns true and every 10 s before, instead of every 2 s.
    """
    status, deadline = "", time.monotonic() + timeout
    asked = float("-inf")
    while time.monotonic() < deadline:
        if ready is None or ready() or time.monotonic() - asked >= 10:
            asked = time.monotonic()
            ls = flwr(["ls", "--run-id", run_id, "--format", "json"], env)
            if ls.returncode == 0:
                runs = json_out(ls.stdout).get("runs", [])
                status = runs[0]["status"] if runs else ""
                if status.startswith("finished"):
                    break
        time.sleep(2 if ready is None else 0.2)
    return status
