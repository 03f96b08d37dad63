"""core/fairness.py against hand-worked examples."""

import numpy as np
import pytest

from flowerdro.core.fairness import summarize, tail_mean


def test_summary_hand_worked_ten_clients():
    acc = [0.9, 0.1, 0.5, 0.7, 0.3, 0.8, 0.2, 0.6, 0.4, 1.0]
    s = summarize(acc)
    # float64 mean/min of ten decimals: ≤ a few ulps; default approx (rel 1e-6) is ample
    assert s["mean"] == pytest.approx(0.55)
    assert s["worst"] == pytest.approx(0.1)
    assert s["worst10"] == pytest.approx(0.1)          # ceil(0.1*10) = 1 client
    assert s["worst20"] == pytest.approx((0.1 + 0.2) / 2)
    assert s["best20"] == pytest.approx((1.0 + 0.9) / 2)
    assert s["std"] == pytest.approx(np.sqrt(np.mean((np.array(acc) - 0.55) ** 2)))
    assert s["n"] == 10


def test_losses_worst_is_highest():
    s = summarize({0: 0.2, 1: 2.0, 2: 1.0}, higher_is_better=False)
    assert s["worst"] == 2.0 and s["best20"] == 0.2


def test_tail_sizes_round_up_and_single_client():
    assert tail_mean([3.0, 1.0, 2.0], 0.2) == 1.0       # ceil(0.6) = 1
    assert tail_mean([3.0, 1.0, 2.0], 0.5) == 1.5       # ceil(1.5) = 2
    assert summarize([0.7])["worst20"] == 0.7


@pytest.mark.parametrize("bad,match", [([], "values"), ([0.1, float("nan")], "finite")])
def test_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        summarize(bad)


def test_bad_fraction():
    with pytest.raises(ValueError, match="fraction"):
        tail_mean([1.0], 0.0)


def test_moving_average_by_hand():
    from flowerdro.runs.plots import _moving_average

    # averages of small integers are exact in float64; default rtol 1e-7 is ample
    np.testing.assert_allclose(_moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1.0, 2.0, 4.0, 6.0])
    np.testing.assert_array_equal(_moving_average(np.array([1.0, 2.0]), 1), [1.0, 2.0])
