r"""flowerdro strategies under Flower's privacy mechanisms: applied, or refused before the first message.

Flower protects a federation with three kinds of pieces, and each flowerdro strategy either
runs its own algorithm with the protection applied to every model it receives, or refuses
with an error that names the piece, what the algorithm sends that the piece cannot
protect, and which strategies do compose:

* **central DP** (:data:`CENTRAL_DP`): Flower's ``DifferentialPrivacy{Server,Client}Side{Fixed,Adaptive}Clipping``
  wrappers (``flwr.serverapp.strategy``; ``flwr.server.strategy`` on the legacy API) clip
  each client's update to norm C and add Gaussian noise of standard deviation
  σ = z·C/m to the aggregate of m clients. That noise bounds the influence of one client
  only when the aggregate is a mean of the clipped updates, and only the model replies
  are clipped: a strategy whose server step reads anything else per client (losses,
  control variates, affine parameters) or weights the updates by what they contain
  (q-FedAvg's F_k^q, FedMGDA+'s min-norm weights) does not compose.
* **local DP** (:data:`LOCAL_DP`): Flower's ``LocalDpMod`` on the clients clips and noises
  each training reply's model before it leaves the client; whatever the server computes
  from such replies is post-processing, so every strategy whose clients send nothing
  else the server reads composes (FedMGDA+'s min-norm step and DR-DSGD's gossip
  included).
* **SecAgg+** (:data:`SECAGG`): Flower's ``SecAggPlusWorkflow`` with ``secaggplus_mod``
  (legacy API) gives the server only the example-weighted mean of the clients' vectors:
  strategies whose server step needs only that (FedAvg, FedProx, FGM/PGD training,
  SCAFFOLD with the control variates kept on the clients) compose.

Each strategy says what it cannot have protected (:meth:`FairStrategy.unprotected
<flowerdro.strategies.base.FairStrategy.unprotected>`). The checks here receive what they
judge (the strategy's declarations, a driver found by :mod:`flowerdro.wrappers`, the
clients' mods, the replies) and import nothing of the strategies: a strategy's
:class:`~flowerdro.strategies.guard.PrivacyGuard` checks every driver on its chain
(:func:`check_driver`) and the clients' mods from their roll-call replies
(:func:`check_client_mods`); with a client-side clipping wrapper every training reply is
checked to be clipped (:func:`unclipped`). :func:`central_dp` builds a Flower wrapper around a
flowerdro strategy (the number of sampled clients and the accountant's population are
filled in when the first round knows them) and lets :meth:`FairStrategy.start
<flowerdro.strategies.base.FairStrategy.start>` drive it; with an accountant the strategy
must aggregate uniformly (``weighting = "uniform"``), as Flower's accounted FedAvg does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log

from flowerdro.settings import Settings, setting
from flowerdro.wrappers import dp_kind, is_secagg, is_strategy

if TYPE_CHECKING:
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import Strategy

__all__ = ["CENTRAL_DP", "DP_KINDS", "LOCAL_DP", "MECHANISMS", "SECAGG", "PrivacyError", "PrivacySettings", "central_dp",
           "check_client_mods", "check_driver", "check_integer_arrays", "dp_from_run_config", "privacy_record",
           "refusal", "set_composing", "unclipped"]

CENTRAL_DP, LOCAL_DP, SECAGG = "central DP", "local DP", "SecAgg+"
#: The mechanisms a strategy declares what it cannot have protected from.
MECHANISMS: tuple[str, ...] = (CENTRAL_DP, LOCAL_DP, SECAGG)
#: The central-DP wrappers :func:`central_dp` builds, by name.
DP_KINDS: tuple[str, ...] = ("server-fixed", "server-adaptive", "client-fixed", "client-adaptive")
#: Client mods that act on the training replies' models (by the name a client reports).
UPDATE_MODS = ("fixedclipping_mod", "adaptiveclipping_mod", "LocalDpMod", "secaggplus_mod")
#: Relative slack of the client-side clipping check: the mods clip in float32.
CLIP_RTOL = 1e-4


@dataclass(frozen=True)
class PrivacySettings(Settings):
    """Central differential privacy around the strategies of flowerdro's ServerApp and experiments runner."""

    dp: str = setting("", "Flower's central-DP wrapper around every strategy (\"\": none); a strategy it cannot "
                          "protect is refused before its first message", choices=("", *DP_KINDS))
    dp_noise_multiplier: float = setting(1.0, "z: the aggregate's Gaussian noise has standard deviation z·C/m", ge=0)
    dp_clipping_norm: float = setting(1.0, "C, the clipping norm (the initial one with adaptive clipping)", gt=0)
    dp_accountant: bool = setting(False, "account the privacy spent (RDP, no amplification; fixed clipping, "
                                         "weighting = \"uniform\"); ε per round in the records")
    dp_delta: float = setting(1e-5, "δ at which the accountant reports ε", gt=0, lt=1)
    dp_max_epsilon: float | None = setting(None, "stop before a round would spend more than this ε (unset: no "
                                                 "limit)", gt=0)
    dp_target_quantile: float = setting(0.5, "adaptive clipping: the quantile of update norms C tracks", ge=0, le=1)
    dp_clip_norm_lr: float = setting(0.2, "adaptive clipping: the step of C's geometric update", gt=0)

    def check(self) -> None:
        """An accountant needs fixed clipping and noise."""
        if self.dp_accountant and not self.dp:
            raise ValueError("dp-accountant: needs dp (\"server-fixed\" or \"client-fixed\")")
        if self.dp_accountant and self.dp.endswith("adaptive"):
            raise ValueError(f"dp-accountant: Flower accounts for fixed clipping only; got dp = {self.dp!r}")


class Declaring(Protocol):
    """What the checks read of a strategy: its names, its declarations, the wrapper it runs under."""

    name: str
    run_name: str
    outer: Any

    def unprotected(self, mechanism: str) -> str | None:
        """What its clients send that ``mechanism`` cannot protect (None: it composes)."""

    def uniform_mean(self) -> bool:
        """Whether its server step is the uniform mean of the clients' models."""


class PrivacyError(ValueError):
    """A privacy mechanism a user asked for cannot protect what a strategy sends (raised before any message)."""


# --------------------------------------------------------------------------- who composes
#: mechanism -> the names of the strategies that compose with it; given by the strategy
#: registry (:func:`set_composing`), which is where the strategies are known.
_composing: Callable[[str], Sequence[str]] | None = None


def set_composing(composing: Callable[[str], Sequence[str]]) -> None:
    """Name, in every refusal, the strategies that compose with the mechanism (``composing(mechanism)``).

    :mod:`flowerdro.strategies.registry` hands its ``composing_names`` over when it is
    imported; until then a refusal names none.
    """
    global _composing
    _composing = composing


def refusal(strategy: Declaring, mechanism: str, by: str, *, extra: str = "") -> PrivacyError | None:
    """The error refusing ``strategy`` under ``mechanism`` (applied by ``by``), or None when it composes."""
    what = strategy.unprotected(mechanism)
    if what is None:
        return None
    names = ", ".join(_composing(mechanism)) if _composing is not None else "see the README's table"
    return PrivacyError(
        f"{by} cannot protect what '{strategy.name}' sends: {what}. The run is refused before its first message "
        f"rather than run without the protection you asked for. Strategies that compose with {mechanism}: "
        f"{names}{extra} (README, 'Privacy and secure aggregation').")


# --------------------------------------------------------------------------- a driver
def check_driver(strategy: Declaring, driver: Any) -> bool:
    """Check one object on the chain that drives ``strategy`` (:func:`flowerdro.wrappers.drivers`).

    Returns True for an object worth remembering (a central-DP wrapper, a SecAgg workflow,
    any other Strategy), False for anything else. Raises :class:`PrivacyError` when
    ``driver`` is a Flower DP wrapper or a SecAgg workflow and the strategy sends what it
    cannot protect, or when a DP wrapper accounts for a strategy that does not aggregate
    uniformly.
    """
    kind = dp_kind(driver)
    if kind is not None:
        by = f"{type(driver).__name__} (central DP, {kind[0]}-side {kind[1]} clipping)"
        err = refusal(strategy, CENTRAL_DP, by)
        if err is not None:
            raise err
        if getattr(driver, "accountant", None) is not None and not strategy.uniform_mean():
            raise PrivacyError(f"{type(driver).__name__} with an accountant: the accounted noise assumes the "
                               f"aggregate is the uniform mean of the clipped updates, but '{strategy.name}' "
                               "weights them by num-examples; set weighting = \"uniform\"")
        log(INFO, "[%s] under %s", strategy.run_name, by)
        return True
    if is_secagg(driver):
        err = refusal(strategy, SECAGG, f"{type(driver).__name__} (secure aggregation)")
        if err is not None:
            raise err
        log(INFO, "[%s] under %s", strategy.run_name, type(driver).__name__)
        return True
    if is_strategy(driver):
        log(INFO, "[%s] driven by %s", strategy.run_name, type(driver).__name__)
        return True
    return False


def check_integer_arrays(wrapper: Any, arrays: ArrayRecord) -> None:
    """Refuse a model with integer arrays under a DP wrapper: its Gaussian noise cannot be added to them."""
    ints = [k for k in arrays.keys() if np.dtype(arrays[k].dtype).kind in "iub"]
    if ints:
        raise PrivacyError(
            f"{type(wrapper).__name__} adds Gaussian noise to every array of the model, but {ints[:5]} hold integers "
            "(e.g. BatchNorm's num_batches_tracked); use a model without integer buffers (BatchNorm with "
            "track_running_stats=False, or GroupNorm/LayerNorm)")


# --------------------------------------------------------------------------- the clients' mods
def check_client_mods(strategy: Declaring, client_info: Mapping[int, Mapping[str, Any]], *,
                      wrapper: tuple[str, str] | None, secagg: bool) -> None:
    """Refuse the run when a client's mods cannot protect what the strategy sends (checked at the roll call).

    ``wrapper`` is the ``(side, clipping)`` of the central-DP wrapper driving the strategy
    (None without one), ``secagg`` whether a SecAgg workflow drives it.
    """
    side = wrapper
    for node, info in sorted(client_info.items()):
        mods = [str(m) for m in (info.get("mods") or [])]
        for mod in mods:
            if mod == "LocalDpMod":
                err = refusal(strategy, LOCAL_DP, f"LocalDpMod on node {node} (local DP)")
                if err is not None:
                    raise err
            elif mod in ("fixedclipping_mod", "adaptiveclipping_mod"):
                clipping = "fixed" if mod == "fixedclipping_mod" else "adaptive"
                if side != ("client", clipping):
                    name = f"DifferentialPrivacyClientSide{clipping.capitalize()}Clipping"
                    raise PrivacyError(
                        f"{mod} on node {node} clips with the norm that {name} sends, but the server's strategy "
                        f"'{strategy.name}' is not wrapped in it: wrap it (flowerdro.privacy.central_dp(strategy, "
                        f"'client-{clipping}', ...)) or remove the mod")
            elif mod == "secaggplus_mod" and not secagg:
                raise PrivacyError(
                    f"secaggplus_mod on node {node} answers Flower's SecAggPlusWorkflow, which is not running: "
                    "run the legacy LegacyStrategy under SecAggPlusWorkflow (README, 'Privacy and secure "
                    "aggregation') or remove the mod")


def unclipped(kind: tuple[str, str], clipping_norm: float, reference: ArrayRecord,
              replies: Sequence[Message]) -> list[tuple[Message, str]]:
    """The training replies a client-side clipping wrapper must not aggregate, each with the reason.

    A clipped reply w_i satisfies ‖w_i − w‖₂ ≤ C over all its arrays (float32 arithmetic
    of the mod: relative slack :data:`CLIP_RTOL`); with adaptive clipping it also carries
    the norm bit the wrapper needs. Dropping an unclipped reply keeps the noise's
    guarantee: the wrapper aggregates only updates bounded by C.
    """
    from flwr.supercore.differential_privacy import KEY_NORM_BIT

    clip = float(clipping_norm)
    ref = {k: np.asarray(reference[k].numpy(), dtype=np.float64) for k in reference.keys()}
    mod = "fixedclipping_mod" if kind[1] == "fixed" else "adaptiveclipping_mod"
    out = []
    for r in replies:
        rec = r.content.array_records.get("arrays") or next(iter(r.content.array_records.values()))
        norm = math.sqrt(sum(float(((np.asarray(rec[k].numpy(), dtype=np.float64) - ref[k]) ** 2).sum())
                             for k in ref))
        if norm > clip * (1 + CLIP_RTOL) + 1e-7:
            out.append((r, f"update norm {norm:.6g} > clipping norm {clip:.6g}: the client does not clip "
                           f"(add {mod} to its ClientApp mods, or run flowerdro's ClientApp, which applies it)"))
        elif kind[1] == "adaptive" and not any(KEY_NORM_BIT in m for m in r.content.metric_records.values()):
            out.append((r, f"no '{KEY_NORM_BIT}' metric: the client does not run adaptiveclipping_mod"))
    return out


# --------------------------------------------------------------------------- central DP around a strategy
def _wrapper_classes() -> dict[str, type]:
    """flowerdro's subclasses of Flower's four central-DP wrappers (see :func:`central_dp`)."""
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideAdaptiveClipping,
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideAdaptiveClipping,
        DifferentialPrivacyServerSideFixedClipping,
    )

    classes = {}
    for kind, base in (("server-fixed", DifferentialPrivacyServerSideFixedClipping),
                       ("client-fixed", DifferentialPrivacyClientSideFixedClipping),
                       ("server-adaptive", DifferentialPrivacyServerSideAdaptiveClipping),
                       ("client-adaptive", DifferentialPrivacyClientSideAdaptiveClipping)):
        classes[kind] = type(base.__name__, (_SampleSize, base), {"__module__": __name__, "__doc__": base.__doc__})
    return classes


class _SampleSize:
    """A Flower DP wrapper whose sample size m (and accountant) are set by the first round's messages.

    Flower's wrappers need m when they are built; a flowerdro strategy knows it once the
    nodes are known. The accountant may be a callable ``population_size -> accountant``.
    With an accountant (fixed clipping only), the wrapped strategy must aggregate
    uniformly, which replaces Flower's check that it is Flower's own FedAvg.
    """

    def __init__(self, strategy: Any, *args: Any, num_sampled_clients: int | None = None,
                 accountant: Any = None, **kwargs: Any) -> None:
        self._lazy_m = num_sampled_clients is None
        self._accountant_factory = accountant if callable(accountant) and not hasattr(accountant, "compose") else None
        given = None if self._accountant_factory is not None else accountant
        super().__init__(strategy, *args, num_sampled_clients=num_sampled_clients or 1, **kwargs)  # type: ignore[call-arg]
        if given is not None:
            self._set_accountant(given)

    def _set_accountant(self, accountant: Any) -> None:
        from flwr.supercore.privacy_accounting import SamplingMethod

        if getattr(self, "noise_multiplier", 0) <= 0:
            raise ValueError("noise-multiplier: must be > 0 with an accountant")
        if accountant.config.sampling_method is not SamplingMethod.NO_AMPLIFICATION:
            raise ValueError("accountant: Flower's fixed-clipping accounting needs sampling_method='no-amplification'")
        if not self.strategy.uniform_mean():
            raise PrivacyError(f"accountant: the accounted noise assumes the aggregate is the uniform mean of the "
                               f"clipped updates, but '{self.strategy.name}' does not aggregate so; set "
                               "weighting = \"uniform\" (fedavg, fedprox, fedavg-fgm, fedavg-pgd)")
        self.accountant = accountant

    def _validate_uniform_weights(self, replies: list[Message]) -> None:  # noqa: D102
        # the strategy aggregates uniformly whatever num-examples the replies carry (checked in _set_accountant)
        return

    def _prepare_accounting(self, server_round: int, messages: Any) -> Any:
        """The fixed-clipping wrappers' hook on the strategy's messages: learn m (and the accountant) first."""
        messages = list(messages)
        self._learn_sample(messages)
        return super()._prepare_accounting(server_round, messages)  # type: ignore[misc]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Any:
        """Flower's configure_train; m is the number of the first round's messages when it was not given."""
        messages = list(super().configure_train(server_round, arrays, config, grid))  # type: ignore[misc]
        self._learn_sample(messages)
        return messages

    def _learn_sample(self, messages: list[Message]) -> None:
        if self._lazy_m:
            self.num_sampled_clients = max(1, len(messages))
            self._lazy_m = False
        if self._accountant_factory is not None and getattr(self, "accountant", None) is None:
            population = len(list(self.strategy.grid.get_node_ids()))
            self._set_accountant(self._accountant_factory(max(population, self.num_sampled_clients)))

    def privacy_record(self) -> dict[str, Any]:
        """The round's DP numbers for the round record: C, σ of the noise, and ε spent so far."""
        from flwr.supercore.differential_privacy import compute_stdv

        out: dict[str, Any] = {"clipping_norm": float(self.clipping_norm),
                               "noise_multiplier": float(self.noise_multiplier),
                               "noise_stdv": float(compute_stdv(self.noise_multiplier, self.clipping_norm,
                                                                self.num_sampled_clients))}
        acc = getattr(self, "accountant", None)
        if acc is not None:
            spent = acc.get_privacy_spent()
            out.update({"epsilon": float(spent.epsilon), "delta": float(spent.delta),
                        "releases": int(spent.num_releases)})
        return out


def central_dp(strategy: Declaring, kind: str, *, noise_multiplier: float, clipping_norm: float = 1.0,
               num_sampled_clients: int | None = None, accountant: Any = None, target_delta: float = 1e-5,
               max_epsilon: float | None = None, **adaptive: Any) -> Strategy:
    """Wrap ``strategy`` in Flower's central-DP wrapper ``kind`` and let ``strategy.start`` drive it.

    Parameters
    ----------
    strategy : FairStrategy
        A flowerdro strategy; refused here (:class:`PrivacyError`) when it sends what central
        DP cannot protect.
    kind : {"server-fixed", "server-adaptive", "client-fixed", "client-adaptive"}
        Flower's ``DifferentialPrivacy{Server,Client}Side{Fixed,Adaptive}Clipping``. With
        client-side clipping the clients must clip (flowerdro's ClientApp and the kit apply
        Flower's clipping mod when the message asks; a reply that is not clipped is dropped).
    noise_multiplier : float
        z: the aggregate's noise has standard deviation z·C/m.
    clipping_norm : float
        C (fixed), or the initial C (adaptive).
    num_sampled_clients : int, optional
        m; unset, the number of training messages of the first round.
    accountant : PrivacyAccountant or True, optional
        Fixed clipping only: Flower's accountant (e.g. ``RdpAccountant(PrivacyConfig(...))``),
        or True for an RDP accountant with no amplification, ``target_delta`` and
        ``max_epsilon``, over the nodes connected in the first round. Needs
        ``weighting = "uniform"`` (and ``pip install 'flwr[dp]'``).
    **adaptive
        ``target_clipped_quantile``, ``clip_norm_lr``, ``clipped_count_stddev`` of the adaptive wrappers.

    Returns
    -------
    The Flower wrapper (a subclass that fills in m and the accountant at the first round);
    ``strategy.outer`` is set to it, so ``strategy.start(...)`` runs through it, and
    ``wrapper.start(...)`` (Flower's loop) works as well.
    """
    if kind not in DP_KINDS:
        raise ValueError(f"dp: unknown {kind!r}; allowed: {', '.join(DP_KINDS)}")
    cls = _wrapper_classes()[kind]
    err = refusal(strategy, CENTRAL_DP, f"{cls.__name__} (central DP)")
    if err is not None:
        raise err
    if accountant is not None and kind.endswith("adaptive"):
        raise ValueError("dp-accountant: Flower accounts for fixed clipping only; use dp = \"server-fixed\" or "
                         "\"client-fixed\"")
    if accountant is True:
        accountant = _rdp_accountant(target_delta, max_epsilon)
    if kind.endswith("fixed"):
        wrapper = cls(strategy, noise_multiplier, clipping_norm, num_sampled_clients=num_sampled_clients,
                      accountant=accountant)
    else:
        wrapper = cls(strategy, noise_multiplier, num_sampled_clients=num_sampled_clients,
                      initial_clipping_norm=clipping_norm, **adaptive)
    strategy.outer = wrapper
    return wrapper


def _rdp_accountant(target_delta: float, max_epsilon: float | None) -> Any:
    """A factory ``N -> RdpAccountant`` (no amplification, add-or-remove-one neighbours)."""
    from flwr.serverapp import NeighboringRelation, PrivacyConfig, SamplingMethod

    try:
        import dp_accounting  # noqa: F401
        from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant
    except ImportError as exc:
        raise ImportError("dp-accountant: the RDP accountant needs dp-accounting: pip install 'flowerdro[dp]'") \
            from exc

    def make(population: int) -> Any:
        return RdpAccountant(PrivacyConfig(target_delta=target_delta, population_size=population,
                                           neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                           sampling_method=SamplingMethod.NO_AMPLIFICATION,
                                           max_epsilon=max_epsilon))

    return make


def dp_from_run_config(strategy: Declaring, settings: Any) -> Strategy | None:
    """The central-DP wrapper the run config asks for (``dp``, ``dp-*`` keys of :class:`PrivacySettings`), if any."""
    if not settings.dp:
        return None
    adaptive = {}
    if settings.dp.endswith("adaptive"):
        adaptive = {"target_clipped_quantile": settings.dp_target_quantile, "clip_norm_lr": settings.dp_clip_norm_lr}
    return central_dp(strategy, settings.dp, noise_multiplier=settings.dp_noise_multiplier,
                      clipping_norm=settings.dp_clipping_norm, accountant=True if settings.dp_accountant else None,
                      target_delta=settings.dp_delta, max_epsilon=settings.dp_max_epsilon, **adaptive)


def privacy_record(wrapper: Any) -> dict[str, Any]:
    """The DP numbers of a central-DP wrapper for the round record: C, z (σ and ε when it knows them)."""
    if hasattr(wrapper, "privacy_record"):
        return wrapper.privacy_record()
    out = {"clipping_norm": float(getattr(wrapper, "clipping_norm", math.nan)),
           "noise_multiplier": float(getattr(wrapper, "noise_multiplier", math.nan))}
    acc = getattr(wrapper, "accountant", None)
    if acc is not None:
        spent = acc.get_privacy_spent()
        out.update({"epsilon": float(spent.epsilon), "delta": float(spent.delta)})
    return out


def mod_names(mods: Sequence[Any]) -> list[str]:
    """The names a client reports for its mods (a function's name, an instance's class name)."""
    return [getattr(m, "__name__", None) or type(m).__name__ for m in mods]
