"""FedMGDA+ family against in-process clients: acceptance (improved fraction), attacks, protocol."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, RecordDict

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import client_config
from flowerdro.core.mgda import min_norm_weights
from flowerdro.experiments import Fault, InProcessGrid
from flowerdro.strategies import build_strategy, initial_arrays
from flowerdro.strategies.base import FairStrategy


def _grid(rc: dict, n: int, faults: dict | None = None) -> InProcessGrid:
    return InProcessGrid(client_app, n, rc, faults=faults or {})


def _run(name: str, rc: dict, n: int, rounds: int, faults: dict | None = None) -> tuple[FairStrategy, ArrayRecord]:
    grid = _grid(rc, n, faults)
    strategy = build_strategy(name, rc)
    init = initial_arrays(grid, rc, 60)
    res = strategy.start(grid, init, num_rounds=rounds, timeout=60, train_config=client_config(rc))
    return strategy, res.arrays


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().ravel() for k in arrays.keys()])


def test_improved_fraction_reaches_one_with_full_batch_steps_and_decaying_rate(synth_rc):
    # Acceptance: one deterministic full-batch local step (g_i = η_l ∇f_i(w_t)), MGDA (ε = 1), so
    # d_t is a common descent direction of every f_i; with η_t decayed (1 → 0.05 → 0.0025 every
    # 10 rounds) every participant's full training loss stops increasing.
    rc = {**synth_rc, "precision": "float64", "local-steps": 1, "batch-size": 1_000_000, "lr": 0.05,
          "eps": 1.0, "global-lr": 1.0, "lr-decay": 0.05**2, "lr-decay-every": 10, "track-improvement": True,
          "fraction-evaluate": 0.0}
    strategy, _ = _run("fedmgda+", rc, n=5, rounds=30)
    fracs = [r["improved_fraction"] for r in strategy.history]
    rates = [r["global_lr"] for r in strategy.history]
    # the decay β^(t/T) by float64 power here and by the code's own route: a few ulps; default
    # approx (rel 1e-6) is ample
    assert rates[0] == pytest.approx(1.0) and rates[15] == pytest.approx(0.05**(2 / 3))
    assert rates[-1] == pytest.approx(0.05**(4 / 3))
    assert min(fracs[:10]) < 1.0  # the large initial rate overshoots some client
    assert fracs[-10:] == [1.0] * 10  # 100% of the participants improve once the rate has decayed
    for r in strategy.history[-10:]:
        assert all(v <= 0 for v in r["loss_change"].values())


def test_fedavg_n_round_equals_normalised_average_of_local_models(synth_rc):
    rc = {**synth_rc, "precision": "float64", "global-lr": 0.3}
    grid = _grid(rc, 4)
    strategy = build_strategy("fedavg-n", rc)
    init = initial_arrays(grid, rc, 60)
    res = strategy.start(grid, init, num_rounds=1, timeout=60, train_config=client_config(rc))
    # by hand: every client trains from the same model; ĝ_i = (w − w_i)/‖w − w_i‖, λ₀ ∝ n_i
    cfg = client_config(rc)
    cfg["server-round"] = 1
    w = _flat(init)
    gs, ns = [], []
    for nid in grid.node_ids:
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=nid, message_type="train.sgd")
        reply = grid.send_and_receive([msg])[0]
        gs.append(w - _flat(reply.content["arrays"]))
        ns.append(reply.content["metrics"]["num-examples"])
    lam0 = np.asarray(ns, float) / sum(ns)
    d = sum(l * g / np.linalg.norm(g) for l, g in zip(lam0, gs, strict=True))
    # float64 step: 4 normalised gradients of O(1) entries summed, rounding ≈ 10·eps ≈ 2e-15; 1e-10
    # / 1e-12 leave margin
    np.testing.assert_allclose(_flat(res.arrays), w - 0.3 * d, rtol=1e-10, atol=1e-12)
    lam = strategy.history[-1]["lambda"]
    assert sorted(lam) == ["0", "1", "2", "3"]
    # λ0 = n_k/Σn in float64 on both sides: ≤ 1 ulp
    np.testing.assert_allclose([lam[str(k)] for k in range(4)], lam0, atol=1e-12)


def test_fedavg_mgda_is_flowers_fedavg_and_tracks_improvement(synth_rc):
    # the ε = 0 unnormalised member of the family is FedAvg: Σ_i (n_i/n) w_i, whatever the
    # shared run config says about global-lr, lr-decay and eps
    rc = {**synth_rc, "precision": "float64", "global-lr": 0.3, "lr-decay": 0.5, "eps": 0.4,
          "fraction-train": 1.0}
    _, ref = _run("fedavg", rc, n=4, rounds=3)
    strategy, arrays = _run("fedavg-mgda", {**rc, "track-improvement": True}, n=4, rounds=3)
    # the same float64 weighted average by two code paths: only the summation order differs (a few
    # ulps of O(1) values)
    np.testing.assert_allclose(_flat(arrays), _flat(ref), rtol=1e-12, atol=1e-13)
    for r in strategy.history:
        assert r["global_lr"] == 1.0 and 0.0 <= r["improved_fraction"] <= 1.0
        # λ is float64 on the simplex: the sum is within n·eps (2.2e-16) of 1
        assert sum(r["lambda"].values()) == pytest.approx(1.0, abs=1e-12)


def test_lambda_logged_by_partition_for_the_sampled_fraction(synth_rc):
    rc = {**synth_rc, "fraction-train": 0.5, "eps": 0.2}
    strategy, arrays = _run("fedmgda+", rc, n=6, rounds=3)
    for r in strategy.history:
        lam = r["lambda"]
        assert len(lam) == 3 and set(lam) <= {str(k) for k in range(6)}
        # λ is float64 on the simplex: the sum is within n·eps (2.2e-16) of 1; 1e-9 is ample
        assert sum(lam.values()) == pytest.approx(1.0, abs=1e-9)
        assert all(1 / 3 - 0.2 - 1e-12 <= v <= 1 / 3 + 0.2 + 1e-12 for v in lam.values())
    assert np.all(np.isfinite(_flat(arrays)))
    assert len({tuple(sorted(r["lambda"])) for r in strategy.history}) > 1  # a new sample each round


def test_scaling_attack_changes_fedavg_but_not_fedmgda_direction(synth_rc):
    rc = {**synth_rc, "precision": "float64", "eps": 0.3}
    attack = {"malicious-ids": "1", "attack": "update-scale", "attack-scale": 25.0}
    _, honest = _run("fedmgda+", rc, n=3, rounds=2)
    _, attacked = _run("fedmgda+", {**rc, **attack}, n=3, rounds=2)
    # normalising g and 25·g gives the same unit vector up to a few float64 ulps; rtol 1e-9 leaves
    # margin
    np.testing.assert_allclose(_flat(attacked), _flat(honest), rtol=1e-9, atol=1e-10)
    _, honest_avg = _run("fedavg", rc, n=3, rounds=2)
    _, attacked_avg = _run("fedavg", {**rc, **attack}, n=3, rounds=2)
    assert np.abs(_flat(attacked_avg) - _flat(honest_avg)).max() > 0.1


def test_bias_attack_changes_qfedavg_and_afl_but_not_fedmgda(synth_rc):
    rc = {**synth_rc, "precision": "float64", "eps": 0.3, "q": 2.0, "dual-lr": 0.1}
    attack = {"malicious-ids": "0", "attack": "bias", "attack-bias": 5.0}
    _, honest = _run("fedmgda+", rc, n=3, rounds=2)
    _, attacked = _run("fedmgda+", {**rc, **attack}, n=3, rounds=2)
    np.testing.assert_array_equal(_flat(attacked), _flat(honest))  # it never reads a loss
    for name in ("qfedavg", "afl-full"):
        _, h = _run(name, rc, n=3, rounds=2)
        _, a = _run(name, {**rc, **attack}, n=3, rounds=2)
        assert np.abs(_flat(a) - _flat(h)).max() > 1e-4, name


def test_vanilla_fedmgda_and_mgda_prox_run_and_failures_are_dropped(synth_rc):
    rc = {**synth_rc, "fraction-train": 1.0, "precision": "float64"}
    strategy, arrays = _run("fedmgda", rc, n=4, rounds=1, faults={2: Fault("raise", message_types=("train",))})
    assert all(sorted(r["lambda"]) == ["0", "1", "3"] for r in strategy.history)
    assert all(r["failures"] == {"train:error": 1} for r in strategy.history)
    # round 1 by hand from the same clients' models: λ satisfies the QP's optimality
    # conditions on the raw Gram G (Gλ)_i = min_j (Gλ)_j wherever λ_i > 0 (no box), and with
    # η = 1 the new model is the λ-average of the local models
    fresh = _grid(rc, 4)
    init = initial_arrays(fresh, rc, 60)
    cfg = strategy.train_config(client_config(rc), 1)
    models = []
    for k in (0, 1, 3):
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=fresh.node_ids[k],
                      message_type="train.sgd")
        models.append(_flat(fresh.send_and_receive([msg])[0].content["arrays"]))
    lam = np.array([strategy.history[0]["lambda"][k] for k in ("0", "1", "3")])
    g = _flat(init) - np.stack(models)
    grad = (g @ g.T) @ lam
    # optimality gap of the QP contract (1e-8 + 1e-7·f in units of max G_ii), as a slack on
    # the gradient entries of the support
    slack = 1e-6 * np.diag(g @ g.T).max()
    assert np.all(grad[lam > 1e-6] <= grad.min() + slack)
    np.testing.assert_allclose(_flat(arrays), lam @ np.stack(models), rtol=0, atol=1e-9)
    prox, arrays = _run("mgda-prox", {**rc, "proximal-mu": 0.5, "track-improvement": True,
                                      "improvement-before": "query"}, n=3, rounds=2)
    assert all(0.0 <= r["improved_fraction"] <= 1.0 for r in prox.history)
    assert np.all(np.isfinite(_flat(arrays)))


def test_inprocess_grid_pull_answers_each_message_once_in_push_order(synth_rc):
    grid = InProcessGrid(client_app, 4, synth_rc, faults={1: Fault("timeout")}, replies_per_pull=1)
    init = initial_arrays(grid, synth_rc, 60)
    cfg = client_config(synth_rc)
    cfg["server-round"] = 1
    msgs = [Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=n, message_type="train.sgd")
            for n in grid.node_ids]
    calls = grid.calls
    ids = list(grid.push_messages(msgs))
    assert ids == [m.metadata.message_id for m in msgs] and len(set(ids)) == 4
    assert grid.calls == calls  # pushing runs nothing
    got = []
    for _ in range(6):
        got.append([r.metadata.reply_to_message_id for r in grid.pull_messages(ids)])
    # one reply per pull, in push order; partition 1 never answers; nothing comes twice
    assert got == [[ids[0]], [ids[2]], [ids[3]], [], [], []]
    assert list(grid.pull_messages(["no-such-id"])) == []


def _one_round(rc: dict, n: int, per_pull: int | None, faults: dict | None = None) -> tuple[FairStrategy, ArrayRecord]:
    grid = InProcessGrid(client_app, n, rc, faults=faults or {}, replies_per_pull=per_pull)
    strategy = build_strategy("fedmgda+", rc)
    strategy.comm.transport.pull_interval = 0.001
    init = initial_arrays(grid, rc, 60)
    res = strategy.start(grid, init, num_rounds=2, timeout=60, train_config=client_config(rc))
    return strategy, res.arrays


def test_replies_one_by_one_give_the_same_rounds_as_all_at_once(synth_rc):
    # float64 model: the streamed Gram rows (matrix-vector products) and the one-block Gram
    # (a matrix product) differ only in summation order, |δG| ≈ d·1e-16·max G_ii with d < 100
    # parameters; λ moves by at most |δG| over the curvature on the optimal face, and 1e-9
    # leaves a factor 1e5 for that conditioning
    rc = {**synth_rc, "eps": 0.3, "global-lr": 0.5, "fraction-evaluate": 0.0, "precision": "float64"}
    one, w_one = _one_round(rc, 5, 1)
    block, w_block = _one_round(rc, 5, None)
    for a, b in zip(one.history, block.history, strict=True):
        assert sorted(a["lambda"]) == sorted(b["lambda"]) == ["0", "1", "2", "3", "4"]
        # Gram summed in one pass vs in blocks differs by float64 rounding (≈1e-16 relative); the
        # min-norm QP
        # amplifies it by its conditioning, so 1e-9 keeps about six orders of magnitude of room
        np.testing.assert_allclose([a["lambda"][k] for k in sorted(a["lambda"])],
                                   [b["lambda"][k] for k in sorted(b["lambda"])], atol=1e-9)
        assert a["server_step_s"] >= 0.0
    np.testing.assert_allclose(_flat(w_one), _flat(w_block), rtol=0, atol=1e-9)


def test_client_failing_mid_stream_is_dropped_and_step_matches_float64_batch(synth_rc):
    # Partition 2 of 5 raises in round 1 while the others' replies stream in one by one.
    rc = {**synth_rc, "eps": 0.2, "global-lr": 0.5, "fraction-evaluate": 0.0}
    faults = {2: Fault("raise", message_types=("train",), rounds=(1,))}
    grid = InProcessGrid(client_app, 5, rc, faults=faults, replies_per_pull=1)
    pulls: list[int] = []
    pull = grid.pull_messages

    def spy(ids):
        out = list(pull(ids))
        pulls.append(len(out))
        return out

    grid.pull_messages = spy  # type: ignore[method-assign]
    strategy = build_strategy("fedmgda+", rc)
    strategy.comm.transport.pull_interval = 0.001
    init = initial_arrays(grid, rc, 60)
    res = strategy.start(grid, init, num_rounds=1, timeout=60, train_config=client_config(rc))
    rec = strategy.history[0]
    assert rec["failures"] == {"train:error": 1}
    assert sorted(rec["lambda"]) == ["0", "1", "3", "4"]
    assert pulls[:5] == [1, 1, 1, 1, 1]  # the replies (and the error) really arrived one pull at a time
    # by hand, in float64, from the same clients' replies
    fresh = InProcessGrid(client_app, 5, rc)
    cfg = strategy.train_config(client_config(rc), 1)
    w = _flat(init).astype(np.float64)
    gs = []
    for k in (0, 1, 3, 4):
        msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=fresh.node_ids[k],
                      message_type="train.sgd")
        gs.append(w - _flat(fresh.send_and_receive([msg])[0].content["arrays"]))
    U = np.stack([g / np.linalg.norm(g) for g in gs])
    G = U @ U.T
    lam = np.array([rec["lambda"][k] for k in ("0", "1", "3", "4")])
    ref = min_norm_weights(G, eps=0.2)
    # float32 model of d < 2¹⁶ parameters: the server's normalised Gram differs from G by at
    # most δ = 2u + 3√d·u per entry (storage rounding, then one float32 sum; see
    # test_fedmgda_stream), so its λ is within 2δ of G's optimal value (plus the QP's
    # 1e-8 + 1e-7·f), and the step's direction within √(that gap) of the optimal one
    u, d = 2.0**-24, w.size
    gap_bound = 2 * (2 * u + 3 * np.sqrt(d) * u) + 2 * (1e-8 + 1e-7 * float(ref @ G @ ref))
    assert lam @ G @ lam - ref @ G @ ref <= gap_bound
    move = 0.5 * np.sqrt(gap_bound) + 3 * u * np.linalg.norm(w)
    assert np.linalg.norm(_flat(res.arrays) - (w - 0.5 * ref @ U)) <= move


def test_improved_fraction_is_the_same_whatever_train_loss_on(synth_rc):
    # "before" and "after" must both be full-data losses: with train-loss-on = "batch" the
    # train reply's train_loss is a first-minibatch loss, so "before" comes from a query at
    # w_t. The training itself does not depend on the mode, so the records must agree.
    rc = {**synth_rc, "precision": "float64", "batch-size": 4, "local-steps": 2, "eps": 0.5, "global-lr": 1.0,
          "track-improvement": True, "fraction-evaluate": 0.0}
    full, w_full = _run("fedmgda+", rc, n=5, rounds=2)
    batch, w_batch = _run("fedmgda+", {**rc, "train-loss-on": "batch"}, n=5, rounds=2)
    np.testing.assert_array_equal(_flat(w_full), _flat(w_batch))
    for a, b in zip(full.history, batch.history, strict=True):
        assert a["improved_fraction"] == b["improved_fraction"]
        # float64 sums of the same per-client losses in another order: a few ulps of O(1) values
        assert a["loss_change"] == pytest.approx(b["loss_change"], rel=0, abs=1e-12)
