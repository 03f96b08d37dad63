"""Validation sets held out of the clients' training data, and evaluate messages answered on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from flowerdro.clients import ClientKit
from flowerdro.clients.handlers import evaluate_reply, get_runtime
from flowerdro.data import DataConfig
from flowerdro.data.federated import load_federated
from flowerdro.experiments.inprocess import ensure_task_identity

SYNTH = {"dataset": "synthetic", "num-partitions": 6, "synthetic-dim": 20, "synthetic-classes": 5}


def _rows(x: np.ndarray) -> set[bytes]:
    return {r.tobytes() for r in np.ascontiguousarray(x)}


def test_validation_rows_come_out_of_the_training_rows_only():
    plain = load_federated(DataConfig.from_run_config(SYNTH))
    held = load_federated(DataConfig.from_run_config({**SYNTH, "validation-fraction": 0.25}))
    for a, b in zip(plain, held, strict=True):
        assert a.x_val is None and b.x_val is not None
        n = a.num_train
        # Training and validation partition the former training rows; the test set is untouched.
        assert b.num_train + b.num_val == n
        assert b.num_val == round(0.25 * n)
        assert _rows(b.x_train) | _rows(b.x_val) == _rows(a.x_train)
        assert not _rows(b.x_train) & _rows(b.x_val)
        np.testing.assert_array_equal(a.x_test, b.x_test)
        # Stratified: each class's validation count is within one row of its share.
        classes, counts = np.unique(a.y_train, return_counts=True)
        val_counts = {c: int((b.y_val == c).sum()) for c in classes}
        for c, k in zip(classes, counts, strict=True):
            assert abs(val_counts[c] - 0.25 * k) <= 1.0 + 1e-9, (c, k, val_counts[c])


def test_the_split_depends_on_the_data_seed_not_the_run_seed():
    a = load_federated(DataConfig.from_run_config({**SYNTH, "validation-fraction": 0.2, "data-seed": 0, "seed": 1}))
    b = load_federated(DataConfig.from_run_config({**SYNTH, "validation-fraction": 0.2, "data-seed": 0, "seed": 7}))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.x_val, y.x_val)


def test_regression_clients_hold_out_random_rows():
    rc = {"dataset": "robust_regression", "num-partitions": 3, "samples-per-client": 40}
    plain, held = (load_federated(DataConfig.from_run_config(c)) for c in (rc, {**rc, "validation-fraction": 0.25}))
    for a, b in zip(plain, held, strict=True):
        assert (b.num_train, b.num_val) == (30, 10)
        assert _rows(b.x_train) | _rows(b.x_val) == _rows(a.x_train)


def _context(run_config: dict, pid: int = 0, n: int = 6) -> Context:
    return Context(run_id=1, node_id=pid + 1, node_config={"partition-id": pid, "num-partitions": n},
                   state=RecordDict(), run_config=run_config)


def _evaluate(ctx: Context, config: dict) -> Message:
    ensure_task_identity()
    rt = get_runtime(ctx)
    arrays = ArrayRecord(rt.new_model(seed=0).state_dict())
    msg = Message(content=RecordDict({"arrays": arrays, "config": ConfigRecord(config)}), dst_node_id=ctx.node_id,
                  message_type="evaluate")
    return evaluate_reply(msg, ctx)


def _accuracy_by_hand(rt, x: torch.Tensor, y: torch.Tensor) -> float:
    model = rt.new_model(seed=0)
    with torch.no_grad():
        return int((model(x).argmax(1) == y).sum()) / int(y.shape[0])


def test_an_evaluate_message_is_answered_on_the_split_it_names():
    ctx = _context({**SYNTH, "validation-fraction": 0.25})
    rt = get_runtime(ctx)
    for split, (x, y) in (("validation", (rt.data.x_val, rt.data.y_val)), ("test", (rt.data.x_test, rt.data.y_test))):
        m = _evaluate(ctx, {"eval-split": split}).content["metrics"]
        assert m["num-examples"] == int(y.shape[0])
        # k/n counted exactly here; the client's float32 mean rounds it to 24 bits
        assert m["test_acc"] == pytest.approx(_accuracy_by_hand(rt, x, y), rel=2.0**-23)
    # the run config's eval-split applies when the message says nothing
    ctx_rc = _context({**SYNTH, "validation-fraction": 0.25, "eval-split": "validation"})
    assert _evaluate(ctx_rc, {}).content["metrics"]["num-examples"] == rt.data.num_val


def test_a_client_without_a_validation_set_refuses_to_answer_on_one():
    with pytest.raises(ValueError, match="eval-split: 'validation' .* set validation-fraction > 0"):
        _evaluate(_context(dict(SYNTH)), {"eval-split": "validation"})


# --------------------------------------------------------------------------- the user's kit
def _kit(parts: int, **kwargs) -> ClientKit:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=g), torch.arange(40) % 2
    data = {2: ((x[:30], y[:30]), (x[30:], y[30:])), 3: ((x[:20], y[:20]), (x[20:30], y[20:30]), (x[30:], y[30:]))}

    return ClientKit(model_fn=lambda: torch.nn.Linear(4, 2), data_fn=lambda pid, n: data[parts],
                     loss_fn=torch.nn.CrossEntropyLoss(), **kwargs)


def _kit_context(rc: dict) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                   run_config=rc)


def test_a_kit_takes_its_validation_part_from_data_fn():
    kit = _kit(3)
    rt = kit.runtime(_kit_context({}))
    assert (rt.data.num_train, rt.data.num_val, rt.data.num_test) == (20, 10, 10)


def test_a_kit_holds_out_validation_rows_of_its_training_tensors():
    kit = _kit(2)
    rt = kit.runtime(_kit_context({"validation-fraction": 0.2, "data-seed": 3}))
    assert (rt.data.num_train, rt.data.num_val) == (24, 6)
    both = torch.cat([rt.data.x_train, rt.data.x_val])
    assert sorted(map(tuple, both.tolist())) == sorted(map(tuple, kit.data_fn(0, 1)[0][0].tolist()))


def test_a_kit_whose_own_code_reads_its_loaders_refuses_a_held_out_split():
    kit = _kit(2, train_fn=lambda model, loader, args: None)
    with pytest.raises(ValueError, match="validation-fraction: your train_fn .* return \\(train, validation, test\\)"):
        kit.runtime(_kit_context({"validation-fraction": 0.2}))
    with pytest.raises(ValueError, match="validation-fraction: your data_fn returns its own validation data"):
        _kit(3).runtime(_kit_context({"validation-fraction": 0.2}))
