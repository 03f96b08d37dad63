"""Flower Message-API strategies.

``from flowerdro.strategies import build_strategy, strategy_names`` builds any registered
strategy from a run config; the classes (``DRFA``, ``DRFAProx``, ``SCAFFPD``, ``SCAFFOLD``, ``DRDSGD``,
``FedRobust``, ``AdversarialTraining``, ``FedMGDA``, the Flower baselines) can also be
built directly with their settings.
"""

from flowerdro.strategies.base import FairStrategy, LoopSettings, RunFailedError
from flowerdro.strategies.baselines import (
    FedAvgBaseline,
    FedProxBaseline,
    FlowerBaseline,
    QFedAvgBaseline,
)
from flowerdro.strategies.drdsgd import DRDSGD, DSGD
from flowerdro.strategies.drfa import DRFA, DRFAProx
from flowerdro.strategies.fedmgda import FedMGDA
from flowerdro.strategies.fedrobust import AdversarialTraining, FedRobust
from flowerdro.strategies.registry import ALGORITHMS, build_strategy, strategy_names, strength_knobs
from flowerdro.strategies.scaffold import SCAFFOLD
from flowerdro.strategies.scaffpd import SCAFFPD
from flowerdro.strategies.transport import initial_arrays

__all__ = [
    "ALGORITHMS",
    "DRDSGD",
    "DRFA",
    "DRFAProx",
    "DSGD",
    "SCAFFOLD",
    "SCAFFPD",
    "AdversarialTraining",
    "FairStrategy",
    "FedAvgBaseline",
    "FedMGDA",
    "FedProxBaseline",
    "FedRobust",
    "FlowerBaseline",
    "LoopSettings",
    "QFedAvgBaseline",
    "RunFailedError",
    "build_strategy",
    "initial_arrays",
    "strategy_names",
    "strength_knobs",
]
