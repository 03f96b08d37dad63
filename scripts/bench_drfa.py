"""Server overhead of one DRFA round without the clients: sampling, v and the λ step.

Times, per round, exactly what :class:`flowerdro.strategies.drfa.DRFA` runs on the server
besides messaging and model averaging (the functions of :mod:`flowerdro.core.drfa`):

1. D(s): m draws with probabilities λ (``sample_by_lambda``) and t′ (``sample_snapshot_steps``),
   the distinct clients and the aggregation weights (``aggregation_weights``);
2. U: m uniform draws (``sample_uniform``);
3. v = (N/m)·f on U and the λ step (``dual_step``: ``loss_vector`` + projection, or the
   prox step for each regulariser), with random losses.

Target: under 5 ms per round for N = 10,000 clients.

Usage: ``python scripts/bench_drfa.py [--n 10000] [--m 100,1000] [--rounds 300]``
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from flowerdro.core.drfa import (
    aggregation_weights,
    dual_step,
    sample_by_lambda,
    sample_snapshot_steps,
    sample_uniform,
)

TARGET_MS = 5.0


def one_round(rng: np.random.Generator, lam: np.ndarray, m: int, tau: int, regularizer: str) -> np.ndarray:
    """The server-side work of one round; returns λ(s+1)."""
    n = lam.size
    draws = sample_by_lambda(rng, lam, m)
    distinct = np.unique(draws)
    sample_snapshot_steps(rng, tau, distinct.size)
    aggregation_weights(draws, distinct.tolist(), lam)
    queried = sample_uniform(rng, n, m)
    losses = rng.uniform(0.1, 3.0, size=m)
    return dual_step(lam, queried, losses, tau=tau, gamma=8e-3, regularizer=regularizer, rho=0.1)


def bench(n: int, m: int, rounds: int, regularizer: str, seed: int = 0) -> np.ndarray:
    """Per-round wall times (ms) over ``rounds`` rounds, λ carried from round to round."""
    rng = np.random.default_rng(seed)
    lam = np.full(n, 1.0 / n)
    for _ in range(5):  # warm-up
        lam = one_round(rng, lam, m, 10, regularizer)
    times = np.empty(rounds)
    for r in range(rounds):
        t0 = time.perf_counter()
        lam = one_round(rng, lam, m, 10, regularizer)
        times[r] = (time.perf_counter() - t0) * 1e3
    return times


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000, help="N clients (default 10000)")
    parser.add_argument("--m", default="100,1000", help="comma-separated m values (default 100,1000)")
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds per setting (default 300)")
    parser.add_argument("--regularizers", default="none,kl,chi2,l2")
    args = parser.parse_args()
    print(f"DRFA server overhead per round, N = {args.n}, {args.rounds} rounds "
          f"(python {platform.python_version()}, numpy {np.__version__}, {platform.processor() or platform.machine()})")
    print(f"target: < {TARGET_MS:.1f} ms per round\n")
    print("| m | regulariser | median ms | p90 ms | max ms | < target |")
    print("|---|---|---|---|---|---|")
    ok: dict[str, bool] = {}
    for m in (int(x) for x in args.m.split(",")):
        for reg in args.regularizers.split(","):
            t = bench(args.n, m, args.rounds, reg)
            med = float(np.median(t))
            ok[reg] = ok.get(reg, True) and med < TARGET_MS
            print(f"| {m} | {reg} | {med:.3f} | {np.percentile(t, 90):.3f} | {t.max():.3f} | "
                  f"{'yes' if med < TARGET_MS else 'NO'} |")
    print()
    for reg, good in ok.items():
        label = "DRFA (Algorithm 1)" if reg == "none" else f"DRFA-Prox ({reg})"
        print(f"{label}: median below {TARGET_MS} ms for every m: {'yes' if good else 'NO'}")


if __name__ == "__main__":
    main()
