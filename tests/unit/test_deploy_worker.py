"""The node-local worker: a forwarded message gets the reply the ClientApp process would make itself."""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
import time

import flwr
import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from flowerdro.clients.routes import handler
from flowerdro.comparison import client_config
from flowerdro.deploy import worker as w
from flowerdro.deploy.supernode import FLOWER_SERIES
from flowerdro.experiments.inprocess import ensure_task_identity

ensure_task_identity()

#: The SuperNode launcher patches one Flower series and refuses every other by design.
patched_flower = pytest.mark.skipif(
    not flwr.__version__.startswith(FLOWER_SERIES),
    reason=f"the SuperNode launcher patches Flower {FLOWER_SERIES}x and refuses the installed "
           f"{flwr.__version__} by design (test_the_launcher_refuses_the_installed_flower covers it)")


def _context(rc: dict, folder, node_id: int = 3, worker: int = 1) -> Context:
    return Context(run_id=11, node_id=node_id, node_config={"partition-id": 1, "num-partitions": 4, "worker": worker,
                                                             "worker-dir": str(folder), "worker-idle": 60},
                   state=RecordDict(), run_config=dict(rc))


def _message(content: RecordDict, message_type: str, mid: str) -> Message:
    msg = Message(content=content, dst_node_id=3, message_type=message_type)
    msg.metadata._message_id = mid  # what a SuperLink gives it
    return msg


def _init(rc: dict) -> Message:
    return _message(RecordDict({"config": ConfigRecord({"weights": True})}), "query.init", "m-init")


def _train(rc: dict, arrays: ArrayRecord) -> Message:
    cfg = client_config(rc)
    cfg["server-round"] = 1
    return _message(RecordDict({"arrays": arrays, "config": cfg}), "train", "m-train")


def _arrays(reply: Message) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in reply.content.array_records["arrays"].items()}


def _kill_workers(folder) -> None:
    for pid_file in folder.glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "w"
    yield d
    _kill_workers(d)


def test_forwarded_replies_equal_the_local_ones(folder, synth_rc):
    ctx_w, ctx_l = _context(synth_rc, folder), _context(synth_rc, folder, worker=0)
    settings = w.worker_settings(ctx_w.node_config)
    init_w = w.forward(_init(synth_rc), ctx_w, settings)
    init_l = handler("query.init")(_init(synth_rc), ctx_l)
    assert init_w is not None and init_w.metadata.reply_to_message_id == "m-init"
    a, b = _arrays(init_w), _arrays(init_l)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    arrays = init_l.content.array_records["arrays"]
    tr_w = w.forward(_train(synth_rc, arrays), ctx_w, settings)
    tr_l = handler("train")(_train(synth_rc, arrays), ctx_l)
    # the same seeded float32 SGD steps on the same data: bit-identical
    a, b = _arrays(tr_w), _arrays(tr_l)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert dict(tr_w.content.metric_records["metrics"]) == dict(tr_l.content.metric_records["metrics"])
    assert tr_w.metadata.reply_to_message_id == "m-train"
    # one worker served both messages, its socket private to the user
    assert len(list(folder.glob("*.pid"))) == 1
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_the_state_a_handler_keeps_comes_back_into_the_context(folder, synth_rc):
    # SCAFF-PD phase 1 keeps c_i in context.state; the forwarded run must leave the same record there
    ctx_w, ctx_l = _context(synth_rc, folder), _context(synth_rc, folder, worker=0)
    arrays = handler("query.init")(_init(synth_rc), ctx_l).content.array_records["arrays"]
    cfg = client_config(synth_rc)
    cfg["server-round"] = 2

    def msg():
        return _message(RecordDict({"arrays": arrays, "config": cfg}), "query.loss_grad", "m-grad")

    assert w.forward(msg(), ctx_w, w.worker_settings(ctx_w.node_config)) is not None
    handler("query.loss_grad")(msg(), ctx_l)
    got, want = ctx_w.state.array_records["scaffpd.grad"], ctx_l.state.array_records["scaffpd.grad"]
    assert got.keys() == want.keys() and all(np.array_equal(got[k].numpy(), want[k].numpy()) for k in got)
    assert dict(ctx_w.state.config_records["scaffpd.meta"]) == {"server-round": 2}


def test_a_handler_error_surfaces_as_the_messages_error(folder, synth_rc):
    ctx = _context(synth_rc, folder)
    bad = _message(RecordDict({"config": client_config(synth_rc)}), "train", "m-bad")  # no arrays
    with pytest.raises(w.WorkerError, match="Traceback"):
        w.forward(bad, ctx, w.worker_settings(ctx.node_config))
    # the worker lives on and serves the next message
    assert w.forward(_init(synth_rc), ctx, w.worker_settings(ctx.node_config)) is not None


def test_a_killed_worker_is_restarted(folder, synth_rc):
    ctx = _context(synth_rc, folder)
    settings = w.worker_settings(ctx.node_config)
    assert w.forward(_init(synth_rc), ctx, settings) is not None
    (pid_file,) = folder.glob("*.pid")
    first = int(pid_file.read_text())
    os.kill(first, signal.SIGKILL)
    time.sleep(0.2)
    assert w.forward(_init(synth_rc), ctx, settings) is not None
    assert int(pid_file.read_text()) != first


def test_a_worker_that_dies_before_replying_leaves_the_message_to_the_caller(folder, synth_rc):
    ctx = _context(synth_rc, folder)
    settings = w.worker_settings(ctx.node_config)
    path = w.socket_path(ctx, settings)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def accept_and_hang_up() -> None:
        conn, _ = server.accept()
        conn.recv(16)
        conn.close()

    t = threading.Thread(target=accept_and_hang_up)
    t.start()
    try:
        assert w.forward(_init(synth_rc), ctx, settings) is None
    finally:
        t.join(5)
        server.close()


def test_the_node_config_keys_are_checked(tmp_path):
    assert w.worker_settings({}) == w.WorkerSettings()
    assert w.worker_settings({"worker": 1, "worker-idle": 5}).enabled
    with pytest.raises(ValueError, match="worker: allowed"):
        w.worker_settings({"worker": "yes"})
    with pytest.raises(ValueError, match="worker-idle"):
        w.worker_settings({"worker-idle": 0})
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        w.socket_path(_context({}, shared), w.worker_settings({"worker-dir": str(shared)}))


# ----------------------------------------------------------------------------- SuperNode launcher
@patched_flower
def test_the_launcher_shortens_only_the_idle_sleep(monkeypatch):
    import time as time_module

    from flwr.supernode import start_client_internal as sci

    from flowerdro.deploy.supernode import patch_idle_sleep

    monkeypatch.setattr(sci, "time", time_module)  # restored after the test
    slept = []
    monkeypatch.setattr(time_module, "sleep", slept.append)
    patch_idle_sleep(0.2)
    sci.time.sleep(3)
    sci.time.sleep(0.5)
    assert slept == [0.2, 0.5] and sci.time.monotonic is time_module.monotonic


@patched_flower
def test_the_launcher_refuses_another_flower(monkeypatch):
    import inspect
    import time as time_module

    import flwr
    from flwr.supernode import start_client_internal as sci

    from flowerdro.deploy.supernode import main, patch_idle_sleep

    monkeypatch.setattr(sci, "time", time_module)
    monkeypatch.setattr(flwr, "__version__", "1.42.0")
    with pytest.raises(RuntimeError, match="installed: 1.42.0"):
        patch_idle_sleep(0.1)
    monkeypatch.undo()
    monkeypatch.setattr(inspect, "getsource", lambda _m: "while True:\n    time.sleep(5)\n")
    with pytest.raises(RuntimeError, match="does not apply"):
        patch_idle_sleep(0.1)
    assert main(["--poll", "0", "--", "--insecure"]) == 2
    assert sci.time is time_module


@patched_flower
def test_the_launcher_runs_flower_supernode_with_its_arguments():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-m", "flowerdro.deploy.supernode", "--poll", "0.1", "--", "--help"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "--superlink" in out.stdout, out.stderr[-2000:]


@pytest.mark.skipif(flwr.__version__.startswith(FLOWER_SERIES),
                    reason=f"Flower {flwr.__version__} is the series the launcher patches")
def test_the_launcher_refuses_the_installed_flower():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-m", "flowerdro.deploy.supernode", "--poll", "0.1", "--", "--help"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"patches Flower {FLOWER_SERIES}x; installed: {flwr.__version__}" in out.stderr


# ----------------------------------------------------------------------------- the ClientApp's route
def test_the_client_app_forwards_with_worker_1_and_runs_here_when_no_worker_answers(folder, synth_rc, monkeypatch):
    from flowerdro.apps.client_app import app

    ctx = _context(synth_rc, folder)
    via_worker = app(_init(synth_rc), ctx)
    assert len(list(folder.glob("*.pid"))) == 1  # served by the worker
    local = handler("query.init")(_init(synth_rc), _context(synth_rc, folder, worker=0))
    a, b = _arrays(via_worker), _arrays(local)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    monkeypatch.setattr(w, "forward", lambda *_: None)  # no worker reachable: the message runs here
    here = app(_init(synth_rc), ctx)
    a = _arrays(here)
    assert all(np.array_equal(a[k], b[k]) for k in a)
