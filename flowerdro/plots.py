"""PNG plots of per-round fairness metrics (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _curve(history: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["round"], r[key]) for r in history if key in r]
    if not pts:
        return np.array([]), np.array([])
    x, y = zip(*pts, strict=True)
    return np.asarray(x), np.asarray(y)


def _moving_average(y: np.ndarray, k: int) -> np.ndarray:
    """Trailing mean over the last ``k`` points (fewer at the start)."""
    if k <= 1:
        return y
    c = np.cumsum(np.insert(np.asarray(y, dtype=float), 0, 0.0))
    idx = np.arange(1, y.size + 1)
    lo = np.maximum(0, idx - k)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_history(
    runs: Mapping[str, Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]]],
    path: str | Path,
    *,
    keys: Sequence[tuple[str, str]] = (("acc_worst", "worst-client accuracy"), ("acc_mean", "mean client accuracy"),
                                       ("acc_std", "std of client accuracy")),
    title: str | None = None,
    smooth: int = 1,
) -> Path:
    """Plot per-round curves for each run (one panel per key).

    ``runs`` maps a label to one history (list of round records) or to several (seeds),
    in which case the mean is drawn with a ±1 std band. ``smooth = k > 1`` replaces each
    seed's curve by its trailing moving average over k evaluated rounds first.
    """
    if smooth < 1:
        raise ValueError(f"smooth: window must be >= 1, got {smooth}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], keys, strict=True):
        for name, hist in runs.items():
            seeds = [hist] if hist and isinstance(hist[0], Mapping) else list(hist)
            curves = [_curve(h, key) for h in seeds]
            curves = [c for c in curves if c[0].size]
            if not curves:
                continue
            n = min(c[0].size for c in curves)
            x = curves[0][0][:n]
            ys = np.stack([_moving_average(c[1][:n], smooth) for c in curves])
            m = ys.mean(0)
            line, = ax.plot(x, m, label=name)
            if ys.shape[0] > 1:
                sd = ys.std(0)
                ax.fill_between(x, m - sd, m + sd, alpha=0.2, color=line.get_color())
        ax.set_xlabel("communication round")
        ax.set_ylabel(label if smooth <= 1 else f"{label}\n(moving average over {smooth} rounds)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
