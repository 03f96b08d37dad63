"""A run's files, written by an observer attached to a strategy.

:class:`RunWriter` follows a strategy's run (:meth:`FairStrategy.add_observer`) and
writes, under its folder: ``settings.json`` at the start, one JSON line per round in
``rounds.jsonl``, a checkpoint of the whole server state every ``checkpoint_every``
rounds (``checkpoint_roundNNNN.npz`` + ``.json``, written atomically), and at the end
``final_model.npz`` and ``progress.png``. A strategy without a writer writes nothing.
"""

from __future__ import annotations

import json
from logging import WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import log

from flowerdro.strategies.arrays import save_arrays

if TYPE_CHECKING:
    from flowerdro.strategies.base import FairStrategy

__all__ = ["RunWriter", "json_default"]


def json_default(obj: Any) -> Any:
    """JSON for numpy scalars and arrays (and ``str`` for anything else)."""
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


class RunWriter:
    """Writes a strategy's settings, round records, checkpoints, final model and plot.

    Parameters
    ----------
    output_dir : str or Path
        The run's folder (created when the run starts).
    plot : bool (default: True)
        Draw ``progress.png`` at the end.
    """

    def __init__(self, output_dir: str | Path, *, plot: bool = True) -> None:
        self.output_dir = Path(output_dir)
        self.plot = plot

    @property
    def rounds_path(self) -> Path:
        """Where the round records go."""
        return self.output_dir / "rounds.jsonl"

    def on_start(self, strategy: FairStrategy, num_rounds: int) -> None:
        """Create the folder, write ``settings.json`` and start an empty ``rounds.jsonl``."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.rounds_path.write_text("")
        (self.output_dir / "settings.json").write_text(
            json.dumps(strategy.settings(), indent=2, default=json_default))

    def on_round(self, strategy: FairStrategy, record: dict[str, Any]) -> None:
        """Append the round record; save a checkpoint when one is due."""
        with self.rounds_path.open("a") as fh:
            fh.write(json.dumps(record, default=json_default) + "\n")
        every = strategy.loop.checkpoint_every
        if every and record["round"] % every == 0 and strategy.current_arrays is not None:
            save_arrays(self.output_dir / f"checkpoint_round{record['round']:04d}.npz", strategy.current_arrays)

    def on_end(self, strategy: FairStrategy, final: ArrayRecord) -> None:
        """Write ``final_model.npz`` and ``progress.png`` (a plot never fails a run)."""
        save_arrays(self.output_dir / "final_model.npz", final)
        if not self.plot:
            return
        try:
            from flowerdro.plots import plot_history

            plot_history({strategy.run_name: strategy.history}, self.output_dir / "progress.png",
                         title=strategy.run_name)
        except Exception as exc:  # noqa: BLE001  # plotting must never fail a run
            log(WARNING, "[%s] could not draw the plot: %s", strategy.run_name, exc)
