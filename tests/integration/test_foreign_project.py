"""A Flower project nobody here wrote (tests/fixtures/foreign), converted as the README says, runs every
strategy through ``run_simulation`` on both APIs.

Its model has BatchNorm (an integer counter among its arrays), it trains with momentum SGD
over local epochs and names its metrics ``accuracy`` / ``val_loss``. One ``run_simulation``
per API runs all the strategies one after another (a Ray start costs seconds); the checks:
no dropped reply, every round recorded with the fairness numbers, and the results keep
the project's own metric names (the Message API's ``Result``, the legacy ``History``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from flwr.app import Context

from flowerdro.strategies import strategy_names

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "foreign"
BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}
#: One round of each strategy on two SuperNodes: every message type, reply and aggregation once (the
#: in-process tests run the rounds that follow).
ROUNDS, NODES = 1, 2

pytestmark = pytest.mark.slow


def _module(name: str):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"foreignapp.{name}")


def test_every_strategy_runs_through_run_simulation_on_the_message_api():
    from flwr.simulation import run_simulation

    app = _module("message_api")
    app.RUN_CONFIG.update({"strategies": ",".join(strategy_names()), "num-server-rounds": ROUNDS})
    app.RESULTS.clear()
    run_simulation(server_app=app.server, client_app=app.client, num_supernodes=NODES, backend_config=BACKEND)
    assert sorted(app.RESULTS) == sorted(strategy_names())
    for name, (strategy, result) in app.RESULTS.items():
        assert len(strategy.history) == ROUNDS, name
        assert not any(r["failures"] for r in strategy.history), (name, strategy.history[-1]["failures"])
        assert all("acc_worst20" in r for r in strategy.history), name
        last = result.evaluate_metrics_clientapp[ROUNDS]
        assert {"accuracy", "val_loss", "acc_mean", "acc_worst"} <= set(last.keys()), name


def test_every_strategy_runs_through_run_simulation_on_the_legacy_api():
    from flwr.server import ServerApp
    from flwr.server.compat.app import start_grid
    from flwr.simulation import run_simulation

    app = _module("legacy_api")
    histories = {}
    every = ServerApp()

    @every.main()
    def _main(grid, context: Context) -> None:
        # the project's own server_fn, once per strategy (what ServerApp(server_fn=...) does once)
        for name in strategy_names():
            ctx = Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                          state=context.state, run_config={**dict(context.run_config), "strategy": name,
                                                           "num-server-rounds": ROUNDS})
            components = app.server_fn(ctx)
            histories[name] = (start_grid(grid=grid, strategy=components.strategy, config=components.config),
                               components.strategy)

    run_simulation(server_app=every, client_app=app.client, num_supernodes=NODES, backend_config=BACKEND)
    assert sorted(histories) == sorted(strategy_names())
    for name, (history, legacy) in histories.items():
        records = legacy.history
        assert len(records) == ROUNDS and not any(r["failures"] for r in records), (name, records[-1]["failures"])
        assert [r for r, _ in history.losses_distributed] == list(range(1, ROUNDS + 1)), name  # val_loss
        assert [r for r, _ in history.metrics_distributed["accuracy"]] == list(range(1, ROUNDS + 1)), name
        assert [v for _, v in history.metrics_distributed["acc_worst"]] == [r["acc_worst"] for r in records], name
