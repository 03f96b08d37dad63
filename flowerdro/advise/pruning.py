"""Pruning an advisor trial against the trials of its own strategy only.

Optuna's pruners compare a trial with every trial of the study. The strategies of an
advisor search climb at different speeds: robust ones (DRFA, AFL, FedMGDA+) often start
slower than q-FedAvg or SCAFF-PD and catch up late. Compared across strategies, every trial
of a slow starter is stopped at the first rung, the strategy never gets a complete trial
and drops out of the search unseen. :class:`StrategyPruner` runs Optuna's own
``SuccessiveHalvingPruner`` per strategy, in Hyperband's brackets (as Optuna's
``HyperbandPruner`` assigns them: a CRC32 of the study name and trial number, weighted by
each bracket's trial budget): a trial's competitors at a rung are the trials of the same
strategy in the same bracket. Optuna has no pruner over groups of trials, and its
``HyperbandPruner`` reads the bracket's trials from the storage directly (so a filtered
view of the study cannot be handed to it); hence this class.

A trial whose user attribute :data:`FULL` is true (each strategy's first two trials, see
:mod:`flowerdro.advise.search`) is never stopped, but its values are recorded at every
rung, so the later trials of its strategy are compared with it.
"""

from __future__ import annotations

import binascii
import math
from collections.abc import Container
from typing import Any

import optuna
from optuna.pruners import BasePruner, SuccessiveHalvingPruner
from optuna.trial import FrozenTrial, TrialState

__all__ = ["FULL", "StrategyPruner"]

#: User attribute of a trial that runs to its end whatever the pruner says.
FULL = "full"


class StrategyPruner(BasePruner):
    """Successive halving over rounds trained, per strategy (in Hyperband brackets when ``brackets``).

    Parameters
    ----------
    min_resource : int
        Steps (rounds trained) before the first rung.
    max_resource : int
        Steps of a complete trial (search seeds × num-rounds); sets the number of brackets
        ⌊log_η(max/min)⌋ + 1 as in Optuna's ``HyperbandPruner``.
    reduction_factor : int
        η: about 1/η of a rung's trials of a strategy go on to the next rung.
    brackets : bool (default: True)
        Hyperband's brackets; False: one bracket (plain successive halving).
    """

    def __init__(self, min_resource: int, max_resource: int, reduction_factor: int, *, brackets: bool = True) -> None:
        if min_resource < 1 or max_resource < min_resource or reduction_factor < 2:
            raise ValueError(f"pruner: needs 1 <= min_resource <= max_resource and reduction_factor >= 2, got "
                             f"{min_resource}, {max_resource}, {reduction_factor}")
        n = math.floor(math.log(max_resource / min_resource, reduction_factor)) + 1 if brackets else 1
        self.budgets = [math.ceil(n * reduction_factor ** (n - 1 - b) / (n - b)) for b in range(n)]
        self.halving = [SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=reduction_factor,
                                                min_early_stopping_rate=b) for b in range(n)]

    def bracket(self, study_name: str, number: int) -> int:
        """The bracket of trial ``number`` (Optuna's HyperbandPruner rule)."""
        n = binascii.crc32(f"{study_name}_{number}".encode()) % sum(self.budgets)
        for b, budget in enumerate(self.budgets):
            n -= budget
            if n < 0:
                return b
        raise AssertionError("unreachable: the budgets sum to the modulus")

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        """Whether to stop ``trial``, judged against its strategy's trials in its bracket."""
        b = self.bracket(study.study_name, trial.number)
        stop = self.halving[b].prune(_Peers(study, trial.params.get("strategy"), b, self), trial)
        return stop and not trial.user_attrs.get(FULL, False)


class _Peers:
    """The part of a study that ``SuccessiveHalvingPruner.prune`` reads, narrowed to one strategy and bracket."""

    def __init__(self, study: optuna.Study, label: Any, bracket: int, pruner: StrategyPruner) -> None:
        self._study, self._label, self._bracket, self._pruner = study, label, bracket, pruner

    @property
    def direction(self) -> Any:
        return self._study.direction

    @property
    def _storage(self) -> Any:
        return self._study._storage  # noqa: SLF001  # the pruner records rung values through it

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        name = self._study.study_name
        return [t for t in self._study.get_trials(deepcopy=deepcopy, states=states)
                if t.params.get("strategy") == self._label and self._pruner.bracket(name, t.number) == self._bracket]
