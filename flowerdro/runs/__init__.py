"""Running comparisons: the driver the ServerApp and the runner share, tables, the results reader."""

from flowerdro.runs.driver import (
    Comparison,
    Plan,
    RunSettings,
    client_config,
    initial_arrays,
    run_plans,
)
from flowerdro.runs.report import comparison_table, final_summary, first_round_reaching
from flowerdro.runs.results import load_comparison, load_records, load_settings, run_dirs

__all__ = [
    "Comparison",
    "Plan",
    "RunSettings",
    "client_config",
    "comparison_table",
    "final_summary",
    "first_round_reaching",
    "initial_arrays",
    "load_comparison",
    "load_records",
    "load_settings",
    "run_dirs",
    "run_plans",
]
