"""A chain of wrappers hides nothing: Flower's privacy pieces are found however they are stacked.

A user's pass-through Strategy (one that holds another and forwards each method, as a
logging wrapper does) between Flower's central-DP wrapper and a flowerdro strategy, and
two wrappers nested in either order, on the Message API and on the legacy API (Flower's
legacy ``Server`` and workflows around :class:`flowerdro.legacy.LegacyStrategy`). A
strategy whose clients send what the piece cannot protect is refused before any
message, naming the piece; a strategy that composes runs with the protection applied
(every training reply clipped to the C the wrapper sends).
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
from flwr.app import Context, RecordDict
from flwr.client import mod as legacy_mods
from flwr.clientapp import mod as msg_mods
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server import strategy as legacy_api
from flwr.serverapp import strategy as msg_api
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from flowerdro import wrappers
from flowerdro.experiments import InProcessGrid
from flowerdro.privacy import PrivacyError
from flowerdro.strategies import build_strategy, initial_arrays

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ROUNDS, NODES, C = 2, 4, 0.05
RC = {"lr": 0.5, "local-epochs": 1, "local-steps": 5, "batch-size": 32, "max-failed-rounds": 1, "seed": 0}
#: What each refused strategy sends that central DP cannot protect (its own declaration names it).
REFUSED = {"drfa": "per-client losses", "qfedavg": "per-client losses F_k", "scaffold": "control variates"}


def _example(folder: str, package: str):
    root = EXAMPLES / folder
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"{package}.client_app"), importlib.import_module(f"{package}.task")


class Grid(InProcessGrid):
    """The in-process grid, remembering each delivered message's type and each training update's norm."""

    def _deliver(self, msg):  # noqa: D102
        mtype = msg.metadata.message_type
        for ins in ("fitins.config", "evaluateins.config"):
            cfg = msg.content.config_records.get(ins)
            if cfg is not None:
                mtype = str(cfg.get("flowerdro.type", mtype))
        self.sent.append(mtype)
        sent = _arrays(msg, "arrays", "fitins.parameters")
        cfg = msg.content.config_records.get("config") or msg.content.config_records.get("fitins.config") or {}
        reply, elapsed = super()._deliver(msg)
        if sent is not None and reply is not None and not reply.has_error() and mtype.startswith("train"):
            got = _arrays(reply, "arrays", "fitres.parameters")
            norm = math.sqrt(sum(float(((b - a) ** 2).sum()) for a, b in zip(sent, got[:len(sent)], strict=True)))
            self.updates.append((norm, float(cfg.get(KEY_CLIPPING_NORM, math.inf))))
        return reply, elapsed


def _arrays(msg, *names):
    for name in names:
        rec = msg.content.array_records.get(name)
        if rec is not None:
            return [np.asarray(rec[k].numpy(), dtype=np.float64) for k in rec.keys()]
    return None


def _grid(app, rc) -> Grid:
    grid = Grid(app, NODES, rc)
    grid.sent, grid.updates = [], []
    grid.set_run(SimpleNamespace(run_id=1))
    return grid


# --------------------------------------------------------------------------- a user's pass-through wrappers
class PassThrough(msg_api.Strategy):
    """A user's logging wrapper on the Message API: holds a strategy (under a name of its own) and forwards."""

    def __init__(self, inner) -> None:
        self._wrapped = inner
        self.calls: list[str] = []

    def summary(self):  # noqa: D102
        self.calls.append("summary")
        return self._wrapped.summary()

    def configure_train(self, server_round, arrays, config, grid):  # noqa: D102
        self.calls.append("configure_train")
        return self._wrapped.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):  # noqa: D102
        self.calls.append("aggregate_train")
        return self._wrapped.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round, arrays, config, grid):  # noqa: D102
        return self._wrapped.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):  # noqa: D102
        return self._wrapped.aggregate_evaluate(server_round, replies)


class LegacyPassThrough(legacy_api.Strategy):
    """The same on the legacy API (``flwr.server.strategy.Strategy``)."""

    def __init__(self, inner) -> None:
        self._wrapped = inner

    def initialize_parameters(self, client_manager):  # noqa: D102
        return self._wrapped.initialize_parameters(client_manager)

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: D102
        return self._wrapped.configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):  # noqa: D102
        return self._wrapped.aggregate_fit(server_round, results, failures)

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: D102
        return self._wrapped.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: D102
        return self._wrapped.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round, parameters):  # noqa: D102
        return self._wrapped.evaluate(server_round, parameters)


def _dp(module, piece: str, inner):
    """Flower's central-DP wrapper ``piece`` (noise 0, clipping norm C) around ``inner``."""
    side, clipping = piece.split("-")
    cls = getattr(module, f"DifferentialPrivacy{side.capitalize()}Side{clipping.capitalize()}Clipping")
    norm = {"clipping_norm": C} if clipping == "fixed" else {"initial_clipping_norm": C}
    return cls(inner, noise_multiplier=0.0, num_sampled_clients=NODES, **norm)


#: Chains around the strategy, outermost first: "dp" is Flower's wrapper, "pt" a pass-through.
CHAINS = (("dp", "pt"), ("dp", "pt", "pt"), ("pt", "dp", "pt"))


def _chain(module, wrapper_cls, chain, piece, strategy):
    outer = strategy
    for kind in reversed(chain):
        outer = _dp(module, piece, outer) if kind == "dp" else wrapper_cls(outer)
    return outer


# --------------------------------------------------------------------------- Message API
def _message_api_run(name: str, piece: str, chain: tuple[str, ...], client_mods: list):
    _, task = _example("message-api", "msgexample")
    from flowerdro.clients import ClientKit

    kit = ClientKit(model_fn=task.Net, data_fn=task.load_data, loss_fn=torch.nn.CrossEntropyLoss(),
                    train_fn=lambda net, loader, a: task.train(net, loader, a.epochs, a.lr, a.device),
                    test_fn=task.test)
    grid = _grid(kit.client_app(mods=client_mods), RC)
    strategy = build_strategy(name, RC)
    init = initial_arrays(grid, RC, 60)
    grid.sent.clear()
    outer = _chain(msg_api, PassThrough, chain, piece, strategy)
    return grid, strategy, lambda: outer.start(grid, init, num_rounds=ROUNDS, timeout=60)


@pytest.mark.parametrize("chain", CHAINS, ids="-".join)
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_message_api_refuses_through_a_chain_of_wrappers(name, chain):
    grid, strategy, run = _message_api_run(name, "server-fixed", chain, [])
    with pytest.raises(PrivacyError, match="DifferentialPrivacyServerSideFixedClipping") as err:
        run()
    assert REFUSED[name] in str(err.value)
    assert grid.sent == []  # not even the roll call
    assert not strategy.history


@pytest.mark.parametrize("chain", CHAINS, ids="-".join)
def test_message_api_client_side_clipping_through_a_pass_through_runs_fedavg_clipped(chain):
    grid, strategy, run = _message_api_run("fedavg", "client-fixed", chain, [msg_mods.fixedclipping_mod])
    run()
    assert len(strategy.history) == ROUNDS and not any(r["failures"] for r in strategy.history)
    assert any(type(d).__name__ == "DifferentialPrivacyClientSideFixedClipping" for d in strategy.guard.drivers)
    assert len(grid.updates) == ROUNDS * NODES
    assert all(norm <= limit * (1 + 1e-4) for norm, limit in grid.updates), grid.updates


# --------------------------------------------------------------------------- legacy API
def _legacy_run(name: str, piece: str, chain: tuple[str, ...], client_mods: list, *, secagg: bool = False):
    client, task = _example("legacy-api", "legacyexample")
    from flwr.common import ndarrays_to_parameters

    from flowerdro.legacy import LegacyClientApp, LegacyStrategy

    app = LegacyClientApp(client.client_fn, loss_fn=torch.nn.CrossEntropyLoss(), mods=client_mods)
    rc = dict(RC)
    grid = _grid(app, rc)
    torch.manual_seed(0)
    legacy = LegacyStrategy(name, rc, num_rounds=ROUNDS,
                            initial_parameters=ndarrays_to_parameters(task.get_weights(task.Net())))
    outer = _chain(legacy_api, LegacyPassThrough, chain, piece, legacy)
    if secagg:
        from flwr.server import LegacyContext
        from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

        server = ServerApp()

        @server.main()
        def _main(grid_, context):
            ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=ROUNDS), strategy=outer)
            DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2))(grid_, ctx)
    else:
        server = ServerApp(server_fn=lambda ctx: ServerAppComponents(strategy=outer,
                                                                     config=ServerConfig(num_rounds=ROUNDS)))
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
    return grid, legacy.strategy, lambda: server(grid, context)


@pytest.mark.parametrize("chain", CHAINS, ids="-".join)
@pytest.mark.parametrize("name", ["drfa", "scaffold"])
def test_legacy_api_refuses_through_a_chain_of_wrappers_instead_of_crashing(name, chain):
    grid, strategy, run = _legacy_run(name, "server-fixed", chain, [])
    with pytest.raises(PrivacyError, match="DifferentialPrivacyServerSideFixedClipping") as err:
        run()
    assert REFUSED[name] in str(err.value)
    assert not any(t.startswith("train") for t in grid.sent)
    assert not strategy.history


def test_legacy_api_refuses_drfa_under_secagg_through_a_pass_through():
    grid, strategy, run = _legacy_run("drfa", "server-fixed", ("pt",), [legacy_mods.secaggplus_mod], secagg=True)
    with pytest.raises(PrivacyError, match="SecAggPlusWorkflow") as err:
        run()
    assert "per-client losses" in str(err.value)
    assert not any(t.startswith("train") for t in grid.sent)


@pytest.mark.parametrize("chain", [("dp", "pt"), ("pt", "dp", "pt")], ids="-".join)
def test_legacy_api_client_side_clipping_through_a_pass_through_runs_fedavg_clipped(chain):
    grid, strategy, run = _legacy_run("fedavg", "client-fixed", chain, [legacy_mods.fixedclipping_mod])
    run()
    assert len(strategy.history) == ROUNDS and not any(r["failures"] for r in strategy.history)
    assert len(grid.updates) == ROUNDS * NODES
    assert all(norm <= limit * (1 + 1e-4) for norm, limit in grid.updates), grid.updates


# --------------------------------------------------------------------------- the contract of drivers()
def test_drivers_are_the_callers_outermost_first_without_the_skipped():
    """``drivers()`` names the Strategies whose methods are running above the call, each once."""
    seen = []

    class Leaf(msg_api.Strategy):
        def summary(self):  # noqa: D102
            seen.append(wrappers.drivers(skip=[self]))

        configure_train = aggregate_train = configure_evaluate = aggregate_evaluate = None

    leaf = Leaf()
    middle = PassThrough(leaf)
    top = _dp(msg_api, "server-fixed", middle)
    top.summary()
    assert [type(d).__name__ for d in seen[0]] == ["DifferentialPrivacyServerSideFixedClipping", "PassThrough"]
    assert seen[0][0] is top and seen[0][1] is middle
    assert wrappers.dp_kind(top) == ("server", "fixed") and wrappers.dp_kind(middle) is None
