"""Where clients compute: the ``device`` key, and a user's CPU-only code beside flowerdro's loops elsewhere.

On a GPU machine flowerdro's own loops run on CUDA while a converted project's ``train``
and ``test`` may never touch CUDA. Without a GPU the second device is stood in for by a
second dtype: the loops' placement is patched to float64 on the CPU, and the project's
code, written for float32 tensors, fails on a float64 model exactly as CPU code fails on
a CUDA model (``mat1 and mat2 must have the same dtype`` / ``... same device``). Where
CUDA is present, the same test also runs with the real device.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flowerdro.clients import ClientKit
from flowerdro.clients import kit as kit_module
from flowerdro.clients.handlers import get_runtime
from flowerdro.clients.training import resolve_device
from flowerdro.comparison import client_config
from flowerdro.experiments import InProcessGrid
from flowerdro.experiments.inprocess import ensure_task_identity
from flowerdro.legacy import LegacyClientApp
from flowerdro.protocol import NodeSettings
from flowerdro.settings import read_settings
from flowerdro.strategies import build_strategy, initial_arrays, strategy_names

FEATURES, CLASSES = 8, 3

#: Every algorithm key a strategy of the registry may need, small and quick.
ALGO_KEYS = {"dual-lr": 0.01, "q": 0.5, "proximal-mu": 0.1, "eps": 0.2, "mu": 6.0, "topology": "complete",
             "adv-lr": 0.01, "affine-lambda": 1.0, "adv-eps": 0.5, "pgd-steps": 2}
RC = {"lr": 0.05, "local-steps": 2, "batch-size": 8, "seed": 0, **ALGO_KEYS}


# --------------------------------------------------------------------------- a CPU-only project
class Net(nn.Module):
    """The project's model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(FEATURES, 8), nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id: int, num_partitions: int, dtype: torch.dtype = torch.float32):
    """Float tensors on the CPU in loaders, as a quickstart project builds them."""
    rng = np.random.default_rng(100 + partition_id)
    x = torch.from_numpy(rng.normal(size=(40, FEATURES))).to(dtype)
    y = torch.from_numpy(rng.integers(0, CLASSES, size=40))
    return (DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8, shuffle=True),
            DataLoader(TensorDataset(x[32:], y[32:]), batch_size=8))


class Seen:
    """What the project's own functions were handed (dtypes and devices of the model's parameters)."""

    def __init__(self) -> None:
        self.user: set[tuple[str, torch.dtype]] = set()
        self.loss: set[tuple[str, torch.dtype]] = set()

    def model(self, net: nn.Module) -> None:
        p = next(net.parameters())
        self.user.add((p.device.type, p.dtype))


def cpu_train(net: nn.Module, loader: DataLoader, epochs: int, lr: float) -> float:
    """The project's training: batches straight from the loader, never moved anywhere."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return float(np.mean(losses))


def cpu_test(net: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """The project's evaluation, equally unaware of devices."""
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = net(x)
            loss += float(nn.functional.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            n += len(y)
    return loss / n, correct / n


def message_api_app(seen: Seen):
    """The Message-API project: a ClientKit of its pieces."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.loss.add((out.device.type, out.dtype))
        return nn.functional.cross_entropy(out, y)

    def train_fn(net, loader, args):
        seen.model(net)
        return cpu_train(net, loader, 1, args.lr)

    def test_fn(net, loader, device):
        seen.model(net)
        return cpu_test(net, loader)

    return ClientKit(model_fn=Net, data_fn=load_data, loss_fn=loss_fn, train_fn=train_fn,
                     test_fn=test_fn).client_app()


class CpuClient:
    """The legacy project's NumPyClient: its ``fit`` and ``evaluate`` work on its own ``net`` on the CPU.

    ``train_dtype``: the dtype its ``fit`` moves the net to before training (the project's
    own choice, like a project that moves its net to its GPU inside ``fit``).
    """

    def __init__(self, pid: int, seen: Seen, data_dtype: torch.dtype = torch.float32,
                 train_dtype: torch.dtype | None = None) -> None:
        self.net = Net().to(data_dtype)
        self.trainloader, self.valloader = load_data(pid, 2, data_dtype)
        self.seen, self.train_dtype = seen, train_dtype

    def _set(self, parameters) -> None:
        keys = list(self.net.state_dict())
        self.net.load_state_dict({k: torch.tensor(v) for k, v in zip(keys, parameters, strict=True)})

    def fit(self, parameters, config):
        self._set(parameters)
        self.seen.model(self.net)
        if self.train_dtype is not None:
            self.net.to(self.train_dtype)
            loader = [(x.to(self.train_dtype), y) for x, y in self.trainloader]
        else:
            loader = self.trainloader
        loss = cpu_train(self.net, loader, 1, float(config["lr"]))
        return [v.detach().cpu().numpy() for v in self.net.state_dict().values()], 32, {"train_loss": loss}

    def evaluate(self, parameters, config):
        self._set(parameters)
        self.seen.model(self.net)
        loss, acc = cpu_test(self.net, self.valloader)
        return loss, 8, {"accuracy": acc}


def legacy_app(seen: Seen, **client_kwargs) -> LegacyClientApp:
    """The legacy project: its unchanged client_fn behind LegacyClientApp."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.loss.add((out.device.type, out.dtype))
        return nn.functional.cross_entropy(out, y)

    return LegacyClientApp(lambda ctx: CpuClient(int(ctx.node_config["partition-id"]), seen, **client_kwargs),
                           loss_fn=loss_fn)


def _run(app, name: str, rc: dict, *, rounds: int = 1, n: int = 2):
    """Run strategy ``name`` on ``n`` in-process clients of ``app``; the strategy, its result and the dtypes it sent."""
    grid = InProcessGrid(app, n, rc)
    strategy = build_strategy(name, rc)
    init = initial_arrays(grid, rc, 60)
    sent = {k: init[k].numpy().dtype for k in init.keys()}
    res = strategy.start(grid, init, num_rounds=rounds, timeout=60, train_config=client_config(rc))
    return strategy, res, sent


def _dtypes(arrays: ArrayRecord) -> dict[str, np.dtype]:
    return {k: arrays[k].numpy().dtype for k in arrays.keys()}


@pytest.fixture(params=["float64 stand-in", "cuda"])
def second_device(request, monkeypatch) -> tuple[str, torch.dtype]:
    """Put flowerdro's loops on a second placement the project's code does not use; returns it."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device: the float64 stand-in covers this path")
        return "cuda", torch.float32  # device "auto": the loops on CUDA, the project's code on the CPU
    monkeypatch.setattr(kit_module, "loop_placement",
                        lambda device, dtype: kit_module.Placement(device, torch.float64))
    # device "auto": the loops on CUDA where the machine has it, in float64 either way
    return ("cuda" if torch.cuda.is_available() else "cpu"), torch.float64


@pytest.mark.parametrize("name", strategy_names())
def test_cpu_only_project_code_runs_every_strategy_while_the_loops_run_elsewhere(name, second_device):
    # Prepare: the loops on the second placement; the project's data and functions on the CPU in float32
    loop_device, loop_dtype = second_device
    rc = {**RC, **({"local-steps": 1} if name in ("drdsgd", "dsgd") else {})}
    for api, make in (("message", message_api_app), ("legacy", legacy_app)):
        seen = Seen()
        # Execute
        strategy, res, sent = _run(make(seen), name, rc)
        # Assert: every reply valid, every client evaluated, and each side stayed where it belongs
        assert not any(r["failures"] for r in strategy.history), (api, strategy.history[-1]["failures"])
        assert all(r["acc_mean"] is not None and r["acc_n"] == 2 for r in strategy.history), api
        assert seen.user == {("cpu", torch.float32)}, api  # the project's functions: its own placement only
        assert seen.loss <= {(loop_device, loop_dtype)}, api  # flowerdro's loops: the second placement
        assert _dtypes(res.arrays) == sent, api  # the replies keep the dtypes the server sent


# --------------------------------------------------------------------------- proximal hooks
def _kit_message(kit: ClientKit, rc: dict, mu: float) -> tuple[Message, Context, ArrayRecord]:
    """A ``train`` message with the kit's seeded model and FedProx's μ, the node's context and the arrays sent."""
    ensure_task_identity()  # what a grid sets before messages are built outside one
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                  run_config=dict(rc))
    rt = kit.runtime(ctx)
    torch.manual_seed(0)
    sent = ArrayRecord(rt.new_model().state_dict())
    cfg = client_config(rc)
    cfg["server-round"], cfg["proximal-mu"] = 1, mu
    return (Message(content=RecordDict({"arrays": sent, "config": cfg}), dst_node_id=1, message_type="train"),
            ctx, sent)


def test_proximal_hooks_follow_a_model_the_users_loop_moves_to_another_dtype():
    # Prepare: the project's data are float64, so the kit's model and the arrays sent are float64;
    # the user's loop casts the model to float32 and takes two full-batch SGD steps. The proximal
    # term's w⁰ (float64) must meet each parameter in its dtype at use: a float64 gradient for a
    # float32 parameter is refused by autograd ("hook ... has changed the type of value").
    lr, mu = 0.1, 0.5

    def train_fn(model, loader, args):
        model.float()
        x, y = loader.dataset.tensors
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.float()), y).backward()
            opt.step()
        return 0.0

    kit = ClientKit(model_fn=Net, data_fn=lambda p, n: load_data(p, n, torch.float64),
                    loss_fn=nn.CrossEntropyLoss(), train_fn=train_fn)
    msg, ctx, sent = _kit_message(kit, {**RC, "lr": lr}, mu)
    # Execute
    reply = kit.client_app()(msg, ctx)
    # Assert: the reply holds float64 arrays (as sent) equal to FedProx's two steps done here in float32:
    # w1 = w0 − η ∇f(w0), w2 = w1 − η (∇f(w1) + μ (w1 − w0))
    got = reply.content["arrays"].to_torch_state_dict()
    assert {v.dtype for v in got.values()} == {torch.float64}
    model = Net()
    model.load_state_dict({k: v.float() for k, v in sent.to_torch_state_dict().items()})
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = kit.runtime(ctx).train_loader.dataset.tensors
    for _ in range(2):
        model.zero_grad()
        nn.functional.cross_entropy(model(x.float()), y).backward()
        with torch.no_grad():
            for k, p in model.named_parameters():
                p -= lr * (p.grad + mu * (p - w0[k]))
    for k, p in model.named_parameters():
        # two float32 steps in another order of operations: a few float32 ulps of values of size ~1
        torch.testing.assert_close(got[k], p.detach().double(), rtol=0, atol=1e-6)


def test_a_users_loop_that_replaces_the_parameters_under_fedprox_is_refused():
    # model.to("meta") cannot swap tensors in place: torch makes new parameters, without the hooks
    def train_fn(model, loader, args):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.to("meta")
        model.to_empty(device="cpu")
        model.load_state_dict(state)
        return 0.0

    kit = ClientKit(model_fn=Net, data_fn=load_data, loss_fn=nn.CrossEntropyLoss(), train_fn=train_fn)
    msg, ctx, _ = _kit_message(kit, RC, 0.1)
    reply = kit.client_app()(msg, ctx)  # the client's error travels in its reply
    assert reply.has_error() and re.match(r"RuntimeError: proximal-mu: train_fn replaced the model's parameters",
                                          reply.error.reason)
    msg, ctx, _ = _kit_message(kit, RC, 0.0)
    assert not kit.client_app()(msg, ctx).has_error()  # without FedProx the same loop is plain local training


@pytest.mark.parametrize("name", ["fedprox", "mgda-prox"])
def test_legacy_fedprox_when_fit_moves_the_net_to_its_own_dtype(name):
    # The H200 failure's cause on a CPU: the NumPyClient's fit moves its net (float64, as its data) to
    # float32 before training, as a quickstart client moves it to its GPU; the reply keeps float64
    seen = Seen()
    strategy, res, sent = _run(legacy_app(seen, data_dtype=torch.float64, train_dtype=torch.float32), name, RC,
                               rounds=2)
    assert not any(r["failures"] for r in strategy.history), strategy.history[-1]["failures"]
    assert set(sent.values()) == {np.dtype(np.float64)} and _dtypes(res.arrays) == sent


# --------------------------------------------------------------------------- the device key
@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", "mps"])
def test_the_server_refuses_a_device_of_no_known_form(value):
    with pytest.raises(ValueError, match=r"device: unknown value .*allowed: auto, cpu, cuda, cuda:N"):
        read_settings(NodeSettings, {"device": value})
    with pytest.raises(ValueError, match=r"device: unknown value"):
        build_strategy("fedavg", {"device": value})


def test_known_device_forms_pass_the_server():
    for value in ("auto", "cpu", "cuda", "cuda:0", "cuda:3"):
        assert read_settings(NodeSettings, {"device": value}).device == value


def test_resolve_device_follows_the_machine(monkeypatch):
    # a machine with two CUDA devices, as torch would report it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")  # cpu on any machine
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"device: 'cuda:2' asked for, but this client has 2 CUDA devices"):
        resolve_device("cuda:2")
    # a machine without CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device: 'cuda' asked for, but torch sees no CUDA device"):
        resolve_device("cuda")


def _absent_cuda() -> str:
    """A CUDA device this machine does not have."""
    return f"cuda:{torch.cuda.device_count()}"


def test_flowerdros_client_app_honours_device(synth_rc, monkeypatch):
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                  run_config={**synth_rc, "device": "cpu"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # cpu wins on a CUDA machine too
    assert get_runtime(ctx).data.x_train.device == torch.device("cpu")
    monkeypatch.undo()
    ctx.run_config["device"] = _absent_cuda()
    with pytest.raises(ValueError, match=rf"device: '{_absent_cuda()}' asked for"):
        get_runtime(ctx)


def test_the_kit_and_the_legacy_client_honour_device():
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                  run_config={"device": "cpu"})
    kit = ClientKit(model_fn=Net, data_fn=load_data, loss_fn=nn.CrossEntropyLoss())
    rt = kit.runtime(ctx)
    assert rt.data.x_train.device.type == "cpu" and rt.user.device.type == "cpu"
    ctx.run_config["device"] = _absent_cuda()
    for app_kit in (kit, legacy_app(Seen()).kit(ctx)):
        with pytest.raises(ValueError, match=rf"device: '{_absent_cuda()}' asked for"):
            app_kit.runtime(ctx)
    # a kit built for one device under a run config naming another: refused, naming both
    pinned = ClientKit(model_fn=Net, data_fn=load_data, loss_fn=nn.CrossEntropyLoss(), device="cpu")
    with pytest.raises(ValueError, match=r"device: the ClientKit was built with device='cpu' but the run config "
                                         r"sets device = 'cuda:"):
        pinned.runtime(ctx)
    with pytest.raises(ValueError, match=r"device: unknown value 'gpu'"):
        ClientKit(model_fn=Net, data_fn=load_data, loss_fn=nn.CrossEntropyLoss(), device="gpu")


def test_a_placement_mismatch_in_the_users_function_names_the_device_key():
    # the project's test function insists on float64 inputs its model does not have
    def test_fn(net, loader, device):
        x, _ = next(iter(loader))
        return float(net(x.double()).sum()), 0.5

    kit = ClientKit(model_fn=Net, data_fn=load_data, loss_fn=nn.CrossEntropyLoss(), test_fn=test_fn)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                  run_config={})
    torch.manual_seed(0)
    ensure_task_identity()
    msg = Message(content=RecordDict({"arrays": ArrayRecord(Net().state_dict())}), dst_node_id=1,
                  message_type="evaluate")
    reply = kit.client_app()(msg, ctx)  # the client's error travels in its reply
    assert reply.has_error() and re.match(r"RuntimeError: test_fn: your function failed with the model handed to it "
                                          r"on cpu \(float32\) \(.*dtype.*\)\. Run-config device = 'auto'",
                                          reply.error.reason)
