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
from flowerdro.strategies.fedmgda import FedMGDA, VanillaFedMGDA
from flowerdro.strategies.output import RunWriter

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
adv-eps adv-lr affine-lambda affine-max-dim client-sampling clients-per-round cvar-alpha dual-lr
dual-lr-decay dual-step-scale eval-model evaluate-model gamma grad-on
graph-p graph-radius graph-resample graph-rows graph-seed lambda-floor lambda-init
loss-on max-tilt-weight mu mu-x num-partitions objective on-failure
output-model pgd-step-size pgd-steps primal-lr regularizer rho sample-with-replacement
server-lr snapshot step-rule theta tilt-log-cap topology
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


def _drdsgd_kwargs(s: Settings) -> dict[str, Any]:
    """Graph and local-step settings shared by DR-DSGD and DSGD (see flowerdro.strategies.drdsgd)."""
    from flowerdro.strategies.drdsgd import EVAL_MODELS

    topology = s.str("topology", "erdos_renyi")
    return {
        "topology": topology,
        "p": s.float("graph-p", 0.3) if topology == "erdos_renyi" else None,
        "radius": s.float("graph-radius", 0.5) if topology == "geometric" else None,
        "rows": (s.int("graph-rows", 0, minimum=0) or None) if topology == "grid" else None,
        "resample": s.bool("graph-resample", False),
        "graph_seed": s.int("graph-seed", 0, minimum=0) if s.has("graph-seed") else None,
        "num_nodes": s.int("num-partitions", 1, minimum=1) if s.has("num-partitions") else None,
        "local_steps": s.int("local-steps", 1, minimum=1),
        "eval_model": s.str("eval-model", "own", choices=EVAL_MODELS),
    }


def _every_device(kw: dict[str, Any], name: str) -> dict[str, Any]:
    """Decentralised SGD steps every device each iteration: full participation by definition.

    A comparison shares one run config, so a ``fraction-train`` meant for the other
    strategies is overridden here (with a warning) instead of failing the whole run;
    constructing ``DRDSGD`` directly with a fraction below 1 is still an error.
    """
    from dataclasses import replace

    loop = kw["loop"]
    if loop.fraction_train != 1.0:
        from logging import WARNING

        from flwr.common import log

        log(WARNING, "%s: fraction-train=%s ignored; every device steps every iteration", name, loop.fraction_train)
    return {**kw, "loop": replace(loop, fraction_train=1.0)}


@register("drdsgd")
def _drdsgd(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.drdsgd import DEFAULT_LOG_CAP, MIN_LOG_CAP, drdsgd

    # max-tilt-weight M (cap h/mu at M, not in the paper) or tilt-log-cap c = log M; not both.
    return drdsgd(mu=s.float("mu", 6.0, positive=True),
                  log_cap=s.float("tilt-log-cap", DEFAULT_LOG_CAP, minimum=MIN_LOG_CAP),
                  max_tilt_weight=s.float("max-tilt-weight", 1.0, positive=True) if s.has("max-tilt-weight") else None,
                  **_drdsgd_kwargs(s), **_every_device(kw, "drdsgd"))


@register("dsgd")
def _dsgd(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.drdsgd import dsgd

    return dsgd(**_drdsgd_kwargs(s), **_every_device(kw, "dsgd"))


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


# ---------------------------------------------------------------- SCAFF-PD / SCAFFOLD
def _is_regression(run_config: Mapping[str, Any]) -> bool:
    """Whether the run's data set has real-valued targets (its clients report a test loss only)."""
    from flowerdro.data.config import REGRESSION_DATASETS

    dataset = str(run_config.get("dataset") or "synthetic").strip().lower().replace("-", "_")
    return dataset in REGRESSION_DATASETS


@register("scaffpd")
def _scaffpd(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.scaffpd import (
        FAILURE_POLICIES,
        GRAD_ON,
        SCAFFPD,
        SCAFFPD_OBJECTIVES,
        STEP_RULES,
    )

    mu_default = s.float("weight-decay", 0.0, minimum=0.0)
    strategy = SCAFFPD(
        objective=s.str("objective", "chi2", choices=SCAFFPD_OBJECTIVES),
        rho=s.float("rho", 0.1, minimum=0.0),
        alpha=s.float("cvar-alpha", 0.5, positive=True, maximum=1.0),
        local_steps=s.int("local-steps", 10, minimum=1),
        lr=s.float("lr", 0.01, positive=True),
        batch_size=s.int("batch-size", 32, minimum=1) if s.has("batch-size") else None,
        step_rule=s.str("step-rule", "5.2", choices=STEP_RULES),
        primal_lr=s.float("primal-lr", 1.0, positive=True) if s.has("primal-lr") else None,
        dual_lr=s.float("dual-lr", 0.1, positive=True),
        gamma=s.float("gamma", 1.0, positive=True) if s.has("gamma") else None,
        theta=s.float("theta", 1.0, minimum=0.0) if s.has("theta") else None,
        mu_x=s.float("mu-x", mu_default, minimum=0.0),
        grad_on=s.str("grad-on", "full", choices=GRAD_ON),
        on_failure=s.str("on-failure", "reuse", choices=FAILURE_POLICIES),
        num_partitions=s.int("num-partitions", 1, minimum=1) if s.has("num-partitions") else None,
        **kw,
    )
    return strategy


@register("scaffold")
def _scaffold(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.scaffold import SCAFFOLD

    strategy = SCAFFOLD(
        local_steps=s.int("local-steps", 10, minimum=1),
        lr=s.float("lr", 0.05, positive=True),
        server_lr=s.float("server-lr", 1.0, positive=True),
        batch_size=s.int("batch-size", 32, minimum=1) if s.has("batch-size") else None,
        **kw,
    )
    return strategy


# ---------------------------------------------------------------- FedRobust and adversarial training
@register("fedrobust")
def _fedrobust(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.fedrobust import FedRobust

    return FedRobust(
        local_steps=s.int("local-steps", 10, minimum=1),
        adv_lr=s.float("adv-lr", 0.01, positive=True),
        affine_lambda=s.float("affine-lambda", 1.0, minimum=0.0),
        lr=s.float("lr", 0.05, positive=True) if s.has("lr") else None,
        batch_size=s.int("batch-size", 32, minimum=1) if s.has("batch-size") else None,
        affine_max_dim=s.int("affine-max-dim", 3072, minimum=1) if s.has("affine-max-dim") else None,
        **kw,
    )


def _adversarial(kind: str, s: Settings, kw: dict[str, Any]) -> FairStrategy:
    from flowerdro.strategies.fedrobust import AdversarialTraining

    return AdversarialTraining(
        kind,
        adv_eps=s.float("adv-eps", 1.0, minimum=0.0),
        pgd_steps=s.int("pgd-steps", 10, minimum=1),
        pgd_step_size=s.float("pgd-step-size", 0.1, positive=True) if s.has("pgd-step-size") else None,
        local_steps=s.int("local-steps", 10, minimum=1) if s.has("local-steps") else None,
        lr=s.float("lr", 0.05, positive=True) if s.has("lr") else None,
        batch_size=s.int("batch-size", 32, minimum=1) if s.has("batch-size") else None,
        **kw,
    )


@register("fedavg-fgm")
def _fedavg_fgm(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    return _adversarial("fgm", s, kw)


@register("fedavg-pgd")
def _fedavg_pgd(s: Settings, kw: dict[str, Any]) -> FairStrategy:
    return _adversarial("pgd", s, kw)
