"""SCAFF-PD and SCAFFOLD against in-process clients, checked with independent solves (cvxpy, closed forms)."""

from __future__ import annotations

import numpy as np
import pytest

from flowerdro.apps.client_app import app as client_app
from flowerdro.core.simplex import project_simplex
from flowerdro.data import DataConfig, load_federated
from flowerdro.experiments import Fault, InProcessGrid
from flowerdro.experiments.references import chi2_dro_regression_saddle_point
from flowerdro.runs import client_config, initial_arrays
from flowerdro.strategies import build_strategy

cp = pytest.importorskip("cvxpy")

N, D, M, MU = 4, 5, 30, 0.1
RC = {"dataset": "robust-regression", "model": "linear", "precision": "float64", "num-partitions": N,
      "regression-dim": D, "samples-per-client": M, "weight-decay": MU, "batch-size": 1000,
      "lr": 0.04, "local-steps": 10, "dual-lr": 0.05, "fraction-evaluate": 0.0}
ROUNDS = 70  # ~35-40 rounds reach 1e-11 here (linear rate); margin for the failure tests


def _data(n: int = N) -> list[tuple[np.ndarray, np.ndarray]]:
    clients = load_federated(DataConfig.from_run_config(RC, num_partitions=n))
    return [(c.x_train.astype(np.float64), c.y_train.astype(np.float64)) for c in clients]


def _losses(data, x):
    return np.array([np.mean((a @ x - y) ** 2) + MU / 2 * x @ x for a, y in data])


def saddle_point(data, rho: float) -> np.ndarray:
    """x* from an independent solver (cvxpy), checked to be a saddle point."""
    xs, _, residual = chi2_dro_regression_saddle_point(data, rho, MU)
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
    assert np.sum((x - xs) ** 2) <= 1e-10 * np.sum(xs ** 2)
    lam_star = project_simplex(1.0 / N + _losses(data, xs) / (rho * N))
    lam = np.array([strategy.lam[p] for p in range(N)])
    np.testing.assert_allclose(lam, lam_star, atol=1e-5)


def test_rule_51_schedule_also_converges_to_the_saddle_point():
    rho = 0.1
    xs = saddle_point(_data(), rho)
    strategy, x = _run({**RC, "rho": rho, "step-rule": "5.1"}, rounds=ROUNDS)  # μ_x = weight-decay
    h = strategy.history
    assert h[-1]["tau"] < h[0]["tau"] and h[-1]["sigma"] > h[0]["sigma"]  # τ_r ↓, σ_r ↑ (γ_r grows)
    assert h[-1]["tau"] * h[-1]["sigma"] == pytest.approx(h[0]["tau"] * h[0]["sigma"])
    assert np.sum((x - xs) ** 2) <= 1e-10 * np.sum(xs ** 2)


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
    np.testing.assert_allclose(x1, x0 - lr * steps * direction, rtol=1e-10)


def test_phase1_failure_reuses_last_loss_and_gradient_and_still_converges():
    rho = 0.05
    xs = saddle_point(_data(), rho)
    faults = {1: Fault("raise", message_types=("query.loss_grad",), rounds=(3, 4, 5))}
    strategy, x = _run({**RC, "rho": rho}, rounds=ROUNDS, faults=faults)
    hist = {h["round"]: h for h in strategy.history}
    assert hist[3]["failures"] == {"query:error": 1} and hist[3]["reused"] == [1]
    assert hist[3]["substituted"] == [1]  # not trained this round: Δu_1 := c^r
    assert "reused" not in hist[6]
    assert np.sum((x - xs) ** 2) <= 1e-10 * np.sum(xs ** 2)


def test_phase2_failure_every_round_still_reaches_the_exact_saddle_point():
    rho = 0.1
    xs = saddle_point(_data(), rho)
    strategy, x = _run({**RC, "rho": rho}, rounds=ROUNDS, faults={0: Fault("raise", message_types=("train",))})
    assert all(h["failures"] == {"train:error": 1} and h["substituted"] == [0] for h in strategy.history)
    assert np.sum((x - xs) ** 2) <= 1e-10 * np.sum(xs ** 2)


def test_exclude_policy_drops_a_dead_client_and_solves_the_rest():
    rho = 0.1
    data = _data()
    xs_rest = saddle_point([d for i, d in enumerate(data) if i != 2], rho)
    faults = {2: Fault("raise", message_types=("query.loss_grad",))}
    strategy, x = _run({**RC, "rho": rho, "on-failure": "exclude"}, rounds=ROUNDS, faults=faults)
    assert all(h["excluded"] == [2] for h in strategy.history)
    assert strategy.lam[2] == pytest.approx(1 / N)  # frozen: never observed
    assert np.sum((x - xs_rest) ** 2) <= 1e-10 * np.sum(xs_rest ** 2)


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
    assert np.sum((x - x_bar) ** 2) <= 1e-12 * np.sum(x_bar ** 2)
    # the server control is the mean of the clients' c_i (kept in Context.state)
    cis = [grid.contexts[nid].state.array_records["scaffold.control"]["linear.weight"].numpy().ravel()
           for nid in grid.node_ids]
    np.testing.assert_allclose(strategy.control[0].ravel(), np.mean(cis, axis=0), atol=1e-10)


def test_scaffold_partial_participation_and_failures(synth_rc):
    rc = {**synth_rc, "fraction-train": 0.5}
    faults = {1: Fault("raise", message_types=("train",))}
    grid = InProcessGrid(client_app, 6, rc, faults=faults)
    strategy = build_strategy("scaffold", rc)
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=3, timeout=60, train_config=client_config(rc))
    assert len(strategy.history) == 3 and "acc_mean" in strategy.history[-1]
    assert grid.calls > 0
    trained = [nid for nid in grid.node_ids if "scaffold.control" in grid.contexts[nid].state.array_records]
    assert 0 < len(trained) <= 6
