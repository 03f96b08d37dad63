r"""The FedMGDA+ server step, built while the participants' models arrive (numpy only).

Hu, Shaloudegi, Zhang, Yu, "Federated Learning Meets Multi-objective Optimization",
IEEE TNSE 2022 (arXiv:2006.11489), Algorithm 1. For the global model w_t and participants
i = 1..m with local models w_i:

.. math::

    g_i = w_t − w_i,\quad ĝ_i = g_i/‖g_i‖ \;(0 \text{ if } g_i = 0),\quad Ĝ_{ij} = ⟨ĝ_i, ĝ_j⟩,

    λ^* = \operatorname{argmin}_{λ ∈ Δ_m,\ ‖λ − λ_0‖_∞ ≤ ε} λᵀĜλ,
    \qquad w_{t+1} = w_t − η_t Σ_i λ^*_i ĝ_i,

over the model's *update* arrays (its trainable parameters); every other array (a buffer:
BatchNorm's running statistics, its integer batch counter) becomes the λ*-weighted average
of the participants' values, Σ_i λ*_i b_i (rounded for integer arrays). Without
normalisation (vanilla FedMGDA) ĝ_i = g_i.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flowerdro.core.mgda import min_norm_weights

__all__ = ["GRAM_BLOCK", "GRAM_PRECISIONS", "ServerStep", "StreamingServerStep", "clip_negative_eigenvalues",
           "fedmgda_server_step"]

GRAM_PRECISIONS: tuple[str, ...] = ("auto", "float32", "float64")
#: Columns per block of the Gram products (each block's product is summed in float64).
GRAM_BLOCK = 1 << 16


@dataclass
class ServerStep:
    """What one server step computed: w_{t+1}'s arrays, λ*, ‖g_i‖, ‖d_t‖, η_t and λ₀."""

    arrays: list[np.ndarray]
    lam: np.ndarray
    norms: np.ndarray
    direction_norm: float
    global_lr: float
    center: np.ndarray


def clip_negative_eigenvalues(G: np.ndarray) -> np.ndarray:
    """G with its (rounding-size) negative eigenvalues set to 0: V max(Λ, 0) Vᵀ, symmetrised.

    A G that has a Cholesky factor (positive definite) is returned as it is.
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
    r"""The FedMGDA+ server step (module docstring), built up one batch of participants at a time.

    * :meth:`add` writes g_i = w_t − w_i (update arrays only) into row i of a preallocated
      (capacity × d) matrix X and computes the new rows of the Gram matrix against every
      update received so far, G_ij = ⟨g_i, g_j⟩ (j ≤ i), as column blocks of 2¹⁶
      multiplied in the Gram precision and summed in float64;
    * :meth:`finish` normalises, Ĝ = D⁻¹GD⁻¹ with D = diag(‖g_i‖), ‖g_i‖ = √G_ii, solves
      for λ* with :func:`~flowerdro.core.mgda.min_norm_weights`, and steps
      w_{t+1} = w_t − η_t Xᵀ(λ*/‖g‖) (the normalisation folded into the weights, so X is
      never rescaled). Buffers become Σ_i λ*_i b_i.

    With float32 arithmetic, Ĝ's rounding-size negative eigenvalues are clipped to 0
    before the solve. Adding every participant in one batch gives
    :func:`fedmgda_server_step`.

    Parameters
    ----------
    global_arrays : sequence of np.ndarray
        w_t, one array per model entry.
    capacity : int
        The most participants that can be added.
    updates : sequence of bool, optional
        Which arrays are updates (trainable parameters); the others are buffers. Default:
        the floating-point arrays. An integer array cannot be an update.
    normalize : bool (default: True)
        Normalise the updates (FedMGDA+, FedAvg-n) or not (FedMGDA: ĝ_i = g_i).
    gram_precision : {"auto", "float32", "float64"} (default: "auto")
        Arithmetic of the Gram products (sums always float64); ``auto``: float32 for
        float32 models, float64 otherwise.
    """

    def __init__(
        self,
        global_arrays: Sequence[np.ndarray],
        capacity: int,
        *,
        updates: Sequence[bool] | None = None,
        normalize: bool = True,
        gram_precision: str = "auto",
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1:
            raise ValueError(f"capacity: must be an integer >= 1, got {capacity!r}")
        if gram_precision not in GRAM_PRECISIONS:
            raise ValueError(f"gram_precision: must be one of {', '.join(GRAM_PRECISIONS)}, got {gram_precision!r}")
        w = [np.asarray(a) for a in global_arrays]
        floating = [bool(np.issubdtype(a.dtype, np.floating)) for a in w]
        mask = list(floating) if updates is None else [bool(u) for u in updates]
        if len(mask) != len(w):
            raise ValueError(f"updates: has {len(mask)} entries, the model has {len(w)} arrays")
        if any(u and not f for u, f in zip(mask, floating, strict=True)):
            raise ValueError("updates: an integer array cannot be an update")
        self._w, self._update = w, mask
        self._spans: list[tuple[int, int, int]] = []  # (array index, offset, size) of the updates in a row
        off = 0
        for k, a in enumerate(w):
            if mask[k]:
                self._spans.append((k, off, int(a.size)))
                off += int(a.size)
        self.dim = off
        fl = [w[k].dtype for k, _, _ in self._spans]
        self.dtype = np.dtype(np.result_type(np.float32, *fl)) if fl else np.dtype(np.float64)
        self.precision = gram_precision if gram_precision != "auto" else (
            "float32" if self.dtype == np.float32 else "float64")
        self.normalize = bool(normalize)
        self.capacity = int(capacity)
        self.count = 0
        self._w_flat = np.empty(self.dim, dtype=self.dtype)
        for k, o, n in self._spans:
            self._w_flat[o : o + n] = w[k].reshape(-1)
        self._X = np.empty((self.capacity, self.dim), dtype=self.dtype)
        self._G = np.zeros((self.capacity, self.capacity))
        self._buffers: list[list[np.ndarray]] = []  # each participant's buffers

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
            for i, (a, ref) in enumerate(zip(loc, self._w, strict=True)):
                if a.shape != ref.shape:
                    raise ValueError(f"local_arrays: array {i} of participant {n0 + j} has shape {a.shape}, "
                                     f"expected {ref.shape}")
            locs.append(loc)
        for j, loc in enumerate(locs):
            for a, o, n in self._spans:
                np.subtract(self._w[a].reshape(-1), loc[a].reshape(-1), out=self._X[n0 + j, o : o + n],
                            casting="unsafe")
        R = self._gram_rows(n0, n1)
        if not np.all(np.isfinite(R)):
            raise ValueError("local_arrays: the updates contain NaN or Inf")
        self._G[n0:n1, :n0] = R[:, :n0]
        self._G[:n0, n0:n1] = R[:, :n0].T
        self._G[n0:n1, n0:n1] = 0.5 * (R[:, n0:n1] + R[:, n0:n1].T)
        self._buffers.extend([a for a, u in zip(loc, self._update, strict=True) if not u] for loc in locs)
        self.count = n1

    def _gram_rows(self, n0: int, n1: int) -> np.ndarray:
        """⟨g_i, g_j⟩ for new rows i ∈ [n0, n1) and all j < n1: (n1 − n0) × n1, float64."""
        acc = np.zeros((n1 - n0, n1))
        work = np.float64 if self.precision == "float64" else np.float32
        for j in range(0, self.dim, GRAM_BLOCK):
            P = self._X[n0:n1, j : j + GRAM_BLOCK].astype(work, copy=False)
            Q = self._X[:n1, j : j + GRAM_BLOCK].astype(work, copy=False)
            acc += P @ Q.T
        return acc

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
        m = self.count
        if m == 0:
            raise ValueError("local_arrays: at least one participant's model is required")
        G = self._G[:m, :m].copy()
        if self.precision == "float32" and m > 1:
            G = clip_negative_eigenvalues(G)
        norms = np.sqrt(np.maximum(np.diag(G), 0.0))
        scale = np.ones(m)
        if self.normalize:
            nz = norms > 0.0
            scale = np.where(nz, 1.0 / np.where(nz, norms, 1.0), 0.0)
            G = G * np.outer(scale, scale)
            G[np.diag_indices(m)] = nz.astype(np.float64)
        c = np.full(m, 1.0 / m) if center is None else np.asarray(center, dtype=np.float64)
        lam = min_norm_weights(G, eps=eps, center=c)
        coef = np.asarray(lam * scale, dtype=self.dtype)
        flat = np.empty_like(self._w_flat)
        for j in range(0, self.dim, GRAM_BLOCK):
            blk = slice(j, j + GRAM_BLOCK)
            flat[blk] = self._w_flat[blk] - self.dtype.type(global_lr) * (coef @ self._X[:m, blk])
        new: list[np.ndarray] = []
        spans = {k: (o, n) for k, o, n in self._spans}
        b = 0
        for k, a in enumerate(self._w):
            if self._update[k]:
                o, n = spans[k]
                new.append(flat[o : o + n].reshape(a.shape).astype(a.dtype, copy=False))
                continue
            acc = np.zeros(a.shape, dtype=np.float64)
            for li, bufs in zip(lam, self._buffers, strict=True):
                acc += li * np.asarray(bufs[b], dtype=np.float64)
            new.append(acc.astype(a.dtype) if np.issubdtype(a.dtype, np.floating) else np.rint(acc).astype(a.dtype))
            b += 1
        dnorm = float(math.sqrt(max(float(lam @ G @ lam), 0.0)))
        return ServerStep(new, lam, norms, dnorm, float(global_lr), c)


def fedmgda_server_step(
    global_arrays: Sequence[np.ndarray],
    local_arrays: Sequence[Sequence[np.ndarray]],
    *,
    eps: float | None,
    global_lr: float,
    updates: Sequence[bool] | None = None,
    normalize: bool = True,
    center: np.ndarray | None = None,
    gram_precision: str = "auto",
) -> ServerStep:
    r"""One FedMGDA+ server step (module docstring) from every participant's model at once.

    :class:`StreamingServerStep` with all models added in one batch; the parameters are
    those of its constructor and :meth:`StreamingServerStep.finish`.
    """
    if len(local_arrays) == 0:
        raise ValueError("local_arrays: at least one participant's model is required")
    step = StreamingServerStep(global_arrays, len(local_arrays), updates=updates, normalize=normalize,
                               gram_precision=gram_precision)
    step.add(local_arrays)
    return step.finish(eps=eps, global_lr=global_lr, center=center)
