"""Weights & Biases: one W&B run per strategy run, offline by default.

Needs ``wandb`` (``pip install 'flowerdro[wandb]'``). Offline runs are written under
``<dir>/wandb/offline-run-*`` and uploaded later with ``wandb sync`` (no account and no
network needed while training).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowerdro.trackers.common import (
    Tracker,
    client_distributions,
    comparison_figures,
    flat_settings,
    require,
    run_figures,
    run_folder,
)

if TYPE_CHECKING:
    from flowerdro.comparison import Comparison, Plan
    from flowerdro.strategies.base import FairStrategy

__all__ = ["WANDB_MODES", "WandbComparison", "WandbTracker"]

#: ``mode`` values: ``offline`` writes local files for ``wandb sync``; ``online`` streams to the W&B server.
WANDB_MODES = ("offline", "online")


def _check_mode(mode: str) -> str:
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb-mode: unknown value {mode!r}; allowed: {', '.join(WANDB_MODES)}")
    return mode


class WandbTracker(Tracker):
    """Logs a strategy's run as one W&B run.

    ``strategy.add_observer(WandbTracker("my-project", dir="results/wandb"))``. At the
    start the settings as the run's config; per round (step = round) the scalars of
    :func:`~flowerdro.trackers.round_scalars` and the histograms ``client_acc``
    (``client_loss`` on regression tasks) and ``lambda``; at the end ``progress.png`` of
    the run folder as an image (``figures/progress``). With a run folder, the config holds
    ``run_dir`` (absolute). A resumed run is a new W&B run whose config holds
    ``resumed_after`` (the checkpoint's round); it logs the rounds restored from the
    checkpoint again before its own, so its history is the whole run, rounds 1 to R,
    whatever the crashed process had not flushed. The crashed run stays as W&B left it
    (shown as crashed once synced); ``run_dir`` links the two.

    Parameters
    ----------
    project : str (default: "flowerdro")
        The W&B project.
    dir : str or Path (default: ".")
        Where W&B writes (``<dir>/wandb/offline-run-*`` offline).
    mode : str (default: "offline")
        ``offline`` or ``online``.
    group : str, optional
        The W&B group (a comparison).
    job_type : str, optional
        The W&B job type (default: the strategy's label).
    name : str, optional
        The run name (default: ``<strategy label>-seed<k>``).
    max_client_scalars : int (default: 100)
        λ per partition as scalars up to this many partitions.
    """

    kind = "wandb"

    def __init__(self, project: str = "flowerdro", *, dir: str | Path = ".", mode: str = "offline",
                 group: str | None = None, job_type: str | None = None, name: str | None = None,
                 max_client_scalars: int = 100) -> None:
        super().__init__(max_client_scalars)
        if not isinstance(project, str) or not project.strip():
            raise ValueError(f"tracker-project: expected a non-empty W&B project name, got {project!r}")
        self.mode = _check_mode(mode)
        self._wandb = require("wandb", self.kind)
        self.project, self.dir = project, Path(dir)
        self.group, self.job_type, self.name = group, job_type, name
        self.run: Any = None

    def on_start(self, strategy: FairStrategy, num_rounds: int) -> None:
        """Start the W&B run with the settings as its config."""
        seed = strategy.loop.seed
        config: dict[str, Any] = {**flat_settings(strategy.settings()), "num_rounds": num_rounds}
        if (folder := run_folder(strategy)) is not None:
            config["run_dir"] = str(Path(folder).resolve())
        if strategy.history:
            config["resumed_after"] = int(strategy.history[-1]["round"])
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = self._wandb.init(
            project=self.project, dir=str(self.dir), mode=self.mode, group=self.group,
            job_type=self.job_type or strategy.run_name, name=self.name or f"{strategy.run_name}-seed{seed}",
            config=config, tags=[strategy.run_name[:64], strategy.name[:64], f"seed{seed}"],
            reinit="create_new")
        for record in strategy.history:  # a resumed run: the rounds before its checkpoint
            self.on_round(strategy, record)

    def on_round(self, strategy: FairStrategy, record: dict[str, Any]) -> None:
        """Log the round's scalars and per-client histograms at step = round."""
        data: dict[str, Any] = dict(self.scalars(record))
        for name, values in client_distributions(record).items():
            data[name] = self._wandb.Histogram(values.tolist())
        self.run.log(data, step=int(record["round"]))

    def on_end(self, strategy: FairStrategy, final_arrays: Any) -> None:
        """Log ``progress.png`` (when the run folder has it) and finish the run."""
        figures = {f"figures/{p.stem}": self._wandb.Image(str(p)) for p in run_figures(strategy)}
        if figures:
            step = int(strategy.history[-1]["round"]) if strategy.history else 0
            self.run.log(figures, step=step)
        self.run.finish()
        self.run = None

    def close(self, failed: bool) -> None:
        """Finish a run that is still open (exit code 1 when ``failed``)."""
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None


class WandbComparison:
    """Makes the W&B tracker of every run of a comparison (an observer factory).

    Runs share the group ``name`` and take their strategy's label as job type and
    ``<label>-seed<k>`` as name, so W&B's "Group by" on group and job type lines up the
    seeds of each strategy. At the end a run of job type ``comparison`` in the same group
    holds ``comparison.png`` and the final numbers of every run as a table.

    Parameters
    ----------
    project : str
        The W&B project.
    name : str
        The comparison (the W&B group).
    dir : str or Path
        Where W&B writes.
    mode : str (default: "offline")
        ``offline`` or ``online``.
    max_client_scalars : int (default: 100)
        See :class:`WandbTracker`.
    """

    def __init__(self, project: str, name: str, *, dir: str | Path, mode: str = "offline",
                 max_client_scalars: int = 100) -> None:
        self._wandb = require("wandb", WandbTracker.kind)
        self.project, self.name, self.dir, self.mode = project, name, Path(dir), _check_mode(mode)
        self.max_client_scalars = max_client_scalars
        self.trackers: list[WandbTracker] = []

    def __call__(self, plan: Plan) -> WandbTracker:
        """The tracker of one run."""
        tracker = WandbTracker(self.project, dir=self.dir, mode=self.mode, group=self.name, job_type=plan.label,
                               name=f"{plan.label}-seed{plan.seed}", max_client_scalars=self.max_client_scalars)
        self.trackers.append(tracker)
        return tracker

    def finish(self, comparison: Comparison) -> None:
        """Finish runs that ended with an error; log the comparison figure and table in a run of its own."""
        for tracker in self.trackers:
            tracker.close(failed=True)
        if not comparison.summaries:
            return
        keys = sorted({k for runs in comparison.summaries.values() for s in runs for k in s})
        rows = [[label, strategy.loop.seed, *(s.get(k) for k in keys)]
                for label, runs in comparison.summaries.items()
                for strategy, s in zip(comparison.strategies[label], runs, strict=True)]
        self.dir.mkdir(parents=True, exist_ok=True)
        run = self._wandb.init(project=self.project, dir=str(self.dir), mode=self.mode, group=self.name,
                               job_type="comparison", name=self.name, reinit="create_new")
        data: dict[str, Any] = {"final": self._wandb.Table(columns=["strategy", "seed", *keys], data=rows)}
        data.update({f"figures/{p.stem}": self._wandb.Image(str(p)) for p in comparison_figures(comparison)})
        run.log(data)
        run.finish(exit_code=1 if comparison.failed else 0)
