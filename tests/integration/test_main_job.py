"""The README's main-job table is what the main job prints.

``bash scripts/run.sh`` runs ``flwr run .`` with the defaults of ``[tool.flwr.app.config]``
on 20 simulated clients, seed 0. Nodes are sampled in partition order and clients use one
torch thread, so the in-process runner gives the same records for the same config; this
test runs that config in-process and compares its table with the one between the README's
``main-job-table`` markers: digit for digit for every strategy but SCAFF-PD, whose row
depends on the CPU's float32 kernels (README, "Two commands": its λ step amplifies the
last-bit differences between MKL's and torch's kernels on different CPUs), and for SCAFF-PD
what holds on every CPU tried: its worst-20% and mean accuracy above FedAvg's. It also
checks that ``conf/main_job.toml`` (the three-seed version on the results page) runs the
same setting.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from flowerdro.experiments import run
from flowerdro.runs import RunSettings
from flowerdro.settings import describe

ROOT = Path(__file__).resolve().parents[2]
#: `scripts/run.sh` starts this many simulated SuperNodes, one partition each.
NUM_SUPERNODES = 20


def _app_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def _main_job() -> dict:
    """The runner config equivalent to `bash scripts/run.sh` (seed 0)."""
    app = _app_config()
    run_keys = {info.key for info in describe(RunSettings)}
    run_config = {k: v for k, v in app.items() if k not in run_keys and k != "seed" and v != ""}
    # the README's table is CPU arithmetic; on a CUDA machine device "auto" would move its last digits
    run_config["device"] = "cpu"
    return {
        "name": "main_job_readme",
        "num-rounds": int(app["num-rounds"]),
        "seeds": [int(app["seed"])],
        "num-partitions": NUM_SUPERNODES,
        "strategies": [s.strip() for s in str(app["strategies"]).split(",")],
        "run-config": run_config,
    }


def _readme_table() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- main-job-table -->\n(.*?)<!-- /main-job-table -->", text, re.S)
    assert match, "README.md: the main-job-table markers are missing"
    return match.group(1).strip()


#: Strategies whose seed-0 row moves with the CPU's float32 kernels (README, "Two commands").
KERNEL_SENSITIVE = ("scaffpd",)


def _rows(table: str) -> dict[str, list[str]]:
    """The table's cells by strategy (header and rule lines left out)."""
    lines = [line.strip().strip("|").split("|") for line in table.strip().splitlines()[2:]]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in lines}


def test_readme_table_is_what_the_main_job_prints():
    result = run(_main_job(), output_root=None, verbose=False)
    ours, readme = _rows(result.table), _rows(_readme_table())
    assert result.table.strip().splitlines()[:2] == _readme_table().splitlines()[:2]  # same columns
    assert list(ours) == list(readme)
    for name in ours:
        if name not in KERNEL_SENSITIVE:
            assert ours[name] == readme[name], name
    # SCAFF-PD on every CPU tried: worst-20% (column 4) and mean accuracy (column 1) above FedAvg's
    for name in KERNEL_SENSITIVE:
        assert float(ours[name][3]) > float(ours["fedavg"][3]), ours[name]
        assert float(ours[name][0]) > float(ours["fedavg"][0]), ours[name]


def test_conf_main_job_runs_the_main_jobs_setting():
    conf = tomllib.loads((ROOT / "conf" / "main_job.toml").read_text())
    job = _main_job()
    assert conf["strategies"] == job["strategies"]
    assert conf["num-rounds"] == job["num-rounds"] and conf["num-partitions"] == job["num-partitions"]
    assert 0 in conf["seeds"] and len(conf["seeds"]) >= 3
    for key, value in conf["run-config"].items():
        assert job["run-config"].get(key) == value, f"conf/main_job.toml: {key} = {value!r} differs from pyproject"
