"""Writing a run's files so that a failure names the file and leaves nothing half-written.

Every file flowerdro writes into an output folder (settings, round records, checkpoints,
the final model, ``summary.json``, ``table.md``, the figures) is written through
:func:`write_atomic` (a temporary file in the same folder, flushed to disk, then renamed
over the target; :func:`write_text` and :func:`save_figure` for text and figures) or
appended with :func:`append_text` (cut back to its old length when the append fails).
Neither ever writes through a link someone planted in the folder: the rename replaces a
symbolic link by the new file (the link's target is left untouched), and an append
opens the file with ``O_NOFOLLOW``, refusing a link. :func:`read_own` reads a file of
the folder the same way (a planted link is refused, naming it). An ``OSError`` (a full
disk, a folder without write permission, a quota) becomes a :class:`RunFileError` that
names what was being written and its path, e.g. ``could not write checkpoint
/x/checkpoint_round0003.npz: [Errno 28] No space left on device``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
from flwr.app import ArrayRecord

from flowerdro.buffers import to_array

__all__ = ["RunFileError", "append_text", "arrays_from_bytes", "load_arrays", "read_own", "refuse_links", "remove_file",
           "save_arrays", "save_figure", "write_atomic", "write_text"]

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


def write_text(path: str | Path, text: str, what: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` with :func:`write_atomic`."""
    data = text.encode()
    return write_atomic(path, lambda fh: fh.write(data), what)


def remove_file(path: str | Path, what: str) -> None:
    """Remove ``path`` (nothing when absent; a link is removed, not its target).

    Raises
    ------
    RunFileError
        The file could not be removed (``could not remove <what> <path>: ...``).
    """
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as exc:
        raise RunFileError(what, path, exc, action="remove") from exc


def save_figure(fig: Any, path: str | Path, *, dpi: int = 110, what: str = "figure") -> Path:
    """Save a matplotlib figure as PNG to ``path`` with :func:`write_atomic` (never through a link)."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    data = buf.getvalue()
    return write_atomic(path, lambda fh: fh.write(data), what)


#: ``O_NOFOLLOW`` where the platform has it (a link as the last component is refused with ``ELOOP``).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def append_text(path: str | Path, text: str, what: str) -> None:
    """Append ``text`` to ``path``; on failure cut the file back to its old length.

    The file is opened with ``O_NOFOLLOW``: a symbolic link planted in its place is
    refused, never appended to.

    Raises
    ------
    RunFileError
        The append failed (a line never stays half-written when the cut-back succeeds),
        or ``path`` is a symbolic link.
    """
    path = Path(path)
    fd: int | None = None
    size: int | None = None
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o666)
        except OSError as exc:
            raise _link_error(path, exc) from exc
        size = os.fstat(fd).st_size
        with os.fdopen(fd, "a", closefd=True) as fh:
            fd = None
            fh.write(text)
            fh.flush()
    except OSError as exc:
        if size is not None:
            with contextlib.suppress(OSError):
                os.truncate(path, size)
        if fd is not None:
            os.close(fd)
        raise RunFileError(what, path, exc, action="append") from exc


def read_own(path: str | Path, what: str) -> bytes:
    """The bytes of a file of a run folder, read without following a link (``O_NOFOLLOW``).

    Raises
    ------
    FileNotFoundError
        There is no such file.
    RunFileError
        ``path`` is a symbolic link (planted: flowerdro writes none), is not a regular
        file, or cannot be read.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _link_error(path, exc, what=what, action="read") from exc
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise RunFileError(what, path, OSError(errno.EINVAL, "not a regular file"), action="read")
        try:
            return fh.read()
        except OSError as exc:
            raise RunFileError(what, path, exc, action="read") from exc


def _link_error(path: Path, exc: OSError, *, what: str = "", action: str = "append") -> OSError:
    """``exc`` of an ``O_NOFOLLOW`` open; a link in ``path``'s place is named as one (``ELOOP``, ``EMLINK`` on BSD)."""
    if exc.errno in (errno.ELOOP, errno.EMLINK) and path.is_symlink():
        exc = OSError(exc.errno, f"it is a symbolic link (to {os.readlink(path)}), which flowerdro never follows "
                                 "and never writes: remove it")
    return RunFileError(what, path, exc, action=action) if what else exc


def refuse_links(root: str | Path, folder: str | Path) -> None:
    """Refuse a run folder below ``root`` that is, or lies in, a symbolic link planted under ``root``.

    flowerdro creates the folders between ``root`` (the output folder, which may itself be
    a link the user made) and ``folder``; a link among them would send the run's files
    outside ``root``.

    Raises
    ------
    RunFileError
        Naming the link and its target.
    """
    root, folder = Path(root), Path(folder)
    try:
        parts = folder.relative_to(root).parts
    except ValueError:
        return
    here = root
    for part in parts:
        here = here / part
        if here.is_symlink():
            raise RunFileError("the run folder", here, OSError(
                errno.ELOOP, f"it is a symbolic link (to {os.readlink(here)}), which flowerdro never writes "
                             "through: remove it"), action="use")


def save_arrays(path: str | Path | IO[bytes], arrays: ArrayRecord) -> None:
    """Save an ArrayRecord as ``.npz`` (one entry per key, key order kept) to a path or an open binary file."""
    np.savez(path, **{k: arrays[k].numpy() for k in arrays.keys()})


def load_arrays(path: str | Path) -> ArrayRecord:
    """The ArrayRecord saved by :func:`save_arrays` (read without following a link, never unpickled)."""
    return arrays_from_bytes(read_own(path, "arrays"))


def arrays_from_bytes(data: bytes) -> ArrayRecord:
    """The ArrayRecord of the bytes of an ``.npz`` written by :func:`save_arrays` (never unpickled)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return ArrayRecord({k: to_array(npz[k]) for k in npz.files})
