"""TensorBoard: one event-file folder per run, written with ``torch.utils.tensorboard``.

Needs the ``tensorboard`` package (``pip install 'flowerdro[tensorboard]'``); the writer is
torch's ``SummaryWriter``. Scalars are written as float32 ``simple_value`` summaries, the
form TensorBoard's default loader (the Rust ``tensorboard-data-server``) reads: it drops
float64 tensors, which only ``--load_fast=false`` shows. So TensorBoard holds every round
number rounded to float32 (about 7 significant digits); ``rounds.jsonl``, MLflow and W&B
keep them in float64.

Each run writes its settings as an HParams session, with no experiment summary of its
own: TensorBoard then builds the HParams table from every session under ``--logdir``
(the union of the strategies' settings) with the run's scalars as its metrics. (With an
experiment summary per run it would pick one run's arbitrarily, and hide the settings the
other strategies have.)
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
)

if TYPE_CHECKING:
    from flowerdro.comparison import Comparison, Plan
    from flowerdro.strategies.base import FairStrategy

__all__ = ["TensorBoardComparison", "TensorBoardTracker"]

def _image(path: Path) -> Any:
    """A PNG as an (H, W, 3) float array in [0, 1]."""
    from matplotlib.image import imread

    return imread(path)[..., :3]


class TensorBoardTracker(Tracker):
    """Logs a strategy's run into one TensorBoard run folder.

    ``strategy.add_observer(TensorBoardTracker("runs/drfa"))``, then
    ``tensorboard --logdir runs``. Per round: the scalars of
    :func:`~flowerdro.trackers.round_scalars` (step = round, float32), histograms
    ``client_acc`` (``client_loss`` on regression tasks) and ``lambda``; at the start the
    settings as an HParams session and as a text table; at the end ``progress.png`` of the
    run folder as an image.

    Every start supersedes what an earlier process wrote into the folder: the writer
    opens with ``purge_step = 0``, which hides every event written before it, and a
    resumed run logs the rounds restored from its checkpoint again before its own. So
    after a crash and ``resume = true`` the folder shows each round once, with no gap
    where the crashed process had not flushed its events.

    Parameters
    ----------
    log_dir : str or Path
        The run's folder (created when the run starts).
    max_client_scalars : int (default: 100)
        λ per partition as scalars up to this many partitions (histogram only beyond).
    flush_secs : int (default: 10)
        How often pending events are written to disk.
    """

    kind = "tensorboard"

    def __init__(self, log_dir: str | Path, *, max_client_scalars: int = 100, flush_secs: int = 10) -> None:
        super().__init__(max_client_scalars)
        require("tensorboard", self.kind)
        self._tb = require("torch.utils.tensorboard", self.kind)
        self.log_dir = Path(log_dir)
        self.flush_secs = int(flush_secs)
        self.writer: Any = None

    def on_start(self, strategy: FairStrategy, num_rounds: int) -> None:
        """Open the writer (hiding earlier events); log the settings and the rounds restored from a checkpoint."""
        from torch.utils.tensorboard.summary import hparams

        self.writer = self._tb.SummaryWriter(str(self.log_dir), purge_step=0, flush_secs=self.flush_secs)
        settings = flat_settings(strategy.settings())
        _, session_start, _ = hparams(settings, {})
        self.writer.file_writer.add_summary(session_start)
        rows = "\n".join(f"| {k} | {v} |" for k, v in settings.items())
        self.writer.add_text("settings", f"| setting | value |\n|---|---|\n{rows}", 0)
        for record in strategy.history:
            self.on_round(strategy, record)

    def on_round(self, strategy: FairStrategy, record: dict[str, Any]) -> None:
        """Write the round's scalars (float32 ``simple_value``) and per-client histograms at step = round."""
        step = int(record["round"])
        for tag, value in self.scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        for name, values in client_distributions(record).items():
            self.writer.add_histogram(name, values, step)

    def on_end(self, strategy: FairStrategy, final_arrays: Any) -> None:
        """Add ``progress.png`` (when the run folder has it) and close the run."""
        step = int(strategy.history[-1]["round"]) if strategy.history else 0
        for path in run_figures(strategy):
            self.writer.add_image(f"figures/{path.stem}", _image(path), step, dataformats="HWC")
        self._finish(success=True)

    def close(self, failed: bool) -> None:
        """Close a writer that is still open (its session marked failed when ``failed``)."""
        if self.writer is not None:
            self._finish(success=not failed)

    def _finish(self, success: bool) -> None:
        self.writer.file_writer.add_summary(_session_end(success))
        self.writer.close()
        self.writer = None


def _session_end(success: bool) -> Any:
    """The HParams plugin's session-end summary with the run's status (as torch's ``hparams`` builds it)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.metadata import (
        PLUGIN_DATA_VERSION,
        PLUGIN_NAME,
        SESSION_END_INFO_TAG,
    )
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo

    status = Status.Value("STATUS_SUCCESS" if success else "STATUS_FAILURE")
    content = HParamsPluginData(session_end_info=SessionEndInfo(status=status), version=PLUGIN_DATA_VERSION)
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME,
                                                                  content=content.SerializeToString()))
    return Summary(value=[Summary.Value(tag=SESSION_END_INFO_TAG, metadata=meta)])


class TensorBoardComparison:
    """Makes the TensorBoard tracker of every run of a comparison (an observer factory).

    Runs go to ``<root>/<comparison>/<label>/seed<k>``, so ``tensorboard --logdir <root>``
    lists them side by side and a regex on ``<comparison>/`` keeps one comparison; at the
    end ``<root>/<comparison>/comparison`` gets ``comparison.png`` and the final table.

    Parameters
    ----------
    root : str or Path
        The TensorBoard log directory (``<tracker-dir>/tensorboard`` from the run config).
    name : str
        The comparison's name.
    max_client_scalars : int (default: 100)
        See :class:`TensorBoardTracker`.
    """

    def __init__(self, root: str | Path, name: str, *, max_client_scalars: int = 100) -> None:
        require("tensorboard", TensorBoardTracker.kind)
        self.root, self.name, self.max_client_scalars = Path(root), name, max_client_scalars
        self.trackers: list[TensorBoardTracker] = []

    def __call__(self, plan: Plan) -> TensorBoardTracker:
        """The tracker of one run: ``<root>/<comparison>/<label>/seed<k>``."""
        tracker = TensorBoardTracker(self.root / self.name / plan.label / f"seed{plan.seed}",
                                     max_client_scalars=self.max_client_scalars)
        self.trackers.append(tracker)
        return tracker

    def finish(self, comparison: Comparison) -> None:
        """Close runs that ended with an error; write ``comparison.png`` and the table."""
        for tracker in self.trackers:
            tracker.close(failed=True)
        figures = comparison_figures(comparison)
        if not figures and not comparison.table:
            return
        from torch.utils.tensorboard import SummaryWriter

        # purge_step 0: a rerun's figure and table replace the earlier ones
        with SummaryWriter(str(self.root / self.name / "comparison"), purge_step=0) as writer:
            for path in figures:
                writer.add_image(f"figures/{path.stem}", _image(path), 0, dataformats="HWC")
            if comparison.table:
                writer.add_text("table", comparison.table, 0)
