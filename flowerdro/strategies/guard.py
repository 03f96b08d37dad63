"""A strategy's privacy checks: the drivers on its chain, the clients' mods, the model, the replies.

:class:`PrivacyGuard` asks :func:`flowerdro.wrappers.drivers` who drives the strategy on
every call of its Strategy methods and checks each new driver once
(:func:`flowerdro.privacy.check_driver`: a central-DP wrapper or a SecAgg workflow around
a strategy that sends what it cannot protect is refused before that call sends
anything). It then answers what the round needs to know: the central-DP wrapper (its
clipping side and C, its numbers for the round record), whether SecAgg drives the
strategy, which clipping the clients must apply, which training replies were not clipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, Message

from flowerdro import privacy, wrappers

if TYPE_CHECKING:
    from flowerdro.strategies.replies import Expected, Judge

__all__ = ["PrivacyGuard"]


class PrivacyGuard:
    """The privacy pieces around one strategy, found and checked.

    Parameters
    ----------
    strategy : privacy.Declaring
        The strategy guarded (a :class:`~flowerdro.strategies.base.FairStrategy`): what it
        cannot have protected (``unprotected``), whether it aggregates uniformly
        (``uniform_mean``), its ``outer`` wrapper.
    """

    def __init__(self, strategy: privacy.Declaring) -> None:
        self.strategy = strategy
        #: The drivers seen so far (DP wrappers, SecAgg workflows, other Strategies), outermost first.
        self.drivers: list[Any] = []
        #: Objects that call the strategy on its own behalf (flowerdro's legacy adapter): not drivers.
        self.adapters: list[Any] = []

    # ------------------------------------------------------------------ who drives
    def observe(self, extra: Iterable[Any] = ()) -> None:
        """Check the drivers of the call in progress (and ``extra`` objects) that were not seen before."""
        found = wrappers.drivers(skip=[self.strategy, *self.adapters])
        for obj in [*found, *extra]:
            if obj is None or any(obj is d for d in self.drivers):
                continue
            if privacy.check_driver(self.strategy, obj):
                self.drivers.append(obj)

    def observe_config(self, config: Mapping[str, Any]) -> None:
        """A training config with a client-side wrapper's clipping norm: that wrapper drives the strategy.

        Catches a client-side wrapper that is not on the calling thread's stack (see
        :mod:`flowerdro.wrappers`, "Limits").
        """
        if wrappers.clipping_in_config(config) is None or self.client_clipping() is not None:
            return
        err = privacy.refusal(self.strategy, privacy.CENTRAL_DP,
                              "a client-side central-DP wrapper (its clipping norm is in the training config)")
        if err is not None:
            raise err

    def dp_wrapper(self) -> Any | None:
        """The central-DP wrapper that drives the strategy (its ``outer`` or a driver), if any."""
        for obj in [self.strategy.outer, *self.drivers]:
            if obj is not None and wrappers.dp_kind(obj) is not None:
                return obj
        return None

    def secagg(self) -> bool:
        """Whether a SecAgg workflow drives the strategy."""
        return any(wrappers.is_secagg(d) for d in self.drivers)

    def client_clipping(self) -> str | None:
        """``"fixed"`` or ``"adaptive"`` when a client-side clipping wrapper drives the strategy, else None."""
        wrapper = self.dp_wrapper()
        kind = wrappers.dp_kind(wrapper) if wrapper is not None else None
        return kind[1] if kind is not None and kind[0] == "client" else None

    def names(self) -> str:
        """The drivers' class names (for messages), or ``"the caller"``."""
        return ", ".join(type(d).__name__ for d in self.drivers) or "the caller"

    # ------------------------------------------------------------------ what the round checks
    def check_clients(self, client_info: Mapping[int, Mapping[str, Any]]) -> None:
        """Refuse the run when a client's mods cannot protect what the strategy sends (the roll call's answers)."""
        if client_info:
            wrapper = self.dp_wrapper()
            privacy.check_client_mods(self.strategy, client_info,
                                      wrapper=wrappers.dp_kind(wrapper) if wrapper is not None else None,
                                      secagg=self.secagg())

    def check_model(self, arrays: ArrayRecord) -> None:
        """Refuse a model with integer arrays under a central-DP wrapper."""
        if (wrapper := self.dp_wrapper()) is not None:
            privacy.check_integer_arrays(wrapper, arrays)

    def screen(self, expected: Expected, valid: list[Message], judge: Judge) -> list[Message]:
        """The valid replies of a phase less the training replies that were not clipped (each retracted as
        a failure through ``judge``)."""
        if expected.phase != "train":
            return valid
        dropped = self.unclipped(expected.reference, valid)
        for reply, reason in dropped:
            judge.retract("train", int(reply.metadata.src_node_id), "unclipped", reason)
        return [r for r in valid if all(r is not d for d, _ in dropped)]

    def unclipped(self, reference: ArrayRecord | None, replies: Sequence[Message]) -> list[tuple[Message, str]]:
        """The training replies a client-side clipping wrapper must not see, with the reason (see
        :func:`flowerdro.privacy.unclipped`); none without such a wrapper."""
        wrapper = self.dp_wrapper()
        kind = wrappers.dp_kind(wrapper) if wrapper is not None else None
        if kind is None or kind[0] != "client" or reference is None or not replies:
            return []
        return privacy.unclipped(kind, float(wrapper.clipping_norm), reference, replies)

    def record(self) -> dict[str, Any] | None:
        """The central-DP numbers for the round record (None without a central-DP wrapper)."""
        wrapper = self.dp_wrapper()
        return None if wrapper is None else privacy.privacy_record(wrapper)
