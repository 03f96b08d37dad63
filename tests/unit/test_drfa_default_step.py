"""DRFA's default dual step γ: no single-round collapse of λ, and λ still moves over a run.

The claim (``flowerdro.core.drfa.default_dual_lr``): for losses in [0, F), F = 10, one λ
step moves no entry of λ by 1/2 or more, whatever N, m and τ, so λ never lands on one
client in a round that starts with every entry ≤ 1/2 (the uniform λ(0) among them); and on
average λ_i drifts by (f_i − f̄)/(2F) of the uniform weight per round, so a run of 40
rounds with losses one unit apart visibly shifts λ toward the clients with higher loss.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from flowerdro.core.drfa import DUAL_STEP_LOSS_BOUND, default_dual_lr, dual_step, sample_uniform

F = DUAL_STEP_LOSS_BOUND
GRID = list(itertools.product((6, 20, 100, 1000), (1, 10, 50)))
REGULARIZERS = (("none", 0.0), ("kl", 0.1), ("chi2", 0.1), ("l2", 0.1))


def _draws(n: int) -> list[int]:
    return sorted({1, max(1, n // 10), n // 2, n})


def _step(lam, ids, losses, n, m, tau, scale, reg, rho):
    gamma = default_dual_lr(n, m, tau=tau, scale=scale)
    return dual_step(lam, ids, losses, tau=tau, gamma=gamma, regularizer=reg, rho=rho, scale=scale)


@pytest.mark.parametrize("n,tau", GRID)
@pytest.mark.parametrize("scale", ["paper", "public"])
def test_no_step_moves_an_entry_of_lambda_by_half_for_losses_below_the_bound(n, tau, scale):
    rng = np.random.default_rng(n * 100 + tau)
    top = F * (1 - 1e-9)  # the largest loss the bound allows
    uniform = np.full(n, 1.0 / n)
    half = np.zeros(n)
    half[:2] = 0.5  # every entry ≤ 1/2, two clients hold all of λ
    for m, (reg, rho) in itertools.product(_draws(n), REGULARIZERS):
        cases = [
            (uniform, [0] * m, [top] * m),  # the worst case: every query draws the same client
            (half, [0] * m, [top] * m),
            (uniform, list(sample_uniform(rng, n, m)), list(rng.uniform(0, F, m))),
        ]
        for lam, ids, losses in cases:
            new = _step(lam, ids, losses, n, m, tau, scale, reg, rho)
            assert np.max(np.abs(new - lam)) < 0.5, (m, reg)
            assert np.max(new) < 1.0 and np.count_nonzero(new) >= 2, (m, reg, new.max())


def test_the_default_does_not_put_lambda_on_one_client_in_the_setting_that_collapsed():
    # N = m = 6, τ = 10, cross-entropy-sized losses: γ = 0.16·m/N² (the earlier default)
    # put 0.81 of λ on one client in this round; the default keeps every entry within 1/2 of 1/6
    rng = np.random.default_rng(1)
    ids = sample_uniform(rng, 6, 6)
    losses = rng.uniform(1.5, 2.5, 6)[ids]
    lam = np.full(6, 1.0 / 6)
    assert dual_step(lam, ids, losses, tau=10, gamma=0.16 * 6 / 36).max() > 0.8
    new = dual_step(lam, ids, losses, tau=10, gamma=default_dual_lr(6, 6, tau=10))
    assert new.max() < 1.0 / 6 + 0.5 and np.count_nonzero(new) == 6


@pytest.mark.parametrize("n,tau", GRID)
def test_lambda_moves_toward_the_clients_with_higher_loss_within_40_rounds(n, tau):
    # fixed losses 1 … 3 (mean 2): the expected drift moves the highest-loss client by
    # 40·(3 − 2)/(2F) = 2 uniform weights and the lowest-loss one to 0
    rng = np.random.default_rng(n + tau)
    f = np.linspace(1.0, 3.0, n)
    quarter = max(1, n // 4)
    for m in (max(1, n // 2), n):
        lam = np.full(n, 1.0 / n)
        for _ in range(40):
            ids = sample_uniform(rng, n, m)
            lam = dual_step(lam, ids, f[ids], tau=tau, gamma=default_dual_lr(n, m, tau=tau))
        assert lam[-quarter:].sum() >= 1.5 * quarter / n, (m, lam[-quarter:].sum())
        assert lam[:quarter].sum() <= 0.5 * quarter / n, (m, lam[:quarter].sum())


def test_the_default_is_the_bound_over_the_worst_case_move():
    # paper: D ≤ τγN·F = 1/2; public: D ≤ γmF = 1/2 (hand-worked: N = 20, m = 10, τ = 10)
    assert default_dual_lr(20, 10, tau=10) == pytest.approx(0.5 / (10 * 20 * 10), rel=1e-15)
    assert default_dual_lr(20, 10, tau=10, scale="public") == pytest.approx(0.5 / (10 * 10), rel=1e-15)
    with pytest.raises(ValueError, match="scale"):
        default_dual_lr(20, 10, tau=10, scale="other")
    with pytest.raises(ValueError, match="tau"):
        default_dual_lr(20, 10, tau=0)
