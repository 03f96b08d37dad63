"""Every run-config key flowerdro knows, and the check that refuses the others.

A run config feeds several settings classes: what to run (:class:`RunSettings`), the round
loop (:class:`~flowerdro.strategies.base.LoopSettings`), the clients' local work and model
(:mod:`flowerdro.protocol`), the data (:class:`~flowerdro.data.DataConfig`) and each
algorithm's own settings (the ``settings_class`` of every registered strategy). A key
that none of them declares is a typo: :func:`check_run_config` refuses it and names the
closest known key. flowerdro's own entry points (the ServerApp, the experiments runner)
check; ``build_strategy`` does not, so a user's own project may keep keys of its own in
the run config it passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flowerdro.data.config import DataConfig
from flowerdro.privacy import PrivacySettings
from flowerdro.protocol import NodeSettings, TrainingSettings
from flowerdro.runs.driver import RunSettings
from flowerdro.settings import Settings, check_known_keys
from flowerdro.strategies.base import LoopSettings
from flowerdro.strategies.registry import ALGORITHMS

__all__ = ["check_run_config", "known_keys", "settings_groups"]


def settings_groups() -> dict[str, list[type[Settings]]]:
    """The settings classes a run config feeds, by what they configure."""
    algorithms: list[type[Settings]] = []
    for alg in ALGORITHMS.values():
        if alg.strategy.settings_class not in algorithms:
            algorithms.append(alg.strategy.settings_class)
    return {
        "run": [RunSettings],
        "loop": [LoopSettings],
        "clients": [TrainingSettings, NodeSettings],
        "data": [DataConfig],
        "privacy": [PrivacySettings],
        "algorithms": algorithms,
    }


def known_keys() -> set[str]:
    """Every run-config key some settings class declares."""
    keys = {k for group in settings_groups().values() for cls in group for k in cls.keys()}
    return keys | {"seed"}


def check_run_config(config: Mapping[str, Any], *, where: str = "run config") -> None:
    """Refuse keys no settings class knows (naming the closest known key)."""
    check_known_keys(config, known_keys(), where=where)
