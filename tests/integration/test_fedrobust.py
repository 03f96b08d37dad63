"""FedRobust and the FGM / PGD baselines against in-process ClientApp nodes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import client_config
from flowerdro.core.affine import shift_norms
from flowerdro.experiments import Fault, InProcessGrid
from flowerdro.strategies import build_strategy, initial_arrays
from flowerdro.strategies.fedrobust import QUERY_AFFINE_STATE, TRAIN_FEDROBUST, FedRobust
from flowerdro.strategies.replies import DeterministicClientError

ROBUST = {"adv-lr": 0.05, "affine-lambda": 0.01}


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().ravel() for k in arrays.keys()])


def _spy(grid: InProcessGrid) -> list[tuple[Message, Message | None]]:
    """Record every (message, reply) pair the grid carries (reply None when there is none)."""
    log: list[tuple[Message, Message | None]] = []
    original = grid.send_and_receive

    def spy(messages, *, timeout=None):
        messages = list(messages)
        replies = list(original(messages, timeout=timeout))
        by_id = {r.metadata.reply_to_message_id: r for r in replies}
        log.extend((m, by_id.get(m.metadata.message_id)) for m in messages)
        return replies

    grid.send_and_receive = spy  # type: ignore[method-assign]
    return log


def _run(strategy, grid, rc, rounds):
    return strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=rounds, timeout=60,
                          train_config=client_config(rc))


def test_each_partitions_shift_is_stored_by_the_server_and_sent_back_the_next_round(synth_rc):
    rc = {**synth_rc, **ROBUST}
    grid = InProcessGrid(client_app, 3, rc)
    log = _spy(grid)
    strategy = build_strategy("fedrobust", rc)
    seen: list[dict] = []
    strategy.add_round_callback(lambda rec: seen.append(
        {p: (s["rounds"], *shift_norms(s["lambda"], s["delta"])) for p, s in strategy.state["shifts"].items()}))
    _run(strategy, grid, rc, 3)
    assert len(seen) == 3 and all(sorted(s) == [0, 1, 2] for s in seen)
    for pid in range(3):
        assert [s[pid][0] for s in seen] == [1, 2, 3]
        lam_norms, delta_norms = [s[pid][1] for s in seen], [s[pid][2] for s in seen]
        assert 0 < lam_norms[0] < lam_norms[1] < lam_norms[2]
        assert 0 < delta_norms[0] < delta_norms[1] < delta_norms[2]
    train = [(m, r) for m, r in log if m.metadata.message_type == TRAIN_FEDROBUST]
    assert len(train) == 9
    for k, (msg, reply) in enumerate(train):
        rnd, pid = k // 3 + 1, grid.partition_of_node[int(msg.metadata.dst_node_id)]
        assert msg.content["config"]["affine-rounds"] == rnd - 1
        assert ("affine" in msg.content.array_records) == (rnd > 1)  # (I, 0) is implied, never sent
        assert reply.content["metrics"]["affine-rounds"] == rnd
        if rnd < 3:  # what the node sends back is what the server sends it next round
            (nxt,) = [m.content["affine"] for m, _ in train[3 * rnd:3 * rnd + 3]
                      if grid.partition_of_node[int(m.metadata.dst_node_id)] == pid]
            for key in ("lambda", "delta"):
                np.testing.assert_array_equal(nxt[key].numpy(), reply.content["affine"][key].numpy())
    summary = strategy.shift_summary()
    assert sorted(summary) == ["0", "1", "2"] and all(v["affine-rounds"] == 3.0 for v in summary.values())
    assert not any(m.metadata.message_type == QUERY_AFFINE_STATE for m, _ in log)  # no node was unknown


def test_the_shift_summary_is_written_as_affine_state_json(synth_rc, tmp_path):
    rc = {**synth_rc, **ROBUST, "fraction-train": 0.5}
    grid = InProcessGrid(client_app, 4, rc)
    strategy = build_strategy("fedrobust", rc, output_dir=str(tmp_path))
    _run(strategy, grid, rc, 2)
    on_disk = json.loads((tmp_path / "affine_state.json").read_text())
    assert on_disk == strategy.shift_summary()
    assert sum(v["affine-rounds"] for v in on_disk.values()) == 4.0  # 2 clients a round, 2 rounds


def test_server_averages_w_only(synth_rc):
    rc = {**synth_rc, **ROBUST}
    grid = InProcessGrid(client_app, 4, rc)
    init = initial_arrays(grid, rc, 60)
    strategy = build_strategy("fedrobust", rc)
    res = strategy.start(grid, init, num_rounds=1, timeout=60, train_config=client_config(rc))
    # ... and by hand on fresh nodes (no shift sent: (I, 0)): the num-examples-weighted mean of w.
    fresh = InProcessGrid(client_app, 4, rc)
    cfg = strategy.client_config(client_config(rc), 1)
    models, weights = [], []
    for nid in fresh.node_ids:
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=nid,
                      message_type=TRAIN_FEDROBUST)
        reply = fresh.send_and_receive([msg])[0]
        assert sorted(reply.content.array_records) == ["affine", "arrays"]
        models.append(_flat(reply.content["arrays"]))
        weights.append(reply.content["metrics"]["num-examples"])
    # float32 models, 4 terms of O(1): a few float32 ulps (1.2e-7 each)
    np.testing.assert_allclose(_flat(res.arrays), np.average(np.stack(models), axis=0, weights=weights),
                               rtol=1e-5, atol=1e-6)
    assert list(res.arrays.keys()) == list(init.keys())
    assert (cfg["adv-lr"], cfg["affine-lambda"], cfg["local-steps"]) == (0.05, 0.01, 5)


# --------------------------------------------------------------------------- node restarts
class _RestartGrid(InProcessGrid):
    """Partition ``restart``'s node is replaced, before round ``at``, by a new node id with an empty state.

    The new id keeps the node's place in the sorted order, so the sampling and the
    summation order of the average are those of an uninterrupted run.
    """

    def __init__(self, *args, restart: int, at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.restart, self.at = restart, at
        self.old_id = self.node_ids[restart]
        self.new_id = self.old_id + 1
        others = [n for n in self.node_ids if n != self.old_id]
        assert sorted([*others, self.new_id]).index(self.new_id) == sorted(self.node_ids).index(self.old_id)

    def on_round(self, rnd: int) -> None:
        if rnd == self.at:
            self.reconnect(self.restart, self.new_id, keep_state=False)


def _restart_run(rc, restart_at=None, faults=None):
    grid = _RestartGrid(client_app, 3, rc, restart=1, at=restart_at or 0, faults=faults or {})
    log = _spy(grid)
    strategy = build_strategy("fedrobust", rc)
    strategy.add_round_callback(lambda rec: grid.on_round(rec["round"] + 1))
    res = _run(strategy, grid, rc, 4)
    return strategy, res, grid, log


def test_a_node_with_a_new_id_serving_the_same_partition_continues_with_its_shift(synth_rc):
    rc = {**synth_rc, **ROBUST}
    whole, whole_res, _, whole_log = _restart_run(rc)
    cut, cut_res, grid, log = _restart_run(rc, restart_at=3)
    # round 3 finds an unknown node: the round loop's roll call asks it its partition once,
    # so FedRobust never needs its own query
    queries = [m for m, _ in log if m.metadata.message_type == "query.init"
               and int(m.metadata.dst_node_id) == grid.new_id]
    assert len(queries) == 1 and not queries[0].content["config"]["weights"]
    assert not any(m.metadata.message_type == QUERY_AFFINE_STATE for m, _ in [*log, *whole_log])
    sent = [m for m, _ in log if m.metadata.message_type == TRAIN_FEDROBUST
            and int(m.metadata.dst_node_id) == grid.new_id]
    assert [m.content["config"]["affine-rounds"] for m in sent] == [2, 3]
    assert cut.partition(grid.new_id) == 1 and not cut.failures
    # the restarted node continued its partition's shift: the run is the uninterrupted one
    assert whole.state["shifts"][1]["rounds"] == cut.state["shifts"][1]["rounds"] == 4
    for pid in range(3):
        for key in ("lambda", "delta"):
            np.testing.assert_array_equal(cut.state["shifts"][pid][key], whole.state["shifts"][pid][key])
    np.testing.assert_array_equal(_flat(cut_res.arrays), _flat(whole_res.arrays))
    strip = [{k: v for k, v in r.items() if k not in ("time_s", "bytes_sent")} for r in whole.history]
    assert [{k: v for k, v in r.items() if k not in ("time_s", "bytes_sent")} for r in cut.history] == strip


def test_a_reply_trained_from_a_fresh_shift_never_overwrites_the_stored_one(synth_rc):
    # The restarted node cannot be asked (its roll call and its query fail), so round 3 sends it no shift: its
    # reply (affine-rounds 1, not 3) is dropped and partition 1 keeps the shift of round 2.
    # Round 3's evaluation tells the server the node's partition, so round 4 sends the shift.
    rc = {**synth_rc, **ROBUST}
    strategy, _, grid, log = _restart_run(rc, restart_at=3, faults={1: Fault("raise", ("query.init", "query.affine_state"))})
    stale = [f for f in strategy.failures if f.kind == "stale-shift"]
    assert [(f.round, f.node_id, f.partition_id) for f in stale] == [(3, grid.new_id, 1)]
    assert "affine-rounds 1" in stale[0].reason and "expected 3" in stale[0].reason
    assert strategy.history[2]["train"]["num-examples"] < strategy.history[1]["train"]["num-examples"]
    sent = [m for m, _ in log if m.metadata.message_type == TRAIN_FEDROBUST
            and int(m.metadata.dst_node_id) == grid.new_id]
    assert [m.content["config"]["affine-rounds"] for m in sent] == [0, 2]
    assert "affine" not in sent[0].content.array_records and "affine" in sent[1].content.array_records
    assert strategy.state["shifts"][1]["rounds"] == 3


def test_a_shift_of_the_wrong_shape_is_dropped_as_a_failure(synth_rc):
    rc = {**synth_rc, **ROBUST}
    grid = InProcessGrid(client_app, 2, rc)
    strategy = build_strategy("fedrobust", rc)
    original = grid.send_and_receive
    corrupted: list[int] = []

    def corrupt(messages, *, timeout=None):
        replies = list(original(messages, timeout=timeout))
        for r in replies[:1]:
            if "affine" in r.content.array_records:
                r.content["affine"] = ArrayRecord({"lambda": Array(np.eye(3, dtype=np.float32)),
                                                   "delta": Array(np.zeros(20, np.float32))})
                corrupted.append(int(r.content["metrics"]["partition-id"]))
        return replies

    grid.send_and_receive = corrupt  # type: ignore[method-assign]
    _run(strategy, grid, rc, 1)
    assert len(corrupted) == 1
    assert [(f.phase, f.kind, f.partition_id) for f in strategy.failures] == [("train", "bad-arrays", corrupted[0])]
    assert sorted(strategy.state["shifts"]) == [1 - corrupted[0]]  # only the other partition's shift is kept


# --------------------------------------------------------------------------- crash and resume
def _experiment(name: str, rc: dict, root) -> dict:
    return {"name": "resume", "num-rounds": 4, "seeds": [0], "num-partitions": 4, "strategies": [name],
            "run-config": {**rc, **ROBUST, "checkpoint-every": 1, "fraction-train": 0.5}, "output-root": str(root)}


@pytest.mark.parametrize("name", ["fedrobust", "fedavg-pgd"])
def test_a_run_resumed_after_a_crash_equals_an_uninterrupted_run(synth_rc, tmp_path, name, crash_and_resume):
    crash_and_resume(name, lambda root: _experiment(name, synth_rc, root))
    if name == "fedrobust":  # the shifts came back from the checkpoint: same summary, 2 clients x 4 rounds
        a, b = (json.loads((root / "resume" / name / "seed0" / "affine_state.json").read_text())
                for root in (tmp_path / "whole", tmp_path / "cut"))
        assert a == b and sum(v["affine-rounds"] for v in a.values()) == 8.0


# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize("key,value,match", [
    ("affine-lambda", -0.1, "affine-lambda"),
    ("local-steps", 0, "local-steps"),
    ("adv-lr", 0.0, "adv-lr"),
    ("lr", -0.1, "lr"),
    ("affine-max-dim", 0, "affine-max-dim"),
    ("affine-lambda", 100.0, "adv-lr, affine-lambda"),  # with the default adv-lr 0.01: λη₂ = 1
])
def test_fedrobust_rejects_bad_settings(synth_rc, key, value, match):
    with pytest.raises(ValueError, match=match):
        build_strategy("fedrobust", {**synth_rc, key: value})


@pytest.mark.parametrize("name,key,value,match", [
    ("fedavg-pgd", "adv-eps", -1.0, "adv-eps"),
    ("fedavg-fgm", "adv-eps", -0.5, "adv-eps"),
    ("fedavg-pgd", "pgd-steps", 0, "pgd-steps"),
    ("fedavg-pgd", "pgd-step-size", 0.0, "pgd-step-size"),
    ("fedavg-fgm", "local-steps", 0, "local-steps"),
    ("fedavg-pgd", "lr", 0.0, "lr"),
])
def test_adversarial_training_rejects_bad_settings(synth_rc, name, key, value, match):
    with pytest.raises(ValueError, match=match):
        build_strategy(name, {**synth_rc, key: value})


def test_client_refuses_an_input_too_large_for_the_affine_map(synth_rc):
    # synthetic-dim 20 > affine-max-dim 10: every node answers with an error naming the limit.
    rc = {**synth_rc, **ROBUST}
    grid = InProcessGrid(client_app, 2, rc)
    strategy = FedRobust(local_steps=2, adv_lr=0.05, affine_lambda=0.1, affine_max_dim=10, max_failed_rounds=5)
    with pytest.raises(DeterministicClientError, match="affine-max-dim"):  # every client alike: stop at once
        _run(strategy, grid, rc, 1)
    train_fail = [f for f in strategy.failures if f.phase == "train"]
    assert len(train_fail) == 2 and all(f.kind == "error" for f in train_fail)
    assert "affine-max-dim" in train_fail[0].reason and "d = 20" in train_fail[0].reason


def test_client_rejects_bad_message_settings_and_a_shift_of_another_dimension(synth_rc):
    grid = InProcessGrid(client_app, 1, synth_rc)
    init = initial_arrays(grid, synth_rc, 60)

    def send(cfg, **extra):
        content = RecordDict({"arrays": init, "config": ConfigRecord(cfg), **extra})
        return grid.send_and_receive([Message(content=content, dst_node_id=grid.node_ids[0],
                                              message_type=TRAIN_FEDROBUST)])[0]

    for key, value in (("affine-lambda", -1.0), ("adv-lr", 0.0), ("local-steps", 0)):
        reply = send({"adv-lr": 0.1, "affine-lambda": 0.1, key: value})
        assert reply.has_error() and key in reply.error.reason
    wrong = ArrayRecord({"lambda": Array(np.eye(4, dtype=np.float32)), "delta": Array(np.zeros(4, np.float32))})
    reply = send({"adv-lr": 0.1, "affine-lambda": 0.1}, affine=wrong)
    assert reply.has_error() and "affine" in reply.error.reason and "d = 20" in reply.error.reason


@pytest.mark.parametrize("name,mtype", [("fedavg-fgm", "train.fgm"), ("fedavg-pgd", "train.pgd")])
def test_adversarial_baselines_send_their_message_type_and_train(synth_rc, name, mtype):
    rc = {**synth_rc, "adv-eps": 0.5, "pgd-steps": 3, "pgd-step-size": 0.2}
    grid = InProcessGrid(client_app, 3, rc)
    log = _spy(grid)
    strategy = build_strategy(name, rc)
    _run(strategy, grid, rc, 2)
    sent = [m for m, _ in log if m.metadata.message_type == mtype]
    assert len(sent) == 6 and not strategy.failures
    cfg = sent[0].content["config"]
    assert cfg["adv-eps"] == 0.5
    if name == "fedavg-pgd":
        assert (cfg["pgd-steps"], cfg["pgd-step-size"]) == (3, 0.2)
    else:
        assert "pgd-steps" not in cfg
    assert strategy.history[-1]["acc_mean"] > strategy.history[0]["acc_mean"] - 0.05
