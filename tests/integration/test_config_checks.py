"""Node configs and run configs checked on the server before any training message, naming the
key, the value and what is allowed (in-process clients; a recording grid for the ServerApp)."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app import RecordDict as _RD

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import client_config
from flowerdro.experiments import InProcessGrid, run
from flowerdro.strategies import build_strategy, initial_arrays
from flowerdro.validation import NODE_CONFIG_RECORD, check_node_config, roll_call_problem


def _add_node(grid: InProcessGrid, node_id: int, node_config: dict) -> None:
    """One more node on the grid with its own node config (a misconfigured SuperNode)."""
    grid.node_ids.append(node_id)
    grid.partition_of_node[node_id] = -1
    grid.contexts[node_id] = Context(run_id=1, node_id=node_id, state=_RD(), run_config=dict(grid.run_config),
                                     node_config=node_config)


def _recording(grid: InProcessGrid) -> list[tuple[int, str]]:
    """(node id, message type) of every message the grid delivers, in order."""
    sent: list[tuple[int, str]] = []
    deliver = grid._deliver

    def recorded(msg: Message):
        sent.append((int(msg.metadata.dst_node_id), msg.metadata.message_type))
        return deliver(msg)

    grid._deliver = recorded
    return sent


@pytest.mark.parametrize("node_config,reason", [
    ({"partition-id": "abc", "num-partitions": 3}, "its node config: partition-id: expected an integer, got 'abc'"),
    ({"partition-id": 1.5, "num-partitions": 3}, "its node config: partition-id: expected an integer, got 1.5"),
    ({"partition-id": 1, "num-partitions": "three"},
     "its node config: num-partitions: expected an integer, got 'three'"),
    ({"partition-id": -1, "num-partitions": 3}, "its node config: partition-id: must be >= 0, got -1"),
    ({"partition-id": 5, "num-partitions": 3}, "its node config: partition-id 5 is outside 0..2 (num-partitions = 3)"),
])
def test_a_bad_node_config_is_refused_at_the_roll_call_naming_the_key(synth_rc, node_config, reason):
    grid = InProcessGrid(client_app, 3, synth_rc)
    _add_node(grid, 999, node_config)
    sent = _recording(grid)
    strategy = build_strategy("drfa", synth_rc)
    strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=2, timeout=60,
                   train_config=client_config(synth_rc))
    for rec in strategy.history:
        assert rec["refused"] == {"999": reason}
        assert not rec["failures"] and sorted(rec["client_acc"]) == ["0", "1", "2"]
    # the node got the roll call and nothing else: no training, query or evaluate message
    assert {t for n, t in sent if n == 999} == {"query.init"}, sent


def test_the_roll_call_checks_a_nodes_num_partitions_against_the_data_keys():
    rc = {"dataset": "fashion_mnist", "partition": "one-class"}
    reply = Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 5, "partition-id": 3,
                                                                 "num-partitions": 12})}),
                    dst_node_id=0, message_type="query.init")
    why = roll_call_problem(reply, rc)
    assert why == ("its node config's num-partitions = 12 does not suit the run config: num-partitions: partition "
                   "'one-class' needs num-partitions <= num_classes, got 12 > 10 for dataset 'fashion_mnist'")
    ok = Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 5, "partition-id": 3,
                                                              "num-partitions": 10})}),
                 dst_node_id=0, message_type="query.init")
    assert roll_call_problem(ok, rc) is None
    raw = Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 0}),
                                      NODE_CONFIG_RECORD: ConfigRecord({"partition-id": "abc"})}),
                  dst_node_id=0, message_type="query.init")
    assert roll_call_problem(raw) == "its node config: partition-id: expected an integer, got 'abc'"


def test_a_node_config_is_read_as_its_settings_class_reads_it():
    assert check_node_config({"partition-id": "2", "num-partitions": 4}).partition_id == 2
    assert check_node_config({}).partition_id is None  # a ClientKit node may leave it unset
    with pytest.raises(ValueError, match="partition-id: expected an integer, got True"):
        check_node_config({"partition-id": True, "num-partitions": 4})


class _NoMessages:
    """A grid that fails the test if the server sends anything through it."""

    def get_node_ids(self):
        return [1, 2]

    def __getattr__(self, name):
        raise AssertionError(f"the server used the grid ({name}) before refusing the run config")


@pytest.mark.parametrize("rc,error", [
    ({"partition": "iid"}, "partition: 'iid' is not available for dataset 'synthetic'; allowed: natural"),
    ({"model": "cnn_mnist"}, "model: 'cnn_mnist' cannot be used with dataset 'synthetic' (its inputs are not "
                             "images); allowed for synthetic: logreg, mlp"),
    ({"dataset": "robust_regression", "model": "logreg"},
     "model: 'logreg' cannot be used with dataset 'robust_regression' (a regression data set needs a model with "
     "one output); allowed for robust_regression: linear"),
    ({"dataset": "adult", "partition": "domain", "num-partitions": 3},
     "num-partitions: must be 2 for the adult PhD / non-PhD domain partition"),
    ({"dirichlet-alpha": "x"}, "dirichlet-alpha: expected a number, got 'x'"),
])
def test_the_serverapp_refuses_a_run_config_the_clients_cannot_build_before_any_message(tmp_path, rc, error):
    from flowerdro.apps.server_app import run_strategies

    config = {"strategies": "fedavg", "num-rounds": 1, "output-dir": str(tmp_path / "out"), **rc}
    with pytest.raises(ValueError) as err:
        run_strategies(_NoMessages(), config)
    assert error in str(err.value)
    assert not (tmp_path / "out").exists()


def test_the_experiments_runner_refuses_it_before_any_message(tmp_path):
    experiment = {"name": "bad", "num-rounds": 1, "seeds": [0], "num-partitions": 3, "strategies": ["fedavg"],
                  "run-config": {"dataset": "synthetic", "partition": "iid"}, "output-root": str(tmp_path)}
    with pytest.raises(ValueError, match="partition: 'iid' is not available for dataset 'synthetic'"):
        run(experiment, verbose=False)
    assert not (tmp_path / "bad").exists()
