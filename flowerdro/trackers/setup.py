"""Observer factories from the run config: the trackers it names and the user's own factories.

The ServerApp and the experiments runner read the keys of
:class:`~flowerdro.runs.RunSettings` (``tracker``, ``tracker-dir``, ``tracker-experiment``,
``tracker-project``, ``mlflow-tracking-uri``, ``wandb-mode``, ``observers``) and hand
:func:`observer_factories` to :func:`~flowerdro.runs.run_plans`. Everything is imported
and checked here, before any training: a tracker whose library is missing fails with
the extra to install, an ``observers`` entry that does not import fails naming it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from flowerdro.trackers.common import ObserverFactory
from flowerdro.trackers.mlflow_tracker import local_store

if TYPE_CHECKING:
    from flowerdro.runs import RunSettings

__all__ = ["TRACKERS", "load_factory", "observer_factories", "tracker_factories", "tracker_root", "where"]

#: The trackers the ``tracker`` run-config key may name.
TRACKERS = ("tensorboard", "mlflow", "wandb")


def tracker_root(settings: RunSettings, output_dir: str | Path | None) -> Path | None:
    """The folder of the trackers' files: ``tracker-dir``, else ``<output_dir>/trackers``.

    None when neither is set and no tracker named needs a folder (MLflow with a
    ``mlflow-tracking-uri`` of its own).

    Raises
    ------
    ValueError
        A tracker needs a folder, ``tracker-dir`` is empty and there is no output folder.
    """
    if settings.tracker_dir.strip():
        return Path(settings.tracker_dir)
    if output_dir is not None:
        return Path(output_dir) / "trackers"
    needs = [k for k in settings.tracker if not (k == "mlflow" and settings.mlflow_tracking_uri)]
    if needs:
        raise ValueError(f"tracker-dir: unset, and this run writes no output folder for {', '.join(needs)} to write "
                         "into; set tracker-dir (or an output folder)")
    return None


def tracker_factories(settings: RunSettings, comparison: str, output_dir: str | Path | None = None
                      ) -> list[ObserverFactory]:
    """One observer factory per tracker named in ``settings.tracker``, for comparison ``comparison``.

    The comparison's name in the trackers is ``tracker-experiment``, or ``comparison``
    when that is empty. Under :func:`tracker_root` (``tracker-dir``, else
    ``<output_dir>/trackers``): ``tensorboard/<name>/<label>/seed<k>``, ``mlflow.db`` and
    ``mlflow-artifacts/`` (unless ``mlflow-tracking-uri`` names another store),
    ``wandb/offline-run-*``.
    """
    from flowerdro.trackers.mlflow_tracker import MLflowComparison
    from flowerdro.trackers.tensorboard_tracker import TensorBoardComparison
    from flowerdro.trackers.wandb_tracker import WandbComparison

    name = settings.tracker_experiment or comparison
    root = tracker_root(settings, output_dir) if settings.tracker else None
    out: list[ObserverFactory] = []
    for kind in settings.tracker:
        if kind == "tensorboard":
            out.append(TensorBoardComparison(root / "tensorboard", name))
        elif kind == "mlflow":
            uri, artifacts = ((settings.mlflow_tracking_uri, None) if settings.mlflow_tracking_uri
                              else local_store(root))
            out.append(MLflowComparison(name, tracking_uri=uri, artifact_location=artifacts))
        elif kind == "wandb":
            out.append(WandbComparison(settings.tracker_project, name, dir=root, mode=settings.wandb_mode))
        else:
            raise ValueError(f"tracker: unknown tracker {kind!r}; allowed: {', '.join(TRACKERS)}")
    return out


def where(settings: RunSettings, output_dir: str | Path | None, *, tracker_output_dir: str | Path | None = None
          ) -> list[str]:
    """Lines that say where a run's results and tracker files go (absolute paths), and how to look at them.

    ``output_dir`` is the results folder (None: none written); ``tracker_output_dir`` the
    folder whose ``trackers/`` holds the tracker files when ``tracker-dir`` is empty
    (default: ``output_dir``).
    """
    lines = [f"results: {Path(output_dir).resolve()}" if output_dir is not None else "results: none written "
             "(no output folder)"]
    if not settings.tracker:
        return lines
    root = tracker_root(settings, tracker_output_dir if tracker_output_dir is not None else output_dir)
    root = root.resolve() if root is not None else None
    for kind in settings.tracker:
        if kind == "tensorboard":
            lines.append(f"TensorBoard: {root / 'tensorboard'} (look: tensorboard --logdir {root / 'tensorboard'})")
        elif kind == "mlflow":
            uri = settings.mlflow_tracking_uri or local_store(root)[0]
            lines.append(f"MLflow: {uri} (look: mlflow ui --backend-store-uri {uri})")
        elif kind == "wandb":
            look = (f"upload: wandb sync {root / 'wandb'}/offline-run-*" if settings.wandb_mode == "offline"
                    else f"streamed to project {settings.tracker_project}")
            lines.append(f"W&B: {root / 'wandb'} ({look})")
    return lines


def load_factory(path: str) -> ObserverFactory:
    """The observer factory at import path ``"package.module:function"``.

    Raises
    ------
    ValueError
        The path is not ``module:attribute``, the module does not import, it has no such
        attribute, or the attribute is not callable (each message names ``observers``).
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"observers: expected an import path 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"observers: cannot import module {module_name!r} of {path!r}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"observers: {module_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"observers: {path!r} is not callable; it must be a factory plan -> observer")
    return obj


def observer_factories(settings: RunSettings, comparison: str, output_dir: str | Path | None = None
                       ) -> list[ObserverFactory]:
    """The trackers of ``settings.tracker`` (their files under :func:`tracker_root`) and the factories of
    ``settings.observers``, in that order."""
    return [*tracker_factories(settings, comparison, output_dir), *(load_factory(p) for p in settings.observers)]
