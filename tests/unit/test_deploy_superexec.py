"""The forking SuperExec: a flwr-clientapp task runs Flower's entry point in a fork, other commands as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from flowerdro.deploy import superexec as sx


@pytest.fixture
def pristine(monkeypatch):
    """Undo the module patches a test makes (Flower's modules are process-wide)."""
    from flwr.supercore.superexec.executor import subprocess_executor as se
    from flwr.supernode import start_client_internal as sci

    monkeypatch.setattr(se, "subprocess", subprocess)
    monkeypatch.setattr(sci, "subprocess", subprocess)
    return se, sci


def test_a_clientapp_task_runs_flowers_entry_point_in_a_reaped_fork(tmp_path, monkeypatch, pristine):
    import importlib

    cli = importlib.import_module("flwr.supernode.cli.flwr_clientapp")  # the module (the package exports a function)

    out = tmp_path / "argv.json"

    def entry() -> None:  # stands in for flwr_clientapp(): records what it was given
        part = out.with_suffix(".part")  # written whole, then renamed: the test never reads half a file
        part.write_text(json.dumps({"argv": sys.argv, "pid": os.getpid()}))
        os.replace(part, out)
        raise SystemExit(3)

    monkeypatch.setattr(cli, "flwr_clientapp", entry)
    se, _ = pristine
    sx.patch_executor()
    args = ["flwr-clientapp", "--runtime-api-address", "127.0.0.1:1", "--token", "t"]
    pid = se.subprocess.Popen(args)
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    got = json.loads(out.read_text())
    assert got == {"argv": args, "pid": pid} and pid != os.getpid()
    while time.monotonic() < deadline:  # the parent's thread reaps the child: no zombie left
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            break
        time.sleep(0.02)
    else:
        pytest.fail("the forked task was not reaped")


def test_other_commands_still_start_processes(pristine):
    se, _ = pristine
    sx.patch_executor()
    proc = se.subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    assert proc.wait(timeout=60) == 4


def test_the_patch_refuses_an_executor_it_does_not_know(monkeypatch, pristine):
    import inspect

    monkeypatch.setattr(inspect, "getsource", lambda _f: "def launch(self, spec):\n    pass\n")
    with pytest.raises(RuntimeError, match="does not apply"):
        sx.patch_executor()
    se, _ = pristine
    assert se.subprocess is subprocess


def test_the_supernode_launcher_starts_the_forking_superexec(monkeypatch, pristine):
    from flowerdro.deploy.supernode import patch_superexec_command

    _, sci = pristine
    patch_superexec_command()
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda args, **kw: started.append(args))
    sci.subprocess.Popen(["flower-superexec", "--insecure", "--runtime-api-address", "127.0.0.1:9094"])
    sci.subprocess.Popen(["something-else", "--x"])
    assert started == [[sys.executable, "-m", "flowerdro.deploy.superexec", "--insecure", "--runtime-api-address",
                        "127.0.0.1:9094"], ["something-else", "--x"]]
