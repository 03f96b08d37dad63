"""The solver stress script (scripts/stress_mgda.py): its certificate and its families."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import flowerdro.core.mgda as mgda_mod

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("stress_mgda", ROOT / "scripts" / "stress_mgda.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("stress_mgda", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("family, start", [("ipm", 90000), ("mid", 80000), ("mixed", 70000), ("big", 100000)])
def test_short_runs_certify_every_instance(family, start):
    # 15 instances of each family: feasible, Frank-Wolfe certified, deterministic, and
    # (on seed start, a multiple of 5) no worse than cvxpy
    out = _script().run(family, 15, start, cvxpy_every=5, quiet=True)
    assert out["failures"] == []
    assert out["cvxpy_comparisons"] == 3
    passes = out["low_rank_passes"]
    if family == "ipm":  # tight boxes, low rank, m >= 20: a low-rank pass settles each one
        assert passes["affine"]["ok"] + passes["interior_point"]["ok"] >= 15
        assert passes["affine"]["ok"] >= 1 and passes["interior_point"]["ok"] >= 1
    if family == "big":  # m > 200: only the affine-minimum pass runs
        assert passes["affine"]["ok"] >= 1
        assert passes["interior_point"] == passes["proximal"] == {"ok": 0, "fail": 0}
    for name in ("_affine_pass", "_ipm_face", "_pdas_low_rank"):  # the wrappers are removed
        assert getattr(mgda_mod, name).__name__ == name


def test_the_certificate_rejects_a_wrong_answer(monkeypatch):
    # a solver that returns the box centre instead of the minimiser fails the
    # Frank-Wolfe certificate on a problem whose optimum is elsewhere
    stress = _script()
    monkeypatch.setattr(mgda_mod, "min_norm_weights", lambda G, eps=None, center=None: (
        np.full(G.shape[0], 1.0 / G.shape[0]) if center is None else np.asarray(center)))
    out = stress.run("ipm", 5, 90000, cvxpy_every=0, quiet=True)
    assert len(out["failures"]) >= 4
    assert all("Frank-Wolfe" in why for _, why in out["failures"])


def test_family_instance_91101_is_the_regression_instance():
    # tests/unit/test_mgda.py rebuilds instance 91101 of the ipm family by hand (the one
    # on which the final polish made the answer infeasible); both must agree
    spec = importlib.util.spec_from_file_location("_test_mgda_copy", ROOT / "tests" / "unit" / "test_mgda.py")
    test_mgda = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_mgda)
    _stress_instance_91101 = test_mgda._stress_instance_91101

    G, eps, center = _script().instance_ipm(91101)
    G2, eps2, center2 = _stress_instance_91101()
    assert np.array_equal(G, G2) and eps == eps2
    assert (center is None and center2 is None) or np.array_equal(center, center2)


def test_fw_gap_is_zero_at_a_vertex_that_minimises_the_linearisation():
    # worked by hand: G = diag(1, 4), box [0, 1]; λ = (1, 0) has gradient (2, 0), the LP
    # minimiser is (0, 1) with value 0, so the gap is 2 - 0 = 2; at the optimum (0.8, 0.2)
    # the gradient is (1.6, 1.6) and the gap is 0
    stress = _script()
    G = np.diag([1.0, 4.0])
    lo, hi = np.zeros(2), np.ones(2)
    assert stress.fw_gap(G, np.array([1.0, 0.0]), lo, hi) == pytest.approx(2.0)
    assert stress.fw_gap(G, np.array([0.8, 0.2]), lo, hi) == pytest.approx(0.0, abs=1e-15)
