"""Benchmark of the FedMGDA+ weight problem: ``min_norm_weights`` against cvxpy.

For m ∈ {10, 100, 300} (``--m``) normalised random updates, full-rank (d = 2m) and
rank-deficient (d = m/10, and every update sent twice), with and without the ε-box
(ε = 0.5/m around the uniform weights), it reports the median wall time of
``min_norm_weights`` and of cvxpy (CLARABEL through cvxpy's modelling layer, tolerances
1e-10) on the same Gram matrix, and the objective difference f_ours − f_cvxpy in units of
max G_ii (negative: ours is lower). Run: ``OMP_NUM_THREADS=1 python scripts/bench_mgda.py
[--m 10,100,300] [--repeats 5]`` (needs cvxpy, a dev dependency).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np

from flowerdro.core.mgda import min_norm_weights


def _gram(kind: str, m: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "full":
        V = rng.standard_normal((m, 2 * m))
    elif kind == "low-rank":
        V = rng.standard_normal((m, max(1, m // 10)))
    else:  # duplicated
        half = rng.standard_normal((m - m // 2, max(2, m // 3)))
        V = np.concatenate([half, half[: m // 2]])
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    return V @ V.T


def _cvxpy(G: np.ndarray, eps: float | None) -> np.ndarray:
    import cvxpy as cp

    m = G.shape[0]
    lam = cp.Variable(m)
    cons = [cp.sum(lam) == 1, lam >= (0.0 if eps is None else max(0.0, 1 / m - eps))]
    if eps is not None:
        cons.append(lam <= 1 / m + eps)
    prob = cp.Problem(cp.Minimize(cp.quad_form(lam, cp.psd_wrap(G))), cons)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prob.solve(solver="CLARABEL", tol_gap_abs=1e-10, tol_gap_rel=1e-10, tol_feas=1e-10)
    return np.asarray(lam.value)


def _median_time(fn, repeats: int) -> tuple[float, np.ndarray]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="10,100,300", help="comma-separated numbers of updates")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'m':>5} {'kind':>10} {'eps':>8} {'ours ms':>9} {'cvxpy ms':>9} {'f_ours - f_cvxpy':>17}")
    for m in (int(x) for x in args.m.split(",")):
        for kind in ("full", "low-rank", "duplicated"):
            G = _gram(kind, m, rng)
            for eps in (None, 0.5 / m):
                min_norm_weights(G, eps)  # warm-up (imports, first-call allocations)
                t_ours, lam = _median_time(lambda G=G, eps=eps: min_norm_weights(G, eps), args.repeats)
                t_cvx, ref = _median_time(lambda G=G, eps=eps: _cvxpy(G, eps), args.repeats)
                df = float(lam @ G @ lam - ref @ G @ ref)
                e = "none" if eps is None else f"{eps:.4f}"
                print(f"{m:>5} {kind:>10} {e:>8} {t_ours * 1e3:9.2f} {t_cvx * 1e3:9.2f} {df:17.2e}", flush=True)


if __name__ == "__main__":
    main()
