#!/usr/bin/env python3
"""Benchmarks of what a user pays for federated training with flowerdro, side by side.

Sections (each prints its target and the measured ratio; ``--write-docs`` puts its table
in docs/performance.md between ``<!-- bench:NAME -->`` markers, leaving the others):

``runner``  seconds per round of a plain PyTorch loop doing exactly the same local steps,
            weighted averaging and per-client evaluation (the limit) against the experiments
            runner (in-process ClientApp through Flower Messages) for FedAvg, SCAFFOLD and
            DRFA; logistic regression and ``cnn_fmnist`` on Fashion-MNIST, 10 and 100
            clients (``--clients 10,100,1000``); the paths run interleaved, ``--reps`` times,
            and the median round (round 1 dropped) is reported.
            Target: runner ≤ 1.2× the plain loop for strategies whose local work is FedAvg's.
``server``  each strategy's server time per round (everything but the clients: sampling,
            reply checks, deserialisation, aggregation, its own step) at 100 clients ×
            1M parameters, driven by prepared in-process replies, against FedAvg's server
            time and against a whole FedAvg round (100 × one client's local training, measured,
            plus FedAvg's server time). Target: ≤ 10 % of a FedAvg round.
``memory``  peak resident memory of an in-process run at 1,000 and 10,000 clients with partial
            participation (one subprocess each, 10 clients as the baseline), per client, and
            the growth between round 2 and the last round. Target: 10,000 clients within 4 GB.
``flwr``    (``--flwr``, not in ``all``) seconds per round of ``flwr run`` simulation (Ray)
            against the experiments runner on the same job, through ``scripts/flwr_run.py``.
``gpu``     (not in ``all``) the runner on a device (``--device``, default ``auto``: CUDA when
            available): Fashion-MNIST, 10 one-class clients (``--clients``), ``cnn_mnist``,
            τ = 50 local SGD steps of batch 128 (``--local-steps``, ``--batch-size``), the
            received model's full-data loss first, every client evaluated each round; a plain
            PyTorch FedAvg loop with data, model and minibatch indices on the device against
            the runner for FedAvg, SCAFFOLD and DRFA on the same device, interleaved
            ``--reps`` times, median of rounds 2..R (``--rounds``), and each path's peak
            device memory (``torch.cuda.max_memory_allocated``; n/a on the CPU). It runs on
            the CPU too, with small settings (``--clients 2 --rounds 2 --local-steps 2``).

Run: ``OMP_NUM_THREADS=1 python scripts/benchmarks.py [all|runner|server|memory|flwr|gpu ...]
[--clients 10,100] [--reps 2] [--write-docs]``. Fashion-MNIST is read from ``--data-dir``
(default: FLOWERDRO_DATA, else /work/shared/data when present).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from flowerdro.experiments.inprocess import LocalGrid, ensure_task_identity

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "performance.md"
TARGET_RUNNER, TARGET_SERVER, TARGET_MEMORY_GB, TARGET_FLWR = 1.2, 0.10, 4.0, 3.0


def _data_dir() -> str:
    env = os.environ.get("FLOWERDRO_DATA", "")
    return env or ("/work/shared/data" if Path("/work/shared/data").is_dir() else "")


def machine() -> str:
    """``<cpu> with <n> cores`` (the header of every generated table)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return f"{cpu} with {os.cpu_count()} cores (OMP_NUM_THREADS={threads})"


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    fmt = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in fmt])


# =========================================================================== runner vs plain loop
def run_config(model: str, n: int, data_dir: str) -> dict[str, Any]:
    """The job: Fashion-MNIST, τ = 10, batch 50; one class per client at 10 clients, iid above.

    The CNN keeps 300 training examples per client and trains and evaluates 10 clients per
    round above 10 clients (its steps dominate; the ratio is what is compared).
    """
    rc: dict[str, Any] = {"dataset": "fashion_mnist", "data-dir": data_dir, "model": model,
                          "partition": "one-class" if n == 10 else "iid", "lr": 0.1, "local-steps": 10,
                          "batch-size": 50, "seed": 0}
    if model != "logreg":
        rc.update({"samples-per-client": 300, "lr": 0.05})
    frac = 1.0 if model == "logreg" or n <= 10 else 10 / n
    if n >= 1000:
        frac = 10 / n
    rc.update({"fraction-train": frac, "fraction-evaluate": frac})
    return rc


class PlainLoop:
    """FedAvg in plain PyTorch: the same clients, local steps, averaging and evaluation.

    Data, model and the minibatch index draws live on ``device`` (the CPU by default).
    """

    def __init__(self, rc: dict[str, Any], n: int, device: Any = None) -> None:
        import torch

        from flowerdro.data import DataConfig, get_client_data
        from flowerdro.models import build_model

        self.device = torch.device(device or "cpu")
        cfg = DataConfig.from_run_config(rc, num_partitions=n)
        self.clients = []
        for k in range(n):
            cd = get_client_data(cfg, k)
            self.clients.append(tuple(torch.tensor(a, device=self.device)
                                      for a in (cd.x_train, cd.y_train, cd.x_test, cd.y_test)))
        self.model = build_model(rc["model"], cd.input_shape, cd.num_classes, seed=0).to(self.device)
        self.state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.rc, self.n, self.rng = rc, n, np.random.default_rng(0)
        self.loss_full = rc.get("train-loss-on", "full") == "full"

    def round(self, rnd: int) -> None:
        """Train the sampled clients from the global model, average by examples, evaluate."""
        import torch
        from torch.nn import functional as F

        m = max(1, round(self.rc["fraction-train"] * self.n))
        chosen = self.rng.choice(self.n, size=m, replace=False)
        sums = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in self.state.items()}
        total = 0
        lr, tau, b = float(self.rc["lr"]), int(self.rc["local-steps"]), int(self.rc["batch-size"])
        for k in chosen:
            x, y, _, _ = self.clients[int(k)]
            self.model.load_state_dict(self.state)
            if self.loss_full:  # the received model's loss on all local data (FedAvg's train_loss)
                with torch.no_grad():
                    sum(float(F.cross_entropy(self.model(x[s:s + 2048]), y[s:s + 2048], reduction="sum"))
                        for s in range(0, len(y), 2048))
            gen = torch.Generator(device=self.device).manual_seed(rnd * 100_003 + int(k))
            perm, pos = torch.randperm(len(y), generator=gen, device=self.device), 0
            for _ in range(tau):
                if pos + b > len(y):
                    perm, pos = torch.randperm(len(y), generator=gen, device=self.device), 0
                idx = perm[pos:pos + b]
                pos += b
                self.model.zero_grad(set_to_none=True)
                F.cross_entropy(self.model(x[idx]), y[idx]).backward()
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.add_(p.grad, alpha=-lr)
            for name, v in self.model.state_dict().items():
                sums[name] += len(y) * v
            total += len(y)
        self.state = {k: (s / total).to(self.state[k].dtype) for k, s in sums.items()}
        me = max(1, round(self.rc["fraction-evaluate"] * self.n))
        self.model.load_state_dict(self.state)
        with torch.no_grad():
            for k in (range(self.n) if me >= self.n else self.rng.choice(self.n, size=me, replace=False)):
                _, _, xt, yt = self.clients[int(k)]
                for s in range(0, len(yt), 2048):  # in chunks, as the clients' evaluate_model
                    out = self.model(xt[s:s + 2048])
                    float(F.cross_entropy(out, yt[s:s + 2048], reduction="sum"))
                    int((out.argmax(1) == yt[s:s + 2048]).sum())


def _plain_rounds(rc: dict[str, Any], n: int, rounds: int, device: Any = None) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of rounds 2..R of the plain loop (on ``device``, the CPU by default)."""
    loop = PlainLoop(rc, n, device)
    walls, cpus = [], []
    for rnd in range(1, rounds + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        loop.round(rnd)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls[1:], cpus[1:]


def _runner_rounds(rc: dict[str, Any], n: int, strategy: str, rounds: int) -> tuple[list[float], list[float]]:
    """Wall (the records' ``time_s``) and CPU seconds (between round ends) of rounds 2..R of the runner."""
    from flowerdro.experiments import run
    from flowerdro.strategies.observers import Observers

    cfg = {"name": "bench", "num-rounds": rounds, "seeds": [0], "num-partitions": n, "strategies": [strategy],
           "run-config": rc}
    marks: list[float] = []
    notify = Observers.notify

    def timed(self: Observers, strategy: Any, event: str, *a: Any) -> None:
        if event == "on_round":
            marks.append(time.process_time())
        notify(self, strategy, event, *a)

    Observers.notify = timed  # type: ignore[method-assign]
    try:
        res = run(cfg, output_root=None, verbose=False)
    finally:
        Observers.notify = notify  # type: ignore[method-assign]
    return [float(r["time_s"]) for r in res.histories[strategy][0][1:]], list(np.diff(marks))


def bench_runner(args: argparse.Namespace) -> str:
    """Plain loop vs experiments runner, interleaved; returns the markdown section."""
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    strategies = ("fedavg", "scaffold", "drfa")
    rows = []
    for model in ("logreg", "cnn_fmnist"):
        for n in args.clients or [10, 100]:
            rc = run_config(model, n, args.data_dir)
            rounds = 6 if model == "logreg" else 3
            walls: dict[str, list[float]] = {p: [] for p in ("plain", *strategies)}
            cpus: dict[str, list[float]] = {p: [] for p in ("plain", *strategies)}
            for _ in range(args.reps):
                for path in ("plain", *strategies):
                    w, c = _plain_rounds(rc, n, rounds) if path == "plain" else _runner_rounds(rc, n, path, rounds)
                    walls[path] += w
                    cpus[path] += c
            plain_w, plain_c = statistics.median(walls["plain"]), statistics.median(cpus["plain"])
            for path in ("plain", *strategies):
                w, c = statistics.median(walls[path]), statistics.median(cpus[path])
                rows.append([model, n, path, w, w / plain_w, c, c / plain_c])
                print(f"[runner] {model} N={n} {path}: {w:.4f} s/round wall ({w / plain_w:.2f}x plain), "
                      f"{c:.4f} s CPU ({c / plain_c:.2f}x plain; target <= {TARGET_RUNNER}x for FedAvg's "
                      "local work)", flush=True)
    body = table(["model", "clients", "path", "wall s/round", "× plain (wall)", "CPU s/round", "× plain (CPU)"],
                 rows)
    return (f"Target: experiments runner ≤ {TARGET_RUNNER}× the plain loop per round for FedAvg's local work. "
            "Medians of rounds 2-R over the interleaved repetitions; CPU time (single-threaded process) is the "
            "load-robust number on a shared machine. SCAFFOLD adds control variates and skips the full-data "
            "train loss; DRFA trains the distinct clients of m draws by λ (with replacement), keeps a snapshot "
            "and adds a loss-query phase.\n\n" + body)


# =========================================================================== on a device (GPU)
def gpu_run_config(n: int, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The job of the ``gpu`` section: Fashion-MNIST, one class per client, ``cnn_mnist``, τ = 50 of batch 128.

    Every client trains (the received model's full-data loss first) and evaluates every
    round; ``device`` goes to the clients as run-config ``device``.
    """
    rc: dict[str, Any] = {"dataset": "fashion_mnist", "data-dir": args.data_dir, "model": "cnn_mnist",
                          "partition": "one-class", "lr": 0.05, "local-steps": args.local_steps,
                          "batch-size": args.batch_size, "seed": 0, "fraction-train": 1.0,
                          "fraction-evaluate": 1.0, "train-loss-on": "full", "device": device}
    if args.samples_per_client:
        rc["samples-per-client"] = args.samples_per_client
    if args.test_fraction:
        rc["test-fraction"] = args.test_fraction
    return rc


def device_name(device: Any) -> str:
    """The device in words: the GPU's name and torch's CUDA version, or the CPU's model."""
    import torch

    if device.type == "cuda":
        tf32 = "on" if torch.backends.cudnn.allow_tf32 else "off"
        return (f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
                f"TF32 convolutions {tf32})")
    return f"CPU: {machine()} (torch {torch.__version__})"


def _peak_reset(device: Any) -> None:
    """Start a path's run from an empty device: the in-process clients' cached data and models dropped, peak reset."""
    import gc

    import torch

    from flowerdro.clients import handlers

    # the runner's clients keep their data and a model per spec on the device between runs;
    # without this, every later path's peak would include the earlier runs' tensors
    handlers._RUNTIMES.clear()
    handlers._LATEST.clear()
    handlers._MODELS.__dict__.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: Any) -> float | None:
    """Peak device memory allocated by torch since the last reset, in GB (None on the CPU)."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 1e9


def bench_gpu(args: argparse.Namespace) -> str:
    """Plain PyTorch FedAvg on the device against the runner on the same device; returns the markdown section."""
    import logging

    from flowerdro.clients.training import resolve_device

    logging.getLogger("flwr").setLevel(logging.WARNING)
    device = resolve_device(args.device)
    strategies = ("fedavg", "scaffold", "drfa")
    paths = ("plain", *strategies)
    rows = []
    for n in args.clients or [10]:
        rc = gpu_run_config(n, args, str(device))
        walls: dict[str, list[float]] = {p: [] for p in paths}
        peaks: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.reps):
            for path in paths:
                _peak_reset(device)
                if path == "plain":
                    w = _plain_rounds(rc, n, args.rounds, device)[0]
                else:
                    w = _runner_rounds(rc, n, path, args.rounds)[0]
                walls[path] += w
                peak = _peak_gb(device)
                if peak is not None:
                    peaks[path].append(peak)
        plain = statistics.median(walls["plain"])
        for path in paths:
            w = statistics.median(walls[path])
            peak = f"{max(peaks[path]):.2f}" if peaks[path] else "n/a"
            rows.append([n, path, w, w / plain, peak])
            print(f"[gpu] {device} N={n} {path}: {w:.4f} s/round ({w / plain:.2f}x plain), peak device memory "
                  f"{peak} GB", flush=True)
    samples = f", at most {args.samples_per_client} training examples per client" if args.samples_per_client else ""
    if args.test_fraction:
        samples += f", a test fraction of {args.test_fraction:g}"
    return (f"Device: {device_name(device)}. Fashion-MNIST, one class per client{samples}, `cnn_mnist`, τ = "
            f"{args.local_steps} local SGD steps of batch {args.batch_size} after the received model's full-data "
            f"loss, every client training and evaluated every round, {args.rounds} rounds, {args.reps} interleaved "
            "repetitions; median seconds per round of rounds 2-R (wall time, the device synchronised at the end "
            "of each round). The plain loop is FedAvg in plain PyTorch with data, model and minibatch indices "
            "on the device; the runner's clients keep their data on the device (run-config `device`). SCAFFOLD "
            "adds control variates and skips the full-data train loss; DRFA trains the distinct clients of m "
            "draws by λ and adds a loss-query phase. Peak memory: `torch.cuda.max_memory_allocated` over one "
            "run of a path (its data put on the device included), reset before it with the runner's cached "
            "client data dropped, the largest over the repetitions.\n\n"
            + table(["clients", "path", "s/round", "× plain loop", "peak device memory (GB)"], rows))


# =========================================================================== server step
class ReplayGrid(LocalGrid):
    """A grid whose clients answer instantly with prepared replies (only the server is timed).

    Each message gets a reply of its type: ``train*`` → ``arrays`` (one of a few prepared
    models of the right shapes; ``train.scaffold`` adds ``control``, a DRFA message
    with a snapshot step adds ``snapshot``), ``query.loss_grad`` → ``grad``, ``query.loss``
    → metrics only. ``seconds`` accumulates the CPU time spent here (subtracted from the round).
    """

    def __init__(self, n: int, pool: list[Any]) -> None:
        ensure_task_identity()
        self.node_ids = [int((k * 2654435761 + 97531) % 2_147_483_629) + 1 for k in range(n)]
        self.pid = {nid: k for k, nid in enumerate(self.node_ids)}
        self.pool, self.seconds = pool, 0.0

    def _reply(self, msg: Any) -> Any:
        from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

        def fresh(rec: ArrayRecord) -> ArrayRecord:  # Flower's aggregation empties the records it reads
            return ArrayRecord({key: rec[key] for key in rec.keys()})

        nid = int(msg.metadata.dst_node_id)
        k = self.pid[nid]
        arrays = fresh(self.pool[k % len(self.pool)])
        mtype = msg.metadata.message_type
        cfg = msg.content.config_records.get("config", ConfigRecord())
        metrics = MetricRecord({"num-examples": 100 + k, "partition-id": k, "train_loss": 1.0 + 0.001 * k,
                                "train_loss_local": 0.9, "local-steps": 10, "loss": 1.0 + 0.001 * k})
        content = RecordDict({"metrics": metrics})
        if mtype.startswith("train"):
            content["arrays"] = arrays
            if mtype == "train.scaffold":
                content["control"] = fresh(self.pool[(k + 1) % len(self.pool)])
            if int(cfg.get("snapshot-step", 0) or 0) > 0:
                content["snapshot"] = fresh(self.pool[(k + 2) % len(self.pool)])
        elif mtype == "query.loss_grad":
            content["grad"] = arrays
        return Message(content=content, reply_to=msg)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Any]:  # noqa: D102
        t0 = time.process_time()
        out = []
        for msg in messages:
            msg.metadata._message_id = f"m{id(msg)}"
            out.append(self._reply(msg))
        self.seconds += time.process_time() - t0
        return out

    def push_messages(self, messages: Any) -> list[str]:  # noqa: D102
        raise NotImplementedError

    def pull_messages(self, message_ids: Any) -> list[Any]:  # noqa: D102
        raise NotImplementedError


def _pool(model_arrays: Any, size: int = 4) -> list[Any]:
    from flwr.app import Array, ArrayRecord

    rng = np.random.default_rng(0)
    return [ArrayRecord({k: Array((model_arrays[k].numpy() + rng.normal(0, 0.01, model_arrays[k].shape))
                                  .astype(model_arrays[k].numpy().dtype)) for k in model_arrays.keys()})
            for _ in range(size)]


def _server_times(name: str, init: Any, pool: list[Any], n: int, rounds: int) -> list[float]:
    from flowerdro.strategies import build_strategy

    rc = {"fraction-train": 1.0, "fraction-evaluate": 0.0, "local-steps": 10, "lr": 0.05, "seed": 0,
          "clients-per-round": n, "num-partitions": n, "model": "mlp", "hidden": "1024,256"}
    strategy = build_strategy(name, rc)
    grid = ReplayGrid(n, pool)
    per_round: list[float] = []
    marks = [0.0]
    cpu = [time.process_time()]

    def on_round(rec: dict[str, Any]) -> None:
        # CPU time of the process between two round records, less the replay's: the server
        # step in CPU seconds (single-threaded), robust to other jobs on the machine
        now = time.process_time()
        per_round.append(now - cpu[-1] - (grid.seconds - marks[-1]))
        cpu.append(now)
        marks.append(grid.seconds)

    strategy.add_round_callback(on_round)
    gc.collect()  # as the driver does: Flower's to_numpy_ndarrays(keep_input=False) calls gc.collect()
    gc.freeze()  # per array, which would otherwise walk the whole heap each time
    try:
        strategy.start(grid, init, num_rounds=rounds, timeout=3600)
    finally:
        gc.unfreeze()
    return per_round[1:]


def _client_seconds(init: Any, data_dir: str, calls: int = 3) -> float:
    """Seconds of one client's ``train`` reply on the 1M-parameter MLP (in-process handler)."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from flowerdro.apps.client_app import app

    ensure_task_identity()
    rc = {"dataset": "fashion_mnist", "data-dir": data_dir, "partition": "iid", "model": "mlp",
          "hidden": "1024,256", "seed": 0}
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 100}, state=RecordDict(),
                  run_config=rc)
    cfg = ConfigRecord({"lr": 0.05, "local-steps": 10, "batch-size": 50, "seed": 0, "server-round": 1})
    times = []
    for _ in range(calls + 1):
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=1, message_type="train")
        t0 = time.process_time()
        reply = app(msg, ctx)
        times.append(time.process_time() - t0)
        assert not reply.has_error(), reply.error.reason
    return statistics.median(times[1:])


def bench_server(args: argparse.Namespace) -> str:
    """Server time per round of each strategy at 100 clients × 1M parameters."""
    import logging

    from flwr.app import ArrayRecord

    from flowerdro.models import build_model

    logging.getLogger("flwr").setLevel(logging.WARNING)
    model = build_model("mlp", (1, 28, 28), 10, seed=0, hidden="1024,256")
    init = ArrayRecord(model.state_dict())
    d = sum(int(np.prod(init[k].shape)) for k in init.keys())
    pool, n = _pool(init), 100
    names = ["fedavg", "fedprox", "qfedavg", "scaffold", "drfa", "afl", "scaffpd", "fedmgda+"]
    times: dict[str, list[float]] = {s: [] for s in names}
    errors: dict[str, str] = {}
    for _ in range(args.reps):
        for s in names:
            if s in errors:
                continue
            try:
                times[s] += _server_times(s, init, pool, n, 3)
            except Exception as exc:  # noqa: BLE001  # a strategy the replay cannot drive is reported
                errors[s] = f"{type(exc).__name__}: {exc}"[:120]
    client = _client_seconds(init, args.data_dir)
    fedavg = statistics.median(times["fedavg"])
    fedavg_round = n * client + fedavg
    rows = []
    for s in names:
        if s in errors:
            rows.append([s, "n/a", "", "", errors[s]])
            continue
        t = statistics.median(times[s])
        rows.append([s, t, t / fedavg, t / fedavg_round, "meets" if t / fedavg_round <= TARGET_SERVER else "misses"])
        print(f"[server] {s}: {t * 1e3:.1f} ms/round, {t / fedavg:.2f}x FedAvg's server, "
              f"{100 * t / fedavg_round:.2f}% of a FedAvg round (target <= {100 * TARGET_SERVER:.0f}%)", flush=True)
    head = (f"Target: every strategy's server step ≤ {100 * TARGET_SERVER:.0f} % of a FedAvg round. "
            f"{n} clients, d = {d:,} parameters (MLP 784-1024-256-10), every client replying; one client's "
            f"local training (τ = 10, batch 50) takes {client:.3f} s, so a FedAvg round of {n} clients in "
            f"sequence is {fedavg_round:.2f} s. All times are CPU seconds of the single-threaded process "
            "(the server's between two round records, less the replayed clients'), which other jobs on "
            "the machine inflate far less than wall time.\n\n")
    return head + table(["strategy", "server CPU s/round", "× FedAvg server", "share of a FedAvg round", "target"],
                        rows)


# =========================================================================== memory
_MEMORY_CHILD = r"""
import json, resource, sys, time, logging
logging.getLogger("flwr").setLevel(logging.WARNING)
from flowerdro.experiments import run
strategy, n, rounds, data_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()
marks = []
rc = {"dataset": "fashion_mnist", "data-dir": data_dir, "partition": "iid", "model": "logreg", "lr": 0.1,
      "local-steps": 10, "batch-size": 5, "seed": 0, "fraction-train": min(1.0, 100 / n), "clients-per-round": min(n, 100)}
rc.update(json.loads(sys.argv[5]))
cfg = {"name": "mem", "num-rounds": rounds, "seeds": [0], "num-partitions": n, "strategies": [strategy], "run-config": rc}
from flowerdro.strategies.observers import Observers
orig = Observers.notify
def notify(self, strategy, event, *a):
    if event == "on_round":
        marks.append(rss())
    return orig(self, strategy, event, *a)
Observers.notify = notify
t0 = time.perf_counter()
res = run(cfg, output_root=None, verbose=False)
with open("/proc/self/status") as fh:  # VmHWM: this process image's peak (ru_maxrss survives exec)
    peak = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
print(json.dumps({"peak": peak, "rounds": marks,
                  "seconds": time.perf_counter() - t0}))
"""


def _memory_run(strategy: str, n: int, rounds: int, data_dir: str, extra: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, strategy, str(n), str(rounds), data_dir,
                          json.dumps(extra)], capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-800:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_memory(args: argparse.Namespace) -> str:
    """Peak RSS per client in-process at 1,000 and 10,000 clients."""
    rows = []
    sizes = [s for s in (1000, 10000) if s <= args.max_memory_clients]
    for strategy in ("fedavg", "drfa", "scaffold", "fedmgda+"):
        base = _memory_run(strategy, 10, args.memory_rounds, args.data_dir, {})
        for n in sizes:
            try:
                r = _memory_run(strategy, n, args.memory_rounds, args.data_dir, {})
            except RuntimeError as exc:
                rows.append([strategy, n, "failed", "", "", "", str(exc).splitlines()[-1][:100]])
                continue
            per_client = (r["peak"] - base["peak"]) / (n - 10)
            growth = (r["rounds"][-1] - r["rounds"][1]) / 2**20 if len(r["rounds"]) > 2 else float("nan")
            rows.append([strategy, n, r["peak"] / 2**30, per_client / 1024, growth, r["seconds"] / args.memory_rounds,
                         "meets" if r["peak"] / 2**30 <= TARGET_MEMORY_GB else "misses"])
            print(f"[memory] {strategy} N={n}: peak {r['peak'] / 2**30:.2f} GB, {per_client / 1024:.1f} KB/client, "
                  f"RSS growth rounds 2..{args.memory_rounds} {growth:.1f} MB (target: 10,000 clients within "
                  f"{TARGET_MEMORY_GB} GB)", flush=True)
    return (f"Target: 10,000 clients in-process within {TARGET_MEMORY_GB} GB. Fashion-MNIST iid, logistic "
            f"regression, 100 clients trained per round, {args.memory_rounds} rounds, the loop's default "
            "evaluation; per-client memory = (peak at N − peak at 10 clients) / (N − 10).\n\n"
            + table(["strategy", "clients", "peak GB", "KB per client", "RSS growth round 2→last (MB)",
                     "run s / rounds (incl. data loading)", "target"], rows))


# =========================================================================== flwr run
def bench_flwr(args: argparse.Namespace) -> str:
    """``flwr run`` simulation against the experiments runner on the same job."""
    rows = []
    for n in args.clients or [10, 100]:
        if n > 100:
            continue
        rc = run_config("logreg", n, args.data_dir)
        rc_str = " ".join(f"{k}={json.dumps(v)}" for k, v in {**rc, "strategies": "fedavg", "num-rounds": 6,
                                                                  "output-dir": f"/tmp/flowerdro-bench-flwr-{n}"}.items())
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "flwr_run.py"), "--num-supernodes", str(n),
                              "--run-config", rc_str, "--timeout", "900"], capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        recs = Path(f"/tmp/flowerdro-bench-flwr-{n}/fedavg/rounds.jsonl")
        if out.returncode != 0 or not recs.is_file():
            rows.append([n, "failed", "", "", (out.stderr or out.stdout)[-120:].replace("\n", " ")])
            continue
        sim = statistics.median([json.loads(line)["time_s"] for line in recs.read_text().splitlines()[1:]])
        inproc = statistics.median(_runner_rounds(rc, n, "fedavg", 6)[0])
        rows.append([n, sim, inproc, sim / inproc, f"{wall:.0f} s job wall time"])
        print(f"[flwr] N={n}: simulation {sim:.3f} s/round, runner {inproc:.3f}, {sim / inproc:.2f}x "
              f"(target <= {TARGET_FLWR}x)", flush=True)
    return (f"Target: `flwr run` simulation ≤ {TARGET_FLWR}× the experiments runner per round at 100 clients "
            "(FedAvg, logistic regression, rounds 2-6).\n\n"
            + table(["clients", "simulation s/round", "runner s/round", "ratio", "note"], rows))


# =========================================================================== fresh ClientApp process
_COLD_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from flowerdro.apps.client_app import app
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flowerdro.experiments.inprocess import ensure_task_identity
t1 = time.perf_counter()
ensure_task_identity()
rc, node = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ctx = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=rc)
init = app(Message(content=RecordDict({"config": ConfigRecord({"seed": 0})}), dst_node_id=1,
               message_type="query.init"), ctx).content["arrays"]
t2 = time.perf_counter()
cfg = ConfigRecord({"lr": 0.1, "local-steps": 10, "batch-size": 50, "seed": 0, "server-round": 1})
reply = app(Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=1, message_type="train"), ctx)
t3 = time.perf_counter()
assert not reply.has_error(), reply.error.reason
print(json.dumps({"imports": t1 - t0, "data": t2 - t1, "train": t3 - t2}))
"""


def _cold_run(rc: dict[str, Any], node: dict[str, Any]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("FLOWERDRO_DATA_CACHE", None)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _COLD_CHILD, json.dumps(rc), json.dumps(node)], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    total = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-800:])
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process": total}


def bench_coldstart(args: argparse.Namespace) -> str:
    """What one message costs a fresh ClientApp process (Flower 1.41 deployments start one per message)."""
    import shutil
    import tempfile

    jobs = {"synthetic (pyproject job, 20 clients)": {"dataset": "synthetic", "partition": "natural",
                                                       "synthetic-alpha": 0.5, "synthetic-beta": 0.5,
                                                       "model": "logreg", "seed": 0},
            "fashion_mnist one-class (10 clients)": {"dataset": "fashion_mnist", "data-dir": args.data_dir,
                                                      "partition": "one-class", "model": "logreg", "seed": 0}}
    rows = []
    for label, rc in jobs.items():
        n = 20 if rc["dataset"] == "synthetic" else 10
        cache = tempfile.mkdtemp(prefix="flowerdro-cache-")
        try:
            node = {"partition-id": 0, "num-partitions": n}
            _cold_run(rc, {**node, "data-cache": cache})  # fills the cache
            res: dict[str, list[dict[str, float]]] = {"no cache": [], "data-cache": []}
            for _ in range(args.reps + 1):
                res["no cache"].append(_cold_run(rc, node))
                res["data-cache"].append(_cold_run(rc, {**node, "data-cache": cache}))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        for mode, runs in res.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append([label, mode, med["process"], med["imports"], med["data"], med["train"]])
            print(f"[coldstart] {label} {mode}: {med['process']:.2f} s per fresh process (module import "
                  f"{med['imports']:.2f}, setup {med['data']:.2f}, one train reply {med['train']:.3f})", flush=True)
    return ("Target: loopback deployment ≤ 2 s per round of per-message overhead. Flower 1.41 starts a new "
            "`flwr-clientapp` process for every message (both `--isolation` modes); this is what one such "
            "process costs for one `train` message without the SuperNode's polling: the whole process, the "
            "import of flowerdro's ClientApp module (flwr only: the module imports no torch), the first "
            "message's setup (torch, the client's data and model) and the train reply. With the node "
            "config `worker=1` the setup is paid once per node, by its worker (see the deployment "
            "section).\n\n"
            + table(["job", "partition", "process s", "ClientApp module import s", "setup: torch, data, model s",
                     "train reply s"], rows))


# =========================================================================== docs
SECTIONS = {"runner": bench_runner, "server": bench_server, "memory": bench_memory,
            "coldstart": bench_coldstart, "flwr": bench_flwr, "gpu": bench_gpu}


def write_docs(results: dict[str, str], argv: list[str]) -> None:
    """Replace each section's block in docs/performance.md (created from its skeleton when absent)."""
    text = DOCS.read_text() if DOCS.is_file() else "# Performance\n"
    for name, body in results.items():
        block = (f"<!-- bench:{name} -->\nMeasured on {machine()}; `python scripts/benchmarks.py {name}"
                 f"{' ' + ' '.join(argv) if argv else ''}`.\n\n{body}\n<!-- /bench -->")
        pattern = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench -->", re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _, b=block: b, text)
        elif "\n## " in text:  # a new section goes before the hand-written ones
            cut = text.index("\n## ")
            text = text[:cut].rstrip() + f"\n\n{block}\n" + text[cut:]
        else:
            text = text.rstrip() + f"\n\n{block}\n"
    DOCS.write_text(text)
    print(f"wrote {DOCS.relative_to(ROOT)} ({', '.join(results)})")


def main(argv: list[str] | None = None) -> int:
    """Run the sections named in ``argv`` (default: the command line) and print their tables."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sections", nargs="*", default=["all"], help="all (= runner server memory coldstart), or any of "
                                                                  + ", ".join(SECTIONS))
    ap.add_argument("--clients", default=None, help="client counts (runner and flwr: default 10,100, e.g. "
                                                     "10,100,1000; gpu: default 10)")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per run of the gpu section (the first is dropped)")
    ap.add_argument("--device", default="auto", help="gpu section: run-config device of the clients and the "
                                                      "plain loop (auto, cpu, cuda, cuda:N)")
    ap.add_argument("--local-steps", type=int, default=50, help="gpu section: τ, local SGD steps per round")
    ap.add_argument("--batch-size", type=int, default=128, help="gpu section: minibatch size")
    ap.add_argument("--samples-per-client", type=int, default=0, help="gpu section: cap on each client's "
                                                                      "training examples (0: all)")
    ap.add_argument("--test-fraction", type=float, default=None, help="gpu section: fraction of each client's "
                                                                      "data kept for its test set (default: the "
                                                                      "data's, 0.2)")
    ap.add_argument("--memory-rounds", type=int, default=4)
    ap.add_argument("--max-memory-clients", type=int, default=10000)
    ap.add_argument("--data-dir", default=_data_dir())
    ap.add_argument("--write-docs", action="store_true", help="update docs/performance.md")
    args = ap.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")] if args.clients else None
    if args.rounds < 2:
        ap.error("--rounds: must be >= 2 (round 1 is dropped from the medians)")
    sections = ["runner", "server", "memory", "coldstart"] if args.sections == ["all"] else args.sections
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"sections: unknown {unknown}; allowed: all, {', '.join(SECTIONS)}")
    results = {}
    for name in sections:
        print(f"== {name} ({machine()}) ==", flush=True)
        results[name] = SECTIONS[name](args)
        print(results[name], flush=True)
    if args.write_docs:
        given = sys.argv[1:] if argv is None else argv
        flags = [a for a in given if a not in SECTIONS and a not in ("all", "--write-docs")]
        write_docs(results, flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
