r"""DRFA, DRFA-Prox and AFL as a Flower Message-API strategy.

Distributionally Robust Federated Averaging — Y. Deng, M. M. Kamani, M. Mahdavi,
"Distributionally Robust Federated Averaging", NeurIPS 2020,
https://arxiv.org/abs/2102.12660 (Algorithm 1: DRFA; Algorithm 2: DRFA-Prox).
Agnostic Federated Learning — M. Mohri, G. Sivek, A. T. Suresh, ICML 2019,
https://arxiv.org/abs/1902.00146 (AFL = DRFA with τ = 1; "afl-full" with every client in
every round).

Objective, over N clients with losses f_i and mixing weights λ on the simplex Λ = Δ_N:

.. math::

    \min_w \max_{\lambda \in \Lambda} \sum_i \lambda_i f_i(w) \;(+\, g(\lambda)
    \text{ for DRFA-Prox}).

One communication round s (paper symbols; the code's names in brackets):

1. Sample D(s): m clients [``clients_per_round``] drawn with probabilities λ(s), with
   replacement by default, and one snapshot step t′ ~ Uniform{1, …, τ} shared by all
   [``snapshot_step``].
2. ``train.drfa`` to D(s) (one message per distinct client): τ local SGD steps
   [``local_steps``] with step η [``lr``] from w̄(s); the reply carries the final model
   w_i and the snapshot w_i(t′) after step t′.
3. w̄(s+1) = (1/m) Σ_{k ∈ D(s)} w_k (a client drawn twice counts twice);
   w(t′) = (1/m) Σ_{k ∈ D(s)} w_k(t′).
4. Sample U: m clients drawn uniformly (with replacement); ``query.loss`` sends them
   w(t′); each returns f_i(w(t′)) on one local minibatch.
5. v_i = (N/m) Σ_{k ∈ U} 1[k = i] f_i(w(t′)) (so E[v] = f(w(t′)) and
   E_{t′}[τ v] = Σ_{t=1}^{τ} ∇_λ F(w(t), λ)), then
   λ(s+1) = Π_Λ(λ(s) + τγ v)                                  (DRFA, [``dual_lr``] γ)
   λ(s+1) = argmax_{u∈Λ} τ g(u) − (1/2γ)‖λ(s) + γτ v − u‖²     (DRFA-Prox, [``regularizer``])
   with g = −ρ·KL(u‖uniform) (``"kl"``), −ρ·χ²(u) (``"chi2"``) or −(ρ/2)‖u − uniform‖²
   (``"l2"``), solved exactly by :func:`flowerdro.core.dual.drfa_prox_step`.
   Then optionally λ ← floor_simplex(λ, λ_min) and γ ← γ·decay.

The paper outputs the averaged iterate ŵ; here ``output_model="average"`` returns the
running mean of the server iterates, ŵ(S) = (1/S) Σ_{s=1}^{S} w̄(s) (the paper averages
the virtual sequence of every local step; the server only ever sees w̄(s)).

Options (defaults are the paper's; see issue 8 for the public code's departures)
---------------------------------------------------------------------------------
``client_sampling``
    ``"lambda"`` (paper): D(s) is drawn with probabilities λ and averaged uniformly.
    ``"uniform"`` (public MLOPTPSU/TorchFed code): D(s) is drawn uniformly and the model
    *updates* are weighted by a_k = λ_k·N/m:
    w̄(s+1) = w̄(s) + Σ_{k∈D(s)} λ_k (N/m)(w_k − w̄(s)); unbiased for Σ_i λ_i w_i as well,
    but every client is contacted equally often (useful when λ is concentrated and one
    wants the others to keep being seen) at the price of a higher variance.
``snapshot``
    ``"shared"`` (paper): one t′ for all sampled clients; ``"per-client"``: each client
    draws its own t′_i (the average of snapshots then mixes different local times;
    E_{t′}[τv] is unchanged, the variance across clients is lower per round).
``dual_lr_decay``
    γ ← γ·decay after every round (public code: 0.9; default 1.0 = constant γ as in the
    paper's analysis). Makes λ settle, at the cost of ceasing to track the worst client.
``dual_step_scale``
    ``"paper"`` (Algorithm 1): λ(s+1) = Π_Λ(λ(s) + τγ v) with v_i = (N/m′) Σ_{k∈U′} 1[k = i] f_i,
    an unbiased estimate of the whole round's dual gradient. ``"public"`` (public code):
    λ(s+1) = Π_Λ(λ(s) + γ u) with u_i = Σ_{k∈U′} 1[k = i] f_i, i.e. without the factor
    τN/m′ (for DRFA-Prox the prox step is taken with τ = 1 and u). With τ = 10, N = 10,
    m′ = 5 the paper's step is 20× larger; choose ``"public"`` to compare with the public
    code, or when the losses are large enough that the paper's step puts all of λ on one
    client in one round (see docs/results.md, issue 8).
``lambda_floor``
    After the λ step every λ_i below λ_min is raised to λ_min and the vector renormalised
    exactly (:func:`flowerdro.core.simplex.floor_simplex`; public code: 1e-3, default
    off). Keeps every client sampled with probability ≥ λ_min, so a client whose λ hit 0
    can still be drawn and regain weight.

Other choices documented here
-----------------------------
* Node ↔ partition: λ is keyed by partition id; messages go to node ids. Before the
  first round (and whenever a connected node's partition is still unknown) the strategy
  sends ``query.loss`` at the current model to those nodes (phase ``"discover"``) and
  learns the map from the ``partition-id`` of the replies (``loss-on = "full"`` when
  ``lambda_init = "size"``, so that ``num-examples`` is the local training-set size;
  ``"batch"`` otherwise, which is cheap). Replies of every phase (including evaluation)
  also update the map. N is ``num_partitions`` when given, else the number of distinct
  partitions discovered in round 1; a partition discovered later is added with weight
  1/(N+1) (the others scaled by N/(N+1)).
* ``lambda_init = "size"``: λ_i ∝ n_i, the ``num-examples`` of the discovery replies;
  a partition not yet heard from gets the mean size.
* A sampled partition with no connected node (its node vanished) is skipped for that
  phase, exactly like a failed reply.
* Failures: a failed ``train.drfa`` reply is dropped and the average is taken over the
  draws that answered (the weights renormalised over them). If none answered, w̄(s) is
  kept and the λ step skipped. A failed ``query.loss`` reply is dropped and v is built
  from the m′ answers with the factor N/m′ instead of N/m
  (:func:`flowerdro.core.dual.drfa_loss_vector` divides by the number of ids it gets):
  this keeps E[v] = f when failures are independent of the client; a client that fails
  *systematically* never has its loss observed, so its λ only shrinks — a bias against
  it that the strategy logs (``failures``) but cannot remove. If nobody answers, the λ
  step is skipped.
* ``full_participation`` (``"afl-full"``): every known client trains and answers the
  loss query each round; w̄(s+1) = Σ_i λ_i w_i (weights renormalised over the clients
  that answered) and v = f (the full loss vector, no sampling factor).
* Without replacement, D(s) is drawn by successive sampling with probabilities λ (numpy's
  ``choice(replace=False, p=λ)``); if fewer than m entries of λ are positive, only those
  are drawn.

Message protocol
----------------
``train.drfa`` — content ``arrays`` (w̄(s)), ``config``: ``local-steps`` τ, ``snapshot-step``
t′, ``server-round``, ``seed``, and ``lr``/``batch-size`` when set (else the clients' run
config decides), ``local-epochs = 0`` when the run config sets epochs (τ must be exact).
Reply: ``arrays`` (w_i after τ steps), ``snapshot`` (w_i after step t′), ``metrics`` with
``num-examples``, ``partition-id``, ``train_loss``, ``train_loss_local``, ``local-steps``.
``query.loss`` — content ``arrays`` (w(t′); the current model in the discovery phase),
``config``: ``loss-on`` (``"batch"``), ``batch-size``, ``seed``, ``server-round``. Reply:
``metrics`` with ``loss``, ``num-examples``, ``partition-id``.

Run-config keys (read by the ``drfa``, ``drfa-prox``, ``afl``, ``afl-full`` factories)
---------------------------------------------------------------------------------------
``clients-per-round`` m (default: ``fraction-train``·N, at least ``min-train-nodes``),
``local-steps`` τ (10; forced to 1 for AFL), ``lr`` η (clients' default when unset),
``batch-size`` (clients' default when unset), ``dual-lr`` γ (8e-3), ``regularizer``
(``none``/``kl``/``chi2``/``l2``; ``drfa-prox`` default ``kl``), ``rho`` ρ (0.1 for
drfa-prox), ``sample-with-replacement`` (true), ``client-sampling`` (``lambda``/``uniform``),
``snapshot`` (``shared``/``per-client``), ``dual-lr-decay`` (1.0), ``lambda-floor`` (0 = off),
``lambda-init`` (``uniform``/``size``), ``output-model`` (``last``/``average``),
``evaluate-model`` (``last``/``average``), ``loss-on`` (``batch``/``full``, the query's loss),
``num-partitions`` N (to validate m and the floor at construction).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.core.dual import (
    DRFA_REGULARIZERS,
    drfa_dual_ascent,
    drfa_loss_vector,
    drfa_prox_step,
)
from flowerdro.core.simplex import admit_partitions, floor_simplex, lambda_entropy
from flowerdro.strategies.base import (
    NUM_EXAMPLES,
    PARTITION_ID,
    FairStrategy,
    _mean_metrics,
    arrays_to_numpy,
    numpy_to_arrays,
)

__all__ = [
    "CLIENT_SAMPLINGS",
    "DRFA",
    "DRFAState",
    "REGULARIZERS",
    "SNAPSHOT_MODES",
    "DUAL_STEP_SCALES",
    "afl",
    "aggregation_coefficients",
    "combine_models",
    "dual_step",
    "sample_by_lambda",
    "sample_snapshot_steps",
    "sample_uniform",
]

REGULARIZERS: tuple[str, ...] = ("none", *DRFA_REGULARIZERS)
CLIENT_SAMPLINGS: tuple[str, ...] = ("lambda", "uniform")
SNAPSHOT_MODES: tuple[str, ...] = ("shared", "per-client")
DUAL_STEP_SCALES: tuple[str, ...] = ("paper", "public")
LAMBDA_INITS: tuple[str, ...] = ("uniform", "size")
MODEL_CHOICES: tuple[str, ...] = ("last", "average")
LOSS_ON: tuple[str, ...] = ("batch", "full")

TRAIN_TYPE, QUERY_TYPE = "train.drfa", "query.loss"


# =========================================================================== pure steps
def sample_by_lambda(rng: np.random.Generator, lam: np.ndarray, m: int, *, replace: bool = True) -> np.ndarray:
    r"""Draw D(s): ``m`` client indices with probabilities λ.

    With replacement the draws are i.i.d. with P(k = i) = λ_i, so
    E[(1/m) Σ_k w_k] = Σ_i λ_i w_i. Without replacement numpy's successive sampling is
    used and at most ``#{i: λ_i > 0}`` indices are returned.

    Parameters
    ----------
    rng : numpy.random.Generator
        The strategy's seeded generator.
    lam : numpy.ndarray, shape (N,)
        λ on the simplex.
    m : int
        Number of draws, ≥ 1.
    replace : bool (default: True)
        Sample with replacement (the paper).

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
    """Draw ``m`` of ``n`` client indices uniformly (U, and D(s) for ``client_sampling="uniform"``)."""
    return np.asarray(rng.choice(n, size=m if replace else min(m, n), replace=replace), dtype=np.int64)


def sample_snapshot_steps(rng: np.random.Generator, tau: int, k: int, *, mode: str = "shared") -> np.ndarray:
    """t′ ~ Uniform{1, …, τ}: one value repeated ``k`` times (``"shared"``) or ``k`` draws (``"per-client"``)."""
    if mode == "shared":
        return np.full(k, int(rng.integers(1, tau + 1)), dtype=np.int64)
    return rng.integers(1, tau + 1, size=k).astype(np.int64)


def aggregation_coefficients(
    draws: Sequence[int],
    answered: Sequence[int] | set[int],
    lam: np.ndarray,
    *,
    mode: str = "lambda",
) -> dict[int, float]:
    r"""Coefficients a_i of the update w̄(s+1) = w̄(s) + Σ_i a_i (w_i − w̄(s)).

    * ``"lambda"`` (D(s) drawn by λ): a_i = c_i / m′, with c_i the number of draws of
      client i and m′ = Σ_{i answered} c_i — the uniform average over the draws that
      answered (Σ a_i = 1, so w̄(s+1) = Σ_i a_i w_i).
    * ``"uniform"`` (D(s) drawn uniformly, public code): a_i = c_i λ_i N / m′; Σ a_i ≠ 1
      in general, E[Σ_i a_i (w_i − w̄)] = Σ_i λ_i (w_i − w̄), so E[w̄(s+1)] = Σ_i λ_i w_i.
    * ``"full"`` (every client once): a_i = λ_i / Σ_{j answered} λ_j, i.e. Σ_i λ_i w_i
      when everybody answered.

    Parameters
    ----------
    draws : sequence of int
        Client indices drawn (duplicates count).
    answered : collection of int
        Indices whose reply arrived and passed the checks.
    lam : numpy.ndarray, shape (N,)
        Current λ.
    mode : {"lambda", "uniform", "full"}

    Returns
    -------
    dict
        index → a_i for the answered indices (empty when nobody answered).
    """
    ok = set(int(i) for i in answered)
    counts = Counter(int(i) for i in draws if int(i) in ok)
    m_ans = sum(counts.values())
    if m_ans == 0:
        return {}
    n = len(lam)
    if mode == "lambda":
        return {i: c / m_ans for i, c in counts.items()}
    if mode == "uniform":
        return {i: c * float(lam[i]) * n / m_ans for i, c in counts.items()}
    if mode == "full":
        total = sum(float(lam[i]) for i in counts)
        if total <= 0.0:
            return {i: 1.0 / len(counts) for i in counts}
        return {i: float(lam[i]) / total for i in counts}
    raise ValueError(f"mode: unknown aggregation {mode!r}; allowed: lambda, uniform, full")


def combine_models(
    base: Sequence[np.ndarray], models: Mapping[int, Sequence[np.ndarray]], coefs: Mapping[int, float]
) -> list[np.ndarray]:
    """w̄ + Σ_i a_i (w_i − w̄), layer by layer (float64 accumulation, input dtypes kept)."""
    out = []
    for j, b in enumerate(base):
        b64 = np.asarray(b, dtype=np.float64)
        acc = b64.copy()
        for i, a in coefs.items():
            acc += a * (np.asarray(models[i][j], dtype=np.float64) - b64)
        out.append(acc.astype(np.asarray(b).dtype, copy=False))
    return out


def dual_step(
    lam: np.ndarray,
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

    v = drfa_loss_vector(N, U′, f) — v_i = (N/m′) Σ_{k∈U′} 1[k = i] f_i(w(t′)), m′ = |U′| —
    then λ⁺ = Π_Λ(λ + τγv) (``regularizer="none"``) or the exact prox step
    argmax_{u∈Λ} τ g(u) − (1/2γ)‖λ + γτv − u‖²; finally λ⁺ ← floor_simplex(λ⁺, floor)
    when ``floor > 0``. With ``scale="public"`` the step uses u = (m′/N) v and τ = 1
    instead (λ⁺ = Π_Λ(λ + γu), u_i = Σ_{k∈U′} 1[k = i] f_i: the public code's step).

    Returns
    -------
    numpy.ndarray, shape (N,)
        λ(s+1) on the simplex (every entry ≥ ``floor``).
    """
    if scale not in DUAL_STEP_SCALES:
        raise ValueError(f"scale: unknown value {scale!r}; allowed: {', '.join(DUAL_STEP_SCALES)}")
    v = drfa_loss_vector(len(lam), list(query_ids), list(losses))
    if scale == "public":
        v = v * (len(query_ids) / len(lam))
        tau = 1
    if regularizer == "none":
        new = drfa_dual_ascent(lam, v, tau, gamma)
    else:
        new = drfa_prox_step(lam, v, tau, gamma, regularizer, rho)
    if floor > 0.0:
        new = floor_simplex(new, floor)
    return new


# =========================================================================== the strategy
@dataclass
class DRFAState:
    """Server state of DRFA between rounds.

    Attributes
    ----------
    partitions : list of int
        Known partition ids, sorted; index k of λ is partition ``partitions[k]``.
    lam : numpy.ndarray
        λ(s), aligned with ``partitions``.
    dual_lr : float
        The current γ (after the decays so far).
    sizes : dict
        Partition id → local training-set size (``num-examples``), as learned.
    average : list of numpy.ndarray or None
        Running mean ŵ of the server iterates w̄(1..s).
    num_averaged : int
        Number of iterates in ``average``.
    """

    partitions: list[int] = field(default_factory=list)
    lam: np.ndarray = field(default_factory=lambda: np.zeros(0))
    dual_lr: float = 0.0
    sizes: dict[int, int] = field(default_factory=dict)
    average: list[np.ndarray] | None = None
    num_averaged: int = 0

    def lambda_by_partition(self) -> dict[int, float]:
        """λ as {partition id: weight}."""
        return {p: float(v) for p, v in zip(self.partitions, self.lam, strict=True)}


def _err(param: str, kebab: str, msg: str) -> ValueError:
    return ValueError(f"{param} ({kebab}): {msg}")


def _real(x: Any) -> float | None:
    """``x`` as a finite float, or None when it is not one (bools are not numbers here)."""
    if isinstance(x, bool):
        return None
    try:
        val = float(x)
    except (TypeError, ValueError):
        return None
    return val if math.isfinite(val) else None


def _count(x: Any) -> int | None:
    """``x`` as an int when it is an integral number, else None."""
    val = _real(x)
    return int(val) if val is not None and val == int(val) else None


class DRFA(FairStrategy):
    r"""Distributionally Robust Federated Averaging (Deng, Kamani, Mahdavi, NeurIPS 2020).

    Per round: D(s) ~ λ(s) (m draws), t′ ~ U{1..τ}; ``train.drfa`` → w̄(s+1) = mean_k w_k,
    w(t′) = mean_k w_k(t′); U ~ uniform (m draws); ``query.loss`` at w(t′) →
    v_i = (N/m) f_i(w(t′)); λ(s+1) = Π_Λ(λ(s) + τγv) or the DRFA-Prox step.
    See the module docstring for the full algorithm, options and protocol.

    Parameters
    ----------
    clients_per_round : int, optional
        m ≥ 1. Default: ``fraction_train``·N (at least ``min_train_nodes``).
    local_steps : int (default: 10)
        τ ≥ 1 local SGD steps per round.
    dual_lr : float (default: 8e-3)
        γ > 0, the dual step size.
    regularizer : {"none", "kl", "chi2", "l2"} (default: "none")
        g(λ) of DRFA-Prox; ``"none"`` is plain DRFA (projected ascent).
    rho : float (default: 0.0)
        ρ ≥ 0, strength of the regulariser.
    lr : float, optional
        Client step η > 0 sent in every ``train.drfa`` message (unset: the clients' config).
    batch_size : int, optional
        Minibatch size sent to the clients (unset: the clients' config).
    sample_with_replacement : bool (default: True)
        Draw D(s) with replacement (the paper); without, m ≤ N is required.
    client_sampling : {"lambda", "uniform"} (default: "lambda")
        How D(s) is drawn and weighted (see the module docstring).
    snapshot : {"shared", "per-client"} (default: "shared")
        One t′ for all sampled clients, or one each.
    dual_lr_decay : float (default: 1.0)
        γ ← γ·decay after every round, in (0, 1].
    lambda_floor : float (default: 0.0)
        λ_min in [0, 1/N]; 0 disables the floor.
    dual_step_scale : {"paper", "public"} (default: "paper")
        The λ step with Algorithm 1's factor τN/m′, or without it as the public code does.
    lambda_init : {"uniform", "size"} (default: "uniform")
        λ(0) uniform or proportional to the clients' training-set sizes.
    output_model : {"last", "average"} (default: "last")
        The model a run returns: w̄(S) or the averaged iterate ŵ.
    evaluate_model : {"last", "average"} (default: "last")
        The model the clients evaluate each round.
    query_loss_on : {"batch", "full"} (default: "batch")
        f_i(w(t′)) on one minibatch (the paper) or all local training data.
    full_participation : bool (default: False)
        Every client trains and reports its loss each round (AFL's full variant).
    num_partitions : int, optional
        N, when known in advance (validates m and the floor at construction).
    **kwargs
        Passed to :class:`~flowerdro.strategies.base.FairStrategy` (seed, output_dir, …).
    """

    name = "drfa"

    def __init__(
        self,
        *,
        clients_per_round: int | None = None,
        local_steps: int = 10,
        dual_lr: float = 8e-3,
        regularizer: str | None = "none",
        rho: float = 0.0,
        lr: float | None = None,
        batch_size: int | None = None,
        sample_with_replacement: bool = True,
        client_sampling: str = "lambda",
        snapshot: str = "shared",
        dual_lr_decay: float = 1.0,
        lambda_floor: float = 0.0,
        dual_step_scale: str = "paper",
        lambda_init: str = "uniform",
        output_model: str = "last",
        evaluate_model: str = "last",
        query_loss_on: str = "batch",
        full_participation: bool = False,
        num_partitions: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("run_name", self.name)
        super().__init__(**kwargs)
        regularizer = "none" if regularizer is None else str(regularizer)
        if clients_per_round is not None and (_count(clients_per_round) is None or clients_per_round < 1):
            raise _err("clients_per_round", "clients-per-round", f"m must be an integer >= 1, got {clients_per_round!r}")
        if _count(local_steps) is None or local_steps < 1:
            raise _err("local_steps", "local-steps", f"τ must be an integer >= 1, got {local_steps!r}")
        if _real(dual_lr) is None or dual_lr <= 0:
            raise _err("dual_lr", "dual-lr", f"γ must be a finite number > 0, got {dual_lr!r}")
        if regularizer not in REGULARIZERS:
            raise _err("regularizer", "regularizer",
                       f"unknown regulariser {regularizer!r}; allowed: {', '.join(REGULARIZERS)}")
        if _real(rho) is None or rho < 0:
            raise _err("rho", "rho", f"ρ must be a finite number >= 0, got {rho!r}")
        if lr is not None and (_real(lr) is None or lr <= 0):
            raise _err("lr", "lr", f"η must be a finite number > 0, got {lr!r}")
        if batch_size is not None and (_count(batch_size) is None or batch_size < 1):
            raise _err("batch_size", "batch-size", f"must be an integer >= 1, got {batch_size!r}")
        for value, allowed, param, kebab in (
            (client_sampling, CLIENT_SAMPLINGS, "client_sampling", "client-sampling"),
            (snapshot, SNAPSHOT_MODES, "snapshot", "snapshot"),
            (dual_step_scale, DUAL_STEP_SCALES, "dual_step_scale", "dual-step-scale"),
            (lambda_init, LAMBDA_INITS, "lambda_init", "lambda-init"),
            (output_model, MODEL_CHOICES, "output_model", "output-model"),
            (evaluate_model, MODEL_CHOICES, "evaluate_model", "evaluate-model"),
            (query_loss_on, LOSS_ON, "query_loss_on", "loss-on"),
        ):
            if value not in allowed:
                raise _err(param, kebab, f"unknown value {value!r}; allowed: {', '.join(allowed)}")
        if _real(dual_lr_decay) is None or not 0.0 < dual_lr_decay <= 1.0:
            raise _err("dual_lr_decay", "dual-lr-decay", f"must be in (0, 1], got {dual_lr_decay!r}")
        if num_partitions is not None and (_count(num_partitions) is None or num_partitions < 1):
            raise _err("num_partitions", "num-partitions", f"N must be an integer >= 1, got {num_partitions!r}")
        if _real(lambda_floor) is None or not 0.0 <= lambda_floor <= 1.0:
            raise _err("lambda_floor", "lambda-floor", f"must be in [0, 1/N], got {lambda_floor!r}")
        self.clients_per_round = None if clients_per_round is None else int(clients_per_round)
        self.local_steps = int(local_steps)
        self.dual_lr = float(dual_lr)
        self.regularizer = regularizer
        self.rho = float(rho)
        self.lr = None if lr is None else float(lr)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.sample_with_replacement = bool(sample_with_replacement)
        self.client_sampling = client_sampling
        self.snapshot = snapshot
        self.dual_lr_decay = float(dual_lr_decay)
        self.lambda_floor = float(lambda_floor)
        self.dual_step_scale = dual_step_scale
        self.lambda_init = lambda_init
        self.output_model = output_model
        self.evaluate_model = evaluate_model
        self.query_loss_on = query_loss_on
        self.full_participation = bool(full_participation)
        self.num_partitions = None if num_partitions is None else int(num_partitions)
        if self.num_partitions is not None:
            self._check_against_n(self.num_partitions)
        self.state = DRFAState(dual_lr=self.dual_lr)
        self._extras: dict[str, Any] = {}

    # ------------------------------------------------------------------ settings
    def settings(self) -> dict[str, Any]:  # noqa: D102
        out = super().settings()
        out.update({
            "clients_per_round": self.clients_per_round,
            "local_steps": self.local_steps,
            "dual_lr": self.dual_lr,
            "regularizer": self.regularizer,
            "rho": self.rho,
            "lr": self.lr,
            "batch_size": self.batch_size,
            "sample_with_replacement": self.sample_with_replacement,
            "client_sampling": self.client_sampling,
            "snapshot": self.snapshot,
            "dual_lr_decay": self.dual_lr_decay,
            "lambda_floor": self.lambda_floor,
            "dual_step_scale": self.dual_step_scale,
            "lambda_init": self.lambda_init,
            "output_model": self.output_model,
            "evaluate_model": self.evaluate_model,
            "query_loss_on": self.query_loss_on,
            "full_participation": self.full_participation,
            "num_partitions": self.num_partitions,
        })
        return out

    def _check_against_n(self, n: int) -> None:
        """Checks that need N: m ≤ N without replacement, floor ≤ 1/N."""
        m = self.clients_per_round
        if m is not None and not self.sample_with_replacement and not self.full_participation and m > n:
            raise _err("clients_per_round", "clients-per-round",
                       f"m = {m} > N = {n} clients without replacement; set sample-with-replacement = true "
                       f"or m <= {n}")
        if self.lambda_floor * n > 1.0 + 1e-12:
            raise _err("lambda_floor", "lambda-floor", f"must be in [0, 1/N] = [0, {1.0 / n:.6g}], "
                       f"got {self.lambda_floor} with N = {n}")

    def num_sampled(self, n: int) -> int:
        """m for N = ``n`` clients: ``clients_per_round``, else the base's fraction rule."""
        if self.full_participation:
            return n
        return self.clients_per_round if self.clients_per_round is not None else self.num_train_nodes(n)

    # ------------------------------------------------------------------ λ bookkeeping
    @property
    def lam(self) -> dict[int, float]:
        """λ(s) as {partition id: weight}."""
        return self.state.lambda_by_partition()

    def _init_lambda(self, pids: list[int]) -> None:
        st = self.state
        st.partitions = sorted(pids)
        n = len(st.partitions)
        self._check_against_n(n)
        if self.lambda_init == "size" and st.sizes:
            mean = float(np.mean(list(st.sizes.values())))
            w = np.array([float(st.sizes.get(p, mean)) for p in st.partitions])
            lam = w / w.sum()
        else:
            lam = np.full(n, 1.0 / n)
        st.lam = floor_simplex(lam, self.lambda_floor) if self.lambda_floor > 0 else lam
        log(INFO, "[%s] λ initialised (%s) over N = %d partitions", self.run_name, self.lambda_init, n)

    def _add_partitions(self, new: list[int]) -> None:
        st = self.state
        st.partitions, st.lam = admit_partitions(st.partitions, st.lam, new)
        for pid in sorted(new):
            log(INFO, "[%s] partition %d joined: N = %d", self.run_name, pid, len(st.partitions))
        self._check_against_n(len(st.partitions))
        if self.lambda_floor > 0:
            st.lam = floor_simplex(st.lam, self.lambda_floor)

    def _partition_nodes(self, nodes: Sequence[int]) -> dict[int, int]:
        """Partition id → connected node id, from the map learned from replies."""
        connected = set(int(n) for n in nodes)
        return {pid: nid for nid, pid in self.node_to_partition.items() if nid in connected}

    def _discover(self, grid: Grid, arrays: ArrayRecord, nodes: Sequence[int], config: ConfigRecord,
                  server_round: int) -> None:
        """``query.loss`` to connected nodes whose partition is unknown (learns the map and sizes)."""
        unknown = [n for n in nodes if int(n) not in self.node_to_partition]
        if not unknown:
            return
        cfg = self._query_config(config, server_round)
        cfg["loss-on"] = "full" if self.lambda_init == "size" and not self.state.partitions else "batch"
        msgs = self.build_messages(unknown, RecordDict({"arrays": arrays, "config": cfg}), QUERY_TYPE)
        for reply in self.communicate(grid, msgs, phase="discover"):
            mr = reply.content.metric_records.get("metrics") or next(iter(reply.content.metric_records.values()))
            if cfg["loss-on"] == "full":
                self.state.sizes[int(mr[PARTITION_ID])] = int(mr[NUM_EXAMPLES])

    def _sync_partitions(self) -> None:
        known = set(self.node_to_partition.values())
        if not self.state.partitions:
            pids = set(range(self.num_partitions)) if self.num_partitions is not None else known
            extra = known - pids
            if extra:
                log(WARNING, "[%s] partitions %s are outside num-partitions = %s; added", self.run_name,
                    sorted(extra), self.num_partitions)
            if pids | extra:
                self._init_lambda(sorted(pids | extra))
        else:
            new = sorted(known - set(self.state.partitions))
            if new:
                self._add_partitions(new)

    # ------------------------------------------------------------------ configs
    def _train_config(self, config: ConfigRecord, server_round: int, t_prime: int) -> ConfigRecord:
        cfg = ConfigRecord(dict(config))
        cfg["server-round"] = server_round
        cfg["local-steps"] = self.local_steps
        cfg["snapshot-step"] = int(t_prime)
        if "local-epochs" in cfg:
            cfg["local-epochs"] = 0.0  # τ must be exact: steps, never epochs
        if self.lr is not None:
            cfg["lr"] = self.lr
        if self.batch_size is not None:
            cfg["batch-size"] = self.batch_size
        if "seed" not in cfg:
            cfg["seed"] = self.seed
        return cfg

    def _query_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        cfg = ConfigRecord({k: config[k] for k in ("batch-size", "seed") if k in config})
        cfg["server-round"] = server_round
        cfg["loss-on"] = self.query_loss_on
        if self.batch_size is not None:
            cfg["batch-size"] = self.batch_size
        if "seed" not in cfg:
            cfg["seed"] = self.seed
        return cfg

    # ------------------------------------------------------------------ one round
    def train_round(
        self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
    ) -> tuple[ArrayRecord, MetricRecord | None]:
        """One DRFA round: train phase on D(s), loss query on U, λ step (see the class docstring)."""
        st = self.state
        nodes = self.nodes(grid)
        self._discover(grid, arrays, nodes, config, server_round)
        self._sync_partitions()
        self._extras = {}
        if not st.partitions:
            log(WARNING, "[%s] round %d: no partition known yet (every discovery reply failed); model kept",
                self.run_name, server_round)
            self._extras["dual_step"] = "skipped: no partition known"
            self._end_round(arrays)
            return arrays, None
        n = len(st.partitions)
        index_of = {p: k for k, p in enumerate(st.partitions)}
        node_of = self._partition_nodes(nodes)
        m = self.num_sampled(n)

        # 1. D(s) and t′
        if self.full_participation:
            draws = np.arange(n, dtype=np.int64)
        elif self.client_sampling == "lambda":
            draws = sample_by_lambda(self.rng, st.lam, m, replace=self.sample_with_replacement)
        else:
            draws = sample_uniform(self.rng, n, m, replace=self.sample_with_replacement)
        distinct = sorted(set(int(i) for i in draws))
        t_primes = sample_snapshot_steps(self.rng, self.local_steps, len(distinct), mode=self.snapshot)
        t_of = dict(zip(distinct, (int(t) for t in t_primes), strict=True))
        absent = [st.partitions[i] for i in distinct if st.partitions[i] not in node_of]
        targets = {node_of[st.partitions[i]]: i for i in distinct if st.partitions[i] in node_of}
        self._extras.update({
            "sampled": [st.partitions[i] for i in draws],
            "snapshot_step": (int(t_primes[0]) if self.snapshot == "shared" and len(t_primes)
                              else {str(st.partitions[i]): t for i, t in t_of.items()}),
        })
        if absent:
            log(WARNING, "[%s] round %d: sampled partitions %s have no connected node; skipped",
                self.run_name, server_round, absent)
            self._extras["absent"] = absent

        # 2. train.drfa to each distinct sampled client
        msgs = self.build_messages(
            list(targets),
            lambda nid: RecordDict({"arrays": arrays,
                                    "config": self._train_config(config, server_round, t_of[targets[nid]])}),
            TRAIN_TYPE,
        )
        replies = self.communicate(grid, msgs, phase="train", reference=arrays, array_keys=("arrays", "snapshot"))
        finals: dict[int, list[np.ndarray]] = {}
        snaps: dict[int, list[np.ndarray]] = {}
        for r in replies:
            mr = r.content.metric_records.get("metrics") or next(iter(r.content.metric_records.values()))
            pid = int(mr[PARTITION_ID])
            if pid not in index_of:
                continue
            st.sizes[pid] = int(mr[NUM_EXAMPLES])
            finals[index_of[pid]] = arrays_to_numpy(r.content["arrays"])
            snaps[index_of[pid]] = arrays_to_numpy(r.content["snapshot"])

        mode = "full" if self.full_participation else self.client_sampling
        coefs = aggregation_coefficients(draws, finals.keys(), st.lam, mode=mode)
        keys = list(arrays.keys())
        if not coefs:
            log(WARNING, "[%s] round %d: no valid train.drfa reply; model kept, λ step skipped",
                self.run_name, server_round)
            self._extras["dual_step"] = "skipped: no train reply"
            self._end_round(arrays)
            return arrays, None

        # 3. w̄(s+1) and w(t′)
        base = arrays_to_numpy(arrays)
        new_arrays = numpy_to_arrays(keys, combine_models(base, finals, coefs))
        snap_arrays = numpy_to_arrays(keys, combine_models(base, snaps, coefs))

        # 4. U and the loss query at w(t′)
        if self.full_participation:
            queried = np.arange(n, dtype=np.int64)
        else:
            queried = sample_uniform(self.rng, n, m, replace=True)
        q_targets = {node_of[st.partitions[i]]: int(i) for i in set(int(k) for k in queried)
                     if st.partitions[i] in node_of}
        qcontent = RecordDict({"arrays": snap_arrays, "config": self._query_config(config, server_round)})
        qreplies = self.communicate(grid, self.build_messages(list(q_targets), qcontent, QUERY_TYPE),
                                    phase="query", required_metrics=("loss",))
        loss_of: dict[int, float] = {}
        for r in qreplies:
            mr = r.content.metric_records.get("metrics") or next(iter(r.content.metric_records.values()))
            pid = int(mr[PARTITION_ID])
            if pid in index_of:
                loss_of[index_of[pid]] = float(mr["loss"])
        ids = [int(i) for i in queried if int(i) in loss_of]
        self._extras["queried"] = [st.partitions[i] for i in queried]

        # 5. λ step
        if ids:
            st.lam = dual_step(st.lam, ids, [loss_of[i] for i in ids], tau=self.local_steps, gamma=st.dual_lr,
                               regularizer=self.regularizer, rho=self.rho, floor=self.lambda_floor,
                               scale=self.dual_step_scale)
            self._extras["dual_step"] = f"{len(ids)}/{len(queried)} losses"
            self._extras["query_loss"] = {str(st.partitions[i]): loss_of[i] for i in sorted(loss_of)}
        else:
            log(WARNING, "[%s] round %d: no valid query.loss reply; λ step skipped", self.run_name, server_round)
            self._extras["dual_step"] = "skipped: no loss reply"
        self._end_round(new_arrays)
        metrics = _mean_metrics([r.content for r in replies])
        return new_arrays, metrics

    def _end_round(self, arrays: ArrayRecord) -> None:
        st = self.state
        self._extras["dual_lr"] = st.dual_lr
        st.dual_lr *= self.dual_lr_decay
        cur = [np.asarray(a, dtype=np.float64) for a in arrays_to_numpy(arrays)]
        st.num_averaged += 1
        if st.average is None:
            st.average = cur
        else:
            k = st.num_averaged
            st.average = [a + (c - a) / k for a, c in zip(st.average, cur, strict=True)]
        self._avg_keys = list(arrays.keys())
        self._avg_dtypes = [a.dtype for a in arrays_to_numpy(arrays)]

    def averaged_arrays(self) -> ArrayRecord | None:
        """ŵ = (1/S) Σ_{s=1}^{S} w̄(s), or None before the first round."""
        st = self.state
        if st.average is None:
            return None
        return numpy_to_arrays(self._avg_keys, [a.astype(d) for a, d in zip(st.average, self._avg_dtypes,
                                                                              strict=True)])

    # ------------------------------------------------------------------ base hooks
    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """w̄(s) (default) or ŵ with ``evaluate_model="average"``."""
        if self.evaluate_model == "average":
            avg = self.averaged_arrays()
            return avg if avg is not None else arrays
        return arrays

    def output_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """w̄(S) (default) or ŵ with ``output_model="average"``."""
        if self.output_model == "average":
            avg = self.averaged_arrays()
            return avg if avg is not None else arrays
        return arrays

    def round_extras(self) -> dict[str, Any]:
        """λ keyed by partition id (as strings, like ``client_acc``), its entropy, γ and the draws."""
        out: dict[str, Any] = {
            "lambda": {str(p): float(v) for p, v in zip(self.state.partitions, self.state.lam, strict=True)},
            "lambda_entropy": lambda_entropy(self.state.lam),
        }
        out.update(self._extras)
        return out


def afl(**kwargs: Any) -> DRFA:
    """AFL (Mohri et al. 2019) as DRFA with τ = 1 (any ``local_steps`` given is overridden)."""
    kwargs["local_steps"] = 1
    kwargs.setdefault("run_name", "afl")
    strat = DRFA(**kwargs)
    strat.name = "afl"
    return strat

