"""The round loop against in-process clients: loud failure, missing routes, tolerant aggregation,
partition identity, and fairness numbers that say who is missing."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from flowerdro.apps.client_app import app as client_app
from flowerdro.clients import handlers
from flowerdro.comparison import client_config
from flowerdro.experiments import Fault, InProcessGrid
from flowerdro.strategies import RunFailedError, build_strategy, initial_arrays
from flowerdro.strategies.replies import DeterministicClientError


def _run(name: str, rc: dict, grid: InProcessGrid, rounds: int = 3):
    strategy = build_strategy(name, rc)
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=rounds, timeout=60,
                   train_config=client_config(rc))
    return strategy


def _app_without_training() -> ClientApp:
    """A user's ClientApp that serves evaluation and the initial model but no flowerdro training route."""
    app = ClientApp()
    app.evaluate()(handlers.evaluate_reply)
    app.query("init")(handlers.init_reply)
    app.query("loss")(handlers.loss_reply)
    return app


@pytest.mark.parametrize("name,route", [("fedavg", "'train'"), ("drfa", "'train.drfa'"),
                                        ("scaffold", "'train.scaffold'")])
def test_clients_without_the_route_fail_the_run_in_the_first_round_naming_it(synth_rc, name, route, caplog):
    grid = InProcessGrid(_app_without_training(), 4, synth_rc)
    strategy = build_strategy(name, {**synth_rc, "max-failed-rounds": 3})
    with pytest.raises(DeterministicClientError) as err:
        strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=10, timeout=60,
                       train_config=client_config(synth_rc))
    # every client lacks the route alike: a programming error, so the run stops in round 1, not round 3
    assert strategy.round.number == 1 and not strategy.history
    assert route in str(err.value) and "add_routes" in str(err.value)
    # the client's error text is logged in full once, the other clients' drops refer to it
    full = [r for r in caplog.records if "registered with name" in r.getMessage()]
    assert len(full) == 1


def test_an_error_only_some_clients_raise_fails_the_run_after_max_failed_rounds(synth_rc):
    faults = {k: Fault("raise", message_types=("train",)) for k in range(4)}  # each names its partition
    strategy = build_strategy("fedavg", {**synth_rc, "max-failed-rounds": 3})
    grid = InProcessGrid(client_app, 4, synth_rc, faults=faults)
    with pytest.raises(RunFailedError) as err:
        strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=10, timeout=60,
                       train_config=client_config(synth_rc))
    assert not isinstance(err.value, DeterministicClientError)
    assert len(strategy.history) == 3


def test_one_failing_round_does_not_stop_the_run(synth_rc):
    faults = {k: Fault("raise", message_types=("train",), rounds=(2,)) for k in range(4)}
    strategy = _run("fedavg", {**synth_rc, "max-failed-rounds": 2}, InProcessGrid(client_app, 4, synth_rc,
                                                                                  faults=faults), rounds=4)
    assert [bool(r["failures"]) for r in strategy.history] == [False, True, False, False]


def test_the_full_client_error_reaches_the_failure_record(synth_rc):
    long_reason = "x" * 1000

    app = ClientApp()

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        raise RuntimeError(long_reason)

    app.evaluate()(handlers.evaluate_reply)
    app.query("init")(handlers.init_reply)
    strategy = build_strategy("fedavg", {**synth_rc, "max-failed-rounds": 5})
    grid = InProcessGrid(app, 2, synth_rc)
    with pytest.raises(DeterministicClientError) as err:
        strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=1, timeout=60)
    assert long_reason in str(err.value)
    assert len(strategy.failures) == 2 and all(long_reason in f.reason for f in strategy.failures)


def _app_with_extra_metric(partition: int) -> ClientApp:
    """flowerdro's ClientApp, except that one partition reports one more training metric."""
    app = ClientApp()

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        reply = handlers.train_reply(msg, context)
        if int(context.node_config["partition-id"]) == partition:
            mr = reply.content["metrics"]
            reply.content["metrics"] = MetricRecord({**dict(mr), "extra": 1.0})
        return reply

    app.evaluate()(handlers.evaluate_reply)
    app.query("init")(handlers.init_reply)
    return app


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "qfedavg"])
def test_one_client_with_an_extra_metric_does_not_abort_flowers_strategies(synth_rc, name):
    rc = {**synth_rc, "q": 0.5}
    plain = _run(name, rc, InProcessGrid(client_app, 4, rc))
    extra = _run(name, rc, InProcessGrid(_app_with_extra_metric(2), 4, rc))
    # the extra metric is left out; everything else is what the plain run computed
    assert [r["acc_mean"] for r in extra.history] == [r["acc_mean"] for r in plain.history]
    assert not any(r["failures"] for r in extra.history)


def test_q_fedavg_keeps_the_models_dtype(synth_rc):
    grid = InProcessGrid(client_app, 4, synth_rc)
    strategy = build_strategy("qfedavg", {**synth_rc, "q": 1.0})
    res = strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=3, timeout=60)
    assert {res.arrays[k].numpy().dtype for k in res.arrays.keys()} == {np.dtype(np.float32)}
    # every round sends the same float32 bytes (a float64 model would double them)
    assert len({r["bytes_sent"] for r in strategy.history}) == 1


def test_a_partition_that_does_not_evaluate_is_listed_as_missing_with_the_reason(synth_rc):
    faults = {2: Fault("raise", message_types=("evaluate",), rounds=(2,))}
    strategy = _run("fedavg", synth_rc, InProcessGrid(client_app, 5, synth_rc, faults=faults))
    assert [r["missing"] for r in strategy.history] == [{}, {"2": "error"}, {}]
    assert [r["acc_n"] for r in strategy.history] == [5, 4, 5]
    assert "2" not in strategy.history[1]["client_acc"]


class _RestartingGrid(InProcessGrid):
    """Partition ``restart`` goes away after round ``down`` and comes back on a new node id after ``up``."""

    def __init__(self, *args, restart: int, down: int, up: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.restart, self.down, self.up = restart, down, up
        self.old_id = self.node_ids[restart]
        self.new_id = self.old_id + 1_000_000

    def on_round(self, rnd: int) -> None:
        if rnd == self.down + 1:
            self.disconnect(self.restart)
        if rnd == self.up + 1:
            self.reconnect(self.restart, self.new_id, keep_state=True)


def test_a_restarted_node_takes_its_partitions_place_and_the_gap_is_reported(synth_rc):
    grid = _RestartingGrid(client_app, 4, synth_rc, restart=1, down=1, up=2)
    strategy = build_strategy("fedavg", synth_rc)
    strategy.add_round_callback(lambda rec: grid.on_round(rec["round"] + 1))
    strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=4, timeout=60)
    missing = [r["missing"] for r in strategy.history]
    assert missing == [{}, {"1": "node gone"}, {}, {}]
    assert [sorted(r["client_acc"]) for r in strategy.history][2:] == [["0", "1", "2", "3"]] * 2
    assert strategy.partition(grid.new_id) == 1 and strategy.partition(grid.old_id) is None


# --------------------------------------------------------------------------- crash and resume
def _experiment(name: str, rc: dict, root, rounds: int = 4) -> dict:
    return {"name": "resume", "num-rounds": rounds, "seeds": [0], "num-partitions": 4,
            "strategies": [name], "run-config": {**rc, "checkpoint-every": 1, "fraction-train": 0.5},
            "output-root": str(root)}


@pytest.mark.parametrize("name", ["fedavg", "qfedavg"])
def test_a_run_resumed_after_a_crash_equals_an_uninterrupted_run(synth_rc, tmp_path, name, crash_and_resume):
    from flowerdro.runs import load_records

    crash_and_resume(name, lambda root: _experiment(name, synth_rc, root))

    on_disk = load_records(tmp_path / "cut" / "resume" / name / "seed0")
    assert [r["round"] for r in on_disk] == [1, 2, 3, 4]


def test_a_folder_holding_another_run_is_refused_unless_overwritten(synth_rc, tmp_path):
    from flowerdro.experiments import run

    run(_experiment("fedavg", synth_rc, tmp_path, rounds=1), verbose=False)
    other = _experiment("fedavg", {**synth_rc, "lr": 0.1}, tmp_path, rounds=1)
    with pytest.raises(ValueError, match="output-dir: .* holds another run .*lr"):
        run(other, verbose=False)
    run({**other, "overwrite": True}, verbose=False)
    run(other, verbose=False)  # the same run again: started afresh


@pytest.mark.parametrize("cap,expected", [(4, 4), (0, 9), (20, 9)])
def test_evaluate_sample_caps_the_evaluated_clients_and_the_fairness_numbers_say_how_many(synth_rc, cap, expected):
    # 9 clients, fraction-evaluate = 1: a cap of 4 asks 4 distinct clients per round; 0 (no cap)
    # and a cap above N ask all 9. acc_n counts the clients the fairness numbers were computed over.
    grid = InProcessGrid(client_app, 9, synth_rc)
    strategy = _run("fedavg", {**synth_rc, "evaluate-sample": cap}, grid, rounds=2)
    for rec in strategy.history:
        assert rec["acc_n"] == expected
        assert len(rec["client_acc"]) == expected
        assert rec["missing"] == {}


# --------------------------------------------------------------------------- operator faults: nodes
def _add_node(grid: InProcessGrid, node_id: int, partition: int, num_partitions: int) -> None:
    """One more node on the grid whose node config says ``partition-id`` / ``num-partitions`` (a misconfigured SuperNode)."""
    from flwr.app import RecordDict as _RD

    grid.node_ids.append(node_id)
    grid.partition_of_node[node_id] = partition
    grid.contexts[node_id] = Context(run_id=1, node_id=node_id, state=_RD(), run_config=dict(grid.run_config),
                                     node_config={"partition-id": partition, "num-partitions": num_partitions})


def test_a_second_node_for_a_live_partition_and_one_out_of_range_are_refused_by_name(synth_rc, caplog):
    grid = InProcessGrid(client_app, 3, synth_rc)
    _add_node(grid, 777, 0, 3)     # partition 0 again, while its node is connected
    _add_node(grid, 888, 7, 3)     # partition 7 of 3
    strategy = _run("drfa", synth_rc, grid, rounds=2)
    assert len(strategy.history) == 2 and not any(r["failures"] for r in strategy.history)
    for rec in strategy.history:
        assert set(rec["refused"]) == {"777", "888"}
        assert f"partition 0 is served by node {grid.node_ids[0]}" in rec["refused"]["777"]
        assert "outside 0..2" in rec["refused"]["888"]
        assert sorted(rec["client_acc"]) == ["0", "1", "2"] and rec["missing"] == {}
    assert strategy.comm.roster.node_to_partition[grid.node_ids[0]] == 0  # partition 0 never moved
    assert not any("moved from node" in r.getMessage() for r in caplog.records)
    # the refused nodes got nothing but the roll call
    refused_calls = {nid: grid.seconds_per_node.get(nid, 0.0) for nid in (777, 888)}
    assert all(t >= 0 for t in refused_calls.values())


def test_a_refused_second_node_takes_the_partition_when_its_holder_leaves(synth_rc):
    grid = InProcessGrid(client_app, 3, synth_rc)
    _add_node(grid, 777, 1, 3)
    strategy = build_strategy("fedavg", synth_rc)
    init = initial_arrays(grid, synth_rc, 60)

    def leave_after_round_one(record):
        if record["round"] == 1:
            grid.disconnect(1)  # the holder of partition 1 dies

    strategy.add_round_callback(leave_after_round_one)
    strategy.start(grid, init, num_rounds=3, timeout=60)
    assert "777" in strategy.history[0]["refused"]
    assert "refused" not in strategy.history[2] and strategy.comm.roster.node_to_partition[777] == 1
    assert sorted(strategy.history[2]["client_acc"]) == ["0", "1", "2"]


def test_a_node_that_returns_mid_round_is_listed_as_missing(synth_rc):
    """Every known partition is accounted for in every round, also one whose node came back after the
    round's evaluate messages went out."""
    grid = InProcessGrid(client_app, 3, synth_rc)
    strategy = build_strategy("fedavg", synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    original = strategy.evaluate_messages

    def evaluate_messages(rnd, arrays, config, grid_):
        msgs = list(original(rnd, arrays, config, grid_))
        if rnd == 2:
            grid.reconnect(2, 4242, keep_state=False)  # back under a new id, after the messages were built
        return msgs

    def leave(record):
        if record["round"] == 1:
            grid.disconnect(2)

    strategy.evaluate_messages = evaluate_messages
    strategy.add_round_callback(leave)
    strategy.start(grid, init, num_rounds=3, timeout=60)
    second = strategy.history[1]
    assert sorted(second["client_acc"]) == ["0", "1"] and second["acc_n"] == 2
    assert second["missing"] == {"2": "joined late"}
    assert sorted(strategy.history[2]["client_acc"]) == ["0", "1", "2"] and strategy.history[2]["missing"] == {}
