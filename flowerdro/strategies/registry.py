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
client-sampling clients-per-round dual-lr dual-lr-decay dual-step-scale eps evaluate-model
global-lr gram-precision improvement-before lambda-floor lambda-init loss-on lr-decay
lr-decay-every num-partitions output-model proximal-mu regularizer rho sample-with-replacement
server-device snapshot track-improvement
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
    read_settings(NodeSettings, run_config)  # the clients' model and attack settings fail here, not on the clients
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




# ---------------------------------------------------------------- FedMGDA+ / FedMGDA / FedAvg-n / MGDA-Prox
def _fedmgda_kwargs(s: Settings, *, eps: float | None, normalize: bool, lambda_init: str,
                    proximal_mu: float = 0.0) -> dict[str, Any]:
    """FedMGDA+-family settings from the run config (keys documented in flowerdro.strategies.fedmgda)."""
    from flowerdro.strategies.fedmgda import (
        DEVICES,
        GRAM_PRECISIONS,
        IMPROVEMENT_BEFORE,
        LAMBDA_INITS,
    )

    return {
        "eps": s.float("eps", eps, minimum=0.0, maximum=1.0) if eps is not None else None,
        # Normalising is what tells the variants apart, so it is fixed by the name, never
        # read from the (shared) run config.
        "normalize": normalize,
        "global_lr": s.float("global-lr", 1.0, positive=True),
        "lr_decay": s.float("lr-decay", 1.0, positive=True, maximum=1.0),
        "lr_decay_every": s.int("lr-decay-every", 100, minimum=1),
        "lambda_init": s.str("lambda-init", lambda_init, choices=LAMBDA_INITS),
        "proximal_mu": s.float("proximal-mu", proximal_mu, minimum=0.0) if proximal_mu > 0 else 0.0,
        "local_epochs": s.float("local-epochs", 1.0, positive=True)
        if s.has("local-epochs") and float(s.raw("local-epochs")) > 0 else None,
        "local_steps": s.int("local-steps", 1, minimum=1) if s.has("local-steps") else None,
        "lr": s.float("lr", 0.01, positive=True) if s.has("lr") else None,
        "batch_size": s.int("batch-size", 32, minimum=1) if s.has("batch-size") else None,
        "track_improvement": s.bool("track-improvement", False),
        "improvement_before": s.str("improvement-before", "train-loss", choices=IMPROVEMENT_BEFORE),
        "gram_precision": s.str("gram-precision", "auto", choices=GRAM_PRECISIONS),
        "server_device": s.str("server-device", "auto", choices=DEVICES),
    }


@register("fedmgda+")
def _fedmgda_plus(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.fedmgda import FedMGDA

    return FedMGDA(**_fedmgda_kwargs(s, eps=0.1, normalize=True, lambda_init="uniform"), name="fedmgda+", **kw)


@register("fedmgda")
def _fedmgda_vanilla(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.fedmgda import FedMGDA

    # Vanilla MGDA in FL: raw updates, no ε-box, and w_{t+1} = Σ λ*_i w_i (η = 1, no decay),
    # whatever global-lr / lr-decay the shared run config holds for FedMGDA+.
    args = {**_fedmgda_kwargs(s, eps=None, normalize=False, lambda_init="uniform"), "global_lr": 1.0, "lr_decay": 1.0}
    return FedMGDA(**args, name="fedmgda", **kw)


@register("fedavg-n")
def _fedavg_n(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.fedmgda import FedMGDA

    args = _fedmgda_kwargs(s, eps=0.0, normalize=True, lambda_init="size")
    args["eps"] = 0.0  # FedAvg-n is ε = 0 by definition
    return FedMGDA(**args, name="fedavg-n", **kw)


@register("fedavg-mgda")
def _fedavg_mgda(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.fedmgda import FedMGDA

    # FedAvg as the ε = 0 member of the family without normalisation: λ* = λ₀ ∝ n_i and
    # w_{t+1} = w_t − Σ λ₀_i (w_t − w_i) = Σ λ₀_i w_i, the FedAvg step, whatever global-lr /
    # lr-decay / eps the shared run config holds; it exists so that FedAvg gets the family's
    # options (track-improvement above all), which Flower's FedAvg ("fedavg") does not have.
    args = {**_fedmgda_kwargs(s, eps=0.0, normalize=False, lambda_init="size"), "eps": 0.0, "global_lr": 1.0,
            "lr_decay": 1.0}
    return FedMGDA(**args, name="fedavg-mgda", **kw)


@register("mgda-prox")
def _mgda_prox(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.fedmgda import FedMGDA

    return FedMGDA(**_fedmgda_kwargs(s, eps=0.1, normalize=True, lambda_init="uniform", proximal_mu=0.1),
                   name="mgda-prox", **kw)
