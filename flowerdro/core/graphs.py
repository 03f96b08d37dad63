"""Communication graphs of decentralised learning, one per iteration.

Used by DR-DSGD / DSGD (Ben Issaid, Elgabli and Bennis, "DR-DSGD: A Distributionally
Robust Decentralized Learning Algorithm over Graphs", TMLR 2022,
https://openreview.net/forum?id=VcXNAr5Rur). The K devices gossip over an undirected,
connected graph G_t = (V, E_t) (the mixing itself is in :mod:`flowerdro.core.gossip`).
:func:`make_graph` builds the paper's topologies (Erdős–Rényi, ring, grid, random
geometric, complete); Remark 4 of the paper allows a fresh random graph at every
iteration, and :func:`graph_for_iteration` and :class:`GraphSchedule` produce such a
sequence deterministically from a seed, so W_t is a pure function of (seed, t).

Nodes are always labelled ``0 .. K-1`` so that node ``i`` is row ``i`` of W.

Framework-free (networkx + numpy); never imports flwr or torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from flowerdro.core.gossip import _check_real, metropolis_weights

__all__ = [
    "TOPOLOGIES",
    "GraphSchedule",
    "graph_for_iteration",
    "make_graph",
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


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


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
    """The rows × cols lattice, node (r, c) labelled r·cols + c."""
    lattice = nx.grid_2d_graph(rows, cols)
    return nx.relabel_nodes(lattice, {(r, c): r * cols + c for r, c in lattice.nodes})


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
