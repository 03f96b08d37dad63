#!/usr/bin/env python3
"""Regenerate the tables and figures of docs/results.md from ``results/``.

    python scripts/results_page.py            # rewrite every block whose results exist
    python scripts/results_page.py --check    # exit 1 when a block is out of date, write nothing

The page marks what this script owns with two kinds of blocks:

``<!-- table:EXPERIMENT [key=value ...] -->`` … ``<!-- /table -->``
    A Markdown table, one row per strategy label, each cell the mean ± std over seeds of
    one number of ``results/EXPERIMENT/summary.json`` (written by
    ``python -m flowerdro.experiments conf/EXPERIMENT.toml``). The std is the population
    std, ``numpy.std(ddof=0)``, as in the runner's own ``table.md``
    (:func:`flowerdro.runs.report.comparison_table`). Options:

    * ``columns=acc_mean,acc_worst20`` — the summary keys shown, in order (default: the
      runner's columns, :data:`flowerdro.runs.report.COLUMNS`);
    * ``per-seed=acc_worst20`` — instead of ``columns``, one column per seed of this one
      number, then its mean ± std;
    * ``rows=fedavg,drfa`` — the labels shown, in order (default: all, in config order);
    * ``scale=100`` — multiply every number (percent); ``digits=2`` — decimals (default 4);
    * a column ``reach:KEY:THRESHOLD`` (e.g. ``reach:acc_worst:0.5``) — the first round
      whose KEY is at least THRESHOLD, from the round logs
      (:func:`flowerdro.runs.report.first_round_reaching`), over the seeds that reach it,
      with the count of seeds that never do;
    * ``last=K`` — recompute each run's numbers as the mean over its last K evaluated
      rounds from ``<label>/seed<k>/rounds.jsonl`` (:func:`flowerdro.runs.report.final_summary`)
      instead of the runner's ``last-rounds``;
    * ``source=robustness`` — read ``results/EXPERIMENT/robustness.json`` (written by
      ``scripts/repro_fedrobust.py``) instead: per seed, ``clean``, ``fed_acc_mean``, … and
      ``SWEEP@RADIUS`` for the sweeps (``affine_lambda@0.4``, ``affine_delta@2``, ``pgd@1``).

    Rows whose first cell starts with ``paper`` are written by hand (the paper's numbers)
    and kept, after the generated rows.

``<!-- figure:EXPERIMENT [rows=...] -->`` ``![caption](figures/NAME.png)`` ``<!-- /figure -->``
    The image the block links is redrawn with :func:`flowerdro.runs.plots.plot_comparison` from
    every ``results/EXPERIMENT/<label>/seed<k>/rounds.jsonl`` (all seeds of a label
    together). ``--check`` draws it to a temporary file and compares the bytes. Options:
    ``source=robustness sweep=affine_delta`` (or ``affine_lambda``, ``pgd``) draws that sweep
    of ``results/EXPERIMENT/robustness.json`` (FedRobust); ``source=scaling`` draws the honest
    and attacked runs of a scaling-attack experiment (FedMGDA+).

An experiment with nothing under ``results/`` is reported and its blocks are left as they
are.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):  # the package, and the repro scripts that draw their papers' figures
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from flowerdro.runs.report import COLUMNS, final_summary, first_round_reaching  # noqa: E402
from flowerdro.runs.results import load_comparison  # noqa: E402

PAGE = ROOT / "docs" / "results.md"
BLOCK = re.compile(r"<!-- (table|figure):([A-Za-z0-9_.+-]+)((?: [a-z-]+=\S+)*) -->\n(.*?)<!-- /\1 -->", re.S)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")
#: Where a figure block's figure comes from (the first is the default).
FIGURE_SOURCES = ("runs", "robustness", "scaling")
OPTIONS = {"table": ("columns", "rows", "scale", "digits", "last", "source", "per-seed"),
           "figure": ("rows", "source", "sweep")}
SOURCES = {"summary": "summary.json", "robustness": "robustness.json"}
SEED = "_seed"  # the seed of a per-seed entry, added by seed_values
HEADERS = {**dict(COLUMNS), "clean": "clean acc", "fed_acc_mean": "mean acc (shifted nodes)",
           "fed_acc_worst": "worst (shifted nodes)", "lambda-dev-fro": "‖Λ_i − I‖_F", "delta-norm": "‖δ_i‖₂"}
SWEEP_HEADERS = {"affine_lambda": "worst affine, ‖Λ−I‖_F ≤ {r}", "affine_delta": "worst affine, ‖δ‖₂ ≤ {r}",
                 "pgd": "ℓ₂ PGD, ε = {r}"}

__all__ = ["main", "render_table", "seed_values", "update_page"]


def parse_options(kind: str, name: str, text: str) -> dict[str, str]:
    """The ``key=value`` options of a block's opening marker, checked against the allowed keys."""
    opts = dict(item.split("=", 1) for item in text.split())
    unknown = sorted(set(opts) - set(OPTIONS[kind]))
    if unknown:
        raise SystemExit(f"{kind}:{name}: unknown option {unknown[0]!r}; allowed: {', '.join(OPTIONS[kind])}")
    allowed = SOURCES if kind == "table" else FIGURE_SOURCES
    if opts.get("source", next(iter(allowed))) not in allowed:
        raise SystemExit(f"{kind}:{name}: source={opts['source']!r}; allowed: {', '.join(allowed)}")
    return opts


def _flatten(entry: Mapping[str, Any]) -> dict[str, float]:
    """One seed of a robustness report as flat numbers: scalars, and ``SWEEP@RADIUS`` per sweep point."""
    out: dict[str, float] = {}
    for key, value in entry.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out[key] = float(value)
        elif key in SWEEP_HEADERS and isinstance(value, Mapping):
            out.update({f"{key}@{float(r):g}": float(v) for r, v in value.items()})
    return out


def seed_values(exp_dir: Path, opts: Mapping[str, str]) -> dict[str, list[dict[str, float]]] | None:
    """label → one dict of numbers per seed, from the experiment's results (None when there are none).

    ``summary.json``'s ``summaries`` as they are; with ``last=K`` each run's
    :func:`~flowerdro.runs.report.final_summary` over its last K evaluated rounds; with
    ``source=robustness`` each seed of ``robustness.json`` flattened.
    """
    values = _base_values(exp_dir, opts)
    reach = [c for c in opts.get("columns", "").split(",") if c.startswith("reach:")]
    if values is None or not reach:
        return values
    runs = load_comparison(exp_dir) if exp_dir.is_dir() else {}
    for label, per_seed in values.items():
        for entry in per_seed:
            history = runs.get(label, {}).get(entry.get(SEED))
            for column in reach if history is not None else ():
                _, key, threshold = column.split(":")
                first = first_round_reaching(history, key, float(threshold))
                entry[column] = float("nan") if first is None else float(first)
    return values


def _base_values(exp_dir: Path, opts: Mapping[str, str]) -> dict[str, list[dict[str, float]]] | None:
    source = opts.get("source", "summary")
    path = exp_dir / SOURCES[source]
    if source == "robustness":
        if not path.is_file():
            return None
        report = json.loads(path.read_text())
        return {label: [{**_flatten(e), SEED: int(k)} for k, e in sorted(entry.get("seeds", {}).items(),
                                                                         key=lambda kv: int(kv[0]))]
                for label, entry in report.get("strategies", {}).items()}
    if "last" in opts:
        runs = _in_config_order(exp_dir, load_comparison(exp_dir) if exp_dir.is_dir() else {})
        last = int(opts["last"])
        return {label: [{**final_summary(h, last=last), SEED: seed} for seed, h in seeds.items()]
                for label, seeds in runs.items()} or None
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    seeds = [int(s) for s in summary.get("seeds", [])]
    return {label: [{**entry, **({SEED: seeds[i]} if i < len(seeds) else {})} for i, entry in enumerate(runs)]
            for label, runs in summary["summaries"].items()}


def _in_config_order(exp_dir: Path, runs: dict[str, Any]) -> dict[str, Any]:
    """``runs`` with its labels in the order of the experiment's ``summary.json`` (the config's), others after."""
    path = exp_dir / "summary.json"
    order = list(json.loads(path.read_text()).get("summaries", {})) if path.is_file() else []
    return {label: runs[label] for label in [*(x for x in order if x in runs), *(x for x in runs if x not in order)]}


def _header(key: str) -> str:
    if key.startswith("reach:"):
        _, inner, threshold = key.split(":")
        return f"first round {HEADERS.get(inner, inner)} ≥ {threshold}"
    if "@" in key:
        sweep, radius = key.split("@", 1)
        if sweep in SWEEP_HEADERS:
            return SWEEP_HEADERS[sweep].format(r=radius)
    return HEADERS.get(key, key)


def _cell(values: Sequence[float], scale: float, digits: int) -> str:
    """``mean ± std`` over seeds (population std, ddof = 0); one seed: the value alone."""
    if not values:
        return "–"
    if any(np.isnan(values)):  # a reach column: rounds, over the seeds that reach the threshold
        reached = [v for v in values if not np.isnan(v)]
        never = f"{len(values) - len(reached)} of {len(values)} never"
        return f"{_cell(reached, 1.0, 0)} ({never})" if reached else "never"
    arr = np.asarray(values, dtype=float) * scale
    if arr.size == 1:
        return f"{arr[0]:.{digits}f}"
    return f"{arr.mean():.{digits}f} ± {arr.std(ddof=0):.{digits}f}"


def _selected(name: str, available: Sequence[str], wanted: str | None) -> list[str]:
    if wanted is None:
        return list(available)
    rows = [r for r in wanted.split(",") if r]
    missing = [r for r in rows if r not in available]
    if missing:
        raise SystemExit(f"{name}: rows: {missing[0]!r} is not a label of its results ({', '.join(available)})")
    return rows


def render_table(name: str, values: Mapping[str, Sequence[Mapping[str, float]]], opts: Mapping[str, str],
                 kept: Sequence[str] = ()) -> str:
    """The Markdown table of a ``table`` block: one row per label, one column per number.

    Each cell is ``mean ± std`` of ``scale · x_s`` over the seeds s that have the number,
    with std = sqrt(mean((x_s − mean)²)) (ddof = 0); ``kept`` rows (the paper's) follow.
    """
    labels = _selected(f"table:{name}", list(values), opts.get("rows"))
    scale, digits = float(opts.get("scale", 1)), int(opts.get("digits", 4))
    if "per-seed" in opts:
        return _per_seed_table(values, labels, opts["per-seed"], scale, digits, kept)
    present = [k for k, _ in COLUMNS if any(k in s for lab in labels for s in values[lab])]
    columns = [c for c in opts["columns"].split(",") if c] if "columns" in opts else present
    lines = ["| strategy | " + " | ".join(_header(c) for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label in labels:
        cells = [_cell([s[c] for s in values[label] if c in s], *((1.0, 0) if c.startswith("reach:") else
                                                                 (scale, digits))) for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, *kept]) + "\n"


def _per_seed_table(values: Mapping[str, Sequence[Mapping[str, float]]], labels: Sequence[str], key: str,
                    scale: float, digits: int, kept: Sequence[str]) -> str:
    """One column per seed of the number ``key``, then its mean ± std over the seeds."""
    seeds = sorted({int(s[SEED]) for label in labels for s in values[label] if SEED in s and key in s})
    lines = ["| strategy | " + " | ".join(f"seed {k}" for k in seeds) + f" | {_header(key)}, mean ± std |",
             "|---" * (len(seeds) + 2) + "|"]
    for label in labels:
        by_seed = {int(s[SEED]): s[key] for s in values[label] if SEED in s and key in s}
        cells = [_cell([by_seed[k]], scale, digits) if k in by_seed else "–" for k in seeds]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_cell(list(by_seed.values()), scale, digits)} |")
    return "\n".join([*lines, *kept]) + "\n"


def _figure(exp_dir: Path, opts: Mapping[str, str], name: str, path: Path) -> bool:
    """Draw the figure of an experiment to ``path``; False when it has no runs.

    By default the comparison figure (:func:`flowerdro.runs.plots.plot_comparison`) of every
    run; ``source=robustness sweep=KEY`` draws one sweep of ``robustness.json`` as
    ``scripts/repro_fedrobust.py`` does; ``source=scaling`` draws the honest and attacked
    runs as ``scripts/repro_fedmgda.py report`` does.
    """
    source = opts.get("source", "runs")
    if source == "robustness":
        report = exp_dir / "robustness.json"
        if not report.is_file():
            return False
        from repro_fedrobust import plot_sweep

        plot_sweep(json.loads(report.read_text()), opts.get("sweep", "affine_delta"), path)
        return True
    if source == "scaling":
        from repro_fedmgda import scaling_report

        return scaling_report(name, path=path, results=exp_dir.parent)
    from flowerdro.runs.plots import plot_comparison

    runs = _in_config_order(exp_dir, load_comparison(exp_dir) if exp_dir.is_dir() else {})
    if not runs:
        return False
    labels = _selected(f"figure:{name}", list(runs), opts.get("rows"))
    plot_comparison({label: list(runs[label].values()) for label in labels}, path)
    return True


def update_page(page: Path, results: Path, check: bool = False) -> tuple[str, list[str], list[str]]:
    """The page with every block regenerated, the blocks that changed, and the experiments missing.

    Figures are written next to the page unless ``check`` (then drawn to a temporary
    folder and compared byte for byte with the file the block links).
    """
    text = page.read_text()
    changed: list[str] = []
    missing: list[str] = []

    def block(m: re.Match[str]) -> str:
        kind, name, raw, body = m.group(1), m.group(2), m.group(3), m.group(4)
        opts = parse_options(kind, name, raw)
        exp_dir = results / name
        if kind == "table":
            values = seed_values(exp_dir, opts)
            if values is None:
                where = "runs under " + str(exp_dir) if "last" in opts else exp_dir / SOURCES[opts.get("source", "summary")]
                missing.append(f"table:{name} (no {where})")
                return m.group(0)
            kept = [ln for ln in body.splitlines() if re.match(r"\|\s*paper", ln)]
            new = render_table(name, values, opts, kept)
            if new != body:
                changed.append(f"table:{name}")
            head = m.group(0)[: m.start(4) - m.start(0)]
            return f"{head}{new}<!-- /table -->"
        image = IMAGE.search(body)
        if image is None:
            raise SystemExit(f"figure:{name}: the block links no .png image")
        target = page.parent / image.group(1)
        with tempfile.TemporaryDirectory() as tmp:
            drawn = Path(tmp) / target.name if check else target
            if not _figure(exp_dir, opts, name, drawn):
                missing.append(f"figure:{name} (no runs under {exp_dir})")
                return m.group(0)
            if check and (not target.is_file() or drawn.read_bytes() != target.read_bytes()):
                changed.append(f"figure:{name}")
            elif not check:
                changed.append(f"figure:{name} (drawn)")
        return m.group(0)

    return BLOCK.sub(block, text), changed, missing


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; with ``--check``, 1 when a block is out of date."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", type=Path, default=PAGE, help="the page (default: docs/results.md)")
    ap.add_argument("--results", type=Path, default=ROOT / "results", help="the results root (default: results/)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a block is out of date")
    args = ap.parse_args(argv)
    new, changed, missing = update_page(args.page, args.results, check=args.check)
    for item in missing:
        print(f"missing, left unchanged: {item}")
    if args.check:
        for item in changed:
            print(f"out of date: {item}")
        return 1 if changed else 0
    if new != args.page.read_text():
        args.page.write_text(new)
    for item in changed:
        print(f"updated: {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
