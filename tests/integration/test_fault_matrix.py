"""The fault matrix: every registered strategy against one misbehaving partition, per fault.

Partition 1 of 5 misbehaves in every message of rounds 1-3 (the roll call, which carries
no round, is answered). Every run must complete; every failure must be counted against
partition 1 and nobody else; the server's state, the model and λ must stay finite, λ on
the simplex and the model in its dtype. The in-process grid's clock is simulated: a
``timeout`` costs the server its whole round timeout, a ``slow`` reply its seconds.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import client_config
from flowerdro.experiments import Fault, InProcessGrid
from flowerdro.strategies import build_strategy, initial_arrays
from flowerdro.strategies.registry import ALGORITHMS

RUN_CONFIG = {
    "dataset": "synthetic", "partition": "natural", "model": "logreg",
    "synthetic-dim": 20, "synthetic-classes": 5, "lr": 0.05, "local-steps": 2, "batch-size": 8,
    "fraction-train": 1.0, "dual-lr": 0.01, "q": 0.5, "proximal-mu": 0.1, "eps": 0.2,
    "mu": 6.0, "topology": "ring", "adv-lr": 0.01, "affine-lambda": 1.0, "adv-eps": 0.5,
    "pgd-steps": 2,
}
ROUNDS, TIMEOUT, SLOW, BAD = 3, 60.0, 5.0, 1

#: Faults the server must drop (a failure of partition 1) and faults it must take in its stride.
DROPPED = ("raise", "nan", "shape", "timeout", "missing-record")
TOLERATED = ("slow", "extra-metric", "float64")


def _numbers(obj, path="state"):
    """(path, value) of every float or float array inside ``obj`` (dataclasses, dicts, lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _numbers(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}[{k!r}]")
    elif isinstance(obj, list | tuple):
        for k, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{k}]")
    elif isinstance(obj, np.ndarray) and np.issubdtype(obj.dtype, np.number):
        yield path, obj
    elif isinstance(obj, float):
        yield path, np.array(obj)


class _RecordingGrid(InProcessGrid):
    """The in-process grid, noting the dtype of every float array the server sends."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sent_dtypes: set[str] = set()

    def _deliver(self, msg):
        for rec in msg.content.array_records.values():
            self.sent_dtypes.update(str(rec[k].numpy().dtype) for k in rec.keys()
                                    if np.issubdtype(rec[k].numpy().dtype, np.floating))
        return super()._deliver(msg)


def _assert_on_simplex(lam: np.ndarray, what: str) -> None:
    # λ is a float64 vector of ≤ 5 entries renormalised by projection: its sum is 1 up to
    # a few ulps of float64 (eps ≈ 2.2e-16) per entry; 1e-12 leaves room for that
    assert lam.size and np.all(lam >= 0.0) and abs(lam.sum() - 1.0) <= 1e-12, f"{what} not on the simplex: {lam}"


@pytest.mark.parametrize("mode", DROPPED + TOLERATED)
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_one_faulty_partition_never_stops_a_strategy_nor_corrupts_its_state(name, mode):
    rc = dict(RUN_CONFIG, **({"local-steps": 1} if name in ("drdsgd", "dsgd") else {}))
    fault = Fault(mode, rounds=tuple(range(1, ROUNDS + 1)), seconds=SLOW)
    grid = _RecordingGrid(client_app, 5, rc, faults={BAD: fault})
    strategy = build_strategy(name, rc)
    strategy.comm.transport.pull_interval = 1.0  # simulated seconds between empty pulls of the streamed path
    init = initial_arrays(grid, rc, 60)
    t0 = grid.clock()
    res = strategy.start(grid, init, num_rounds=ROUNDS, timeout=TIMEOUT, train_config=client_config(rc))

    # the run completed, every round recorded
    assert [r["round"] for r in strategy.history] == list(range(1, ROUNDS + 1))
    # every failure is partition 1's, none is a phantom (unknown partition)
    assert {f.partition_id for f in strategy.failures} <= {BAD}
    if mode in DROPPED:
        assert strategy.failures, "a fault the server must drop went unnoticed"
        kinds = {f.kind for f in strategy.failures}
        assert kinds <= {"error", "timeout", "nonfinite", "bad-arrays", "bad-metrics"}
        if mode in ("raise", "timeout", "missing-record"):  # the evaluation fails too, and says why
            why = {"raise": "error", "timeout": "timeout", "missing-record": "bad-metrics"}[mode]
            assert all(r["missing"] == {str(BAD): why} for r in strategy.history)
            assert all(r["acc_n"] == 4 for r in strategy.history)
    else:
        assert strategy.failures == []
        assert all(r["missing"] == {} for r in strategy.history)
    if mode == "timeout":  # the server waited out its timeout, at least once a round
        assert grid.clock() - t0 >= ROUNDS * TIMEOUT
    if mode == "slow":  # and for the slow reply, at least once a round
        assert grid.clock() - t0 >= ROUNDS * SLOW
    # the model: finite and in its dtype, and so is everything the server sends
    assert grid.sent_dtypes == {"float32"}
    for k in init.keys():
        a = res.arrays[k].numpy()
        assert a.dtype == init[k].numpy().dtype and a.shape == init[k].numpy().shape, k
        assert np.all(np.isfinite(a)), k
    # the server's state: finite, λ on the simplex
    checkpoint = strategy.server_state()
    for path, value in _numbers(checkpoint["state"]):
        assert np.all(np.isfinite(value)), path
        if path.endswith(".lam") or path.endswith("['lam']"):
            _assert_on_simplex(value, path)
    for rec in strategy.history:
        if "lambda" in rec:
            _assert_on_simplex(np.array(list(rec["lambda"].values())), f"round {rec['round']} lambda")
        assert all(math.isfinite(v) for v in rec.values() if isinstance(v, float)), rec


@pytest.mark.parametrize("name", ["fedavg", "fedmgda+"])  # send_and_receive, and the streamed path
@pytest.mark.parametrize("seconds,late", [(TIMEOUT - 1.0, False), (TIMEOUT + 1.0, True)])
def test_a_train_reply_is_a_timeout_exactly_when_it_comes_after_the_round_timeout(name, seconds, late):
    rc = dict(RUN_CONFIG)
    grid = InProcessGrid(client_app, 4, rc, faults={BAD: Fault("slow", message_types=("train",), seconds=seconds)},
                         replies_per_pull=1)
    strategy = build_strategy(name, rc)
    strategy.comm.transport.pull_interval = 0.5  # simulated seconds; the slow reply is due on a whole second
    t0 = grid.clock()
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=2, timeout=TIMEOUT,
                   train_config=client_config(rc))
    expected = [(r, "train", BAD, "timeout") for r in (1, 2)] if late else []
    assert [(f.round, f.phase, f.partition_id, f.kind) for f in strategy.failures] == expected
    # the server waited for the slow client each round: its delay, or the whole timeout
    assert grid.clock() - t0 >= 2 * min(seconds, TIMEOUT)


class _SlowHostApp:
    """flowerdro's ClientApp on a host that takes ``seconds`` of wall time for every message."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, message, context):
        import time

        time.sleep(self.seconds)
        return client_app(message, context)


@pytest.mark.parametrize("name", ["fedavg", "fedmgda+"])  # send_and_receive, and the streamed path
def test_how_long_the_host_takes_never_makes_a_timeout(name):
    """A host slower than the round timeout (each reply 0.3 s of wall time, timeout 0.2 s) times nothing out:
    the grid's time is the fault model's, and this grid has no fault."""
    rc = dict(RUN_CONFIG)
    grid = InProcessGrid(_SlowHostApp(0.3), 3, rc, replies_per_pull=1)
    strategy = build_strategy(name, rc)
    t0 = grid.clock()
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=1, timeout=0.2, train_config=client_config(rc))
    assert strategy.failures == []
    assert strategy.history[0]["acc_n"] == 3
    assert grid.clock() == t0  # nobody was waited for
