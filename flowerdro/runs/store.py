"""The checkpoints of one run folder: found, read and checked, saved, pruned.

A :class:`CheckpointStore` is the run folder's ``checkpoint_roundNNNN.npz`` files (the
format of :mod:`flowerdro.runs.checkpoint`) seen by one run: it knows the run's identity
and the key of the HMACs, so each checkpoint it reads is checked under the key and
against the identity, and each one it saves carries both. :meth:`CheckpointStore.latest`
chooses the checkpoint a resume continues from (the newest usable one, naming every
checkpoint it passes over); :meth:`CheckpointStore.check_model` refuses one whose model
is not the clients'. Pickled ``.pkl`` checkpoints are found, never loaded.

The store writes no other file of the folder; :class:`~flowerdro.runs.output.RunWriter`
holds one for its run.
"""

from __future__ import annotations

import re
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common import log

from flowerdro.runs.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_model_arrays,
    checkpoint_name,
    read_checkpoint,
    save_checkpoint,
)
from flowerdro.runs.files import remove_file
from flowerdro.runs.identity import compare_identities, describe_differences
from flowerdro.runs.integrity import RunKey

__all__ = ["CheckpointStore"]

_NPZ = re.compile(r"checkpoint_round(\d+)\.npz$")
_PICKLED = re.compile(r"checkpoint_round(\d+)\.pkl$")


class CheckpointStore:
    """The checkpoints of the run folder ``folder``, read and written for one run.

    Parameters
    ----------
    folder : str or Path
        The run's folder.
    key : RunKey or None, optional
        The key of the HMACs (:mod:`flowerdro.runs.integrity`; None: unsigned files).
    identity : dict, optional
        The run's identity (:mod:`flowerdro.runs.identity`): a checkpoint whose header holds
        another is refused, and every checkpoint saved carries it. May be set later (the
        writer takes it when the run starts); None: nothing is compared.
    keep : int (default: 2)
        How many of the latest checkpoints :meth:`save` leaves on disk (at least 1).
    """

    def __init__(self, folder: str | Path, *, key: RunKey | None = None, identity: dict[str, Any] | None = None,
                 keep: int = 2) -> None:
        self.folder = Path(folder)
        self.key, self.identity = key, identity
        self.keep = max(1, int(keep))
        #: The checkpoint :meth:`latest` chose (None before, or when it chose none).
        self.resumed_from: Path | None = None

    def found(self) -> list[tuple[int, Path]]:
        """(round, path) of every checkpoint in the folder, oldest first."""
        return self._matching(_NPZ)

    def pickled(self) -> list[tuple[int, Path]]:
        """(round, path) of the pickled ``checkpoint_roundNNNN.pkl`` files in the folder (never loaded)."""
        return self._matching(_PICKLED)

    def _matching(self, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
        if not self.folder.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.folder.iterdir() if (m := pattern.match(p.name)))

    def read(self, path: str | Path) -> Checkpoint:
        """The checkpoint in ``path``, checked under the key and against the run's identity.

        Raises
        ------
        CheckpointError
            Damaged, not signed as the key requires, or of another run (its header's
            identity differs from :attr:`identity` in a key that shapes the result: each
            named with both values).
        """
        checkpoint = read_checkpoint(path, key=self.key)
        if self.identity is not None and checkpoint.identity is not None:
            refused, _ = compare_identities(checkpoint.identity, self.identity)
            if refused:
                raise CheckpointError(f"checkpoint {path} belongs to another run (its "
                                      f"{', '.join(d.key for d in refused)} differ):\n"
                                      + describe_differences(refused, "in the checkpoint", "in this run"))
        return checkpoint

    def latest(self) -> dict[str, Any] | None:
        """The server state of the newest usable checkpoint (None when the folder holds none).

        A checkpoint that is damaged (truncated, empty, garbage, wrong checksum), fails its
        HMAC, or holds another run's identity is named in a warning and the one before it
        is tried; when an older one is used, a warning names it and its round.
        :attr:`resumed_from` is the file used.

        Raises
        ------
        CheckpointError
            Every checkpoint in the folder is unusable (each file and its fault named), or
            the folder holds pickled ``.pkl`` checkpoints (never loaded; the error says
            how to convert them).
        """
        if pickled := self.pickled():
            names = ", ".join(p.name for _, p in pickled)
            raise CheckpointError(
                f"{self.folder} holds pickled checkpoints ({names}), which are not loaded: unpickling a file "
                "can run any code. If you wrote them yourself, convert them with "
                f"`python -m flowerdro.runs.migrate {self.folder}`; otherwise delete them, or start afresh "
                "without resume")
        tried: list[str] = []
        for rnd, path in reversed(self.found()):
            try:
                checkpoint = self.read(path)
            except CheckpointError as exc:
                log(WARNING, "%s; trying the checkpoint before it", exc)
                tried.append(str(exc))
                continue
            if tried:
                log(WARNING, "resuming from %s (round %d): %d newer checkpoint%s damaged or refused", path, rnd,
                    len(tried), "" if len(tried) == 1 else "s")
            if checkpoint.identity is None and self.identity is not None:
                log(WARNING, "checkpoint %s records no run identity (written by an older flowerdro): its data "
                    "and model are checked against settings.json only", path)
            self.resumed_from = path
            return checkpoint.state
        if tried:
            raise CheckpointError(f"{self.folder} holds no intact checkpoint; tried, newest first: "
                                  + "; ".join(tried))
        return None

    def check_model(self, checkpoint: dict[str, Any], model: Any) -> None:
        """Refuse a checkpoint to resume whose model differs from ``model`` (names, shapes, dtypes).

        Raises
        ------
        CheckpointError
            Naming the checkpoint file (:func:`~flowerdro.runs.checkpoint.check_model_arrays`).
        """
        check_model_arrays(checkpoint, model, self.resumed_from or self.folder)

    def save(self, state: dict[str, Any], server_round: int) -> Path:
        """Write ``state`` as ``checkpoint_roundNNNN.npz`` (atomically) and drop the oldest beyond the kept ones.

        The header carries the run's identity; under a key the file carries its HMAC.

        Raises
        ------
        flowerdro.runs.files.RunFileError
            The checkpoint could not be written (the path is named; the older checkpoints stay).
        """
        path = save_checkpoint(self.folder / checkpoint_name(server_round), state, identity=self.identity,
                               key=self.key)
        for _, old in self.found()[:-self.keep]:
            remove_file(old, "old checkpoint")
        return path

    def remove_after(self, server_round: int) -> None:
        """Remove the checkpoints of the rounds after ``server_round`` (a resumed run writes them again).

        Raises
        ------
        flowerdro.runs.files.RunFileError
            A checkpoint could not be removed.
        """
        for rnd, path in self.found():
            if rnd > server_round:
                remove_file(path, "checkpoint after the resumed round")

    def remove_all(self) -> None:
        """Remove every checkpoint, pickled ones included (a run that starts afresh in the folder).

        Raises
        ------
        flowerdro.runs.files.RunFileError
            A checkpoint could not be removed.
        """
        for _, path in self.found() + self.pickled():
            remove_file(path, "checkpoint of the earlier run")
