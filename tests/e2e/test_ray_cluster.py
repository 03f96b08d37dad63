"""`flwr run` on an existing Ray cluster (the README's "Simulation on a Ray cluster"), on one machine.

A Ray head is started with `ray start --head --num-cpus 2` (its own temp dir and free ports,
bound to 127.0.0.1), then `scripts/flwr_run.py` runs 2 rounds of DRFA on 2 simulated clients
with `RAY_ADDRESS` pointing at it. The cluster's own session logs must show the Flower client
actors (one per CPU: 2 CPUs / `client-resources-num-cpus = 1`), so the simulation ran on that
cluster rather than on a Ray instance of its own. The head's process group is stopped at
the end (`ray stop` would end every Ray process of the machine, not only this one).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ._flower import BIN, REPO, start, stop
from ._flower import flower_env as _env
from ._flower import free_port as _free_port

pytestmark = pytest.mark.e2e


def _ray_head(temp: Path, port: int, env: dict[str, str], log) -> subprocess.Popen:
    """`ray start --head --block` with every port free and the object store small."""
    ports = {flag: str(_free_port()) for flag in (
        "--ray-client-server-port", "--node-manager-port", "--object-manager-port", "--dashboard-port",
        "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
        "--metrics-export-port")}
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2", "--port", str(port),
           "--node-ip-address", "127.0.0.1", "--temp-dir", str(temp), "--include-dashboard=false",
           "--disable-usage-stats", "--object-store-memory", str(200 * 2**20),
           *(x for kv in ports.items() for x in kv)]
    return start(cmd, env, log)


def _wait_for_head(log: Path, head: subprocess.Popen, timeout: float = 180) -> None:
    """Until `ray start` says the head runs (all its processes started), or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.poll() is None, f"ray start --head exited early:\n{log.read_text()[-3000:]}"
        if "Ray runtime started" in log.read_text(errors="replace"):
            return
        time.sleep(1.0)
    raise AssertionError(f"the Ray head did not come up within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def test_flwr_run_simulates_on_an_existing_ray_cluster(tmp_path):
    # Ray's socket paths (temp dir + session name + socket) must stay under ~107 characters
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    env = _env(tmp_path / "home")
    # Ray resolves 127.0.0.1 to the machine's network address unless cluster mode is off;
    # off, the head, its workers and the simulation's driver talk over loopback only
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    port = _free_port()
    out = tmp_path / "out"
    head_log = tmp_path / "ray-head.log"
    with head_log.open("w") as log:
        head = _ray_head(temp, port, {**env, "PYTHONUNBUFFERED": "1"}, log)
        try:
            _wait_for_head(head_log, head)
            proc = subprocess.run(
                [sys.executable, str(REPO / "scripts" / "flwr_run.py"), "--num-supernodes", "2",
                 "--run-config", f"num-rounds=2 strategies='drfa' output-dir='{out}'", "--timeout", "500"],
                cwd=REPO, env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, capture_output=True, text=True,
                timeout=600)
            logs = temp / "session_latest" / "logs"
            actors = [p for p in logs.glob("worker-*.out")
                      if ":actor_name:ClientAppActor" in p.read_text(errors="replace")]
            drivers = list(logs.glob("python-core-driver-*.log"))
        finally:
            stop([head], timeout=10)
            shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "status: finished:completed" in proc.stdout
    assert len(actors) == 2, f"Flower's client actors on the cluster: {[p.name for p in actors]}"
    assert len(drivers) == 1  # the simulation connected to the cluster as its one driver
    rounds = [json.loads(x) for x in (out / "drfa" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2] and sorted(rounds[-1]["client_acc"]) == ["0", "1"]
