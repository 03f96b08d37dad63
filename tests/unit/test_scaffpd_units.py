"""SCAFF-PD / SCAFFOLD: construction errors, step-size rules, client handlers against closed forms."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from flowerdro.apps.client_app import app as client_app
from flowerdro.data import DataConfig, load_federated
from flowerdro.experiments import InProcessGrid
from flowerdro.strategies import build_strategy
from flowerdro.strategies.scaffold import SCAFFOLD
from flowerdro.strategies.scaffpd import SCAFFPD

N, D, M, MU = 3, 4, 20, 0.1
# The clients run in float64 (precision = float64) and the references are numpy float64
# computations of the same quantities in another order: ~1e-15 relative per operation, over
# at most a few dozen operations and J local steps of a well-conditioned least squares, so
# 1e-10 relative leaves five orders of margin. Step sizes: one or two float64 operations (1e-15).
FLOAT64_CLIENT = 1e-10
RC = {"dataset": "robust-regression", "model": "linear", "precision": "float64", "num-partitions": N,
      "regression-dim": D, "samples-per-client": M, "weight-decay": MU, "batch-size": 1000}


# ------------------------------------------------------------------ construction errors
@pytest.mark.parametrize("kwargs,match", [
    ({"rho": -0.1}, "rho"),
    ({"alpha": 0.0}, "cvar-alpha"),
    ({"alpha": 1.5}, "cvar-alpha"),
    ({"local_steps": 0}, "local-steps"),
    ({"local_steps": 2.5}, "local-steps"),
    ({"lr": 0.0}, "lr"),
    ({"dual_lr": -1.0}, "dual-lr"),
    ({"primal_lr": 0.0}, "primal-lr"),
    ({"gamma": -2.0}, "gamma"),
    ({"theta": -0.5}, "theta"),
    ({"mu_x": -1.0}, "mu-x"),
    ({"objective": "kl"}, "objective"),
    ({"step_rule": "5.3"}, "step-rule"),
    ({"grad_on": "half"}, "grad-on"),
    ({"on_failure": "ignore"}, "on-failure"),
])
def test_scaffpd_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SCAFFPD(**kwargs)


@pytest.mark.parametrize("key,value", [("rho", -1.0), ("cvar-alpha", 0.0), ("cvar-alpha", 2.0),
                                       ("local-steps", 0), ("lr", 0.0), ("dual-lr", 0.0), ("primal-lr", -1.0)])
def test_scaffpd_factory_rejects_bad_run_config(key, value):
    with pytest.raises(ValueError, match=key):
        build_strategy("scaffpd", {key: value})


@pytest.mark.parametrize("kwargs,match", [({"local_steps": 0}, "local-steps"), ({"lr": 0.0}, "lr"),
                                          ({"server_lr": -1.0}, "server-lr")])
def test_scaffold_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SCAFFOLD(**kwargs)


def test_factories_read_run_config():
    s = build_strategy("scaffpd", {"objective": "cvar", "cvar-alpha": 0.2, "local-steps": 7, "lr": 0.03,
                                   "dual-lr": 0.5, "weight-decay": 0.2, "dataset": "robust-regression"})
    assert (s.config.objective, s.config.alpha, s.config.dual_lr) == ("cvar", 0.2, 0.5)
    assert (s.training.local_steps, s.training.lr) == (7, 0.03)
    assert s.primal_lr == pytest.approx(0.03 * 7)  # τ_0 default η_l·J
    assert s.mu_x == 0.2  # μ_x defaults to the weight decay
    assert s.eval_metric == "test_loss"
    assert build_strategy("scaffpd", {}).eval_metric == "test_acc"
    f = build_strategy("scaffold", {"server-lr": 0.5, "local-steps": 3})
    assert (f.config.server_lr, f.training.local_steps) == (0.5, 3)


@pytest.mark.parametrize("name", ["scaffpd", "scaffold"])
def test_local_epochs_of_a_shared_run_config_cannot_replace_the_exact_local_steps(name):
    # Δu_i = (x − u_J)/(η_l J) and c_i⁺ need exactly J steps of η_l
    s = build_strategy(name, {"local-epochs": 2.0, "local-steps": 4, "lr": 0.1})
    cfg = s._config(ConfigRecord({"local-epochs": 2.0, "local-steps": 9, "lr": 1.0}), 1, **(
        {"train": True} if name == "scaffpd" else {}))
    assert (cfg["local-epochs"], cfg["local-steps"], cfg["lr"]) == (0.0, 4, 0.1)


# ------------------------------------------------------------------ step sizes
def test_rule_52_auto_theta_by_hand():
    s = SCAFFPD(objective="chi2", rho=0.1, mu_x=0.5, lr=0.1, local_steps=4, dual_lr=0.2)
    # τ = η_l J = 0.4, μ_y = ρN = 0.5: θ = max(1/(1 + 0.5·0.4), 1/(1 + 0.5·0.2)) = max(1/1.2, 1/1.1)
    tau, sigma, _, theta = s._initial_steps(5)
    assert (tau, sigma, theta) == pytest.approx((0.4, 0.2, 10 / 11), rel=1e-15)
    s.state.steps = s._initial_steps(5)
    s._advance_steps()  # rule 5.2: constant
    assert s.state.steps == pytest.approx((0.4, 0.2, 0.5, 10 / 11), rel=1e-15)
    assert SCAFFPD(objective="afl", mu_x=0.5)._initial_steps(5)[3] == 1.0  # μ_y = 0
    assert SCAFFPD(theta=0.3)._initial_steps(5)[3] == 0.3


def test_rule_51_schedule_of_the_strategy_by_hand():
    # τ_0 = η_l J = 1, γ_0 = 2, μ_x = 3: σ_0 = 2; then τ_1 = 1/√(1 + 3) = 1/2, γ_1 = 8, σ_1 = 4, θ_1 = 2/4
    s = SCAFFPD(step_rule="5.1", lr=0.25, local_steps=4, gamma=2.0, mu_x=3.0)
    s.state.steps = s._initial_steps(3)
    assert s.state.steps == (1.0, 2.0, 2.0, 1.0)
    s._advance_steps()
    # step sizes from float64 products/square roots of exact inputs: ≤ 1 ulp; rel 1e-15 ≈ 4 ulps
    assert s.state.steps == pytest.approx((0.5, 4.0, 8.0, 0.5), rel=1e-15)


# ------------------------------------------------------------------ client handlers
def _problem():
    clients = load_federated(DataConfig.from_run_config(RC, num_partitions=N))
    return [(c.x_train.astype(np.float64), c.y_train.astype(np.float64)) for c in clients]


def _grad(a, y, x):
    return 2.0 / len(y) * a.T @ (a @ x - y) + MU * x


def _loss(a, y, x):
    return float(np.mean((a @ x - y) ** 2) + MU / 2 * x @ x)


def _rec(x, key="linear.weight"):
    return ArrayRecord({key: Array(np.asarray(x, dtype=np.float64).reshape(1, -1))})


def _send(grid, nid, mtype, content):
    return grid.send_and_receive([Message(content=RecordDict(content), dst_node_id=nid, message_type=mtype)])[0]


def test_loss_grad_and_scaffpd_local_steps_match_closed_form():
    # Prepare
    data = _problem()
    grid = InProcessGrid(client_app, N, RC)
    rng = np.random.default_rng(0)
    x, c = rng.normal(size=D), rng.normal(size=D)
    lr, steps = 0.05, 6
    pid = 1
    nid = grid.node_ids[pid]
    a, y = data[pid]
    # Execute: phase 1, then phase 2 with the control c
    r1 = _send(grid, nid, "query.loss_grad", {"arrays": _rec(x), "config": ConfigRecord({"server-round": 3})})
    r2 = _send(grid, nid, "train.scaffpd", {"arrays": _rec(x), "control": _rec(c),
                                            "config": ConfigRecord({"server-round": 3, "lr": lr,
                                                                    "local-steps": steps})})
    # Assert: f_i, ∇f_i and J steps of u ← u − η(∇f_i(u) − c_i + c)
    assert not r1.has_error() and not r2.has_error()
    assert r1.content["metrics"]["loss"] == pytest.approx(_loss(a, y, x), rel=FLOAT64_CLIENT)
    ci = _grad(a, y, x)
    np.testing.assert_allclose(r1.content["grad"]["linear.weight"].numpy().ravel(), ci, rtol=FLOAT64_CLIENT)
    u = x.copy()
    for _ in range(steps):
        u = u - lr * (_grad(a, y, u) - ci + c)
    np.testing.assert_allclose(r2.content["arrays"]["linear.weight"].numpy().ravel(), u, rtol=FLOAT64_CLIENT)
    assert set(r2.content.array_records.keys()) == {"arrays"}


def test_scaffpd_train_without_this_rounds_gradient_fails():
    grid = InProcessGrid(client_app, N, RC)
    nid = grid.node_ids[0]
    x = np.zeros(D)
    reply = _send(grid, nid, "train.scaffpd", {"arrays": _rec(x), "control": _rec(x),
                                               "config": ConfigRecord({"server-round": 1})})
    assert reply.has_error() and "query.loss_grad" in reply.error.reason
    _send(grid, nid, "query.loss_grad", {"arrays": _rec(x), "config": ConfigRecord({"server-round": 1})})
    reply = _send(grid, nid, "train.scaffpd", {"arrays": _rec(x), "control": _rec(x),
                                               "config": ConfigRecord({"server-round": 2})})
    assert reply.has_error() and "round 1" in reply.error.reason


def test_scaffold_client_option_two_without_client_state():
    data = _problem()
    grid = InProcessGrid(client_app, N, RC)
    pid, lr, k = 2, 0.05, 5
    nid = grid.node_ids[pid]
    a, y = data[pid]
    rng = np.random.default_rng(1)
    ci = np.zeros(D)
    for rnd in (1, 2):
        x, c = rng.normal(size=D), rng.normal(size=D)
        cfg = ConfigRecord({"server-round": rnd, "lr": lr, "local-steps": k})
        reply = _send(grid, nid, "train.scaffold", {"arrays": _rec(x), "control": _rec(c - ci), "config": cfg})
        # K steps of y ← y − η_l(∇f_i(y) − c_i + c), then c_i⁺ = c_i − c + (x − y_K)/(K η_l)
        yk = x.copy()
        for _ in range(k):
            yk = yk - lr * (_grad(a, y, yk) - ci + c)
        ci_new = ci - c + (x - yk) / (k * lr)
        np.testing.assert_allclose(reply.content["arrays"]["linear.weight"].numpy().ravel(), yk, rtol=FLOAT64_CLIENT)
        np.testing.assert_allclose(reply.content["control"]["linear.weight"].numpy().ravel(), ci_new,
                                   rtol=10 * FLOAT64_CLIENT, atol=1e-12)  # c_i⁺ divides by Kη_l = 0.25
        ci = ci_new
    assert not grid.contexts[nid].state.array_records  # the server keeps c_i, the client nothing


def test_regression_evaluate_reports_test_loss_only():
    data = load_federated(DataConfig.from_run_config(RC, num_partitions=N))
    grid = InProcessGrid(client_app, N, RC)
    x = np.ones(D)
    reply = _send(grid, grid.node_ids[0], "evaluate", {"arrays": _rec(x), "config": ConfigRecord()})
    mr = reply.content["metrics"]
    assert "test_acc" not in mr
    c = data[0]
    # the test data is stored in float32 before the float64 client casts it: ~1e-7 relative
    assert mr["test_loss"] == pytest.approx(float(np.mean((c.x_test.astype(float) @ x - c.y_test) ** 2)), rel=1e-6)
