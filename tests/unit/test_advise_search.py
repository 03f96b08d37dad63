"""The advisor's search without training: every candidate gets complete trials, and the budget covers the verdict.

The runs are replaced by curves written here (``run_seed`` patched), so that the numbers a
trial reports are known in advance: q-FedAvg climbs at once to 0.5 worst-20% accuracy, DRFA
stays near 0.05 for the first rounds and ends at 0.8. A pruner that compared DRFA's trials
with q-FedAvg's would stop every one of them at the first rung; the advisor's must not.
"""

from __future__ import annotations

import math

import optuna
import pytest

import flowerdro.advise.search as search_module
from flowerdro.advise import run
from flowerdro.advise.pruning import FULL, StrategyPruner

ROUNDS = 8
CONFIG = {
    "name": "slow_starter",
    "num-rounds": ROUNDS,
    "num-partitions": 6,
    "run-config": {"dataset": "synthetic", "model": "logreg", "lr": 0.05, "local-steps": 5, "batch-size": 16,
                   "synthetic-dim": 20, "synthetic-classes": 5},
    "advise": {"strategies": ["qfedavg", "drfa"], "trials": 6, "seeds": [0, 1], "verdict-seeds": [5, 6, 7],
               "validation-fraction": 0.25, "pruner": "successive-halving", "pruner-min-rounds": 2,
               "pruner-reduction": 2},
}


def worst20(algorithm: str, run_config: dict, rnd: int) -> float:
    """The scripted worst-20% accuracy of a run after round ``rnd`` (0.002 more per seed)."""
    seed = 0.002 * int(run_config["seed"])
    if algorithm == "drfa":  # a slow starter: 0.053 after 2 rounds, 0.8 after 8
        return 0.05 + 0.75 * (rnd / ROUNDS) ** 4 + 0.001 * math.log10(float(run_config.get("dual-lr", 1e-2))) + seed
    if algorithm == "qfedavg":  # fast: 0.375 after 2 rounds, 0.498 after 8
        return 0.5 * (1 - 0.5 ** rnd) + 0.001 * math.log10(float(run_config.get("q", 1.0))) + seed
    return 0.3 * (1 - 0.5 ** rnd) + seed  # fedavg


@pytest.fixture
def scripted(monkeypatch):
    """Replace every run by its scripted curve; returns the list of (algorithm, seed, split) run."""
    runs: list[tuple[str, int, str]] = []

    def fake_run_seed(app, algorithm, run_config, *, num_rounds, timeout, split, observers=(), label=None):
        runs.append((algorithm, int(run_config["seed"]), split))
        history = []
        for rnd in range(1, num_rounds + 1):
            w = worst20(algorithm, run_config, rnd)
            record = {"round": rnd, "acc_mean": w + 0.2, "acc_worst": w - 0.02, "acc_worst10": w - 0.01,
                      "acc_worst20": w, "acc_best20": w + 0.3, "acc_std": 0.1}
            history.append(record)
            for obs in observers:
                obs.on_round(None, record)
        return history

    monkeypatch.setattr(search_module, "run_seed", fake_run_seed)
    return runs


def _complete(advice, label):
    return [t for t in advice.trials if t["label"] == label and t["state"] == "COMPLETE"]


def test_a_slow_starting_candidate_gets_complete_trials_and_wins(scripted):
    advice = run(CONFIG, output_root=None, progress=False)
    # both candidates' first two trials ran to their end; DRFA's final 0.8 beats q-FedAvg's 0.5
    assert len(_complete(advice, "drfa")) >= 2 and len(_complete(advice, "qfedavg")) >= 2
    assert all(t["full"] for t in advice.trials[:4])
    assert [t["label"] for t in advice.trials[:4]] == ["qfedavg", "drfa", "qfedavg", "drfa"]
    assert advice.candidate["label"] == "drfa"
    # its objective: the mean over seeds 0 and 1 of the last round's 0.8 + 0.001·log10(γ) + 0.002·seed
    assert advice.best["drfa"]["objective"] == pytest.approx(0.8 + 0.001 * math.log10(
        advice.best["drfa"]["knobs"]["dual-lr"]) + 0.001, abs=1e-12)
    assert advice.coverage["drfa"].startswith("2 complete") or advice.coverage["drfa"].startswith("3 complete")
    assert "fewer than" not in advice.coverage["drfa"]


def test_a_pruner_comparing_across_strategies_would_have_stopped_the_slow_starter(scripted, monkeypatch):
    # the same search under Optuna's own successive halving over all trials
    monkeypatch.setattr(search_module.Search, "pruner",
                        lambda self: optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=2))
    advice = run(CONFIG, output_root=None, progress=False)
    drfa = [t for t in advice.trials if t["label"] == "drfa"]
    assert drfa and all(t["state"] == "PRUNED" and t["pruned_at"] == 2 for t in drfa)
    assert advice.candidate["label"] == "qfedavg"
    assert "drfa" not in advice.best
    assert "fewer than 2 complete: its trials were stopped early" in advice.coverage["drfa"]


def _trial(study, strategy: str, value: float, step: int, full: bool = False):
    study.enqueue_trial({"strategy": strategy}, user_attrs={FULL: True} if full else None)
    trial = study.ask()
    trial.suggest_categorical("strategy", ["qfedavg", "drfa"])
    trial.report(value, step)
    return trial


def test_the_pruner_compares_a_trial_with_its_own_strategys_trials_only():
    # successive halving, η = 2, first rung at step 2: a trial goes on when it is in the top half
    study = optuna.create_study(direction="maximize", pruner=StrategyPruner(2, 16, 2, brackets=False))
    fast = _trial(study, "qfedavg", 0.4, 2)
    assert not fast.should_prune()  # alone at its rung
    study.tell(fast, 0.5)
    slow = _trial(study, "drfa", 0.05, 2)
    assert not slow.should_prune()  # below q-FedAvg's 0.4, but the first DRFA trial at this rung
    study.tell(slow, 0.8)
    slower = _trial(study, "drfa", 0.01, 2)
    assert slower.should_prune()  # below the other DRFA trial's 0.05: not in the top half of 2
    study.tell(slower, state=optuna.trial.TrialState.PRUNED)
    guaranteed = _trial(study, "drfa", 0.0, 2, full=True)
    assert not guaranteed.should_prune()  # a FULL trial runs on ...
    assert "completed_rung_0" in study.trials[guaranteed.number].system_attrs  # ... and is a competitor later


def test_the_pruners_brackets_are_optunas_hyperband_brackets():
    study = optuna.create_study(study_name="brackets", direction="maximize")
    for _ in range(40):
        study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=0.0))
    ours = StrategyPruner(2, 54, 3)
    theirs = optuna.pruners.HyperbandPruner(min_resource=2, max_resource=54, reduction_factor=3)
    theirs._try_initialization(study)  # noqa: SLF001  # the brackets Optuna builds at the first prune
    assert len(ours.halving) == len(theirs._pruners) == 4  # ⌊log₃(54/2)⌋ + 1  # noqa: SLF001
    for t in study.trials:
        assert ours.bracket("brackets", t.number) == theirs._get_bracket_id(study, t)  # noqa: SLF001


def test_the_budget_covers_the_verdict_and_is_never_exceeded_in_client_rounds(scripted):
    # one run: 8 rounds × 6 clients = 48 client-rounds. Reference: 2 seeds = 96; a trial: 2 seeds = 96;
    # the verdict: (candidate + FedAvg) × 3 seeds = 6 runs = 288. Budget 500: the first trial starts
    # (reference 96 + the trial 96 + the verdict 288 = 480 <= 500), a second would not fit (96 + 96 + 96
    # + 288 = 576 > 500).
    cfg = {**CONFIG, "advise": {**CONFIG["advise"], "budget": "500 client-rounds"}}
    advice = run(cfg, output_root=None, progress=False)
    assert len(advice.trials) == 1
    assert advice.spent["client_rounds"] == 96 + 96 and advice.spent["verdict_client_rounds"] == 288
    assert advice.spent["client_rounds"] + advice.spent["verdict_client_rounds"] == 480 <= 500
    assert len([r for r in scripted if r[2] == "test"]) == 6
    assert "fewer than 2 complete: the budget (500 client-rounds, which keeps the verdict's share back) was spent " \
           "first" in advice.coverage["qfedavg"]
    assert "fewer than 2 complete: the budget" in advice.coverage["drfa"] and advice.coverage["drfa"].startswith(
        "0 complete")
