"""A node-local worker that keeps torch, the data and the model loaded across messages.

Flower 1.41 runs every message a SuperNode receives in a new ``flwr-clientapp`` process,
which spends most of its time importing torch and loading the client's data. With
``worker=1`` in the node config, the flowerdro ClientApp instead forwards the message to a
long-lived worker process of the node and returns the worker's reply:

1. The first ClientApp process of a (run, node, code) starts the worker detached
   (``python -m flowerdro.deploy.worker``); it listens on a Unix socket in a directory only
   the user can enter (mode 0700, ``<tmp>/flowerdro-worker-<uid>``, or the node config key
   ``worker-dir``), named by a hash of the run id, the node id and the flowerdro code
   (its directory and the files' sizes and mtimes, so a new FAB gets a new worker).
2. Each ClientApp process sends the serialised Message and Context (Flower's protobuf
   serde) and receives the reply and the Context's new state; it imports neither torch nor
   the data code.
3. An exception in the handler comes back as its traceback and is raised in the ClientApp
   process, so Flower replies with the message's error, exactly as without a worker. A
   worker that cannot be started, or that dies before replying, makes the ClientApp run
   the message itself (the next message starts a new worker).
4. The worker exits after ``worker-idle`` seconds without a message (default 600) or when
   the process that started its ClientApp (the SuperExec) is gone.

Node config keys: ``worker`` (0/1), ``worker-idle`` (seconds > 0), ``worker-dir`` (a folder).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context, Message

from flowerdro.deploy.lifetime import guard_worker

__all__ = ["WorkerError", "WorkerSettings", "forward", "serve", "socket_path", "worker_settings"]

log = logging.getLogger(__name__)

_OK, _ERROR = b"K", b"E"
_LEN = struct.Struct("!Q")
#: Seconds a ClientApp process waits for a worker it started to listen.
START_TIMEOUT = 60.0


class WorkerError(RuntimeError):
    """The handler raised in the worker; the message is the worker's traceback."""


@dataclass(frozen=True)
class WorkerSettings:
    """What the node config says about the worker.

    Attributes
    ----------
    enabled : bool
        ``worker`` = 1: forward every message to the node's worker.
    idle : float
        ``worker-idle``: seconds without a message after which the worker exits.
    folder : str
        ``worker-dir``: where the sockets live ("" = ``<tmp>/flowerdro-worker-<uid>``).
    """

    enabled: bool = False
    idle: float = 600.0
    folder: str = ""


def worker_settings(node_config: dict[str, Any]) -> WorkerSettings:
    """Read ``worker``, ``worker-idle`` and ``worker-dir`` from a node config (defaults when absent).

    Raises
    ------
    ValueError
        ``worker`` is not 0/1/true/false, or ``worker-idle`` is not a number > 0.
    """
    raw = str(node_config.get("worker", "0")).strip().lower()
    if raw not in ("0", "1", "true", "false", ""):
        raise ValueError(f"node config worker: allowed 0, 1, true, false; got {node_config.get('worker')!r}")
    try:
        idle = float(node_config.get("worker-idle", 600.0))
    except (TypeError, ValueError):
        idle = -1.0
    if not idle > 0:
        raise ValueError(f"node config worker-idle: seconds > 0, got {node_config.get('worker-idle')!r}")
    return WorkerSettings(raw in ("1", "true"), idle, str(node_config.get("worker-dir", "")))


def _code_hash() -> str:
    """Hash of the flowerdro package's location and its files' sizes and mtimes."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(str(root).encode())
    for f in sorted(root.rglob("*.py")):
        st = f.stat()
        h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def _private_dir(folder: str) -> Path:
    """``folder`` (default ``<tmp>/flowerdro-worker-<uid>``), created 0700; refuse one others can enter."""
    path = Path(folder) if folder else Path(tempfile.gettempdir()) / f"flowerdro-worker-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"worker-dir {path}: must be owned by uid {os.getuid()} with mode 0700 "
                              f"(is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    return path


def socket_path(context: Context, settings: WorkerSettings) -> Path:
    """The socket of the worker serving ``context``'s run and node with this code."""
    key = hashlib.sha256(f"{context.run_id}:{context.node_id}:{_code_hash()}".encode()).hexdigest()[:20]
    return _private_dir(settings.folder) / f"w-{key}.sock"


# ----------------------------------------------------------------------------- framing
def _send(sock: socket.socket, *parts: bytes) -> None:
    sock.sendall(b"".join(_LEN.pack(len(p)) + p for p in parts))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("worker connection closed mid-frame")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> bytes:
    return _recv_exact(sock, int(_LEN.unpack(_recv_exact(sock, _LEN.size))[0]))


def _encode(message: Message, context: Context) -> tuple[bytes, bytes]:
    from flwr.common.serde import context_to_proto, message_to_proto

    return message_to_proto(message).SerializeToString(), context_to_proto(context).SerializeToString()


def _decode(message: bytes, context: bytes) -> tuple[Message, Context]:
    from flwr.common.serde import context_from_proto, message_from_proto
    from flwr.proto.message_pb2 import Context as ProtoContext
    from flwr.proto.message_pb2 import Message as ProtoMessage

    pm, pc = ProtoMessage(), ProtoContext()
    pm.ParseFromString(message)
    pc.ParseFromString(context)
    return message_from_proto(pm), context_from_proto(pc)


# ----------------------------------------------------------------------------- client side
def _connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        return sock
    except OSError:
        sock.close()
        return None


def _start_worker(path: Path, settings: WorkerSettings) -> subprocess.Popen:
    """Start the worker detached, importing the same flowerdro code as this process."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    with open(path.with_suffix(".log"), "ab") as logf:
        return subprocess.Popen(
            [sys.executable, "-m", "flowerdro.deploy.worker", "--socket", str(path), "--idle", str(settings.idle),
             "--watch-pid", str(os.getppid())],
            env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True)


def _connect_or_start(path: Path, settings: WorkerSettings) -> socket.socket | None:
    """A connection to the worker at ``path``, starting it if none listens; None if it never does."""
    sock = _connect(path)
    if sock is not None:
        return sock
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one ClientApp process of the node starts the worker
        sock = _connect(path)
        if sock is not None:
            return sock
        proc = _start_worker(path, settings)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
            sock = _connect(path)
            if sock is not None:
                return sock
    log.warning("flowerdro worker at %s did not start (exit code %s); see %s", path, proc.poll(),
                path.with_suffix(".log"))
    return None


def forward(message: Message, context: Context, settings: WorkerSettings) -> Message | None:
    """Have the node's worker reply to ``message``; its new Context state replaces ``context.state``.

    Returns
    -------
    Message or None
        The worker's reply, or None when no worker could be reached or it died before
        replying (the caller then runs the message itself).

    Raises
    ------
    WorkerError
        The handler raised in the worker (the worker's traceback is the message).
    """
    path = socket_path(context, settings)
    sock = _connect_or_start(path, settings)
    if sock is None:
        return None
    with sock:
        try:
            _send(sock, *_encode(message, context))
            status = _recv_exact(sock, 1)
            if status == _ERROR:
                raise WorkerError(f"flowerdro worker: {_recv(sock).decode(errors='replace')}")
            if status != _OK:
                raise ConnectionError(f"unexpected status byte {status!r}")
            reply, new_context = _decode(_recv(sock), _recv(sock))
        except (ConnectionError, OSError) as exc:
            log.warning("flowerdro worker at %s failed before replying (%s); running the message here", path, exc)
            return None
    context.state = new_context.state
    return reply


# ----------------------------------------------------------------------------- worker side
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _handle(conn: socket.socket) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    from flowerdro.clients.routes import handler

    message, context = _decode(_recv(conn), _recv(conn))
    # what flwr-clientapp sets for its one message (Message() reads it)
    TaskIdentity.run_id, TaskIdentity.node_id = context.run_id, context.node_id
    TaskIdentity.task_id = message.metadata.dst_task_id
    try:
        reply = handler(message.metadata.message_type)(message, context)
        out = _encode(reply, context)
    except Exception:  # noqa: BLE001  # every handler error goes back to the ClientApp process
        conn.sendall(_ERROR)
        _send(conn, traceback.format_exc().encode())
        return
    conn.sendall(_OK)
    _send(conn, *out)


def serve(path: Path, idle: float, watch_pid: int = 0) -> None:
    """Listen on ``path`` and reply to each forwarded message until ``idle`` seconds pass without one.

    Exits at once when another worker already listens on ``path``, and within a second of
    ``watch_pid`` (when > 0) exiting. Removes its socket on exit.
    """
    probe = _connect(path)
    if probe is not None:
        probe.close()
        return
    path.unlink(missing_ok=True)  # a dead worker's socket
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o600)
    inode = path.stat().st_ino
    server.listen(16)
    server.settimeout(1.0)
    last = time.monotonic()
    try:
        while time.monotonic() - last < idle and (watch_pid <= 0 or _alive(watch_pid)):
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(None)
                try:
                    _handle(conn)
                except (ConnectionError, OSError) as exc:
                    log.warning("flowerdro worker: connection failed: %s", exc)
            last = time.monotonic()
    finally:
        server.close()
        try:
            if path.stat().st_ino == inode:
                path.unlink()
        except FileNotFoundError:
            pass


def main(argv: list[str] | None = None) -> int:
    """``python -m flowerdro.deploy.worker --socket PATH [--idle S] [--watch-pid PID]``."""
    ap = argparse.ArgumentParser(description="flowerdro node-local worker (started by the ClientApp)")
    ap.add_argument("--socket", required=True, type=Path)
    ap.add_argument("--idle", type=float, default=600.0)
    ap.add_argument("--watch-pid", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(message)s")
    guard_worker(args.watch_pid)  # ends when the SuperExec is gone (kill -9 included) and on SIGTERM
    args.socket.with_suffix(".pid").write_text(str(os.getpid()))
    serve(args.socket, args.idle, args.watch_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
