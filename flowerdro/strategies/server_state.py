"""What a strategy's server holds between rounds: the checkpoint's content, taken and put back.

:func:`server_state` gathers everything the server needs to continue a run after the
current round into one plain dict (the file format is :mod:`flowerdro.runs.checkpoint`);
:func:`restore` puts a strategy back into the state such a dict describes, so the rounds
that follow are those of an uninterrupted run.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord

from flowerdro.strategies.arrays import numpy_to_arrays

__all__ = ["ServerState"]


class ServerState:
    """Checkpoint and restore of a :class:`~flowerdro.strategies.base.FairStrategy`'s server.

    Uses the strategy's ``current_arrays``, ``rng``, ``comm`` (node ↔ partition map,
    failures), ``results``, ``history`` and the algorithm's own ``state``.
    """

    current_arrays: ArrayRecord | None
    _round: int

    def server_state(self) -> dict[str, Any]:
        """Everything the server needs to continue the run after the current round.

        The global model, the round counter, the generator's state, the node ↔ partition
        map, the failures, the latest per-client results, the history so far and the
        algorithm's own state (``self.state``: λ, control variates, device models, step
        schedules, … whatever the strategy keeps between rounds).
        """
        arrays = self.current_arrays
        return {
            "round": self._round,
            "arrays": None if arrays is None else {k: arrays[k].numpy() for k in arrays.keys()},
            "rng": self.rng.bit_generator.state,
            "node_to_partition": dict(self.comm.node_to_partition),
            "partitions_seen": sorted(self.comm.partitions_seen),
            "failures": list(self.comm.failures),
            "results": {p: dict(v) for p, v in self.results.latest.items()},
            "history": list(self.history),
            "failed_in_row": getattr(self, "_failed_in_row", 0),
            "eval_failed_in_row": getattr(self, "_eval_failed_in_row", 0),
            "refused": {str(n): [p, h, r] for n, (p, h, r) in self.comm.refused.items()},
            "state": copy.deepcopy(getattr(self, "state", None)),
        }

    def restore(self, checkpoint: Mapping[str, Any]) -> ArrayRecord:
        """Put the server back in the state of ``checkpoint``; returns the global model."""
        self._round = int(checkpoint["round"])
        self.comm.refused.update({int(n): (p, h, r) for n, (p, h, r) in checkpoint.get("refused", {}).items()})
        self.rng.bit_generator.state = checkpoint["rng"]
        # what the nodes connected now said of themselves wins over the checkpoint's map
        self.comm.node_to_partition = {**dict(checkpoint["node_to_partition"]), **self.comm.node_to_partition}
        self.comm.partitions_seen = set(checkpoint["partitions_seen"])
        self.comm.failures = list(checkpoint["failures"])
        self.results.latest = {int(p): dict(v) for p, v in checkpoint["results"].items()}
        self.history = list(checkpoint["history"])
        if checkpoint.get("state") is not None:
            self.state = copy.deepcopy(checkpoint["state"])
        self.current_arrays = numpy_to_arrays(list(checkpoint["arrays"]), list(checkpoint["arrays"].values()))
        return self.current_arrays
