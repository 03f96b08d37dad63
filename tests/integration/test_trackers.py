"""Trackers with the real libraries: what TensorBoard, MLflow and W&B read back equals the round records.

One 3-round comparison (FedAvg and DRFA, 6 synthetic clients, in-process) is run through the
experiments runner with ``tracker = "tensorboard,mlflow,wandb"``; each test reads one tool's
files back with that tool's own reader (TensorBoard's ``EventAccumulator``, ``MlflowClient``
on the SQLite store, and W&B's ``wandb leet inspect --json`` on the offline run files) and compares with
``strategy.history``. TensorBoard scalars are float64 tensors, MLflow metrics float64 and W&B
values JSON numbers, so the comparisons are exact.
"""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed (pip install -e '.[dev]')")
pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install -e '.[dev]')")
pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[dev]')")

from flowerdro.apps.client_app import app as client_app  # noqa: E402
from flowerdro.apps.server_app import run_strategies  # noqa: E402
from flowerdro.experiments import InProcessGrid, run  # noqa: E402
from flowerdro.trackers import TrackerUnavailableError, flat_settings  # noqa: E402

NAME = "trackers_test"
STRATEGIES = ("fedavg", "drfa")


#: A small synthetic federation (as conftest's ``synth_rc``, for the module-scoped run).
RUN_CONFIG = {"dataset": "synthetic", "partition": "natural", "model": "logreg", "lr": 0.05, "local-steps": 5,
              "batch-size": 16, "synthetic-dim": 20, "synthetic-classes": 5}


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """The comparison, run once with all three trackers: (result, tracker dir)."""
    root = tmp_path_factory.mktemp("watched")
    config = {"name": NAME, "num-rounds": 3, "seeds": [0], "num-partitions": 6, "strategies": list(STRATEGIES),
              "run-config": dict(RUN_CONFIG), "tracker": "tensorboard,mlflow,wandb",
              "tracker-dir": str(root / "trackers")}
    result = run(config, output_root=root / "results", verbose=False)
    return result, root / "trackers"


def _history(result, label):
    return result.histories[label][0]


# --------------------------------------------------------------------------- TensorBoard
def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "histograms": 0, "images": 0})
    acc.Reload()
    return acc


def _tb_scalar(acc, tag):
    from tensorboard.util.tensor_util import make_ndarray

    return {ev.step: float(make_ndarray(ev.tensor_proto)) for ev in acc.Tensors(tag)}


def test_tensorboard_reads_back_the_records(watched):
    result, root = watched
    for label in STRATEGIES:
        history = _history(result, label)
        acc = _events(root / "tensorboard" / NAME / label / "seed0")
        assert _tb_scalar(acc, "fairness/acc_worst20") == {r["round"]: r["acc_worst20"] for r in history}
        assert _tb_scalar(acc, "cost/bytes_sent") == {r["round"]: float(r["bytes_sent"]) for r in history}
        hist = {ev.step: ev.histogram_value for ev in acc.Histograms("client_acc")}
        for r in history:
            values = list(r["client_acc"].values())
            assert hist[r["round"]].num == len(values)
            assert (hist[r["round"]].min, hist[r["round"]].max) == (min(values), max(values))
            # a float64 sum of at most 6 numbers in [0, 1]: within 6 ulp of the exact sum
            assert math.isclose(hist[r["round"]].sum, math.fsum(values), rel_tol=0, abs_tol=6 * 2.0 ** -52)
        assert [ev.step for ev in acc.Images("figures/progress")] == [3]
    drfa = _history(result, "drfa")
    acc = _events(root / "tensorboard" / NAME / "drfa" / "seed0")
    for part in drfa[-1]["lambda"]:
        assert _tb_scalar(acc, f"lambda/{part}") == {r["round"]: r["lambda"][part] for r in drfa}
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    strategy = result.strategies["drfa"][0]
    assert hparams["lr"].number_value == strategy.training.lr == 0.05
    assert strategy.config.dual_lr is None and hparams["dual_lr"].string_value == "unset"
    assert hparams["strategy"].string_value == "drfa"
    comparison = _events(root / "tensorboard" / NAME / "comparison")
    assert [ev.step for ev in comparison.Images("figures/comparison")] == [0]


# --------------------------------------------------------------------------- MLflow
def test_mlflow_reads_back_the_records(watched):
    from mlflow.tracking import MlflowClient

    result, root = watched
    client = MlflowClient(tracking_uri=f"sqlite:///{(root / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name(NAME)
    runs = {r.data.tags.get("flowerdro.strategy", r.data.tags.get("flowerdro.kind")): r
            for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {*STRATEGIES, "comparison"}
    parent = runs["comparison"].info.run_id
    assert runs["comparison"].info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent)} >= {"comparison.png", "table.md", "summary.json"}
    for label in STRATEGIES:
        history, run_ = _history(result, label), runs[label]
        rid = run_.info.run_id
        assert run_.info.status == "FINISHED" and run_.info.run_name == f"{label}-seed0"
        assert run_.data.tags["mlflow.parentRunId"] == parent and run_.data.tags["flowerdro.seed"] == "0"
        got = {m.step: m.value for m in client.get_metric_history(rid, "fairness/acc_worst20")}
        assert got == {r["round"]: r["acc_worst20"] for r in history}
        median = {m.step: m.value for m in client.get_metric_history(rid, "client_acc/p50")}
        assert median == {r["round"]: float(np.median(list(r["client_acc"].values()))) for r in history}
        settings = flat_settings(result.strategies[label][0].settings())
        assert run_.data.params == {k: str(v) for k, v in settings.items()}
        assert {a.path for a in client.list_artifacts(rid)} == {"clients.csv", "progress.png"}
        table = list(csv.DictReader(io.StringIO(Path(client.download_artifacts(rid, "clients.csv")).read_text())))
        for r in history:
            rows = {row["partition"]: row for row in table if int(row["round"]) == r["round"]}
            assert {p: float(rows[p]["client_acc"]) for p in rows} == r["client_acc"]
    drfa = _history(result, "drfa")
    rid = runs["drfa"].info.run_id
    for part in drfa[-1]["lambda"]:
        got = {m.step: m.value for m in client.get_metric_history(rid, f"lambda/{part}")}
        assert got == {r["round"]: r["lambda"][part] for r in drfa}


# --------------------------------------------------------------------------- W&B
def _wandb_run(run_file: Path) -> dict:
    """Run info, config and history (step -> key -> value) of an offline run, read by W&B's own
    reader of its transaction log (``wandb leet inspect --json``: one JSON object per record;
    nested keys joined by ".")."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    run_: dict = {"history": {}}
    for line in out.splitlines():
        rec = json.loads(line)
        if rec["type"] == "run":
            run_["run"] = rec["run"]
            run_["config"] = rec["run"]["config"]["update"]
        elif rec["type"] == "history":
            items = rec["history"]["item"]
            run_["history"][int(items["_step"])] = items
    return run_


def test_wandb_offline_files_read_back_the_records(watched):
    result, root = watched
    runs = [_wandb_run(f) for f in sorted((root / "wandb").glob("offline-run-*/run-*.wandb"))]
    by_job = {r["run"]["job_type"]: r for r in runs}
    assert sorted(by_job) == sorted([*STRATEGIES, "comparison"])
    assert {r["run"]["run_group"] for r in runs} == {NAME}
    for label in STRATEGIES:
        history, logged = _history(result, label), by_job[label]
        assert logged["run"]["display_name"] == f"{label}-seed0"
        assert logged["config"]["seed"] == 0 and logged["config"]["strategy"] == label
        assert {s: h["fairness/acc_worst20"] for s, h in logged["history"].items()
                if "fairness/acc_worst20" in h} == {r["round"]: r["acc_worst20"] for r in history}
        for r in history:
            hist = logged["history"][r["round"]]
            assert hist["client_acc._type"] == "histogram" and sum(hist["client_acc.values"]) == len(r["client_acc"])
        assert logged["history"][3]["figures/progress._type"] == "image-file"
    drfa, logged = _history(result, "drfa"), by_job["drfa"]
    for r in drfa:
        assert {k: logged["history"][r["round"]][f"lambda/{k}"] for k in r["lambda"]} == r["lambda"]
    final = next(h for h in by_job["comparison"]["history"].values() if "final._type" in h)
    assert final["final._type"] == "table-file" and final["figures/comparison._type"] == "image-file"


# --------------------------------------------------------------------------- run config, ServerApp, extras
def test_server_app_takes_trackers_and_observer_factories_from_the_run_config(tmp_path, monkeypatch, synth_rc):
    # a user's package with an observer factory, importable by its path
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "my_watch.py").write_text(
        "from flowerdro.trackers import StopRun\n"
        "SEEN = []\n"
        "class Stop:\n"
        "    def __init__(self, label): self.label = label\n"
        "    def on_round(self, strategy, record):\n"
        "        SEEN.append((self.label, record['round'], record['acc_worst20']))\n"
        "        if self.label == 'drfa' and record['round'] == 2: raise StopRun('enough')\n"
        "def make(plan): return Stop(plan.label)\n")
    monkeypatch.syspath_prepend(str(pkg))
    rc = {**synth_rc, "num-partitions": 4, "strategies": "fedavg,drfa", "num-rounds": 3,
          "output-dir": str(tmp_path / "out"), "tracker": "tensorboard", "tracker-dir": str(tmp_path / "trk"),
          "tracker-experiment": "mine", "observers": "my_watch:make"}
    grid = InProcessGrid(client_app, 4, rc)
    result = run_strategies(grid, rc)
    seen = sys.modules["my_watch"].SEEN
    assert [(lab, rnd) for lab, rnd, _ in seen] == [("fedavg", 1), ("fedavg", 2), ("fedavg", 3), ("drfa", 1), ("drfa", 2)]
    assert [w for lab, _, w in seen if lab == "drfa"] == [r["acc_worst20"] for r in result.histories["drfa"][0]]
    # the stopped run ended cleanly after round 2: its writer and tracker got on_end
    assert len(result.histories["drfa"][0]) == 2
    assert (tmp_path / "out" / "drfa" / "final_model.npz").is_file()
    acc = _events(tmp_path / "trk" / "tensorboard" / "mine" / "drfa" / "seed0")
    assert sorted(_tb_scalar(acc, "fairness/acc_worst20")) == [1, 2]
    assert [ev.step for ev in acc.Images("figures/progress")] == [2]


class _NoGrid:
    """A grid that fails the test when anything talks to it."""

    def __getattr__(self, name):
        raise AssertionError(f"the grid was used ({name}) before the missing extra was reported")


@pytest.mark.parametrize(("tracker", "module"), [("tensorboard", "tensorboard"), ("mlflow", "mlflow"),
                                                 ("wandb", "wandb")])
def test_a_missing_extra_fails_before_training_with_the_install_hint(tracker, module, monkeypatch, tmp_path, synth_rc):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    rc = {**synth_rc, "strategies": "fedavg", "tracker": tracker, "tracker-dir": str(tmp_path)}
    with pytest.raises(TrackerUnavailableError, match=rf"pip install 'flowerdro\[{tracker}\]'"):
        run_strategies(_NoGrid(), rc)
    with pytest.raises(TrackerUnavailableError, match=rf"pip install 'flowerdro\[{tracker}\]'"):
        run({"strategies": ["fedavg"], "num-rounds": 1, "run-config": synth_rc, "tracker": tracker,
             "tracker-dir": str(tmp_path)}, output_root=None)


def _readme_observer_example() -> dict:
    """Run the README's early-stopping observer example and return its namespace."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("### Observers: your own code after every round"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    namespace: dict = {}
    exec(code[:code.index("```")], namespace)  # noqa: S102  # the README's own example
    return namespace


def test_readme_early_stopping_example_stops_where_the_records_say(tmp_path, synth_rc):
    example = _readme_observer_example()
    config = {"name": "stop", "num-rounds": 6, "seeds": [0], "num-partitions": 5, "strategies": ["drfa"],
              "run-config": synth_rc}
    whole = run(config, output_root=None, verbose=False).histories["drfa"][0]
    # patience 1: the run ends at the first round whose worst-20% is no better than every earlier one
    w20 = [r["acc_worst20"] for r in whole]
    expected = next((i + 1 for i in range(1, len(w20)) if w20[i] <= max(w20[:i])), len(w20))
    assert expected < len(w20), "the setting must stall before the last round for this test to bite"
    result = run(config, output_root=tmp_path, verbose=False,
                 observers=[lambda plan: example["StopWhenWorst20Stalls"](patience=1)])
    stopped = result.histories["drfa"][0]
    assert [r["acc_worst20"] for r in stopped] == w20[:expected]
    assert len((tmp_path / "stop" / "drfa" / "seed0" / "rounds.jsonl").read_text().splitlines()) == expected
    assert (tmp_path / "stop" / "drfa" / "seed0" / "final_model.npz").is_file()
    assert example["make"](None).patience == 5


def test_a_resumed_run_continues_its_tensorboard_folder_without_repeating_rounds(crash_and_resume, synth_rc):
    def experiment(root: Path) -> dict:
        return {"name": "resumed", "num-rounds": 4, "seeds": [0], "num-partitions": 4, "strategies": ["drfa"],
                "run-config": {**synth_rc, "checkpoint-every": 2}, "output-root": str(root),
                "tracker": "tensorboard", "tracker-dir": str(root / "trk")}

    # cut after round 3, resumed from the checkpoint of round 2: round 3 is logged twice on disk
    whole, resumed = crash_and_resume("drfa", experiment, crash_round=3)
    run_dir = Path(resumed.output_dir).parent / "trk" / "tensorboard" / "resumed" / "drfa" / "seed0"
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2
    # the resumed writer's purge_step hides the cut run's round 3: TensorBoard's server (its
    # plugin event accumulator; the legacy one purges no tensors) reads each round once
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("fairness/acc_worst20")
    assert [ev.step for ev in events] == [1, 2, 3, 4]
    assert [float(make_ndarray(ev.tensor_proto)) for ev in events] == [
        r["acc_worst20"] for r in _history(whole, "drfa")]
