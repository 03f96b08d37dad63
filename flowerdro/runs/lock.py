"""One run per output folder: a lock held for the run, with its holder written beside it.

:class:`FolderLock` takes an exclusive lock on ``<folder>/<name>.lock`` with the
`filelock <https://py-filelock.readthedocs.io>`_ package (``flock`` on Unix: the
operating system releases it when the holding process ends, however it ends) and writes
who holds it to ``<folder>/<name>.lock.json``: process id, host, start time and, when
known, the Flower run id. A second run on the folder is refused at once with a
:class:`FolderInUseError` that names the folder and that holder; it never waits.

The lock file is opened without following a link (``O_NOFOLLOW``, filelock ≥ 3.20.3): a
symbolic link planted in its place is refused, naming it, and its target is never
opened or truncated. The holder file is replaced by rename (:func:`~flowerdro.runs.files.write_atomic`).

A holder file left by a run that ended without releasing its lock (``kill -9``, a crash
of its machine) is found when the lock is next taken: the lock itself is free (the
operating system dropped it with the process), so it is taken over with a warning that
names the old holder and whether its process is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from logging import WARNING
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import filelock
from flwr.common import log

from flowerdro.runs.files import RunFileError, _link_error, write_atomic

__all__ = ["FolderInUseError", "FolderLock", "describe_holder"]


class FolderInUseError(RuntimeError):
    """Another run holds the lock of the folder (the message names the folder and the holder)."""


def describe_holder(holder: dict[str, Any] | None) -> str:
    """``holder`` (the content of a ``.lock.json``) in words: run id, pid, host, start time."""
    if not holder:
        return "a run that has not written its holder file yet"
    parts = []
    if holder.get("run_id") is not None:
        parts.append(f"flwr run {holder['run_id']}")
    parts.append(f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}")
    if holder.get("started"):
        parts.append(f"started {holder['started']}")
    return ", ".join(parts)


class FolderLock:
    """The exclusive lock of one output folder for one run.

    Parameters
    ----------
    folder : str or Path
        The folder (created when the lock is taken).
    name : str (default: "run")
        The lock's file name stem: ``<folder>/<name>.lock`` and ``<name>.lock.json``.
    run_id : int, optional
        The Flower run id, written into the holder file when known.
    what : str (default: "output-dir")
        What the folder is to the user (named in the errors).
    """

    def __init__(self, folder: str | Path, *, name: str = "run", run_id: int | None = None,
                 what: str = "output-dir") -> None:
        self.folder = Path(folder)
        self.path = self.folder / f"{name}.lock"
        self.holder_path = self.folder / f"{name}.lock.json"
        self.run_id, self.what = run_id, what
        self._lock: filelock.BaseFileLock | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock is not None

    def holder(self) -> dict[str, Any] | None:
        """The holder file's content (None when there is none or it cannot be read)."""
        try:
            data = json.loads(self.holder_path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def acquire(self) -> None:
        """Take the lock (nothing when held already) and write the holder file.

        Raises
        ------
        FolderInUseError
            Another run holds it (the message names the folder and the holder).
        flowerdro.runs.files.RunFileError
            The folder or the lock file cannot be created or written (naming the path).
        """
        if self._lock is not None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunFileError(f"the {self.what} folder", self.folder, exc, action="create") from exc
        lock = filelock.FileLock(self.path, thread_local=False)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            raise FolderInUseError(
                f"{self.what}: {self.folder} is in use by another run ({describe_holder(self.holder())}; "
                f"lock {self.path}); wait until it ends or stop it, or choose another {self.what}") from None
        except OSError as exc:
            raise _link_error(self.path, exc, what="the lock", action="take") from exc
        try:
            if (old := self.holder()) is not None:
                log(WARNING, "%s: taking over the lock of %s from %s, which ended without releasing it (%s)",
                    self.what, self.folder, describe_holder(old), _fate(old))
            me = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": self.run_id,
                  "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}

            def write(fh: IO[bytes]) -> None:
                fh.write(json.dumps(me, indent=2).encode())

            write_atomic(self.holder_path, write, "the lock's holder file")
        except BaseException:
            lock.release()
            raise
        self._lock = lock

    def release(self) -> None:
        """Remove the holder file and release the lock (nothing when not held)."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                self.holder_path.unlink()
        finally:
            lock.release()

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _fate(holder: dict[str, Any]) -> str:
    """What became of a holder's process, as far as this machine can tell."""
    if holder.get("host") != socket.gethostname():
        return "it ran on another host"
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return "its process id is unknown"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} is gone"
    except PermissionError:
        pass
    return f"a process {pid} runs on this host but does not hold the lock"
