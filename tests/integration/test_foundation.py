"""The strategy base, Flower baselines and client handlers against in-process clients."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from flowerdro.apps.client_app import app as client_app
from flowerdro.clients.handlers import get_runtime
from flowerdro.clients.training import evaluate_model
from flowerdro.comparison import client_config
from flowerdro.experiments import Fault, InProcessGrid, run
from flowerdro.experiments.inprocess import ensure_task_identity
from flowerdro.strategies import build_strategy, initial_arrays
from flowerdro.strategies.base import FairStrategy


def _grid(rc: dict, n: int = 6, faults: dict | None = None) -> InProcessGrid:
    return InProcessGrid(client_app, n, rc, faults=faults or {})


def _start(strategy: FairStrategy, grid: InProcessGrid, rc: dict, rounds: int = 2):
    init = initial_arrays(grid, rc, 60)
    return strategy.start(grid, init, num_rounds=rounds, timeout=60, train_config=client_config(rc))


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().ravel() for k in arrays.keys()])


def test_fedavg_round_equals_weighted_average_of_local_models(synth_rc):
    # Prepare: one round, every client, computed by the strategy ...
    grid = _grid(synth_rc, n=4)
    strategy = build_strategy("fedavg", synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    res = strategy.start(grid, init, num_rounds=1, timeout=60, train_config=client_config(synth_rc))
    # ... and by hand: ask each client to train from the same model, average by num-examples.
    cfg = client_config(synth_rc)
    cfg["server-round"] = 1
    models, weights = [], []
    for nid in grid.node_ids:
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=nid, message_type="train")
        reply = grid.send_and_receive([msg])[0]
        models.append(_flat(reply.content["arrays"]))
        weights.append(reply.content["metrics"]["num-examples"])
    expected = np.average(np.stack(models), axis=0, weights=np.asarray(weights, float))
    # float32 weights of size ≲ 1 averaged over 4 clients: a few float32 roundings (u ≈ 6e-8)
    np.testing.assert_allclose(_flat(res.arrays), expected, rtol=1e-5, atol=1e-6)


def test_node_to_partition_learned_from_replies(synth_rc):
    grid = _grid(synth_rc, n=5)
    strategy = build_strategy("fedavg", synth_rc)
    _start(strategy, grid, synth_rc, rounds=1)
    assert strategy.comm.roster.node_to_partition == grid.partition_of_node
    assert sorted(strategy.client_metrics) == list(range(5))


def test_seeded_sampling_is_repeatable_and_seed_dependent(synth_rc):
    rc = {**synth_rc, "fraction-train": 0.5}
    picks = []
    for seed in (3, 3, 4):
        s = build_strategy("fedavg", {**rc, "seed": seed})
        grid = _grid(rc, n=10)
        picks.append([sorted(m.metadata.dst_node_id for m in s.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
                      for _ in range(5)])
    assert picks[0] == picks[1]
    assert picks[0] != picks[2]
    assert all(len(p) == 5 for p in picks[0])


@pytest.mark.parametrize("mode,kind", [("raise", "error"), ("timeout", "timeout"), ("nan", "nonfinite"),
                                       ("nan-metric", "nonfinite"), ("shape", "bad-arrays")])
def test_misbehaving_client_is_dropped_counted_and_run_completes(synth_rc, mode, kind):
    faults = {2: Fault(mode, message_types=("train",))}
    grid = _grid(synth_rc, n=5, faults=faults)
    strategy = build_strategy("fedavg", synth_rc)
    res = _start(strategy, grid, synth_rc, rounds=3)
    assert len(strategy.failures) == 3
    assert {f.kind for f in strategy.failures} == {kind}
    assert {f.partition_id for f in strategy.failures if f.partition_id is not None} <= {2}
    assert all(r["failures"] == {f"train:{kind}": 1} for r in strategy.history)
    assert np.all(np.isfinite(_flat(res.arrays)))
    # the faulty client still evaluates; everybody has a test accuracy
    assert len(strategy.history[-1]["client_acc"]) == 5


def test_round_is_skipped_when_every_client_fails(synth_rc):
    faults = {k: Fault("raise", message_types=("train",)) for k in range(3)}
    grid = _grid(synth_rc, n=3, faults=faults)
    strategy = build_strategy("fedavg", synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    res = strategy.start(grid, init, num_rounds=2, timeout=60, train_config=client_config(synth_rc))
    np.testing.assert_array_equal(_flat(res.arrays), _flat(init))
    assert len(strategy.failures) == 6


def test_failing_evaluation_is_dropped_not_averaged(synth_rc):
    grid = _grid(synth_rc, n=4, faults={1: Fault("nan-metric", message_types=("evaluate",))})
    strategy = build_strategy("fedavg", synth_rc)
    _start(strategy, grid, synth_rc, rounds=1)
    rec = strategy.history[-1]
    assert sorted(rec["client_acc"]) == ["0", "2", "3"]
    assert rec["failures"] == {"evaluate:nonfinite": 1}
    accs = list(rec["client_acc"].values())
    # float64 statistics of the same per-client accuracies (1e-6 covers their rounding in the record)
    assert rec["acc_worst"] == pytest.approx(min(accs), abs=1e-6)
    assert rec["acc_mean"] == pytest.approx(np.mean(accs), abs=1e-6)


def test_train_loss_is_loss_of_received_model(synth_rc):
    # q-FedAvg needs F_k(w^t): the loss of the model the client *received*.
    grid = _grid(synth_rc, n=2)
    init = initial_arrays(grid, synth_rc, 60)
    nid = grid.node_ids[1]
    msg = Message(content=RecordDict({"arrays": init, "config": client_config(synth_rc)}), dst_node_id=nid,
                  message_type="train")
    reply = grid.send_and_receive([msg])[0]
    rt = get_runtime(grid.contexts[nid])
    expected, _ = evaluate_model(rt.model_from(init), rt.data.x_train, rt.data.y_train)
    # the same evaluate_model pass on the same data (bitwise equal; 1e-6 ≈ 8 float32 ulps)
    assert reply.content["metrics"]["train_loss"] == pytest.approx(expected, rel=1e-6)
    assert reply.content["metrics"]["partition-id"] == 1
    assert set(reply.content.array_records) == {"arrays"}  # nothing extra unless asked


def test_query_loss_full_and_batch(synth_rc):
    grid = _grid(synth_rc, n=2)
    init = initial_arrays(grid, synth_rc, 60)
    nid = grid.node_ids[0]
    rt = get_runtime(grid.contexts[nid])
    full, _ = evaluate_model(rt.model_from(init), rt.data.x_train, rt.data.y_train)
    out = {}
    for mode in ("full", "batch"):
        cfg = ConfigRecord({"loss-on": mode, "batch-size": 8, "server-round": 1})
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=nid, message_type="query.loss")
        out[mode] = grid.send_and_receive([msg])[0].content["metrics"]
    assert out["full"]["loss"] == pytest.approx(full, rel=1e-6)  # the same evaluate_model pass, as above
    assert out["full"]["num-examples"] == rt.data.num_train
    assert out["batch"]["num-examples"] == 8
    assert np.isfinite(out["batch"]["loss"])


def test_fedprox_proximal_term_pulls_towards_global_model(synth_rc):
    grid = _grid(synth_rc, n=2)
    init = initial_arrays(grid, synth_rc, 60)
    dist = {}
    for mu in (0.0, 5.0):
        cfg = ConfigRecord({**client_config(synth_rc), "proximal-mu": mu, "local-steps": 30})
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=grid.node_ids[0],
                      message_type="train")
        dist[mu] = np.linalg.norm(_flat(grid.send_and_receive([msg])[0].content["arrays"]) - _flat(init))
    assert dist[5.0] < dist[0.0]


def test_bias_attack_shifts_reported_losses_only(synth_rc):
    rc = {**synth_rc, "malicious-ids": "1", "attack": "bias", "attack-bias": 3.0}
    clean, attacked = _grid(synth_rc, n=2), _grid(rc, n=2)
    init = initial_arrays(clean, synth_rc, 60)
    cfg = ConfigRecord({"loss-on": "full", "server-round": 1})
    vals = []
    for g in (clean, attacked):
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=g.node_ids[1],
                      message_type="query.loss")
        vals.append(g.send_and_receive([msg])[0].content["metrics"]["loss"])
    assert vals[1] - vals[0] == pytest.approx(3.0, abs=1e-9)  # float64 loss + 3: one rounding ≈ 4e-16


def test_scale_attack_multiplies_update(synth_rc):
    rc = {**synth_rc, "malicious-ids": "0", "attack": "update-scale", "attack-scale": 4.0}
    clean, attacked = _grid(synth_rc, n=1), _grid(rc, n=1)
    init = initial_arrays(clean, synth_rc, 60)
    ups = []
    for g in (clean, attacked):
        msg = Message(content=RecordDict({"arrays": init, "config": client_config(synth_rc)}),
                      dst_node_id=g.node_ids[0], message_type="train")
        ups.append(_flat(g.send_and_receive([msg])[0].content["arrays"]) - _flat(init))
    # float32: (w + 4u) − w vs 4u with |w| ≲ 1 loses ≈ u·|w| ≈ 6e-8 per entry; |u| is small, so rtol alone
    # (on u) would not do: atol 1e-6 ≈ 16 ulps of |w|
    np.testing.assert_allclose(ups[1], 4.0 * ups[0], rtol=1e-4, atol=1e-6)


def test_runner_writes_logs_plots_and_table(tmp_path, synth_rc):
    cfg = {"name": "t", "num-rounds": 2, "seeds": [0, 1], "num-partitions": 4,
           "strategies": ["fedavg", "q02"], "run-config": synth_rc,
           "strategy": {"q02": {"strategy": "qfedavg", "q": 0.2}}}
    res = run(cfg, output_root=tmp_path, verbose=False)
    assert set(res.histories) == {"fedavg", "q02"} and len(res.histories["q02"]) == 2
    lines = (tmp_path / "t" / "q02" / "seed1" / "rounds.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert [r["round"] for r in recs] == [1, 2]
    for key in ("acc_mean", "acc_worst", "acc_worst10", "acc_worst20", "acc_best20", "acc_std", "loss_mean",
                "bytes_sent", "bytes_received", "time_s", "client_acc"):
        assert key in recs[-1]
    accs = np.array(list(recs[-1]["client_acc"].values()))
    # the record's statistics of the same accuracies (1e-5 covers rounding of the logged values)
    assert recs[-1]["acc_worst"] == pytest.approx(accs.min(), abs=1e-5)
    assert recs[-1]["acc_std"] == pytest.approx(accs.std(), abs=1e-5)
    assert (tmp_path / "t" / "comparison.png").stat().st_size > 1000
    assert (tmp_path / "t" / "q02" / "seed0" / "final_model.npz").exists()
    assert "| q02 |" in res.table and "±" in res.table


def test_same_seed_same_result(synth_rc):
    cfg = {"name": "r", "num-rounds": 2, "seeds": [5], "num-partitions": 4, "strategies": ["fedavg"],
           "run-config": {**synth_rc, "fraction-train": 0.5}}
    a = run(cfg, output_root=None, verbose=False)
    b = run(cfg, output_root=None, verbose=False)
    np.testing.assert_array_equal(_flat(a.final_arrays["fedavg"][0]), _flat(b.final_arrays["fedavg"][0]))


@pytest.mark.parametrize("key,value,match", [
    ("lr", -0.1, "lr"), ("lr", 0.0, "lr"), ("local-steps", 0, "local-steps"), ("batch-size", 0, "batch-size"),
    ("fraction-train", 0.0, "fraction-train"), ("q", -1.0, "q"), ("proximal-mu", -1.0, "proximal-mu"),
])
def test_bad_rates_and_counts_are_named(synth_rc, key, value, match):
    rc = {**synth_rc, key: value}
    cfg = {"name": "bad", "num-rounds": 1, "num-partitions": 2, "strategies": ["fedavg", "qfedavg", "fedprox"],
           "run-config": rc}
    with pytest.raises(ValueError, match=match):
        # construction errors come first; client-side errors are raised inside the client
        res = run(cfg, output_root=None, verbose=False)
        # a client-side error must surface as dropped replies with the parameter named
        reasons = [f.reason for s in res.strategies.values() for st in s for f in st.failures]
        if reasons:
            raise ValueError(reasons[0])


def test_unknown_names_list_allowed_values(synth_rc):
    with pytest.raises(ValueError, match="strategy.*allowed"):
        build_strategy("fedsomething", synth_rc)
    ensure_task_identity()
    for key, bad in (("dataset", "imagenet"), ("partition", "zigzag"), ("model", "resnet999")):
        ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                      run_config={**synth_rc, key: bad})
        with pytest.raises(ValueError, match=key):
            rt = get_runtime(ctx)
            rt.new_model()


def test_missing_partition_id_is_explained(synth_rc):
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=synth_rc)
    with pytest.raises(ValueError, match="partition-id"):
        get_runtime(ctx)


def test_metric_record_keys_are_consistent_for_flower_strategies(synth_rc):
    # Flower's FedAvg refuses replies whose MetricRecords differ in keys.
    grid = _grid(synth_rc, n=3)
    init = initial_arrays(grid, synth_rc, 60)
    msgs = [Message(content=RecordDict({"arrays": init, "config": client_config(synth_rc)}), dst_node_id=n,
                    message_type="train") for n in grid.node_ids]
    keys = {tuple(sorted(r.content["metrics"].keys())) for r in grid.send_and_receive(msgs)}
    assert len(keys) == 1
    assert isinstance(next(iter(grid.send_and_receive(msgs[:1]))).content["metrics"], MetricRecord)
    assert torch.get_default_dtype() == torch.float32


def test_run_config_proximal_mu_does_not_leak_into_fedavg(synth_rc):
    # Regression: the client used to fall back to the run config's proximal-mu, so plain
    # FedAvg trained with a proximal term whenever the run config named one.
    finals = []
    for mu in (0.0, 5.0):
        cfg = {"name": "x", "num-rounds": 1, "num-partitions": 3, "strategies": ["fedavg"],
               "run-config": {**synth_rc, "proximal-mu": mu}}
        finals.append(_flat(run(cfg, output_root=None, verbose=False).final_arrays["fedavg"][0]))
    # identical runs up to float32 rounding (u ≈ 6e-8 per operation on weights ≲ 1, one round)
    np.testing.assert_allclose(finals[0], finals[1], rtol=1e-5, atol=1e-6)


def test_shared_run_config_does_not_turn_drfa_into_drfa_prox(synth_rc):
    # The run config is shared by every strategy of a comparison (pyproject lists
    # `regularizer = "kl"` for drfa-prox); plain DRFA and AFL must ignore it.
    rc = {**synth_rc, "regularizer": "kl", "rho": 0.5}
    for name in ("drfa", "afl", "afl-full"):
        st = build_strategy(name, rc)
        assert st.settings()["regularizer"] == "none" and st.settings()["rho"] == 0.0, name
    assert build_strategy("drfa-prox", rc).settings()["regularizer"] == "kl"


def test_shared_run_config_does_not_redefine_fedmgda_variants(synth_rc):
    # One run config serves every strategy of a comparison: keys meant for FedMGDA+ must
    # not change what vanilla FedMGDA is (raw updates, no box, eta = 1, no decay).
    rc = {**synth_rc, "normalize-updates": True, "global-lr": 0.3, "lr-decay": 0.5, "eps": 0.2}
    vanilla = build_strategy("fedmgda", rc).settings()
    plus = build_strategy("fedmgda+", {**rc, "normalize-updates": False}).settings()
    assert vanilla["normalize"] is False and vanilla["global_lr"] == 1.0 and vanilla["lr_decay"] == 1.0
    assert vanilla["eps"] is None
    assert plus["normalize"] is True and plus["global_lr"] == 0.3 and plus["eps"] == 0.2


def test_client_side_data_error_reaches_the_server_with_its_reason(synth_rc):
    # A client that cannot build its data (here: too few classes for one-class) makes
    # query.init fail; the server's error must carry the client's reason, not just "failed".
    rc = {**synth_rc, "partition": "one-class"}
    grid = _grid(rc, n=2)
    with pytest.raises(RuntimeError, match="partition"):
        initial_arrays(grid, rc, 60)
