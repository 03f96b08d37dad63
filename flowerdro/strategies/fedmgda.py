r"""FedMGDA+, FedMGDA, FedAvg-n and MGDA-Prox as a Flower Message-API strategy.

Z. Hu, K. Shaloudegi, G. Zhang, Y. Yu, "Federated Learning Meets Multi-objective
Optimization", IEEE Transactions on Network Science and Engineering, 2022,
https://arxiv.org/abs/2006.11489 (Algorithm 1: FedMGDA+).

Every client's loss f_i is one objective; the server looks for a common descent direction
of the sampled objectives, the min-norm element of the convex hull of their updates,
within ε of the FedAvg weights λ₀. One round t (paper symbols; the code's names in
brackets):

1. Sample I_t: a fraction p of the connected nodes [``fraction_train``], uniformly
   without replacement, from the strategy's seeded generator.
2. ``train.sgd`` to I_t with w_t: k local epochs [``local_epochs``] (or τ steps
   [``local_steps``]) of SGD with batch b [``batch_size``] and step η_l [``lr``]; MGDA-Prox
   adds (μ/2)‖w − w_t‖² to the local objective [``proximal_mu``]. Reply: w_i.
3. g_i = w_t − w_i over the floating-point arrays (integer buffers are not updates), and

   .. math::

       ĝ_i = g_i / ‖g_i‖ \;(ĝ_i = 0 \text{ if } g_i = 0), \qquad G_{ij} = ⟨ĝ_i, ĝ_j⟩,

       λ^* = \operatorname{argmin}_{λ ∈ Δ_m,\ ‖λ − λ_0‖_∞ ≤ ε} λᵀ G λ,
       \qquad d_t = Σ_i λ^*_i ĝ_i,

       w_{t+1} = w_t − η_t d_t, \qquad η_t = η_0 β^{⌊t/P⌋},\ β = \text{decay}^{P/T}.

   λ₀ is uniform (1/m) or proportional to the participants' data sizes
   [``lambda_init`` = ``"uniform"`` / ``"size"``], restricted to I_t and renormalised.
   The QP is solved exactly by :func:`flowerdro.core.mgda.min_norm_weights`, the rate by
   :func:`flowerdro.core.mgda.fedmgda_lr` (t = server round − 1, so rounds 1..P use η₀;
   P = 100 in the paper [``lr_decay_every``]).

The family (registry names):

* ``"fedmgda+"``: normalised updates, ε ∈ [0, 1] (default 0.1).
* ``"fedavg-n"``: ε = 0, so λ* = λ₀ and d_t = Σ λ₀_i ĝ_i: FedAvg on normalised updates
  (λ₀ = data sizes by default, as FedAvg).
* ``"fedmgda"``: *vanilla* MGDA in FL (the paper's FedMGDA, §3 before the "+" changes):
  **no** normalisation and **no** ε-box (λ ∈ Δ_m only), d_t = Σ λ*_i g_i on the raw
  updates, w_{t+1} = w_t − η_t d_t with η₀ = 1 and no decay by default, so that
  w_{t+1} = Σ λ*_i w_i is a convex combination of the local models.
* ``"mgda-prox"``: FedMGDA+ whose clients add the proximal term μ (default 0.1).

Choices documented here
-----------------------
* Zero updates: a client with g_i = 0 keeps ĝ_i = 0 (no NaN). MGDA then may put all
  weight on it (its min norm is 0) and the model does not move: a client at a stationary
  point makes w_t Pareto-stationary for the sampled objectives. All g_i = 0 gives G = 0,
  λ* = λ₀ and w_{t+1} = w_t.
* Integer arrays (e.g. BatchNorm's ``num_batches_tracked``): never normalised nor
  stepped; w_{t+1} takes their λ*-weighted average over the participants, rounded.
* Failed replies are dropped (see :class:`~flowerdro.strategies.base.FairStrategy`); λ₀
  is restricted to the clients that answered. Nobody answering keeps w_t.
* The step is built while the replies arrive (:class:`StreamingServerStep`, fed by
  :meth:`~flowerdro.strategies.base.FairStrategy.communicate_stream`): each pulled reply's
  update g_i is written once into a preallocated (m × d) matrix and its Gram row
  ⟨g_i, g_j⟩ (j ≤ i) computed at once, so after the last reply only that reply's row
  (one read of the updates), the m × m solve and w_{t+1} = w_t − η_t Xᵀ(λ*/‖g‖) (a
  second read) remain. The normalisation is folded into Ĝ = D⁻¹GD⁻¹ and the weights
  λ*_i/‖g_i‖, so updates are never rescaled. Replies that arrive together are added as
  one block; all at once it is the batch step, :func:`fedmgda_server_step`. Large models
  go to the GPU when there is one (``server_device="auto"``).
* The Gram matrix of float32 models is built with float32 block products summed in
  float64 (``gram_precision="auto"``): its error (≈1e-7 of max G_ii) is below the float32
  rounding of the updates themselves; its rounding-size negative eigenvalues are clipped
  to 0 before the solve. float64 models use float64 throughout.
* Fairness during training (``track_improvement``, off by default): after the step the
  participants get ``query.loss`` (``loss-on = "full"``) at w_{t+1}; "before" is the
  ``train_loss`` of their train reply (the loss of the received w_t on all local training
  data, the same code path: the train message then sets ``train-loss-on = "full"``
  whatever the run config says, so both losses are on the same data) or, with
  ``improvement_before="query"``, a second ``query.loss`` at w_t. The round logs ``improved_fraction`` = #{i: f_i(w_{t+1}) ≤
  f_i(w_t)} / #answers. A bias attacker adds the same bias to both losses.
* The method never reads a reported loss to update the model, so a client's loss-bias
  attack has no effect on it; normalisation removes any positive scaling of an update
  (``attack = "update-scale"``). A ``loss-scale`` attacker (the paper's §6.2.2) takes s
  times larger local steps, which for more than one step is not a multiple of its honest
  update.

Message protocol
----------------
``train.sgd`` — content ``arrays`` (w_t), ``config``: ``server-round``, ``seed``, and
``local-epochs`` k or ``local-steps`` τ (with ``local-epochs = 0`` so τ is exact),
``lr``, ``batch-size`` when set here (else the clients' run config decides),
``proximal-mu`` μ (MGDA-Prox only). Reply: ``arrays`` (w_i), ``metrics`` with
``num-examples`` (local training-set size), ``partition-id``, ``train_loss`` (f_i(w_t) on
all local training data), ``train_loss_local``, ``local-steps``.
``query.loss`` (only with ``track_improvement``) — content ``arrays`` (w_{t+1}, or w_t),
``config``: ``loss-on = "full"``, ``server-round``, ``seed``. Reply: ``metrics`` with
``loss``, ``num-examples``, ``partition-id``.

Run-config keys (read by the ``fedmgda+``, ``fedmgda``, ``fedavg-n``, ``mgda-prox``
factories): ``eps`` ε, ``global-lr`` η₀ (1.0), ``lr-decay`` decay (1.0 = constant),
``lr-decay-every`` P (100),
``lambda-init`` (``uniform``/``size``), ``normalize-updates`` (bool; family default),
``proximal-mu`` μ (``mgda-prox``), ``local-epochs`` k / ``local-steps`` τ, ``lr``,
``batch-size``, ``track-improvement`` (false), ``improvement-before``
(``train-loss``/``query``), ``gram-precision`` (``auto``/``float32``/``float64``), and
the base loop's ``fraction-train`` p, ``seed`` …; T is the run's number of rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from flowerdro.core.mgda import fedmgda_lr, min_norm_weights
from flowerdro.strategies.base import (
    NUM_EXAMPLES,
    PARTITION_ID,
    FairStrategy,
    array_view,
    mean_of_metric_records,
    numpy_to_arrays,
)

__all__ = [
    "DEVICES",
    "GRAM_PRECISIONS",
    "IMPROVEMENT_BEFORE",
    "LAMBDA_INITS",
    "FedMGDA",
    "ReplyStream",
    "ServerStep",
    "StreamingServerStep",
    "fedmgda_server_step",
    "improved_fraction",
]

LAMBDA_INITS: tuple[str, ...] = ("uniform", "size")
IMPROVEMENT_BEFORE: tuple[str, ...] = ("train-loss", "query")
GRAM_PRECISIONS: tuple[str, ...] = ("auto", "float32", "float64")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
#: Columns per block of the Gram products (each block's product is summed in float64).
GRAM_BLOCK = 1 << 16
#: ``device="auto"`` puts the update matrix on the GPU from this many entries (m·d) on.
GPU_MIN_ENTRIES = 1 << 22
TRAIN_TYPE, QUERY_TYPE = "train.sgd", "query.loss"


# =========================================================================== pure steps
class ServerStep:
    """What one server step computed: the new arrays, λ*, ‖g_i‖, ‖d_t‖, η_t (plain fields)."""

    __slots__ = ("arrays", "lam", "norms", "direction_norm", "global_lr", "center")

    def __init__(self, arrays: list[np.ndarray], lam: np.ndarray, norms: np.ndarray, direction_norm: float,
                 global_lr: float, center: np.ndarray) -> None:
        self.arrays, self.lam, self.norms = arrays, lam, norms
        self.direction_norm, self.global_lr, self.center = direction_norm, global_lr, center


def _center(lambda_init: str, sizes: Sequence[float]) -> np.ndarray:
    m = len(sizes)
    if lambda_init == "uniform":
        return np.full(m, 1.0 / m)
    n = np.asarray(sizes, dtype=np.float64)
    if not np.all(np.isfinite(n)) or np.any(n < 0) or n.sum() <= 0:
        return np.full(m, 1.0 / m)
    return n / n.sum()


def _pick_device(device: str, entries: int, itemsize: int) -> str:
    """``"cpu"`` or ``"cuda"`` for an (m × d) update matrix of ``entries`` elements."""
    if device not in DEVICES:
        raise ValueError(f"device: must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return "cpu"
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
        return "cuda"
    if entries < GPU_MIN_ENTRIES or not torch.cuda.is_available():
        return "cpu"
    free, _ = torch.cuda.mem_get_info()
    return "cuda" if 1.25 * entries * itemsize < free else "cpu"


def _clip_negative_eigenvalues(G: np.ndarray) -> np.ndarray:
    """G with its (rounding-size) negative eigenvalues set to 0: V max(Λ, 0) Vᵀ, symmetrised.

    A G that has a Cholesky factor (positive definite: the usual case, updates in general
    position) is returned as it is without the eigendecomposition (0.1 ms instead of 2 ms
    at m = 100, and no multi-threaded LAPACK call to stall on a loaded machine).
    """
    try:
        np.linalg.cholesky(G)
        return G
    except np.linalg.LinAlgError:
        pass
    w, V = np.linalg.eigh(G)
    if w[0] >= 0.0:
        return G
    out = (V * np.maximum(w, 0.0)) @ V.T
    return 0.5 * (out + out.T)


class StreamingServerStep:
    r"""The FedMGDA+ server step, built up one reply (or one batch of replies) at a time.

    For w_t and participants i = 1..m whose models w_i arrive in any order, in batches:

    * :meth:`add` writes g_i = w_t − w_i (floating-point arrays only) into row i of a
      preallocated (capacity × d) matrix X, the only copy of the update, and computes the
      new rows of the Gram matrix against every update received so far,

      .. math::  G_{ij} = ⟨g_i, g_j⟩ \quad (j ≤ i),\qquad ‖g_i‖ = \sqrt{G_{ii}},

      as column blocks of 2¹⁶ multiplied in the Gram precision and summed in float64; a
      batch of k new rows is one (k × d)(d × n) product per block, so one reply costs one
      read of the updates received so far;
    * :meth:`finish` normalises, Ĝ = D⁻¹GD⁻¹ with D = diag(‖g_i‖) (ĝ_i = g_i/‖g_i‖, a zero
      update stays zero), solves λ* = argmin_{λ ∈ Δ, ‖λ − λ₀‖_∞ ≤ ε} λᵀĜλ with
      :func:`~flowerdro.core.mgda.min_norm_weights`, and steps

      .. math::  w_{t+1} = w_t − η_t Σ_i λ^*_i ĝ_i = w_t − η_t Xᵀ(λ^* / ‖g‖)

      as one matrix-vector product (``addmv``). Integer arrays become the rounded
      λ*-weighted average of the participants' values.

    The normalisation is folded into Ĝ and the combination weights λ*_i/‖g_i‖, so the
    updates are written once and never rescaled; after the last reply only its Gram row
    (one read of X), the m × m solve and the combination (a second read of X) remain.
    With float32 arithmetic, Ĝ's rounding-size negative eigenvalues are clipped to 0
    before the solve (one m × m eigendecomposition). Adding all replies in one batch gives
    the batch step (:func:`fedmgda_server_step`).

    Parameters
    ----------
    global_arrays : sequence of np.ndarray
        w_t, one array per model entry.
    capacity : int
        The most participants that can be added (the number of messages sent).
    normalize : bool (default: True)
        Normalise the updates (FedMGDA+, FedAvg-n) or not (FedMGDA: ĝ_i = g_i).
    gram_precision : {"auto", "float32", "float64"} (default: "auto")
        Arithmetic of the Gram products (sums always float64); ``auto``: float32 for
        float32 models, float64 otherwise.
    device : {"auto", "cpu", "cuda"} (default: "auto")
        Where X lives and the products run; ``auto``: CUDA when torch sees a GPU, the
        matrix has at least 2²² entries and fits in 80% of the free GPU memory, else CPU.
    """

    def __init__(
        self,
        global_arrays: Sequence[np.ndarray],
        capacity: int,
        *,
        normalize: bool = True,
        gram_precision: str = "auto",
        device: str = "auto",
    ) -> None:
        import torch

        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1:
            raise ValueError(f"capacity: must be an integer >= 1, got {capacity!r}")
        if gram_precision not in GRAM_PRECISIONS:
            raise ValueError(f"gram_precision: must be one of {', '.join(GRAM_PRECISIONS)}, got {gram_precision!r}")
        w = [np.asarray(a) for a in global_arrays]
        self._w = w
        self._float = [bool(np.issubdtype(a.dtype, np.floating)) for a in w]
        self._spans: list[tuple[int, int, int]] = []  # (array index, offset, size) of the float arrays in a row
        off = 0
        for k, a in enumerate(w):
            if self._float[k]:
                self._spans.append((k, off, int(a.size)))
                off += int(a.size)
        self.dim = off
        fl = [w[k].dtype for k, _, _ in self._spans]
        self.dtype = np.dtype(np.result_type(np.float32, *fl)) if fl else np.dtype(np.float64)
        self.precision = gram_precision if gram_precision != "auto" else (
            "float32" if self.dtype == np.float32 else "float64")
        self.normalize = bool(normalize)
        self.capacity = int(capacity)
        self.device = _pick_device(device, self.capacity * self.dim, self.dtype.itemsize)
        self.count = 0
        w_flat = np.empty(self.dim, dtype=self.dtype)
        for k, o, n in self._spans:
            w_flat[o : o + n] = w[k].reshape(-1)
        if self.device == "cpu":
            self._X_np: np.ndarray | None = np.empty((self.capacity, self.dim), dtype=self.dtype)
            self._X = torch.from_numpy(self._X_np)
            self._w_flat = torch.from_numpy(w_flat)
        else:
            self._X_np = None
            self._X = torch.empty((self.capacity, self.dim), dtype=getattr(torch, self.dtype.name),
                                  device=self.device)
            self._w_flat = torch.from_numpy(w_flat).to(self.device)
        self._G = np.zeros((self.capacity, self.capacity))
        self._others: list[list[np.ndarray]] = []  # each participant's non-float arrays

    @property
    def gram(self) -> np.ndarray:
        """G_ij = ⟨g_i, g_j⟩ of the updates added so far (raw, float64, a copy)."""
        return self._G[: self.count, : self.count].copy()

    def add(self, local_arrays: Sequence[Sequence[np.ndarray]]) -> None:
        """Add the models w_i of one or more participants: their updates and Gram rows.

        Raises ValueError (nothing is added) when a model's arrays do not match w_t, the
        capacity would be exceeded, or an update holds NaN/Inf.
        """
        k = len(local_arrays)
        if k == 0:
            return
        n0, n1 = self.count, self.count + k
        if n1 > self.capacity:
            raise ValueError(f"local_arrays: {n1} participants exceed the capacity {self.capacity}")
        locs = []
        for j, loc in enumerate(local_arrays):
            loc = [np.asarray(a) for a in loc]
            if len(loc) != len(self._w):
                raise ValueError(f"local_arrays: participant {n0 + j} has {len(loc)} arrays, "
                                 f"the model has {len(self._w)}")
            for a, ref, i in zip(loc, self._w, range(len(loc)), strict=True):
                if a.shape != ref.shape:
                    raise ValueError(f"local_arrays: array {i} of participant {n0 + j} has shape {a.shape}, "
                                     f"expected {ref.shape}")
            locs.append(loc)
        for j, loc in enumerate(locs):
            self._write_update(n0 + j, loc)
        R = self._gram_rows(n0, n1)
        if not np.all(np.isfinite(R)):
            raise ValueError("local_arrays: the updates contain NaN or Inf")
        new = 0.5 * (R[:, n0:n1] + R[:, n0:n1].T)
        self._G[n0:n1, :n0] = R[:, :n0]
        self._G[:n0, n0:n1] = R[:, :n0].T
        self._G[n0:n1, n0:n1] = new
        self._others.extend([a for a, f in zip(loc, self._float, strict=True) if not f] for loc in locs)
        self.count = n1

    def _write_update(self, row: int, loc: list[np.ndarray]) -> None:
        """X[row] = w_t − w_i over the floating-point arrays."""
        if self._X_np is not None:
            for k, o, n in self._spans:
                np.subtract(self._w[k].reshape(-1), loc[k].reshape(-1), out=self._X_np[row, o : o + n],
                            casting="unsafe")
            return
        import torch

        for k, o, n in self._spans:
            local = torch.tensor(loc[k].reshape(-1), device=self.device, dtype=self._X.dtype)
            torch.sub(self._w_flat[o : o + n], local, out=self._X[row, o : o + n])

    def _gram_rows(self, n0: int, n1: int) -> np.ndarray:
        """⟨g_i, g_j⟩ for new rows i ∈ [n0, n1) and all j < n1: (n1 − n0) × n1, float64."""
        import torch

        acc = torch.zeros((n1 - n0, n1), dtype=torch.float64, device=self.device)
        work = torch.float64 if self.precision == "float64" else torch.float32
        for j in range(0, self.dim, GRAM_BLOCK):
            P = self._X[n0:n1, j : j + GRAM_BLOCK].to(work)
            Q = self._X[:n1, j : j + GRAM_BLOCK].to(work)
            acc += (P @ Q.T).to(torch.float64)
        return acc.cpu().numpy()

    def _combine(self, m: int, coef: Any, global_lr: float) -> np.ndarray:
        """w_t − η_t Xᵀc over the float entries, as a flat array (column blocks, last block first).

        One ``addmv`` per block of 2¹⁶ columns: small enough that torch's threads split
        every block, and taken in the reverse of the Gram products' order, so the blocks
        the last Gram row read most recently are read again while they are still cached.
        """
        import torch

        flat = torch.empty_like(self._w_flat)
        X = self._X[:m]
        for j in reversed(range(0, self.dim, GRAM_BLOCK)):
            blk = slice(j, j + GRAM_BLOCK)
            torch.addmv(self._w_flat[blk], X[:, blk].T, coef, alpha=-global_lr, out=flat[blk])
        return flat.cpu().numpy()

    def finish(self, *, eps: float | None, global_lr: float, center: np.ndarray | None = None) -> ServerStep:
        """Normalise, solve for λ*, and step: the :class:`ServerStep` of the participants added.

        Parameters
        ----------
        eps : float or None
            ε ∈ [0, 1]; None means no box (vanilla MGDA).
        global_lr : float
            η_t > 0.
        center : np.ndarray of shape (m,) or None (default: None)
            λ₀ on the simplex for the m participants added, in the order added (None: uniform).
        """
        import torch

        m = self.count
        if m == 0:
            raise ValueError("local_arrays: at least one participant's model is required")
        G = self._G[:m, :m].copy()
        if self.precision == "float32" and m > 1:
            G = _clip_negative_eigenvalues(G)
        norms = np.sqrt(np.maximum(np.diag(G), 0.0))
        if self.normalize:
            scale = np.zeros(m)
            nz = norms > 0.0
            scale[nz] = 1.0 / norms[nz]
            Gn = G * np.outer(scale, scale)
            Gn[np.diag_indices(m)] = nz.astype(np.float64)
        else:
            scale = np.ones(m)
            Gn = G
        c = np.full(m, 1.0 / m) if center is None else np.asarray(center, dtype=np.float64)
        lam = min_norm_weights(Gn, eps=eps, center=c)
        coef = torch.from_numpy(np.asarray(lam * scale, dtype=self.dtype)).to(self.device)
        flat_np = self._combine(m, coef, float(global_lr))
        dnorm = float(math.sqrt(max(float(lam @ Gn @ lam), 0.0)))
        new: list[np.ndarray] = []
        spans = {k: (o, n) for k, o, n in self._spans}
        o_idx = 0
        for k, a in enumerate(self._w):
            if self._float[k]:
                o, n = spans[k]
                new.append(flat_np[o : o + n].reshape(a.shape).astype(a.dtype, copy=False))
            else:
                acc = np.zeros(a.shape, dtype=np.float64)
                for li, others in zip(lam, self._others, strict=True):
                    acc += li * np.asarray(others[o_idx], dtype=np.float64)
                new.append(np.rint(acc).astype(a.dtype))
                o_idx += 1
        return ServerStep(new, lam, norms, dnorm, float(global_lr), c)


def fedmgda_server_step(
    global_arrays: Sequence[np.ndarray],
    local_arrays: Sequence[Sequence[np.ndarray]],
    *,
    eps: float | None,
    global_lr: float,
    normalize: bool = True,
    center: np.ndarray | None = None,
    gram_precision: str = "auto",
    device: str = "auto",
) -> ServerStep:
    r"""One FedMGDA+ server step from the global model and all participants' models at once.

    .. math::

        g_i = w_t − w_i,\quad ĝ_i = g_i/‖g_i‖,\quad
        λ^* = \operatorname{argmin}_{λ∈Δ,\ ‖λ−λ_0‖_∞≤ε} λᵀGλ,\quad
        w_{t+1} = w_t − η_t Σ_i λ^*_i ĝ_i,

    over the floating-point arrays (G_ij = ⟨ĝ_i, ĝ_j⟩); without normalisation ĝ_i = g_i.
    This is :class:`StreamingServerStep` with every model added in one batch: the updates
    are written once into an (m × d) matrix X, G = XXᵀ in column blocks gives ‖g_i‖ = √G_ii
    and the normalised Gram D⁻¹GD⁻¹, and w_{t+1} = w_t − η_t Xᵀ(λ*/‖g‖) is one
    matrix-vector product. Integer arrays become the rounded λ*-weighted average of the
    participants' values.

    Parameters
    ----------
    global_arrays : sequence of np.ndarray
        w_t, one array per model entry.
    local_arrays : sequence of sequences of np.ndarray
        w_i for each participant (same shapes as ``global_arrays``).
    eps : float or None
        ε ∈ [0, 1]; None means no box (vanilla MGDA).
    global_lr : float
        η_t > 0.
    normalize : bool (default: True)
        Normalise the updates (FedMGDA+, FedAvg-n) or not (FedMGDA).
    center : np.ndarray of shape (m,) or None (default: None)
        λ₀ on the simplex (None: uniform).
    gram_precision : {"auto", "float32", "float64"} (default: "auto")
        Arithmetic of the Gram products; ``auto`` is float32 for float32 models.
    device : {"auto", "cpu", "cuda"} (default: "auto")
        Where the products run (see :class:`StreamingServerStep`).

    Returns
    -------
    ServerStep
    """
    if len(local_arrays) == 0:
        raise ValueError("local_arrays: at least one participant's model is required")
    step = StreamingServerStep(global_arrays, len(local_arrays), normalize=normalize,
                               gram_precision=gram_precision, device=device)
    step.add(local_arrays)
    return step.finish(eps=eps, global_lr=global_lr, center=center)


def improved_fraction(before: dict[int, float], after: dict[int, float]) -> float | None:
    """Fraction of partitions with f_i(w_{t+1}) ≤ f_i(w_t), over those with both losses."""
    common = [p for p in after if p in before]
    if not common:
        return None
    return float(np.mean([after[p] <= before[p] for p in common]))


def _metrics(content: RecordDict) -> MetricRecord:
    return content.metric_records.get("metrics") or next(iter(content.metric_records.values()))


class ReplyStream:
    """A :class:`StreamingServerStep` fed with reply Messages (their ``arrays``, partition ids, sizes).

    Parameters
    ----------
    arrays : ArrayRecord
        w_t (the model the replies' updates are relative to).
    capacity : int
        The most replies that will be added (the number of messages sent).
    normalize, gram_precision, device
        As in :class:`StreamingServerStep`.
    """

    def __init__(self, arrays: ArrayRecord, capacity: int, *, normalize: bool = True, gram_precision: str = "auto",
                 device: str = "auto") -> None:
        self.keys = list(arrays.keys())
        self.step = StreamingServerStep([arrays[k].numpy() for k in self.keys], capacity, normalize=normalize,
                                        gram_precision=gram_precision, device=device)
        self.partition_ids: list[int] = []
        self.sizes: list[float] = []
        self.metrics: list[MetricRecord] = []

    def add(self, replies: Sequence[Message]) -> None:
        """Add the models w_i of ``replies`` (validated replies with ``arrays`` and ``metrics``).

        The arrays are read as views of the replies' buffers (:func:`array_view`, no copy);
        the reply metrics are kept for the round's averages.
        """
        locs, mrs = [], []
        for r in replies:
            rec = r.content.array_records.get("arrays") or next(iter(r.content.array_records.values()))
            locs.append([array_view(rec[k]) for k in self.keys])
            mrs.append(_metrics(r.content))
        self.step.add(locs)
        self.metrics.extend(mrs)
        self.partition_ids.extend(int(mr[PARTITION_ID]) for mr in mrs)
        self.sizes.extend(float(mr[NUM_EXAMPLES]) for mr in mrs)


# =========================================================================== strategy
class FedMGDA(FairStrategy):
    r"""FedMGDA+ and its family (see the module docstring for the round and the protocol).

    Parameters
    ----------
    eps : float or None (default: 0.1)
        ε ∈ [0, 1], the ∞-norm radius around λ₀ (0: FedAvg-n, 1: MGDA); None: no box.
    normalize : bool (default: True)
        Normalise each update to unit length (False for vanilla FedMGDA).
    global_lr : float (default: 1.0)
        η₀ > 0, the global step size.
    lr_decay : float (default: 1.0)
        Total decay of η_t over the run, in (0, 1]: η_t = η₀ β^⌊t/P⌋, β = decay^{P/T}.
    lr_decay_every : int (default: 100)
        The decay period P in rounds (the paper's 100).
    num_rounds : int or None (default: None)
        T for the rate schedule; None: the ``num_rounds`` given to :meth:`start`.
    lambda_init : {"uniform", "size"} (default: "uniform")
        λ₀ uniform or proportional to the participants' ``num-examples``.
    proximal_mu : float (default: 0.0)
        μ ≥ 0 sent to the clients (MGDA-Prox when > 0).
    local_epochs : float or None (default: None)
        k > 0 local epochs (sent as ``local-epochs``).
    local_steps : int or None (default: None)
        τ ≥ 1 local steps (sent with ``local-epochs = 0``); ignored when ``local_epochs`` is set.
    lr : float or None (default: None)
        Client step size η_l (None: the clients' run config).
    batch_size : int or None (default: None)
        Client batch size b (None: the clients' run config).
    track_improvement : bool (default: False)
        Log the fraction of participants whose full training loss did not increase.
    improvement_before : {"train-loss", "query"} (default: "train-loss")
        Where f_i(w_t) comes from: the train reply's ``train_loss`` or a ``query.loss``.
    gram_precision : {"auto", "float32", "float64"} (default: "auto")
        Arithmetic of the Gram matrix (``auto``: the model's float dtype).
    server_device : {"auto", "cpu", "cuda"} (default: "auto")
        Where the server step runs (``auto``: the GPU for large models when there is one).
    name : str (default: "fedmgda+")
        Label of the variant for logs.
    **kwargs
        :class:`~flowerdro.strategies.base.FairStrategy` settings (``fraction_train`` p, seed, …).
    """

    name = "fedmgda+"

    def __init__(
        self,
        *,
        eps: float | None = 0.1,
        normalize: bool = True,
        global_lr: float = 1.0,
        lr_decay: float = 1.0,
        lr_decay_every: int = 100,
        num_rounds: int | None = None,
        lambda_init: str = "uniform",
        proximal_mu: float = 0.0,
        local_epochs: float | None = None,
        local_steps: int | None = None,
        lr: float | None = None,
        batch_size: int | None = None,
        track_improvement: bool = False,
        improvement_before: str = "train-loss",
        gram_precision: str = "auto",
        server_device: str = "auto",
        name: str = "fedmgda+",
        **kwargs: Any,
    ) -> None:
        self.name = name
        kwargs.setdefault("run_name", name)
        super().__init__(**kwargs)
        if eps is not None and not (isinstance(eps, int | float) and 0.0 <= float(eps) <= 1.0):
            raise ValueError(f"eps: must be in [0, 1] (or None for no box), got {eps!r}")
        if not (isinstance(global_lr, int | float) and math.isfinite(global_lr) and global_lr > 0):
            raise ValueError(f"global_lr: must be a finite number > 0, got {global_lr!r}")
        if not (isinstance(lr_decay, int | float) and 0.0 < float(lr_decay) <= 1.0):
            raise ValueError(f"lr_decay: must be in (0, 1], got {lr_decay!r}")
        if isinstance(lr_decay_every, bool) or not isinstance(lr_decay_every, int) or lr_decay_every < 1:
            raise ValueError(f"lr_decay_every: must be an integer >= 1, got {lr_decay_every!r}")
        if num_rounds is not None and num_rounds < 1:
            raise ValueError(f"num_rounds: must be >= 1, got {num_rounds}")
        if lambda_init not in LAMBDA_INITS:
            raise ValueError(f"lambda_init: must be one of {', '.join(LAMBDA_INITS)}, got {lambda_init!r}")
        if not proximal_mu >= 0:
            raise ValueError(f"proximal_mu: must be >= 0, got {proximal_mu}")
        if local_epochs is not None and not local_epochs > 0:
            raise ValueError(f"local_epochs: must be > 0, got {local_epochs}")
        if local_steps is not None and local_steps < 1:
            raise ValueError(f"local_steps: must be >= 1, got {local_steps}")
        if lr is not None and not lr > 0:
            raise ValueError(f"lr: must be > 0, got {lr}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if improvement_before not in IMPROVEMENT_BEFORE:
            raise ValueError(f"improvement_before: must be one of {', '.join(IMPROVEMENT_BEFORE)}, "
                             f"got {improvement_before!r}")
        if gram_precision not in GRAM_PRECISIONS:
            raise ValueError(f"gram_precision: must be one of {', '.join(GRAM_PRECISIONS)}, got {gram_precision!r}")
        if server_device not in DEVICES:
            raise ValueError(f"server_device: must be one of {', '.join(DEVICES)}, got {server_device!r}")
        self.eps = None if eps is None else float(eps)
        self.normalize = bool(normalize)
        self.global_lr = float(global_lr)
        self.lr_decay = float(lr_decay)
        self.lr_decay_every = int(lr_decay_every)
        self.num_rounds = num_rounds
        self._num_rounds_given = num_rounds is not None
        self.lambda_init = lambda_init
        self.proximal_mu = float(proximal_mu)
        self.local_epochs = local_epochs
        self.local_steps = local_steps
        self.lr = lr
        self.batch_size = batch_size
        self.track_improvement = bool(track_improvement)
        self.improvement_before = improvement_before
        self.gram_precision = gram_precision
        self.server_device = server_device
        #: The global model w_t last sent by :meth:`configure_train` (what the updates are relative to).
        self.current_arrays: ArrayRecord | None = None
        self._extras: dict[str, Any] = {}

    def settings(self) -> dict[str, Any]:  # noqa: D102
        out = super().settings()
        out.update({
            "variant": self.name, "eps": self.eps, "normalize": self.normalize, "global_lr": self.global_lr,
            "lr_decay": self.lr_decay, "lr_decay_every": self.lr_decay_every, "num_rounds": self.num_rounds,
            "lambda_init": self.lambda_init,
            "proximal_mu": self.proximal_mu, "local_epochs": self.local_epochs, "local_steps": self.local_steps,
            "lr": self.lr, "batch_size": self.batch_size, "track_improvement": self.track_improvement,
            "improvement_before": self.improvement_before, "gram_precision": self.gram_precision,
            "server_device": self.server_device,
        })
        return out

    # ------------------------------------------------------------------ schedule
    def global_rate(self, server_round: int) -> float:
        """η_t for server round t (1-based): :func:`fedmgda_lr` (t − 1, T, decay, η₀, every=P)."""
        total = self.num_rounds or max(int(server_round), 1)
        return fedmgda_lr(max(int(server_round) - 1, 0), int(total), self.lr_decay, self.global_lr,
                          every=self.lr_decay_every)

    # ------------------------------------------------------------------ configs
    def train_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        """The ``train.sgd`` config: run-config client keys overridden by the strategy's."""
        cfg = ConfigRecord(dict(config))
        cfg["server-round"] = int(server_round)
        if "seed" not in cfg:
            cfg["seed"] = self.seed
        if self.local_epochs is not None:
            cfg["local-epochs"] = float(self.local_epochs)
        elif self.local_steps is not None:
            cfg["local-steps"] = int(self.local_steps)
            cfg["local-epochs"] = 0.0  # τ exact, whatever the run config says
        if self.lr is not None:
            cfg["lr"] = float(self.lr)
        if self.batch_size is not None:
            cfg["batch-size"] = int(self.batch_size)
        if self.proximal_mu > 0:
            cfg["proximal-mu"] = self.proximal_mu
        if self.track_improvement and self.improvement_before == "train-loss":
            # "before" must be measured on the data "after" is (all local training data)
            cfg["train-loss-on"] = "full"
        return cfg

    def query_config(self, config: ConfigRecord, server_round: int) -> ConfigRecord:
        """The ``query.loss`` config: full local training loss."""
        cfg = ConfigRecord({k: config[k] for k in ("seed",) if k in config})
        cfg["server-round"] = int(server_round)
        cfg["loss-on"] = "full"
        if "seed" not in cfg:
            cfg["seed"] = self.seed
        return cfg

    # ------------------------------------------------------------------ Flower's Strategy API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample a fraction p of the nodes (seeded) and send them ``train.sgd`` with w_t."""
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        self.current_arrays = arrays
        content = RecordDict({"arrays": arrays, "config": self.train_config(config, server_round)})
        return self.build_messages(chosen, content, TRAIN_TYPE)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The FedMGDA+ step on the valid replies, all at once (w_t is :attr:`current_arrays`).

        :meth:`train_round` does the same step while the replies arrive
        (:meth:`start_stream`); this is the batch form for Flower's own loop and for tests.
        """
        self._extras = {}
        replies = [r for r in replies if not r.has_error()]
        if not replies:
            return None, None
        if self.current_arrays is None:
            raise RuntimeError("current_arrays: aggregate_train needs the global model w_t; call configure_train "
                               "first (or set strategy.current_arrays)")
        stream = self.start_stream(self.current_arrays, len(replies))
        stream.add(replies)
        return self.finish_stream(server_round, stream)

    # ------------------------------------------------------------------ the step as replies arrive
    def start_stream(self, arrays: ArrayRecord, capacity: int) -> ReplyStream:
        """A :class:`ReplyStream` for w_t = ``arrays`` and up to ``capacity`` replies."""
        return ReplyStream(arrays, capacity, normalize=self.normalize, gram_precision=self.gram_precision,
                           device=self.server_device)

    def finish_stream(self, server_round: int, stream: ReplyStream) -> tuple[ArrayRecord, MetricRecord]:
        """λ*, w_{t+1} and the round's metrics from a stream holding every valid reply."""
        eta = self.global_rate(server_round)
        step = stream.step.finish(eps=self.eps, global_lr=eta, center=_center(self.lambda_init, stream.sizes))
        pids = stream.partition_ids
        self._extras = {
            "lambda": {str(p): float(v) for p, v in zip(pids, step.lam, strict=True)},
            "update_norms": {str(p): float(v) for p, v in zip(pids, step.norms, strict=True)},
            "direction_norm": step.direction_norm,
            "global_lr": eta,
        }
        metrics = mean_of_metric_records(stream.metrics)
        metrics["direction_norm"] = step.direction_norm
        metrics["global_lr"] = eta
        metrics["lambda_max"] = float(step.lam.max())
        return numpy_to_arrays(stream.keys, step.arrays), metrics

    # ------------------------------------------------------------------ one round
    def train_round(
        self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
    ) -> tuple[ArrayRecord, MetricRecord | None]:
        """``train.sgd``, the server step built as replies arrive; then, when tracked, ``query.loss``.

        Each pulled batch of valid replies is added to a :class:`ReplyStream` at once
        (update, ‖g_i‖ and Gram rows), so after the last reply only its Gram row, the
        solve and the combination remain; ``server_step_s`` in the round record is that
        time (from the start of the last batch's work to the new model).
        """
        messages = list(self.configure_train(server_round, arrays, ConfigRecord(dict(config)), grid))
        self._extras = {}
        replies, new_arrays, metrics = self._stream_round(server_round, grid, arrays, messages)
        if new_arrays is None or metrics is None:
            log(WARNING, "[%s] round %d: no valid training reply; model unchanged", self.run_name, server_round)
            return arrays, None
        if self.track_improvement:
            frac = self._track(grid, server_round, arrays, new_arrays, config, replies)
            if frac is not None:
                metrics["improved_fraction"] = frac
        return new_arrays, metrics

    def _stream_round(
        self, server_round: int, grid: Grid, arrays: ArrayRecord, messages: list[Message]
    ) -> tuple[list[Message], ArrayRecord | None, MetricRecord | None]:
        """Send ``messages``, add each batch of valid replies to a stream as it arrives, then step."""
        if not messages:
            return [], None, None
        stream = self.start_stream(arrays, len(messages))
        last = [0.0]

        def on_replies(batch: list[Message]) -> None:
            last[0] = time.perf_counter()
            stream.add(batch)

        required = ("train_loss",) if self.track_improvement and self.improvement_before == "train-loss" else ()
        replies = self.communicate_stream(grid, messages, on_replies, phase="train", reference=arrays,
                                          required_metrics=required)
        if not replies:
            return [], None, None
        new_arrays, metrics = self.finish_stream(server_round, stream)
        self._extras["server_step_s"] = round(time.perf_counter() - last[0], 6)
        return replies, new_arrays, metrics

    def _losses(self, grid: Grid, node_ids: list[int], arrays: ArrayRecord, config: ConfigRecord,
                server_round: int, phase: str) -> dict[int, float]:
        content = RecordDict({"arrays": arrays, "config": self.query_config(config, server_round)})
        replies = self.communicate(grid, self.build_messages(node_ids, content, QUERY_TYPE), phase=phase,
                                   required_metrics=("loss",))
        return {int(_metrics(r.content)[PARTITION_ID]): float(_metrics(r.content)["loss"]) for r in replies}

    def _track(self, grid: Grid, server_round: int, old: ArrayRecord, new: ArrayRecord, config: ConfigRecord,
               replies: list[Message]) -> float | None:
        nodes = [int(r.metadata.src_node_id) for r in replies]
        if self.improvement_before == "query":
            before = self._losses(grid, nodes, old, config, server_round, "improvement-before")
        else:
            before = {int(_metrics(r.content)[PARTITION_ID]): float(_metrics(r.content)["train_loss"])
                      for r in replies}
        after = self._losses(grid, nodes, new, config, server_round, "improvement-after")
        frac = improved_fraction(before, after)
        self._extras["improved_fraction"] = frac
        self._extras["loss_change"] = {str(p): after[p] - before[p] for p in sorted(after) if p in before}
        return frac

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Any = None) -> Result:
        """The base loop; T of the rate schedule defaults to ``num_rounds``."""
        if not self._num_rounds_given:
            self.num_rounds = int(num_rounds)
        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout,
                             train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)

    def round_extras(self) -> dict[str, Any]:
        """λ* and ‖g_i‖ keyed by partition id, ‖d_t‖, η_t, and the improved fraction when tracked."""
        return dict(self._extras)
