#!/usr/bin/env python3
"""Seconds per round of a real loopback deployment: 1 SuperLink + N SuperNodes, insecure.

Starts ``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1 (each in its
own process group, own FLWR_HOME), submits ``flwr run .`` with the given run config, waits
for the run to finish, reads the per-round ``time_s`` from ``<output-dir>/<strategy>/rounds.jsonl``
and stops every process group it started (SuperExec and ClientApp children included).

Usage::

    python scripts/deploy_bench.py [--supernodes 2] [--rounds 4] [--strategy fedavg]
        [--env FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1] [--node-config "worker=1"]
        [--launcher "python -m flowerdro.deploy.supernode --poll 0.2 --"]

Prints one line per round and the median of rounds 2.. (the first round also pays the FAB
install and, with ``worker=1``, the worker's start).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _json(stdout: str) -> dict:
    return json.loads(stdout[stdout.find("{"):])


def _stop(procs: list[subprocess.Popen]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def run(args: argparse.Namespace) -> list[float]:
    """Start the deployment, run the job, return the per-round ``time_s``."""
    tmp = Path(tempfile.mkdtemp(prefix="flowerdro-deploy-"))
    home, out, port = tmp / "home", tmp / "out", _port()
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "HF_HUB_OFFLINE": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(kv.split("=", 1) for kv in args.env)
    procs: list[subprocess.Popen] = []
    workers = tmp / "workers"  # the node-local workers' sockets and pid files (node config worker=1)
    node_config = f"{args.node_config} worker-dir='{workers}'".strip()

    def start(cmd: list[str], name: str) -> None:
        log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start([str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
               "--disable-runtime-dependency-installation"], "superlink")
        time.sleep(4)
        launcher = shlex.split(args.launcher) if args.launcher else []
        for pid in range(args.supernodes):
            start([*launcher, str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                   "--node-config", f"partition-id={pid} num-partitions={args.supernodes} {node_config}",
                   "--host", "127.0.0.1", "--port", str(_port())], f"supernode{pid}")
        time.sleep(4)
        cfg = f"num-rounds={args.rounds} strategies='{args.strategy}' output-dir='{out}' {args.run_config}"
        sub = subprocess.run([str(BIN / "flwr"), "run", str(ROOT), "--format", "json", "--run-config", cfg],
                             env=env, capture_output=True, text=True, timeout=120)
        if sub.returncode:
            raise SystemExit(sub.stdout + sub.stderr)
        run_id, status = str(_json(sub.stdout)["run-id"]), ""
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline and not status.startswith("finished"):
            time.sleep(2)
            ls = subprocess.run([str(BIN / "flwr"), "ls", "--run-id", run_id, "--format", "json"],
                                env=env, capture_output=True, text=True, timeout=60)
            runs = _json(ls.stdout).get("runs", []) if ls.returncode == 0 else []
            status = runs[0]["status"] if runs else ""
        if status != "finished:completed":
            raise SystemExit(f"run {run_id}: {status!r}; logs in {tmp}")
        lines = (out / args.strategy / "rounds.jsonl").read_text().splitlines()
        return [json.loads(x)["time_s"] for x in lines]
    finally:
        _stop(procs)
        for pid_file in workers.glob("*.pid"):  # detached: not in the SuperNodes' process groups
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--supernodes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--strategy", default="fedavg")
    ap.add_argument("--run-config", default="", help="extra run-config keys")
    ap.add_argument("--node-config", default="", help="extra node-config keys for every SuperNode")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for every Flower process")
    ap.add_argument("--launcher", default="", help="command prefix for flower-supernode")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    times = run(args)
    for i, t in enumerate(times, 1):
        print(f"round {i}: {t:.2f} s")
    later = times[1:] or times
    print(f"median s/round (rounds 2..{len(times)}): {statistics.median(later):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
