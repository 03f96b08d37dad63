"""DR-DSGD / DSGD: the relayed gossip step, failures, the client step and the errors."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from torch.nn import functional as F

from flowerdro.apps.client_app import app as client_app
from flowerdro.clients.drdsgd import drdsgd_generator, drdsgd_local_step
from flowerdro.clients.handlers import get_runtime
from flowerdro.clients.training import LocalData, minibatches
from flowerdro.comparison import client_config
from flowerdro.experiments import Fault, InProcessGrid
from flowerdro.experiments.inprocess import ensure_task_identity
from flowerdro.strategies import build_strategy, initial_arrays
from flowerdro.strategies.drdsgd import DRDSGD, DSGD


# --------------------------------------------------------------------------- a scripted grid
class ScriptGrid(Grid):
    """Nodes whose train reply is θ_received + δ_pid (or an error), and whose evaluate reply
    reports ``test_loss = Σ θ_received`` so the test can see which model each node got."""

    def __init__(
        self,
        deltas: dict[int, np.ndarray],
        fail: Callable[[int, int], bool] = lambda pid, rnd: False,
        reply_dtype: dict[int, type] | None = None,
    ):
        ensure_task_identity()
        self.deltas, self.fail, self.reply_dtype = deltas, fail, reply_dtype or {}
        self.node_ids = [
            1000 + 7 * (len(deltas) - k) for k in range(len(deltas))
        ]  # reverse of partition order
        self.partition_of = {nid: k for k, nid in enumerate(self.node_ids)}
        self.received: list[tuple[str, int, int, np.ndarray]] = []
        self.configs: list[tuple[str, int, int, dict]] = []
        self._n = 0

    def set_run(self, run):  # noqa: D102
        pass

    @property
    def run(self):  # noqa: D102
        return None

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: D102
        return Message(
            content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id
        )

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return list(self.node_ids)

    def push_messages(self, messages):  # noqa: D102
        raise NotImplementedError

    def pull_messages(self, message_ids):  # noqa: D102
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
        out = []
        for msg in messages:
            self._n += 1
            msg.metadata._message_id = f"s{self._n}"
            nid = int(msg.metadata.dst_node_id)
            pid = self.partition_of[nid]
            rnd = int(msg.content["config"]["server-round"])
            theta = msg.content["arrays"]["w"].numpy()
            mtype = msg.metadata.message_type
            self.received.append((mtype, rnd, pid, theta.copy()))
            self.configs.append((mtype, rnd, pid, dict(msg.content["config"])))
            if mtype.startswith("train"):
                if self.fail(pid, rnd):
                    out.append(
                        Message(error=Error(code=1, reason="scripted failure"), reply_to=msg)
                    )
                    continue
                dtype = self.reply_dtype.get(pid, theta.dtype)
                arrays = ArrayRecord({"w": Array((theta.astype(dtype) + self.deltas[pid]).astype(dtype))})
                metrics = MetricRecord(
                    {
                        "num-examples": 10,
                        "partition-id": pid,
                        "train_loss": 1.0 + pid,
                        "log_tilt_weight": 0.1 * pid,
                        "tilt_capped": 0,
                    }
                )
            else:
                arrays = None
                metrics = MetricRecord(
                    {
                        "num-examples": 5,
                        "partition-id": pid,
                        "test_loss": float(theta.sum()),
                        "test_acc": 0.5,
                    }
                )
            content = RecordDict(
                {"metrics": metrics} if arrays is None else {"arrays": arrays, "metrics": metrics}
            )
            out.append(Message(content=content, reply_to=msg))
        return out


def _ring_by_hand(theta: np.ndarray) -> np.ndarray:
    """Metropolis gossip on the ring C_K: every degree is 2, so W_ij = 1/3 on i, i±1."""
    return (np.roll(theta, 1, axis=0) + theta + np.roll(theta, -1, axis=0)) / 3.0


def _ring_strategy(K: int, **kw) -> DRDSGD:
    return DRDSGD(mu=2.0, topology="ring", num_partitions=K, **kw)


def test_gossip_step_matches_hand_computation_and_each_node_gets_its_own_model():
    # Prepare: K = 5 devices on a ring, device i moves by δ_i at every iteration.
    K = 5
    deltas = {i: np.array([i + 1.0, -2.0 * i, 0.5], dtype=np.float64) for i in range(K)}
    grid = ScriptGrid(deltas)
    strategy = _ring_strategy(K)
    init = ArrayRecord({"w": Array(np.zeros(3))})
    # Execute
    strategy.start(grid, init, num_rounds=2, timeout=10)
    # Assert: θ^1 = W(θ^0 + δ), θ^2 = W(θ^1 + δ), with W worked out by hand.
    D = np.stack([deltas[i] for i in range(K)])
    theta1 = _ring_by_hand(np.zeros((K, 3)) + D)
    theta2 = _ring_by_hand(theta1 + D)
    for i in range(K):
        # float64 models and deltas: two ring averages, rounding ≈ 1e-15 relative; 1e-12 leaves
        # margin
        np.testing.assert_allclose(strategy.device_model(i)["w"].numpy(), theta2[i], rtol=1e-12)
    # round 2 sent device i its own θ_i^1, and evaluation used θ_i^2
    sent2 = {pid: th for mt, rnd, pid, th in grid.received if mt == "train.drdsgd" and rnd == 2}
    for i in range(K):
        np.testing.assert_allclose(sent2[i], theta1[i], rtol=1e-12)
        assert strategy.client_metrics[i]["test_loss"] == pytest.approx(theta2[i].sum(), rel=1e-9)
    # the reported model is the average θ̄ (which gossip with a doubly stochastic W preserves)
    np.testing.assert_allclose(
        strategy.output_arrays(init)["w"].numpy(), theta2.mean(axis=0), rtol=1e-12
    )
    np.testing.assert_allclose(theta2.mean(axis=0), 2 * D.mean(axis=0), rtol=1e-12)


def test_eval_model_average_sends_the_consensus_average_to_every_device():
    # Prepare: as above, but every device evaluates θ̄ instead of its own θ_i.
    K = 5
    deltas = {i: np.array([i + 1.0, -2.0 * i, 0.5 * i * i], dtype=np.float64) for i in range(K)}
    grid = ScriptGrid(deltas)
    strategy = _ring_strategy(K, eval_model="average")
    # Execute
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(3))}), num_rounds=2, timeout=10)
    # Assert: θ̄^2 worked out by hand from the gossip (the mean of the rows of θ^2) ...
    D = np.stack([deltas[i] for i in range(K)])
    theta1 = _ring_by_hand(D)
    theta2 = _ring_by_hand(theta1 + D)
    avg2 = theta2.mean(axis=0)
    # ... and, another way, θ̄ is preserved by a doubly stochastic W: θ̄^2 = 2·mean(δ)
    np.testing.assert_allclose(avg2, 2 * D.mean(axis=0), rtol=1e-12)
    evaluated = {pid: th for mt, rnd, pid, th in grid.received if mt == "evaluate" and rnd == 2}
    assert sorted(evaluated) == list(range(K))
    for i in range(K):
        # float64 averages of 5 rows and their sum (the scripted loss): rounding ≈ 1e-15; 1e-12 /
        # 1e-9 leave margin
        np.testing.assert_allclose(evaluated[i], avg2, rtol=1e-12)
        assert strategy.client_metrics[i]["test_loss"] == pytest.approx(avg2.sum(), rel=1e-9)
    # training still sends each device its own model, and the devices still differ
    sent2 = {pid: th for mt, rnd, pid, th in grid.received if mt == "train.drdsgd" and rnd == 2}
    for i in range(K):
        np.testing.assert_allclose(sent2[i], theta1[i], rtol=1e-12)
        np.testing.assert_allclose(strategy.device_model(i)["w"].numpy(), theta2[i], rtol=1e-12)
    # devices differ by O(1), far above allclose's default rtol 1e-5
    assert not np.allclose(theta2[0], avg2)
    assert strategy.settings()["eval_model"] == "average"


@pytest.mark.parametrize("name", ["drdsgd", "dsgd"])
def test_eval_model_is_read_from_the_run_config_and_checked(name):
    assert build_strategy(name, {"num-partitions": 5}).config.eval_model == "own"
    assert build_strategy(name, {"num-partitions": 5, "eval-model": "average"}).config.eval_model == "average"
    with pytest.raises(ValueError, match="eval-model"):
        build_strategy(name, {"num-partitions": 5, "eval-model": "mean"})
    with pytest.raises(ValueError, match="eval-model"):
        (DRDSGD if name == "drdsgd" else DSGD)(eval_model="global")


def _train_configs(strategy: DRDSGD, K: int = 5) -> list[dict]:
    """The config of every train message of one round against a scripted grid."""
    grid = ScriptGrid({i: np.zeros(1) for i in range(K)})
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(1))}), num_rounds=1, timeout=10,
                   train_config=ConfigRecord({"lr": 0.1, "local-steps": 10}))
    return [cfg for mtype, _, _, cfg in grid.configs if mtype.startswith("train")]


def test_max_tilt_weight_sets_the_log_cap_sent_to_clients_and_is_flagged():
    # default: the e^50 overflow guard, as the paper's algorithm (no binding cap)
    default = build_strategy("drdsgd", {"num-partitions": 5})
    assert default.config.log_cap == 50.0 and default.settings()["tilt_cap_departs_from_paper"] is False
    capped = build_strategy("drdsgd", {"num-partitions": 5, "max-tilt-weight": 0.5})
    assert capped.config.log_cap == pytest.approx(math.log(0.5), rel=1e-15)
    settings = capped.settings()
    # exp and log round-trips of 0.5 in float64: ≤ 1 ulp each; rel 1e-15 ≈ 4 ulps
    assert settings["max_tilt_weight"] == pytest.approx(0.5, rel=1e-15)
    assert settings["tilt_cap_departs_from_paper"] is True
    configs = _train_configs(capped)
    assert len(configs) == 5
    assert all(c["tilt-log-cap"] == pytest.approx(math.log(0.5), rel=1e-15) for c in configs)
    # DSGD has no multiplier, so the option is not even one of its settings
    dsgd = build_strategy("dsgd", {"num-partitions": 5, "max-tilt-weight": 0.5})
    assert "max_tilt_weight" not in dsgd.settings()
    assert all("tilt-log-cap" not in c and "mu" not in c for c in _train_configs(dsgd))


@pytest.mark.parametrize("name", ["drdsgd", "dsgd"])
def test_steps_per_gossip_fixes_the_local_steps_whatever_local_steps_says(name):
    # A comparison config with DRFA's tau = 10: the paper's DR-DSGD still takes one step per gossip.
    shared = build_strategy(name, {"num-partitions": 5, "local-steps": 10, "local-epochs": 2.0})
    assert [c["local-steps"] for c in _train_configs(shared)] == [1] * 5
    assert all("local-epochs" not in c for c in _train_configs(build_strategy(name, {"num-partitions": 5})))
    own = build_strategy(name, {"num-partitions": 5, "local-steps": 10, "steps-per-gossip": 3})
    assert [c["local-steps"] for c in _train_configs(own)] == [3] * 5
    assert own.settings()["local_steps"] == 3
    with pytest.raises(ValueError, match="steps-per-gossip"):
        build_strategy(name, {"num-partitions": 5, "steps-per-gossip": 0})


def test_real_clients_take_one_step_per_gossip_under_a_shared_local_steps(synth_rc):
    # the clients report how many steps they took: one, though the run config says ten
    rc = {**synth_rc, "local-steps": 10, "mu": 2.0, "topology": "ring", "num-partitions": 3}
    grid = InProcessGrid(client_app, 3, rc)
    strategy = build_strategy("drdsgd", rc)
    steps: list[float] = []
    original = strategy.train_step

    def spy(server_round, replies):
        steps.extend(float(r.content["metrics"]["local-steps"]) for r in replies)
        return original(server_round, replies)

    strategy.train_step = spy
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=1, timeout=60, train_config=client_config(rc))
    assert steps == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"max-tilt-weight": 0.0}, "max-tilt-weight"),
        ({"max-tilt-weight": -2.0}, "max-tilt-weight"),
        ({"max-tilt-weight": 1.0, "tilt-log-cap": 3.0}, "not both"),
        ({"tilt-log-cap": -800.0}, "tilt-log-cap"),
    ],
)
def test_bad_tilt_caps_are_named(extra, match):
    with pytest.raises(ValueError, match=match):
        build_strategy("drdsgd", {"num-partitions": 5, **extra})


def test_client_step_with_max_tilt_weight_is_min_of_multiplier_and_cap():
    # μ = 0.5 makes exp(ℓ/μ)/μ well above 1 for a cross-entropy of order 1, so M = 1 binds
    model, data = _toy(seed=7)
    mu, cap = 0.5, 1.0
    expected, loss = _manual_step(
        model, data, 0.2, 8, (0, 3, 2), lambda l: min(math.exp(l / mu) / mu, cap)
    )
    assert math.exp(loss / mu) / mu > cap
    res = drdsgd_local_step(
        model,
        data,
        lr=0.2,
        batch_size=8,
        generator=drdsgd_generator(0, 3, 2),
        mu=mu,
        log_cap=math.log(cap),
    )
    # float32 model, step by two code paths: loss within ~10 float32 eps (1.2e-7), so rel 1e-6;
    # weights of size ~1 after one scaled step within rtol 1e-5 / atol 1e-6 (≈ 10 eps and its
    # absolute floor)
    assert res.capped == 1 and res.scales == [pytest.approx(cap)]
    assert res.log_weights[0] == pytest.approx(loss / mu - math.log(mu), rel=1e-6)
    np.testing.assert_allclose(res.state["weight"].numpy(), expected[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.state["bias"].numpy(), expected[1], rtol=1e-5, atol=1e-6)


def test_round_log_has_consensus_distance_transfers_rho_and_tilt_weights():
    K = 4
    deltas = {i: np.array([float(i), 1.0], dtype=np.float64) for i in range(K)}
    strategy = _ring_strategy(K)
    strategy.start(
        ScriptGrid(deltas), ArrayRecord({"w": Array(np.zeros(2))}), num_rounds=1, timeout=10
    )
    rec = strategy.history[-1]
    theta1 = _ring_by_hand(np.stack([deltas[i] for i in range(K)]))
    expected_xi = np.mean(np.sum((theta1 - theta1.mean(axis=0)) ** 2, axis=1))
    # float64 gossip of 4 rows: rounding ≈ 1e-15 relative; 1e-12 leaves margin
    assert rec["consensus_distance"] == pytest.approx(expected_xi, rel=1e-12)
    assert rec["transfers"] == 2 * K  # a ring has K edges, one model each way
    # ring of 4 with weights 1/3: eigenvalues 1, 1/3, -1/3, 1/3 → ρ = max(λ₂², λ_K²) = 1/9
    assert rec["rho"] == pytest.approx(1 / 9, rel=1e-12)
    assert rec["log_tilt_weight"] == {str(i): pytest.approx(0.1 * i) for i in range(K)}
    assert rec["train"]["train_loss"] == pytest.approx(np.mean([1.0 + i for i in range(K)]))


def test_failed_node_keeps_its_model_and_is_mixed_as_if_it_had_not_moved_scripted():
    K, bad = 5, 2
    deltas = {i: np.array([1.0 + i, 3.0 - i], dtype=np.float64) for i in range(K)}
    grid = ScriptGrid(deltas, fail=lambda pid, rnd: pid == bad and rnd == 2)
    strategy = _ring_strategy(K)
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(2))}), num_rounds=2, timeout=10)
    D = np.stack([deltas[i] for i in range(K)])
    theta1 = _ring_by_hand(D)
    half = theta1 + D
    half[bad] = theta1[bad]  # no step: θ_bad^{t+½} = θ_bad^t
    theta2 = _ring_by_hand(half)
    for i in range(K):
        np.testing.assert_allclose(strategy.device_model(i)["w"].numpy(), theta2[i], rtol=1e-12)
    assert [(f.round, f.partition_id, f.kind) for f in strategy.failures] == [(2, bad, "error")]
    assert strategy.history[-1]["failures"] == {"train:error": 1}
    assert str(bad) not in strategy.history[-1]["log_tilt_weight"]


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().ravel() for k in arrays.keys()])


def test_failed_node_keeps_model_against_real_clients(synth_rc):
    # Prepare: 5 real clients on a ring; partition 3 raises in its round-2 training.
    K, bad = 5, 3
    rc = {**synth_rc, "mu": 3.0, "topology": "ring", "num-partitions": K}
    grid = InProcessGrid(
        client_app, K, rc, faults={bad: Fault("raise", message_types=("train",), rounds=(2,))}
    )
    strategy = build_strategy("drdsgd", rc)
    snapshots: list[dict[int, list[np.ndarray]]] = []
    strategy.add_round_callback(
        lambda rec: snapshots.append({p: [a.copy() for a in m] for p, m in strategy.state.models.items()})
    )
    init = initial_arrays(grid, rc, 60)
    # Execute
    strategy.start(grid, init, num_rounds=2, timeout=60, train_config=client_config(rc))
    # Assert: redo round 2 by hand from the round-1 models, with the failed device standing still.
    theta1, keys = snapshots[0], strategy.state.keys
    cfg = ConfigRecord(
        {**client_config(rc), "server-round": 2, "local-steps": 1, "mu": 3.0, "tilt-log-cap": 50.0}
    )
    clean = InProcessGrid(client_app, K, rc)
    node_of = {p: n for n, p in clean.partition_of_node.items()}
    half = {}
    for pid in range(K):
        if pid == bad:
            half[pid] = theta1[pid]
            continue
        msg = Message(
            content=RecordDict(
                {"arrays": ArrayRecord({k: Array(a) for k, a in zip(keys, theta1[pid], strict=True)}),
                 "config": cfg}
            ),
            dst_node_id=node_of[pid],
            message_type="train.drdsgd",
        )
        reply = clean.send_and_receive([msg])[0]
        assert not reply.has_error(), reply.error
        assert reply.content["metrics"]["partition-id"] == pid
        half[pid] = [reply.content["arrays"][k].numpy() for k in keys]
    W = strategy.mixing_matrix(1)
    assert strategy.state.order == list(range(K))  # row i of W is partition i
    for i in range(K):
        expected = [sum(W[i, j] * half[j][layer].astype(np.float64) for j in range(K)) for layer in range(len(keys))]
        # float32 models: the mix rounds once to float32 (rel. 6e-8) after float64 sums of five
        # terms; 1e-6 leaves room for the client's float32 step being recomputed on another grid
        for e, g in zip(expected, strategy.state.models[i], strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)
    assert [f.partition_id for f in strategy.failures] == [bad]


# --------------------------------------------------------------------------- the client step
def _toy(seed: int = 0, n: int = 40, d: int = 6, c: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, c, (n,), generator=g)
    data = LocalData(x, y, x[:5], y[:5])
    model = torch.nn.Linear(d, c)
    with torch.no_grad():
        model.weight.copy_(torch.randn(c, d, generator=g))
        model.bias.copy_(torch.randn(c, generator=g))
    return model, data


def _manual_step(model, data, lr, batch_size, gen_args, multiplier: Callable[[float], float]):
    """θ − η m(ℓ) ∇ℓ_B(θ) on the same first minibatch the client draws."""
    idx = next(
        minibatches(data.num_train, batch_size, drdsgd_generator(*gen_args), data.x_train.device)
    )
    params = [p.detach().clone().requires_grad_(True) for p in (model.weight, model.bias)]
    loss = F.cross_entropy(data.x_train[idx] @ params[0].T + params[1], data.y_train[idx])
    grads = torch.autograd.grad(loss, params)
    m = multiplier(float(loss.detach()))
    new = [(p - lr * m * g).detach().numpy() for p, g in zip(params, grads, strict=True)]
    return new, float(loss.detach())


def test_dsgd_step_is_plain_sgd_step():
    model, data = _toy()
    expected, _ = _manual_step(model, data, 0.3, 8, (1, 2, 3), lambda loss: 1.0)
    res = drdsgd_local_step(
        model,
        data,
        lr=0.3,
        batch_size=8,
        generator=drdsgd_generator(1, 2, 3),
        mu=None,
        robust=False,
    )
    # float32 model, one SGD step by two code paths: ~10 float32 eps (1.2e-7) on weights of size ~1
    np.testing.assert_allclose(res.state["weight"].numpy(), expected[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.state["bias"].numpy(), expected[1], rtol=1e-5, atol=1e-6)
    assert res.scales == [1.0] and res.log_weights == [0.0] and res.capped == 0


@pytest.mark.parametrize("mu", [0.5, 2.0, 6.0])
def test_drdsgd_step_scale_is_exp_loss_over_mu_over_mu(mu):
    model, data = _toy(seed=4)
    expected, loss = _manual_step(model, data, 0.1, 10, (0, 5, 1), lambda l: math.exp(l / mu) / mu)
    res = drdsgd_local_step(
        model, data, lr=0.1, batch_size=10, generator=drdsgd_generator(0, 5, 1), mu=mu
    )
    # float32 loss by two code paths: a few eps (1.2e-7); exp(ℓ/μ)/μ and ℓ/μ − log μ inherit it
    # times ℓ/μ ≲ 3,
    # so rel 1e-6; weights as in the plain step (rtol 1e-5, atol 1e-6)
    assert res.losses[0] == pytest.approx(loss, rel=1e-6)
    assert res.scales[0] == pytest.approx(math.exp(loss / mu) / mu, rel=1e-6)
    assert res.log_weights[0] == pytest.approx(loss / mu - math.log(mu), rel=1e-6)
    np.testing.assert_allclose(res.state["weight"].numpy(), expected[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.state["bias"].numpy(), expected[1], rtol=1e-5, atol=1e-6)


def test_tiny_mu_is_capped_and_stays_finite():
    model, data = _toy(seed=2)
    res = drdsgd_local_step(
        model, data, lr=1e-3, batch_size=10, generator=drdsgd_generator(0, 1, 0), mu=1e-3
    )
    # scale = exp(cap 50) in float64: ≤ 1 ulp; default approx (rel 1e-6) is ample
    assert res.capped == 1 and res.scales[0] == pytest.approx(math.exp(50.0))
    assert res.log_weights[0] > 50  # uncapped log-weight kept exactly
    assert all(torch.isfinite(v).all() for v in res.state.values())


def _numpy_first_batch_loss(data: LocalData, arrays: ArrayRecord, *, batch_size: int, seed: int, rnd: int,
                            pid: int) -> float:
    """Cross-entropy of a logistic regression on the device's first DR-DSGD minibatch, in numpy.

    The minibatch is the first ``batch_size`` entries of the permutation drawn from the
    device's generator for (seed, round, partition); the loss is mean(logsumexp(z) − z_y)
    with z = x Wᵀ + b.
    """
    idx = torch.randperm(data.num_train, generator=drdsgd_generator(seed, rnd, pid))[:batch_size].numpy()
    x = data.x_train.cpu().numpy().reshape(data.num_train, -1)[idx].astype(np.float64)
    y = data.y_train.cpu().numpy()[idx]
    weight = arrays["linear.weight"].numpy().astype(np.float64)
    bias = arrays["linear.bias"].numpy().astype(np.float64)
    z = x @ weight.T + bias
    zmax = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - zmax).sum(axis=1)) + zmax[:, 0]
    return float(np.mean(lse - z[np.arange(len(y)), y]))


def test_handler_reply_keys_and_log_weight(synth_rc):
    K = 2
    grid = InProcessGrid(client_app, K, synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    cfg = ConfigRecord({**client_config(synth_rc), "server-round": 1, "local-steps": 1, "mu": 1.5})
    msg = Message(
        content=RecordDict({"arrays": init, "config": cfg}),
        dst_node_id=grid.node_ids[1],
        message_type="train.drdsgd",
    )
    reply = grid.send_and_receive([msg])[0]
    m = reply.content["metrics"]
    assert set(m.keys()) == {
        "num-examples",
        "partition-id",
        "train_loss",
        "train_loss_local",
        "log_tilt_weight",
        "tilt_capped",
        "local-steps",
    }
    assert m["partition-id"] == 1 and m["tilt_capped"] == 0
    assert m["train_loss_local"] == m["train_loss"]  # one step: its loss is the received θ_i's
    # h = exp(ℓ/μ) by hand, with ℓ the cross-entropy of the received logistic regression on the
    # device's first minibatch, computed in float64 numpy from the data and the weights
    ctx = grid.contexts[grid.node_ids[1]]
    loss = _numpy_first_batch_loss(get_runtime(ctx).data, init, batch_size=16, seed=0, rnd=1, pid=1)
    h = math.exp(loss / 1.5)
    # float32 client forward pass vs float64 here: logits of 20 features and a 5-class
    # logsumexp carry a few float32 eps (1.2e-7) each, so ℓ (about 1.6) and log(h/μ) agree to 1e-6
    assert m["log_tilt_weight"] == pytest.approx(math.log(h / 1.5), abs=1e-6)
    # a cap below 1 (max-tilt-weight 0.5, sent as tilt-log-cap = log 0.5 < 0) is accepted
    low = ConfigRecord({**dict(cfg), "tilt-log-cap": math.log(0.5)})
    capped = grid.send_and_receive(
        [Message(content=RecordDict({"arrays": init, "config": low}), dst_node_id=grid.node_ids[1],
                 message_type="train.drdsgd")]
    )[0]
    assert not capped.has_error(), capped.error
    mc = capped.content["metrics"]
    assert mc["log_tilt_weight"] == pytest.approx(m["log_tilt_weight"], rel=1e-9)  # same batch
    assert mc["log_tilt_weight"] > math.log(0.5) and mc["tilt_capped"] == 1
    # same minibatch, same gradient: the capped update is the uncapped one scaled by 0.5/(h/μ)
    theta0 = {k: init[k].numpy().astype(np.float64) for k in init.keys()}
    ratio = 0.5 / math.exp(m["log_tilt_weight"])
    for k in init.keys():
        full = reply.content["arrays"][k].numpy() - theta0[k]
        part = capped.content["arrays"][k].numpy() - theta0[k]
        # θ − θ0 cancels in float32: relative error ≈ u·|θ|/|Δθ| ≈ 1e-5 for steps ~1% of θ, so rtol
        # 1e-4;
        # atol 1e-7 ≈ one float32 ulp of O(1) weights for entries whose update is near 0
        np.testing.assert_allclose(part, ratio * full, rtol=1e-4, atol=1e-7)
    # without mu the robust handler refuses, naming the key
    del cfg["mu"]
    bad = Message(
        content=RecordDict({"arrays": init, "config": cfg}),
        dst_node_id=grid.node_ids[0],
        message_type="train.drdsgd",
    )
    reply = grid.send_and_receive([bad])[0]
    assert reply.has_error() and "mu" in reply.error.reason
    dsgd = Message(
        content=RecordDict({"arrays": init, "config": cfg}),
        dst_node_id=grid.node_ids[0],
        message_type="train.dsgd",
    )
    assert grid.send_and_receive([dsgd])[0].content["metrics"]["log_tilt_weight"] == 0.0


# --------------------------------------------------------------------------- graphs and errors
def test_resampled_graph_changes_and_logs_expected_rho():
    K = 6
    deltas = {i: np.array([float(i)]) for i in range(K)}
    strategy = DRDSGD(mu=1.0, topology="erdos_renyi", graph_p=0.5, graph_resample=True, num_partitions=K, seed=3)
    strategy.start(
        ScriptGrid(deltas), ArrayRecord({"w": Array(np.zeros(1))}), num_rounds=4, timeout=10
    )
    Ws = [strategy.mixing_matrix(t) for t in range(4)]
    assert any(not np.array_equal(Ws[0], W) for W in Ws[1:])
    rho_exp = strategy.history[-1]["rho_expected"]
    gram = sum(W.T @ W for W in Ws) / 4
    # float64 2-norm of a 6×6 symmetric matrix: eigen-solver rounding ≈ K·eps; rel 1e-12 leaves
    # margin
    assert rho_exp == pytest.approx(np.linalg.norm(gram - np.full((K, K), 1 / K), ord=2), rel=1e-12)
    assert all(r["rho"] < 1 for r in strategy.history)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"mu": 0.0}, "mu"),
        ({"mu": -1.0}, "mu"),
        ({"graph-p": 0.0}, "graph-p"),
        ({"graph-p": 1.5}, "graph-p"),
        ({"topology": "geometric", "graph-radius": 2.0}, "graph-radius"),
        ({"topology": "star"}, "topology.*allowed"),
        ({"topology": "ring", "num-partitions": 2}, "K=2.*>= 3"),
        ({"topology": "grid", "num-partitions": 7}, "K=7.*prime"),
        ({"graph-p": 0.01, "num-partitions": 40}, "disconnected"),
        ({"topology": "geometric", "graph-radius": 0.01, "num-partitions": 30}, "disconnected"),
        ({"graph-seed": -1}, "graph-seed"),
        ({"lr": -0.1}, "lr"),
        ({"steps-per-gossip": 1.5}, "steps-per-gossip"),
        ({"eval-model": "mean"}, "eval-model.*allowed: own, average"),
    ],
)
def test_bad_settings_are_named(extra, match):
    rc = {"num-partitions": 10, **extra}
    with pytest.raises(ValueError, match=match):
        build_strategy("drdsgd", rc)


def test_partial_participation_is_refused_directly_and_overridden_from_a_shared_run_config():
    # Every device steps every iteration: constructing DR-DSGD with a fraction is an error,
    # but a run config shared with other strategies (fraction-train = 0.5) must not fail it.
    with pytest.raises(ValueError, match="fraction-train"):
        DRDSGD(mu=1.0, fraction_train=0.5)
    for name in ("drdsgd", "dsgd"):
        assert build_strategy(name, {"num-partitions": 10, "fraction-train": 0.5}).loop.fraction_train == 1.0


def test_dsgd_ignores_mu_but_checks_the_graph():
    assert build_strategy("dsgd", {"mu": -1.0, "num-partitions": 5}).robust is False
    with pytest.raises(ValueError, match="graph-p"):
        build_strategy("dsgd", {"graph-p": 0.0})


def test_k_from_connected_nodes_is_validated_at_first_round(synth_rc):
    grid = InProcessGrid(client_app, 2, synth_rc)
    strategy = DRDSGD(mu=1.0, topology="ring")  # K unknown until the first round
    with pytest.raises(ValueError, match="K=2"):
        strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=1, timeout=60)


def test_more_nodes_than_devices_is_refused(synth_rc):
    grid = InProcessGrid(client_app, 4, synth_rc)
    strategy = DRDSGD(mu=1.0, topology="ring", num_partitions=3)
    with pytest.raises(ValueError, match="num-partitions"):
        strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=1, timeout=60)


# --------------------------------------------------------------------------- reliability
def test_device_models_keep_their_dtype_when_a_client_replies_float64():
    # Prepare: float32 models on a ring of 5; device 2 answers in float64 every round.
    K = 5
    deltas = {i: np.array([0.5 * i, 1.0], dtype=np.float64) for i in range(K)}
    grid = ScriptGrid(deltas, reply_dtype={2: np.float64})
    strategy = _ring_strategy(K)
    init = ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))})
    # Execute
    res = strategy.start(grid, init, num_rounds=3, timeout=10)
    # Assert: every device model, every model sent and the reported model stay float32 ...
    assert {m[0].dtype for m in strategy.state.models.values()} == {np.dtype(np.float32)}
    assert {th.dtype for _, _, _, th in grid.received} == {np.dtype(np.float32)}
    assert res.arrays["w"].numpy().dtype == np.float32
    assert len({r["bytes_sent"] for r in strategy.history}) == 1
    # ... with the values of the gossip worked out by hand (float32 rounding: 6e-8 relative)
    D = np.stack([deltas[i] for i in range(K)])
    theta = np.zeros((K, 2))
    for _ in range(3):
        theta = _ring_by_hand(theta + D)
    for i in range(K):
        np.testing.assert_allclose(strategy.device_model(i)["w"].numpy(), theta[i], rtol=1e-6)


class _RestartingGrid(InProcessGrid):
    """Partition ``restart`` goes away after round ``down`` and comes back on a new node id after ``up``."""

    def __init__(self, *args, restart: int, down: int, up: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.restart, self.down, self.up = restart, down, up
        self.old_id = self.node_ids[restart]
        self.new_id = self.old_id + 1_000_000
        self.sent: list[Message] = []

    def on_round(self, rnd: int) -> None:
        if rnd == self.down + 1:
            self.disconnect(self.restart)
        if rnd == self.up + 1:
            self.reconnect(self.restart, self.new_id, keep_state=True)

    def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
        messages = list(messages)
        self.sent.extend(messages)
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.parametrize("up", [1, 2])
def test_a_restarted_node_takes_its_partitions_place(synth_rc, up):
    # Prepare: 4 real clients on a ring; partition 1's node dies after round 1 and comes back
    # on a new node id after round `up` (up = 1: at once; up = 2: one round away).
    K, rc = 4, {**synth_rc, "mu": 2.0, "topology": "ring", "num-partitions": 4}
    grid = _RestartingGrid(client_app, K, rc, restart=1, down=1, up=up)
    strategy = build_strategy("drdsgd", rc)
    snapshots: list[dict[int, list[np.ndarray]]] = []
    strategy.add_round_callback(lambda rec: snapshots.append(
        {p: [a.copy() for a in m] for p, m in strategy.state.models.items()}))
    strategy.add_round_callback(lambda rec: grid.on_round(rec["round"] + 1))
    # Execute
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=4, timeout=60, train_config=client_config(rc))
    # Assert: the new node is partition 1 and got partition 1's own model θ_1 in its first training
    assert strategy.partition(grid.new_id) == 1 and strategy.partition(grid.old_id) is None
    first = next(m for m in grid.sent if m.metadata.message_type == "train.drdsgd"
                 and int(m.metadata.dst_node_id) == grid.new_id)
    assert int(first.content["config"]["server-round"]) == up + 1
    before = snapshots[up - 1][1]  # θ_1 after round `up`
    for k, a in zip(strategy.state.keys, before, strict=True):
        np.testing.assert_array_equal(first.content["arrays"][k].numpy(), a)
    # partition 1 trains and is evaluated again from then on; while it was away it is reported missing
    assert [sorted(r["log_tilt_weight"]) for r in strategy.history][up:] == [["0", "1", "2", "3"]] * (4 - up)
    assert [sorted(r["client_acc"]) for r in strategy.history][up:] == [["0", "1", "2", "3"]] * (4 - up)
    assert [r["missing"] for r in strategy.history] == [{}] + [{"1": "node gone"}] * (up - 1) + [{}] * (4 - up)
    assert strategy.state.order == [0, 1, 2, 3] and not any(r["failures"] for r in strategy.history)


def test_a_device_silent_in_the_first_round_is_asked_its_partition_and_keeps_its_row(synth_rc):
    # Prepare: partition 2 fails its first training, before the server has heard its partition id
    K, rc = 4, {**synth_rc, "mu": 2.0, "topology": "ring", "num-partitions": 4}
    grid = InProcessGrid(client_app, K, rc, faults={2: Fault("raise", message_types=("train",), rounds=(1,))})
    strategy = build_strategy("drdsgd", rc)
    init = initial_arrays(grid, rc, 60)
    # Execute
    strategy.start(grid, init, num_rounds=1, timeout=60, train_config=client_config(rc))
    # Assert: the silent node was asked its partition, so the rows of W are partitions 0..3,
    # and the failure is attributed to the real node
    assert strategy.state.order == [0, 1, 2, 3]
    assert strategy.partition(grid.node_ids[2]) == 2
    assert [(f.phase, f.node_id) for f in strategy.failures] == [("train", grid.node_ids[2])]
    assert sorted(strategy.history[-1]["log_tilt_weight"]) == ["0", "1", "3"]
