"""Watching runs: TensorBoard, MLflow and W&B trackers, and the observer API they are built on.

A tracker is an observer (:class:`Observer`): attach it to a strategy with
``strategy.add_observer(TensorBoardTracker("runs/drfa"))``, or name it in the run config
(``tracker = "tensorboard,mlflow,wandb"``) for ``flwr run``, the experiments runner and
deployments. Each library is an optional extra (``pip install 'flowerdro[tensorboard]'``,
``[mlflow]``, ``[wandb]``) imported when the tracker is built, so a missing one fails
before any training with the command that installs it. What is logged is
:func:`round_scalars` and :func:`client_distributions` of every round record.
"""

from flowerdro.trackers.common import (
    EXTRAS,
    Observer,
    ObserverFactory,
    StopRun,
    Tracker,
    TrackerUnavailableError,
    client_distributions,
    flat_settings,
    round_scalars,
)
from flowerdro.trackers.mlflow_tracker import MLflowComparison, MLflowTracker, local_store
from flowerdro.trackers.setup import TRACKERS, load_factory, observer_factories, tracker_factories
from flowerdro.trackers.tensorboard_tracker import TensorBoardComparison, TensorBoardTracker
from flowerdro.trackers.wandb_tracker import WANDB_MODES, WandbComparison, WandbTracker

__all__ = [
    "EXTRAS",
    "TRACKERS",
    "WANDB_MODES",
    "MLflowComparison",
    "MLflowTracker",
    "Observer",
    "ObserverFactory",
    "StopRun",
    "TensorBoardComparison",
    "TensorBoardTracker",
    "Tracker",
    "TrackerUnavailableError",
    "WandbComparison",
    "WandbTracker",
    "client_distributions",
    "flat_settings",
    "load_factory",
    "local_store",
    "observer_factories",
    "round_scalars",
    "tracker_factories",
]
