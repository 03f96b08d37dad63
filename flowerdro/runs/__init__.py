"""Run folders: their files, lock, identity, checkpoints (with their optional key) and what a finished run
left (records, tables, figures).

Below the strategies: a strategy's :class:`~flowerdro.runs.output.RunWriter` writes its
folder (its :class:`~flowerdro.runs.store.CheckpointStore` the checkpoints), and
everything here reads or writes files without knowing the algorithms; what only the
registry knows (the run-config keys flowerdro declares, the settings that shape a
result) is handed to :func:`~flowerdro.runs.identity.run_identity`.
"""

from flowerdro.runs.report import comparison_table, final_summary, first_round_reaching
from flowerdro.runs.results import load_comparison, load_records, load_settings, run_dirs
from flowerdro.runs.settings import RunSettings

__all__ = [
    "RunSettings",
    "comparison_table",
    "final_summary",
    "first_round_reaching",
    "load_comparison",
    "load_records",
    "load_settings",
    "run_dirs",
]
