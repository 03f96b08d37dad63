"""Failures are counted against the node a message went to, whoever sent the reply."""

from __future__ import annotations

from flwr.app import Error, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from flowerdro.experiments.inprocess import LocalGrid, ensure_task_identity
from flowerdro.strategies.messaging import Communicator

UNAVAILABLE = ("Error: Node Unavailable — The destination node failed to report a heartbeat "
               "within 2 × its expected interval.")


class _SuperLinkGrid(LocalGrid):
    """Nodes 11, 12, 13 (partitions 0, 1, 2); node 12 is gone: the SuperLink answers for it."""

    def __init__(self) -> None:
        ensure_task_identity()
        self.node_ids = [11, 12, 13]

    def push_messages(self, messages):  # noqa: D102
        raise NotImplementedError

    def pull_messages(self, message_ids):  # noqa: D102
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
        out = []
        for k, msg in enumerate(messages):
            msg.metadata._message_id = f"x{k}"
            nid = int(msg.metadata.dst_node_id)
            if nid == 12:  # made by the SuperLink: its own node id as the sender
                reply = Message(error=Error(code=ErrorCode.NODE_UNAVAILABLE, reason=UNAVAILABLE), reply_to=msg)
                reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
                assert int(reply.metadata.src_node_id) == SUPERLINK_NODE_ID
            else:
                metrics = MetricRecord({"num-examples": 5, "partition-id": nid - 11})
                reply = Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
            out.append(reply)
        return out[::-1]  # arrival order differs from message order


def test_an_unavailable_node_is_one_node_gone_failure_of_its_own_partition():
    grid = _SuperLinkGrid()
    comm = Communicator("t")
    for nid in grid.node_ids:
        comm.roster.learn(nid, nid - 11)
    comm.begin_round(3)
    msgs = Communicator.build_messages(grid.node_ids, RecordDict(), "query.loss")
    valid = comm.send(grid, msgs, phase="query")
    # the valid replies come back in message order; the SuperLink's error is node 12's
    assert [int(r.metadata.src_node_id) for r in valid] == [11, 13]
    assert [(f.round, f.node_id, f.partition_id, f.kind) for f in comm.log.failures] == [(3, 12, 1, "node gone")]
    assert "Node Unavailable" in comm.log.failures[0].reason
