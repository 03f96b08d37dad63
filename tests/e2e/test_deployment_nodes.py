"""Misconfigured SuperNodes on a loopback deployment: a second one for a live partition, one out
of range, one whose partition id is not a number.

Three SuperNodes serve partitions 0, 1, 2 of 3; a fourth is started with ``partition-id=0``
(the operator copied a command line), a fifth with ``partition-id=7`` and a sixth with
``partition-id="abc"``. The run must complete with the numbers of the three right nodes
(every partition evaluated, none missing, no partition moving between nodes), and every
round record must name the three refused nodes with the reason (the key and the value),
as the server's log does once.
"""

from __future__ import annotations

import pytest

from ._flower import flwr, wait_run
from .test_deployment_restart import Deployment, _records, run_config

pytestmark = pytest.mark.e2e


@pytest.fixture
def deployment(tmp_path):
    dep = Deployment(tmp_path, num_nodes=3)
    try:
        yield dep
    finally:
        dep.close()


def test_a_duplicate_and_an_out_of_range_supernode_are_refused_by_name(deployment, tmp_path):
    dep = deployment
    out = tmp_path / "out"
    dep.start_superlink()
    for p in range(3):
        dep.start_supernode(p)
    dep.start_supernode(0, name="duplicate")
    dep.start_supernode(7, name="out_of_range")
    dep.start_supernode('"abc"', name="not_a_number")  # type: ignore[arg-type]  # --node-config 'partition-id="abc"'
    dep.wait_online(6)
    run_id = dep.submit(run_config(num_rounds=2, strategies='fedavg', output_dir=str(out), min_available_nodes=6))
    assert wait_run(run_id, dep.env, timeout=900) == "finished:completed", dep.tail("superlink")
    records = _records(out / "fedavg")
    assert [r["round"] for r in records] == [1, 2]
    for rec in records:
        assert sorted(rec["client_acc"]) == ["0", "1", "2"] and rec["missing"] == {}, rec
        assert not rec["failures"], rec["failures"]
        reasons = sorted(rec["refused"].values())
        assert len(reasons) == 3, rec["refused"]
        assert any(r.startswith("partition 0 is served by node") for r in reasons), reasons
        assert any("partition-id 7 is outside 0..2" in r for r in reasons), reasons
        assert "its node config: partition-id: expected an integer, got 'abc'" in reasons, reasons
    log = flwr(["log", run_id, "deploy", "--show"], dep.env).stdout
    assert "refused" in log and "moved from node" not in log, log[-3000:]
