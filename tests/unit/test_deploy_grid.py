"""PromptGrid: Flower's send_and_receive loop with a short pull interval; the ClientApp module's imports."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowerdro.deploy.grid import PromptGrid


class _SlowGrid:
    """Answers one outstanding message per pull, in id order; ``mute`` ids never answer."""

    def __init__(self, mute: frozenset[str] = frozenset()) -> None:
        self.mute, self.pulls, self.closed = mute, 0, False

    def push_messages(self, messages):
        return [m.id for m in messages]

    def pull_messages(self, ids):
        self.pulls += 1
        ids = [i for i in ids if i not in self.mute]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=ids[0]))] if ids else []

    def close(self):
        self.closed = True


def _msgs(*ids):
    return [SimpleNamespace(id=i) for i in ids]


def test_every_reply_comes_back_one_pull_interval_apart():
    inner = _SlowGrid()
    start = time.monotonic()
    replies = PromptGrid(inner, interval=0.01).send_and_receive(_msgs("a", "b", "c"))
    assert [r.metadata.reply_to_message_id for r in replies] == ["a", "b", "c"]
    # three pulls, two sleeps of 0.01 s in between; 1 s leaves room for a loaded machine
    assert inner.pulls == 3 and time.monotonic() - start < 1.0


def test_a_silent_node_costs_the_timeout_and_no_more():
    inner = _SlowGrid(mute=frozenset({"b"}))
    start = time.monotonic()
    replies = PromptGrid(inner, interval=0.01, max_interval=0.01).send_and_receive(_msgs("a", "b"), timeout=0.3)
    took = time.monotonic() - start
    assert [r.metadata.reply_to_message_id for r in replies] == ["a"]
    assert 0.3 <= took < 1.3 and inner.pulls > 5  # polled all along, stopped at the deadline


def test_the_sleep_doubles_while_nothing_arrives_and_is_capped():
    inner = _SlowGrid(mute=frozenset({"b"}))
    start = time.monotonic()
    PromptGrid(inner, interval=0.01, max_interval=0.08).send_and_receive(_msgs("a", "b"), timeout=0.6)
    # pull 1 brings "a" (sleep 0.01); then empty pulls sleep 0.02, 0.04, 0.08, 0.08, ... until
    # 0.6 s: 0.01 + 0.02 + 0.04 = 0.07 s, then (0.6 − 0.07)/0.08 ≈ 6.6 more sleeps, so about 10
    # pulls; a fixed 0.01 s sleep would make about 60. Timer slack on a loaded machine only
    # lengthens sleeps, which means fewer pulls, so only the upper bound is tight.
    assert 3 <= inner.pulls <= 12, inner.pulls
    assert time.monotonic() - start >= 0.6


def test_other_attributes_reach_the_wrapped_grid():
    inner = _SlowGrid()
    PromptGrid(inner).close()
    assert inner.closed
    with pytest.raises(ValueError, match="interval must be > 0"):
        PromptGrid(inner, interval=0)
    with pytest.raises(ValueError, match="max_interval must be >= interval"):
        PromptGrid(inner, interval=0.5, max_interval=0.1)


def test_the_client_app_module_imports_neither_torch_nor_the_data_code():
    code = ("import sys, flowerdro.apps.client_app as c; "
            "assert len(c.app._registered_funcs) == 15, c.app._registered_funcs; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('flowerdro.data')))")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
