"""DR-DSGD and DSGD end to end through the experiments runner on the synthetic federation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from flowerdro.clients.handlers import get_runtime
from flowerdro.clients.training import evaluate_model
from flowerdro.experiments import run
from flowerdro.strategies import initial_arrays


def _cfg(synth_rc: dict, **rc) -> dict:
    return {
        "name": "dec",
        "num-rounds": 3,
        "seeds": [0],
        "num-partitions": 5,
        "strategies": ["drdsgd", "dsgd"],
        "run-config": {**synth_rc, "local-steps": 1, "mu": 2.0, "graph-p": 0.5, **rc},
    }


def test_drdsgd_and_dsgd_run_and_log_consensus_transfers_rho(tmp_path, synth_rc):
    res = run(_cfg(synth_rc), output_root=tmp_path, verbose=False)
    for label in ("drdsgd", "dsgd"):
        recs = [
            json.loads(x)
            for x in (tmp_path / "dec" / label / "seed0" / "rounds.jsonl").read_text().splitlines()
        ]
        assert [r["round"] for r in recs] == [1, 2, 3]
        for r in recs:
            assert math.isfinite(r["consensus_distance"]) and r["consensus_distance"] >= 0
            assert 0 <= r["rho"] < 1
            assert r["transfers"] > 0 and r["transfers"] % 2 == 0
            assert len(r["client_acc"]) == 5  # every device evaluated on its own test set
            assert r["failures"] == {}
        if label == "drdsgd":
            assert set(recs[-1]["log_tilt_weight"]) == {str(i) for i in range(5)}
            # round 1: every device got θ^0, so h_i = exp(ℓ_i/μ) with ℓ_i the cross-entropy of
            # θ^0 on device i's first minibatch, computed here in float64 numpy
            theta0 = initial_arrays(_grid(synth_rc, 5), {**synth_rc, "num-partitions": 5}, 60)
            for pid, ctx in _contexts(synth_rc, 5).items():
                loss = _numpy_first_batch_loss(get_runtime(ctx).data, theta0, pid=pid)
                # float32 logits vs float64 here: a few float32 eps (1.2e-7) on ℓ ≈ 1.6; the
                # record rounds to 6 decimals (5e-7)
                assert recs[0]["log_tilt_weight"][str(pid)] == pytest.approx(
                    math.log(math.exp(loss / 2.0) / 2.0), abs=2e-6)
        strategy = res.strategies[label][0]
        # the graph is the same for DR-DSGD and DSGD with the same seed
        assert strategy.settings()["rho"] == pytest.approx(recs[0]["rho"])
        # per-device accuracy is the accuracy of *that device's* model
        grid_ctx = _contexts(synth_rc, 5)
        for pid, ctx in grid_ctx.items():
            rt = get_runtime(ctx)
            _, acc = evaluate_model(
                rt.model_from(strategy.device_model(pid)), rt.data.x_test, rt.data.y_test
            )
            # accuracy = correct/n from the same predictions: equal up to the float64 division
            # (1e-16); 1e-9 is ample
            assert strategy.client_metrics[pid]["test_acc"] == pytest.approx(acc, abs=1e-9)
        assert np.all(
            np.isfinite(
                np.concatenate([a.numpy().ravel() for a in res.final_arrays[label][0].values()])
            )
        )
    assert (tmp_path / "dec" / "drdsgd" / "seed0" / "device_models.npz").exists()


def _grid(rc: dict, n: int):
    from flowerdro.apps.client_app import app
    from flowerdro.experiments import InProcessGrid

    return InProcessGrid(app, n, {**rc, "num-partitions": n})


def _contexts(rc: dict, n: int):
    grid = _grid(rc, n)
    return {grid.partition_of_node[nid]: ctx for nid, ctx in grid.contexts.items()}


def _numpy_first_batch_loss(data, arrays: ArrayRecord, *, pid: int, batch_size: int = 16) -> float:
    """Cross-entropy of a logistic regression on device ``pid``'s first minibatch of round 1 (seed 0).

    The minibatch is the first ``batch_size`` entries of the permutation drawn from the
    device's DR-DSGD generator; the loss is mean(logsumexp(z) − z_y), z = x Wᵀ + b.
    """
    import torch

    from flowerdro.clients.drdsgd import drdsgd_generator

    idx = torch.randperm(data.num_train, generator=drdsgd_generator(0, 1, pid))[:batch_size].numpy()
    x = data.x_train.cpu().numpy().reshape(data.num_train, -1)[idx].astype(np.float64)
    z = x @ arrays["linear.weight"].numpy().astype(np.float64).T + arrays["linear.bias"].numpy()
    lse = np.log(np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1)) + z.max(axis=1)
    return float(np.mean(lse - z[np.arange(len(idx)), data.y_train.cpu().numpy()[idx]]))


def test_complete_graph_reaches_exact_consensus(synth_rc):
    res = run(
        {**_cfg(synth_rc, topology="complete"), "strategies": ["drdsgd"]},
        output_root=None,
        verbose=False,
    )
    hist = res.histories["drdsgd"][0]
    # W = 11ᵀ/K gives every device the same float32 average: squared differences are 0 or
    # (1e-7)²-level, far below 1e-10
    assert all(r["consensus_distance"] < 1e-10 for r in hist)
    # ρ = ‖W − 11ᵀ/K‖₂ of W = 11ᵀ/K in float64: eigen-solver rounding ≈ K·eps ≈ 1e-15
    assert all(r["rho"] == pytest.approx(0.0, abs=1e-12) for r in hist)
    assert hist[-1]["transfers"] == 5 * 4  # K(K−1)/2 edges, both ways


def test_ring_drdsgd_weights_high_loss_devices_more(synth_rc):
    # the device with the largest minibatch loss has the largest log tilt weight
    res = run(
        {**_cfg(synth_rc, topology="ring"), "strategies": ["drdsgd"]},
        output_root=None,
        verbose=False,
    )
    last = res.histories["drdsgd"][0][-1]
    worst = max(last["train_loss_device"], key=last["train_loss_device"].get)
    assert max(last["log_tilt_weight"], key=last["log_tilt_weight"].get) == worst
    assert last["transfers"] == 2 * 5


def test_eval_model_average_scores_the_consensus_average_on_each_device(synth_rc):
    # Prepare: a ring keeps the device models apart, so θ̄ and θ_i give different scores.
    cfg = {**_cfg(synth_rc, topology="ring", **{"eval-model": "average"}), "strategies": ["drdsgd"]}
    # Execute
    res = run(cfg, output_root=None, verbose=False)
    # Assert: every device's accuracy is that of θ̄ = (1/K) Σ_i θ_i (averaged here from the
    # device models, not taken from the strategy's reported model) on its own test set.
    strategy = res.strategies["drdsgd"][0]
    assert strategy.settings()["eval_model"] == "average"
    device = {pid: strategy.device_model(pid) for pid in range(5)}
    keys = list(device[0].keys())
    avg = {k: np.mean([device[p][k].numpy().astype(np.float64) for p in range(5)], axis=0) for k in keys}
    assert max(
        float(np.abs(device[p][k].numpy() - avg[k]).max()) for p in range(5) for k in keys
    ) > 1e-4  # the devices did not reach consensus
    theta_bar = ArrayRecord({k: Array(avg[k].astype(device[0][k].numpy().dtype)) for k in keys})
    for pid, ctx in _contexts(synth_rc, 5).items():
        rt = get_runtime(ctx)
        loss, acc = evaluate_model(rt.model_from(theta_bar), rt.data.x_test, rt.data.y_test)
        # θ̄ here (float64 mean cast to float32) and the strategy's differ by an ulp at most (u ≈
        # 6e-8):
        # the float32 loss moves by a few u, far inside rel 1e-5; the accuracy (a count over n)
        # flips only
        # for a margin within an ulp, so abs 1e-9 only absorbs the float64 division
        assert strategy.client_metrics[pid]["test_acc"] == pytest.approx(acc, abs=1e-9)
        assert strategy.client_metrics[pid]["test_loss"] == pytest.approx(loss, rel=1e-5)


# --------------------------------------------------------------------------- resume and restarts
def _experiment(name: str, rc: dict, root) -> dict:
    return {"name": "resume", "num-rounds": 4, "seeds": [0], "num-partitions": 5, "strategies": [name],
            "run-config": {**rc, "checkpoint-every": 1, "topology": "erdos_renyi", "graph-p": 0.5,
                           "graph-resample": True, "mu": 2.0, "fraction-evaluate": 0.6},
            "output-root": str(root)}


@pytest.mark.parametrize("name", ["drdsgd", "dsgd"])
def test_a_run_resumed_after_a_crash_equals_an_uninterrupted_run(synth_rc, name, crash_and_resume):
    # A resampled graph (W_t, Σ W_tᵀW_t) and sampled evaluation (RNG) live between rounds; the
    # fixture checks the records (wall times aside) and the reported model, here the device models.
    whole, resumed = crash_and_resume(name, lambda root: _experiment(name, synth_rc, root))
    assert "rho_expected" in whole.histories[name][0][-1]
    a, b = whole.strategies[name][0].state, resumed.strategies[name][0].state
    assert a.order == b.order == list(range(5)) and a.iterations == b.iterations == 4
    for pid in a.order:
        for x, y in zip(a.models[pid], b.models[pid], strict=True):
            np.testing.assert_array_equal(x, y)
