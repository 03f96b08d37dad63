r"""SCAFF-PD as a Flower Message-API strategy.

Y. Yu, S. P. Karimireddy, Y. Ma, M. I. Jordan, "Scaff-PD: Communication Efficient Fair
and Robust Federated Learning", 2023, https://arxiv.org/abs/2307.13381 (Algorithm 1:
accelerated primal-dual server loop; Algorithm 2: bias-corrected local steps). The
server's steps are the pure functions of :mod:`flowerdro.core.scaffpd`; this module sends
the messages and keeps the state between rounds.

One round r (paper symbols; the code's names in brackets), full participation:

1. ``query.loss_grad`` to every client at x^r: L_i = f_i(x^r) and c_i = g_i(x^r) (full-batch
   or one minibatch [``grad_on``]); the client keeps c_i until phase 2.
2. s^r = (1 + θ_r) L^r − θ_r L^{r−1} (L^{−1} = L^0) and the exact proximal dual step
   λ^{r+1} = argmin_{λ∈Λ} ψ(λ) − ⟨s^r, λ⟩ + (1/2σ_r)‖λ − λ^r‖²; c^r = Σ_i λ_i^{r+1} c_i.
3. ``train.scaffpd`` with x^r and c^r: J [``local_steps``] steps
   u ← u − η_l (g_i(u) − c_i + c^r) [``lr``]; the client returns u_J and the server forms
   Δu_i = (x^r − u_J)/(η_l J).
4. x^{r+1} = x^r − τ_r Σ_i λ_i^{r+1} Δu_i.

Step sizes (τ_r [``primal_lr``], σ_r [``dual_lr``], θ_r [``theta``]) by ``step_rule``:
``"5.2"`` (Condition 5.2): constant, θ from :func:`~flowerdro.core.scaffpd.auto_theta`
unless given (μ_y = ρN for χ², 0 for AFL and CVaR); ``"5.1"`` (Condition 5.1): from τ_0
and γ_0 [``gamma``], σ_r = γ_r τ_r and :func:`~flowerdro.core.scaffpd.next_steps` each
round. τ_0 defaults to η_l·J (x^{r+1} = Σ_i λ_i^{r+1} u_J^i), γ_0 to σ_0/τ_0, μ_x to the
clients' weight decay. For the usual primal-dual stability τσ‖∇L‖² ≲ 1, lower σ when λ
oscillates.

Failures (``on_failure``)
-------------------------
The server keeps every client's last (L_i, c_i). Let K be the clients whose loss is
known this round:

* ``"reuse"`` (default): a client that fails phase 1 keeps its last L_i and c_i (stale,
  as in SAG), so K is every client heard from at least once. It is not sent
  ``train.scaffpd`` (it holds no c_i of this round). A client of K with no valid phase-2
  reply gets Δu_i := c^r, the first-order value of its corrected local update
  (u_t ≈ x^r ⇒ g_i(u_t) − c_i + c^r ≈ c^r). At a saddle point c^r = 0 and every Δu_i = 0,
  so x* stays a fixed point even when some client always fails phase 2.
* ``"exclude"``: K is the clients that answered phase 1 this round, and only the clients
  that answered phase 2 enter step 4, with λ renormalised over them.

When K is not every client the dual step runs on the sub-vector
(:func:`~flowerdro.core.scaffpd.dual_step_on`); c^r and step 4 use λ^{r+1} renormalised
over K (resp. over the phase-2 answers). A client never heard from is outside K. If K is
empty, or (``"exclude"``) no phase-2 reply is valid, the model is kept (with
``"exclude"`` the λ step of phase 1 still happens).

Message protocol
----------------
``query.loss_grad`` — content ``arrays`` (x^r), ``config``: ``grad-on``, ``batch-size``,
``seed``, ``server-round`` (+ the clients' settings such as ``weight-decay``). Reply:
``metrics`` {``loss``, ``num-examples``, ``partition-id``}, ArrayRecord ``grad`` (c_i).
``train.scaffpd`` — content ``arrays`` (x^r), ``control`` (c^r), ``config``: ``lr``,
``local-steps``, ``batch-size``, ``seed``, ``server-round``. Reply: ``arrays`` (u_J),
``metrics`` {``num-examples``, ``partition-id``, ``train_loss_local``, ``local-steps``}.
See :mod:`flowerdro.clients.scaffpd`; the run-config keys are those of
:class:`SCAFFPDSettings` and the clients' ``lr``, ``local-steps``, ``batch-size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.core import scaffpd as core
from flowerdro.core.layers import mean_buffers, update_mask
from flowerdro.core.simplex import admit_partitions
from flowerdro.protocol import PARTITION_ID
from flowerdro.runs.codec import register_state
from flowerdro.settings import Knob, Settings, setting
from flowerdro.strategies.arrays import array_view, arrays_to_numpy, numpy_to_arrays
from flowerdro.strategies.base import FairStrategy
from flowerdro.strategies.records import mean_of_metric_records
from flowerdro.strategies.replies import metrics_of

__all__ = ["SCAFFPD", "SCAFFPDSettings", "SCAFFPDState"]

QUERY_TYPE, TRAIN_TYPE = "query.loss_grad", "train.scaffpd"
STEP_RULES: tuple[str, ...] = ("5.1", "5.2")
GRAD_ON: tuple[str, ...] = ("full", "batch")
FAILURE_POLICIES: tuple[str, ...] = ("reuse", "exclude")


@dataclass(frozen=True)
class SCAFFPDSettings(Settings):
    """SCAFF-PD (Yu, Karimireddy, Ma, Jordan 2023); local steps J and η_l are the clients' settings."""

    objective: str = setting("chi2", "ψ and Λ: χ² penalty (ρ/2N)Σ(Nλ_i−1)², AFL (ψ = 0) or CVaR "
                                     "(λ_i ≤ 1/(αN))", choices=core.OBJECTIVES)
    rho: float = setting(0.1, "ρ of the χ² penalty", ge=0, knob=Knob(1e-3, 10.0, "log"))
    alpha: float = setting(0.5, "α of CVaR, λ_i ≤ 1/(αN)", key="cvar-alpha", gt=0, le=1)
    step_rule: str = setting("5.2", "step sizes: constant (Cond. 5.2) or τ_r ↓, σ_r ↑ (Cond. 5.1)",
                             choices=STEP_RULES)
    primal_lr: float | None = setting(None, "τ_0, the server's primal step (unset: lr · local-steps)", gt=0)
    dual_lr: float = setting(0.1, "σ_0, the dual step", gt=0, knob=Knob(1e-3, 1.0, "log"))
    gamma: float | None = setting(None, "γ_0 of rule 5.1, σ_r = γ_r τ_r (unset: dual-lr / primal-lr)", gt=0)
    theta: float | None = setting(None, "θ of rule 5.2, s^r = (1+θ)L^r − θL^{r−1} (unset: "
                                        "max(1/(1+μ_xτ), 1/(1+μ_yσ)) when μ_x, μ_y > 0, else 1)", ge=0)
    mu_x: float | None = setting(None, "μ_x, the strong convexity of every f_i (unset: weight-decay)", ge=0)
    grad_on: str = setting("full", "c_i on all local data or one minibatch", choices=GRAD_ON)
    on_failure: str = setting("reuse", "a failed client: reuse its last loss and c_i, or exclude it",
                              choices=FAILURE_POLICIES)
    num_partitions: int | None = setting(None, "N when known: λ starts uniform over partitions 0..N−1 "
                                               "(unset: over those heard in round 1)", ge=1)


@register_state
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
        Partition id → L_i^{r−1} (the losses of the previous round, for s^r).
    memory : dict
        Partition id → (L_i, c_i) of the last round the client answered phase 1.
    steps : tuple of float, optional
        (τ_r, σ_r, γ_r, θ_r) of the coming round (None before the first).
    """

    partitions: list[int] = field(default_factory=list)
    lam: np.ndarray = field(default_factory=lambda: np.zeros(0))
    loss_prev: dict[int, float] = field(default_factory=dict)
    memory: dict[int, tuple[float, list[np.ndarray]]] = field(default_factory=dict)
    steps: tuple[float, float, float, float] | None = None


class SCAFFPD(FairStrategy):
    r"""SCAFF-PD: accelerated primal-dual with control variates (see the module docstring).

    Per round: L_i, c_i at x^r (``query.loss_grad``); s^r = (1+θ_r)L^r − θ_r L^{r−1};
    λ^{r+1} = prox_{σ_r ψ}(λ^r + σ_r s^r) on Λ; c^r = Σλ_i^{r+1} c_i; J local steps
    u ← u − η_l(g_i(u) − c_i + c^r) (``train.scaffpd``); x^{r+1} = x^r − τ_r Σλ_i^{r+1} Δu_i.
    Built like every :class:`~flowerdro.strategies.base.FairStrategy`, e.g.
    ``SCAFFPD(objective="cvar", alpha=0.2, lr=0.05, local_steps=5)``.
    """

    name: ClassVar[str] = "scaffpd"
    settings_class: ClassVar[type[Settings]] = SCAFFPDSettings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = SCAFFPDState()
        self._extras: dict[str, Any] = {}
        self._plan: tuple[Any, ...] | None = None

    def on_start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None) -> None:
        """A new run starts from uniform λ and the initial step sizes."""
        self.state = SCAFFPDState()

    # ------------------------------------------------------------------ settings
    @property
    def primal_lr(self) -> float:
        """τ_0: ``primal-lr``, else η_l·J."""
        c = self.config
        return c.primal_lr if c.primal_lr is not None else self.training.lr * self.training.local_steps

    @property
    def mu_x(self) -> float:
        """μ_x: ``mu-x``, else the clients' weight decay."""
        return self.config.mu_x if self.config.mu_x is not None else self.training.weight_decay

    def _initial_steps(self, n: int) -> tuple[float, float, float, float]:
        """(τ_0, σ_0, γ_0, θ_0) for N = ``n`` clients."""
        c, tau = self.config, self.primal_lr
        gamma = c.gamma if c.gamma is not None else c.dual_lr / tau
        if c.step_rule == "5.1":
            return tau, gamma * tau, gamma, 1.0
        mu_y = c.rho * n if c.objective == "chi2" else 0.0
        theta = c.theta if c.theta is not None else core.auto_theta(self.mu_x, mu_y, tau, c.dual_lr)
        return tau, c.dual_lr, c.dual_lr / tau, theta

    def _advance_steps(self) -> None:
        if self.config.step_rule == "5.1" and self.state.steps is not None:
            tau, sigma, gamma, _ = self.state.steps
            self.state.steps = core.next_steps(tau, sigma, gamma, self.mu_x)

    # ------------------------------------------------------------------ λ bookkeeping
    @property
    def lam(self) -> dict[int, float]:
        """λ^r as {partition id: weight}."""
        return {p: float(v) for p, v in zip(self.state.partitions, self.state.lam, strict=True)}

    def _sync_partitions(self, heard: set[int]) -> None:
        st = self.state
        if not st.partitions:
            n = self.config.num_partitions
            pids = (set(range(n)) if n is not None else set()) | heard
            if pids:
                st.partitions = sorted(pids)
                st.lam = np.full(len(pids), 1.0 / len(pids))
                log(INFO, "[%s] λ initialised uniform over N = %d partitions", self.run_name, len(pids))
            return
        st.partitions, st.lam = admit_partitions(st.partitions, st.lam, heard - set(st.partitions))

    def _config(self, config: ConfigRecord, server_round: int, *, train: bool) -> ConfigRecord:
        cfg = self.train_config(config, server_round)
        if train:  # Δu_i divides by η_l J: the clients must use exactly these
            cfg.update({"lr": self.training.lr, "local-steps": self.training.local_steps, "local-epochs": 0.0})
        else:
            cfg["grad-on"] = self.config.grad_on
        return cfg

    # ------------------------------------------------------------------ one round
    def _query(self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
               ) -> tuple[dict[int, int], set[int]]:
        """Phase 1: L_i and c_i at x^r; returns partition → node and the partitions that answered."""
        content = RecordDict({"arrays": arrays, "config": self._config(config, server_round, train=False)})
        replies = self.communicate(grid, self.build_messages(self.nodes(grid), content, QUERY_TYPE),
                                   phase="query", reference=arrays, array_keys=("grad",),
                                   required_metrics=("loss",))
        node_of: dict[int, int] = {}
        for r in replies:
            pid = int(metrics_of(r)[PARTITION_ID])
            node_of[pid] = int(r.metadata.src_node_id)
            self.state.memory[pid] = (float(metrics_of(r)["loss"]),
                                      [array_view(g).astype(np.float64) for g in r.content["grad"].values()])
        return node_of, set(node_of)

    def _dual(self, active: list[int]) -> tuple[dict[int, float], np.ndarray]:
        """s^r and λ^{r+1} over the active clients; returns their renormalised weights and s^r."""
        st, c = self.state, self.config
        tau, sigma, _, theta = st.steps
        index = {p: k for k, p in enumerate(st.partitions)}
        loss_now = np.array([st.memory[p][0] for p in active])
        loss_prev = np.array([st.loss_prev.get(p, st.memory[p][0]) for p in active])
        s = core.extrapolate(loss_now, loss_prev, theta)
        st.lam, weights = core.dual_step_on(st.lam, [index[p] for p in active], s, sigma, c.objective,
                                            rho=c.rho, alpha=c.alpha)
        st.loss_prev = {p: st.memory[p][0] for p in active}
        return dict(zip(active, weights, strict=True)), s

    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> list[Message]:
        """Phase 1 (``query.loss_grad`` to every node), the dual step and c^r; then ``train.scaffpd`` messages."""
        st = self.state
        self._extras = {}
        self._plan = None
        keys = list(arrays.keys())
        dtypes = [a.dtype for a in arrays_to_numpy(arrays)]

        node_of, fresh = self._query(server_round, grid, arrays, config)
        self._sync_partitions(fresh)
        if st.steps is None and st.partitions:
            st.steps = self._initial_steps(len(st.partitions))
        exclude = self.config.on_failure == "exclude"
        active = [p for p in st.partitions if (p in fresh if exclude else p in st.memory)]
        if not active or st.steps is None:
            log(WARNING, "[%s] round %d: no client loss known; model and λ kept", self.run_name, server_round)
            self._extras["dual_step"] = "skipped: no loss"
            return []
        tau, sigma, _, theta = st.steps
        self._extras.update({"tau": tau, "sigma": sigma, "theta": theta})
        if stale := [p for p in active if p not in fresh]:
            self._extras["reused"] = stale
        if missing := [p for p in st.partitions if p not in active]:
            self._extras["excluded"] = missing

        weight, s = self._dual(active)
        control = core.weighted_sum([weight[p] for p in active], [st.memory[p][1] for p in active])
        self._extras["query_loss"] = {str(p): st.memory[p][0] for p in active}
        self._extras["s"] = {str(p): float(v) for p, v in zip(active, s, strict=True)}
        self._plan = (arrays, active, weight, control, tau)

        # Phase 2: corrected local steps on the clients that answered phase 1.
        trainers = [p for p in active if p in fresh]
        content = RecordDict({
            "arrays": arrays,
            "control": numpy_to_arrays(keys, [c.astype(d) for c, d in zip(control, dtypes, strict=True)]),
            "config": self._config(config, server_round, train=True),
        })
        return self.build_messages([node_of[p] for p in trainers], content, TRAIN_TYPE)

    def train_step(self, server_round: int, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """x^{r+1} = x^r − τ_r Σλ_i Δu_i over the replies (or their stand-ins, see ``on-failure``)."""
        if self._plan is None:
            return None, None
        arrays, active, weight, control, tau = self._plan
        self._plan = None
        keys = list(arrays.keys())
        base = arrays_to_numpy(arrays)
        dtypes = [a.dtype for a in base]
        x = [a.astype(np.float64) for a in base]
        delta: dict[int, list[np.ndarray]] = {}
        trained: dict[int, list[np.ndarray]] = {}
        for r in replies:
            pid = int(metrics_of(r)[PARTITION_ID])
            if pid in weight:
                trained[pid] = [array_view(a) for a in r.content["arrays"].values()]
                delta[pid] = core.local_direction(x, trained[pid], self.training.lr, self.training.local_steps)
        if self.config.on_failure == "exclude":
            total = sum(weight[p] for p in delta)
            coef = {p: weight[p] / total for p in delta} if total > 0 else {}
        else:
            if substituted := [p for p in active if p not in delta]:
                self._extras["substituted"] = substituted
            delta.update({p: control for p in substituted})
            coef = weight
        self._advance_steps()
        if not coef:
            log(WARNING, "[%s] round %d: no valid train.scaffpd reply; model kept", self.run_name, server_round)
            self._extras["primal_step"] = "skipped: no train reply"
            return None, None
        direction = core.weighted_sum(list(coef.values()), [delta[p] for p in coef])
        new = [xk.astype(d) for xk, d in zip(core.primal_step(x, direction, tau), dtypes, strict=True)]
        if any(coef.get(p, 0.0) > 0 for p in trained):  # buffers: λ-weighted mean of the trained models'
            new = mean_buffers(new, update_mask(keys, base), trained, {p: coef[p] for p in trained if p in coef})
        metrics = mean_of_metric_records([metrics_of(r) for r in replies]) if replies else None
        return numpy_to_arrays(keys, new), metrics

    def unprotected(self, mechanism: str) -> str | None:
        """SCAFF-PD's dual step reads every client's loss L_i and gradient c_i (``query.loss_grad``)."""
        return ("per-client losses L_i and gradients c_i (query.loss_grad) for the dual step and the control "
                "variate, read by partition")

    def round_extras(self) -> dict[str, Any]:
        """λ^{r+1} keyed by partition id, the step sizes (τ_r, σ_r, θ_r) and the failure handling."""
        out: dict[str, Any] = {"lambda": {str(p): float(v) for p, v in self.lam.items()}}
        out.update(self._extras)
        return out
