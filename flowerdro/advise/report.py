"""The advisor's report: every trial on validation, the Pareto front, the test verdict, one sentence.

"Beyond seed noise" is decided by Welch's two-sided t-test (``scipy.stats.ttest_ind``
with ``equal_var=False``) on the per-seed objective of the recommended setting and of
FedAvg over the verdict seeds, at the level ``significance`` (default 0.05): the
recommendation is put forward only when its mean is higher and p < level.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flowerdro.runs.files import save_figure, write_text

if TYPE_CHECKING:
    from flowerdro.advise.search import Advice, Search

__all__ = ["best_per_strategy", "judge", "pareto_front", "trial_rows", "welch", "write_report"]

NO_BEAT = "no robust strategy beats FedAvg here beyond seed noise"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, both coordinates maximised, sorted by the first.

    Point j dominates i when ``p_j ≥ p_i`` in both coordinates and ``>`` in one. Duplicates
    of a front point are all on the front.
    """
    pts = [(float(a), float(b)) for a, b in points]
    front = [i for i, (a, b) in enumerate(pts)
             if not any(c >= a and d >= b and (c > a or d > b) for c, d in pts)]
    return sorted(front, key=lambda i: pts[i])


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Welch's t-test of mean(a) vs mean(b): ``{"diff", "t", "p"}`` (two-sided; p = 1 when both samples are constant and equal)."""
    from scipy import stats

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    diff = float(x.mean() - y.mean())
    if x.std() == 0 and y.std() == 0:
        return {"diff": diff, "t": 0.0 if diff == 0 else math.copysign(math.inf, diff), "p": 1.0 if diff == 0 else 0.0}
    res = stats.ttest_ind(x, y, equal_var=False)
    return {"diff": diff, "t": float(res.statistic), "p": float(res.pvalue)}


def trial_rows(study: Any, search: Search) -> list[dict[str, Any]]:
    """One dict per trial: number, state, label, knob values, per-seed validation numbers, means."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if "strategy" not in t.params:
            continue
        label = t.params["strategy"]
        cand = search.by_label.get(label)
        knobs = {k.split(".", 1)[1]: v for k, v in t.params.items() if k.startswith(f"{label}.")}
        row: dict[str, Any] = {"number": t.number, "state": t.state.name, "label": label,
                               "algorithm": cand.algorithm if cand else label, "knobs": {**(cand.fixed if cand else {}),
                                                                                        **knobs},
                               "seeds": t.user_attrs.get("seeds", []), "error": t.user_attrs.get("run_failed", "")}
        if t.state.name == "COMPLETE":
            row["objective"] = float(t.value)
            for key in ("acc_mean", "acc_worst20", "acc_worst10", "acc_worst"):
                vals = [s[key] for s in row["seeds"] if key in s]
                if vals:
                    row[key] = float(np.mean(vals))
            row["feasible"] = all(float(v) <= 0 for v in t.constraints.values())
        elif t.state.name == "PRUNED" and t.intermediate_values:
            row["last_estimate"] = float(t.intermediate_values[max(t.intermediate_values)])
            row["pruned_at"] = int(max(t.intermediate_values))
        rows.append(row)
    return rows


def best_per_strategy(trials: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The best complete feasible trial of each strategy label (by objective)."""
    best: dict[str, dict[str, Any]] = {}
    for t in trials:
        if t["state"] != "COMPLETE" or not t.get("feasible", True):
            continue
        if t["label"] not in best or t["objective"] > best[t["label"]]["objective"]:
            best[t["label"]] = dict(t)
    return best


def _knobs_text(knobs: Mapping[str, float]) -> str:
    return ", ".join(f"{k} = {v:.3g}" for k, v in knobs.items()) or "its defaults"


def judge(advice: Advice, significance: float, max_mean_drop: float | None) -> None:
    """Fill ``advice.test`` (Welch's test on the verdict seeds) and ``advice.sentence``."""
    rec, runs = advice.recommended, advice.verdict
    assert rec is not None
    key = "objective"
    mine, base = [r[key] for r in runs["recommended"]], [r[key] for r in runs["fedavg"]]
    test = welch(mine, base)
    mean_rec = float(np.mean([r["acc_mean"] for r in runs["recommended"]]))
    mean_avg = float(np.mean([r["acc_mean"] for r in runs["fedavg"]]))
    test.update({"objective_recommended": float(np.mean(mine)), "objective_fedavg": float(np.mean(base)),
                 "mean_recommended": mean_rec, "mean_fedavg": mean_avg, "significance": significance,
                 "n": float(len(mine))})
    ref_val = float(np.mean([r["objective"] for r in advice.reference]))
    test["validation_fedavg"] = ref_val
    advice.test = test
    what = {"worst20": "the worst 20% of clients", "worst10": "the worst 10% of clients",
            "worst": "the worst client", "mean": "the mean client"}[advice.objective]
    setting = f"{rec['label']} with {_knobs_text(rec['knobs'])}"
    where = f"on the clients' test sets over {len(mine)} fresh seeds"
    numbers = (f"{np.mean(mine):.3f} ± {np.std(mine):.3f} for {what} against FedAvg's {np.mean(base):.3f} ± "
               f"{np.std(base):.3f} {where} (Welch's t-test p = {test['p']:.2g})")
    if rec["validation"] <= ref_val:
        advice.sentence = (f"{NO_BEAT[0].upper() + NO_BEAT[1:]}: on validation no trial beat FedAvg's "
                           f"{ref_val:.3f}; the best, {setting}, gives {numbers}. Use FedAvg.")
    elif test["diff"] > 0 and test["p"] < significance:
        cost = mean_avg - mean_rec
        price = (f"it costs {cost * 100:.1f} points of mean accuracy ({mean_avg:.3f} → {mean_rec:.3f})" if cost > 0
                 else f"at no cost in mean accuracy ({mean_avg:.3f} → {mean_rec:.3f})")
        advice.sentence = (f"Use {setting}: {where} it lifts {what} from {np.mean(base):.3f} ± {np.std(base):.3f} "
                           f"(FedAvg) to {np.mean(mine):.3f} ± {np.std(mine):.3f}, {test['diff'] * 100:+.1f} points "
                           f"(Welch's t-test p = {test['p']:.2g}); {price}.")
    else:
        advice.sentence = f"{NO_BEAT[0].upper() + NO_BEAT[1:]}: the best on validation, {setting}, gives {numbers}."
    if max_mean_drop is not None and mean_avg - mean_rec > max_mean_drop:
        advice.sentence += (f" On test its mean accuracy is {(mean_avg - mean_rec) * 100:.1f} points below FedAvg's, "
                            f"more than max-mean-drop = {max_mean_drop:g} allowed on validation.")


def _pm(vals: Sequence[float]) -> str:
    return f"{np.mean(vals):.4f} ± {np.std(vals):.4f}" if len(vals) > 1 else f"{vals[0]:.4f}"


def markdown(advice: Advice, figure: str) -> str:
    """The report page."""
    s, rec, t = advice.settings, advice.recommended or {}, advice.test
    states = [tr["state"] for tr in advice.trials]
    lines = [f"# Advice: {advice.name}", ""]
    if s.get("description"):
        lines += [s["description"], ""]
    lines += [
        f"**Verdict.** {advice.sentence}", "",
        "## Setting", "",
        f"{s['num-partitions']} clients, {s['num-rounds']} rounds per run; objective `{advice.objective}` "
        f"(mean over the last {s['last-rounds']} evaluated round(s)) on validation sets holding "
        f"{s['validation-fraction']:g} of each client's training data; search seeds {s['seeds']}, verdict seeds "
        f"{s['verdict-seeds']} (test sets); pruner {s['pruner']} (first rung after {s['pruner-min-rounds']} rounds, "
        f"η = {s['pruner-reduction']}); max-mean-drop {s['max-mean-drop']}; budget {s['budget']}.", "",
        f"Trials: {len(states)} ({states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, "
        f"{states.count('FAIL')} failed); spent {advice.spent.get('client_rounds', 0):.0f} client-rounds and "
        f"{advice.spent.get('seconds', 0) / 60:.1f} min of training on the search.", "",
        f"![trials on validation and the test verdict]({figure})", "",
        "## Best setting per strategy (validation)", "",
        f"| strategy | knobs | {advice.objective} (mean ± std over seeds) | mean acc | worst-20% | trial |",
        "|---|---|---|---|---|---|",
    ]
    ref = advice.reference
    lines.append(f"| fedavg (reference) | – | {_pm([r['objective'] for r in ref])} | "
                 f"{_pm([r['acc_mean'] for r in ref])} | {_pm([r['acc_worst20'] for r in ref])} | – |")
    for label, b in sorted(advice.best.items(), key=lambda kv: -kv[1]["objective"]):
        lines.append(f"| {label} | {_knobs_text(b['knobs'])} | {_pm([x['objective'] for x in b['seeds']])} | "
                     f"{_pm([x['acc_mean'] for x in b['seeds']])} | {_pm([x['acc_worst20'] for x in b['seeds']])} | "
                     f"{b['number']} |")
    lines += ["", f"## Test verdict (seeds {s['verdict-seeds']}, never used in the search)", "",
              "| setting | mean acc | worst-20% | worst-10% | worst | " + advice.objective + " per seed |",
              "|---|---|---|---|---|---|"]
    for name, runs in advice.verdict.items():
        title = f"recommended: {rec.get('label')} ({_knobs_text(rec.get('knobs', {}))})" if name == "recommended" \
            else name
        lines.append(f"| {title} | {_pm([r['acc_mean'] for r in runs])} | {_pm([r['acc_worst20'] for r in runs])} | "
                     f"{_pm([r['acc_worst10'] for r in runs])} | {_pm([r['acc_worst'] for r in runs])} | "
                     + ", ".join(f"{r['objective']:.3f}" for r in runs) + " |")
    lines += ["", f"Welch's t-test, recommended vs FedAvg on {advice.objective}: difference {t['diff']:+.4f}, "
              f"t = {t['t']:.3g}, p = {t['p']:.3g} (beyond seed noise when the difference is positive and "
              f"p < {t['significance']:g}). Cells are mean ± std (population std) over the seeds.", "",
              "## Every trial (validation)", "",
              "| trial | strategy | knobs | state | objective | mean acc | worst-20% |", "|---|---|---|---|---|---|---|"]
    for tr in advice.trials:
        obj = f"{tr['objective']:.4f}" if "objective" in tr else (
            f"({tr['last_estimate']:.4f} at {tr['pruned_at']} rounds)" if "last_estimate" in tr else "–")
        feas = "" if tr.get("feasible", True) else " (infeasible)"
        lines.append(f"| {tr['number']} | {tr['label']} | {_knobs_text(tr['knobs'])} | {tr['state'].lower()}{feas} | "
                     f"{obj} | {_num(tr.get('acc_mean'))} | {_num(tr.get('acc_worst20'))} |")
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def figure(advice: Advice, path: Path) -> None:
    """Left: every complete trial's validation (mean, worst-20%) with the Pareto front and FedAvg;
    right: the verdict's per-seed test objective of each setting with its mean ± std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.4, 1]})
    done = [t for t in advice.trials if t["state"] == "COMPLETE" and "acc_worst20" in t]
    labels = sorted({t["label"] for t in done})
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}
    for lab in labels:
        pts = [t for t in done if t["label"] == lab]
        ax.scatter([t["acc_mean"] for t in pts], [t["acc_worst20"] for t in pts], color=colors[lab], label=lab,
                   s=28, alpha=0.85, marker="o")
    pts = [(t["acc_mean"], t["acc_worst20"]) for t in done]
    front = pareto_front(pts)
    if front:
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "k--", lw=1, label="Pareto front")
    ref = advice.reference
    ax.scatter([np.mean([r["acc_mean"] for r in ref])], [np.mean([r["acc_worst20"] for r in ref])], marker="*",
               s=220, color="black", label="FedAvg", zorder=5)
    rec = advice.recommended
    if rec is not None:
        top = next((t for t in done if t["number"] == rec["trial"]), None)
        if top is not None:
            ax.scatter([top["acc_mean"]], [top["acc_worst20"]], s=260, facecolors="none", edgecolors="red", lw=2,
                       label="recommended", zorder=6)
    ax.set_xlabel("validation mean accuracy")
    ax.set_ylabel("validation worst-20% accuracy")
    ax.set_title(f"{advice.name}: {len(done)} complete trials (mean over search seeds)")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    names = list(advice.verdict)
    for i, name in enumerate(names):
        vals = [r["objective"] for r in advice.verdict[name]]
        bx.scatter([i] * len(vals), vals, color="gray", s=18, zorder=3)
        bx.errorbar([i], [np.mean(vals)], yerr=[np.std(vals)], fmt="o", color="red" if name == "recommended" else
                    "black", capsize=6, ms=8, zorder=4)
    bx.set_xticks(range(len(names)))
    bx.set_xticklabels([f"{rec['label']}\n(recommended)" if n == "recommended" and rec else
                        n if n == "fedavg" else f"{n}\n(reference)" for n in names], fontsize=8)
    bx.set_ylabel(f"test {advice.objective} accuracy")
    bx.set_title(f"verdict: {len(next(iter(advice.verdict.values())))} fresh seeds, test sets "
                 f"(p = {advice.test.get('p', float('nan')):.2g})")
    bx.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_figure(fig, path, dpi=110)  # by atomic rename: never through a link planted at path
    finally:
        plt.close(fig)


def write_report(advice: Advice, out_dir: Path, figure_path: Path | None = None) -> None:
    """Write ``advice.md``, ``advice.png`` and ``advice.json`` into ``out_dir`` (and the figure to ``figure_path``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figure(advice, out_dir / "advice.png")
    if figure_path is not None:
        figure(advice, figure_path)
    write_text(out_dir / "advice.md", markdown(advice, "advice.png"), "the advice")
    payload = {k: v for k, v in vars(advice).items() if k != "output_dir"}
    payload["flwr_run_config"] = flwr_run_config(advice)
    write_text(out_dir / "advice.json", json.dumps(payload, indent=2, default=str), "the advice")


def flwr_run_config(advice: Advice) -> str:
    """The recommended setting as a ``flwr run --run-config`` string (test split, first verdict seed).

    The federation's run config, the setting's own keys, ``num-rounds``, the seed and
    ``eval-split``; ``num-partitions`` is left to the SuperNodes' node config.
    """
    rec = advice.recommended or {}
    base = {k: v for k, v in advice.settings["run-config"].items() if k != "num-partitions"}
    items = {"strategies": rec.get("algorithm", ""), **base, **rec.get("run_config", {}),
             "num-rounds": advice.settings["num-rounds"], "seed": advice.settings["verdict-seeds"][0],
             "eval-split": "test"}
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}".replace('"', "'") for k, v in items.items())
