"""Same seed, same model: reply order must not change what a strategy computes."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message

from flowerdro.apps.client_app import app as client_app
from flowerdro.comparison import client_config
from flowerdro.experiments import InProcessGrid
from flowerdro.strategies import build_strategy, initial_arrays


class _ShuffledGrid(InProcessGrid):
    """Answers every batch in a seeded random order, as replies that race each other."""

    def __init__(self, *args, order_seed: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._order = np.random.default_rng(order_seed)

    def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
        replies = list(super().send_and_receive(messages, timeout=timeout))
        return [replies[i] for i in self._order.permutation(len(replies))]


def _final(name: str, rc: dict, order_seed: int) -> np.ndarray:
    grid = _ShuffledGrid(client_app, 4, rc, order_seed=order_seed)
    strategy = build_strategy(name, rc)
    res = strategy.start(grid, initial_arrays(grid, rc, 60), num_rounds=3, timeout=60,
                         train_config=client_config(rc))
    arrays: ArrayRecord = res.arrays
    return np.concatenate([arrays[k].numpy().ravel() for k in arrays.keys()])


@pytest.mark.parametrize("name", ["fedavg", "qfedavg", "drfa", "afl-full"])
def test_final_model_is_bit_identical_whatever_the_reply_order(synth_rc, name):
    # float32 sums depend on their order; the strategy must sum in message order
    rc = {**synth_rc, "q": 1.0, "fraction-train": 0.75}
    a = _final(name, rc, order_seed=1)
    b = _final(name, rc, order_seed=2)
    np.testing.assert_array_equal(a, b)


def test_communicate_returns_valid_replies_in_message_order(synth_rc):
    grid = _ShuffledGrid(client_app, 4, synth_rc, order_seed=5)
    strategy = build_strategy("fedavg", synth_rc)
    init = initial_arrays(grid, synth_rc, 60)
    cfg = client_config(synth_rc)
    cfg["server-round"] = 1
    from flwr.app import RecordDict

    nodes = list(reversed(grid.node_ids))
    msgs = [Message(content=RecordDict({"arrays": init, "config": cfg}), dst_node_id=n, message_type="train.sgd")
            for n in nodes]
    replies = strategy.communicate(grid, msgs, phase="train", reference=init)
    assert [int(r.metadata.src_node_id) for r in replies] == nodes
