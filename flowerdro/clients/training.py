"""Local training loops: plain functions on a torch model and in-memory tensors.

Nothing here knows about Flower messages; ``handlers.py`` turns messages into calls of
these functions, and a foreign ClientApp can call them directly.

Every loop draws its minibatches from an explicit ``torch.Generator`` so that a run is
repeatable from its seed, whatever else happens in the process.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from flowerdro.data.federated import SplitSizes

LOSS_BEFORE_ON: tuple[str, ...] = ("full", "batch", "none")
"""Where :func:`local_sgd` measures the received model's loss (run config ``train-loss-on``)."""

StateDict = dict[str, torch.Tensor]

#: A loss ``loss_fn(model_output, targets) -> mean loss`` (a scalar tensor).
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (1/n) Σ_j (ŷ_j − y_j)² for a model with one output per example.

    The regression loss of SCAFF-PD's §6.1 robust regression; ``output`` of shape (n, 1)
    or (n,) is compared with ``target`` of shape (n,).
    """
    return F.mse_loss(output.reshape(target.shape), target)


def scaled_loss(loss_fn: LossFn | None, factor: float) -> LossFn:
    """The loss s·ℓ(output, target) with ℓ = ``loss_fn`` (cross-entropy when None), s = ``factor``.

    A ``loss-scale`` attacker trains on it (FedMGDA+ §6.2.2): every gradient, and so every
    local step, is s times the honest one at the same point.
    """
    base = loss_fn or F.cross_entropy
    s = float(factor)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return s * base(output, target)

    return loss


def loss_function(task: str) -> LossFn:
    """The training loss of a task: cross-entropy (``"classification"``) or MSE (``"regression"``)."""
    if task == "classification":
        return F.cross_entropy
    if task == "regression":
        return mse_loss
    raise ValueError(f"task: unknown task {task!r}; allowed: classification, regression")


def default_device() -> torch.device:
    """CUDA when available (simulation gives each client a GPU fraction), else CPU: ``device = "auto"``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """The torch device that run-config ``device`` names, checked against this machine.

    ``auto`` (or None) is :func:`default_device`; ``cpu`` the CPU on any machine;
    ``cuda`` the current CUDA device and ``cuda:N`` the N-th, each refused where it is
    absent (no silent fallback to the CPU). A ``torch.device`` is checked the same way.

    Raises
    ------
    ValueError
        Naming the key ``device``, the value and what this machine has.
    """
    from flowerdro.protocol import check_device

    if name is None:
        name = "auto"
    text = check_device(str(name) if isinstance(name, torch.device) else name)
    if text == "auto":
        return default_device()
    if text == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {text!r} asked for, but torch sees no CUDA device on this client "
                         f"(torch {torch.__version__}); allowed here: auto, cpu")
    device = torch.device(text)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"device: {text!r} asked for, but this client has {count} CUDA device"
                         f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})")
    return device


@dataclass
class LocalData(SplitSizes):
    """A client's data as tensors on one device: train and test split, and the validation set if any.

    The training loops read ``x_train``/``y_train`` only; an evaluation reads the split its
    message asks for (:func:`flowerdro.clients.handlers.evaluation_split`).
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None

    @classmethod
    def from_numpy(
        cls,
        x_train: np.ndarray,
        y_train: np.ndarray,
        x_test: np.ndarray,
        y_test: np.ndarray,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        x_val: np.ndarray | None = None,
        y_val: np.ndarray | None = None,
    ) -> LocalData:
        """Move numpy arrays to ``device`` once.

        Inputs become ``dtype`` (float32 by default; float64 for high-precision runs);
        integer labels become int64, floating targets (regression) become ``dtype``. An
        array already of that dtype, C-contiguous and bound for the CPU is shared, not
        copied (the training loops never write into their data).
        """
        dev = device or default_device()

        def tensor(arr: np.ndarray, target: torch.dtype) -> torch.Tensor:
            if dev.type == "cpu" and arr.flags.c_contiguous and arr.dtype == torch.empty(0, dtype=target).numpy().dtype:
                with warnings.catch_warnings():  # read-only arrays of the data cache: shared, never written
                    warnings.simplefilter("ignore", UserWarning)
                    return torch.from_numpy(arr)
            return torch.tensor(arr, dtype=target, device=dev)

        def tx(a: np.ndarray) -> torch.Tensor:
            return tensor(np.asarray(a), dtype)

        def ty(a: np.ndarray) -> torch.Tensor:
            arr = np.asarray(a)
            return tensor(arr, dtype if np.issubdtype(arr.dtype, np.floating) else torch.int64)

        if (x_val is None) != (y_val is None):
            raise ValueError("x_val, y_val: give both validation arrays or neither")
        val = (tx(x_val), ty(y_val)) if x_val is not None and y_val is not None else (None, None)
        return cls(tx(x_train), ty(y_train), tx(x_test), ty(y_test), *val)


def minibatches(
    num_examples: int, batch_size: int, generator: torch.Generator, device: torch.device
) -> Iterator[torch.Tensor]:
    """Endless stream of index batches: reshuffle every epoch, sample without replacement within one."""
    if num_examples < 1:
        raise ValueError("num_examples: a client needs at least one training example")
    b = min(batch_size, num_examples)
    while True:
        perm = torch.randperm(num_examples, generator=generator).to(device)
        for start in range(0, num_examples - b + 1, b):
            yield perm[start : start + b]


def make_generator(*seeds: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from several integers (run seed, round, partition, …)."""
    ss = np.random.SeedSequence([int(s) & 0xFFFFFFFF for s in seeds])
    g = torch.Generator()
    g.manual_seed(int(ss.generate_state(1, dtype=np.uint64)[0] & 0x7FFF_FFFF_FFFF_FFFF))
    return g


@torch.no_grad()
def evaluate_model(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2048, loss_fn: LossFn | None = None
) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` on ``(x, y)``.

    The loss is cross-entropy unless ``loss_fn`` is given (e.g. :func:`mse_loss`); the
    accuracy is only defined for the default classification loss and is NaN otherwise.
    """
    if y.shape[0] == 0:
        return float("nan"), float("nan")
    model.eval()
    total_loss, correct = 0.0, 0
    for s in range(0, y.shape[0], batch_size):
        out = model(x[s : s + batch_size])
        yb = y[s : s + batch_size]
        if loss_fn is None:
            total_loss += float(F.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
        else:
            total_loss += float(loss_fn(out, yb)) * int(yb.shape[0])
    n = int(y.shape[0])
    return total_loss / n, (correct / n if loss_fn is None else float("nan"))


def batch_loss(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, loss_fn: LossFn | None = None
) -> float:
    """Loss of ``model`` on one minibatch ``idx`` (no gradient; cross-entropy by default)."""
    model.eval()
    with torch.no_grad():
        return float((loss_fn or F.cross_entropy)(model(x[idx]), y[idx]))


#: Salt of the global-RNG seed a training loop derives from its minibatch generator.
_SALT_GLOBAL_RNG = 97


@contextmanager
def seeded_global_rng(generator: torch.Generator, device: torch.device | None = None) -> Iterator[None]:
    """Seed torch's global RNG from ``generator``'s seed for a training loop, then restore it.

    Dropout layers (the FedMGDA+ paper's networks) draw their masks from the global RNG of
    the device they run on (the CPU's, or the CUDA generator of ``device``: the data's
    device; unset, the current CUDA device when there is one), not from the loop's minibatch
    generator. Inside this context the CPU generator and that CUDA generator start from a
    seed derived from the generator's initial seed and a salt (the generator itself is not
    advanced), so a client's local training is repeatable from the run seed whatever else
    ran in the process; on exit both are back where they were.
    """
    seed = int(generator.initial_seed())
    ss = np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, _SALT_GLOBAL_RNG])
    if device is not None and device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    elif device is None and torch.cuda.is_available():
        devices = [torch.cuda.current_device()]
    else:
        devices = []
    with torch.random.fork_rng(devices=devices):
        # The generators fork_rng restores, seeded as torch.manual_seed would seed them (which
        # also queues every other backend's seeding: ~100x the cost of these two calls).
        global_seed = int(ss.generate_state(1, dtype=np.uint64)[0] & 0x7FFF_FFFF_FFFF_FFFF)
        torch.default_generator.manual_seed(global_seed)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(global_seed)
        yield


def clone_state(model: nn.Module) -> StateDict:
    """Detached copy of the model's state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class TrainResult:
    """Outcome of a local training run.

    ``loss_before`` is the loss of the *received* model on the local training data
    (what q-FedAvg calls F_k(w^t)); ``mean_batch_loss`` is the average minibatch loss
    seen during the local steps; ``snapshot`` is the model after step t′ when asked for.
    """

    state: StateDict
    steps: int
    num_examples: int
    loss_before: float
    mean_batch_loss: float
    snapshot: StateDict | None = None
    extras: dict[str, float] = field(default_factory=dict)


GradHook = Callable[[nn.Module, int], None]


def check_loop_args(steps: int, lr: float, batch_size: int) -> None:
    """Check the arguments every local loop shares: τ = ``steps`` >= 1, η = ``lr`` > 0, ``batch_size`` >= 1.

    Raises
    ------
    ValueError
        Naming the run-config key (``local-steps``, ``lr``, ``batch-size``) of the bad value.
    """
    if steps < 1:
        raise ValueError(f"local-steps: must be >= 1, got {steps}")
    if not lr > 0:
        raise ValueError(f"lr: must be > 0, got {lr}")
    if batch_size < 1:
        raise ValueError(f"batch-size: must be >= 1, got {batch_size}")


def host_values(values: list[torch.Tensor]) -> list[float]:
    """Scalar tensors (e.g. the step losses a loop kept on its device) as Python floats.

    One transfer to the host for all of them instead of one synchronising ``float()`` per
    step. Each value is widened to float64 exactly, so summing the result in order gives
    the same number as adding ``float(v)`` step by step.
    """
    if not values:
        return []
    return torch.stack([v.reshape(()) for v in values]).double().cpu().tolist()


def local_sgd(
    model: nn.Module,
    data: LocalData,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    proximal_mu: float = 0.0,
    snapshot_step: int | None = None,
    weight_decay: float = 0.0,
    grad_hook: GradHook | None = None,
    step_scale: Callable[[float], float] | None = None,
    loss_before_on: str = "full",
    loss_fn: LossFn | None = None,
) -> TrainResult:
    """Run ``steps`` minibatch SGD steps on the local training data.

    Update, for t = 1..τ with minibatch B_t:

        w ← w − η · ( s(ℓ_t) · ∇ℓ_{B_t}(w) + μ (w − w⁰) + wd · w ),

    where w⁰ is the received model (the FedProx proximal term when μ = ``proximal_mu`` > 0),
    ``s`` is an optional loss-dependent step scale (DR-DSGD's h/μ; 1 otherwise) and
    ``grad_hook(model, t)`` may edit the gradients before the step (SCAFFOLD-style control
    variates). With ``snapshot_step = t′ ∈ {1..τ}`` the model after step t′ is kept too
    (DRFA's w(t′)).

    Parameters
    ----------
    steps : int
        τ ≥ 1 local steps.
    lr : float
        η > 0.
    batch_size : int
        Minibatch size ≥ 1 (clipped to the local data size).
    generator : torch.Generator
        Source of the minibatch order.
    loss_before_on : {"full", "batch", "none"}
        The loss of the received model w⁰ reported as ``loss_before``: on all local training
        data ("full", one extra forward pass over the data), on the first minibatch B_1
        ("batch": ℓ_{B_1}(w⁰), the loss the first step computes anyway, so free), or not at
        all ("none": NaN).
    loss_fn : callable, optional
        ℓ(output, target) → mean loss; cross-entropy when unset (:func:`mse_loss` for
        regression).
    """
    check_loop_args(steps, lr, batch_size)
    if proximal_mu < 0:
        raise ValueError(f"proximal-mu: must be >= 0, got {proximal_mu}")
    if snapshot_step is not None and not 1 <= snapshot_step <= steps:
        raise ValueError(f"snapshot-step: must be in [1, {steps}], got {snapshot_step}")
    if loss_before_on not in LOSS_BEFORE_ON:
        raise ValueError(f"train-loss-on: must be one of {', '.join(LOSS_BEFORE_ON)}, got {loss_before_on!r}")

    device = data.x_train.device
    loss_before = (
        evaluate_model(model, data.x_train, data.y_train, loss_fn=loss_fn)[0]
        if loss_before_on == "full" else float("nan")
    )
    criterion = loss_fn or F.cross_entropy
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params] if proximal_mu > 0 else None
    batches = minibatches(data.num_train, batch_size, generator, device)
    snapshot: StateDict | None = None
    losses: list[torch.Tensor] = []  # kept on the device: no host round-trip per step
    with seeded_global_rng(generator, device):  # dropout layers draw from it
        model.train()
        for t in range(1, steps + 1):
            idx = next(batches)
            model.zero_grad(set_to_none=True)
            loss = criterion(model(data.x_train[idx]), data.y_train[idx])
            loss.backward()
            losses.append(loss.detach())
            if grad_hook is not None:
                grad_hook(model, t)
            # a loss-dependent step needs the loss on the host at every step
            scale = step_scale(float(losses[-1])) if step_scale is not None else 1.0
            with torch.no_grad():
                for i, p in enumerate(params):
                    if p.grad is None:
                        continue
                    g = p.grad if scale == 1.0 else p.grad * scale
                    if anchor is not None:
                        g = g + proximal_mu * (p - anchor[i])
                    if weight_decay:
                        g = g + weight_decay * p
                    p.add_(g, alpha=-lr)
            if snapshot_step == t:
                snapshot = clone_state(model)
    step_losses = host_values(losses)
    if loss_before_on == "batch":
        loss_before = step_losses[0]
    return TrainResult(
        state=clone_state(model),
        steps=steps,
        num_examples=data.num_train,
        loss_before=loss_before,
        mean_batch_loss=sum(step_losses) / steps,
        snapshot=snapshot,
    )


def steps_from_epochs(epochs: float, num_examples: int, batch_size: int) -> int:
    """Number of local steps in ``epochs`` passes over ``num_examples`` with ``batch_size``."""
    if epochs <= 0:
        raise ValueError(f"local-epochs: must be > 0, got {epochs}")
    per_epoch = max(1, math.ceil(num_examples / max(1, min(batch_size, num_examples))))
    return max(1, int(round(epochs * per_epoch)))


def full_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 4096, loss_fn: LossFn | None = None
) -> tuple[float, list[torch.Tensor]]:
    """Loss and gradient of the mean loss (cross-entropy unless ``loss_fn``) over all of ``(x, y)``."""
    criterion = loss_fn or F.cross_entropy
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) for p in params]
    n = int(y.shape[0])
    total = 0.0
    model.train()
    for s in range(0, n, batch_size):
        model.zero_grad(set_to_none=True)
        yb = y[s : s + batch_size]
        loss = criterion(model(x[s : s + batch_size]), yb) * (int(yb.shape[0]) / n)
        loss.backward()
        total += float(loss.detach())
        for g, p in zip(grads, params, strict=True):
            if p.grad is not None:
                g.add_(p.grad)
    return total, grads
