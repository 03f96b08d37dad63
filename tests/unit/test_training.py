"""Local training loops against hand-computed SGD steps."""

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from flowerdro.clients.config import Settings
from flowerdro.clients.training import (
    LocalData,
    evaluate_model,
    local_sgd,
    make_generator,
    minibatches,
    steps_from_epochs,
)
from flowerdro.models import build_model


def _data(n=12, d=4, k=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, k, n)
    return LocalData.from_numpy(x, y, x, y, torch.device("cpu"))


def _manual_steps(model, data, steps, lr, batch, gen_seed, mu=0.0):
    """Plain SGD written out: w <- w - lr * (grad + mu (w - w0))."""
    w = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    w0 = [p.detach().clone() for p in w]
    batches = minibatches(data.num_train, batch, make_generator(gen_seed), torch.device("cpu"))
    for _ in range(steps):
        idx = next(batches)
        logits = data.x_train[idx] @ w[0].T + w[1]
        loss = F.cross_entropy(logits, data.y_train[idx])
        grads = torch.autograd.grad(loss, w)
        with torch.no_grad():
            w = [(p - lr * (g + mu * (p - p0))).requires_grad_(True) for p, g, p0 in zip(w, grads, w0, strict=True)]
    return [p.detach() for p in w]


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_local_sgd_matches_manual_sgd(mu):
    data = _data()
    model = build_model("logreg", (4,), 3, seed=1)
    expected = _manual_steps(build_model("logreg", (4,), 3, seed=1), data, 7, 0.3, 5, gen_seed=42, mu=mu)
    res = local_sgd(model, data, steps=7, lr=0.3, batch_size=5, generator=make_generator(42), proximal_mu=mu)
    # float32, weights ≤ 0.3: 7 steps of a 4 × 3 model, each a few roundings of u ≈ 6e-8 per entry
    # (the two paths differ ~3e-8); 1e-6 + 1e-5·|w| leaves room for other summation orders.
    torch.testing.assert_close(res.state["linear.weight"], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res.state["linear.bias"], expected[1], rtol=1e-5, atol=1e-6)


def test_loss_before_is_loss_of_received_model_and_snapshot_is_step_t():
    data = _data()
    model = build_model("logreg", (4,), 3, seed=2)
    before, _ = evaluate_model(build_model("logreg", (4,), 3, seed=2), data.x_train, data.y_train)
    res = local_sgd(model, data, steps=6, lr=0.2, batch_size=4, generator=make_generator(9), snapshot_step=2)
    assert res.loss_before == pytest.approx(before, rel=1e-6)  # the same evaluate_model call on the same data
    snap = _manual_steps(build_model("logreg", (4,), 3, seed=2), data, 2, 0.2, 4, gen_seed=9)
    torch.testing.assert_close(res.snapshot["linear.weight"], snap[0], rtol=1e-5, atol=1e-6)  # as above, 2 steps


def test_loss_before_on_batch_is_the_received_models_loss_on_the_first_minibatch():
    data = _data(n=20)
    received = build_model("logreg", (4,), 3, seed=3)
    idx = next(minibatches(data.num_train, 5, make_generator(11), torch.device("cpu")))
    with torch.no_grad():
        expected = float(F.cross_entropy(received(data.x_train[idx]), data.y_train[idx]))
    res = local_sgd(build_model("logreg", (4,), 3, seed=3), data, steps=4, lr=0.2, batch_size=5,
                    generator=make_generator(11), loss_before_on="batch")
    # the same float32 cross-entropy on the same 5 rows (bitwise equal here; 1e-6 ≈ 8 float32 ulps)
    assert res.loss_before == pytest.approx(expected, rel=1e-6)
    # the trained model does not depend on where the loss was measured
    full = local_sgd(build_model("logreg", (4,), 3, seed=3), data, steps=4, lr=0.2, batch_size=5,
                     generator=make_generator(11))
    # the same float32 steps on the same batches: equal here; torch's float32 defaults (rtol 1.3e-6)
    # only absorb reordering
    torch.testing.assert_close(res.state["linear.weight"], full.state["linear.weight"])
    assert np.isnan(local_sgd(build_model("logreg", (4,), 3, seed=3), data, steps=1, lr=0.2, batch_size=5,
                              generator=make_generator(11), loss_before_on="none").loss_before)
    with pytest.raises(ValueError, match="train-loss-on"):
        local_sgd(received, data, steps=1, lr=0.2, batch_size=5, generator=make_generator(0), loss_before_on="all")


def test_minibatches_cover_each_epoch_once():
    gen = make_generator(0)
    it = minibatches(10, 5, gen, torch.device("cpu"))
    seen = torch.cat([next(it), next(it)])
    assert sorted(seen.tolist()) == list(range(10))


def test_evaluate_accuracy_by_hand():
    model = build_model("logreg", (2,), 2, seed=0)
    with torch.no_grad():
        model.linear.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        model.linear.bias.zero_()
    x = torch.tensor([[2.0, 0.0], [0.0, 2.0], [3.0, 1.0], [1.0, 3.0]])
    y = torch.tensor([0, 1, 1, 1])
    loss, acc = evaluate_model(model, x, y)
    assert acc == 0.75
    expected = float(F.cross_entropy(x, y))
    # float32 mean vs sum-then-divide of 4 positive terms: ≤ 4 roundings of u ≈ 6e-8 each
    assert loss == pytest.approx(expected, rel=1e-6)


def test_steps_from_epochs():
    assert steps_from_epochs(1, 100, 10) == 10
    assert steps_from_epochs(2, 95, 10) == 20
    with pytest.raises(ValueError, match="local-epochs"):
        steps_from_epochs(0, 10, 2)


@pytest.mark.parametrize("kw,match", [({"steps": 0}, "local-steps"), ({"lr": 0.0}, "lr"), ({"batch_size": 0}, "batch-size"),
                                      ({"proximal_mu": -1.0}, "proximal-mu"), ({"snapshot_step": 9}, "snapshot-step")])
def test_local_sgd_errors(kw, match):
    args = {"steps": 3, "lr": 0.1, "batch_size": 2, "generator": make_generator(0)}
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        local_sgd(build_model("logreg", (4,), 3), _data(), **args)


def test_settings_layering_and_validation():
    s = Settings({"lr": 0.5}, {"lr": 0.1, "local-steps": 4, "flag": "yes", "ids": "1, 3"})
    assert s.float("lr", 1.0) == 0.5 and s.int("local-steps", 1) == 4
    assert s.bool("flag", False) is True and s.int_list("ids") == (1, 3)
    with pytest.raises(ValueError, match="local-steps"):
        s.int("local-steps", 1, minimum=5)
    with pytest.raises(ValueError, match="mode.*allowed"):
        Settings({"mode": "x"}).str("mode", "a", choices=("a", "b"))
    with pytest.raises(ValueError, match="lr"):
        Settings({"lr": "fast"}).float("lr", 0.1)


def test_local_steps_and_epochs_are_read_from_one_layer():
    from flowerdro.clients.config import Settings
    from flowerdro.clients.handlers import _local_steps

    # the message sets τ = 7 only; the node's run config asks for 1 epoch: τ wins
    assert _local_steps(Settings({"local-steps": 7}, {"local-epochs": 1}), num_train=100, batch_size=10) == 7
    # the message sets epochs: 2 epochs of ceil(100 / 10) = 10 batches each
    assert _local_steps(Settings({"local-epochs": 2, "local-steps": 7}, {}), num_train=100, batch_size=10) == 20
    # only the run config speaks: its epochs apply
    assert _local_steps(Settings({}, {"local-epochs": 1}), num_train=100, batch_size=10) == 10
    assert Settings({"a": 1}, {"b": 2}).first_layer("b").raw("b") == 2
    assert not Settings({"a": 1}).first_layer("c").has("c")


def test_host_values_sums_like_step_by_step_floats():
    """One transfer of the kept step losses gives the bits of adding float(loss) at each step."""
    from flowerdro.clients.training import host_values

    g = torch.Generator().manual_seed(0)
    losses = [torch.rand((), generator=g, dtype=torch.float32) * 10 ** k for k in range(-3, 5)] * 3
    step_by_step = 0.0
    for v in losses:
        step_by_step += float(v)
    got = host_values(losses)
    assert got == [float(v) for v in losses]
    assert sum(got) == step_by_step  # same float64 additions in the same order: equal bits
    assert host_values([]) == []
