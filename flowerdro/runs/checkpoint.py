"""The file format of a checkpoint: a strategy's server state in one ``.npz`` that loading cannot run.

A checkpoint is a plain dict (:meth:`FairStrategy.server_state
<flowerdro.strategies.base.FairStrategy.server_state>`); ``start(resume=checkpoint)``
continues the run after it, so the rounds that follow are those of an uninterrupted run.
:func:`save_checkpoint` writes it as one ``.npz`` file that loading cannot turn into code:

* ``meta``: UTF-8 JSON ``{"format": "flowerdro-checkpoint", "version": 1, "round": r,
  "state": tree}``, where ``tree`` is the dict in the typed JSON of
  :mod:`flowerdro.runs.codec` (int keys, tuples, numpy scalars and the algorithms'
  registered state dataclasses kept exactly);
* ``a0``, ``a1``, …: the numpy arrays and scalars the tree refers to, in their dtypes;
* ``sha256``: the SHA-256 of the payload (``meta``, then each array's name, dtype,
  shape and bytes), checked before anything is decoded.

:func:`load_checkpoint` reads it with ``numpy.load(allow_pickle=False)`` and raises
:class:`CheckpointError` naming the file for anything else: a truncated, empty or
garbage file, a checksum that does not match, an unknown format, an object array, a
state class that is not registered, or a pickled ``.pkl`` checkpoint (those are never
unpickled here; ``python -m flowerdro.runs.migrate DIR`` converts a folder of one's own).
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from flowerdro.runs.codec import decode, encode
from flowerdro.runs.files import write_atomic

__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "checkpoint_name", "load_checkpoint", "save_checkpoint"]

#: The ``format`` and ``version`` a checkpoint's ``meta`` carries.
CHECKPOINT_FORMAT, CHECKPOINT_VERSION = "flowerdro-checkpoint", 1

_ARRAY = re.compile(r"a\d+")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used (damaged, of an unknown format, or pickled); names the file."""


def checkpoint_name(server_round: int) -> str:
    """The file name of round ``server_round``'s checkpoint: ``checkpoint_roundNNNN.npz``."""
    return f"checkpoint_round{int(server_round):04d}.npz"


def save_checkpoint(path: str | Path, state: Mapping[str, Any]) -> Path:
    """Write the checkpoint ``state`` (a dict with ``round``) to ``path`` atomically.

    Raises
    ------
    flowerdro.runs.codec.CodecError
        ``state`` holds a value without an exact form (naming where).
    flowerdro.runs.files.RunFileError
        The file could not be written (full disk, permissions; the path is named and no
        temporary file is left).
    """
    tree, arrays = encode(dict(state))
    meta = json.dumps({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                       "round": int(state["round"]), "state": tree}).encode()
    digest = _digest(meta, arrays)

    def write(fh: IO[bytes]) -> None:
        np.savez(fh, meta=np.frombuffer(meta, dtype=np.uint8),
                 sha256=np.frombuffer(digest.encode(), dtype=np.uint8), **arrays)

    return write_atomic(path, write, "checkpoint")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint saved in ``path`` by :func:`save_checkpoint`, checked and decoded.

    Raises
    ------
    CheckpointError
        The file is not an intact checkpoint of this format; the message names the file
        and what is wrong with it.
    """
    path = Path(path)
    if path.suffix == ".pkl":
        raise CheckpointError(
            f"{path} is a pickled checkpoint, which is not loaded (unpickling a file can run any code); "
            f"if you wrote it yourself, convert its folder with `python -m flowerdro.runs.migrate {path.parent}`, "
            "or delete it and start the run afresh")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
        if not magic:
            raise CheckpointError("the file is empty")
        if magic[:1] == b"\x80":
            raise CheckpointError("it holds pickled data, which is never loaded")
        if magic[:2] != b"PK":
            raise CheckpointError(f"not an .npz archive (it starts with {magic!r})")
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise CheckpointError("not an .npz archive")
        with archive as data:
            names = list(data.files)
            extra = [n for n in names if n not in ("meta", "sha256") and not _ARRAY.fullmatch(n)]
            if "meta" not in names or "sha256" not in names or extra:
                raise CheckpointError("entries " + ", ".join(sorted(names)) + " are not those of a checkpoint")
            loaded = {n: data[n] for n in names}
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: {exc}") from None
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: the archive is truncated or corrupt "
                              f"(BadZipFile: {exc})") from exc
    except ValueError as exc:
        if "pickle" not in str(exc):
            raise CheckpointError(f"checkpoint {path} is damaged: ValueError: {exc}") from exc
        raise CheckpointError(f"checkpoint {path} is damaged: an entry holds pickled (object) data, "
                              "which is never loaded") from None
    except Exception as exc:  # noqa: BLE001  # any failure to read the archive means it is damaged
        raise CheckpointError(f"checkpoint {path} is damaged: {type(exc).__name__}: {exc}") from exc
    meta, digest = loaded.pop("meta"), loaded.pop("sha256")
    if meta.dtype != np.uint8 or meta.ndim != 1 or digest.dtype != np.uint8:
        raise CheckpointError(f"checkpoint {path} is damaged: its meta or sha256 entry is not bytes")
    meta_bytes = meta.tobytes()
    if digest.tobytes().decode("ascii", "replace") != _digest(meta_bytes, loaded):
        raise CheckpointError(f"checkpoint {path} is damaged: its SHA-256 does not match its content")
    try:
        head = json.loads(meta_bytes)
        if head.get("format") != CHECKPOINT_FORMAT or head.get("version") != CHECKPOINT_VERSION:
            raise CheckpointError(f"format {head.get('format')!r} version {head.get('version')!r} "
                                  f"(readable: {CHECKPOINT_FORMAT!r} version {CHECKPOINT_VERSION})")
        state = decode(head["state"], loaded)
        if not isinstance(state, dict) or state.get("round") != head.get("round"):
            raise CheckpointError("its state does not carry the round of its header")
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be used: {exc}") from None
    except Exception as exc:  # noqa: BLE001  # malformed JSON or tree
        raise CheckpointError(f"checkpoint {path} cannot be used: {type(exc).__name__}: {exc}") from exc
    return state


def _digest(meta: bytes, arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 (hex) of ``meta`` and every array's name, dtype, shape and bytes, by name."""
    h = hashlib.sha256(meta)
    for name in sorted(arrays, key=lambda n: (len(n), n)):
        arr = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{arr.dtype.str}\0{arr.shape}\0".encode())
        h.update(arr.reshape(-1).view(np.uint8).data)
    return h.hexdigest()
