"""Typed JSON for the server state: plain data as JSON, numpy values as arrays beside it.

A checkpoint holds dicts keyed by partition id (ints), numpy arrays of several dtypes,
lists and tuples of arrays, numpy scalars, ``None``, generator states with 128-bit
integers and the algorithms' own state dataclasses. JSON alone loses most of these
(int keys become strings, tuples lists, float32 scalars Python floats), and a pickle
keeps them only by running code named in the file when it is loaded. :func:`encode`
writes every value as JSON with a tag where JSON has no exact form, and puts each numpy
array or scalar into a separate mapping of arrays (saved in the checkpoint's ``.npz``,
read back with ``allow_pickle=False``); :func:`decode` gives back values equal in type,
dtype and bits.

The tree :func:`encode` returns is a JSON value in which

* ``None``, ``bool``, ``int`` (any size), ``float`` (NaN and ±inf included) and ``str``
  stand for themselves, and a JSON list for a Python list;
* every JSON object is a tag: ``{"@": "map", "items": {key: value, ...}}`` (a dict whose
  keys are all ``str``), ``{"@": "dict", "items": [[key, value], ...]}`` (keys of any
  other encodable type; order kept in both), ``{"@": "tuple" | "set" | "frozenset",
  "items": [...]}``,
  ``{"@": "array" | "scalar", "ref": name}`` (a numpy array, or a numpy scalar stored as
  a 0-d array, under ``name`` in the arrays), and ``{"@": "state", "type": name,
  "fields": {field: value, ...}}`` for a dataclass.

A dataclass is rebuilt only from the classes given to :func:`register_state`, looked up
by class name: nothing read from a file is ever imported or called. Anything else (an
object array, a class that is not registered, a field the class does not have) is
refused with an error naming where in the state it sits.

Written here rather than taken from a library: safetensors stores flat arrays only and
msgpack or JSON serialisers need the same per-type hooks for int keys, tuples, numpy
scalars and dataclasses; this module is those hooks and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = ["CodecError", "decode", "encode", "register_state", "registered_states"]

_TAG = "@"
#: Types written as themselves (JSON has an exact form for each).
_PLAIN = frozenset({type(None), bool, int, float, str})

#: Dataclasses a checkpoint may hold, by class name.
_STATES: dict[str, type] = {}


class CodecError(ValueError):
    """A value that cannot be written, or a tree that cannot be read, exactly."""


def register_state(*classes: type) -> type | None:
    """Allow instances of the dataclasses ``classes`` in a checkpoint (also a class decorator).

    A strategy whose ``self.state`` (or anything inside it) is a dataclass registers
    that class once, next to its definition (``@register_state`` above ``@dataclass``,
    as flowerdro's own algorithms do), so that importing the class registers it. The class is
    found again by its ``__name__``, which must therefore be unique among the registered
    classes.

    Raises
    ------
    TypeError
        A class is not a dataclass, or another class of the same name is registered.
    """
    for cls in classes:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"register_state: {cls!r} is not a dataclass")
        known = _STATES.get(cls.__name__)
        if known is not None and known is not cls:
            raise TypeError(f"register_state: {cls.__module__}.{cls.__qualname__} has the name of the "
                            f"registered {known.__module__}.{known.__qualname__}; rename one of them")
        _STATES[cls.__name__] = cls
    return classes[0] if len(classes) == 1 else None


def registered_states() -> dict[str, type]:
    """The registered state dataclasses, by name (a copy)."""
    return dict(_STATES)


def encode(value: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """``value`` as a JSON tree and the arrays it refers to (module docstring).

    Returns
    -------
    tree : JSON-serialisable value
        Write it with ``json.dumps`` (NaN and ±inf are written as ``NaN``/``Infinity``,
        which ``json.loads`` reads back).
    arrays : dict of str to numpy.ndarray
        ``"a0"``, ``"a1"``, … in the order the tree refers to them; none has dtype object.

    Raises
    ------
    CodecError
        A value of a type without an exact form (naming its place, e.g. ``state.lam``).
    """
    arrays: dict[str, np.ndarray] = {}
    return _encode(value, arrays, "state"), arrays


def decode(tree: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """The value :func:`encode` wrote as ``tree`` and ``arrays``.

    Raises
    ------
    CodecError
        A tag that is not one of the module's, a dataclass that is not registered or
        whose fields differ from the class's, a reference to a missing array.
    """
    return _decode(tree, arrays, "state")


# ---------------------------------------------------------------------------- writing
def _encode(value: Any, arrays: dict[str, np.ndarray], where: str) -> Any:
    # leaves that stand for themselves are returned before any path text is built (speed)
    if type(value) in _PLAIN:
        return value
    if type(value) is list:
        return [v if type(v) in _PLAIN else _encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value) is dict:
        if all(type(k) is str for k in value):
            return {_TAG: "map", "items": {k: v if type(v) in _PLAIN else _encode(v, arrays, f"{where}[{k!r}]")
                                           for k, v in value.items()}}
        return {_TAG: "dict", "items": [[_encode(k, arrays, f"{where} key {k!r}"),
                                         v if type(v) in _PLAIN else _encode(v, arrays, f"{where}[{k!r}]")]
                                        for k, v in value.items()]}
    if type(value) is tuple:
        return {_TAG: "tuple", "items": [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if type(value) in (set, frozenset):
        items = _sorted(value)
        return {_TAG: type(value).__name__, "items": [_encode(v, arrays, f"{where} item") for v in items]}
    if type(value) is np.ndarray or isinstance(value, np.generic):
        arr = np.asarray(value)
        if arr.dtype.hasobject:
            raise CodecError(f"{where}: an array of dtype {arr.dtype} cannot be stored without pickle")
        name = f"a{len(arrays)}"
        arrays[name] = arr
        return {_TAG: "array" if isinstance(value, np.ndarray) else "scalar", "ref": name}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if _STATES.get(cls.__name__) is not cls:
            raise CodecError(f"{where}: {cls.__module__}.{cls.__qualname__} is not a registered state class; "
                             "register it with flowerdro.runs.codec.register_state")
        names = [f.name for f in dataclasses.fields(value)]
        extra = sorted(set(getattr(value, "__dict__", {})) - set(names))
        if extra:
            raise CodecError(f"{where}: {cls.__name__} carries attributes that are not fields: {', '.join(extra)}")
        return {_TAG: "state", "type": cls.__name__,
                "fields": {n: _encode(getattr(value, n), arrays, f"{where}.{n}") for n in names}}
    raise CodecError(f"{where}: a value of type {type(value).__module__}.{type(value).__qualname__} has no "
                     "exact form in a checkpoint (allowed: None, bool, int, float, str, list, tuple, set, dict, "
                     "numpy arrays and scalars, registered dataclasses)")


def _sorted(items: Iterable[Any]) -> list[Any]:
    """A set's items in a fixed order (sorted when they compare, else by repr)."""
    items = list(items)
    try:
        return sorted(items)
    except TypeError:
        return sorted(items, key=repr)


# ---------------------------------------------------------------------------- reading
def _decode(tree: Any, arrays: Mapping[str, np.ndarray], where: str) -> Any:
    if type(tree) in _PLAIN:
        return tree
    if type(tree) is list:
        return [v if type(v) in _PLAIN else _decode(v, arrays, f"{where}[{i}]") for i, v in enumerate(tree)]
    if type(tree) is not dict or not isinstance(tree.get(_TAG), str):
        raise CodecError(f"{where}: expected a value or a tagged object, found {type(tree).__name__}")
    tag = tree[_TAG]
    if tag == "map":
        items = tree.get("items")
        if type(items) is not dict:
            raise CodecError(f"{where}: a map without its items")
        return {k: v if type(v) in _PLAIN else _decode(v, arrays, f"{where}[{k!r}]") for k, v in items.items()}
    if tag == "dict":
        pairs = _items(tree, where)
        out = {}
        for i, pair in enumerate(pairs):
            if type(pair) is not list or len(pair) != 2:
                raise CodecError(f"{where}: entry {i} of a dict is not a [key, value] pair")
            out[_decode(pair[0], arrays, f"{where} key {i}")] = _decode(pair[1], arrays, f"{where}[{i}]")
        return out
    if tag in ("tuple", "set", "frozenset"):
        items = [_decode(v, arrays, f"{where}[{i}]") for i, v in enumerate(_items(tree, where))]
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag in ("array", "scalar"):
        ref = tree.get("ref")
        if not isinstance(ref, str) or ref not in arrays:
            raise CodecError(f"{where}: refers to array {ref!r}, which the checkpoint does not hold")
        arr = arrays[ref]
        if tag == "scalar":
            if arr.ndim != 0:
                raise CodecError(f"{where}: scalar {ref!r} has shape {arr.shape}")
            return arr[()]
        return arr
    if tag == "state":
        name, fields = tree.get("type"), tree.get("fields")
        cls = _STATES.get(name) if isinstance(name, str) else None
        if cls is None:
            raise CodecError(f"{where}: state class {name!r} is not registered (registered: "
                             f"{', '.join(sorted(_STATES)) or 'none'})")
        if type(fields) is not dict:
            raise CodecError(f"{where}: {name} without its fields")
        expected = [f.name for f in dataclasses.fields(cls)]
        if sorted(fields) != sorted(expected):
            raise CodecError(f"{where}: {name} holds fields {sorted(fields)}; this code's {name} has {sorted(expected)}")
        obj = object.__new__(cls)
        for n in expected:  # as the class lists them; object.__setattr__ also sets frozen fields
            object.__setattr__(obj, n, _decode(fields[n], arrays, f"{where}.{n}"))
        return obj
    raise CodecError(f"{where}: unknown tag {tag!r} (known: map, dict, tuple, set, frozenset, array, scalar, state)")


def _items(tree: dict[str, Any], where: str) -> list[Any]:
    items = tree.get("items")
    if type(items) is not list:
        raise CodecError(f"{where}: a {tree[_TAG]} without its items")
    return items
