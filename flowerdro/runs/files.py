"""Writing a run's files so that a failure names the file and leaves nothing half-written.

Every file of a run folder is written through :func:`write_atomic` (a temporary file in
the same folder, flushed to disk, then renamed over the target) or appended with
:func:`append_text` (cut back to its old length when the append fails). An ``OSError``
(a full disk, a folder without write permission, a quota) becomes a :class:`RunFileError`
that names what was being written and its path, e.g. ``could not write checkpoint
/x/checkpoint_round0003.npz: [Errno 28] No space left on device``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np
from flwr.app import ArrayRecord

from flowerdro.buffers import to_array

__all__ = ["RunFileError", "append_text", "load_arrays", "save_arrays", "write_atomic"]

# The process's umask, read once: mkstemp creates files readable by their owner only, and
# a run's files get the permissions a plain open() would give them. (umask can only be
# read by setting it; done at import, before any thread of this package writes files.)
_UMASK = os.umask(0o022)
os.umask(_UMASK)


class RunFileError(OSError):
    """An ``OSError`` while writing one of a run's files, naming the file.

    ``errno``, ``strerror`` and ``filename`` are those of the original error (also in
    ``__cause__``); ``str()`` says what was written where.
    """

    def __init__(self, what: str, path: str | Path, exc: OSError, action: str = "write") -> None:
        super().__init__(exc.errno, exc.strerror or str(exc), str(path))
        self.what, self.path, self.action = what, Path(path), action
        self.detail = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno is not None else str(exc)

    def __str__(self) -> str:
        return f"could not {self.action} {self.what} {self.path}: {self.detail}"

    def __reduce__(self) -> tuple[object, ...]:  # keeps the class across process boundaries
        return (_rebuild, (self.what, str(self.path), self.errno, self.strerror, self.action))


def _rebuild(what: str, path: str, errno: int | None, strerror: str | None, action: str) -> RunFileError:
    return RunFileError(what, path, OSError(errno, strerror), action)


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], None], what: str) -> Path:
    """Write ``path`` through ``write(fh)`` on a temporary file, then rename it over ``path``.

    The temporary file sits in ``path``'s folder (same file system, so the rename is
    atomic), is synced to disk before the rename, and is removed when anything fails, so
    ``path`` holds either its old content or the whole new one.

    Raises
    ------
    RunFileError
        The folder or the file could not be written (the original ``OSError`` as cause).
    """
    path = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~_UMASK)
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise RunFileError(what, path, exc) from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


def append_text(path: str | Path, text: str, what: str) -> None:
    """Append ``text`` to ``path``; on failure cut the file back to its old length.

    Raises
    ------
    RunFileError
        The append failed (a line never stays half-written when the cut-back succeeds).
    """
    path = Path(path)
    size: int | None = None
    try:
        size = path.stat().st_size if path.exists() else 0
        with path.open("a") as fh:
            fh.write(text)
            fh.flush()
    except OSError as exc:
        if size is not None:
            with contextlib.suppress(OSError):
                os.truncate(path, size)
        raise RunFileError(what, path, exc, action="append") from exc


def save_arrays(path: str | Path | IO[bytes], arrays: ArrayRecord) -> None:
    """Save an ArrayRecord as ``.npz`` (one entry per key, key order kept) to a path or an open binary file."""
    np.savez(path, **{k: arrays[k].numpy() for k in arrays.keys()})


def load_arrays(path: str | Path) -> ArrayRecord:
    """The ArrayRecord saved by :func:`save_arrays`."""
    with np.load(path) as data:
        return ArrayRecord({k: to_array(data[k]) for k in data.files})
