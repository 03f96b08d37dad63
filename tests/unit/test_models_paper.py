"""The FedMGDA+ paper's networks (Hu et al., arXiv:2006.11489, Tables 2-4): layers and sizes from the tables."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowerdro.models import build_model, count_parameters


def _conv(c_in: int, c_out: int, k: int) -> int:
    return c_out * c_in * k * k + c_out  # weights + one bias per output channel


def _fc(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


#: name → (input shape, classes, trainable parameters worked out from the paper's table)
TABLES = {
    # Table 2: conv5 3→64, pool, LRN, conv5 64→64, LRN, pool, FC 1600→384→192→10
    "cnn_cifar10": ((3, 32, 32), 10, _conv(3, 64, 5) + _conv(64, 64, 5) + _fc(1600, 384) + _fc(384, 192)
                    + _fc(192, 10)),
    # Table 3: conv5 1→10, pool, conv5 10→20, pool, Dropout2d, FC 320→50, Dropout, →10
    "cnn_fmnist": ((1, 28, 28), 10, _conv(1, 10, 5) + _conv(10, 20, 5) + _fc(320, 50) + _fc(50, 10)),
    # Table 4: conv3 1→32, conv3 32→64, pool, Dropout, FC 9216→128, Dropout, →62
    "cnn_femnist": ((1, 28, 28), 62, _conv(1, 32, 3) + _conv(32, 64, 3) + _fc(9216, 128) + _fc(128, 62)),
}


def test_parameter_counts_are_the_tables():
    # the same counts written out: 10·1·25+10 + 20·10·25+20 + 320·50+50 + 50·10+10 = 21,840
    assert TABLES["cnn_fmnist"][2] == 260 + 5020 + 16050 + 510 == 21_840
    assert TABLES["cnn_cifar10"][2] == 4864 + 102_464 + 614_784 + 73_920 + 1930 == 797_962
    assert TABLES["cnn_femnist"][2] == 320 + 18_496 + 1_179_776 + 7998 == 1_206_590
    for name, (shape, classes, count) in TABLES.items():
        assert count_parameters(build_model(name, shape, classes)) == count, name


@pytest.mark.parametrize("name", sorted(TABLES))
def test_layers_follow_the_table(name):
    shape, classes, _ = TABLES[name]
    model = build_model(name, shape, classes, seed=0)
    kinds = [type(m).__name__ for m in model.modules() if not list(m.children())]
    expected = {
        "cnn_cifar10": ["Conv2d", "ReLU", "MaxPool2d", "LocalResponseNorm", "Conv2d", "ReLU", "LocalResponseNorm",
                        "MaxPool2d", "Flatten", "Linear", "ReLU", "Linear", "ReLU", "Linear"],
        "cnn_fmnist": ["Conv2d", "MaxPool2d", "ReLU", "Conv2d", "MaxPool2d", "ReLU", "Dropout2d", "Flatten",
                       "Linear", "ReLU", "Dropout", "Linear"],
        "cnn_femnist": ["Conv2d", "ReLU", "Conv2d", "ReLU", "MaxPool2d", "Dropout", "Flatten", "Linear", "ReLU",
                        "Dropout", "Linear"],
    }[name]
    assert kinds == expected
    drops = [(type(m).__name__, m.p) for m in model.modules() if isinstance(m, nn.Dropout | nn.Dropout2d)]
    assert drops == {"cnn_cifar10": [], "cnn_fmnist": [("Dropout2d", 0.5), ("Dropout", 0.5)],
                     "cnn_femnist": [("Dropout", 0.25), ("Dropout", 0.5)]}[name]
    x = torch.randn(3, *shape)
    model.eval()
    out = model(x)
    assert out.shape == (3, classes)
    assert torch.equal(out, model(x))  # eval mode: no dropout


def test_fmnist_network_is_the_pytorch_mnist_example_function():
    # Table 3 with the functional form of the PyTorch MNIST example (eval mode, no dropout):
    # relu(pool(conv1 x)), relu(pool(conv2 ·)), relu(fc1 ·), fc2 ·.
    model = build_model("cnn_fmnist", (1, 28, 28), 10, seed=1).double().eval()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    fcs = [m for m in model.modules() if isinstance(m, nn.Linear)]
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    f = torch.nn.functional
    h = f.relu(f.max_pool2d(convs[0](x), 2))
    h = f.relu(f.max_pool2d(convs[1](h), 2))
    ref = fcs[1](f.relu(fcs[0](h.flatten(1))))
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)


def test_local_training_with_dropout_is_repeatable_and_leaves_the_global_rng_alone():
    # Dropout draws from torch's global RNG; local training seeds it from its minibatch
    # generator, so the same generator seed gives the same model whatever ran before.
    from flowerdro.clients.training import LocalData, local_sgd, make_generator

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)
    data = LocalData(x, y, x[:4], y[:4])
    states = []
    for junk in (0, 3):
        torch.rand(junk)  # move the global RNG differently before each run
        before = torch.random.get_rng_state()
        model = build_model("cnn_fmnist", (1, 28, 28), 10, seed=0)
        res = local_sgd(model, data, steps=3, lr=0.1, batch_size=8, generator=make_generator(1, 2, 3),
                        loss_before_on="none")
        assert torch.equal(torch.random.get_rng_state(), before)
        states.append(res.state)
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
    # dropout is on while training: the mean minibatch loss differs from an eval-mode pass
    model = build_model("cnn_fmnist", (1, 28, 28), 10, seed=0)
    other = local_sgd(model, data, steps=1, lr=0.1, batch_size=40, generator=make_generator(9),
                      loss_before_on="full")
    assert other.mean_batch_loss != other.loss_before
