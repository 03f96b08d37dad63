"""One ``flwr run`` of each example project (Flower's simulation engine, real processes)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("example", ["message-api", "legacy-api"])
def test_flwr_run_of_the_example_completes_with_a_flowerdro_strategy(tmp_path, example):
    # a copy: `flwr run` rewrites the federation tables of the pyproject.toml it is given
    app = tmp_path / "app"
    shutil.copytree(REPO / "examples" / example, app)
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "flwr_run.py"), "--app", str(app),
         "--num-supernodes", "3", "--run-config", "num-server-rounds=2 strategy='drfa'", "--timeout", "600"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[drfa] round 2/2" in proc.stdout + proc.stderr


def test_flwr_run_with_clients_lacking_the_route_exits_nonzero_naming_it(tmp_path):
    # the example's server with the quickstart's own ClientApp (no flowerdro routes)
    app = tmp_path / "app"
    shutil.copytree(REPO / "examples" / "message-api", app)
    shutil.copy(REPO / "tests" / "fixtures" / "quickstart" / "message-api" / "client_app.py",
                app / "msgexample" / "client_app.py")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "flwr_run.py"), "--app", str(app), "--num-supernodes", "2",
         "--run-config", "num-server-rounds=5 strategy='drfa'", "--timeout", "600"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "add_routes" in out
