"""The package keeps its shape: no import circle, no import up the layers, small classes and modules.

Measured from the source with ``scripts/house.py`` (the standard library's ``ast``; nothing
is imported), which prints the same figures: ``python scripts/house.py``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "house.py"


def _house():
    spec = importlib.util.spec_from_file_location("house", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("house", module)
    spec.loader.exec_module(module)
    return module


def test_no_import_circle_between_modules_or_rooms():
    house = _house()
    modules = house.read_package()
    assert house.circles(house.edges(modules)) == []
    assert house.circles(house.room_edges(modules)) == []


def test_every_import_runs_down_the_layers():
    house = _house()
    modules = house.read_package()
    assert house.unlayered(modules) == []
    assert house.upward(modules) == []


def test_the_architecture_docs_layer_table_is_the_one_measured():
    """docs/architecture.md's table of layers names the rooms of :data:`LAYERS`, layer by layer."""
    house = _house()
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.MULTILINE)
    table = tuple(tuple(re.findall(r"`([a-z_]+)(?:/|\.py)`", rooms)) for _, rooms in rows)
    assert [int(n) for n, _ in rows] == list(range(1, len(house.LAYERS) + 1))
    assert table == house.LAYERS


def test_classes_and_modules_stay_small():
    house = _house()
    over = set()
    for mod in house.read_package().values():
        if mod.lines > house.MAX_MODULE_LINES:
            over.add(f"module {mod.name}")
        over |= {f"class {mod.name}.{c}" for c, n in mod.classes.items() if n > house.MAX_CLASS_LINES}
    assert over == set(), sorted(over)


def test_the_reader_sees_imports_inside_functions_and_leaves_type_checking_out(tmp_path):
    """A circle made by an import inside a function counts; one made only for annotations does not."""
    house = _house()
    pkg = tmp_path / house.PACKAGE
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from flowerdro.low.a import f\n")
    (pkg / "low" / "a.py").write_text("def f():\n    from flowerdro.high import g\n")
    (pkg / "high.py").write_text("from flowerdro.low import f\n")
    (pkg / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flowerdro import high\n")
    modules = house.read_package(tmp_path)
    assert house.circles(house.edges(modules)) == [["flowerdro.high", "flowerdro.low.a"]]
    assert modules["flowerdro.typed"].imports == set()
