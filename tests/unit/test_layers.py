"""Buffers (BatchNorm running statistics, integer counters) on the server: cast, averaged, kept apart.

Hand-worked numbers, Flower's own aggregation on the parameters as the reference for what
the wrappers leave to Flower, and the crash Flower's q-FedAvg hits on an int64 counter.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType
from flwr.serverapp.strategy import FedAvg, QFedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flowerdro.core.drfa import combine_models
from flowerdro.core.layers import cast_layer, mean_buffers, update_mask
from flowerdro.experiments.inprocess import ensure_task_identity
from flowerdro.strategies.arrays import average_arrays
from flowerdro.strategies.baselines import aggregate_apart_from_buffers

PARAMS = ("fc.weight", "fc.bias")
#: Examples, batch counters and running means of three clients.
SIZES, COUNTERS = (10, 20, 35), (30, 40, 50)


def test_integer_layers_are_rounded_not_truncated():
    # 7/3 + 7/3 + 7/3 sums to 6.999999999999999 in float64; astype(int64) would give 6
    three = np.float64(0.0)
    for _ in range(3):
        three += (1.0 / 3.0) * 7
    assert int(three) == 6
    assert cast_layer(three, np.int64) == 7
    np.testing.assert_array_equal(cast_layer(np.array([2.5, -0.6, 3.49]), np.int32), np.array([2, -1, 3]))
    assert cast_layer(np.array([0.2, 0.7]), np.bool_).tolist() == [False, True]
    assert cast_layer(np.array([1.5]), np.float32).dtype == np.float32


def test_drfa_combination_rounds_an_integer_counter():
    out = combine_models([np.zeros(2, np.float32), np.array(0, np.int64)],
                         {i: [np.full(2, i, np.float32), np.array(7, np.int64)] for i in range(3)},
                         {i: 1.0 / 3.0 for i in range(3)})
    assert out[1].dtype == np.int64 and int(out[1]) == 7
    np.testing.assert_allclose(out[0], [1.0, 1.0], rtol=1e-7)  # (0 + 1 + 2)/3 in float32


def test_update_mask_tells_parameters_from_buffers():
    keys = ["fc.weight", "bn.weight", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "mask"]
    arrays = [np.zeros(2, np.float32)] * 4 + [np.array(0, np.int64), np.zeros(2, np.uint8)]
    assert update_mask(keys, arrays) == [True, True, False, False, False, False]


def test_mean_buffers_is_the_weighted_mean_of_the_buffers_only():
    mask = [True, False, False]
    layers = [np.full(2, 9.0, np.float32), np.zeros(2, np.float32), np.array(0, np.int64)]
    models = {k: [np.zeros(2, np.float32), np.full(2, float(c), np.float32), np.array(c, np.int64)]
              for k, c in zip("abc", COUNTERS, strict=True)}
    out = mean_buffers(layers, mask, models, dict(zip("abc", SIZES, strict=True)))
    # (10·30 + 20·40 + 35·50) / 65 = 2850 / 65 = 43.846...
    assert out[0] is layers[0]
    np.testing.assert_allclose(out[1], np.full(2, 2850 / 65), rtol=2.0 ** -23)
    assert out[1].dtype == np.float32
    assert out[2].dtype == np.int64 and int(out[2]) == 44
    with pytest.raises(ValueError, match="weights"):
        mean_buffers(layers, mask, models, {"a": 0.0})
    with pytest.raises(ValueError, match="weights"):
        mean_buffers(layers, mask, models, {"a": -1.0, "b": 2.0})


def _model(seed: int, counter: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"fc.weight": rng.normal(size=(3, 2)).astype(np.float32), "fc.bias": rng.normal(size=2).astype(np.float32),
            "bn.running_mean": rng.normal(size=2).astype(np.float32), "bn.num_batches_tracked": np.array(counter)}


def _reply(arrays: dict[str, np.ndarray], n: int, loss: float, node: int) -> Message:
    ensure_task_identity()
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "metrics": MetricRecord({"num-examples": n, "train_loss": loss})})
    return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN)


def _replies(keys=None) -> list[Message]:
    out = []
    for i, (n, c) in enumerate(zip(SIZES, COUNTERS, strict=True)):
        model = _model(i + 1, c)
        out.append(_reply({k: model[k] for k in (keys or model)}, n, 0.5 + i, i + 1))
    return out


def _global(keys=None) -> ArrayRecord:
    model = _model(0, 20)
    return ArrayRecord({k: Array(model[k]) for k in (keys or model)})


def _as_dict(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: rec[k].numpy() for k in rec.keys()}


def test_flowers_qfedavg_cannot_step_an_integer_counter():
    strategy = QFedAvg(client_learning_rate=0.1, q=0.5)
    strategy.current_arrays = _global()
    with pytest.raises(TypeError, match="int64"):
        strategy.aggregate_train(1, _replies())


def test_qfedavg_steps_the_parameters_as_flower_does_and_averages_the_buffers_over_the_examples():
    # Prepare: Flower's q-FedAvg on a model that has only the parameters is the reference
    reference = QFedAvg(client_learning_rate=0.1, q=0.5)
    reference.current_arrays = _global(PARAMS)
    expected, _ = reference.aggregate_train(1, _replies(PARAMS))
    strategy = QFedAvg(client_learning_rate=0.1, q=0.5)
    strategy.current_arrays = _global()
    replies = _replies()
    # Execute
    arrays, metrics = aggregate_apart_from_buffers(strategy, 1, replies, _global())
    # Assert
    out = _as_dict(arrays)
    assert list(out) == list(_model(0, 0))
    for k in PARAMS:
        np.testing.assert_array_equal(out[k], expected[k].numpy())
    means = np.stack([_model(i + 1, 0)["bn.running_mean"].astype(np.float64) for i in range(3)])
    np.testing.assert_allclose(out["bn.running_mean"], np.average(means, axis=0, weights=SIZES), rtol=2.0 ** -23)
    assert out["bn.num_batches_tracked"].dtype == np.int64 and int(out["bn.num_batches_tracked"]) == 44
    assert metrics is not None
    # the replies and q-FedAvg's copy of the global model are given back whole
    for i, r in enumerate(replies):
        got = _as_dict(r.content["arrays"])
        assert list(got) == list(_model(0, 0)) and int(got["bn.num_batches_tracked"]) == COUNTERS[i]
    assert list(strategy.current_arrays.keys()) == list(_model(0, 0))


def test_fedavg_keeps_flowers_parameters_and_an_integer_counter():
    strategy = FedAvg()
    flower = aggregate_arrayrecords([r.content for r in _replies()], "num-examples")
    arrays, _ = aggregate_apart_from_buffers(strategy, 1, _replies(), _global())
    out = _as_dict(arrays)
    for k in PARAMS:
        np.testing.assert_array_equal(out[k], flower[k].numpy())
    assert flower["bn.num_batches_tracked"].numpy().dtype == np.float64  # what Flower alone returns
    assert out["bn.num_batches_tracked"].dtype == np.int64 and int(out["bn.num_batches_tracked"]) == 44


def test_average_arrays_keeps_flowers_parameters_and_the_counters_dtype():
    contents = [r.content for r in _replies()]
    flower = aggregate_arrayrecords(contents, "num-examples")
    out = _as_dict(average_arrays(contents, "num-examples"))
    for k in PARAMS:
        np.testing.assert_array_equal(out[k], flower[k].numpy())
    assert out["bn.num_batches_tracked"].dtype == np.int64 and int(out["bn.num_batches_tracked"]) == 44
    # a model without buffers is exactly Flower's average
    plain = [r.content for r in _replies(PARAMS)]
    ours, theirs = average_arrays(plain, "num-examples"), aggregate_arrayrecords(plain, "num-examples")
    assert all(ours[k].data == theirs[k].data for k in PARAMS)
