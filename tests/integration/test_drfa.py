"""DRFA, DRFA-Prox and AFL with the real ClientApp on the synthetic federation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ArrayRecord

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import client_config
from flowerdro.experiments import Fault, InProcessGrid, run
from flowerdro.strategies import build_strategy, initial_arrays


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().ravel() for k in arrays.keys()])


def _on_simplex(lam: dict) -> bool:
    vals = np.array(list(lam.values()))
    # λ is float64 on the simplex: the sum is within n·eps (2.2e-16) of 1; 1e-9 is ample
    return bool(vals.min() >= 0 and abs(vals.sum() - 1) < 1e-9)


def _project(y: np.ndarray) -> np.ndarray:
    """Euclidean projection onto the simplex by bisection on the shift θ of Σ_i max(y_i − θ, 0) = 1."""
    lo, hi = y.min() - 1.0, y.max()
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.maximum(y - mid, 0.0).sum() > 1.0 else (lo, mid)
    return np.maximum(y - (lo + hi) / 2, 0.0)


def test_drfa_prox_and_afl_run_through_the_experiments_runner(tmp_path, synth_rc):
    rc = {**synth_rc, "clients-per-round": 3, "dual-lr": 0.05}
    n, gamma, rho = 5, 0.05, 0.1
    cfg = {"name": "drfa", "num-rounds": 3, "seeds": [0], "num-partitions": n,
           "strategies": ["drfa", "prox-kl", "prox-chi2", "prox-l2", "afl", "afl-full"], "run-config": rc,
           "strategy": {f"prox-{g}": {"strategy": "drfa-prox", "regularizer": g, "rho": rho}
                        for g in ("kl", "chi2", "l2")}}
    res = run(cfg, output_root=tmp_path, verbose=False)
    for label, runs in res.histories.items():
        hist, strategy = runs[0], res.strategies[label][0]
        assert [r["round"] for r in hist] == [1, 2, 3], label
        assert all(_on_simplex(r["lambda"]) and sorted(r["lambda"]) == list("01234") for r in hist), label
        assert all(r["dual_step"].endswith("losses") for r in hist), label
        assert strategy.regularizer() == ((label[5:], rho) if "prox" in label else ("none", 0.0))
        # λ after round 1 from the losses the round recorded: v_i = (N/m) Σ_{k∈U} 1[k=i] f_i,
        # y = 1/N + γτv, then the step of each variant in closed form
        tau = 1 if label.startswith("afl") else synth_rc["local-steps"]
        queried, f = hist[0]["queried"], hist[0]["query_loss"]
        v = np.zeros(n)
        for i in queried:
            v[i] += f[str(i)] * n / len(queried)
        y, kappa = 1 / n + gamma * tau * v, gamma * tau * rho
        lam = np.array([hist[0]["lambda"][str(i)] for i in range(n)])
        if label == "prox-kl":  # stationarity: κ(log(N u_i) + 1) + u_i − y_i is the same for every i
            resid = kappa * (np.log(n * lam) + 1) + lam - y
            assert np.ptp(resid) < 1e-12, resid  # float64 roundings of terms of size ≤ 1
        else:
            expected = {"prox-l2": _project((y + kappa / n) / (1 + kappa)),
                        "prox-chi2": _project((y + kappa) / (1 + kappa * n))}.get(label, _project(y))
            np.testing.assert_allclose(lam, expected, rtol=0, atol=1e-12)  # bisection to float64 resolution
    # AFL is τ = 1 whatever the shared run config says; afl-full queries every client once
    assert res.strategies["afl"][0].training.local_steps == 1
    assert sorted(res.histories["afl-full"][0][0]["sampled"]) == list(range(n))
    assert sorted(res.histories["afl-full"][0][0]["queried"]) == list(range(n))
    recs = [json.loads(x) for x in (tmp_path / "drfa" / "drfa" / "seed0" / "rounds.jsonl").read_text().splitlines()]
    assert set(recs[-1]["lambda"]) == set("01234") and "lambda_entropy" in recs[-1]


def test_drfa_train_messages_carry_tau_and_snapshot_and_replies_are_used(synth_rc):
    rc = {**synth_rc, "local-epochs": 2.0}  # τ must win over epochs
    grid = InProcessGrid(client_app, 4, rc)
    sent = []
    orig = grid.send_and_receive

    def spy(messages, *, timeout=None):
        messages = list(messages)
        sent.extend(messages)
        return orig(messages, timeout=timeout)

    grid.send_and_receive = spy
    st = build_strategy("drfa", {**rc, "clients-per-round": 7, "local-steps": 6, "num-partitions": 4})
    init = initial_arrays(grid, rc, 60)
    sent.clear()
    st.start(grid, init, num_rounds=1, timeout=60, train_config=client_config(rc))
    train = [m for m in sent if m.metadata.message_type == "train.drfa"]
    assert train and all(m.content["config"]["local-steps"] == 6 for m in train)
    assert all(m.content["config"]["local-epochs"] == 0.0 for m in train)
    assert len({m.content["config"]["snapshot-step"] for m in train}) == 1
    assert len(train) == len(set(st.history[0]["sampled"])) < 7


def test_client_drawn_twice_is_counted_twice_in_the_aggregate(synth_rc):
    # Prepare: 3 clients, 7 draws (duplicates certain); record the valid train replies.
    grid = InProcessGrid(client_app, 3, synth_rc)
    replies = {}
    orig = grid.send_and_receive

    def spy(messages, *, timeout=None):
        out = list(orig(list(messages), timeout=timeout))
        for r in out:
            if r.metadata.message_type == "train.drfa" and not r.has_error():
                replies[int(r.content["metrics"]["partition-id"])] = _flat(r.content["arrays"])
        return out

    grid.send_and_receive = spy
    st = build_strategy("drfa", {**synth_rc, "clients-per-round": 7})
    init = initial_arrays(grid, synth_rc, 60)
    # Execute
    res = st.start(grid, init, num_rounds=1, timeout=60, train_config=client_config(synth_rc))
    # Assert: w̄ = (1/m) Σ_k w_{D_k}, by hand
    sampled = st.history[0]["sampled"]
    assert len(sampled) == 7 and len(set(sampled)) < 7
    expected = np.mean([replies[p] for p in sampled], axis=0)
    np.testing.assert_allclose(_flat(res.arrays), expected, rtol=1e-5, atol=1e-6)  # float32 models (eps 1.2e-7), 7 draws


def test_client_failing_in_train_phase_is_dropped_and_round_completes(synth_rc):
    grid = InProcessGrid(client_app, 4, synth_rc, faults={2: Fault("raise", message_types=("train",))})
    # a γ small enough that λ does not settle on the failing client (no round without any reply)
    st = build_strategy("drfa", {**synth_rc, "clients-per-round": 6, "num-partitions": 4, "dual-lr": 8e-3})
    init = initial_arrays(grid, synth_rc, 60)
    st.start(grid, init, num_rounds=3, timeout=60, train_config=client_config(synth_rc))
    hit = [r for r in st.history if 2 in r["sampled"]]
    assert hit, "partition 2 was never sampled; choose another seed"
    for r in st.history:
        assert r.get("failures", {}).get("train:error", 0) == (1 if 2 in r["sampled"] else 0)
        assert r["dual_step"].endswith("losses")  # the round went on to the λ step
        assert _on_simplex(r["lambda"])
    assert {f.partition_id for f in st.failures} == {2}


def test_client_failing_in_query_phase_is_dropped_and_round_completes(synth_rc):
    faults = {1: Fault("raise", message_types=("query.loss",))}
    grid = InProcessGrid(client_app, 4, synth_rc, faults=faults)
    # A client whose loss is never observed only loses weight (documented bias): a floor
    # keeps it in the draws so that its training replies are seen to be used.
    # γ = 0.04 moves λ_1 (whose loss is never seen) to the floor within the first rounds
    st = build_strategy("drfa", {**synth_rc, "clients-per-round": 6, "num-partitions": 4, "lambda-floor": 0.2,
                                 "dual-lr": 0.04})
    init = initial_arrays(grid, synth_rc, 60)
    st.start(grid, init, num_rounds=5, timeout=60, train_config=client_config(synth_rc))
    assert len(st.history) == 5
    # partition 1's loss is never seen (v_1 = 0 every round): it only loses weight and sits at the floor
    assert all(r["lambda"]["1"] == pytest.approx(0.2, abs=1e-12) for r in st.history)
    assert all(min(r["lambda"].values()) >= 0.2 - 1e-12 for r in st.history)
    # the round loop's roll call (query.init) learns every partition, so the failing loss
    # query costs partition 1 nothing before it is first queried
    assert st.history[0]["failures"] == {}
    later = st.history[1:]
    assert any(1 in r["sampled"] for r in later)
    assert not any("train:error" in r["failures"] for r in st.history)
    for r in later:
        n_fail = r["failures"].get("query:error", 0)
        assert n_fail == (1 if 1 in r["queried"] else 0)
        answered = sum(1 for q in r["queried"] if q != 1)
        assert r["dual_step"] == f"{answered}/{len(r['queried'])} losses"
        assert "1" not in r.get("query_loss", {})


@pytest.mark.parametrize("name", ["drfa", "afl"])
def test_seeded_runs_repeat_exactly(synth_rc, name):
    out = []
    for _ in range(2):
        grid = InProcessGrid(client_app, 4, synth_rc)
        st = build_strategy(name, {**synth_rc, "clients-per-round": 2, "seed": 3})
        init = initial_arrays(grid, synth_rc, 60)
        res = st.start(grid, init, num_rounds=2, timeout=60, train_config=client_config(synth_rc))
        out.append((_flat(res.arrays), [r["lambda"] for r in st.history]))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    assert out[0][1] == out[1][1]


# --------------------------------------------------------------------------- crash and resume
@pytest.mark.parametrize("name", ["drfa", "drfa-prox"])
def test_a_run_resumed_after_a_crash_equals_an_uninterrupted_run(synth_rc, tmp_path, name, crash_and_resume):
    # λ, γ's decay and the averaged iterate ŵ all live between rounds: a resumed run must
    # continue them exactly.
    from flowerdro.runs import load_records

    rc = {**synth_rc, "checkpoint-every": 1, "fraction-train": 0.5, "dual-lr": 0.05, "dual-lr-decay": 0.8,
          "output-model": "average", "evaluate-model": "average", "sample-with-replacement": False}

    def experiment(root):
        return {"name": "resume", "num-rounds": 4, "seeds": [0], "num-partitions": 4, "strategies": [name],
                "run-config": rc, "output-root": str(root)}

    whole, _ = crash_and_resume(name, experiment)
    # γ·0.8^k by a power here and by repeated products in the code: k float64 roundings; default
    # approx (rel 1e-6) is ample
    assert [r["dual_lr"] for r in whole.histories[name][0]] == pytest.approx([0.05 * 0.8**k for k in range(4)])
    assert [r["round"] for r in load_records(tmp_path / "cut" / "resume" / name / "seed0")] == [1, 2, 3, 4]


def test_lambda_init_size_through_the_runner_starts_from_the_training_set_sizes(synth_rc):
    # The runner learns every node's partition before round 1; the sizes still need asking.
    rc = {**synth_rc, "lambda-init": "size", "dual-lr": 1e-9, "clients-per-round": 2}
    cfg = {"name": "size", "num-rounds": 1, "seeds": [0], "num-partitions": 4, "strategies": ["drfa"],
           "run-config": rc}
    res = run(cfg, output_root=None, verbose=False)
    strategy, rec = res.strategies["drfa"][0], res.histories["drfa"][0][0]
    sizes = np.array([strategy.state.sizes[p] for p in range(4)], dtype=float)
    assert np.ptp(sizes) > 0  # the check is not vacuous: the partitions differ in size
    lam = np.array([rec["lambda"][str(p)] for p in range(4)])
    np.testing.assert_allclose(lam, sizes / sizes.sum(), rtol=0, atol=1e-7)  # one step of γτv with γ = 1e-9
