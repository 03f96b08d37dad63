"""One ``flwr run`` of each example project (Flower's simulation engine, real processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("example", ["message-api", "legacy-api"])
def test_flwr_run_of_the_example_completes_with_a_flowerdro_strategy(tmp_path, example):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "flwr_run.py"), "--app", str(REPO / "examples" / example),
         "--num-supernodes", "3", "--run-config", "num-server-rounds=2 strategy='drfa'", "--timeout", "600"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[drfa] round 2/2" in proc.stdout + proc.stderr
