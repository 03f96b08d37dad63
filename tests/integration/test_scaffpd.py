"""SCAFF-PD and SCAFFOLD against in-process clients, checked with independent solves (cvxpy, closed forms)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import client_config
from flowerdro.core.simplex import project_simplex
from flowerdro.data import DataConfig, load_federated
from flowerdro.experiments import Fault, InProcessGrid
from flowerdro.experiments.references import chi2_dro_regression_saddle_point
from flowerdro.strategies import SCAFFPD, build_strategy, initial_arrays

cp = pytest.importorskip("cvxpy")

N, D, M, MU = 4, 5, 30, 0.1
RC = {"dataset": "robust-regression", "model": "linear", "precision": "float64", "num-partitions": N,
      "regression-dim": D, "samples-per-client": M, "weight-decay": MU, "batch-size": 1000,
      "lr": 0.04, "local-steps": 10, "dual-lr": 0.05, "fraction-evaluate": 0.0}
ROUNDS = 70  # ~35-40 rounds reach 1e-11 here (linear rate); margin for the failure tests
# ‖x^R − x*‖² ≤ 1e-10‖x*‖², i.e. a distance of 1e-5 relative: the size of the saddle-point
# residual the cvxpy reference is checked to (see saddle_point), so what it can certify.
SADDLE = 1e-10


def _data(n: int = N) -> list[tuple[np.ndarray, np.ndarray]]:
    clients = load_federated(DataConfig.from_run_config(RC, num_partitions=n))
    return [(c.x_train.astype(np.float64), c.y_train.astype(np.float64)) for c in clients]


def _losses(data, x):
    return np.array([np.mean((a @ x - y) ** 2) + MU / 2 * x @ x for a, y in data])


def saddle_point(data, rho: float) -> np.ndarray:
    """x* from an independent solver (cvxpy), checked to be a saddle point."""
    xs, _, residual = chi2_dro_regression_saddle_point(data, rho, MU)
    # cvxpy's interior-point solver stops at gaps ≈ 1e-8; its saddle-point residual is well within
    # 1e-5 relative
    assert residual <= 1e-5 * max(1.0, np.linalg.norm(xs))
    return xs


def _run(rc: dict, rounds: int, faults: dict | None = None, n: int = N):
    grid = InProcessGrid(client_app, n, rc, faults=faults or {})
    strategy = build_strategy("scaffpd", rc)
    init = initial_arrays(grid, rc, 60)
    res = strategy.start(grid, init, num_rounds=rounds, timeout=60, train_config=client_config(rc))
    return strategy, res.arrays["linear.weight"].numpy().ravel()


@pytest.mark.parametrize("rho", [0.01, 0.05, 0.1])
def test_scaffpd_converges_linearly_to_the_cvxpy_saddle_point(rho):
    # Prepare: the saddle point from an independent solver
    data = _data()
    xs = saddle_point(data, rho)
    # Execute: deterministic (full-batch) SCAFF-PD
    strategy, x = _run({**RC, "rho": rho}, rounds=ROUNDS)
    # Assert: ‖x^R − x*‖² ≤ 1e-10 ‖x*‖², and λ^R = Π_Δ(1/N + f(x*)/(ρN)) (the inner argmax)
    assert np.sum((x - xs) ** 2) <= SADDLE * np.sum(xs ** 2)
    lam_star = project_simplex(1.0 / N + _losses(data, xs) / (rho * N))
    lam = np.array([strategy.lam[p] for p in range(N)])
    np.testing.assert_allclose(lam, lam_star, atol=1e-5)  # λ* from the ~1e-6-accurate cvxpy x*, times 1/(ρN)


def test_rule_51_schedule_also_converges_to_the_saddle_point():
    rho = 0.1
    xs = saddle_point(_data(), rho)
    strategy, x = _run({**RC, "rho": rho, "step-rule": "5.1"}, rounds=ROUNDS)  # μ_x = weight-decay
    h = strategy.history
    assert h[-1]["tau"] < h[0]["tau"] and h[-1]["sigma"] > h[0]["sigma"]  # τ_r ↓, σ_r ↑ (γ_r grows)
    assert h[-1]["tau"] * h[-1]["sigma"] == pytest.approx(h[0]["tau"] * h[0]["sigma"])
    assert np.sum((x - xs) ** 2) <= SADDLE * np.sum(xs ** 2)


def test_one_round_equals_the_algorithm_by_hand():
    # Prepare
    rho, sigma, lr, steps = 0.1, RC["dual-lr"], RC["lr"], RC["local-steps"]
    data = _data()
    x0 = np.zeros(D)  # the linear model starts at zero
    # Execute
    _, x1 = _run({**RC, "rho": rho}, rounds=1)
    # Assert: L, c_i, λ¹ = Π_Δ((λ⁰ + σL + σρ)/(1 + σρN)), c, local steps, x¹ = x⁰ − τ Σλ_i Δu_i
    grads = [2 / M * a.T @ (a @ x0 - y) + MU * x0 for a, y in data]
    lam = project_simplex((np.full(N, 1 / N) + sigma * _losses(data, x0) + sigma * rho) / (1 + sigma * rho * N))
    c = sum(l * g for l, g in zip(lam, grads, strict=True))
    direction = np.zeros(D)
    for (a, y), g, w in zip(data, grads, lam, strict=True):
        u = x0.copy()
        for _ in range(steps):
            u = u - lr * (2 / M * a.T @ (a @ u - y) + MU * u - g + c)
        direction += w * (x0 - u) / (lr * steps)
    np.testing.assert_allclose(x1, x0 - lr * steps * direction, rtol=1e-10)  # float64 clients, J = 10 steps


def test_phase1_failure_reuses_last_loss_and_gradient_and_still_converges():
    rho = 0.05
    xs = saddle_point(_data(), rho)
    faults = {1: Fault("raise", message_types=("query.loss_grad",), rounds=(3, 4, 5))}
    strategy, x = _run({**RC, "rho": rho}, rounds=ROUNDS, faults=faults)
    hist = {h["round"]: h for h in strategy.history}
    assert hist[3]["failures"] == {"query:error": 1} and hist[3]["reused"] == [1]
    assert hist[3]["substituted"] == [1]  # not trained this round: Δu_1 := c^r
    assert "reused" not in hist[6]
    assert np.sum((x - xs) ** 2) <= SADDLE * np.sum(xs ** 2)


def test_phase2_failure_every_round_still_reaches_the_exact_saddle_point():
    rho = 0.1
    xs = saddle_point(_data(), rho)
    strategy, x = _run({**RC, "rho": rho}, rounds=ROUNDS, faults={0: Fault("raise", message_types=("train",))})
    assert all(h["failures"] == {"train:error": 1} and h["substituted"] == [0] for h in strategy.history)
    assert np.sum((x - xs) ** 2) <= SADDLE * np.sum(xs ** 2)


def test_exclude_policy_drops_a_dead_client_and_solves_the_rest():
    rho = 0.1
    data = _data()
    xs_rest = saddle_point([d for i, d in enumerate(data) if i != 2], rho)
    faults = {2: Fault("raise", message_types=("query.loss_grad",))}
    strategy, x = _run({**RC, "rho": rho, "on-failure": "exclude"}, rounds=ROUNDS, faults=faults)
    assert all(h["excluded"] == [2] for h in strategy.history)
    assert strategy.lam[2] == pytest.approx(1 / N)  # frozen: never observed
    assert np.sum((x - xs_rest) ** 2) <= SADDLE * np.sum(xs_rest ** 2)


def test_phase2_failure_with_exclude_policy_completes():
    faults = {3: Fault("raise", message_types=("train",), rounds=(2,))}
    strategy, x = _run({**RC, "rho": 0.1, "on-failure": "exclude"}, rounds=3, faults=faults)
    assert strategy.history[1]["failures"] == {"train:error": 1}
    assert np.all(np.isfinite(x))


def test_scaffpd_runs_on_classification_with_minibatches(synth_rc):
    rc = {**synth_rc, "grad-on": "batch", "local-steps": 3, "lr": 0.05, "dual-lr": 0.05}
    grid = InProcessGrid(client_app, 4, rc)
    strategy = build_strategy("scaffpd", rc)
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=2, timeout=60, train_config=client_config(rc))
    last = strategy.history[-1]
    # λ is float64 on the simplex: the sum is within n·eps of 1; default approx (rel 1e-6) is ample
    assert "acc_mean" in last and sum(last["lambda"].values()) == pytest.approx(1.0)
    assert not strategy.failures


def test_scaffold_full_participation_converges_to_the_average_risk_minimiser():
    # Prepare: x̄ = argmin (1/N) Σ f_i, closed form
    data = _data()
    h = sum(2 / M * a.T @ a for a, _ in data) / N + MU * np.eye(D)
    b = sum(2 / M * a.T @ y for a, y in data) / N
    x_bar = np.linalg.solve(h, b)
    rc = {**RC, "lr": 0.02, "local-steps": 20}
    grid = InProcessGrid(client_app, N, rc)
    strategy = build_strategy("scaffold", rc)
    res = strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=40, timeout=60,
                         train_config=client_config(rc))
    x = res.arrays["linear.weight"].numpy().ravel()
    assert np.sum((x - x_bar) ** 2) <= 1e-12 * np.sum(x_bar ** 2)  # closed form, float64: linear rate to ~1e-16
    # the server control is the mean of the clients' c_i, which the server keeps per partition
    # (float64 sums of N = 4 terms of size ~1: 1e-10 is far above their rounding)
    assert sorted(strategy.state.client_controls) == list(range(N))
    cis = [strategy.state.client_controls[p][0].ravel() for p in range(N)]
    np.testing.assert_allclose(strategy.control[0].ravel(), np.mean(cis, axis=0), atol=1e-10)
    assert not any(ctx.state.array_records for ctx in grid.contexts.values())  # clients keep nothing


def test_scaffold_partial_participation_and_failures(synth_rc):
    rc = {**synth_rc, "fraction-train": 0.5}
    faults = {1: Fault("raise", message_types=("train",))}
    grid = InProcessGrid(client_app, 6, rc, faults=faults)
    strategy = build_strategy("scaffold", rc)
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=3, timeout=60, train_config=client_config(rc))
    assert len(strategy.history) == 3 and "acc_mean" in strategy.history[-1]
    assert grid.calls > 0
    trained = sorted(strategy.state.client_controls)
    assert 0 < len(trained) <= 6 and 1 not in trained  # partition 1 never answers: no c_1


# --------------------------------------------------------------------------- how s^r is fed across rounds
#: L^r of partitions 0, 1, 2 in rounds 1, 2, 3 (the fake clients' losses, whatever the model).
LOSSES = {1: (1.0, 2.0, 3.0), 2: (3.0, 1.0, 2.0), 3: (2.0, 2.0, 5.0)}


def _fake_clients() -> ClientApp:
    """Clients whose loss in round r is LOSSES[r], with zero gradients and no local progress."""
    app = ClientApp()

    def metrics(ctx: Context, **extra) -> MetricRecord:
        return MetricRecord({"num-examples": 1, "partition-id": int(ctx.node_config["partition-id"]), **extra})

    @app.query("loss_grad")
    def _query(msg: Message, ctx: Context) -> Message:
        arrays = msg.content["arrays"]
        loss = LOSSES[int(msg.content["config"]["server-round"])][int(ctx.node_config["partition-id"])]
        grad = ArrayRecord({k: Array(np.zeros_like(arrays[k].numpy())) for k in arrays.keys()})
        return Message(content=RecordDict({"grad": grad, "metrics": metrics(ctx, loss=loss)}), reply_to=msg)

    @app.train("scaffpd")
    def _train(msg: Message, ctx: Context) -> Message:
        return Message(content=RecordDict({"arrays": msg.content["arrays"], "metrics": metrics(ctx)}), reply_to=msg)

    return app


@pytest.mark.parametrize("theta,expected", [
    # AFL, σ = 0.1, λ⁰ = 1/3: interior steps, so Π_Δ(λ + σs) = λ + σ(s − mean s).
    # θ = 0.5: s¹ = L¹ = (1, 2, 3); s² = 1.5(3, 1, 2) − 0.5(1, 2, 3) = (4, 0.5, 1.5);
    #          s³ = 1.5(2, 2, 5) − 0.5(3, 1, 2) = (1.5, 2.5, 6.5)
    (0.5, [(-0.1, 0.0, 0.1), (0.1, -0.15, 0.05), (-0.1, -0.25, 0.35)]),
    # θ unset: AFL has μ_y = 0, so θ = 1: s² = 2(3, 1, 2) − (1, 2, 3) = (5, 0, 1);
    #          s³ = 2(2, 2, 5) − (3, 1, 2) = (1, 3, 8)
    (None, [(-0.1, 0.0, 0.1), (0.2, -0.2, 0.0), (-0.1, -0.3, 0.4)]),
])
def test_lambda_follows_the_extrapolated_step_fed_with_the_previous_rounds_losses(theta, expected):
    strategy = SCAFFPD(objective="afl", dual_lr=0.1, theta=theta, fraction_evaluate=0.0)
    grid = InProcessGrid(_fake_clients(), 3, {})
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(2))}), num_rounds=3, timeout=60)
    lams = [[r["lambda"][str(p)] for p in range(3)] for r in strategy.history]
    # λ^r = 1/3 + the offsets above; a few float64 operations on O(1) numbers
    np.testing.assert_allclose(lams, np.array(expected) + 1 / 3, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- crash and resume, restarts
def _experiment(name: str, rc: dict, root) -> dict:
    return {"name": "resume", "num-rounds": 4, "seeds": [0], "num-partitions": 4, "strategies": [name],
            "run-config": {**rc, "checkpoint-every": 1}, "output-root": str(root)}


@pytest.mark.parametrize("name,rc", [
    ("scaffpd", {"grad-on": "batch", "local-steps": 3, "step-rule": "5.1", "weight-decay": 0.01}),
    ("scaffold", {"fraction-train": 0.5}),
])
def test_a_run_resumed_after_a_crash_equals_an_uninterrupted_run(synth_rc, name, rc, crash_and_resume):
    crash_and_resume(name, lambda root: _experiment(name, {**synth_rc, **rc}, root))


class _RestartAfterTraining(InProcessGrid):
    """Partition ``restart``'s node restarts (new node id, empty Context) right after training in round ``at``."""

    def __init__(self, *args, restart: int, at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.restart, self.at = restart, at
        self.old_id = self.node_ids[restart]
        self.new_id = self.old_id + 1  # keeps the sorted order of the node ids, so sampling is unchanged
        assert self.new_id not in self.node_ids

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        rounds = {int(m.content["config"]["server-round"]) for m in messages if m.metadata.message_type ==
                  "train.scaffold"}
        if self.at in rounds:
            ctx = self.contexts.pop(self.old_id)
            self.contexts[self.new_id] = Context(run_id=1, node_id=self.new_id, node_config=ctx.node_config,
                                                 state=RecordDict(), run_config=ctx.run_config)
            self.partition_of_node[self.new_id] = self.restart
            self.node_ids = sorted(self.contexts)
        return replies


def test_scaffold_a_node_restarted_under_a_new_id_keeps_its_partitions_control(synth_rc):
    rc = {**synth_rc, "fraction-train": 1.0}

    def final(grid):
        strategy = build_strategy("scaffold", rc)
        res = strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=4, timeout=60,
                             train_config=client_config(rc))
        return strategy, res.arrays

    plain, plain_x = final(InProcessGrid(client_app, 4, rc))
    grid = _RestartAfterTraining(client_app, 4, rc, restart=1, at=2)
    restarted, restarted_x = final(grid)
    # the evaluation of round 2 tells the server the new node's partition, so round 3 sends it c − c_1
    assert restarted.partition(grid.new_id) == 1 and grid.old_id not in grid.contexts
    assert [r["control_norm"] for r in restarted.history] == [r["control_norm"] for r in plain.history]
    for k in plain_x.keys():
        np.testing.assert_array_equal(restarted_x[k].numpy(), plain_x[k].numpy())


# --------------------------------------------------------------------------- SCAFFOLD's server step by hand
def test_scaffold_server_step_by_hand_with_partial_participation():
    """x ← x + η_g mean_S(y_i − x) and c ← c + Σ_S(c_i⁺ − c_i)/N, replayed with exact numbers.

    Fake client i replies y_i = x + (i+1)·(1, 2) and c_i⁺ = r·(i+1)·(1, −1) in round r, in
    float64 (the server keeps c_i in the model's float32). All values are small multiples
    of 1/8, exact in float32, so the check is equality.
    """
    N, eta = 4, 0.5
    seen: list[tuple[int, int, np.ndarray]] = []  # (round, partition, received c − c_i)
    app = ClientApp()

    @app.train("scaffold")
    def _train(msg: Message, ctx: Context) -> Message:
        pid = int(ctx.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        x = msg.content["arrays"]["w"].numpy()
        seen.append((rnd, pid, msg.content["control"]["w"].numpy()))
        y = ArrayRecord({"w": Array(x + (pid + 1) * np.array([1.0, 2.0], dtype=np.float32))})
        ci = ArrayRecord({"w": Array(rnd * (pid + 1) * np.array([1.0, -1.0]))})
        metrics = MetricRecord({"num-examples": 1, "partition-id": pid})
        return Message(content=RecordDict({"arrays": y, "control": ci, "metrics": metrics}), reply_to=msg)

    strategy = build_strategy("scaffold", {"fraction-train": 0.5, "fraction-evaluate": 0.0, "server-lr": eta,
                                           "seed": 3})
    grid = InProcessGrid(app, N, {})
    result = strategy.start(grid, ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))}), num_rounds=3,
                            timeout=60)
    x, c, cis = np.zeros(2), np.zeros(2), {}
    for rnd in (1, 2, 3):
        batch = [(pid, got) for r, pid, got in seen if r == rnd]
        assert len(batch) == N // 2
        for pid, got in batch:
            np.testing.assert_array_equal(got, c - cis.get(pid, 0.0))
            assert got.dtype == np.float32
        x = x + eta * np.mean([(pid + 1) * np.array([1.0, 2.0]) for pid, _ in batch], axis=0)
        for pid, _ in batch:
            new = rnd * (pid + 1) * np.array([1.0, -1.0])
            c = c + (new - cis.get(pid, 0.0)) / N
            cis[pid] = new
    np.testing.assert_array_equal(result.arrays["w"].numpy(), x)
    final = strategy.state
    np.testing.assert_array_equal(final.control[0], c)
    assert all(v[0].dtype == np.float32 for v in final.client_controls.values())
    assert sorted(final.client_controls) == sorted(cis)
