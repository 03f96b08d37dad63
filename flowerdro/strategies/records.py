"""Per-client evaluation results and the fairness numbers of a round.

Every evaluate reply is kept per partition (not averaged away). The round's fairness
numbers (:func:`flowerdro.core.fairness.summarize`: mean, worst, worst-10%, worst-20%,
best-20%, std) say over how many clients they were computed (``acc_n``), and the round
record lists the partitions that were expected but did not report, with the reason:
``timeout``, ``error``, an invalid reply, or ``node gone`` (a partition seen before whose
node is no longer connected).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Message, MetricRecord

from flowerdro.core.fairness import summarize
from flowerdro.protocol import IDENTIFIER_METRICS, NUM_EXAMPLES, PARTITION_ID, USER_TRAIN_FN
from flowerdro.strategies.replies import Failure, metrics_of

if TYPE_CHECKING:
    from flwr.serverapp import Grid

    from flowerdro.strategies.messaging import Communicator

__all__ = ["ClientResults", "DataSizes", "RoundRecorder", "mean_of_metric_records", "missing_partitions", "round_line",
           "round_record"]


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
    expected: Iterable[int], reported: Iterable[int], failures: Iterable[Failure], gone: Iterable[int] = (),
    late: Iterable[int] = ()
) -> dict[str, str]:
    """Partition id (as a string) → why it did not report: the failure's kind, ``node gone`` or ``joined late``.

    ``expected`` are the partitions the evaluation asked for, plus, when every client was
    meant to evaluate, every partition known to the run: ``gone`` ones (no connected node
    serves them) and ``late`` ones (their node came back after the round's evaluate
    messages were sent).
    """
    reasons: dict[int, str] = {int(p): "node gone" for p in gone}
    reasons.update({int(p): "joined late" for p in late})
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
    keys -= set(IDENTIFIER_METRICS)
    w = np.array([float(m[NUM_EXAMPLES]) for m in mrs])
    out: dict[str, float] = {}
    for k in sorted(keys):
        if k == NUM_EXAMPLES:
            out[k] = float(w.sum())
        else:
            out[k] = float(np.dot(w, [float(m[k]) for m in mrs]) / max(w.sum(), 1e-12))
    return MetricRecord(out)


def round_record(run_name: str, rnd: int, seconds: float, *, bytes_sent: int, bytes_received: int,
                 failures: Iterable[Failure], train_metrics: MetricRecord | None, eval_metrics: MetricRecord | None,
                 client_values: Mapping[str, Mapping[int, float]], missing: Mapping[str, str] | None,
                 refused: Mapping[int, str], extras: Mapping[str, Any]) -> dict[str, Any]:
    """The round's record (one line of ``rounds.jsonl``).

    ``round``, ``time_s``, the bytes so far, the round's ``failures`` by ``phase:kind``, the
    aggregated ``train`` metrics, the fairness numbers of the evaluation with the clients'
    accuracies (``client_values["acc"]``, or their test losses ``client_values["loss"]``
    on a regression task) by partition, the ``missing`` partitions with their reasons, the
    ``refused`` nodes, then the strategy's ``extras`` (:meth:`round_extras`).
    """
    rec: dict[str, Any] = {
        "strategy": run_name, "round": rnd, "time_s": round(seconds, 4),
        "bytes_sent": bytes_sent, "bytes_received": bytes_received,
        "failures": dict(Counter(f"{f.phase}:{f.kind}" for f in failures)),
    }
    if train_metrics is not None:
        rec["train"] = {k: v for k, v in train_metrics.items() if isinstance(v, int | float) and k != PARTITION_ID}
    if eval_metrics is not None:
        rec.update({k: v for k, v in eval_metrics.items() if isinstance(v, int | float)})
        acc = client_values["acc"]
        if acc:
            rec["client_acc"] = {str(p): round(v, 6) for p, v in sorted(acc.items())}
        else:  # regression: per-client test loss instead
            rec["client_loss"] = {str(p): v for p, v in sorted(client_values["loss"].items())}
    if missing is not None:
        rec["missing"] = dict(missing)
    if refused:
        rec["refused"] = {str(n): reason for n, reason in sorted(refused.items())}
    rec.update(extras)
    return rec


class RoundRecorder:
    """A round's record from what the round's collaborators saw: traffic, failures, results, who is missing.

    Parameters
    ----------
    run_name : str
        The record's ``strategy``.
    comm : Communicator
        The round's traffic, failures and roster.
    results : ClientResults
        The clients' latest evaluation.
    """

    def __init__(self, run_name: str, comm: Communicator, results: ClientResults) -> None:
        self.run_name, self.comm, self.results = run_name, comm, results

    def record(self, rnd: int, seconds: float, train_metrics: MetricRecord | None,
               eval_metrics: MetricRecord | None, missing: Mapping[str, str] | None,
               extras: Mapping[str, Any]) -> dict[str, Any]:
        """The round's record (:func:`round_record`)."""
        traffic, roster = self.comm.transport.traffic, self.comm.roster
        return round_record(
            self.run_name, rnd, seconds, bytes_sent=traffic.bytes_sent, bytes_received=traffic.bytes_received,
            failures=self.comm.log.of_round(), train_metrics=train_metrics, eval_metrics=eval_metrics,
            client_values={"acc": self.results.values(self.results.accuracy_metric),
                           "loss": self.results.values(self.results.loss_metric)},
            missing=missing, refused={n: r for n, (_, _, r) in roster.refused.items()}, extras=extras)

    def missing(self, grid: Grid, asked: Iterable[Message], valid: Iterable[Message],
                everyone: Callable[[int], bool]) -> dict[str, str]:
        """Partition → why it did not report this round's evaluation (see :func:`missing_partitions`).

        When every client was meant to evaluate (``everyone(number of connected nodes)``),
        every partition known to the run is accounted for: one whose node has left is
        ``node gone``, one whose node came back after the evaluate messages were sent is
        ``joined late``.
        """
        roster = self.comm.roster
        asked_parts = {roster.partition(int(m.metadata.dst_node_id)) for m in asked}
        nodes = [int(n) for n in grid.get_node_ids()]
        roster.roll_call(grid, nodes, self.comm.transport.timeout)  # a node back during the round says its partition
        nodes = [n for n in nodes if n not in roster.refused]
        connected = set(roster.nodes_of(nodes))
        full = everyone(len(nodes))
        known = roster.partitions_seen | set(roster.node_to_partition.values())
        gone = sorted(known - connected) if full else []
        late = sorted((known & connected) - asked_parts) if full else []
        reported = [roster.partition(int(r.metadata.src_node_id)) for r in valid]
        fails = [f for f in self.comm.log.of_round() if f.phase == "evaluate"]
        return missing_partitions([p for p in asked_parts if p is not None], [p for p in reported if p is not None],
                                  fails, gone, late)


def round_line(rec: Mapping[str, Any], num_rounds: int) -> str:
    """The round's log line: fairness numbers, time, traffic, drops and missing clients."""
    parts = [f"[{rec['strategy']}] round {rec['round']}/{num_rounds}"]
    if "acc_mean" in rec:
        parts.append(f"acc mean {rec['acc_mean']:.4f} worst {rec['acc_worst']:.4f} "
                     f"w20 {rec['acc_worst20']:.4f} std {rec['acc_std']:.4f}"
                     + (f" | loss {rec['loss_mean']:.4f}" if "loss_mean" in rec else ""))
    elif "loss_mean" in rec:
        parts.append(f"loss mean {rec['loss_mean']:.6g} worst {rec['loss_worst']:.6g}")
    parts.append(f"{rec['time_s']:.2f}s sent {rec['bytes_sent'] / 1e6:.2f}MB recv {rec['bytes_received'] / 1e6:.2f}MB")
    if rec["failures"]:
        parts.append(f"dropped {sum(rec['failures'].values())}")
    if rec.get("missing"):
        parts.append(f"missing {len(rec['missing'])}")
    return " | ".join(parts)


class DataSizes:
    """Each partition's ``num-examples`` in its latest training and evaluation replies (its data's sizes)."""

    def __init__(self) -> None:
        #: Phase (``"train"``, ``"evaluate"``) → partition → ``num-examples``.
        self.by_phase: dict[str, dict[int, int]] = {"train": {}, "evaluate": {}}
        #: Whether a client reported training with its own ``train_fn`` (the kit's user loop).
        self.user_train_fn = False
        self._logged = False

    def note(self, phase: str, valid: Iterable[Message], partition_of: Callable[[int], int | None]) -> None:
        """Remember each partition's ``num-examples`` of a training or evaluate phase."""
        sizes = self.by_phase.get(phase)
        if sizes is None:
            return
        for r in valid:
            mr = metrics_of(r)
            pid = partition_of(int(r.metadata.src_node_id))
            if pid is not None and NUM_EXAMPLES in mr:
                sizes[pid] = int(mr[NUM_EXAMPLES])
            if mr.get(USER_TRAIN_FN):
                self.user_train_fn = True

    def line_once(self, batch_size: int | None) -> str | None:
        """:meth:`line`, the first time it has something to say; None after that."""
        if self._logged or (line := self.line(batch_size)) is None:
            return None
        self._logged = True
        return line

    def line(self, batch_size: int | None) -> str | None:
        """The data the clients hold, once both phases have reported: train/test examples (min, median, max).

        Read from the ``num-examples`` of the training and evaluate replies by partition,
        so a data function that hands a client almost nothing is visible in the first
        round's log. Also says when the clients trained with their own ``train_fn`` (then
        the settings' local steps and batch size are only what that function is told). None
        until a training reply has arrived.
        """
        train, test = self.by_phase["train"], self.by_phase["evaluate"]
        if not train:
            return None

        def spread(sizes: Mapping[int, int]) -> str:
            v = np.array(sorted(sizes.values()))
            return f"min {int(v[0])}, median {float(np.median(v)):g}, max {int(v[-1])} over {len(v)} partitions"

        parts = [f"data: train examples {spread(train)}"]
        if test:
            parts.append(f"test examples {spread(test)}")
        line = "; ".join(parts)
        small = sorted(p for p, n in train.items() if batch_size is not None and n < batch_size)
        if small:
            line += (f". Partitions {small[:10]}{' …' if len(small) > 10 else ''} hold fewer training examples than "
                     f"one batch ({batch_size}): check the data function")
        if self.user_train_fn:
            line += (". Local training: the clients' own training function (a ClientKit's train_fn, a NumPyClient's "
                     "fit), which is handed lr, local-epochs, local-steps and batch-size (TrainArgs, or the fit config) "
                     "and may use values of its own instead")
        return line
