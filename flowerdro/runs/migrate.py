"""``python -m flowerdro.runs.migrate DIR [DIR ...]``: convert pickled checkpoints to ``.npz``.

Checkpoints are ``checkpoint_roundNNNN.npz`` files that loading cannot turn into code
(:mod:`flowerdro.runs.checkpoint`); a resume refuses pickled checkpoints
(``checkpoint_roundNNNN.pkl``, a Python pickle of the same state dict). This command
converts them for the folders you name (and the folders below them), **unpickling each
one**: run it only on checkpoints you wrote yourself, since unpickling a file can run any
code in it.

Each ``.pkl`` is loaded, written as the ``.npz`` of the same round (with the run identity
its folder's ``settings.json`` records, signed with the key of the environment when one
is set: :mod:`flowerdro.runs.integrity`), read back through the safe loader and compared
with what was unpickled (every value, type and array bit), and only then removed
(``--keep`` keeps it). Each folder is locked while it is converted, so a
run using it is not disturbed. The exit code is 1 when a file could not be converted
(each named), else 0.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np

from flowerdro.runs.checkpoint import checkpoint_name, load_checkpoint, save_checkpoint
from flowerdro.runs.integrity import run_key
from flowerdro.runs.lock import FolderLock
from flowerdro.runs.output import folder_settings
from flowerdro.runs.store import CheckpointStore

__all__ = ["main", "migrate_folder"]


def migrate_folder(folder: str | Path, *, keep: bool = False) -> list[Path]:
    """Convert the pickled checkpoints of ``folder`` (not its sub-folders); returns the ``.npz`` written.

    Raises
    ------
    flowerdro.runs.lock.FolderInUseError
        A run holds the folder.
    ValueError
        A pickled checkpoint does not hold a checkpoint, or its ``.npz`` does not read back
        equal (naming the file).
    """
    folder = Path(folder)
    written: list[Path] = []
    with FolderLock(folder):
        key = run_key(folder)
        identity = folder_settings(folder).get("identity")  # the folder's own record
        for rnd, path in CheckpointStore(folder, key=key).pickled():
            with path.open("rb") as fh:
                state = pickle.load(fh)  # noqa: S301  # the user's own checkpoint, converted on request
            if not isinstance(state, dict) or state.get("round") != rnd:
                raise ValueError(f"{path}: does not hold the checkpoint of round {rnd}")
            target = save_checkpoint(folder / checkpoint_name(rnd), state, identity=identity, key=key)
            if not _same(load_checkpoint(target, key=key), state):
                target.unlink()
                raise ValueError(f"{path}: its .npz conversion does not read back equal; left as it is")
            if not keep:
                path.unlink()
            written.append(target)
    return written


def _same(a: Any, b: Any) -> bool:
    """Equal in type, value and, for arrays, dtype, shape and bits (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray | np.generic):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if hasattr(a, "__dataclass_fields__"):
        return all(_same(getattr(a, n), getattr(b, n)) for n in a.__dataclass_fields__)
    return bool(a == b)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m flowerdro.runs.migrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="run or comparison folders (searched recursively)")
    parser.add_argument("--keep", action="store_true", help="keep the .pkl files after converting them")
    args = parser.parse_args(argv)
    failed = 0
    for root in map(Path, args.folders):
        if not root.is_dir():
            print(f"{root}: not a folder", file=sys.stderr)
            failed += 1
            continue
        folders = sorted({p.parent for p in root.rglob("checkpoint_round*.pkl")})
        if not folders:
            print(f"{root}: no pickled checkpoints")
        for folder in folders:
            try:
                for path in migrate_folder(folder, keep=args.keep):
                    print(f"wrote {path}")
            except Exception as exc:  # noqa: BLE001  # report every folder, fail at the end
                print(f"{folder}: {type(exc).__name__}: {exc}", file=sys.stderr)
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
