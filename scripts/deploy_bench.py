#!/usr/bin/env python3
"""Seconds per round of a real loopback deployment: 1 SuperLink + N SuperNodes, insecure.

Starts ``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1 (each in its
own process group, own FLWR_HOME), submits ``flwr run .`` with the given run config, waits
for the run to finish, reads the per-round ``time_s`` from ``<output-dir>/<strategy>/rounds.jsonl``
and stops every process group it started (SuperExec and ClientApp children included).

Usage::

    python scripts/deploy_bench.py [--supernodes 2] [--rounds 4] [--strategy fedavg]
        [--env FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1] [--node-config "worker=1"]
        [--launcher "python -m flowerdro.deploy.supernode --poll 0.1 --fork-clientapp --"]

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
import threading
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


def _phases(log: Path) -> list[tuple[float, float]]:
    """Per message a SuperNode served: (s from receiving it to its ClientApp process's first log line,
    s from there to sending the reply), from the timed log."""
    out, got, started = [], None, None
    for line in log.read_text().splitlines():
        stamp = line[:10].strip()
        if "Receiving:" in line:
            got, started = float(stamp), None
        elif "Start `flwr-clientapp` process" in line and got is not None:
            started = float(stamp)
        elif "Sending:" in line and got is not None and started is not None:
            out.append((started - got, float(stamp) - started))
            got = None
    return out


def run(args: argparse.Namespace) -> dict:
    """Start the deployment, run the job; per-round ``time_s``, per-message phases and the load average."""
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

    t0 = time.monotonic()

    def start(cmd: list[str], name: str) -> None:
        """Start ``cmd`` in its own process group; its output goes to ``<tmp>/<name>.log``, each line timed."""
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        procs.append(proc)

        def copy() -> None:
            with open(tmp / f"{name}.log", "w") as log:
                for line in iter(proc.stdout.readline, b""):
                    log.write(f"{time.monotonic() - t0:9.3f} {line.decode(errors='replace')}")
                    log.flush()

        threading.Thread(target=copy, daemon=True).start()

    try:
        start([str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
               "--disable-runtime-dependency-installation"], "superlink")
        time.sleep(4)
        launcher = shlex.split(args.launcher) if args.launcher else []
        for pid in range(args.supernodes):
            start([*(launcher or [str(BIN / "flower-supernode")]), "--insecure", "--superlink", f"127.0.0.1:{port}",
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
        print(f"logs (each line with its second since the start): {tmp}", flush=True)
        phases = [p for i in range(args.supernodes) for p in _phases(tmp / f"supernode{i}.log")[1:]]
        return {"times": [json.loads(x)["time_s"] for x in lines], "phases": phases, "load": os.getloadavg()[0]}
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
    ap.add_argument("--launcher", default="", help="command that replaces flower-supernode (its arguments follow)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--docs", action="store_true",
                    help="run every row of the operator-settings table and write it into docs/performance.md")
    args = ap.parse_args()
    if args.docs:
        return write_docs(args)
    res = run(args)
    for i, t in enumerate(res["times"], 1):
        print(f"round {i}: {t:.2f} s")
    print(_summary(res))
    return 0


def _summary(res: dict) -> str:
    later = res["times"][1:] or res["times"]
    wait = statistics.median(p[0] for p in res["phases"]) if res["phases"] else float("nan")
    work = statistics.median(p[1] for p in res["phases"]) if res["phases"] else float("nan")
    return (f"median s/round (rounds 2..{len(res['times'])}): {statistics.median(later):.2f}; per message: "
            f"{wait:.2f} s received → process started, {work:.2f} s started → reply sent; load {res['load']:.1f}")


#: The rows of the docs table: label, extra environment, node config, launcher.
_LAUNCHER = f"{sys.executable} -m flowerdro.deploy.supernode --poll 0.1 --"
_POLL = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1"
ROWS = [
    ("Flower's defaults", [], "", ""),
    (f"`{_POLL}`", [_POLL], "", ""),
    (f"`{_POLL}`, `worker=1`", [_POLL], "worker=1", ""),
    (f"`{_POLL}`, launcher `--poll 0.1`", [_POLL], "", _LAUNCHER),
    (f"`{_POLL}`, launcher `--poll 0.1`, `worker=1`", [_POLL], "worker=1", _LAUNCHER),
    (f"`{_POLL}`, launcher `--poll 0.1 --fork-clientapp`, `worker=1`", [_POLL], "worker=1",
     _LAUNCHER.replace("--poll 0.1", "--poll 0.1 --fork-clientapp")),
]


def write_docs(args: argparse.Namespace) -> int:
    """Run each row of :data:`ROWS` and replace the ``bench:deploy`` block of docs/performance.md."""
    import re

    body = []
    for label, env, node, launcher in ROWS:
        res = run(argparse.Namespace(**{**vars(args), "env": [*args.env, *env], "node_config": node,
                                        "launcher": launcher}))
        print(f"[deploy] {label}: {_summary(res)}", flush=True)
        later = res["times"][1:]
        wait = statistics.median(p[0] for p in res["phases"])
        work = statistics.median(p[1] for p in res["phases"])
        body.append(f"| {label} | {statistics.median(later):.2f} | {wait:.2f} | {work:.2f} | {res['load']:.1f} |")
    cmd = f"python scripts/deploy_bench.py --docs --supernodes {args.supernodes} --rounds {args.rounds}"
    block = (f"<!-- bench:deploy -->\n`{cmd}`: 1 SuperLink + {args.supernodes} SuperNodes on 127.0.0.1 (insecure), "
             f"the pyproject job with `num-rounds={args.rounds} strategies='{args.strategy}'` (FedAvg: a train and an "
             f"evaluate phase per round); s/round is the median `time_s` of rounds 2..{args.rounds}; per message, "
             "the median over the SuperNodes' messages of the time from receiving it to its `flwr-clientapp` "
             "process's first log line (SuperExec poll, process start, imports) and from there to sending the "
             "reply (FAB check, app load, the handler or the forward, the push); load = the 1-minute load "
             "average after the run.\n\n"
             "| settings | s/round | received → process started s | started → reply sent s | load |\n"
             "|---|---|---|---|---|\n" + "\n".join(body) + "\n<!-- /bench -->")
    docs = ROOT / "docs" / "performance.md"
    text = docs.read_text()
    pattern = re.compile(r"<!-- bench:deploy -->.*?<!-- /bench -->", re.S)
    if not pattern.search(text):
        raise SystemExit("docs/performance.md has no <!-- bench:deploy --> block")
    docs.write_text(pattern.sub(lambda _: block, text))
    print(f"wrote {docs.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
