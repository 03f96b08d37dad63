"""``dp-max-epsilon`` ends a run as an early stop: the last round's record, the final model, the summary and the table.

The budget is placed between the ε of two and of three Gaussian releases, worked out here
with dp-accounting's RDP accountant (no amplification, as Flower's accountant under the
ServerApp), so the run must stop after round 2 of 5.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from flowerdro.apps.client_app import app as client_app
from flowerdro.apps.server_app import run_strategies
from flowerdro.experiments import InProcessGrid
from flowerdro.runs.files import load_arrays
from flowerdro.runs.report import final_summary
from flowerdro.runs.results import load_records
from flowerdro.strategies.base import RunFailedError

NOISE, DELTA = 1.5, 1e-5


def _epsilon(releases: int) -> float:
    dp_accounting = pytest.importorskip("dp_accounting")
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(NOISE), releases)
    return float(acc.get_epsilon(DELTA))


def _run_config(synth_rc, tmp_path, max_epsilon: float) -> dict:
    return {**synth_rc, "num-partitions": 3, "strategies": "fedavg", "num-rounds": 5, "weighting": "uniform",
            "dp": "server-fixed", "dp-noise-multiplier": NOISE, "dp-clipping-norm": 1.0, "dp-accountant": True,
            "dp-delta": DELTA, "dp-max-epsilon": max_epsilon, "output-dir": str(tmp_path / "out")}


def test_dp_max_epsilon_stops_the_run_after_the_last_round_it_allows(synth_rc, tmp_path, caplog):
    # Prepare: a budget between ε(2 releases) and ε(3 releases)
    eps2, eps3 = _epsilon(2), _epsilon(3)
    budget = (eps2 + eps3) / 2
    rc = _run_config(synth_rc, tmp_path, budget)

    # Execute
    with caplog.at_level(logging.INFO, logger="flwr"):
        comparison = run_strategies(InProcessGrid(client_app, 3, rc), rc)

    # Assert: two rounds ran and were recorded, with ε(2) spent; none was recorded for round 3
    out = tmp_path / "out"
    records = load_records(out / "fedavg")
    assert [r["round"] for r in records] == [1, 2]
    assert records[-1]["dp"]["epsilon"] == pytest.approx(eps2, rel=1e-9) and eps2 <= budget < eps3
    assert comparison.histories["fedavg"][0] == records
    # the final model, the summary and the table are written
    final = load_arrays(out / "fedavg" / "final_model.npz")
    assert list(final.keys()) and all(np.isfinite(final[k].numpy()).all() for k in final.keys())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["summaries"]["fedavg"] == [final_summary(records)]
    assert "fedavg" in (out / "table.md").read_text()
    # the reason is logged
    lines = [r.getMessage() for r in caplog.records]
    assert any("[fedavg] stopped after round 2 of 5: round 3 would exceed the privacy budget dp-max-epsilon" in line
               for line in lines), lines[-10:]


def test_a_budget_too_small_for_one_round_fails_the_run_naming_the_key(synth_rc, tmp_path):
    rc = _run_config(synth_rc, tmp_path, _epsilon(1) / 2)
    with pytest.raises(RunFailedError, match="dp-max-epsilon: round 1, the run's first, would already exceed"):
        run_strategies(InProcessGrid(client_app, 3, rc), rc)
    assert not (tmp_path / "out" / "fedavg" / "final_model.npz").exists()
