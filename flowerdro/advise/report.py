"""The advisor's report: every trial on validation, each candidate's trials, the verdict, what to use.

``advice.md`` (the page), ``advice.png`` (the figure) and ``advice.json`` (everything, with
``flwr_run_config``: the line that runs the recommended setting, FedAvg's when FedAvg
stands). The verdict's rules are :mod:`flowerdro.advise.verdict`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flowerdro.advise.config import Budget, Candidate
from flowerdro.advise.verdict import Advice, flwr_run_config, setting_text
from flowerdro.runs.files import save_figure, write_text

__all__ = ["best_per_strategy", "coverage", "figure", "markdown", "pareto_front", "trial_rows", "write_report"]


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, both coordinates maximised, sorted by the first.

    Point j dominates i when ``p_j ≥ p_i`` in both coordinates and ``>`` in one. Duplicates
    of a front point are all on the front.
    """
    pts = [(float(a), float(b)) for a, b in points]
    front = [i for i, (a, b) in enumerate(pts)
             if not any(c >= a and d >= b and (c > a or d > b) for c, d in pts)]
    return sorted(front, key=lambda i: pts[i])


def trial_rows(study: Any, by_label: Mapping[str, Candidate]) -> list[dict[str, Any]]:
    """One dict per trial that ran: number, state, label, knob values, per-seed validation numbers, means."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if "strategy" not in t.params:
            continue
        label = t.params["strategy"]
        cand = by_label.get(label)
        knobs = {k.split(".", 1)[1]: v for k, v in t.params.items() if k.startswith(f"{label}.")}
        row: dict[str, Any] = {"number": t.number, "state": t.state.name, "label": label,
                               "algorithm": cand.algorithm if cand else label,
                               "knobs": {**(cand.fixed if cand else {}), **knobs}, "full": bool(t.user_attrs.get("full")),
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


def coverage(trials: Sequence[Mapping[str, Any]], candidates: Sequence[Candidate], settings: Mapping[str, Any],
             stopped_by: str) -> dict[str, str]:
    """One line per candidate: its trials by outcome, and why it has fewer than two complete ones (one without knobs).

    ``stopped_by`` is why the search stopped starting trials: ``"trials"`` or ``"budget"``.
    """
    needed = sum(2 if c.knobs else 1 for c in candidates)
    out = {}
    for cand in candidates:
        mine = [t for t in trials if t["label"] == cand.label]
        states = [t["state"] for t in mine]
        done = [t for t in mine if t["state"] == "COMPLETE"]
        parts = [f"{len(done)} complete"]
        if states.count("PRUNED"):
            parts.append(f"{states.count('PRUNED')} stopped early against its own strategy's trials")
        if states.count("FAIL"):
            parts.append(f"{states.count('FAIL')} failed")
        line = ", ".join(parts) + f" of {len(mine)} trials"
        want = 2 if cand.knobs else 1
        if not cand.knobs:
            line += " (no knob to search: one setting)"
        if len(done) < want:
            errors = [t["error"] for t in mine if t.get("error")]
            if errors:
                why = f"its runs failed: {errors[0]}"
            elif len(mine) >= want:
                why = "its trials were stopped early"
            elif stopped_by == "budget":
                why = f"the budget ({settings['budget']}, which keeps the verdict's share back) was spent first"
            else:
                why = (f"trials = {settings['trials']} ran out first (the candidates' guaranteed trials alone "
                       f"need {needed})")
            line += f"; fewer than {want} complete: {why}"
        elif done and not any(t.get("feasible", True) for t in done):
            line += f"; none feasible (validation mean more than max-mean-drop = {settings['max-mean-drop']} below " \
                    "FedAvg's)"
        out[cand.label] = line
    return out


def _knobs_text(knobs: Mapping[str, float]) -> str:
    return ", ".join(f"{k} = {v:.3g}" for k, v in knobs.items()) or "its defaults"


def _pm(vals: Sequence[float]) -> str:
    return f"{np.mean(vals):.4f} ± {np.std(vals):.4f}" if len(vals) > 1 else f"{vals[0]:.4f}"


def _verdict_title(advice: Advice, name: str) -> str:
    cand = advice.candidate or {}
    if name == "candidate":
        text = f"{cand.get('label')} ({_knobs_text(cand.get('knobs', {}))})"
        return f"best candidate, rejected: {text}" if advice.fedavg_stands else f"recommended: {text}"
    if name == "fedavg":
        return "recommended: fedavg (the verdict keeps FedAvg)" if advice.fedavg_stands else "fedavg"
    return f"{name} (reference)"


def markdown(advice: Advice, figure_name: str) -> str:
    """The report page."""
    s, t = advice.settings, advice.test
    states = [tr["state"] for tr in advice.trials]
    sp = advice.spent
    lines = [f"# Advice: {advice.name}", ""]
    if s.get("description"):
        lines += [s["description"], ""]
    lines += [
        f"**Verdict.** {advice.sentence}", "",
        f"**Use:** {setting_text(advice.recommended or {'label': 'fedavg'})} "
        f"(`advice.json`'s `flwr_run_config`).", "",
        "## Setting", "",
        f"{s['num-partitions']} clients, {s['num-rounds']} rounds per run; objective `{advice.objective}` "
        f"(mean over the last {s['last-rounds']} evaluated round(s)) on validation sets holding "
        f"{s['validation-fraction']:g} of each client's training data; search seeds {s['seeds']}, verdict seeds "
        f"{s['verdict-seeds']} (test sets); pruner {s['pruner']} per strategy (first rung after "
        f"{s['pruner-min-rounds']} rounds, η = {s['pruner-reduction']}; each candidate's first two trials run to "
        f"their end); max-mean-drop {s['max-mean-drop']}; budget {s['budget']}"
        + (" (reference, trials and verdict)." if s["budget"] != str(Budget()) else "."), "",
        f"Trials: {len(states)} ({states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, "
        f"{states.count('FAIL')} failed). Spent: {sp.get('client_rounds', 0):.0f} client-rounds and "
        f"{sp.get('seconds', 0) / 60:.1f} min on the reference and the search, "
        f"{sp.get('verdict_client_rounds', 0):.0f} client-rounds and {sp.get('verdict_seconds', 0) / 60:.1f} min on "
        "the verdict.", "",
        f"![trials on validation and the test verdict]({figure_name})", "",
        "## Trials per candidate", "",
        *(f"- **{label}**: {line}" for label, line in advice.coverage.items()), "",
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
    for label in advice.coverage:
        if label not in advice.best:
            lines.append(f"| {label} | – | no complete feasible trial (see Trials per candidate) | – | – | – |")
    lines += ["", f"## Test verdict (seeds {s['verdict-seeds']}, never used in the search)", "",
              "| setting | mean acc | worst-20% | worst-10% | worst | " + advice.objective + " per seed |",
              "|---|---|---|---|---|---|"]
    for name, runs in advice.verdict.items():
        lines.append(f"| {_verdict_title(advice, name)} | {_pm([r['acc_mean'] for r in runs])} | "
                     f"{_pm([r['acc_worst20'] for r in runs])} | {_pm([r['acc_worst10'] for r in runs])} | "
                     f"{_pm([r['acc_worst'] for r in runs])} | " + ", ".join(f"{r['objective']:.3f}" for r in runs)
                     + " |")
    lines += ["", f"Welch's t-test, candidate vs FedAvg on {advice.objective}: difference {t['diff']:+.4f}, "
              f"t = {t['t']:.3g}, p = {t['p']:.3g} (beyond seed noise when the difference is positive and "
              f"p < {t['significance']:g}); Cohen's d = {t['cohen_d']:.2f}; the candidate wins on {t['wins']} of "
              f"{t['paired']} seeds" + (" (borderline)" if t["borderline"] else "") + ". Cells are mean ± std "
              "(population std) over the seeds.", "",
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
    """Left: every complete trial's validation (mean, worst-20%) with the Pareto front, FedAvg and what to use
    (each strategy's legend entry counts its complete trials); right: the verdict's per-seed test objective of
    each setting with its mean ± std, the recommended one in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.4, 1]})
    done = [t for t in advice.trials if t["state"] == "COMPLETE" and "acc_worst20" in t]
    labels = list(advice.coverage) or sorted({t["label"] for t in advice.trials})
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}
    for lab in labels:
        pts = [t for t in done if t["label"] == lab]
        total = sum(t["label"] == lab for t in advice.trials)
        ax.scatter([t["acc_mean"] for t in pts], [t["acc_worst20"] for t in pts], color=colors[lab], s=28,
                   alpha=0.85, marker="o", label=f"{lab} ({len(pts)} of {total} trials complete)")
    pts = [(t["acc_mean"], t["acc_worst20"]) for t in done]
    front = pareto_front(pts)
    if front:
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "k--", lw=1, label="Pareto front")
    ref = advice.reference
    fedavg_xy = (np.mean([r["acc_mean"] for r in ref]), np.mean([r["acc_worst20"] for r in ref]))
    ax.scatter([fedavg_xy[0]], [fedavg_xy[1]], marker="*", s=220, color="black", label="FedAvg", zorder=5)
    cand = advice.candidate or {}
    top = next((t for t in done if t["number"] == cand.get("trial")), None)
    if top is not None:
        ax.scatter([top["acc_mean"]], [top["acc_worst20"]], s=260, facecolors="none",
                   edgecolors="gray" if advice.fedavg_stands else "red", lw=2,
                   linestyle="--" if advice.fedavg_stands else "-",
                   label="best candidate (rejected by the verdict)" if advice.fedavg_stands else "recommended",
                   zorder=6)
    if advice.fedavg_stands:
        ax.scatter([fedavg_xy[0]], [fedavg_xy[1]], s=420, facecolors="none", edgecolors="red", lw=2,
                   label="recommended: FedAvg", zorder=6)
    ax.set_xlabel("validation mean accuracy")
    ax.set_ylabel("validation worst-20% accuracy")
    ax.set_title(f"{advice.name}: {len(done)} complete trials (mean over search seeds)")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    names = list(advice.verdict)
    recommended = "fedavg" if advice.fedavg_stands else "candidate"
    for i, name in enumerate(names):
        vals = [r["objective"] for r in advice.verdict[name]]
        bx.scatter([i] * len(vals), vals, color="gray", s=18, zorder=3)
        bx.errorbar([i], [np.mean(vals)], yerr=[np.std(vals)], fmt="o", color="red" if name == recommended else
                    "black", capsize=6, ms=8, zorder=4)
    ticks = {"candidate": f"{cand.get('label')}\n" + ("(rejected)" if advice.fedavg_stands else "(recommended)"),
             "fedavg": "fedavg\n(recommended)" if advice.fedavg_stands else "fedavg"}
    bx.set_xticks(range(len(names)))
    bx.set_xticklabels([ticks.get(n, f"{n}\n(reference)") for n in names], fontsize=8)
    bx.set_ylabel(f"test {advice.objective} accuracy")
    p = advice.test.get("p", float("nan"))
    bx.set_title(f"verdict: {len(next(iter(advice.verdict.values())))} fresh seeds, test sets (p = {p:.2g}"
                 + (", borderline)" if advice.test.get("borderline") else ")"))
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
