"""Typed settings: one frozen dataclass per concern, one reader for every run config.

Every group of settings (the round loop, the clients' local work, each algorithm) is a
frozen dataclass whose fields are declared with :func:`setting`: the default, the
run-config key (kebab-case of the field name unless given), a one-line meaning and the
allowed values (``choices``, or bounds ``ge``/``gt``/``le``/``lt``). The dataclass checks
itself when it is built (:meth:`Settings.__post_init__`), so a value is validated in
exactly one place whether it comes from a run config, a TOML file or Python code, and
the error names the run-config key and what is allowed::

    @dataclass(frozen=True)
    class DRFASettings(Settings):
        dual_lr: float = setting(0.01, "γ, the dual step size", gt=0)

    read_settings(DRFASettings, {"dual-lr": 0.05})     # DRFASettings(dual_lr=0.05)
    read_settings(DRFASettings, {"dual-lr": -1})       # ValueError: dual-lr: must be > 0, got -1.0

:func:`read_settings` turns run-config values (typed, or strings as ``--run-config``
and TOML files may give them) into field values; ``""`` means "unset" (the default).
:func:`check_known_keys` refuses a run config holding a key that no settings class
knows, naming the closest known key; :func:`check_near_misses` refuses only the keys that
look like a misspelt known key (a user's run config also holds the project's own keys).
:func:`describe` lists a class's keys, types,
defaults and meanings for the documentation and for the checks that keep
``pyproject.toml`` and the docs in line with the code.

A field may also be declared a *strength knob* (``knob=Knob(low, high, "log")``): the
setting that says how strongly an algorithm favours its worst clients (q of q-FFL, DRFA's
dual step γ, FedMGDA+'s ε, …), with the range a search over it should cover.
:func:`knobs` lists them; the tuning advisor (:mod:`flowerdro.advise`) reads them, so an
algorithm brings its own search space.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

__all__ = [
    "Knob",
    "Settings",
    "SettingInfo",
    "check_known_keys",
    "check_near_misses",
    "describe",
    "knobs",
    "known_keys",
    "near_miss",
    "read_settings",
    "setting",
]

S = TypeVar("S", bound="Settings")

#: Scales of a strength knob: ``log`` (a search draws log(value) uniformly) or ``linear``.
KNOB_SCALES: tuple[str, ...] = ("log", "linear")


@dataclasses.dataclass(frozen=True)
class Knob:
    """The range of a strength knob: the values a search over the setting should try.

    Parameters
    ----------
    low, high : float
        The ends of the range, ``low < high``, both inside what the setting accepts (a
        test builds every strategy at the corners of its knobs' ranges).
    scale : {"log", "linear"} (default: "log")
        How a search spreads its draws: uniformly in log(value) (``low > 0``) for a
        setting that matters by its order of magnitude, or uniformly in the value.
    """

    low: float
    high: float
    scale: str = "log"

    def __post_init__(self) -> None:
        if self.scale not in KNOB_SCALES:
            raise ValueError(f"knob scale: unknown scale {self.scale!r}; allowed: {', '.join(KNOB_SCALES)}")
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"knob range: expected finite low < high, got [{self.low}, {self.high}]")
        if self.scale == "log" and self.low <= 0:
            raise ValueError(f"knob range: a log-scale knob needs low > 0, got {self.low}")

    @property
    def log(self) -> bool:
        """Whether draws are uniform in log(value)."""
        return self.scale == "log"

    def __str__(self) -> str:
        return f"[{self.low:g}, {self.high:g}] ({self.scale})"


def setting(
    default: Any,
    meaning: str,
    *,
    key: str | None = None,
    choices: tuple[Any, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    forms: str | None = None,
    knob: Knob | None = None,
) -> Any:
    """A dataclass field with its run-config key, meaning and allowed values.

    Parameters
    ----------
    default : Any
        The value when the run config does not set the key (``None``: "unset"/"auto",
        the field's meaning says what that means).
    meaning : str
        One line for the documentation, with the paper's symbol where there is one.
    key : str, optional
        The run-config key (default: the field name with ``_`` replaced by ``-``).
    choices : tuple, optional
        The allowed values (strings, usually).
    ge, gt, le, lt : float, optional
        Bounds on a number (≥, >, ≤, <).
    forms : str, optional
        The allowed values in words, for the documentation, where neither ``choices`` nor
        bounds can say them (e.g. ``"auto, cpu, cuda, cuda:N"``); the class's ``check()``
        enforces them.
    knob : Knob, optional
        Declares the field a strength knob of its algorithm, with the range a search over
        it covers (a float field; see :func:`knobs`).
    """
    if knob is not None and not isinstance(knob, Knob):
        raise TypeError(f"setting: knob must be a Knob, got {type(knob).__name__}")
    meta = {"meaning": meaning, "key": key, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt,
            "forms": forms, "knob": knob}
    if isinstance(default, list | dict | set):
        raise TypeError("setting: mutable defaults are not allowed; use a tuple")
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class SettingInfo:
    """What :func:`describe` says about one field: key, type, default, meaning, allowed values."""

    name: str
    key: str
    type: str
    default: Any
    meaning: str
    allowed: str


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base of every settings dataclass: validates its fields when built.

    Subclasses declare their fields with :func:`setting` and may add cross-field checks
    in ``check()`` (raise ``ValueError`` naming the keys).
    """

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(f, hints[f.name], getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Checks that involve several fields (none by default)."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The run-config keys of this class, in field order."""
        return tuple(_key(f) for f in dataclasses.fields(cls))

    def to_config(self) -> dict[str, Any]:
        """The settings as run-config items ``{key: value}`` (``None`` values left out)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[_key(f)] = list(value) if isinstance(value, tuple) else value
        return out


def read_settings(cls: type[S], config: Mapping[str, Any], **fixed: Any) -> S:
    """Build ``cls`` from a run config; ``fixed`` fields are set by the caller, never read.

    A key that is absent, ``None`` or ``""`` takes the field's default. ``fixed`` holds
    the values that define a variant of an algorithm (AFL is DRFA with τ = 1): the run
    config cannot change them.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"run config: expected a mapping of keys to values, got {type(config).__name__}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            continue
        value = config.get(_key(f))
        if value is not None and value != "":
            kwargs[f.name] = value
    unknown = set(fixed) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"read_settings: {cls.__name__} has no fields {sorted(unknown)}")
    return cls(**kwargs, **fixed)


def known_keys(classes: Iterable[type[Settings]]) -> set[str]:
    """The union of the run-config keys of ``classes``."""
    return {k for c in classes for k in c.keys()}


def check_known_keys(config: Mapping[str, Any], known: Iterable[str], *, where: str = "run config") -> None:
    """Refuse keys of ``config`` that no settings class knows, naming the closest known key."""
    known = set(known)
    bad = [k for k in config if k not in known]
    if not bad:
        return
    parts = []
    for k in sorted(bad):
        close = difflib.get_close_matches(k.replace("_", "-"), sorted(known), n=1, cutoff=0.6)
        parts.append(f"'{k}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    raise ValueError(f"{where}: unknown key{'s' if len(bad) > 1 else ''} {', '.join(parts)}")


def knobs(cls: type[Settings], *, exclude: Iterable[str] = ()) -> dict[str, Knob]:
    """The strength knobs of ``cls``: run-config key → :class:`Knob`, in field order.

    ``exclude`` names fields left out (those a registry entry fixes: FedAvg-n is FedMGDA+
    with ε = 0, so it has no ε to tune).
    """
    skip, hints, out = set(exclude), _hints(cls), {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("knob") is None or f.name in skip:
            continue
        tp = hints[f.name]
        if _is_optional(tp):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if tp is not float:
            raise TypeError(f"{cls.__name__}.{f.name}: a strength knob must be a float setting, got {_type_name(tp)}")
        out[_key(f)] = f.metadata["knob"]
    return out


def near_miss(key: str, known: Iterable[str]) -> str | None:
    """The known key that ``key`` looks like a misspelling of, or None.

    ``key`` is compared with each known key after lower-casing and writing ``_`` as ``-``
    (``dual_lr``, ``Dual-LR`` → ``dual-lr``), by the optimal-string-alignment edit
    distance d (insertions, deletions, substitutions and swaps of two neighbouring
    characters count 1 each). With m the length of the shorter of the two, ``key`` is a
    near miss when d ≤ 0 for m ≤ 4, d ≤ 1 for m ≤ 11 and d ≤ 2 for longer keys: one
    slip in a word (``dual-lrr``, ``lcoal-steps``, ``num-round``), two in a long one,
    while short words a project may well use (``mode``, ``seeds``) and keys that differ
    in a whole word (``strategy`` vs ``strategies``, ``fraction-fit`` vs
    ``fraction-train``, ``num-server-rounds`` vs ``num-rounds``) stay apart. A known key
    itself is no near miss.

    Parameters
    ----------
    key : str
        A run-config key.
    known : iterable of str
        The known keys (kebab-case).

    Returns
    -------
    str or None
        The closest known key within the allowed distance (ties: the first in sorted
        order), or None.

    Examples
    --------
    >>> near_miss("lcoal-steps", ["local-steps", "lr"]), near_miss("strategy", ["strategies"])
    ('local-steps', None)
    """
    known = sorted(set(known))
    if key in known:
        return None
    norm = key.strip().lower().replace("_", "-")
    best: tuple[int, str] | None = None
    for k in known:
        shorter = min(len(norm), len(k))
        allowed = 0 if shorter <= 4 else 1 if shorter <= 11 else 2
        if abs(len(norm) - len(k)) > allowed:
            continue
        d = _osa_distance(norm, k)
        if d <= allowed and (best is None or d < best[0]):
            best = (d, k)
    return None if best is None else best[1]


def check_near_misses(config: Mapping[str, Any], known: Iterable[str], *, own: Iterable[str] = (),
                      where: str = "run config") -> None:
    """Refuse keys of ``config`` that look like a misspelt known key (:func:`near_miss`).

    Keys that are known, or far from every known key (the project's own keys), pass;
    ``own`` lists keys that pass even though they are near one (the project's own keys
    that happen to look like a flowerdro key).

    Raises
    ------
    ValueError
        Naming each near miss, the key it looks like, and the escape (``own_keys``); or
        when ``own`` names a known key (flowerdro reads it, so it cannot be the project's own).
    """
    known = set(known)
    own = set(own)
    if taken := sorted(own & known):
        raise ValueError(f"own_keys: {', '.join(map(repr, taken))} {'are' if len(taken) > 1 else 'is a'} "
                         f"flowerdro key{'s' if len(taken) > 1 else ''}; flowerdro reads "
                         f"{'them' if len(taken) > 1 else 'it'} from the run config, so "
                         f"{'they' if len(taken) > 1 else 'it'} cannot be your project's own")
    misses = [(k, near) for k in sorted(map(str, config)) if k not in own and (near := near_miss(k, known))]
    if not misses:
        return
    names = ", ".join(f"'{k}' (did you mean '{near}'?)" for k, near in misses)
    mine = ", ".join(repr(k) for k, _ in misses)
    raise ValueError(f"{where}: {names}: not a flowerdro key but close to one, so flowerdro would not read it "
                     f"(the key it looks like keeps its own value or default). Fix the spelling, or, if "
                     f"{'these are' if len(misses) > 1 else 'it is'} your project's own, pass "
                     f"own_keys=({mine},) to build_strategy / LegacyStrategy")


def _osa_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: edits, and swaps of neighbours, that turn ``a`` into ``b``.

    A dynamic programme over two rows plus the one before (Wagner-Fischer with the
    transposition case); run-config keys are short, and the standard library's difflib
    has ratios, not edit distances.
    """
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[len(b)]


def describe(cls: type[Settings]) -> list[SettingInfo]:
    """Key, type, default, meaning and allowed values of every field of ``cls``."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        m = f.metadata
        bounds = [f"{op} {m[name]:g}" for name, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                  if m.get(name) is not None]
        allowed = ", ".join(map(str, m["choices"])) if m.get("choices") else m.get("forms") or " and ".join(bounds)
        out.append(SettingInfo(f.name, _key(f), _type_name(hints[f.name]), f.default, m.get("meaning", ""), allowed))
    return out


# --------------------------------------------------------------------------- internals
def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name.replace("_", "-")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if _is_optional(tp):
        return f"{_type_name(next(a for a in args if a is not type(None)))} or unset"
    if typing.get_origin(tp) is tuple:
        return f"list of {args[0].__name__}"
    return getattr(tp, "__name__", str(tp))


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _coerce(f: dataclasses.Field, tp: Any, value: Any) -> Any:
    """``value`` as the field's type, checked against its choices and bounds."""
    key = _key(f)
    if _is_optional(tp):
        if value is None or value == "":
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is tuple:
        out = _as_tuple(key, typing.get_args(tp)[0], value)
        for item in out:
            _check(f, key, item)
        return out
    if tp is bool:
        return _as_bool(key, value)
    if tp is int:
        return _check(f, key, _as_int(key, value))
    if tp is float:
        return _check(f, key, _as_float(key, value))
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return _check(f, key, value)
    raise TypeError(f"{key}: unsupported settings type {tp!r}")


def _check(f: dataclasses.Field, key: str, value: Any) -> Any:
    m = f.metadata
    choices = m.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{key}: unknown value {value!r}; allowed: {', '.join(map(str, choices))}")
    for name, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                           ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        bound = m.get(name)
        if bound is not None and not ok(value, bound):
            raise ValueError(f"{key}: must be {word} {bound:g}, got {value!r}")
    return value


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{key}: expected true or false, got {value!r}")


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected an integer, got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    return int(number)


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return number


def _as_tuple(key: str, item: type, value: Any) -> tuple[Any, ...]:
    if isinstance(value, tuple | list):
        items = list(value)
    elif isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    else:
        items = [value]
    convert = {int: _as_int, float: _as_float, str: lambda _k, v: str(v)}[item]
    try:
        return tuple(convert(key, v) for v in items)
    except ValueError:
        raise ValueError(f"{key}: expected a comma-separated list of {item.__name__}, got {value!r}") from None


def unset(config: Mapping[str, Any], key: str) -> bool:
    """Whether ``key`` is absent from ``config`` or set to the "unset" values ``None`` / ``""``."""
    value = config.get(key)
    return value is None or value == ""
