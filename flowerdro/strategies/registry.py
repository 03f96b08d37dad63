"""Strategies by name: one registry line per algorithm, built from a Flower run config.

:data:`ALGORITHMS` maps a name to an :class:`Algorithm`: the strategy class (whose
``settings_class`` declares the algorithm's run-config keys), the message types its
clients must serve, and the settings the name fixes (AFL is DRFA with τ = 1: the run
config cannot change it). :func:`build_strategy` reads the algorithm's settings, the
round loop's (:class:`~flowerdro.strategies.base.LoopSettings`) and the clients'
(:mod:`flowerdro.protocol`) from one run config; every value is validated where it is
declared, before any message is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from flowerdro.clients.config import Settings
from flowerdro.protocol import NodeSettings, TrainingSettings
from flowerdro.settings import read_settings
from flowerdro.strategies.base import FairStrategy, LoopSettings
from flowerdro.strategies.baselines import FedAvgBaseline, FedProxBaseline, QFedAvgBaseline
from flowerdro.strategies.drdsgd import DRDSGD, DSGD
from flowerdro.strategies.fedmgda import FedMGDA, VanillaFedMGDA
from flowerdro.strategies.fedrobust import FedAvgFGM, FedAvgPGD, FedRobust
from flowerdro.strategies.output import RunWriter
from flowerdro.strategies.scaffold import SCAFFOLD
from flowerdro.strategies.scaffpd import SCAFFPD

#: Message types every flowerdro server sends, whatever the algorithm.
COMMON_ROUTES = ("evaluate", "query.init")


@dataclass(frozen=True)
class Algorithm:
    """One registry entry: how a name becomes a strategy."""

    strategy: type[FairStrategy]
    routes: tuple[str, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    summary: str = ""


ALGORITHMS: dict[str, Algorithm] = {
    "fedavg": Algorithm(FedAvgBaseline, ("train",), summary="Flower's FedAvg"),
    "fedprox": Algorithm(FedProxBaseline, ("train",), summary="Flower's FedProx"),
    "qfedavg": Algorithm(QFedAvgBaseline, ("train",), summary="Flower's q-FedAvg"),
    "drdsgd": Algorithm(DRDSGD, ("train.drdsgd",), fixed={"fraction_train": 1.0},
                        summary="DR-DSGD: tilted local steps (h/μ) + Metropolis gossip"),
    "dsgd": Algorithm(DSGD, ("train.dsgd",), fixed={"fraction_train": 1.0},
                      summary="DSGD: plain local SGD steps + Metropolis gossip"),
    "scaffpd": Algorithm(SCAFFPD, ("query.loss_grad", "train.scaffpd"), fixed={"local_epochs": 0.0},
                         summary="SCAFF-PD: accelerated primal-dual with control variates"),
    "scaffold": Algorithm(SCAFFOLD, ("train.scaffold",), fixed={"local_epochs": 0.0},
                          summary="SCAFFOLD, option II"),
    "fedrobust": Algorithm(FedRobust, ("train.fedrobust", "query.affine_state"),
                           summary="FedRobust: local GDA against per-client affine shifts"),
    "fedavg-fgm": Algorithm(FedAvgFGM, ("train.fgm",), summary="FedAvg over FGM adversarial training"),
    "fedavg-pgd": Algorithm(FedAvgPGD, ("train.pgd",), summary="FedAvg over PGD adversarial training"),
    "fedmgda+": Algorithm(FedMGDA, ("train.sgd", "query.loss"), fixed={"proximal_mu": 0.0},
                          summary="FedMGDA+: min-norm step on normalised updates, ε-box around λ₀"),
    "fedmgda": Algorithm(VanillaFedMGDA, ("train.sgd", "query.loss"),
                         fixed={"eps": None, "global_lr": 1.0, "lr_decay": 1.0, "proximal_mu": 0.0},
                         summary="FedMGDA: MGDA on raw updates, no box, η = 1"),
    "fedavg-n": Algorithm(FedMGDA, ("train.sgd", "query.loss"),
                          fixed={"eps": 0.0, "lambda_init": "size", "proximal_mu": 0.0},
                          summary="FedAvg on normalised updates (FedMGDA+ with ε = 0)"),
    "fedavg-mgda": Algorithm(VanillaFedMGDA, ("train.sgd", "query.loss"), summary="FedAvg through the FedMGDA step",
                             fixed={"eps": 0.0, "lambda_init": "size", "global_lr": 1.0, "lr_decay": 1.0,
                                    "proximal_mu": 0.0}),
    "mgda-prox": Algorithm(FedMGDA, ("train.sgd", "query.loss"), summary="FedMGDA+ with proximal local steps"),
}

Factory = Callable[[Settings, dict[str, Any]], FairStrategy]
_REGISTRY: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    """Register a factory ``(settings, common_kwargs) -> FairStrategy`` under ``name``."""

    def deco(fn: Factory) -> Factory:
        _REGISTRY[name] = fn
        return fn

    return deco


#: Run-config keys of the algorithms still built by the factories below (until each has a
#: settings class, these are the keys the factories read).
_LEGACY_KEYS = frozenset("""
client-sampling clients-per-round dual-lr dual-lr-decay dual-step-scale evaluate-model
lambda-floor lambda-init loss-on num-partitions output-model regularizer rho
sample-with-replacement snapshot
""".split())


def legacy_keys() -> set[str]:
    """Run-config keys read by algorithms that have no settings class yet."""
    return set(_LEGACY_KEYS) if _REGISTRY else set()


def strategy_names() -> tuple[str, ...]:
    """Registered strategy names."""
    return tuple(sorted({*ALGORITHMS, *_REGISTRY}))


def loop_settings(run_config: Mapping[str, Any], **fixed: Any) -> LoopSettings:
    """The round loop's settings; ``eval-metric`` defaults to the loss metric on a regression data set."""
    loop = read_settings(LoopSettings, run_config, **fixed)
    if loop.eval_metric is None and _is_regression(run_config):
        loop = replace(loop, eval_metric=loop.loss_metric)
    return loop


def common_kwargs(s: Settings, run_config: Mapping[str, Any], run_name: str) -> dict[str, Any]:
    """The round loop's settings (sampling fractions, seed, …) and the run's label."""
    return {"loop": loop_settings(run_config), "run_name": run_name}


def build_strategy(
    name: str,
    run_config: Mapping[str, Any],
    *,
    output_dir: str | None = None,
    run_name: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> FairStrategy:
    """Build strategy ``name`` with its settings read from ``run_config`` (validated before any message).

    With ``output_dir``, a :class:`~flowerdro.strategies.output.RunWriter` writes the run's
    files there (``resume`` / ``overwrite``: what to do with a folder that holds a run).
    """
    if name not in ALGORITHMS and name not in _REGISTRY:
        raise ValueError(f"strategy: unknown strategy {name!r}; allowed: {', '.join(strategy_names())}")
    node = read_settings(NodeSettings, run_config)  # the clients' model and attack settings fail here, not on the clients
    if name in ALGORITHMS:
        alg = ALGORITHMS[name]
        groups = [alg.strategy.settings_class, LoopSettings, TrainingSettings]
        fixed = [{k: v for k, v in alg.fixed.items() if k in {f.name for f in fields(cls)}} for cls in groups]
        strategy = alg.strategy(read_settings(groups[0], run_config, **fixed[0]),
                                loop=loop_settings(run_config, **fixed[1]),
                                training=read_settings(TrainingSettings, run_config, **fixed[2]),
                                run_name=run_name or name)
    else:
        read_settings(TrainingSettings, run_config)
        strategy = _REGISTRY[name](Settings(run_config), common_kwargs(Settings(run_config), run_config,
                                                                      run_name or name))
    strategy.attack = node.attack_record()
    if output_dir is not None:
        strategy.add_observer(RunWriter(output_dir, resume=resume, overwrite=overwrite))
    return strategy


# ---------------------------------------------------------------- DRFA / DRFA-Prox / AFL
def _drfa_kwargs(s: Settings, *, regularizer_default: str, rho_default: float) -> dict[str, Any]:
    """DRFA hyper-parameters from the run config (keys documented in flowerdro.strategies.drfa)."""
    from flowerdro.strategies.drfa import (
        CLIENT_SAMPLINGS,
        DUAL_STEP_SCALES,
        LAMBDA_INITS,
        LOSS_ON,
        MODEL_CHOICES,
        REGULARIZERS,
        SNAPSHOT_MODES,
    )

    return {
        "clients_per_round": s.int("clients-per-round", 1, minimum=1) if s.has("clients-per-round") else None,
        "local_steps": s.int("local-steps", 10, minimum=1),
        "dual_lr": s.float("dual-lr", 8e-3, positive=True),
        "regularizer": s.str("regularizer", regularizer_default, choices=REGULARIZERS),
        "rho": s.float("rho", rho_default, minimum=0.0),
        "lr": s.float("lr", 0.1, positive=True) if s.has("lr") else None,
        "batch_size": s.int("batch-size", 32, minimum=1) if s.has("batch-size") else None,
        "sample_with_replacement": s.bool("sample-with-replacement", True),
        "client_sampling": s.str("client-sampling", "lambda", choices=CLIENT_SAMPLINGS),
        "snapshot": s.str("snapshot", "shared", choices=SNAPSHOT_MODES),
        "dual_lr_decay": s.float("dual-lr-decay", 1.0, positive=True, maximum=1.0),
        "lambda_floor": s.float("lambda-floor", 0.0, minimum=0.0),
        "dual_step_scale": s.str("dual-step-scale", "paper", choices=DUAL_STEP_SCALES),
        "lambda_init": s.str("lambda-init", "uniform", choices=LAMBDA_INITS),
        "output_model": s.str("output-model", "last", choices=MODEL_CHOICES),
        "evaluate_model": s.str("evaluate-model", "last", choices=MODEL_CHOICES),
        "query_loss_on": s.str("loss-on", "batch", choices=LOSS_ON),
        "num_partitions": s.int("num-partitions", 1, minimum=1) if s.has("num-partitions") else None,
    }


@register("drfa")
def _drfa(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.drfa import DRFA

    return DRFA(**_no_regularizer(_drfa_kwargs(s, regularizer_default="none", rho_default=0.0)), **kw)


def _no_regularizer(args: dict[str, Any]) -> dict[str, Any]:
    """DRFA and AFL have no regulariser whatever the run config says.

    The run config is shared by every strategy of a comparison, so a ``regularizer`` or
    ``rho`` meant for ``drfa-prox`` must not turn plain DRFA into DRFA-Prox.
    """
    return {**args, "regularizer": "none", "rho": 0.0}


@register("drfa-prox")
def _drfa_prox(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.core.dual import DRFA_REGULARIZERS
    from flowerdro.strategies.drfa import DRFA

    args = _drfa_kwargs(s, regularizer_default="kl", rho_default=0.1)
    if args["regularizer"] not in DRFA_REGULARIZERS:
        raise ValueError(f"regularizer: drfa-prox needs one of {', '.join(DRFA_REGULARIZERS)}, "
                         f"got {args['regularizer']!r} (use strategy 'drfa' for no regulariser)")
    return DRFA(**args, **kw)


@register("afl")
def _afl(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.drfa import DRFA

    return DRFA(**{**_no_regularizer(_drfa_kwargs(s, regularizer_default="none", rho_default=0.0)),
                   "local_steps": 1}, **kw)


@register("afl-full")
def _afl_full(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.drfa import DRFA

    args = {**_no_regularizer(_drfa_kwargs(s, regularizer_default="none", rho_default=0.0)), "local_steps": 1,
            "full_participation": True}
    return DRFA(**args, **kw)


# ---------------------------------------------------------------- data sets
def _is_regression(run_config: Mapping[str, Any]) -> bool:
    """Whether the run's data set has real-valued targets (its clients report a test loss only)."""
    from flowerdro.data.config import REGRESSION_DATASETS

    dataset = str(run_config.get("dataset") or "synthetic").strip().lower().replace("-", "_")
    return dataset in REGRESSION_DATASETS


