"""A run's files, written by an observer attached to a strategy.

:class:`RunWriter` follows a strategy's run (:meth:`FairStrategy.add_observer`) and
writes, under its folder: ``settings.json`` at the start (the settings, the planned
``num_rounds`` and the run's ``identity``, :mod:`flowerdro.runs.identity`), one JSON line
per round in ``rounds.jsonl``, a checkpoint of the whole server state every
``checkpoint-every`` rounds (``checkpoint_roundNNNN.npz``, the format of
:mod:`flowerdro.runs.checkpoint`, with the identity in its header; the latest two are
kept; its :class:`~flowerdro.runs.store.CheckpointStore` finds, checks and saves them),
and at the end ``final_model.npz``, ``progress.png`` and, under a key
(:mod:`flowerdro.runs.integrity`), ``signature.json``. A strategy without a writer
writes nothing.

Rules of the folder:

* **One run at a time.** The writer holds the folder's lock (:class:`FolderLock`,
  ``run.lock``) from the start of the run to its end; a second run on the folder is
  refused naming the holder. :meth:`RunWriter.close` (or ``on_error``) releases it after
  a run that raised.
* **A run knows what it is.** Another run's folder (its identity differs in a key that
  shapes the result) is refused, naming every such key with both values, unless the
  writer is told to ``overwrite`` it; a folder of the same run is started afresh (old
  rounds and checkpoints removed) or, with ``resume``, continued after its latest intact
  checkpoint (:meth:`RunWriter.resume_checkpoint`): ``rounds.jsonl`` is cut back to that
  round. A resume with other settings is refused the same way before any message, and so
  is a finished run asked to continue with other settings (:meth:`RunWriter.finished_run`);
  a checkpoint whose header holds another run's identity (copied from another folder) is
  not used. A change of ``device``, ``threads``, ``data-dir`` or a patch release of
  flowerdro or Flower is logged, not refused (:func:`~flowerdro.runs.identity.compare_identities`).
* **The plan is part of the run.** A resumed run keeps its ``num_rounds``: fewer rounds
  than the plan are refused, more only with ``extend`` (logged, and recorded under
  ``extensions`` in ``settings.json``).
* **Nobody else's files.** Every file is written atomically (a link planted in its place
  is replaced, its target untouched) or appended without following a link, and the
  folder's own files are read the same way (:mod:`flowerdro.runs.files`); a full disk or a
  missing permission fails the run with the path, and no temporary file stays behind.
* **Under a key** (``FLOWERDRO_CHECKPOINT_KEY`` / ``FLOWERDRO_CHECKPOINT_KEY_FILE``) every
  checkpoint carries an HMAC and a finished run's files are signed: a resume uses only
  files whose HMAC holds.
"""

from __future__ import annotations

import json
from logging import WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import log

from flowerdro.runs.files import (
    append_text,
    arrays_from_bytes,
    read_own,
    remove_file,
    save_arrays,
    write_atomic,
    write_text,
)
from flowerdro.runs.identity import (
    RunIdentityError,
    compare_identities,
    describe_differences,
    run_identity,
)
from flowerdro.runs.integrity import IntegrityError, RunKey, check_signature, run_key, sign_files
from flowerdro.runs.lock import FolderLock
from flowerdro.runs.records import expand_record, json_default, record_line
from flowerdro.runs.store import CheckpointStore

if TYPE_CHECKING:
    from flowerdro.strategies.base import FairStrategy

__all__ = ["FROM_ENVIRONMENT", "PLAN_KEYS", "SIGNED_FILES", "RunWriter", "check_plan", "folder_settings"]


#: Keys of ``settings.json`` that describe the plan, not the run's identity: a resumed or
#: restarted run may differ in them without being "another run".
PLAN_KEYS = ("num_rounds", "extensions")
#: The files of a finished run that ``signature.json`` covers (what a resume takes from disk).
SIGNED_FILES = ("settings.json", "rounds.jsonl", "final_model.npz")
#: ``RunWriter(key=...)`` default: the key of the environment (:func:`~flowerdro.runs.integrity.run_key`).
FROM_ENVIRONMENT: Any = object()


def check_plan(num_rounds: int, done: int, planned: int | None, *, extend: bool, where: str | Path) -> None:
    """Refuse a resumed run whose ``num-rounds`` breaks the run's plan.

    Parameters
    ----------
    num_rounds : int
        The number of rounds the resumed run asks for.
    done : int
        The round the checkpoint reached.
    planned : int or None
        The run's planned number of rounds (None when the folder does not record it).
    extend : bool
        Whether ``num_rounds`` above ``planned`` is asked for explicitly.
    where : str or Path
        The run's folder (named in the errors).

    Raises
    ------
    ValueError
        ``num_rounds < done``; ``num_rounds < planned``; ``num_rounds > planned`` without ``extend``.
    """
    if num_rounds < done:
        raise ValueError(f"num-rounds: {num_rounds} is below round {done}, which the run in {where} has reached "
                         f"(its plan: {planned if planned is not None else 'not recorded'} rounds); resume with "
                         "the run's num-rounds, or start afresh without resume")
    if planned is None:
        return
    if num_rounds < planned:
        raise ValueError(f"num-rounds: {num_rounds} is below the {planned} rounds the run in {where} is planned "
                         f"for; a resumed run keeps its plan: resume with num-rounds = {planned} (its first "
                         f"{num_rounds} round records are those of the whole run), or start afresh without resume")
    if num_rounds > planned and not extend:
        raise ValueError(f"num-rounds: {num_rounds} is above the {planned} rounds the run in {where} is planned "
                         f"for; set extend = true to continue it to {num_rounds} rounds, or resume with "
                         f"num-rounds = {planned}")


def folder_settings(folder: str | Path) -> dict[str, Any]:
    """The ``settings.json`` of the run folder ``folder`` (empty when absent), read without following a link.

    Raises
    ------
    ValueError
        It is not valid JSON, or holds no settings object (naming the file).
    flowerdro.runs.files.RunFileError
        It is a planted link.
    """
    path = Path(folder) / "settings.json"
    if not path.is_file() and not path.is_symlink():
        return {}
    return parse_settings(read_own(path, "settings"), path)


def parse_settings(data: bytes, path: Path) -> dict[str, Any]:
    """The settings object a run folder's ``settings.json`` at ``path`` holds, from its bytes ``data``.

    Raises
    ------
    ValueError
        ``data`` is not valid JSON, or holds no settings object (naming ``path``).
    """
    try:
        settings = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"output-dir: {path} is not valid JSON ({exc}); repair or remove it, or set "
                         "overwrite = true") from exc
    if not isinstance(settings, dict):
        raise ValueError(f"output-dir: {path} does not hold a settings object; repair or remove it")
    return settings


def refuse_other_run(folder: Path, old: dict[str, Any], settings: dict[str, Any], identity: dict[str, Any], *,
                     resume: bool) -> None:
    """Refuse to start a run in ``folder`` whose recorded settings ``old`` are another run's.

    The folder's run is another one when its recorded identity differs from ``identity``
    in a key that shapes the result; a folder of an older flowerdro (no identity) is
    compared by its flat settings with ``settings``, the plan (:data:`PLAN_KEYS`) aside.

    Raises
    ------
    ValueError
        Naming the keys that differ (with both values when the folder records an identity).
    """
    hint = ", or resume = true only for the same run" if resume else ""
    if "identity" in old:
        refused, _ = compare_identities(old["identity"], identity)
        if refused:
            raise ValueError(
                f"output-dir: {folder} holds another run (settings differ in "
                f"{', '.join(d.key for d in refused)}):\n" + describe_differences(refused, "there", "now")
                + "\nChoose another output-dir, or set overwrite = true to replace it" + hint)
        return
    diff = sorted(k for k in (set(old) | set(settings)) - set(PLAN_KEYS) if old.get(k) != settings.get(k))
    if diff:
        raise ValueError(f"output-dir: {folder} holds another run (settings differ in {', '.join(diff[:5])}); "
                         "choose another output-dir, or set overwrite = true to replace it" + hint)


class RunWriter:
    """Writes a strategy's settings, round records, checkpoints, final model and plot.

    Parameters
    ----------
    output_dir : str or Path
        The run's folder (created when the run starts).
    plot : bool (default: True)
        Draw ``progress.png`` at the end.
    resume : bool (default: False)
        Continue the run whose files the folder holds (see :meth:`resume_checkpoint`).
    overwrite : bool (default: False)
        Replace another run's files instead of refusing the folder.
    keep_checkpoints : int (default: 2)
        How many of the latest checkpoints stay on disk.
    extend : bool (default: False)
        With ``resume``: allow more rounds than the run was planned for (refused without
        ``resume``).
    run_id : int, optional
        The Flower run id, written into the folder lock's holder file.
    identity : dict, optional
        The run's identity (:func:`~flowerdro.strategies.registry.strategy_identity` of the
        strategy and its run config, which :func:`~flowerdro.strategies.registry.build_strategy`
        passes). Unset: the strategy's part of it (:func:`~flowerdro.runs.identity.run_identity`
        without a run config), taken when the run starts.
    key : RunKey or None, optional
        The key of the HMACs (:mod:`flowerdro.runs.integrity`); default: the one the
        environment gives, None for none.

    Raises
    ------
    ValueError
        ``extend`` without ``resume``; a key of the environment that cannot be used.
    """

    _RUN_FILES = ("rounds.jsonl", "final_model.npz", "progress.png", "signature.json")

    def __init__(self, output_dir: str | Path, *, plot: bool = True, resume: bool = False,
                 overwrite: bool = False, keep_checkpoints: int = 2, extend: bool = False,
                 run_id: int | None = None, identity: dict[str, Any] | None = None,
                 key: RunKey | None = FROM_ENVIRONMENT) -> None:
        if extend and not resume:
            raise ValueError("extend: only with resume = true (it lets a resumed run go beyond its planned "
                             "num-rounds); a fresh run takes num-rounds as its plan")
        self.output_dir = Path(output_dir)
        self.plot, self.resume, self.overwrite, self.extend = plot, resume, overwrite, extend
        self.lock = FolderLock(self.output_dir, run_id=run_id)
        #: The run's number of rounds (set when it starts; saved with each checkpoint).
        self.num_rounds: int | None = None
        #: The key of the HMACs (None: unsigned files).
        self.key: RunKey | None = run_key(self.output_dir) if key is FROM_ENVIRONMENT else key
        #: The folder's checkpoints, read and saved under the key and against the run's identity.
        self.checkpoints = CheckpointStore(self.output_dir, key=self.key, identity=identity, keep=keep_checkpoints)
        self._checked = False

    @property
    def identity(self) -> dict[str, Any] | None:
        """The run's identity (what shapes its result; :mod:`flowerdro.runs.identity`), None until known."""
        return self.checkpoints.identity

    @property
    def rounds_path(self) -> Path:
        """Where the round records go."""
        return self.output_dir / "rounds.jsonl"

    # ------------------------------------------------------------------ the folder's lock
    def acquire(self) -> None:
        """Take the folder's lock for this run (see :class:`FolderLock`; nothing when held).

        :meth:`on_start` takes it; the driver takes it before the run so that a folder in
        use is refused before any message is sent.
        """
        self.lock.acquire()

    def close(self) -> None:
        """Release the folder's lock (nothing when not held); :meth:`on_end` does it after a run."""
        self.lock.release()

    def on_error(self, strategy: FairStrategy, exc: BaseException) -> None:
        """A run that raised: release the folder's lock (the files written so far stay)."""
        self.close()

    # ------------------------------------------------------------------ the run's identity
    def check_identity(self, *, finished: int | None = None, recorded: dict[str, Any] | None = None) -> None:
        """Refuse to continue the folder's run with settings that shape its result otherwise.

        Compares :attr:`identity` with the one ``settings.json`` records (nothing to do when
        either is unknown, or with ``overwrite``); differences of the environment are logged.

        Parameters
        ----------
        finished : int, optional
            The rounds of the folder's run when it is finished (the message says so).
        recorded : dict, optional
            The folder's settings as read already (default: ``settings.json`` read now).

        Raises
        ------
        RunIdentityError
            Naming every key that differs, with the run's value and this one.
        """
        if self.identity is None or self.overwrite:
            return
        settings = folder_settings(self.output_dir) if recorded is None else recorded
        recorded = settings.get("identity")
        if recorded is None:
            if settings and not self._checked:
                log(WARNING, "%s/settings.json records no run identity (written by an older flowerdro): the data "
                    "and the model of the run are not checked", self.output_dir)
            self._checked = True
            return
        refused, warned = compare_identities(recorded, self.identity)
        if warned and not self._checked:
            log(WARNING, "resume: the run in %s goes on, although it computed elsewhere or under other versions:\n%s",
                self.output_dir, describe_differences(warned))
        self._checked = True
        if not refused:
            return
        if finished is not None:
            raise RunIdentityError(
                f"resume: the run in {self.output_dir} finished its {finished} rounds with other settings "
                f"({', '.join(d.key for d in refused)}):\n"
                f"{describe_differences(refused)}\nIt is kept as it is. To run these settings, choose another "
                "output-dir, or set overwrite = true to replace it; to keep it, resume with its settings")
        raise RunIdentityError(
            f"resume: the run in {self.output_dir} was started with other settings "
            f"({', '.join(d.key for d in refused)}), and a resumed run must go on with its own:\n"
            f"{describe_differences(refused)}\nResume with the run's settings, or start afresh "
            "in another output-dir (or with overwrite = true)")

    # ------------------------------------------------------------------ what a resume takes from the folder
    def resume_checkpoint(self, num_rounds: int) -> dict[str, Any] | None:
        """The checkpoint to continue the run from, with its identity and ``num_rounds`` checked.

        Checks the run's identity against the folder's (:meth:`check_identity`), then
        returns the latest usable checkpoint (:meth:`CheckpointStore.latest
        <flowerdro.runs.store.CheckpointStore.latest>`), or None (logged: "no checkpoint,
        starting afresh") when the folder holds no checkpoint; the run then starts from
        round 1. The model of the checkpoint is checked later, against the clients'
        (:meth:`CheckpointStore.check_model <flowerdro.runs.store.CheckpointStore.check_model>`).

        Raises
        ------
        RunIdentityError
            The folder's run has other settings (every key named with both values).
        CheckpointError
            See :meth:`CheckpointStore.latest <flowerdro.runs.store.CheckpointStore.latest>`.
        ValueError
            ``num_rounds`` breaks the run's plan (:func:`check_plan`).
        """
        self.check_identity()
        checkpoint = self.checkpoints.latest()
        if checkpoint is None:
            records = self.rounds_path.read_text().count("\n") if self.rounds_path.is_file() else 0
            log(WARNING, "resume: no checkpoint in %s, starting afresh from round 1%s", self.output_dir,
                f" (its {records} round records are replaced)" if records else "")
            return None
        planned = folder_settings(self.output_dir).get("num_rounds", checkpoint.get("num_rounds"))
        check_plan(num_rounds, int(checkpoint["round"]), planned, extend=self.extend, where=self.output_dir)
        return checkpoint

    def finished_run(self, num_rounds: int) -> tuple[list[dict[str, Any]], ArrayRecord] | None:
        """The records and final model of the folder's run when it finished ``num_rounds`` rounds (else None).

        Raises
        ------
        RunIdentityError
            The run finished with other settings (every key named with both values).
        IntegrityError
            Its files fail their HMAC under the key (or are signed while no key is set).
        RunFileError
            One of them is a planted link.
        """
        final, rounds = self.output_dir / "final_model.npz", self.rounds_path
        if not final.is_file() or not rounds.is_file():
            return None
        # each file is read once: what is checked is what is used
        files = {name: read_own(self.output_dir / name, name) for name in SIGNED_FILES
                 if (self.output_dir / name).is_file()}
        records = [expand_record(json.loads(line)) for line in files["rounds.jsonl"].decode().splitlines()
                   if line.strip()]
        if not records or int(records[-1]["round"]) != num_rounds:
            return None
        settings = (parse_settings(files["settings.json"], self.output_dir / "settings.json")
                    if "settings.json" in files else {})
        self.check_identity(finished=num_rounds, recorded=settings)
        signature_path = self.output_dir / "signature.json"
        signature = json.loads(read_own(signature_path, "signature")) if signature_path.is_file() else None
        if (why := check_signature(self.key, signature, files, self.output_dir, SIGNED_FILES)) is not None:
            raise IntegrityError(f"resume: the finished run in {self.output_dir} is not taken from disk: {why}")
        return records, arrays_from_bytes(files["final_model.npz"])

    # ------------------------------------------------------------------ the run
    def on_start(self, strategy: FairStrategy, num_rounds: int) -> None:
        """Take the lock, check the folder and the plan, write ``settings.json``, start (or cut back) ``rounds.jsonl``."""
        self.acquire()
        try:
            self._start(strategy, int(num_rounds))
        except BaseException:
            self.close()
            raise

    def _start(self, strategy: FairStrategy, num_rounds: int) -> None:
        if self.identity is None:
            self.checkpoints.identity = run_identity(strategy)
        settings = json.loads(json.dumps(strategy.settings(), default=json_default))
        old = folder_settings(self.output_dir)
        resumed = self.resume and bool(strategy.history)
        if old and not self.overwrite:
            if resumed:
                self.check_identity()
            else:
                refuse_other_run(self.output_dir, old, settings, self.identity, resume=self.resume)
        extensions = list(old.get("extensions", [])) if old else []
        if resumed:
            done = int(strategy.history[-1]["round"])
            planned = old.get("num_rounds") if old else None
            check_plan(num_rounds, done, planned, extend=self.extend, where=self.output_dir)
            if planned is not None and num_rounds > planned:
                log(WARNING, "[%s] extend = true: the run in %s planned for %d rounds goes on to %d "
                    "(recorded in settings.json)", strategy.run_name, self.output_dir, planned, num_rounds)
                extensions.append({"from": planned, "to": num_rounds, "after_round": done})
            remove_file(self.output_dir / "signature.json", "signature of the earlier end")
            write_text(self.rounds_path, "".join(record_line(r) for r in strategy.history), "round records")
            self.checkpoints.remove_after(done)
        else:
            self.checkpoints.remove_all()
            for name in self._RUN_FILES:
                remove_file(self.output_dir / name, "file of the earlier run")
            write_text(self.rounds_path, "", "round records")
            extensions = []
        self.num_rounds = num_rounds
        settings["num_rounds"] = num_rounds
        if extensions:
            settings["extensions"] = extensions
        settings["identity"] = self.identity
        write_text(self.output_dir / "settings.json", json.dumps(settings, indent=2), "settings")

    def on_round(self, strategy: FairStrategy, record: dict[str, Any]) -> None:
        """Append the round record; save a checkpoint when one is due."""
        append_text(self.rounds_path, record_line(record), "the round record to")
        every = strategy.loop.checkpoint_every
        if every and record["round"] % every == 0:
            self.checkpoints.save({**strategy.server_state(), "num_rounds": self.num_rounds}, int(record["round"]))

    def on_end(self, strategy: FairStrategy, final: ArrayRecord) -> None:
        """Write ``final_model.npz``, the strategy's own files, ``signature.json`` under a key and
        ``progress.png`` (a plot never fails a run); release the folder's lock."""
        try:
            self._end(strategy, final)
        finally:
            self.close()

    def _end(self, strategy: FairStrategy, final: ArrayRecord) -> None:
        write_atomic(self.output_dir / "final_model.npz", lambda fh: save_arrays(fh, final), "final model")
        for name, content in strategy.output_files().items():
            path = self.output_dir / name
            if name.endswith(".json"):
                write_text(path, json.dumps(content, indent=2, default=json_default), "output file")
            else:
                write_atomic(path, lambda fh, c=content: np.savez(fh, **{k: np.asarray(v) for k, v in c.items()}),
                             "output file")
        if self.key is not None:
            files = {name: read_own(self.output_dir / name, name) for name in SIGNED_FILES}
            write_text(self.output_dir / "signature.json", json.dumps(sign_files(self.key, files), indent=2),
                       "signature")
        if not self.plot:
            return
        try:
            from flowerdro.runs.plots import plot_comparison

            plot_comparison({strategy.run_name: strategy.history}, self.output_dir / "progress.png",
                            title=strategy.run_name)
        except Exception as exc:  # noqa: BLE001  # plotting must never fail a run
            log(WARNING, "[%s] could not draw the plot: %s", strategy.run_name, exc)
