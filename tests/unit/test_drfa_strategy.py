"""DRFA / DRFA-Prox / AFL strategy: the pure steps, and the round loop against a fake ClientApp.

The fake ClientApp (``_FakeApp``) answers with known numbers: ``train.drfa`` returns
w + δ_i (final) and w + (t′/τ)·δ_i (snapshot) for fixed vectors δ_i, ``query.loss`` returns
a fixed loss f_i, so every expected value below is computed by hand from δ and f.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from scipy import stats

from flowerdro.core.dual import drfa_loss_vector, drfa_prox_step
from flowerdro.core.simplex import project_simplex
from flowerdro.experiments.inprocess import Fault, InProcessGrid
from flowerdro.strategies import DRFA, build_strategy
from flowerdro.strategies.drfa import (
    aggregation_coefficients,
    combine_models,
    dual_step,
    lambda_entropy,
    sample_by_lambda,
    sample_snapshot_steps,
    sample_uniform,
)

DIM = 3


class _FakeApp:
    """A ClientApp stand-in with known replies; records every message it receives."""

    def __init__(self, deltas: np.ndarray, losses: np.ndarray, tau: int | None = None) -> None:
        self.deltas, self.losses, self.tau = deltas, losses, tau
        self.received: list[tuple[str, int, dict]] = []

    def __call__(self, msg: Message, ctx: Context) -> Message:
        pid = int(ctx.node_config["partition-id"])
        mtype = msg.metadata.message_type
        cfg = dict(msg.content.config_records.get("config") or {})
        self.received.append((mtype, pid, cfg))
        w = msg.content["arrays"]["w"].numpy()
        metrics = {"num-examples": 10 * (pid + 1), "partition-id": pid}
        content = RecordDict()
        if mtype == "train.drfa":
            tau, tp = int(cfg["local-steps"]), int(cfg["snapshot-step"])
            content["arrays"] = ArrayRecord({"w": Array(w + self.deltas[pid])})
            content["snapshot"] = ArrayRecord({"w": Array(w + (tp / tau) * self.deltas[pid])})
            metrics["train_loss"] = float(self.losses[pid])
        elif mtype == "query.loss":
            metrics["loss"] = float(self.losses[pid])
        elif mtype == "evaluate":
            metrics.update({"test_acc": 0.5, "test_loss": float(self.losses[pid])})
        content["metrics"] = MetricRecord(metrics)
        return Message(content=content, reply_to=msg)


def _fake(n: int, seed: int = 0, faults: dict | None = None) -> tuple[_FakeApp, InProcessGrid, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    deltas = rng.normal(size=(n, DIM)).astype(np.float64)
    losses = rng.uniform(0.5, 2.0, size=n)
    app = _FakeApp(deltas, losses)
    return app, InProcessGrid(app, n, {}, faults=faults or {}), losses


def _init() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(DIM, dtype=np.float64))})


def _w(arrays: ArrayRecord) -> np.ndarray:
    return arrays["w"].numpy()


def _run(strategy: DRFA, grid: InProcessGrid, rounds: int):
    return strategy.start(grid, _init(), num_rounds=rounds, timeout=60, train_config=ConfigRecord({"seed": 0}))


# =============================================================================== pure steps
def test_tau_v_is_unbiased_for_the_sum_of_lambda_gradients_over_the_local_steps():
    # Prepare: a fixed loss table F[t, i] = f_i(w(t)) for t = 1..τ; ∇_λ F(w(t), λ) = F[t].
    rng = np.random.default_rng(0)
    n, m, tau, reps = 7, 3, 5, 40_000
    table = rng.uniform(0.0, 3.0, size=(tau, n))
    target = table.sum(axis=0)  # Σ_t ∇_λ F(w(t), λ)
    # Execute: many draws of t′ and U, exactly as the strategy draws them.
    draws = np.empty((reps, n))
    for r in range(reps):
        tp = sample_snapshot_steps(rng, tau, 1)[0]
        u = sample_uniform(rng, n, m)
        draws[r] = tau * drfa_loss_vector(n, u, table[tp - 1, u])
    # Assert: mean within 5 standard errors, coordinate-wise.
    se = draws.std(axis=0, ddof=1) / np.sqrt(reps)
    assert np.all(np.abs(draws.mean(axis=0) - target) < 5 * se)
    assert se.max() < 0.05 * target.min()  # the check is not vacuous


def test_dual_step_is_projected_ascent_with_hand_computed_v():
    # In the interior of the simplex Π_Δ(y) = y − (Σy − 1)/N, so λ⁺ = λ + τγ(v − mean(v)).
    lam = np.array([0.3, 0.2, 0.25, 0.25])
    ids, losses = [1, 3, 1], [0.6, 1.5, 0.6]
    v = np.zeros(4)
    v[1], v[3] = 2 * 0.6 * 4 / 3, 1.5 * 4 / 3
    tau, gamma = 4, 0.01
    expected = lam + tau * gamma * (v - v.mean())
    np.testing.assert_allclose(dual_step(lam, ids, losses, tau=tau, gamma=gamma), expected, atol=1e-12)


@pytest.mark.parametrize("reg", ["none", "kl", "chi2", "l2"])
def test_dual_step_stays_on_the_simplex(reg):
    rng = np.random.default_rng(1)
    lam = np.full(20, 1 / 20)
    for _ in range(200):
        ids = rng.integers(0, 20, size=5)
        lam = dual_step(lam, ids, rng.uniform(0, 50, size=5), tau=10, gamma=0.5, regularizer=reg, rho=0.3)
        assert lam.min() >= 0.0 and lam.sum() == pytest.approx(1.0, abs=1e-9)


def test_dual_step_l2_prox_matches_closed_form():
    # g(u) = −(ρ/2)‖u − 1/N‖²: λ⁺ = Π_Δ((λ + γτv + γτρ/N) / (1 + γτρ)).
    lam, ids, losses = np.array([0.1, 0.6, 0.3]), [0, 2], [2.0, 1.0]
    v = np.array([2.0 * 1.5, 0.0, 1.0 * 1.5])
    k = 0.2 * 3 * 0.5
    expected = project_simplex((lam + 0.2 * 3 * v + k / 3) / (1 + k))
    got = dual_step(lam, ids, losses, tau=3, gamma=0.2, regularizer="l2", rho=0.5)
    np.testing.assert_allclose(got, expected, atol=1e-12)


def test_lambda_floor_keeps_simplex_and_floor():
    rng = np.random.default_rng(2)
    lam, floor = np.full(10, 0.1), 1e-2
    for _ in range(100):
        ids = rng.integers(0, 10, size=3)
        lam = dual_step(lam, ids, rng.uniform(0, 100, size=3), tau=10, gamma=1.0, floor=floor)
        assert lam.min() >= floor - 1e-12 and lam.sum() == pytest.approx(1.0, abs=1e-12)
    # without the floor the same updates drive entries to exactly zero
    lam2 = dual_step(np.full(10, 0.1), [0], [100.0], tau=10, gamma=1.0)
    assert lam2.min() == 0.0


def test_sampling_by_lambda_is_repeatable_and_matches_lambda():
    lam = np.array([0.05, 0.4, 0.0, 0.25, 0.3])
    a = sample_by_lambda(np.random.default_rng(7), lam, 20_000)
    b = sample_by_lambda(np.random.default_rng(7), lam, 20_000)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, sample_by_lambda(np.random.default_rng(8), lam, 20_000))
    counts = np.bincount(a, minlength=5)
    assert counts[2] == 0  # λ_i = 0 is never drawn
    keep = lam > 0
    _, p = stats.chisquare(counts[keep], lam[keep] * counts.sum())
    assert p > 1e-3


def test_sampling_without_replacement_is_distinct_and_bounded_by_support():
    rng = np.random.default_rng(0)
    d = sample_by_lambda(rng, np.array([0.5, 0.0, 0.5, 0.0]), 3, replace=False)
    assert sorted(d.tolist()) == [0, 2]
    d = sample_by_lambda(rng, np.full(6, 1 / 6), 4, replace=False)
    assert len(set(d.tolist())) == 4


def test_uniform_client_sampling_aggregate_is_unbiased_for_lambda_mixture():
    # Prepare
    rng = np.random.default_rng(3)
    n, m, reps = 6, 2, 30_000
    lam = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    base = [rng.normal(size=4)]
    models = {i: [rng.normal(size=4)] for i in range(n)}
    target = sum(lam[i] * models[i][0] for i in range(n))
    # Execute
    out = np.empty((reps, 4))
    for r in range(reps):
        draws = sample_uniform(rng, n, m)
        coefs = aggregation_coefficients(draws, range(n), lam, mode="uniform")
        out[r] = combine_models(base, models, coefs)[0]
    # Assert
    se = out.std(axis=0, ddof=1) / np.sqrt(reps)
    assert np.all(np.abs(out.mean(axis=0) - target) < 5 * se)


def test_lambda_client_sampling_aggregate_is_unbiased_for_lambda_mixture():
    rng = np.random.default_rng(4)
    n, m, reps = 5, 3, 20_000
    lam = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
    base = [np.zeros(2)]
    models = {i: [rng.normal(size=2)] for i in range(n)}
    target = sum(lam[i] * models[i][0] for i in range(n))
    out = np.empty((reps, 2))
    for r in range(reps):
        draws = sample_by_lambda(rng, lam, m)
        out[r] = combine_models(base, models, aggregation_coefficients(draws, range(n), lam))[0]
    se = out.std(axis=0, ddof=1) / np.sqrt(reps)
    assert np.all(np.abs(out.mean(axis=0) - target) < 5 * se)


def test_aggregation_coefficients_by_hand():
    lam = np.array([0.5, 0.25, 0.25])
    # client 0 drawn twice, client 2 once, client 1 once but its reply failed
    assert aggregation_coefficients([0, 2, 0, 1], {0, 2}, lam) == {0: 2 / 3, 2: 1 / 3}
    assert aggregation_coefficients([0, 2, 0, 1], {0, 2}, lam, mode="uniform") == {0: 2 * 0.5 * 3 / 3,
                                                                                  2: 0.25 * 3 / 3}
    assert aggregation_coefficients([0, 1, 2], {0, 1}, lam, mode="full") == {0: 0.5 / 0.75, 1: 0.25 / 0.75}
    assert aggregation_coefficients([0, 1], set(), lam) == {}


def test_snapshot_steps_shared_and_per_client():
    rng = np.random.default_rng(5)
    shared = sample_snapshot_steps(rng, 10, 6, mode="shared")
    assert len(set(shared.tolist())) == 1 and 1 <= shared[0] <= 10
    per = np.concatenate([sample_snapshot_steps(rng, 4, 50, mode="per-client") for _ in range(20)])
    assert set(per.tolist()) == {1, 2, 3, 4}


def test_lambda_entropy():
    assert lambda_entropy(np.full(8, 1 / 8)) == pytest.approx(np.log(8))
    assert lambda_entropy(np.array([1.0, 0.0])) == 0.0


# =============================================================================== the round loop
def test_round_aggregate_counts_a_client_drawn_twice_twice_and_messages_it_once():
    # Prepare: N = 3 clients, m = 8 draws: duplicates are certain.
    app, grid, _ = _fake(3)
    strategy = DRFA(clients_per_round=8, local_steps=4, dual_lr=0.01, seed=1)
    # Execute
    res = _run(strategy, grid, rounds=1)
    # Assert: one train.drfa message per distinct client, each with the same t′ ...
    rec = strategy.history[0]
    train_msgs = [(pid, cfg) for t, pid, cfg in app.received if t == "train.drfa"]
    assert sorted(pid for pid, _ in train_msgs) == sorted(set(rec["sampled"]))
    assert len(rec["sampled"]) == 8 and len(train_msgs) < 8
    assert {cfg["snapshot-step"] for _, cfg in train_msgs} == {rec["snapshot_step"]}
    # ... and the model is the average over draws, duplicates counted: (1/m) Σ_k δ_{D_k}.
    expected = np.mean([app.deltas[p] for p in rec["sampled"]], axis=0)
    np.testing.assert_allclose(_w(res.arrays), expected, atol=1e-12)
    # The query went to w(t′) = (1/m) Σ_k (t′/τ) δ_{D_k}.
    q_w = [cfg for t, _, cfg in app.received if t == "query.loss"]
    assert q_w and all(c["loss-on"] == "batch" for c in q_w)


def test_strategy_lambda_step_is_unbiased_over_rounds():
    # With a tiny γ, λ stays interior, so (λ(s+1) − λ(s))/(τγ) = v − mean(v) every round;
    # averaged over rounds it must approach f − mean(f) (E[v] = f).
    n, tau, gamma, rounds = 5, 3, 1e-6, 600
    app, grid, losses = _fake(n, seed=2)
    strategy = DRFA(clients_per_round=2, local_steps=tau, dual_lr=gamma, seed=3, fraction_evaluate=0.0)
    _run(strategy, grid, rounds)
    lams = [np.full(n, 1 / n)] + [np.array([r["lambda"][str(i)] for i in range(n)]) for r in strategy.history]
    steps = np.diff(np.stack(lams), axis=0) / (tau * gamma)
    target = losses - losses.mean()
    se = steps.std(axis=0, ddof=1) / np.sqrt(rounds)
    assert np.all(np.abs(steps.mean(axis=0) - target) < 5 * se)
    # and each single step equals the hand-built v of that round's U
    for s, rec in enumerate(strategy.history[:20]):
        v = drfa_loss_vector(n, rec["queried"], losses[rec["queried"]])
        np.testing.assert_allclose(steps[s], v - v.mean(), atol=1e-6)


def test_seeded_strategy_run_is_repeatable():
    runs = []
    for seed in (5, 5, 6):
        _, grid, _ = _fake(6)
        st = DRFA(clients_per_round=3, local_steps=2, dual_lr=0.1, seed=seed, fraction_evaluate=0.0)
        _run(st, grid, 4)
        runs.append([(r["sampled"], r["queried"], r["snapshot_step"]) for r in st.history])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_per_client_snapshot_steps_differ_within_a_round():
    app, grid, _ = _fake(8)
    st = DRFA(clients_per_round=8, local_steps=10, snapshot="per-client", seed=0, fraction_evaluate=0.0)
    _run(st, grid, 3)
    steps = {cfg["snapshot-step"] for t, _, cfg in app.received if t == "train.drfa" and cfg["server-round"] == 1}
    assert len(steps) > 1
    assert isinstance(st.history[0]["snapshot_step"], dict)


def test_lambda_on_simplex_every_round_and_logged_by_partition():
    _, grid, _ = _fake(6)
    st = DRFA(clients_per_round=3, local_steps=5, dual_lr=0.5, regularizer="chi2", rho=0.01, seed=0)
    _run(st, grid, 10)
    for r in st.history:
        lam = np.array(list(r["lambda"].values()))
        assert sorted(r["lambda"]) == [str(i) for i in range(6)]
        assert lam.min() >= 0 and lam.sum() == pytest.approx(1.0, abs=1e-9)
        assert r["lambda_entropy"] == pytest.approx(lambda_entropy(lam))


def test_lambda_floor_and_dual_lr_decay_in_the_loop():
    _, grid, _ = _fake(5)
    st = DRFA(clients_per_round=2, local_steps=5, dual_lr=2.0, lambda_floor=0.05, dual_lr_decay=0.5, seed=0,
              fraction_evaluate=0.0)
    _run(st, grid, 6)
    for k, r in enumerate(st.history):
        assert min(r["lambda"].values()) >= 0.05 - 1e-12
        assert sum(r["lambda"].values()) == pytest.approx(1.0, abs=1e-12)
        assert r["dual_lr"] == pytest.approx(2.0 * 0.5**k)


def test_lambda_init_size_uses_num_examples_of_discovery():
    app, grid, _ = _fake(4)
    st = DRFA(clients_per_round=2, dual_lr=1e-9, lambda_init="size", seed=0, fraction_evaluate=0.0)
    _run(st, grid, 1)
    sizes = np.array([10, 20, 30, 40.0])
    lam = np.array([st.history[0]["lambda"][str(i)] for i in range(4)])
    np.testing.assert_allclose(lam, sizes / sizes.sum(), atol=1e-6)
    disc = [cfg for t, _, cfg in app.received if t == "query.loss" and cfg.get("loss-on") == "full"]
    assert len(disc) == 4  # one discovery query per node, on all local data


def test_output_model_average_is_mean_of_server_iterates():
    class Recording(DRFA):
        def train_round(self, *a, **k):
            out = super().train_round(*a, **k)
            self.iterates.append(_w(out[0]).copy())
            return out

    _, grid, _ = _fake(4)
    st = Recording(clients_per_round=2, local_steps=2, output_model="average", seed=0, fraction_evaluate=0.0)
    st.iterates = []
    res = _run(st, grid, 5)
    np.testing.assert_allclose(_w(res.arrays), np.mean(st.iterates, axis=0), atol=1e-12)


def test_full_participation_aggregate_is_lambda_mixture():
    app, grid, losses = _fake(4)
    st = DRFA(local_steps=1, dual_lr=0.1, full_participation=True, seed=0, fraction_evaluate=0.0)
    res = _run(st, grid, 1)
    # round 1: λ(1) uniform, so w̄(2) = Σ_i (1/4) δ_i; v = f exactly (everybody answered)
    np.testing.assert_allclose(_w(res.arrays), app.deltas.mean(axis=0), atol=1e-12)
    lam = np.array([st.history[0]["lambda"][str(i)] for i in range(4)])
    np.testing.assert_allclose(lam, project_simplex(0.25 + 0.1 * losses), atol=1e-12)


def test_every_train_reply_failing_keeps_model_and_skips_dual_step():
    faults = {k: Fault("raise", message_types=("train",)) for k in range(3)}
    _, grid, _ = _fake(3, faults=faults)
    st = DRFA(clients_per_round=2, seed=0, fraction_evaluate=0.0)
    res = _run(st, grid, 2)
    np.testing.assert_array_equal(_w(res.arrays), np.zeros(DIM))
    assert all(r["dual_step"].startswith("skipped") for r in st.history)
    assert all(v == pytest.approx(1 / 3) for v in st.history[-1]["lambda"].values())


def test_failed_query_rescales_v_by_number_of_answers():
    # partition 0 never answers query.loss; the λ step uses the m′ answers with factor N/m′
    _, grid, losses = _fake(4, faults={0: Fault("raise", message_types=("query.loss",))})
    st = DRFA(clients_per_round=4, local_steps=1, dual_lr=1e-6, seed=0, num_partitions=4)
    _run(st, grid, 3)
    for s in range(1, 3):
        rec, prev = st.history[s], st.history[s - 1]
        ids = [i for i in rec["queried"] if i != 0]
        lam0 = np.array([prev["lambda"][str(i)] for i in range(4)])
        lam1 = np.array([rec["lambda"][str(i)] for i in range(4)])
        if ids:
            v = drfa_loss_vector(4, ids, losses[ids])
            np.testing.assert_allclose((lam1 - lam0) / 1e-6, v - v.mean(), atol=1e-5)
    assert any(k.startswith("query:error") for r in st.history for k in r["failures"])


def test_vanished_node_is_skipped():
    _, grid, _ = _fake(4)
    gone = grid.node_ids[2]
    st = DRFA(clients_per_round=6, local_steps=2, seed=0)

    def drop(rec):
        if rec["round"] == 1 and gone in grid.node_ids:
            grid.node_ids.remove(gone)

    st.add_round_callback(drop)
    _run(st, grid, 4)
    later = st.history[1:]
    assert any(2 in r.get("absent", []) for r in later)
    assert all("2" not in r["client_acc"] for r in later)
    assert len(st.history) == 4


def test_new_partition_joining_extends_lambda():
    _, grid, _ = _fake(4)
    late = grid.node_ids.pop()  # partition 3 is not connected in round 1
    st = DRFA(clients_per_round=2, seed=0, fraction_evaluate=0.0)
    st.add_round_callback(lambda rec: grid.node_ids.append(late) if rec["round"] == 1 else None)
    _run(st, grid, 3)
    assert sorted(st.history[0]["lambda"]) == ["0", "1", "2"]
    assert sorted(st.history[-1]["lambda"]) == ["0", "1", "2", "3"]
    assert sum(st.history[-1]["lambda"].values()) == pytest.approx(1.0)


# =============================================================================== errors
@pytest.mark.parametrize("kwargs,param", [
    ({"clients_per_round": 5, "sample_with_replacement": False, "num_partitions": 4}, "clients_per_round"),
    ({"local_steps": 0}, "local_steps"),
    ({"dual_lr": 0.0}, "dual_lr"),
    ({"dual_lr": -1.0}, "dual_lr"),
    ({"rho": -0.1}, "rho"),
    ({"regularizer": "entropy"}, "regularizer"),
    ({"dual_lr_decay": 0.0}, "dual_lr_decay"),
    ({"dual_lr_decay": 1.5}, "dual_lr_decay"),
    ({"lambda_floor": 0.3, "num_partitions": 4}, "lambda_floor"),
    ({"lambda_floor": -0.1}, "lambda_floor"),
    ({"client_sampling": "random"}, "client_sampling"),
    ({"snapshot": "last"}, "snapshot"),
    ({"lambda_init": "zeros"}, "lambda_init"),
    ({"output_model": "best"}, "output_model"),
])
def test_construction_errors_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param):
        DRFA(**kwargs)


def test_unknown_regularizer_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="none, kl, chi2, l2"):
        DRFA(regularizer="tv")


@pytest.mark.parametrize("name,rc,key", [
    ("drfa", {"clients-per-round": 5, "sample-with-replacement": False, "num-partitions": 4}, "clients-per-round"),
    ("drfa", {"local-steps": 0}, "local-steps"),
    ("drfa", {"dual-lr": 0.0}, "dual-lr"),
    ("drfa-prox", {"rho": -1.0}, "rho"),
    ("drfa-prox", {"regularizer": "tv"}, "regularizer"),
    ("drfa-prox", {"regularizer": "none"}, "regularizer"),
    ("drfa", {"lambda-floor": 0.5, "num-partitions": 4}, "lambda-floor"),
    ("afl", {"dual-lr-decay": 2.0}, "dual-lr-decay"),
])
def test_registry_errors_name_the_run_config_key(name, rc, key):
    with pytest.raises(ValueError, match=key):
        build_strategy(name, rc)


def test_m_greater_than_n_without_replacement_detected_at_first_round_when_n_unknown():
    _, grid, _ = _fake(3)
    st = DRFA(clients_per_round=5, sample_with_replacement=False)
    with pytest.raises(ValueError, match="clients_per_round"):
        _run(st, grid, 1)


def test_public_dual_step_scale_drops_tau_n_over_m():
    # public step: λ + γ Σ_{k∈U′} 1[k=i] f_i (duplicates counted), projected; worked by hand
    lam = np.array([0.25, 0.25, 0.25, 0.25])
    got = dual_step(lam, [1, 1, 3], [0.2, 0.2, 0.1], tau=10, gamma=0.5, scale="public")
    # raw = λ + 0.5·(0, 0.4, 0, 0.1) = (0.25, 0.45, 0.25, 0.30), sum 1.25 → shift by 0.0625
    np.testing.assert_allclose(got, [0.1875, 0.3875, 0.1875, 0.2375], atol=1e-15)
    # the paper's step on the same input is τN/m′ = 10·4/3 times larger before projecting
    paper = dual_step(lam, [1, 1, 3], [0.2, 0.2, 0.1], tau=10, gamma=0.5 * 3 / 40)
    np.testing.assert_allclose(paper, got, atol=1e-15)
    # prox variant: the same as the paper's prox step with τ = 1 and the rescaled vector
    rng = np.random.default_rng(5)
    lam = rng.dirichlet(np.ones(6))
    ids, losses = [0, 2, 2, 5], rng.uniform(0, 3, size=4)
    got = dual_step(lam, ids, losses, tau=7, gamma=0.3, regularizer="kl", rho=0.2, scale="public")
    v = drfa_loss_vector(6, ids, list(losses)) * 4 / 6
    np.testing.assert_allclose(got, drfa_prox_step(lam, v, 1, 0.3, "kl", 0.2), atol=1e-12)
    with pytest.raises(ValueError, match="scale"):
        dual_step(lam, ids, losses, tau=1, gamma=0.1, scale="nope")
    with pytest.raises(ValueError, match="dual_step_scale"):
        DRFA(dual_step_scale="typo")
    assert build_strategy("drfa", {"dual-step-scale": "public"}).dual_step_scale == "public"
    assert build_strategy("drfa", {}).dual_step_scale == "paper"


def test_registry_builds_each_variant():
    assert build_strategy("afl", {"local-steps": 10}).local_steps == 1
    full = build_strategy("afl-full", {})
    assert full.full_participation and full.local_steps == 1
    prox = build_strategy("drfa-prox", {"regularizer": "chi2", "rho": 0.5})
    assert (prox.regularizer, prox.rho) == ("chi2", 0.5)
    d = build_strategy("drfa", {"client-sampling": "uniform", "snapshot": "per-client", "dual-lr-decay": 0.9,
                                "lambda-floor": 1e-3, "output-model": "average", "clients-per-round": 4})
    assert (d.client_sampling, d.snapshot, d.dual_lr_decay, d.lambda_floor, d.output_model,
            d.clients_per_round) == ("uniform", "per-client", 0.9, 1e-3, "average", 4)
