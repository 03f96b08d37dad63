"""What an advisor file says: the federation (as an experiment file), the candidates and their knobs.

An advisor file is an experiment file (:mod:`flowerdro.experiments.runner`: ``name``,
``num-rounds``, ``num-partitions``, ``[run-config]``, ``[strategy.<label>]``, …) with an
optional ``[advise]`` table (:class:`AdviseSettings`) and optional knob ranges::

    [advise]
    strategies = ["qfedavg", "drfa", "scaffpd"]   # candidates (default: the file's strategies less fedavg)
    trials = 30
    seeds = [0, 1]                                 # every trial runs these seeds
    budget = "30 min"                              # or "20000 client-rounds"
    references = ["scaffpd"]                       # run beside the candidate in the verdict

    [advise.knobs.drfa]                            # narrower ranges, or a number to fix a knob
    dual-lr = [1e-3, 1.0]
    lambda-floor = 1e-3

A candidate is a label of the file (its ``[strategy.<label>]`` table fixes the settings
that are not searched) or a registered strategy name; its strength knobs are those its
settings class declares (:func:`flowerdro.strategies.strength_knobs`). :func:`search_space`
checks every knob range against the federation before any training: the strategy is
built at every corner of its knobs' box with the file's run config, so a range the
settings refuse (DRFA's λ floor above 1/N, FedRobust's λη₂ ≥ 1) fails at once, naming the
candidate, the knob values and the reason.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.common import log

from flowerdro.settings import Knob, Settings, read_settings, setting

__all__ = ["OBJECTIVES", "AdviseSettings", "Budget", "Candidate", "parse_budget", "search_space"]

#: Objectives: which validation number a search maximises → the round record's key.
OBJECTIVES: dict[str, str] = {"worst20": "acc_worst20", "worst10": "acc_worst10", "worst": "acc_worst",
                              "mean": "acc_mean"}
PRUNERS: tuple[str, ...] = ("hyperband", "successive-halving", "none")
#: The reference every search measures itself against (always run, never searched).
REFERENCE = "fedavg"


@dataclass(frozen=True)
class AdviseSettings(Settings):
    """The ``[advise]`` table of an advisor file: what to search, how long, how to judge."""

    strategies: tuple[str, ...] = setting((), "candidate strategies: labels of the file's strategies or "
                                              "[strategy.<label>] tables, or registered names (unset: the "
                                              "file's strategies less fedavg)")
    trials: int = setting(20, "trials of the search in all (a resumed search completes them)", ge=1)
    seeds: tuple[int, ...] = setting((), "seeds every trial runs; its objective is the mean over them (unset: "
                                         "the file's seeds, else 0,1)", ge=0)
    verdict_seeds: tuple[int, ...] = setting((), "fresh seeds of the test-set verdict (unset: the five seeds after "
                                                 "the largest search seed)", ge=0)
    objective: str = setting("worst20", "the validation number maximised: mean accuracy of the worst 20% or "
                                        "10% of clients, the worst client's, or the mean",
                             choices=tuple(OBJECTIVES))
    max_mean_drop: float | None = setting(None, "a trial is feasible only when its validation mean accuracy "
                                                "is at most this far below FedAvg's (unset: no constraint)", ge=0)
    validation_fraction: float = setting(0.2, "share of each client's training data held out for validation "
                                              "(0: the clients bring their own, a ClientKit with "
                                              "(train, validation, test) data)", ge=0, lt=1)
    budget: str = setting("", "what the whole search may spend, the reference, the trials and the verdict: "
                              "wall time (\"30 min\", \"2 h\", \"90 s\") or \"N client-rounds\" (rounds × "
                              "clients, all runs); a trial starts only while it and the verdict still fit; unset: "
                              "trials only")
    pruner: str = setting("hyperband", "stop unpromising trials early, over rounds, against the trials of the "
                                       "same strategy (each candidate's first two trials run to their end)",
                          choices=PRUNERS)
    pruner_min_rounds: int | None = setting(None, "rounds a trial runs before it can be stopped (unset: a "
                                                  "quarter of num-rounds)", ge=1)
    pruner_reduction: int = setting(3, "reduction factor η of the pruner: about 1/η of the trials go on at "
                                       "each rung", ge=2)
    startup_trials: int = setting(10, "trials drawn at random (after the guaranteed ones) before TPE models "
                                      "the results", ge=0)
    sampler_seed: int = setting(0, "seed of the TPE sampler", ge=0)
    storage: str = setting("", "Optuna storage URL (unset: sqlite:///<output>/study.db, so a stopped search "
                               "resumes)")
    references: tuple[str, ...] = setting((), "labels run beside the candidate in the verdict with the "
                                              "file's own settings (e.g. the hand-tuned best)")
    significance: float = setting(0.05, "level of the two-sided Welch t-test that decides \"beyond seed "
                                        "noise\"", gt=0, lt=1)


@dataclass(frozen=True)
class Budget:
    """How much a search may spend: ``seconds`` of wall time or ``client_rounds`` (None: unlimited)."""

    seconds: float | None = None
    client_rounds: int | None = None

    def __str__(self) -> str:
        if self.seconds is not None:
            return f"{self.seconds / 60:g} min wall time"
        if self.client_rounds is not None:
            return f"{self.client_rounds} client-rounds"
        return "no budget (trials only)"


_BUDGET = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(s|sec|min|m|h|client-rounds)\s*$", re.I)


def parse_budget(text: str) -> Budget:
    """``"30 min"``, ``"2 h"``, ``"90 s"`` (wall time) or ``"20000 client-rounds"``; ``""``: no budget."""
    if not text or not str(text).strip():
        return Budget()
    m = _BUDGET.match(str(text))
    if not m:
        raise ValueError(f"budget: expected wall time (\"30 min\", \"2 h\", \"90 s\") or \"N client-rounds\", "
                         f"got {text!r}")
    amount, unit = float(m.group(1)), m.group(2).lower()
    if not amount > 0:
        raise ValueError(f"budget: must be > 0, got {text!r}")
    if unit == "client-rounds":
        if amount != int(amount):
            raise ValueError(f"budget: client-rounds must be a whole number, got {text!r}")
        return Budget(client_rounds=int(amount))
    return Budget(seconds=amount * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[unit])


@dataclass(frozen=True)
class Candidate:
    """One strategy the search may pick, with its own settings and its knobs.

    ``own`` holds the file's ``[strategy.<label>]`` settings (kept in every trial),
    ``knobs`` the ranges searched, ``fixed`` the knobs held at one value (``[advise.knobs]``
    numbers) and ``start`` the values of its first trial (the file's, else the defaults,
    where they lie in the range).
    """

    label: str
    algorithm: str
    own: dict[str, Any] = field(default_factory=dict)
    knobs: dict[str, Knob] = field(default_factory=dict)
    fixed: dict[str, float] = field(default_factory=dict)
    start: dict[str, float] = field(default_factory=dict)

    def param(self, key: str) -> str:
        """The Optuna parameter name of knob ``key`` (``<label>.<key>``: conditional on the label)."""
        return f"{self.label}.{key}"

    def run_config(self, values: Mapping[str, float]) -> dict[str, Any]:
        """This candidate's run-config items with knob ``values`` (keys without the label)."""
        return {**self.own, **self.fixed, **dict(values)}


def _candidate(label: str, config: Mapping[str, Any], ranges: Mapping[str, Any]) -> Candidate:
    from flowerdro.strategies.registry import ALGORITHMS, strategy_names, strength_knobs

    own = dict(config.get("strategy", {}).get(label, {}))
    algorithm = str(own.pop("strategy", label))
    if algorithm not in ALGORITHMS:
        raise ValueError(f"advise.strategies: {label!r} is neither a registered strategy nor a [strategy.{label}] "
                         f"table naming one; registered: {', '.join(strategy_names())}")
    declared = strength_knobs(algorithm)
    unknown = sorted(set(ranges) - set(declared))
    if unknown:
        raise ValueError(f"advise.knobs.{label}: {', '.join(unknown)} not a strength knob of {algorithm}; its "
                         f"knobs: {', '.join(declared) or 'none'}")
    knobs, fixed = dict(declared), {}
    for key, value in ranges.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            fixed[key] = float(value)
            del knobs[key]
        elif isinstance(value, list | tuple) and len(value) == 2:
            try:
                knobs[key] = Knob(float(value[0]), float(value[1]), declared[key].scale)
            except ValueError as exc:
                raise ValueError(f"advise.knobs.{label}.{key}: {exc}") from None
        else:
            raise ValueError(f"advise.knobs.{label}.{key}: expected [low, high] or one number, got {value!r}")
    base = {**dict(config.get("run-config", {})), **own}
    settings_cls = ALGORITHMS[algorithm].strategy.settings_class
    defaults = read_settings(settings_cls, {}).to_config()
    start = {}
    for key, knob in knobs.items():
        from_file = key in base and base[key] not in (None, "")
        value = base[key] if from_file else defaults.get(key)
        if value is None:
            continue
        value = float(value)
        if knob.low <= value <= knob.high:
            start[key] = value
        else:  # e.g. DRFA's λ floor, off (0) by default, below a log range
            log(WARNING if from_file else INFO, "advise: %s's %s = %g (%s) lies outside its knob range %s; its "
                "first trial draws it", label, key, value, "from the file" if from_file else "the default", knob)
    return Candidate(label, algorithm, own, knobs, fixed, start)


def search_space(config: Mapping[str, Any], advise: AdviseSettings, run_config: Mapping[str, Any]
                 ) -> list[Candidate]:
    """The candidates of a search, each with its knobs, checked at every corner of the knob box.

    ``run_config`` is the federation's run config (data, model, clients, ``num-partitions``);
    each candidate is built with it at every corner of its knobs (at most 2^k builds for
    k knobs), so the whole range is accepted by the settings for this federation.
    """
    from flowerdro.strategies.registry import build_strategy

    labels = list(advise.strategies) or [str(s) for s in _listed(config) if str(s) != REFERENCE]
    if not labels:
        raise ValueError("advise.strategies: no candidate strategy; list some in [advise] strategies or the "
                         "file's strategies (fedavg, the reference, is always run)")
    if REFERENCE in labels:
        raise ValueError("advise.strategies: fedavg is the reference every search runs; leave it out of the "
                         "candidates")
    if len(set(labels)) != len(labels):
        raise ValueError(f"advise.strategies: a label is listed twice: {labels}")
    knob_tables = dict(config.get("advise", {}).get("knobs", {}))
    extra = sorted(set(knob_tables) - set(labels))
    if extra:
        raise ValueError(f"advise.knobs: {', '.join(extra)} not among the candidates ({', '.join(labels)})")
    out = []
    for label in labels:
        cand = _candidate(label, config, knob_tables.get(label, {}))
        keys = list(cand.knobs)
        for corner in itertools.product(*[(cand.knobs[k].low, cand.knobs[k].high) for k in keys]):
            values = dict(zip(keys, corner, strict=True))
            try:
                build_strategy(cand.algorithm, {**run_config, **cand.run_config(values)})
            except ValueError as exc:
                raise ValueError(f"advise: candidate {label} ({cand.algorithm}) refuses its knob corner {values}: "
                                 f"{exc}; narrow the range in [advise.knobs.{label}]") from None
        out.append(cand)
    return out


def _listed(config: Mapping[str, Any]) -> list[Any]:
    value = config.get("strategies", [])
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    return list(value)


def default_seeds(config: Mapping[str, Any], advise: AdviseSettings) -> tuple[list[int], list[int]]:
    """(search seeds, verdict seeds): ``[advise]`` values, else the file's seeds / 0, 1, and the next five."""
    seeds = list(advise.seeds) or [int(s) for s in config.get("seeds", [0, 1])]
    verdict = list(advise.verdict_seeds) or list(range(max(seeds) + 1, max(seeds) + 6))
    clash = sorted(set(seeds) & set(verdict))
    if clash:
        raise ValueError(f"advise.verdict-seeds: {clash} are search seeds too; the verdict needs fresh seeds")
    if len(verdict) < 2:
        raise ValueError(f"advise.verdict-seeds: Welch's t-test needs at least 2 verdict seeds, got {verdict}")
    return seeds, verdict


def min_rounds(advise: AdviseSettings, num_rounds: int) -> int:
    """Rounds a trial runs before the pruner may stop it."""
    return advise.pruner_min_rounds or max(1, math.ceil(num_rounds / 4))
