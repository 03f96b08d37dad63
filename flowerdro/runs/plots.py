"""Figures that show fairness: who is served, round by round (matplotlib, no display needed).

:func:`plot_comparison` draws one figure a user would put in a slide:

* the distribution of per-client accuracy at the end of training, clients sorted from
  the worst to the best (the curve a fair model lifts at its left end);
* the worst-20% and the mean client accuracy per round (mean over seeds with a ±1 std
  band when there are several);
* for every strategy that keeps client weights (DRFA and AFL's λ, SCAFF-PD's λ, FedMGDA+'s
  λ* over the round's participants), those weights per round, the worst client's in red.

A regression run (no accuracy, only a test loss per client) gets the same panels on the
loss, worst meaning highest. :func:`plot_history` draws plain per-round curves of chosen
keys, for scripts.

The figures are of run results (the round records of :mod:`flowerdro.runs.records`) and
are written like every file of a run folder (:func:`flowerdro.runs.files.save_figure`:
atomically, never through a link): a run's ``progress.png``
(:class:`~flowerdro.runs.output.RunWriter`) and a comparison's ``comparison.png``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flowerdro.runs.files import save_figure

History = Sequence[Mapping[str, Any]]

__all__ = ["plot_comparison", "plot_history"]


def _curve(history: History, key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["round"], r[key]) for r in history if key in r]
    if not pts:
        return np.array([]), np.array([])
    x, y = zip(*pts, strict=True)
    return np.asarray(x), np.asarray(y, dtype=float)


def _moving_average(y: np.ndarray, k: int) -> np.ndarray:
    """Trailing mean over the last ``k`` points (fewer at the start)."""
    if k <= 1:
        return y
    c = np.cumsum(np.insert(np.asarray(y, dtype=float), 0, 0.0))
    idx = np.arange(1, y.size + 1)
    lo = np.maximum(0, idx - k)
    return (c[idx] - c[lo]) / (idx - lo)


def _seeds(hist: History | Sequence[History]) -> list[History]:
    """One history, or several (one per seed), as a list of histories."""
    if not hist:
        return []
    return [hist] if isinstance(hist[0], Mapping) else list(hist)  # type: ignore[list-item]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _band(ax: Any, runs: Mapping[str, Any], key: str, smooth: int = 1) -> bool:
    """Mean over seeds of ``key`` per round, with a ±1 std band; whether anything was drawn."""
    drawn = False
    for name, hist in runs.items():
        curves = [c for c in (_curve(h, key) for h in _seeds(hist)) if c[0].size]
        if not curves:
            continue
        n = min(c[0].size for c in curves)
        x = curves[0][0][:n]
        ys = np.stack([_moving_average(c[1][:n], smooth) for c in curves])
        m = ys.mean(0)
        (line,) = ax.plot(x, m, label=name, lw=1.8)
        if ys.shape[0] > 1:
            sd = ys.std(0)
            ax.fill_between(x, m - sd, m + sd, alpha=0.18, color=line.get_color())
        drawn = True
    return drawn


def _final_clients(history: History, key: str) -> np.ndarray:
    """The per-client values of the last round that has them."""
    for rec in reversed(history):
        if rec.get(key):
            return np.asarray(list(rec[key].values()), dtype=float)
    return np.array([])


def plot_history(
    runs: Mapping[str, History | Sequence[History]],
    path: str | Path,
    *,
    keys: Sequence[tuple[str, str]] = (("acc_worst", "worst-client accuracy"), ("acc_mean", "mean client accuracy"),
                                       ("acc_std", "std of client accuracy")),
    title: str | None = None,
    smooth: int = 1,
) -> Path:
    """Per-round curves of ``keys`` (one panel each) for each run; several seeds give mean ± std.

    ``smooth = k > 1`` replaces each seed's curve by its trailing moving average over k
    evaluated rounds first.
    """
    if smooth < 1:
        raise ValueError(f"smooth: window must be >= 1, got {smooth}")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], keys, strict=True):
        _band(ax, runs, key, smooth)
        ax.set_xlabel("communication round")
        ax.set_ylabel(label if smooth <= 1 else f"{label}\n(moving average over {smooth} rounds)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, plt, path)


def plot_comparison(runs: Mapping[str, History | Sequence[History]], path: str | Path, *,
                    title: str | None = None) -> Path:
    """The fairness figure of a comparison (see the module docstring); ``runs``: label → history or seeds."""
    plt = _pyplot()
    runs = {k: v for k, v in runs.items() if _seeds(v)}
    acc = any("acc_mean" in r for hist in runs.values() for h in _seeds(hist) for r in h)
    per_client, worst_key, mean_key, unit = (("client_acc", "acc_worst20", "acc_mean", "accuracy") if acc
                                             else ("client_loss", "loss_worst", "loss_mean", "test loss"))
    weighted = [name for name, hist in runs.items() if any("lambda" in r for r in _seeds(hist)[0])]
    ncols = max(3, len(weighted))
    nrows = 2 if weighted else 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.8 * nrows), squeeze=False)

    ax = axes[0][0]
    for name, hist in runs.items():
        finals = [np.sort(v) if acc else np.sort(v)[::-1] for v in (_final_clients(h, per_client) for h in _seeds(hist))
                  if v.size]
        if not finals:
            continue
        n = min(v.size for v in finals)
        y = np.mean([v[:n] for v in finals], axis=0)
        ax.plot(np.arange(1, n + 1), y, marker="o", ms=3, lw=1.5, label=name)
    ax.set_xlabel("clients, worst to best")
    ax.set_ylabel(f"final {unit}")
    ax.set_title(f"per-client {unit} after the last round", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    for ax, key, label in ((axes[0][1], worst_key, "worst-20% clients" if acc else "worst client"),
                           (axes[0][2], mean_key, "mean over clients")):
        _band(ax, runs, key)
        ax.set_xlabel("communication round")
        ax.set_ylabel(f"{unit}, {label}")
        ax.set_title(f"{label}, per round", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[0][3:]:
        ax.axis("off")

    for k, name in enumerate(weighted):
        _plot_weights(axes[1][k], _seeds(runs[name])[0], name, per_client, acc)
    for ax in (axes[1][len(weighted):] if weighted else []):
        ax.axis("off")
    if title:
        fig.suptitle(title)
    return _save(fig, plt, path)


def _plot_weights(ax: Any, history: History, name: str, per_client: str, acc: bool) -> None:
    """Client weights per round (λ, or λ* of the round's participants), the worst client's in red."""
    final = next((r[per_client] for r in reversed(history) if r.get(per_client)), {})
    worst = (min if acc else max)(final, key=final.get) if final else None
    clients = sorted({p for r in history for p in r.get("lambda", {})}, key=int)
    for p in clients:
        pts = [(r["round"], r["lambda"][p]) for r in history if p in r.get("lambda", {})]
        x, y = zip(*pts, strict=True)
        style = {"color": "tab:red", "lw": 2.2, "zorder": 3, "label": f"worst client ({p})"} if p == worst \
            else {"color": "0.55", "lw": 0.8, "alpha": 0.7}
        if len(pts) == len(history):
            ax.plot(x, y, **style)
        else:  # sampled participants: weights only in the rounds a client took part
            ax.scatter(x, y, s=8, **{k: v for k, v in style.items() if k not in ("lw",)})
    if clients:
        per_round = int(np.median([len(r["lambda"]) for r in history if r.get("lambda")]))
        ax.axhline(1.0 / per_round, color="k", ls=":", lw=1, label="uniform")
    ax.set_xlabel("communication round")
    ax.set_ylabel("client weight λ")
    ax.set_title(f"{name}: client weights", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_figure(fig, path, dpi=110)  # by atomic rename: never through a link planted at path
    finally:
        plt.close(fig)
    return path
