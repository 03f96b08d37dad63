"""A run's files, written by an observer attached to a strategy.

:class:`RunWriter` follows a strategy's run (:meth:`FairStrategy.add_observer`) and
writes, under its folder: ``settings.json`` at the start, one JSON line per round in
``rounds.jsonl``, a checkpoint of the whole server state every ``checkpoint-every``
rounds (``checkpoint_roundNNNN.pkl``, written atomically; the latest two are kept), and
at the end ``final_model.npz`` and ``progress.png``. A strategy without a writer writes
nothing.

A folder that holds another run's files (its ``settings.json`` differs) is refused unless
the writer is told to ``overwrite`` it or to ``resume`` that run; a folder of the same
run is started afresh (old rounds and checkpoints removed) or, with ``resume``,
continued after its latest checkpoint: ``rounds.jsonl`` is cut back to that round.
Checkpoints are Python pickles, like ``torch.save`` files: load only your own.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from logging import WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import log

from flowerdro.strategies.arrays import save_arrays

if TYPE_CHECKING:
    from flowerdro.strategies.base import FairStrategy

__all__ = ["COMPACT_MIN", "RunWriter", "compact_record", "expand_record", "json_default", "record_line"]


def json_default(obj: Any) -> Any:
    """JSON for numpy scalars and arrays (and ``str`` for anything else)."""
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


#: A per-client mapping of at least this many entries is written as a compact array.
COMPACT_MIN = 1000
_IDS, _VALUES = "__client_ids__", "__client_values__"


def compact_record(record: dict[str, Any], min_entries: int = COMPACT_MIN) -> dict[str, Any]:
    """``record`` with each large per-client mapping ``{"<id>": number}`` as two arrays.

    A top-level value that maps at least ``min_entries`` integer strings to numbers (λ over
    10,000 clients, per-client accuracies) becomes ``{"__client_ids__": ids, "__client_values__":
    values}``, with ``ids = [start, stop]`` when the ids are ``start, …, stop − 1`` in order
    (the usual case), else the list of ids. :func:`expand_record` gives the mapping back.
    """
    out = {}
    for key, value in record.items():
        if (isinstance(value, dict) and len(value) >= min_entries
                and all(isinstance(k, str) and k.lstrip("-").isdigit() for k in value)
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values())):
            ids = [int(k) for k in value]
            dense = ids == list(range(ids[0], ids[0] + len(ids)))
            out[key] = {_IDS: [ids[0], ids[0] + len(ids)] if dense else ids, _VALUES: list(value.values())}
        else:
            out[key] = value
    return out


def expand_record(record: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`compact_record` (records without compact arrays come back unchanged)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict) and _IDS in value and _VALUES in value:
            ids, values = value[_IDS], value[_VALUES]
            if len(ids) == 2 and len(values) != 2:
                ids = range(ids[0], ids[1])
            out[key] = {str(i): v for i, v in zip(ids, values, strict=True)}
        else:
            out[key] = value
    return out


def record_line(record: dict[str, Any]) -> str:
    """One ``rounds.jsonl`` line: the compact record as JSON."""
    return json.dumps(compact_record(record), default=json_default) + "\n"


class RunWriter:
    """Writes a strategy's settings, round records, checkpoints, final model and plot.

    Parameters
    ----------
    output_dir : str or Path
        The run's folder (created when the run starts).
    plot : bool (default: True)
        Draw ``progress.png`` at the end.
    resume : bool (default: False)
        Continue the run whose files the folder holds (see :meth:`latest_checkpoint`).
    overwrite : bool (default: False)
        Replace another run's files instead of refusing the folder.
    keep_checkpoints : int (default: 2)
        How many of the latest checkpoints stay on disk.
    """

    _CKPT = re.compile(r"checkpoint_round(\d+)\.pkl$")
    _RUN_FILES = ("rounds.jsonl", "final_model.npz", "progress.png")

    def __init__(self, output_dir: str | Path, *, plot: bool = True, resume: bool = False,
                 overwrite: bool = False, keep_checkpoints: int = 2) -> None:
        self.output_dir = Path(output_dir)
        self.plot, self.resume, self.overwrite = plot, resume, overwrite
        self.keep_checkpoints = max(1, int(keep_checkpoints))

    @property
    def rounds_path(self) -> Path:
        """Where the round records go."""
        return self.output_dir / "rounds.jsonl"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(round, path) of every checkpoint in the folder, oldest first."""
        if not self.output_dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.output_dir.iterdir() if (m := self._CKPT.match(p.name))]
        return sorted(found)

    def latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest checkpoint of the folder (None when there is none)."""
        ckpts = self.checkpoints()
        if not ckpts:
            return None
        with ckpts[-1][1].open("rb") as fh:
            return pickle.load(fh)  # noqa: S301  # the run's own checkpoint

    def on_start(self, strategy: FairStrategy, num_rounds: int) -> None:
        """Check the folder, write ``settings.json``, and start (or cut back) ``rounds.jsonl``."""
        settings = json.loads(json.dumps(strategy.settings(), default=json_default))
        old_path = self.output_dir / "settings.json"
        if old_path.is_file():
            old = json.loads(old_path.read_text())
            if old != settings and not self.overwrite:
                diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
                raise ValueError(
                    f"output-dir: {self.output_dir} holds another run (settings differ in {', '.join(diff[:5])}); "
                    "choose another output-dir, or set overwrite = true to replace it"
                    + (", or resume = true only for the same run" if self.resume else ""))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.resume and strategy.history:
            done = int(strategy.history[-1]["round"])
            self.rounds_path.write_text("".join(record_line(r) for r in strategy.history))
            for rnd, path in self.checkpoints():
                if rnd > done:
                    path.unlink()
        else:
            for _, path in self.checkpoints():
                path.unlink()
            for name in self._RUN_FILES:
                (self.output_dir / name).unlink(missing_ok=True)
            self.rounds_path.write_text("")
        old_path.write_text(json.dumps(settings, indent=2))

    def on_round(self, strategy: FairStrategy, record: dict[str, Any]) -> None:
        """Append the round record; save a checkpoint when one is due."""
        with self.rounds_path.open("a") as fh:
            fh.write(record_line(record))
        every = strategy.loop.checkpoint_every
        if every and record["round"] % every == 0:
            self.save_checkpoint(strategy.server_state(), int(record["round"]))

    def save_checkpoint(self, state: dict[str, Any], server_round: int) -> Path:
        """Write ``state`` atomically as ``checkpoint_roundNNNN.pkl`` and drop the oldest beyond the kept ones."""
        path = self.output_dir / f"checkpoint_round{server_round:04d}.pkl"
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as fh:
            pickle.dump(state, fh, protocol=pickle.HIGHEST_PROTOCOL)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        for _, old in self.checkpoints()[:-self.keep_checkpoints]:
            old.unlink()
        return path

    def on_end(self, strategy: FairStrategy, final: ArrayRecord) -> None:
        """Write ``final_model.npz``, the strategy's own files and ``progress.png`` (a plot never fails a run)."""
        save_arrays(self.output_dir / "final_model.npz", final)
        for name, content in strategy.output_files().items():
            path = self.output_dir / name
            if name.endswith(".json"):
                path.write_text(json.dumps(content, indent=2, default=json_default))
            else:
                np.savez(path, **{k: np.asarray(v) for k, v in content.items()})
        if not self.plot:
            return
        try:
            from flowerdro.plots import plot_comparison

            plot_comparison({strategy.run_name: strategy.history}, self.output_dir / "progress.png",
                            title=strategy.run_name)
        except Exception as exc:  # noqa: BLE001  # plotting must never fail a run
            log(WARNING, "[%s] could not draw the plot: %s", strategy.run_name, exc)
