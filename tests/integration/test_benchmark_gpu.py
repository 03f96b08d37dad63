"""scripts/benchmarks.py's ``gpu`` section runs on the CPU too, so CI exercises its code.

On a CUDA machine ``python scripts/benchmarks.py gpu --write-docs`` times the same code on
the GPU (docs/performance.md); here it runs with tiny settings on the CPU and its block must
name the device and list every path.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def benchmarks():
    spec = importlib.util.spec_from_file_location("benchmarks", ROOT / "scripts" / "benchmarks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("benchmarks", None)


@pytest.mark.data
def test_the_gpu_section_runs_on_the_cpu_and_writes_its_block(benchmarks, data_dir, tmp_path, monkeypatch):
    # Prepare: the docs page is a copy, so the real one is left alone
    docs = tmp_path / "performance.md"
    docs.write_text("# Performance\n\n## Notes\n")
    monkeypatch.setattr(benchmarks, "DOCS", docs)
    monkeypatch.setattr(benchmarks, "ROOT", tmp_path)
    # Execute: two clients, two rounds of two steps on 32 examples each, on the CPU
    rc = benchmarks.main(["gpu", "--device", "cpu", "--clients", "2", "--rounds", "2", "--reps", "1",
                          "--local-steps", "2", "--batch-size", "8", "--samples-per-client", "32",
                          "--test-fraction", "0.002", "--data-dir", str(data_dir), "--write-docs"])
    # Assert: one block, naming the CPU as the device, one row per path with its ratio to the plain loop
    assert rc == 0
    text = docs.read_text()
    block = re.search(r"<!-- bench:gpu -->\n(.*?)<!-- /bench -->", text, re.S)
    assert block, text
    body = block.group(1)
    assert "Device: CPU: " in body and "python scripts/benchmarks.py gpu --device cpu --clients 2" in body
    rows = {cells[1]: cells for line in body.splitlines()
            if (cells := [c.strip() for c in line.strip("|").split("|")])[0] == "2"}
    assert set(rows) == {"plain", "fedavg", "scaffold", "drfa"}
    assert float(rows["plain"][3]) == 1.0  # the plain loop is its own reference
    assert all(float(r[2]) > 0 and r[4] == "n/a" for r in rows.values())  # no device memory on the CPU
    assert text.index("<!-- bench:gpu -->") < text.index("## Notes")  # a new block goes before the notes


def test_rounds_below_two_are_refused(benchmarks):
    with pytest.raises(SystemExit):
        benchmarks.main(["gpu", "--rounds", "1"])
