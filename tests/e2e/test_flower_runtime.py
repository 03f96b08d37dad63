"""True Flower runs: `flwr run .` on the simulation engine (Ray) and a local deployment.

These spin up real Flower processes (SuperLink, Ray or SuperNodes) and take about a minute
each. Every test uses its own FLWR_HOME and ports, and stops what it started.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ._flower import BIN, REPO, start, stop, wait_run
from ._flower import flower_env as _env
from ._flower import free_port as _free_port

pytestmark = pytest.mark.e2e


def _flwr_run(tmp_path: Path, run_config: str, supernodes: int = 4) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "flwr_run.py"), "--num-supernodes", str(supernodes),
         "--run-config", run_config, "--timeout", "800"],
        cwd=REPO, env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=900,
    )


def test_flwr_run_simulation_completes_and_reports_fairness(tmp_path):
    out = tmp_path / "out"
    # every algorithm family through the real simulation engine, in one Ray start
    names = {"fedavg", "qfedavg", "drfa", "drfa-prox", "afl", "scaffpd", "scaffold", "fedmgda+", "drdsgd",
             "fedrobust"}
    proc = _flwr_run(tmp_path, f"num-rounds=2 strategies='{','.join(sorted(names))}' output-dir='{out}'")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "status: finished:completed" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())["summaries"]
    assert set(summary) == names
    for (s,) in summary.values():  # one seed per strategy
        assert 0.0 <= s["acc_worst"] <= s["acc_mean"] <= s["acc_best20"] <= 1.0
    for name in names:
        rounds = [json.loads(x) for x in (out / name / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rounds] == [1, 2]
        assert len(rounds[-1]["client_acc"]) == 4
        assert not any(r["failures"] for r in rounds)
    for name in ("drfa", "drfa-prox", "afl"):
        last = json.loads((out / name / "rounds.jsonl").read_text().splitlines()[-1])
        lam = last["lambda"]
        assert sorted(lam) == ["0", "1", "2", "3"]
        # λ is float64 on the simplex and JSON keeps float64 exactly: the sum is within n·eps
        # (2.2e-16) of 1; 1e-9 is ample
        assert abs(sum(lam.values()) - 1.0) < 1e-9 and min(lam.values()) >= 0.0


#: The README's `run_simulation` pattern ("`flwr run`, or `run_simulation` from Python") on the
#: Message-API example: a wrapper ServerApp fills the run config that run_simulation leaves empty.
RUN_SIMULATION = """
import sys
sys.path.insert(0, sys.argv[1])
from flwr.serverapp import ServerApp
from flwr.simulation import run_simulation
from msgexample import client_app, server_app

def with_run_config(app, run_config):
    wrapper = ServerApp()

    @wrapper.main()
    def main(grid, context):
        context.run_config = {**run_config, **context.run_config}
        app(grid, context)

    return wrapper

run_config = {"strategy": "drfa", "num-server-rounds": 2, "lr": 0.05, "local-epochs": 1, "batch-size": 32}
run_simulation(server_app=with_run_config(server_app.app, run_config), client_app=client_app.app,
               num_supernodes=2, backend_config={"client_resources": {"num_cpus": 1}})
"""


def test_run_simulation_with_the_readmes_wrapper_runs_a_strategy(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUN_SIMULATION, str(REPO / "examples" / "message-api")],
                          cwd=tmp_path, env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "[drfa] round 2/2" in log and "[drfa] finished 2 rounds" in log, log[-4000:]
    assert "KeyError" not in log and "(0 dropped replies)" in log, log[-4000:]


def test_flwr_run_failure_exits_nonzero(tmp_path):
    # `flwr run` itself exits 0 when the ServerApp fails; the wrapper must not.
    proc = _flwr_run(tmp_path, "num-rounds=1 strategies='no-such-strategy'", supernodes=2)
    assert proc.returncode != 0
    assert "finished:failed" in proc.stdout or "failed" in (proc.stdout + proc.stderr)


def test_deployment_superlink_and_two_supernodes(tmp_path):
    """SuperLink + 2 SuperNodes on 127.0.0.1 (insecure), `flwr run` against them, 2 rounds."""
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = _env(home)
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        log = open(tmp_path / "superlink.log", "w")
        logs.append(log)
        procs.append(start(
            [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
             "--disable-runtime-dependency-installation"], env, log))
        time.sleep(4)
        for pid in range(2):
            log = open(tmp_path / f"supernode{pid}.log", "w")
            logs.append(log)
            procs.append(start(
                [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                 "--node-config", f"partition-id={pid} num-partitions=2",
                 "--host", "127.0.0.1", "--port", str(_free_port())], env, log))
        time.sleep(4)
        sub = subprocess.run(
            [str(BIN / "flwr"), "run", str(REPO), "--format", "json", "--run-config",
             f"num-rounds=2 strategies='fedavg,fedrobust' output-dir='{out}'"],
            env=env, capture_output=True, text=True, timeout=120)
        assert sub.returncode == 0, sub.stdout + sub.stderr
        run_id = str(json.loads(sub.stdout[sub.stdout.find("{"):])["run-id"])
        status = wait_run(run_id, env, timeout=900)  # generous: the machine may be shared
        assert status == "finished:completed", (tmp_path / "superlink.log").read_text()[-3000:]
        rounds = [json.loads(x) for x in (out / "fedavg" / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rounds] == [1, 2]
        assert sorted(rounds[-1]["client_acc"]) == ["0", "1"]
        # FedRobust's per-client affine shift (Λ_i, δ_i) is kept by the server per partition and
        # travels with each message: its round counter reaches 2 only if the shift came back.
        robust = [json.loads(x) for x in (out / "fedrobust" / "rounds.jsonl").read_text().splitlines()]
        assert [r["train"]["affine-rounds"] for r in robust] == [1.0, 2.0]
        assert robust[1]["train"]["lambda-dev-fro"] > 0.0
        # ... and written out after the last round: the partition sampled for training (the
        # same one in both rounds, seeded) holds the shift it moved in both
        state = json.loads((out / "fedrobust" / "affine_state.json").read_text())
        assert state and all(v["affine-rounds"] == 2.0 and v["lambda-dev-fro"] > 0.0 for v in state.values()), state
    finally:
        stop(procs)  # whole process groups: SuperExec and app subprocesses too
        for log in logs:
            log.close()
