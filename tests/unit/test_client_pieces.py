"""The pieces between a user's Flower project and flowerdro's client side.

``data_fn`` arguments filled by name, whole epochs as ints, the accuracy's key in a metrics
dict, a client error as an error reply whose text is the same on every client, what a kit
or a legacy app keeps per run, the in-process grid's order for the legacy Server's threads,
and the settings log's check of the first training message.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from torch import nn

from flowerdro.client_errors import describe, reply_errors
from flowerdro.clients import ClientKit
from flowerdro.clients.userdata import call_data_fn
from flowerdro.clients.userloop import accuracy_key, epochs_of
from flowerdro.experiments import InProcessGrid
from flowerdro.experiments.inprocess import ensure_task_identity
from flowerdro.protocol import TrainingSettings
from flowerdro.strategies.settings_log import sent_training_note


def _context(run_config: dict | None = None, run_id: int = 1, node_id: int = 7, pid: int = 0) -> Context:
    return Context(run_id=run_id, node_id=node_id, node_config={"partition-id": pid, "num-partitions": 2},
                   state=RecordDict(), run_config=dict(run_config or {}))


def _message(config: dict | None = None, mtype: str = "train") -> Message:
    ensure_task_identity()
    return Message(content=RecordDict({"config": ConfigRecord(dict(config or {}))}), dst_node_id=7,
                   message_type=mtype)


# --------------------------------------------------------------------------- data_fn
def test_data_fn_parameters_after_the_partition_are_filled_by_name():
    def quickstart(partition_id, num_partitions, batch_size):
        return partition_id, num_partitions, batch_size

    def with_default(partition_id, num_partitions, batch_size=64):
        return batch_size

    def with_context(pid, n, *, context, run_config):
        return context.node_id, run_config["k"]

    assert call_data_fn(quickstart, 1, 2, _context({"batch-size": 16})) == (1, 2, 16)
    assert call_data_fn(quickstart, 1, 2, _context()) == (1, 2, 32)  # flowerdro's loops use 32 too
    assert call_data_fn(with_default, 1, 2, _context()) == 64  # the function's own default
    assert call_data_fn(with_default, 1, 2, _context({"batch-size": 8})) == 8
    assert call_data_fn(with_context, 0, 2, _context({"k": "v"})) == (7, "v")
    assert call_data_fn(lambda pid, n: (pid, n), 3, 4, _context()) == (3, 4)


def test_a_data_fn_parameter_the_kit_cannot_fill_is_refused_when_the_kit_is_built():
    def needs_root(partition_id, num_partitions, root):
        return None

    with pytest.raises(TypeError, match=r"data_fn: parameter 'root' has no default .*batch_size .*context"):
        ClientKit(model_fn=nn.Linear, data_fn=needs_root, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match=r"data_fn: expected data_fn\(partition_id, num_partitions, \.\.\.\)"):
        ClientKit(model_fn=nn.Linear, data_fn=lambda pid: None, loss_fn=nn.CrossEntropyLoss())


# --------------------------------------------------------------------------- epochs and metric names
@pytest.mark.parametrize("message,run,expected", [
    ({"local-epochs": 1.0}, {}, (int, 1)),       # flowerdro sends local-epochs as a float
    ({}, {"local-epochs": 3}, (int, 3)),
    ({"local-epochs": 0.5}, {}, (float, 0.5)),
    ({"local-epochs": 0.0}, {"local-epochs": 2.0}, (int, 2)),  # 0 in the message: the run config's
    ({}, {}, (int, 1)),
])
def test_whole_epochs_reach_the_users_train_as_an_int(message, run, expected):
    epochs = epochs_of(_message(message), _context(run))
    assert (type(epochs), epochs) == expected
    assert list(range(epochs)) if isinstance(epochs, int) else True


def test_the_accuracy_key_comes_from_the_kit_else_the_servers_name_else_accuracy():
    assert accuracy_key({"acc": 1, "my_acc": 2}, "acc", "my_acc", "ClientKit") == "acc"
    assert accuracy_key({"my_acc": 2, "accuracy": 3}, None, "my_acc", "ClientKit") == "my_acc"
    assert accuracy_key({"accuracy": 3}, None, "my_acc", "ClientKit") == "accuracy"
    with pytest.raises(ValueError, match=r"none of \['my_acc', 'accuracy'\] .*\['acc'\].*LegacyClientApp"):
        accuracy_key({"acc": 1}, None, "my_acc", "LegacyClientApp")


# --------------------------------------------------------------------------- client errors
def _fails(x):
    raise ValueError(f"bad shape {x}")


def _wraps():
    try:
        _fails(3)
    except ValueError as exc:
        raise RuntimeError("train_fn: your function failed") from exc


def test_a_client_error_reads_the_same_on_every_client_and_locates_the_error():
    texts = []
    for _ in range(2):  # two clients failing alike
        try:
            _wraps()
        except RuntimeError as exc:
            texts.append(describe(exc))
    assert texts[0] == texts[1]
    lines = texts[0].splitlines()
    assert lines[0] == "RuntimeError: train_fn: your function failed"
    assert lines[1] == "client-side traceback (most recent call last):"
    assert "Traceback (" not in texts[0]
    # the cause's frames first, then its message, then the frames that raised the error
    assert texts[0].index("in _fails") < texts[0].index("ValueError: bad shape 3") < texts[0].rindex("in _wraps\n")


def test_a_route_that_raises_answers_with_an_error_reply():
    msg = _message()
    reply = reply_errors(msg, _context(), lambda m, c: _fails(5))
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert reply.error.reason.startswith("ValueError: bad shape 5\nclient-side traceback")
    ok = Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
    assert reply_errors(msg, _context(), lambda m, c: ok) is ok


# --------------------------------------------------------------------------- what is kept per run
def test_a_kit_reads_the_users_data_once_per_partition_and_run():
    calls = []

    def data_fn(pid, n):
        calls.append(pid)
        x = torch.randn(8, 3)
        return (x, torch.zeros(8, dtype=torch.int64)), (x, torch.zeros(8, dtype=torch.int64))

    kit = ClientKit(model_fn=lambda: nn.Linear(3, 2), data_fn=data_fn, loss_fn=nn.CrossEntropyLoss())
    for run_id in (1, 1, 2, 2, 3):
        for pid in (0, 1):
            kit.runtime(_context(run_id=run_id, pid=pid))
    assert calls == [0, 1, 0, 1, 0, 1]  # once per (run, partition): runs 1, 2, 3
    assert {k[0] for k in kit._runtimes} == {2, 3}  # the latest runs only (RUNS_KEPT = 2)


def test_a_legacy_app_builds_its_clients_once_per_node_and_run():
    from flwr.client import NumPyClient

    from flowerdro.legacy import LegacyClientApp

    built = []

    class Client(NumPyClient):
        def __init__(self):
            self.net = nn.Linear(3, 2)
            x = torch.randn(8, 3)
            self.trainloader = self.valloader = (x, torch.zeros(8, dtype=torch.int64))

    def client_fn(context):
        built.append((context.run_id, context.node_id))
        return Client()

    app = LegacyClientApp(client_fn, loss_fn=nn.CrossEntropyLoss())
    for run_id in (1, 1, 2):
        for node in (5, 6):
            app.kit(_context(run_id=run_id, node_id=node))
    assert built == [(1, 5), (1, 6), (2, 5), (2, 6)]


# --------------------------------------------------------------------------- the legacy Server's threads
def test_the_in_process_grid_runs_one_message_calls_in_the_order_it_was_given():
    ran = []

    def app(msg, ctx):
        ran.append(int(ctx.node_config["partition-id"]))
        return Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    grid = InProcessGrid(app, 4, {})
    order = [grid.node_ids[p] for p in (2, 0, 3, 1)]
    grid.run_in_order(order)
    messages = {nid: grid.create_message(RecordDict(), "train", nid, "") for nid in grid.node_ids}
    # the threads start in another order than the one given, as a thread pool's may
    threads = [threading.Thread(target=grid.send_and_receive, args=([messages[nid]],)) for nid in reversed(order)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert ran == [2, 0, 3, 1]
    assert grid._call_order == []


# --------------------------------------------------------------------------- the settings log
def test_the_settings_log_names_each_value_the_training_messages_carry_instead_of_the_setting():
    strategy = SimpleNamespace(training=TrainingSettings(lr=0.05, local_epochs=1.0), name="drfa", run_name="drfa")
    sent = [_message({"lr": 0.1, "local-steps": 10, "local-epochs": 0.0, "batch-size": 32, "weight-decay": 0.0,
                      "train-loss-on": "full"})]
    note = sent_training_note(strategy, sent, {"lr": 0.1})
    assert note == ("[drfa] the training messages carry lr = 0.1 (the train config passed to the strategy; the "
                    "setting says 0.05); local-epochs = 0.0 (drfa's own; the setting says 1.0)")
    overridden = sent_training_note(strategy, [_message({**dict(sent[0].content["config"]), "lr": 0.05})],
                                    {"lr": 0.1})
    assert "lr = 0.05 (drfa's own; the train config passed to the strategy asks for 0.1, which is not used)" in \
        overridden
    same = TrainingSettings(lr=0.1, local_epochs=0.0)
    assert sent_training_note(SimpleNamespace(training=same, name="x", run_name="x"), sent, {}) is None
