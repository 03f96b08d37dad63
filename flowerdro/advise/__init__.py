"""The tuning advisor: which strategy lifts my worst clients, and how strongly.

``python -m flowerdro.advise conf/<name>.toml`` (or :func:`run` from Python) searches over
the registered strategies and their strength knobs (declared with each algorithm's
settings, :func:`flowerdro.strategies.strength_knobs`) for the setting that serves the
worst clients best, on validation sets held out of the clients' training data, then
judges that setting once on the clients' test sets over fresh seeds against FedAvg. The
search is Optuna's (TPE sampling, Hyperband or successive-halving pruning over rounds
against each strategy's own trials, SQLite storage so a stopped search resumes); it needs
the extra ``flowerdro[advise]``.

See :mod:`flowerdro.advise.config` for the file format, :mod:`flowerdro.advise.search`
for the phases, :mod:`flowerdro.advise.pruning` for the pruner,
:mod:`flowerdro.advise.verdict` for the verdict's test and :mod:`flowerdro.advise.report`
for the report.
"""

from flowerdro.advise.config import AdviseSettings, Budget, Candidate, parse_budget, search_space
from flowerdro.advise.search import Search, load_config, run
from flowerdro.advise.verdict import Advice

__all__ = ["Advice", "AdviseSettings", "Budget", "Candidate", "Search", "load_config", "parse_budget", "run",
           "search_space"]
