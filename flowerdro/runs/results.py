"""The one reader of what runs leave on disk.

A run's folder holds ``settings.json``, ``rounds.jsonl`` (one record per round),
``final_model.npz`` and plots; a comparison's folder holds one run folder per strategy
label (and, from the experiments runner, per seed: ``<label>/seed<k>/``) plus
``summary.json``. Every script that reads results goes through these functions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from flowerdro.runs.records import expand_record

__all__ = ["load_comparison", "load_records", "load_settings", "run_dirs"]

_SEED_DIR = re.compile(r"seed(\d+)$")


def load_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The round records of one run (``<run_dir>/rounds.jsonl``), in round order."""
    path = Path(run_dir) / "rounds.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"results: no rounds.jsonl in {run_dir}")
    return [expand_record(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def load_settings(run_dir: str | Path) -> dict[str, Any]:
    """The settings a run was started with (``<run_dir>/settings.json``; empty if absent)."""
    path = Path(run_dir) / "settings.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def run_dirs(root: str | Path) -> dict[str, dict[int, Path]]:
    """label → {seed: run folder} under a comparison folder.

    Understands both layouts: ``<root>/<label>/seed<k>/rounds.jsonl`` (experiments
    runner) and ``<root>/<label>/rounds.jsonl`` (one run per label, seed from its
    settings).
    """
    root = Path(root)
    out: dict[str, dict[int, Path]] = {}
    for label_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        seeds = {int(m.group(1)): d for d in label_dir.iterdir()
                 if d.is_dir() and (m := _SEED_DIR.match(d.name)) and (d / "rounds.jsonl").is_file()}
        if not seeds and (label_dir / "rounds.jsonl").is_file():
            seeds = {int(load_settings(label_dir).get("seed", 0)): label_dir}
        if seeds:
            out[label_dir.name] = dict(sorted(seeds.items()))
    return out


def load_comparison(root: str | Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """label → {seed: round records} for every run under a comparison folder."""
    return {label: {seed: load_records(d) for seed, d in seeds.items()} for label, seeds in run_dirs(root).items()}
