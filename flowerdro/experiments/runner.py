"""Run several strategies (and seeds) on the same federated partition and compare them.

Config (a dict, or a TOML file for ``python -m flowerdro.experiments conf/<name>.toml``)::

    name = "fmnist_one_class"        # results go to results/<name>/
    num-rounds = 20
    seeds = [0, 1, 2]                # one run per strategy and seed
    num-partitions = 10
    strategies = ["fedavg", "qfedavg"]   # names, or labels of [strategy.<label>] tables
    round-timeout = 600
    last-rounds = 1                  # final numbers = mean over the last k evaluated rounds

    [run-config]                     # shared by every run (data, model, client settings)
    dataset = "fashion_mnist"
    partition = "one-class"
    model = "logreg"
    lr = 0.1

    [strategy.qfedavg]               # per-label overrides of run-config
    q = 0.2
    [strategy.drfa-tau5]             # a label may name its algorithm with `strategy`
    strategy = "drfa"
    local-steps = 5

Trackers and observers are top-level keys (``tracker = "tensorboard,mlflow"``,
``tracker-dir`` (default: ``<output root>/trackers``, e.g. ``results/trackers``),
``tracker-experiment`` (default: ``name``), ``tracker-project``,
``mlflow-tracking-uri``, ``wandb-mode``, ``observers``; see :class:`~flowerdro.runs.RunSettings`).

The seed of a run sets the strategy's sampling, the clients' minibatches and the initial
model; the data partition uses ``data-seed`` (default 0) so every strategy and seed sees
the same clients. Clients run in this process through :class:`InProcessGrid`.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.common import log

from flowerdro.comparison import Comparison, Plan, run_plans
from flowerdro.experiments.inprocess import Fault, InProcessGrid
from flowerdro.runs import RunSettings
from flowerdro.runs.settings import WATCH_KEYS
from flowerdro.settings import read_settings
from flowerdro.trackers import ObserverFactory, observer_factories
from flowerdro.trackers.setup import where as output_lines

#: What ``run`` returns (kept under this name for callers of the runner).
RunResult = Comparison

TOP_LEVEL_KEYS = ("name", "num-rounds", "seeds", "num-partitions", "strategies", "round-timeout",
                  "run-config", "strategy", "output-root", "last-rounds", "description", "resume", "overwrite",
                  "extend", *WATCH_KEYS)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read an experiment TOML file (its name defaults to the file's stem)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config: no experiment file at {p}")
    with p.open("rb") as fh:
        cfg = tomllib.load(fh)
    cfg.setdefault("name", p.stem)
    return cfg


def _names(config: Mapping[str, Any], key: str) -> list[Any]:
    """A list-valued key: a TOML list, or (strategies only) one comma-separated string."""
    value = config.get(key)
    if isinstance(value, str) and key == "strategies":
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not value:
        example = '["fedavg", "drfa"]' if key == "strategies" else "[0, 1, 2]"
        raise ValueError(f"{key}: expected a non-empty list, e.g. {key} = {example}, got {value!r}")
    return value


def _validate(config: Mapping[str, Any]) -> None:
    from flowerdro.settings import check_known_keys

    check_known_keys(config, TOP_LEVEL_KEYS, where="experiment file (top level; client and strategy settings "
                                                   "belong in [run-config] or [strategy.<label>])")
    for key, low in (("num-rounds", 1), ("num-partitions", 1), ("last-rounds", 1)):
        if key in config and (isinstance(config[key], bool) or not isinstance(config[key], int)
                              or config[key] < low):
            raise ValueError(f"{key}: must be an integer >= {low}, got {config[key]!r}")
    timeout = config.get("round-timeout", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"round-timeout: must be a number of seconds > 0, got {timeout!r}")
    _names(config, "strategies")
    if "seeds" in config:
        seeds = _names(config, "seeds")
        if any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
            raise ValueError(f"seeds: expected a list of integers, got {seeds!r}")
    from flowerdro.runs import RunSettings
    from flowerdro.strategies.registry import check_run_config

    tables = {"[run-config]": dict(config.get("run-config", {}))}
    tables.update({f"[strategy.{label}]": {k: v for k, v in table.items() if k != "strategy"}
                   for label, table in config.get("strategy", {}).items()})
    for where, table in tables.items():
        check_run_config(table, where=where)
        # the ServerApp's run keys: an experiment file sets them at its top level
        misplaced = sorted(set(table) & set(RunSettings.keys()))
        if misplaced:
            key = misplaced[0]
            top = "output-root" if key == "output-dir" else key
            raise ValueError(f"{key}: not a {where} key of an experiment file; set {top} at its top level")
    base = tables["[run-config]"]
    for where, table in tables.items():
        merged = {**base, **table}
        if str(merged.get("eval-split", "test")) == "validation" and not float(merged.get("validation-fraction") or 0) > 0:
            raise ValueError(f"eval-split: 'validation' in {where} needs validation-fraction > 0 (the share of each "
                             "client's training data held out for validation); got validation-fraction = "
                             f"{merged.get('validation-fraction', 0)!r}")
    labels = {str(s) for s in _names(config, "strategies")}
    extra = sorted(set(config.get("strategy", {})) - labels)
    if extra:
        from logging import WARNING

        from flwr.common import log

        log(WARNING, "[strategy.%s] is not in strategies (%s); it runs only when --strategies names it",
            extra[0], ", ".join(sorted(labels)))


def check_config(config: Mapping[str, Any]) -> None:
    """Validate an experiment config (top-level keys, the run-config tables, the strategies) before any run.

    Raises ValueError naming the key and the allowed values.
    """
    _validate(config)


def plans_of(config: Mapping[str, Any], out_dir: Path | None) -> list[Plan]:
    """One :class:`Plan` per (strategy label, seed) of an experiment config."""
    _validate(config)
    seeds = [int(s) for s in config.get("seeds", [0])]
    num_partitions = int(config.get("num-partitions", 10))
    overrides: Mapping[str, Mapping[str, Any]] = config.get("strategy", {})
    base_rc = dict(config.get("run-config", {}))
    plans = []
    for label in (str(s) for s in _names(config, "strategies")):
        own = dict(overrides.get(label, {}))
        algo = str(own.pop("strategy", label))
        for seed in seeds:
            rc = {"data-seed": int(base_rc.get("data-seed", 0)), **base_rc, **own, "seed": seed,
                  "num-partitions": num_partitions}
            plans.append(Plan(label, algo, seed, rc, out_dir / label / f"seed{seed}" if out_dir else None))
    return plans


def run(
    config: Mapping[str, Any],
    *,
    output_root: str | Path | None = "results",
    faults: Mapping[int, Fault] | None = None,
    verbose: bool = True,
    observers: Sequence[ObserverFactory] = (),
) -> Comparison:
    """Run every (strategy, seed) of ``config`` in-process and compare them.

    Returns a :class:`~flowerdro.runs.Comparison`; with ``output_root`` set, writes
    ``<root>/<name>/<label>/seed<k>/{rounds.jsonl, final_model.npz, progress.png}`` and
    ``<root>/<name>/{summary.json, table.md, comparison.png}``. The trackers and
    observer factories the config names (``tracker``, ``observers``) come first, then
    ``observers``: factories ``(plan) -> observer`` called once per run (see
    :func:`~flowerdro.runs.run_plans`).
    """
    from flowerdro.apps.client_app import app as client_app

    name = str(config.get("name", "experiment"))
    root = config.get("output-root", output_root)
    out_dir = Path(root) / name if root else None
    plans = plans_of(config, out_dir)
    num_partitions = int(config.get("num-partitions", 10))
    watch = read_settings(RunSettings, {k: config[k] for k in WATCH_KEYS if k in config})
    factories = [*observer_factories(watch, name, Path(root) if root else None), *observers]
    for line in output_lines(watch, out_dir, tracker_output_dir=Path(root) if root else None):
        log(INFO, "%s: %s", name, line)

    def grid_for(plan: Plan) -> InProcessGrid:
        return InProcessGrid(client_app, num_partitions, plan.run_config, faults=dict(faults or {}))

    return run_plans(plans, grid_for, name=name, num_rounds=int(config.get("num-rounds", 10)),
                     timeout=float(config.get("round-timeout", 600.0)), out_dir=out_dir,
                     last_rounds=int(config.get("last-rounds", 1)), config=config, verbose=verbose,
                     resume=bool(config.get("resume", False)), overwrite=bool(config.get("overwrite", False)),
                     extend=bool(config.get("extend", False)), observers=factories)
