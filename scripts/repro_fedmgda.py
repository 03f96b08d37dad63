"""Reproduce FedMGDA+ experiments (Hu, Shaloudegi, Zhang, Yu, IEEE TNSE 2022, arXiv:2006.11489, §6).

Sub-commands (run from the repository root; on a shared CPU set ``OMP_NUM_THREADS=1``)::

    python scripts/repro_fedmgda.py adult  [--biases 0,0.01,0.1,1] [--strategies afl,fedmgda+] [--rounds 500]
    python scripts/repro_fedmgda.py fmnist [--rounds 100] [--strategies fedmgda+,fedavg]
    python scripts/repro_fedmgda.py report          # tables + docs/figures/fedmgda_*.png from results/

``adult`` runs ``conf/fedmgda_adult_bias.toml`` once per bias on the PhD client (partition
0) and writes ``results/fedmgda_adult_bias/bias<b>/``; ``fmnist`` runs
``conf/fedmgda_fmnist.toml`` (20 rounds). ``report`` prints the tables (uniform = accuracy
on the union of the two domains' test rows, i.e. the test-size weighted mean; PhD;
non-PhD) and draws the figures, and does the same for the longer Fashion-MNIST runs, each
made by ``OMP_NUM_THREADS=1 python -m flowerdro.experiments conf/<name>.toml``:

* ``fedmgda_fmnist_long``: the method comparison (paper Fig. 3), and the same with seed 1
  (``fedmgda_fmnist_long_seed1``); ``fedmgda_fmnist_80`` and ``fedmgda_fmnist_200``:
  FedMGDA+ and FedAvg for 80 and 200 rounds;
* ``fedmgda_fmnist_eps``: ε ∈ {0.05, 0.5, 1} (Fig. 1; ε = 0 and 0.1 are the long run's
  ``fedavg-n`` and ``fedmgda+``);
* ``fedmgda_fmnist_improvement_fullbatch``: fraction of improved participants with
  full-batch local steps (Fig. 4; the b = 10 curves come from the two runs above);
* ``fedmgda_fmnist_scaling``: FedAvg and FedMGDA+ honest, and with one client scaling its
  loss (``attack = "loss-scale"``, the paper's §6.2.2 attack) or its update
  (``attack = "update-scale"``) by ``attack-scale``, evaluated every round.

Departures from the paper, to keep the runs to CPU hours (stated again in the tables):
Adult uses one local step of batch 10 per round for every method (AFL's own τ = 1; the
paper's q-FedAvg / FedMGDA+ run local epochs), and Fashion-MNIST runs far fewer rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ADULT_CONF = REPO / "conf" / "fedmgda_adult_bias.toml"
FMNIST_CONF = REPO / "conf" / "fedmgda_fmnist.toml"
RESULTS = REPO / "results"
FIGURES = REPO / "docs" / "figures"



def _save(fig: Any, name: str) -> None:
    """Write ``fig`` to docs/figures/``name`` (PNG, 120 dpi), close it and say where it went."""
    import matplotlib.pyplot as plt

    fig.savefig(FIGURES / name, dpi=120)
    plt.close(fig)
    print(f"figure: {FIGURES / name}")

def _cheap_gc() -> None:
    """Make ``gc.collect()`` a generation-0 collection in this process.

    Flower's ``ArrayRecord.to_numpy_ndarrays(keep_input=False)`` (used by its QFedAvg
    aggregation) calls ``gc.collect()`` several times per round; a full collection over a
    heap holding pandas, torch and the data can cost seconds per round, more than the
    round's training. Results do not depend on it; reference counting still frees the
    arrays immediately.
    """
    import gc

    full = gc.collect
    gc.collect = lambda generation=0: full(0)  # type: ignore[assignment]


def _bias_tag(b: float) -> str:
    return f"bias{b:g}"


def run_adult(biases: list[float], strategies: list[str] | None, rounds: int | None) -> None:
    from flowerdro.experiments.runner import load_config, run

    for b in biases:
        cfg = load_config(ADULT_CONF)
        cfg["name"] = f"{cfg['name']}/{_bias_tag(b)}"
        cfg["run-config"]["attack-bias"] = float(b)
        if strategies:
            cfg["strategies"] = strategies
        if rounds:
            cfg["num-rounds"] = rounds
        t0 = time.time()
        run(cfg, output_root=RESULTS, verbose=False)
        print(f"adult bias {b:g}: {', '.join(cfg['strategies'])} done in {time.time() - t0:.0f} s", flush=True)


def run_fmnist(strategies: list[str] | None, rounds: int | None) -> None:
    from flowerdro.experiments.runner import load_config, run

    cfg = load_config(FMNIST_CONF)
    if strategies:
        cfg["strategies"] = strategies
        cfg["name"] = f"{cfg['name']}/{'_'.join(strategies)}"
    if rounds:
        cfg["num-rounds"] = rounds
    run(cfg, output_root=RESULTS, verbose=True)


def _last_eval(path: Path) -> dict | None:
    rec = None
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "client_acc" in r:
            rec = r
    return rec


def report() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    root = RESULTS / "fedmgda_adult_bias"
    table: dict[str, dict[float, tuple[float, float, float]]] = {}
    if root.is_dir():
        for bdir in sorted(root.glob("bias*")):
            b = float(bdir.name[4:])
            for f in sorted(bdir.glob("*/seed0/rounds.jsonl")):
                rec = _last_eval(f)
                if rec is None:
                    continue
                table.setdefault(f.parent.parent.name, {})[b] = (
                    100 * rec["acc_weighted"], 100 * rec["client_acc"]["0"], 100 * rec["client_acc"]["1"])
    if table:
        biases = sorted({b for v in table.values() for b in v})
        print("Adult, bias attack on the PhD client: test accuracy % (uniform / PhD / non-PhD)")
        print("| method | " + " | ".join(f"bias {b:g}" for b in biases) + " |")
        print("|---|" + "---|" * len(biases))
        for name in sorted(table):
            cells = ["{:.2f} / {:.2f} / {:.2f}".format(*table[name][b]) if b in table[name] else "-"
                     for b in biases]
            print(f"| {name} | " + " | ".join(cells) + " |")
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for k, title in enumerate(("uniform (all test rows)", "PhD (attacker's domain)", "non-PhD")):
            for name in sorted(table):
                bs = sorted(table[name])
                axes[k].plot([max(b, 1e-3) for b in bs], [table[name][b][k] for b in bs], "o-", label=name)
            axes[k].set_xscale("log")
            axes[k].set_xlabel("bias on the PhD client's losses (0 drawn at 1e-3)")
            axes[k].set_title(title)
        axes[0].set_ylabel("test accuracy %")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(FIGURES / "fedmgda_adult_bias.png", dpi=120)
        print(f"figure: {FIGURES / 'fedmgda_adult_bias.png'}")
    froot = RESULTS / "fedmgda_fmnist"
    if froot.is_dir():
        rows = {}
        curves = {}
        for f in sorted(froot.glob("**/seed*/rounds.jsonl")):
            label = f.parent.parent.name
            recs = [json.loads(x) for x in f.read_text().splitlines()]
            ev = [r for r in recs if "client_acc" in r]
            if not ev:
                continue
            rows.setdefault(label, []).append((100 * ev[-1]["acc_mean"], 100 * ev[-1]["acc_std"],
                                               100 * ev[-1]["acc_worst"], ev[-1]["round"],
                                               100 * ev[-1]["acc_worst20"]))
            curves.setdefault(label, []).append(([r["round"] for r in ev], [100 * r["acc_mean"] for r in ev],
                                                 [100 * r["acc_std"] for r in ev]))
        print("\nFashion-MNIST, 100 clients x 5 shards: client test accuracy % (last evaluated round)")
        print("| method | mean | std | worst | worst-20% | round | seeds |")
        print("|---|---|---|---|---|---|---|")
        for label, vals in sorted(rows.items()):
            import numpy as np

            v = np.asarray(vals)
            print(f"| {label} | {v[:, 0].mean():.2f} | {v[:, 1].mean():.2f} | {v[:, 2].mean():.2f} | "
                  f"{v[:, 4].mean():.2f} | {int(v[0, 3])} | {len(vals)} |")
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for label, cs in sorted(curves.items()):
            rs, mean, std = cs[0]
            axes[0].plot(rs, mean, label=label)
            axes[1].plot(rs, std, label=label)
        axes[0].set_title("mean client test accuracy %")
        axes[1].set_title("std of client test accuracy %")
        for ax in axes:
            ax.set_xlabel("round")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(FIGURES / "fedmgda_fmnist.png", dpi=120)
        print(f"figure: {FIGURES / 'fedmgda_fmnist.png'}")


def improvement_report() -> None:
    """Fraction of improved participants per round (``results/fedmgda_fmnist_improvement``)."""
    import numpy as np

    root = RESULTS / "fedmgda_fmnist_improvement"
    if not root.is_dir():
        return
    print("\nFashion-MNIST, fraction of participants with f_i(w_{t+1}) <= f_i(w_t)")
    print("| method | mean over rounds | min | rounds at 100% |")
    print("|---|---|---|---|")
    for f in sorted(root.glob("*/seed0/rounds.jsonl")):
        fr = [json.loads(x).get("improved_fraction") for x in f.read_text().splitlines()]
        fr = [x for x in fr if x is not None]
        if fr:
            print(f"| {f.parent.parent.name} | {np.mean(fr):.3f} | {min(fr):.2f} | {sum(x == 1.0 for x in fr)}/{len(fr)} |")


# --------------------------------------------------------------------------- longer Fashion-MNIST runs
LONG = "fedmgda_fmnist_long"
LONG_SEED1 = "fedmgda_fmnist_long_seed1"
LONG80 = "fedmgda_fmnist_80"
LONG200 = "fedmgda_fmnist_200"
EPS = "fedmgda_fmnist_eps"
FULLBATCH = "fedmgda_fmnist_improvement_fullbatch"
# FedAvg's improvement curves (``fedavg-mgda``: FedAvg through the family's server step)
FEDAVG_B10 = "fedmgda_fmnist_improvement_fedavg"
FEDAVG_FULLBATCH = "fedmgda_fmnist_improvement_fullbatch_fedavg"
SCALING = "fedmgda_fmnist_scaling"
# ε of each run in the Fig. 1 sweep: (experiment, label) -> ε
EPS_RUNS: dict[float, tuple[str, str]] = {
    0.0: (LONG, "fedavg-n"), 0.05: (EPS, "fedmgda+-eps0.05"), 0.1: (LONG, "fedmgda+"),
    0.5: (EPS, "fedmgda+-eps0.5"), 1.0: (EPS, "fedmgda+-eps1"),
}


def _runs(name: str, seed: int = 0, results: Path = RESULTS) -> dict[str, list[dict]]:
    """Round records of ``<results>/<name>/<label>/seed<seed>/rounds.jsonl`` for every label."""
    out: dict[str, list[dict]] = {}
    root = results / name
    if root.is_dir():
        for f in sorted(root.glob(f"*/seed{seed}/rounds.jsonl")):
            out[f.parent.parent.name] = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return out


def _evals(recs: list[dict]) -> dict[int, dict]:
    """Evaluated rounds of one run: round -> record with the client-accuracy summary."""
    return {int(r["round"]): r for r in recs if "acc_mean" in r}


def _fractions(recs: list[dict], upto: int | None = None) -> list[float]:
    """``improved_fraction`` of rounds 1..upto (all rounds when ``upto`` is None)."""
    return [float(r["improved_fraction"]) for r in recs
            if r.get("improved_fraction") is not None and (upto is None or int(r["round"]) <= upto)]


def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def fmnist_long_report() -> None:
    """Paper Fig. 3: mean / std / worst / worst-20% client test accuracy per method and round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs(LONG)
    if not runs:
        return
    print(f"\nFashion-MNIST 100 x 5 shards ({LONG}): client test accuracy % at the last evaluated round")
    print("| method | round | mean | std | worst | worst-20% | mean / std at each evaluated round |")
    print("|---|---|---|---|---|---|---|")
    for label, recs in runs.items():
        ev = _evals(recs)
        if not ev:
            continue
        last = ev[max(ev)]
        path = ", ".join(f"{_pct(ev[t]['acc_mean'])} / {_pct(ev[t]['acc_std'])}" for t in sorted(ev))
        print(f"| {label} | {max(ev)} | {_pct(last['acc_mean'])} | {_pct(last['acc_std'])} | "
              f"{_pct(last['acc_worst'])} | {_pct(last['acc_worst20'])} | {path} |")
    seed1 = _runs(LONG_SEED1, seed=1)
    both = [label for label in runs if label in seed1 and _evals(seed1[label])]
    if both:
        t = min(max(_evals(seed1[label])) for label in both)
        print(f"\nSeeds 0 and 1 ({LONG} / {LONG_SEED1}) at round {t}: mean / std client test accuracy %")
        print("| method | seed 0 | seed 1 | mean of the 2 seeds |")
        print("|---|---|---|---|")
        for label in both:
            a, b = _evals(runs[label]).get(t), _evals(seed1[label]).get(t)
            if a is None or b is None:
                continue
            print(f"| {label} | {_pct(a['acc_mean'])} / {_pct(a['acc_std'])} | {_pct(b['acc_mean'])} / "
                  f"{_pct(b['acc_std'])} | {_pct((a['acc_mean'] + b['acc_mean']) / 2)} / "
                  f"{_pct((a['acc_std'] + b['acc_std']) / 2)} |")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, (label, recs) in enumerate(runs.items()):
        ev = _evals(recs)
        ts = sorted(ev)
        axes[0].plot(ts, [100 * ev[t]["acc_mean"] for t in ts], "o-", ms=3, color=f"C{k}", label=f"{label} (seed 0)")
        axes[1].plot(ts, [100 * ev[t]["acc_std"] for t in ts], "o-", ms=3, color=f"C{k}", label=f"{label} (seed 0)")
        ev1 = _evals(seed1.get(label, []))
        if ev1:
            ts1 = sorted(ev1)
            axes[0].plot(ts1, [100 * ev1[t]["acc_mean"] for t in ts1], "x:", ms=4, color=f"C{k}")
            axes[1].plot(ts1, [100 * ev1[t]["acc_std"] for t in ts1], "x:", ms=4, color=f"C{k}")
    axes[0].set_title("mean client test accuracy %")
    axes[1].set_title("std of client test accuracy %")
    for ax in axes:
        ax.set_xlabel("round")
    axes[0].legend(fontsize=7)
    fig.suptitle("Fashion-MNIST, 100 clients x 5 label-sorted shards, p = 0.1, b = 10, k = 1 "
                 "(solid: seed 0; dotted x: seed 1 where run)", fontsize=9)
    fig.tight_layout()
    _save(fig, "fedmgda_fmnist_long.png")


def fmnist_80_report(name: str = LONG80, seed: int = 0) -> None:
    """FedMGDA+ and FedAvg for 80 (or 200) rounds: mean / std client test accuracy at every evaluated round."""
    runs = {label: recs for label, recs in _runs(name, seed).items() if _evals(recs)}
    if not runs:
        return
    rounds = sorted(set.union(*(set(_evals(r)) for r in runs.values())))
    print(f"\n{name}, seed {seed}: mean / std client test accuracy % (worst-20% at the last round)")
    print("| method | " + " | ".join(f"round {t}" for t in rounds) + " | worst-20% |")
    print("|---|" + "---|" * (len(rounds) + 1))
    for label, recs in runs.items():
        ev = _evals(recs)
        cells = " | ".join(f"{_pct(ev[t]['acc_mean'])} / {_pct(ev[t]['acc_std'])}" if t in ev else "–" for t in rounds)
        print(f"| {label} | {cells} | {_pct(ev[max(ev)]['acc_worst20'])} @{max(ev)} |")


def eps_report() -> None:
    """Paper Fig. 1: FedMGDA+ from ε = 0 (FedAvg-n) to ε = 1 (normalised MGDA) at equal rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cache = {name: _runs(name) for name in {LONG, EPS}}
    rows = {eps: cache[name].get(label) for eps, (name, label) in EPS_RUNS.items()}
    rows = {eps: recs for eps, recs in rows.items() if recs}
    if len(rows) < 2:
        return
    common = sorted(set.intersection(*(set(_evals(r)) for r in rows.values())))
    if not common:
        return
    horizon = common[-1]
    print(f"\nFedMGDA+ epsilon sweep (rounds evaluated by every run; ε = 0 / 0.1 from {LONG}): "
          "client test accuracy % mean / std; improved fraction and mean max λ over rounds 1.."
          f"{horizon}")
    print("| ε | run | " + " | ".join(f"round {t}" for t in common)
          + " | worst-20% @" + str(horizon) + " | improved (mean) | max λ (mean) |")
    print("|---|---|" + "---|" * (len(common) + 3))
    for eps, recs in sorted(rows.items()):
        ev = _evals(recs)
        name, label = EPS_RUNS[eps]
        fr = _fractions(recs, horizon)
        lmax = [max(r["lambda"].values()) for r in recs if r.get("lambda") and int(r["round"]) <= horizon]
        cells = " | ".join(f"{_pct(ev[t]['acc_mean'])} / {_pct(ev[t]['acc_std'])}" for t in common)
        print(f"| {eps:g} | {name}/{label} | {cells} | {_pct(ev[horizon]['acc_worst20'])} | "
              f"{(sum(fr) / len(fr)) if fr else float('nan'):.3f} | {(sum(lmax) / len(lmax)) if lmax else float('nan'):.3f} |")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for eps, recs in sorted(rows.items()):
        ev = _evals(recs)
        ts = [t for t in sorted(ev) if t <= horizon]
        axes[0].plot(ts, [100 * ev[t]["acc_mean"] for t in ts], "o-", ms=3, label=f"ε = {eps:g}")
        axes[1].plot(ts, [100 * ev[t]["acc_std"] for t in ts], "o-", ms=3, label=f"ε = {eps:g}")
    axes[0].set_title("mean client test accuracy %")
    axes[1].set_title("std of client test accuracy %")
    for ax in axes:
        ax.set_xlabel("round")
    axes[0].legend(fontsize=7)
    fig.suptitle("FedMGDA+ ε sweep, Fashion-MNIST 100 x 5 shards, η₀ = 0.3 (ε = 0: FedAvg-n, ε = 1: normalised MGDA)",
                 fontsize=9)
    fig.tight_layout()
    _save(fig, "fedmgda_fmnist_eps.png")


def improvement_curves_report() -> None:
    """Paper Fig. 4: fraction of participants with f_i(w_{t+1}) ≤ f_i(w_t), b = 10 and full batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {
        "b = 10": {f"{name}/{label}": recs for name in (LONG, EPS, FEDAVG_B10) for label, recs in _runs(name).items()
                   if _fractions(recs)},
        "full batch": {f"{name}/{label}": recs for name in (FULLBATCH, FEDAVG_FULLBATCH)
                       for label, recs in _runs(name).items() if _fractions(recs)},
    }
    if not any(panels.values()):
        return
    short = min((len(_fractions(r)) for p in panels.values() for r in p.values()), default=0)
    print("\nFraction of participants whose full local training loss did not increase over the round")
    print(f"| local batch | run | rounds | mean | min | rounds at 100% | mean over rounds 1..{short} |")
    print("|---|---|---|---|---|---|---|")
    for panel, runs in panels.items():
        for key, recs in runs.items():
            fr = _fractions(recs)
            head = _fractions(recs, short)
            print(f"| {panel} | {key} | {len(fr)} | {sum(fr) / len(fr):.3f} | {min(fr):.1f} | "
                  f"{sum(x == 1.0 for x in fr)}/{len(fr)} | {sum(head) / len(head):.3f} |")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, (panel, runs) in zip(axes, panels.items(), strict=True):
        for key, recs in runs.items():
            rs = [int(r["round"]) for r in recs if r.get("improved_fraction") is not None]
            ax.plot(rs, [100 * x for x in _fractions(recs)], ".-", lw=0.8, label=key.split("/", 1)[1])
        ax.set_title(f"local batch: {panel}")
        ax.set_xlabel("round")
        if runs:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("% participants improved")
    fig.tight_layout()
    _save(fig, "fedmgda_fmnist_improvement.png")


def scaling_report(name: str = SCALING, path: Path | None = None, results: Path = RESULTS) -> bool:
    """Scaling attacks of ``conf/<name>.toml``: each method honest, under loss and under update scaling.

    Labels ``<method>`` run honestly and ``<method>-<attack>`` with the attacker of their
    table. Prints, per label, the mean client accuracy in the rounds the attacker took part
    (evaluated after that round's step), the lowest mean accuracy from the attacker's first
    round on, and the last round's; draws ``path`` (default docs/figures/<name>.png), one
    panel per attack. False when the experiment has no runs.
    """
    import tomllib

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conf = REPO / "conf" / f"{name}.toml"
    runs = _runs(name, results=results)
    if not runs or not conf.is_file():
        return False
    cfg = tomllib.loads(conf.read_text())
    tables = cfg.get("strategy", {})
    attacks = ("loss-scale", "update-scale")
    methods = [m for m in runs if not m.endswith(attacks)]
    attacked = {m: {a: runs[f"{m}-{a}"] for a in attacks if f"{m}-{a}" in runs} for m in methods}
    bad = next(str(tab["malicious-ids"]).split(",")[0].strip() for tab in tables.values() if "malicious-ids" in tab)
    scale = cfg["run-config"].get("attack-scale")
    # the attacker's rounds: FedMGDA+ logs the participants as the keys of λ; every label samples alike
    lam_runs = [recs for label, recs in runs.items() if any("lambda" in r for r in recs)]
    part = [int(r["round"]) for r in (lam_runs[0] if lam_runs else []) if bad in (r.get("lambda") or {})]
    print(f"\nScaling attacks: partition {bad} scales its loss or its update by {scale}; it was sampled in "
          f"rounds {part}. Mean client test accuracy %")
    print("| method | attack | mean over the attacker's rounds | lowest from round "
          f"{part[0] if part else '-'} | last round |")
    print("|---|---|---|---|---|")
    for m in methods:
        for attack, recs in [("none", runs[m]), *attacked[m].items()]:
            ev = _evals(recs)
            at = [ev[t]["acc_mean"] for t in part if t in ev]
            after = [ev[t]["acc_mean"] for t in ev if part and t >= part[0]]
            print(f"| {m} | {attack} | {_pct(sum(at) / len(at)) if at else '-'} | "
                  f"{_pct(min(after)) if after else '-'} | {_pct(ev[max(ev)]['acc_mean'])} |")
    fig, axes = plt.subplots(1, len(attacks), figsize=(9, 3.6), sharey=True)
    for ax, attack in zip(axes, attacks, strict=True):
        for k, m in enumerate(methods):
            for recs, style, what in ((runs[m], "-", "honest"), (attacked[m].get(attack), "--", "attacked")):
                if recs is None:
                    continue
                ev = _evals(recs)
                ts = sorted(ev)
                ax.plot(ts, [100 * ev[t]["acc_mean"] for t in ts], style, color=f"C{k}", lw=1.3,
                        label=f"{m}, {what}")
        for t in part:
            ax.axvline(t, color="grey", lw=0.6, alpha=0.6)
        what = "its loss" if attack == "loss-scale" else "its update"
        ax.set_title(f"client {bad} scales {what} by {scale:g}", fontsize=9)
        ax.set_xlabel(f"round (grey: client {bad} sampled)")
    axes[0].set_ylabel("mean client test accuracy %")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    if path is None:
        _save(fig, f"{name}.png")
    else:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("adult", "fmnist", "report"))
    parser.add_argument("--biases", default="0,0.01,0.1,1")
    parser.add_argument("--strategies", default="")
    parser.add_argument("--rounds", type=int, default=0)
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s] or None
    _cheap_gc()
    if args.what == "adult":
        run_adult([float(b) for b in args.biases.split(",")], strategies, args.rounds or None)
    elif args.what == "fmnist":
        run_fmnist(strategies, args.rounds or None)
    else:
        report()
        improvement_report()
        fmnist_long_report()
        fmnist_80_report()
        for seed in (0, 1):
            fmnist_80_report(LONG200, seed)
        eps_report()
        improvement_curves_report()
        scaling_report(SCALING)


if __name__ == "__main__":
    main()
