"""The tuning advisor end to end on a tiny synthetic federation (in-process clients).

A search of 2 strategies, 3 trials of 2 rounds over 2 seeds: it runs, is stopped in its
third trial and resumed (trials 0-1 are not run again), never reads a client's test
split before the verdict (the one function that hands out evaluation tensors is
instrumented), and writes its report.
"""

from __future__ import annotations

import json

import optuna
import pytest

import flowerdro.advise.search as search_module
from flowerdro.advise import run
from flowerdro.clients import handlers

CONFIG = {
    "name": "tiny_advice",
    "num-rounds": 2,
    "num-partitions": 6,
    "run-config": {"dataset": "synthetic", "model": "logreg", "lr": 0.05, "local-steps": 5, "batch-size": 16,
                   "synthetic-dim": 20, "synthetic-classes": 5},
    "advise": {"strategies": ["qfedavg", "drfa"], "trials": 3, "seeds": [0, 1], "verdict-seeds": [5, 6],
               "validation-fraction": 0.25},
}


class _Stop(Exception):
    """The search is cut off here (a crash, a killed process)."""


def test_a_tiny_search_runs_resumes_and_reads_the_test_split_only_in_the_verdict(tmp_path, monkeypatch):
    # Prepare: record every split handed out for evaluation, and when the verdict begins
    reads: list[str] = []
    original_split = handlers.evaluation_split

    def recording_split(rt, split):
        reads.append(split)
        return original_split(rt, split)

    monkeypatch.setattr(handlers, "evaluation_split", recording_split)
    original_verdict = search_module.Search.verdict

    def marked_verdict(self, study, candidate):
        reads.append("VERDICT")
        return original_verdict(self, study, candidate)

    monkeypatch.setattr(search_module.Search, "verdict", marked_verdict)
    runs: list[tuple[str, int, str]] = []
    original_run_seed = search_module.run_seed

    def counting_run_seed(app, algorithm, run_config, **kw):
        runs.append((algorithm, int(run_config["seed"]), kw["split"]))
        if stop_at is not None and len(runs) == stop_at:
            raise _Stop
        return original_run_seed(app, algorithm, run_config, **kw)

    monkeypatch.setattr(search_module, "run_seed", counting_run_seed)

    # Execute: FedAvg's 2 reference runs, trials 0 and 1 (2 seeds each), then stop in trial 2
    stop_at = 7
    with pytest.raises(_Stop):
        run(CONFIG, output_root=tmp_path, progress=False)
    storage = f"sqlite:///{tmp_path / 'tiny_advice' / 'study.db'}"
    first = optuna.load_study(study_name="tiny_advice", storage=storage).get_trials()
    assert [t.state.name for t in first] == ["COMPLETE", "COMPLETE", "FAIL"]

    # Execute: resume
    runs.clear()
    stop_at = None
    advice = run(CONFIG, output_root=tmp_path, progress=False)

    # Assert: only trial 2 and the verdict ran (no reference run, no trial 0 or 1 again)
    assert [r for r in runs if r[2] == "validation"] == [(first[2].params["strategy"], 0, "validation"),
                                                         (first[2].params["strategy"], 1, "validation")]
    assert sorted((a, s) for a, s, split in runs if split == "test") == sorted(
        [(advice.candidate["algorithm"], 5), (advice.candidate["algorithm"], 6), ("fedavg", 5), ("fedavg", 6)])
    done = [t for t in advice.trials if t["state"] == "COMPLETE"]
    assert len(done) == 3
    again = optuna.load_study(study_name="tiny_advice", storage=storage).get_trials()
    for before in first[:2]:
        after = again[before.number]
        assert (after.params, after.value, after.datetime_complete) == (before.params, before.value,
                                                                        before.datetime_complete)
    assert again[3].params == first[2].params  # the interrupted trial, run again with its settings

    # Assert: no test split before the verdict; only test splits in it
    cut = reads.index("VERDICT")
    assert reads[:cut] and set(reads[:cut]) == {"validation"}
    assert reads[cut + 1:] and set(reads[cut + 1:]) == {"test"}
    assert reads.count("VERDICT") == 1

    # Assert: the report, its figure and its numbers
    out = tmp_path / "tiny_advice"
    page = (out / "advice.md").read_text()
    assert advice.sentence in page and "## Test verdict" in page
    assert (out / "advice.png").stat().st_size > 0
    saved = json.loads((out / "advice.json").read_text())
    assert saved["candidate"]["label"] in ("qfedavg", "drfa")
    best = max(done, key=lambda t: t["objective"])
    assert saved["candidate"]["trial"] == best["number"]
    # what to use is the candidate only when the verdict accepts it, else FedAvg, everywhere
    use = saved["candidate"] if saved["test"]["accepted"] else {"label": "fedavg", "algorithm": "fedavg"}
    assert saved["recommended"]["label"] == use["label"]
    assert f"strategies='{use['algorithm']}'" in saved["flwr_run_config"]
    assert f"**Use:** {use['label']}" in page
    assert set(saved["coverage"]) == {"qfedavg", "drfa"}
    for t in done:  # a trial's objective is the mean over its seeds of their last-round validation worst-20%
        assert t["objective"] == pytest.approx(sum(s["acc_worst20"] for s in t["seeds"]) / 2, rel=1e-12)

    # Execute / Assert: a finished search reruns nothing and writes the same verdict
    runs.clear()
    reads.clear()
    again_advice = run(CONFIG, output_root=tmp_path, progress=False)
    assert runs == [] and again_advice.sentence == advice.sentence


def test_a_stored_search_with_other_settings_is_not_resumed(tmp_path):
    cfg = {**CONFIG, "advise": {**CONFIG["advise"], "trials": 1, "strategies": ["qfedavg"]}}
    run(cfg, output_root=tmp_path, progress=False)
    with pytest.raises(ValueError, match="other settings \\(num-rounds differ\\); pass --overwrite"):
        run({**cfg, "num-rounds": 3}, output_root=tmp_path, progress=False)


@pytest.mark.parametrize(("advise", "message"), [
    ({"objective": "worst5"}, "objective: unknown value 'worst5'; allowed: worst20, worst10, worst, mean"),
    ({"trails": 3}, "\\[advise\\]: unknown key 'trails' \\(did you mean 'trials'\\?\\)"),
    ({"strategies": ["nope"]}, "advise.strategies: 'nope' is neither a registered strategy"),
    ({"strategies": ["fedavg"]}, "fedavg is the reference every search runs"),
    ({"seeds": [0, 1], "verdict-seeds": [1, 2]}, "advise.verdict-seeds: \\[1\\] are search seeds too"),
    ({"knobs": {"drfa": {"lambda-floor": [1e-3, 0.5]}}},
     "candidate drfa \\(drfa\\) refuses its knob corner .*lambda-floor.*narrow the range in \\[advise.knobs.drfa\\]"),
    ({"knobs": {"drfa": {"q": [0.1, 1]}}}, "advise.knobs.drfa: q not a strength knob of drfa"),
    ({"budget": "soon"}, "budget: expected wall time"),
    ({"validation-fraction": 0}, "validation-fraction: 0 means the clients bring their own validation data"),
])
def test_a_bad_advisor_file_is_refused_naming_the_key(tmp_path, advise, message):
    cfg = {**CONFIG, "advise": {**CONFIG["advise"], **advise}}
    with pytest.raises(ValueError, match=message):
        run(cfg, output_root=tmp_path, progress=False)


def test_the_advisor_sets_the_validation_keys_itself(tmp_path):
    cfg = {**CONFIG, "run-config": {**CONFIG["run-config"], "eval-split": "test"}}
    with pytest.raises(ValueError, match="eval-split: the advisor sets it; remove it from \\[run-config\\]"):
        run(cfg, output_root=tmp_path, progress=False)


def test_max_mean_drop_marks_the_trials_below_fedavgs_mean_infeasible(tmp_path):
    drop = 0.05
    cfg = {**CONFIG, "advise": {**CONFIG["advise"], "trials": 2, "max-mean-drop": drop}}
    try:
        advice = run(cfg, output_root=tmp_path, progress=False)
    except RuntimeError as exc:  # every trial fell below FedAvg's mean by more than the drop
        assert "no trial of tiny_advice completed feasibly" in str(exc)
        return
    floor = sum(r["acc_mean"] for r in advice.reference) / len(advice.reference) - drop
    for t in advice.trials:
        if t["state"] == "COMPLETE":
            mean = sum(s["acc_mean"] for s in t["seeds"]) / len(t["seeds"])
            assert t["feasible"] == (mean >= floor), t
    assert advice.best and all(b["feasible"] for b in advice.best.values())
