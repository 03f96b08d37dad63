"""Observer factories in a comparison: one observer per run, ``finish`` after the last run, also when one failed."""

from __future__ import annotations

import pytest

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import Plan, run_plans
from flowerdro.experiments import Fault, InProcessGrid
from flowerdro.strategies import RunFailedError


class Recorder:
    """An observer factory that records what each run's observer saw, and the comparison at ``finish``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self.finished = None

    def __call__(self, plan: Plan):
        events, label = self.events, plan.label

        class _Observer:
            def on_start(self, strategy, num_rounds):
                events.append(("start", label, num_rounds))

            def on_round(self, strategy, record):
                events.append(("round", label, record["round"]))

            def on_end(self, strategy, final_arrays):
                events.append(("end", label, len(strategy.history)))

        return _Observer()

    def finish(self, comparison) -> None:
        self.finished = comparison


def test_factories_watch_every_run_and_finish_after_a_failed_one(synth_rc):
    rc = {**synth_rc, "max-failed-rounds": 1}
    plans = [Plan("broken", "fedavg", 0, rc), Plan("drfa", "drfa", 0, rc)]
    broken = {k: Fault("raise", message_types=("train",)) for k in range(4)}

    def grid_for(plan: Plan) -> InProcessGrid:
        return InProcessGrid(client_app, 4, rc, faults=broken if plan.label == "broken" else {})

    recorder = Recorder()
    skipped = []

    def only_drfa(plan: Plan):
        skipped.append(plan.label)
        return None  # no observer for this plan

    with pytest.raises(RunFailedError, match="1 of 2 runs failed: broken"):
        run_plans(plans, grid_for, name="cmp", num_rounds=2, timeout=60, verbose=False,
                  observers=[recorder, only_drfa])
    assert recorder.events == [("start", "broken", 2), ("round", "broken", 1),
                               ("start", "drfa", 2), ("round", "drfa", 1), ("round", "drfa", 2), ("end", "drfa", 2)]
    assert skipped == ["broken", "drfa"]
    comparison = recorder.finished
    assert comparison is not None and list(comparison.summaries) == ["drfa"]
    assert len(comparison.failed) == 1 and comparison.failed[0].startswith("broken (seed 0)")
