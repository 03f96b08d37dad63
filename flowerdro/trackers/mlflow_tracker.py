"""MLflow: one MLflow run per strategy run, through ``MlflowClient`` (no global active run).

Needs ``mlflow-skinny`` (``pip install 'flowerdro[mlflow]'``): the tracking client without
the UI server. The full ``mlflow`` package (for ``mlflow ui``) can live in another
environment and read the same store. MLflow 3 refuses its plain-file store unless
``MLFLOW_ALLOW_FILE_STORE=true``; the local default here is therefore an SQLite database
(``sqlite:///<tracker-dir>/mlflow.db``, through SQLAlchemy and Alembic, which flwr
already requires), with artifacts in ``<tracker-dir>/mlflow-artifacts``.

**A crashed process and ``resume = true``.** Every run is tagged ``flowerdro.run_dir``
(its run folder, absolute). A process killed mid-run leaves its MLflow runs RUNNING;
when a run starts in the same folder again (resumed, or started afresh), it holds that
folder's lock, so any RUNNING MLflow run tagged with the folder belongs to a dead process:
it is marked KILLED, with its comparison's parent run and that parent's other RUNNING
runs. The resumed run is a new MLflow run tagged ``flowerdro.resumed_after`` (the
checkpoint's round) and ``flowerdro.resumes`` (the run it continues); it logs the
rounds restored from the checkpoint again before its own, so its series is the whole
run, rounds 1 to R, with no gap.
"""

from __future__ import annotations

import csv
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from logging import WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.common import log

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

__all__ = ["QUANTILES", "RUN_DIR_TAG", "MLflowComparison", "MLflowTracker", "end_stale_runs", "local_store"]

#: The quantiles of the clients' accuracies logged per round (``client_acc/p10``, …).
QUANTILES = (10, 25, 50, 75, 90)
#: MLflow's limits per ``log_batch`` request (metrics, params).
_MAX_METRICS, _MAX_PARAMS, _MAX_PARAM_LEN = 1000, 100, 6000


def local_store(directory: str | Path) -> tuple[str, str]:
    """The tracking URI and artifact location of a local MLflow store in ``directory``.

    ``sqlite:///<directory>/mlflow.db`` and ``file://<directory>/mlflow-artifacts``
    (absolute paths).
    """
    root = Path(directory).resolve()
    return f"sqlite:///{root / 'mlflow.db'}", (root / "mlflow-artifacts").as_uri()


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _experiment_id(client: Any, name: str, artifact_location: str | None) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location)


#: The tag that names a run's run folder (absolute path).
RUN_DIR_TAG = "flowerdro.run_dir"


def _runs_of_folder(client: Any, exp_id: str, run_dir: str) -> list[Any]:
    """Every MLflow run of experiment ``exp_id`` tagged with run folder ``run_dir``, oldest first."""
    if "'" in run_dir:  # not expressible in a filter string: filter here
        runs = _all_runs(client, exp_id, "")
        found = [r for r in runs if r.data.tags.get(RUN_DIR_TAG) == run_dir]
    else:
        found = _all_runs(client, exp_id, f"tags.`{RUN_DIR_TAG}` = '{run_dir}'")
    return sorted(found, key=lambda r: (r.info.start_time or 0, r.info.run_id))


def _all_runs(client: Any, exp_id: str, filter_string: str) -> list[Any]:
    out, token = [], None
    while True:
        page = client.search_runs([exp_id], filter_string=filter_string, max_results=1000, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out


def end_stale_runs(client: Any, exp_id: str, run_dirs: Iterable[str], *, keep: Iterable[str] = ()) -> list[str]:
    """Mark KILLED the runs a dead process left RUNNING in these run folders; return the parent runs so ended.

    Called by a run that holds the lock of each folder in ``run_dirs``: a RUNNING run
    tagged with one of them is therefore no longer written by anyone. Its parent
    (a comparison's run), when RUNNING and not in ``keep``, is marked KILLED as well,
    with the parent's other RUNNING runs.
    """
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    keep, killed, parents, ended = set(keep), [], set(), []
    for run_dir in run_dirs:
        for run in _runs_of_folder(client, exp_id, run_dir):
            if run.info.run_id in keep:
                continue
            if run.info.status == "RUNNING":
                client.set_terminated(run.info.run_id, "KILLED")
                killed.append(run.info.run_id)
            parent = run.data.tags.get(MLFLOW_PARENT_RUN_ID)
            if parent and parent not in keep:
                parents.add(parent)
    for parent in sorted(parents):
        if client.get_run(parent).info.status != "RUNNING":
            continue
        for child in _all_runs(client, exp_id, f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent}'"):
            if child.info.status == "RUNNING" and child.info.run_id not in keep:
                client.set_terminated(child.info.run_id, "KILLED")
                killed.append(child.info.run_id)
        client.set_terminated(parent, "KILLED")
        killed.append(parent)
        ended.append(parent)
    if killed:
        log(WARNING, "mlflow: %d run(s) left RUNNING by a process that died in the same run folder(s) are marked "
            "KILLED: %s", len(killed), ", ".join(killed))
    return ended


class MLflowTracker(Tracker):
    """Logs a strategy's run as one MLflow run.

    ``strategy.add_observer(MLflowTracker("my-comparison", tracking_uri="sqlite:///mlflow.db"))``.
    At the start: the settings as params, tags ``flowerdro.strategy`` (the run's label),
    ``flowerdro.algorithm``, ``flowerdro.seed``. Per round (step = round): the scalars of
    :func:`~flowerdro.trackers.round_scalars` and the quantiles ``client_acc/p10`` …
    ``p90`` of the clients' accuracies (``client_loss/…`` on regression tasks). At the
    end, artifacts ``clients.csv`` (round, partition and each per-client value: accuracy
    or loss, λ) and ``progress.png`` of the run folder; the run is marked FINISHED (an
    unfinished run is marked FAILED by :meth:`close`). With a run folder, the run is
    tagged ``flowerdro.run_dir``, and runs a dead process left RUNNING in that folder are
    marked KILLED first (:func:`end_stale_runs`). A resumed run is a new MLflow run tagged
    ``flowerdro.resumed_after`` and ``flowerdro.resumes`` (the folder's previous run) that
    logs the rounds restored from the checkpoint again, so it holds every round.

    Parameters
    ----------
    experiment : str (default: "flowerdro")
        The MLflow experiment (created when missing).
    tracking_uri : str, optional
        Where MLflow keeps runs (a database URI, a tracking server's ``http(s)://`` URL);
        unset: MLflow's own choice (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``).
    artifact_location : str, optional
        Artifact root of the experiment when it is created (unset: the store's default).
    run_name : str, optional
        The MLflow run name (default: ``<strategy label>-seed<k>``).
    tags : mapping, optional
        More tags of the run.
    parent_run_id : str or callable, optional
        Nest the run under this run (a comparison's run), or under the run this callable
        returns when the run starts.
    max_client_scalars : int (default: 100)
        λ per partition as metrics up to this many partitions.
    """

    kind = "mlflow"

    def __init__(self, experiment: str = "flowerdro", *, tracking_uri: str | None = None,
                 artifact_location: str | None = None, run_name: str | None = None,
                 tags: Mapping[str, str] | None = None, parent_run_id: str | Callable[[], str] | None = None,
                 max_client_scalars: int = 100) -> None:
        super().__init__(max_client_scalars)
        if not isinstance(experiment, str) or not experiment.strip():
            raise ValueError(f"experiment: expected a non-empty MLflow experiment name, got {experiment!r}")
        require("mlflow", self.kind)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment, self.artifact_location = experiment, artifact_location
        self.run_name, self.tags, self.parent_run_id = run_name, dict(tags or {}), parent_run_id
        self.run_id: str | None = None
        self._rows: list[tuple[int, int, dict[str, float]]] = []

    def on_start(self, strategy: FairStrategy, num_rounds: int) -> None:
        """End runs a dead process left in the run folder; create the run with its tags and params; log the
        rounds restored from a checkpoint."""
        from mlflow.entities import Param

        seed = strategy.loop.seed
        tags = {"flowerdro.strategy": strategy.run_name, "flowerdro.algorithm": strategy.name,
                "flowerdro.seed": str(seed), "flowerdro.num_rounds": str(num_rounds), **self.tags}
        exp_id = _experiment_id(self.client, self.experiment, self.artifact_location)
        parent = self._parent(exp_id)
        if parent is not None:
            tags["mlflow.parentRunId"] = parent
        folder = run_folder(strategy)
        if folder is not None:
            run_dir = str(Path(folder).resolve())
            tags[RUN_DIR_TAG] = run_dir
            end_stale_runs(self.client, exp_id, [run_dir], keep=[parent] if parent else [])
            earlier = _runs_of_folder(self.client, exp_id, run_dir)
            if strategy.history and earlier:
                tags["flowerdro.resumes"] = earlier[-1].info.run_id
        if strategy.history:
            tags["flowerdro.resumed_after"] = str(int(strategy.history[-1]["round"]))
        run = self.client.create_run(exp_id, run_name=self.run_name or f"{strategy.run_name}-seed{seed}", tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:_MAX_PARAM_LEN]) for k, v in flat_settings(strategy.settings()).items()]
        for chunk in _chunks(params, _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=chunk)
        for record in strategy.history:  # a resumed run: the rounds before its checkpoint
            self.on_round(strategy, record)

    def _parent(self, exp_id: str) -> str | None:
        """The run to nest this one under (``parent_run_id``, or the one a comparison makes on demand)."""
        return self.parent_run_id() if callable(self.parent_run_id) else self.parent_run_id

    def on_round(self, strategy: FairStrategy, record: dict[str, Any]) -> None:
        """Log the round's scalars and the quantiles of the clients' accuracies."""
        from mlflow.entities import Metric

        step, stamp = int(record["round"]), int(time.time() * 1000)
        values = self.scalars(record)
        dists = client_distributions(record)
        for name in ("client_acc", "client_loss"):
            if name in dists:
                qs = np.percentile(dists[name], QUANTILES)
                values.update({f"{name}/p{q}": float(v) for q, v in zip(QUANTILES, qs, strict=True)})
        metrics = [Metric(k, v, stamp, step) for k, v in values.items()]
        for chunk in _chunks(metrics, _MAX_METRICS):
            self.client.log_batch(self._run(), metrics=chunk)
        if dists:
            from flowerdro.runs.records import expand_record

            rec = expand_record(record)
            parts = sorted({int(p) for name in dists for p in rec[name]})
            for p in parts:
                self._rows.append((step, p, {name: float(rec[name][str(p)]) for name in dists
                                             if str(p) in rec[name]}))

    def on_end(self, strategy: FairStrategy, final_arrays: Any) -> None:
        """Log ``clients.csv`` and ``progress.png``; mark the run FINISHED."""
        with tempfile.TemporaryDirectory() as tmp:
            if self._rows:
                names = sorted({n for _, _, vals in self._rows for n in vals})
                path = Path(tmp) / "clients.csv"
                with path.open("w", newline="") as fh:
                    writer = csv.writer(fh)
                    writer.writerow(["round", "partition", *names])
                    for rnd, part, vals in self._rows:
                        writer.writerow([rnd, part, *(repr(vals[n]) if n in vals else "" for n in names)])
                self.client.log_artifact(self._run(), str(path))
        for path in run_figures(strategy):
            self.client.log_artifact(self._run(), str(path))
        self.client.set_terminated(self._run(), "FINISHED")
        self.run_id = None

    def _run(self) -> str:
        if self.run_id is None:
            raise RuntimeError("MLflowTracker: no open MLflow run (on_start was not called, or the run has ended)")
        return self.run_id

    def close(self, failed: bool) -> None:
        """Mark a run that is still open as FAILED (or FINISHED when not ``failed``)."""
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
            self.run_id = None


class MLflowComparison:
    """Makes the MLflow tracker of every run of a comparison (an observer factory).

    The comparison is one MLflow experiment (``name``) holding a parent run ``name``
    (tag ``flowerdro.kind = comparison``) with one nested run per (strategy, seed), so
    the experiment's compare view lines them up by the tags ``flowerdro.strategy`` and
    ``flowerdro.seed``. The parent run is made when the first run starts; runs that a
    dead process left RUNNING in any of the comparison's run folders are marked KILLED
    then, with their parent runs (:func:`end_stale_runs`). At the end the parent run gets
    ``comparison.png``, ``table.md`` and ``summary.json`` of the comparison, and FINISHED
    (FAILED when a run failed).

    Parameters
    ----------
    name : str
        The comparison, and the MLflow experiment.
    tracking_uri : str, optional
        See :class:`MLflowTracker`.
    artifact_location : str, optional
        See :class:`MLflowTracker`.
    max_client_scalars : int (default: 100)
        See :class:`MLflowTracker`.
    """

    def __init__(self, name: str, *, tracking_uri: str | None = None, artifact_location: str | None = None,
                 max_client_scalars: int = 100) -> None:
        require("mlflow", MLflowTracker.kind)
        from mlflow.tracking import MlflowClient

        self.name, self.tracking_uri, self.artifact_location = name, tracking_uri, artifact_location
        self.max_client_scalars = max_client_scalars
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.parent_run_id: str | None = None
        self.trackers: list[MLflowTracker] = []
        self.run_dirs: list[str] = []

    def __call__(self, plan: Plan) -> MLflowTracker:
        """The tracker of one run (nested under the comparison's parent run, made when a run first starts)."""
        if plan.output_dir is not None:
            self.run_dirs.append(str(Path(plan.output_dir).resolve()))
        tracker = MLflowTracker(self.name, tracking_uri=self.tracking_uri, artifact_location=self.artifact_location,
                                run_name=f"{plan.label}-seed{plan.seed}",
                                tags={"flowerdro.comparison": self.name, "flowerdro.strategy": plan.label},
                                parent_run_id=self.parent, max_client_scalars=self.max_client_scalars)
        self.trackers.append(tracker)
        return tracker

    def parent(self) -> str:
        """The comparison's parent run, made on the first call (after ending what a dead process left)."""
        if self.parent_run_id is None:
            exp_id = _experiment_id(self.client, self.name, self.artifact_location)
            ended = end_stale_runs(self.client, exp_id, self.run_dirs)
            tags = {"flowerdro.kind": "comparison", "flowerdro.comparison": self.name}
            if ended:
                tags["flowerdro.resumes"] = ",".join(ended)[:5000]
            self.parent_run_id = self.client.create_run(exp_id, run_name=self.name, tags=tags).info.run_id
        return self.parent_run_id

    def finish(self, comparison: Comparison) -> None:
        """Mark unfinished runs FAILED; log the comparison's files to its parent run and close it."""
        for tracker in self.trackers:
            tracker.close(failed=True)
        if self.parent_run_id is None:
            return
        for path in comparison_figures(comparison):
            self.client.log_artifact(self.parent_run_id, str(path))
        if comparison.table:
            self.client.log_text(self.parent_run_id, comparison.table + "\n", "table.md")
        self.client.log_dict(self.parent_run_id, {"seeds": comparison.seeds, "summaries": comparison.summaries,
                                                  "failed": comparison.failed}, "summary.json")
        self.client.set_terminated(self.parent_run_id, "FAILED" if comparison.failed else "FINISHED")
        self.parent_run_id = None
