"""The flowerdro ServerApp: runs the strategies named in the run config, one after another.

Run-config keys read here: ``strategies`` (comma-separated names), ``num-rounds``,
``round-timeout`` (seconds), ``output-dir``, ``resume``, ``overwrite``, ``extend``
(:class:`flowerdro.runs.RunSettings`); all others go to the strategies and clients. The
run holds the lock of ``output-dir`` (its holder file names the Flower run id), so a
second run into the same folder is refused while this one lasts. Initial weights come from one client
(``query.init``), so the server never needs the data set. At the end the comparison
table of the final per-client accuracies is printed and written with ``summary.json``
and the comparison figure under ``output-dir``. The grid pulls replies every 0.05 s
(:class:`~flowerdro.deploy.grid.PromptGrid`; Flower's deployment grid waits 3 s between pulls).
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flowerdro.deploy.grid import PromptGrid
from flowerdro.runs import Comparison, Plan, RunSettings, run_plans
from flowerdro.runs.config import check_run_config
from flowerdro.settings import read_settings

app = ServerApp()


def run_strategies(grid: Grid, run_config: dict, run_id: int | None = None) -> Comparison:
    """Run every strategy named in the run config on ``grid``; return the comparison.

    ``run_id`` (the Flower run's id) is written into the output folders' lock files.
    """
    check_run_config(run_config)
    run = read_settings(RunSettings, run_config)
    out_root = Path(run.output_dir)
    seed = int(run_config.get("seed", 0) or 0)
    plans = [Plan(name, name, seed, dict(run_config), out_root / name) for name in run.strategies]
    return run_plans(plans, lambda _plan: grid, name="flwr-run", num_rounds=run.num_rounds,
                     timeout=run.round_timeout, out_dir=out_root, config=run_config, resume=run.resume,
                     overwrite=run.overwrite, extend=run.extend, run_id=run_id)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point (replies pulled every 0.05 s, :class:`~flowerdro.deploy.grid.PromptGrid`)."""
    run_strategies(PromptGrid(grid), dict(context.run_config), run_id=int(context.run_id))
