"""Restarts of a loopback deployment: a SuperLink killed mid-run, a SuperNode killed mid-run.

The SuperLink keeps its state in a database file (``--database``), so the SuperNodes,
which retry without limit by default, carry on with the restarted SuperLink under their
old node ids. docs/architecture.md, "Restarting a deployment", gives the operator's
procedure with the commands these tests run (:class:`Deployment` builds them).

* ``kill -9`` of the SuperLink (with its SuperExec and ServerApp) after round 2 of 4,
  restart, ``flwr run`` again with ``resume = true`` into the same output-dir: the round
  records (minus wall times) and the final model equal those of an uninterrupted run.
* ``kill -9`` of the SuperNode serving partition 1 under SCAFFOLD and FedRobust, restart
  with the same partition: the rounds in between report partition 1 missing, it trains
  again afterwards with the state the server kept for it.

Every message starts a ``flwr-clientapp`` process, so each test takes minutes of CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

import numpy as np
import pytest

from flowerdro.strategies.checkpoint import load_checkpoint

from ._flower import BIN, REPO, flower_env, flwr, free_port, json_out, start, stop, wait_run

pytestmark = pytest.mark.e2e

#: Keys of a round record that measure the machine, not the algorithm.
VOLATILE = ("time_s", "server_step_s")

#: A tiny federation: 2 SuperNodes, logistic regression on 10-dimensional synthetic data.
RUN_CONFIG = ("seed=0 dataset='synthetic' synthetic-dim=10 synthetic-classes=3 model='logreg' local-steps=2 "
              "batch-size=16 fraction-train=1.0 checkpoint-every=1 round-timeout=60")


class Deployment:
    """SuperLink (state in a database file) and SuperNodes on 127.0.0.1, insecure.

    The commands are those of docs/architecture.md, "Restarting a deployment".
    """

    def __init__(self, folder: Path, num_nodes: int) -> None:
        self.folder, self.num_nodes = folder, num_nodes
        self.home = folder / "home"
        self.home.mkdir(parents=True)
        self.port = free_port()
        self.database = folder / "superlink.db"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "127.0.0.1:{self.port}"\n'
            "insecure = true\n")
        self.env = flower_env(self.home)
        self.superlink: subprocess.Popen | None = None
        self.supernodes: dict[int, subprocess.Popen] = {}
        self._logs: list[IO[str]] = []
        self._procs: list[subprocess.Popen] = []

    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "a")  # a restart appends to the same log
        self._logs.append(log)
        self._procs.append(start(cmd, self.env, log))
        return self._procs[-1]

    def superlink_cmd(self) -> list[str]:
        """``flower-superlink --insecure --database FILE ...``: the same command starts and restarts it."""
        return [str(BIN / "flower-superlink"), "--insecure", "--database", str(self.database),
                "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(self.port)]

    def supernode_cmd(self, partition: int) -> list[str]:
        """``flower-supernode`` for ``partition``; it retries the SuperLink without limit (the default)."""
        return [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                "--node-config", f"partition-id={partition} num-partitions={self.num_nodes}",
                "--host", "127.0.0.1", "--port", str(free_port())]

    def start_superlink(self) -> None:
        """Start the SuperLink and wait until its Control API answers."""
        self.superlink = self._start("superlink", self.superlink_cmd())
        deadline = time.monotonic() + 90
        while not _flwr_json(["ls", "deploy"], self.env).get("success"):
            assert time.monotonic() < deadline, self.tail("superlink")
            time.sleep(1)

    def start_supernode(self, partition: int) -> None:
        """Start (or restart) the SuperNode serving ``partition``."""
        self.supernodes[partition] = self._start(f"supernode{partition}", self.supernode_cmd(partition))

    def online(self) -> int:
        """How many SuperNodes the SuperLink lists as online."""
        answer = _flwr_json(["supernode", "list", "deploy"], self.env)
        return sum(n.get("status") == "online" for n in answer.get("nodes", []))

    def wait_online(self, count: int, timeout: float = 120) -> None:
        """Wait until ``count`` SuperNodes are online."""
        deadline = time.monotonic() + timeout
        while self.online() < count:
            assert time.monotonic() < deadline, self.tail("superlink")
            time.sleep(1)

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """``kill -9`` a process started here, its process group and its descendants.

        The SuperLink starts its SuperExec in a session of its own, and the SuperExec the
        ServerApp: they go too, as in a crash of the machine.
        """
        family = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)

    def submit(self, run_config: str) -> str:
        """``flwr run`` the flowerdro app with ``run_config``; returns the run id."""
        sub = flwr(["run", str(REPO), "deploy", "--format", "json", "--run-config", run_config], self.env, timeout=180)
        assert sub.returncode == 0, sub.stdout + sub.stderr + self.tail("superlink")
        return str(json_out(sub.stdout)["run-id"])

    def run(self, run_config: str, timeout: float = 1200) -> None:
        """Submit and wait for the run to finish; it must complete."""
        status = wait_run(self.submit(run_config), self.env, timeout=timeout)
        assert status == "finished:completed", status + self.tail("superlink")

    def tail(self, name: str) -> str:
        """The end of a process's log, for failure messages."""
        path = self.folder / f"{name}.log"
        return f"\n--- {name}.log ---\n" + (path.read_text()[-4000:] if path.is_file() else "(none)")

    def close(self) -> None:
        """Stop every process started here."""
        stop(self._procs)
        for log in self._logs:
            log.close()


def _flwr_json(args: list[str], env: dict[str, str]) -> dict:
    """`flwr ARGS --format json` answer; these commands exit 0 on failure, so read "success"."""
    proc = flwr([*args, "--format", "json"], env)
    try:
        return json_out(proc.stdout)
    except ValueError:
        return {"success": False, "error-message": proc.stdout + proc.stderr}


def _descendants(pid: int) -> list[int]:
    """Ids of the living descendants of process ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _records(run_dir: Path) -> list[dict]:
    """The complete round records of ``run_dir/rounds.jsonl`` (a line still being written is left out)."""
    path = run_dir / "rounds.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(x) for x in text.split("\n")[:-1]]  # only newline-terminated lines


def _without_wall_times(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in records]


def _wait_rounds(run_dir: Path, count: int, timeout: float = 900, keep: Path | None = None) -> None:
    """Wait until ``rounds.jsonl`` holds ``count`` records; copy each new checkpoint to ``keep``."""
    deadline = time.monotonic() + timeout
    while len(_records(run_dir)) < count:
        assert time.monotonic() < deadline, f"{run_dir}: fewer than {count} rounds after {timeout:.0f} s"
        if keep is not None:
            _keep_checkpoints(run_dir, keep)
        time.sleep(0.2)
    if keep is not None:
        _keep_checkpoints(run_dir, keep)


def _keep_checkpoints(run_dir: Path, keep: Path) -> None:
    keep.mkdir(exist_ok=True)
    for path in run_dir.glob("checkpoint_round*.npz"):
        if not (keep / path.name).exists():
            try:
                shutil.copyfile(path, keep / path.name)
            except FileNotFoundError:  # replaced by a newer one meanwhile
                pass


@pytest.fixture
def deployment(tmp_path):
    dep = Deployment(tmp_path, num_nodes=2)
    try:
        yield dep
    finally:
        dep.close()


@pytest.mark.parametrize("name", ["drfa", "scaffpd", "drdsgd", "fedmgda+"])
def test_a_run_resumed_after_the_superlink_is_killed_equals_an_uninterrupted_run(deployment, tmp_path, name):
    dep = deployment
    rc = f"{RUN_CONFIG} num-rounds=4 min-available-nodes=2 strategies='{name}'"
    dep.start_superlink()
    for p in range(dep.num_nodes):
        dep.start_supernode(p)
    dep.wait_online(dep.num_nodes)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    dep.run(f"{rc} output-dir='{whole}'")

    # kill -9 the SuperLink and its ServerApp once round 2 is on disk, then restart it
    dep.submit(f"{rc} output-dir='{cut}'")
    _wait_rounds(cut / name, 2)
    dep.kill(dep.superlink)
    done = _records(cut / name)
    assert len(done) < 4, "the run finished before it could be killed"
    saved = max(int(p.stem[-4:]) for p in (cut / name).glob("checkpoint_round*.npz"))
    dep.start_superlink()
    dep.wait_online(dep.num_nodes)  # the SuperNodes carried on with the restarted SuperLink
    dep.run(f"{rc} output-dir='{cut}' resume=true")

    resumed = _records(cut / name)
    assert _without_wall_times(resumed) == _without_wall_times(_records(whole / name))
    # the rounds checkpointed before the kill were continued, not run again: their wall
    # times are kept
    assert saved >= 1 and [r["time_s"] for r in resumed[:saved]] == [r["time_s"] for r in done[:saved]]
    with np.load(whole / name / "final_model.npz") as a, np.load(cut / name / "final_model.npz") as b:
        assert a.files == b.files
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k])
    assert all(p.poll() is None for p in dep.supernodes.values()), "a SuperNode exited"


def _scaffold_control(checkpoint: Path, partition: int) -> np.ndarray:
    state = load_checkpoint(checkpoint)["state"]
    return np.concatenate([a.ravel() for a in state.client_controls[partition]])


@pytest.mark.parametrize("name", ["scaffold", "fedrobust"])
def test_a_restarted_supernode_takes_its_partitions_place_with_its_state(deployment, tmp_path, name):
    dep = deployment
    rounds, gone = 6, 1  # partition 1's SuperNode is killed after round 2, restarted after round 3
    dep.start_superlink()
    for p in range(dep.num_nodes):
        dep.start_supernode(p)
    dep.wait_online(dep.num_nodes)
    out, kept = tmp_path / "out", tmp_path / "kept"
    run_id = dep.submit(f"{RUN_CONFIG} num-rounds={rounds} min-available-nodes=1 strategies='{name}' "
                        f"output-dir='{out}'")
    _wait_rounds(out / name, 2, keep=kept)
    dep.kill(dep.supernodes[gone])
    _wait_rounds(out / name, 3, keep=kept)
    dep.start_supernode(gone)
    _wait_rounds(out / name, rounds, timeout=1500, keep=kept)

    records = _records(out / name)
    missing = [str(gone) in r["missing"] for r in records]
    # present before the kill, missing from round 3 on for a gap, present again to the end
    assert missing[:2] == [False, False] and missing[2], [r["missing"] for r in records]
    back = missing.index(False, 2)
    assert not any(missing[back:]), [r["missing"] for r in records]
    assert back < rounds, "the restarted SuperNode never trained again"
    assert all(sorted(r["client_acc"]) == ["0", "1"] for r in records[back:])
    # one node is gone: at most one failure per phase and round, none before or after the gap
    for r in records:
        phases = [k.split(":")[0] for k in r["failures"]]
        assert len(phases) == len(set(phases)) and all(v == 1 for v in r["failures"].values()), r["failures"]
    assert not any(r["failures"] for r in records[:2] + records[back + 1:]), [r["failures"] for r in records]
    status = wait_run(run_id, dep.env, timeout=300)
    assert status == "finished:completed", status + dep.tail("superlink")

    if name == "fedrobust":
        # (Λ_1, δ_1) continued from where it was: its round counter counts the 2 rounds
        # before the kill and those after the restart (all of them, or all but the first
        # when the node came back between that round's training and its evaluation)
        state = json.loads((out / name / "affine_state.json").read_text())
        assert 2 + (rounds - back) - 1 <= state[str(gone)]["affine-rounds"] <= 2 + (rounds - back), state
        assert state["0"]["affine-rounds"] == rounds
    else:
        # c_1 was kept while partition 1 was away, and moved again once it came back
        before = _scaffold_control(kept / "checkpoint_round0002.npz", gone)
        during = _scaffold_control(kept / f"checkpoint_round{back:04d}.npz", gone)
        final = _scaffold_control(kept / f"checkpoint_round{rounds:04d}.npz", gone)
        np.testing.assert_array_equal(during, before)
        assert np.any(final != before)
    assert dep.supernodes[gone].poll() is None
