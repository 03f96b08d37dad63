"""Benchmark of the FedMGDA+ server step when the replies arrive one by one.

m synthetic replies (default 100) of a float32 model with d parameters (default 1M, in
four float arrays plus an integer buffer) arrive one at a time. Reported, side by side in
one run, as the median of several repeats:

(a) the time after the last reply until the new model is ready:
    a1. ``StreamingServerStep``: the last reply's ``add`` (its update, ‖g_i‖ and Gram row)
        plus ``finish`` (eigenvalue clip, solve, combination, new arrays), split into the two;
    a2. the whole strategy: ``FedMGDA.train_round`` on a grid whose ``pull_messages``
        hands out one prepared reply per call, from the moment the last reply is handed
        out until ``train_round`` returns the new ``ArrayRecord`` (adds reply checks,
        deserialising the arrays, building the ArrayRecord);
(b) the incremental cost per reply: ``add`` of reply i (grows with i: one read of the
    i updates received so far), as the mean over all replies and the cost of the last;
parts of a1, timed again one by one: the last Gram row, the eigenvalue clip, the solve,
the combination;
(c) the batch step on all m models at once, ``fedmgda_server_step`` (the stream with one
    block of m).

Also: one read of the stacked updates (``X.sum()``), the lower bound of anything that
touches every update once; a1 needs two reads (the last Gram row and the combination).
On a shared machine the wall times grow with the load; the ``*_cpu`` rows are the CPU
time this (single-threaded) process used for the same spans (``time.process_time``), a
closer measure of the work itself.
Run: ``OMP_NUM_THREADS=1 python scripts/bench_fedmgda_step.py [--m 100] [--d 1000000]
[--repeats 5] [--out results/bench_fedmgda_step/...json]`` (the BLAS thread count is the
environment's ``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flowerdro.core.mgda import min_norm_weights
from flowerdro.core.mgda_step import (
    StreamingServerStep,
    clip_negative_eigenvalues,
    fedmgda_server_step,
)
from flowerdro.experiments.inprocess import LocalGrid, ensure_task_identity
from flowerdro.strategies.fedmgda import FedMGDA

EPS, ETA = 0.1, 0.5


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def synthetic(m: int, d: int, seed: int = 0) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """w_t and m local models w_i = w_t − g_i with g_i = s_i (0.5 c + z_i), s_i log-uniform."""
    rng = np.random.default_rng(seed)
    shapes = [(d // 2,), (d // 8, 2), (d - d // 2 - 2 * (d // 8) - 10,), (10,)]
    w = [rng.standard_normal(s, dtype=np.float32) for s in shapes] + [np.array(0, np.int64)]
    common = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    locs = []
    for i in range(m):
        s = np.float32(10.0 ** rng.uniform(-3, 0))
        locs.append([a - s * (np.float32(0.5) * c + rng.standard_normal(a.shape, dtype=np.float32))
                     for a, c in zip(w[:-1], common, strict=True)] + [np.array(i, np.int64)])
    return w, locs


def bench_stream(w: list[np.ndarray], locs: list[list[np.ndarray]]) -> dict[str, float]:
    """One streamed step: per-reply add times, then the last add and finish."""
    m = len(locs)
    s = StreamingServerStep(w, m)
    per = []
    for loc in locs[:-1]:
        t0 = time.perf_counter()
        s.add([loc])
        per.append(time.perf_counter() - t0)
    c0, t0 = time.process_time(), time.perf_counter()
    s.add([locs[-1]])
    t1 = time.perf_counter()
    step = s.finish(eps=EPS, global_lr=ETA)
    t2, c2 = time.perf_counter(), time.process_time()
    per.append(t1 - t0)
    assert np.all(np.isfinite(step.arrays[0]))
    out = {"a1_after_last_reply": t2 - t0, "a1_after_last_reply_cpu": c2 - c0, "a1_last_add": t1 - t0,
           "a1_finish": t2 - t1,
           "b_mean_per_reply": float(np.mean(per)), "b_first_half_mean": float(np.mean(per[: m // 2])),
           "b_total_all_replies": float(np.sum(per))}
    # the parts of a1, timed again one by one on the final state (they do not change it)
    G = s.gram
    norms = np.sqrt(np.diag(G))
    Gn = G / np.outer(norms, norms)
    coef = (step.lam / norms).astype(np.float32)
    for name, fn in (("part_last_gram_row", lambda: s._gram_rows(m - 1, m)),
                     ("part_eigenvalue_clip", lambda: clip_negative_eigenvalues(G)),
                     ("part_solve", lambda: min_norm_weights(Gn, eps=EPS)),
                     ("part_combine", lambda: coef @ s._X[:m])):
        t0 = time.perf_counter()
        fn()
        out[name] = time.perf_counter() - t0
    return out


class OneByOneGrid(LocalGrid):
    """Nodes 1..m whose prepared ``train.sgd`` replies are handed out one per pull."""

    def __init__(self, contents: list[RecordDict]) -> None:
        ensure_task_identity()
        self.contents = contents
        self.node_ids = list(range(1, len(contents) + 1))
        self.queue: list[Message] = []
        self.last_reply_at = self.last_reply_cpu = 0.0

    def push_messages(self, messages):  # noqa: D102
        out = []
        for i, msg in enumerate(messages):
            msg.metadata._message_id = f"b{i}"
            self.queue.append(msg)
            out.append(f"b{i}")
        return out

    def pull_messages(self, message_ids):  # noqa: D102
        if not self.queue:
            return []
        msg = self.queue.pop(0)
        reply = Message(content=self.contents[int(msg.metadata.dst_node_id) - 1], reply_to=msg)
        if not self.queue:
            self.last_reply_at, self.last_reply_cpu = time.perf_counter(), time.process_time()
        return [reply]

    def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
        raise NotImplementedError


def bench_strategy(w: list[np.ndarray], contents: list[RecordDict]) -> dict[str, float]:
    """FedMGDA.train_round end to end; time after the last pull until the new model."""
    keys = [f"a{k}" for k in range(len(w))]
    arrays = ArrayRecord({k: Array(a) for k, a in zip(keys, w, strict=True)})
    grid = OneByOneGrid(contents)
    s = FedMGDA(eps=EPS, global_lr=ETA)
    s.comm.transport.pull_interval = 0.0
    s.state["num_rounds"] = 1
    new, _ = s.train_round(1, grid, arrays, ConfigRecord({}))
    t_end, c_end = time.perf_counter(), time.process_time()
    assert len(s.round_extras()["lambda"]) == len(contents) and not s.failures
    assert new is not arrays
    return {"a2_after_last_reply": t_end - grid.last_reply_at, "a2_after_last_reply_cpu": c_end - grid.last_reply_cpu,
            "a2_server_step_s": s.round_extras()["server_step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=100, help="number of replies")
    parser.add_argument("--d", type=int, default=1_000_000, help="float parameters of the model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the medians as JSON here")
    args = parser.parse_args()
    if args.m < 2 or args.d < 100 or args.repeats < 1:
        raise SystemExit("--m must be >= 2, --d >= 100, --repeats >= 1")
    print(f"CPU cores {os.cpu_count()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"m = {args.m}, d = {args.d:,} float32 (+1 int64 buffer), eps = {EPS}, repeats = {args.repeats}")
    print("before:", _uptime())
    w, locs = synthetic(args.m, args.d)
    keys = [f"a{k}" for k in range(len(w))]
    contents = [RecordDict({"arrays": ArrayRecord({k: Array(a) for k, a in zip(keys, loc, strict=True)}),
                            "metrics": MetricRecord({"num-examples": 10, "partition-id": i})})
                for i, loc in enumerate(locs)]
    X = np.stack([np.concatenate([(a - b).ravel() for a, b in zip(w[:-1], loc[:-1], strict=True)]) for loc in locs])
    # correctness: the streamed step against the batch step
    ref = fedmgda_server_step(w, locs, eps=EPS, global_lr=ETA).arrays
    s = StreamingServerStep(w, args.m)
    for loc in locs:
        s.add([loc])
    new = s.finish(eps=EPS, global_lr=ETA).arrays
    diff = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(new[:-1], ref[:-1], strict=True))
    print(f"max |w_stream - w_batch| = {diff:.2e} (float32 rounding)", flush=True)
    runs: dict[str, list[float]] = {}

    def record(d: dict[str, float]) -> None:
        for k, v in d.items():
            runs.setdefault(k, []).append(v)

    for _ in range(args.repeats):
        t0 = time.perf_counter()
        X.sum()
        record({"read_X_once": time.perf_counter() - t0})
        record(bench_stream(w, locs))
        record(bench_strategy(w, contents))
        c0, t0 = time.process_time(), time.perf_counter()
        fedmgda_server_step(w, locs, eps=EPS, global_lr=ETA)
        record({"c_fedmgda_server_step_one_block": time.perf_counter() - t0,
                "c_fedmgda_server_step_one_block_cpu": time.process_time() - c0})
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\n== median of {args.repeats} (ms) ==   {_uptime()}")
    for k, v in med.items():
        spread = f"[{min(runs[k]) * 1e3:.1f} .. {max(runs[k]) * 1e3:.1f}]"
        print(f"  {k:<36} {v * 1e3:9.1f}   {spread}", flush=True)
    print("\nafter:", _uptime())
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"m": args.m, "d": args.d, "repeats": args.repeats, "uptime_end": _uptime(),
                                   "max_abs_diff_stream_vs_batch": diff, "median_s": med}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
