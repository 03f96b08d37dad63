"""TensorBoard: one event-file folder per run, written with ``torch.utils.tensorboard``.

Needs the ``tensorboard`` package (``pip install 'flowerdro[tensorboard]'``); the writer is
torch's ``SummaryWriter``. Scalars are written as float64 tensors (``new_style`` with
``double_precision``), so the values read back equal the round records exactly.
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

#: The scalars the HParams dashboard shows beside a run's settings.
HPARAM_METRICS = tuple(f"fairness/{k}" for k in (
    "acc_mean", "acc_worst", "acc_worst10", "acc_worst20", "acc_best20", "acc_std", "loss_mean", "loss_worst"))


def _image(path: Path) -> Any:
    """A PNG as an (H, W, 3) float array in [0, 1]."""
    from matplotlib.image import imread

    return imread(path)[..., :3]


class TensorBoardTracker(Tracker):
    """Logs a strategy's run into one TensorBoard run folder.

    ``strategy.add_observer(TensorBoardTracker("runs/drfa"))``, then
    ``tensorboard --logdir runs``. Per round: the scalars of
    :func:`~flowerdro.trackers.round_scalars` (step = round), histograms ``client_acc``
    (``client_loss`` on regression tasks) and ``lambda``; at the start the settings as
    HParams (with the fairness numbers as its metrics) and as a text table; at the end
    ``progress.png`` of the run folder as an image. A resumed run continues the folder:
    events after the checkpoint's round are hidden (``purge_step``).

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
        """Open the writer; log the settings (HParams and a text table)."""
        from torch.utils.tensorboard.summary import hparams

        first = int(strategy.history[-1]["round"]) + 1 if strategy.history else 1
        self.writer = self._tb.SummaryWriter(str(self.log_dir), purge_step=first, flush_secs=self.flush_secs)
        settings = flat_settings(strategy.settings())
        exp, ssi, _ = hparams(settings, dict.fromkeys(HPARAM_METRICS, 0.0))
        self.writer.file_writer.add_summary(exp)
        self.writer.file_writer.add_summary(ssi)
        rows = "\n".join(f"| {k} | {v} |" for k, v in settings.items())
        self.writer.add_text("settings", f"| setting | value |\n|---|---|\n{rows}", 0)

    def on_round(self, strategy: FairStrategy, record: dict[str, Any]) -> None:
        """Write the round's scalars and per-client histograms at step = round."""
        step = int(record["round"])
        for tag, value in self.scalars(record).items():
            self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
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

        with SummaryWriter(str(self.root / self.name / "comparison")) as writer:
            for path in figures:
                writer.add_image(f"figures/{path.stem}", _image(path), 0, dataformats="HWC")
            if comparison.table:
                writer.add_text("table", comparison.table, 0)
