"""Plain ``flwr run`` with a relative ``output-dir``: where the results and tracker files land, and what says so.

``flwr run`` starts a local SuperLink in the caller's working folder; the ServerApp runs
in that SuperLink's working folder, so a relative ``output-dir`` lands there. The
ServerApp's log must say so with absolute paths, and the tracker files must follow
``output-dir``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ._flower import REPO
from ._flower import flower_env as _env

pytestmark = pytest.mark.e2e


def test_a_relative_output_dir_lands_in_the_superlinks_folder_and_the_log_says_where(tmp_path):
    caller = tmp_path / "caller"
    caller.mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "flwr_run.py"), "--num-supernodes", "2", "--run-config",
         "num-rounds=1 strategies='fedavg' output-dir='rel-out' tracker='tensorboard'", "--timeout", "600"],
        cwd=caller, env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    results = caller / "rel-out"
    assert (results / "summary.json").is_file() and (results / "fedavg" / "final_model.npz").is_file()
    assert (results / "trackers" / "tensorboard" / "flwr-run" / "fedavg" / "seed0").is_dir()
    assert f"flwr-run: results: {results}" in out
    assert f"flwr-run: TensorBoard: {results / 'trackers' / 'tensorboard'}" in out
    assert f"flwr-run: output-dir is relative to this ServerApp's working folder {caller}; under `flwr run` " \
           "that is the folder the local SuperLink was first started in" in out
    assert "flwr_run: results and tracker files in the app's output-dir / tracker-dir, relative to the working " \
           "folder of the local SuperLink" in out
