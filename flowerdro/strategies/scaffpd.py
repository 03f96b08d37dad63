r"""SCAFF-PD as a Flower Message-API strategy.

Y. Yu, S. P. Karimireddy, Y. Ma, M. I. Jordan, "Scaff-PD: Communication Efficient Fair
and Robust Federated Learning", 2023, https://arxiv.org/abs/2307.13381 (Algorithm 1:
accelerated primal-dual server loop; Algorithm 2: bias-corrected local steps).

Problem, over N clients with losses f_i and weights λ ∈ Λ:

.. math::

    \min_x \max_{\lambda \in \Lambda}\ \sum_i \lambda_i f_i(x) - \psi(\lambda),

with (``objective``) ``"chi2"``: ψ(λ) = (ρ/2N) Σ_i (Nλ_i − 1)², Λ = Δ_N; ``"afl"``: ψ = 0,
Λ = Δ_N (χ² with ρ = 0); ``"cvar"``: ψ = 0, Λ = {λ ∈ Δ_N : λ_i ≤ 1/(αN)}.

One round r (paper symbols; the code's names in brackets), full participation:

1. ``query.loss_grad`` to every client at x^r: L_i = f_i(x^r) and c_i = g_i(x^r) (full-batch
   or one minibatch [``grad_on``]); the client keeps c_i.
2. s^r = (1 + θ_r) L^r − θ_r L^{r−1} (L^{−1} = L^0) and the exact proximal dual step
   λ^{r+1} = argmin_{λ∈Λ} ψ(λ) − ⟨s^r, λ⟩ + (1/2σ_r)‖λ − λ^r‖²
   (:func:`flowerdro.core.dual.scaffpd_extrapolate`, :func:`~flowerdro.core.dual.scaffpd_dual_step`);
   c^r = Σ_i λ_i^{r+1} c_i.
3. ``train.scaffpd`` with x^r and c^r: J [``local_steps``] steps
   u ← u − η_l (g_i(u) − c_i + c^r) [``lr``]; the client returns u_J and the server forms
   Δu_i = (x^r − u_J)/(η_l J).
4. x^{r+1} = x^r − τ_r Σ_i λ_i^{r+1} Δu_i.

Step sizes (τ_r [``primal_lr``], σ_r [``dual_lr``], θ_r [``theta``]), chosen by
``step_rule``:

* ``"5.2"`` (Condition 5.2, constant): τ_r = τ, σ_r = σ, θ_r = θ. Default
  θ = max(1/(1 + μ_x τ), 1/(1 + μ_y σ)) when μ_x > 0 and μ_y > 0 (the linear rate of
  accelerated primal-dual for strongly-convex–strongly-concave problems), else θ = 1;
  μ_y = ρN is the strong convexity of ψ (χ²), 0 for AFL and CVaR.
* ``"5.1"`` (Condition 5.1, strongly-convex–concave): from τ_0 and γ_0 [``gamma``],
  σ_r = γ_r τ_r, θ_r = σ_{r−1}/σ_r (θ_0 unused), γ_{r+1} = γ_r (1 + μ_x τ_r) and
  τ_{r+1} = τ_r √(γ_r/γ_{r+1}) (so σ_r τ_r = γ_0 τ_0² stays constant; Chambolle & Pock
  2011, Alg. 2; Hamedani & Aybat 2021). With μ_x = 0 it is rule 5.2 with θ = 1.

What the user gives, and the defaults: μ_x [``mu_x``] (0; the strong convexity of every
f_i, e.g. the weight decay), η_l [``lr``] (0.01) and J [``local_steps``] (10), the client
step and number of local steps; τ_0 [``primal_lr``] (default η_l·J, i.e. the server
applies the λ-weighted average of the local models, x^{r+1} = Σ_i λ_i^{r+1} u_J^i);
σ_0 [``dual_lr``] (0.1) or, for rule 5.1, γ_0 [``gamma``] (default σ_0/τ_0). For the
usual primal-dual stability τσ‖∇L‖² ≲ 1 (‖∇L‖ the Lipschitz constant of x ↦ L(x)),
lower σ when λ oscillates.

Failures (``on_failure``)
-------------------------
The strategy keeps every client's last (L_i, c_i). Let K be the clients whose loss is
known this round:

* ``"reuse"`` (default): a client that fails phase 1 keeps its last L_i and c_i (stale,
  as in SAG), so K is every client heard from at least once. It is not sent
  ``train.scaffpd`` (it holds no c_i of this round). A client of K with no valid phase-2
  reply (failed in phase 1 or in phase 2) gets Δu_i := c^r, the first-order value of its
  corrected local update (u_t ≈ x^r ⇒ g_i(u_t) − c_i + c^r ≈ c^r). At a saddle point
  c^r = 0 and every Δu_i = 0, so x* stays a fixed point: with deterministic gradients
  SCAFF-PD still converges to the exact saddle point when some client always fails
  phase 2.
* ``"exclude"``: K is the clients that answered phase 1 this round, and only the clients
  that answered phase 2 enter step 4, with λ renormalised over them.

When K is not every client, the dual step runs on the sub-vector: with M = Σ_{i∈K} λ_i^r,
λ_K^{r+1} = M · step(λ_K^r/M, s_K) (ψ, Λ taken over the |K| clients), the other λ_i stay;
c^r and step 4 use λ^{r+1} renormalised over K (resp. over the phase-2 answers). A client
never heard from is outside K. If K is empty, or (``"exclude"``) no phase-2 reply is valid,
the model is kept (with ``"exclude"`` the λ step of phase 1 still happens).

Message protocol
----------------
``query.loss_grad`` — content ``arrays`` (x^r), ``config``: ``grad-on``, ``batch-size``,
``seed``, ``server-round`` (+ the run's client keys such as ``weight-decay``). Reply:
``metrics`` {``loss``, ``num-examples``, ``partition-id``}, ArrayRecord ``grad`` (c_i).
``train.scaffpd`` — content ``arrays`` (x^r), ``control`` (c^r), ``config``: ``lr``,
``local-steps``, ``batch-size``, ``seed``, ``server-round``. Reply: ``arrays`` (u_J),
``metrics`` {``num-examples``, ``partition-id``, ``train_loss_local``, ``local-steps``}.
See :mod:`flowerdro.clients.scaffpd`.

Run-config keys (factory ``"scaffpd"``)
---------------------------------------
``objective`` (chi2), ``rho`` ρ (0.1), ``cvar-alpha`` α (0.5), ``local-steps`` J (10),
``lr`` η_l (0.01), ``batch-size`` (clients' default when unset), ``step-rule`` (5.2),
``primal-lr`` τ_0 (η_l·J), ``dual-lr`` σ_0 (0.1), ``gamma`` γ_0 (σ_0/τ_0), ``theta`` θ
(auto), ``mu-x`` μ_x (``weight-decay``, else 0), ``grad-on`` (full), ``on-failure``
(reuse), ``num-partitions`` N, ``eval-metric`` (``test_loss`` for a regression data set,
else ``test_acc``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.core.dual import SCAFFPD_OBJECTIVES, scaffpd_dual_step, scaffpd_extrapolate
from flowerdro.core.simplex import admit_partitions
from flowerdro.strategies.base import (
    PARTITION_ID,
    FairStrategy,
    _mean_metrics,
    arrays_to_numpy,
    numpy_to_arrays,
)

QUERY_TYPE, TRAIN_TYPE = "query.loss_grad", "train.scaffpd"
STEP_RULES: tuple[str, ...] = ("5.1", "5.2")
GRAD_ON: tuple[str, ...] = ("full", "batch")
FAILURE_POLICIES: tuple[str, ...] = ("reuse", "exclude")


def _metrics_of(reply: Message) -> Any:
    return reply.content.metric_records.get("metrics") or next(iter(reply.content.metric_records.values()))


def _finite(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


@dataclass
class StepSizes:
    r"""The step-size schedule of SCAFF-PD (Conditions 5.1 and 5.2).

    Attributes
    ----------
    rule : {"5.1", "5.2"}
        Which condition.
    tau, sigma, theta : float
        τ_r, σ_r, θ_r of the current round.
    gamma : float
        γ_r (rule 5.1; σ_r = γ_r τ_r).
    mu_x : float
        μ_x ≥ 0.
    """

    rule: str
    tau: float
    sigma: float
    theta: float
    gamma: float
    mu_x: float
    round: int = 0

    def advance(self) -> None:
        r"""Move to round r + 1.

        Rule 5.1: γ_{r+1} = γ_r(1 + μ_x τ_r), τ_{r+1} = τ_r √(γ_r/γ_{r+1}),
        σ_{r+1} = γ_{r+1} τ_{r+1}, θ_{r+1} = σ_r/σ_{r+1}. Rule 5.2: unchanged.
        """
        self.round += 1
        if self.rule != "5.1":
            return
        gamma_next = self.gamma * (1.0 + self.mu_x * self.tau)
        tau_next = self.tau * math.sqrt(self.gamma / gamma_next)
        sigma_next = gamma_next * tau_next
        self.theta = self.sigma / sigma_next
        self.gamma, self.tau, self.sigma = gamma_next, tau_next, sigma_next


@dataclass
class SCAFFPDState:
    """What the server keeps between rounds.

    Attributes
    ----------
    partitions : list of int
        Partition ids, sorted; position k holds λ_k.
    lam : numpy.ndarray
        λ^r over ``partitions``.
    loss_prev : dict
        Partition id → L_i^{r−1} (the loss vector of the previous round, for s^r).
    memory : dict
        Partition id → (L_i, c_i) of the last round the client answered phase 1.
    """

    partitions: list[int] = field(default_factory=list)
    lam: np.ndarray = field(default_factory=lambda: np.zeros(0))
    loss_prev: dict[int, float] = field(default_factory=dict)
    memory: dict[int, tuple[float, list[np.ndarray]]] = field(default_factory=dict)


class SCAFFPD(FairStrategy):
    r"""SCAFF-PD (Yu, Karimireddy, Ma, Jordan 2023): accelerated primal-dual with control variates.

    Per round: L_i, c_i at x^r (``query.loss_grad``); s^r = (1+θ_r)L^r − θ_r L^{r−1};
    λ^{r+1} = prox_{σ_r ψ}(λ^r + σ_r s^r) on Λ; c^r = Σλ_i^{r+1} c_i; J local steps
    u ← u − η_l(g_i(u) − c_i + c^r) (``train.scaffpd``); x^{r+1} = x^r − τ_r Σλ_i^{r+1} Δu_i,
    Δu_i = (x^r − u_J^i)/(η_l J). See the module docstring for step sizes, failures and
    the protocol.

    Parameters
    ----------
    objective : {"chi2", "afl", "cvar"} (default: "chi2")
        ψ and Λ.
    rho : float (default: 0.1)
        ρ ≥ 0 of the χ² penalty.
    alpha : float (default: 0.5)
        CVaR level α ∈ (0, 1] (checked for every objective, used by ``"cvar"``).
    local_steps : int (default: 10)
        J ≥ 1.
    lr : float (default: 0.01)
        η_l > 0, the clients' local step.
    batch_size : int, optional
        Minibatch size of the local steps and of ``grad_on="batch"`` (unset: the clients'
        config). A size ≥ m_i gives full-batch (deterministic) local steps.
    step_rule : {"5.1", "5.2"} (default: "5.2")
        Step-size rule (see the module docstring).
    primal_lr : float, optional
        τ_0 > 0 (default η_l·J).
    dual_lr : float (default: 0.1)
        σ_0 > 0.
    gamma : float, optional
        γ_0 > 0 of rule 5.1 (default σ_0/τ_0).
    theta : float, optional
        θ ≥ 0 of rule 5.2 (default: see the module docstring).
    mu_x : float (default: 0.0)
        μ_x ≥ 0, strong convexity of the f_i.
    grad_on : {"full", "batch"} (default: "full")
        c_i on all local data or one minibatch.
    on_failure : {"reuse", "exclude"} (default: "reuse")
        Failure policy.
    num_partitions : int, optional
        N when known (λ starts uniform over 0..N−1; else over the partitions of round 1).
    **kwargs
        Passed to :class:`~flowerdro.strategies.base.FairStrategy`.
    """

    name = "scaffpd"

    def __init__(
        self,
        *,
        objective: str = "chi2",
        rho: float = 0.1,
        alpha: float = 0.5,
        local_steps: int = 10,
        lr: float = 0.01,
        batch_size: int | None = None,
        step_rule: str = "5.2",
        primal_lr: float | None = None,
        dual_lr: float = 0.1,
        gamma: float | None = None,
        theta: float | None = None,
        mu_x: float = 0.0,
        grad_on: str = "full",
        on_failure: str = "reuse",
        num_partitions: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("run_name", self.name)
        super().__init__(**kwargs)
        if objective not in SCAFFPD_OBJECTIVES:
            raise ValueError(f"objective: unknown objective {objective!r}; allowed: {', '.join(SCAFFPD_OBJECTIVES)}")
        if not _finite(rho) or rho < 0:
            raise ValueError(f"rho: ρ must be a finite number >= 0, got {rho!r}")
        if not _finite(alpha) or not 0.0 < alpha <= 1.0:
            raise ValueError(f"cvar-alpha: α must be in (0, 1], got {alpha!r}")
        if isinstance(local_steps, bool) or not _finite(local_steps) or int(local_steps) != local_steps \
                or local_steps < 1:
            raise ValueError(f"local-steps: J must be an integer >= 1, got {local_steps!r}")
        for value, key, sym in ((lr, "lr", "η_l"), (dual_lr, "dual-lr", "σ")):
            if not _finite(value) or value <= 0:
                raise ValueError(f"{key}: {sym} must be a finite number > 0, got {value!r}")
        for value, key, sym in ((primal_lr, "primal-lr", "τ"), (gamma, "gamma", "γ_0")):
            if value is not None and (not _finite(value) or value <= 0):
                raise ValueError(f"{key}: {sym} must be a finite number > 0, got {value!r}")
        if theta is not None and (not _finite(theta) or theta < 0):
            raise ValueError(f"theta: θ must be a finite number >= 0, got {theta!r}")
        if not _finite(mu_x) or mu_x < 0:
            raise ValueError(f"mu-x: μ_x must be a finite number >= 0, got {mu_x!r}")
        if batch_size is not None and (not _finite(batch_size) or int(batch_size) != batch_size or batch_size < 1):
            raise ValueError(f"batch-size: must be an integer >= 1, got {batch_size!r}")
        if step_rule not in STEP_RULES:
            raise ValueError(f"step-rule: unknown rule {step_rule!r}; allowed: {', '.join(STEP_RULES)}")
        if grad_on not in GRAD_ON:
            raise ValueError(f"grad-on: unknown value {grad_on!r}; allowed: {', '.join(GRAD_ON)}")
        if on_failure not in FAILURE_POLICIES:
            raise ValueError(f"on-failure: unknown policy {on_failure!r}; allowed: {', '.join(FAILURE_POLICIES)}")
        if num_partitions is not None and (not _finite(num_partitions) or int(num_partitions) != num_partitions
                                           or num_partitions < 1):
            raise ValueError(f"num-partitions: N must be an integer >= 1, got {num_partitions!r}")
        self.objective = objective
        self.rho = float(rho)
        self.alpha = float(alpha)
        self.local_steps = int(local_steps)
        self.lr = float(lr)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.step_rule = step_rule
        self.primal_lr = float(primal_lr) if primal_lr is not None else self.lr * self.local_steps
        self.dual_lr = float(dual_lr)
        self.gamma = float(gamma) if gamma is not None else self.dual_lr / self.primal_lr
        self.theta = None if theta is None else float(theta)
        self.mu_x = float(mu_x)
        self.grad_on = grad_on
        self.on_failure = on_failure
        self.num_partitions = None if num_partitions is None else int(num_partitions)
        self.state = SCAFFPDState()
        self.steps: StepSizes | None = None
        self._extras: dict[str, Any] = {}

    # ------------------------------------------------------------------ settings
    def settings(self) -> dict[str, Any]:  # noqa: D102
        out = super().settings()
        out.update({
            "objective": self.objective, "rho": self.rho, "alpha": self.alpha, "local_steps": self.local_steps,
            "lr": self.lr, "batch_size": self.batch_size, "step_rule": self.step_rule,
            "primal_lr": self.primal_lr, "dual_lr": self.dual_lr, "gamma": self.gamma, "theta": self.theta,
            "mu_x": self.mu_x, "grad_on": self.grad_on, "on_failure": self.on_failure,
            "num_partitions": self.num_partitions, "eval_metric": self.eval_metric,
        })
        return out

    def mu_y(self, n: int) -> float:
        """Strong convexity of ψ on the simplex: ρN for χ², 0 for AFL and CVaR."""
        return self.rho * n if self.objective == "chi2" else 0.0

    def _init_steps(self, n: int) -> StepSizes:
        if self.step_rule == "5.1":
            return StepSizes("5.1", self.primal_lr, self.gamma * self.primal_lr, 1.0, self.gamma, self.mu_x)
        theta = self.theta
        if theta is None:
            mu_y = self.mu_y(n)
            theta = (max(1.0 / (1.0 + self.mu_x * self.primal_lr), 1.0 / (1.0 + mu_y * self.dual_lr))
                     if self.mu_x > 0 and mu_y > 0 else 1.0)
        return StepSizes("5.2", self.primal_lr, self.dual_lr, theta, self.dual_lr / self.primal_lr, self.mu_x)

    # ------------------------------------------------------------------ λ bookkeeping
    @property
    def lam(self) -> dict[int, float]:
        """λ^r as {partition id: weight}."""
        return {p: float(v) for p, v in zip(self.state.partitions, self.state.lam, strict=True)}

    def _sync_partitions(self, heard: set[int]) -> None:
        st = self.state
        if not st.partitions:
            pids = set(range(self.num_partitions)) if self.num_partitions is not None else set()
            pids |= heard
            if pids:
                st.partitions = sorted(pids)
                st.lam = np.full(len(pids), 1.0 / len(pids))
                log(INFO, "[%s] λ initialised uniform over N = %d partitions", self.run_name, len(pids))
            return
        st.partitions, st.lam = admit_partitions(st.partitions, st.lam, heard - set(st.partitions))

    # ------------------------------------------------------------------ configs
    def _config(self, config: ConfigRecord, server_round: int, *, train: bool) -> ConfigRecord:
        cfg = ConfigRecord(dict(config))
        cfg["server-round"] = server_round
        if "seed" not in cfg:
            cfg["seed"] = self.seed
        if self.batch_size is not None:
            cfg["batch-size"] = self.batch_size
        if train:
            cfg["lr"] = self.lr
            cfg["local-steps"] = self.local_steps
            if "local-epochs" in cfg:
                cfg["local-epochs"] = 0.0  # J must be exact
        else:
            cfg["grad-on"] = self.grad_on
        return cfg

    # ------------------------------------------------------------------ one round
    def dual_update(self, lam: np.ndarray, s: np.ndarray, sigma: float) -> np.ndarray:
        """λ^{r+1} = argmin_{λ∈Λ} ψ(λ) − ⟨s, λ⟩ + (1/2σ)‖λ − λ^r‖² (one exact prox step)."""
        return scaffpd_dual_step(lam, s, sigma, self.objective, rho=self.rho, alpha=self.alpha)

    def train_round(
        self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
    ) -> tuple[ArrayRecord, MetricRecord | None]:
        """One SCAFF-PD round: loss/gradient query, dual step, corrected local steps, primal step."""
        st = self.state
        self._extras = {}
        nodes = self.nodes(grid)
        keys = list(arrays.keys())
        base = arrays_to_numpy(arrays)
        dtypes = [a.dtype for a in base]
        x = [a.astype(np.float64) for a in base]

        # Phase 1: L_i and c_i at x^r from every client.
        qcontent = RecordDict({"arrays": arrays, "config": self._config(config, server_round, train=False)})
        qreplies = self.communicate(grid, self.build_messages(nodes, qcontent, QUERY_TYPE), phase="query",
                                    reference=arrays, array_keys=("grad",), required_metrics=("loss",))
        node_of: dict[int, int] = {}
        fresh: set[int] = set()
        for r in qreplies:
            pid = int(_metrics_of(r)[PARTITION_ID])
            node_of[pid] = int(r.metadata.src_node_id)
            fresh.add(pid)
            st.memory[pid] = (float(_metrics_of(r)["loss"]),
                              [g.astype(np.float64) for g in arrays_to_numpy(r.content["grad"])])
        self._sync_partitions(fresh)
        if self.steps is None and st.partitions:
            self.steps = self._init_steps(len(st.partitions))
        active = [p for p in st.partitions if (p in fresh if self.on_failure == "exclude" else p in st.memory)]
        if not active or self.steps is None:
            log(WARNING, "[%s] round %d: no client loss known; model and λ kept", self.run_name, server_round)
            self._extras["dual_step"] = "skipped: no loss"
            return arrays, None
        steps = self.steps
        index = {p: k for k, p in enumerate(st.partitions)}
        idx = np.array([index[p] for p in active])
        self._extras.update({"tau": steps.tau, "sigma": steps.sigma, "theta": steps.theta})
        stale = [p for p in active if p not in fresh]
        if stale:
            self._extras["reused"] = stale
        missing = [p for p in st.partitions if p not in active]
        if missing:
            self._extras["excluded"] = missing

        # Dual step on the active sub-vector (the whole λ when every client is known).
        loss_now = np.array([st.memory[p][0] for p in active])
        loss_prev = np.array([st.loss_prev.get(p, st.memory[p][0]) for p in active])
        s = scaffpd_extrapolate(loss_now, loss_prev, steps.theta)
        mass = float(st.lam[idx].sum())
        sub = st.lam[idx] / mass if mass > 1e-300 else np.full(len(idx), 1.0 / len(idx))
        new_sub = self.dual_update(sub, s, steps.sigma)
        lam = st.lam.copy()
        lam[idx] = new_sub * (mass if mass > 1e-300 else 0.0)
        if mass <= 1e-300:
            log(WARNING, "[%s] round %d: active clients have λ = 0; λ kept", self.run_name, server_round)
        st.lam = lam / lam.sum()
        st.loss_prev = {p: st.memory[p][0] for p in active}
        w = new_sub  # λ^{r+1} renormalised over the active clients
        weight = dict(zip(active, w, strict=True))
        control = [sum(weight[p] * st.memory[p][1][k] for p in active) for k in range(len(x))]
        self._extras["query_loss"] = {str(p): st.memory[p][0] for p in active}
        self._extras["s"] = {str(p): float(v) for p, v in zip(active, s, strict=True)}

        # Phase 2: corrected local steps on the clients that answered phase 1.
        trainers = [p for p in active if p in fresh]
        tcontent = RecordDict({
            "arrays": arrays,
            "control": numpy_to_arrays(keys, [c.astype(d) for c, d in zip(control, dtypes, strict=True)]),
            "config": self._config(config, server_round, train=True),
        })
        treplies = self.communicate(grid, self.build_messages([node_of[p] for p in trainers], tcontent, TRAIN_TYPE),
                                    phase="train", reference=arrays)
        delta: dict[int, list[np.ndarray]] = {}
        scale = 1.0 / (self.lr * self.local_steps)
        for r in treplies:
            pid = int(_metrics_of(r)[PARTITION_ID])
            if pid in weight:
                u = arrays_to_numpy(r.content["arrays"])
                delta[pid] = [(xk - uk.astype(np.float64)) * scale for xk, uk in zip(x, u, strict=True)]
        if self.on_failure == "reuse":
            substituted = [p for p in active if p not in delta]
            for p in substituted:
                delta[p] = control
            if substituted:
                self._extras["substituted"] = substituted
            coef = weight
        else:
            total = sum(weight[p] for p in delta)
            coef = {p: weight[p] / total for p in delta} if total > 0 else {}
        if not coef:
            log(WARNING, "[%s] round %d: no valid train.scaffpd reply; model kept", self.run_name, server_round)
            self._extras["primal_step"] = "skipped: no train reply"
            steps.advance()
            return arrays, None
        direction = [sum(coef[p] * delta[p][k] for p in coef) for k in range(len(x))]
        new = [(xk - steps.tau * dk).astype(d) for xk, dk, d in zip(x, direction, dtypes, strict=True)]
        steps.advance()
        metrics = _mean_metrics([r.content for r in treplies]) if treplies else None
        return numpy_to_arrays(keys, new), metrics

    def round_extras(self) -> dict[str, Any]:
        """λ^{r+1} keyed by partition id, the step sizes (τ_r, σ_r, θ_r) and the failure handling."""
        out: dict[str, Any] = {"lambda": {str(p): float(v) for p, v in self.lam.items()}}
        out.update(self._extras)
        return out
