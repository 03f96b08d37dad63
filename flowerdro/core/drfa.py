r"""DRFA's server steps: sampling, model aggregation and the λ step, as pure functions.

Y. Deng, M. M. Kamani, M. Mahdavi, "Distributionally Robust Federated Averaging",
NeurIPS 2020, https://arxiv.org/abs/2102.12660 (Algorithm 1: DRFA; Algorithm 2:
DRFA-Prox). AFL (Mohri, Sivek, Suresh, ICML 2019) is DRFA with τ = 1.

The problem is :math:`\min_w \max_{\lambda\in\Delta} \sum_i \lambda_i f_i(w) + g(\lambda)`
over N clients (g = 0 for DRFA). One round s of Algorithm 1, with the functions below:

1. D(s): m clients drawn with probabilities λ(s) (:func:`sample_by_lambda`) and one
   snapshot step t′ ~ U{1..τ} (:func:`sample_snapshot_steps`).
2. The clients of D(s) run τ local steps from w̄(s) and return w_k and w_k(t′).
3. w̄(s+1) = w̄(s) + Σ_k a_k (w_k − w̄(s)) and w(t′) likewise, with the weights a of
   :func:`aggregation_weights` (the uniform mean over the draws in the paper),
   computed by :func:`combine_models`.
4. U: m clients drawn uniformly (:func:`sample_uniform`) report f_i(w(t′)).
5. v = :func:`loss_vector`, λ(s+1) = :func:`dual_step` (projected ascent
   :func:`dual_ascent`, or the proximal step :func:`prox_step` of Algorithm 2).

numpy and scipy only; the strategy (:mod:`flowerdro.strategies.drfa`) does the messaging.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import brentq
from scipy.special import wrightomega

from flowerdro.core.layers import cast_layer
from flowerdro.core.simplex import (
    _as_vector,
    _local_steps,
    _nonnegative,
    _positive,
    _simplex_and_vector,
    floor_simplex,
    project_simplex,
)

__all__ = [
    "DESIGNS",
    "DUAL_STEP_LOSS_BOUND",
    "DUAL_STEP_SCALES",
    "MAX_DUAL_MOVE",
    "REGULARIZERS",
    "aggregation_weights",
    "combine_models",
    "default_dual_lr",
    "dual_ascent",
    "dual_step",
    "loss_vector",
    "prox_step",
    "sample_by_lambda",
    "sample_snapshot_steps",
    "sample_uniform",
]

#: Regularisers g of DRFA-Prox.
REGULARIZERS: tuple[str, ...] = ("kl", "chi2", "l2")
#: The λ step with Algorithm 1's factor τN/m′ ("paper") or without it ("public").
DUAL_STEP_SCALES: tuple[str, ...] = ("paper", "public")
#: How D(s) was drawn, which decides the unbiased aggregation weights.
DESIGNS: tuple[str, ...] = ("lambda", "lambda-successive", "uniform", "full")
#: κ of :func:`default_dual_lr`: no λ step moves an entry of λ by κ or more (losses below F).
MAX_DUAL_MOVE = 0.5
#: F of :func:`default_dual_lr`: the losses the default γ is meant for lie in [0, F).
DUAL_STEP_LOSS_BOUND = 10.0


# ----------------------------------------------------------------------------- sampling
def sample_by_lambda(rng: np.random.Generator, lam: ArrayLike, m: int, *, replace: bool = True) -> np.ndarray:
    r"""Draw D(s): ``m`` client indices with probabilities λ, in the order drawn.

    With replacement the draws are i.i.d., P(k = i) = λ_i. Without replacement they are
    successive: the k-th draw picks i among the clients not drawn yet with probability
    λ_i / (1 − Σ_{j<k} λ_{i_j}) (numpy's ``choice(replace=False, p=λ)``, whose order is
    the order of the draws); at most ``#{i: λ_i > 0}`` indices are returned.

    Parameters
    ----------
    rng : numpy.random.Generator
        The strategy's seeded generator.
    lam : array_like, shape (N,)
        λ on the simplex.
    m : int
        Number of draws, ≥ 1.
    replace : bool (default: True)
        Draw with replacement (the paper).

    Returns
    -------
    numpy.ndarray of int64, shape (m,) (fewer without replacement when λ is sparse)
    """
    p = np.clip(np.asarray(lam, dtype=np.float64), 0.0, None)
    p = p / p.sum()
    if not replace:
        m = min(m, int(np.count_nonzero(p)))
    return np.asarray(rng.choice(p.size, size=m, replace=replace, p=p), dtype=np.int64)


def sample_uniform(rng: np.random.Generator, n: int, m: int, *, replace: bool = True) -> np.ndarray:
    """Draw ``m`` of ``n`` client indices uniformly (U, and D(s) for uniform client sampling)."""
    return np.asarray(rng.choice(n, size=m if replace else min(m, n), replace=replace), dtype=np.int64)


def sample_snapshot_steps(rng: np.random.Generator, tau: int, k: int, *, mode: str = "shared") -> np.ndarray:
    """t′ ~ Uniform{1, …, τ}: one value repeated ``k`` times (``"shared"``) or ``k`` draws (``"per-client"``)."""
    if mode == "shared":
        return np.full(k, int(rng.integers(1, tau + 1)), dtype=np.int64)
    return rng.integers(1, tau + 1, size=k).astype(np.int64)


# -------------------------------------------------------------------------- aggregation
def aggregation_weights(
    draws: Sequence[int],
    answered: Collection[int],
    lam: ArrayLike,
    *,
    design: str = "lambda",
) -> dict[int, float]:
    r"""Weights a_i of the update w̄(s+1) = w̄(s) + Σ_i a_i (w_i − w̄(s)), unbiased for Σ_i λ_i w_i.

    With c_i the number of draws of client i (``draws`` in the order drawn):

    * ``"lambda"`` (D(s) i.i.d. by λ, the paper): a_i = c_i / m, the mean over the draws.
    * ``"lambda-successive"`` (D(s) by λ without replacement, :func:`sample_by_lambda`):
      the uniform mean is biased there (client i is in D(s) with a probability that is not
      proportional to λ_i), so the ordered estimator of Des Raj (1956, JASA 51, "Some
      estimators in sampling with varying probabilities without replacement") is used:
      with P_k = Σ_{j<k} λ_{i_j} the weight already drawn before the k-th draw,

      .. math::

          t_k = \sum_{j<k} \lambda_{i_j} w_{i_j} + (1 - P_k)\, w_{i_k}, \qquad
          \hat w = \frac1m \sum_{k=1}^m t_k ,

      so the k-th client drawn gets a = ((1 − P_k) + (m − k) λ_{i_k}) / m. Given the first
      k − 1 draws, i_k = i with probability λ_i / (1 − P_k) among the others, hence
      E[t_k] = Σ_i λ_i w_i for every k; each t_k is a convex combination, so the weights
      are ≥ 0 and sum to 1.
    * ``"uniform"`` (D(s) uniform, with or without replacement; the public code):
      a_i = c_i λ_i N / m (Hansen-Hurwitz / Horvitz-Thompson with inclusion rate m/N);
      Σ a_i ≠ 1 in general, E[Σ_i a_i (w_i − w̄)] = Σ_i λ_i (w_i − w̄).
    * ``"full"`` (every client once): a_i = λ_i.

    Draws whose reply is missing are left out and the weights of the others renormalised
    to the same total (``"uniform"``: m becomes the number of answered draws), which keeps
    the estimate unbiased when failures do not depend on the client.

    Parameters
    ----------
    draws : sequence of int
        Client indices drawn, in the order drawn (duplicates count).
    answered : collection of int
        Indices whose reply arrived and passed the checks.
    lam : array_like, shape (N,)
        λ(s), the weights D(s) was drawn with.
    design : {"lambda", "lambda-successive", "uniform", "full"}

    Returns
    -------
    dict
        index → a_i for the answered indices (empty when nobody answered).
    """
    if design not in DESIGNS:
        raise ValueError(f"design: unknown value {design!r}; allowed: {', '.join(DESIGNS)}")
    p = np.asarray(lam, dtype=np.float64)
    ok = {int(i) for i in answered}
    drawn = [int(i) for i in draws]
    if design == "uniform":
        counts = Counter(i for i in drawn if i in ok)
        m_ans = sum(counts.values())
        return {i: c * float(p[i]) * p.size / m_ans for i, c in counts.items()}
    raw: dict[int, float] = {}
    if design == "lambda":
        for i in drawn:
            raw[i] = raw.get(i, 0.0) + 1.0
    elif design == "full":
        raw = {i: float(p[i]) for i in drawn}
    else:
        q = np.clip(p, 0.0, None) / np.clip(p, 0.0, None).sum()
        before = np.concatenate(([0.0], np.cumsum(q[drawn])[:-1]))
        m = len(drawn)
        for k, i in enumerate(drawn):
            raw[i] = raw.get(i, 0.0) + ((1.0 - before[k]) + (m - 1 - k) * q[i]) / m
    kept = {i: a for i, a in raw.items() if i in ok}
    total = sum(kept.values())
    if not kept:
        return {}
    if total <= 0.0:
        return {i: 1.0 / len(kept) for i in kept}
    return {i: a / total for i, a in kept.items()}


def combine_models(
    base: Sequence[np.ndarray], models: Mapping[int, Sequence[np.ndarray]], coefs: Mapping[int, float]
) -> list[np.ndarray]:
    r"""w̄ + Σ_i a_i (w_i − w̄), layer by layer (float64 accumulation, input dtypes kept).

    With Σ_i a_i = 1 (:func:`aggregation_weights`) this is Σ_i a_i w_i, the a-weighted
    mean of the models, buffers included (:mod:`flowerdro.core.layers`); integer layers
    are rounded to the nearest integer (:func:`~flowerdro.core.layers.cast_layer`).

    Parameters
    ----------
    base : sequence of numpy.ndarray
        The layers of w̄.
    models : mapping
        Client index → layers of w_i (same shapes as ``base``).
    coefs : mapping
        Client index → a_i (:func:`aggregation_weights`).

    Returns
    -------
    list of numpy.ndarray
        The combined layers, each with the dtype of its ``base`` layer.
    """
    out: list[np.ndarray] = []
    for j, b in enumerate(base):
        b64 = np.asarray(b, dtype=np.float64)
        acc = b64.copy()
        for i, a in coefs.items():
            acc += a * (np.asarray(models[i][j], dtype=np.float64) - b64)
        out.append(cast_layer(acc, np.asarray(b).dtype))
    return out


# ------------------------------------------------------------------------------ λ step
def loss_vector(num_clients: int, sampled_ids: Sequence[int] | ArrayLike, losses: ArrayLike) -> np.ndarray:
    r"""Unbiased estimate of the loss vector for the λ step (Algorithm 1, line 10).

    The losses at the snapshot model :math:`w^{(t')}` of the m clients U drawn uniformly
    with replacement give

    .. math::

        v_i = \frac{N}{m} \sum_{k=1}^{m} \mathbb{1}[U_k = i]\, f_i(w^{(t')}),

    (a client drawn twice counts twice, a client not drawn has :math:`v_i = 0`), so that
    :math:`\mathbb{E}[v] = (f_1, \dots, f_N)`.

    Parameters
    ----------
    num_clients : int
        N, ``>= 1``.
    sampled_ids : sequence of int, length m
        The drawn client indices, each in ``[0, N)``; duplicates allowed; ``m >= 1``.
    losses : array_like, shape (m,)
        ``losses[k]`` is :math:`f_{U_k}` at the snapshot, aligned with ``sampled_ids``.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        The vector :math:`v`.

    Raises
    ------
    ValueError
        If ``num_clients < 1``, ``sampled_ids`` is empty or has an id outside
        ``[0, num_clients)``, or ``losses`` is not finite or not of length m.

    Examples
    --------
    >>> loss_vector(4, [1, 3, 1], [0.5, 2.0, 0.5])
    array([0.        , 1.33333333, 0.        , 2.66666667])
    """
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or int(num_clients) < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    n = int(num_clients)
    ids_raw = np.asarray(sampled_ids)
    if ids_raw.ndim != 1 or ids_raw.size == 0:
        raise ValueError(f"sampled_ids must be a non-empty one-dimensional sequence of ints, got shape {ids_raw.shape}")
    if not (np.issubdtype(ids_raw.dtype, np.integer)
            or (np.issubdtype(ids_raw.dtype, np.floating) and np.all(ids_raw == np.round(ids_raw)))):
        raise ValueError(f"sampled_ids must hold integers in [0, {n}), got {ids_raw!r}")
    ids = ids_raw.astype(np.int64)
    if ids.min() < 0 or ids.max() >= n:
        raise ValueError(f"sampled_ids must be in [0, num_clients) = [0, {n}), got min {ids.min()} and max {ids.max()}")
    f = _as_vector(losses, "losses")
    if f.size != ids.size:
        raise ValueError(f"losses must have one entry per sampled id (m={ids.size}), got {f.size}")
    v = np.zeros(n)
    np.add.at(v, ids, f)
    return v * (n / ids.size)


def dual_ascent(lam: ArrayLike, v: ArrayLike, tau: float, gamma: float) -> np.ndarray:
    r"""DRFA projected dual ascent (Algorithm 1, line 12).

    .. math::

        \lambda^{(s+1)} = \Pi_\Delta\big(\lambda^{(s)} + \tau\gamma\, v\big),

    with :math:`v` from :func:`loss_vector` (τv is an unbiased estimate of the λ-gradient
    summed over the τ local steps of the round) and :math:`\Pi_\Delta` the Euclidean
    projection onto the simplex.

    Parameters
    ----------
    lam : array_like, shape (N,)
        :math:`\lambda^{(s)}` on the simplex (tolerance 1e-6).
    v : array_like, shape (N,)
        The loss vector, finite.
    tau : float
        τ ≥ 1, local steps per round.
    gamma : float
        γ > 0, the dual step size.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        :math:`\lambda^{(s+1)}`.

    Examples
    --------
    >>> dual_ascent([0.5, 0.5], [1.0, 0.0], tau=1, gamma=0.2)
    array([0.6, 0.4])
    """
    lam_arr, v_arr = _simplex_and_vector(lam, v, "v")
    return project_simplex(lam_arr + _local_steps(tau, "tau") * _positive(gamma, "gamma") * v_arr)


def prox_step(lam: ArrayLike, v: ArrayLike, tau: float, gamma: float, regularizer: str, rho: float) -> np.ndarray:
    r"""DRFA-Prox dual step (Algorithm 2).

    .. math::

        \lambda^{(s+1)} = \arg\max_{u \in \Delta}\ \tau\, g(u)
            - \frac{1}{2\gamma}\big\|\lambda^{(s)} + \gamma\tau v - u\big\|_2^2 ,

    with :math:`y = \lambda^{(s)} + \gamma\tau v`, :math:`\kappa = \gamma\tau\rho` and:

    * ``"l2"``: :math:`g(u) = -\frac{\rho}{2}\|u - \tfrac1N\mathbf 1\|^2`, so
      :math:`\lambda^{(s+1)} = \Pi_\Delta\big((y + \kappa/N)/(1 + \kappa)\big)`.
    * ``"chi2"``: :math:`g(u) = -\rho\,\chi^2(u)`,
      :math:`\chi^2(u) = \frac{1}{2N}\sum_i (N u_i - 1)^2` (``"l2"`` with ρN):
      :math:`\lambda^{(s+1)} = \Pi_\Delta\big((y + \kappa)/(1 + \kappa N)\big)`.
    * ``"kl"``: :math:`g(u) = -\rho\sum_i u_i\log(N u_i)`. The solution is interior with
      :math:`\kappa(\log(N u_i) + 1) + u_i - y_i = -\nu` for all i, i.e.
      :math:`u_i = \kappa\,\omega(y_i/\kappa - \mu)` with the Wright omega function
      (:math:`\omega + \log\omega = x`) and the scalar μ set by :math:`\sum_i u_i = 1`.

    ρ = 0 gives :func:`dual_ascent`.

    Parameters
    ----------
    lam : array_like, shape (N,)
        :math:`\lambda^{(s)}` on the simplex (tolerance 1e-6).
    v : array_like, shape (N,)
        The loss vector (:func:`loss_vector`).
    tau : float
        τ ≥ 1.
    gamma : float
        γ > 0.
    regularizer : {"kl", "chi2", "l2"}
        The regulariser g.
    rho : float
        ρ ≥ 0, its strength.

    Returns
    -------
    numpy.ndarray, shape (N,), float64
        :math:`\lambda^{(s+1)}`.

    Examples
    --------
    >>> prox_step([0.5, 0.5], [1.0, 0.0], tau=1, gamma=1.0, regularizer="l2", rho=1.0)
    array([0.75, 0.25])
    """
    if regularizer not in REGULARIZERS:
        raise ValueError(f"regularizer must be one of {', '.join(map(repr, REGULARIZERS))}, got {regularizer!r}")
    rho_f = _nonnegative(rho, "rho")
    lam_arr, v_arr = _simplex_and_vector(lam, v, "v")
    tau_f = _local_steps(tau, "tau")
    gamma_f = _positive(gamma, "gamma")
    if rho_f == 0.0:
        return dual_ascent(lam_arr, v_arr, tau_f, gamma_f)
    n = lam_arr.size
    y = lam_arr + gamma_f * tau_f * v_arr
    kappa = gamma_f * tau_f * rho_f
    if regularizer == "l2":
        return project_simplex((y + kappa / n) / (1.0 + kappa))
    if regularizer == "chi2":
        return project_simplex((y + kappa) / (1.0 + kappa * n))
    if not np.isfinite(kappa):
        return np.full(n, 1.0 / n)
    if kappa < 1e-300:  # 1/κ overflows; the KL term is below float resolution
        return project_simplex(y)
    return _kl_prox(y, kappa)


def _kl_prox(y: np.ndarray, kappa: float) -> np.ndarray:
    r"""Solve :math:`\min_{u \in \Delta} \kappa \sum_i u_i \log(N u_i) + \tfrac12\|u - y\|^2`.

    :math:`u_i(\mu) = \kappa\,\omega(y_i/\kappa - \mu)`; :math:`\sum_i u_i(\mu)` decreases
    in μ. With :math:`\max_i y_i = 0` (a shift of y only shifts μ) the largest entry lies in
    :math:`[1/N, 1]`, which brackets
    :math:`\mu \in [\log\kappa - 1/\kappa,\ \log(N\kappa) - 1/(N\kappa)]`.
    """
    n = y.size
    if n == 1:
        return np.ones(1)
    w = y - y.max()
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        x = w / kappa  # may be -inf for tiny κ; ω(-inf) = 0
    x = np.where(np.isnan(x), -np.inf, x)

    def excess(mu: float) -> float:
        return float(kappa * wrightomega(x - mu).sum() - 1.0)

    lo = np.log(kappa) - 1.0 / kappa
    hi = np.log(n) + np.log(kappa) - 1.0 / n / kappa
    pad = 8.0 * np.finfo(np.float64).eps * max(abs(lo), abs(hi), 1.0)  # rounding never excludes the root
    lo, hi = lo - pad, hi + pad
    if excess(lo) <= 0.0:
        mu = lo
    elif excess(hi) >= 0.0:
        mu = hi
    else:
        mu = _kl_newton(x, kappa, lo, hi)
        if mu is None:  # Newton did not settle: the bracketed solve
            mu = brentq(excess, lo, hi, xtol=1e-300, rtol=4 * np.finfo(np.float64).eps, maxiter=500)
    u = kappa * wrightomega(x - mu)
    return u / u.sum()


def _kl_newton(x: np.ndarray, kappa: float, lo: float, hi: float, max_iter: int = 60) -> float | None:
    r"""Root of :math:`e(\mu) = \kappa\sum_i \omega(x_i - \mu) - 1` by Newton from the left.

    e is convex and decreasing in μ, so Newton steps from where e > 0 increase
    monotonically to the root; ω'(z) = ω/(1 + ω). None if it does not settle.
    """
    mu = lo
    eps = np.finfo(np.float64).eps
    for _ in range(max_iter):
        om = wrightomega(x - mu)
        e = kappa * om.sum() - 1.0
        slope = kappa * float((om / (1.0 + om)).sum())
        if e <= 0.0 or slope <= 0.0:
            return mu
        step = e / slope
        new = mu + step
        if not lo <= new <= hi:
            return None
        if step <= 4.0 * eps * max(1.0, abs(mu)):
            return new
        mu = new
    return None


def dual_step(
    lam: ArrayLike,
    query_ids: Sequence[int],
    losses: Sequence[float],
    *,
    tau: int,
    gamma: float,
    regularizer: str = "none",
    rho: float = 0.0,
    floor: float = 0.0,
    scale: str = "paper",
) -> np.ndarray:
    r"""The λ step of DRFA / DRFA-Prox from the answered loss queries.

    v = :func:`loss_vector` (v_i = (N/m′) Σ_{k∈U′} 1[k = i] f_i(w(t′)), m′ = |U′|), then
    λ⁺ = Π_Δ(λ + τγv) (``regularizer="none"``, :func:`dual_ascent`) or the prox step
    :func:`prox_step`; finally λ⁺ ← floor_simplex(λ⁺, floor) when ``floor > 0``. With
    ``scale="public"`` the step uses u = (m′/N) v and τ = 1 instead
    (λ⁺ = Π_Δ(λ + γu), u_i = Σ_{k∈U′} 1[k = i] f_i: the public code's step).

    Returns
    -------
    numpy.ndarray, shape (N,)
        λ(s+1) on the simplex (every entry ≥ ``floor``).
    """
    if scale not in DUAL_STEP_SCALES:
        raise ValueError(f"scale: unknown value {scale!r}; allowed: {', '.join(DUAL_STEP_SCALES)}")
    n = len(np.asarray(lam))
    v = loss_vector(n, list(query_ids), list(losses))
    if scale == "public":
        v, tau = v * (len(query_ids) / n), 1
    if regularizer == "none":
        new = dual_ascent(lam, v, tau, gamma)
    else:
        new = prox_step(lam, v, tau, gamma, regularizer, rho)
    return floor_simplex(new, floor) if floor > 0.0 else new


def default_dual_lr(num_clients: int, num_draws: int, *, tau: int, scale: str = "paper") -> float:
    r"""γ when none is given: γ = κ/(τ N F) (``scale="paper"``) or κ/(m F) (``"public"``).

    κ = :data:`MAX_DUAL_MOVE` = 1/2 bounds how far one λ step can move λ, and
    F = :data:`DUAL_STEP_LOSS_BOUND` = 10 is the loss scale it is meant for: the losses
    f_i a client reports are assumed to lie in [0, F) (cross-entropy is ln C at a uniform
    prediction, 2.3 for 10 classes, and well below F once training starts).

    **The bound.** One step is λ⁺ = Π_Δ(λ + d) with d = τγv ≥ 0 (:func:`dual_step`). The
    projection subtracts one θ ∈ [0, max_j d_j] from every entry and clips at 0, so
    |λ⁺_i − λ_i| ≤ D := max_j d_j for every i. In the paper's step
    v_i = (N/m′) c_i f_i, where client i was drawn c_i ≤ m′ times among the m′ answered
    queries, so D ≤ τγ N max_i f_i < τγNF, whatever m′ (the worst case: every query draws
    the same client). γ = κ/(τNF) makes D < κ = 1/2 for every N, m and τ. The public step
    (λ + γ u, u_i = c_i f_i) has D ≤ γ m′ F ≤ γ m F, hence γ = κ/(mF) there. So no entry of
    λ moves by half of the simplex or more in a round, and λ⁺ is never a vertex when every
    λ_i ≤ 1/2 before the step (λ⁺_j = 1 would need λ_j > 1/2; λ(0) uniform qualifies for
    N ≥ 2). The prox steps of DRFA-Prox shrink the differences between entries before
    projecting (l2, χ²) or stay interior (KL), and the floor only raises small entries, so
    the same holds for them.

    **It still moves.** On average (E[v] = f) the step moves λ_i by τγ(f_i − f̄) =
    κ(f_i − f̄)/(NF) per round (until an entry reaches 0), i.e. by κ(f_i − f̄)/F = 5 % of
    the uniform weight 1/N per unit of loss above the mean, at every N, m and τ: over 40
    rounds a client whose loss is one unit above the mean reaches about three times the
    uniform weight. The typical single draw moves λ_i by κ f_i/(F m′) in absolute terms,
    far below the worst case.

    Parameters
    ----------
    num_clients : int
        N ≥ 1.
    num_draws : int
        m ≥ 1, the clients drawn per round for the loss query (N with full participation).
    tau : int
        τ ≥ 1, the local steps (the paper's step multiplies γ by τ).
    scale : {"paper", "public"}
        The λ step :func:`dual_step` takes.

    Returns
    -------
    float
        γ > 0.

    Examples
    --------
    >>> default_dual_lr(20, 10, tau=10)
    0.00025
    """
    if num_clients < 1 or num_draws < 1:
        raise ValueError(f"num_clients and num_draws must be >= 1, got {num_clients} and {num_draws}")
    if scale not in DUAL_STEP_SCALES:
        raise ValueError(f"scale: unknown value {scale!r}; allowed: {', '.join(DUAL_STEP_SCALES)}")
    if scale == "public":
        return MAX_DUAL_MOVE / (num_draws * DUAL_STEP_LOSS_BOUND)
    return MAX_DUAL_MOVE / (_local_steps(tau, "tau") * num_clients * DUAL_STEP_LOSS_BOUND)
