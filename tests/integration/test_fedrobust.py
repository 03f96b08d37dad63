"""FedRobust and the FGM / PGD baselines against in-process ClientApp nodes."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from flowerdro.apps.client_app import app as client_app
from flowerdro.clients.robust import STATE_AFFINE
from flowerdro.experiments import InProcessGrid
from flowerdro.runs import client_config, initial_arrays
from flowerdro.strategies import build_strategy
from flowerdro.strategies.fedrobust import QUERY_AFFINE_STATE, TRAIN_FEDROBUST, FedRobust

ROBUST = {"adv-lr": 0.05, "affine-lambda": 0.01}


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().ravel() for k in arrays.keys()])


def _query_state(grid: InProcessGrid) -> dict[int, dict[str, float]]:
    """partition id -> metrics of ``query.affine_state``."""
    msgs = [Message(content=RecordDict({"config": ConfigRecord({})}), dst_node_id=nid,
                    message_type=QUERY_AFFINE_STATE) for nid in grid.node_ids]
    out = {}
    for reply in grid.send_and_receive(msgs):
        assert not reply.has_error(), reply.error.reason
        m = reply.content["metrics"]
        out[int(m["partition-id"])] = {k: float(v) for k, v in m.items()}
    return out


def _stored_norms(grid: InProcessGrid, nid: int) -> tuple[float, float]:
    rec = grid.contexts[nid].state.array_records[STATE_AFFINE]
    lam, delta = rec["lambda"].numpy(), rec["delta"].numpy()
    return float(np.linalg.norm(lam - np.eye(lam.shape[0]))), float(np.linalg.norm(delta))


def test_affine_shifts_persist_across_rounds_and_are_read_back_by_query(synth_rc):
    rc = {**synth_rc, **ROBUST}
    grid = InProcessGrid(client_app, 3, rc)
    before = _query_state(grid)
    assert all(v["lambda-dev-fro"] == 0.0 and v["delta-norm"] == 0.0 and v["affine-rounds"] == 0
               for v in before.values())
    strategy = build_strategy("fedrobust", rc)
    seen: list[dict[int, dict[str, float]]] = []
    strategy.add_round_callback(lambda rec: seen.append(_query_state(grid)))
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=3, timeout=60, train_config=client_config(rc))
    assert len(seen) == 3
    for pid, nid in enumerate(grid.node_ids):
        lam_norms = [s[pid]["lambda-dev-fro"] for s in seen]
        delta_norms = [s[pid]["delta-norm"] for s in seen]
        assert [s[pid]["affine-rounds"] for s in seen] == [1, 2, 3]
        assert 0 < lam_norms[0] < lam_norms[1] < lam_norms[2]
        assert 0 < delta_norms[0] < delta_norms[1] < delta_norms[2]
        # the query reports exactly what the node keeps in its Context.state
        lam_stored, delta_stored = _stored_norms(grid, nid)
        assert lam_norms[-1] == pytest.approx(lam_stored, rel=1e-6)
        assert delta_norms[-1] == pytest.approx(delta_stored, rel=1e-6)
        # the strategy's own read-back after the last round reports the same stored shift
        got = strategy.affine_state[str(pid)]
        assert got["affine-rounds"] == 3.0
        assert got["lambda-dev-fro"] == pytest.approx(lam_stored, rel=1e-6)
        assert got["delta-norm"] == pytest.approx(delta_stored, rel=1e-6)
    assert sorted(strategy.affine_state, key=int) == ["0", "1", "2"]


def test_shift_read_back_counts_a_failing_node_and_keeps_the_others(synth_rc, tmp_path):
    from flowerdro.experiments import Fault

    rc = {**synth_rc, **ROBUST}
    grid = InProcessGrid(client_app, 3, rc, faults={1: Fault("raise", message_types=("query.affine_state",))})
    strategy = build_strategy("fedrobust", rc, output_dir=str(tmp_path))
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=2, timeout=60, train_config=client_config(rc))
    assert sorted(strategy.affine_state) == ["0", "2"]
    assert all(v["affine-rounds"] == 2.0 for v in strategy.affine_state.values())
    assert any(f.phase == "affine-state" for f in strategy.failures)
    import json

    assert json.loads((tmp_path / "affine_state.json").read_text()) == strategy.affine_state


def test_server_averages_w_only_and_the_shift_never_leaves_the_node(synth_rc):
    rc = {**synth_rc, **ROBUST}
    # Prepare: one round by the strategy ...
    grid = InProcessGrid(client_app, 4, rc)
    init = initial_arrays(grid, rc, 60)
    sent: list[Message] = []
    received: list[Message] = []
    original = grid.send_and_receive

    def spy(messages, *, timeout=None):
        messages = list(messages)
        replies = list(original(messages, timeout=timeout))
        if messages and messages[0].metadata.message_type == TRAIN_FEDROBUST:
            sent.extend(messages)
            received.extend(replies)
        return replies

    grid.send_and_receive = spy  # type: ignore[method-assign]
    strategy = build_strategy("fedrobust", rc)
    res = strategy.start(grid, init, num_rounds=1, timeout=60, train_config=client_config(rc))
    # ... and by hand on fresh nodes (fresh (Λ_i, δ_i) = (I, 0)): the num-examples-weighted mean of w.
    fresh = InProcessGrid(client_app, 4, rc)
    cfg = strategy.client_config(client_config(rc), 1)
    models, weights = [], []
    for nid in fresh.node_ids:
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=nid,
                      message_type=TRAIN_FEDROBUST)
        reply = fresh.send_and_receive([msg])[0]
        models.append(_flat(reply.content["arrays"]))
        weights.append(reply.content["metrics"]["num-examples"])
    np.testing.assert_allclose(_flat(res.arrays), np.average(np.stack(models), axis=0, weights=weights),
                               rtol=1e-5, atol=1e-6)
    # Only the model travels: one ArrayRecord with the model's keys, each way.
    assert len(sent) == 4 and len(received) == 4
    for m in sent + received:
        assert list(m.content.array_records.keys()) == ["arrays"]
        assert list(m.content["arrays"].keys()) == list(init.keys())
    cfg_sent = sent[0].content["config"]
    assert (cfg_sent["adv-lr"], cfg_sent["affine-lambda"], cfg_sent["local-steps"]) == (0.05, 0.01, 5)


@pytest.mark.parametrize("key,value,match", [
    ("affine-lambda", -0.1, "affine-lambda"),
    ("local-steps", 0, "local-steps"),
    ("adv-lr", 0.0, "adv-lr"),
    ("lr", -0.1, "lr"),
    ("affine-lambda", 100.0, "adv-lr, affine-lambda"),  # with the default adv-lr 0.01: λη₂ = 1
])
def test_fedrobust_rejects_bad_settings(synth_rc, key, value, match):
    with pytest.raises(ValueError, match=match):
        build_strategy("fedrobust", {**synth_rc, key: value})


@pytest.mark.parametrize("name,key,value,match", [
    ("fedavg-pgd", "adv-eps", -1.0, "adv-eps"),
    ("fedavg-fgm", "adv-eps", -0.5, "adv-eps"),
    ("fedavg-pgd", "pgd-steps", 0, "pgd-steps"),
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
    strategy = FedRobust(local_steps=2, adv_lr=0.05, affine_lambda=0.1, affine_max_dim=10)
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=1, timeout=60, train_config=client_config(rc))
    train_fail = [f for f in strategy.failures if f.phase == "train"]
    assert len(train_fail) == 2 and all(f.kind == "error" for f in train_fail)
    assert "affine-max-dim" in train_fail[0].reason and "d = 20" in train_fail[0].reason


def test_client_rejects_bad_message_settings(synth_rc):
    grid = InProcessGrid(client_app, 1, synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    for key, value in (("affine-lambda", -1.0), ("adv-lr", 0.0), ("local-steps", 0)):
        cfg = ConfigRecord({"adv-lr": 0.1, "affine-lambda": 0.1, key: value})
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=grid.node_ids[0],
                      message_type=TRAIN_FEDROBUST)
        reply = grid.send_and_receive([msg])[0]
        assert reply.has_error() and key in reply.error.reason
    # a rejected message leaves no state behind
    assert STATE_AFFINE not in grid.contexts[grid.node_ids[0]].state


@pytest.mark.parametrize("name,mtype", [("fedavg-fgm", "train.fgm"), ("fedavg-pgd", "train.pgd")])
def test_adversarial_baselines_send_their_message_type_and_train(synth_rc, name, mtype):
    rc = {**synth_rc, "adv-eps": 0.5, "pgd-steps": 3}
    grid = InProcessGrid(client_app, 3, rc)
    types: list[str] = []
    original = grid.send_and_receive

    def spy(messages, *, timeout=None):
        messages = list(messages)
        types.extend(m.metadata.message_type for m in messages)
        return original(messages, timeout=timeout)

    grid.send_and_receive = spy  # type: ignore[method-assign]
    strategy = build_strategy(name, rc)
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=2, timeout=60, train_config=client_config(rc))
    assert types.count(mtype) == 6 and not strategy.failures
    assert strategy.history[-1]["acc_mean"] > strategy.history[0]["acc_mean"] - 0.05
