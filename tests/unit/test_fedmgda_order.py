"""FedMGDA+'s streamed step does not depend on the order the replies arrive in."""

from __future__ import annotations

import numpy as np
import pytest

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import client_config
from flowerdro.experiments import Fault, InProcessGrid
from flowerdro.strategies import build_strategy, initial_arrays


class _ReversedGrid(InProcessGrid):
    """The in-process grid, except that the replies come last message first."""

    def pull_messages(self, message_ids):  # noqa: D102
        out = []
        for mid in list(message_ids)[::-1]:
            if self.replies_per_pull is not None and len(out) >= self.replies_per_pull:
                break
            out.extend(InProcessGrid.pull_messages(self, [mid]))
        return out


def _run(grid: InProcessGrid, rc: dict, name: str, chunk: int) -> tuple[list[dict], list[np.ndarray]]:
    strategy = build_strategy(name, rc)
    strategy.stream_chunk = chunk
    strategy.comm.transport.pull_interval = 0.001
    res = strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=3, timeout=60, train_config=client_config(rc))
    records = [{k: v for k, v in r.items() if k not in ("time_s", "server_step_s")} for r in strategy.history]
    return records, [res.arrays[k].numpy() for k in res.arrays.keys()]


@pytest.mark.parametrize("name", ["fedmgda+", "fedmgda"])
@pytest.mark.parametrize("chunk", [2, 16])
def test_fedmgda_records_and_model_do_not_depend_on_the_arrival_order(synth_rc, name, chunk):
    rc = {**synth_rc, "fraction-train": 1.0, "synthetic-dim": 60}
    faults = {3: Fault("raise", message_types=("train",), rounds=(2,))}
    in_order = _run(InProcessGrid(client_app, 7, rc, faults=faults), rc, name, chunk)
    for per_pull in (None, 1, 3):  # all at once, one by one, three at a time: last message first
        reversed_ = _run(_ReversedGrid(client_app, 7, rc, faults=faults, replies_per_pull=per_pull), rc, name, chunk)
        assert reversed_[0] == in_order[0]
        for a, b in zip(reversed_[1], in_order[1], strict=True):
            np.testing.assert_array_equal(a, b)
    assert in_order[0][1]["failures"] == {"train:error": 1}
