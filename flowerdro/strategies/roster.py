"""Who is connected, which partition each node serves, and the seeded draw of clients.

:class:`Roster` keeps the node ↔ partition map. It learns a node's partition from the
``partition-id`` of its replies (a reply without one stands for the partition named by
its node id, so a client that does not know its partition still gets a stable identity)
and, for a node never heard from, asks it once (the roll call, ``query.init`` with
``weights = false``); a partition that reappears on another node (a restarted SuperNode)
moves to that node. Connected nodes are listed in partition order, so a seeded draw of
positions in the list selects the same partitions whatever ids the simulation or the
deployment gave the nodes. :func:`sample` draws from the strategy's own
``numpy.random.Generator``; Flower's ``random`` is never used.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.protocol import CLIENT_RECORD, PARTITION_ID
from flowerdro.validation import roll_call_problem

__all__ = ["Roster", "num_evaluate_nodes", "num_train_nodes", "sample"]


class Roster:
    """Connected nodes in partition order; the node ↔ partition map; nodes refused and what clients said.

    Parameters
    ----------
    run_name : str
        Label in log lines.
    """

    def __init__(self, run_name: str) -> None:
        self.run_name = run_name
        self.node_to_partition: dict[int, int] = {}
        #: Nodes already asked their partition by :meth:`roll_call`.
        self.asked: set[int] = set()
        #: Every partition heard from in this run.
        self.partitions_seen: set[int] = set()
        #: Node id → (partition it claims, the node that holds that partition, reason) of refused nodes.
        self.refused: dict[int, tuple[int | None, int | None, str]] = {}
        #: Node id → what its ``query.init`` reply said of the client (e.g. ``{"mods": [...]}``).
        self.client_info: dict[int, dict] = {}
        #: The run config whose data keys a node's ``num-partitions`` must suit at the roll call
        #: (:func:`flowerdro.validation.roll_call_problem`; set by flowerdro's comparison driver).
        self.run_config: Mapping[str, Any] | None = None

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

    def connected(self, grid: Grid, min_nodes: int, wait_timeout: float, timeout: float) -> list[int]:
        """Connected node ids in partition order; waits up to ``wait_timeout`` s for ``min_nodes``.

        Nodes whose partition is known come first, by partition id, then the others by node
        id. A node never heard from is asked its partition once (:meth:`roll_call`, waiting
        at most ``timeout`` s for the answers). Refused nodes (:attr:`refused`: a second
        node for a partition a connected node serves, a partition id out of range) are left
        out. The wait is for real nodes to connect (a deployment's SuperNodes), so it is
        wall-clock time.
        """
        start = time.monotonic()
        while True:
            connected = [int(n) for n in grid.get_node_ids()]
            if len(connected) >= min_nodes:
                self.roll_call(grid, connected, timeout)
                self._reconsider(connected)
                part = self.node_to_partition
                usable = [n for n in connected if n not in self.refused]
                return sorted(usable, key=lambda n: (0, part[n], n) if n in part else (1, 0, n))
            if time.monotonic() - start > wait_timeout:
                raise RuntimeError(f"min-available-nodes: waited {wait_timeout:.0f} s for {min_nodes} nodes, "
                                   f"only {len(connected)} connected")
            log(INFO, "Waiting for nodes: %d connected, %d needed", len(connected), min_nodes)
            time.sleep(1.0)

    def roll_call(self, grid: Grid, node_ids: Sequence[int], timeout: float) -> None:
        """Ask nodes of unknown partition for it (``query.init`` with ``weights = false``), once per node.

        A node that does not answer (within ``timeout`` s, at most 120 s), or answers without a
        ``partition-id``, is learnt from its first reply instead. A node that claims a partition
        a connected node serves, or a partition id outside its ``num-partitions``, is refused
        (:meth:`refuse`).
        """
        ask = [n for n in node_ids if n not in self.node_to_partition and n not in self.asked]
        if not ask:
            return
        self.asked.update(ask)
        messages = [Message(content=RecordDict({"config": ConfigRecord({"weights": False})}), dst_node_id=n,
                            message_type="query.init") for n in ask]
        try:
            replies = list(grid.send_and_receive(messages, timeout=min(timeout, 120.0)))
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

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the roster."""
        return {"node_to_partition": dict(self.node_to_partition), "partitions_seen": sorted(self.partitions_seen),
                "refused": {str(n): [p, h, r] for n, (p, h, r) in self.refused.items()}}

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Take the roster of a checkpoint; what the nodes connected now said of themselves wins over its map."""
        self.refused.update({int(n): (p, h, r) for n, (p, h, r) in checkpoint.get("refused", {}).items()})
        self.node_to_partition = {**dict(checkpoint["node_to_partition"]), **self.node_to_partition}
        self.partitions_seen = set(checkpoint["partitions_seen"])


def num_train_nodes(num_nodes: int, fraction: float, minimum: int) -> int:
    """How many nodes to sample: ``max(min-train-nodes, round(fraction-train·N))``, at most N."""
    return int(min(num_nodes, max(minimum, round(fraction * num_nodes))))


def num_evaluate_nodes(num_nodes: int, fraction: float, cap: int) -> int:
    """How many nodes evaluate: ``min(max(1, round(fraction-evaluate·N)), evaluate-sample)``; a cap of 0 lifts it."""
    k = max(1, round(fraction * num_nodes))
    return min(k, cap) if cap > 0 else k


def sample(rng: np.random.Generator, node_ids: Sequence[int], k: int, *, p: np.ndarray | None = None,
           replace: bool = False) -> list[int]:
    """Draw ``k`` node ids with ``rng`` (with probabilities ``p`` when given)."""
    if k > len(node_ids) and not replace:
        raise ValueError(f"k: cannot sample {k} of {len(node_ids)} nodes without replacement")
    idx = rng.choice(len(node_ids), size=k, replace=replace, p=p)
    return [int(node_ids[i]) for i in np.atleast_1d(idx)]
