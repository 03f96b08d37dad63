"""Restarts of a loopback deployment: a SuperLink killed mid-run, a SuperNode killed mid-run.

The SuperLink keeps its state in a database file (``--database``), so the SuperNodes,
which retry without limit by default, carry on with the restarted SuperLink under their
old node ids. docs/architecture.md, "Restarting a deployment", gives the operator's
procedure with the commands these tests run (:class:`Deployment` builds them), with the
operator settings of docs/performance.md, "Deployment" (the SuperNode launcher's 0.1 s
poll and forked ClientApps, a node-local worker, the SuperExec's 0.1 s task poll) where the
installed Flower is the one the launcher patches; elsewhere plain ``flower-supernode``.

* One run of DRFA, SCAFF-PD, DR-DSGD and FedMGDA+ (3 rounds each): ``kill -9`` of the
  SuperLink (with its SuperExec and ServerApp) once SCAFF-PD's round 2 is on disk, restart,
  ``flwr run`` again with ``resume = true`` into the same output-dir. DRFA's finished run
  is kept, SCAFF-PD continues from its checkpoint, DR-DSGD and FedMGDA+ run after it; the
  round records (minus wall times) and final models of all four equal those of the same
  run through the experiments runner in this process (a seed's numbers are the same
  through every path). Every strategy's resume from a checkpoint is also checked
  in-process: tests/integration/test_resume_all.py.
* One run of SCAFFOLD then FedRobust (4 rounds each): ``kill -9`` of the SuperNode serving
  partition 1 after round 1 of each, restart with the same partition once a round without
  it is on disk: the rounds in between report partition 1 missing, and it trains again
  afterwards from the state the server kept for it (SCAFFOLD's c_1, FedRobust's (Λ_1, δ_1)).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import flwr as flower
import numpy as np
import pytest

from flowerdro.deploy.supernode import FLOWER_SERIES
from flowerdro.runs.checkpoint import load_checkpoint

from ._flower import BIN, REPO, flower_env, flwr, free_port, json_out, start, stop, wait_run

pytestmark = pytest.mark.e2e

#: Keys of a round record that measure the machine, not the algorithm.
VOLATILE = ("time_s", "server_step_s")

#: A tiny federation: 2 SuperNodes, logistic regression on 10-dimensional synthetic data.
SETTINGS = {"dataset": "synthetic", "synthetic-dim": 10, "synthetic-classes": 3, "model": "logreg", "local-steps": 2,
            "batch-size": 16, "fraction-train": 1.0, "seed": 0, "checkpoint-every": 1, "round-timeout": 60.0}


def run_config(**overrides: object) -> str:
    """``--run-config`` of :data:`SETTINGS` with ``overrides`` (``num_rounds=4`` → ``num-rounds=4``)."""
    items = {**SETTINGS, **{k.replace("_", "-"): v for k, v in overrides.items()}}
    return " ".join(f"{k}={v!r}" for k, v in items.items())


def _app_config() -> dict:
    """The defaults ``flwr run`` fuses with ``--run-config``: ``[tool.flwr.app.config]`` of pyproject.toml."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
#: The SuperNode launcher's patches hold for this Flower: the tests use the operator settings.
FAST = flower.__version__.startswith(FLOWER_SERIES)


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

    def _start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "a")  # a restart appends to the same log
        self._logs.append(log)
        self._procs.append(start(cmd, self.env if env is None else env, log))
        return self._procs[-1]

    def superlink_cmd(self) -> list[str]:
        """``flower-superlink --insecure --database FILE ...``: the same command starts and restarts it."""
        return [str(BIN / "flower-superlink"), "--insecure", "--database", str(self.database),
                "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(self.port)]

    def supernode_cmd(self, partition: int) -> list[str]:
        """``flower-supernode`` for ``partition``; it retries the SuperLink without limit (the default).

        With :data:`FAST`, through the launcher (``--poll 0.1 --fork-clientapp``) and with
        ``worker=1`` in the node config (docs/performance.md, "Deployment").
        """
        node_config = f"partition-id={partition} num-partitions={self.num_nodes}" + (" worker=1" if FAST else "")
        args = ["--insecure", "--superlink", f"127.0.0.1:{self.port}", "--node-config", node_config,
                "--host", "127.0.0.1", "--port", str(free_port())]
        if FAST:
            return [sys.executable, "-m", "flowerdro.deploy.supernode", "--poll", "0.1", "--fork-clientapp", "--",
                    *args]
        return [str(BIN / "flower-supernode"), *args]

    def start_superlink(self) -> None:
        """Start the SuperLink and wait until its Control API answers."""
        self.superlink = self._start("superlink", self.superlink_cmd())
        deadline = time.monotonic() + 90
        while not _flwr_json(["ls", "deploy"], self.env).get("success"):
            assert time.monotonic() < deadline, self.tail("superlink")
            time.sleep(1)

    def start_supernode(self, partition: int, name: str | None = None) -> subprocess.Popen:
        """Start (or restart) a SuperNode serving ``partition`` (with :data:`FAST`, its SuperExec polls every 0.1 s).

        Without ``name`` it is *the* node of ``partition`` (``self.supernodes``, log
        ``supernode<partition>.log``); with one, an extra node logging to ``<name>.log``.
        """
        env = {**self.env, "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"} if FAST else self.env
        proc = self._start(name or f"supernode{partition}", self.supernode_cmd(partition), env)
        if name is None:
            self.supernodes[partition] = proc
        return proc

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

    def run(self, run_config: str, done: Path, timeout: float = 1200) -> None:
        """Submit and wait for the run to finish (``done`` written, then its status); it must complete."""
        status = wait_run(self.submit(run_config), self.env, timeout=timeout, ready=done.exists)
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


def _wait_rounds(run_dir: Path, count: int, timeout: float = 900) -> None:
    """Wait until ``rounds.jsonl`` holds ``count`` records."""
    deadline = time.monotonic() + timeout
    while len(_records(run_dir)) < count:
        assert time.monotonic() < deadline, f"{run_dir}: fewer than {count} rounds after {timeout:.0f} s"
        time.sleep(0.2)


def _keep_checkpoints(run_dir: Path, keep: Path) -> None:
    keep.mkdir(parents=True, exist_ok=True)
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


#: The SuperLink-kill run: the SuperLink is killed once KILLED_IN's round 2 is on disk; the
#: clients evaluate after the last round only (one message phase fewer in the others).
RESUMED, KILLED_IN, KILL_ROUNDS = ("drfa", "scaffpd", "drdsgd", "fedmgda+"), "scaffpd", 3


def test_a_run_resumed_after_the_superlink_is_killed_equals_an_uninterrupted_run(deployment, tmp_path):
    # the uninterrupted run: the experiments runner, in this process (a seed's records and
    # model are the same through every path; README, "Two commands")
    from flowerdro.experiments import run
    from flowerdro.strategies.registry import settings_groups

    whole = tmp_path / "inprocess" / "whole"
    run_keys = set(settings_groups()["run"][0].keys())
    fused = {k: v for k, v in {**_app_config(), **SETTINGS, "evaluate-every": KILL_ROUNDS}.items()
             if k not in run_keys and k != "seed" and v != ""}
    run({"name": "whole", "num-rounds": KILL_ROUNDS, "seeds": [SETTINGS["seed"]], "num-partitions": 2,
         "strategies": list(RESUMED), "run-config": fused}, output_root=tmp_path / "inprocess", verbose=False)

    dep = deployment
    rc = run_config(num_rounds=KILL_ROUNDS, min_available_nodes=2, strategies=",".join(RESUMED),
                    evaluate_every=KILL_ROUNDS)
    dep.start_superlink()
    for p in range(dep.num_nodes):
        dep.start_supernode(p)
    dep.wait_online(dep.num_nodes)
    # kill -9 the SuperLink and its ServerApp once SCAFF-PD's round 2 is on disk, then restart it
    cut = tmp_path / "cut"
    dep.submit(f"{rc} output-dir='{cut}'")
    _wait_rounds(cut / KILLED_IN, 2)
    dep.kill(dep.superlink)
    done = _records(cut / KILLED_IN)
    assert len(done) < KILL_ROUNDS, "the run finished before it could be killed"
    saved = max(int(p.stem[-4:]) for p in (cut / KILLED_IN).glob("checkpoint_round*.npz"))
    finished_before = {name: _records(cut / name) for name in RESUMED[:RESUMED.index(KILLED_IN)]}
    dep.start_superlink()
    dep.wait_online(dep.num_nodes)  # the SuperNodes carried on with the restarted SuperLink
    dep.run(f"{rc} output-dir='{cut}' resume=true", done=cut / "summary.json")

    for name in RESUMED:
        assert _without_wall_times(_records(cut / name)) == _without_wall_times(_records(whole / name / "seed0")), name
        with np.load(whole / name / "seed0" / "final_model.npz") as a, np.load(cut / name / "final_model.npz") as b:
            assert a.files == b.files
            for k in a.files:
                np.testing.assert_array_equal(a[k], b[k])
    # DRFA's finished run was kept as it was, and SCAFF-PD's rounds checkpointed before the
    # kill were continued, not run again: their wall times are kept
    for name, records in finished_before.items():
        assert len(records) == KILL_ROUNDS and _records(cut / name) == records, name
    resumed = _records(cut / KILLED_IN)
    assert saved >= 1 and [r["time_s"] for r in resumed[:saved]] == [r["time_s"] for r in done[:saved]]
    assert all(p.poll() is None for p in dep.supernodes.values()), "a SuperNode exited"


def _kept_state(checkpoint: Path, name: str, partition: int) -> tuple[np.ndarray, int]:
    """What the server keeps for ``partition`` in a checkpoint: SCAFFOLD's c_i, or FedRobust's (Λ_i, δ_i) and its rounds."""
    state = load_checkpoint(checkpoint)["state"]
    if name == "scaffold":
        return np.concatenate([a.ravel() for a in state.client_controls[partition]]), 0
    shift = state["shifts"][partition]
    return np.concatenate([shift["lambda"].ravel(), shift["delta"].ravel()]), int(shift["rounds"])


#: The SuperNode-restart run: partition 1's node is killed after round 1 of each strategy and
#: restarted once a round without it is on disk; a round waits at most 30 s for a dead node.
RESTARTED, ROUNDS, GONE = ("scaffold", "fedrobust"), 4, 1


def _wait_missing(run_dir: Path, partition: int, timeout: float = 300) -> None:
    """Wait until a round record lists ``partition`` as missing."""
    deadline = time.monotonic() + timeout
    while not any(str(partition) in r["missing"] for r in _records(run_dir)):
        assert time.monotonic() < deadline, f"{run_dir}: partition {partition} never missing after {timeout:.0f} s"
        time.sleep(0.2)


def _keep_while(out: Path, kept: Path, names: tuple[str, ...], stop: threading.Event) -> None:
    """Copy every new checkpoint of ``out/<name>`` to ``kept/<name>`` until ``stop`` is set (then once more)."""
    while not stop.wait(0.05):
        for name in names:
            if (out / name).is_dir():
                _keep_checkpoints(out / name, kept / name)
    for name in names:
        if (out / name).is_dir():
            _keep_checkpoints(out / name, kept / name)


def test_a_restarted_supernode_takes_its_partitions_place_with_its_state(deployment, tmp_path):
    dep = deployment
    dep.start_superlink()
    for p in range(dep.num_nodes):
        dep.start_supernode(p)
    dep.wait_online(dep.num_nodes)
    out, kept = tmp_path / "out", tmp_path / "kept"
    # a checkpoint file lasts one round: copy each one as it appears, for the checks below
    stop_keeping = threading.Event()
    keeper = threading.Thread(target=_keep_while, args=(out, kept, RESTARTED, stop_keeping), daemon=True)
    keeper.start()
    run_id = dep.submit(run_config(round_timeout=30.0, num_rounds=ROUNDS, min_available_nodes=1,
                                   strategies=",".join(RESTARTED), output_dir=str(out)))
    before: dict[str, int] = {}
    try:
        for name in RESTARTED:
            _wait_rounds(out / name, 1)
            before[name] = len(_records(out / name))  # rounds complete before the kill
            dep.kill(dep.supernodes[GONE])
            _wait_missing(out / name, GONE)
            dep.start_supernode(GONE)
        status = wait_run(run_id, dep.env, timeout=1500, ready=(out / "summary.json").exists)
    finally:
        stop_keeping.set()
        keeper.join(timeout=10)
    assert status == "finished:completed", status + dep.tail("superlink")

    for name in RESTARTED:
        records = _records(out / name)
        assert len(records) == ROUNDS
        # partition 1 took part in a round when it is not missing and reported its evaluation
        present = [str(GONE) not in r["missing"] and str(GONE) in r["client_acc"] for r in records]
        # present before the kill; away from the round in progress at the kill (or the next)
        # for a gap; present again from its return to the end
        assert all(present[:before[name]]) and False in present, (name, [r["missing"] for r in records])
        first = present.index(False)
        assert first <= before[name] + 1, (name, before[name], present)
        assert True in present[first:], f"{name}: the restarted SuperNode never trained again"
        back = present.index(True, first)
        assert all(present[back:]), (name, present)
        # one node is gone: at most one failure per phase and round, none before or after the gap
        for r in records:
            phases = [k.split(":")[0] for k in r["failures"]]
            assert len(phases) == len(set(phases)) and all(v == 1 for v in r["failures"].values()), r["failures"]
        assert not any(r["failures"] for r in records[:first] + records[back:]), \
            (name, [r["failures"] for r in records])
        # the server kept partition 1's state while it was away (from the round of the kill, in
        # which it may have trained before it died, to the last round before its return), and
        # the node went on from that state once it was back
        at_kill, rounds_at_kill = _kept_state(kept / name / f"checkpoint_round{first + 1:04d}.npz", name, GONE)
        away, rounds_away = _kept_state(kept / name / f"checkpoint_round{back:04d}.npz", name, GONE)
        final, rounds_final = _kept_state(kept / name / f"checkpoint_round{ROUNDS:04d}.npz", name, GONE)
        np.testing.assert_array_equal(away, at_kill)
        assert np.any(final != away), name
        if name == "fedrobust":
            # (Λ_1, δ_1)'s round counter counts on from the kept one (the server refuses a reply
            # whose count is not the kept one + 1): it trained before the kill and after the return
            assert rounds_away == rounds_at_kill >= before[name] >= 1
            assert rounds_away < rounds_final <= rounds_away + ROUNDS - back + 1, (rounds_away, rounds_final)
    assert dep.supernodes[GONE].poll() is None
