"""The advisor's verdict on hand-made per-seed numbers: what is recommended, and when it is borderline.

Welch's p is worked out here from its definition (t, the Welch–Satterthwaite degrees of
freedom, Student's t tail from ``scipy.stats.t``), Cohen's d with ``statistics.stdev``, and
the per-seed wins by counting.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import matplotlib.figure
import pytest
from scipy import stats

from flowerdro.advise.report import figure, markdown, write_report
from flowerdro.advise.verdict import FEDAVG, Advice, judge

FEDAVG_TEST = [0.47, 0.50, 0.51, 0.49, 0.46]
CANDIDATE = {"label": "drfa", "algorithm": "drfa", "knobs": {"dual-lr": 0.05}, "trial": 3,
             "run_config": {"dual-lr": 0.05}, "validation": 0.55}


def _runs(values, seeds=(10, 11, 12, 13, 14)):
    return [{"seed": s, "objective": v, "acc_worst20": v, "acc_worst10": v - 0.05, "acc_worst": v - 0.1,
             "acc_mean": 0.8} for s, v in zip(seeds, values, strict=True)]


def _advice(candidate_values, fedavg_values=FEDAVG_TEST, validation=0.55) -> Advice:
    settings = {"run-config": {"dataset": "synthetic", "model": "logreg", "num-partitions": 6}, "num-rounds": 20,
                "num-partitions": 6, "seeds": [0, 1], "verdict-seeds": [10, 11, 12, 13, 14], "last-rounds": 1,
                "validation-fraction": 0.2, "pruner": "hyperband", "pruner-min-rounds": 5, "pruner-reduction": 3,
                "max-mean-drop": None, "budget": "no budget (trials only)", "trials": 4, "description": ""}
    trial = {"number": 3, "state": "COMPLETE", "label": "drfa", "knobs": {"dual-lr": 0.05}, "objective": 0.55,
             "acc_mean": 0.8, "acc_worst20": 0.55, "seeds": _runs([0.55, 0.55], seeds=(0, 1)), "full": True}
    return Advice("hand", "worst20", settings, reference=_runs([0.45, 0.45], seeds=(0, 1)), trials=[trial],
                  best={"drfa": trial}, candidate={**CANDIDATE, "validation": validation},
                  verdict={"candidate": _runs(candidate_values), "fedavg": _runs(fedavg_values)},
                  coverage={"drfa": "2 complete of 2 trials"})


def _welch_p(a, b) -> float:
    """Two-sided Welch p from the definitions: t = Δ/√(s_a²/n_a + s_b²/n_b), ν by Welch–Satterthwaite."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    t = (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb)
    nu = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return 2 * stats.t.sf(abs(t), nu)


def _cohen_d(a, b) -> float:
    return (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt((statistics.stdev(a) ** 2
                                                                    + statistics.stdev(b) ** 2) / 2)


def _drawn(advice) -> matplotlib.figure.Figure:
    """The report's figure object (``savefig`` captured instead of writing a file)."""
    drawn = []
    original = matplotlib.figure.Figure.savefig
    matplotlib.figure.Figure.savefig = lambda self, *a, **k: drawn.append(self)
    try:
        figure(advice, Path("unused.png"))
    finally:
        matplotlib.figure.Figure.savefig = original
    return drawn[0]


def test_a_clear_win_is_recommended_everywhere(tmp_path):
    cand = [0.60, 0.62, 0.61, 0.63, 0.64]
    advice = _advice(cand)
    judge(advice, 0.05, None)
    assert advice.test["p"] == pytest.approx(_welch_p(cand, FEDAVG_TEST), rel=1e-9) and advice.test["p"] < 0.05
    assert advice.test["accepted"] and not advice.test["borderline"] and advice.test["wins"] == 5
    assert advice.recommended["label"] == "drfa" and not advice.fedavg_stands
    assert advice.sentence.startswith("Use drfa with dual-lr = 0.05:") and "Borderline" not in advice.sentence
    write_report(advice, tmp_path)
    saved = json.loads((tmp_path / "advice.json").read_text())
    assert saved["flwr_run_config"].startswith("strategies='drfa' dataset='synthetic'")
    assert "dual-lr=0.05" in saved["flwr_run_config"]
    assert "| recommended: drfa (dual-lr = 0.05) |" in (tmp_path / "advice.md").read_text()
    ticks = [t.get_text() for t in _drawn(advice).axes[1].get_xticklabels()]
    assert ticks == ["drfa\n(recommended)", "fedavg"]


def test_a_rejected_candidate_is_never_labelled_recommended(tmp_path):
    cand = [0.40, 0.41, 0.42, 0.43, 0.44]  # below FedAvg on every seed
    advice = _advice(cand)
    judge(advice, 0.05, None)
    assert not advice.test["accepted"] and not advice.test["borderline"] and advice.test["losses"] == 5
    assert advice.recommended == FEDAVG and advice.fedavg_stands
    assert advice.sentence.endswith("Use FedAvg.")
    write_report(advice, tmp_path)
    saved = json.loads((tmp_path / "advice.json").read_text())
    assert saved["recommended"]["label"] == "fedavg" and saved["candidate"]["label"] == "drfa"
    assert saved["flwr_run_config"].startswith("strategies='fedavg' ") and "dual-lr" not in saved["flwr_run_config"]
    page = (tmp_path / "advice.md").read_text()
    assert "| recommended: fedavg (the verdict keeps FedAvg) |" in page
    assert "| best candidate, rejected: drfa (dual-lr = 0.05) |" in page
    assert "recommended: drfa" not in page and "**Use:** fedavg" in page
    drawn = _drawn(advice)
    assert [t.get_text() for t in drawn.axes[1].get_xticklabels()] == ["drfa\n(rejected)", "fedavg\n(recommended)"]
    legend = [t.get_text() for t in drawn.axes[0].get_legend().get_texts()]
    assert "recommended: FedAvg" in legend and "best candidate (rejected by the verdict)" in legend
    assert "recommended" not in legend


def test_a_p_between_significance_and_twice_it_is_borderline_with_effect_size_and_wins():
    cand = [0.57, 0.53, 0.62, 0.50, 0.50]  # above FedAvg on every seed, p = 0.063
    advice = _advice(cand)
    judge(advice, 0.05, None)
    p, d = _welch_p(cand, FEDAVG_TEST), _cohen_d(cand, FEDAVG_TEST)
    assert 0.05 <= p < 0.1 and advice.test["p"] == pytest.approx(p, rel=1e-9)
    assert advice.test["cohen_d"] == pytest.approx(d, rel=1e-12)
    assert advice.test["borderline"] and not advice.test["accepted"] and advice.fedavg_stands
    diff = statistics.fmean(cand) - statistics.fmean(FEDAVG_TEST)
    assert (f"Borderline: {diff * 100:+.1f} points, Cohen's d = {d:.2f}, it wins on 5 of 5 seeds, p = {p:.2g}, "
            "not below significance = 0.05") in advice.sentence


def test_a_verdict_that_changes_sign_across_seeds_is_borderline_even_below_significance():
    cand = [0.60, 0.62, 0.61, 0.63, 0.44]
    fedavg = [0.30, 0.32, 0.31, 0.33, 0.45]  # the last seed goes FedAvg's way
    advice = _advice(cand, fedavg)
    judge(advice, 0.05, None)
    assert advice.test["p"] == pytest.approx(_welch_p(cand, fedavg), rel=1e-9) and advice.test["p"] < 0.05
    assert advice.test["accepted"] and advice.recommended["label"] == "drfa"
    assert (advice.test["wins"], advice.test["losses"]) == (4, 1) and advice.test["borderline"]
    diff = statistics.fmean(cand) - statistics.fmean(fedavg)
    assert (f"Borderline: it wins on 4 of 5 seeds and loses on 1 ({diff * 100:+.1f} points, Cohen's d = "
            f"{_cohen_d(cand, fedavg):.2f}") in advice.sentence


def test_fedavg_stands_when_no_trial_beat_it_on_validation():
    cand = [0.60, 0.62, 0.61, 0.63, 0.64]
    advice = _advice(cand, validation=0.44)  # FedAvg's validation objective is 0.45
    judge(advice, 0.05, None)
    assert advice.fedavg_stands and "on validation no trial beat FedAvg's 0.450" in advice.sentence
    assert markdown(advice, "advice.png").count("recommended: fedavg") == 1
