"""No flowerdro process outlives its SuperNode: ``kill -9`` of a SuperNode and the ServerApp mid-run.

A SuperNode started through the launcher with forked ClientApps and a node-local worker
(docs/performance.md, "Deployment") runs three kinds of flowerdro processes: the forking
SuperExec (``python -m flowerdro.deploy.superexec ... --parent-pid <SuperNode>``), its
task forks (same command line, children of the SuperExec) and the worker
(``python -m flowerdro.deploy.worker ... --watch-pid <SuperExec>``, in a session of its
own). Once the run has trained a round (so that all three exist), the SuperNode and
the ServerApp are killed with SIGKILL, nothing else; 10 s later none of the node's
flowerdro processes may be left (:mod:`flowerdro.deploy.lifetime`). A SIGTERM to a fresh
node's SuperExec ends it and its worker as well.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from .test_deployment_restart import FAST, Deployment, _records, _wait_rounds, run_config

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not FAST, reason="the SuperNode launcher (forked ClientApps, "
                                                                   "worker) patches only its own Flower series")]


def _processes() -> dict[int, tuple[int, str, list[str]]]:
    """pid → (parent pid, state, command line) of every process (from /proc)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        out[int(stat.parent.name)] = (int(fields[1]), fields[0], [c.decode(errors="replace") for c in cmdline if c])
    return out


def _arg(cmd: list[str], name: str) -> int | None:
    return int(cmd[cmd.index(name) + 1]) if name in cmd and cmd.index(name) + 1 < len(cmd) else None


def _node_family(supernode: int, superexecs: list[int] | None = None) -> dict[str, list[int]]:
    """The living flowerdro processes of the SuperNode ``supernode``, found by their command lines.

    The SuperExec and its forks (whatever their parent now: a fork whose SuperExec died
    is re-parented) carry ``--parent-pid <supernode>``; the SuperExec is the one whose
    parent is ``supernode`` (or one of ``superexecs`` known from before); the worker
    carries ``--watch-pid <SuperExec>``.
    """
    procs = {pid: p for pid, p in _processes().items() if p[1] != "Z"}
    tagged = [pid for pid, (_, _, cmd) in procs.items()
              if "flowerdro.deploy.superexec" in cmd and _arg(cmd, "--parent-pid") == supernode]
    known = set(superexecs or ()) | {pid for pid in tagged if procs[pid][0] == supernode}
    workers = [pid for pid, (_, _, cmd) in procs.items()
               if "flowerdro.deploy.worker" in cmd and _arg(cmd, "--watch-pid") in known]
    return {"superexec": sorted(known & set(tagged)), "fork": sorted(set(tagged) - known), "worker": workers}


def _alive(pids: list[int]) -> list[int]:
    """The pids that are still running (a zombie, dead but not yet reaped, is not)."""
    procs = _processes()
    return [pid for pid in pids if pid in procs and procs[pid][1] != "Z"]


def _serverapps() -> list[int]:
    return [pid for pid, (_, state, cmd) in _processes().items()
            if state != "Z" and any(c.endswith("flwr-serverapp") for c in cmd[:2])]


@pytest.fixture
def deployment(tmp_path):
    dep = Deployment(tmp_path, num_nodes=1)
    try:
        yield dep
    finally:
        dep.close()


def _wait_family(dep: Deployment, supernode: int, timeout: float = 60) -> dict[str, list[int]]:
    """The node's flowerdro processes once its SuperExec and worker both run."""
    deadline = time.monotonic() + timeout
    while True:
        family = _node_family(supernode)
        if family["superexec"] and family["worker"]:
            return family
        assert time.monotonic() < deadline, f"no SuperExec and worker of node {supernode}: {family}" + \
            dep.tail("supernode0")
        time.sleep(0.2)


def test_no_flowerdro_process_outlives_a_killed_supernode_and_serverapp(deployment, tmp_path):
    dep = deployment
    out = tmp_path / "out"
    dep.start_superlink()
    node = dep.start_supernode(0)
    dep.wait_online(1)
    dep.submit(run_config(num_rounds=200, strategies="fedavg", output_dir=str(out), round_timeout=30.0))
    _wait_rounds(out / "fedavg", 1, timeout=300)  # a ClientApp fork has run, the worker serves the node
    family = _wait_family(dep, node.pid)
    pids = [pid for group in family.values() for pid in group]
    serverapps = _serverapps()
    assert serverapps, "no ServerApp process found" + dep.tail("superlink")

    os.kill(node.pid, signal.SIGKILL)  # the SuperNode only: its children are not signalled
    for pid in serverapps:
        os.kill(pid, signal.SIGKILL)
    node.wait(timeout=10)
    killed = time.monotonic()
    while (left := _left(node.pid, family, pids)) and time.monotonic() - killed < 10:
        time.sleep(0.1)
    assert not left, f"flowerdro processes of the killed SuperNode still alive 10 s later: {left}"
    assert len(_records(out / "fedavg")) < 200


def test_a_sigterm_to_the_superexec_ends_it_and_its_worker(deployment, tmp_path):
    dep = deployment
    out = tmp_path / "out"
    dep.start_superlink()
    node = dep.start_supernode(0)
    dep.wait_online(1)
    dep.submit(run_config(num_rounds=200, strategies="fedavg", output_dir=str(out), round_timeout=30.0))
    _wait_rounds(out / "fedavg", 1, timeout=300)
    family = _wait_family(dep, node.pid)
    (superexec,) = family["superexec"]
    os.kill(superexec, signal.SIGTERM)
    sent = time.monotonic()
    pids = [pid for group in family.values() for pid in group]
    while (left := _left(node.pid, family, pids)) and time.monotonic() - sent < 10:
        time.sleep(0.1)
    assert not left, f"flowerdro processes of the node still alive 10 s after SIGTERM to its SuperExec: {left}"
    assert node.poll() is None, "the SuperNode itself is not to end"


def _left(supernode: int, family: dict[str, list[int]], pids: list[int]) -> dict[int, tuple]:
    """The node's flowerdro processes still alive: those seen before and any started since."""
    now = _node_family(supernode, family["superexec"])
    alive = set(_alive(pids)) | {pid for group in now.values() for pid in group}
    procs = _processes()
    return {pid: procs.get(pid) for pid in sorted(alive)}
