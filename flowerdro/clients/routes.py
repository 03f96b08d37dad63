"""Message type → the flowerdro handler that serves it, named by module and function.

This table imports neither torch nor the data code: a ClientApp process that only forwards
a message (node config ``worker=1``, :mod:`flowerdro.deploy.worker`) loads nothing else,
and :func:`handler` imports a handler's module on its first call.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ROUTE_SPECS", "handler"]

_H, _SP, _RB, _DR = ("flowerdro.clients.handlers", "flowerdro.clients.scaffpd", "flowerdro.clients.robust",
                     "flowerdro.clients.drdsgd")

#: Every message type a flowerdro strategy sends → (module, function, keyword arguments).
ROUTE_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "train": (_H, "train_reply", {}),
    "train.sgd": (_H, "train_reply", {}),
    "train.drfa": (_H, "train_reply", {"with_snapshot": True}),
    "train.drdsgd": (_DR, "drdsgd_reply", {"robust": True}),
    "train.dsgd": (_DR, "drdsgd_reply", {"robust": False}),
    "train.scaffpd": (_SP, "scaffpd_train_reply", {}),
    "train.scaffold": (_SP, "scaffold_train_reply", {}),
    "train.fedrobust": (_RB, "fedrobust_train_reply", {}),
    "train.fgm": (_RB, "adversarial_train_reply", {"kind": "fgm"}),
    "train.pgd": (_RB, "adversarial_train_reply", {"kind": "pgd"}),
    "evaluate": (_H, "evaluate_reply", {"named": True}),
    "query.loss": (_H, "loss_reply", {}),
    "query.init": (_H, "init_reply", {}),
    "query.loss_grad": (_SP, "loss_grad_reply", {}),
    "query.affine_state": (_RB, "affine_state_reply", {}),
}


def handler(message_type: str) -> Callable[[Any, Any], Any]:
    """The handler ``(message, context) -> reply`` of ``message_type``, its module imported on first call.

    Raises
    ------
    KeyError
        ``message_type`` is not one of :data:`ROUTE_SPECS`.
    """
    if message_type not in ROUTE_SPECS:
        raise KeyError(f"no flowerdro handler for message type {message_type!r}; known: {sorted(ROUTE_SPECS)}")
    module, function, kwargs = ROUTE_SPECS[message_type]
    return _Route(module, function, tuple(sorted(kwargs.items())))


@dataclass(frozen=True)
class _Route:
    """A lazily imported handler: ``module.function(message, context, **kwargs)``.

    A module-level class rather than a closure: Flower's Ray simulation pickles the
    ClientApp with every message it hands an actor, and an instance of an importable
    class pickles as a reference plus three strings, where a closure pickles its code.
    """

    module: str
    function: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __call__(self, message: Any, context: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.function)(message, context, **dict(self.kwargs))
