"""A run's identity: everything that shapes its result, recorded and compared by key.

:func:`run_identity` describes a run as one flat mapping of run-config keys to values:

* ``strategy``, the algorithm's own settings, the round loop's (sampling, evaluation,
  ``seed``) and the clients' local training (``lr``, ``local-steps``, …), as the strategy
  holds them (the values a registry entry fixes included, e.g. AFL's τ = 1);
* given the run config: the data set and its parameters, the partition and its
  parameters, ``data-seed``, the validation split (:class:`~flowerdro.data.DataConfig`;
  ``num-partitions`` as the run config gives it, unset when the nodes' config decides),
  the model and the attack (:class:`~flowerdro.protocol.NodeSettings`), central DP
  (:class:`~flowerdro.privacy.PrivacySettings`), and each of the project's own run-config
  keys (a key no flowerdro settings class declares) as ``own:<key>`` with the SHA-256 of
  its value (the value itself is not written: it may be a path or a secret);
* ``flowerdro-version`` and ``flwr-version``.

Which run-config keys flowerdro knows, and which settings classes beyond the data's and the
nodes' shape a result, are the registry's knowledge (it sits above the run folders):
:func:`~flowerdro.strategies.registry.strategy_identity` hands them to :func:`run_identity`.

What a run's *plan* or *operation* is, not its result, is left out: ``num-rounds`` (its
own rule, :func:`~flowerdro.runs.output.check_plan`), ``output-dir``, ``resume``,
``overwrite``, ``extend``, ``round-timeout``, the trackers and observers,
``checkpoint-every``, ``max-failed-rounds`` and ``min-available-nodes``.

:func:`compare_identities` sorts the keys in which two identities differ:

* **refused**: any key of the result, and a version whose major.minor differs
  (flowerdro's algorithms and defaults, and Flower's own strategies and message
  handling, may change between minor releases);
* **warned**: where the clients compute and with how many threads (``device``,
  ``threads``: the same algorithm on the same data, its floating-point sums possibly in
  another order), where the data files lie (``data-dir``: the same data set elsewhere),
  and a version whose major.minor is the same (a patch release fixes bugs without
  changing what a setting means).

A key one identity has and the other lacks is refused, unless flowerdro's version
differs (a newer flowerdro records settings an older one did not have): then warned.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from flowerdro.runs.records import json_default
from flowerdro.settings import Settings, read_settings

if TYPE_CHECKING:
    from flowerdro.strategies.base import FairStrategy

__all__ = ["ENVIRONMENT_KEYS", "LEFT_OUT", "VERSION_KEYS", "Difference", "RunIdentityError", "compare_identities",
           "describe_differences", "run_identity", "versions"]

#: Keys that say where and how the run computed, not what: a change is warned, never refused.
ENVIRONMENT_KEYS: tuple[str, ...] = ("device", "threads", "data-dir")
#: Version keys: refused when major.minor differs, warned otherwise.
VERSION_KEYS: tuple[str, ...] = ("flowerdro-version", "flwr-version")
#: Settings of the round loop that do not shape the result (how often to save, when to give up, whom to wait for).
LEFT_OUT: tuple[str, ...] = ("checkpoint-every", "max-failed-rounds", "min-available-nodes")
#: Prefix of the project's own run-config keys.
OWN = "own:"

_MISSING = object()


class RunIdentityError(ValueError):
    """A resume (or a run into a folder) whose settings differ from the run's; the message names every key."""


@dataclass(frozen=True)
class Difference:
    """One key in which two identities differ: the recorded value, the current one (``None`` when absent)."""

    key: str
    recorded: Any
    current: Any
    recorded_has: bool = True
    current_has: bool = True

    def text(self, recorded: str = "in the run", current: str = "now") -> str:
        """``key: <recorded> in the run, <current> now`` (``not recorded`` for an absent key)."""
        old = _show(self.recorded) if self.recorded_has else "not recorded"
        new = _show(self.current) if self.current_has else "not set"
        return f"{self.key}: {old} {recorded}, {new} {current}"


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def versions() -> dict[str, str]:
    """``flowerdro-version`` and ``flwr-version`` of this process."""
    import flwr

    import flowerdro

    return {"flowerdro-version": str(flowerdro.__version__), "flwr-version": str(getattr(flwr, "__version__", "?"))}


def _jsonable(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples as lists, numpy numbers as Python numbers)."""
    return json.loads(json.dumps(value, default=json_default))


def _settings_items(obj: Any) -> dict[str, Any]:
    """A settings dataclass as ``{run-config key: value}`` (``None`` kept: it means "unset")."""
    out = {}
    for f in fields(obj):
        key = f.metadata.get("key") or f.name.replace("_", "-")
        out[key] = getattr(obj, f.name)
    return out


def own_key_digest(value: Any) -> str:
    """``sha256:<hex>`` of a run-config value as JSON (sorted keys), the form the identity records."""
    text = json.dumps(_jsonable(value), sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def run_identity(strategy: FairStrategy, run_config: Mapping[str, Any] | None = None, *,
                 algorithm: str | None = None, known_keys: Collection[str] | None = None,
                 settings_classes: Sequence[type[Settings]] = ()) -> dict[str, Any]:
    """Everything that shapes ``strategy``'s run, as ``{run-config key: value}`` (module docstring).

    Parameters
    ----------
    strategy : FairStrategy
        The run's strategy (its ``config``, ``loop``, ``training`` and ``attack``).
    run_config : Mapping, optional
        The run config the strategy was built from: adds the data, the model, the values
        of ``settings_classes`` and the project's own keys. Without it (a strategy built in
        Python and given a :class:`~flowerdro.runs.output.RunWriter` by hand) the identity
        holds what the strategy knows.
    algorithm : str, optional
        The registered name the strategy was built under (``afl`` is a DRFA); default:
        the strategy's ``name``.
    known_keys : collection of str, optional
        Every run-config key a flowerdro settings class declares; any other key of
        ``run_config`` is the project's own (``own:<key>``). Required with ``run_config``.
    settings_classes : sequence of Settings subclasses
        Settings read from ``run_config`` whose values shape the result besides the data's
        and the nodes' (central DP's :class:`~flowerdro.privacy.PrivacySettings`).

    Raises
    ------
    ValueError
        A value of the run config that its settings class refuses (naming the key).
    TypeError
        ``run_config`` without ``known_keys``.
    """
    out: dict[str, Any] = {"strategy": algorithm or strategy.name}
    for obj in (strategy.config, strategy.loop, strategy.training):
        out.update({k: v for k, v in _settings_items(obj).items() if k not in LEFT_OUT})
    attack = {k.replace("_", "-"): v for k, v in getattr(strategy, "attack", {}).items()}
    if run_config is not None:
        if known_keys is None:
            raise TypeError("run_identity: known_keys is required with a run config (without it every key would "
                            "count as the project's own); strategies.registry.strategy_identity passes it")
        from flowerdro.protocol import NodeSettings
        from flowerdro.validation import data_config

        data = data_config(run_config)
        extra = _settings_items(data)
        extra["num-partitions"] = run_config.get("num-partitions") if run_config.get("num-partitions") != "" else None
        extra.update(_settings_items(read_settings(NodeSettings, run_config)))
        for cls in settings_classes:
            extra.update(_settings_items(read_settings(cls, run_config)))
        for key, value in extra.items():
            out.setdefault(key, value)
        for key in sorted(k for k in run_config if k not in known_keys):
            out[OWN + str(key)] = own_key_digest(run_config[key])
    else:
        out.update({k: v for k, v in attack.items() if k not in out})
    out.update(versions())
    return _jsonable(out)


def _minor(version: Any) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def compare_identities(recorded: Mapping[str, Any], current: Mapping[str, Any]
                       ) -> tuple[list[Difference], list[Difference]]:
    """The keys in which ``current`` differs from ``recorded``: (refused, warned) (module docstring).

    Returns
    -------
    refused, warned : list of Difference
        Sorted by key.
    """
    refused: list[Difference] = []
    warned: list[Difference] = []
    newer = recorded.get("flowerdro-version") != current.get("flowerdro-version")
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key, _MISSING), current.get(key, _MISSING)
        if old == new:
            continue
        diff = Difference(key, None if old is _MISSING else old, None if new is _MISSING else new,
                          old is not _MISSING, new is not _MISSING)
        if key in ENVIRONMENT_KEYS:
            warned.append(diff)
        elif key in VERSION_KEYS:
            same = _minor(old) is not None and _minor(old) == _minor(new)
            (warned if same else refused).append(diff)
        elif (old is _MISSING or new is _MISSING) and newer:
            warned.append(diff)
        else:
            refused.append(diff)
    return refused, warned


def describe_differences(diffs: list[Difference], recorded: str = "in the run", current: str = "now") -> str:
    """The differences one per line (indented), e.g. ``  data-seed: 0 in the run, 1 now``."""
    return "\n".join("  " + d.text(recorded, current) for d in diffs)
