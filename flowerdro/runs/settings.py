"""What a run is asked to do: the strategies, the rounds, where its folders go, what watches it.

:class:`RunSettings` holds the run-config keys that flowerdro's ServerApp and experiments
runner read besides those of the strategies, the clients and the data (every key of a run
config is declared by one settings class; see
:func:`flowerdro.strategies.registry.settings_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowerdro.settings import Settings, setting

__all__ = ["TRACKERS", "WANDB_MODES", "WATCH_KEYS", "RunSettings"]

#: The trackers the ``tracker`` key may name (those of :mod:`flowerdro.trackers`; a test keeps the two in line).
TRACKERS: tuple[str, ...] = ("tensorboard", "mlflow", "wandb")
#: The modes of ``wandb-mode`` (:data:`flowerdro.trackers.WANDB_MODES`; a test keeps the two in line).
WANDB_MODES: tuple[str, ...] = ("offline", "online")


@dataclass(frozen=True)
class RunSettings(Settings):
    """What the ServerApp runs: which strategies, how many rounds, where results go, what watches them."""

    strategies: tuple[str, ...] = setting(("fedavg",), "strategies to compare, one after another "
                                                       "(comma-separated names)")
    num_rounds: int = setting(10, "communication rounds per strategy", ge=1)
    round_timeout: float = setting(600.0, "seconds to wait for the replies of one exchange", gt=0)
    output_dir: str = setting("results/flwr-run", "where the results go (one folder per strategy)")
    resume: bool = setting(False, "continue the runs in output-dir from their latest checkpoints "
                                  "(finished runs are kept as they are)")
    overwrite: bool = setting(False, "replace another run's files in output-dir instead of refusing")
    extend: bool = setting(False, "with resume: let num-rounds go beyond the rounds the runs were planned "
                                  "for (the runs are extended; settings.json records it)")
    tracker: tuple[str, ...] = setting((), "trackers that log every run (comma-separated; empty: none)",
                                       choices=TRACKERS)
    tracker_dir: str = setting("", "where the trackers write: tensorboard/, mlflow.db with mlflow-artifacts/, "
                                   "wandb/ (empty: trackers/ in the output folder, <output-dir>/trackers)")
    tracker_experiment: str = setting("", "the comparison's name in the trackers: MLflow experiment, W&B group, "
                                          "TensorBoard folder (empty: the experiment file's name; flwr-run "
                                          "for the ServerApp)")
    tracker_project: str = setting("flowerdro", "the W&B project")
    mlflow_tracking_uri: str = setting("", "where MLflow keeps the runs: a database URI or a tracking server's "
                                           "URL (empty: the SQLite database mlflow.db in tracker-dir)")
    wandb_mode: str = setting("offline", "offline: W&B writes files for wandb sync; online: it streams to "
                                         "the W&B server", choices=WANDB_MODES)
    observers: tuple[str, ...] = setting((), "observer factories by import path (comma-separated "
                                             "package.module:function), each called once per run with its Plan")

    def check(self) -> None:
        """Each tracker once."""
        for key, values in (("tracker", self.tracker), ("observers", self.observers)):
            if len(set(values)) != len(values):
                raise ValueError(f"{key}: names an entry twice: {','.join(values)}")


#: The run-config keys of :class:`RunSettings` that choose what watches the runs.
WATCH_KEYS = ("tracker", "tracker-dir", "tracker-experiment", "tracker-project", "mlflow-tracking-uri",
              "wandb-mode", "observers")
