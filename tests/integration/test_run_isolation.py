"""Every run starts clean: seeded runs in one process repeat the same runs in fresh processes, on both APIs.

A notebook or a comparison runs experiments one after another in one process, with the
project's modules (its ClientApp, a ClientKit or a LegacyClientApp) imported once. What the
clients keep (the kit's tensors of the user's data, the NumPyClient objects ``client_fn``
built) is keyed by the Flower run, so each new grid (a new run id) builds its own: the
same seeded experiment twice, and a different one between, each give exactly what the
experiment gives alone in a fresh Python process. The stand-in quickstart is what makes
a leak visible: its ``client_fn`` and ``Net()`` draw from torch's global generator and its
shuffling loaders too, so a run that reused the previous run's client objects draws other
minibatches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._quickstart import APIS, REPO, convert, experiment, load

pytestmark = pytest.mark.slow

#: (strategy, seed) of the experiment run twice, and of the different one run between.
SAME, OTHER = ("fedavg", 0), ("drfa", 1)


def _fresh(api: str, strategy: str, seed: int) -> dict:
    """The experiment's digest from a new Python process."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_quickstart.py")), api, strategy, str(seed),
                          "2"], capture_output=True, text=True, env=env, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("api", APIS)
def test_seeded_runs_in_one_process_equal_their_runs_in_fresh_processes(api, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = convert(api, tmp_path)
    modules = load(root)  # imported once, as a notebook would
    first = experiment(api, root, modules, *SAME)
    other = experiment(api, root, modules, *OTHER)
    again = experiment(api, root, modules, *SAME)
    assert first["client_acc"] and len(first["client_acc"]) == 2
    assert again == first
    assert other != first
    assert _fresh(api, *SAME) == first
    assert _fresh(api, *OTHER) == other
