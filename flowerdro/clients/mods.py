"""Flower mods around flowerdro's client routes.

Flower's ``ClientApp(mods=...)`` wraps every message type in every mod. Flower's mods that
act on a training reply's model (``fixedclipping_mod``, ``adaptiveclipping_mod``,
``LocalDpMod``, ``secaggplus_mod``: :data:`UPDATE_MODS`) answer any other message with an
error (an evaluate or query reply carries no model), so flowerdro applies them to the
training routes only and every other mod to every route. A ``query.init`` reply says
which mods the client runs (a ``client`` ConfigRecord), so the server can refuse, before
any training message, a strategy that those mods cannot protect (:mod:`flowerdro.privacy`).
Outside all of them, :func:`~flowerdro.client_errors.reply_errors` turns an exception of
a route (or of a mod) into an error reply that carries it once (:mod:`flowerdro.client_errors`).

When the server's strategy is wrapped in Flower's client-side clipping wrapper, its training
messages carry the clipping norm; a training route without a clipping mod of its own then
applies Flower's matching mod (:func:`clip_as_asked`), so flowerdro's ClientApp and a kit
app clip as the wrapper expects. A reply that is not clipped is dropped by the server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flwr.app import ConfigRecord, Context, Message

from flowerdro.client_errors import reply_errors
from flowerdro.protocol import CLIENT_RECORD, CLIPPING_KEY

__all__ = ["CLIPPING_KEY", "ModChain", "UPDATE_MODS", "clip_as_asked", "is_update_mod", "mod_name"]

#: Mods that act on a training reply's model (by name: Flower ships each in two modules).
UPDATE_MODS: tuple[str, ...] = ("fixedclipping_mod", "adaptiveclipping_mod", "LocalDpMod", "secaggplus_mod")
_CLIPPING_MODS = ("fixedclipping_mod", "adaptiveclipping_mod")

Mod = Callable[[Message, Context, Callable[[Message, Context], Message]], Message]


def mod_name(mod: Any) -> str:
    """The name a client reports for a mod: a function's name, an instance's class name."""
    return getattr(mod, "__name__", None) or type(mod).__name__


def is_update_mod(mod: Any) -> bool:
    """Whether ``mod`` acts on a training reply's model (one of :data:`UPDATE_MODS`)."""
    return mod_name(mod) in UPDATE_MODS


def _is_training(message: Message) -> bool:
    mtype = message.metadata.message_type
    return mtype == "train" or mtype.startswith("train.")


def _config(message: Message) -> ConfigRecord | None:
    records = message.content.config_records
    return records.get("config") or records.get("fitins.config")


def clip_as_asked(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower's clipping mod when a training message carries the clipping norm of a client-side DP wrapper.

    ``dp-clipping`` in the message's config picks ``fixedclipping_mod`` (default) or
    ``adaptiveclipping_mod``; a message without the clipping norm passes unchanged.
    """
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    cfg = _config(message) if message.has_content() else None
    if not _is_training(message) or cfg is None or KEY_CLIPPING_NORM not in cfg:
        return call_next(message, context)
    if "fitins.config" in message.content.config_records:  # a legacy FitIns: the legacy API's mods
        from flwr.client.mod import adaptiveclipping_mod, fixedclipping_mod
    else:
        from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
    mod = adaptiveclipping_mod if str(cfg.get(CLIPPING_KEY, "fixed")) == "adaptive" else fixedclipping_mod
    return mod(message, context, call_next)


class ModChain:
    """A client's mods, applied per message type as described in the module docstring.

    Parameters
    ----------
    mods : sequence
        Flower mods in ``ClientApp(mods=...)`` order (the first is the outermost).
    extra_names : sequence of str
        Names of mods applied elsewhere (an app's own mods) to report as well.
    """

    def __init__(self, mods: Sequence[Any], extra_names: Sequence[str] = ()) -> None:
        self.mods = list(mods)
        self.names = [*extra_names, *(mod_name(m) for m in self.mods)]
        clips = any(n in _CLIPPING_MODS for n in self.names)
        self.training = [*self.mods, *([] if clips else [clip_as_asked])]
        self.other = [m for m in self.mods if not is_update_mod(m)]

    def for_type(self, message_type: str) -> list[Any]:
        """The mods of a route of ``message_type``, inside :func:`~flowerdro.client_errors.reply_errors`."""
        training = message_type == "train" or message_type.startswith("train.")
        return [reply_errors, *(self.training if training else self.other)]

    def call(self, message: Message, context: Context, dispatch: Callable[[Message, Context], Message]) -> Message:
        """``dispatch(message, context)`` through the mods of the message's type."""
        from flwr.client.mod.utils import make_ffn

        return make_ffn(dispatch, self.for_type(message.metadata.message_type))(message, context)

    def report(self, message: Message, reply: Message) -> Message:
        """Add the mods' names to a ``query.init`` reply (the server checks them at the roll call)."""
        if message.metadata.message_type == "query.init" and reply.has_content():
            reply.content[CLIENT_RECORD] = ConfigRecord({"mods": list(self.names)})
        return reply


class ReportMods:
    """A ``query.init`` handler that says which mods the client runs (see :meth:`ModChain.report`).

    A module-level class (not a closure), so a pickled ClientApp holds a reference to it.
    """

    def __init__(self, inner: Callable[[Message, Context], Message], chain: ModChain) -> None:
        self.inner, self.chain = inner, chain

    def __call__(self, message: Message, context: Context) -> Message:  # noqa: D102
        return self.chain.report(message, self.inner(message, context))
