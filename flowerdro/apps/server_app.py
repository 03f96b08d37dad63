"""The flowerdro ServerApp: runs the strategies named in the run config, one after another.

Run-config keys read here: ``strategies`` (comma-separated names), ``num-rounds``,
``round-timeout`` (seconds), ``output-dir``, ``resume``, ``overwrite``, ``extend``, and
what watches the runs: ``tracker`` (``tensorboard,mlflow,wandb``), ``tracker-dir``
(default ``<output-dir>/trackers``), ``tracker-experiment`` (default ``flwr-run``),
``tracker-project``, ``mlflow-tracking-uri``, ``wandb-mode`` and ``observers`` (import paths of observer factories)
(:class:`flowerdro.runs.RunSettings`); the ``dp`` keys wrap every strategy in Flower's
central DP (:class:`flowerdro.privacy.PrivacySettings`); all others go to the strategies
and clients. Trackers and observer factories are imported and checked before the first
message. The run holds the lock of ``output-dir`` (its holder file names the Flower run
id), so a second run into the same folder is refused while this one lasts. Initial weights come from one client
(``query.init``), so the server never needs the data set. At the end the comparison
table of the final per-client accuracies is printed and written with ``summary.json``
and the comparison figure under ``output-dir``. Before the first message it logs where
the results and the tracker files go, as absolute paths: relative ones are taken from the
ServerApp's working folder, which under ``flwr run`` is the folder the local SuperLink
was started in, not the caller's. The grid pulls replies every 0.05 s
(:class:`~flowerdro.deploy.grid.PromptGrid`; Flower's deployment grid waits 3 s between pulls).
"""

from __future__ import annotations

from collections.abc import Sequence
from logging import INFO
from pathlib import Path

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from flowerdro.comparison import Comparison, Plan, run_plans
from flowerdro.deploy.grid import PromptGrid
from flowerdro.runs import RunSettings
from flowerdro.settings import read_settings
from flowerdro.strategies.registry import check_run_config
from flowerdro.trackers import ObserverFactory, observer_factories
from flowerdro.trackers.setup import where

app = ServerApp()


#: The comparison's name (in logs, and in the trackers unless ``tracker-experiment`` is set).
COMPARISON = "flwr-run"


def run_strategies(grid: Grid, run_config: dict, observers: Sequence[ObserverFactory] = (),
                   run_id: int | None = None) -> Comparison:
    """Run every strategy named in the run config on ``grid``; return the comparison.

    The trackers and observer factories of the run config watch every run, then
    ``observers`` (factories ``(plan) -> observer``, see :func:`~flowerdro.runs.run_plans`).
    ``run_id`` (the Flower run's id) is written into the output folders' lock files.
    """
    check_run_config(run_config)
    run = read_settings(RunSettings, run_config)
    out_root = Path(run.output_dir)
    factories = [*observer_factories(run, COMPARISON, out_root), *observers]
    for line in where(run, out_root):
        log(INFO, "%s: %s", COMPARISON, line)
    relative = [k for k, v in (("output-dir", run.output_dir), ("tracker-dir", run.tracker_dir))
                if v.strip() and not Path(v).is_absolute()]
    if relative:
        log(INFO, "%s: %s relative to this ServerApp's working folder %s; under `flwr run` that is the folder the "
            "local SuperLink was first started in (give an absolute path to choose the place)", COMPARISON,
            " and ".join(relative) + (" is" if len(relative) == 1 else " are"), Path.cwd())
    seed = int(run_config.get("seed", 0) or 0)
    plans = [Plan(name, name, seed, dict(run_config), out_root / name) for name in run.strategies]
    return run_plans(plans, lambda _plan: grid, name=COMPARISON, num_rounds=run.num_rounds,
                     timeout=run.round_timeout, out_dir=out_root, config=run_config, resume=run.resume,
                     overwrite=run.overwrite, extend=run.extend, run_id=run_id, observers=factories)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point (replies pulled every 0.05 s, :class:`~flowerdro.deploy.grid.PromptGrid`)."""
    run_strategies(PromptGrid(grid), dict(context.run_config), run_id=int(context.run_id))
