"""The advisor's verdict: the best candidate against FedAvg on the test sets, and what to use.

The candidate (the best feasible trial's setting on validation) and FedAvg run over the same
fresh seeds (same data, same initial model per seed). "Beyond seed noise" is decided by
Welch's two-sided t-test (``scipy.stats.ttest_ind`` with ``equal_var=False``) on the
per-seed objective at the level α = ``significance`` (0.05 by default):

* the candidate is **recommended** only when it beat FedAvg on validation, its test mean is
  higher and p < α; otherwise **FedAvg stands** and is what :attr:`Advice.recommended`,
  ``flwr_run_config``, the report's "recommended:" row and the figure name;
* the verdict is **borderline** when α ≤ p < 2α (0.05 ≤ p < 0.1 by default), or when the
  per-seed differences change sign (the candidate wins on some seeds and loses on others):
  the sentence then gives the effect size (the difference in points and Cohen's d with the
  two samples' mean variance, d = Δ / √((s_c² + s_f²)/2), s with ddof 1) and the seeds it
  wins, so that a verdict that a few more seeds could turn is not read as settled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FEDAVG", "NO_BEAT", "Advice", "effect", "flwr_run_config", "judge", "welch"]

NO_BEAT = "no robust strategy beats FedAvg here beyond seed noise"
#: What :attr:`Advice.recommended` holds when FedAvg stands.
FEDAVG: dict[str, Any] = {"label": "fedavg", "algorithm": "fedavg", "knobs": {}, "run_config": {}}


@dataclass
class Advice:
    """What a search found: every trial, the best setting per strategy, the verdict.

    ``trials`` holds one dict per trial (number, state, label, knobs, per-seed validation
    numbers, objective); ``reference`` FedAvg's validation numbers per search seed;
    ``candidate`` the best feasible trial's setting, which the verdict tests;
    ``recommended`` what to use: the candidate when the verdict accepts it, else
    :data:`FEDAVG`; ``verdict`` per setting (``candidate``, ``fedavg``, each reference
    label) its test numbers per verdict seed; ``test`` the Welch test, effect size and
    per-seed wins; ``coverage`` one line per candidate strategy (its complete trials, or
    why it has fewer than two); ``spent`` the client-rounds and seconds of the reference
    and the search, and of the verdict.
    """

    name: str
    objective: str
    settings: dict[str, Any]
    reference: list[dict[str, float]]
    trials: list[dict[str, Any]]
    best: dict[str, dict[str, Any]]
    candidate: dict[str, Any] | None
    recommended: dict[str, Any] | None = None
    verdict: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    test: dict[str, Any] = field(default_factory=dict)
    sentence: str = ""
    coverage: dict[str, str] = field(default_factory=dict)
    spent: dict[str, float] = field(default_factory=dict)
    output_dir: Path | None = None

    @property
    def fedavg_stands(self) -> bool:
        """Whether the verdict keeps FedAvg (the candidate is rejected)."""
        return self.recommended is not None and self.recommended["label"] == FEDAVG["label"]


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Welch's t-test of mean(a) vs mean(b): ``{"diff", "t", "p"}`` (two-sided; p = 1 when both samples are constant and equal)."""
    from scipy import stats

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    diff = float(x.mean() - y.mean())
    if x.std() == 0 and y.std() == 0:
        return {"diff": diff, "t": 0.0 if diff == 0 else math.copysign(math.inf, diff), "p": 1.0 if diff == 0 else 0.0}
    res = stats.ttest_ind(x, y, equal_var=False)
    return {"diff": diff, "t": float(res.statistic), "p": float(res.pvalue)}


def effect(candidate: Sequence[Mapping[str, float]], fedavg: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Effect size and per-seed wins of the candidate over FedAvg on ``objective``.

    ``cohen_d`` = Δ / √((s_c² + s_f²)/2) with sample variances (ddof 1; ±inf when both are 0
    and Δ ≠ 0, 0 when Δ = 0); ``wins`` / ``losses`` count the seeds (paired by seed) where
    the candidate's objective is above / below FedAvg's; ``per_seed`` lists
    ``[seed, candidate, fedavg]``.
    """
    by_seed = {int(r["seed"]): float(r["objective"]) for r in fedavg}
    pairs = [(int(r["seed"]), float(r["objective"]), by_seed[int(r["seed"])]) for r in candidate
             if int(r["seed"]) in by_seed]
    c = np.array([r["objective"] for r in candidate], dtype=float)
    f = np.array([r["objective"] for r in fedavg], dtype=float)
    diff = float(c.mean() - f.mean())
    var = (c.var(ddof=1) + f.var(ddof=1)) / 2 if min(len(c), len(f)) > 1 else 0.0
    d = diff / math.sqrt(var) if var > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))
    return {"cohen_d": d, "wins": sum(a > b for _, a, b in pairs), "losses": sum(a < b for _, a, b in pairs),
            "paired": len(pairs), "per_seed": [list(p) for p in pairs]}


def _knobs_text(knobs: Mapping[str, float]) -> str:
    return ", ".join(f"{k} = {v:.3g}" for k, v in knobs.items()) or "its defaults"


def setting_text(setting: Mapping[str, Any]) -> str:
    """``"<label> with <knob> = <value>, …"`` (FedAvg: ``"fedavg"``)."""
    if setting["label"] == FEDAVG["label"]:
        return "fedavg"
    return f"{setting['label']} with {_knobs_text(setting.get('knobs', {}))}"


def judge(advice: Advice, significance: float, max_mean_drop: float | None) -> None:
    """Fill ``advice.test``, ``advice.recommended`` and ``advice.sentence`` from the verdict runs (module docstring)."""
    cand, runs = advice.candidate, advice.verdict
    assert cand is not None
    mine, base = [r["objective"] for r in runs["candidate"]], [r["objective"] for r in runs["fedavg"]]
    test: dict[str, Any] = {**welch(mine, base), **effect(runs["candidate"], runs["fedavg"])}
    mean_c = float(np.mean([r["acc_mean"] for r in runs["candidate"]]))
    mean_f = float(np.mean([r["acc_mean"] for r in runs["fedavg"]]))
    ref_val = float(np.mean([r["objective"] for r in advice.reference]))
    beat_on_validation = cand["validation"] > ref_val
    accepted = beat_on_validation and test["diff"] > 0 and test["p"] < significance
    mixed = test["wins"] > 0 and test["losses"] > 0
    test.update({"objective_candidate": float(np.mean(mine)), "objective_fedavg": float(np.mean(base)),
                 "mean_candidate": mean_c, "mean_fedavg": mean_f, "significance": significance, "n": len(mine),
                 "validation_fedavg": ref_val, "accepted": accepted,
                 "borderline": bool(significance <= test["p"] < 2 * significance or mixed)})
    advice.test = test
    advice.recommended = dict(cand) if accepted else dict(FEDAVG)
    what = {"worst20": "the worst 20% of clients", "worst10": "the worst 10% of clients",
            "worst": "the worst client", "mean": "the mean client"}[advice.objective]
    setting = setting_text(cand)
    where = f"on the clients' test sets over {len(mine)} fresh seeds"
    numbers = (f"{np.mean(mine):.3f} ± {np.std(mine):.3f} for {what} against FedAvg's {np.mean(base):.3f} ± "
               f"{np.std(base):.3f} {where} (Welch's t-test p = {test['p']:.2g})")
    no_beat = NO_BEAT[0].upper() + NO_BEAT[1:]
    if accepted:
        cost = mean_f - mean_c
        price = (f"it costs {cost * 100:.1f} points of mean accuracy ({mean_f:.3f} → {mean_c:.3f})" if cost > 0
                 else f"at no cost in mean accuracy ({mean_f:.3f} → {mean_c:.3f})")
        sentence = (f"Use {setting}: {where} it lifts {what} from {np.mean(base):.3f} ± {np.std(base):.3f} "
                    f"(FedAvg) to {np.mean(mine):.3f} ± {np.std(mine):.3f}, {test['diff'] * 100:+.1f} points "
                    f"(Welch's t-test p = {test['p']:.2g}); {price}.")
    elif not beat_on_validation:
        sentence = (f"{no_beat}: on validation no trial beat FedAvg's {ref_val:.3f}; the best, {setting}, gives "
                    f"{numbers}. Use FedAvg.")
    else:
        sentence = f"{no_beat}: the best on validation, {setting}, gives {numbers}. Use FedAvg."
    if test["borderline"]:
        sentence += " " + borderline_text(test, significance, accepted)
    if max_mean_drop is not None and mean_f - mean_c > max_mean_drop:
        sentence += (f" On test the candidate's mean accuracy is {(mean_f - mean_c) * 100:.1f} points below "
                     f"FedAvg's, more than max-mean-drop = {max_mean_drop:g} allowed on validation.")
    advice.sentence = sentence


def borderline_text(test: Mapping[str, Any], significance: float, accepted: bool) -> str:
    """The sentence that flags a borderline verdict: effect size, per-seed wins, p against α."""
    seeds = f"it wins on {test['wins']} of {test['paired']} seeds" + (
        f" and loses on {test['losses']}" if test["losses"] else "")
    size = f"{test['diff'] * 100:+.1f} points, Cohen's d = {test['cohen_d']:.2f}"
    if accepted:
        return (f"Borderline: {seeds} ({size}, p = {test['p']:.2g}); the lift holds on average but not on every "
                "seed, so check it on more seeds before relying on it.")
    near = significance <= test["p"] < 2 * significance
    return (f"Borderline: {size}, {seeds}, p = {test['p']:.2g}"
            + (f", not below significance = {significance:g}" if near else "")
            + "; a few more verdict seeds could turn this verdict.")


def flwr_run_config(advice: Advice) -> str:
    """The recommended setting (FedAvg when it stands) as a ``flwr run --run-config`` string (test split,
    first verdict seed).

    The federation's run config, the setting's own keys, ``num-rounds``, the seed and
    ``eval-split``; ``num-partitions`` is left to the SuperNodes' node config.
    """
    rec = advice.recommended or FEDAVG
    base = {k: v for k, v in advice.settings["run-config"].items() if k != "num-partitions"}
    items = {"strategies": rec.get("algorithm", ""), **base, **rec.get("run_config", {}),
             "num-rounds": advice.settings["num-rounds"], "seed": advice.settings["verdict-seeds"][0],
             "eval-split": "test"}
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}".replace('"', "'") for k, v in items.items())
