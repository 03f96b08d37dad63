"""The search: Optuna trials over (strategy, strength knobs) on validation, then the test verdict.

Phases, in this order (the test split is read in the last one only):

1. **reference**: FedAvg over the search seeds, evaluated on the clients' validation sets
   (its objective and mean accuracy are what the trials are compared with and what
   ``max-mean-drop`` is measured from);
2. **search**: Optuna trials (TPE over a categorical strategy choice with each strategy's
   knobs as conditional parameters). Each candidate's first trial takes the file's own
   values, its second TPE's draw (a candidate without knobs has one setting, so one
   trial); these two run to their end (:data:`~flowerdro.advise.pruning.FULL`), one pass
   over the candidates after the other, so every candidate gets two complete trials
   unless ``trials`` or the budget runs out first (the report says so, per strategy).
   A trial runs every search seed one after another and reports after every evaluated
   round the running estimate of its objective, (Σ_{finished seeds} J_s + J_current(r)) / (k+1),
   at step k·R + r (seed index k, round r of R), to a pruner over rounds trained that
   compares it with the trials of its own strategy only
   (:class:`~flowerdro.advise.pruning.StrategyPruner`);
3. **verdict**: the best feasible trial's setting (the candidate), FedAvg and the
   ``references`` are run over fresh seeds and evaluated on the clients' test sets
   (:mod:`flowerdro.advise.verdict` decides).

The ``budget`` covers all three phases: a trial starts only while the reference, the trials
so far, one more complete trial and the verdict fit in it. Client-rounds are exact (a
trial: search seeds × rounds × clients; the verdict: (2 + references) × verdict seeds ×
rounds × clients), so a client-round budget is never exceeded; seconds are estimated from
the slowest complete run so far, so a wall-time budget holds up to that estimate.

Each run is one strategy on an :class:`~flowerdro.experiments.inprocess.InProcessGrid`
(the ClientApp in this process: flowerdro's, or the user's, e.g. a ``ClientKit``'s).
Everything a later session needs to resume (the reference, every trial's per-seed
numbers, the verdict) is kept in the Optuna storage (SQLite by default).
"""

from __future__ import annotations

import gc
import json
import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord
from flwr.clientapp import ClientApp
from flwr.common import log

from flowerdro.advise.config import (
    OBJECTIVES,
    REFERENCE,
    AdviseSettings,
    Budget,
    Candidate,
    default_seeds,
    min_rounds,
    parse_budget,
    search_space,
)
from flowerdro.advise.pruning import FULL
from flowerdro.advise.report import best_per_strategy, coverage, trial_rows, write_report
from flowerdro.advise.verdict import Advice, judge
from flowerdro.runs.report import final_summary
from flowerdro.settings import check_known_keys, read_settings

__all__ = ["Advice", "Search", "load_config", "run", "run_seed"]

#: Fairness numbers kept per run (round-record keys).
KEPT = ("acc_mean", "acc_worst", "acc_worst10", "acc_worst20", "acc_best20", "acc_std")
#: User attribute of a trial whose own run failed (RunFailedError): it counts as done, whereas a
#: trial failed by an interruption (a crash, Ctrl-C) runs again.
_RUN_FAILED = "run_failed"
#: Name of the ``max-mean-drop`` constraint: (FedAvg's validation mean − drop) − the trial's, ≤ 0 when feasible.
CONSTRAINT = "mean-drop"


def load_config(path: str | Path) -> dict[str, Any]:
    """Read an advisor (or experiment) TOML file; its name defaults to the file's stem."""
    from flowerdro.experiments.runner import load_config as load

    return load(path)


def run_seed(
    app: ClientApp,
    algorithm: str,
    run_config: Mapping[str, Any],
    *,
    num_rounds: int,
    timeout: float,
    split: str,
    observers: Sequence[Any] = (),
    label: str | None = None,
) -> list[dict[str, Any]]:
    """Run strategy ``algorithm`` once (the run config's ``seed``) and return its round records.

    The evaluate messages carry ``eval-split = split`` (and so does the run config the
    clients see): ``"validation"`` during the search, ``"test"`` in the verdict.
    """
    from flowerdro.comparison import client_config
    from flowerdro.experiments.inprocess import InProcessGrid
    from flowerdro.strategies import initial_arrays
    from flowerdro.strategies.registry import build_strategy

    rc = {**dict(run_config), "eval-split": split}
    strategy = build_strategy(algorithm, rc, run_name=label or algorithm)
    for obs in observers:
        strategy.add_observer(obs)
    grid = InProcessGrid(app, int(rc["num-partitions"]), rc)
    init = initial_arrays(grid, rc, timeout)
    gc.collect()
    gc.freeze()  # see flowerdro/comparison.py: Flower's per-array gc.collect() walks a large heap otherwise
    strategy.start(grid, init, num_rounds=num_rounds, timeout=timeout, train_config=client_config(rc),
                   evaluate_config=ConfigRecord({"eval-split": split}))
    if not any("acc_mean" in r for r in strategy.history):
        raise RuntimeError(f"advise: {label or algorithm} (seed {rc.get('seed')}) finished without any accuracy "
                           "record; the clients' evaluate replies failed (see the log)")
    return strategy.history


def summarize(history: Sequence[Mapping[str, Any]], last: int, key: str) -> dict[str, float]:
    """A run's fairness numbers (mean over its last ``last`` evaluated rounds) and its objective."""
    summ = final_summary(history, last=last)
    out = {k: float(summ[k]) for k in KEPT if k in summ}
    out["objective"] = out[key]
    return out


class _Progress:
    """Observer of one seed's run in a trial: progress bar, intermediate objective, pruning."""

    def __init__(self, trial: Any, key: str, last: int, seed_index: int, num_rounds: int, done: list[float],
                 bar: Any, mean_floor: float | None) -> None:
        self.trial, self.key, self.last, self.k, self.R = trial, key, last, seed_index, num_rounds
        self.done, self.bar, self.values, self.means, self.mean_floor = done, bar, [], [], mean_floor
        self.rounds = 0

    def on_round(self, strategy: Any, record: Mapping[str, Any]) -> None:  # noqa: D102
        import optuna

        self.rounds += 1
        if self.bar is not None:
            self.bar.update(1)
        if "acc_mean" not in record or self.trial is None:
            return
        self.values.append(float(record[self.key]))
        self.means.append(float(record["acc_mean"]))
        current = float(np.mean(self.values[-self.last:]))
        estimate = (sum(self.done) + current) / (len(self.done) + 1)
        self.trial.report(estimate, self.k * self.R + int(record["round"]))
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.key} {estimate:.4f}")
        if self.trial.should_prune():
            if self.mean_floor is not None:  # a trial stopped here is judged on its mean so far
                self.trial.set_constraint(CONSTRAINT, self.mean_floor - float(np.mean(self.means[-self.last:])))
            raise optuna.TrialPruned(f"{self.key} estimate {estimate:.4f} after {self.k * self.R + record['round']} "
                                     "rounds trained")


# ---------------------------------------------------------------------- the stored study
def finished(study: Any) -> list[Any]:
    """Trials that count towards ``trials``: complete, pruned, or failed in their own run."""
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            or (t.state == TrialState.FAIL and _RUN_FAILED in t.user_attrs)]


def spent(study: Any) -> dict[str, float]:
    """Client-rounds and seconds spent so far by the reference and every trial, and by the verdict (as stored)."""
    ref, trials = study.user_attrs.get("reference", {}), study.get_trials(deepcopy=False)
    verdict = study.user_attrs.get("verdict", {})
    return {"client_rounds": float(ref.get("client_rounds", 0)) + sum(float(t.user_attrs.get("client_rounds", 0))
                                                                      for t in trials),
            "seconds": float(ref.get("seconds", 0)) + sum(float(t.user_attrs.get("seconds", 0)) for t in trials),
            "verdict_client_rounds": float(verdict.get("client_rounds", 0)),
            "verdict_seconds": float(verdict.get("seconds", 0))}


def recover(study: Any) -> None:
    """Trials a stopped search left running or failed without a result are run again (same settings)."""
    from optuna.trial import TrialState

    requeued = set(study.user_attrs.get("requeued", []))
    for t in study.get_trials(deepcopy=False):
        stale = t.state == TrialState.RUNNING or (t.state == TrialState.FAIL and _RUN_FAILED not in t.user_attrs)
        if not stale or t.number in requeued:
            continue
        if t.state == TrialState.RUNNING:
            study.tell(t.number, state=TrialState.FAIL)
        log(WARNING, "advise: trial %d was interrupted; it runs again with the same settings", t.number)
        study.enqueue_trial(dict(t.params), user_attrs={FULL: True} if t.user_attrs.get(FULL) else None)
        requeued.add(t.number)
    study.set_user_attr("requeued", sorted(requeued))


def queue_guaranteed(study: Any, candidates: Sequence[Candidate]) -> None:
    """Queue the next guaranteed trial (:data:`FULL`) when no trial waits to run.

    First pass: each candidate's starting point (the file's values); second pass: one more
    trial of each candidate with knobs, its knobs drawn by the sampler. A trial counts
    once it ran (complete, or failed in its own run) or waits; an interrupted one is
    replaced by its re-queued copy (:func:`recover`), which runs first.
    """
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    if any(t.state == TrialState.WAITING for t in trials):
        return
    counted = [t for t in trials if t.user_attrs.get(FULL)
               and (t.state != TrialState.FAIL or _RUN_FAILED in t.user_attrs)]
    have = {c.label: sum(t.params.get("strategy") == c.label for t in counted) for c in candidates}
    for want in (1, 2):
        for cand in candidates:
            if have[cand.label] < want and (want == 1 or cand.knobs):
                params = {cand.param(k): v for k, v in cand.start.items()} if want == 1 else {}
                study.enqueue_trial({"strategy": cand.label, **params}, user_attrs={FULL: True})
                return


def _check_references(refs: Sequence[str], by_label: Mapping[str, Candidate], config: Mapping[str, Any]) -> None:
    from flowerdro.strategies.registry import ALGORITHMS

    for ref in refs:
        if ref == REFERENCE:
            raise ValueError("advise.references: fedavg is always in the verdict; list other labels")
        if ref not in by_label and ref not in config.get("strategy", {}) and ref not in ALGORITHMS:
            raise ValueError(f"advise.references: {ref!r} is neither a label of the file nor a registered strategy")


def _bar(progress: bool | None, total: int, desc: str, values: Mapping[str, float]) -> Any:
    """A trial's progress bar (None when ``progress`` is False; shown on a terminal only when None)."""
    if progress is False:
        return None
    from tqdm.auto import tqdm

    knobs = ", ".join(f"{k}={v:.3g}" for k, v in values.items())
    return tqdm(total=total, desc=desc + (f" ({knobs})" if knobs else ""), unit="round", leave=True,
                disable=None if progress is None else False)


class Search:
    """One advisor search: its settings, candidates, Optuna study, and the three phases (module docstring)."""

    def __init__(self, config: Mapping[str, Any], *, output_root: str | Path | None = "results",
                 client_app: ClientApp | None = None, progress: bool | None = None, overwrite: bool = False,
                 figure: str | Path | None = None) -> None:
        from flowerdro.experiments.runner import check_config
        from flowerdro.strategies.registry import check_run_config

        self.config = dict(config)
        experiment = {k: v for k, v in self.config.items() if k != "advise"}
        table = dict(self.config.get("advise", {}))
        if not isinstance(table.pop("knobs", {}), Mapping):
            raise ValueError("advise.knobs: expected tables [advise.knobs.<label>]")
        if "strategies" not in experiment:
            experiment["strategies"] = list(table.get("strategies", [])) or [REFERENCE]
        check_config(experiment)
        check_known_keys(table, AdviseSettings.keys(), where="[advise]")
        self.advise = read_settings(AdviseSettings, table)
        self.budget: Budget = parse_budget(self.advise.budget)
        self.name = str(self.config.get("name", "advice"))
        self.num_rounds = int(self.config.get("num-rounds", 10))
        self.num_partitions = int(self.config.get("num-partitions", 10))
        self.timeout = float(self.config.get("round-timeout", 600.0))
        self.last = int(self.config.get("last-rounds", 1))
        self.key = OBJECTIVES[self.advise.objective]
        self.seeds, self.verdict_seeds = default_seeds(self.config, self.advise)
        rc = dict(self.config.get("run-config", {}))
        for key in ("validation-fraction", "eval-split", "seed"):
            if key in rc:
                raise ValueError(f"{key}: the advisor sets it; remove it from [run-config] "
                                 + ("(use [advise] validation-fraction)" if key == "validation-fraction" else ""))
        if self.advise.validation_fraction == 0 and client_app is None:
            raise ValueError("validation-fraction: 0 means the clients bring their own validation data, which "
                             "flowerdro's own clients do not; set [advise] validation-fraction > 0 (e.g. 0.2) or "
                             "pass the ClientApp of a ClientKit whose data_fn returns (train, validation, test)")
        self.run_config = {"data-seed": int(rc.get("data-seed", 0)), **rc, "num-partitions": self.num_partitions}
        if self.advise.validation_fraction > 0:
            self.run_config["validation-fraction"] = self.advise.validation_fraction
        check_run_config(self.run_config, where="[run-config]")
        self.candidates: list[Candidate] = search_space(self.config, self.advise, self.run_config)
        self.by_label = {c.label: c for c in self.candidates}
        _check_references(self.advise.references, self.by_label, self.config)
        if client_app is None:
            from flowerdro.apps.client_app import app as client_app
        self.app = client_app
        root = self.config.get("output-root", output_root)
        self.output_dir = Path(root) / self.name if root else None
        self.progress, self.overwrite = progress, overwrite
        self.figure = Path(figure) if figure else None
        self._study: Any = None
        self._ref: list[dict[str, float]] = []
        self.stopped_by = "trials"

    # ------------------------------------------------------------------ the study
    def fingerprint(self) -> dict[str, Any]:
        """What makes two searches the same search (a resumed study must match it)."""
        return json.loads(json.dumps({
            "run-config": self.run_config, "num-rounds": self.num_rounds, "seeds": self.seeds,
            "objective": self.advise.objective, "max-mean-drop": self.advise.max_mean_drop,
            "last-rounds": self.last, "pruner": [self.advise.pruner, min_rounds(self.advise, self.num_rounds),
                                                 self.advise.pruner_reduction, "per-strategy"],
            "candidates": {c.label: {"algorithm": c.algorithm, "own": c.own, "fixed": c.fixed,
                                     "knobs": {k: [v.low, v.high, v.scale] for k, v in c.knobs.items()}}
                           for c in self.candidates},
        }, default=str))

    def storage_url(self) -> str:
        """The Optuna storage: ``[advise] storage``, else SQLite in the output folder."""
        if self.advise.storage:
            return self.advise.storage
        if self.output_dir is None:
            return "sqlite:///:memory:"
        self.output_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.output_dir / 'study.db').resolve()}"

    def study(self) -> Any:
        """Create the Optuna study, or load the stored one (``load_if_exists``) and check it is this search's."""
        import optuna

        if self._study is not None:
            return self._study
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        url = self.storage_url()
        if self.overwrite:
            try:
                optuna.delete_study(study_name=self.name, storage=url)
            except KeyError:
                pass
        # with max-mean-drop, each trial sets its constraint (Trial.set_constraint), which TPE reads
        sampler = optuna.samplers.TPESampler(seed=self.advise.sampler_seed, multivariate=True, group=True,
                                             n_startup_trials=self.advise.startup_trials + 2 * len(self.candidates))
        study = optuna.create_study(storage=url, study_name=self.name, direction="maximize", sampler=sampler,
                                    pruner=self.pruner(), load_if_exists=True)
        stored, mine = study.user_attrs.get("fingerprint"), self.fingerprint()
        if stored is None:
            study.set_user_attr("fingerprint", mine)
        elif stored != mine:
            diff = sorted(k for k in set(stored) | set(mine) if stored.get(k) != mine.get(k))
            raise ValueError(f"advise: the storage {url} holds a search of study {self.name!r} with other settings "
                             f"({', '.join(diff)} differ); pass --overwrite to start afresh, or give the file "
                             "another name")
        self._study = study
        recover(study)
        return study

    def pruner(self) -> Any:
        """The pruner over rounds trained (seeds × num-rounds steps per trial), per strategy."""
        import optuna

        from flowerdro.advise.pruning import StrategyPruner

        if self.advise.pruner == "none":
            return optuna.pruners.NopPruner()
        lo, total = min_rounds(self.advise, self.num_rounds), len(self.seeds) * self.num_rounds
        return StrategyPruner(lo, max(total, lo + 1), self.advise.pruner_reduction,
                              brackets=self.advise.pruner == "hyperband")

    def verdict_cost(self, study: Any) -> dict[str, float]:
        """What the verdict will spend: exact client-rounds, and seconds at the slowest complete run so far."""
        runs = (2 + len(self.advise.references)) * len(self.verdict_seeds)
        return {"client_rounds": float(runs * self.num_rounds * self.num_partitions),
                "seconds": runs * self._seconds_per_run(study)}

    def _seconds_per_run(self, study: Any) -> float:
        """The slowest complete run so far (FedAvg's reference runs, complete trials), in seconds."""
        ref = study.user_attrs.get("reference", {})
        per_run = [float(ref.get("seconds", 0)) / len(self.seeds)]
        per_run += [float(t.user_attrs.get("seconds", 0)) / len(self.seeds) for t in study.get_trials(deepcopy=False)
                    if t.state.name == "COMPLETE"]
        return max(per_run)

    def budget_left(self, study: Any) -> bool:
        """Whether another trial may start: what is spent, one more complete trial and the verdict fit in the budget."""
        used, verdict = spent(study), self.verdict_cost(study)
        trial = {"client_rounds": len(self.seeds) * self.num_rounds * self.num_partitions,
                 "seconds": len(self.seeds) * self._seconds_per_run(study)}
        return all(limit is None or used[k] + trial[k] + verdict[k] <= limit
                   for k, limit in (("seconds", self.budget.seconds), ("client_rounds", self.budget.client_rounds)))

    # ------------------------------------------------------------------ running
    def _rc(self, cand_config: Mapping[str, Any], seed: int) -> dict[str, Any]:
        return {**self.run_config, **dict(cand_config), "seed": int(seed)}

    def _run(self, algorithm: str, rc: Mapping[str, Any], split: str, observers: Sequence[Any] = (),
             label: str | None = None) -> list[dict[str, Any]]:
        flwr_logger = logging.getLogger("flwr")
        level = flwr_logger.level
        if self.progress is not False:
            flwr_logger.setLevel(WARNING)
        try:
            return run_seed(self.app, algorithm, rc, num_rounds=self.num_rounds, timeout=self.timeout,
                            split=split, observers=observers, label=label)
        finally:
            flwr_logger.setLevel(level)

    def reference(self, study: Any) -> list[dict[str, float]]:
        """FedAvg on validation over the search seeds (stored in the study, run once)."""
        stored = study.user_attrs.get("reference")
        if stored is not None:
            return stored["seeds"]
        t0, out = time.time(), []
        for seed in self.seeds:
            log(INFO, "advise: reference fedavg, seed %d (validation)", seed)
            hist = self._run(REFERENCE, self._rc({}, seed), "validation", label=REFERENCE)
            out.append({"seed": seed, **summarize(hist, self.last, self.key)})
        study.set_user_attr("reference", {"seeds": out, "seconds": time.time() - t0,
                                          "client_rounds": len(self.seeds) * self.num_rounds * self.num_partitions})
        return out

    def objective(self, trial: Any) -> float:
        """One trial: draw a strategy and its knobs, run every search seed on validation, return the mean objective."""
        from flowerdro.strategies.base import RunFailedError

        label = trial.suggest_categorical("strategy", [c.label for c in self.candidates])
        cand = self.by_label[label]
        values = {k: trial.suggest_float(cand.param(k), kn.low, kn.high, log=kn.log) for k, kn in cand.knobs.items()}
        floor = None
        if self.advise.max_mean_drop is not None:
            floor = float(np.mean([r["acc_mean"] for r in self._ref])) - self.advise.max_mean_drop
        bar = _bar(self.progress, len(self.seeds) * self.num_rounds, f"trial {trial.number} {label}", values)
        t0, done, seeds_out = time.time(), [], []
        try:
            for k, seed in enumerate(self.seeds):
                obs = _Progress(trial, self.key, self.last, k, self.num_rounds, list(done), bar, floor)
                try:
                    hist = self._run(cand.algorithm, self._rc(cand.run_config(values), seed), "validation", [obs],
                                     label=label)
                except RunFailedError as exc:
                    trial.set_user_attr(_RUN_FAILED, str(exc)[:500])
                    raise
                finally:
                    trial.set_user_attr("client_rounds", (k * self.num_rounds + obs.rounds) * self.num_partitions)
                    trial.set_user_attr("seconds", time.time() - t0)
                seeds_out.append({"seed": seed, **summarize(hist, self.last, self.key)})
                done.append(seeds_out[-1]["objective"])
                trial.set_user_attr("seeds", seeds_out)
        finally:
            if bar is not None:
                bar.close()
        if floor is not None:
            trial.set_constraint(CONSTRAINT, floor - float(np.mean([s["acc_mean"] for s in seeds_out])))
        return float(np.mean(done))

    def search(self, study: Any) -> None:
        """Run trials until ``trials`` are finished or the budget (the verdict's share kept back) is spent."""
        from flowerdro.strategies.base import RunFailedError

        self.stopped_by = "trials"
        while len(finished(study)) < self.advise.trials:
            if not self.budget_left(study):
                self.stopped_by = "budget"
                log(WARNING, "advise: budget (%s, the verdict's share kept back) spent after %d of %d trials",
                    self.budget, len(finished(study)), self.advise.trials)
                break
            queue_guaranteed(study, self.candidates)
            study.optimize(self.objective, n_trials=1, catch=(RunFailedError,))

    # ------------------------------------------------------------------ verdict
    def verdict(self, study: Any, candidate: Mapping[str, Any]) -> dict[str, list[dict[str, float]]]:
        """The candidate, FedAvg and the references on the test sets over the verdict seeds (stored)."""
        key = json.dumps({"candidate": candidate, "seeds": self.verdict_seeds,
                          "references": list(self.advise.references)}, sort_keys=True, default=str)
        stored = study.user_attrs.get("verdict")
        if stored is not None and stored.get("key") == key:
            return stored["runs"]
        settings = {"candidate": (candidate["algorithm"], candidate["run_config"]), REFERENCE: (REFERENCE, {})}
        for ref in self.advise.references:
            own = dict(self.config.get("strategy", {}).get(ref, {}))
            settings[ref] = (str(own.pop("strategy", ref)), own)
        t0, runs = time.time(), {}
        for name, (algorithm, own) in settings.items():
            for seed in self.verdict_seeds:
                log(INFO, "advise: verdict %s, seed %d (test)", name, seed)
                hist = self._run(algorithm, self._rc(own, seed), "test", label=name)
                runs.setdefault(name, []).append({"seed": seed, **summarize(hist, self.last, self.key)})
        study.set_user_attr("verdict", {"key": key, "runs": runs, "seconds": time.time() - t0,
                                        "client_rounds": len(settings) * len(self.verdict_seeds) * self.num_rounds
                                        * self.num_partitions})
        return runs

    # ------------------------------------------------------------------ everything
    def run(self) -> Advice:
        """Reference, search, verdict, report (each phase taken from the storage when done before)."""
        study = self.study()
        self._ref = self.reference(study)
        self.search(study)
        trials = trial_rows(study, self.by_label)
        feasible = [t for t in trials if t["state"] == "COMPLETE" and t.get("feasible", True)]
        if not feasible:
            cost = self.verdict_cost(study)
            raise RuntimeError(f"advise: no trial of {self.name} completed feasibly ({len(trials)} trials); raise "
                               f"trials or the budget (which also covers the verdict: {cost['client_rounds']:.0f} "
                               f"client-rounds, about {cost['seconds']:.0f} s), or relax max-mean-drop")
        top = max(feasible, key=lambda t: t["objective"])
        cand = self.by_label[top["label"]]
        candidate = {"label": cand.label, "algorithm": cand.algorithm, "knobs": top["knobs"], "trial": top["number"],
                     "run_config": cand.run_config(top["knobs"]), "validation": top["objective"]}
        runs = self.verdict(study, candidate)
        settings = self.describe()
        advice = Advice(self.name, self.advise.objective, settings, self._ref, trials, best_per_strategy(trials),
                        candidate, verdict=runs, spent=spent(study), output_dir=self.output_dir,
                        coverage=coverage(trials, self.candidates, settings, self.stopped_by))
        judge(advice, self.advise.significance, self.advise.max_mean_drop)
        if self.output_dir is not None:
            write_report(advice, self.output_dir, self.figure)
        return advice

    def describe(self) -> dict[str, Any]:
        """The search's settings for the report."""
        return {"num-rounds": self.num_rounds, "num-partitions": self.num_partitions, "seeds": self.seeds,
                "verdict-seeds": self.verdict_seeds, "trials": self.advise.trials, "budget": str(self.budget),
                "objective": self.advise.objective, "max-mean-drop": self.advise.max_mean_drop,
                "validation-fraction": self.advise.validation_fraction, "last-rounds": self.last,
                "pruner": self.advise.pruner, "pruner-min-rounds": min_rounds(self.advise, self.num_rounds),
                "pruner-reduction": self.advise.pruner_reduction, "significance": self.advise.significance,
                "description": str(self.config.get("description", "")), "run-config": self.run_config,
                "candidates": {c.label: {"algorithm": c.algorithm, "knobs": {k: str(v) for k, v in c.knobs.items()},
                                         "fixed": c.fixed, "own": c.own} for c in self.candidates},
                "references": list(self.advise.references)}


def run(
    config: Mapping[str, Any],
    *,
    output_root: str | Path | None = "results",
    client_app: ClientApp | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
    figure: str | Path | None = None,
) -> Advice:
    """Search for the strategy and strength that serve the worst clients best; judge it on test.

    Parameters
    ----------
    config : Mapping
        An advisor file's contents (:mod:`flowerdro.advise.config`).
    output_root : str or Path, optional
        ``<root>/<name>/`` gets ``study.db`` (the resumable search), ``advice.md``,
        ``advice.png`` and ``advice.json``; None keeps the study in memory and writes nothing.
    client_app : ClientApp, optional
        The clients (default: flowerdro's ClientApp on the file's data set); e.g. a
        ``ClientKit``'s ``client_app()``.
    progress : bool, optional
        A progress bar per trial: True always, False never (and Flower's round logs stay
        on), None when stderr is a terminal.
    overwrite : bool
        Delete a stored study of the same name first instead of resuming it.
    figure : str or Path, optional
        Also draw the report's figure there (e.g. ``docs/figures/advisor_<name>.png``).

    Returns
    -------
    Advice
        Every trial, the best setting per strategy, the verdict, what to use and its sentence.
    """
    search = Search(config, output_root=output_root, client_app=client_app, progress=progress, overwrite=overwrite,
                    figure=figure)
    return search.run()
