"""Strategies by name: one registry line per algorithm, built from a Flower run config.

:data:`ALGORITHMS` maps a name to an :class:`Algorithm`: the strategy class (whose
``settings_class`` declares the algorithm's run-config keys), the message types its
clients must serve, and the settings the name fixes (AFL is DRFA with τ = 1: the run
config cannot change it). :func:`build_strategy` reads the algorithm's settings, the
round loop's (:class:`~flowerdro.strategies.base.LoopSettings`) and the clients'
(:mod:`flowerdro.protocol`) from one run config; every value is validated where it is
declared, before any message is sent.

Every run-config key flowerdro knows is declared by one settings class
(:func:`settings_groups`); :func:`check_run_config` refuses the others, naming the
closest known key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from logging import INFO
from typing import Any

from flwr.common import log

from flowerdro import privacy
from flowerdro.protocol import NodeSettings, TrainingSettings
from flowerdro.runs.identity import run_identity
from flowerdro.runs.output import RunWriter
from flowerdro.runs.settings import RunSettings
from flowerdro.settings import (
    Knob,
    Settings,
    check_known_keys,
    check_near_misses,
    knobs,
    read_settings,
)
from flowerdro.strategies.base import FairStrategy, LoopSettings
from flowerdro.strategies.baselines import FedAvgBaseline, FedProxBaseline, QFedAvgBaseline
from flowerdro.strategies.drdsgd import DRDSGD, DSGD
from flowerdro.strategies.drfa import DRFA, DRFAProx
from flowerdro.strategies.fedmgda import FedMGDA, VanillaFedMGDA
from flowerdro.strategies.fedrobust import FedAvgFGM, FedAvgPGD, FedRobust
from flowerdro.strategies.scaffold import SCAFFOLD
from flowerdro.strategies.scaffpd import SCAFFPD


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
    "drfa": Algorithm(DRFA, ("train.drfa", "query.loss"), summary="DRFA (Deng, Kamani, Mahdavi 2020)"),
    "drfa-prox": Algorithm(DRFAProx, ("train.drfa", "query.loss"), summary="DRFA-Prox: DRFA with a regulariser"),
    "afl": Algorithm(DRFA, ("train.drfa", "query.loss"), fixed={"local_steps": 1},
                     summary="AFL (Mohri, Sivek, Suresh 2019): DRFA with τ = 1"),
    "afl-full": Algorithm(DRFA, ("train.drfa", "query.loss"), fixed={"local_steps": 1, "full_participation": True},
                          summary="AFL with every client in every round"),
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

#: Keys that Flower's legacy FedAvg examples read, and flowerdro's key for the same setting
#: (named in the log when a project's run config holds them: flowerdro does not read them).
FLOWER_NAMES: dict[str, str] = {
    "fraction-fit": "fraction-train",
    "min-fit-clients": "min-train-nodes",
    "min-available-clients": "min-available-nodes",
}


def strategy_names() -> tuple[str, ...]:
    """Registered strategy names."""
    return tuple(sorted(ALGORITHMS))


def strength_knobs(name: str) -> dict[str, Knob]:
    """The strength knobs of strategy ``name``: run-config key → :class:`~flowerdro.settings.Knob`.

    The knobs its settings class declares, less the fields the registry entry fixes (AFL
    keeps DRFA's γ; FedAvg-n, FedMGDA+ with ε = 0, has no ε). Strategies without a knob
    (FedAvg, SCAFFOLD, DSGD) give ``{}``.
    """
    if name not in ALGORITHMS:
        raise ValueError(f"strategy: unknown strategy {name!r}; allowed: {', '.join(strategy_names())}")
    alg = ALGORITHMS[name]
    return knobs(alg.strategy.settings_class, exclude=alg.fixed)


def loop_settings(run_config: Mapping[str, Any], **fixed: Any) -> LoopSettings:
    """The round loop's settings; ``eval-metric`` defaults to the loss metric on a regression data set."""
    loop = read_settings(LoopSettings, run_config, **fixed)
    if loop.eval_metric is None and _is_regression(run_config):
        loop = replace(loop, eval_metric=loop.loss_metric)
    return loop


def build_strategy(
    name: str,
    run_config: Mapping[str, Any],
    *,
    own_keys: Iterable[str] = (),
    output_dir: str | None = None,
    run_name: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    extend: bool = False,
    run_id: int | None = None,
) -> FairStrategy:
    """Build strategy ``name`` with its settings read from ``run_config`` (validated before any message).

    ``run_config`` may hold the project's own keys besides flowerdro's (a Flower project
    passes its ``context.run_config``): they are not read. A key that is not a flowerdro
    key but looks like a misspelt one (``dual_lr``, ``lcoal-steps``, ``num-round``:
    :func:`~flowerdro.settings.near_miss`) is refused, naming the key it looks like;
    ``own_keys`` lists the project's own keys that look like a flowerdro key and must
    pass. With ``output_dir``, a :class:`~flowerdro.runs.output.RunWriter` writes the
    run's files there (``resume`` / ``overwrite`` / ``extend``: what to do with a folder that
    holds a run; ``run_id``: the Flower run id its folder lock names).

    Parameters
    ----------
    name : str
        A registered strategy (:func:`strategy_names`).
    run_config : Mapping
        The run config (kebab-case keys, e.g. ``dual-lr``).
    own_keys : iterable of str
        The project's own keys that are near a flowerdro key (passed, not read).
    output_dir, run_name, resume, overwrite, extend, run_id
        Where the run's files go, its folder's name, what to do with a folder that holds a
        run, and the Flower run id its lock names.

    Returns
    -------
    FairStrategy
        The strategy, every setting validated.
    """
    if name not in ALGORITHMS:
        raise ValueError(f"strategy: unknown strategy {name!r}; allowed: {', '.join(strategy_names())}")
    known = known_keys()
    check_near_misses(run_config, known, own=own_keys, where="run config")
    if own := sorted(k for k in run_config if k not in known):
        hints = [f"{k} → {FLOWER_NAMES[k]}" for k in own if k in FLOWER_NAMES]
        log(INFO, "[%s] run-config keys flowerdro does not read (your project's own): %s%s", name,
            ", ".join(own), f" (flowerdro's names: {', '.join(hints)})" if hints else "")
    node = read_settings(NodeSettings, run_config)  # the clients' model and attack settings fail here, not on the clients
    alg = ALGORITHMS[name]
    groups = [alg.strategy.settings_class, LoopSettings, TrainingSettings]
    fixed = [{k: v for k, v in alg.fixed.items() if k in {f.name for f in fields(cls)}} for cls in groups]
    strategy = alg.strategy(read_settings(groups[0], run_config, **fixed[0]),
                            loop=loop_settings(run_config, **fixed[1]),
                            training=read_settings(TrainingSettings, run_config, **fixed[2]),
                            run_name=run_name or name)
    strategy.attack = node.attack_record()
    if output_dir is not None:
        strategy.add_observer(RunWriter(output_dir, resume=resume, overwrite=overwrite, extend=extend,
                                        run_id=run_id, identity=strategy_identity(strategy, run_config, name)))
    return strategy


def strategy_identity(strategy: FairStrategy, run_config: Mapping[str, Any], algorithm: str | None = None
                      ) -> dict[str, Any]:
    """The run identity of ``strategy`` built from ``run_config`` (:func:`flowerdro.runs.identity.run_identity`).

    Hands the identity what the registry knows: every key a settings class declares
    (:func:`known_keys`; the others are the project's own) and the settings classes of
    central DP, whose values shape the result.

    Parameters
    ----------
    strategy : FairStrategy
        The strategy :func:`build_strategy` built from ``run_config``.
    run_config : Mapping
        Its run config.
    algorithm : str, optional
        The registered name it was built under (default: the strategy's ``name``).
    """
    return run_identity(strategy, run_config, algorithm=algorithm, known_keys=known_keys(),
                        settings_classes=settings_groups()["privacy"])


# ---------------------------------------------------------------- every key of a run config
def settings_groups() -> dict[str, list[type[Settings]]]:
    """The settings classes a run config feeds, by what they configure.

    What to run (:class:`~flowerdro.runs.settings.RunSettings`), the round loop, the
    clients' local work and model (:mod:`flowerdro.protocol`), the data
    (:class:`~flowerdro.data.DataConfig`), central DP and each registered algorithm's own
    settings.
    """
    from flowerdro.data.config import DataConfig  # the data's settings, not its loaders

    algorithms: list[type[Settings]] = []
    for alg in ALGORITHMS.values():
        if alg.strategy.settings_class not in algorithms:
            algorithms.append(alg.strategy.settings_class)
    return {
        "run": [RunSettings],
        "loop": [LoopSettings],
        "clients": [TrainingSettings, NodeSettings],
        "data": [DataConfig],
        "privacy": [privacy.PrivacySettings],
        "algorithms": algorithms,
    }


def known_keys() -> set[str]:
    """Every run-config key some settings class declares."""
    keys = {k for group in settings_groups().values() for cls in group for k in cls.keys()}
    return keys | {"seed"}


def check_run_config(config: Mapping[str, Any], *, where: str = "run config") -> None:
    """Refuse keys no settings class knows (naming the closest known key).

    flowerdro's own entry points (the ServerApp, the experiments runner) check;
    :func:`build_strategy` does not, so a user's own project may keep keys of its own in
    the run config it passes.
    """
    check_known_keys(config, known_keys(), where=where)


# ---------------------------------------------------------------- who composes with Flower's privacy pieces
def composes(name_or_strategy: str | FairStrategy, mechanism: str) -> bool:
    """Whether a strategy (a registered name with its default settings, or an object) composes with ``mechanism``.

    ``mechanism`` is one of :data:`flowerdro.privacy.MECHANISMS`; the answer is the
    strategy's own declaration (``unprotected(mechanism) is None``).
    """
    if mechanism not in privacy.MECHANISMS:
        raise ValueError(f"mechanism: unknown {mechanism!r}; allowed: {', '.join(privacy.MECHANISMS)}")
    strategy = build_strategy(name_or_strategy, {}) if isinstance(name_or_strategy, str) else name_or_strategy
    return strategy.unprotected(mechanism) is None


def composing_names(mechanism: str) -> list[str]:
    """The registered strategies that compose with ``mechanism`` under their default settings."""
    return [n for n in strategy_names() if composes(n, mechanism)]


# every refusal names the strategies that do compose
privacy.set_composing(composing_names)

#: The columns of :func:`composition_table`: a piece of Flower and the mechanism it is.
PIECES: tuple[tuple[str, str], ...] = (
    ("central DP, server-side clipping (fixed / adaptive)", privacy.CENTRAL_DP),
    ("central DP, client-side clipping (fixed / adaptive)", privacy.CENTRAL_DP),
    ("LocalDpMod", privacy.LOCAL_DP),
    ("SecAgg+ (legacy API)", privacy.SECAGG),
)


def composition_table() -> str:
    """Markdown: every registered strategy × Flower's privacy pieces → runs, or refused and why.

    From the strategies' own declarations (``unprotected``) under their default settings;
    the test matrix runs every pair and checks the outcome.
    """
    rows = ["| strategy | " + " | ".join(p for p, _ in PIECES) + " |", "|---|" + "---|" * len(PIECES)]
    reasons: dict[str, str] = {}
    for name in strategy_names():
        strategy = build_strategy(name, {})
        cells = []
        for _, mechanism in PIECES:
            what = strategy.unprotected(mechanism)
            if what is None:
                cells.append("runs")
            else:
                ref = reasons.setdefault(what, f"R{len(reasons) + 1}")
                cells.append(f"refused ({ref})")
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    rows.append("")
    rows.extend(f"{ref}: {what}." for what, ref in reasons.items())
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------- data sets
def _is_regression(run_config: Mapping[str, Any]) -> bool:
    """Whether the run's data set has real-valued targets (its clients report a test loss only)."""
    from flowerdro.data.config import REGRESSION_DATASETS

    dataset = str(run_config.get("dataset") or "synthetic").strip().lower().replace("-", "_")
    return dataset in REGRESSION_DATASETS


