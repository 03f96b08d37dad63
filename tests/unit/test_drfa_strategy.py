"""DRFA / DRFA-Prox / AFL strategy: the round loop against a fake ClientApp.

The fake ClientApp (``_FakeApp``) answers with known numbers: ``train.drfa`` returns
w + δ_i (final) and w + (t′/τ)·δ_i (snapshot) for fixed vectors δ_i, ``query.loss`` returns
a fixed loss f_i (or, with ``centers``, f_i + ‖w − z_i‖², a loss of the received model), so
every expected value below is computed by hand from δ, f and z.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from flowerdro.core.drfa import loss_vector
from flowerdro.core.simplex import lambda_entropy, project_simplex
from flowerdro.experiments.inprocess import Fault, InProcessGrid
from flowerdro.strategies import build_strategy
from flowerdro.strategies.drfa import DRFA, DRFAProx

DIM = 3


class _FakeApp:
    """A ClientApp stand-in with known replies; records every message it receives."""

    def __init__(self, deltas: np.ndarray, losses: np.ndarray, centers: np.ndarray | None = None) -> None:
        self.deltas, self.losses, self.centers = deltas, losses, centers
        self.received: list[tuple[str, int, dict]] = []
        self.queried_models: list[tuple[int, int, np.ndarray]] = []  # (round, partition, w) of query.loss

    def loss(self, pid: int, w: np.ndarray) -> float:
        """f_i, or f_i + ‖w − z_i‖² with centers."""
        if self.centers is None:
            return float(self.losses[pid])
        return float(self.losses[pid] + np.sum((w - self.centers[pid]) ** 2))

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
            metrics["loss"] = self.loss(pid, w)
            self.queried_models.append((int(cfg["server-round"]), pid, w.copy()))
        elif mtype == "evaluate":
            metrics.update({"test_acc": 0.5, "test_loss": float(self.losses[pid])})
        content["metrics"] = MetricRecord(metrics)
        return Message(content=content, reply_to=msg)


def _fake(n: int, seed: int = 0, faults: dict | None = None, model_loss: bool = False
          ) -> tuple[_FakeApp, InProcessGrid, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    deltas = rng.normal(size=(n, DIM)).astype(np.float64)
    losses = rng.uniform(0.5, 2.0, size=n)
    app = _FakeApp(deltas, losses, rng.normal(size=(n, DIM)) if model_loss else None)
    return app, InProcessGrid(app, n, {}, faults=faults or {}), losses


def _init() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(DIM, dtype=np.float64))})


def _w(arrays: ArrayRecord) -> np.ndarray:
    return arrays["w"].numpy()


def _run(strategy: DRFA, grid: InProcessGrid, rounds: int):
    return strategy.start(grid, _init(), num_rounds=rounds, timeout=60, train_config=ConfigRecord({"seed": 0}))


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
    np.testing.assert_allclose(_w(res.arrays), expected, atol=1e-12)  # float64 mean of ≤ 8 vectors of size ~1
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
    # CLT over 600 rounds: each mean within 5 standard errors of E[v] − mean (probability of failure
    # < 1e-6 per entry)
    assert np.all(np.abs(steps.mean(axis=0) - target) < 5 * se)
    # and each single step equals the hand-built v of that round's U
    for s, rec in enumerate(strategy.history[:20]):
        v = loss_vector(n, rec["queried"], losses[rec["queried"]])
        np.testing.assert_allclose(steps[s], v - v.mean(), atol=1e-6)  # λ's float64 rounding (~1e-16) over τγ = 3e-6


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
    st = DRFAProx(clients_per_round=3, local_steps=5, dual_lr=0.5, regularizer="chi2", rho=0.01, seed=0)
    _run(st, grid, 10)
    for r in st.history:
        lam = np.array(list(r["lambda"].values()))
        assert sorted(r["lambda"]) == [str(i) for i in range(6)]
        # λ is float64 on the simplex: sum within n·eps of 1 (1e-9 is ample); entropy of the same λ:
        # default approx
        assert lam.min() >= 0 and lam.sum() == pytest.approx(1.0, abs=1e-9)
        assert r["lambda_entropy"] == pytest.approx(lambda_entropy(lam))


def test_lambda_floor_and_dual_lr_decay_in_the_loop():
    _, grid, _ = _fake(5)
    st = DRFA(clients_per_round=2, local_steps=5, dual_lr=2.0, lambda_floor=0.05, dual_lr_decay=0.5, seed=0,
              fraction_evaluate=0.0)
    _run(st, grid, 6)
    for k, r in enumerate(st.history):
        assert min(r["lambda"].values()) >= 0.05 - 1e-12
        # float64 floor projection: floor and sum kept up to n·eps; 2·0.5^k is exact in binary
        assert sum(r["lambda"].values()) == pytest.approx(1.0, abs=1e-12)
        assert r["dual_lr"] == pytest.approx(2.0 * 0.5**k)


def test_lambda_init_size_uses_num_examples_of_discovery():
    app, grid, _ = _fake(4)
    st = DRFA(clients_per_round=2, dual_lr=1e-9, lambda_init="size", seed=0, fraction_evaluate=0.0)
    _run(st, grid, 1)
    sizes = np.array([10, 20, 30, 40.0])
    lam = np.array([st.history[0]["lambda"][str(i)] for i in range(4)])
    np.testing.assert_allclose(lam, sizes / sizes.sum(), atol=1e-6)  # one λ step τγ(N/m)f ≤ 1e-7 at γ = 1e-9
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
    np.testing.assert_allclose(_w(res.arrays), np.mean(st.iterates, axis=0), atol=1e-12)  # float64 running mean of 5 iterates


def test_full_participation_aggregate_is_lambda_mixture():
    app, grid, losses = _fake(4)
    st = DRFA(local_steps=1, dual_lr=0.1, full_participation=True, seed=0, fraction_evaluate=0.0)
    res = _run(st, grid, 1)
    # round 1: λ(1) uniform, so w̄(2) = Σ_i (1/4) δ_i; v = f exactly (everybody answered)
    np.testing.assert_allclose(_w(res.arrays), app.deltas.mean(axis=0), atol=1e-12)  # float64 sums of 4 terms of size ~1
    lam = np.array([st.history[0]["lambda"][str(i)] for i in range(4)])
    np.testing.assert_allclose(lam, project_simplex(0.25 + 0.1 * losses), atol=1e-12)  # float64 sums of 4 terms of size ~1


def test_every_train_reply_failing_keeps_model_and_skips_dual_step():
    faults = {k: Fault("raise", message_types=("train",)) for k in range(3)}
    _, grid, _ = _fake(3, faults=faults)
    st = DRFA(clients_per_round=2, seed=0, fraction_evaluate=0.0)
    res = _run(st, grid, 2)
    np.testing.assert_array_equal(_w(res.arrays), np.zeros(DIM))
    assert all(r["dual_step"].startswith("skipped") for r in st.history)
    # 1/3 from float64 normalisation: ≤ 1 ulp; default approx (rel 1e-6) is ample
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
            v = loss_vector(4, ids, losses[ids])
            np.testing.assert_allclose((lam1 - lam0) / 1e-6, v - v.mean(), atol=1e-5)  # λ's float64 rounding (~1e-16) over γ = 1e-6
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
    # λ is float64 on the simplex: the sum is within n·eps of 1; default approx (rel 1e-6) is ample
    assert sum(st.history[-1]["lambda"].values()) == pytest.approx(1.0)


def _lam(rec: dict, n: int) -> np.ndarray:
    return np.array([rec["lambda"][str(i)] for i in range(n)])


def test_loss_query_receives_the_snapshot_average_and_lambda_follows_its_losses():
    # f_i(w) = f_i + ‖w − z_i‖²: the λ step reveals which model the losses were taken at.
    n, tau, gamma = 4, 4, 1e-4
    app, grid, _ = _fake(n, seed=3, model_loss=True)
    st = DRFA(clients_per_round=3, local_steps=tau, dual_lr=gamma, seed=2, fraction_evaluate=0.0)
    _run(st, grid, 2)
    w_bar, lam = np.zeros(DIM), np.full(n, 1 / n)
    for s, rec in enumerate(st.history, start=1):
        t_prime, sampled, queried = rec["snapshot_step"], rec["sampled"], rec["queried"]
        assert t_prime < tau, "the snapshot is the final model in this round; choose another seed"
        step = np.mean([app.deltas[p] for p in sampled], axis=0)
        w_snap, w_next = w_bar + (t_prime / tau) * step, w_bar + step  # w(t′) and w̄(s+1)
        # the round's loss queries are its last messages of that type (round 1 may start with discovery)
        got = [w for rnd, _, w in app.queried_models if rnd == s][-len(set(queried)):]
        assert got and all(np.allclose(w, w_snap, rtol=0, atol=1e-15) for w in got)  # float64 sums of 3 terms

        def lam_after(w, lam=lam, queried=queried):
            # interior of the simplex: λ⁺ = λ + τγ(v − mean v), v_i = (N/m) Σ_{k∈U} 1[k=i] f_i(w)
            v = np.zeros(n)
            for i in queried:
                v[i] += app.loss(i, w) * n / len(queried)
            return lam + tau * gamma * (v - v.mean())

        # the same float64 update on O(1) numbers: differs by at most a few ulps (≈1e-16)
        np.testing.assert_allclose(_lam(rec, n), lam_after(w_snap), rtol=0, atol=1e-15)
        for wrong in (w_bar, w_next):  # the test has teeth: the other models give another λ
            assert np.abs(lam_after(wrong) - lam_after(w_snap)).max() > 1e-7
        w_bar, lam = w_next, _lam(rec, n)


def test_without_replacement_the_round_uses_the_ordered_unbiased_weights():
    # λ uniform over 3 clients, draws (i, j) in this order: t_1 = w_i, t_2 = (1/3) w_i + (2/3) w_j,
    # so w̄(2) = (2/3) δ_i + (1/3) δ_j, not the mean (1/2)(δ_i + δ_j).
    app, grid, _ = _fake(3)
    st = DRFA(clients_per_round=2, sample_with_replacement=False, local_steps=2, dual_lr=0.01, seed=4,
              fraction_evaluate=0.0)
    res = _run(st, grid, 1)
    i, j = st.history[0]["sampled"]
    np.testing.assert_allclose(_w(res.arrays), (2 / 3) * app.deltas[i] + (1 / 3) * app.deltas[j], atol=1e-15)  # float64 sum of 2 terms


def test_a_round_without_a_new_model_neither_decays_gamma_nor_enters_the_average():
    # round 2: every train reply fails (no new model); round 3: every loss query fails (new
    # model, no λ step). γ decays after rounds 1 and 4 only; ŵ averages the models of rounds 1, 3, 4.
    faults = {k: Fault("raise", message_types=("train",), rounds=(2,)) for k in range(3)}
    app, grid, _ = _fake(3, faults=faults)
    st = DRFA(clients_per_round=2, local_steps=2, dual_lr=0.1, dual_lr_decay=0.5, output_model="average",
              seed=0, fraction_evaluate=0.0)
    query_fault = Fault("raise", message_types=("query.loss",), rounds=(3,))

    def switch(rec):  # after round 2, the loss queries of round 3 fail instead
        if rec["round"] == 2:
            grid.faults = dict.fromkeys(range(3), query_fault)

    st.add_round_callback(switch)
    res = _run(st, grid, 4)
    hist = st.history
    assert [r["dual_lr"] for r in hist] == [0.1, 0.05, 0.05, 0.05]
    assert [r["dual_step"].split(":")[0] for r in hist] == ["2/2 losses", "skipped", "skipped", "2/2 losses"]
    assert _lam(hist[0], 3).tolist() == _lam(hist[1], 3).tolist() == _lam(hist[2], 3).tolist()
    w1 = np.mean([app.deltas[p] for p in hist[0]["sampled"]], axis=0)
    w3 = w1 + np.mean([app.deltas[p] for p in hist[2]["sampled"]], axis=0)
    w4 = w3 + np.mean([app.deltas[p] for p in hist[3]["sampled"]], axis=0)
    np.testing.assert_allclose(_w(res.arrays), (w1 + w3 + w4) / 3, atol=1e-15)  # float64 sums of ≤ 6 terms of size ~1


def test_default_dual_lr_follows_n_tau_and_the_step_scale_and_a_given_one_is_kept():
    # γ = 1/(2τN·10) for the paper's step, 1/(2m·10) for the public one; N = 20, τ = 10 by default
    cases = [({"clients_per_round": 4}, 0.5 / (10 * 20 * 10)), ({"local_steps": 2}, 0.5 / (2 * 20 * 10)),
             ({"clients_per_round": 4, "dual_lr": 0.05}, 0.05), ({"full_participation": True}, 0.5 / (10 * 20 * 10)),
             ({"clients_per_round": 4, "dual_step_scale": "public"}, 0.5 / (4 * 10)),
             ({"clients_per_round": 30, "dual_step_scale": "public"}, 0.5 / (30 * 10))]
    for kwargs, gamma in cases:
        _, grid, _ = _fake(20)
        st = DRFA(seed=0, fraction_evaluate=0.0, **kwargs)
        _run(st, grid, 1)
        # γ from a float64 formula of exact inputs: ≤ 1 ulp; rel 1e-15 ≈ 4 ulps
        assert st.history[0]["dual_lr"] == pytest.approx(gamma, rel=1e-15), kwargs


# =============================================================================== errors
@pytest.mark.parametrize("kwargs,key", [
    ({"clients_per_round": 5, "sample_with_replacement": False, "num_partitions": 4}, "clients-per-round"),
    ({"local_steps": 0}, "local-steps"),
    ({"dual_lr": 0.0}, "dual-lr"),
    ({"dual_lr": -1.0}, "dual-lr"),
    ({"dual_lr_decay": 0.0}, "dual-lr-decay"),
    ({"dual_lr_decay": 1.5}, "dual-lr-decay"),
    ({"lambda_floor": 0.3, "num_partitions": 4}, "lambda-floor"),
    ({"lambda_floor": -0.1}, "lambda-floor"),
    ({"client_sampling": "random"}, "client-sampling"),
    ({"snapshot": "last"}, "snapshot"),
    ({"lambda_init": "zeros"}, "lambda-init"),
    ({"output_model": "best"}, "output-model"),
    ({"dual_step_scale": "typo"}, "dual-step-scale"),
])
def test_construction_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        DRFA(**kwargs)


def test_drfa_has_no_regularizer_and_drfa_prox_lists_the_allowed_ones():
    with pytest.raises(TypeError, match="regularizer"):
        DRFA(regularizer="kl")
    with pytest.raises(ValueError, match="regularizer: unknown value 'tv'; allowed: kl, chi2, l2"):
        DRFAProx(regularizer="tv")
    with pytest.raises(ValueError, match="rho: must be >= 0"):
        DRFAProx(rho=-0.1)


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
    with pytest.raises(ValueError, match="clients-per-round"):
        _run(st, grid, 1)


def test_registry_builds_each_variant():
    afl = build_strategy("afl", {"local-steps": 10})
    assert afl.training.local_steps == 1 and not afl.config.full_participation
    full = build_strategy("afl-full", {"local-steps": 10})
    assert full.config.full_participation and full.training.local_steps == 1
    prox = build_strategy("drfa-prox", {"regularizer": "chi2", "rho": 0.5})
    assert prox.regularizer() == ("chi2", 0.5)
    assert build_strategy("drfa-prox", {}).regularizer() == ("kl", 0.1)
    # a comparison's shared run config may hold drfa-prox's keys: plain DRFA and AFL ignore them
    for name in ("drfa", "afl", "afl-full"):
        assert build_strategy(name, {"regularizer": "chi2", "rho": 0.5}).regularizer() == ("none", 0.0)
    d = build_strategy("drfa", {"client-sampling": "uniform", "snapshot": "per-client", "dual-lr-decay": 0.9,
                                "lambda-floor": 1e-3, "output-model": "average", "clients-per-round": 4,
                                "dual-step-scale": "public", "loss-on": "full"})
    c = d.config
    assert (c.client_sampling, c.snapshot, c.dual_lr_decay, c.lambda_floor, c.output_model, c.clients_per_round,
            c.dual_step_scale, c.query_loss_on, c.dual_lr) == ("uniform", "per-client", 0.9, 1e-3, "average", 4,
                                                                 "public", "full", None)
