"""Bad client-side settings fail in build_strategy, before any message, naming the key."""

from __future__ import annotations

import json
import math

import pytest

from flowerdro.strategies import build_strategy
from flowerdro.strategies.registry import ALGORITHMS

BASE = {"dataset": "synthetic", "model": "logreg"}

#: (run-config entries, the key the error must name)
BAD = [
    ({"lr": -0.1}, "lr"), ({"lr": "abc"}, "lr"), ({"lr": 0}, "lr"), ({"lr": math.nan}, "lr"),
    ({"local-steps": 0}, "local-steps"), ({"local-steps": 2.5}, "local-steps"), ({"batch-size": 0}, "batch-size"),
    ({"local-epochs": -1.0}, "local-epochs"), ({"weight-decay": -0.1}, "weight-decay"),
    ({"malicious-ids": "1;2"}, "malicious-ids"), ({"malicious-ids": "a,b"}, "malicious-ids"),
    ({"attack": "flip"}, "attack"), ({"hidden": "a,b"}, "hidden"), ({"model": "resnet"}, "model"),
    ({"round-timeout": -1}, "round-timeout"),
]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("config,key", BAD, ids=[f"{k}={v!r}" for c, k in BAD for v in c.values()])
def test_a_bad_client_setting_fails_in_build_strategy_naming_the_key(name, config, key):
    if key == "round-timeout":
        pytest.skip("round-timeout is read by the run (RunSettings), see test_bad_run_settings_fail_before_training")
    if key.replace("-", "_") in ALGORITHMS[name].fixed:
        pytest.skip(f"{name} pins {key} and never reads the run config's value")
    with pytest.raises(ValueError, match=f"(^|\\W){key}:"):
        build_strategy(name, {**BASE, **config})


def test_bad_run_settings_fail_before_training():
    from flowerdro.runs import RunSettings
    from flowerdro.settings import read_settings

    with pytest.raises(ValueError, match="^round-timeout:"):
        read_settings(RunSettings, {"round-timeout": -1})


@pytest.mark.parametrize("config,key", [({"lr": -0.1}, "lr"), ({"local-steps": 2.5}, "local-steps"),
                                        ({"attack": "flip"}, "attack"), ({"round-timeout": -1}, "round-timeout"),
                                        ({"round-timeout": 30}, "round-timeout")])
def test_the_runner_refuses_a_bad_setting_before_any_strategy_runs(tmp_path, monkeypatch, config, key):
    from flowerdro.experiments import InProcessGrid, run

    calls = []
    original = InProcessGrid._deliver
    monkeypatch.setattr(InProcessGrid, "_deliver", lambda self, msg: calls.append(msg) or original(self, msg))
    experiment = {"name": "t", "strategies": ["fedavg", "drdsgd"], "num-rounds": 2, "seeds": [0],
                  "num-partitions": 3, "run-config": {**BASE, **config}, "output-root": str(tmp_path)}
    with pytest.raises(ValueError, match=f"(^|\\W){key}:"):
        run(experiment, verbose=False)
    assert calls == []  # no message reached a client
    assert not list(tmp_path.rglob("rounds.jsonl"))


def test_a_failed_run_does_not_stop_the_others_and_the_comparison_still_fails(tmp_path, monkeypatch):
    """One strategy that cannot train: the others run and are written, then the runner raises."""
    from flowerdro.experiments import run
    from flowerdro.strategies import RunFailedError
    from flowerdro.strategies.drdsgd import DRDSGD

    def cannot_train(self, *args, **kwargs):
        raise RunFailedError(f"[{self.run_name}] no valid training reply in 3 rounds in a row")

    monkeypatch.setattr(DRDSGD, "start", cannot_train)
    experiment = {"name": "t", "strategies": ["drdsgd", "fedavg"], "num-rounds": 2, "seeds": [0, 1],
                  "num-partitions": 3, "run-config": dict(BASE), "output-root": str(tmp_path)}
    with pytest.raises(RunFailedError, match=r"2 of 4 runs failed: drdsgd \(seed 0\).*drdsgd \(seed 1\)"):
        run(experiment, verbose=False)
    # FedAvg ran after the failed runs, for both seeds, and the comparison of what finished is written
    assert sorted(p.parent.name for p in (tmp_path / "t" / "fedavg").rglob("rounds.jsonl")) == ["seed0", "seed1"]
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert list(summary["summaries"]) == ["fedavg"]
