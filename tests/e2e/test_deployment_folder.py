"""Two ``flwr run`` s of one job into one output folder on a loopback deployment: the second
is refused, naming the folder and the first run, and the first completes undisturbed.

The first run takes the lock of its ``output-dir`` when its ServerApp starts and holds it
while it waits for a SuperNode (none is started until the second run has been refused),
so the two runs overlap for as long as the test needs without training anything. The
SuperNode then runs its ClientApp processes as forks (``flowerdro.deploy.supernode
--fork-clientapp``), which keeps the first run's single round short.
"""

from __future__ import annotations

import json
import time

import pytest

from ._flower import flwr, wait_run
from .test_deployment_restart import Deployment, _records, run_config

pytestmark = pytest.mark.e2e


@pytest.fixture
def deployment(tmp_path):
    dep = Deployment(tmp_path, num_nodes=1)
    try:
        yield dep
    finally:
        dep.close()


def _wait_file(path, timeout: float, dep: Deployment) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < deadline, f"{path} did not appear" + dep.tail("superlink")
        time.sleep(0.2)


def test_a_second_flwr_run_into_a_folder_in_use_is_refused(deployment, tmp_path):
    dep = deployment
    out = tmp_path / "out"
    rc = run_config(num_rounds=1, strategies='fedavg', output_dir=str(out))
    dep.start_superlink()
    first = dep.submit(rc)
    _wait_file(out / "comparison.lock.json", 180, dep)  # the first ServerApp holds the folder
    holder = json.loads((out / "comparison.lock.json").read_text())
    assert holder["run_id"] == int(first)

    second = dep.submit(rc)
    assert wait_run(second, dep.env, timeout=180) == "finished:failed"
    logs = flwr(["log", second, "deploy", "--show"], dep.env).stdout
    assert f"output-dir: {out} is in use by another run (flwr run {first}, pid {holder['pid']}" in logs, logs

    dep.start_supernode(0)
    assert wait_run(first, dep.env, timeout=300) == "finished:completed", dep.tail("superlink")
    assert [r["round"] for r in _records(out / "fedavg")] == [1]  # one run's records only
    assert not (out / "comparison.lock.json").exists() and not (out / "fedavg" / "run.lock.json").exists()
