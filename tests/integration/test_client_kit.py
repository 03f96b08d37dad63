"""The client toolkit: every strategy with a user's own model, data and loss.

The user-pieces path must compute what flowerdro's own ClientApp computes when the pieces
are flowerdro's own model and data (same seed: bit-identical round records), run the
user's own training function where the algorithm allows it, and turn bad pieces into
errors that name what was expected.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from flowerdro.apps.client_app import app as flowerdro_app
from flowerdro.clients import ClientKit, add_routes
from flowerdro.clients.kit import ROUTES, check_state_dict, tensors_of
from flowerdro.comparison import client_config
from flowerdro.data import DataConfig, get_client_data
from flowerdro.experiments import InProcessGrid
from flowerdro.models import build_model
from flowerdro.strategies import build_strategy, initial_arrays, strategy_names

#: Keys of a round record that measure the machine, not the algorithm.
VOLATILE = ("time_s", "server_step_s")

#: Every algorithm key set (as the golden config does), on a 4-client synthetic federation.
ALGO_KEYS = {"dual-lr": 0.01, "q": 0.5, "proximal-mu": 0.1, "eps": 0.2, "mu": 6.0, "topology": "ring",
             "adv-lr": 0.01, "affine-lambda": 1.0, "adv-eps": 0.5, "pgd-steps": 3}


def own_pieces_kit(rc: dict, n: int, **kwargs) -> ClientKit:
    """A kit whose pieces are flowerdro's own logreg model and synthetic data, as a user would pass them."""
    cfg = DataConfig.from_run_config(rc, num_partitions=n)
    probe = get_client_data(cfg, 0)
    shape, classes = tuple(probe.input_shape), int(probe.num_classes)

    def data_fn(pid: int, num: int):
        cd = get_client_data(cfg, pid)
        return (cd.x_train, cd.y_train), (cd.x_test, cd.y_test)

    # device unset: "auto", as flowerdro's own client (CUDA where available, for both paths)
    return ClientKit(model_fn=lambda: build_model("logreg", shape, classes), data_fn=data_fn,
                     loss_fn=nn.CrossEntropyLoss(), **kwargs)


def _records(app, name: str, rc: dict, n: int = 4, rounds: int = 2):
    grid = InProcessGrid(app, n, rc)
    strategy = build_strategy(name, rc)
    res = strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=rounds, timeout=60,
                         train_config=client_config(rc))
    recs = [{k: v for k, v in r.items() if k not in VOLATILE} for r in strategy.history]
    return recs, np.concatenate([res.arrays[k].numpy().ravel() for k in res.arrays.keys()])


@pytest.mark.parametrize("name", strategy_names())
def test_user_pieces_give_the_round_records_of_flowerdros_own_client(synth_rc, name):
    rc = {**synth_rc, **ALGO_KEYS, **({"local-steps": 1} if name in ("drdsgd", "dsgd") else {})}
    own_recs, own_model = _records(flowerdro_app, name, rc)
    kit_recs, kit_model = _records(own_pieces_kit(rc, 4).client_app(), name, rc)
    assert not any(r["failures"] for r in kit_recs)
    assert kit_recs == own_recs  # same tensors, same loops, same seeds: bit-identical
    np.testing.assert_array_equal(kit_model, own_model)


def _sgd_train(model: nn.Module, loader, args) -> float:
    """A user's own training loop (plain torch.optim.SGD over the loader for ``epochs``)."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    model.train()
    losses = []
    for _ in range(int(args.epochs)):
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return float(np.mean(losses))


def _loader_kit(rc: dict, n: int, calls: list, **kwargs) -> ClientKit:
    from torch.utils.data import DataLoader, TensorDataset

    cfg = DataConfig.from_run_config(rc, num_partitions=n)
    probe = get_client_data(cfg, 0)

    def data_fn(pid: int, num: int):
        cd = get_client_data(cfg, pid)
        tr = TensorDataset(torch.tensor(cd.x_train, dtype=torch.float32), torch.tensor(cd.y_train))
        te = TensorDataset(torch.tensor(cd.x_test, dtype=torch.float32), torch.tensor(cd.y_test))
        return DataLoader(tr, batch_size=16, shuffle=True), DataLoader(te, batch_size=64)

    def train_fn(model, loader, args):
        calls.append(args)
        return _sgd_train(model, loader, args)

    # device "auto": train_fn gets the model on the CPU, where the loader's tensors are
    return ClientKit(model_fn=lambda: build_model("logreg", probe.input_shape, probe.num_classes),
                     data_fn=data_fn, loss_fn=nn.CrossEntropyLoss(), train_fn=train_fn, **kwargs)


def test_the_users_train_function_runs_for_fedavg_and_reports_the_received_models_loss(synth_rc):
    calls: list = []
    rc = {**synth_rc, "local-epochs": 2}
    kit = _loader_kit(rc, 3, calls)
    recs, _ = _records(kit.client_app(), "qfedavg", {**rc, "q": 0.5}, n=3)
    assert len(calls) == 2 * 3 and all(a.epochs == 2 for a in calls)
    assert not any(r["failures"] for r in recs)
    # train_loss is F_i(w) of the received model: round 1 starts from the same model everywhere,
    # so it equals the full-data loss of the initial model computed here independently
    grid = InProcessGrid(kit.client_app(), 3, rc)
    init = initial_arrays(grid, rc, 60)
    ctx = grid.contexts[grid.node_ids[0]]
    rt = kit.runtime(ctx)
    model = rt.model_from(init)
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(model(rt.data.x_train), rt.data.y_train))
    msg = _train_message(grid, init, rc)
    reply = grid.app(msg, ctx)
    # mean of per-batch sums vs one mean: float32 rounding over ≤ 10^3 terms (≈ 1e-7 · 10^3)
    assert abs(reply.content["metrics"]["train_loss"] - expected) < 1e-4
    assert "train_loss_local" in reply.content["metrics"]


def _train_message(grid, arrays, rc, extra=None):
    from flwr.app import Message

    cfg = client_config(rc)
    cfg["server-round"] = 1
    for k, v in (extra or {}).items():
        cfg[k] = v
    return Message(content=RecordDict({"arrays": arrays, "config": cfg}), dst_node_id=grid.node_ids[0],
                   message_type="train")


def _two_full_batch_steps(model: nn.Module, loader, args) -> float:
    """A user's loop of two full-batch SGD steps (the same steps at every call)."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = loader.dataset.tensors
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return 0.0


def test_fedprox_hooks_add_the_proximal_gradient_to_the_users_loop(synth_rc):
    # A user's loop of two full-batch SGD steps; with the hooks they must be FedProx's steps
    # w1 = w0 − η ∇f(w0) (the proximal term vanishes at w⁰) and w2 = w1 − η (∇f(w1) + μ (w1 − w0)),
    # recomputed here by hand.
    lr, mu = 0.1, 0.5
    kit = _loader_kit(synth_rc, 2, [])
    kit.train_fn = _two_full_batch_steps
    grid = InProcessGrid(kit.client_app(), 2, synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    ctx = grid.contexts[grid.node_ids[0]]
    reply = grid.app(_train_message(grid, init, {**synth_rc, "lr": lr}, {"proximal-mu": mu}), ctx)
    got = reply.content["arrays"].to_torch_state_dict()
    # the same two steps by hand, through torch.func on a copy of the model
    rt = kit.runtime(ctx)
    x, y = rt.train_loader.dataset.tensors
    model = rt.model_from(init).to(x.device)  # where the user's loop ran
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    for _ in range(2):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for k, p in model.named_parameters():
                p -= lr * (p.grad + mu * (p - w0[k]))
    for k, p in model.named_parameters():
        # two float32 SGD steps computed in another order: a few ulps of values of size ~1
        torch.testing.assert_close(got[k], p.detach(), rtol=0, atol=1e-6)


def test_an_update_scale_attacker_with_the_users_train_function_sends_the_scaled_update(synth_rc):
    # FedMGDA+'s update-scaling attacker (§6.2.2) trains honestly and sends w0 + s·(w − w0): the
    # honest reply of the same deterministic loop, scaled here by hand; loss-scale cannot scale
    # the loss of the user's own loop and is refused, naming the way out
    kit = _loader_kit(synth_rc, 2, [])
    kit.train_fn = _two_full_batch_steps
    grid = InProcessGrid(kit.client_app(), 2, synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    ctx = grid.contexts[grid.node_ids[0]]
    attacker = {"malicious-ids": "0", "attack-scale": 3.0}
    honest = grid.app(_train_message(grid, init, synth_rc), ctx).content["arrays"].to_torch_state_dict()
    scaled = grid.app(_train_message(grid, init, synth_rc, {**attacker, "attack": "update-scale"}), ctx)
    got = scaled.content["arrays"].to_torch_state_dict()
    w0 = init.to_torch_state_dict()
    for k in w0:
        assert not torch.equal(honest[k], w0[k])
        # w0 + 3 (w − w0) in float32: a few ulps of values of size ~1
        torch.testing.assert_close(got[k], w0[k] + 3.0 * (honest[k] - w0[k]), rtol=0, atol=1e-6)
    refused = grid.app(_train_message(grid, init, synth_rc, {**attacker, "attack": "loss-scale"}), ctx)
    assert refused.has_error() and re.match("ValueError: .*loss-scale.*own train_fn.*update-scale", refused.error.reason)


def test_clients_without_partition_id_use_their_node_id(synth_rc):
    kit = own_pieces_kit(synth_rc, 3)
    ctx = Context(run_id=1, node_id=987654, node_config={}, state=RecordDict(), run_config=dict(synth_rc))
    seen = []
    inner = kit.data_fn
    kit.data_fn = lambda pid, n: (seen.append((pid, n)), inner(0, 3))[1]
    assert kit.runtime(ctx).partition_id == 987654 and seen == [(987654, 0)]


def test_a_route_the_app_already_serves_is_kept_unless_replaced(synth_rc):
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def mine(msg, context):  # noqa: ARG001
        raise RuntimeError("the user's own route")

    kit = own_pieces_kit(synth_rc, 2)
    add_routes(app, kit)
    assert app._registered_funcs.keys() >= {"train.default", "train.drfa", "query.loss_grad", "evaluate.default"}
    grid = InProcessGrid(app, 2, synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    with pytest.raises(RuntimeError, match="user's own route"):
        app(_train_message(grid, init, synth_rc), grid.contexts[grid.node_ids[0]])
    add_routes(app, kit, replace=True)
    reply = app(_train_message(grid, init, synth_rc), grid.contexts[grid.node_ids[0]])
    assert not reply.has_error()
    assert len(ROUTES) == 15


# --------------------------------------------------------------------------- clear errors
class _Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(20, 5)

    def forward(self, x):
        return self.fc(x)


def test_a_model_that_does_not_match_the_servers_arrays_names_the_keys():
    server = ArrayRecord({"linear.weight": torch.zeros(5, 20), "linear.bias": torch.zeros(5)})
    with pytest.raises(ValueError) as err:
        check_state_dict(_Other(), server)
    msg = str(err.value)
    assert "fc.weight" in msg and "linear.weight" in msg and "state_dict" in msg
    wrong = ArrayRecord({"fc.weight": torch.zeros(5, 21), "fc.bias": torch.zeros(5)})
    with pytest.raises(ValueError, match=r"fc.weight: server \(5, 21\), model \(5, 20\)"):
        check_state_dict(_Other(), wrong)


@pytest.mark.parametrize("name", ["fedavg", "drfa", "scaffold"])
def test_a_model_mismatch_stops_the_run_in_round_1_with_the_error_logged_once(synth_rc, name, caplog):
    # the server's model has one class more than the clients' (a project that changed its
    # model on one side): every client fails alike, so the run stops in round 1 with the
    # client's message naming the array and both shapes, logged in full once
    import logging

    from flowerdro.strategies.replies import DeterministicClientError

    kit = own_pieces_kit(synth_rc, 4)
    grid = InProcessGrid(kit.client_app(), 4, synth_rc)
    theirs = initial_arrays(grid, synth_rc, 60).to_torch_state_dict()
    server = ArrayRecord({k: torch.zeros((v.shape[0] + 1, *v.shape[1:])) for k, v in theirs.items()})
    weight = next(k for k, v in theirs.items() if v.dim() == 2)
    shapes = f"{weight}: server {tuple(server[weight].shape)}, model {tuple(theirs[weight].shape)}"
    strategy = build_strategy(name, {**synth_rc, "max-failed-rounds": 3})
    caplog.set_level(logging.WARNING, logger="flwr")  # whatever an earlier test left
    with pytest.raises(DeterministicClientError) as err:
        strategy.start(grid, server, num_rounds=5, timeout=60, train_config=client_config(synth_rc))
    assert strategy.round.number == 1 and not strategy.history
    assert shapes in str(err.value)
    assert sum(shapes in r.getMessage() for r in caplog.records) == 1


def test_bad_data_gets_an_error_naming_what_was_expected(synth_rc):
    x = np.zeros((8, 20), np.float32)
    with pytest.raises(ValueError, match="expected floating point"):
        tensors_of((np.zeros((8, 20), np.uint8), np.zeros(8, np.int64)), "train data")
    with pytest.raises(ValueError, match="one label per example"):
        tensors_of([(torch.zeros(8, 20), torch.zeros(7, dtype=torch.long))], "train data")
    with pytest.raises(ValueError, match="batch_keys"):
        tensors_of([{"img": torch.zeros(2, 20), "label": torch.zeros(2, dtype=torch.long)}], "train data")
    x7 = np.zeros((8, 7), np.float32)
    kit = ClientKit(model_fn=_Other, data_fn=lambda p, n: ((x7, np.zeros(8, np.int64)), (x, np.zeros(8, np.int64))),
                    loss_fn=nn.CrossEntropyLoss(), device=torch.device("cpu"))
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                  run_config={})
    with pytest.raises(ValueError, match=r"test data: inputs of shape \(20,\) per example; the training inputs "
                                         r"have \(7,\)"):
        kit.runtime(ctx)
    kit.data_fn = lambda p, n: ((x7, np.zeros(8, np.int64)), (x7, np.zeros(8, np.int64)))
    with pytest.raises(ValueError, match=r"could not run on inputs of shape \(2, 7\)"):
        kit.runtime(ctx)
    kit = ClientKit(model_fn=_Other, data_fn=lambda p, n: ((x, np.full(8, 9)), (x, np.zeros(8, np.int64))),
                    loss_fn=nn.CrossEntropyLoss(), device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"labels in \[9, 9\] but the model has 5 outputs"):
        kit.runtime(ctx)
    kit = ClientKit(model_fn=_Other, data_fn=lambda p, n: ((x, np.zeros(8, np.float32)), (x, np.zeros(8))),
                    loss_fn=nn.CrossEntropyLoss(), device=torch.device("cpu"))
    with pytest.raises(ValueError, match="expects integer class labels"):
        kit.runtime(ctx)


def test_a_missing_loss_function_and_an_unknown_metric_name_are_refused(synth_rc):
    with pytest.raises(ValueError, match="loss_fn: missing"):
        ClientKit(model_fn=_Other, data_fn=lambda p, n: None)
    kit = own_pieces_kit(synth_rc, 2, test_fn=lambda model, loader, device: (0.5, {"acc": 0.9}),
                         test_accuracy_key="accuracy")
    grid = InProcessGrid(kit.client_app(), 2, synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    from flwr.app import Message

    msg = Message(content=RecordDict({"arrays": init}), dst_node_id=grid.node_ids[0], message_type="evaluate")
    reply = kit.client_app()(msg, grid.contexts[grid.node_ids[0]])  # the error travels in the reply
    assert reply.has_error() and reply.error.reason.startswith(
        "ValueError: test_accuracy_key: none of ['accuracy'] is among your test function's metrics ['acc']")


def _kit_behind(route):
    """The kit a route serves with: the handler itself, or the one inside its mods' closures."""
    seen, todo = set(), [route]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if hasattr(f, "kit"):
            return f.kit
        todo.extend(getattr(f, "inner", None) for _ in [0] if hasattr(f, "inner"))
        todo.extend(c.cell_contents for c in (getattr(f, "__closure__", None) or ()) if callable(c.cell_contents))
    raise AssertionError(f"no kit behind {route}")


def test_copies_of_a_pickled_kit_app_serve_from_one_kit(synth_rc):
    """Flower's Ray simulation pickles the ClientApp with every message it hands an actor:
    the copies in one process must share one kit, so the user's data is read once per
    partition, not once per message."""
    cloudpickle = pytest.importorskip("cloudpickle")
    from flwr.app import Message

    grid = InProcessGrid(flowerdro_app, 2, synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    blob = cloudpickle.dumps(own_pieces_kit(synth_rc, 2).client_app())
    first, second = cloudpickle.loads(blob), cloudpickle.loads(blob)
    nid = grid.node_ids[0]
    replies = [app(Message(content=RecordDict({"arrays": init}), dst_node_id=nid, message_type="evaluate"),
                   grid.contexts[nid]) for app in (first, second)]
    kits = {id(_kit_behind(app._registered_funcs[name])) for app in (first, second) for name in app._registered_funcs}
    assert len(kits) == 1  # one kit behind every route of both copies (through the routes' mods)
    kit = _kit_behind(first._registered_funcs["evaluate.default"])
    # built by the first message, reused by the second (kept for this run: the grid's run id)
    assert list(kit._runtimes) == [(grid.run_id, 0, 2, "auto")]
    assert dict(replies[0].content["metrics"]) == dict(replies[1].content["metrics"])


def test_copies_of_a_pickled_legacy_client_app_are_one_app_without_the_senders_kits():
    cloudpickle = pytest.importorskip("cloudpickle")
    from flowerdro.legacy import LegacyClientApp

    app = LegacyClientApp(lambda context: None, loss_fn=nn.CrossEntropyLoss())
    app._kits[(1, 1)] = "a kit built in the sending process"
    blob = cloudpickle.dumps(app)
    first, second = cloudpickle.loads(blob), cloudpickle.loads(blob)
    assert first is second and first is not app
    assert first._kits == {} and first._kit_options == app._kit_options


# --------------------------------------------------------------------------- protocol traps
def test_fairness_numbers_read_the_configured_metric_names(synth_rc):
    kit = own_pieces_kit(synth_rc, 3, accuracy_metric="eval_acc", loss_metric="eval_loss")
    rc = {**synth_rc, "accuracy-metric": "eval_acc", "loss-metric": "eval_loss"}
    recs, _ = _records(kit.client_app(), "fedavg", rc, n=3)
    own, _ = _records(flowerdro_app, "fedavg", synth_rc, n=3)
    assert [r["acc_worst"] for r in recs] == [r["acc_worst"] for r in own]
    assert [r["loss_mean"] for r in recs] == [r["loss_mean"] for r in own]


@pytest.mark.parametrize("name", ["drfa", "afl", "scaffpd"])
def test_a_clients_own_local_epochs_does_not_override_the_algorithms_local_steps(synth_rc, name):
    # the server's run config has no local-epochs; the nodes' run config (the user's project) has 1
    rc = {**synth_rc, **ALGO_KEYS}
    plain, _ = _records(flowerdro_app, name, rc)
    grid = InProcessGrid(flowerdro_app, 4, {**rc, "local-epochs": 1})
    strategy = build_strategy(name, rc)
    strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=2, timeout=60, train_config=client_config(rc))
    recs = [{k: v for k, v in r.items() if k not in VOLATILE} for r in strategy.history]
    assert not any(r["failures"] for r in recs)
    assert recs == plain


def test_dr_dsgd_with_a_loss_its_client_step_cannot_use_is_refused(synth_rc):
    import inspect

    from flowerdro.clients.drdsgd import drdsgd_local_step

    kit = own_pieces_kit(synth_rc, 2)
    kit.loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    app = kit.client_app()  # every other strategy is served
    grid = InProcessGrid(app, 2, synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    from flwr.app import Message

    cfg = client_config(synth_rc)
    cfg["mu"], cfg["server-round"] = 6.0, 1
    msg = Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=grid.node_ids[0],
                  message_type="train.drdsgd")
    if "loss_fn" in inspect.signature(drdsgd_local_step).parameters:
        assert not app(msg, grid.contexts[grid.node_ids[0]]).has_error()  # the step takes the user's loss
    else:
        with pytest.raises(ValueError, match="loss_fn: the DR-DSGD/DSGD client step"):
            app(msg, grid.contexts[grid.node_ids[0]])


def test_the_servers_metric_names_win_over_the_kits_own(synth_rc):
    """The names are set once, on the server: they travel with every evaluate message."""
    kit = own_pieces_kit(synth_rc, 2, accuracy_metric="eval_acc", loss_metric="eval_loss")
    grid = InProcessGrid(kit.client_app(), 2, synth_rc)
    strategy = build_strategy("fedavg", {**synth_rc, "accuracy-metric": "accuracy", "loss-metric": "val_loss"})
    result = strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=1, timeout=60)
    assert not strategy.failures
    per_client = strategy.client_metrics
    assert all({"accuracy", "val_loss"} <= set(m) and "eval_acc" not in m for m in per_client.values())
    # the result keeps the clients' names (example-weighted, as Flower's FedAvg reports) beside the fairness numbers
    got = result.evaluate_metrics_clientapp[1]
    sizes = {p: m["num-examples"] for p, m in per_client.items()}
    weighted = sum(sizes[p] * per_client[p]["accuracy"] for p in sizes) / sum(sizes.values())
    assert got["accuracy"] == pytest.approx(weighted, rel=1e-12)
    assert got["acc_mean"] == pytest.approx(np.mean([m["accuracy"] for m in per_client.values()]), rel=1e-12)


def test_flowerdros_own_client_reports_under_the_servers_names(synth_rc):
    grid = InProcessGrid(flowerdro_app, 3, synth_rc)
    strategy = build_strategy("fedavg", {**synth_rc, "accuracy-metric": "accuracy", "loss-metric": "val_loss"})
    result = strategy.start(grid, initial_arrays(grid, synth_rc, 60), num_rounds=1, timeout=60)
    assert not strategy.failures and "acc_worst20" in strategy.history[0]
    assert {"accuracy", "val_loss", "acc_worst"} <= set(result.evaluate_metrics_clientapp[1].keys())
