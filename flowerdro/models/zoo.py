"""Model zoo: logistic regression, MLP, LeNet-5 and the papers' small CNNs (torch only).

``cnn_cifar10``, ``cnn_fmnist`` and ``cnn_femnist`` are the networks of the FedMGDA+ paper's
Tables 2-4 (Hu, Shaloudegi, Zhang, Yu, arXiv:2006.11489); ``cnn_mnist`` is FedRobust's MNIST
CNN; ``lenet`` is LeNet-5 (not a network of those papers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn


def _flat_dim(input_shape: Sequence[int]) -> int:
    return int(math.prod(input_shape))


class LogisticRegression(nn.Module):
    """Multinomial logistic regression ``softmax(W x + b)`` on the flattened input.

    The DRFA paper's Fashion-MNIST model and FedMGDA+'s Adult model (2 classes).
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(_flat_dim(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.linear(x.flatten(1))


class LinearRegression(nn.Module):
    """Linear model without bias ``x ↦ ⟨x, w⟩`` (one output) on the flattened input.

    SCAFF-PD's §6.1 robust regression: f_i(w) = (1/m_i)‖A_i w − y_i‖² (+ (μ_x/2)‖w‖² as
    weight decay). The weights start at zero (the problem is convex; x⁰ = 0).
    """

    def __init__(self, input_shape: Sequence[int]) -> None:
        super().__init__()
        self.linear = nn.Linear(_flat_dim(input_shape), 1, bias=False)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    """Fully connected network ``Linear → ReLU → … → Linear`` on the flattened input.

    DR-DSGD uses hidden sizes (128, 64) on Fashion-MNIST.
    """

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (128, 64)
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = _flat_dim(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.net(x.flatten(1))


class _ConvNet(nn.Module):
    """A CNN as two stages: ``features`` (convolutions, pooling) then ``head`` (flatten, FC layers)."""

    features: nn.Sequential
    head: nn.Sequential

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.head(self.features(x))


def _feature_map(input_shape: Sequence[int], layers: Sequence[tuple[str, int]]) -> tuple[int, int, int]:
    """(c, h', w'): the input's channels and the sides after ``layers`` (see :func:`_conv_pool_side`)."""
    c, h, w = _image_shape(input_shape)
    return c, _conv_pool_side(h, layers), _conv_pool_side(w, layers)


#: Two rounds of an unpadded 5×5 convolution then a 2×2 max-pool (LeNet, FedMGDA+'s CIFAR and FMNIST CNNs).
_TWO_CONV5_POOL2 = (("conv", 5), ("pool", 2), ("conv", 5), ("pool", 2))


class SmallCNN(_ConvNet):
    """Two 5×5 conv layers (32, 64 channels) with max-pooling and one hidden FC layer.

    A small CNN for 28×28 grey-scale digits (the FedRobust MNIST experiments).
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, fc: int = 128) -> None:
        super().__init__()
        c, h, w = _image_shape(input_shape)
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), fc), nn.ReLU(), nn.Linear(fc, num_classes)
        )


class LeNetCNN(_ConvNet):
    """LeNet-style CNN: conv5×5(c1) → pool → conv5×5(c2) → pool → FC(f1) → FC(f2) → FC(classes).

    With the defaults (c1, c2) = (6, 16), (f1, f2) = (120, 84) it is LeNet-5 (``lenet``),
    for any (c, h, w) input with h, w ≥ 16. Not one of the FedMGDA+ paper's networks
    (those are :class:`FedMGDACifarCNN`, :class:`FedMGDAFmnistCNN`, :class:`FedMGDAFemnistCNN`).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: tuple[int, int] = (6, 16),
        hidden: tuple[int, int] = (120, 84),
    ) -> None:
        super().__init__()
        c, hh, ww = _feature_map(input_shape, _TWO_CONV5_POOL2)
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(c, c1, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * hh * ww, hidden[0]), nn.ReLU(),
            nn.Linear(hidden[0], hidden[1]), nn.ReLU(),
            nn.Linear(hidden[1], num_classes),
        )


def _conv_pool_side(side: int, layers: Sequence[tuple[str, int]]) -> int:
    """Spatial size after unpadded convolutions (``("conv", k)``: side − k + 1) and 2×2 pools (``("pool", 2)``)."""
    for kind, k in layers:
        side = side - k + 1 if kind == "conv" else side // k
        if side < 1:
            raise ValueError(f"input_shape: images too small for this network (a side reaches {side})")
    return side


class FedMGDACifarCNN(_ConvNet):
    """The FedMGDA+ paper's CIFAR-10 network (Hu et al., arXiv:2006.11489, Table 2), ``cnn_cifar10``.

    conv5×5 3→64 → ReLU → maxpool 2 → LRN → conv5×5 64→64 → ReLU → LRN → maxpool 2 →
    FC 1600→384 → ReLU → FC 384→192 → ReLU → FC 192→classes (1600 = 64·5·5 for 32×32
    inputs: 32 −4→ 28 /2→ 14 −4→ 10 /2→ 5). The local response normalisation is TensorFlow's
    CIFAR-10 tutorial's (depth radius 4, bias 1, α = 0.001/9, β = 0.75), i.e. torch's
    ``LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1)`` (torch divides α by the size);
    it has no parameters.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        c, hh, ww = _feature_map(input_shape, _TWO_CONV5_POOL2)
        self.features = nn.Sequential(
            nn.Conv2d(c, 64, 5), nn.ReLU(), nn.MaxPool2d(2), _lrn(),
            nn.Conv2d(64, 64, 5), nn.ReLU(), _lrn(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * hh * ww, 384), nn.ReLU(),
            nn.Linear(384, 192), nn.ReLU(),
            nn.Linear(192, num_classes),
        )


def _lrn() -> nn.Module:
    return nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1.0)


class FedMGDAFmnistCNN(_ConvNet):
    """The FedMGDA+ paper's Fashion-MNIST network (arXiv:2006.11489, Table 3), ``cnn_fmnist``.

    conv5×5 1→10 → maxpool 2 → ReLU → conv5×5 10→20 → maxpool 2 → ReLU → Dropout2d(0.5) →
    FC 320→50 → ReLU → Dropout(0.5) → FC 50→classes (320 = 20·4·4 for 28×28 inputs:
    28 −4→ 24 /2→ 12 −4→ 8 /2→ 4). ReLU and max-pooling commute, so the order of the two does
    not change the function.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        c, hh, ww = _feature_map(input_shape, _TWO_CONV5_POOL2)
        self.features = nn.Sequential(
            nn.Conv2d(c, 10, 5), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(10, 20, 5), nn.MaxPool2d(2), nn.ReLU(), nn.Dropout2d(0.5),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(20 * hh * ww, 50), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(50, num_classes),
        )


class FedMGDAFemnistCNN(_ConvNet):
    """The FedMGDA+ paper's FEMNIST network (arXiv:2006.11489, Table 4), ``cnn_femnist``.

    conv3×3 1→32 → ReLU → conv3×3 32→64 → ReLU → maxpool 2 → Dropout(0.25) →
    FC 9216→128 → ReLU → Dropout(0.5) → FC 128→classes (62 for FEMNIST; 9216 = 64·12·12
    for 28×28 inputs: 28 −2→ 26 −2→ 24 /2→ 12).
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        c, hh, ww = _feature_map(input_shape, (("conv", 3), ("conv", 3), ("pool", 2)))
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 3), nn.ReLU(),
            nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * hh * ww, 128), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(128, num_classes),
        )


def _image_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"input_shape: a CNN needs images shaped (channels, height, width), got {tuple(input_shape)}"
        )
    c, h, w = (int(s) for s in input_shape)
    return c, h, w


def parse_hidden(value: str | Sequence[int] | int | None, default: Sequence[int] = (128, 64)) -> tuple[int, ...]:
    """Parse hidden sizes from a run-config value such as ``"128,64"`` or ``[128, 64]``."""
    if value is None or value == "":
        return tuple(default)
    if isinstance(value, int):
        sizes: tuple[int, ...] = (value,)
    elif isinstance(value, str):
        sizes = tuple(int(v) for v in value.replace(" ", "").split(",") if v)
    else:
        sizes = tuple(int(v) for v in value)
    if any(s < 1 for s in sizes):
        raise ValueError(f"hidden: every hidden size must be a positive integer, got {value!r}")
    return sizes


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "logreg": lambda s, k, **kw: LogisticRegression(s, k),
    "linear": lambda s, k, **kw: LinearRegression(s),
    "mlp": lambda s, k, **kw: MLP(s, k, parse_hidden(kw.get("hidden"))),
    "cnn_mnist": lambda s, k, **kw: SmallCNN(s, k),
    "cnn_cifar10": lambda s, k, **kw: FedMGDACifarCNN(s, k),
    "cnn_fmnist": lambda s, k, **kw: FedMGDAFmnistCNN(s, k),
    "cnn_femnist": lambda s, k, **kw: FedMGDAFemnistCNN(s, k),
    "lenet": lambda s, k, **kw: LeNetCNN(s, k, (6, 16), (120, 84)),
}

MODEL_NAMES: tuple[str, ...] = tuple(sorted(_BUILDERS))

#: Models with one real output (``num_classes`` is ignored).
_REGRESSION_MODELS: tuple[str, ...] = ("linear",)


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, *, seed: int | None = None, **kwargs: object
) -> nn.Module:
    """Build model ``name`` for inputs of ``input_shape`` and ``num_classes`` outputs.

    With ``seed`` set, the initial weights are drawn from ``torch.Generator(seed)`` so that
    the server and every client agree on the initial model without any shared state.
    """
    if name not in _BUILDERS:
        raise ValueError(f"model: unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    if num_classes < 2 and name not in _REGRESSION_MODELS:
        raise ValueError(f"num_classes: need at least 2 classes, got {num_classes}")
    if seed is None:
        return _BUILDERS[name](tuple(input_shape), int(num_classes), **kwargs)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(int(seed))
        return _BUILDERS[name](tuple(input_shape), int(num_classes), **kwargs)
    finally:
        torch.random.set_rng_state(state)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
