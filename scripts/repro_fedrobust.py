"""Reproduce FedRobust's §5 MNIST comparison (Reisizadeh, Farnia, Pedarsani, Jadbabaie, NeurIPS 2020).

Trains every strategy of an experiment TOML (the runner's format, e.g.
``conf/fedrobust_mnist.toml``) in-process, then evaluates every final model on the
*unshifted* global MNIST test set (a seeded subsample) with :mod:`flowerdro.models.robustness`:

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

``--attack-loss margin`` makes both attacks ascend :func:`flowerdro.models.affine.margin_loss`
instead of cross-entropy (stronger on models whose outputs are close to uniform);
``--attack-loss both`` runs each and keeps, per radius, the lower accuracy.

Tuning and seeds (docs/results/fedrobust.md, "Choosing λ and η₂ on validation images"):

* ``--eval-split validation`` evaluates on training-split images that are in no node's
  training set (:func:`validation_indices`), for choosing hyperparameters without the
  test images; the default ``test`` is the tables' seeded subsample of the test split;
* ``--seeds 0,1,2`` overrides the config's seeds; every seed's final model is evaluated
  and the report holds each seed (``seeds``) and the mean and sample std over them
  (:func:`aggregate_seeds`); figures draw mean ± std;
* ``--eval-from A,B,...`` takes each (label, seed) model from the first folder that has it;
  each evaluation is cached beside its model (``eval_cache/``, keyed by the model file and
  the evaluation settings), so models trained in separate runs are tabulated together
  without being attacked twice.

    python scripts/repro_fedrobust.py conf/fedrobust_mnist_cnn_n10_tuned.toml --seeds 0 \\
        --strategies fedrobust-lam1 --eval-from fedrobust_mnist_cnn_n10_tune --name my_val \\
        --eval-split validation --attack-loss both --eval-samples 500 --affine-steps 5
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
    ap.add_argument("--seeds", help="comma-separated seeds (default: the config's `seeds`)")
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
    ap.add_argument("--attack-loss", choices=("ce", "margin", "both"), default="ce",
                    help="loss the affine and ℓ₂ attacks ascend (margin: for near-uniform outputs; both: run "
                         "each and report, per radius, the lower accuracy)")
    ap.add_argument("--eval-split", choices=("test", "validation"), default="test",
                    help="test: a seeded subsample of the MNIST test split (the tables); validation: training-"
                         "split images in no node's training set (for tuning; see validation_indices)")
    ap.add_argument("--no-eval", action="store_true", help="train and time only")
    ap.add_argument("--eval-from", metavar="NAME[,NAME...]",
                    help="no training: evaluate the final models saved under <out>/NAME/<label>/seed<k>/ for every "
                         "seed (first folder holding it wins; training statistics copied from its "
                         "robustness.json); use with --name")
    ap.add_argument("--figures-prefix", default="fedrobust")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady timings on a shared CPU)")
    ap.add_argument("--timing-repeats", type=int, default=3, help="repeats of the per-round CPU timing (0: skip)")
    args = ap.parse_args(argv)

    import torch

    from flowerdro.data import load_raw
    from flowerdro.data.sources import to_float32
    from flowerdro.experiments import run
    from flowerdro.experiments.runner import load_config
    from flowerdro.models.robustness import load_model

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    if args.rounds:
        cfg["num-rounds"] = args.rounds
    if args.seeds:
        cfg["seeds"] = [int(v) for v in args.seeds.split(",") if v.strip()]
    if args.strategies:
        cfg["strategies"] = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.name:
        cfg["name"] = args.name
    for item in args.set:
        key, _, value = item.partition("=")
        cfg.setdefault("run-config", {})[key.strip()] = _parse_value(value.strip())
    rc = cfg["run-config"]
    seeds = [int(v) for v in cfg.get("seeds", [0])]
    report: dict[str, Any] = {"config": cfg, "eval_split": args.eval_split, "attack_loss": args.attack_loss,
                              "lambda_at": args.lambda_at, "delta_at": args.delta_at,
                              "strategies": {}}
    if args.eval_from:
        folders = [args.out / f.strip() for f in args.eval_from.split(",") if f.strip()]
        if args.name is None or args.name in [f.name for f in folders]:
            raise SystemExit("--eval-from: give a different --name, so the saved report is not overwritten")
        final_arrays = _saved_models(folders, cfg, report)
        args.timing_repeats = 0
    else:
        t0 = time.time()
        result = run(cfg, output_root=args.out)
        print(f"training: {time.time() - t0:.1f} s")
        final_arrays = {label: dict(zip(seeds, arrays, strict=True)) for label, arrays in result.final_arrays.items()}
        for label, histories in result.histories.items():
            report["strategies"][label] = {"seeds": {s: _train_stats(h) for s, h in zip(seeds, histories, strict=True)}}

    if args.timing_repeats > 0:
        for label, seconds in _train_cpu_seconds(cfg, args.timing_repeats).items():
            report["strategies"][label]["train_cpu_s_per_round"] = seconds

    if not args.no_eval:
        raw = load_raw(rc.get("dataset", "mnist"), str(rc.get("data-dir", "")))
        if args.eval_split == "validation":
            idx = validation_indices(rc, int(cfg.get("num-partitions", 10)), args.eval_samples)
            x_all, y_all = raw.x_train, raw.y_train
        else:
            rng = np.random.default_rng(0)
            idx = rng.choice(len(raw.y_test), size=min(args.eval_samples, len(raw.y_test)), replace=False)
            x_all, y_all = raw.x_test, raw.y_test
        x = torch.as_tensor(to_float32(x_all[idx]))
        y = torch.as_tensor(y_all[idx].astype(np.int64))
        radii = {"affine_lambda": [float(v) for v in args.lambda_radii.split(",")],
                 "affine_delta": [float(v) for v in args.delta_radii.split(",")],
                 "pgd": [float(v) for v in args.pgd_radii.split(",")]}
        attacks = {"ce": ("ce",), "margin": ("margin",), "both": ("ce", "margin")}[args.attack_loss]
        kwargs = {"hidden": str(rc.get("hidden", "128,64"))} if rc.get("model") == "mlp" else {}
        for label, by_seed in final_arrays.items():
            entry = report["strategies"].setdefault(label, {"seeds": {}})
            for seed, arrays in by_seed.items():
                te = time.time()
                seed_entry = entry["seeds"].setdefault(seed, {})
                saved = Path(seed_entry.get("model_from", args.out / cfg["name"] / label / f"seed{seed}" /
                                            "final_model.npz"))
                cache = _cache_path(saved, idx, radii, attacks, args) if saved.exists() else None
                if cache is not None and cache.exists():
                    evaluation = json.loads(cache.read_text())
                    for key in SWEEPS:  # JSON keys are strings; the radii are floats
                        evaluation[key] = {float(r): v for r, v in evaluation[key].items()}
                        for a in evaluation["by_attack"].values():
                            a[key] = {float(r): v for r, v in a[key].items()}
                    print(f"{label} seed {seed}: evaluation read from {cache}")
                else:
                    model = load_model(str(rc.get("model", "logreg")), arrays, x.shape[1:], 10, **kwargs)
                    evaluation = evaluate_model(model, x, y, radii, attacks, args)
                    if cache is not None:
                        cache.parent.mkdir(exist_ok=True)
                        cache.write_text(json.dumps(evaluation, indent=1))
                    print(f"evaluated {label} seed {seed} in {time.time() - te:.1f} s "
                          f"(CPU {evaluation['eval_cpu_s']:.1f} s)", flush=True)
                seed_entry.update(evaluation)
        for entry in report["strategies"].values():
            entry.update(aggregate_seeds(entry["seeds"]))
        _plots(report, args)
    else:
        for entry in report["strategies"].values():
            entry.update(aggregate_seeds(entry["seeds"]))

    out = args.out / cfg["name"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "robustness.json").write_text(json.dumps(report, indent=2, default=str))
    _tables(report, args)
    return 0


def _cache_path(model_file: Path, idx: np.ndarray, radii: dict[str, list[float]], attacks: tuple[str, ...],
                args: argparse.Namespace) -> Path:
    """``<model dir>/eval_cache/<sha1>.json``: one evaluation of one saved model under one setting.

    The SHA-1 covers the model file's bytes, the evaluation images (split and indices), the
    radii, the attack losses and steps, so a cached result is reused only for the same
    model and the same evaluation (it lets runs of different strategies and seeds be
    evaluated in their own processes and tabulated together with ``--eval-from``).
    """
    import hashlib

    h = hashlib.sha1(model_file.read_bytes())
    setting = {"split": args.eval_split, "radii": radii, "attacks": list(attacks), "affine_steps": args.affine_steps,
               "pgd_steps": args.pgd_steps, "lambda_at": args.lambda_at, "delta_at": args.delta_at}
    h.update(json.dumps(setting, sort_keys=True).encode())
    h.update(np.asarray(idx, dtype=np.int64).tobytes())
    return model_file.parent / "eval_cache" / f"{h.hexdigest()}.json"


def _train_stats(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Training statistics of one run: wall s/round, last federated accuracy, learned shift norms."""
    entry: dict[str, Any] = {"train_s_per_round": train_seconds_per_round(history)}
    evaluated = [r for r in history if "acc_mean" in r]
    if evaluated:
        entry.update({"fed_acc_mean": evaluated[-1]["acc_mean"], "fed_acc_worst": evaluated[-1]["acc_worst"]})
    if "train" in history[-1]:
        entry.update({k: history[-1]["train"][k] for k in ("lambda-dev-fro", "delta-norm") if k in history[-1]["train"]})
    return entry


def validation_indices(run_config: dict[str, Any], num_partitions: int, size: int, seed: int = 0) -> np.ndarray:
    """Indices into the global training split of ``size`` images that are in no node's training set.

    Rebuilds the nodes' data exactly as the clients do (``DataConfig.from_run_config`` with
    the run's ``data-seed``, default 0, and ``num_partitions``), but with the affine-shift
    scales set to 0: the partition, split and cap use their own random streams, so the
    unshifted nodes hold the same images as the shifted ones (checked in
    ``tests/unit/test_affine_data.py``). An image is *used* when its float32 bytes equal
    (by a 128-bit BLAKE2b digest) those of any row of any node's training set; the
    validation pool is every training-split image that is not used (compared by content,
    so a duplicate of a training image is excluded too), and ``size`` of them are drawn
    without replacement with ``np.random.default_rng([seed, 1])``. The pool holds the
    rows the nodes hold out as their local test sets (with ``partition = "iid"``,
    ``test-fraction`` 0.2 and 10 nodes, all 60,000 MNIST training images are in some node's
    train or local test set), never the MNIST test split the tables use.

    Raises
    ------
    ValueError
        If ``size`` < 1 or the pool holds fewer than ``size`` images.
    AssertionError
        If a drawn image matches a node's training image (the disjointness check).
    """
    import hashlib

    from flowerdro.data import DataConfig, load_federated, load_raw
    from flowerdro.data.sources import to_float32

    if size < 1:
        raise ValueError(f"eval-samples: the validation set needs >= 1 image, got {size}")
    rc = {**run_config, "num-partitions": int(num_partitions), "data-seed": int(run_config.get("data-seed", 0)),
          "affine-shift-lambda-std": 0.0, "affine-shift-delta-std": 0.0}
    cfg = DataConfig.from_run_config(rc)

    def digest(row: np.ndarray) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()

    used = {digest(row) for client in load_federated(cfg) for row in client.x_train}
    raw = load_raw(cfg.dataset, cfg.data_dir)
    x = to_float32(raw.x_train)
    pool = np.array([i for i in range(len(x)) if digest(x[i]) not in used], dtype=np.int64)
    if len(pool) < size:
        raise ValueError(f"eval-samples: only {len(pool)} training images are in no node's training set, "
                         f"asked for {size}")
    idx = np.random.default_rng([seed, 1]).choice(pool, size=size, replace=False)
    assert not any(digest(x[i]) in used for i in idx), "validation image found in a node's training set"
    return idx


def evaluate_model(model: Any, x: Any, y: Any, radii: dict[str, list[float]], attacks: tuple[str, ...],
                   args: argparse.Namespace) -> dict[str, Any]:
    """Clean accuracy and the three sweeps under each attack loss, plus their minimum over the attacks.

    ``attacks`` names the loss each attack ascends (``ce``: cross-entropy, ``margin``:
    :func:`flowerdro.models.affine.margin_loss`); ``<sweep>`` holds, per radius, the lowest
    accuracy over them (a stronger combined attack: each attack is a valid perturbation),
    ``by_attack[<loss>][<sweep>]`` each attack's own accuracy.
    """
    from flowerdro.models.affine import margin_loss
    from flowerdro.models.robustness import robust_accuracy

    c0 = time.process_time()
    out: dict[str, Any] = {"clean": robust_accuracy(model, x, y, "clean"), "by_attack": {}}
    for name in attacks:
        loss_fn = margin_loss if name == "margin" else None
        # (ε₁, ε₂) → accuracy, each pair attacked once (the two sweeps share (--lambda-at, --delta-at))
        pairs = [(r, args.delta_at) for r in radii["affine_lambda"]] + [(args.lambda_at, r) for r in radii["affine_delta"]]
        affine = {p: robust_accuracy(model, x, y, "affine", eps_lambda=p[0], eps_delta=p[1],
                                     steps=args.affine_steps, loss_fn=loss_fn) for p in dict.fromkeys(pairs)}
        out["by_attack"][name] = {
            "affine_lambda": {r: affine[(r, args.delta_at)] for r in radii["affine_lambda"]},
            "affine_delta": {r: affine[(args.lambda_at, r)] for r in radii["affine_delta"]},
            "pgd": {r: robust_accuracy(model, x, y, "pgd", eps=r, steps=args.pgd_steps, loss_fn=loss_fn)
                    for r in radii["pgd"]},
        }
    for key in SWEEPS:
        out[key] = {r: min(out["by_attack"][a][key][r] for a in attacks) for r in radii[key]}
    out["eval_cpu_s"] = time.process_time() - c0
    return out


#: The three evaluation sweeps of a report entry.
SWEEPS = ("affine_lambda", "affine_delta", "pgd")
#: Scalar statistics averaged over seeds.
SCALARS = ("train_s_per_round", "train_cpu_s_per_round", "fed_acc_mean", "fed_acc_worst", "lambda-dev-fro",
           "delta-norm", "clean")


def aggregate_seeds(per_seed: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """Mean and (sample, ddof = 1; 0 for one seed) standard deviation over seeds of every statistic.

    Scalars ``k`` become ``k`` (mean) and ``k_std``; sweeps ``s`` become ``s[r]`` (mean) and
    ``s_std[r]``, also for each attack under ``by_attack``; ``n_seeds`` counts the seeds.
    """
    def stats(values: list[float]) -> tuple[float, float]:
        arr = np.asarray(values, dtype=float)
        return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0

    entries = list(per_seed.values())
    out: dict[str, Any] = {"n_seeds": len(entries)}
    for key in SCALARS:
        if entries and all(key in e for e in entries):
            out[key], out[f"{key}_std"] = stats([e[key] for e in entries])

    def sweeps(getter: Any) -> dict[str, Any]:
        res: dict[str, Any] = {}
        for key in SWEEPS:
            if entries and all(key in getter(e) for e in entries):
                radii = list(getter(entries[0])[key])
                pairs = {r: stats([getter(e)[key][r] for e in entries]) for r in radii}
                res[key] = {r: m for r, (m, _) in pairs.items()}
                res[f"{key}_std"] = {r: s for r, (_, s) in pairs.items()}
        return res

    out.update(sweeps(lambda e: e))
    if entries and all("by_attack" in e for e in entries):
        out["by_attack"] = {a: sweeps(lambda e, a=a: e["by_attack"][a]) for a in entries[0]["by_attack"]}
    return out


def _saved_models(folders: list[Path], cfg: dict[str, Any], report: dict[str, Any]) -> dict[str, dict[int, Any]]:
    """The final models of ``cfg["strategies"]`` × ``cfg["seeds"]`` saved by earlier runs in ``folders``.

    For each (label, seed) the first folder holding ``<label>/seed<k>/final_model.npz`` is
    used (a seed no folder holds is left out, with a note; a label with none is an error); its training statistics (wall and CPU time per round, federated accuracy, shift
    norms) are copied from that folder's ``robustness.json`` (per seed, or the flat entry of
    a report written before seeds were kept apart, which holds its first seed), or else
    from the seed's ``rounds.jsonl``.
    """
    keep = ("train_s_per_round", "train_cpu_s_per_round", "fed_acc_mean", "fed_acc_worst", "lambda-dev-fro",
            "delta-norm")
    out: dict[str, dict[int, Any]] = {}
    for label in cfg["strategies"]:
        entry = report["strategies"].setdefault(label, {"seeds": {}})
        for seed in (int(s) for s in cfg.get("seeds", [0])):
            folder = next((f for f in folders if (f / label / f"seed{seed}" / "final_model.npz").exists()), None)
            if folder is None:
                print(f"--eval-from: no saved model for {label!r} seed {seed}; left out")
                continue
            stats: dict[str, Any] = {"model_from": str(folder / label / f"seed{seed}" / "final_model.npz")}
            rounds = folder / label / f"seed{seed}" / "rounds.jsonl"
            if rounds.exists():  # the run's own log (a run stopped before writing robustness.json has it too)
                stats.update(_train_stats([json.loads(line) for line in rounds.read_text().splitlines() if line]))
            report_path = folder / "robustness.json"
            if report_path.exists():
                saved = json.loads(report_path.read_text())
                e = saved["strategies"].get(label, {})
                first = int(saved.get("config", {}).get("seeds", [0])[0])
                src = e["seeds"].get(str(seed), {}) if "seeds" in e else (e if seed == first else {})
                stats.update({k: src[k] for k in keep if k in src})
            entry["seeds"][seed] = stats
            out.setdefault(label, {})[seed] = dict(np.load(folder / label / f"seed{seed}" / "final_model.npz"))
        if label not in out:
            raise SystemExit(f"--eval-from: no saved model for {label!r} in {[str(f) for f in folders]}")
    return out


def _train_cpu_seconds(cfg: dict[str, Any], repeats: int) -> dict[str, float]:
    """CPU seconds (this process) of the clients' work in one training round of every label.

    Each label's strategy runs one round (no evaluation) on an InProcessGrid, so the
    ClientApp runs in this process and ``time.process_time`` around the grid's exchanges
    is the clients' cost of that round (every message the strategy sends, e.g. FedRobust's
    ``train.fedrobust``), steady under a loaded machine; the minimum over ``repeats``
    fresh grids is reported.
    """
    from flowerdro.apps.client_app import app as client_app
    from flowerdro.comparison import client_config
    from flowerdro.experiments import InProcessGrid
    from flowerdro.strategies import build_strategy, initial_arrays

    base = dict(cfg.get("run-config", {}))
    n = int(cfg.get("num-partitions", 10))
    out = {}
    for label in cfg["strategies"]:
        over = dict(cfg.get("strategy", {}).get(label, {}))
        algo = str(over.pop("strategy", label))
        rc = {"data-seed": 0, **base, **over, "seed": 0, "num-partitions": n, "fraction-evaluate": 0.0}
        best = float("inf")
        for _ in range(repeats):
            grid = InProcessGrid(client_app, n, rc)
            init = initial_arrays(grid, rc, 600)
            spent = [0.0]
            exchange = grid.send_and_receive

            def timed(messages: Any, *, timeout: float | None = None, _exchange: Any = exchange,
                      _spent: list[float] = spent) -> Any:
                c0 = time.process_time()
                replies = list(_exchange(messages, timeout=timeout))
                _spent[0] += time.process_time() - c0
                bad = [r.error.reason for r in replies if r.has_error()]
                assert not bad, bad
                return replies

            grid.send_and_receive = timed  # type: ignore[method-assign]
            build_strategy(algo, rc).start(grid, init, num_rounds=1, timeout=3600,
                                           train_config=client_config(rc))
            best = min(best, spent[0])
        out[label] = best
    return out


def plot_sweep(report: dict[str, Any], key: str, path: Path) -> None:
    """Draw one sweep of a robustness report (``affine_lambda``, ``affine_delta`` or ``pgd``) to ``path``.

    Accuracy against the sweep's radius per strategy, mean ± std over seeds when there are
    several. ``report`` is what this script writes to ``robustness.json`` (radii may be
    floats or, read back from JSON, strings).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lambda_at, delta_at = float(report.get("lambda_at", 0.4)), float(report.get("delta_at", 1.0))
    xlabel = {"affine_lambda": r"$\|\Lambda - I\|_F \leq \varepsilon_1$" + f"  (at $\\|\\delta\\|_2 \\leq {delta_at:g}$)",
              "affine_delta": r"$\|\delta\|_2 \leq \varepsilon_2$" + f"  (at $\\|\\Lambda - I\\|_F \\leq {lambda_at:g}$)",
              "pgd": r"$\ell_2$ PGD radius $\varepsilon$"}[key]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for label, e in report["strategies"].items():
        if key not in e:
            continue
        values = {float(r): v for r, v in dict(e[key]).items()}
        radii = sorted(values)
        std = e.get(f"{key}_std") if e.get("n_seeds", 1) > 1 else None
        err = None if std is None else [{float(r): v for r, v in dict(std).items()}[r] for r in radii]
        ax.errorbar(radii, [values[r] for r in radii], yerr=err, marker="o", capsize=3,
                    label=f"{label} ({e.get('n_seeds', 1)} seeds)")
    ax.set_xlabel(xlabel)
    split = "validation: MNIST train split" if report.get("eval_split") == "validation" else "unshifted MNIST test"
    ax.set_ylabel(f"accuracy ({split})")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    n_seeds = max(e.get("n_seeds", 1) for e in report["strategies"].values())
    attack = {"ce": "", "margin": ", margin attack", "both": ", min of CE and margin attacks"}[
        str(report.get("attack_loss", "ce"))]
    seeds = ", mean ± std over seeds" if n_seeds > 1 else ""
    ax.set_title({"affine_lambda": "worst affine shift", "affine_delta": "worst affine shift",
                  "pgd": "per-sample l2 PGD (10 steps)"}[key] + attack + seeds, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plots(report: dict[str, Any], args: argparse.Namespace) -> None:
    figs = ROOT / "docs" / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    for key in ("affine_lambda", "affine_delta", "pgd"):
        path = figs / f"{args.figures_prefix}_{key}.png"
        plot_sweep(report, key, path)
        print(f"wrote {path}")


def _fmt(e: dict[str, Any], key: str, r: Any = None, digits: int = 3) -> str:
    """``mean`` or ``mean ± std`` (several seeds) of ``e[key]`` (or ``e[key][r]``); ``nan`` when absent."""
    if key not in e:
        return "nan"
    mean = e[key] if r is None else e[key][r]
    std = e.get(f"{key}_std")
    std = std if r is None or std is None else std[r]
    if e.get("n_seeds", 1) > 1 and std is not None:
        return f"{mean:.{digits}f} ± {std:.{digits}f}"
    return f"{mean:.{digits}f}"


def _tables(report: dict[str, Any], args: argparse.Namespace) -> None:
    strategies = report["strategies"]
    print(f"\n(eval split: {args.eval_split}, attack loss: {args.attack_loss})")
    print("\n| strategy | seeds | train CPU s/round | train wall s/round | clean | fed mean acc | fed worst acc "
          "| ‖Λ_i−I‖_F | ‖δ_i‖ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, e in strategies.items():
        print(f"| {label} | {e.get('n_seeds', 1)} | {_fmt(e, 'train_cpu_s_per_round', digits=2)} | "
              f"{_fmt(e, 'train_s_per_round', digits=2)} | {_fmt(e, 'clean')} | {_fmt(e, 'fed_acc_mean')} | "
              f"{_fmt(e, 'fed_acc_worst')} | {_fmt(e, 'lambda-dev-fro', digits=2)} | {_fmt(e, 'delta-norm', digits=2)} |")
    titles = (("affine_lambda", f"worst affine, ‖Λ−I‖_F ≤ ε₁ at ‖δ‖ ≤ {args.delta_at:g}"),
              ("affine_delta", f"worst affine, ‖δ‖ ≤ ε₂ at ‖Λ−I‖_F ≤ {args.lambda_at:g}"),
              ("pgd", "ℓ₂ PGD radius ε"))
    views = [("", lambda e: e)]
    first = next(iter(strategies.values()), {})
    if len(first.get("by_attack", {})) > 1:
        views = [(" (min over attacks)", lambda e: e)] + [
            (f" ({a} attack)", lambda e, a=a: e["by_attack"][a]) for a in first["by_attack"]]
    for suffix, view in views:
        for key, title in titles:
            if key not in view(first):
                continue
            radii = list(view(first)[key])
            print(f"\n{title}{suffix}\n\n| strategy | " + " | ".join(f"{r:g}" for r in radii) + " |")
            print("|---|" + "---|" * len(radii))
            for label, e in strategies.items():
                v = {**view(e), "n_seeds": e.get("n_seeds", 1)}
                print(f"| {label} | " + " | ".join(_fmt(v, key, r) for r in radii) + " |")
    if any(len(e.get("seeds", {})) > 1 for e in strategies.values()):
        print("\nper seed: clean / worst affine at (" f"{args.lambda_at:g}, {args.delta_at:g}) (min over attacks)\n")
        for label, e in strategies.items():
            cells = [f"seed {s}: {v.get('clean', float('nan')):.3f} / "
                     f"{v.get('affine_delta', {}).get(args.delta_at, float('nan')):.3f}" for s, v in e["seeds"].items()]
            print(f"- {label}: " + "; ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main())
