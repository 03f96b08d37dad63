"""Flower's pieces around flowerdro strategies: SecAgg+, DP accounting, error replies, the legacy History.

The strategy × piece matrix is tests/integration/test_privacy_matrix.py; here each piece's
own promise is checked against numbers computed another way.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from flowerdro.apps.client_app import app as client_app
from flowerdro.experiments import InProcessGrid
from flowerdro.experiments.inprocess import ensure_task_identity
from flowerdro.privacy import PrivacyError, central_dp
from flowerdro.strategies import RunFailedError, build_strategy, initial_arrays

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _legacy_example():
    root = EXAMPLES / "legacy-api"
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("legacyexample.client_app"), importlib.import_module("legacyexample.task")


# --------------------------------------------------------------------------- SecAgg+
def _secagg_apps(with_secagg: bool, holder: list):
    """A legacy ServerApp (FedAvg through LegacyStrategy, SecAgg+ or not) and a LegacyClientApp."""
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    from flowerdro.legacy import LegacyClientApp, LegacyStrategy

    _, task = _legacy_example()

    class Client(NumPyClient):
        def __init__(self, pid: int, n: int) -> None:
            self.net = task.Net()
            self.trainloader, self.valloader = task.load_data(pid, n)

        def evaluate(self, parameters, config):
            task.set_weights(self.net, parameters)
            loss, accuracy = task.test(self.net, self.valloader, torch.device("cpu"))
            return loss, len(self.valloader.dataset), {"accuracy": accuracy}

    def client_fn(context: Context):
        return Client(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))

    # flowerdro's own seeded SGD (use_fit=False) makes the two runs comparable number for number
    client = LegacyClientApp(client_fn, loss_fn=torch.nn.CrossEntropyLoss(), use_fit=False,
                             mods=[secaggplus_mod] if with_secagg else [])
    server = ServerApp()
    rc = {"lr": 0.1, "local-steps": 5, "batch-size": 32, "seed": 0, "fraction-evaluate": 1.0}

    @server.main()
    def _main(grid, context):
        torch.manual_seed(0)
        legacy = LegacyStrategy("fedavg", rc, num_rounds=2,
                                initial_parameters=ndarrays_to_parameters(task.get_weights(task.Net())))
        holder.append(legacy)
        ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=2), strategy=legacy)
        # every client holds 120 training examples: max_weight 150 keeps the weights n_i/max_weight near 1,
        # where SecAgg+'s 2^22 quantisation levels resolve the weighted values to ~4e-6
        fit = SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2, max_weight=150.0) if with_secagg else None
        (DefaultWorkflow(fit_workflow=fit) if fit else DefaultWorkflow())(grid, ctx)

    return server, client


def test_secagg_plus_fedavg_through_run_simulation_equals_the_run_without_it():
    """FedAvg under SecAggPlusWorkflow + secaggplus_mod (run_simulation, Ray) completes, with the SecAgg+
    stages run, and ends at the model of the same run without SecAgg+, up to SecAgg+'s quantisation."""
    from flwr.simulation import run_simulation

    held: list = []
    server, client = _secagg_apps(True, held)
    run_simulation(server_app=server, client_app=client, num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    secure = held[0]
    assert any(type(c).__name__ == "SecAggPlusWorkflow" for c in secure.strategy.guard.drivers)
    assert len(secure.history) == 2 and not any(r["failures"] for r in secure.history)

    # the same run without SecAgg+, in-process (the legacy Server and the same client app)
    plain_held: list = []
    plain_server, plain_client = _secagg_apps(False, plain_held)
    grid = InProcessGrid(plain_client, 4, {})
    grid.set_run(SimpleNamespace(run_id=1))
    plain_server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    plain = plain_held[0]
    a = [np.asarray(v) for v in _ndarrays(secure.final_parameters)]
    b = [np.asarray(v) for v in _ndarrays(plain.final_parameters)]
    # SecAgg+ quantises each value in [-8, 8] with 2^22 levels (step 3.8e-6) and the weights
    # n_i / max_weight with the same resolution; two rounds of training carry the rounding on
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True)) > 0  # it really went through SecAgg+


def _ndarrays(parameters):
    from flwr.common import parameters_to_ndarrays

    return parameters_to_ndarrays(parameters)


def test_secagg_sends_its_stages_and_sums_what_scaffold_needs_with_the_controls_on_the_clients(synth_rc):
    """SCAFFOLD with c_i on the clients under SecAgg+ (in-process): the server gets only the sums, and
    its model equals the same run without SecAgg+ (server keeping nothing per client)."""
    from flwr.client.mod import secaggplus_mod
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    from flowerdro.apps.client_app import client_app as make_app
    from flowerdro.legacy import LegacyStrategy

    rc = {**synth_rc, "control-variates-on": "client", "lr": 0.05}
    finals = []
    for secure in (True, False):
        ensure_task_identity()
        grid = InProcessGrid(make_app(mods=[secaggplus_mod] if secure else []), 4, rc)
        grid.set_run(SimpleNamespace(run_id=1))
        legacy = LegacyStrategy("scaffold", rc, num_rounds=2)
        server = ServerApp()

        @server.main()
        def _main(grid_, context, legacy=legacy, secure=secure):
            ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=2), strategy=legacy)
            # the clients report weight 1 (SCAFFOLD's means are uniform): max_weight 1 keeps SecAgg+'s
            # weight quantisation exact and its values at the full 2^22 levels over [-8, 8]
            fit = SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2, max_weight=1.0) if secure else None
            (DefaultWorkflow(fit_workflow=fit) if fit else DefaultWorkflow())(grid_, ctx)

        server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
        assert len(legacy.history) == 2 and not any(r["failures"] for r in legacy.history)
        assert not legacy.strategy.state.client_controls  # the server keeps no c_i
        finals.append(_ndarrays(legacy.final_parameters))
    for x, y in zip(*finals, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)


def test_scaffold_refuses_secagg_while_the_server_keeps_the_controls(synth_rc):
    from flowerdro.privacy import SECAGG

    strategy = build_strategy("scaffold", synth_rc)
    assert "control-variates-on" in strategy.unprotected(SECAGG)
    assert build_strategy("scaffold", {**synth_rc, "control-variates-on": "client"}).unprotected(SECAGG) is None


# --------------------------------------------------------------------------- DP accounting
@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_the_accountant_reports_the_privacy_spent_by_each_round(synth_rc, name):
    """ε after each round equals the RDP accounting of T Gaussian releases (dp-accounting, computed here)."""
    dp_accounting = pytest.importorskip("dp_accounting")
    rc = {**synth_rc, "weighting": "uniform"}
    strategy = build_strategy(name, rc)
    grid = InProcessGrid(client_app, 4, rc)
    central_dp(strategy, "server-fixed", noise_multiplier=1.5, clipping_norm=1.0, accountant=True, target_delta=1e-5)
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=3, timeout=60)
    for t, record in enumerate(strategy.history, start=1):
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(1.5), t)
        assert record["dp"]["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
        assert record["dp"]["releases"] == t and record["dp"]["noise_stdv"] == pytest.approx(1.5 * 1.0 / 4)
    assert strategy.history[0]["dp"]["epsilon"] < strategy.history[-1]["dp"]["epsilon"]


def test_the_accountant_is_refused_for_an_example_weighted_mean(synth_rc):
    strategy = build_strategy("fedavg", synth_rc)
    grid = InProcessGrid(client_app, 2, synth_rc)
    central_dp(strategy, "server-fixed", noise_multiplier=1.0, accountant=True)
    with pytest.raises(PrivacyError, match='weighting = "uniform"'):
        strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=1, timeout=60)


def test_central_dp_refuses_before_building_a_wrapper(synth_rc):
    with pytest.raises(PrivacyError, match="per-client losses L_i and gradients"):
        central_dp(build_strategy("scaffpd", synth_rc), "client-fixed", noise_multiplier=1.0)


def test_a_model_with_integer_buffers_is_refused_under_dp(synth_rc):
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    strategy = build_strategy("fedavg", synth_rc)
    grid = InProcessGrid(client_app, 2, synth_rc)
    arrays = initial_arrays(grid, synth_rc, 60)
    arrays["bn.num_batches_tracked"] = Array(np.array(0, dtype=np.int64))
    wrapper = DifferentialPrivacyServerSideFixedClipping(strategy, 1.0, 1.0, 2)
    with pytest.raises(PrivacyError, match="num_batches_tracked"):
        wrapper.start(grid, arrays, num_rounds=1)


def test_client_side_clipping_drops_a_reply_that_was_not_clipped(synth_rc):
    """A client without the clipping mod (its own train route) is caught: its unclipped update is a failure."""
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

    from flowerdro.clients import handlers

    app = ClientApp()  # trains without clipping, whatever the message asks
    app.train()(handlers.train_reply)
    app.evaluate()(lambda m, c: handlers.evaluate_reply(m, c, named=True))
    app.query("init")(handlers.init_reply)
    strategy = build_strategy("fedavg", {**synth_rc, "lr": 0.5, "max-failed-rounds": 1})
    grid = InProcessGrid(app, 2, synth_rc)
    wrapper = DifferentialPrivacyClientSideFixedClipping(strategy, 0.0, 1e-3, 2)
    with pytest.raises(RunFailedError, match="fixedclipping_mod"):
        wrapper.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=2)
    assert {f.kind for f in strategy.failures} == {"unclipped"}


# --------------------------------------------------------------------------- error replies
def _error(to: Message, reason: str = "boom") -> Message:
    return Message(Error(code=0, reason=reason), reply_to=to)


@pytest.mark.parametrize("name", ["fedavg", "qfedavg", "drfa", "scaffold", "scaffpd", "fedrobust", "drdsgd",
                                  "fedmgda+", "fedavg-pgd"])
def test_every_aggregation_survives_error_replies(synth_rc, name):
    """An error reply from a mod or the transport is a failure in aggregate_train and aggregate_evaluate."""
    grid = InProcessGrid(client_app, 3, synth_rc)
    strategy = build_strategy(name, {**synth_rc, "fraction-train": 1.0})
    init = initial_arrays(grid, synth_rc, 60)
    msgs = list(strategy.configure_train(1, init, ConfigRecord(), grid))
    replies = [grid.send_and_receive([m], timeout=60)[0] for m in msgs]
    replies[0] = _error(msgs[0], "a mod refused")
    new, _ = strategy.aggregate_train(1, replies)
    assert new is not None or name == "drdsgd"
    evals = list(strategy.configure_evaluate(1, strategy.current_arrays, ConfigRecord(), grid))
    ereplies = [_error(m, f"no content on node {m.metadata.dst_node_id}") for m in evals]
    assert strategy.aggregate_evaluate(1, ereplies) is None
    kinds = {(f.phase, f.kind) for f in strategy.failures}
    assert ("train", "error") in kinds and ("evaluate", "error") in kinds
    assert len(strategy.history) == 1  # the round was closed and recorded


@pytest.mark.parametrize("name,phase", [("drfa", "query"), ("scaffpd", "query")])
def test_the_algorithms_own_exchanges_survive_error_replies(synth_rc, name, phase):
    """DRFA's loss query and SCAFF-PD's loss/gradient query: an error reply is a failure, the round goes on."""
    from flowerdro.experiments.inprocess import Fault

    faults = {0: Fault("raise", message_types=("query",))}
    grid = InProcessGrid(client_app, 3, synth_rc, faults=faults)
    strategy = build_strategy(name, {**synth_rc, "fraction-train": 1.0})
    strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=2, timeout=60)
    assert len(strategy.history) == 2
    assert any(f.phase in (phase, "discover") and f.kind == "error" for f in strategy.failures)


def test_a_run_whose_every_evaluation_fails_stops_loudly(synth_rc):
    from flowerdro.experiments.inprocess import Fault

    faults = {k: Fault("raise", message_types=("evaluate",)) for k in range(3)}  # each names its partition
    strategy = build_strategy("drfa", {**synth_rc, "max-failed-rounds": 2})
    grid = InProcessGrid(client_app, 3, synth_rc, faults=faults)
    with pytest.raises(RunFailedError, match="no client evaluation succeeded in 2 evaluated rounds"):
        strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=5, timeout=60)
    assert len(strategy.history) == 2 and all("acc_mean" not in r for r in strategy.history)


# --------------------------------------------------------------------------- the harness
def test_each_node_gets_its_own_copy_of_the_content(synth_rc):
    """A mod that pops a config key on one node does not change what the other nodes receive."""
    seen = []

    def popping_mod(msg, ctx, call_next):
        seen.append("server-round" in msg.content["config"])
        msg.content["config"].pop("server-round", None)
        return call_next(msg, ctx)

    from flowerdro.clients import handlers

    app = ClientApp(mods=[popping_mod])
    app.query("init")(handlers.init_reply)
    grid = InProcessGrid(app, 3, synth_rc)
    shared = RecordDict({"config": ConfigRecord({"server-round": 1, "weights": False})})
    msgs = [Message(content=shared, dst_node_id=n, message_type="query.init") for n in grid.node_ids]
    grid.send_and_receive(msgs, timeout=60)
    assert seen == [True, True, True]


# --------------------------------------------------------------------------- legacy History
def test_the_legacy_history_holds_the_distributed_losses_and_metrics_of_every_round(synth_rc):
    """A 3-round LegacyStrategy run fills the History where Flower's FedAvg does."""
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig

    from flowerdro.legacy import LegacyStrategy

    captured = {}
    legacy = LegacyStrategy("drfa", synth_rc, num_rounds=3)
    original = legacy.aggregate_evaluate

    def spy(*a):
        out = original(*a)
        captured.setdefault("evals", []).append(out)
        return out

    legacy.aggregate_evaluate = spy
    from flwr.server.compat import app as compat_app

    hist_holder = []
    real = compat_app.run_fl

    def run_fl(server, config):
        hist = real(server=server, config=config)
        hist_holder.append(hist)
        return hist

    compat_app.run_fl = run_fl
    try:
        server = ServerApp(server_fn=lambda ctx: ServerAppComponents(strategy=legacy, config=ServerConfig(3)))
        grid = InProcessGrid(client_app, 3, synth_rc)
        grid.set_run(SimpleNamespace(run_id=1))
        server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=synth_rc))
    finally:
        compat_app.run_fl = real
    hist = hist_holder[0]
    assert [r for r, _ in hist.losses_distributed] == [1, 2, 3]
    assert [r for r, _ in hist.metrics_distributed["acc_worst20"]] == [1, 2, 3]
    assert all(len(rec["client_acc"]) == 3 for rec in legacy.history)
    # the last round's distributed loss: the example-weighted mean of the clients' test losses (as FedAvg's)
    latest = legacy.strategy.client_metrics
    n = {p: m["num-examples"] for p, m in latest.items()}
    expected = sum(n[p] * latest[p]["test_loss"] for p in n) / sum(n.values())
    assert hist.losses_distributed[-1][1] == pytest.approx(expected, rel=1e-12)
    assert [v for _, v in hist.metrics_distributed["acc_worst"]] == [r["acc_worst"] for r in legacy.history]
    assert "test_acc" in hist.metrics_distributed  # the clients' own metric, example-weighted


# --------------------------------------------------------------------------- the data-size line
def test_the_first_round_logs_the_data_each_client_holds(synth_rc, caplog):
    import logging

    strategy = build_strategy("fedavg", synth_rc)
    grid = InProcessGrid(client_app, 3, synth_rc)
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=2, timeout=60)
    lines = [r.getMessage() for r in caplog.records if "data: train examples" in r.getMessage()]
    assert len(lines) == 1  # once, after the first round
    sizes = strategy.data_sizes.by_phase["train"]
    assert f"min {min(sizes.values())}" in lines[0] and f"max {max(sizes.values())}" in lines[0]
    median = float(np.median(list(sizes.values())))
    assert f"median {median:g}" in lines[0] and "over 3 partitions" in lines[0]
    assert math.isfinite(median)


def test_the_server_apps_run_config_wraps_every_strategy_in_central_dp(synth_rc, tmp_path):
    """dp = "server-fixed" in the run config: the runs carry their DP numbers; a strategy it cannot protect is
    refused before any message, naming the key's wrapper."""
    from flowerdro.apps.server_app import run_strategies

    rc = {**synth_rc, "dp": "server-fixed", "dp-noise-multiplier": 0.5, "dp-clipping-norm": 2.0,
          "weighting": "uniform", "dp-accountant": True, "num-rounds": 2, "output-dir": str(tmp_path / "ok")}
    grid = InProcessGrid(client_app, 3, rc)
    comparison = run_strategies(grid, {**rc, "strategies": "fedavg,fedprox"})
    for label in ("fedavg", "fedprox"):
        records = comparison.histories[label][0]
        assert [r["dp"]["releases"] for r in records] == [1, 2]
        assert records[0]["dp"]["noise_stdv"] == pytest.approx(0.5 * 2.0 / 3)
    with pytest.raises(PrivacyError, match="DifferentialPrivacyServerSideFixedClipping"):
        run_strategies(grid, {**rc, "strategies": "fedavg,drfa", "output-dir": str(tmp_path / "refused")})
    assert not (tmp_path / "refused").exists()  # refused before the first run began
