#!/usr/bin/env python3
"""Regenerate the run-config key tables of README.md and docs/protocol.md from the settings classes.

The ``privacy-composition`` block is the table of which strategy composes with which of
Flower's privacy pieces, from the declarations that tests/integration/test_privacy_matrix.py
checks by running every pair.

Each table sits between ``<!-- keys:NAME -->`` and ``<!-- /keys -->``; NAME is a group of
:func:`flowerdro.strategies.registry.settings_groups` (run, loop, clients, data), the name of a
registered strategy (its own settings), ``advise`` (the advisor file's ``[advise]`` table) or
``knobs`` (every strategy's strength knobs). ``--check`` exits 1 when a table is out of date
(the test suite runs it), without writing.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = (ROOT / "README.md", ROOT / "docs" / "protocol.md")
BLOCK = re.compile(r"(<!-- keys:([a-z0-9+-]+) -->\n)(.*?)(<!-- /keys -->)", re.S)


def table(name: str) -> str:
    """The markdown table of the keys of group or strategy ``name`` (``privacy-composition``: who composes)."""
    if name == "privacy-composition":
        from flowerdro.strategies.registry import composition_table

        return composition_table()
    from flowerdro.settings import describe
    from flowerdro.strategies.registry import ALGORITHMS, settings_groups

    if name == "knobs":
        return knob_table()
    groups = settings_groups()
    if name == "advise":
        from flowerdro.advise.config import AdviseSettings

        groups["advise"] = [AdviseSettings]
    classes = groups[name] if name in groups else [ALGORITHMS[name].strategy.settings_class]
    rows = ["| key | meaning | default | allowed |", "|---|---|---|---|"]
    for cls in classes:
        for info in describe(cls):
            default = "unset" if info.default is None else (
                ",".join(map(str, info.default)) if isinstance(info.default, tuple) else info.default)
            default = '""' if default == "" else default
            allowed = info.allowed or info.type
            if allowed.startswith(", "):  # an empty choice: "" (off)
                allowed = '"" (off)' + allowed
            rows.append(f"| `{info.key}` | {info.meaning} | `{default}` | {allowed} |")
    return "\n".join(rows) + "\n"


def knob_table() -> str:
    """The strength knobs of every registered strategy: its key, meaning, range and scale."""
    from flowerdro.settings import describe
    from flowerdro.strategies.registry import ALGORITHMS, strength_knobs

    rows = ["| strategy | knob | meaning | range | scale |", "|---|---|---|---|---|"]
    for name in ALGORITHMS:
        meaning = {i.key: i.meaning for i in describe(ALGORITHMS[name].strategy.settings_class)}
        knobs = strength_knobs(name)
        if not knobs:
            rows.append(f"| `{name}` | – | no strength knob | | |")
        for key, knob in knobs.items():
            rows.append(f"| `{name}` | `{key}` | {meaning[key]} | {knob.low:g} … {knob.high:g} | {knob.scale} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="only report tables that are out of date")
    args = ap.parse_args()
    stale = []
    for path in FILES:
        text = path.read_text()
        new = BLOCK.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(4), text)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    if stale:
        print(("out of date: " if args.check else "updated: ") + ", ".join(map(str, stale)))
    return 1 if (stale and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
