"""Tests for flowerdro.core.graphs and flowerdro.core.gossip: topologies, Metropolis weights, ρ, mixing."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest

from flowerdro.core.gossip import (
    average_models,
    consensus_distance,
    edges_used,
    metropolis_weights,
    mix,
    spectral_gap_rho,
)
from flowerdro.core.graphs import TOPOLOGIES, GraphSchedule, graph_for_iteration, make_graph

# (topology, K, kwargs) covering every topology and several K.
CASES = [
    ("ring", 3, {}),
    ("ring", 8, {}),
    ("ring", 25, {}),
    ("complete", 2, {}),
    ("complete", 7, {}),
    ("grid", 4, {}),
    ("grid", 12, {}),
    ("grid", 30, {}),
    ("erdos_renyi", 5, {"p": 0.6, "seed": 0}),
    ("erdos_renyi", 20, {"p": 0.3, "seed": 1}),
    ("erdos_renyi", 40, {"p": 0.15, "seed": 2}),
    ("geometric", 5, {"radius": 0.8, "seed": 3}),
    ("geometric", 20, {"radius": 0.45, "seed": 4}),
    ("geometric", 40, {"radius": 0.35, "seed": 5}),
]


def _independent_metropolis(graph: nx.Graph) -> np.ndarray:
    """Vectorised Metropolis weights from the adjacency matrix (independent of the code)."""
    K = graph.number_of_nodes()
    A = nx.to_numpy_array(graph, nodelist=range(K))
    d = A.sum(axis=1)
    W = A / (1.0 + np.maximum(d[:, None], d[None, :]))
    return W + np.diag(1.0 - W.sum(axis=1))


def _rho_by_eig(W: np.ndarray) -> float:
    K = W.shape[0]
    return float(np.max(np.abs(np.linalg.eigvalsh(W.T @ W - np.ones((K, K)) / K))))


# ----------------------------------------------------------------------------------------
# make_graph + metropolis_weights + spectral_gap_rho on every topology
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("topology", "K", "kw"), CASES)
def test_topologies_give_doubly_stochastic_w_with_rho_below_one(topology, K, kw):
    # Prepare
    graph = make_graph(topology, K, **kw)
    # Execute
    W = metropolis_weights(graph)
    rho = spectral_gap_rho(W)
    # Assert
    assert nx.is_connected(graph)
    assert sorted(graph.nodes) == list(range(K))
    assert W.shape == (K, K)
    np.testing.assert_allclose(W, W.T, atol=0)
    # float64 sums of ≤ 40 Metropolis weights ≤ 1: within K·eps ≈ 1e-14 of 1; 1e-12 leaves margin
    np.testing.assert_allclose(W.sum(axis=1), np.ones(K), atol=1e-12)
    np.testing.assert_allclose(W.sum(axis=0), np.ones(K), atol=1e-12)
    assert np.all(W >= 0)
    # each entry one float64 division (the diagonal 1 − Σ in the same order): ≤ a few ulps of values
    # ≤ 1
    np.testing.assert_allclose(W, _independent_metropolis(graph), atol=1e-15)
    # support of W = edges + diagonal
    A = nx.to_numpy_array(graph, nodelist=range(K)) > 0
    assert np.array_equal((W > 0) & ~np.eye(K, dtype=bool), A)
    assert edges_used(W) == graph.number_of_edges()
    # ρ against an independent eigen-decomposition, and ρ < 1
    assert rho == pytest.approx(_rho_by_eig(W), abs=1e-12)
    # for symmetric W: ρ = max over non-unit eigenvalues of λ², i.e. max(λ_2², λ_K²)
    lam = np.sort(np.linalg.eigvalsh(W))
    assert rho == pytest.approx(max(lam[-2] ** 2, lam[0] ** 2), abs=1e-12)
    assert rho < 1.0 - 1e-9


@pytest.mark.parametrize("K", [3, 4, 7, 12])
def test_ring_rho_matches_circulant_closed_form(K):
    # Metropolis on a ring: every weight 1/3, eigenvalues 1/3 + (2/3) cos(2πk/K).
    W = metropolis_weights(make_graph("ring", K))
    lam = [1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / K) for k in range(1, K)]
    expected = max(x * x for x in lam)
    assert spectral_gap_rho(W) == pytest.approx(expected, abs=1e-12)


def test_metropolis_path_of_three_by_hand():
    # degrees 1, 2, 1: W_01 = W_12 = 1/(1+2) = 1/3
    W = metropolis_weights(nx.path_graph(3))
    expected = np.array(
        [
            [2 / 3, 1 / 3, 0.0],
            [1 / 3, 1 / 3, 1 / 3],
            [0.0, 1 / 3, 2 / 3],
        ]
    )
    # hand fractions vs float64 divisions and 1 − Σ: a few ulps of values ≤ 1 (1.1e-16 each)
    np.testing.assert_allclose(W, expected, atol=1e-15)
    # eigenvalues of this W are 1, 2/3, 0 -> rho = (2/3)^2
    assert spectral_gap_rho(W) == pytest.approx(4 / 9, abs=1e-12)


def test_metropolis_star_by_hand():
    # centre 0 of degree 3, leaves of degree 1: W_0j = 1/(1+3) = 1/4
    W = metropolis_weights(nx.star_graph(3))
    expected = np.array(
        [
            [1 / 4, 1 / 4, 1 / 4, 1 / 4],
            [1 / 4, 3 / 4, 0.0, 0.0],
            [1 / 4, 0.0, 3 / 4, 0.0],
            [1 / 4, 0.0, 0.0, 3 / 4],
        ]
    )
    # hand fractions vs float64 divisions and 1 − Σ: a few ulps of values ≤ 1 (1.1e-16 each)
    np.testing.assert_allclose(W, expected, atol=1e-15)
    # eigenvalues: 1, 3/4 (twice), 0 -> rho = 9/16
    assert spectral_gap_rho(W) == pytest.approx(9 / 16, abs=1e-12)


def test_metropolis_single_node_and_self_loops_ignored():
    np.testing.assert_array_equal(metropolis_weights(nx.empty_graph(1)), [[1.0]])
    g = nx.path_graph(3)
    g.add_edge(1, 1)
    # the self-loop is ignored: the same float64 arithmetic; default rtol 1e-7 is ample
    np.testing.assert_allclose(metropolis_weights(g), metropolis_weights(nx.path_graph(3)))


def test_metropolis_rejects_bad_labels_and_directed():
    with pytest.raises(ValueError, match="0..5"):
        metropolis_weights(nx.grid_2d_graph(2, 3))
    with pytest.raises(ValueError, match="0..2"):
        metropolis_weights(nx.relabel_nodes(nx.path_graph(3), {0: 5}))
    with pytest.raises(ValueError, match="undirected"):
        metropolis_weights(nx.DiGraph([(0, 1)]))
    with pytest.raises(ValueError, match="at least one node"):
        metropolis_weights(nx.Graph())


def test_complete_graph_w_is_exact_average_and_rho_zero():
    K = 6
    W = metropolis_weights(make_graph("complete", K))
    # 1/K by one division (few ulps); eigenvalues of a 6×6 float64 matrix of norm 1: ≈ K·eps ≈ 1e-15
    np.testing.assert_allclose(W, np.full((K, K), 1 / K), atol=1e-15)
    assert spectral_gap_rho(W) == pytest.approx(0.0, abs=1e-14)


def test_disconnected_w_has_rho_one():
    g = nx.Graph([(0, 1), (2, 3)])
    # ρ is 1 exactly; the float64 eigen-solver error is ≈ K·eps ≪ 1e-12
    assert spectral_gap_rho(metropolis_weights(g)) == pytest.approx(1.0, abs=1e-12)


# ----------------------------------------------------------------------------------------
# specific topologies
# ----------------------------------------------------------------------------------------
def test_erdos_renyi_repeatable_and_seed_dependent():
    g1 = make_graph("erdos_renyi", 20, p=0.3, seed=7)
    g2 = make_graph("erdos_renyi", 20, p=0.3, seed=7)
    g3 = make_graph("erdos_renyi", 20, p=0.3, seed=8)
    assert sorted(g1.edges) == sorted(g2.edges)
    assert sorted(g1.edges) != sorted(g3.edges)
    gen = make_graph("erdos_renyi", 20, p=0.3, seed=np.random.default_rng(7))
    assert sorted(gen.edges) == sorted(g1.edges)


def test_erdos_renyi_edge_density_close_to_p():
    K, p = 60, 0.3
    g = make_graph("erdos_renyi", K, p=p, seed=11)
    n_pairs = K * (K - 1) / 2
    mean, std = p * n_pairs, math.sqrt(n_pairs * p * (1 - p))
    # fixed seed; a 5σ binomial bound (a failure under another seed has probability < 1e-6)
    assert abs(g.number_of_edges() - mean) < 5 * std


def test_erdos_renyi_p_one_is_complete():
    g = make_graph("erdos_renyi", 6, p=1.0, seed=0)
    assert g.number_of_edges() == 15


def test_ring_structure():
    g = make_graph("ring", 6)
    assert all(d == 2 for _, d in g.degree)
    assert g.has_edge(0, 5) and g.has_edge(2, 3)


@pytest.mark.parametrize(
    ("K", "rows", "shape"),
    [
        (4, None, (2, 2)),
        (12, None, (3, 4)),
        (16, None, (4, 4)),
        (18, None, (3, 6)),
        (12, 2, (2, 6)),
    ],
)
def test_grid_factorisation_and_labels(K, rows, shape):
    g = make_graph("grid", K, rows=rows)
    r, c = shape
    assert (g.graph["rows"], g.graph["cols"]) == (r, c)
    assert nx.is_isomorphic(g, nx.grid_2d_graph(r, c))
    assert g.number_of_edges() == r * (c - 1) + c * (r - 1)
    # node (i, j) is labelled i*c + j
    assert g.has_edge(0, 1) and g.has_edge(0, c) and not g.has_edge(c - 1, c)


def test_geometric_edges_follow_radius_and_repeatable():
    radius = 0.4
    g = make_graph("geometric", 25, radius=radius, seed=3)
    pos = np.array([g.nodes[i]["pos"] for i in range(25)])
    for i in range(25):
        for j in range(i + 1, 25):
            dist = float(np.linalg.norm(pos[i] - pos[j]))
            assert g.has_edge(i, j) == (dist <= radius)
    g2 = make_graph("geometric", 25, radius=radius, seed=3)
    assert sorted(g.edges) == sorted(g2.edges)


# ----------------------------------------------------------------------------------------
# make_graph errors
# ----------------------------------------------------------------------------------------
def test_unknown_topology_lists_allowed_names():
    with pytest.raises(ValueError, match="topology must be one of") as info:
        make_graph("torus", 5)
    for name in TOPOLOGIES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("topology", "K", "kw"),
    [
        ("ring", 2, {}),
        ("complete", 1, {}),
        ("grid", 3, {}),
        ("erdos_renyi", 1, {"p": 0.5}),
        ("geometric", 1, {"radius": 0.5}),
    ],
)
def test_too_few_nodes(topology, K, kw):
    with pytest.raises(ValueError, match="num_nodes must be >="):
        make_graph(topology, K, **kw)


@pytest.mark.parametrize("K", [5, 7, 13])
def test_grid_prime_rejected(K):
    with pytest.raises(ValueError, match="prime"):
        make_graph("grid", K)


@pytest.mark.parametrize("rows", [3, 1, 8])
def test_grid_bad_rows(rows):
    with pytest.raises(ValueError, match="rows"):
        make_graph("grid", 8, rows=rows)


@pytest.mark.parametrize("p", [0.0, -0.1, 1.5, float("nan"), None, "0.5"])
def test_bad_p(p):
    with pytest.raises(ValueError, match="p "):
        make_graph("erdos_renyi", 10, p=p, seed=0)


@pytest.mark.parametrize("radius", [0.0, -1.0, 1.5, float("inf"), None])
def test_bad_radius(radius):
    with pytest.raises(ValueError, match="radius"):
        make_graph("geometric", 10, radius=radius, seed=0)


def test_disconnected_erdos_renyi_names_p_and_k():
    with pytest.raises(ValueError, match=r"p=0\.01.*50.*disconnected"):
        make_graph("erdos_renyi", 50, p=0.01, seed=0, max_tries=5)


def test_disconnected_geometric_names_radius():
    with pytest.raises(ValueError, match=r"radius=0\.01.*disconnected"):
        make_graph("geometric", 30, radius=0.01, seed=0, max_tries=5)


def test_parameter_of_other_topology_and_bad_counts_rejected():
    with pytest.raises(ValueError, match="p is not a parameter of topology 'ring'"):
        make_graph("ring", 5, p=0.3)
    with pytest.raises(ValueError, match="radius is not a parameter"):
        make_graph("erdos_renyi", 5, p=0.3, radius=0.2)
    with pytest.raises(ValueError, match="max_tries"):
        make_graph("erdos_renyi", 5, p=0.3, max_tries=0)
    with pytest.raises(ValueError, match="num_nodes"):
        make_graph("ring", 5.0)


# ----------------------------------------------------------------------------------------
# spectral_gap_rho / edges_used inputs
# ----------------------------------------------------------------------------------------
def test_rho_of_stack_is_norm_of_mean_gram():
    rng = np.random.default_rng(0)
    Ws = np.stack(
        [metropolis_weights(make_graph("erdos_renyi", 8, p=0.4, seed=rng)) for _ in range(5)]
    )
    mean_gram = sum(W.T @ W for W in Ws) / 5
    expected = float(np.max(np.abs(np.linalg.eigvalsh(mean_gram - np.full((8, 8), 1 / 8)))))
    # two float64 eigen-solves of the same 8×8 matrix of norm ≤ 1: ≈ K·eps ≪ 1e-12
    assert spectral_gap_rho(Ws) == pytest.approx(expected, abs=1e-12)


def test_rho_and_edges_reject_bad_w():
    with pytest.raises(ValueError, match="W must"):
        spectral_gap_rho(np.ones((2, 3)))
    with pytest.raises(ValueError, match="W must"):
        spectral_gap_rho(np.ones(3))
    with pytest.raises(ValueError, match="finite"):
        spectral_gap_rho(np.array([[np.nan, 0.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="W must"):
        edges_used(np.ones((2, 3)))
    with pytest.raises(ValueError, match="atol"):
        edges_used(np.eye(2), atol=-1.0)


def test_edges_used_by_hand():
    W = np.array(
        [
            [0.5, 0.5, 0.0, 0.0],
            [0.5, 0.25, 0.25, 0.0],
            [0.0, 0.25, 0.75, 1e-9],
            [0.0, 0.0, 0.0, 1.0],  # asymmetric tiny entry at (2, 3) still counts once
        ]
    )
    assert edges_used(W) == 3
    assert edges_used(W, atol=1e-6) == 2


# ----------------------------------------------------------------------------------------
# mix and consensus_distance
# ----------------------------------------------------------------------------------------
def test_mix_path_of_three_by_hand():
    W = metropolis_weights(nx.path_graph(3))
    out = mix(np.array([[0.0], [3.0], [6.0]]), W)
    # row 0: 2/3*0 + 1/3*3 = 1; row 1: (0+3+6)/3 = 3; row 2: 1/3*3 + 2/3*6 = 5
    np.testing.assert_allclose(out, [[1.0], [3.0], [5.0]], atol=1e-14)


@pytest.mark.parametrize(("topology", "K", "kw"), CASES)
def test_mix_preserves_sum(topology, K, kw):
    rng = np.random.default_rng(K)
    W = metropolis_weights(make_graph(topology, K, **kw))
    theta = rng.normal(size=(K, 7))
    mixed = mix(theta, W)
    # W doubly stochastic preserves column sums; K-term float64 sums of O(1) values: ≈ K·eps ≪ 1e-12
    np.testing.assert_allclose(mixed.sum(axis=0), theta.sum(axis=0), atol=1e-12)


def test_mix_complete_graph_is_exact_average_layered():
    K = 5
    rng = np.random.default_rng(1)
    W = metropolis_weights(make_graph("complete", K))
    models = [[rng.normal(size=(3, 2)), rng.normal(size=4)] for _ in range(K)]
    out = mix(models, W)
    avg0 = np.mean([m[0] for m in models], axis=0)
    avg1 = np.mean([m[1] for m in models], axis=0)
    assert len(out) == K
    for node in out:
        assert len(node) == 2
        # each node gets the float64 mean of K = 5 rows: ≈ K·eps ≈ 1e-15; squared row differences ≪
        # 1e-25
        np.testing.assert_allclose(node[0], avg0, atol=1e-14)
        np.testing.assert_allclose(node[1], avg1, atol=1e-14)
    assert consensus_distance(out) == pytest.approx(0.0, abs=1e-25)


def test_mix_layered_equals_flat_and_keeps_dtype_and_input():
    K = 6
    rng = np.random.default_rng(2)
    W = metropolis_weights(make_graph("erdos_renyi", K, p=0.5, seed=2))
    models = [
        [
            rng.normal(size=(2, 3)).astype(np.float32),
            rng.normal(size=5),
            np.array(4, dtype=np.int64),
        ]
        for _ in range(K)
    ]
    copies = [[layer.copy() for layer in node] for node in models]
    out = mix(models, W)
    flat = np.stack([np.concatenate([node[0].ravel(), node[1].ravel()]) for node in models])
    expected = W @ flat.astype(np.float64)
    got = np.stack([np.concatenate([node[0].ravel(), node[1].ravel()]) for node in out])
    # float64 mixing, then one float32 rounding of values ≲ 4 (≤ 2.4e-7) for the float32 layer
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert out[0][0].dtype == np.float32 and out[0][0].shape == (2, 3)
    assert out[0][1].dtype == np.float64
    assert out[0][2].dtype == np.int64 and int(out[0][2]) == 4  # equal counters stay equal
    for node, copy in zip(models, copies, strict=True):
        for layer, layer_copy in zip(node, copy, strict=True):
            np.testing.assert_array_equal(layer, layer_copy)


def test_mix_contracts_consensus_distance_by_rho():
    # For doubly stochastic W: Ξ(WΘ) <= ρ Ξ(Θ) with ρ = ‖WᵀW − J‖₂.
    K = 12
    rng = np.random.default_rng(3)
    W = metropolis_weights(make_graph("ring", K))
    theta = rng.normal(size=(K, 10))
    rho = spectral_gap_rho(W)
    assert consensus_distance(mix(theta, W)) <= rho * consensus_distance(theta) + 1e-12


def test_mix_rejects_mismatched_inputs():
    W = np.full((3, 3), 1 / 3)
    with pytest.raises(ValueError, match="K=2"):
        mix(np.zeros((2, 4)), W)
    with pytest.raises(ValueError, match="K=2"):
        mix([[np.zeros(2)], [np.zeros(2)]], W)
    with pytest.raises(ValueError, match="shape"):
        mix([[np.zeros(2)], [np.zeros(3)], [np.zeros(2)]], W)
    with pytest.raises(ValueError, match="layers"):
        mix([[np.zeros(2)], [np.zeros(2), np.zeros(1)], [np.zeros(2)]], W)
    with pytest.raises(ValueError, match="W must"):
        mix(np.zeros((3, 2)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="models"):
        mix("abc", W)


def test_consensus_distance_by_hand():
    # mean = (1, 1); squared distances 2, 2, 4 -> Ξ = 8/3
    theta = np.array([[0.0, 0.0], [2.0, 0.0], [1.0, 3.0]])
    assert consensus_distance(theta) == pytest.approx(8 / 3, abs=1e-14)
    layered = [[row[:1].copy(), row[1:].copy()] for row in theta]
    assert consensus_distance(layered) == pytest.approx(8 / 3, abs=1e-14)
    assert consensus_distance(np.ones((4, 3))) == 0.0
    with pytest.raises(ValueError, match="K >= 1"):
        consensus_distance([])
    with pytest.raises(ValueError, match="finite"):
        consensus_distance(np.array([[np.inf], [0.0]]))


# ----------------------------------------------------------------------------------------
# a new graph per iteration (Remark 4)
# ----------------------------------------------------------------------------------------
def test_graph_for_iteration_deterministic_and_resampled():
    kw = {"p": 0.3}
    a = graph_for_iteration("erdos_renyi", 15, 4, 123, True, **kw)
    b = graph_for_iteration("erdos_renyi", 15, 4, 123, True, **kw)
    c = graph_for_iteration("erdos_renyi", 15, 5, 123, True, **kw)
    assert sorted(a.edges) == sorted(b.edges)
    assert sorted(a.edges) != sorted(c.edges)
    s1 = graph_for_iteration("erdos_renyi", 15, 1, 123, False, **kw)
    s9 = graph_for_iteration("erdos_renyi", 15, 9, 123, False, **kw)
    assert sorted(s1.edges) == sorted(s9.edges)
    assert sorted(s1.edges) == sorted(make_graph("erdos_renyi", 15, seed=123, **kw).edges)


def test_graph_schedule_matches_function_and_expected_rho():
    sched = GraphSchedule("geometric", 10, base_seed=9, resample=True, params={"radius": 0.6})
    for t in (0, 3):
        expected = metropolis_weights(graph_for_iteration("geometric", 10, t, 9, True, radius=0.6))
        np.testing.assert_array_equal(sched.mixing_matrix(t), expected)
    Ws = np.stack([sched.mixing_matrix(t) for t in range(10)])
    assert spectral_gap_rho(Ws) < 1.0
    static = GraphSchedule("ring", 5)
    np.testing.assert_array_equal(static.mixing_matrix(0), static.mixing_matrix(17))
    np.testing.assert_array_equal(static.mixing_matrix(0), metropolis_weights(nx.cycle_graph(5)))


def test_graph_for_iteration_errors():
    with pytest.raises(ValueError, match="t must"):
        graph_for_iteration("ring", 5, -1, 0, True)
    with pytest.raises(ValueError, match="base_seed"):
        graph_for_iteration("ring", 5, 0, -3, True)
    with pytest.raises(ValueError, match="use base_seed"):
        graph_for_iteration("erdos_renyi", 5, 0, 0, True, p=0.5, seed=1)
    with pytest.raises(ValueError, match="resample"):
        graph_for_iteration("ring", 5, 0, 0, "yes")
    with pytest.raises(ValueError, match="topology"):
        GraphSchedule("star", 5)


def test_average_models_is_the_layerwise_mean_in_each_layers_dtype():
    # two float32 nodes and an integer counter: mean (1, 3) and round((3 + 4) / 2) = round(3.5) = 4
    models = [
        [np.array([0.0, 2.0], dtype=np.float32), np.array(3, dtype=np.int64)],
        [np.array([2.0, 4.0], dtype=np.float32), np.array(4, dtype=np.int64)],
    ]
    avg = average_models(models)
    assert avg[0].dtype == np.float32 and avg[0].tolist() == [1.0, 3.0]
    assert avg[1].dtype == np.int64 and int(avg[1]) == 4
    # gossip with a doubly stochastic W leaves the average where it was
    W = metropolis_weights(nx.path_graph(2))
    np.testing.assert_array_equal(average_models(mix([m[:1] for m in models], W))[0], avg[0])
    with pytest.raises(ValueError, match="at least one node"):
        average_models([])
