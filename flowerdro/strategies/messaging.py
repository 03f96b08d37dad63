"""Talking to the clients: send, wait, validate replies, count failures and bytes.

:class:`Communicator` is the one place where a strategy's messages leave and its replies
come back. It drops a reply that is an error (``node gone`` when the SuperLink reports
the node unavailable), never arrives (timeout), lacks ``num-examples`` or a required
metric, carries a NaN/Inf metric, or holds arrays whose keys/shapes differ from the
model or are not finite; each drop becomes a :class:`Failure` attributed to the node the
message went to and its partition, with the client's full error text. It learns which
partition each node serves from the ``partition-id`` of the replies (a reply without one
stands for the partition named by its node id, so a client that does not know its
partition still gets a stable identity), and a partition that reappears on another node
(a restarted SuperNode) moves to that node.

Transport and validation are separate steps, so that whoever drives a strategy (its own
:meth:`~flowerdro.strategies.base.FairStrategy.start`, Flower's ``Strategy.start``, a
DP wrapper, a user's loop) gets the same checks: :meth:`Communicator.exchange` pushes
messages and pulls the raw replies; :meth:`Communicator.accept` judges the replies of one
phase against what it sent (an :class:`Expected`): errors, timeouts and invalid replies
become failures, the valid replies come back in message order. An error that every asked
client raises with the same text (a model that does not match, a missing route) is
deterministic: the run stops in that round with :class:`DeterministicClientError`, the
error logged once with the number of clients that raised it.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from flowerdro.deploy.grid import pull_replies
from flowerdro.protocol import CLIENT_RECORD, NUM_EXAMPLES, PARTITION_ID
from flowerdro.runs.codec import register_state
from flowerdro.strategies.arrays import check_arrays, record_bytes
from flowerdro.validation import roll_call_problem

__all__ = ["Communicator", "DeterministicClientError", "Expected", "Failure", "RunFailedError", "metrics_of",
           "initial_arrays", "missing_route_hint"]


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
        wrapper saw them): :meth:`Communicator.accept` then only drops error replies.
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
    client-side traceback (:func:`flowerdro.clients.errors.describe`); the dropped reply's
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


class Communicator:
    """Messages out, valid replies back; failures, bytes and the node ↔ partition map.

    Parameters
    ----------
    run_name : str
        Label in log lines.
    timeout : float (default: 3600.0)
        Seconds to wait for the replies of one exchange.
    pull_interval : float (default: 0.05)
        Seconds :meth:`stream` sleeps after a pull that brought nothing.
    reply_poll : float (default: 0.01)
        Seconds :meth:`send` waits between two pulls of the replies (Flower's own
        ``send_and_receive`` waits 0.1 s in a simulation and 3 s in a deployment, which a
        round pays about half of per message phase after the last reply has arrived).
    reply_poll_max : float (default: 0.05)
        The longest wait between two pulls: it doubles from ``reply_poll`` after each pull
        that brought nothing, so outstanding replies are asked for at most 20 times a second
        through a long round, and a reply waits at most 0.05 s to be seen.
    """

    def __init__(self, run_name: str, *, timeout: float = 3600.0, pull_interval: float = 0.05,
                 reply_poll: float = 0.01, reply_poll_max: float = 0.05) -> None:
        self.run_name = run_name
        self.timeout = float(timeout)
        self.pull_interval = float(pull_interval)
        self.reply_poll = float(reply_poll)
        self.reply_poll_max = float(reply_poll_max)
        self.node_to_partition: dict[int, int] = {}
        #: Nodes already asked their partition by :meth:`roll_call`.
        self.asked: set[int] = set()
        self.failures: list[Failure] = []
        self.round = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        #: Valid replies of the current round, per phase.
        self.valid_replies: Counter[str] = Counter()
        #: Every partition heard from in this run.
        self.partitions_seen: set[int] = set()
        #: Node id → (partition it claims, the node that holds that partition, reason) of refused nodes.
        self.refused: dict[int, tuple[int | None, int | None, str]] = {}
        #: Node id → what its ``query.init`` reply said of the client (e.g. ``{"mods": [...]}``).
        self.client_info: dict[int, dict] = {}
        #: The run config whose data keys a node's ``num-partitions`` must suit at the roll call
        #: (:func:`flowerdro.validation.roll_call_problem`; set by flowerdro's comparison driver).
        self.run_config: Mapping[str, Any] | None = None
        #: (round, phase, kind, reason) of the failures whose reason was logged in full.
        self._logged: set[tuple[int, str, str, str]] = set()

    # ------------------------------------------------------------------ bookkeeping
    def begin_round(self, server_round: int) -> None:
        """Start counting bytes for ``server_round``."""
        self.round, self.bytes_sent, self.bytes_received = int(server_round), 0, 0
        self.valid_replies = Counter()

    def failures_of_round(self, server_round: int | None = None) -> list[Failure]:
        """The failures of ``server_round`` (default: the current round)."""
        rnd = self.round if server_round is None else server_round
        return [f for f in self.failures if f.round == rnd]

    def partition(self, node_id: int) -> int | None:
        """Partition id of a node, once one of its replies has told us."""
        return self.node_to_partition.get(int(node_id))

    def nodes_of(self, node_ids: Iterable[int]) -> dict[int, int]:
        """Partition id → node id for the given (connected) nodes whose partition is known."""
        return {self.node_to_partition[n]: n for n in (int(x) for x in node_ids) if n in self.node_to_partition}

    def learn(self, node_id: int, partition_id: int) -> None:
        """Record that ``node_id`` serves ``partition_id`` (a partition lives on one node at a time)."""
        node_id, partition_id = int(node_id), int(partition_id)
        self.partitions_seen.add(partition_id)
        if self.node_to_partition.get(node_id) == partition_id:
            return
        for old in [n for n, p in self.node_to_partition.items() if p == partition_id and n != node_id]:
            del self.node_to_partition[old]
            log(WARNING, "[%s] partition %d moved from node %d to node %d", self.run_name, partition_id, old, node_id)
        self.node_to_partition[node_id] = partition_id

    @staticmethod
    def build_messages(
        node_ids: Iterable[int], content: RecordDict | Callable[[int], RecordDict], message_type: str
    ) -> list[Message]:
        """One message per node; ``content`` may be a function node id → RecordDict."""
        out = []
        for nid in node_ids:
            rec = content(nid) if callable(content) else content
            out.append(Message(content=rec, dst_node_id=int(nid), message_type=message_type))
        return out

    # ------------------------------------------------------------------ exchanges
    def send(
        self,
        grid: Grid,
        messages: Sequence[Message],
        *,
        phase: str,
        reference: ArrayRecord | None = None,
        array_keys: Sequence[str] = ("arrays",),
        required_metrics: Sequence[str] = (),
    ) -> list[Message]:
        """Send ``messages``, wait for the replies, and return the valid ones in message order.

        :meth:`exchange` then :meth:`accept`. Returning the replies in the order of
        ``messages`` (not of arrival) makes every aggregation sum in the same order on
        every run.
        """
        expected = Expected(phase, list(messages), reference, tuple(array_keys), tuple(required_metrics))
        return self.accept(expected, self.exchange(grid, expected.messages))

    def exchange(self, grid: Grid, messages: Sequence[Message]) -> list[Message]:
        """Push ``messages`` and pull their replies (errors included) until all came or the timeout passed."""
        messages = list(messages)
        if not messages:
            return []
        self.bytes_sent += sum(record_bytes(m.content) for m in messages)
        return self._send_and_receive(grid, messages, self.timeout)

    def accept(self, expected: Expected, replies: Iterable[Message]) -> list[Message]:
        """The valid replies of one phase, in the order of its messages; every other outcome a failure.

        An error reply, a reply that fails the checks of ``expected`` (see
        :meth:`_validate`) and a message without a reply (``timeout``) each become a
        :class:`Failure` of ``expected.phase``. The replies of an ``expected`` already
        judged pass with only error replies dropped. Raises
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

        before = len(self.failures)
        valid, answered = [], set()
        for reply in replies:
            nid = node_of(reply)
            answered.add(nid)
            if self._accept(reply, nid, expected.phase, expected.reference, expected.array_keys,
                            expected.required_metrics):
                valid.append(reply)
        self._timeouts(expected.phase, [int(m.metadata.dst_node_id) for m in messages
                                        if int(m.metadata.dst_node_id) not in answered])
        position = {int(m.metadata.dst_node_id): i for i, m in enumerate(messages)}
        valid.sort(key=lambda r: position.get(node_of(r), len(position)))
        self._summarise(expected.phase, self.failures[before:], asked=len(messages) or len(replies), valid=len(valid))
        return valid

    def _summarise(self, phase: str, failures: Sequence[Failure], *, asked: int, valid: int) -> None:
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

    def _send_and_receive(self, grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
        """Push ``messages`` once and pull their replies until all have come or ``timeout`` s have passed.

        Flower's ``Grid.send_and_receive`` does the same with a fixed wait between pulls
        (0.1 s in a simulation, 3 s in a deployment); here a pull comes :attr:`reply_poll`
        seconds after one that brought replies, and the wait doubles after each pull that
        brought nothing, up to :attr:`reply_poll_max` (:func:`~flowerdro.deploy.grid.pull_replies`). A grid with its own
        ``clock()`` (the in-process grid, whose time is simulated) or whose
        ``push_messages`` raises ``NotImplementedError`` answers through its own
        ``send_and_receive``.
        """
        if hasattr(grid, "clock"):
            return list(grid.send_and_receive(messages, timeout=timeout))
        try:
            pending = {str(i) for i in grid.push_messages(messages) if i}
        except NotImplementedError:
            return list(grid.send_and_receive(messages, timeout=timeout))
        return pull_replies(grid, pending, timeout, interval=self.reply_poll, max_interval=self.reply_poll_max)

    def stream(
        self,
        grid: Grid,
        messages: Sequence[Message],
        on_replies: Callable[[list[Message]], None],
        *,
        phase: str,
        reference: ArrayRecord | None = None,
        array_keys: Sequence[str] = ("arrays",),
        required_metrics: Sequence[str] = (),
    ) -> list[Message]:
        """Like :meth:`send`, but hand each pull's valid replies to ``on_replies`` as they arrive.

        The messages are pushed once; the outstanding ones are pulled until all have
        answered or the timeout has passed (sleeping ``pull_interval`` after an empty
        pull). A reply that arrives after the deadline is not accepted: its node counts as
        a timeout. The time ``on_replies`` takes counts against the timeout. A grid with
        its own ``clock()`` and ``sleep(seconds)`` (the in-process grid's simulated clock)
        is timed by them, any other by wall time. A grid whose ``push_messages`` raises
        ``NotImplementedError`` is served by one :meth:`send`. Returns every valid reply
        in arrival order.
        """
        messages = list(messages)
        if not messages:
            return []
        before = len(self.failures)
        try:
            ids = list(grid.push_messages(messages))
        except NotImplementedError:
            valid = self.send(grid, messages, phase=phase, reference=reference, array_keys=array_keys,
                              required_metrics=required_metrics)
            if valid:
                on_replies(valid)
            return valid
        self.bytes_sent += sum(record_bytes(m.content) for m in messages)
        if len(ids) == len(messages):  # Flower keeps the order and puts None where a push failed
            pairs = list(zip(ids, messages, strict=True))
        else:
            pushed = {str(i) for i in ids if i}
            pairs = [(m.metadata.message_id if m.metadata.message_id in pushed else None, m) for m in messages]
        pending: dict[str, int] = {}
        for mid, msg in pairs:
            if mid:
                pending[str(mid)] = int(msg.metadata.dst_node_id)
            else:
                self._fail(phase, int(msg.metadata.dst_node_id), "error", "the grid could not push the message")
        valid: list[Message] = []
        clock, sleep = getattr(grid, "clock", time.monotonic), getattr(grid, "sleep", time.sleep)
        deadline = clock() + self.timeout
        while pending:
            replies = list(grid.pull_messages(list(pending)))
            if clock() > deadline:  # these came too late
                break
            batch = []
            for reply in replies:
                nid = pending.pop(str(reply.metadata.reply_to_message_id), None)
                if nid is not None and self._accept(reply, nid, phase, reference, array_keys, required_metrics):
                    batch.append(reply)
            if batch:
                valid.extend(batch)
                on_replies(batch)
            now = clock()
            if not pending or now >= deadline:
                break
            if not replies:
                sleep(min(self.pull_interval, deadline - now))
        self._timeouts(phase, list(pending.values()))
        self._summarise(phase, self.failures[before:], asked=len(messages), valid=len(valid))
        return valid

    # ------------------------------------------------------------------ checks
    def _accept(
        self,
        reply: Message,
        node_id: int,
        phase: str,
        reference: ArrayRecord | None,
        array_keys: Sequence[str],
        required_metrics: Sequence[str],
    ) -> bool:
        if reply.has_error():
            gone = int(reply.error.code) == ErrorCode.NODE_UNAVAILABLE
            self._fail(phase, node_id, "node gone" if gone else "error", str(reply.error.reason))
            return False
        self.bytes_received += record_bytes(reply.content)
        why = self._validate(reply, node_id, reference, array_keys, required_metrics)
        if why is not None:
            self._fail(phase, node_id, *why)
            return False
        self.valid_replies[phase] += 1
        return True

    def _validate(
        self,
        reply: Message,
        node_id: int,
        reference: ArrayRecord | None,
        array_keys: Sequence[str],
        required_metrics: Sequence[str],
    ) -> tuple[str, str] | None:
        content = reply.content
        if not any(isinstance(v, MetricRecord) for v in content.values()):
            return "bad-metrics", "reply has no MetricRecord"
        try:
            metrics = metrics_of(reply)
        except ValueError as exc:
            return "bad-metrics", str(exc)
        for key in (NUM_EXAMPLES, *required_metrics):
            if key not in metrics:
                return "bad-metrics", (f"metric '{key}' missing (the reply has {', '.join(sorted(metrics.keys()))}; "
                                       "an evaluate reply's names are set by accuracy-metric / loss-metric)")
        for key, value in metrics.items():
            vals = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in vals):
                return "nonfinite", f"metric '{key}' is {value}"
        pid = metrics.get(PARTITION_ID)
        self.learn(node_id, int(pid) if pid is not None else node_id)
        if reference is not None:
            for key in array_keys:
                rec = content.get(key)
                if not isinstance(rec, ArrayRecord):
                    return "bad-arrays", f"ArrayRecord '{key}' missing"
                why = check_arrays(reference, rec)
                if why is not None:
                    return ("nonfinite" if "NaN" in why else "bad-arrays"), why
        return None

    def _timeouts(self, phase: str, node_ids: Iterable[int]) -> None:
        for nid in dict.fromkeys(node_ids):
            self._fail(phase, nid, "timeout", f"no reply within {self.timeout:g} s")

    def _fail(self, phase: str, node_id: int, kind: str, reason: str) -> None:
        """Record a dropped reply; its full reason is logged the first time it occurs in the round's phase."""
        f = Failure(self.round, phase, int(node_id), self.partition(node_id), kind, reason)
        key = (f.round, phase, kind, reason)
        if key in self._logged:
            log(WARNING, "[%s] round %d %s: dropped node %d (partition %s): %s (the same reason as above)",
                self.run_name, f.round, phase, node_id, f.partition_id, kind)
        else:
            self._logged.add(key)
            log(WARNING, "[%s] round %d %s: dropped node %d (partition %s): %s: %s",
                self.run_name, f.round, phase, node_id, f.partition_id, kind, reason)
        self.failures.append(f)

    def no_train_reply(self) -> bool:
        """Whether this round brought no valid training reply although its exchanges failed.

        Any phase but evaluation counts: when a query that comes first fails everywhere
        (DRFA's loss query, SCAFF-PD's loss/gradient), no training message is sent at all.
        """
        fails = [f for f in self.failures_of_round() if f.phase != "evaluate"]
        return bool(fails) and self.valid_replies.get("train", 0) == 0

    # ------------------------------------------------------------------ who is connected
    def roster(self, grid: Grid, min_nodes: int, wait_timeout: float) -> list[int]:
        """Connected node ids in partition order; waits up to ``wait_timeout`` s for ``min_nodes``.

        Nodes whose partition is known come first, by partition id, then the others by node
        id. A node never heard from is asked its partition once (:meth:`roll_call`), so a
        seeded draw of positions in this list selects the same partitions whatever ids the
        nodes got (simulation, deployment and in-process runs agree, and a restarted node
        takes its partition's place). Refused nodes (:attr:`refused`: a second node for a
        partition a connected node serves, a partition id out of range) are left out.
        """
        start = time.monotonic()
        while True:
            connected = [int(n) for n in grid.get_node_ids()]
            if len(connected) >= min_nodes:
                self.roll_call(grid, connected)
                self._reconsider(connected)
                part = self.node_to_partition
                usable = [n for n in connected if n not in self.refused]
                return sorted(usable, key=lambda n: (0, part[n], n) if n in part else (1, 0, n))
            if time.monotonic() - start > wait_timeout:
                raise RuntimeError(f"min-available-nodes: waited {wait_timeout:.0f} s for {min_nodes} nodes, "
                                   f"only {len(connected)} connected")
            log(INFO, "Waiting for nodes: %d connected, %d needed", len(connected), min_nodes)
            time.sleep(1.0)

    def roll_call(self, grid: Grid, node_ids: Sequence[int]) -> None:
        """Ask nodes of unknown partition for it (``query.init`` with ``weights = false``), once per node.

        A node that does not answer, or answers without a ``partition-id``, is learnt from
        its first reply instead. A node that claims a partition a connected node serves, or
        a partition id outside its ``num-partitions``, is refused (:meth:`refuse`).
        """
        ask = [n for n in node_ids if n not in self.node_to_partition and n not in self.asked]
        if not ask:
            return
        self.asked.update(ask)
        messages = [Message(content=RecordDict({"config": ConfigRecord({"weights": False})}), dst_node_id=n,
                            message_type="query.init") for n in ask]
        try:
            replies = list(grid.send_and_receive(messages, timeout=min(self.timeout, 120.0)))
        except Exception as exc:  # noqa: BLE001  # the partition is then learnt from replies
            log(WARNING, "[%s] roll call failed: %s", self.run_name, exc)
            return
        connected = {int(n) for n in node_ids}
        for reply in replies:
            if reply.has_error():
                continue
            nid = int(reply.metadata.src_node_id)
            self.note_client(nid, reply)
            if (why := roll_call_problem(reply, self.run_config)) is not None:
                self.refuse(nid, None, why)
                continue
            metrics = reply.content.metric_records.get("metrics")
            if metrics is None or PARTITION_ID not in metrics:
                continue
            pid, n = int(metrics[PARTITION_ID]), int(metrics.get("num-partitions", 0) or 0)
            holder = next((m for m, p in self.node_to_partition.items() if p == pid and m != nid), None)
            if n > 0 and not 0 <= pid < n:
                self.refuse(nid, pid, f"its partition-id {pid} is outside 0..{n - 1} (num-partitions = {n} in its "
                                      "node config)")
            elif holder is not None and holder in connected:
                self.refuse(nid, pid, f"partition {pid} is served by node {holder}, which is connected",
                            holder=holder)
            else:
                self.learn(nid, pid)

    def refuse(self, node_id: int, partition_id: int | None, reason: str, *, holder: int | None = None) -> None:
        """Leave node ``node_id`` out of the run (its messages are not sent, its replies not used), once, loudly."""
        self.refused[int(node_id)] = (partition_id, holder, reason)
        log(WARNING, "[%s] node %d refused: %s; fix its --node-config (partition-id, num-partitions)",
            self.run_name, node_id, reason)

    def _reconsider(self, connected: Sequence[int]) -> None:
        """A node refused as a second node of a partition takes the partition once its holder has left."""
        alive = {int(n) for n in connected}
        for nid, (pid, holder, _) in list(self.refused.items()):
            if nid not in alive:
                del self.refused[nid]
            elif holder is not None and holder not in alive and pid is not None:
                del self.refused[nid]
                self.learn(nid, pid)

    def note_client(self, node_id: int, reply: Message) -> None:
        """Keep what a ``query.init`` reply says of its client (its ``client`` ConfigRecord: the mods it runs)."""
        info = reply.content.config_records.get(CLIENT_RECORD)
        if info is not None:
            self.client_info[int(node_id)] = dict(info)


def most_frequent_reason(failures: Sequence[Failure]) -> str | None:
    """The reason given most often among ``failures`` (None when there are none)."""
    if not failures:
        return None
    return Counter(f.reason for f in failures).most_common(1)[0][0]


def failed_rounds_reason(failures: Sequence[Failure], server_round: int, rounds: int) -> str:
    """The most frequent reason of the non-evaluation drops of the last ``rounds`` rounds."""
    fails = [f for f in failures if f.phase != "evaluate" and f.round > server_round - rounds]
    return most_frequent_reason(fails) or "unknown"


def initial_arrays(grid: Grid, run_config: Mapping[str, Any], timeout: float) -> ArrayRecord:
    """Ask a client for the seeded initial model (``query.init``; up to three clients are tried)."""
    start = time.monotonic()
    while not (nodes := sorted(grid.get_node_ids())):
        if time.monotonic() - start > 120:
            raise RuntimeError("no client node connected within 120 s; cannot get the initial model")
        time.sleep(1.0)
    cfg = ConfigRecord({"seed": int(run_config.get("seed", 0))})
    reasons: list[str] = []
    for nid in nodes[:3]:
        msg = Message(content=RecordDict({"config": cfg}), dst_node_id=nid, message_type="query.init")
        replies = list(grid.send_and_receive([msg], timeout=timeout))
        for reply in replies:
            if not reply.has_error() and "arrays" in reply.content.array_records:
                return reply.content.array_records["arrays"]
            if reply.has_error():
                reason = str(reply.error.reason)
                log(WARNING, "query.init failed on node %d: %s", nid,
                    "the same error as above" if reason in reasons else reason)
                reasons.append(reason)
        if not replies:
            reasons.append(f"node {nid} did not answer within {timeout:.0f} s")
    first = reasons[0].partition("\n")[0] if reasons else "no reply"
    raise RuntimeError("could not get initial model weights from any client (query.init failed); "
                       f"first reason: {first}" + (" (the client-side traceback is in the log above)"
                                                   if reasons and "\n" in reasons[0] else ""))
