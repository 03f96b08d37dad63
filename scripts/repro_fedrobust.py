"""Reproduce FedRobust's §5 MNIST comparison (Reisizadeh, Farnia, Pedarsani, Jadbabaie, NeurIPS 2020).

Trains every strategy of an experiment TOML (the runner's format, e.g.
``conf/fedrobust_mnist.toml``) in-process, then evaluates every final model on the
*unshifted* global MNIST test set (a seeded subsample) with :mod:`flowerdro.core.affine`:

* clean accuracy;
* accuracy under the worst affine shift, sweeping ‖Λ − I‖_F ≤ ε₁ at ‖δ‖₂ ≤ 1 and
  ‖δ‖₂ ≤ ε₂ at ‖Λ − I‖_F ≤ 0.4 (paper Fig. 1);
* accuracy under per-sample ℓ₂ PGD (10 steps), sweeping ε (paper Fig. 2);
* wall time per training round (rounds without evaluation; paper: FedRobust ≈ 4× faster
  than PGD training).

Writes ``<out>/<name>/robustness.json`` and the plots
``docs/figures/<prefix>_{affine_lambda,affine_delta,pgd}.png``, and prints Markdown tables.

    python scripts/repro_fedrobust.py conf/fedrobust_mnist.toml
    python scripts/repro_fedrobust.py conf/fedrobust_mnist.toml --rounds 3 --set model=cnn_mnist \\
        --set evaluate-every=3 --name fedrobust_mnist_cnn_timing --no-eval   # CNN timing only
    python scripts/repro_fedrobust.py conf/fedrobust_mnist_cnn_n10.toml --eval-from fedrobust_mnist_cnn_n10 \
        --name fedrobust_mnist_cnn_n10_margin --attack-loss margin   # re-attack saved models, no training

``--attack-loss margin`` makes both attacks ascend :func:`flowerdro.core.affine.margin_loss`
instead of cross-entropy (stronger on models whose outputs are close to uniform).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def train_seconds_per_round(history: list[dict[str, Any]]) -> float:
    """Mean wall time of the rounds that did no evaluation (all rounds if every one did)."""
    rounds = [r["time_s"] for r in history if "acc_mean" not in r] or [r["time_s"] for r in history]
    return float(np.mean(rounds))


def main(argv: list[str] | None = None) -> int:
    """Train, evaluate, plot, print."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path)
    ap.add_argument("--rounds", type=int, help="override num-rounds")
    ap.add_argument("--strategies", help="comma-separated labels to run (default: all of the config)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a run-config key")
    ap.add_argument("--name", help="override the experiment name (output folder)")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--eval-samples", type=int, default=2000, help="unshifted MNIST test images used")
    ap.add_argument("--lambda-radii", default="0,0.2,0.4,0.6", help="ε₁ sweep at ‖δ‖ ≤ --delta-at")
    ap.add_argument("--delta-at", type=float, default=1.0)
    ap.add_argument("--delta-radii", default="0,0.5,1,1.5,2", help="ε₂ sweep at ‖Λ − I‖_F ≤ --lambda-at")
    ap.add_argument("--lambda-at", type=float, default=0.4)
    ap.add_argument("--pgd-radii", default="0,0.5,1,1.5,2,2.5")
    ap.add_argument("--affine-steps", type=int, default=20)
    ap.add_argument("--pgd-steps", type=int, default=10)
    ap.add_argument("--attack-loss", choices=("ce", "margin"), default="ce",
                    help="loss the affine and ℓ₂ attacks ascend (margin: for near-uniform outputs)")
    ap.add_argument("--no-eval", action="store_true", help="train and time only")
    ap.add_argument("--eval-from", metavar="NAME",
                    help="no training: evaluate the final models saved under <out>/NAME/<label>/seed<first seed>/ "
                         "(training statistics copied from <out>/NAME/robustness.json); use with --name")
    ap.add_argument("--figures-prefix", default="fedrobust")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady timings on a shared CPU)")
    ap.add_argument("--timing-repeats", type=int, default=3, help="repeats of the per-round CPU timing (0: skip)")
    args = ap.parse_args(argv)

    import torch

    from flowerdro.core.affine import robust_accuracy
    from flowerdro.data import load_raw
    from flowerdro.data.sources import to_float32
    from flowerdro.experiments import run
    from flowerdro.experiments.runner import load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    if args.rounds:
        cfg["num-rounds"] = args.rounds
    if args.strategies:
        cfg["strategies"] = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.name:
        cfg["name"] = args.name
    for item in args.set:
        key, _, value = item.partition("=")
        cfg.setdefault("run-config", {})[key.strip()] = _parse_value(value.strip())
    rc = cfg["run-config"]
    report: dict[str, Any] = {"config": cfg, "strategies": {}}
    if args.eval_from:
        if args.name is None or args.name == args.eval_from:
            raise SystemExit("--eval-from: give a different --name, so the saved report is not overwritten")
        final_arrays = _saved_models(args.out / args.eval_from, cfg, report)
        args.timing_repeats = 0
    else:
        t0 = time.time()
        result = run(cfg, output_root=args.out)
        print(f"training: {time.time() - t0:.1f} s")
        final_arrays = result.final_arrays
    for label, histories in ({} if args.eval_from else result.histories).items():
        hist = histories[0]
        last = [r for r in hist if "acc_mean" in r][-1]
        entry = {"train_s_per_round": train_seconds_per_round(hist),
                 "fed_acc_mean": last["acc_mean"], "fed_acc_worst": last["acc_worst"]}
        if "train" in hist[-1]:
            entry.update({k: hist[-1]["train"][k] for k in ("lambda-dev-fro", "delta-norm") if k in hist[-1]["train"]})
        report["strategies"][label] = entry

    if args.timing_repeats > 0:
        for label, seconds in _train_cpu_seconds(cfg, args.timing_repeats).items():
            report["strategies"][label]["train_cpu_s_per_round"] = seconds

    if not args.no_eval:
        raw = load_raw(rc.get("dataset", "mnist"), str(rc.get("data-dir", "")))
        rng = np.random.default_rng(0)
        idx = rng.choice(len(raw.y_test), size=min(args.eval_samples, len(raw.y_test)), replace=False)
        x = torch.as_tensor(to_float32(raw.x_test[idx]))
        y = torch.as_tensor(raw.y_test[idx].astype(np.int64))
        radii_l = [float(v) for v in args.lambda_radii.split(",")]
        radii_d = [float(v) for v in args.delta_radii.split(",")]
        radii_p = [float(v) for v in args.pgd_radii.split(",")]
        from flowerdro.core.affine import load_model, margin_loss

        loss_fn = margin_loss if args.attack_loss == "margin" else None

        for label, arrays_list in final_arrays.items():
            te = time.time()
            kwargs = {"hidden": str(rc.get("hidden", "128,64"))} if rc.get("model") == "mlp" else {}
            model = load_model(str(rc.get("model", "logreg")), arrays_list[0], x.shape[1:], 10, **kwargs)
            e = report["strategies"][label]
            e["clean"] = robust_accuracy(model, x, y, "clean")
            # (ε₁, ε₂) → accuracy, each pair attacked once (the two sweeps share (--lambda-at, --delta-at))
            pairs = [(r, args.delta_at) for r in radii_l] + [(args.lambda_at, r) for r in radii_d]
            affine = {p: robust_accuracy(model, x, y, "affine", eps_lambda=p[0], eps_delta=p[1],
                                         steps=args.affine_steps, loss_fn=loss_fn) for p in dict.fromkeys(pairs)}
            e["affine_lambda"] = {r: affine[(r, args.delta_at)] for r in radii_l}
            e["affine_delta"] = {r: affine[(args.lambda_at, r)] for r in radii_d}
            e["pgd"] = {r: robust_accuracy(model, x, y, "pgd", eps=r, steps=args.pgd_steps, loss_fn=loss_fn)
                        for r in radii_p}
            print(f"evaluated {label} in {time.time() - te:.1f} s")
        _plots(report, args, radii_l, radii_d, radii_p)

    out = args.out / cfg["name"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "robustness.json").write_text(json.dumps(report, indent=2, default=str))
    _tables(report, args)
    return 0


def _saved_models(folder: Path, cfg: dict[str, Any], report: dict[str, Any]) -> dict[str, list[Any]]:
    """The final models of ``cfg["strategies"]`` saved by an earlier run in ``folder``.

    Fills ``report["strategies"]`` with that run's training statistics (from its
    ``robustness.json``: wall and CPU time per round, federated accuracy, shift norms).
    """
    seed = int(cfg.get("seeds", [0])[0])
    saved = json.loads((folder / "robustness.json").read_text())["strategies"]
    out = {}
    for label in cfg["strategies"]:
        path = folder / label / f"seed{seed}" / "final_model.npz"
        if label not in saved or not path.exists():
            raise SystemExit(f"--eval-from: no saved model or report entry for {label!r} in {folder}")
        keep = ("train_s_per_round", "train_cpu_s_per_round", "fed_acc_mean", "fed_acc_worst", "lambda-dev-fro",
                "delta-norm")
        report["strategies"][label] = {k: saved[label][k] for k in keep if k in saved[label]}
        out[label] = [dict(np.load(path))]
    return out


def _train_cpu_seconds(cfg: dict[str, Any], repeats: int) -> dict[str, float]:
    """CPU seconds (this process) of one training round of every label: all nodes, from the initial model.

    The ClientApp runs in this process (InProcessGrid), so ``time.process_time`` around
    ``send_and_receive`` is the clients' training cost, steady under a loaded machine; the
    minimum over ``repeats`` fresh grids is reported.
    """
    from flwr.app import ConfigRecord

    from flowerdro.apps.client_app import app as client_app
    from flowerdro.apps.server_app import client_config, initial_arrays
    from flowerdro.experiments import InProcessGrid
    from flowerdro.strategies import build_strategy

    base = dict(cfg.get("run-config", {}))
    n = int(cfg.get("num-partitions", 10))
    out = {}
    for label in cfg["strategies"]:
        over = dict(cfg.get("strategy", {}).get(label, {}))
        algo = str(over.pop("strategy", label))
        rc = {"data-seed": 0, **base, **over, "seed": 0, "num-partitions": n}
        best = float("inf")
        for _ in range(repeats):
            grid = InProcessGrid(client_app, n, rc)
            init = initial_arrays(grid, rc, 600)
            msgs = list(build_strategy(algo, rc).configure_train(1, init, ConfigRecord(dict(client_config(rc))), grid))
            c0 = time.process_time()
            replies = list(grid.send_and_receive(msgs))
            best = min(best, time.process_time() - c0)
            assert all(not r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
        out[label] = best
    return out


def _plots(report: dict[str, Any], args: argparse.Namespace, radii_l: list[float], radii_d: list[float],
           radii_p: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = ROOT / "docs" / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    specs = [
        ("affine_lambda", radii_l, r"$\|\Lambda - I\|_F \leq \varepsilon_1$" + f"  (at $\\|\\delta\\|_2 \\leq {args.delta_at:g}$)"),
        ("affine_delta", radii_d, r"$\|\delta\|_2 \leq \varepsilon_2$" + f"  (at $\\|\\Lambda - I\\|_F \\leq {args.lambda_at:g}$)"),
        ("pgd", radii_p, r"$\ell_2$ PGD radius $\varepsilon$"),
    ]
    for key, radii, xlabel in specs:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        for label, e in report["strategies"].items():
            ax.plot(radii, [e[key][r] for r in radii], marker="o", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (unshifted MNIST)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title({"affine_lambda": "worst affine shift", "affine_delta": "worst affine shift",
                      "pgd": "per-sample l2 PGD (10 steps)"}[key])
        fig.tight_layout()
        path = figs / f"{args.figures_prefix}_{key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        print(f"wrote {path}")


def _tables(report: dict[str, Any], args: argparse.Namespace) -> None:
    strategies = report["strategies"]
    print("\n| strategy | train CPU s/round | train wall s/round | clean | fed mean acc | fed worst acc | ‖Λ_i−I‖_F | ‖δ_i‖ |")
    print("|---|---|---|---|---|---|---|---|")
    for label, e in strategies.items():
        print(f"| {label} | {e.get('train_cpu_s_per_round', float('nan')):.3f} | {e['train_s_per_round']:.3f} | "
              f"{e.get('clean', float('nan')):.4f} | "
              f"{e['fed_acc_mean']:.4f} | {e['fed_acc_worst']:.4f} | {e.get('lambda-dev-fro', float('nan')):.3f} | "
              f"{e.get('delta-norm', float('nan')):.3f} |")
    first = next(iter(strategies.values()))
    for key, title in (("affine_lambda", f"worst affine, ‖Λ−I‖_F ≤ ε₁ at ‖δ‖ ≤ {args.delta_at:g}"),
                       ("affine_delta", f"worst affine, ‖δ‖ ≤ ε₂ at ‖Λ−I‖_F ≤ {args.lambda_at:g}"),
                       ("pgd", "ℓ₂ PGD radius ε")):
        if key not in first:
            continue
        radii = list(first[key])
        print(f"\n{title}\n\n| strategy | " + " | ".join(f"{r:g}" for r in radii) + " |")
        print("|---|" + "---|" * len(radii))
        for label, e in strategies.items():
            print(f"| {label} | " + " | ".join(f"{e[key][r]:.4f}" for r in radii) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
