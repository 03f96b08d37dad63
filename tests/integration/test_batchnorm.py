"""A user's BatchNorm model through the client kit: every strategy keeps and averages its buffers.

The user's pieces are those of a project nobody here wrote: a BatchNorm MLP, its own data
(clients of different sizes, so example-weighted means are not plain means), momentum SGD
over local epochs as its own ``train`` and its own ``test``. BatchNorm adds float running
statistics and an int64 batch counter to the ``state_dict``; docs/architecture.md
("Buffers") says how every strategy aggregates them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flowerdro.clients import ClientKit
from flowerdro.comparison import client_config
from flowerdro.experiments import InProcessGrid
from flowerdro.strategies import build_strategy, initial_arrays, strategy_names

FEATURES, CLASSES, BATCH = 8, 3, 16
#: Training examples per client (4 clients): 3, 4, 5 and 6 batches of 16.
TRAIN_SIZES = (48, 64, 80, 96)
RC = {"lr": 0.05, "local-steps": 3, "local-epochs": 1, "batch-size": BATCH, "dual-lr": 0.01, "q": 0.5,
      "topology": "ring", "adv-eps": 0.5, "pgd-steps": 2}


class BNNet(nn.Module):
    """The user's model: Linear → BatchNorm1d → ReLU → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def load_data(partition_id: int, num_partitions: int):
    """The user's data: shifted Gaussian classes, a client-specific size and class mix."""
    rng = np.random.default_rng(100 + partition_id)
    n = TRAIN_SIZES[partition_id] + 32
    centers = np.random.default_rng(0).normal(size=(CLASSES, FEATURES)) * 2.0
    y = rng.choice(CLASSES, size=n, p=rng.dirichlet(np.ones(CLASSES)))
    x = (centers[y] + rng.normal(size=(n, FEATURES)) + partition_id * 0.3).astype(np.float32)
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    cut = TRAIN_SIZES[partition_id]
    gen = torch.Generator().manual_seed(partition_id)
    return (DataLoader(TensorDataset(x_t[:cut], y_t[:cut]), batch_size=BATCH, shuffle=True, generator=gen),
            DataLoader(TensorDataset(x_t[cut:], y_t[cut:]), batch_size=BATCH))


def train(net: nn.Module, loader, epochs: float, lr: float) -> float:
    """The user's training: momentum SGD over the loader."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    losses = []
    for _ in range(int(epochs)):
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return float(np.mean(losses))


def evaluate(net: nn.Module, loader, device) -> tuple[float, float]:
    """The user's evaluation: mean batch loss and accuracy."""
    net.eval()
    loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = net(x)
            loss += float(nn.functional.cross_entropy(out, y)) * len(y)
            correct += int((out.argmax(1) == y).sum())
            seen += len(y)
    return loss / seen, correct / seen


def _kit(trained: dict | None = None) -> ClientKit:
    def train_fn(net, loader, args):
        loss = train(net, loader, args.epochs, args.lr)
        if trained is not None:  # what each client sends back, for the checks below
            trained[len(loader.dataset)] = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
        return loss

    return ClientKit(model_fn=BNNet, data_fn=load_data, loss_fn=nn.CrossEntropyLoss(), train_fn=train_fn,
                     test_fn=evaluate, device=torch.device("cpu"))


def _run(name: str, rounds: int, kit: ClientKit):
    rc = {**RC, "fraction-train": 1.0}
    grid = InProcessGrid(kit.client_app(), len(TRAIN_SIZES), rc)
    strategy = build_strategy(name, rc)
    torch.manual_seed(0)
    result = strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=rounds, timeout=60,
                            train_config=client_config(rc))
    return strategy, {k: result.arrays[k].numpy() for k in result.arrays.keys()}


@pytest.mark.parametrize("name", strategy_names())
def test_every_strategy_runs_a_batchnorm_model_and_keeps_its_buffers_dtypes(name):
    strategy, model = _run(name, 2, _kit())
    assert not any(r["failures"] for r in strategy.history), strategy.history[-1]["failures"]
    assert model["bn.num_batches_tracked"].dtype == np.int64
    assert model["bn.running_mean"].dtype == np.float32 and model["bn.running_var"].dtype == np.float32
    # two rounds of training forward passes moved the counter and the statistics
    assert model["bn.num_batches_tracked"] > 0
    assert np.all(model["bn.running_var"] > 0) and np.any(model["bn.running_mean"] != 0)


@pytest.mark.parametrize("name", ["fedavg", "qfedavg"])
def test_flowers_baselines_average_the_buffers_over_the_examples(name):
    # one round from the same model: every client runs one epoch of the user's loop, i.e.
    # TRAIN_SIZES / 16 = 3, 4, 5, 6 batches, so each client's counter is its batch count
    trained: dict = {}
    _, model = _run(name, 1, _kit(trained))
    sizes = np.array(sorted(trained), dtype=np.float64)
    assert list(sizes) == list(TRAIN_SIZES)
    counters = [int(trained[n]["bn.num_batches_tracked"]) for n in sorted(trained)]
    assert counters == [n // BATCH for n in TRAIN_SIZES]
    # Σ n_k c_k / Σ n_k = (48·3 + 64·4 + 80·5 + 96·6) / 288 = 1376 / 288 = 4.78 → 5
    assert int(model["bn.num_batches_tracked"]) == 5
    for key in ("bn.running_mean", "bn.running_var"):
        expected = np.average(np.stack([trained[n][key] for n in sorted(trained)]), axis=0, weights=sizes)
        # float32 results of a float64 mean: one rounding to float32 (half an ulp, 2^-24 relative)
        np.testing.assert_allclose(model[key], expected.astype(np.float32), rtol=2.0 ** -23, atol=0)
