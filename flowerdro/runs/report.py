"""Summaries and comparison tables of finished runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: Columns of the comparison table: (key in the summary, header).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("acc_mean", "mean acc"),
    ("acc_worst", "worst"),
    ("acc_worst10", "worst-10%"),
    ("acc_worst20", "worst-20%"),
    ("acc_best20", "best-20%"),
    ("acc_std", "std"),
    ("loss_mean", "mean loss"),
)


def final_summary(history: Sequence[Mapping[str, Any]], last: int = 1) -> dict[str, float]:
    """Fairness numbers of a run: the mean over its last ``last`` evaluated rounds.

    Also reports ``rounds``, total ``time_s``, ``bytes`` and ``dropped`` replies.
    """
    evaluated = [r for r in history if "acc_mean" in r]
    out: dict[str, float] = {
        "rounds": float(len(history)),
        "time_s": float(sum(r.get("time_s", 0.0) for r in history)),
        "bytes": float(sum(r.get("bytes_sent", 0) + r.get("bytes_received", 0) for r in history)),
        "dropped": float(sum(sum(r.get("failures", {}).values()) for r in history)),
    }
    if evaluated:
        tail = evaluated[-max(1, last):]
        for key, _ in COLUMNS:
            vals = [r[key] for r in tail if key in r]
            if vals:
                out[key] = float(np.mean(vals))
    return out


def first_round_reaching(history: Sequence[Mapping[str, Any]], key: str, threshold: float) -> int | None:
    """First round whose ``key`` is at least ``threshold`` (None if never)."""
    for r in history:
        if key in r and r[key] >= threshold:
            return int(r["round"])
    return None


def comparison_table(
    summaries: Mapping[str, Mapping[str, float] | Sequence[Mapping[str, float]]],
    columns: Sequence[tuple[str, str]] = COLUMNS,
) -> str:
    """A Markdown table, one row per strategy; lists of summaries (seeds) give mean ± std."""
    header = "| strategy | " + " | ".join(h for _, h in columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 1)]
    for name, summ in summaries.items():
        runs = [summ] if isinstance(summ, Mapping) else list(summ)
        cells = []
        for key, _ in columns:
            vals = [float(r[key]) for r in runs if key in r]
            if not vals:
                cells.append("–")
            elif len(vals) == 1:
                cells.append(f"{vals[0]:.4f}")
            else:
                cells.append(f"{np.mean(vals):.4f} ± {np.std(vals):.4f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
