"""The run-config key tables of README.md and docs/protocol.md are those the settings classes give."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("update_docs", ROOT / "scripts" / "update_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", ["README.md", "docs/protocol.md"])
def test_every_key_table_is_up_to_date(path):
    script = _script()
    text = (ROOT / path).read_text()
    assert script.BLOCK.search(text), f"{path} holds no generated key table"
    fresh = script.BLOCK.sub(lambda m: m.group(1) + script.table(m.group(2)) + m.group(4), text)
    assert fresh == text, f"{path}: a key table is stale; run python scripts/update_docs.py"
