"""Every registered strategy, cut after round 2 and resumed from its checkpoint, gives the
round records and final model of the same run left uninterrupted."""

from __future__ import annotations

import numpy as np
import pytest

from flowerdro.strategies.registry import ALGORITHMS

#: Keys of a round record that measure the machine, not the algorithm.
VOLATILE = ("time_s", "server_step_s")

#: Every strategy's algorithm keys set (as in the golden config), 5 synthetic clients.
RUN_CONFIG = {
    "dataset": "synthetic", "partition": "natural", "model": "logreg",
    "synthetic-dim": 20, "synthetic-classes": 5, "lr": 0.05, "local-steps": 3, "batch-size": 8,
    "fraction-train": 0.6, "dual-lr": 0.01, "q": 0.5, "proximal-mu": 0.1, "eps": 0.2,
    "mu": 6.0, "topology": "ring", "adv-lr": 0.01, "affine-lambda": 1.0, "adv-eps": 0.5,
    "pgd-steps": 3, "checkpoint-every": 1,
}


def _experiment(name: str, root) -> dict:
    return {"name": "resume", "num-rounds": 4, "seeds": [0], "num-partitions": 5, "strategies": [name],
            "run-config": dict(RUN_CONFIG), "output-root": str(root),
            "strategy": {"drdsgd": {"local-steps": 1}, "dsgd": {"local-steps": 1}}}


def _records(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in history]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_strategy_resumed_after_round_2_equals_the_uninterrupted_run(tmp_path, name, crash_after):
    from flowerdro.experiments import run
    from flowerdro.runs import load_records

    whole = run(_experiment(name, tmp_path / "whole"), verbose=False)
    crash_after(_experiment(name, tmp_path / "cut"), 2)  # round 2's record and checkpoint are written
    resumed = run({**_experiment(name, tmp_path / "cut"), "resume": True}, verbose=False)

    assert _records(resumed.histories[name][0]) == _records(whole.histories[name][0])
    a, b = whole.final_arrays[name][0], resumed.final_arrays[name][0]
    assert list(a.keys()) == list(b.keys())
    for k in a.keys():
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy())
    on_disk = load_records(tmp_path / "cut" / "resume" / name / "seed0")
    assert _records(on_disk) == _records(whole.histories[name][0])
