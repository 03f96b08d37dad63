"""An in-process :class:`flwr.serverapp.Grid`: the ClientApp runs in this process.

Used by the experiments runner and the integration tests: every strategy talks to real
ClientApp handlers through real Messages, without Ray or a SuperLink, so runs are fast and
exactly repeatable. Each node keeps its own :class:`flwr.app.Context` (its ``state``
persists across rounds, as on a SuperNode). Node ids are scrambled so that sorting them
does not give the partition order, as with a real SuperLink.

``faults`` injects misbehaving clients for tests: per partition id a :class:`Fault` says
what goes wrong (an exception, no reply, a late reply, NaN arrays or metrics, a wrongly
shaped array, float64 arrays, an extra metric, a missing record), in which phases
(message types) and rounds.

Time on the grid is simulated, never the host's: :meth:`InProcessGrid.clock` counts the
seconds the server waited for its clients, moved only by the fault model (a ``slow``
client's ``seconds``, a silent one's whole timeout) and by the server's own waits
(:meth:`InProcessGrid.sleep`). The server's deadline logic reads it
(``send_and_receive`` discards a reply whose simulated delay exceeds its ``timeout``;
:meth:`flowerdro.strategies.transport.Transport.stream` times its deadline and its waits
between pulls with the grid's ``clock``/``sleep``). A ``timeout`` fault thus costs the
server its whole round timeout, as a hung SuperNode would, without the test sleeping
through it, and how long the host takes to run a client (a loaded machine, a slow CPU)
never turns a reply into a timeout: a run on this grid gives the same failures on every
host.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

#: Run ids of the grids made in this process (each grid is one run unless told otherwise).
_RUN_IDS = count(1)

#: Real seconds a call waits for the calls ahead of it in :meth:`InProcessGrid.run_in_order`'s order
#: before passing them over. A guard against a call that never comes (a deadlock), not a
#: schedule: a thread of Flower's pool that a loaded host starts late must still get its
#: turn, or the run's result would depend on the host's speed.
ORDER_WAIT = 600.0

FAULT_MODES = ("raise", "timeout", "slow", "nan", "nan-metric", "shape", "float64", "extra-metric",
               "missing-record")


@dataclass(frozen=True)
class Fault:
    """How a client misbehaves.

    mode : one of ``raise`` (the handler raises), ``timeout`` (no reply, ever: the server
        waits out its timeout), ``slow`` (the reply comes ``seconds`` of simulated time
        after the message), ``nan`` (arrays replaced by NaN), ``nan-metric`` (every float
        metric NaN), ``shape`` (first array flattened to a wrong shape), ``float64``
        (arrays cast to float64), ``extra-metric`` (one more metric, ``extra-metric``, in
        every MetricRecord), ``missing-record`` (the reply's ArrayRecords left out, or its
        MetricRecords where it has no arrays).
    message_types : message types affected (e.g. ``("train",)``, ``("query.loss",)``);
        empty means all.
    rounds : server rounds affected (from the ``server-round`` config); empty means all.
    seconds : simulated seconds a ``slow`` reply takes (> 0; ignored by the other modes).
    """

    mode: str
    message_types: tuple[str, ...] = ()
    rounds: tuple[int, ...] = ()
    seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"mode: unknown fault {self.mode!r}; allowed: {', '.join(FAULT_MODES)}")
        if not self.seconds > 0:
            raise ValueError(f"seconds: must be > 0, got {self.seconds}")

    @property
    def delay(self) -> float:
        """Simulated seconds until the reply arrives (inf: never)."""
        return math.inf if self.mode == "timeout" else self.seconds if self.mode == "slow" else 0.0

    def applies(self, message: Message) -> bool:
        """Whether this fault hits ``message``."""
        mtype = message.metadata.message_type
        if self.message_types and not any(mtype == t or mtype.startswith(t + ".") for t in self.message_types):
            return False
        if self.rounds:
            cfg = message.content.config_records.get("config")
            rnd = int(cfg["server-round"]) if cfg is not None and "server-round" in cfg else -1
            return rnd in self.rounds
        return True


class LocalGrid(Grid):
    """The part of Flower's ``Grid`` every grid living in this process shares.

    Subclasses set ``node_ids`` and implement ``push_messages``, ``pull_messages`` and
    ``send_and_receive``; messages are built locally (no SuperLink), ``run`` is whatever
    ``set_run`` was given.
    """

    node_ids: list[int]
    _run: Any = None

    def set_run(self, run: Any) -> None:  # noqa: D102
        self._run = run

    @property
    def run(self) -> Any:  # noqa: D102
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # noqa: D102
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return list(self.node_ids)


@dataclass
class InProcessGrid(LocalGrid):
    """Grid whose nodes are ClientApp calls in this process.

    Parameters
    ----------
    app : ClientApp
        The client application (e.g. ``flowerdro.apps.client_app.app``).
    num_nodes : int
        Number of nodes; node k gets ``partition-id = k`` and ``num-partitions = num_nodes``.
    run_config : Mapping
        The run config every node sees (``context.run_config``).
    faults : Mapping[int, Fault]
        Misbehaviour per partition id (tests).
    replies_per_pull : int or None (default: None)
        How many replies one ``pull_messages`` call runs and returns (None: every queued
        message at once). 1 makes replies arrive one by one, as from clients that finish
        at different times.
    skew : float (default: 0.0)
        Simulated seconds on the grid's :meth:`clock` when it starts.
    run_id : int or None (default: None)
        The Flower run id in every node's Context; None: a new one for each grid, so two
        grids in one process are two runs (the clients key what they keep by it).
    """

    app: ClientApp
    num_nodes: int
    run_config: Mapping[str, Any]
    faults: Mapping[int, Fault] = field(default_factory=dict)
    seconds_per_node: dict[int, float] = field(default_factory=dict)
    calls: int = 0
    replies_per_pull: int | None = None
    skew: float = 0.0
    run_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes: must be >= 1, got {self.num_nodes}")
        if self.replies_per_pull is not None and self.replies_per_pull < 1:
            raise ValueError(f"replies_per_pull: must be >= 1 or None, got {self.replies_per_pull}")
        # Scrambled 31-bit ids, deterministic: partition k <-> node id.
        self.node_ids = [int((k * 2654435761 + 97531) % 2_147_483_629) + 1 for k in range(self.num_nodes)]
        self.partition_of_node = {nid: k for k, nid in enumerate(self.node_ids)}
        self.run_id = next(_RUN_IDS) if self.run_id is None else int(self.run_id)
        self.contexts = {
            nid: Context(
                run_id=self.run_id,
                node_id=nid,
                node_config={"partition-id": k, "num-partitions": self.num_nodes},
                state=RecordDict(),
                run_config=dict(self.run_config),
            )
            for k, nid in enumerate(self.node_ids)
        }
        self._ids = count(1)
        self._queued: dict[str, Message] = {}  # pushed, not yet pulled (message id -> message)
        self._pushed_at: dict[str, float] = {}  # message id -> clock() when pushed
        self._run: Any = None
        self._lock = threading.RLock()
        self._turn = threading.Condition()
        self._call_order: list[int] = []
        ensure_task_identity()

    # -- nodes that die and restart (tests of a SuperNode restart) -----------------------
    def disconnect(self, partition: int) -> int:
        """The node serving ``partition`` leaves the grid (a SuperNode that died); returns its id."""
        nid = next(n for n in self.node_ids if self.partition_of_node[n] == partition)
        self.node_ids = [n for n in self.node_ids if n != nid]
        return nid

    def reconnect(self, partition: int, new_id: int, *, keep_state: bool) -> None:
        """A node with id ``new_id`` serves ``partition`` (a restarted SuperNode).

        Its Context keeps the old node's ``state`` when ``keep_state`` (a node-local store),
        else it starts empty; it takes the old node's place in :attr:`node_ids`, or rejoins at
        its partition's position when the old node had left; the old node answers no more.
        """
        old = next(n for n, p in self.partition_of_node.items() if p == partition and n in self.contexts)
        ctx = self.contexts.pop(old)  # the old node is gone for good
        self.contexts[new_id] = Context(run_id=ctx.run_id, node_id=new_id, node_config=ctx.node_config,
                                        state=ctx.state if keep_state else RecordDict(),
                                        run_config=ctx.run_config)
        self.partition_of_node[new_id] = partition
        if old in self.node_ids:
            self.node_ids = [new_id if n == old else n for n in self.node_ids]
        else:
            self.node_ids = sorted([*self.node_ids, new_id], key=lambda n: self.partition_of_node[n])

    # -- simulated clock -------------------------------------------------------------------
    def clock(self) -> float:
        """Seconds on the grid's clock: simulated time, the :attr:`skew` the server has waited so far."""
        return self.skew

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass on the grid's clock (simulated: returns at once)."""
        self.skew += max(float(seconds), 0.0)

    def _delay(self, msg: Message) -> float:
        """Simulated seconds the reply to ``msg`` takes (inf: none comes)."""
        fault = self.faults.get(self.partition_of_node.get(int(msg.metadata.dst_node_id), -1))
        return fault.delay if fault is not None and fault.applies(msg) else 0.0

    # -- Grid API (set_run, run, create_message, get_node_ids from LocalGrid) -----------

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Queue ``messages`` (nothing runs yet) and return their message ids, in order."""
        ids = []
        for msg in messages:
            mid = self._accept(msg)
            self._queued[mid] = msg
            self._pushed_at[mid] = self.clock()
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Run the queued messages among ``message_ids`` (in push order) and return their replies.

        Each message is run and answered once, when its reply is due on the grid's
        :meth:`clock` (a ``slow`` fault: ``seconds`` after the push; a ``timeout`` fault:
        never). At most :attr:`replies_per_pull` replies come back per call (None: all that
        are due), so a strategy that streams sees them arrive one pull at a time.
        """
        wanted = set(message_ids)
        replies: list[Message] = []
        now = self.clock()
        for mid in [m for m in self._queued if m in wanted]:
            if self.replies_per_pull is not None and len(replies) >= self.replies_per_pull:
                break
            if now < self._pushed_at[mid] + self._delay(self._queued[mid]):
                continue  # not due yet (or never)
            del self._pushed_at[mid]
            reply, _ = self._deliver(self._queued.pop(mid))
            if reply is not None:
                replies.append(reply)
        return replies

    # -- the order of the legacy Server's threads ------------------------------------------
    def run_in_order(self, node_ids: Iterable[int]) -> None:
        """Let the next one-message :meth:`send_and_receive` calls to ``node_ids`` run in this order.

        Flower's legacy ``Server`` sends each client's FitIns/EvaluateIns from its own
        thread of a pool; which thread comes first depends on the host's timing, and the
        nodes of this grid share torch's global generator (a project's shuffling loader,
        its ``Net()`` in ``client_fn``), so the order would change the run.
        :class:`~flowerdro.legacy.LegacyStrategy` hands its instructions' order here; a
        call that does not come within :data:`ORDER_WAIT` seconds is passed over.
        """
        with self._turn:
            self._call_order = [int(n) for n in node_ids]
            self._turn.notify_all()

    def _take_turn(self, nid: int) -> bool:
        """Wait until ``nid`` is first in :meth:`run_in_order`'s order; False when it is not in it."""
        with self._turn:
            if nid not in self._call_order:
                return False
            if not self._turn.wait_for(lambda: nid not in self._call_order or self._call_order[0] == nid, ORDER_WAIT):
                del self._call_order[:self._call_order.index(nid)]  # the calls ahead of it never came
            return True

    def _end_turn(self, nid: int) -> None:
        with self._turn:
            if nid in self._call_order:
                self._call_order.remove(nid)
            self._turn.notify_all()

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Run the ClientApp for each message in turn and collect the replies.

        A reply whose simulated delay (a ``slow`` fault's seconds) exceeds ``timeout`` is
        discarded, as a SuperLink would; the time the host takes to run the client is no
        part of it. The clients answer in parallel on a real grid, so the :meth:`clock`
        moves on by the longest simulated delay, at most ``timeout`` (a ``timeout`` fault:
        the whole ``timeout``). A call with one message to a node of :meth:`run_in_order`'s
        order waits for its turn.
        """
        messages = list(messages)
        nid = int(messages[0].metadata.dst_node_id) if len(messages) == 1 else None
        turn = nid is not None and self._take_turn(nid)
        try:
            return self._send_and_receive(messages, timeout)
        finally:
            if turn:
                self._end_turn(nid)  # type: ignore[arg-type]

    def _send_and_receive(self, messages: list[Message], timeout: float | None) -> list[Message]:
        replies, waited = [], 0.0
        for msg in messages:
            self._accept(msg)
            delay = self._delay(msg)
            waited = max(waited, delay if timeout is None else min(delay, timeout))
            reply, _ = self._deliver(msg)
            if reply is None or (timeout is not None and delay > timeout):
                continue
            replies.append(reply)
        if math.isinf(waited):
            raise RuntimeError("timeout: a client never answers and send_and_receive was given no timeout")
        self.sleep(waited)
        return replies

    def _accept(self, msg: Message) -> str:
        """Check that ``msg`` goes to a known node and give it a message id, as a SuperLink would."""
        nid = int(msg.metadata.dst_node_id)
        if nid not in self.contexts:
            raise ValueError(f"dst_node_id: unknown node {nid}")
        mid = f"m{next(self._ids)}"
        msg.metadata._message_id = mid
        return mid

    def _deliver(self, msg: Message) -> tuple[Message | None, float]:
        """Run the ClientApp on ``msg`` with the node's Context and faults: (reply or None, seconds).

        One call at a time: Flower's legacy ``Server`` asks its clients from a thread pool,
        and the nodes of this grid share one process (imports, torch's global state).
        """
        with self._lock:
            return self._deliver_now(msg)

    def _deliver_now(self, msg: Message) -> tuple[Message | None, float]:
        nid = int(msg.metadata.dst_node_id)
        fault = self.faults.get(self.partition_of_node[nid])
        fault = fault if fault is not None and fault.applies(msg) else None
        if fault is not None and fault.mode == "timeout":
            return None, 0.0
        self.calls += 1
        msg.content = delivered_copy(msg.content)
        t0 = time.perf_counter()
        try:
            if fault is not None and fault.mode == "raise":
                raise RuntimeError(f"injected failure on partition {self.partition_of_node[nid]}")
            reply = self.app(msg, self.contexts[nid])
        except Exception as exc:  # a failing client becomes an error reply, as in Flower
            reply = Message(error=Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
        elapsed = time.perf_counter() - t0
        self.seconds_per_node[nid] = self.seconds_per_node.get(nid, 0.0) + elapsed
        if fault is not None and not reply.has_error():
            _corrupt(reply, fault.mode)
        return reply, elapsed


def delivered_copy(content: RecordDict) -> RecordDict:
    """The content a node receives: its own records, as a real Grid delivers a deserialised copy.

    The server may hand one RecordDict to many messages; a mod or workflow on one node
    that pops a key or replaces a record must not change what the other nodes get. The
    records are copied; their :class:`~flwr.app.Array` values (immutable bytes) are shared.
    """
    out = RecordDict()
    for name, rec in content.items():
        if isinstance(rec, ArrayRecord):
            out[name] = ArrayRecord({k: rec[k] for k in rec.keys()})
        elif isinstance(rec, MetricRecord):
            out[name] = MetricRecord({k: list(v) if isinstance(v, list) else v for k, v in rec.items()})
        elif isinstance(rec, ConfigRecord):
            out[name] = ConfigRecord({k: list(v) if isinstance(v, list) else v for k, v in rec.items()})
        else:
            out[name] = rec
    return out


def ensure_task_identity(run_id: int = 1) -> None:
    """Give this process a Flower task identity (a ServerApp process gets one from Flower).

    Flower's ``Message`` constructor reads the run id, node id and task id of the current
    process; outside a SuperLink-launched ServerApp nothing sets them.
    """
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", run_id), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 0)):
        if getattr(TaskIdentity, attr) is None:
            setattr(TaskIdentity, attr, value)


def _corrupt(reply: Message, mode: str) -> None:
    content = reply.content
    if mode == "nan":
        for name in list(content.array_records.keys()):
            rec = content.array_records[name]
            content[name] = ArrayRecord(
                {k: Array(np.full(rec[k].shape, np.nan, dtype=np.float32)) for k in rec.keys()}
            )
    elif mode == "shape":
        for name in list(content.array_records.keys()):
            rec = content.array_records[name]
            keys = list(rec.keys())
            arrs = {k: rec[k].numpy() for k in keys}
            arrs[keys[0]] = np.concatenate([arrs[keys[0]].reshape(-1), np.zeros(1, arrs[keys[0]].dtype)])
            content[name] = ArrayRecord({k: Array(v) for k, v in arrs.items()})
    elif mode == "nan-metric":
        for name in list(content.metric_records.keys()):
            mr = content.metric_records[name]
            content[name] = MetricRecord({k: (float("nan") if isinstance(v, float) else v) for k, v in mr.items()})
    elif mode == "float64":
        for name in list(content.array_records.keys()):
            rec = content.array_records[name]
            content[name] = ArrayRecord({k: Array(rec[k].numpy().astype(np.float64)) for k in rec.keys()})
    elif mode == "extra-metric":
        for name in list(content.metric_records.keys()):
            content[name] = MetricRecord({**dict(content.metric_records[name]), "extra-metric": 1.0})
    elif mode == "missing-record":
        for name in list(content.array_records.keys() or content.metric_records.keys()):
            del content[name]
