"""Summarise DR-DSGD / DSGD reproduction runs (paper §6 of Ben Issaid, Elgabli, Bennis, TMLR 2022).

Reads ``<results>/<experiment>/<label>/seed*/rounds.jsonl`` written by
``python -m flowerdro.experiments conf/drdsgd_*.toml`` and prints, per label:

* a summary table: mean ± std over seeds of the average, worst, worst-10% device test
  accuracy and of the across-device standard deviation, each first averaged over the last
  ``--last`` evaluated rounds of a seed; the worst-device accuracy averaged over every
  evaluated round of the second half (t > T/2, steadier than the last rounds when the worst
  device swings from round to round); the first evaluated iteration at which the
  worst-device accuracy reaches ``--threshold`` (paper Fig. 2: 70%), per seed and for the
  seed-mean curve; ρ of the graph and the final consensus distance;
* a per-round table (every ``--every``-th evaluated round): average and worst-device
  accuracy, mean ± std over seeds (the curves of paper Fig. 2);
* with ``--plot PATH``, a figure of those curves (mean over seeds, ± std shaded), and with
  ``--json PATH``, the numbers behind both tables.

Seeds whose run diverged (a non-finite accuracy, a consensus distance that is non-finite or
above ``--diverged-cd``, or evaluations that stopped before the others' last one, which is
what happens when the blown-up models are dropped as non-finite replies) and runs that are
still going or were stopped (fewer rounds than the longest run in the folder) are listed
apart and left out of the means. Only rounds evaluated in every kept seed enter the
per-round curves.

    python scripts/repro_drdsgd.py results/drdsgd_fmnist_k10 [--threshold 0.7] [--every 4] \\
        [--last 3] [--plot /tmp/drdsgd_k10_curves.png] [--json results/drdsgd_fmnist_k10/repro.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

Run = list[dict[str, Any]]

#: Keys of the summary table: (round-record key, column title).
SUMMARY_KEYS = (
    ("acc_mean", "avg acc"),
    ("acc_worst", "worst acc"),
    ("acc_worst10", "worst-10%"),
    ("acc_std", "std across devices"),
)


def load(folder: Path) -> dict[str, dict[int, Run]]:
    """label → {seed: round records} for every ``<label>/seed<k>/rounds.jsonl`` under ``folder``."""
    out: dict[str, dict[int, Run]] = {}
    for label_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        runs: dict[int, Run] = {}
        for seed_dir in sorted(label_dir.glob("seed*")):
            f = seed_dir / "rounds.jsonl"
            if f.is_file() and seed_dir.name[4:].isdigit():
                runs[int(seed_dir.name[4:])] = [
                    json.loads(x) for x in f.read_text().splitlines() if x.strip()
                ]
        if runs:
            out[label_dir.name] = dict(sorted(runs.items()))
    return out


def evaluated(history: Run) -> Run:
    """The round records that carry a device evaluation."""
    return [r for r in history if "acc_mean" in r]


def diverged(history: Run, max_cd: float = 1e6) -> bool:
    """Whether a run blew up: a consensus distance above ``max_cd`` (or non-finite), or a
    non-finite evaluated accuracy."""
    for r in history:
        cd = r.get("consensus_distance")
        if cd is not None and not float(cd) <= max_cd:  # also catches NaN
            return True
        if "acc_mean" in r and not math.isfinite(float(r["acc_mean"])):
            return True
    return False


def first_reaching(history: Run, key: str, threshold: float) -> int | None:
    """First round whose ``key`` is at least ``threshold`` (None if never)."""
    for r in history:
        if key in r and r[key] >= threshold:
            return int(r["round"])
    return None


def last_mean(history: Run, key: str, last: int) -> float:
    """Mean of ``key`` over the last ``last`` evaluated rounds of one run."""
    recs = evaluated(history)[-last:]
    return float(np.mean([r[key] for r in recs]))


def curves(runs: list[Run], keys: tuple[str, ...]) -> dict[str, Any]:
    """Per-round mean and std over seeds of ``keys``, on the rounds every run evaluated."""
    common = set.intersection(*({r["round"] for r in evaluated(h)} for h in runs))
    rounds = sorted(common)
    out: dict[str, Any] = {"round": rounds}
    for key in keys:
        vals = np.array(
            [[next(r[key] for r in h if r["round"] == rnd) for h in runs] for rnd in rounds]
        )  # (rounds, seeds)
        out[key] = {"mean": vals.mean(axis=1).tolist(), "std": vals.std(axis=1).tolist()}
    return out


def summarise(
    data: dict[str, dict[int, Run]], *, threshold: float, last: int, max_cd: float = 1e6
) -> dict[str, Any]:
    """Numbers behind the tables, per label (see the module docstring)."""
    out: dict[str, Any] = {}
    horizon = max((h[-1]["round"] for runs in data.values() for h in runs.values() if h), default=0)
    last_eval = max(
        (evaluated(h)[-1]["round"] for runs in data.values() for h in runs.values() if evaluated(h)),
        default=0,
    )
    for label, by_seed in data.items():
        short = [s for s, h in by_seed.items() if not h or h[-1]["round"] < horizon]
        bad = [
            s
            for s, h in by_seed.items()
            if s not in short
            and (diverged(h, max_cd) or not evaluated(h) or evaluated(h)[-1]["round"] < last_eval)
        ]
        kept = {s: h for s, h in by_seed.items() if s not in bad and s not in short}
        entry: dict[str, Any] = {"seeds": list(kept), "diverged_seeds": bad, "incomplete_seeds": short}
        if kept:
            runs = list(kept.values())
            entry["last_round"] = int(evaluated(runs[0])[-1]["round"])
            for key, _ in SUMMARY_KEYS:
                v = np.array([last_mean(h, key, last) for h in runs])
                entry[key] = {"mean": float(v.mean()), "std": float(v.std()), "per_seed": v.tolist()}
            half = entry["last_round"] / 2
            v = np.array(
                [np.mean([r["acc_worst"] for r in evaluated(h) if r["round"] > half]) for h in runs]
            )
            entry["acc_worst_second_half"] = {
                "mean": float(v.mean()), "std": float(v.std()), "per_seed": v.tolist()
            }
            firsts = {s: first_reaching(h, "acc_worst", threshold) for s, h in kept.items()}
            entry["first_worst_reach"] = firsts
            cur = curves(runs, ("acc_mean", "acc_worst", "acc_std"))
            entry["curves"] = cur
            entry["first_worst_reach_of_mean_curve"] = next(
                (rnd for rnd, w in zip(cur["round"], cur["acc_worst"]["mean"], strict=True)
                 if w >= threshold),
                None,
            )
            entry["rho"] = float(np.mean([h[0]["rho"] for h in runs]))
            entry["consensus_distance_last"] = float(
                np.mean([h[-1]["consensus_distance"] for h in runs])
            )
        out[label] = entry
    return out


def _pm(d: dict[str, float]) -> str:
    return f"{100 * d['mean']:.1f} ± {100 * d['std']:.1f}"


def print_tables(summary: dict[str, Any], *, threshold: float, last: int, every: int) -> None:
    """Markdown summary table and per-round table on stdout."""
    cols = " | ".join(title for _, title in SUMMARY_KEYS)
    print(
        f"| label | seeds | last round | {cols} | worst acc, t > T/2 | first round worst ≥ {threshold:.0%} "
        "(per seed; mean curve) | ρ | consensus dist |"
    )
    print("|---" * (len(SUMMARY_KEYS) + 7) + "|")
    for label, e in summary.items():
        div = f", {len(e['diverged_seeds'])} diverged" if e["diverged_seeds"] else ""
        if e["incomplete_seeds"]:
            div += f", {len(e['incomplete_seeds'])} incomplete"
        if not e["seeds"]:
            print(f"| {label} | 0{div} |" + " – |" * (len(SUMMARY_KEYS) + 5))
            continue
        vals = " | ".join(_pm(e[key]) for key, _ in SUMMARY_KEYS)
        per_seed = ", ".join("never" if f is None else str(f) for f in e["first_worst_reach"].values())
        mc = e["first_worst_reach_of_mean_curve"]
        print(
            f"| {label} | {len(e['seeds'])}{div} | {e['last_round']} | {vals} | "
            f"{_pm(e['acc_worst_second_half'])} | {per_seed}; "
            f"{'never' if mc is None else mc} | {e['rho']:.3f} | {e['consensus_distance_last']:.2e} |"
        )
    if last > 1:
        print(f"\n(each seed: mean of its last {last} evaluated rounds; then mean ± std over seeds)")
    labels = [lab for lab, e in summary.items() if e["seeds"]]
    if not labels:
        return
    print("\nPer round, mean ± std over seeds (%): average / worst-device accuracy")
    print("| round | " + " | ".join(f"{lab} avg | {lab} worst" for lab in labels) + " |")
    print("|---" * (2 * len(labels) + 1) + "|")
    rounds = sorted(set.intersection(*(set(summary[lab]["curves"]["round"]) for lab in labels)))
    for i, rnd in enumerate(rounds):
        if (i + 1) % every and rnd != rounds[-1]:
            continue
        cells = []
        for lab in labels:
            c = summary[lab]["curves"]
            j = c["round"].index(rnd)
            for key in ("acc_mean", "acc_worst"):
                cells.append(f"{100 * c[key]['mean'][j]:.1f} ± {100 * c[key]['std'][j]:.1f}")
        print(f"| {rnd} | " + " | ".join(cells) + " |")


def plot(summary: dict[str, Any], path: Path, *, threshold: float, title: str) -> None:
    """Average and worst-device accuracy per round (mean over seeds, ± std shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        ("acc_mean", "average device accuracy"),
        ("acc_worst", "worst-device accuracy"),
        ("acc_std", "std of device accuracy"),
    )
    for ax, (key, name) in zip(axes, panels, strict=True):
        for label, e in summary.items():
            if not e["seeds"]:
                continue
            c = e["curves"]
            x = np.array(c["round"])
            m, s = np.array(c[key]["mean"]), np.array(c[key]["std"])
            (line,) = ax.plot(x, m, label=f"{label} ({len(e['seeds'])} seeds)")
            ax.fill_between(x, m - s, m + s, color=line.get_color(), alpha=0.2)
        if key == "acc_worst":
            ax.axhline(threshold, color="grey", ls=":", lw=1)
        ax.set_xlabel("iteration")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Print the summary and per-round tables; optionally write the figure and the numbers."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("folder", type=Path)
    ap.add_argument("--threshold", type=float, default=0.7)
    ap.add_argument("--every", type=int, default=4, help="print every k-th evaluated round")
    ap.add_argument(
        "--last", type=int, default=1, help="average each seed over its last k evaluated rounds"
    )
    ap.add_argument(
        "--diverged-cd", type=float, default=1e6,
        help="a run whose consensus distance exceeds this counts as diverged (default 1e6)",
    )
    ap.add_argument("--labels", help="comma-separated labels to include (default: all)")
    ap.add_argument("--seeds", help="comma-separated seeds to include (default: all)")
    ap.add_argument("--plot", type=Path, help="write the per-round figure here (PNG)")
    ap.add_argument("--json", type=Path, help="write the numbers behind the tables here")
    args = ap.parse_args(argv)
    if args.every < 1 or args.last < 1:
        raise SystemExit("--every and --last must be >= 1")
    if not 0.0 < args.threshold <= 1.0:
        raise SystemExit(f"--threshold must be an accuracy in (0, 1], got {args.threshold}")
    if not args.folder.is_dir():
        raise SystemExit(f"folder: {args.folder} is not a directory")
    data = load(args.folder)
    if args.labels:
        wanted = args.labels.split(",")
        missing = [lab for lab in wanted if lab not in data]
        if missing:
            raise SystemExit(f"--labels: not found under {args.folder}: {', '.join(missing)}")
        data = {lab: data[lab] for lab in wanted}
    if args.seeds:
        keep = {int(x) for x in args.seeds.split(",")}
        data = {lab: {s: h for s, h in runs.items() if s in keep} for lab, runs in data.items()}
        data = {lab: runs for lab, runs in data.items() if runs}
    if not data:
        raise SystemExit(f"folder: no <label>/seed*/rounds.jsonl under {args.folder}")
    summary = summarise(data, threshold=args.threshold, last=args.last, max_cd=args.diverged_cd)
    print_tables(summary, threshold=args.threshold, last=args.last, every=args.every)
    if args.plot:
        plot(summary, args.plot, threshold=args.threshold, title=args.folder.name)
        print(f"\nfigure: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
        print(f"numbers: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
