"""Data sets generated in code: LEAF's Synthetic(α, β) and SCAFF-PD's robust regression.

Synthetic(α, β) follows the generator of LEAF / FedProx (Li et al., "Federated
Optimization in Heterogeneous Networks", MLSys 2020, https://arxiv.org/abs/1812.06127;
Caldas et al., "LEAF", 2018, ``data/synthetic``). For client k:

    u_k ~ N(0, α²),  B_k ~ N(0, β²)
    W_k ∈ R^{C×d}, b_k ∈ R^C with entries ~ N(u_k, 1)
    v_k ∈ R^d with entries ~ N(B_k, 1)
    x ~ N(v_k, Σ),  Σ = diag(j^{-1.2}), j = 1..d
    y = argmax softmax(W_k x + b_k) = argmax (W_k x + b_k)

As in LEAF's code, α and β are the *standard deviations* of u_k and B_k (the paper writes
N(0, α)). The number of samples of client k is ⌊lognormal(4, 2)⌋ + 50 as in LEAF, capped
at `max_samples` (default 1000) so totals stay small. Synthetic-IID (LEAF's
``generate_iid.py``): one W, b with entries ~ N(0, 1) shared by every client and
v = 0 for all, so all clients draw from the same distribution.

The robust-regression problem is SCAFF-PD §6.1 (Yu, Karimireddy, Ma, Jordan,
"Scaff-PD: Communication Efficient Fair and Robust Federated Learning", 2023,
https://arxiv.org/abs/2307.13381): rows a ~ N(0, I_d), a shared x̂ ~ N(0, c² I_d), a
per-client shift δ_i ~ N(0, σ² I_d) and noiseless targets y = ⟨a, x̂ + δ_i⟩.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SyntheticClient:
    """Samples of one Synthetic(α, β) client.

    Attributes
    ----------
    x : np.ndarray
        float32 inputs (n, d).
    y : np.ndarray
        int64 labels (n,) in ``0 .. C-1``.
    weights : np.ndarray
        The client's W_k (C, d), float64.
    bias : np.ndarray
        The client's b_k (C,), float64.
    mean : np.ndarray
        The client's input mean v_k (d,), float64.
    """

    x: np.ndarray
    y: np.ndarray
    weights: np.ndarray
    bias: np.ndarray
    mean: np.ndarray


def leaf_synthetic(
    num_clients: int,
    alpha: float = 1.0,
    beta: float = 1.0,
    dim: int = 60,
    num_classes: int = 10,
    iid: bool = False,
    seed: int = 0,
    max_samples: int = 1000,
) -> list[SyntheticClient]:
    """Generate LEAF's Synthetic(α, β) federated classification data.

    Parameters
    ----------
    num_clients : int
        Number of clients K ≥ 1.
    alpha : float (default: 1.0)
        Std α ≥ 0 of the per-client model mean u_k (model heterogeneity).
    beta : float (default: 1.0)
        Std β ≥ 0 of the per-client input-mean centre B_k (input heterogeneity).
    dim : int (default: 60)
        Input dimension d ≥ 1.
    num_classes : int (default: 10)
        Classes C ≥ 2.
    iid : bool (default: False)
        Shared W, b (entries N(0, 1)) and v = 0 for every client.
    seed : int (default: 0)
        Seed of the ``numpy.random.Generator``.
    max_samples : int (default: 1000)
        Cap on ⌊lognormal(4, 2)⌋ + 50 samples per client (≥ 50).

    Returns
    -------
    list[SyntheticClient]
        One record per client with its samples and generating parameters.

    Raises
    ------
    ValueError
        If a parameter is outside its range.

    Examples
    --------
    >>> clients = leaf_synthetic(3, dim=5, num_classes=4, seed=1)
    >>> clients[0].x.shape[1], int(clients[0].y.max()) < 4
    (5, True)
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if alpha < 0 or beta < 0:
        raise ValueError(f"synthetic-alpha and synthetic-beta must be >= 0, got {alpha}, {beta}")
    if dim < 1:
        raise ValueError(f"synthetic-dim must be >= 1, got {dim}")
    if num_classes < 2:
        raise ValueError(f"synthetic-classes must be >= 2, got {num_classes}")
    if max_samples < 50:
        raise ValueError(f"max_samples must be >= 50, got {max_samples}")
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.lognormal(4.0, 2.0, num_clients).astype(np.int64) + 50, max_samples)
    u = rng.normal(0.0, alpha, num_clients)
    centres = rng.normal(0.0, beta, num_clients)
    std_x = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2.0)  # sqrt of Σ_jj = j^-1.2
    if iid:
        w_shared = rng.normal(0.0, 1.0, (num_classes, dim))
        b_shared = rng.normal(0.0, 1.0, num_classes)
    clients = []
    for k in range(num_clients):
        if iid:
            w, b, v = w_shared, b_shared, np.zeros(dim)
        else:
            w = rng.normal(u[k], 1.0, (num_classes, dim))
            b = rng.normal(u[k], 1.0, num_classes)
            v = rng.normal(centres[k], 1.0, dim)
        x = v + rng.standard_normal((int(sizes[k]), dim)) * std_x
        y = np.argmax(x @ w.T + b, axis=1).astype(np.int64)
        clients.append(SyntheticClient(x=x.astype(np.float32), y=y, weights=w, bias=b, mean=v))
    return clients


@dataclass(frozen=True)
class RobustRegressionProblem:
    """SCAFF-PD's robust-regression problem with its ground truth.

    Attributes
    ----------
    features : list[np.ndarray]
        A_i, shape (n, d), rows ~ N(0, I_d).
    targets : list[np.ndarray]
        y_i = A_i (x̂ + δ_i), shape (n,).
    x_hat : np.ndarray
        The shared solution x̂ ~ N(0, c² I_d).
    shifts : np.ndarray
        δ_i stacked, shape (num_clients, d), δ_i ~ N(0, σ² I_d).
    """

    features: list[np.ndarray]
    targets: list[np.ndarray]
    x_hat: np.ndarray
    shifts: np.ndarray


def robust_regression_problem(
    num_clients: int,
    dim: int,
    samples_per_client: int,
    scale: float = 1.0,
    shift_sigma: float = 1.0,
    seed: int = 0,
) -> RobustRegressionProblem:
    """Generate SCAFF-PD §6.1's heterogeneous linear-regression clients, with ground truth.

    Draws, in this order from ``numpy.random.default_rng(seed)``: x̂ ~ N(0, c² I_d), then
    for each client i the shift δ_i ~ N(0, σ² I_d), the rows of A_i ~ N(0, I_d), and sets
    y_i = A_i (x̂ + δ_i) (float64, no noise).

    Parameters
    ----------
    num_clients : int
        Number of clients N ≥ 1.
    dim : int
        Dimension d ≥ 1.
    samples_per_client : int
        Rows n ≥ 1 per client.
    scale : float (default: 1.0)
        c ≥ 0, the std of the entries of x̂.
    shift_sigma : float (default: 1.0)
        σ ≥ 0, the std of the entries of each δ_i (client heterogeneity).
    seed : int (default: 0)
        Seed.

    Returns
    -------
    RobustRegressionProblem
        Features, targets, x̂ and the shifts.

    Raises
    ------
    ValueError
        If a parameter is outside its range.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    if samples_per_client < 1:
        raise ValueError(f"samples_per_client must be >= 1, got {samples_per_client}")
    if not scale >= 0:
        raise ValueError(f"scale must be >= 0, got {scale}")
    if not shift_sigma >= 0:
        raise ValueError(f"shift_sigma must be >= 0, got {shift_sigma}")
    rng = np.random.default_rng(seed)
    x_hat = rng.normal(0.0, scale, dim)
    shifts = np.empty((num_clients, dim))
    features, targets = [], []
    for i in range(num_clients):
        shifts[i] = rng.normal(0.0, shift_sigma, dim)
        a = rng.standard_normal((samples_per_client, dim))
        features.append(a)
        targets.append(a @ (x_hat + shifts[i]))
    return RobustRegressionProblem(features=features, targets=targets, x_hat=x_hat, shifts=shifts)
