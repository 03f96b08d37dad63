"""Gossip over a communication graph: Metropolis mixing matrices, mixing, consensus.

DR-DSGD / DSGD (Ben Issaid, Elgabli and Bennis, "DR-DSGD: A Distributionally Robust
Decentralized Learning Algorithm over Graphs", TMLR 2022, Alg. 2,
https://openreview.net/forum?id=VcXNAr5Rur): after its local step every device i
averages the half-step models of its neighbours in G_t,

    θ_i^{t+1} = Σ_j W_ij θ_j^{t+½},      i.e.  Θ^{t+1} = W Θ^{t+½},

with the Metropolis mixing matrix W of G_t (:func:`metropolis_weights`), symmetric and
doubly stochastic and supported on E_t ∪ {(i, i)}. The speed of consensus is governed by

    ρ = ‖WᵀW − J‖₂,   J = 11ᵀ / K,

which is < 1 exactly when G_t is connected. Row i of W is node i of the graph; the graphs
themselves are built by :mod:`flowerdro.core.graphs`.

Framework-free (networkx + numpy); never imports flwr or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import networkx as nx
import numpy as np

__all__ = [
    "average_models",
    "consensus_distance",
    "edges_used",
    "metropolis_weights",
    "mix",
    "spectral_gap_rho",
]

# A model is either an array whose first axis indexes the K nodes, or a list (one entry
# per node) of lists of numpy arrays (one per layer).
Models = np.ndarray | Sequence[Sequence[np.ndarray]]


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


def _check_square_matrix(W: Any, name: str = "W") -> np.ndarray:
    arr = np.asarray(W, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] < 1:
        raise ValueError(
            f"{name} must be a square (K x K) matrix with K >= 1, got shape {arr.shape}"
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must contain only finite entries")
    return arr


# ----------------------------------------------------------------------------------------
# mixing matrices
# ----------------------------------------------------------------------------------------
def metropolis_weights(graph: nx.Graph) -> np.ndarray:
    """Metropolis–Hastings mixing matrix W of an undirected graph.

    .. math::

        W_{ij} = \\frac{1}{1 + \\max(d_i, d_j)} \\text{ if } (i, j) \\in E,\\qquad
        W_{ii} = 1 - \\sum_{j \\ne i} W_{ij},\\qquad W_{ij} = 0 \\text{ otherwise},

    where d_i is the number of neighbours of node i (self-loops are ignored). W is
    symmetric, non-negative and doubly stochastic (W1 = 1, 1ᵀW = 1ᵀ); with G connected,
    ρ = ‖WᵀW − J‖₂ < 1.

    Parameters
    ----------
    graph : networkx.Graph
        Undirected graph whose nodes are exactly the integers ``0 .. K-1`` (row i of W
        is node i).

    Returns
    -------
    numpy.ndarray
        The (K, K) float64 matrix W.

    Raises
    ------
    ValueError
        If the graph is directed, empty, or its node labels are not ``0 .. K-1``.

    Examples
    --------
    >>> metropolis_weights(nx.path_graph(3)).round(4).tolist()
    [[0.6667, 0.3333, 0.0], [0.3333, 0.3333, 0.3333], [0.0, 0.3333, 0.6667]]
    """
    if not isinstance(graph, nx.Graph):
        raise ValueError(f"graph must be a networkx.Graph, got {type(graph).__name__}")
    if graph.is_directed():
        raise ValueError("graph must be undirected (got a directed graph)")
    num_nodes = graph.number_of_nodes()
    if num_nodes < 1:
        raise ValueError("graph must have at least one node")
    nodes = set(graph.nodes)
    if nodes != set(range(num_nodes)):
        sample = sorted(map(repr, nodes))[:5]
        raise ValueError(
            f"graph node labels must be exactly the integers 0..{num_nodes - 1}; got "
            f"labels such as {sample} (use networkx.convert_node_labels_to_integers)"
        )
    adjacency = nx.to_numpy_array(graph, nodelist=range(num_nodes), weight=None, dtype=np.float64)
    np.fill_diagonal(adjacency, 0.0)  # self-loops carry no gossip weight of their own
    adjacency = (adjacency > 0).astype(np.float64)
    degree = adjacency.sum(axis=1)
    W = adjacency / (1.0 + np.maximum.outer(degree, degree))
    np.fill_diagonal(W, 1.0 - W.sum(axis=1))
    return W


def spectral_gap_rho(W: np.ndarray) -> float:
    """Consensus contraction factor ρ = ‖WᵀW − J‖₂ of a mixing matrix.

    .. math::

        \\rho = \\lVert W^\\top W - J \\rVert_2,\\qquad J = \\tfrac{1}{K} \\mathbf{1}\\mathbf{1}^\\top,

    the spectral norm (largest singular value). For a symmetric doubly stochastic W this
    equals max(λ₂(W)², λ_K(W)²), and ρ < 1 iff the graph is connected (and W has a
    positive diagonal, as Metropolis weights do). For Remark 4 of DR-DSGD (a random W_t
    every iteration) pass a stack of samples: ρ is then estimated as
    ‖(1/T) Σ_t W_tᵀ W_t − J‖₂, the empirical version of ‖E[WᵀW] − J‖₂.

    Parameters
    ----------
    W : numpy.ndarray
        A (K, K) mixing matrix, or a (T, K, K) stack of them.

    Returns
    -------
    float
        ρ >= 0.

    Raises
    ------
    ValueError
        If W is not (K, K) or (T, K, K) with T, K >= 1, or has non-finite entries.

    Examples
    --------
    >>> round(spectral_gap_rho(np.full((4, 4), 0.25)), 12)
    0.0
    """
    arr = np.asarray(W, dtype=np.float64)
    if arr.ndim == 3:
        if arr.shape[0] < 1 or arr.shape[1] != arr.shape[2] or arr.shape[1] < 1:
            raise ValueError(
                f"W must have shape (K, K) or (T, K, K) with T, K >= 1, got {arr.shape}"
            )
        if not np.all(np.isfinite(arr)):
            raise ValueError("W must contain only finite entries")
        gram = np.einsum("tki,tkj->ij", arr, arr) / arr.shape[0]
    else:
        if arr.ndim != 2:
            raise ValueError(
                f"W must have shape (K, K) or (T, K, K) with T, K >= 1, got {arr.shape}"
            )
        arr = _check_square_matrix(arr)
        gram = arr.T @ arr
    num_nodes = gram.shape[0]
    M = gram - np.full((num_nodes, num_nodes), 1.0 / num_nodes)
    return float(np.linalg.norm(M, ord=2))


def edges_used(W: np.ndarray, atol: float = 0.0) -> int:
    """Number of undirected edges that carry weight in a mixing matrix.

    Counts the pairs i < j with |W_ij| > atol or |W_ji| > atol. One gossip step
    θ_i ← Σ_j W_ij θ_j sends a model each way over every such edge, i.e.
    ``2 * edges_used(W)`` model transfers.

    Parameters
    ----------
    W : numpy.ndarray
        A (K, K) mixing matrix.
    atol : float (default: 0.0)
        Weights with absolute value <= atol count as absent; atol >= 0.

    Returns
    -------
    int
        |{(i, j) : i < j, W_ij ≠ 0 or W_ji ≠ 0}|.

    Raises
    ------
    ValueError
        If W is not a finite square matrix or atol < 0.

    Examples
    --------
    >>> edges_used(metropolis_weights(nx.cycle_graph(5)))
    5
    """
    arr = _check_square_matrix(W)
    tol = _check_real("atol", atol)
    if tol < 0:
        raise ValueError(f"atol must be >= 0, got {tol}")
    nonzero = np.abs(arr) > tol
    sym = nonzero | nonzero.T
    return int(np.count_nonzero(np.triu(sym, k=1)))


# ----------------------------------------------------------------------------------------
# models on the nodes
# ----------------------------------------------------------------------------------------
def _as_layer_lists(models: Any, name: str = "models") -> list[list[np.ndarray]] | None:
    """Return a validated list of per-node layer lists, or None for an array input."""
    if isinstance(models, np.ndarray):
        return None
    if not isinstance(models, Sequence) or isinstance(models, str | bytes):
        raise ValueError(
            f"{name} must be a (K, d) numpy array or a list of K per-node lists of "
            f"numpy arrays, got {type(models).__name__}"
        )
    if len(models) < 1:
        raise ValueError(f"{name} must contain at least one node (K >= 1)")
    nodes: list[list[np.ndarray]] = []
    for i, node in enumerate(models):
        if isinstance(node, np.ndarray) or not isinstance(node, Sequence):
            raise ValueError(
                f"{name}[{i}] must be a list of numpy arrays (one per layer), "
                f"got {type(node).__name__}"
            )
        nodes.append([np.asarray(layer) for layer in node])
    num_layers = len(nodes[0])
    for i, node in enumerate(nodes):
        if len(node) != num_layers:
            raise ValueError(
                f"{name}[{i}] has {len(node)} layers but {name}[0] has {num_layers}; "
                "every node must hold the same architecture"
            )
        for l, layer in enumerate(node):
            if layer.shape != nodes[0][l].shape:
                raise ValueError(
                    f"{name}[{i}][{l}] has shape {layer.shape} but {name}[0][{l}] has "
                    f"shape {nodes[0][l].shape}"
                )
            if not (
                np.issubdtype(layer.dtype, np.floating) or np.issubdtype(layer.dtype, np.integer)
            ):
                raise ValueError(
                    f"{name}[{i}][{l}] must have a real (float or integer) dtype, got {layer.dtype}"
                )
    return nodes


def _as_node_array(models: np.ndarray, name: str = "models") -> np.ndarray:
    if models.ndim < 1 or models.shape[0] < 1:
        raise ValueError(f"{name} must have shape (K, ...) with K >= 1, got {models.shape}")
    if not (np.issubdtype(models.dtype, np.floating) or np.issubdtype(models.dtype, np.integer)):
        raise ValueError(f"{name} must have a real (float or integer) dtype, got {models.dtype}")
    return models


def _finite(flat: np.ndarray) -> np.ndarray:
    if not np.all(np.isfinite(flat)):
        raise ValueError("models must contain only finite entries")
    return flat


def consensus_distance(models: Models) -> float:
    """Average squared distance of the node models to their mean.

    .. math::

        \\Xi = \\frac{1}{K} \\sum_{i=1}^{K} \\lVert \\theta_i - \\bar\\theta \\rVert^2,
        \\qquad \\bar\\theta = \\frac{1}{K} \\sum_{i=1}^{K} \\theta_i,

    where for layered models ‖·‖² sums over all layers (the models are flattened and
    concatenated). Ξ = 0 iff all nodes agree.

    Parameters
    ----------
    models : numpy.ndarray or list of list of numpy.ndarray
        Either an array of shape (K, d) (or (K, ...), the first axis indexing nodes),
        or K per-node lists of layer arrays with matching shapes.

    Returns
    -------
    float
        Ξ >= 0, computed in float64.

    Raises
    ------
    ValueError
        If K = 0, layers are missing or have mismatched shapes, or entries are not real.

    Examples
    --------
    >>> consensus_distance(np.array([[0.0, 0.0], [2.0, 0.0]]))
    1.0
    """
    nodes = _as_layer_lists(models)
    if nodes is None:
        arr = _as_node_array(np.asarray(models)).astype(np.float64, copy=False)
        flat = _finite(arr.reshape(arr.shape[0], -1))
        total = float(np.sum((flat - flat.mean(axis=0)) ** 2))
        num_nodes = arr.shape[0]
    else:
        num_nodes = len(nodes)
        total = 0.0
        for l in range(len(nodes[0])):
            stacked = np.stack([node[l] for node in nodes]).astype(np.float64, copy=False)
            flat = _finite(stacked.reshape(num_nodes, -1))
            total += float(np.sum((flat - flat.mean(axis=0)) ** 2))
    return total / num_nodes


def _mix_stacked(stacked: np.ndarray, W: np.ndarray) -> np.ndarray:
    """θ ← Wθ along axis 0 with one matmul, keeping the input dtype."""
    num_nodes = stacked.shape[0]
    flat = stacked.reshape(num_nodes, -1).astype(np.float64, copy=False)
    mixed = (W @ flat).reshape(stacked.shape)
    if np.issubdtype(stacked.dtype, np.integer):
        return np.rint(mixed).astype(stacked.dtype)
    return mixed.astype(stacked.dtype, copy=False)


def mix(models: Models, W: np.ndarray) -> np.ndarray | list[list[np.ndarray]]:
    """One gossip (consensus) step θ_i ← Σ_j W_ij θ_j.

    .. math::

        \\theta_i^{t+1} = \\sum_{j=1}^{K} W_{ij}\\, \\theta_j^{t+1/2},

    i.e. Θ ← WΘ with Θ the (K, d) matrix whose rows are the node models; for layered
    models this is done with a single (K, K) × (K, d_l) matmul per layer l. If W is
    column stochastic (1ᵀW = 1ᵀ, as Metropolis weights are) the sum Σ_i θ_i, hence the
    average θ̄, is unchanged.

    The arithmetic is float64; each output array has the dtype of its input. Integer
    layers (e.g. counters such as BatchNorm's ``num_batches_tracked``) are mixed then
    rounded to the nearest integer.

    Parameters
    ----------
    models : numpy.ndarray or list of list of numpy.ndarray
        A (K, d) array (or (K, ...), first axis = node), or K per-node lists of layer
        arrays with matching shapes.
    W : numpy.ndarray
        The (K, K) mixing matrix; row i holds the weights node i gives its neighbours.

    Returns
    -------
    numpy.ndarray or list of list of numpy.ndarray
        The mixed models in the same structure as ``models`` (new arrays; the input is
        not modified).

    Raises
    ------
    ValueError
        If W is not a finite (K, K) matrix matching the K models, or the models are
        malformed (see :func:`consensus_distance`).

    Examples
    --------
    >>> mix(np.array([[0.0], [2.0]]), np.full((2, 2), 0.5)).tolist()
    [[1.0], [1.0]]
    """
    Wm = _check_square_matrix(W)
    nodes = _as_layer_lists(models)
    if nodes is None:
        arr = _as_node_array(np.asarray(models))
        if arr.shape[0] != Wm.shape[0]:
            raise ValueError(
                f"W has shape {Wm.shape} but models holds K={arr.shape[0]} nodes; W must be (K, K)"
            )
        return _mix_stacked(arr, Wm)
    num_nodes = len(nodes)
    if num_nodes != Wm.shape[0]:
        raise ValueError(
            f"W has shape {Wm.shape} but models holds K={num_nodes} nodes; W must be (K, K)"
        )
    out: list[list[np.ndarray]] = [[] for _ in range(num_nodes)]
    for l in range(len(nodes[0])):
        mixed = _mix_stacked(np.stack([node[l] for node in nodes]), Wm)
        for i in range(num_nodes):
            out[i].append(mixed[i])
    return out


def average_models(models: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """The layer-wise mean of K node models, each layer in the dtype of node 0's.

    .. math::

        \\bar\\theta = \\frac{1}{K} \\sum_{i=1}^{K} \\theta_i,

    computed in float64; an integer layer (a counter) is rounded to the nearest integer.
    Gossip with a column-stochastic W (1ᵀW = 1ᵀ) leaves θ̄ unchanged.

    Parameters
    ----------
    models : list of list of numpy.ndarray
        K ≥ 1 per-node lists of layer arrays with matching shapes.

    Returns
    -------
    list of numpy.ndarray
        θ̄, one array per layer.

    Raises
    ------
    ValueError
        If K = 0 or the layers are missing or have mismatched shapes.

    Examples
    --------
    >>> average_models([[np.array([0.0, 2.0])], [np.array([2.0, 4.0])]])[0].tolist()
    [1.0, 3.0]
    """
    nodes = _as_layer_lists(models)
    if nodes is None:
        raise ValueError("models must be a list of K per-node lists of numpy arrays")
    out = []
    for layer in range(len(nodes[0])):
        mean = np.stack([node[layer] for node in nodes]).astype(np.float64).mean(axis=0)
        dtype = nodes[0][layer].dtype
        out.append(np.rint(mean).astype(dtype) if np.issubdtype(dtype, np.integer) else mean.astype(dtype))
    return out
