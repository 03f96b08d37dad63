"""One clear error, once: a deterministic client error under Flower's Ray simulation.

The Message-API quickstart stand-in, converted by the README's snippets, runs through
``flwr.simulation.run_simulation`` (Ray) with a ServerApp whose model has one output more
than the clients' (a project that changed its model on one side). Every client refuses the
server's arrays alike, so the run stops in round 1; what a user sees in the terminal is
counted: the client's error with its traceback once, each other client in one line, and
the uncaught ``DeterministicClientError`` (its own traceback, Python's), nothing from Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..integration._quickstart import REPO, convert, run_config

pytestmark = pytest.mark.e2e

#: What the subprocess runs: the converted project, a wider model on the server, run_simulation.
SCRIPT = """
import sys
import torch
from flwr.serverapp import ServerApp
from flwr.simulation import run_simulation
from pytorchexample import client_app, server_app, task

class Wider(task.Net):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(32, task.CLASSES + 1)

server_app.Net = Wider  # the server starts from a model the clients do not have
run_config = {RUN_CONFIG}
wrapper = ServerApp()

@wrapper.main()
def main(grid, context):
    context.run_config = {{**run_config, **context.run_config}}
    server_app.app(grid, context)

run_simulation(server_app=wrapper, client_app=client_app.app, num_supernodes=2,
               backend_config={{"client_resources": {{"num_cpus": 1, "num_gpus": 0.0}}}})
"""


def test_a_model_mismatch_under_run_simulation_prints_one_error_with_one_traceback(tmp_path):
    root = convert("message-api", tmp_path)
    rc = run_config(root, strategy="fedavg", **{"num-server-rounds": 3})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(root)]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(RUN_CONFIG=repr(rc))], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    lines = output.splitlines()
    assert proc.returncode != 0
    assert "DeterministicClientError: [fedavg] round 1 train: all 2 clients failed with the same error" in output
    # the client's own error, with the frames that locate it, logged once
    assert output.count("client-side traceback (most recent call last):") == 1
    assert output.count("shapes differ: out.weight: server (11, 32), model (10, 32)") == 2  # the log, the error
    assert "(the same reason as above)" in output  # the second client: one line
    # one Python traceback (the ServerApp's uncaught error); nothing of Ray's
    assert output.count("Traceback (most recent call last)") == 1, output
    assert "RayTaskError" not in output and "ClientAppException" not in output
    assert len(lines) <= 60, "\n".join(lines)
