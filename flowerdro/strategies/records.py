"""Per-client evaluation results and the fairness numbers of a round.

Every evaluate reply is kept per partition (not averaged away). The round's fairness
numbers (:func:`flowerdro.core.fairness.summarize`: mean, worst, worst-10%, worst-20%,
best-20%, std) say over how many clients they were computed (``acc_n``), and the round
record lists the partitions that were expected but did not report, with the reason:
``timeout``, ``error``, an invalid reply, or ``node gone`` (a partition seen before whose
node is no longer connected).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import Message, MetricRecord

from flowerdro.core.fairness import summarize
from flowerdro.protocol import NUM_EXAMPLES, PARTITION_ID
from flowerdro.strategies.messaging import Failure, metrics_of

__all__ = ["ClientResults", "mean_of_metric_records", "missing_partitions"]


class ClientResults:
    """The latest evaluation of every client and its fairness summary.

    Parameters
    ----------
    accuracy_metric : str (default: "test_acc")
        The metric holding a client's test accuracy.
    loss_metric : str (default: "test_loss")
        The metric holding a client's test loss.
    """

    def __init__(self, accuracy_metric: str = "test_acc", loss_metric: str = "test_loss") -> None:
        self.accuracy_metric = accuracy_metric
        self.loss_metric = loss_metric
        #: Partition id → that client's numeric metrics of the latest evaluation.
        self.latest: dict[int, dict[str, float]] = {}

    def update(self, replies: Iterable[Message], partition_of: Mapping[int, int]) -> MetricRecord | None:
        """Keep each reply's metrics under its partition and summarise them (None without replies).

        ``partition_of`` maps a node id to its partition (the communicator's map, which
        already holds the reply's ``partition-id`` or the node-id fallback).
        """
        per_client: dict[int, dict[str, float]] = {}
        for m in replies:
            mr = metrics_of(m)
            nid = int(m.metadata.src_node_id)
            pid = int(mr[PARTITION_ID]) if PARTITION_ID in mr else partition_of.get(nid, nid)
            per_client[pid] = {k: float(v) for k, v in mr.items() if isinstance(v, int | float)}
        if not per_client:
            return None
        self.latest = per_client
        acc = self.values(self.accuracy_metric)
        loss = self.values(self.loss_metric)
        out: dict[str, float] = {}
        if acc:
            out.update({f"acc_{k}": v for k, v in summarize(acc).items()})
            w = np.array([per_client[p].get(NUM_EXAMPLES, 1.0) for p in acc], dtype=float)
            out["acc_weighted"] = float(np.dot(w, list(acc.values())) / max(w.sum(), 1.0))
        if loss:
            s = summarize(loss, higher_is_better=False)
            out.update({"loss_mean": s["mean"], "loss_worst": s["worst"], "loss_n": s["n"]})
        return MetricRecord(out)

    def values(self, metric: str) -> dict[int, float]:
        """Partition id → ``metric`` of the latest evaluation (clients that reported it, in reply order)."""
        return {p: v[metric] for p, v in self.latest.items() if metric in v}


def missing_partitions(
    expected: Iterable[int], reported: Iterable[int], failures: Iterable[Failure], gone: Iterable[int] = ()
) -> dict[str, str]:
    """Partition id (as a string) → why it did not report: the failure's kind, or ``node gone``.

    ``expected`` are the partitions the evaluation asked for (plus, with full evaluation,
    the ``gone`` ones: seen before, no longer connected).
    """
    reasons: dict[int, str] = {int(p): "node gone" for p in gone}
    for f in failures:
        if f.partition_id is not None:
            reasons[int(f.partition_id)] = f.kind
    got = {int(p) for p in reported}
    out = {}
    for p in sorted({int(x) for x in expected} | set(reasons)):
        if p not in got:
            out[str(p)] = reasons.get(p, "no reply")
    return out


def mean_of_metric_records(mrs: list[MetricRecord]) -> MetricRecord:
    """Σ_i n_i v_i / Σ_i n_i for each scalar metric v that every record holds (n_i = ``num-examples``).

    Metrics that only some clients report are left out rather than failing the round.
    """
    if not mrs:
        return MetricRecord({})
    keys = set.intersection(*(set(k for k, v in m.items() if isinstance(v, int | float)) for m in mrs))
    keys -= {PARTITION_ID}
    w = np.array([float(m[NUM_EXAMPLES]) for m in mrs])
    out: dict[str, float] = {}
    for k in sorted(keys):
        if k == NUM_EXAMPLES:
            out[k] = float(w.sum())
        else:
            out[k] = float(np.dot(w, [float(m[k]) for m in mrs]) / max(w.sum(), 1e-12))
    return MetricRecord(out)
