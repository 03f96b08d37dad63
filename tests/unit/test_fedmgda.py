"""FedMGDA+ server step against hand computations on mocked replies (no clients run)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flowerdro.core.mgda import min_norm_weights
from flowerdro.core.mgda_step import fedmgda_server_step
from flowerdro.experiments.inprocess import ensure_task_identity
from flowerdro.strategies import build_strategy
from flowerdro.strategies.baselines import FedAvgBaseline
from flowerdro.strategies.fedmgda import FedMGDA, VanillaFedMGDA, improved_fraction


def _record(w: np.ndarray, b: np.ndarray, n: int = 0) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.asarray(w, dtype=np.float64)), "b": Array(np.asarray(b, dtype=np.float64)),
                        "n": Array(np.array(n, dtype=np.int64))})


def _reply(arrays: ArrayRecord, pid: int, num_examples: int = 10, train_loss: float = 1.0) -> Message:
    # Prepare a reply as a client would send it (Flower's own strategy tests do the same).
    ensure_task_identity()
    metrics = MetricRecord({"num-examples": num_examples, "partition-id": pid, "train_loss": train_loss})
    return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), dst_node_id=pid + 1,
                   message_type="train.sgd")


def _flat(rec: ArrayRecord, keys=("w", "b")) -> np.ndarray:
    return np.concatenate([rec[k].numpy().ravel() for k in keys])


GLOBAL = _record([1.0, 2.0, 3.0], [0.5], n=10)


def _strategy(normalize: bool = True, num_rounds: int | None = None, **kw) -> FedMGDA:
    s = (FedMGDA if normalize else VanillaFedMGDA)(**kw)
    s.current_arrays = GLOBAL
    s.state["num_rounds"] = num_rounds
    return s


def test_two_replies_hand_computation_with_box():
    # Prepare: g_1 = w_t − w_1 = (2, 0, 0, 0), g_2 = w_t − w_2 = (0, 0.6, 0.8, 0)·5
    w1 = _record([1.0 - 2.0, 2.0, 3.0], [0.5], n=12)
    w2 = _record([1.0, 2.0 - 3.0, 3.0 - 4.0], [0.5], n=14)
    # ĝ_1 = e_1, ĝ_2 = (0, .6, .8, 0): orthonormal, so the min-norm λ is (1/2, 1/2) inside any box.
    s = _strategy(eps=1.0, global_lr=0.5)
    # Execute
    arrays, metrics = s.aggregate_train(1, [_reply(w1, 0), _reply(w2, 1)])
    # Assert: w_{t+1} = w_t − η (½ ĝ_1 + ½ ĝ_2)
    d = 0.5 * np.array([1.0, 0, 0, 0]) + 0.5 * np.array([0, 0.6, 0.8, 0])
    np.testing.assert_allclose(_flat(arrays), _flat(GLOBAL) - 0.5 * d, rtol=0, atol=1e-12)
    assert s.round_extras()["lambda"] == pytest.approx({"0": 0.5, "1": 0.5}, abs=1e-12)
    assert s.round_extras()["update_norms"] == pytest.approx({"0": 2.0, "1": 5.0})
    # integer buffer: rounded λ-weighted average of the participants' values
    assert int(arrays["n"].numpy()) == 13
    assert metrics["direction_norm"] == pytest.approx(math.sqrt(0.5), abs=1e-12)


def test_two_replies_closed_form_clipped_by_the_box():
    # Prepare: two *unit* updates always give λ = (½, ½); the box binds on raw updates.
    # g_1 = e_1, g_2 = (1, 3): λ_1 = ⟨g_2 − g_1, g_2⟩ / ‖g_1 − g_2‖² = 9/9 = 1 without a box,
    # clipped to ½ + ε = 0.6 by the ε-box (ε = 0.1).
    g1 = np.array([1.0, 0.0, 0.0, 0.0])
    g2 = np.array([1.0, 3.0, 0.0, 0.0])
    lam1_free = float(np.dot(g2 - g1, g2) / np.dot(g1 - g2, g1 - g2))
    assert lam1_free == pytest.approx(1.0)
    eps = 0.1
    lam1 = min(max(lam1_free, 0.5 - eps), 0.5 + eps)
    w1 = _record(_flat(GLOBAL)[:3] - g1[:3], [0.5 - g1[3]])
    w2 = _record(_flat(GLOBAL)[:3] - g2[:3], [0.5 - g2[3]])
    s = _strategy(eps=eps, normalize=False, global_lr=1.0)
    # Execute
    arrays, _ = s.aggregate_train(1, [_reply(w1, 3), _reply(w2, 7)])
    # Assert
    d = lam1 * g1 + (1 - lam1) * g2
    np.testing.assert_allclose(_flat(arrays), _flat(GLOBAL) - d, atol=1e-12)
    assert s.round_extras()["lambda"]["3"] == pytest.approx(0.6, abs=1e-12)
    # without the box (ε = 1) all the weight goes to g_1, the min-norm point of the segment
    s1 = _strategy(eps=1.0, normalize=False)
    arrays, _ = s1.aggregate_train(1, [_reply(w1, 3), _reply(w2, 7)])
    np.testing.assert_allclose(_flat(arrays), _flat(GLOBAL) - g1, atol=1e-12)


def test_three_orthogonal_replies_uniform_and_vanilla_mgda():
    # Prepare: updates along e_1, e_2, e_3 with norms 1, 2, 4.
    gs = [np.array([1.0, 0, 0, 0]), np.array([0, 2.0, 0, 0]), np.array([0, 0, 4.0, 0])]
    replies = [_reply(_record(_flat(GLOBAL)[:3] - g[:3], [0.5 - g[3]]), i) for i, g in enumerate(gs)]
    # FedMGDA+ (ε = 1): G = I, λ = 1/3 each, d = (1/3)(e_1 + e_2 + e_3).
    s = _strategy(eps=1.0, global_lr=0.3)
    arrays, _ = s.aggregate_train(1, replies)
    np.testing.assert_allclose(_flat(arrays), _flat(GLOBAL) - 0.3 * np.array([1, 1, 1, 0]) / 3, atol=1e-12)
    # Vanilla FedMGDA (raw updates, no box): min ‖Σλ_i g_i‖² with G = diag(1, 4, 16) gives
    # λ_i ∝ 1/G_ii = (16, 4, 1)/21 and d = Σ λ_i g_i = (16, 8, 4)/21.
    v = _strategy(eps=None, normalize=False, global_lr=1.0)
    arrays, _ = v.aggregate_train(1, replies)
    lam = np.array([16.0, 4.0, 1.0]) / 21
    # the QP's exact face solve leaves only float64 rounding (≈1e-16·cond) on O(1) values; 1e-12
    # leaves margin
    np.testing.assert_allclose([v.round_extras()["lambda"][str(i)] for i in range(3)], lam, atol=1e-12)
    np.testing.assert_allclose(_flat(arrays), _flat(GLOBAL) - np.array([16, 8, 4, 0]) / 21, atol=1e-12)
    # with η = 1 the vanilla step is the λ-weighted average of the local models
    local = np.stack([_flat(r.content["arrays"]) for r in replies])
    np.testing.assert_allclose(_flat(arrays), lam @ local, atol=1e-12)


def test_eps_zero_is_fedavg_on_normalised_updates_with_lambda0():
    rng = np.random.default_rng(0)
    sizes = [5, 20, 75]
    gs = [rng.standard_normal(4) * s for s in (0.1, 1.0, 10.0)]
    replies = [_reply(_record(_flat(GLOBAL)[:3] - g[:3], [0.5 - g[3]]), i, num_examples=n)
               for i, (g, n) in enumerate(zip(gs, sizes, strict=True))]
    for lambda_init, lam0 in (("size", np.array(sizes) / 100), ("uniform", np.full(3, 1 / 3))):
        s = _strategy(eps=0.0, lambda_init=lambda_init, global_lr=0.7)
        arrays, _ = s.aggregate_train(1, replies)
        d = sum(l * g / np.linalg.norm(g) for l, g in zip(lam0, gs, strict=True))
        # ε = 0 pins λ = λ0 (≤ 1 ulp); the step is a float64 sum of 3 unit vectors, rounding ≈ 1e-16
        np.testing.assert_allclose(_flat(arrays), _flat(GLOBAL) - 0.7 * d, atol=1e-12)
        np.testing.assert_allclose([s.round_extras()["lambda"][str(i)] for i in range(3)], lam0, atol=1e-15)
    # the registered "fedavg-n" is exactly this (data-size λ₀ by default)
    fn = build_strategy("fedavg-n", {"global-lr": 0.7})
    fn.current_arrays = GLOBAL
    arrays, _ = fn.aggregate_train(1, replies)
    d = sum(n / 100 * g / np.linalg.norm(g) for n, g in zip(sizes, gs, strict=True))
    # float64 sum of 3 weighted unit vectors: rounding ≈ 1e-16; 1e-12 leaves margin
    np.testing.assert_allclose(_flat(arrays), _flat(GLOBAL) - 0.7 * d, atol=1e-12)


def test_integer_arrays_are_not_normalised_nor_counted():
    g1, g2 = np.array([1.0, 0, 0, 0]), np.array([0, 0, 1.0, 1.0])
    base = [_record(_flat(GLOBAL)[:3] - g[:3], [0.5 - g[3]], n=10) for g in (g1, g2)]
    huge = [_record(_flat(GLOBAL)[:3] - g[:3], [0.5 - g[3]], n=n) for g, n in ((g1, 10_000), (g2, 30_000))]
    s = _strategy(eps=1.0)
    a, _ = s.aggregate_train(1, [_reply(r, i) for i, r in enumerate(base)])
    b, _ = s.aggregate_train(1, [_reply(r, i) for i, r in enumerate(huge)])
    np.testing.assert_array_equal(_flat(a), _flat(b))  # the integer values never enter the norms or G
    assert s.round_extras()["update_norms"] == pytest.approx({"0": 1.0, "1": math.sqrt(2)})
    lam = np.array([s.round_extras()["lambda"][k] for k in ("0", "1")])
    assert int(b["n"].numpy()) == int(np.rint(lam @ [10_000, 30_000]))
    assert b["n"].numpy().dtype == np.int64


def test_zero_updates_give_no_nan():
    # all g_i = 0: G = 0, λ = λ₀, model unchanged
    s = _strategy(eps=0.5)
    arrays, metrics = s.aggregate_train(1, [_reply(GLOBAL, 0), _reply(GLOBAL, 1)])
    np.testing.assert_array_equal(_flat(arrays), _flat(GLOBAL))
    assert s.round_extras()["lambda"] == {"0": 0.5, "1": 0.5}
    assert metrics["direction_norm"] == 0.0
    # one zero update: MGDA (ε = 1) puts all weight on it, the model does not move
    other = _record([0.0, 0.0, 0.0], [0.0])
    arrays, _ = _strategy(eps=1.0).aggregate_train(1, [_reply(GLOBAL, 0), _reply(other, 1)])
    assert np.all(np.isfinite(_flat(arrays)))
    np.testing.assert_allclose(_flat(arrays), _flat(GLOBAL), atol=1e-15)
    # vanilla FedMGDA on zero updates
    arrays, _ = _strategy(eps=None, normalize=False).aggregate_train(1, [_reply(GLOBAL, 0), _reply(GLOBAL, 1)])
    np.testing.assert_array_equal(_flat(arrays), _flat(GLOBAL))


def test_scaled_update_leaves_fedmgda_unchanged_but_moves_fedavg():
    rng = np.random.default_rng(3)
    gs = [rng.standard_normal(4) for _ in range(3)]
    def replies(scale: float) -> list[Message]:
        out = []
        for i, g in enumerate(gs):
            g = g * (scale if i == 0 else 1.0)
            out.append(_reply(_record(_flat(GLOBAL)[:3] - g[:3], [0.5 - g[3]]), i))
        return out
    s = _strategy(eps=0.3)
    honest, _ = s.aggregate_train(1, replies(1.0))
    attacked, _ = s.aggregate_train(1, replies(50.0))
    # normalising g and 50·g gives the same unit vector up to a few float64 ulps
    np.testing.assert_allclose(_flat(attacked), _flat(honest), atol=1e-12)
    fa = FedAvgBaseline()
    honest_avg, _ = fa.aggregate_train(1, replies(1.0))
    attacked_avg, _ = fa.aggregate_train(1, replies(50.0))
    assert np.abs(_flat(attacked_avg) - _flat(honest_avg)).max() > 1.0


def test_global_rate_decays_every_100_rounds():
    g = np.array([1.0, 0, 0, 0])
    reply = _reply(_record(_flat(GLOBAL)[:3] - g[:3], [0.5]), 0)
    s = _strategy(eps=1.0, global_lr=2.0, lr_decay=0.25, num_rounds=200)
    assert s.global_rate(1) == 2.0 and s.global_rate(100) == 2.0
    assert s.global_rate(101) == pytest.approx(1.0)  # β = 0.25^(100/200) = 0.5
    arrays, _ = s.aggregate_train(150, [reply])
    assert _flat(arrays)[0] == pytest.approx(1.0 - 1.0)
    assert s.round_extras()["global_lr"] == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs,name", [
    ({"eps": -0.1}, "eps"), ({"eps": 1.5}, "eps"), ({"eps": float("nan")}, "eps"),
    ({"fraction_train": 0.0}, "fraction-train"), ({"fraction_train": 1.2}, "fraction-train"),
    ({"lr_decay": 0.0}, "lr-decay"), ({"lr_decay": 1.1}, "lr-decay"),
    ({"global_lr": 0.0}, "global-lr"), ({"global_lr": -1.0}, "global-lr"),
    ({"lambda_init": "random"}, "lambda-init"), ({"proximal_mu": -1.0}, "proximal-mu"),
    ({"improvement_before": "x"}, "improvement-before"), ({"gram_precision": "float16"}, "gram-precision"),
])
def test_construction_errors_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        FedMGDA(**kwargs)


@pytest.mark.parametrize("rc,key", [({"eps": 2.0}, "eps"), ({"fraction-train": 0.0}, "fraction-train"),
                                    ({"lr-decay": 1.5}, "lr-decay"), ({"global-lr": -1}, "global-lr")])
def test_run_config_errors_name_the_key(rc, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        build_strategy("fedmgda+", rc)


def test_messages_of_the_family():
    class _Grid:
        def get_node_ids(self):
            return [11, 12, 13, 14]
    ensure_task_identity()
    plus = build_strategy("fedmgda+", {"fraction-train": 0.5, "local-steps": 3, "batch-size": 10,
                                       "proximal-mu": 0.3})
    msgs = list(plus.configure_train(4, GLOBAL, ConfigRecord(), _Grid()))
    assert len(msgs) == 2 and {m.metadata.message_type for m in msgs} == {"train.sgd"}
    c = msgs[0].content["config"]
    assert c["local-steps"] == 3 and c["local-epochs"] == 0.0 and c["batch-size"] == 10
    assert c["server-round"] == 4 and "proximal-mu" not in c
    prox = build_strategy("mgda-prox", {"proximal-mu": 0.3, "local-epochs": 1})
    c = list(prox.configure_train(1, GLOBAL, ConfigRecord(), _Grid()))[0].content["config"]
    assert c["proximal-mu"] == 0.3 and c["local-epochs"] == 1.0
    vanilla = build_strategy("fedmgda", {"eps": 0.3, "global-lr": 0.5})
    assert vanilla.config.eps is None and vanilla.normalize is False and vanilla.config.global_lr == 1.0
    fedavg_n = build_strategy("fedavg-n", {"eps": 0.3, "lambda-init": "uniform"})
    assert fedavg_n.config.eps == 0.0 and fedavg_n.config.lambda_init == "size" and fedavg_n.normalize


def test_server_step_float32_model_matches_float64_reference():
    rng = np.random.default_rng(5)
    w = [rng.standard_normal((30, 20)).astype(np.float32), rng.standard_normal(20).astype(np.float32)]
    locs = [[a - rng.standard_normal(a.shape).astype(np.float32) * s for a in w] for s in (0.1, 1.0, 3.0, 0.5)]
    step = fedmgda_server_step(w, locs, eps=1.0, global_lr=1.0)
    X = np.stack([np.concatenate([(a.astype(np.float64) - b).ravel() for a, b in zip(w, loc, strict=True)])
                  for loc in locs])
    U = X / np.linalg.norm(X, axis=1, keepdims=True)
    G = U @ U.T
    lam = min_norm_weights(G, eps=1.0)
    # the float32 step's normalised Gram is off by δ ≤ 2u + 3√d·u per entry (storage rounding of
    # the updates and one float32 sum of d = 620 terms), so its λ is within 2δ of the optimal
    # value on G (plus the QP's 1e-8 + 1e-7·f), and its direction within √(that gap)
    u, d = 2.0**-24, X.shape[1]
    gap = 2 * (2 * u + 3 * np.sqrt(d) * u) + 2 * (1e-8 + 1e-7 * float(lam @ G @ lam))
    assert step.lam @ G @ step.lam - lam @ G @ lam <= gap
    w64 = np.concatenate([a.ravel() for a in w]).astype(np.float64)
    new = np.concatenate([a.ravel() for a in step.arrays])
    assert np.linalg.norm(new - (w64 - lam @ U)) <= np.sqrt(gap) + 3 * u * np.linalg.norm(w64)
    assert step.arrays[0].dtype == np.float32


def test_improved_fraction():
    assert improved_fraction({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.5}) == 0.5
    assert improved_fraction({0: 1.0}, {1: 1.0}) is None


def test_vanilla_fedmgda_two_orthogonal_updates_closed_form():
    # Two orthogonal raw updates: min_λ ‖λ g_1 + (1 − λ) g_2‖² = λ²|g_1|² + (1 − λ)²|g_2|² is
    # minimised at λ_1 = |g_2|²/(|g_1|² + |g_2|²); with η = 1 the step is the λ-average of the
    # local models. |g_1| = 3, |g_2| = 4: λ = (16/25, 9/25).
    g1, g2 = np.array([3.0, 0.0, 0.0, 0.0]), np.array([0.0, 0.0, 0.0, 4.0])
    replies = [_reply(_record(_flat(GLOBAL)[:3] - g[:3], [0.5 - g[3]]), i) for i, g in enumerate((g1, g2))]
    s = build_strategy("fedmgda", {"global-lr": 0.3})  # the variant fixes η = 1 and no box
    s.current_arrays = GLOBAL
    arrays, metrics = s.aggregate_train(1, replies)
    assert s.round_extras()["lambda"] == pytest.approx({"0": 16 / 25, "1": 9 / 25}, abs=1e-12)
    d = 16 / 25 * g1 + 9 / 25 * g2  # = (48, 0, 0, 36)/25, ‖d‖ = 12/5
    np.testing.assert_allclose(_flat(arrays), _flat(GLOBAL) - d, atol=1e-12)
    assert metrics["direction_norm"] == pytest.approx(12 / 5, abs=1e-12)


def test_batchnorm_buffers_are_averaged_not_stepped():
    # A model with BatchNorm: weights/biases are updates, running_mean/running_var and the
    # integer num_batches_tracked are buffers (docs/protocol.md). Two clients take one SGD step
    # in train mode on different data, which moves both their parameters and their statistics.
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = {k for k, _ in model.named_parameters()}
    assert {k for k in start if k not in params} == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    locals_ = []
    for i, shift in enumerate((0.0, 5.0)):
        model.load_state_dict(start)
        model.train()
        x = torch.randn(16, 3) + shift
        loss = model(x).square().mean() * (i + 1)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        locals_.append({k: v.detach().clone().numpy() for k, v in model.state_dict().items()})
    w = {k: v.numpy() for k, v in start.items()}
    glob = ArrayRecord({k: Array(v) for k, v in w.items()})
    replies = [_reply(ArrayRecord({k: Array(v) for k, v in loc.items()}), i) for i, loc in enumerate(locals_)]
    s = build_strategy("fedmgda+", {"eps": 1.0, "global-lr": 0.5})
    s.current_arrays = glob
    arrays, _ = s.aggregate_train(1, replies)
    # two normalised updates always give λ = (½, ½) (the midpoint of two unit vectors is the
    # min-norm point of their segment), so d = (ĝ_1 + ĝ_2)/2 over the parameters only
    assert s.round_extras()["lambda"] == pytest.approx({"0": 0.5, "1": 0.5}, abs=1e-9)
    keys = [k for k in w if k in params]
    gs = [np.concatenate([(w[k].astype(np.float64) - loc[k]).ravel() for k in keys]) for loc in locals_]
    norms = [float(np.linalg.norm(g)) for g in gs]
    # ‖g_i‖ from float32 updates and a float32 Gram sum of 26 terms: ≈ (1 + √26)u relative
    assert [s.round_extras()["update_norms"][p] for p in ("0", "1")] == pytest.approx(norms, rel=1e-6)
    d = 0.5 * (gs[0] / norms[0] + gs[1] / norms[1])
    new = np.concatenate([arrays[k].numpy().ravel() for k in keys])
    ref = np.concatenate([w[k].ravel() for k in keys]) - 0.5 * d
    # float32 model with entries below 2: the stored update, the product and the new entry each
    # round by u = 6e-8 relative, so 1e-6 (> 3u·2) bounds the difference from float64
    assert np.abs(ref).max() < 2.0
    np.testing.assert_allclose(new, ref, atol=1e-6)
    for k in ("1.running_mean", "1.running_var"):
        # the average is taken in float64 and stored in float32: one rounding, u = 6e-8 relative
        np.testing.assert_allclose(arrays[k].numpy(), 0.5 * (locals_[0][k] + locals_[1][k]), rtol=1.2e-7)
        assert not np.allclose(arrays[k].numpy(), w[k])  # the statistics did move
    assert arrays["1.num_batches_tracked"].numpy().dtype == np.int64
    assert int(arrays["1.num_batches_tracked"].numpy()) == 1
