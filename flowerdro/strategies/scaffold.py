r"""SCAFFOLD (stochastic controlled averaging) as a Flower Message-API strategy — a baseline.

S. P. Karimireddy, S. Kale, M. Mohri, S. J. Reddi, S. U. Stich, A. T. Suresh,
"SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020,
https://arxiv.org/abs/1910.06378 (Algorithm 1, option II). Used as a baseline of SCAFF-PD
(Yu, Karimireddy, Ma, Jordan 2023, https://arxiv.org/abs/2307.13381, Table 1).

One round (paper symbols; the code's names in brackets):

1. Sample S ⊆ [N] (``fraction_train``·N clients, seeded, without replacement).
2. ``train.scaffold`` to every i ∈ S with x and the correction c − c_i: K [``local_steps``]
   steps y_i ← y_i − η_l (g_i(y_i) − c_i + c) [``lr``] from y_i = x, then option II
   c_i⁺ = c_i − c + (x − y_i)/(K η_l). Reply y_i and c_i⁺.
3. Δx = (1/|S|) Σ_{i∈S} (y_i − x), Δc = (1/|S|) Σ_{i∈S} (c_i⁺ − c_i);
   x ← x + η_g Δx [``server_lr``], c ← c + (|S|/N) Δc.

The server keeps c and every client's c_i, keyed by partition (zero at first), so a
client holds no state between rounds: a node that restarts, or comes back under a new
node id, continues with its partition's c_i once the server knows which partition it
serves (from any earlier reply of that node, evaluation included; a node never heard
from trains with c_i = 0 and its partition's c_i is then replaced, keeping c the mean of
the stored c_i). N is the number of connected nodes. A failed reply is dropped: the
averages run over the valid replies S′ (Δc scaled by |S′|/N) and the client keeps its c_i.

Message protocol
----------------
``train.scaffold`` — content ``arrays`` (x), ``control`` (c − c_i), ``config``: ``lr``,
``local-steps``, ``batch-size``, ``seed``, ``server-round``. Reply: ``arrays`` (y_i),
``control`` (c_i⁺), ``metrics`` {``num-examples``, ``partition-id``,
``train_loss_local``, ``local-steps``}. See :mod:`flowerdro.clients.scaffpd`; the
run-config keys are those of :class:`SCAFFOLDSettings` and the clients' ``lr``,
``local-steps``, ``batch-size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flowerdro.core.layers import cast_layer, update_mask
from flowerdro.privacy import SECAGG
from flowerdro.protocol import PARTITION_ID
from flowerdro.runs.codec import register_state
from flowerdro.settings import Settings, setting
from flowerdro.strategies.arrays import array_view, arrays_to_numpy, numpy_to_arrays
from flowerdro.strategies.base import FairStrategy
from flowerdro.strategies.records import mean_of_metric_records
from flowerdro.strategies.replies import metrics_of

__all__ = ["SCAFFOLD", "SCAFFOLDSettings", "SCAFFOLDState"]

TRAIN_TYPE = "train.scaffold"


@dataclass(frozen=True)
class SCAFFOLDSettings(Settings):
    """SCAFFOLD (Karimireddy et al. 2020); local steps K and η_l are the clients' settings."""

    server_lr: float = setting(1.0, "η_g, the server's step on the averaged update", gt=0)
    control_variates_on: str = setting(
        "server", "where each c_i lives: on the server by partition (survives a node restart; N·d floats), or on "
                  "the clients in their node state, as in the paper (the server needs only sums: secure "
                  "aggregation, large N)", choices=("server", "client"))


@register_state
@dataclass
class SCAFFOLDState:
    """What the server keeps between rounds.

    Attributes
    ----------
    control : list of numpy.ndarray, optional
        c, float64 per layer (None before the first round).
    client_controls : dict
        Partition id → c_i per layer, in the model's dtype (the values the client computed).
    """

    control: list[np.ndarray] | None = None
    client_controls: dict[int, list[np.ndarray]] = field(default_factory=dict)


class SCAFFOLD(FairStrategy):
    r"""SCAFFOLD, option II, with server learning rate and sampling (see the module docstring).

    x ← x + η_g mean_{i∈S}(y_i − x), c ← c + (|S|/N) mean_{i∈S}(c_i⁺ − c_i), where each
    sampled client runs K steps y ← y − η_l(g_i(y) − c_i + c) and returns
    c_i⁺ = c_i − c + (x − y_K)/(K η_l).
    """

    name: ClassVar[str] = "scaffold"
    settings_class: ClassVar[type[Settings]] = SCAFFOLDSettings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = SCAFFOLDState()
        self._num_nodes = 0

    train_array_keys: ClassVar[tuple[str, ...]] = ("arrays", "control")

    def on_start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None) -> None:
        """A new run starts from c = c_i = 0."""
        self.state = SCAFFOLDState()

    @property
    def control(self) -> list[np.ndarray] | None:
        """The server control variate c."""
        return self.state.control

    def _config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        cfg = self.train_config(config, server_round)
        # option II divides by K η_l: the clients must use exactly these
        cfg.update({"lr": self.training.lr, "local-steps": self.training.local_steps, "local-epochs": 0.0})
        if self.on_client:
            cfg["control-on"] = "client"
        return cfg

    @property
    def on_client(self) -> bool:
        """Whether the clients keep their c_i (``control-variates-on = "client"``)."""
        return self.config.control_variates_on == "client"

    def unprotected(self, mechanism: str) -> str | None:
        """SCAFFOLD's replies carry a control variate besides the model; only sums of both are needed when
        the clients keep c_i, which SecAgg+ protects."""
        if mechanism == SECAGG and self.on_client:
            return None
        if mechanism == SECAGG:
            return ("each client's new control variate c_i⁺, stored by partition (control-variates-on = \"server\"; "
                    "set control-variates-on = \"client\" so that only sums are needed)")
        return ("the control variates (c_i⁺ or c_i⁺ − c_i), a second per-client vector that the mechanism neither "
                "clips nor noises")

    def _client_control(self, node_id: int, like: list[np.ndarray]) -> list[np.ndarray]:
        """c_i of the node's partition (zeros in the model's dtype when none is stored, or when the clients keep it)."""
        if self.on_client:
            return [np.zeros_like(a) for a in like]
        pid = self.partition(node_id)
        stored = self.state.client_controls.get(pid) if pid is not None else None
        return stored if stored is not None else [np.zeros_like(a) for a in like]

    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> list[Message]:
        """Sample S; ``train.scaffold`` to each i ∈ S with x and the correction c − c_i."""
        st = self.state
        keys = list(arrays.keys())
        base = arrays_to_numpy(arrays)
        dtypes = [a.dtype for a in base]
        if st.control is None:
            st.control = [np.zeros(a.shape, dtype=np.float64) for a in base]
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        self._num_nodes = len(nodes)
        c = [a.astype(d) for a, d in zip(st.control, dtypes, strict=True)]
        cfg = self._config(config, server_round)

        def content(nid: int) -> RecordDict:
            correction = [ck - cik for ck, cik in zip(c, self._client_control(nid, base), strict=True)]
            return RecordDict({"arrays": arrays, "control": numpy_to_arrays(keys, correction), "config": cfg})

        return self.build_messages(chosen, content, TRAIN_TYPE)

    def train_step(self, server_round: int, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """x ← x + η_g (mean y_i − x), c ← c + Σ(c_i⁺ − c_i)/N over the valid replies."""
        st, arrays = self.state, self.current_arrays
        if not replies or arrays is None:
            log(WARNING, "[%s] round %d: no valid train.scaffold reply; model kept", self.run_name, server_round)
            return None, None
        keys = list(arrays.keys())
        base = arrays_to_numpy(arrays)
        dtypes = [a.dtype for a in base]
        x = [a.astype(np.float64) for a in base]
        m = len(replies)
        # Σ_i y_i and Σ_i (c_i⁺ − c_i), accumulated in float64 straight from the reply buffers:
        # a sum of float32 values of similar size is exact in float64, so this is at least as
        # accurate as averaging the differences, with one pass per reply array.
        sum_y = [np.zeros_like(a) for a in x]
        sum_dc = [np.zeros_like(a) for a in x]
        for r in replies:
            pid = int(metrics_of(r)[PARTITION_ID])
            y, ci = r.content["arrays"], r.content["control"]
            # c_i is kept (and sent back) in the model's dtype, whatever the client replied in;
            # a reply in that dtype is kept as the read-only view of its buffer, not copied
            ci_new = [np.asarray(array_view(ci[k]), dtype=d) for k, d in zip(keys, dtypes, strict=True)]
            if self.on_client:  # the reply is Δc_i = c_i⁺ − c_i; the client keeps c_i⁺
                ci_old = None
            else:
                ci_old = st.client_controls.get(pid)
                st.client_controls[pid] = ci_new
            for k, key in enumerate(keys):
                np.add(sum_y[k], array_view(y[key]), out=sum_y[k])
                np.add(sum_dc[k], ci_new[k], out=sum_dc[k])
                if ci_old is not None:
                    np.subtract(sum_dc[k], ci_old[k], out=sum_dc[k])
        n = self._num_nodes or m
        # c ← c + (|S|/N)·(1/|S|)Σ(c_i⁺ − c_i) = c + Σ(c_i⁺ − c_i)/N
        st.control = [ck + d / n for ck, d in zip(st.control, sum_dc, strict=True)]
        # x ← x + η_g (mean_i y_i − x); buffers (core/layers.py) take mean_i y_i in their dtype
        new = [(xk + self.config.server_lr * (sy / m - xk)).astype(dt) if update else cast_layer(sy / m, dt)
               for xk, sy, dt, update in zip(x, sum_y, dtypes, update_mask(keys, base), strict=True)]
        return numpy_to_arrays(keys, new), mean_of_metric_records([metrics_of(r) for r in replies])

    def round_extras(self) -> dict[str, Any]:
        """‖c‖, the norm of the server control variate."""
        if self.state.control is None:
            return {}
        return {"control_norm": float(math.sqrt(sum(float((c ** 2).sum()) for c in self.state.control)))}
