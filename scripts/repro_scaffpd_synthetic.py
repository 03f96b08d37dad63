"""Reproduce SCAFF-PD §6.1 (Fig. 2): robust regression, ‖x^r − x*‖² against rounds, SCAFF-PD vs DRFA.

Yu, Karimireddy, Ma, Jordan, "Scaff-PD: Communication Efficient Fair and Robust Federated
Learning", 2023, https://arxiv.org/abs/2307.13381.

Setting: N = 5 clients, d = 10, m_i = 100 rows a ~ N(0, I), y = ⟨a, x̂ + δ_i⟩
(``flowerdro.data.synthetic.robust_regression_problem``), f_i(x) = (1/m_i)‖A_i x − y_i‖² + (μ_x/2)‖x‖²,
χ² objective ψ(λ) = (ρ/2N)Σ(Nλ_i − 1)² with ρ ∈ {0.01, 0.05, 0.1}, J = 100 full-batch local
steps, float64 clients. x* comes from cvxpy (Clarabel) on the equivalent convex problem
min_{x,η} η + Σ_i (f_i(x) − η + ρ)_+²/(2ρN) and is checked to be a saddle point
(‖Σλ*_i ∇f_i(x*)‖ ≈ 0 with λ* = Π_Δ(1/N + f(x*)/(ρN))).

Runs (in-process Flower clients, ``flowerdro.experiments.InProcessGrid``):

* SCAFF-PD (strategy ``scaffpd``): rule 5.2, η_l = 0.01, J = 100, τ = η_l J, σ = ``--dual-lr``.
* DRFA-Prox (strategy ``drfa-prox``, regulariser ``chi2`` with the same ρ, i.e. the same
  objective): m = N clients sampled by λ per round, τ = 100 full-batch local steps with
  η = 0.01, λ step with γ = ``--drfa-dual-lr`` (γτ plays the role of σ).

Usage::

    nice -n 10 python scripts/repro_scaffpd_synthetic.py            # full (≈10 min on 2 CPU cores)
    nice -n 10 python scripts/repro_scaffpd_synthetic.py --rounds 30  # quick look

Writes ``docs/figures/scaffpd_synthetic.png`` and ``docs/figures/scaffpd_synthetic.json``
(the curves and the settings).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import client_config
from flowerdro.data import DataConfig, load_federated
from flowerdro.experiments import InProcessGrid
from flowerdro.experiments.references import chi2_dro_regression_saddle_point
from flowerdro.strategies import build_strategy, initial_arrays

REPO = Path(__file__).resolve().parents[1]


def saddle_point(data: list[tuple[np.ndarray, np.ndarray]], rho: float, mu: float) -> tuple[np.ndarray, float]:
    """x* of the χ²-DRO regression by cvxpy, and its saddle-point residual ‖Σλ*_i ∇f_i(x*)‖."""
    xs, _, residual = chi2_dro_regression_saddle_point(data, rho, mu)
    return xs, residual


def run_distances(name: str, rc: dict, rounds: int, xs: np.ndarray, n: int) -> tuple[list[float], float, dict]:
    """Run strategy ``name``; return ‖x^r − x*‖²/‖x*‖² for r = 0..R, the wall time and the final λ."""
    grid = InProcessGrid(client_app, n, rc)
    strategy = build_strategy(name, rc)
    init = initial_arrays(grid, rc, 600)
    key = "linear.weight"
    x0 = init[key].numpy().ravel()
    dist = [float(np.sum((x0 - xs) ** 2) / np.sum(xs ** 2))]
    train_round = strategy.train_round

    def tracked(*args):  # record x^r after every round
        out = train_round(*args)
        x = out[0][key].numpy().ravel()
        dist.append(float(np.sum((x - xs) ** 2) / np.sum(xs ** 2)))
        return out

    strategy.train_round = tracked  # type: ignore[method-assign]
    t0 = time.time()
    strategy.start(grid, init, num_rounds=rounds, timeout=600, train_config=client_config(rc))
    lam = {str(k): round(float(v), 6) for k, v in getattr(strategy, "lam", {}).items()}
    return dist, time.time() - t0, lam


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--rhos", type=float, nargs="+", default=[0.01, 0.05, 0.1])
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--dim", type=int, default=10)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--mu", type=float, default=0.1, help="μ_x, the ℓ2 regularisation (weight decay)")
    p.add_argument("--local-steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--dual-lr", type=float, default=0.01, help="SCAFF-PD σ")
    p.add_argument("--drfa-dual-lr", type=float, default=1e-4, help="DRFA γ (its λ step is γτ·loss)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "figures" / "scaffpd_synthetic.png")
    args = p.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)

    n = args.clients
    base = {"dataset": "robust-regression", "model": "linear", "precision": "float64", "num-partitions": n,
            "regression-dim": args.dim, "samples-per-client": args.samples, "weight-decay": args.mu,
            "data-seed": args.seed, "seed": args.seed, "batch-size": 10 * args.samples,
            "lr": args.lr, "local-steps": args.local_steps, "fraction-evaluate": 0.0}
    clients = load_federated(DataConfig.from_run_config(base, num_partitions=n))
    data = [(c.x_train.astype(np.float64), c.y_train.astype(np.float64)) for c in clients]

    results: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "runs": {}}
    for rho in args.rhos:
        xs, residual = saddle_point(data, rho, args.mu)
        print(f"rho={rho}: ||x*||^2={np.sum(xs ** 2):.4f}, saddle residual {residual:.2e}", flush=True)
        runs = {
            "SCAFF-PD": ("scaffpd", {**base, "rho": rho, "objective": "chi2", "dual-lr": args.dual_lr}),
            "DRFA": ("drfa-prox", {**base, "rho": rho, "regularizer": "chi2", "dual-lr": args.drfa_dual_lr,
                                   "clients-per-round": n, "loss-on": "full"}),
        }
        for label, (name, rc) in runs.items():
            dist, secs, lam = run_distances(name, rc, args.rounds, xs, n)
            first = next((r for r, e in enumerate(dist) if e <= 1e-10), None)
            print(f"  {label:9s} final rel. dist {dist[-1]:.3e}, first round <= 1e-10: {first}, {secs:.1f} s, "
                  f"lambda {lam}", flush=True)
            results["runs"][f"{label} rho={rho}"] = {"rho": rho, "strategy": name, "distance": dist,
                                                     "final": dist[-1], "first_round_1e-10": first,
                                                     "seconds": round(secs, 2), "lambda": lam,
                                                     "saddle_residual": residual}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.rhos), figsize=(4.2 * len(args.rhos), 3.4), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, rho in zip(axes, args.rhos, strict=True):
        for label, style in (("SCAFF-PD", "-"), ("DRFA", "--")):
            d = results["runs"][f"{label} rho={rho}"]["distance"]
            ax.semilogy(range(len(d)), np.maximum(d, 1e-16), style, label=label)
        ax.axhline(1e-10, color="grey", lw=0.6, ls=":")
        ax.set_title(f"χ², ρ = {rho}")
        ax.set_xlabel("communication round r")
    axes[0].set_ylabel("‖x^r − x*‖² / ‖x*‖²")
    axes[0].legend()
    fig.suptitle(f"Robust regression (N={n}, d={args.dim}, m={args.samples}, J={args.local_steps}, μ_x={args.mu})")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
