"""Communication graphs and Metropolis mixing matrices for decentralised learning.

Used by DR-DSGD / DSGD (Ben Issaid, Elgabli and Bennis, "DR-DSGD: A Distributionally
Robust Decentralized Learning Algorithm over Graphs", TMLR 2022,
https://openreview.net/forum?id=VcXNAr5Rur). Each of the K devices keeps its own model
θ_i and, after a local step, gossips with its neighbours in an undirected graph
G = (V, E):

    θ_i^{t+1} = Σ_j W_ij θ_j^{t+½},

with a symmetric, doubly stochastic mixing matrix W supported on E ∪ {(i, i)}. The
speed of consensus is governed by

    ρ = ‖WᵀW − J‖₂,   J = 11ᵀ / K,

which is < 1 exactly when G is connected (for Metropolis weights). Remark 4 of the paper
allows a fresh random graph at every iteration; :func:`graph_for_iteration` and
:class:`GraphSchedule` produce such a sequence deterministically from a seed.

Nodes are always labelled ``0 .. K-1`` so that node ``i`` is row ``i`` of W.

This module is framework-free (networkx + numpy); it never imports flwr.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

__all__ = [
    "TOPOLOGIES",
    "GraphSchedule",
    "consensus_distance",
    "edges_used",
    "graph_for_iteration",
    "make_graph",
    "metropolis_weights",
    "mix",
    "spectral_gap_rho",
]

#: Names accepted by :func:`make_graph`, with the smallest number of nodes each allows.
TOPOLOGIES: dict[str, int] = {
    "erdos_renyi": 2,
    "ring": 3,
    "grid": 4,
    "geometric": 2,
    "complete": 2,
}

# Which keyword arguments of make_graph belong to which topology.
_TOPOLOGY_PARAMS: dict[str, tuple[str, ...]] = {
    "erdos_renyi": ("p",),
    "ring": (),
    "grid": ("rows",),
    "geometric": ("radius",),
    "complete": (),
}

SeedLike = int | np.random.Generator | None

# A model is either an array whose first axis indexes the K nodes, or a list (one entry
# per node) of lists of numpy arrays (one per layer).
Models = np.ndarray | Sequence[Sequence[np.ndarray]]


# ----------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------
def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


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
# graph construction
# ----------------------------------------------------------------------------------------
def _most_square_rows(num_nodes: int) -> int | None:
    """Largest divisor r of K with 2 <= r <= sqrt(K) (so cols = K / r >= r >= 2)."""
    for r in range(math.isqrt(num_nodes), 1, -1):
        if num_nodes % r == 0:
            return r
    return None


def _erdos_renyi(num_nodes: int, p: float, rng: np.random.Generator) -> nx.Graph:
    iu, ju = np.triu_indices(num_nodes, k=1)
    keep = rng.random(iu.size) < p
    graph = nx.empty_graph(num_nodes)
    graph.add_edges_from(zip(iu[keep].tolist(), ju[keep].tolist(), strict=True))
    return graph


def _geometric(num_nodes: int, radius: float, rng: np.random.Generator) -> nx.Graph:
    pos = rng.random((num_nodes, 2))
    diff = pos[:, None, :] - pos[None, :, :]
    dist2 = np.einsum("ijk,ijk->ij", diff, diff)
    iu, ju = np.triu_indices(num_nodes, k=1)
    keep = dist2[iu, ju] <= radius * radius
    graph = nx.empty_graph(num_nodes)
    for i in range(num_nodes):
        graph.nodes[i]["pos"] = (float(pos[i, 0]), float(pos[i, 1]))
    graph.add_edges_from(zip(iu[keep].tolist(), ju[keep].tolist(), strict=True))
    return graph


def _grid(rows: int, cols: int) -> nx.Graph:
    graph = nx.empty_graph(rows * cols)
    for r in range(rows):
        for c in range(cols):
            node = r * cols + c
            if c + 1 < cols:
                graph.add_edge(node, node + 1)
            if r + 1 < rows:
                graph.add_edge(node, node + cols)
    return graph


def make_graph(
    topology: str,
    num_nodes: int,
    *,
    p: float | None = None,
    radius: float | None = None,
    rows: int | None = None,
    seed: SeedLike = None,
    max_tries: int = 100,
) -> nx.Graph:
    """Build a connected undirected communication graph on nodes ``0 .. K-1``.

    Parameters
    ----------
    topology : str
        One of ``"erdos_renyi"``, ``"ring"``, ``"grid"``, ``"geometric"``,
        ``"complete"``.

        * ``erdos_renyi``: G(K, p), each of the K(K−1)/2 edges present independently
          with probability p; resampled until connected (K >= 2).
        * ``ring``: the cycle C_K, node i linked to i ± 1 mod K (K >= 3).
        * ``grid``: 2-D lattice of ``rows x cols = K`` nodes, node (r, c) labelled
          ``r * cols + c``, 4-neighbourhood, no wrap-around (rows, cols >= 2).
        * ``geometric``: K points uniform in the unit square [0, 1]², an edge when the
          Euclidean distance is <= radius; resampled until connected (K >= 2). The
          positions are stored in the node attribute ``"pos"``.
        * ``complete``: K_K, every pair linked (K >= 2).
    num_nodes : int
        Number of devices K.
    p : float, optional
        Edge probability of ``erdos_renyi``, in (0, 1]. Required for that topology,
        must be None for the others.
    radius : float, optional
        Connection radius of ``geometric``, in (0, √2]. Required for that topology,
        must be None for the others.
    rows : int, optional
        Number of rows of ``grid`` (>= 2, dividing K with K / rows >= 2). When None,
        the most square factorisation is used (the largest divisor r <= √K).
        Must be None for the other topologies.
    seed : int or numpy.random.Generator, optional (default: None)
        Seed of the ``numpy.random.Generator`` used by the random topologies; the same
        seed always gives the same graph. Ignored by the deterministic topologies.
    max_tries : int (default: 100)
        How many random draws the random topologies may make before giving up on
        finding a connected graph.

    Returns
    -------
    networkx.Graph
        A connected simple graph with node labels ``0 .. K-1``; ``graph.graph`` records
        ``topology`` and the parameters used.

    Raises
    ------
    ValueError
        Unknown topology (the message lists the allowed names), K too small for the
        topology, a parameter out of its range or given to a topology that does not
        use it, a K that has no grid factorisation, or no connected draw within
        ``max_tries``.

    Examples
    --------
    >>> g = make_graph("ring", 5)
    >>> sorted(g.neighbors(0))
    [1, 4]
    """
    if not isinstance(topology, str) or topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {sorted(TOPOLOGIES)}, got {topology!r}")
    min_nodes = TOPOLOGIES[topology]
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int | np.integer):
        raise ValueError(f"num_nodes must be an integer >= {min_nodes}, got {num_nodes!r}")
    if num_nodes < min_nodes:
        raise ValueError(
            f"num_nodes must be >= {min_nodes} for topology {topology!r}, got {num_nodes}"
        )
    num_nodes = int(num_nodes)
    max_tries = _check_int("max_tries", max_tries, 1)

    given = {"p": p, "radius": radius, "rows": rows}
    for name, value in given.items():
        if value is not None and name not in _TOPOLOGY_PARAMS[topology]:
            raise ValueError(
                f"{name} is not a parameter of topology {topology!r} "
                f"(it takes {list(_TOPOLOGY_PARAMS[topology]) or 'no parameters'}); "
                f"got {name}={value!r}"
            )

    if topology == "ring":
        graph = nx.cycle_graph(num_nodes)
        graph.graph.update(topology="ring")
        return graph

    if topology == "complete":
        graph = nx.complete_graph(num_nodes)
        graph.graph.update(topology="complete")
        return graph

    if topology == "grid":
        if rows is None:
            r = _most_square_rows(num_nodes)
            if r is None:
                raise ValueError(
                    f"num_nodes must factor as rows x cols with rows, cols >= 2 for "
                    f"topology 'grid'; {num_nodes} is prime"
                )
        else:
            r = _check_int("rows", rows, 2)
            if num_nodes % r != 0 or num_nodes // r < 2:
                raise ValueError(
                    f"rows must divide num_nodes={num_nodes} with num_nodes / rows >= 2, "
                    f"got rows={r}"
                )
        cols = num_nodes // r
        graph = _grid(r, cols)
        graph.graph.update(topology="grid", rows=r, cols=cols)
        return graph

    rng = np.random.default_rng(seed)
    if topology == "erdos_renyi":
        if p is None:
            raise ValueError(
                "p is required for topology 'erdos_renyi' (edge probability in (0, 1])"
            )
        p_val = _check_real("p", p)
        if not 0.0 < p_val <= 1.0:
            raise ValueError(f"p must be in (0, 1], got {p_val}")
        return _draw_connected(
            lambda: _erdos_renyi(num_nodes, p_val, rng), max_tries, {"topology": "erdos_renyi", "p": p_val},
            f"erdos_renyi graph with p={p_val} and num_nodes (K)={num_nodes}",
            f"increase p (connectivity needs p well above ln(K)/K = {math.log(num_nodes) / num_nodes:.3g})",
        )

    # geometric
    if radius is None:
        raise ValueError("radius is required for topology 'geometric' (radius in (0, sqrt(2)])")
    r_val = _check_real("radius", radius)
    if not 0.0 < r_val <= math.sqrt(2.0):
        raise ValueError(f"radius must be in (0, sqrt(2)] = (0, {math.sqrt(2.0):.6f}], got {r_val}")
    return _draw_connected(
        lambda: _geometric(num_nodes, r_val, rng), max_tries, {"topology": "geometric", "radius": r_val},
        f"geometric graph with radius={r_val} and num_nodes (K)={num_nodes}",
        f"increase radius (connectivity needs radius well above sqrt(ln(K)/(pi K)) = "
        f"{math.sqrt(math.log(num_nodes) / (math.pi * num_nodes)):.3g})",
    )


def _draw_connected(
    draw: Callable[[], nx.Graph], max_tries: int, attrs: dict[str, Any], what: str, hint: str
) -> nx.Graph:
    """Call ``draw()`` until the graph is connected (at most ``max_tries`` times), else raise."""
    for attempt in range(1, max_tries + 1):
        graph = draw()
        if nx.is_connected(graph):
            graph.graph.update(attrs, tries=attempt)
            return graph
    raise ValueError(f"{what} was disconnected in all {max_tries} draws; {hint} or max_tries")


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
    neighbours = [set(graph.neighbors(i)) - {i} for i in range(num_nodes)]
    degree = np.array([len(nb) for nb in neighbours], dtype=np.float64)
    W = np.zeros((num_nodes, num_nodes), dtype=np.float64)
    for i in range(num_nodes):
        for j in neighbours[i]:
            if j > i:
                w = 1.0 / (1.0 + max(degree[i], degree[j]))
                W[i, j] = w
                W[j, i] = w
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


# ----------------------------------------------------------------------------------------
# a fresh graph per iteration (Remark 4 of DR-DSGD)
# ----------------------------------------------------------------------------------------
def graph_for_iteration(
    topology: str,
    num_nodes: int,
    t: int,
    base_seed: int,
    resample: bool,
    **kw: Any,
) -> nx.Graph:
    """The communication graph G_t used at iteration t.

    With ``resample=False`` the graph is the same at every iteration,
    G_t = make_graph(topology, K, seed=base_seed). With ``resample=True`` (Remark 4 of
    DR-DSGD: a new random graph each iteration, the analysis then holding with
    ρ = ‖E[W_tᵀW_t] − J‖₂) the graph is drawn with the seed
    ``numpy.random.SeedSequence([base_seed, t])``, so G_t is a deterministic function
    of (base_seed, t) and independent across t. Deterministic topologies (ring, grid,
    complete) give the same graph either way. Every G_t is connected.

    Parameters
    ----------
    topology : str
        See :func:`make_graph`.
    num_nodes : int
        Number of devices K.
    t : int
        Iteration index, t >= 0.
    base_seed : int
        Run seed, >= 0.
    resample : bool
        Draw a new graph at every iteration (True) or keep one graph (False).
    **kw
        ``p``, ``radius``, ``rows``, ``max_tries`` forwarded to :func:`make_graph`.

    Returns
    -------
    networkx.Graph
        G_t with nodes ``0 .. K-1``.

    Raises
    ------
    ValueError
        On t < 0, base_seed < 0, a non-bool ``resample``, a ``seed`` in ``kw``, or any
        error of :func:`make_graph`.
    """
    t = _check_int("t", t, 0)
    base_seed = _check_int("base_seed", base_seed, 0)
    if not isinstance(resample, bool | np.bool_):
        raise ValueError(f"resample must be a bool, got {resample!r}")
    if "seed" in kw:
        raise ValueError("seed must not be passed to graph_for_iteration; use base_seed")
    if resample:
        seed: SeedLike = np.random.default_rng(np.random.SeedSequence([base_seed, t]))
    else:
        seed = base_seed
    return make_graph(topology, num_nodes, seed=seed, **kw)


@dataclass(frozen=True)
class GraphSchedule:
    """Mixing matrices W_t for t = 0, 1, 2, ... of a decentralised run.

    A small immutable record of how the graph is chosen; :meth:`graph` and
    :meth:`mixing_matrix` are pure functions of t (see :func:`graph_for_iteration`).
    When ``resample`` is False the single graph and its Metropolis matrix are built
    once at construction.

    Parameters
    ----------
    topology : str
        See :func:`make_graph`.
    num_nodes : int
        Number of devices K.
    base_seed : int (default: 0)
        Run seed, >= 0.
    resample : bool (default: False)
        New random graph every iteration (Remark 4 of DR-DSGD).
    params : dict (default: {})
        ``p``, ``radius``, ``rows``, ``max_tries`` for :func:`make_graph`.

    Examples
    --------
    >>> sched = GraphSchedule("ring", 4)
    >>> sched.mixing_matrix(7)[0].round(4).tolist()
    [0.3333, 0.3333, 0.0, 0.3333]
    """

    topology: str
    num_nodes: int
    base_seed: int = 0
    resample: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    _static: tuple[nx.Graph, np.ndarray] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # Validate everything once by building G_0.
        graph = graph_for_iteration(
            self.topology, self.num_nodes, 0, self.base_seed, self.resample, **self.params
        )
        if not self.resample:
            W = metropolis_weights(graph)
            W.setflags(write=False)
            object.__setattr__(self, "_static", (graph, W))

    def graph(self, t: int) -> nx.Graph:
        """G_t, the communication graph of iteration t >= 0."""
        if self._static is not None:
            _check_int("t", t, 0)
            return self._static[0].copy()
        return graph_for_iteration(
            self.topology, self.num_nodes, t, self.base_seed, True, **self.params
        )

    def mixing_matrix(self, t: int) -> np.ndarray:
        """W_t = metropolis_weights(G_t), the (K, K) mixing matrix of iteration t >= 0."""
        if self._static is not None:
            _check_int("t", t, 0)
            return self._static[1].copy()
        return metropolis_weights(self.graph(t))
