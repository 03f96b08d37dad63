"""The file format of a checkpoint: a strategy's server state in one ``.npz`` that loading cannot run.

A checkpoint is a plain dict (:meth:`FairStrategy.server_state
<flowerdro.strategies.base.FairStrategy.server_state>`); ``start(resume=checkpoint)``
continues the run after it, so the rounds that follow are those of an uninterrupted run.
:func:`save_checkpoint` writes it as one ``.npz`` file that loading cannot turn into code:

* ``meta``: UTF-8 JSON ``{"format": "flowerdro-checkpoint", "version": 2, "round": r,
  "identity": {...}, "key-id": k, "state": tree}``: the run's identity
  (:mod:`flowerdro.runs.identity`: data, model, settings, versions; ``null`` when not
  given), the id of the key that signed it (``null`` when unsigned), and the dict as
  ``tree`` in the typed JSON of :mod:`flowerdro.runs.codec` (int keys, tuples, numpy
  scalars and the algorithms' registered state dataclasses kept exactly);
* ``a0``, ``a1``, …: the numpy arrays and scalars the tree refers to, in their dtypes;
* ``sha256``: the SHA-256 of the payload (``meta``, then each array's name, dtype,
  shape and bytes), checked before anything is decoded: it catches accidents;
* ``hmac`` (with a key, :mod:`flowerdro.runs.integrity`): the HMAC-SHA256 of the same
  payload under the key, which nobody without the key can recompute after an edit.

:func:`read_checkpoint` reads it with ``numpy.load(allow_pickle=False)``, from a file
opened without following a link, and raises :class:`CheckpointError` naming the file for
anything else: a truncated, empty or garbage file, a checksum that does not match, an
HMAC that does not match (or is missing while a key is set, or present while none is),
an unknown format, an object array, a state class that is not registered, or a pickled
``.pkl`` checkpoint (those are never unpickled here; ``python -m flowerdro.runs.migrate
DIR`` converts a folder of one's own). Version 1 files (no identity, no HMAC) are read
as before. :func:`check_model_arrays` checks a checkpoint's model against the model a
client builds (names, shapes, dtypes).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from flowerdro.runs.codec import decode, encode
from flowerdro.runs.files import read_own, write_atomic
from flowerdro.runs.integrity import RunKey, describe_key_names

__all__ = ["CHECKPOINT_FORMAT", "Checkpoint", "CheckpointError", "check_model_arrays", "checkpoint_name",
           "load_checkpoint", "read_checkpoint", "save_checkpoint"]

#: The ``format`` and ``version`` a checkpoint's ``meta`` carries (versions read: 1 and 2).
CHECKPOINT_FORMAT, CHECKPOINT_VERSION = "flowerdro-checkpoint", 2
_READABLE = (1, 2)

_ARRAY = re.compile(r"a\d+")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used (damaged, of an unknown format, or pickled); names the file."""


@dataclass
class Checkpoint:
    """A checkpoint read by :func:`read_checkpoint`.

    Attributes
    ----------
    state : dict
        The server state (what ``start(resume=...)`` takes).
    identity : dict or None
        The run identity of its header (None in a version 1 file).
    path : Path
        The file.
    key_id : str or None
        The id of the key that signed it (None: unsigned).
    """

    state: dict[str, Any]
    identity: dict[str, Any] | None
    path: Path
    key_id: str | None = None

    @property
    def round(self) -> int:
        """The round after which it was saved."""
        return int(self.state["round"])


def checkpoint_name(server_round: int) -> str:
    """The file name of round ``server_round``'s checkpoint: ``checkpoint_roundNNNN.npz``."""
    return f"checkpoint_round{int(server_round):04d}.npz"


def save_checkpoint(path: str | Path, state: Mapping[str, Any], *, identity: Mapping[str, Any] | None = None,
                    key: RunKey | None = None) -> Path:
    """Write the checkpoint ``state`` (a dict with ``round``) to ``path`` atomically.

    ``identity`` (the run's, :func:`~flowerdro.runs.identity.run_identity`) goes into the
    header; with ``key`` the file also carries the HMAC of its payload under the key.

    Raises
    ------
    flowerdro.runs.codec.CodecError
        ``state`` holds a value without an exact form (naming where).
    flowerdro.runs.files.RunFileError
        The file could not be written (full disk, permissions; the path is named and no
        temporary file is left).
    """
    tree, arrays = encode(dict(state))
    meta = json.dumps({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "round": int(state["round"]),
                       "identity": None if identity is None else dict(identity),
                       "key-id": None if key is None else key.key_id, "state": tree}).encode()
    digest = _digest(meta, arrays)
    extra = {} if key is None else {"hmac": np.frombuffer(_digest(meta, arrays, key).encode(), dtype=np.uint8)}

    def write(fh: IO[bytes]) -> None:
        np.savez(fh, meta=np.frombuffer(meta, dtype=np.uint8),
                 sha256=np.frombuffer(digest.encode(), dtype=np.uint8), **extra, **arrays)

    return write_atomic(path, write, "checkpoint")


def load_checkpoint(path: str | Path, *, key: RunKey | None = None) -> dict[str, Any]:
    """The server state saved in ``path`` by :func:`save_checkpoint`, checked and decoded.

    Raises
    ------
    CheckpointError
        See :func:`read_checkpoint`.
    """
    return read_checkpoint(path, key=key).state


def read_checkpoint(path: str | Path, *, key: RunKey | None = None) -> Checkpoint:
    """The checkpoint in ``path``, checked (SHA-256, and the HMAC under ``key``) and decoded.

    Parameters
    ----------
    path : str or Path
        The file (a symbolic link in its place is refused).
    key : RunKey, optional
        The run's key: the file must carry an HMAC under it. Without a key a signed file
        is refused too (its protection would be dropped without a word).

    Raises
    ------
    CheckpointError
        The file is not an intact checkpoint of this format, or its HMAC does not hold;
        the message names the file and what is wrong with it.
    """
    path = Path(path)
    if path.suffix == ".pkl":
        raise CheckpointError(
            f"{path} is a pickled checkpoint, which is not loaded (unpickling a file can run any code); "
            f"if you wrote it yourself, convert its folder with `python -m flowerdro.runs.migrate {path.parent}`, "
            "or delete it and start the run afresh")
    try:
        try:
            raw = read_own(path, "checkpoint")
        except OSError as exc:
            raise CheckpointError(str(exc)) from exc
        magic = raw[:4]
        if not magic:
            raise CheckpointError("the file is empty")
        if magic[:1] == b"\x80":
            raise CheckpointError("it holds pickled data, which is never loaded")
        if magic[:2] != b"PK":
            raise CheckpointError(f"not an .npz archive (it starts with {magic!r})")
        archive = np.load(io.BytesIO(raw), allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise CheckpointError("not an .npz archive")
        with archive as data:
            names = list(data.files)
            extra = [n for n in names if n not in ("meta", "sha256", "hmac") and not _ARRAY.fullmatch(n)]
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
    meta, digest, mac = loaded.pop("meta"), loaded.pop("sha256"), loaded.pop("hmac", None)
    if meta.dtype != np.uint8 or meta.ndim != 1 or digest.dtype != np.uint8 \
            or (mac is not None and mac.dtype != np.uint8):
        raise CheckpointError(f"checkpoint {path} is damaged: its meta, sha256 or hmac entry is not bytes")
    meta_bytes = meta.tobytes()
    if digest.tobytes().decode("ascii", "replace") != _digest(meta_bytes, loaded):
        raise CheckpointError(f"checkpoint {path} is damaged: its SHA-256 does not match its content")
    try:
        head = json.loads(meta_bytes)
        if head.get("format") != CHECKPOINT_FORMAT or head.get("version") not in _READABLE:
            raise CheckpointError(f"format {head.get('format')!r} version {head.get('version')!r} "
                                  f"(readable: {CHECKPOINT_FORMAT!r} versions {', '.join(map(str, _READABLE))})")
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be used: {exc}") from None
    except Exception as exc:  # noqa: BLE001  # malformed JSON
        raise CheckpointError(f"checkpoint {path} cannot be used: {type(exc).__name__}: {exc}") from exc
    key_id = head.get("key-id")
    if key is not None:
        if mac is None:
            raise CheckpointError(f"checkpoint {path} is not signed, and the run's key is set ({key.source}): "
                                  "only checkpoints written under the key are loaded")
        if not key.matches(mac.tobytes().decode("ascii", "replace"), _digest(meta_bytes, loaded, key)):
            why = (f"it was signed with another key (key id {key_id}; the key of {key.source} has id {key.key_id})"
                   if key_id != key.key_id else "its HMAC does not match its content: it was changed after it "
                                                 "was written")
            raise CheckpointError(f"checkpoint {path} is refused: {why}")
    elif mac is not None:
        raise CheckpointError(f"checkpoint {path} is signed (key id {key_id}) but no key is set: set "
                              f"{describe_key_names()} to the run's key")
    try:
        state = decode(head["state"], loaded)
        if not isinstance(state, dict) or state.get("round") != head.get("round"):
            raise CheckpointError("its state does not carry the round of its header")
        identity = head.get("identity")
        if identity is not None and not isinstance(identity, dict):
            raise CheckpointError("its identity is not a mapping")
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be used: {exc}") from None
    except Exception as exc:  # noqa: BLE001  # malformed tree
        raise CheckpointError(f"checkpoint {path} cannot be used: {type(exc).__name__}: {exc}") from exc
    return Checkpoint(state, identity, path, key_id if mac is not None else None)


def check_model_arrays(state: Mapping[str, Any], model: Mapping[str, np.ndarray] | Any, where: str | Path) -> None:
    """Refuse a checkpoint whose model does not fit ``model`` (the one the clients build).

    The checkpoint's global model (``state["arrays"]``) must hold the same names, in the
    same order, with the same shapes and dtypes; every per-layer list of arrays in the
    algorithm's state with as many entries as the model has arrays (control variates,
    device models) must hold the same shapes.

    Parameters
    ----------
    state : Mapping
        A checkpoint's server state.
    model : Mapping or ArrayRecord
        The model's arrays by name (an ArrayRecord, e.g. a client's ``query.init`` reply).
    where : str or Path
        The checkpoint file (named in the error).

    Raises
    ------
    CheckpointError
        Naming the file, the first array that differs and both shapes or dtypes.
    """
    names = list(model.keys())
    ref = {k: np.asarray(model[k].numpy() if hasattr(model[k], "numpy") else model[k]) for k in names}
    arrays = state.get("arrays")
    if arrays is None:
        return
    if list(arrays) != names:
        missing = [k for k in names if k not in arrays]
        extra = [k for k in arrays if k not in ref]
        parts = ([f"it lacks {', '.join(missing)}"] if missing else []) + \
            ([f"it has {', '.join(extra)}, which the model has not"] if extra else [])
        raise CheckpointError(f"checkpoint {where} holds a model that is not this run's: "
                              + ("; ".join(parts) or "its arrays are in another order")
                              + f" (the clients' model has {', '.join(names)})")
    for k in names:
        got, want = np.asarray(arrays[k]), ref[k]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise CheckpointError(
                f"checkpoint {where} holds a model that is not this run's: array '{k}' has shape {got.shape} and "
                f"dtype {got.dtype}, the clients' model {want.shape} and {want.dtype}")
    shapes = [ref[k].shape for k in names]
    for place, layers in _layer_lists(state.get("state"), "state", len(names)):
        for k, layer, shape in zip(names, layers, shapes, strict=True):
            if np.asarray(layer).shape != shape:
                raise CheckpointError(
                    f"checkpoint {where} holds state that does not fit the model: {place} has shape "
                    f"{np.asarray(layer).shape} for '{k}', the clients' model {shape}")


def _layer_lists(value: Any, where: str, n: int, depth: int = 0) -> list[tuple[str, list[Any]]]:
    """Lists of ``n`` arrays inside ``value`` (per-layer state), with where they sit."""
    if depth > 6:
        return []
    if isinstance(value, list | tuple):
        if len(value) == n and n and all(isinstance(v, np.ndarray) for v in value):
            return [(where, list(value))]
        return [x for i, v in enumerate(value) for x in _layer_lists(v, f"{where}[{i}]", n, depth + 1)]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _layer_lists(v, f"{where}[{k!r}]", n, depth + 1)]
    if hasattr(value, "__dataclass_fields__"):
        return [x for f in value.__dataclass_fields__
                for x in _layer_lists(getattr(value, f), f"{where}.{f}", n, depth + 1)]
    return []


def _digest(meta: bytes, arrays: Mapping[str, np.ndarray], key: RunKey | None = None) -> str:
    """SHA-256 (hex) of ``meta`` and every array's name, dtype, shape and bytes, by name; HMAC under ``key``."""
    h: Any = hashlib.sha256() if key is None else key.mac()
    h.update(meta)
    for name in sorted(arrays, key=lambda n: (len(n), n)):
        arr = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{arr.dtype.str}\0{arr.shape}\0".encode())
        h.update(arr.reshape(-1).view(np.uint8).data)
    return h.hexdigest()
