"""Benchmark of the FedMGDA+ server maths (flowerdro.core.mgda).

1. ``min_norm_weights`` against cvxpy (CLARABEL, default tolerances, the same objective
   λᵀGλ on the same Gram matrices) for m ∈ {10, 100, 1000}, full-rank (d = 2m) and
   rank-deficient (d = m/10, and duplicated updates; d = m/3 for m ≤ 100) sets of
   normalised random updates, with and without the ε-box (ε = 0.5/m). The two solvers
   run interleaved (same load);
   median wall time of 7 rounds (3 at m = 1000; ours 5 calls per round below m = 1000),
   and the CPU-time ratio as a load-robust cross-check.
2. The whole server step on the CPU: normalise 100 updates of a 1M-parameter model, Gram,
   solve, combine (``mgda_direction`` from a list of float32 layers and from a stacked
   (m × d) float32 matrix; ``fedmgda_server_step`` from w_t and the local models), with its
   parts timed separately: one read of X (a lower bound for anything exact), the Gram
   matrix by backend and precision, the QP, the combination, and an incremental Gram
   (row by row as replies arrive: what is left after the last reply).

Targets (issue): ≥ 20× faster than cvxpy at m = 100; server step at m = 100 with 1M
parameters under 50 ms. Run: ``python scripts/bench_mgda.py [--quick] [--server-only | --solver-only]
[--before FILE]``; ``--before`` times an earlier version of ``flowerdro/core/mgda.py``
(e.g. ``git show HEAD:flowerdro/core/mgda.py > /tmp/mgda_before.py``) in the same
interleaved rounds and adds its CPU time and our CPU-time speed-up over it
(on a shared machine set ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``: threaded BLAS on
busy cores is 10-50x slower).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings

import numpy as np
from stress_mgda import load_module  # scripts/ is on the path when run as a script

from flowerdro.core.mgda import combine_rows, gram_matrix, mgda_direction, min_norm_weights
from flowerdro.strategies.fedmgda import fedmgda_server_step


def _median_time(fn, repeats: int) -> tuple[float, object]:
    out = None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _paired_times(fns, repeats: int) -> tuple[list[float], list[float], list[object]]:
    """Run the functions in turn, ``repeats`` rounds; median wall and CPU time of each.

    Interleaving puts both solvers under the same load on a shared machine (the ratio is
    what is compared); CPU time (``time.process_time``) is the load-robust cross-check.
    """
    walls: list[list[float]] = [[] for _ in fns]
    cpus: list[list[float]] = [[] for _ in fns]
    outs: list[object] = [None for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            c0, t0 = time.process_time(), time.perf_counter()
            outs[i] = fn()
            walls[i].append(time.perf_counter() - t0)
            cpus[i].append(time.process_time() - c0)
    return [statistics.median(w) for w in walls], [statistics.median(c) for c in cpus], outs


def _phase_probe() -> float:
    """Best of 5 × 20,000 additions of two 100-element arrays, in ns: a fixed workload whose
    time shows how fast this (virtual) machine runs small numpy calls at the moment."""
    x, y = np.ones(100), np.ones(100)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20_000):
            x + y
        best = min(best, (time.perf_counter() - t0) / 20_000)
    return best * 1e9


def _cvxpy_solve(G: np.ndarray, eps: float | None) -> np.ndarray:
    import cvxpy as cp

    m = G.shape[0]
    lam = cp.Variable(m)
    cons = [cp.sum(lam) == 1, lam >= 0]
    if eps is not None:
        c = np.full(m, 1.0 / m)
        cons += [lam >= c - eps, lam <= c + eps]
    prob = cp.Problem(cp.Minimize(cp.quad_form(lam, cp.psd_wrap(G))), cons)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prob.solve(solver="CLARABEL")
    return np.asarray(lam.value)


def _gram(kind: str, m: int, rng: np.random.Generator) -> np.ndarray:
    d = {"full d=2m": 2 * m, "rank m/10": max(1, m // 10), "rank m/3": max(1, m // 3),
         "duplicated": 2 * m}[kind]
    V = rng.standard_normal((m, d))
    if kind == "duplicated":
        V[m // 2 :] = V[: m - m // 2]
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    return V @ V.T


def bench_qp(quick: bool, before: str | None = None) -> None:
    print("== min_norm_weights vs cvxpy (CLARABEL), same G, interleaved runs, median times ==")
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")
    print(f"machine phase: {_phase_probe():.0f} ns per 100-element numpy add (lower: a faster phase of this VM)")
    old = load_module(before) if before else None
    header = (
        f"{'m':>5} {'case':<11} {'eps':>6} {'ours ms':>9} {'cvxpy ms':>9} {'speed-up':>9} "
        f"{'CPU speed-up':>12} {'f_ours - f_cvxpy':>17}  target"
    )
    if old is not None:
        header += "  | before CPU ms, CPU speed-up over it, f_ours - f_before"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    sizes = (10, 100) if quick else (10, 100, 1000)
    for m in sizes:
        for kind in ("full d=2m", "rank m/10", "duplicated", "rank m/3"):
            if m == 1000 and kind in ("duplicated", "rank m/3"):
                continue
            # the rank m/3 case (added later) has its own generator, so the other cases
            # keep the matrices of the earlier runs
            G = _gram(kind, m, rng if kind != "rank m/3" else np.random.default_rng([m, 3]))
            for eps in (None, 0.5 / m):
                min_norm_weights(G, eps)  # warm-up (imports, first-call allocations)
                _cvxpy_solve(G, eps)
                # ours runs `inner` times per round so that each timing is well above the
                # clock and scheduler noise; cvxpy once per round
                inner = 1 if m >= 1000 else 5
                rounds = 3 if m >= 1000 else 7

                def ours(G=G, eps=eps, inner=inner):
                    for _ in range(inner):
                        lam = min_norm_weights(G, eps)
                    return lam

                fns = [ours, lambda G=G, eps=eps: _cvxpy_solve(G, eps)]
                if old is not None:
                    old.min_norm_weights(G, eps)

                    def before_fn(G=G, eps=eps, inner=inner):
                        for _ in range(inner):
                            lam = old.min_norm_weights(G, eps)
                        return lam

                    fns.append(before_fn)
                walls, cpus, outs = _paired_times(fns, rounds)
                (w_ours, w_cvx), (c_ours, c_cvx), (lam, ref) = walls[:2], cpus[:2], outs[:2]
                w_ours, c_ours = w_ours / inner, c_ours / inner
                diff = float(lam @ G @ lam - ref @ G @ ref)
                target = ""
                if m == 100:
                    target = ">= 20x met" if w_cvx / w_ours >= 20 else ">= 20x missed"
                eps_s = "None" if eps is None else f"{eps:.4f}"
                line = (
                    f"{m:>5} {kind:<11} {eps_s:>6} {w_ours * 1e3:>9.3f} {w_cvx * 1e3:>9.1f} "
                    f"{w_cvx / w_ours:>8.1f}x {c_cvx / c_ours:>11.1f}x {diff:>17.2e}  {target}"
                )
                if old is not None:
                    c_old, lam_old = cpus[2] / inner, outs[2]
                    d_old = float(lam @ G @ lam - lam_old @ G @ lam_old)
                    line += f"  | {c_old * 1e3:.3f} {c_old / c_ours:.2f}x {d_old:.1e}"
                print(line, flush=True)


def bench_server_step(quick: bool) -> None:
    m = 100
    d = 200_000 if quick else 1_000_000
    print(f"\n== server step: normalise + Gram + solve + combine, m={m}, d={d:,} (CPU) ==")
    import torch

    print(f"torch threads {torch.get_num_threads()}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}")
    rng = np.random.default_rng(1)
    shapes = [(d // 2,), (d // 8, 2), (d // 4 - 10,), (10,)]
    assert sum(int(np.prod(s)) for s in shapes) == d
    X = rng.standard_normal((m, d), dtype=np.float32)
    layers = []
    for i in range(m):
        off, u = 0, []
        for s in shapes:
            n = int(np.prod(s))
            u.append(X[i, off : off + n].reshape(s).copy())
            off += n
        u.append(np.array(i, dtype=np.int64))  # an integer buffer (num_batches_tracked)
        layers.append(u)
    reps = 3
    w_t = [np.zeros(s, np.float32) for s in shapes] + [np.array(0, np.int64)]
    G64 = gram_matrix(X, backend="numpy")
    rows = []
    for label, fn in (
        ("read X once (X.sum(), lower bound)", lambda: X.sum()),
        ("Gram numpy f64 blocks (old default)", lambda: gram_matrix(X, backend="numpy")),
        ("Gram numpy f32 blocks", lambda: gram_matrix(X, backend="numpy", precision="float32")),
        ("Gram torch f64 blocks", lambda: gram_matrix(X, backend="torch")),
        ("Gram torch f32 blocks (f64 sums)", lambda: gram_matrix(X, backend="torch", precision="float32")),
        ("solve only (min_norm_weights)", lambda: min_norm_weights(G64 / np.outer(np.sqrt(np.diag(G64)),
                                                                             np.sqrt(np.diag(G64))), 0.05)),
        ("combine (λ/‖g‖)ᵀX (torch mv)", lambda: combine_rows(X, np.full(m, 1.0 / m))),
        ("mgda_direction, stacked X, f32 Gram",
         lambda: mgda_direction(X, eps=0.05, backend="torch", precision="float32")),
        ("mgda_direction, layers, f32 Gram",
         lambda: mgda_direction(layers, eps=0.05, backend="torch", precision="float32")),
        ("fedmgda_server_step (w_t, w_i layers)",
         lambda: fedmgda_server_step(w_t, layers, eps=0.05, global_lr=1.0)),
    ):
        t, out = _median_time(fn, reps)
        rows.append((label, t))
        print(f"{label:<44} {t * 1e3:9.1f} ms", flush=True)
    G32 = gram_matrix(X, backend="torch", precision="float32")
    print(f"f32-block Gram: max |G32 - G64| / max G_ii = {np.abs(G32 - G64).max() / np.diag(G64).max():.2e}")
    # incremental Gram: rows arrive one at a time; each arrival costs one (i × d)·d product,
    # so only the last row's product remains after the last reply.
    T = torch.from_numpy(X)
    t0 = time.perf_counter()
    Ginc = np.zeros((m, m))
    last = 0.0
    for i in range(m):
        ti = time.perf_counter()
        row = (T[: i + 1] @ T[i]).to(torch.float64).numpy()
        Ginc[i, : i + 1] = row
        Ginc[: i + 1, i] = row
        last = time.perf_counter() - ti
    total = time.perf_counter() - t0
    print(f"incremental Gram (row by row, torch mv): total {total * 1e3:.1f} ms, "
          f"after the last reply {last * 1e3:.1f} ms")
    best = min(t for label, t in rows if label.startswith(("mgda_direction", "fedmgda_server_step")))
    print(f"best batch server step {best * 1e3:.1f} ms (all replies at once; the < 50 ms target is for the "
          "streamed step after the last reply: scripts/bench_fedmgda_step.py)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m <= 100 and d = 200k only")
    parser.add_argument("--server-only", action="store_true", help="skip the QP-vs-cvxpy part")
    parser.add_argument("--solver-only", action="store_true", help="skip the server-step part")
    parser.add_argument("--before", default=None, help="an earlier mgda.py to time beside ours")
    args = parser.parse_args()
    print(f"CPU cores visible: {os.cpu_count()}, numpy {np.__version__}")
    t0 = time.perf_counter()
    if not args.server_only:
        bench_qp(args.quick, args.before)
    if not args.solver_only:
        bench_server_step(args.quick)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
