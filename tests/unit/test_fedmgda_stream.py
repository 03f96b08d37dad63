"""The FedMGDA+ step built as replies arrive: against a float64 batch computation, and the
streaming message loop (``FairStrategy.communicate_stream``) on a scripted grid."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from flowerdro.core.mgda import min_norm_weights
from flowerdro.core.mgda_step import (
    GRAM_BLOCK,
    StreamingServerStep,
    clip_negative_eigenvalues,
    fedmgda_server_step,
)
from flowerdro.experiments.inprocess import LocalGrid, ensure_task_identity
from flowerdro.strategies.arrays import array_view, record_bytes
from flowerdro.strategies.base import FairStrategy
from flowerdro.strategies.fedmgda import FedMGDA

SHAPES = [(200, 300), (10_000,), (7,)]  # 70 007 floats: more than one column block of the Gram products


def _model(rng: np.random.Generator, dtype=np.float32) -> list[np.ndarray]:
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES] + [np.array(5, dtype=np.int64)]


def _locals(rng: np.random.Generator, w: list[np.ndarray], m: int) -> list[list[np.ndarray]]:
    # updates of very different norms, some nearly parallel (a realistic, ill-conditioned G)
    base = [rng.standard_normal(a.shape) for a in w[:-1]]
    out = []
    for i in range(m):
        scale = 10.0 ** rng.uniform(-3, 1)
        mix = 0.9 if i % 3 == 0 else 0.0
        g = [scale * (mix * b + (1 - mix) * rng.standard_normal(a.shape)) for a, b in zip(w[:-1], base, strict=True)]
        out.append([(a - u).astype(a.dtype) for a, u in zip(w[:-1], g, strict=True)] + [np.array(i, np.int64)])
    return out


def _reference(w, locs, eps, normalize=True, eta=0.7):
    """The whole step in float64 numpy, computed from scratch (no code shared with the stream)."""
    X = np.stack([np.concatenate([(np.float64(a) - b).ravel() for a, b in zip(w[:-1], loc[:-1], strict=True)])
                  for loc in locs])
    norms = np.linalg.norm(X, axis=1)
    U = X / norms[:, None] if normalize else X
    G = U @ U.T
    lam = min_norm_weights(G, eps=eps)
    new = np.concatenate([a.ravel() for a in w[:-1]]).astype(np.float64) - eta * (lam @ U)
    return X @ X.T, norms, lam, new


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([a.ravel().astype(np.float64) for a in arrays[:-1]])


def _objective_bound(G: np.ndarray, lam: np.ndarray, eps, Gpert: np.ndarray) -> tuple[float, float]:
    """(f(λ) − f*, its bound) on the float64 Gram G = UUᵀ for a λ that minimises a perturbed Gpert.

    If λ minimises λᵀ(G + δ)λ over the feasible set P (a subset of the simplex), then for the
    true minimiser λ*: f(λ) − f(λ*) ≤ λᵀδλ − λ*ᵀδλ* ≤ 2·max|δ_ij| (|xᵀδx| ≤ max|δ_ij| on the
    simplex). The QP's own accuracy (1e-8 + 1e-7·f, the min_norm_weights contract) is added.
    """
    ref = min_norm_weights(G, eps=eps)
    f, f_ref = float(lam @ G @ lam), float(ref @ G @ ref)
    return f - f_ref, 2.0 * float(np.abs(Gpert - G).max()) + 2 * (1e-8 + 1e-7 * f_ref)


@pytest.mark.parametrize("eps,normalize", [(0.1, True), (1.0, True), (None, False), (0.0, True)])
def test_streamed_step_matches_float64_batch_computation(eps, normalize):
    # Prepare
    rng = np.random.default_rng(11)
    w = _model(rng)
    locs = _locals(rng, w, 12)
    G64, norms64, lam64, new64 = _reference(w, locs, eps, normalize)
    # Execute: replies arrive one by one, then in uneven blocks (3, 1, 5, 3)
    one = StreamingServerStep(w, 12, normalize=normalize)
    for loc in locs:
        one.add([loc])
    blocks = StreamingServerStep(w, 12, normalize=normalize)
    for a, b in ((0, 3), (3, 4), (4, 9), (9, 12)):
        blocks.add(locs[a:b])
    assert GRAM_BLOCK < w[0].size + w[1].size  # the products really run over several column blocks
    step1 = one.finish(eps=eps, global_lr=0.7)
    step2 = blocks.finish(eps=eps, global_lr=0.7)
    batch = fedmgda_server_step(w, locs, eps=eps, global_lr=0.7, normalize=normalize)
    # Assert: the Gram products. Storing g_i in float32 rounds each entry by u = 6e-8
    # (relative), so |δG_ij| ≤ 2u‖g_i‖‖g_j‖ (Cauchy-Schwarz); each column block's product sums
    # n = 2¹⁶ float32 terms, whose rounding error is below λ√n·u·‖g_i‖‖g_j‖ with high
    # probability whatever the summation order (Higham & Mary 2019, λ = 3; a BLAS's blocked
    # and multi-lane sums do better), and the float64 sum over blocks adds nothing visible.
    u = 2.0**-24
    tol = (2 * u + 3 * np.sqrt(GRAM_BLOCK) * u) * np.outer(norms64, norms64)
    for s in (one, blocks):
        assert np.all(np.abs(s.gram - G64) <= tol)
        np.testing.assert_array_equal(s.gram, s.gram.T)
    # The weights: λ is not a stable function of G (a perturbation δ of G moves the minimiser
    # by up to ‖δ‖ / (smallest curvature on the optimal face), unbounded for nearly parallel
    # updates), so each step's λ is checked by its objective on the float64 Gram, whose error
    # is bounded by the size of the Gram perturbation alone (see _objective_bound). Then the
    # direction d = Σλ_i ĝ_i, the min-norm point of a convex set, is stable:
    # ‖d − d*‖² ≤ ‖d‖² − ‖d*‖² = f(λ) − f*, so the model moves by η‖d − d*‖ ≤ η√(f − f*) at most,
    # plus the float32 rounding of the new model.
    scale = 1.0 / norms64 if normalize else np.ones(12)
    U64 = G64 * np.outer(scale, scale)
    for s, step in ((one, step1), (blocks, step2), (one, batch)):
        # ‖g_i‖ = √G_ii: half the relative error of G_ii above
        np.testing.assert_allclose(step.norms, norms64, rtol=0.5 * (2 * u + 3 * np.sqrt(GRAM_BLOCK) * u))
        Gs = clip_negative_eigenvalues(s.gram)  # the Gram the step solved with
        Gs = Gs * np.outer(1.0 / step.norms, 1.0 / step.norms) if normalize else Gs
        gap, bound = _objective_bound(U64, step.lam, eps, Gs)
        assert gap <= bound, (gap, bound)
        # float32: the stored model, the product Xᵀc and the weights c each round by u
        move = 0.7 * np.sqrt(bound) + 3 * u * np.linalg.norm(new64)
        assert np.linalg.norm(_flat(step.arrays) - new64) <= move
        assert step.arrays[0].dtype == np.float32 and step.arrays[-1].dtype == np.int64
        assert int(step.arrays[-1]) == int(np.rint(step.lam @ np.arange(12)))
    if eps == 0.0:  # the box is a point: λ = λ₀ exactly, whatever the Gram
        for step in (step1, step2, batch):
            np.testing.assert_array_equal(step.lam, np.full(12, 1 / 12))


def test_float64_model_stream_is_exact_to_float64_rounding():
    rng = np.random.default_rng(2)
    w = _model(rng, np.float64)
    locs = _locals(rng, w, 6)
    G64, norms64, lam64, new64 = _reference(w, locs, 0.3)
    s = StreamingServerStep(w, 8)
    for loc in locs:
        s.add([loc])
    step = s.finish(eps=0.3, global_lr=0.7)
    assert s.precision == "float64"
    # float64 throughout: the Gram differs from the reference by summation order only,
    # ≈ √d·1e-16 relative (d = 70 007); 1e-12 leaves a margin of 40, and 1e-9 on λ a factor
    # 1e3 for the conditioning of the optimal face
    np.testing.assert_allclose(s.gram, G64, rtol=1e-12, atol=1e-12 * np.diag(G64).max())
    np.testing.assert_allclose(step.lam, lam64, atol=1e-9)
    np.testing.assert_allclose(_flat(step.arrays), new64, atol=1e-10)


def test_stream_of_zero_updates_gives_lambda0_and_no_nan():
    rng = np.random.default_rng(3)
    w = _model(rng)
    s = StreamingServerStep(w, 3)
    for _ in range(3):
        s.add([[a.copy() for a in w]])
    step = s.finish(eps=0.2, global_lr=1.0, center=np.array([0.2, 0.3, 0.5]))
    # equal rows make the QP flat: the solver returns the center up to float64 rounding (≈1e-16)
    np.testing.assert_allclose(step.lam, [0.2, 0.3, 0.5], atol=1e-12)
    np.testing.assert_array_equal(_flat(step.arrays), _flat(w))
    assert step.direction_norm == 0.0 and np.all(step.norms == 0.0)


def test_stream_errors_name_the_parameter_and_add_nothing():
    rng = np.random.default_rng(4)
    w = _model(rng)
    locs = _locals(rng, w, 3)
    with pytest.raises(ValueError, match="^capacity:"):
        StreamingServerStep(w, 0)
    with pytest.raises(ValueError, match="^gram_precision:"):
        StreamingServerStep(w, 2, gram_precision="half")
    s = StreamingServerStep(w, 2)
    with pytest.raises(ValueError, match="^local_arrays: at least one"):
        s.finish(eps=0.1, global_lr=1.0)
    bad = [a.reshape(-1) if k == 0 else a for k, a in enumerate(locs[0])]
    with pytest.raises(ValueError, match=r"^local_arrays: array 0 of participant 0 has shape"):
        s.add([bad])
    with pytest.raises(ValueError, match="^local_arrays: participant 0 has 2 arrays"):
        s.add([locs[0][:2]])
    assert s.count == 0
    s.add([locs[0]])
    with pytest.raises(ValueError, match="^local_arrays: 3 participants exceed the capacity 2"):
        s.add(locs[1:3])
    nan = [a.copy() for a in locs[1]]
    nan[1][3] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        s.add([nan])
    assert s.count == 1


# --------------------------------------------------------------------------- communicate_stream
def _arrays(v: float, n: int = 3) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.full(n, v, dtype=np.float64))})


class PullScriptGrid(LocalGrid):
    """Nodes 1..k; ``schedule[p]`` lists what the p-th pull returns: (node, kind) with kind
    ``ok``, ``error``, ``nan``, ``shape``, ``nan-metric`` or ``again`` (a second reply)."""

    def __init__(self, num_nodes: int, schedule: list[list[tuple[int, str]]], unpushable: Iterable[int] = ()):
        ensure_task_identity()
        self.node_ids = list(range(1, num_nodes + 1))
        self.schedule, self.unpushable = list(schedule), set(unpushable)
        self.sent: dict[int, Message] = {}
        self.pulls: list[int] = []  # replies returned per pull

    def push_messages(self, messages):  # noqa: D102
        out = []
        for msg in messages:
            nid = int(msg.metadata.dst_node_id)
            msg.metadata._message_id = f"x{nid}"
            self.sent[nid] = msg
            out.append(None if nid in self.unpushable else f"x{nid}")
        return out

    def pull_messages(self, message_ids):  # noqa: D102
        wanted = set(message_ids)
        step = self.schedule.pop(0) if self.schedule else []
        out = []
        for nid, kind in step:
            msg = self.sent[nid]
            if kind != "again" and msg.metadata.message_id not in wanted:
                continue
            out.append(self._reply(msg, nid, kind))
        self.pulls.append(len(out))
        return out

    def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
        raise AssertionError("the streaming loop must not call send_and_receive")

    @staticmethod
    def _reply(msg: Message, nid: int, kind: str) -> Message:
        if kind == "error":
            return Message(error=Error(code=1, reason="client crashed"), reply_to=msg)
        arrays = {"nan": _arrays(np.nan), "shape": _arrays(1.0, 4)}.get(kind, _arrays(float(nid)))
        v = float("nan") if kind == "nan-metric" else 0.5
        metrics = MetricRecord({"num-examples": 10, "partition-id": nid - 1, "train_loss": v})
        return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


def _messages(grid: PullScriptGrid) -> list[Message]:
    content = RecordDict({"arrays": _arrays(0.0)})
    return FairStrategy.build_messages(grid.node_ids, content, "train.sgd")


def test_communicate_stream_hands_over_each_pull_and_drops_bad_replies():
    # Prepare: 8 nodes; pull 1 brings node 1, pull 2 nothing, pull 3 nodes 2 (error) and 3,
    # pull 4 node 4 with NaN arrays, node 5 with a wrong shape, node 3 again, pull 5 node 6
    # with a NaN metric; node 7 never answers, node 8 cannot be pushed.
    schedule = [[(1, "ok")], [], [(2, "error"), (3, "ok")], [(4, "nan"), (5, "shape"), (3, "again")],
                [(6, "nan-metric")]]
    grid = PullScriptGrid(8, schedule, unpushable=[8])
    s = FairStrategy()
    s.comm.transport.timeout, s.comm.transport.pull_interval = 0.4, 0.01
    batches: list[list[int]] = []
    # Execute
    t0 = time.monotonic()
    valid = s.communicate_stream(grid, _messages(grid), lambda b: batches.append(
        [int(r.metadata.src_node_id) for r in b]), phase="train", reference=_arrays(0.0),
        required_metrics=("train_loss",))
    waited = time.monotonic() - t0
    # Assert: valid replies in arrival order, one on_replies call per pull that brought one
    assert [int(r.metadata.src_node_id) for r in valid] == [1, 3]
    assert batches == [[1], [3]]
    kinds = {(f.node_id, f.kind) for f in s.failures}
    assert kinds == {(8, "error"), (2, "error"), (4, "nonfinite"), (5, "bad-arrays"), (6, "nonfinite"),
                     (7, "timeout")}
    assert all(f.phase == "train" for f in s.failures)
    assert 0.4 <= waited < 3.0  # waited for node 7 until the round timeout, not longer
    # as in communicate: every message counts as sent, every reply that is not an error as received
    assert s.comm.transport.traffic.bytes_sent == 8 * record_bytes(_messages(grid)[0].content)
    received = [_arrays(1.0), _arrays(3.0), _arrays(np.nan), _arrays(1.0, 4), _arrays(6.0)]
    assert s.comm.transport.traffic.bytes_received == sum(record_bytes(RecordDict({"a": a})) for a in received)


def test_communicate_stream_stops_pulling_when_everyone_answered():
    grid = PullScriptGrid(3, [[(2, "ok")], [(1, "ok"), (3, "ok")], [(1, "again")]])
    s = FairStrategy()
    s.comm.transport.pull_interval = 0.01
    batches = []
    valid = s.communicate_stream(grid, _messages(grid), batches.append, phase="train")
    assert [len(b) for b in batches] == [1, 2] and len(valid) == 3
    assert grid.pulls == [1, 2]  # no third pull
    assert s.failures == []


def test_communicate_stream_falls_back_to_send_and_receive():
    class OldGrid(PullScriptGrid):
        def push_messages(self, messages):  # noqa: D102
            raise NotImplementedError

        def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
            out = []
            for m in messages:
                m.metadata._message_id = f"y{m.metadata.dst_node_id}"
                out.append(self._reply(m, int(m.metadata.dst_node_id), "ok"))
            return out[1:]  # node 1 never answers

    grid = OldGrid(3, [])
    s = FairStrategy()
    batches = []
    valid = s.communicate_stream(grid, _messages(grid), batches.append, phase="train")
    assert [len(b) for b in batches] == [2] and len(valid) == 2
    assert [(f.node_id, f.kind) for f in s.failures] == [(1, "timeout")]


def test_fedmgda_streamed_round_on_scripted_grid_equals_batch_aggregation():
    # Prepare: 4 nodes answer one per pull, node 3 with an error
    schedule = [[(2, "ok")], [(3, "error")], [(1, "ok")], [(4, "ok")]]
    grid = PullScriptGrid(4, schedule)
    s = FedMGDA(eps=0.5, global_lr=0.4)
    s.comm.transport.pull_interval = 0.01
    arrays = ArrayRecord({"w": Array(np.array([0.0, 0.0, 1.0]))})
    # Execute
    new, metrics = s.train_round(1, grid, arrays, ConfigRecord({"lr": 0.1}))
    # Assert: updates g_i = -(i, i, i-1) from nodes 2, 1, 4 (node i replies w = i·1)
    assert set(s.round_extras()["lambda"]) == {"0", "1", "3"}
    assert s.failures[0].kind == "error" and s.failures[0].node_id == 3
    assert s.round_extras()["server_step_s"] >= 0.0
    replies = [PullScriptGrid._reply(grid.sent[n], n, "ok") for n in (2, 1, 4)]
    b = FedMGDA(eps=0.5, global_lr=0.4)
    b.current_arrays = arrays
    ref, _ = b.aggregate_train(1, replies)
    # streamed and in-memory steps: float64 on O(1) values, a few ulps apart at most (1e-15 ≈ 4 ulps
    # of 1)
    np.testing.assert_allclose(new["w"].numpy(), ref["w"].numpy(), atol=1e-15)
    # and by hand: ĝ_i = g_i/‖g_i‖, λ from the exact QP
    X = np.stack([np.array([0.0, 0.0, 1.0]) - n for n in (2.0, 1.0, 4.0)])
    U = X / np.linalg.norm(X, axis=1, keepdims=True)
    lam = min_norm_weights(U @ U.T, eps=0.5)
    # a 3-client QP and step in float64 on O(1) values: rounding ≈ 1e-16·cond; 1e-12 leaves margin
    np.testing.assert_allclose(new["w"].numpy(), [0.0, 0.0, 1.0] - 0.4 * lam @ U, atol=1e-12)
    assert metrics["lambda_max"] == pytest.approx(lam.max(), abs=1e-12)


@pytest.mark.parametrize("value", [
    np.arange(12, dtype=np.float32).reshape(3, 4), np.array(2.5), np.zeros((0, 3), np.float16),
    np.array([1, -2, 3], dtype=">i8"), np.array([True, False]), np.arange(6.0).reshape(2, 3).T,  # Fortran order
    np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
])
def test_array_view_equals_array_numpy(value):
    arr = Array(value)
    view, ref = array_view(arr), arr.numpy()
    assert view.dtype == ref.dtype and view.shape == ref.shape
    np.testing.assert_array_equal(view, ref)
    np.testing.assert_array_equal(view, value)


def test_eigenvalue_clip_keeps_positive_definite_and_clips_indefinite_gram():
    rng = np.random.default_rng(3)
    A = rng.standard_normal((6, 9))
    G = A @ A.T  # positive definite: returned unchanged (the Cholesky shortcut)
    assert clip_negative_eigenvalues(G) is G
    B = rng.standard_normal((6, 3))
    low = B @ B.T  # rank 3, PSD
    V = np.linalg.qr(rng.standard_normal((6, 6)))[0]
    bad = low - 1e-9 * np.outer(V[:, 0], V[:, 0])  # a rounding-size negative direction
    out = clip_negative_eigenvalues(bad)
    np.testing.assert_allclose(out, out.T, atol=0)
    assert np.linalg.eigvalsh(out).min() >= -1e-12
    # the clip is V max(Λ, 0) Vᵀ, computed here another way
    w, U = np.linalg.eigh(bad)
    np.testing.assert_allclose(out, (U * np.clip(w, 0, None)) @ U.T, atol=1e-12)
