"""Every strategy under every privacy piece of Flower: the algorithm with the protection applied, or a refusal.

One parametrised test runs each registered strategy under each of Flower's pieces, on the
Message API and on the legacy API, with the example projects' own models and data
(examples/): the four central-DP wrappers (server- and client-side, fixed and adaptive
clipping), ``LocalDpMod`` on the clients, and SecAgg+ (legacy API). It accepts exactly two
outcomes, and which one must happen is what :func:`flowerdro.strategies.registry.composes` declares
(so the docs' table, generated from the same declaration, cannot drift from what runs):

(a) the run goes on: the algorithm's own message types were sent, the wrapper's
    aggregation ran every round, the noise being zero, every round's model moved by at most
    the clipping norm C (the updates, about 10·C unclipped, were clipped), and the round
    records with the fairness numbers exist;
(b) a :class:`~flowerdro.privacy.PrivacyError` before any message of the strategy (before
    any training message for client mods, which the server learns at the roll call),
    naming the piece and what it cannot protect.
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
from flwr.server import strategy as legacy_dp
from flwr.serverapp import strategy as msg_dp
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from flowerdro.experiments import InProcessGrid
from flowerdro.privacy import CENTRAL_DP, LOCAL_DP, SECAGG, PrivacyError
from flowerdro.strategies import build_strategy, initial_arrays, strategy_names
from flowerdro.strategies.registry import ALGORITHMS, composes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ROUNDS, NODES, C = 2, 4, 0.05
#: lr large enough that every unclipped update is far above C (checked below).
RC = {"lr": 0.5, "local-epochs": 1, "local-steps": 5, "batch-size": 32, "max-failed-rounds": 1,
      "clients-per-round": NODES, "seed": 0}
MSG_PIECES = ("server-fixed", "server-adaptive", "client-fixed", "client-adaptive", "local-dp")
LEGACY_PIECES = (*MSG_PIECES, "secagg+")
MECHANISM = {p: CENTRAL_DP for p in MSG_PIECES[:4]} | {"local-dp": LOCAL_DP, "secagg+": SECAGG}


def _example(folder: str, package: str) -> tuple[object, object]:
    root = EXAMPLES / folder
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"{package}.client_app"), importlib.import_module(f"{package}.task")


class RecordingGrid(InProcessGrid):
    """An in-process grid that remembers every message type it delivered (a legacy FitIns by its flowerdro type),
    and, for every training reply, ‖w_i − w‖ with the clipping norm its message carried."""

    def _deliver(self, msg):  # noqa: D102
        self.sent.append(_type_of(msg))
        sent = _model(msg, "arrays", "fitins.parameters")
        cfg = msg.content.config_records.get("config") or msg.content.config_records.get("fitins.config") or {}
        reply, elapsed = super()._deliver(msg)
        if sent is not None and reply is not None and not reply.has_error() and _type_of(msg).startswith("train"):
            got = _model(reply, "arrays", "fitres.parameters")
            if got is not None and len(got) >= len(sent):
                norm = math.sqrt(sum(float(((b.astype(np.float64) - a) ** 2).sum()) for a, b in zip(sent, got[:len(sent)], strict=True)))
                self.updates.append((norm, float(cfg.get(KEY_CLIPPING_NORM, C))))
        return reply, elapsed


def _model(msg, *names) -> list | None:
    for name in names:
        rec = msg.content.array_records.get(name)
        if rec is not None:
            return [np.asarray(rec[k].numpy(), dtype=np.float64) for k in rec.keys()]
    return None


def _type_of(msg) -> str:
    for ins in ("fitins.config", "evaluateins.config"):
        cfg = msg.content.config_records.get(ins)
        if cfg is not None:
            return str(cfg.get("flowerdro.type", msg.metadata.message_type))
    return msg.metadata.message_type


def _grid(app, rc) -> RecordingGrid:
    grid = RecordingGrid(app, NODES, rc)
    grid.sent, grid.updates = [], []
    grid.set_run(SimpleNamespace(run_id=1))
    return grid


def _client_mods(piece: str, legacy: bool) -> list:
    mods = legacy_mods if legacy else msg_mods
    if piece == "local-dp":  # sensitivity 0: no noise, so the clipping is visible in the model
        return [mods.LocalDpMod(clipping_norm=C, sensitivity=0.0, epsilon=1.0, delta=1e-5)]
    if piece == "client-fixed":
        return [mods.fixedclipping_mod]
    if piece == "client-adaptive":
        return [mods.adaptiveclipping_mod]
    if piece == "secagg+":
        return [legacy_mods.secaggplus_mod]
    return []


def _wrap(module, piece: str, strategy, spy: dict):
    """Flower's central-DP wrapper ``piece`` around ``strategy`` (noise 0), its aggregation spied on."""
    name = {"server-fixed": "DifferentialPrivacyServerSideFixedClipping",
            "server-adaptive": "DifferentialPrivacyServerSideAdaptiveClipping",
            "client-fixed": "DifferentialPrivacyClientSideFixedClipping",
            "client-adaptive": "DifferentialPrivacyClientSideAdaptiveClipping"}[piece]
    cls = getattr(module, name)
    kwargs = {"clipping_norm": C} if "fixed" in piece else {"initial_clipping_norm": C}
    wrapper = cls(strategy, noise_multiplier=0.0, num_sampled_clients=NODES, **kwargs)
    method = "aggregate_fit" if module is legacy_dp else "aggregate_train"
    original = getattr(wrapper, method)

    def aggregate(server_round, *args):
        spy["norms"].append(wrapper.clipping_norm)  # the C of this round's clipping
        return original(server_round, *args)

    setattr(wrapper, method, aggregate)
    return wrapper


def _update_norms(models: list) -> list[float]:
    out = []
    for a, b in zip(models, models[1:], strict=False):
        pairs = zip([a[k].numpy() for k in a.keys()], [b[k].numpy() for k in b.keys()], strict=True)
        out.append(math.sqrt(sum(float(((np.asarray(y, np.float64) - x) ** 2).sum()) for x, y in pairs)))
    return out


def _run_message_api(name: str, piece: str):
    client, task = _example("message-api", "msgexample")
    from flowerdro.clients import ClientKit

    kit = ClientKit(model_fn=task.Net, data_fn=task.load_data, loss_fn=torch.nn.CrossEntropyLoss(),
                    train_fn=lambda net, loader, a: task.train(net, loader, a.epochs, a.lr, a.device),
                    test_fn=task.test)
    grid = _grid(kit.client_app(mods=_client_mods(piece, legacy=False)), RC)
    strategy = build_strategy(name, RC)
    init = initial_arrays(grid, RC, 60)
    grid.sent.clear()
    spy: dict = {"norms": []}
    models = [init]
    strategy.add_round_callback(lambda rec: models.append(strategy.current_arrays))
    if piece == "local-dp":
        strategy.start(grid, init, num_rounds=ROUNDS, timeout=60)
    else:
        _wrap(msg_dp, piece, strategy, spy).start(grid, init, num_rounds=ROUNDS, timeout=60)
    return strategy, grid, spy, models


def _run_legacy(name: str, piece: str):
    client, task = _example("legacy-api", "legacyexample")
    from flwr.common import ndarrays_to_parameters

    from flowerdro.legacy import LegacyClientApp, LegacyStrategy

    app = LegacyClientApp(client.client_fn, loss_fn=torch.nn.CrossEntropyLoss(), mods=_client_mods(piece, True))
    rc = {**RC, "local-epochs": 1}
    grid = _grid(app, rc)
    torch.manual_seed(0)
    legacy = LegacyStrategy(name, rc, num_rounds=ROUNDS,
                            initial_parameters=ndarrays_to_parameters(task.get_weights(task.Net())))
    spy: dict = {"norms": []}
    models: list = [legacy._arrays(legacy.initial_parameters)]
    legacy.strategy.add_round_callback(lambda rec: models.append(legacy.strategy.current_arrays))
    if piece == "secagg+":
        from flwr.server import LegacyContext
        from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

        server = ServerApp()

        @server.main()
        def _main(grid_, context):
            ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=ROUNDS), strategy=legacy)
            DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2))(grid_, ctx)
    else:
        outer = legacy if piece == "local-dp" else _wrap(legacy_dp, piece, legacy, spy)
        server = ServerApp(server_fn=lambda ctx: ServerAppComponents(strategy=outer,
                                                                     config=ServerConfig(num_rounds=ROUNDS)))
    server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    return legacy, grid, spy, models


def _check(name: str, piece: str, run) -> None:
    mechanism = MECHANISM[piece]
    strategy_for_text = build_strategy(name, RC)
    if composes(strategy_for_text, mechanism):
        strategy, grid, spy, models = run(name, piece)
        strategy = getattr(strategy, "strategy", strategy)
        assert len(strategy.history) == ROUNDS and all("acc_worst" in r for r in strategy.history)
        assert not any(r["failures"] for r in strategy.history), strategy.history[-1]["failures"]
        assert set(ALGORITHMS[name].routes) - {"query.loss", "query.affine_state"} <= set(grid.sent)
        if piece in MSG_PIECES[:4]:
            assert len(spy["norms"]) == ROUNDS  # the wrapper aggregated every round
        if piece in ("server-fixed", "server-adaptive"):
            # the server clips, the noise is 0: the model moves by a mean of updates clipped to C, at most C
            norms = _update_norms(models)
            assert len(norms) == ROUNDS
            for norm, limit in zip(norms, spy["norms"], strict=True):
                assert norm <= limit * (1 + 1e-4), (norm, limit)
        elif piece in ("client-fixed", "client-adaptive", "local-dp"):
            # the clients clip: every training reply moved its model by at most the C it was sent
            assert len(grid.updates) >= ROUNDS
            assert all(norm <= limit * (1 + 1e-4) for norm, limit in grid.updates), grid.updates
        else:  # SecAgg+: its stages ran (setup, share keys, collect, unmask: several train messages per node)
            assert grid.sent.count("train") >= 3 * NODES * ROUNDS
    else:
        with pytest.raises(PrivacyError) as err:
            run(name, piece)
        text = str(err.value)
        assert strategy_for_text.unprotected(mechanism) in text
        expected_piece = {"local-dp": "LocalDpMod", "secagg+": "SecAggPlusWorkflow"}.get(piece, "DifferentialPrivacy")
        assert expected_piece in text


@pytest.mark.parametrize("piece", MSG_PIECES)
@pytest.mark.parametrize("name", strategy_names())
def test_message_api_runs_the_algorithm_protected_or_refuses(name, piece):
    _check(name, piece, _run_message_api)


@pytest.mark.parametrize("piece", LEGACY_PIECES)
@pytest.mark.parametrize("name", strategy_names())
def test_legacy_api_runs_the_algorithm_protected_or_refuses(name, piece):
    _check(name, piece, _run_legacy)


def test_the_updates_exceed_the_clipping_norm_without_protection():
    """The matrix's clipping check is meaningful: unclipped, the first round moves the model by more than 10·C."""
    client, task = _example("message-api", "msgexample")
    from flowerdro.clients import ClientKit

    kit = ClientKit(model_fn=task.Net, data_fn=task.load_data, loss_fn=torch.nn.CrossEntropyLoss(),
                    train_fn=lambda net, loader, a: task.train(net, loader, a.epochs, a.lr, a.device))
    grid = _grid(kit.client_app(), RC)
    strategy = build_strategy("fedavg", RC)
    init = initial_arrays(grid, RC, 60)
    models = [init]
    strategy.add_round_callback(lambda rec: models.append(strategy.current_arrays))
    strategy.start(grid, init, num_rounds=1, timeout=60)
    assert _update_norms(models)[0] > 10 * C


def test_a_refusal_sends_no_message():
    """Refused under a central-DP wrapper: not even the roll call goes out."""
    client, task = _example("message-api", "msgexample")
    grid = _grid(client.app, RC)
    init = initial_arrays(grid, RC, 60)
    grid.sent.clear()
    strategy = build_strategy("drfa", RC)
    with pytest.raises(PrivacyError, match="per-client losses"):
        msg_dp.DifferentialPrivacyServerSideFixedClipping(strategy, 1.0, C, NODES).start(grid, init, num_rounds=1)
    assert grid.sent == []
