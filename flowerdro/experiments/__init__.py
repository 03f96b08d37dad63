"""Multi-strategy comparisons in-process: ``run(config) -> Comparison`` and ``python -m flowerdro.experiments``."""

from flowerdro.experiments.inprocess import Fault, InProcessGrid
from flowerdro.experiments.runner import RunResult, load_config, run

__all__ = ["Fault", "InProcessGrid", "RunResult", "load_config", "run"]
