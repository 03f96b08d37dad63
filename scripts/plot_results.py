#!/usr/bin/env python3
"""Plot every strategy of an experiment folder (mean ± std over seeds).

Usage::

    python scripts/plot_results.py results/drfa_fmnist_compare docs/figures/drfa_fmnist_compare.png
    python scripts/plot_results.py results/drfa_fmnist_tau docs/figures/drfa_tau.png --local-iterations

``--local-iterations`` adds a panel of worst-client accuracy against local iterations
(round × τ, τ = ``local_steps`` in each run's settings.json), as in the DRFA paper's Fig. 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def load(root: Path) -> dict[str, list[list[dict]]]:
    """``{label: [history of seed k, ...]}`` from ``root/<label>/seed*/rounds.jsonl``."""
    runs: dict[str, list[list[dict]]] = {}
    for label_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        hist = [[json.loads(x) for x in f.read_text().splitlines() if x.strip()]
                for f in sorted(label_dir.glob("seed*/rounds.jsonl"))]
        if hist:
            runs[label_dir.name] = hist
    return runs


def main() -> None:  # noqa: D103
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("out")
    ap.add_argument("--local-iterations", action="store_true")
    ap.add_argument("--title", default=None)
    ap.add_argument("--smooth", type=int, default=1, help="moving average over this many rounds")
    args = ap.parse_args()
    root = Path(args.root)
    runs = load(root)
    from flowerdro.runs.plots import plot_history

    plot_history(runs, args.out, title=args.title or root.name, smooth=args.smooth)
    if args.local_iterations:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for label, hists in runs.items():
            settings = json.loads((root / label / "seed0" / "settings.json").read_text())
            tau = int(settings.get("local_steps") or 1)
            n = min(len(h) for h in hists)
            worst = np.array([[r["acc_worst"] for r in h[:n]] for h in hists])
            rounds = np.arange(1, n + 1)
            for ax, x in zip(axes, (rounds * tau, rounds), strict=True):
                line, = ax.plot(x, worst.mean(0), label=f"{label} (τ={tau})")
                ax.fill_between(x, worst.mean(0) - worst.std(0), worst.mean(0) + worst.std(0), alpha=0.2,
                                color=line.get_color())
        axes[0].set_xlabel("local iterations (round × τ)")
        axes[1].set_xlabel("communication round")
        for ax in axes:
            ax.set_ylabel("worst-client accuracy")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        out = Path(args.out)
        fig.savefig(out.with_name(out.stem + "_iterations.png"), dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
