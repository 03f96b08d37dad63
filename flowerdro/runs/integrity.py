"""The optional key of a run's files: an HMAC that whoever can write the output folder cannot forge.

Without a key a checkpoint carries a SHA-256 of its content, which catches accidents
(a truncated copy, a flipped bit) but not an edit: whoever can write the folder can
recompute it. With a key, flowerdro also writes an HMAC-SHA256 under that key into every
checkpoint (:mod:`flowerdro.runs.checkpoint`) and, at the end of a run, into
``signature.json`` for the files a resume takes a finished run from (``rounds.jsonl``,
``final_model.npz``, ``settings.json``); a resume then loads only files whose HMAC
matches, so nobody without the key can plant server state or a run's results.

The key comes from the environment of the process that runs the strategies (the
ServerApp's, i.e. the SuperLink's in a deployment; the experiments runner's):

* ``FLOWERDRO_CHECKPOINT_KEY``: the key itself (its UTF-8 bytes), e.g. from a secrets store;
* ``FLOWERDRO_CHECKPOINT_KEY_FILE``: a file holding it (its bytes, a trailing newline
  removed), which must lie outside the output folder (a key the folder's writers can
  read or replace protects nothing).

At least :data:`MIN_KEY_BYTES` bytes (``openssl rand -hex 32`` gives 64). Setting both is
refused, as is a key file inside the output folder. The threat model is in
docs/architecture.md, "Restarting a deployment".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path

from flwr.common import log

__all__ = ["KEY_ENV", "KEY_FILE_ENV", "MIN_KEY_BYTES", "IntegrityError", "RunKey", "check_signature",
           "describe_key_names", "run_key", "sign_files"]

#: The environment variable holding the key itself.
KEY_ENV = "FLOWERDRO_CHECKPOINT_KEY"
#: The environment variable naming a file that holds the key.
KEY_FILE_ENV = "FLOWERDRO_CHECKPOINT_KEY_FILE"
#: The shortest key accepted, in bytes.
MIN_KEY_BYTES = 16


class IntegrityError(RuntimeError):
    """A run's files that fail their HMAC, or are signed while no key is set (the message names the file)."""


@dataclass(frozen=True)
class RunKey:
    """A key for the HMACs of a run's files.

    Attributes
    ----------
    source : str
        Where it came from (the environment variable, and the file), for messages.
    """

    secret: bytes = field(repr=False)
    source: str = ""

    @property
    def key_id(self) -> str:
        """A short public name of the key (16 hex digits of HMAC(key, "flowerdro key id")): tells keys apart."""
        return hmac.new(self.secret, b"flowerdro key id", hashlib.sha256).hexdigest()[:16]

    def mac(self) -> hmac.HMAC:
        """A new HMAC-SHA256 under this key."""
        return hmac.new(self.secret, digestmod=hashlib.sha256)

    def file_mac(self, data: bytes, name: str) -> str:
        """HMAC (hex) of a file's ``name`` and ``data``."""
        h = self.mac()
        h.update(name.encode() + b"\0")
        h.update(data)
        return h.hexdigest()

    def matches(self, mac: str, expected: str) -> bool:
        """Whether two HMACs (hex) are equal, compared in constant time."""
        return hmac.compare_digest(str(mac).encode(), str(expected).encode())


def run_key(output_dir: str | Path | None = None, environ: Mapping[str, str] | None = None) -> RunKey | None:
    """The key the environment gives (None when it gives none).

    Parameters
    ----------
    output_dir : str or Path, optional
        The output folder the key protects: a key file inside it is refused.
    environ : Mapping, optional
        The environment (default: ``os.environ``).

    Raises
    ------
    ValueError
        Both variables set, a key file that cannot be read, lies inside ``output_dir`` or
        holds fewer than :data:`MIN_KEY_BYTES` bytes (naming the variable and the file).
    """
    env = os.environ if environ is None else environ
    inline, path = env.get(KEY_ENV, ""), env.get(KEY_FILE_ENV, "")
    if inline and path:
        raise ValueError(f"{KEY_ENV} and {KEY_FILE_ENV} are both set; set one of them")
    if inline:
        secret, source = inline.encode(), KEY_ENV
    elif path:
        file = Path(path).expanduser()
        if output_dir is not None and _inside(file, Path(output_dir)):
            raise ValueError(f"{KEY_FILE_ENV}: {file} lies inside the output folder {output_dir}, which whoever "
                             "can write the folder can read or replace; keep the key outside it")
        try:
            secret = file.read_bytes().rstrip(b"\r\n")
            mode = file.stat().st_mode
        except OSError as exc:
            raise ValueError(f"{KEY_FILE_ENV}: cannot read the key file {file}: {exc.strerror or exc}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log(WARNING, "%s: the key file %s can be read or written by others than its owner (mode %o); "
                "chmod 600 it", KEY_FILE_ENV, file, stat.S_IMODE(mode))
        source = f"{KEY_FILE_ENV} ({file})"
    else:
        return None
    if len(secret) < MIN_KEY_BYTES:
        raise ValueError(f"{source.split(' ')[0]}: the key has {len(secret)} bytes; at least {MIN_KEY_BYTES} are "
                         "needed (e.g. `openssl rand -hex 32`)")
    return RunKey(secret, source)


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` (resolved) lies in ``folder`` (resolved) or below it."""
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def describe_key_names() -> str:
    """The two variables, for messages."""
    return f"{KEY_ENV} or {KEY_FILE_ENV}"


def sign_files(key: RunKey, files: Mapping[str, bytes]) -> dict[str, object]:
    """The content of ``signature.json``: the key's id and the HMAC of every file by name."""
    return {"format": "flowerdro-signature", "version": 1, "key-id": key.key_id,
            "files": {name: key.file_mac(data, name) for name, data in sorted(files.items())}}


def check_signature(key: RunKey | None, signature: Mapping[str, object] | None, files: Mapping[str, bytes],
                    where: str | Path, names: Iterable[str]) -> str | None:
    """What is wrong with a finished run's files under ``key`` (None: nothing).

    Without a key a signature is not needed; a signed run read without a key is refused
    (the key would be dropped silently). With a key every file of ``names`` must carry
    the HMAC ``signature`` records for it.
    """
    if key is None:
        if signature is not None:
            return (f"{where} was written with a key (signature.json, key id {signature.get('key-id')}); set "
                    f"{describe_key_names()} to that key")
        return None
    if signature is None:
        return f"{where} holds no signature.json: its files were not written under the key of {key.source}"
    if signature.get("key-id") != key.key_id:
        return (f"{where}/signature.json was made with another key (key id {signature.get('key-id')}; the key of "
                f"{key.source} has id {key.key_id})")
    macs = signature.get("files")
    macs = macs if isinstance(macs, dict) else {}
    for name in names:
        if name not in files:
            return f"{where}/{name} is missing"
        if name not in macs or not key.matches(str(macs[name]), key.file_mac(files[name], name)):
            return f"{where}/{name} does not match its HMAC in signature.json: it was changed after the run wrote it"
    return None
