"""Judging the replies of a phase, and accounting for every one that fails.

:class:`Judge` is where a reply becomes valid or a :class:`Failure`. It drops a reply
that is an error (``node gone`` when the SuperLink reports the node unavailable), never
arrives (timeout), lacks ``num-examples`` or a required metric, carries a NaN/Inf metric,
or holds arrays whose keys/shapes differ from the model or are not finite; each drop is
attributed to the node the message went to and its partition, with the client's full
error text, and logged (a reason repeated in a phase is logged in full once). It learns
which partition a node serves from the ``partition-id`` of its replies (through the
:class:`~flowerdro.strategies.roster.Roster`). An error that every asked client raises
with the same text (a model that does not match, a missing route) is deterministic: the
run stops in that round with :class:`DeterministicClientError`, the error logged once
with the number of clients that raised it.

:class:`FailureLog` keeps the run's failures and the round's valid replies per phase;
:class:`RunHealth` counts the rounds in a row without a valid training reply or a valid
evaluation and stops a run that cannot go on (:class:`RunFailedError`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common import log
from flwr.common.constant import ErrorCode

from flowerdro.protocol import NUM_EXAMPLES, PARTITION_ID
from flowerdro.runs.codec import register_state
from flowerdro.strategies.arrays import check_arrays, record_bytes

if TYPE_CHECKING:
    from flowerdro.strategies.roster import Roster
    from flowerdro.strategies.transport import Traffic

__all__ = ["DeterministicClientError", "Expected", "Failure", "FailureLog", "Judge", "RunFailedError", "RunHealth",
           "failed_rounds_reason", "metrics_of", "missing_route_hint", "most_frequent_reason"]


def metrics_of(message: Message) -> MetricRecord:
    """The reply's metrics: its MetricRecord ``"metrics"``, else its only MetricRecord.

    Reads the content's entries directly (``RecordDict.metric_records`` builds a new typed
    view on every access).
    """
    content = message.content
    rec = content.get("metrics")
    if isinstance(rec, MetricRecord):
        return rec
    records = {k: v for k, v in content.items() if isinstance(v, MetricRecord)}
    if len(records) == 1:
        return next(iter(records.values()))
    raise ValueError(f"reply: expected a MetricRecord 'metrics', found {sorted(records) or 'none'}")


@register_state
@dataclass(frozen=True)
class Failure:
    """A dropped reply: round, phase, node, partition (None if never heard of), kind, full reason."""

    round: int
    phase: str
    node_id: int
    partition_id: int | None
    kind: str
    reason: str


class RunFailedError(RuntimeError):
    """A run that cannot train or evaluate: no valid reply for ``max-failed-rounds`` rounds, or an
    error every client raises alike."""


class DeterministicClientError(RunFailedError):
    """Every client asked in a phase failed with the same error (a programming error, not a fault)."""


@dataclass
class Expected:
    """What one phase of a round sent and what a valid reply to it holds.

    Attributes
    ----------
    phase : str
        ``"train"``, ``"evaluate"``, ``"query"``, … (failures are counted under it).
    messages : list of Message
        The messages sent (their destinations are the nodes that owe a reply). Empty
        when unknown (replies handed to an aggregation directly): then nobody times out.
    reference : ArrayRecord, optional
        The model whose keys and shapes every reply's arrays must have.
    array_keys : tuple of str
        The reply's ArrayRecords that must match ``reference``.
    required_metrics : tuple of str
        Metrics every reply must carry besides ``num-examples``.
    judged : bool
        The replies were accepted already (streamed, or checked by the driver before a
        wrapper saw them): :meth:`Judge.accept` then only drops error replies.
    """

    phase: str
    messages: list[Message] = field(default_factory=list)
    reference: ArrayRecord | None = None
    array_keys: tuple[str, ...] = ("arrays",)
    required_metrics: tuple[str, ...] = ()
    judged: bool = False


_NO_ROUTE = re.compile(r"No (\w+) function registered with name '(\w+)'")
_LEGACY_TYPE = re.compile(r"Invalid message type: (?:train|evaluate|query)\.\w+")


def _error_head(reason: str) -> str:
    """A client error's first line, pointing to the logged traceback when the reason carries one.

    flowerdro's client routes answer an exception with its type and message, then the
    client-side traceback (:func:`flowerdro.client_errors.describe`); the dropped reply's
    log line shows all of it once, the run's error repeats only the first line.
    """
    head, _, rest = reason.partition("\n")
    return head + (" (the client-side traceback is in the log above)" if rest else "")


def missing_route_hint(reason: str) -> str | None:
    """What to do when clients lack a message type's handler (None for another reason).

    Flower's ClientApp answers a message type it has no function for with
    "No <category> function registered with name '<action>'"; a legacy ``client_fn``
    ClientApp answers "Invalid message type: <type>" or fails on flowerdro's records with a
    ``KeyError`` on ``fitins.parameters``.
    """
    m = _NO_ROUTE.search(reason)
    if m:
        mtype = f"{m.group(1)}.{m.group(2)}" if m.group(2) != "default" else m.group(1)
        return (f"the clients do not serve message type '{mtype}': add flowerdro's handlers to your ClientApp "
                "with flowerdro.clients.add_routes(app, ...), or run flowerdro's ClientApp (see the README, "
                "'Use flowerdro in your own Flower project')")
    if "fitins.parameters" in reason or "evaluateins.parameters" in reason or _LEGACY_TYPE.search(reason):
        return ("the clients run a legacy ClientApp(client_fn), which serves neither flowerdro's message types "
                "nor its Message-API records: wrap the same client_fn as "
                "flowerdro.legacy.LegacyClientApp(client_fn, loss_fn=...) (see the README, "
                "'Use flowerdro in your own Flower project')")
    return None


def most_frequent_reason(failures: Sequence[Failure]) -> str | None:
    """The reason given most often among ``failures`` (None when there are none)."""
    if not failures:
        return None
    return Counter(f.reason for f in failures).most_common(1)[0][0]


def failed_rounds_reason(failures: Sequence[Failure], server_round: int, rounds: int) -> str:
    """The most frequent reason of the non-evaluation drops of the last ``rounds`` rounds."""
    fails = [f for f in failures if f.phase != "evaluate" and f.round > server_round - rounds]
    return most_frequent_reason(fails) or "unknown"


class FailureLog:
    """Every dropped reply of a run, and the valid replies of the current round per phase.

    Parameters
    ----------
    run_name : str
        Label in log lines.
    """

    def __init__(self, run_name: str) -> None:
        self.run_name = run_name
        self.round = 0
        self.failures: list[Failure] = []
        #: Valid replies of the current round, per phase.
        self.valid_replies: Counter[str] = Counter()
        #: (round, phase, kind, reason) of the failures whose reason was logged in full.
        self._logged: set[tuple[int, str, str, str]] = set()

    def begin_round(self, server_round: int) -> None:
        """Start counting the valid replies of ``server_round``."""
        self.round = int(server_round)
        self.valid_replies = Counter()

    def of_round(self, server_round: int | None = None) -> list[Failure]:
        """The failures of ``server_round`` (default: the current round)."""
        rnd = self.round if server_round is None else server_round
        return [f for f in self.failures if f.round == rnd]

    def record(self, phase: str, node_id: int, partition_id: int | None, kind: str, reason: str) -> None:
        """Record a dropped reply; its full reason is logged the first time it occurs in the round's phase."""
        f = Failure(self.round, phase, int(node_id), partition_id, kind, reason)
        key = (f.round, phase, kind, reason)
        if key in self._logged:
            log(WARNING, "[%s] round %d %s: dropped node %d (partition %s): %s (the same reason as above)",
                self.run_name, f.round, phase, node_id, partition_id, kind)
        else:
            self._logged.add(key)
            log(WARNING, "[%s] round %d %s: dropped node %d (partition %s): %s: %s",
                self.run_name, f.round, phase, node_id, partition_id, kind, reason)
        self.failures.append(f)

    def retract(self, phase: str, node_id: int, partition_id: int | None, kind: str, reason: str) -> None:
        """A reply counted valid turned out not to be (an algorithm's or a privacy check's own test): a failure."""
        self.record(phase, node_id, partition_id, kind, reason)
        self.valid_replies[phase] -= 1

    def no_train_reply(self) -> bool:
        """Whether this round brought no valid training reply although its exchanges failed.

        Any phase but evaluation counts: when a query that comes first fails everywhere
        (DRFA's loss query, SCAFF-PD's loss/gradient), no training message is sent at all.
        """
        fails = [f for f in self.of_round() if f.phase != "evaluate"]
        return bool(fails) and self.valid_replies.get("train", 0) == 0

    def summarise(self, phase: str, failures: Sequence[Failure], *, asked: int, valid: int) -> None:
        """Log once how many clients gave each repeated error; stop the run on an error every client gives."""
        if not failures:
            return
        by_reason = Counter((f.kind, f.reason) for f in failures)
        everyone = valid == 0 and asked >= 2 and len(failures) == asked and len(by_reason) == 1
        for (kind, reason), n in by_reason.items():
            if everyone and kind == "error":
                break  # the error below says it
            if n > 1:
                parts = sorted({f.partition_id for f in failures if (f.kind, f.reason) == (kind, reason)},
                               key=lambda p: (p is None, p or 0))
                log(WARNING, "[%s] round %d %s: the same %s on %d clients (partitions %s)", self.run_name,
                    self.round, phase, kind, n, ", ".join(str(p) for p in parts))
        if everyone:
            (kind, reason), = by_reason
            if kind == "error":
                hint = missing_route_hint(reason)
                raise DeterministicClientError(
                    f"[{self.run_name}] round {self.round} {phase}: all {asked} clients failed with the same error, "
                    f"so every round would: {_error_head(reason)}" + (f"\n=> {hint}" if hint else ""))


class Judge:
    """The valid replies of a phase, in message order; every other outcome a :class:`Failure`.

    Parameters
    ----------
    roster : Roster
        Learns each replying node's partition; names a failure's partition.
    traffic : Traffic
        Counts the bytes of the replies received.
    failures : FailureLog
        Where the drops go.
    """

    def __init__(self, roster: Roster, traffic: Traffic, failures: FailureLog) -> None:
        self.roster, self.traffic, self.log = roster, traffic, failures

    def accept(self, expected: Expected, replies: Iterable[Message], timeout: float) -> list[Message]:
        """The valid replies of one phase, in the order of its messages.

        An error reply, a reply that fails the checks of ``expected`` (see :meth:`check`)
        and a message without a reply (``timeout``: none within ``timeout`` seconds) each
        become a :class:`Failure` of ``expected.phase``. The replies of an ``expected``
        already judged pass with only error replies dropped. Raises
        :class:`DeterministicClientError` when at least two clients were asked and every
        one of them answered with the same error.
        """
        replies = list(replies)
        if expected.judged:
            return [r for r in replies if not r.has_error()]
        expected.judged = True
        messages = expected.messages
        # the node a reply answers for is its message's destination: an error the SuperLink
        # makes for an unavailable node comes from the SuperLink's own node id
        sent_to = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in messages if m.metadata.message_id}

        def node_of(reply: Message) -> int:
            return sent_to.get(reply.metadata.reply_to_message_id, int(reply.metadata.src_node_id))

        before = len(self.log.failures)
        valid, answered = [], set()
        for reply in replies:
            nid = node_of(reply)
            answered.add(nid)
            if self.accept_one(reply, nid, expected):
                valid.append(reply)
        self.timeouts(expected.phase, [int(m.metadata.dst_node_id) for m in messages
                                       if int(m.metadata.dst_node_id) not in answered], timeout)
        position = {int(m.metadata.dst_node_id): i for i, m in enumerate(messages)}
        valid.sort(key=lambda r: position.get(node_of(r), len(position)))
        self.log.summarise(expected.phase, self.log.failures[before:], asked=len(messages) or len(replies),
                           valid=len(valid))
        return valid

    def accept_one(self, reply: Message, node_id: int, expected: Expected) -> bool:
        """Whether one reply of node ``node_id`` is valid (a failure of ``expected.phase`` when not)."""
        if reply.has_error():
            gone = int(reply.error.code) == ErrorCode.NODE_UNAVAILABLE
            self.fail(expected.phase, node_id, "node gone" if gone else "error", str(reply.error.reason))
            return False
        self.traffic.bytes_received += record_bytes(reply.content)
        why = self.check(reply, node_id, expected)
        if why is not None:
            self.fail(expected.phase, node_id, *why)
            return False
        self.log.valid_replies[expected.phase] += 1
        return True

    def check(self, reply: Message, node_id: int, expected: Expected) -> tuple[str, str] | None:
        """(kind, reason) of what is wrong with a reply that is not an error, or None; learns its partition."""
        content = reply.content
        if not any(isinstance(v, MetricRecord) for v in content.values()):
            return "bad-metrics", "reply has no MetricRecord"
        try:
            metrics = metrics_of(reply)
        except ValueError as exc:
            return "bad-metrics", str(exc)
        for key in (NUM_EXAMPLES, *expected.required_metrics):
            if key not in metrics:
                return "bad-metrics", (f"metric '{key}' missing (the reply has {', '.join(sorted(metrics.keys()))}; "
                                       "an evaluate reply's names are set by accuracy-metric / loss-metric)")
        for key, value in metrics.items():
            vals = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in vals):
                return "nonfinite", f"metric '{key}' is {value}"
        pid = metrics.get(PARTITION_ID)
        self.roster.learn(node_id, int(pid) if pid is not None else node_id)
        if expected.reference is not None:
            for key in expected.array_keys:
                rec = content.get(key)
                if not isinstance(rec, ArrayRecord):
                    return "bad-arrays", f"ArrayRecord '{key}' missing"
                why = check_arrays(expected.reference, rec)
                if why is not None:
                    return ("nonfinite" if "NaN" in why else "bad-arrays"), why
        return None

    def timeouts(self, phase: str, node_ids: Iterable[int], timeout: float) -> None:
        """Each of ``node_ids`` owed a reply of ``phase`` and sent none within ``timeout`` seconds."""
        for nid in dict.fromkeys(node_ids):
            self.fail(phase, nid, "timeout", f"no reply within {timeout:g} s")

    def fail(self, phase: str, node_id: int, kind: str, reason: str) -> None:
        """Record a dropped reply of node ``node_id`` under its partition."""
        self.log.record(phase, node_id, self.roster.partition(node_id), kind, reason)

    def retract(self, phase: str, node_id: int, kind: str, reason: str) -> None:
        """A reply judged valid is dropped after all (see :meth:`FailureLog.retract`)."""
        self.log.retract(phase, node_id, self.roster.partition(node_id), kind, reason)


class RunHealth:
    """Rounds in a row without a valid training reply, or without a valid evaluation; the run stops at the limit.

    Parameters
    ----------
    run_name : str
        Label in the error.
    limit : int
        ``max-failed-rounds``.
    """

    def __init__(self, run_name: str, limit: int) -> None:
        self.run_name, self.limit = run_name, int(limit)
        self.failed_in_row = 0
        self.eval_failed_in_row = 0

    def after_round(self, *, trained: bool, evaluated: bool, valid_evaluations: int) -> None:
        """Count the round: no valid training reply (``trained`` False), an evaluation without a valid reply."""
        self.failed_in_row = 0 if trained else self.failed_in_row + 1
        if evaluated:
            self.eval_failed_in_row = 0 if valid_evaluations else self.eval_failed_in_row + 1

    def check(self, server_round: int, failures: Sequence[Failure]) -> None:
        """Raise :class:`RunFailedError` after ``max-failed-rounds`` rounds without training or evaluation."""
        if self.failed_in_row >= self.limit:
            reason = failed_rounds_reason(failures, server_round, self.failed_in_row)
            hint = missing_route_hint(reason)
            raise RunFailedError(
                f"[{self.run_name}] no valid training reply in {self.failed_in_row} rounds in a row "
                f"(max-failed-rounds = {self.limit}); most frequent reason: {reason}"
                + (f"\n=> {hint}" if hint else ""))
        if self.eval_failed_in_row >= self.limit:
            fails = [f for f in failures if f.phase == "evaluate" and f.round > server_round - self.eval_failed_in_row]
            reason = most_frequent_reason(fails) or "unknown"
            hint = missing_route_hint(reason)
            raise RunFailedError(
                f"[{self.run_name}] no client evaluation succeeded in {self.eval_failed_in_row} evaluated rounds in "
                f"a row (max-failed-rounds = {self.limit}), so the run has no fairness number; most frequent "
                f"reason: {reason}" + (f"\n=> {hint}" if hint else ""))
