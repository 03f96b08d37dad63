"""What a strategy's log says about its settings, checked against what its messages carry.

:func:`settings_lines` renders the settings as a small tree, one branch per group (the
algorithm's, the round loop's, the clients' local training, the attack), the ``key=value``
pairs wrapped. The local-training values are the defaults of every training message:
a ``train_config`` passed to ``start`` (or the config another loop hands to
``configure_train``) and the algorithm itself may set others (SCAFFOLD sends its own η_l
and τ whatever the caller asks; DRFA sends τ steps, never epochs). So
:func:`sent_training_note` compares the first training message with the settings and
names every value the clients get instead, with where it came from.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from flwr.app import Message

__all__ = ["sent_training_note", "settings_lines"]

#: Width of a wrapped line of ``key=value`` pairs.
WIDTH = 96


def _pairs(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def settings_lines(strategy: Any) -> list[str]:
    """The settings tree of ``strategy`` (``config``, ``loop``, ``training``, ``attack``), one line per entry."""
    groups = [("algorithm", strategy.config), ("round loop", strategy.loop),
              ("clients' local training (every training message, unless noted at round 1)", strategy.training)]
    branches = [(title, {f.name: getattr(obj, f.name) for f in fields(obj)}) for title, obj in groups]
    if strategy.attack:
        branches.append(("attack", dict(strategy.attack)))
    branches = [(t, v) for t, v in branches if v]
    lines = [f"├──> {strategy.run_name} settings ({strategy.name}):"]
    for i, (title, values) in enumerate(branches):
        last = i == len(branches) - 1
        lines.append(f"│\t{'└' if last else '├'}── {title}:")
        for chunk in textwrap.wrap(_pairs(values), WIDTH):
            lines.append(f"│\t{' ' if last else '│'}     {chunk}")
    return lines


def _differs(sent: Any, own: Any) -> bool:
    try:
        return float(sent) != float(own)
    except (TypeError, ValueError):
        return str(sent) != str(own)


def sent_training_note(strategy: Any, messages: Iterable[Message], caller_config: Mapping[str, Any]) -> str | None:
    """Where the first training message's local-training values are not the settings', say so (else None).

    Each value the message carries instead of the setting is named with its source: the
    ``config`` the caller handed to ``configure_train`` (a ``train_config`` passed to
    ``start``) when it holds that value, else the algorithm itself; a caller's value the
    algorithm overrides (SCAFFOLD's η_l) is named as not used, and a setting the message
    leaves out as not sent.
    """
    first = next(iter(messages), None)
    if first is None or not first.has_content() or "config" not in first.content.config_records:
        return None
    sent = first.content.config_records["config"]
    notes = []
    for key, own in strategy.training.to_config().items():
        asked = caller_config.get(key)
        if key not in sent:
            if own not in (0, 0.0, None, ""):
                notes.append(f"no {key} ({strategy.name} does not use it; the setting says {own})")
        elif asked is not None and _differs(asked, sent[key]):
            notes.append(f"{key} = {sent[key]} ({strategy.name}'s own; the train config passed to the strategy "
                         f"asks for {asked}, which is not used)")
        elif _differs(sent[key], own):
            source = "the train config passed to the strategy" if asked is not None else f"{strategy.name}'s own"
            notes.append(f"{key} = {sent[key]} ({source}; the setting says {own})")
    if not notes:
        return None
    return f"[{strategy.run_name}] the training messages carry " + "; ".join(notes)
