"""What a strategy's server holds between rounds: the checkpoint's content, taken and put back.

:func:`server_state` gathers everything the server needs to continue a run after the
current round into one plain dict (its file format is :mod:`flowerdro.runs.checkpoint`);
:func:`restore` puts a strategy back into the state such a dict describes, so the rounds
that follow are those of an uninterrupted run.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord

from flowerdro.strategies.arrays import numpy_to_arrays

__all__ = ["restore", "server_state"]


def server_state(strategy: Any) -> dict[str, Any]:
    """Everything a :class:`~flowerdro.strategies.base.FairStrategy`'s server needs to continue the run.

    The global model, the round counter, the generator's state, the node ↔ partition
    map, the failures, the latest per-client results, the history so far, the rounds in
    a row without training or evaluation and the algorithm's own state (``state``: λ,
    control variates, device models, step schedules, … whatever the strategy keeps
    between rounds).
    """
    arrays, roster = strategy.current_arrays, strategy.comm.roster.state()
    return {
        "round": strategy.round.number,
        "arrays": None if arrays is None else {k: arrays[k].numpy() for k in arrays.keys()},
        "rng": strategy.rng.bit_generator.state,
        "node_to_partition": roster["node_to_partition"],
        "partitions_seen": roster["partitions_seen"],
        "failures": list(strategy.comm.log.failures),
        "results": {p: dict(v) for p, v in strategy.results.latest.items()},
        "history": list(strategy.history),
        "failed_in_row": strategy.health.failed_in_row,
        "eval_failed_in_row": strategy.health.eval_failed_in_row,
        "refused": roster["refused"],
        "state": copy.deepcopy(getattr(strategy, "state", None)),
    }


def restore(strategy: Any, checkpoint: Mapping[str, Any]) -> ArrayRecord:
    """Put ``strategy``'s server back in the state of ``checkpoint``; returns the global model."""
    strategy.round.number = int(checkpoint["round"])
    strategy.comm.roster.restore(dict(checkpoint))
    strategy.rng.bit_generator.state = checkpoint["rng"]
    strategy.comm.log.failures = list(checkpoint["failures"])
    strategy.results.latest = {int(p): dict(v) for p, v in checkpoint["results"].items()}
    strategy.history = list(checkpoint["history"])
    strategy.health.failed_in_row = int(checkpoint["failed_in_row"])
    strategy.health.eval_failed_in_row = int(checkpoint.get("eval_failed_in_row", 0))
    if checkpoint.get("state") is not None:
        strategy.state = copy.deepcopy(checkpoint["state"])
    strategy.current_arrays = numpy_to_arrays(list(checkpoint["arrays"]), list(checkpoint["arrays"].values()))
    return strategy.current_arrays
