"""The round records as lines of ``rounds.jsonl``: JSON of numpy values, large per-client mappings compacted.

A run's :class:`~flowerdro.runs.output.RunWriter` writes one :func:`record_line` per
round; every reader of ``rounds.jsonl`` (:func:`flowerdro.runs.results.load_records`, a
resumed run's finished records, the trackers) turns a line back with
:func:`expand_record`. :func:`json_default` is the one JSON form of numpy scalars and
arrays in a run's files (its settings and identity too).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__ = ["COMPACT_MIN", "compact_record", "expand_record", "json_default", "record_line"]


def json_default(obj: Any) -> Any:
    """JSON for numpy scalars and arrays (and ``str`` for anything else)."""
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


#: A per-client mapping of at least this many entries is written as a compact array.
COMPACT_MIN = 1000
_IDS, _VALUES = "__client_ids__", "__client_values__"


def compact_record(record: dict[str, Any], min_entries: int = COMPACT_MIN) -> dict[str, Any]:
    """``record`` with each large per-client mapping ``{"<id>": number}`` as two arrays.

    A top-level value that maps at least ``min_entries`` integer strings to numbers (λ over
    10,000 clients, per-client accuracies) becomes ``{"__client_ids__": ids, "__client_values__":
    values}``, with ``ids = [start, stop]`` when the ids are ``start, …, stop − 1`` in order
    (the usual case), else the list of ids. :func:`expand_record` gives the mapping back.
    """
    out = {}
    for key, value in record.items():
        if (isinstance(value, dict) and len(value) >= min_entries
                and all(isinstance(k, str) and k.lstrip("-").isdigit() for k in value)
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values())):
            ids = [int(k) for k in value]
            dense = ids == list(range(ids[0], ids[0] + len(ids)))
            out[key] = {_IDS: [ids[0], ids[0] + len(ids)] if dense else ids, _VALUES: list(value.values())}
        else:
            out[key] = value
    return out


def expand_record(record: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`compact_record` (records without compact arrays come back unchanged)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict) and _IDS in value and _VALUES in value:
            ids, values = value[_IDS], value[_VALUES]
            if len(ids) == 2 and len(values) != 2:
                ids = range(ids[0], ids[1])
            out[key] = {str(i): v for i, v in zip(ids, values, strict=True)}
        else:
            out[key] = value
    return out


def record_line(record: dict[str, Any]) -> str:
    """One ``rounds.jsonl`` line: the compact record as JSON."""
    return json.dumps(compact_record(record), default=json_default) + "\n"
