"""The example Flower projects under examples/: every strategy runs through them in-process.

Each example is a small project in the style of Flower's quickstart (its own model, data,
train and test in ``task.py``); a run-config key ``strategy`` picks the flowerdro strategy.
"""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from flowerdro.experiments import InProcessGrid
from flowerdro.strategies import strategy_names

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _project(folder: str, package: str) -> tuple[dict, object, object]:
    """The example's run config and its client and server modules (imported from the example folder)."""
    root = EXAMPLES / folder
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    client = importlib.import_module(f"{package}.client_app")
    server = importlib.import_module(f"{package}.server_app")
    return dict(config), client, server


def _run_example(project: str, package: str, entry: str, built_by: str, name: str, rounds: int,
                 extra: dict | None = None):
    """Run ``server.<entry>`` of an example on an in-process grid; returns the object ``server.<built_by>`` built.

    ``extra`` adds run-config keys (as ``flwr run --run-config`` would).
    """
    from types import SimpleNamespace

    config, client, server = _project(project, package)
    rc = {**config, "strategy": name, "num-server-rounds": rounds, **(extra or {})}
    grid = InProcessGrid(client.app, 4, rc)
    grid.set_run(SimpleNamespace(run_id=1))
    built = []
    original = getattr(server, built_by)

    def spy(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    setattr(server, built_by, spy)
    try:
        getattr(server, entry)(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    finally:
        setattr(server, built_by, original)
    return built[0]


def _run_message_api(name: str, rounds: int = 2, extra: dict | None = None):
    return _run_example("message-api", "msgexample", "main", "build_strategy", name, rounds, extra)


@pytest.mark.parametrize("name", strategy_names())
def test_every_strategy_runs_through_the_message_api_example(name):
    strategy = _run_message_api(name)
    assert len(strategy.history) == 2
    assert not any(r["failures"] for r in strategy.history), strategy.history[-1]["failures"]
    assert all("acc_worst" in r for r in strategy.history)


def _run_legacy(name: str, rounds: int = 2, extra: dict | None = None):
    return _run_example("legacy-api", "legacyexample", "app", "LegacyStrategy", name, rounds, extra)


@pytest.mark.parametrize("name", strategy_names())
def test_every_strategy_runs_through_the_legacy_example(name):
    legacy = _run_legacy(name)
    strategy = legacy.strategy
    assert len(strategy.history) == 2
    assert not any(r["failures"] for r in strategy.history), strategy.history[-1]["failures"]
    assert legacy.final_parameters is not None


@pytest.mark.parametrize("name", ["drfa", "scaffpd"])
def test_legacy_two_exchange_algorithms_give_the_lambda_sequence_of_the_message_api(name):
    # same model (seed 0), same data and seed: the legacy adapter runs the same loop on the grid
    legacy = _run_legacy(name, rounds=3).strategy
    message = _run_message_api(name, rounds=3)
    assert [r["lambda"] for r in legacy.history] == [r["lambda"] for r in message.history]
    assert [r["acc_worst"] for r in legacy.history] == [r["acc_worst"] for r in message.history]


RUN = {"message-api": _run_message_api, "legacy-api": _run_legacy}


@pytest.mark.parametrize("api", sorted(RUN))
@pytest.mark.parametrize("typo,meant", [("dual-lrr", "dual-lr"), ("lcoal-steps", "local-steps"),
                                        ("num-round", "num-rounds"), ("dual_lr", "dual-lr"),
                                        ("accuracy_metric", "accuracy-metric")])
def test_a_misspelt_flowerdro_key_in_the_projects_run_config_is_refused_naming_the_key(api, typo, meant):
    with pytest.raises(ValueError, match=rf"'{typo}' \(did you mean '{meant}'\?\).*own_keys"):
        RUN[api]("drfa", 1, {typo: 3})


@pytest.mark.parametrize("api", sorted(RUN))
def test_the_projects_own_keys_pass_and_are_named_in_the_log(api):
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # whatever an earlier test (a CLI's --quiet) left
    try:
        # num-server-rounds, strategy, local-epochs and batch-size are in the example's own config
        built = RUN[api]("fedavg", 1, {"fraction-fit": 0.5, "my-model-width": 64})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    own = [r for r in records if "keys flowerdro does not read" in r]
    assert own and "fraction-fit, my-model-width, num-server-rounds, strategy" in own[0], own
    assert "fraction-fit → fraction-train" in own[0]
    strategy = built.strategy if api == "legacy-api" else built
    assert strategy.loop.fraction_train == 1.0  # fraction-fit is not flowerdro's sampling
    assert len(strategy.history) == 1 and not strategy.history[0]["failures"]


def test_own_keys_let_a_projects_key_near_a_flowerdro_key_through_on_both_apis():
    from flowerdro.legacy import LegacyStrategy
    from flowerdro.strategies import build_strategy

    rc = {"dual_lr": 0.3, "batch_size": 8}
    assert build_strategy("drfa", rc, own_keys=("dual_lr", "batch_size")).config.dual_lr is None
    legacy = LegacyStrategy("drfa", rc, num_rounds=1, own_keys=("dual_lr", "batch_size"))
    assert legacy.strategy.training.batch_size == 32  # flowerdro's batch-size keeps its default
    with pytest.raises(ValueError, match="'batch_size' \\(did you mean 'batch-size'"):
        LegacyStrategy("drfa", rc, num_rounds=1, own_keys=("dual_lr",))
    with pytest.raises(ValueError, match="own_keys: 'dual-lr' is a flowerdro key"):
        build_strategy("drfa", {"dual-lr": 0.3}, own_keys=("dual-lr",))


def _with_batchnorm(monkeypatch, project: str, package: str) -> None:
    """Give the example's own ``Net`` a BatchNorm layer (float running statistics, an int64 counter)."""
    import torch
    from torch import nn

    _, client, _ = _project(project, package)
    task = importlib.import_module(f"{package}.task")

    def __init__(self):
        nn.Module.__init__(self)
        self.fc1, self.bn = nn.Linear(task.NUM_FEATURES, 32), nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, task.NUM_CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))

    monkeypatch.setattr(task.Net, "__init__", __init__)
    monkeypatch.setattr(task.Net, "forward", forward)
    if hasattr(client.app, "_kits"):  # the legacy app keeps one kit (holding the client's net) per node
        monkeypatch.setattr(client.app, "_kits", {})


@pytest.mark.parametrize("api", ["message-api", "legacy-api"])
def test_qfedavg_runs_a_batchnorm_model_through_both_examples(monkeypatch, api):
    import numpy as np
    from flwr.common import parameters_to_ndarrays

    _with_batchnorm(monkeypatch, api, "msgexample" if api == "message-api" else "legacyexample")
    if api == "message-api":
        strategy = _run_message_api("qfedavg")
    else:
        legacy = _run_legacy("qfedavg")
        strategy = legacy.strategy
        counter = parameters_to_ndarrays(legacy.final_parameters)[6]  # bn.num_batches_tracked
        assert counter.dtype == np.int64 and counter > 0
    assert len(strategy.history) == 2
    assert not any(r["failures"] for r in strategy.history), strategy.history[-1]["failures"]


def test_an_unchanged_numpyclient_still_serves_flowers_own_legacy_strategy():
    from types import SimpleNamespace

    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerConfig
    from flwr.server.compat import start_grid
    from flwr.server.strategy import FedAvg

    config, client, _ = _project("legacy-api", "legacyexample")
    grid = InProcessGrid(client.app, 3, config)
    grid.set_run(SimpleNamespace(run_id=1))
    import torch
    from legacyexample.task import Net, get_weights

    torch.manual_seed(0)
    params = ndarrays_to_parameters(get_weights(Net()))
    hist = start_grid(grid=grid, strategy=FedAvg(initial_parameters=params, min_available_clients=3,
                                                 min_fit_clients=3, min_evaluate_clients=3),
                      config=ServerConfig(num_rounds=1))
    assert len(hist.losses_distributed) == 1


def _changed_lines(before: Path, after: Path) -> int:
    """Non-blank lines added or modified in ``after`` relative to ``before`` (a modified line counts once)."""
    import difflib

    a, b = before.read_text().splitlines(), after.read_text().splitlines()
    changed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        added = [line for line in b[j1:j2] if line.strip()]
        removed = [line for line in a[i1:i2] if line.strip()]
        changed += max(len(added), len(removed))
    return changed


@pytest.mark.parametrize("example,package,limit", [("message-api", "msgexample", 10), ("legacy-api", "legacyexample", 15)])
def test_converting_the_quickstart_changes_few_lines(example, package, limit):
    before = Path(__file__).resolve().parents[1] / "fixtures" / "quickstart" / example
    after = EXAMPLES / example
    counts = {name: _changed_lines(before / name, after / (name if name == "pyproject.toml" else f"{package}/{name}"))
              for name in ("client_app.py", "server_app.py", "pyproject.toml")}
    assert sum(counts.values()) <= limit, counts
    # the project's own model, data and train/test are untouched
    assert "def train(" in (after / package / "task.py").read_text()


def test_a_legacy_server_against_an_unchanged_legacy_client_app_names_the_wrapper():
    from types import SimpleNamespace

    from flwr.clientapp import ClientApp

    config, client, server = _project("legacy-api", "legacyexample")
    rc = {**config, "strategy": "drfa", "num-server-rounds": 2}
    grid = InProcessGrid(ClientApp(client_fn=client.client_fn), 3, rc)
    grid.set_run(SimpleNamespace(run_id=1))
    with pytest.raises(RuntimeError, match="LegacyClientApp"):
        server.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))


def test_a_message_api_server_against_a_legacy_client_app_fails_naming_the_wrapper():
    from flwr.clientapp import ClientApp

    from flowerdro.strategies import RunFailedError, build_strategy

    config, client, _ = _project("legacy-api", "legacyexample")
    _, _, msg_server = _project("message-api", "msgexample")
    grid = InProcessGrid(ClientApp(client_fn=client.client_fn), 3, config)
    strategy = build_strategy("drfa", config)
    import torch

    torch.manual_seed(0)
    from flwr.app import ArrayRecord

    arrays = ArrayRecord(msg_server.Net().state_dict())
    with pytest.raises(RunFailedError, match="LegacyClientApp") as err:
        strategy.start(grid, arrays, num_rounds=5, timeout=60)
    # every client fails alike (a programming error): the run stops in its first round
    assert not strategy.history and "Invalid message type: query.loss" in str(err.value)


def test_a_message_api_strategy_in_legacy_server_app_components_names_the_adapter():
    from types import SimpleNamespace

    from flwr.server import ServerConfig
    from flwr.server.compat import start_grid

    from flowerdro.strategies import build_strategy

    config, client, _ = _project("legacy-api", "legacyexample")
    grid = InProcessGrid(client.app, 2, config)
    grid.set_run(SimpleNamespace(run_id=1))
    with pytest.raises(TypeError, match=r"flowerdro.legacy.LegacyStrategy\('drfa'"):
        start_grid(grid=grid, strategy=build_strategy("drfa", config), config=ServerConfig(num_rounds=1))
