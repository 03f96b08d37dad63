"""Stress test of the FedMGDA+ min-norm solver on random degenerate instances.

Every instance is solved by ``flowerdro.core.mgda.min_norm_weights`` and certified
independently of the solver:

* feasibility: Σλ = 1 and lo ≤ λ ≤ hi to 1e-12;
* optimality: f − f* ≤ min(Frank–Wolfe gap, f) ≤ 1e-9 |f| + 1e-12 max(1, max G_ii), where
  the Frank–Wolfe gap ∇f(λ)ᵀ(λ − y*) uses the exact minimiser y* of the linearisation over
  the box-simplex (fill the smallest gradient entries first), and f* ≥ 0 because G is PSD;
* determinism: a second call returns the same array, bit for bit;
* optionally, no worse than an earlier version of the module (``--before``), and, on every
  ``--cvxpy-every``-th instance, no worse than cvxpy (CLARABEL at 1e-10) unless cvxpy's
  lower value comes with a constraint violation above 1e-13.

Families (``--family``), each a function of the seed only:

* ``mixed``: m ∈ {1, …, 100}; full-rank, duplicated, rank m/10, opposite and zero, ill-
  conditioned, near-duplicate, integer-grid and near-tie updates; ε ∈ {None, 0, 1e-12,
  1e-4, 0.5/m, 0.01, 0.05, 0.2, 1}; random centres, some with exact zeros;
* ``mid``: m ∈ [30, 200], ranks 2 … m − 1, some duplicated; ε ∈ {None, 0.2/m, …, 0.3};
* ``ipm``: m ∈ [20, 200], rank ≤ m/2, tight boxes ε ∈ {0.2, 0.5, 1, 2, 5, 20}/m,
  duplicated and opposite rows, random centres with zeros (the affine-minimum pass, then
  the interior-point pass run first on these);
* ``big``: m ∈ [201, 600], rank < m/4, some duplicated; ε ∈ {None, 0.5/m, …, 5/m, 0.05}
  (only the affine-minimum pass runs before the active-set method at these sizes).

Run: ``python scripts/stress_mgda.py --family ipm --count 6000 --start 90000``; the exit
status is 1 when any instance fails. Session 4 ran mixed 6000 from 70000, mid 2000 from
80000 and ipm 6000 from 90000; session 5 the same and big 2000 from 100000
(docs/results.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np

import flowerdro.core.mgda as mgda

REL, ABS = 1e-9, 1e-12
Instance = tuple[np.ndarray, float | None, np.ndarray | None]


def _unit(V: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(V, axis=1, keepdims=True)
    return V / np.where(n > 0, n, 1.0)


def _centre(rng: np.random.Generator, m: int, zeros: bool) -> np.ndarray:
    center = rng.dirichlet(np.full(m, rng.choice([0.3, 1.0, 5.0])))
    if zeros and rng.random() < 0.3:  # exact zeros in the centre
        center[rng.integers(0, m, max(1, m // 4))] = 0.0
        center /= center.sum()
    return center


def instance_mixed(seed: int) -> Instance:
    """Small and mid-size Gram matrices of every degenerate kind, any ε."""
    rng = np.random.default_rng(seed)
    m = int(rng.choice([1, 2, 3, 5, 8, 12, 20, 40, 60, 100, 100, 100]))
    kind = int(rng.integers(0, 9))
    if kind == 0:
        V = rng.standard_normal((m, int(rng.integers(1, 2 * m + 1))))
    elif kind == 1:  # duplicated rows
        base = rng.standard_normal((max(1, m // 2), int(rng.integers(1, m + 2))))
        V = base[rng.integers(0, base.shape[0], m)]
    elif kind == 2:
        V = rng.standard_normal((m, max(1, m // 10)))
    elif kind == 3:  # opposite and zero rows
        base = rng.standard_normal((max(1, m // 2), int(rng.integers(1, m + 2))))
        V = np.concatenate([base, -base, np.zeros((m, base.shape[1]))])[:m]
    elif kind == 4:  # ill-conditioned
        V = rng.standard_normal((m, m)) * np.logspace(0, -rng.uniform(2, 8), m)[:, None]
    elif kind == 5:  # near-duplicates
        base = rng.standard_normal((max(1, m // 3), 5))
        V = base[rng.integers(0, base.shape[0], m)] + 1e-9 * rng.standard_normal((m, 5))
    elif kind == 6:  # integer grid: many exact ties
        V = rng.integers(-2, 3, size=(m, int(rng.integers(1, 4)))).astype(float)
    elif kind == 7:  # benchmark-like: rank m/10 or duplicated halves
        V = rng.standard_normal((m, max(1, m // 10))) if rng.random() < 0.5 else rng.standard_normal((m, 2 * m))
        if rng.random() < 0.5:
            V[m // 2 :] = V[: m - m // 2]
    else:  # near-ties: a common row plus tiny perturbations
        V = np.ones((m, 4)) + 1e-7 * rng.standard_normal((m, 4))
    if rng.random() < 0.7:
        V = _unit(V)
    eps = [None, 0.0, 1e-12, 1e-4, 0.5 / m, 0.01, 0.05, 0.2, 1.0][int(rng.integers(0, 9))]
    center = _centre(rng, m, m > 2) if rng.random() < 0.4 else None
    return V @ V.T, eps, center


def instance_mid(seed: int) -> Instance:
    """Low and intermediate ranks at m ∈ [30, 200] (the low-rank passes)."""
    rng = np.random.default_rng(seed)
    m = int(rng.integers(30, 201))
    r = int(rng.integers(2, m))
    V = _unit(rng.standard_normal((m, r)))
    if rng.random() < 0.2:
        V[m // 2 :] = V[: m - m // 2]
    eps = [None, 0.2 / m, 0.5 / m, 1.0 / m, 2.0 / m, 0.05, 0.3][int(rng.integers(0, 7))]
    center = rng.dirichlet(np.full(m, rng.choice([0.3, 1.0, 5.0]))) if rng.random() < 0.4 else None
    return V @ V.T, eps, center


def instance_ipm(seed: int) -> Instance:
    """Tight boxes and low rank at m ∈ [20, 200] (the low-rank passes run on these)."""
    rng = np.random.default_rng(seed)
    m = int(rng.integers(20, 201))
    r = int(rng.integers(1, max(2, m // 2)))
    V = _unit(rng.standard_normal((m, r)))
    if rng.random() < 0.2:
        V[m // 2 :] = V[: m - m // 2]
    if rng.random() < 0.1:
        V[: m // 4] = -V[m // 4 : 2 * (m // 4)]
    eps = float(rng.choice([0.2, 0.5, 1.0, 2.0, 5.0, 20.0])) / m
    center = _centre(rng, m, True) if rng.random() < 0.4 else None
    return V @ V.T, eps, center


def instance_big(seed: int) -> Instance:
    """Low rank at m ∈ [201, 600], above the interior-point and proximal passes' range
    (only the affine-minimum pass runs there before the active-set method)."""
    rng = np.random.default_rng(seed)
    m = int(rng.integers(201, 601))
    r = int(rng.integers(1, m // 4))
    V = _unit(rng.standard_normal((m, r)))
    if rng.random() < 0.2:
        V[m // 2 :] = V[: m - m // 2]
    eps = [None, 0.5 / m, 1.0 / m, 2.0 / m, 5.0 / m, 0.05][int(rng.integers(0, 6))]
    center = _centre(rng, m, True) if rng.random() < 0.4 else None
    return V @ V.T, eps, center


FAMILIES: dict[str, Callable[[int], Instance]] = {
    "mixed": instance_mixed,
    "mid": instance_mid,
    "ipm": instance_ipm,
    "big": instance_big,
}


def bounds(m: int, eps: float | None, center: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The box of the problem, lo = max(0, c − ε), hi = min(1, c + ε) ([0, 1] without ε)."""
    c = np.full(m, 1.0 / m) if center is None else center
    if eps is None:
        return np.zeros(m), np.ones(m)
    return np.maximum(0.0, c - eps), np.minimum(1.0, c + eps)


def fw_gap(G: np.ndarray, lam: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """Frank–Wolfe gap ∇f(λ)ᵀ(λ − y*) of f(λ) = λᵀGλ, y* = argmin_{y in the box-simplex} ∇fᵀy.

    y* starts at lo and gives the remaining mass 1 − Σlo to the smallest gradient entries
    first, each up to its upper bound (exact, unlike an LP solver's 1e-7 tolerance).
    """
    grad = 2.0 * G @ lam
    y = lo.copy()
    rest = 1.0 - float(lo.sum())
    for i in np.argsort(grad, kind="stable"):
        if rest <= 0:
            break
        add = min(hi[i] - lo[i], rest)
        y[i] += add
        rest -= add
    return float(grad @ lam - grad @ y)


def cvxpy_value(G: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[float, float]:
    """(λᵀGλ, constraint violation) of cvxpy's solution (CLARABEL at 1e-10)."""
    import cvxpy as cp

    lam = cp.Variable(G.shape[0])
    cons = [cp.sum(lam) == 1, lam >= lo, lam <= hi]
    prob = cp.Problem(cp.Minimize(cp.quad_form(lam, cp.psd_wrap(G))), cons)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prob.solve(solver="CLARABEL", tol_gap_abs=1e-10, tol_gap_rel=1e-10, tol_feas=1e-10)
    v = np.asarray(lam.value)
    viol = max(abs(float(v.sum()) - 1.0), float((lo - v).max()), float((v - hi).max()))
    return float(v @ G @ v), viol


def load_module(path: str):
    """Import an earlier version of ``flowerdro/core/mgda.py`` from a file (``--before``)."""
    spec = importlib.util.spec_from_file_location("mgda_before", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before: cannot load a module from {path!r}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(family: str, count: int, start: int, before: str | None = None,
        cvxpy_every: int = 10, quiet: bool = False) -> dict:
    """Solve and certify ``count`` instances of ``family`` from seed ``start``; a summary.

    The summary holds the failing seeds with a reason, how many answers were worse or
    better than ``before``'s, the cvxpy comparisons, and how often each low-rank pass
    (affine minimum, interior point, proximal) reported success or failure.
    """
    if family not in FAMILIES:
        raise ValueError(f"family: must be one of {', '.join(FAMILIES)}, got {family!r}")
    make = FAMILIES[family]
    old = load_module(before) if before else None
    names = {"_affine_pass": "affine", "_ipm_face": "interior_point", "_pdas_low_rank": "proximal"}
    stats = {label: {"ok": 0, "fail": 0} for label in names.values()}
    real = {name: getattr(mgda, name) for name in names}

    def counting(name):
        def wrapper(*args, **kwargs):
            out = real[name](*args, **kwargs)
            stats[names[name]]["ok" if out[2] else "fail"] += 1
            return out
        wrapper.__name__ = f"counting{name}"
        return wrapper

    fails: list[tuple[int, str]] = []
    worse = better = ncvx = 0
    cvx_infeasible: list[tuple[int, float, float]] = []
    t0 = time.time()
    for name in names:
        setattr(mgda, name, counting(name))
    try:
        for seed in range(start, start + count):
            G, eps, center = make(seed)
            m = G.shape[0]
            lo, hi = bounds(m, eps, center)
            try:
                lam = mgda.min_norm_weights(G, eps, center)
            except Exception as err:  # a raise is a failure, recorded with its message
                fails.append((seed, f"raised {err!r}"))
                continue
            scale = max(1.0, float(np.max(np.diag(G))))
            f = float(lam @ G @ lam)
            tol = REL * abs(f) + ABS * scale
            reasons = []
            if not (abs(float(lam.sum()) - 1.0) <= 1e-12 and np.all(lam >= lo - 1e-12) and np.all(lam <= hi + 1e-12)):
                reasons.append("infeasible")
            gap = fw_gap(G, lam, lo, hi)
            if min(gap, f) > tol:
                reasons.append(f"Frank-Wolfe gap {gap:.2e} at f = {f:.3e}")
            if not np.array_equal(lam, mgda.min_norm_weights(G, eps, center)):
                reasons.append("not deterministic")
            if old is not None:
                try:
                    lo_ = old.min_norm_weights(G, eps, center)
                except Exception:  # the earlier version may raise where this one does not
                    lo_ = None
                if lo_ is not None:
                    fo = float(lo_ @ G @ lo_)
                    if f > fo + REL * abs(fo) + ABS * scale:
                        worse += 1
                        reasons.append(f"worse than before ({f:.6e} > {fo:.6e})")
                    elif f < fo - REL * abs(fo) - ABS * scale:
                        better += 1
            if cvxpy_every and seed % cvxpy_every == 0:
                fc, viol = cvxpy_value(G, lo, hi)
                ncvx += 1
                if f > fc + REL * abs(fc) + ABS * scale:
                    if viol > 1e-13:  # cvxpy bought the lower value with infeasibility
                        cvx_infeasible.append((seed, f - fc, viol))
                    else:
                        reasons.append(f"cvxpy {fc:.6e} < ours {f:.6e}")
            if reasons:
                fails.append((seed, "; ".join(reasons)))
            done = seed - start + 1
            if not quiet and done % 500 == 0:
                print(f"{done} done, {len(fails)} failures, {time.time() - t0:.0f} s", flush=True)
    finally:
        for name, fn in real.items():
            setattr(mgda, name, fn)
    return {"family": family, "count": count, "start": start, "failures": fails,
            "worse_than_before": worse, "better_than_before": better,
            "cvxpy_comparisons": ncvx, "cvxpy_lower_but_infeasible": cvx_infeasible,
            "low_rank_passes": stats, "seconds": time.time() - t0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="mixed")
    parser.add_argument("--count", type=int, default=1000, help="number of instances")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--before", default=None, help="an earlier mgda.py to compare objectives with")
    parser.add_argument("--cvxpy-every", type=int, default=10, help="compare with cvxpy on every N-th seed (0: never)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count: must be >= 1")
    if args.cvxpy_every < 0:
        parser.error("--cvxpy-every: must be >= 0")
    out = run(args.family, args.count, args.start, args.before, args.cvxpy_every, args.quiet)
    print(f"family {out['family']}: instances {out['count']} (seeds {out['start']}..{out['start'] + out['count'] - 1}), "
          f"failures {len(out['failures'])}, worse than before {out['worse_than_before']}, "
          f"better than before {out['better_than_before']}, {out['seconds']:.0f} s")
    print(f"cvxpy comparisons {out['cvxpy_comparisons']}; cvxpy lower only by violating "
          f"constraints (> 1e-13): {out['cvxpy_lower_but_infeasible']}")
    print(f"low-rank passes: {out['low_rank_passes']}")
    for seed, why in out["failures"][:20]:
        print(f"  seed {seed}: {why}")
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
