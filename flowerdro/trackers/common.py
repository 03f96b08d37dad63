"""What every tracker logs of a round record, and the pieces the trackers share.

A round record (``docs/architecture.md``, "Round record") becomes, for every tracker:

* **scalars** (:func:`round_scalars`), named by group:

  ========================  ==========================================================
  name                      from the record
  ========================  ==========================================================
  ``fairness/<key>``        every number whose key starts with ``acc_`` or ``loss_``
                            (``acc_mean``, ``acc_worst``, ``acc_worst10``,
                            ``acc_worst20``, ``acc_best20``, ``acc_std``,
                            ``acc_weighted``, ``acc_n``, ``loss_mean``, ``loss_worst``, …)
  ``cost/<key>``            ``time_s``, ``bytes_sent``, ``bytes_received``
  ``failures/dropped``      the replies dropped this round (sum of ``failures``)
  ``failures/<phase>_<kind>``  each entry of ``failures`` (``failures/train_timeout``)
  ``failures/missing``      the clients missing from the evaluation (``missing``)
  ``train/<key>``           the aggregated training metrics (``train``)
  ``lambda/<partition>``    λ of each partition, where the record has ``lambda``
                            (up to ``max_client_scalars`` partitions)
  ``server/<key>``          any other number of the record (the strategy's
                            ``round_extras``: ``dual_lr``, ``lambda_entropy``, …)
  ========================  ==========================================================

* **per-client distributions** (:func:`client_distributions`): the clients' accuracies
  ``client_acc`` (``client_loss`` on a regression task) and ``lambda``, as histograms in
  TensorBoard and W&B and as quantiles plus a table in MLflow.

The step of every value is the round number. Records read back from ``rounds.jsonl``
may hold compacted per-client mappings; they are expanded first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from logging import WARNING
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.common import log

from flowerdro.runs.records import expand_record
from flowerdro.strategies.base import StopRun  # noqa: F401  # re-exported: observers raise it

if TYPE_CHECKING:
    from flowerdro.comparison import Comparison, Plan
    from flowerdro.strategies.base import FairStrategy

__all__ = [
    "EXTRAS",
    "Observer",
    "ObserverFactory",
    "StopRun",
    "Tracker",
    "TrackerUnavailableError",
    "client_distributions",
    "comparison_figures",
    "flat_settings",
    "require",
    "round_scalars",
    "run_figures",
    "run_folder",
]

#: The optional extra that installs each tracker's library.
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}

#: Record keys that are no numbers to plot (identity, per-client detail kept in rounds.jsonl).
_SKIP = frozenset({"round", "strategy"})
_COST = ("time_s", "bytes_sent", "bytes_received")


class TrackerUnavailableError(ImportError):
    """A tracker's library is not installed; the message names the extra that installs it."""


class Observer:
    """The observer API: subclass it, or write any object with some of these methods.

    A strategy calls every observer attached with :meth:`FairStrategy.add_observer`, in
    the order they were attached (a :class:`~flowerdro.runs.output.RunWriter`
    first when the strategy writes a run folder). Each method is optional; the base
    class's do nothing.
    """

    def on_start(self, strategy: FairStrategy, num_rounds: int) -> None:
        """Before the first round (after a resume: before the first round still to run,
        with ``strategy.history`` holding the records restored from the checkpoint)."""

    def on_round(self, strategy: FairStrategy, record: dict[str, Any]) -> None:
        """After every round, with its record (a plain dict; see :func:`round_scalars`)."""

    def on_end(self, strategy: FairStrategy, final_arrays: Any) -> None:
        """After the last round, with the run's final model (an ``ArrayRecord``)."""


#: Called once per run of a comparison (``run_plans(..., observers=[factory])``) with its
#: :class:`~flowerdro.runs.Plan`, before any training; returns the observer of that run.
#: A factory may also define ``finish(comparison)``, called once after the last run.
ObserverFactory = Callable[["Plan"], Any]


def require(module: str, tracker: str) -> ModuleType:
    """Import ``module`` for ``tracker``, or fail naming the extra that installs it.

    Raises
    ------
    TrackerUnavailableError
        ``module`` cannot be imported: the message says ``pip install 'flowerdro[<extra>]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerUnavailableError(
            f"tracker: {tracker} needs the {module.split('.')[0]!r} package, which is not installed "
            f"({exc}); install it with: pip install 'flowerdro[{EXTRAS[tracker]}]'") from exc


def _number(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _per_client(value: Any) -> bool:
    return (isinstance(value, Mapping) and bool(value)
            and all(isinstance(k, str) and k.lstrip("-").isdigit() for k in value)
            and all(_number(v) for v in value.values()))


def round_scalars(record: Mapping[str, Any], *, max_client_scalars: int = 100) -> dict[str, float]:
    """The round's numbers under their tracker names (the module docstring's table).

    λ per partition is included when the record has ``lambda`` over at most
    ``max_client_scalars`` partitions (beyond that, λ goes to the histograms only).
    """
    rec = expand_record(dict(record))
    out: dict[str, float] = {}
    for key, value in rec.items():
        if key in _SKIP:
            continue
        if _number(value):
            group = "fairness" if key.startswith(("acc_", "loss_")) else "cost" if key in _COST else "server"
            out[f"{group}/{key}"] = float(value)
        elif key == "failures" and isinstance(value, Mapping):
            out["failures/dropped"] = float(sum(value.values()))
            out.update({f"failures/{k.replace(':', '_')}": float(v) for k, v in value.items()})
        elif key == "missing" and isinstance(value, Mapping):
            out["failures/missing"] = float(len(value))
        elif key == "train" and isinstance(value, Mapping):
            out.update({f"train/{k}": float(v) for k, v in value.items() if _number(v)})
        elif key == "lambda" and _per_client(value) and len(value) <= max_client_scalars:
            out.update({f"lambda/{k}": float(v) for k, v in value.items()})
    return out


def client_distributions(record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The round's per-client values by name: ``client_acc`` (or ``client_loss``) and ``lambda``.

    Each is a float64 array in partition order.
    """
    rec = expand_record(dict(record))
    out = {}
    for key in ("client_acc", "client_loss", "lambda"):
        value = rec.get(key)
        if isinstance(value, Mapping) and _per_client(value):
            out[key] = np.array([float(value[k]) for k in sorted(value, key=int)])
    return out


def flat_settings(settings: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """``strategy.settings()`` as hyperparameters: lists joined by commas, ``None`` as ``"unset"``."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in settings.items():
        if value is None:
            out[key] = "unset"
        elif isinstance(value, bool | str) or _number(value):
            out[key] = value.item() if isinstance(value, np.generic) else value
        elif isinstance(value, list | tuple):
            out[key] = ",".join(map(str, value))
        else:
            out[key] = str(value)
    return out


def run_folder(strategy: FairStrategy) -> Path | None:
    """The run folder the strategy's :class:`~flowerdro.runs.output.RunWriter` writes (None without one)."""
    from flowerdro.runs.output import RunWriter

    for obs in getattr(getattr(strategy, "observers", None), "items", ()):  # the strategy's observers, in attach order
        if isinstance(obs, RunWriter):
            return obs.output_dir
    return None


def run_figures(strategy: FairStrategy) -> list[Path]:
    """``progress.png`` of the strategy's run folder, when its RunWriter drew it."""
    folder = run_folder(strategy)
    return [p for p in ([folder / "progress.png"] if folder else []) if p.is_file() and not p.is_symlink()]


def comparison_figures(comparison: Comparison) -> list[Path]:
    """``comparison.png`` of a comparison, when it was written."""
    out = comparison.output_dir
    return [p for p in ([Path(out) / "comparison.png"] if out else []) if p.is_file() and not p.is_symlink()]


class Tracker(Observer):
    """Shared base of the trackers: the scalars of a round, and closing a run that did not end.

    Parameters
    ----------
    max_client_scalars : int (default: 100)
        λ is logged per partition (``lambda/<partition>``) up to this many partitions;
        beyond, only its histogram (a warning says so once).
    """

    #: The tracker's name in the ``tracker`` run-config key.
    kind = ""

    def __init__(self, max_client_scalars: int = 100) -> None:
        if isinstance(max_client_scalars, bool) or not isinstance(max_client_scalars, int) or max_client_scalars < 0:
            raise ValueError(f"max_client_scalars: must be an integer >= 0, got {max_client_scalars!r}")
        self.max_client_scalars = max_client_scalars
        self._warned = False

    def scalars(self, record: Mapping[str, Any]) -> dict[str, float]:
        """:func:`round_scalars` of ``record``, with a warning the first time λ is too long to log per partition."""
        rec = expand_record(dict(record))
        lam = rec.get("lambda")
        if not self._warned and isinstance(lam, Mapping) and len(lam) > self.max_client_scalars:
            self._warned = True
            log(WARNING, "[%s] lambda has %d partitions, more than max_client_scalars = %d: "
                "logged as a histogram only", self.kind, len(lam), self.max_client_scalars)
        return round_scalars(rec, max_client_scalars=self.max_client_scalars)

    def close(self, failed: bool) -> None:
        """End the tracker's run if it is still open (``failed``: the run stopped with an error)."""
