"""The one comparison driver: several strategies (and seeds) on one federation, one table.

The ServerApp (``flwr run``, deployments) and the experiments runner (in-process) both
describe what to run as :class:`Plan` s and call :func:`run_plans`, which builds every
strategy first (a bad setting fails before any training), gets the initial model from a
client (``query.init``: the server never loads data), runs the strategies one after
another, and writes ``summary.json``, ``table.md`` and the comparison figure.

Before any message, :func:`run_plans` checks every run's data keys and model
(:func:`~flowerdro.validation.check_run_config_values`), takes the lock of the
comparison's folder (``comparison.lock``) and of every run folder (``run.lock``,
:class:`~flowerdro.runs.lock.FolderLock`), so a second comparison on the same folders is
refused at once naming the holder, and with ``resume`` it checks every run's identity
against its folder's and loads and checks its checkpoint and plan
(:meth:`~flowerdro.runs.output.RunWriter.resume_checkpoint`), or takes a finished run from
disk (:meth:`~flowerdro.runs.output.RunWriter.finished_run`); the locks are released when
it returns or raises. The strategies' roll call checks each node's config against the
run config (:func:`~flowerdro.validation.roll_call_problem`), and a resumed checkpoint's
model is checked against the clients' initial model (names, shapes, dtypes) before the
first training message. ``summary.json``, ``table.md`` and ``comparison.png`` are
written by atomic rename (:mod:`flowerdro.runs.files`).
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.privacy import PrivacySettings, dp_from_run_config
from flowerdro.runs.files import refuse_links, write_text
from flowerdro.runs.integrity import run_key
from flowerdro.runs.lock import FolderLock
from flowerdro.runs.output import RunWriter
from flowerdro.runs.report import comparison_table, final_summary
from flowerdro.settings import read_settings
from flowerdro.strategies import FairStrategy, RunFailedError, build_strategy, initial_arrays
from flowerdro.validation import check_run_config_values

__all__ = ["Comparison", "ObserverFactory", "Plan", "client_config", "run_plans"]

#: Run-config keys forwarded to the clients in every training message's config.
CLIENT_KEYS = ("lr", "local-steps", "local-epochs", "batch-size", "seed", "loss-on", "weight-decay")


@dataclass
class Plan:
    """One run of a comparison: a label, its algorithm, seed, run config and output folder."""

    label: str
    algorithm: str
    seed: int
    run_config: dict[str, Any]
    output_dir: Path | None = None


#: A factory ``(plan) -> observer or None``, called once per run (see :func:`run_plans`);
#: :func:`flowerdro.trackers.observer_factories` makes them from the run config.
ObserverFactory = Callable[[Plan], Any]


@dataclass
class Comparison:
    """Everything a comparison produced.

    ``histories[label][k]`` is the list of round records of ``seeds[k]``; ``final_arrays``
    the models the runs returned; ``summaries`` the final fairness numbers.
    """

    name: str
    seeds: list[int]
    histories: dict[str, list[list[dict[str, Any]]]] = field(default_factory=dict)
    final_arrays: dict[str, list[ArrayRecord]] = field(default_factory=dict)
    summaries: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    strategies: dict[str, list[FairStrategy]] = field(default_factory=dict)
    output_dir: Path | None = None
    table: str = ""
    #: The runs that stopped with :class:`RunFailedError`, with the error.
    failed: list[str] = field(default_factory=list)


def client_config(run_config: Mapping[str, Any]) -> ConfigRecord:
    """The client hyper-parameters of the run config, as sent in every training message."""
    return ConfigRecord({k: run_config[k] for k in CLIENT_KEYS if k in run_config and run_config[k] != ""})


def run_plans(
    plans: Sequence[Plan],
    grid_for: Callable[[Plan], Grid],
    *,
    name: str,
    num_rounds: int,
    timeout: float,
    out_dir: Path | None = None,
    last_rounds: int = 1,
    config: Mapping[str, Any] | None = None,
    verbose: bool = True,
    resume: bool = False,
    overwrite: bool = False,
    extend: bool = False,
    run_id: int | None = None,
    observers: Sequence[ObserverFactory] = (),
) -> Comparison:
    """Run every plan on the grid ``grid_for(plan)`` and compare the strategies.

    Returns a :class:`Comparison`; with ``out_dir`` set, each plan's strategy writes its
    run folder (``plan.output_dir``) and ``out_dir`` gets ``summary.json``, ``table.md`` and
    ``comparison.png``. With ``resume``, a plan whose folder holds a finished run of
    ``num_rounds`` rounds is taken from disk, and one with a checkpoint continues after
    its newest intact one (``num_rounds`` beyond the run's plan only with ``extend``); one
    without a checkpoint starts afresh (logged). ``run_id`` (the Flower run id) is written
    into the folder locks' holder files.

    A plan whose run stops with :class:`RunFailedError` (it could not train, e.g. a
    diverging strategy) does not stop the others: they run, the comparison of the runs
    that finished is written, and then :class:`RunFailedError` is raised naming every
    failed run, so the comparison as a whole still fails loudly.

    ``observers`` are factories ``(plan) -> observer`` (or ``None`` for no observer),
    called for every plan once its strategy is built, before any training; each run
    gets its own observer, attached after the run's writer. A factory that has
    ``finish(comparison)`` is called once after the last run (also when a run failed,
    before the error is raised), when ``comparison.png`` has been written. An observer
    that raises :class:`~flowerdro.strategies.base.StopRun` in ``on_round`` ends its run
    there (:meth:`FairStrategy.start <flowerdro.strategies.base.FairStrategy.start>`).

    Raises
    ------
    flowerdro.runs.lock.FolderInUseError
        Another run holds the lock of ``out_dir`` or of a plan's folder (before any message).
    flowerdro.runs.checkpoint.CheckpointError
        With ``resume``: a run folder holds only damaged, refused or pickled checkpoints; a
        checkpoint's model does not fit the clients' (before any training message).
    flowerdro.runs.identity.RunIdentityError
        With ``resume``: a run folder's run (finished or not) has other settings, each key
        named with both values (before any message).
    ValueError
        A run config's data keys or model cannot be built (naming the key); with
        ``resume``: ``num_rounds`` breaks a run's plan (before any message).
    """
    for plan in plans:  # what the clients would fail on in round 1, refused now naming the key
        check_run_config_values(plan.run_config)
    if out_dir is not None:
        run_key(out_dir)  # a key of the environment that cannot protect the folder is refused now
    built = [(plan, build_strategy(plan.algorithm, plan.run_config, output_dir=plan.output_dir,
                                   run_name=plan.label, resume=resume, overwrite=overwrite, extend=extend,
                                   run_id=run_id)) for plan in plans]
    for plan, strategy in built:  # central DP when the run config asks: refused here for a strategy it cannot protect
        dp_from_run_config(strategy, read_settings(PrivacySettings, plan.run_config))
        strategy.comm.roster.run_config = plan.run_config  # the roll call checks each node's num-partitions against it
    releases: list[Callable[[], None]] = []
    try:
        if out_dir is not None:
            root = FolderLock(out_dir, name="comparison", run_id=run_id)
            root.acquire()
            releases.append(root.release)
        starts: list[tuple[list[dict[str, Any]], ArrayRecord] | dict[str, Any] | None] = []
        for _plan, strategy in built:
            writer = _writer(strategy)
            if writer is not None:
                if out_dir is not None:
                    refuse_links(out_dir, writer.output_dir)
                writer.acquire()
                releases.append(writer.close)
            if resume and writer is not None and (done := writer.finished_run(num_rounds)):
                starts.append(done)
            else:
                starts.append(writer.resume_checkpoint(num_rounds) if resume and writer is not None else None)
        return _run(built, starts, grid_for, name=name, num_rounds=num_rounds, timeout=timeout, out_dir=out_dir,
                    last_rounds=last_rounds, config=config, verbose=verbose, observers=observers)
    finally:
        for release in reversed(releases):
            release()


def _run(built: list[tuple[Plan, FairStrategy]], starts: list[Any], grid_for: Callable[[Plan], Grid], *,
         name: str, num_rounds: int, timeout: float, out_dir: Path | None, last_rounds: int,
         config: Mapping[str, Any] | None, verbose: bool, observers: Sequence[ObserverFactory]) -> Comparison:
    """The runs of :func:`run_plans`, each from its start (a finished run, a checkpoint or round 1),
    watched by ``observers``; then the comparison's files and the factories' ``finish``."""
    seeds = sorted({p.seed for p, _ in built})
    result = Comparison(name=name, seeds=seeds, output_dir=out_dir)
    done = False
    try:
        for plan, strategy in built:
            for factory in observers:
                if (observer := factory(plan)) is not None:
                    strategy.add_observer(observer)
        _run_all(result, built, starts, grid_for, num_rounds=num_rounds, timeout=timeout, last_rounds=last_rounds,
                 verbose=verbose)
        if out_dir is not None and result.summaries:
            _write(result, out_dir, config)
        done = True
    finally:
        _finish(observers, result, raise_errors=done)
    if result.failed:
        raise RunFailedError(f"{name}: {len(result.failed)} of {len(built)} runs failed: " + "; ".join(result.failed))
    return result


def _run_all(result: Comparison, built: Sequence[tuple[Plan, FairStrategy]], starts: list[Any],
             grid_for: Callable[[Plan], Grid], *, num_rounds: int, timeout: float, last_rounds: int,
             verbose: bool) -> None:
    """Run every plan's strategy in turn from its start and collect what finished (see :func:`run_plans`)."""
    name, t0 = result.name, time.time()
    for i, (plan, strategy) in enumerate(built):
        begin, starts[i] = starts[i], None  # a checkpoint is not kept in memory once its run started
        if isinstance(begin, tuple):
            strategy.history, final = begin
            log(INFO, "=== %s / %s (seed %d): finished before, read from %s ===", name, plan.label, plan.seed,
                plan.output_dir)
            _collect(result, plan, strategy, final, last_rounds)
            continue
        grid = grid_for(plan)
        init = initial_arrays(grid, plan.run_config, timeout)
        if isinstance(begin, dict) and (writer := _writer(strategy)) is not None:
            writer.checkpoints.check_model(begin, init)  # the checkpoint's model is the clients' (names, shapes, dtypes)
        # Libraries and data sets are loaded now and live for the whole run. Flower forces
        # gc.collect() in ArrayRecord.to_numpy_ndarrays(keep_input=False) (q-FedAvg calls it
        # per reply); without freezing, each collection walks this large heap.
        gc.collect()
        gc.freeze()
        if verbose:
            log(INFO, "=== %s / %s (seed %d) ===", name, plan.label, plan.seed)
        try:
            res = strategy.start(grid, init, num_rounds=num_rounds, timeout=timeout,
                                 train_config=client_config(plan.run_config), evaluate_config=ConfigRecord(),
                                 **({"resume": begin} if begin is not None else {}))
            final = res.arrays
        except RunFailedError as exc:
            log(ERROR, "=== %s / %s (seed %d) failed: %s; the other runs go on ===", name, plan.label, plan.seed, exc)
            result.failed.append(f"{plan.label} (seed {plan.seed}): {exc}")
            continue
        finally:
            if (writer := _writer(strategy)) is not None:
                writer.close()
        _collect(result, plan, strategy, final, last_rounds)
    result.table = comparison_table(result.summaries) if result.summaries else ""
    if verbose and result.summaries:
        print(f"\n{name}: {len(result.summaries)} strategies x {len(result.seeds)} seeds, {num_rounds} rounds, "
              f"{time.time() - t0:.1f} s\n{result.table}\n", flush=True)


def _finish(observers: Sequence[ObserverFactory], result: Comparison, *, raise_errors: bool) -> None:
    """Call ``finish(result)`` of every factory that has one.

    After a comparison that ended normally an error there is raised; while another
    error is on its way out, it is logged so that the first error is the one raised.
    """
    for factory in observers:
        finish = getattr(factory, "finish", None)
        if finish is None:
            continue
        try:
            finish(result)
        except Exception as exc:
            if raise_errors:
                raise
            log(ERROR, "%s.finish failed while the comparison stopped with an error: %s",
                type(factory).__name__, exc)


def _collect(result: Comparison, plan: Plan, strategy: FairStrategy, final: ArrayRecord, last_rounds: int) -> None:
    result.histories.setdefault(plan.label, []).append(strategy.history)
    result.final_arrays.setdefault(plan.label, []).append(final)
    result.summaries.setdefault(plan.label, []).append(final_summary(strategy.history, last=last_rounds))
    result.strategies.setdefault(plan.label, []).append(strategy)


def _writer(strategy: FairStrategy) -> RunWriter | None:
    """The strategy's :class:`RunWriter` (None when it writes no files)."""
    return strategy.observers.of_type(RunWriter)


def _write(result: Comparison, out_dir: Path, config: Mapping[str, Any] | None) -> None:
    """``summary.json``, ``table.md`` and ``comparison.png``, each by atomic rename (never through a link)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "summary.json", json.dumps(
        {"config": _jsonable(config or {}), "seeds": result.seeds, "summaries": result.summaries}, indent=2),
        "the comparison's summary")
    write_text(out_dir / "table.md", result.table + "\n", "the comparison's table")
    try:
        from flowerdro.runs.plots import plot_comparison

        plot_comparison(result.histories, out_dir / "comparison.png", title=result.name)
    except Exception as exc:  # noqa: BLE001  # a figure never fails a run
        log(WARNING, "could not draw the comparison figure: %s", exc)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj
