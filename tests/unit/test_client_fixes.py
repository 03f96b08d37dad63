"""Client-side loss plumbing: every local loop trains the task's loss (MSE on a regression task)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowerdro.clients.drdsgd import drdsgd_local_step
from flowerdro.clients.training import LocalData, make_generator, mse_loss
from flowerdro.experiments import run
from flowerdro.models import build_model

#: A small robust-regression federation (SCAFF-PD §6.1 data, linear model, float64).
RR = {"dataset": "robust-regression", "model": "linear", "precision": "float64", "regression-dim": 4,
      "samples-per-client": 12, "batch-size": 1000, "lr": 0.05, "local-steps": 1, "fraction-evaluate": 1.0}


def _tiny_regression(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(6, 3))
    y = rng.normal(size=6)
    w = rng.normal(size=3)
    return a, y, w


def _linear(w: np.ndarray) -> torch.nn.Module:
    model = build_model("linear", (w.size,), 1).to(torch.float64)
    with torch.no_grad():
        model.linear.weight.copy_(torch.tensor(w[None, :]))
    return model


@pytest.mark.parametrize("robust", [True, False])
def test_drdsgd_step_on_regression_is_the_tilted_mse_gradient_step(robust):
    # Prepare: a tiny least-squares problem, one full-batch step from w.
    a, y, w = _tiny_regression()
    data = LocalData.from_numpy(a, y, a, y, torch.device("cpu"), dtype=torch.float64)
    model = _linear(w)
    lr, mu = 0.1, 2.0
    # Execute
    res = drdsgd_local_step(model, data, lr=lr, batch_size=100, generator=make_generator(0), mu=mu,
                            robust=robust, loss_fn=mse_loss)
    # Assert: ℓ = (1/n)‖Aw − y‖², ∇ℓ = (2/n)Aᵀ(Aw − y), multiplier exp(ℓ/μ)/μ (DR-DSGD) or 1 (DSGD).
    r = a @ w - y
    loss = float(r @ r) / len(y)
    grad = 2.0 / len(y) * a.T @ r
    mult = math.exp(loss / mu) / mu if robust else 1.0
    assert res.losses == [pytest.approx(loss, rel=1e-12)]  # float64 sums of 6 terms
    np.testing.assert_allclose(res.state["linear.weight"].numpy().ravel(), w - lr * mult * grad, rtol=1e-12)


def test_drdsgd_and_dsgd_train_robust_regression_with_no_dropped_reply():
    # Before the fix every train.drdsgd / train.dsgd reply on a regression task was an error
    # (cross-entropy on real targets) and the model never moved.
    cfg = {"name": "rr", "num-rounds": 4, "seeds": [0], "num-partitions": 4, "strategies": ["drdsgd", "dsgd"],
           "run-config": {**RR, "mu": 5.0, "topology": "complete"}}
    res = run(cfg, output_root=None, verbose=False)
    for label in ("drdsgd", "dsgd"):
        hist = res.histories[label][0]
        assert [r["failures"] for r in hist] == [{}] * 4, label
        assert all(len(r["train_loss_device"]) == 4 for r in hist), label
        # full-batch gradient steps with a small rate on a convex quadratic: the mean loss decreases
        mean_loss = [float(np.mean(list(r["train_loss_device"].values()))) for r in hist]
        assert all(b < a for a, b in zip(mean_loss, mean_loss[1:], strict=False)), (label, mean_loss)


@pytest.mark.parametrize("kind", ["fgm", "pgd"])
def test_adversarial_training_on_regression_attacks_the_mse(kind):
    # Prepare: f_w(x) = ⟨w, x⟩ with per-sample loss (⟨w, x⟩ − y)². Its input gradient is
    # 2 r w (r = ⟨w, x⟩ − y), so the ℓ₂ attack of radius ε is x + ε sign(r) w/‖w‖ (FGM; PGD's
    # steps all point the same way, 2.5ε in total, projected back to ε), which raises |r| by ε‖w‖.
    a, y, w = _tiny_regression(1)
    data = LocalData.from_numpy(a, y, a, y, torch.device("cpu"), dtype=torch.float64)
    model = _linear(w)
    eps, lr = 0.3, 0.05
    # Execute
    from flowerdro.clients.robust import adversarial_local

    res = adversarial_local(model, data, kind=kind, eps=eps, steps=1, lr=lr, batch_size=100,
                            generator=make_generator(0), loss_fn=mse_loss)
    # Assert
    r = a @ w - y
    x_adv = a + eps * np.sign(r)[:, None] * w[None, :] / np.linalg.norm(w)
    r_adv = x_adv @ w - y
    np.testing.assert_allclose(np.abs(r_adv), np.abs(r) + eps * np.linalg.norm(w), rtol=1e-12)
    assert res.mean_batch_loss == pytest.approx(float(r_adv @ r_adv) / len(y), rel=1e-12)  # float64, 6 terms
    assert res.mean_batch_loss > float(r @ r) / len(y)  # the attack increased the MSE
    w_next = w - lr * 2.0 / len(y) * x_adv.T @ r_adv
    np.testing.assert_allclose(res.state["linear.weight"].numpy().ravel(), w_next, rtol=1e-12)


def _fedmgda_run(rc: dict, rounds: int):
    from flowerdro.apps.client_app import app
    from flowerdro.comparison import client_config
    from flowerdro.experiments import InProcessGrid
    from flowerdro.strategies import build_strategy, initial_arrays

    grid = InProcessGrid(app, 5, rc)
    strategy = build_strategy("fedmgda+", rc)
    init = initial_arrays(grid, rc, 60)
    res = strategy.start(grid, init, num_rounds=rounds, timeout=60, train_config=client_config(rc))
    return grid, strategy, init, res.arrays


def test_fedmgda_improved_fraction_is_the_same_whatever_train_loss_on(synth_rc):
    # 5 synthetic clients, batch 4: with train-loss-on = "batch" the "before" loss was a
    # first-minibatch loss and the "after" one a full-data loss, so the fractions differed.
    rc = {**synth_rc, "batch-size": 4, "track-improvement": True, "fraction-evaluate": 0.0}
    fracs = {}
    for mode in ("full", "batch"):
        _, strategy, _, _ = _fedmgda_run({**rc, "train-loss-on": mode}, rounds=4)
        fracs[mode] = [r["improved_fraction"] for r in strategy.history]
    assert fracs["batch"] == fracs["full"]
    # Round 1 by hand: every client's full training loss at w_0 and at w_1.
    from flowerdro.clients.handlers import get_runtime
    from flowerdro.clients.training import evaluate_model

    grid, strategy, w0, w1 = _fedmgda_run({**rc, "train-loss-on": "batch"}, rounds=1)
    change = {}
    for nid, ctx in grid.contexts.items():
        rt = get_runtime(ctx)
        before = evaluate_model(rt.model_from(w0), rt.data.x_train, rt.data.y_train)[0]
        after = evaluate_model(rt.model_from(w1), rt.data.x_train, rt.data.y_train)[0]
        change[str(grid.partition_of_node[nid])] = after - before
    rec = strategy.history[0]
    assert set(rec["loss_change"]) == set(change)
    for pid, d in change.items():
        # the same float32 forward passes on the same data; losses ≈ ln 5 ≈ 1.6, so even a
        # different summation order moves each by ~1.6 · 1.2e-7 · log2(n) < 1e-6
        assert rec["loss_change"][pid] == pytest.approx(d, abs=1e-6)
    assert rec["improved_fraction"] == pytest.approx(np.mean([d <= 0 for d in change.values()]))
    assert rec["improved_fraction"] == fracs["full"][0]


def _attacked_train(rc: dict, attack: str, steps: int, scale: float):
    """One ``train`` message to a single (malicious) robust-regression client: its reply and data."""
    from flwr.app import Message, RecordDict

    from flowerdro.apps.client_app import app
    from flowerdro.clients.handlers import get_runtime
    from flowerdro.comparison import client_config
    from flowerdro.experiments import InProcessGrid
    from flowerdro.strategies import initial_arrays

    rc = {**rc, "local-steps": steps, "malicious-ids": "0", "attack": attack, "attack-scale": scale}
    grid = InProcessGrid(app, 1, rc)
    init = initial_arrays(grid, rc, 60)
    msg = Message(content=RecordDict({"arrays": init, "config": client_config(rc)}),
                  dst_node_id=grid.node_ids[0], message_type="train")
    reply = grid.send_and_receive([msg])[0]
    rt = get_runtime(grid.contexts[grid.node_ids[0]])
    w = reply.content["arrays"]["linear.weight"].numpy().ravel()
    return w, reply.content["metrics"], rt.data.x_train.cpu().numpy(), rt.data.y_train.cpu().numpy()


def test_loss_scale_and_update_scale_agree_for_one_full_batch_step_only():
    s = 3.0
    one = {a: _attacked_train(RR, a, 1, s)[0] for a in ("loss-scale", "update-scale")}
    # w − η·s∇f(w) either way; float64 rounding of a d = 4 step
    np.testing.assert_allclose(one["loss-scale"], one["update-scale"], rtol=1e-12, atol=1e-14)
    three = {a: _attacked_train(RR, a, 3, s)[0] for a in ("loss-scale", "update-scale")}
    assert np.abs(three["loss-scale"] - three["update-scale"]).max() > 1e-3


def test_loss_scale_attacker_trains_on_s_times_its_mse():
    # Prepare: a loss-scale attacker from w⁰ = 0 (the linear model's start), full batch, τ = 3.
    s, steps = 3.0, 3
    w, metrics, a, y = _attacked_train(RR, "loss-scale", steps, s)
    # By hand: w ← w − η s (2/m) Aᵀ(Aw − y), and the reported losses are s·f.
    m = len(y)
    v = np.zeros(a.shape[1])
    f0 = float(y @ y) / m
    local = []
    for _ in range(steps):
        r = a @ v - y
        local.append(s * float(r @ r) / m)
        v = v - RR["lr"] * s * 2.0 / m * a.T @ r
    np.testing.assert_allclose(w, v, rtol=1e-10)  # float64, 3 steps on 12 × 4 data
    assert metrics["train_loss"] == pytest.approx(s * f0, rel=1e-12)
    assert metrics["train_loss_local"] == pytest.approx(float(np.mean(local)), rel=1e-12)
    honest = _attacked_train(RR, "none", steps, s)  # attack "none": an honest client
    assert honest[1]["train_loss"] == pytest.approx(f0, rel=1e-12)


def test_run_settings_say_which_attack_ran(tmp_path, synth_rc):
    import json

    attack = {"malicious-ids": "1", "attack": "loss-scale", "attack-scale": 10.0}
    cfg = {"name": "atk", "num-rounds": 1, "seeds": [0], "num-partitions": 3, "strategies": ["fedavg", "fedmgda+"],
           "run-config": {**synth_rc, **attack}}
    run(cfg, output_root=tmp_path, verbose=False)
    for label in ("fedavg", "fedmgda+"):
        settings = json.loads((tmp_path / "atk" / label / "seed0" / "settings.json").read_text())
        assert settings["attack"] == "loss-scale" and settings["attack_scale"] == 10.0
        assert settings["malicious_ids"] == [1]
    run({**cfg, "name": "honest", "run-config": synth_rc}, output_root=tmp_path, verbose=False)
    assert "attack" not in json.loads((tmp_path / "honest" / "fedavg" / "seed0" / "settings.json").read_text())


def test_the_old_scale_attack_name_is_refused_naming_both_scalings(synth_rc):
    from flowerdro.strategies import build_strategy

    with pytest.raises(ValueError, match="attack.*loss-scale.*update-scale"):
        build_strategy("fedavg", {**synth_rc, "malicious-ids": "0", "attack": "scale"})
