"""Who drives a strategy: the one place where Flower's wrappers and workflows around it are found.

Contract
--------
A strategy is *driven* by the objects whose methods call its Strategy methods, directly or
through one another: the chain from the loop that runs the rounds (Flower's
``Strategy.start``, the legacy ``Server``, a workflow, a user's own loop) down to the
strategy. :func:`drivers` returns that chain for the call in progress: every object whose
method is running on the current thread's call stack above it, outermost first, each
once, with the objects of ``skip`` (the strategy itself, flowerdro's legacy adapter) left
out. What an object on the chain is, is decided here and nowhere else:

* :func:`dp_kind`: one of Flower's four central-DP wrappers
  (``DifferentialPrivacy{Server,Client}Side{Fixed,Adaptive}Clipping``) of either API, or a
  subclass of one (:func:`flowerdro.privacy.central_dp` builds such subclasses), as
  ``(side, clipping)``;
* :func:`is_secagg`: Flower's ``SecAggPlusWorkflow`` or ``SecAggWorkflow``;
* :func:`is_strategy`: any other Strategy of either API (a user's pass-through wrapper,
  Flower's legacy ``FedAvg`` driving a flowerdro strategy inside it, …).

Every wrapper on the chain counts, however many there are and in whichever order, so a
user's pass-through between a DP wrapper and the strategy, or two nested wrappers, hide
nothing. flowerdro's strategies ask on every call of their Strategy methods
(:class:`~flowerdro.strategies.guard.PrivacyGuard`: Message API ``summary``,
``configure_train``, ``aggregate_train``, ``configure_evaluate``, ``aggregate_evaluate``;
the legacy adapter's ``initialize_parameters``, ``configure_fit``, ``aggregate_fit``,
``configure_evaluate``, ``aggregate_evaluate``), and check each object the first time it
appears, before that call sends anything.

Why the call stack: a driver does not announce itself to what it drives. A server-side
DP wrapper hands its strategy exactly the arguments it was given (the clipping and the
noise happen to the replies and the result, around the call); Flower's loops pass no
reference to the outermost object down the chain; a user's wrapper may keep the strategy
under any attribute name, in a closure or a bound method, so walking attributes down
from a known top can be avoided by the user's code, and the objects that merely *hold*
a strategy (found through the garbage collector, which also misses everything
``gc.freeze`` moved out of its generations) include wrappers built and dropped that
drive nothing. The callers of a call are exactly its drivers.

Limits, stated: a wrapper that hands the call to another thread (an executor) is not
on the calling thread's stack. A client-side wrapper is recognised in that case too,
by the clipping norm it adds to the training config (:func:`clipping_in_config`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["DP_WRAPPERS", "clipping_in_config", "dp_kind", "drivers", "is_secagg", "is_strategy"]

#: Flower's central-DP wrappers by class name: (side, clipping).
DP_WRAPPERS: dict[str, tuple[str, str]] = {
    "DifferentialPrivacyServerSideFixedClipping": ("server", "fixed"),
    "DifferentialPrivacyServerSideAdaptiveClipping": ("server", "adaptive"),
    "DifferentialPrivacyClientSideFixedClipping": ("client", "fixed"),
    "DifferentialPrivacyClientSideAdaptiveClipping": ("client", "adaptive"),
}


@functools.cache
def _wrapper_classes() -> list[tuple[type, tuple[str, str]]]:
    from flwr.server import strategy as legacy
    from flwr.serverapp import strategy as message_api

    out = []
    for name, kind in DP_WRAPPERS.items():
        for module in (message_api, legacy):
            cls = getattr(module, name, None)
            if cls is not None:
                out.append((cls, kind))
    return out


def dp_kind(obj: Any) -> tuple[str, str] | None:
    """``(side, clipping)`` of a Flower central-DP wrapper of either API (or a subclass), else None.

    ``side`` is ``"server"`` or ``"client"`` (who clips), ``clipping`` ``"fixed"`` or ``"adaptive"``.
    """
    for cls, kind in _wrapper_classes():
        if isinstance(obj, cls):
            return kind
    return None


@functools.cache
def _secagg_classes() -> tuple[type, ...]:
    from flwr.server.workflow import SecAggPlusWorkflow, SecAggWorkflow

    return SecAggPlusWorkflow, SecAggWorkflow


@functools.cache
def _strategy_classes() -> tuple[type, ...]:
    from flwr.server.strategy import Strategy as LegacyStrategyBase
    from flwr.serverapp.strategy import Strategy

    return Strategy, LegacyStrategyBase


def is_secagg(obj: Any) -> bool:
    """Whether ``obj`` is Flower's ``SecAggPlusWorkflow`` or ``SecAggWorkflow``."""
    return isinstance(obj, _secagg_classes())


def is_strategy(obj: Any) -> bool:
    """Whether ``obj`` is a Strategy of Flower's Message API or of its legacy API."""
    return isinstance(obj, _strategy_classes())


def _is_driver(obj: Any) -> bool:
    return isinstance(obj, _strategy_classes() + _secagg_classes())


def drivers(skip: Iterable[Any] = ()) -> list[Any]:
    """The drivers of the call in progress: Strategies and SecAgg workflows whose methods run above it.

    Walks the current thread's call stack from the caller of the function that asks, and
    takes each frame's bound object (the first argument of a method); those that
    :func:`is_strategy` or :func:`is_secagg` recognise form the chain, outermost first,
    each once, without the objects of ``skip`` (compared by identity).
    """
    left_out = {id(o) for o in skip}
    found: dict[int, Any] = {}
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount:
            obj = frame.f_locals.get(code.co_varnames[0])
            if obj is not None and id(obj) not in left_out and id(obj) not in found and _is_driver(obj):
                found[id(obj)] = obj
        frame = frame.f_back
    return list(reversed(found.values()))


def clipping_in_config(config: Mapping[str, Any]) -> float | None:
    """The clipping norm a client-side DP wrapper put into a training config (None when it holds none)."""
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    value = config.get(KEY_CLIPPING_NORM) if config is not None else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
