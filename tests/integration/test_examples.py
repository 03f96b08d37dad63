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


def _run_message_api(name: str, rounds: int = 2):
    config, client, server = _project("message-api", "msgexample")
    rc = {**config, "strategy": name, "num-server-rounds": rounds}
    grid = InProcessGrid(client.app, 4, rc)
    built = []
    original = server.build_strategy

    def spy(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    server.build_strategy = spy
    try:
        server.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    finally:
        server.build_strategy = original
    return built[0]


@pytest.mark.parametrize("name", strategy_names())
def test_every_strategy_runs_through_the_message_api_example(name):
    strategy = _run_message_api(name)
    assert len(strategy.history) == 2
    assert not any(r["failures"] for r in strategy.history), strategy.history[-1]["failures"]
    assert all("acc_worst" in r for r in strategy.history)
