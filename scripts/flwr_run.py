#!/usr/bin/env python3
"""Run ``flwr run .`` safely: a failed run exits non-zero, and the local SuperLink is stopped.

``flwr run`` (1.41) starts a detached local SuperLink that outlives the run, installs the
app's dependencies with ``uv sync`` unless FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1,
and exits 0 even when the ServerApp fails. This wrapper:

1. uses a project-local FLWR_HOME (``.flwr-home/``) with a ``local`` SuperLink connection,
   and disables the runtime dependency install (the venv already has everything);
2. submits the run (``--format json``) and streams its log until it ends;
3. reads the final status with ``flwr ls --run-id ID --format json`` and exits 1 unless the
   run finished successfully;
4. stops the local SuperLink if this script started it;
5. prints where the results and the tracker files are: for this repository's app it passes
   an absolute ``output-dir`` (``results/flwr-run``; the trackers write into its
   ``trackers/``), since relative paths land in the working folder of the local SuperLink
   (the folder ``flwr run`` first started it in).

Each simulated client gets one CPU (``client-resources-num-cpus=1``, so one Ray actor per
core) unless ``--federation-config`` says otherwise.

Usage: ``python scripts/flwr_run.py [--num-supernodes 20] [--run-config "k=v ..."] [--timeout 900]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _flwr() -> str:
    exe = shutil.which("flwr") or str(Path(sys.executable).parent / "flwr")
    if not Path(exe).exists():
        sys.exit("flwr_run: the `flwr` command is not installed in this environment (pip install flwr[simulation])")
    return exe


def _superlink_pids(port: str) -> set[int]:
    out = subprocess.run(["pgrep", "-f", f"flower-superlink.*--control-api-address 127.0.0.1:{port}"],
                         capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _run_info(flwr: str, run_id: str, env: dict[str, str]) -> dict:
    """The run's entry of ``flwr ls --run-id ID --format json`` (empty when unreadable)."""
    ls = subprocess.run([flwr, "ls", "--run-id", run_id, "--format", "json"], env=env,
                        capture_output=True, text=True)
    try:
        runs = _json_from(ls.stdout).get("runs", [])
    except ValueError:
        return {}
    return runs[0] if runs else {}


def _status(flwr: str, run_id: str, env: dict[str, str]) -> str:
    """The run's status, e.g. ``running`` or ``finished:completed``."""
    return str(_run_info(flwr, run_id, env).get("status", "unknown"))


def _details(flwr: str, run_id: str, env: dict[str, str]) -> str:
    """Why the run ended as it did (Flower's ``status-details``)."""
    return str(_run_info(flwr, run_id, env).get("status-details", ""))


def _json_from(text: str) -> dict:
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON in output: {text[-2000:]}")
    return json.loads(text[start:])


def _overrides(run_config: str) -> dict[str, object]:
    """The ``k=v`` items of a ``--run-config`` string (values read as TOML, as Flower does)."""
    import shlex
    import tomllib

    out: dict[str, object] = {}
    for item in shlex.split(run_config):
        key, sep, value = item.partition("=")
        if not sep:
            continue
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value.strip("'\"")
    return out


def _where(overrides: dict[str, object], ours: bool) -> str:
    """Where the ServerApp wrote the results and the tracker files."""
    out = str(overrides.get("output-dir", "results/flwr-run" if ours else ""))
    trackers = str(overrides.get("tracker-dir", "")) or (f"{out}/trackers" if out else "")
    if out and Path(out).is_absolute() and (not trackers or Path(trackers).is_absolute()):
        return f"results in {out}; tracker files (when tracker is set) in {trackers}"
    return ("results and tracker files in the app's output-dir / tracker-dir, relative to the working folder "
            "of the local SuperLink (the folder `flwr run` first started it in; see the run's log line "
            "'results: ...' for the absolute path); pass absolute paths in --run-config to choose")


def main() -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--app", default=str(ROOT))
    ap.add_argument("--num-supernodes", type=int, default=20)
    ap.add_argument("--run-config", default="", help="overrides, e.g. \"num-rounds=5 strategies='fedavg'\"")
    ap.add_argument("--federation-config", default="", help="extra simulation settings (k=v ...)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is declared failed")
    ap.add_argument("--gpu-fraction", type=float, default=None,
                    help="GPU share per simulated client (default: 0.25 when CUDA is available, else 0)")
    ap.add_argument("--keep-superlink", action="store_true", help="leave the local SuperLink running")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the results of an earlier run in output-dir (the run config's overwrite = true)")
    args = ap.parse_args()

    env = os.environ.copy()
    env.setdefault("FLWR_HOME", str(ROOT / ".flwr-home"))
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    # `flwr run` starts `flower-superlink` by name: the one installed beside this Python,
    # also when the environment is used without being activated
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    port = env.get("FLWR_LOCAL_CONTROL_API_PORT", "39093")
    home = Path(env["FLWR_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    cfg = home / "config.toml"
    if not cfg.exists():
        cfg.write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    flwr = _flwr()
    before = _superlink_pids(port)

    fed = f"num-supernodes={args.num_supernodes}"
    if "client-resources-num-cpus" not in args.federation_config:
        # One core per simulated client, as the clients' torch threads (run config `threads = 1`):
        # Flower's default of 2 leaves one Ray actor on a 2-core machine, and a single actor
        # serves the messages one Ray round trip after another. Each further actor reads the
        # data set once more (a slower first round, more memory).
        fed += " client-resources-num-cpus=1"
    gpu = args.gpu_fraction if args.gpu_fraction is not None else (0.25 if _has_cuda() else 0.0)
    if gpu > 0:
        fed += f" client-resources-num-gpus={gpu}"
        print(f"flwr_run: CUDA available; each simulated client gets {gpu} of a GPU", flush=True)
    if args.federation_config:
        fed += " " + args.federation_config
    cmd = [flwr, "run", args.app, "--format", "json", "--federation-config", fed]
    run_config = args.run_config
    if Path(args.app).resolve() == ROOT and "output-dir" not in _overrides(run_config):
        # The ServerApp runs in the local SuperLink's working folder; give it an absolute path
        # (the trackers' files follow it into <output-dir>/trackers unless tracker-dir is set).
        run_config = (run_config + f" output-dir='{ROOT / 'results' / 'flwr-run'}'").strip()
    if args.overwrite:
        run_config += " overwrite=true"
    cmd += ["--run-config", run_config]
    status, code = "unknown", 1
    try:
        print("$", " ".join(cmd), flush=True)
        sub = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if sub.returncode != 0:
            print(sub.stdout, sub.stderr, sep="\n", file=sys.stderr)
            print(f"flwr_run: `flwr run` failed with exit code {sub.returncode}", file=sys.stderr)
            return 1
        try:
            info = _json_from(sub.stdout)
        except ValueError as exc:
            print(sub.stdout, sub.stderr, sep="\n", file=sys.stderr)
            print(f"flwr_run: could not read the run id: {exc}", file=sys.stderr)
            return 1
        if not info.get("success", True) or "run-id" not in info:
            print(json.dumps(info, indent=2), file=sys.stderr)
            return 1
        run_id = str(info["run-id"])
        print(f"flwr_run: run {run_id} submitted; streaming its log", flush=True)
        # `flwr log --stream` does not return when a run fails while loading its apps, so
        # the run's status is polled beside the stream, and the stream stops with the run.
        stream = subprocess.Popen([flwr, "log", run_id, "--stream"], env=env)
        deadline, status = time.monotonic() + args.timeout, "unknown"
        while not (status := _status(flwr, run_id, env)).startswith("finished"):
            if time.monotonic() > deadline:
                print(f"flwr_run: run {run_id} still going after {args.timeout:.0f} s; stopping it",
                      file=sys.stderr)
                subprocess.run([flwr, "stop", run_id], env=env, capture_output=True)
                break
            time.sleep(10.0)  # each `flwr ls` is a process that imports Flower
        try:
            stream.wait(timeout=30 if status == "finished:completed" else 5)  # the log's last lines
        except subprocess.TimeoutExpired:
            stream.terminate()
        if status.startswith("finished:failed"):
            details = _details(flwr, run_id, env)
            print(f"flwr_run: run {run_id} failed: {details}", file=sys.stderr)
        print(f"flwr_run: run {run_id} status: {status}", flush=True)
        print(f"flwr_run: {_where(_overrides(run_config), Path(args.app).resolve() == ROOT)}", flush=True)
        code = 0 if status == "finished:completed" else 1
    finally:
        if not args.keep_superlink:
            for pid in _superlink_pids(port) - before:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
    return code


if __name__ == "__main__":
    sys.exit(main())
