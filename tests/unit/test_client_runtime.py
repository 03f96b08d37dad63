"""The client's reused model: each call holds exactly the received weights, as a fresh model would."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, RecordDict

from flowerdro.clients.handlers import get_runtime


def _runtime(synth_rc):
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                  run_config={**synth_rc, "model": "mlp", "hidden": "8,4"})
    return get_runtime(ctx)


def _random_like(rt, seed: int) -> ArrayRecord:
    rng = np.random.default_rng(seed)
    return ArrayRecord({k: Array(rng.normal(size=tuple(v.shape)).astype(np.float32))
                        for k, v in rt.new_model().state_dict().items()})


def test_each_call_equals_a_fresh_model_loaded_with_the_same_weights(synth_rc):
    rt = _runtime(synth_rc)
    for seed in (1, 2):
        arrays = _random_like(rt, seed)
        model = rt.model_from(arrays)
        fresh = rt.new_model()
        fresh.load_state_dict({k: torch.from_numpy(arrays[k].numpy()) for k in arrays.keys()})
        for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
            assert torch.equal(a, b), k
        assert all(p.grad is None for p in model.parameters())
        model(rt.data.x_train[:3]).sum().backward()  # leaves gradients the next call must clear


def test_a_wrong_shape_is_refused_naming_the_array(synth_rc):
    rt = _runtime(synth_rc)
    arrays = _random_like(rt, 3)
    key = next(iter(arrays.keys()))
    bad = ArrayRecord({k: (Array(np.zeros(3, np.float32)) if k == key else arrays[k]) for k in arrays.keys()})
    with pytest.raises(RuntimeError, match=key.replace(".", r"\.")):
        rt.model_from(bad)
