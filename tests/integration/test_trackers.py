"""Trackers with the real libraries and tools: what TensorBoard, MLflow and W&B show equals the round records.

One 3-round comparison (FedAvg and DRFA, 6 synthetic clients, in-process) is run through the
experiments runner with ``tracker = "tensorboard,mlflow,wandb"``, and one DRFA run of the
runner is killed with SIGKILL (a real second process) after round 3 and resumed from its
checkpoint of round 2. Each tool is read the way a person looks at it: a real
``tensorboard`` server with its default loader (the Rust data server) through its HTTP API,
``MlflowClient`` on the SQLite store, and W&B's own reader of the offline run files
(``wandb leet inspect --json``); every value is compared with the round records. MLflow
metrics are float64 and W&B values JSON numbers, so those comparisons are exact;
TensorBoard holds float32 scalars (what its default loader reads), so its values equal the
records rounded to float32.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed (pip install -e '.[dev]')")
pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install -e '.[dev]')")
pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[dev]')")

from flowerdro.apps.client_app import app as client_app  # noqa: E402
from flowerdro.apps.server_app import run_strategies  # noqa: E402
from flowerdro.experiments import InProcessGrid, run  # noqa: E402
from flowerdro.runs.results import load_records  # noqa: E402
from flowerdro.trackers import TrackerUnavailableError, flat_settings  # noqa: E402

NAME = "trackers_test"
STRATEGIES = ("fedavg", "drfa")
ROOT = Path(__file__).resolve().parents[2]


#: A small synthetic federation (as conftest's ``synth_rc``, for the module-scoped runs).
RUN_CONFIG = {"dataset": "synthetic", "partition": "natural", "model": "logreg", "lr": 0.05, "local-steps": 5,
              "batch-size": 16, "synthetic-dim": 20, "synthetic-classes": 5}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The module's folder: the watched comparison under ``watched/``, the killed run under ``killed/``."""
    return tmp_path_factory.mktemp("trackers")


@pytest.fixture(scope="module")
def watched(root):
    """The comparison, run once with all three trackers: (result, tracker dir)."""
    config = {"name": NAME, "num-rounds": 3, "seeds": [0], "num-partitions": 6, "strategies": list(STRATEGIES),
              "run-config": dict(RUN_CONFIG), "tracker": "tensorboard,mlflow,wandb",
              "tracker-dir": str(root / "watched" / "trackers")}
    result = run(config, output_root=root / "watched" / "results", verbose=False)
    return result, root / "watched" / "trackers"


def _history(result, label):
    return result.histories[label][0]


def f32(x: float) -> float:
    """``x`` rounded to float32, as TensorBoard stores a scalar."""
    return float(np.float32(x))


# --------------------------------------------------------------------------- a run killed with SIGKILL, resumed
KILLED, KILL_AFTER, CHECKPOINT_EVERY, KILLED_ROUNDS = "killed", 3, 2, 6

#: An observer factory for the killed process: after round KILL_AFTER it says so and waits to be killed.
HOLD = """
import os, time
from pathlib import Path

class Hold:
    def on_round(self, strategy, record):
        if record["round"] == int(os.environ["HOLD_ROUND"]):
            Path(os.environ["HOLD_MARKER"]).write_text(str(record["round"]))
            time.sleep(600)

def make(plan):
    return Hold()
"""


@pytest.fixture(scope="module")
def killed(root):
    """``python -m flowerdro.experiments killed.toml --out <out>`` (DRFA, 6 rounds, checkpoint every 2,
    all three trackers, no tracker-dir) killed with SIGKILL right after round 3, then resumed
    (``resume = true``) in this process. Returns (the resumed comparison, out, the killed
    process's log, its working folder)."""
    base = root / "killed"
    pkg, cwd, out = base / "pkg", base / "cwd", base / "out"
    for d in (pkg, cwd, out):
        d.mkdir(parents=True)
    (pkg / "hold_after_round.py").write_text(HOLD)
    config = {"name": KILLED, "num-rounds": KILLED_ROUNDS, "seeds": [0], "num-partitions": 4, "strategies": ["drfa"],
              "run-config": {**RUN_CONFIG, "checkpoint-every": CHECKPOINT_EVERY}, "tracker": "tensorboard,mlflow,wandb"}
    toml = "\n".join([f'name = "{KILLED}"', f"num-rounds = {KILLED_ROUNDS}", "seeds = [0]", "num-partitions = 4",
                      'strategies = ["drfa"]', 'tracker = "tensorboard,mlflow,wandb"',
                      'observers = "hold_after_round:make"', "[run-config]",
                      *(f"{k} = {json.dumps(v)}" for k, v in config["run-config"].items())])
    (base / f"{KILLED}.toml").write_text(toml + "\n")
    marker, log = base / "held", base / "killed.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(pkg)]), "HOLD_ROUND": str(KILL_AFTER),
           "HOLD_MARKER": str(marker), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "flowerdro.experiments", str(base / f"{KILLED}.toml"),
                                 "--out", str(out)], cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not marker.exists():
                assert proc.poll() is None, f"the runner exited ({proc.returncode}) before round {KILL_AFTER}:\n" \
                                            + log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the runner did not reach round 3 in 300 s"
                time.sleep(0.2)
        finally:  # kill -9 the runner and whatever it started (W&B's service): nothing gets to flush
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed = run({**config, "resume": True}, output_root=out, verbose=False)
    return resumed, out, log.read_text(), cwd


def test_the_runner_says_where_results_and_trackers_go_and_puts_trackers_under_out(killed):
    _, out, log, cwd = killed
    trackers = out.resolve() / "trackers"
    assert f"{KILLED}: results: {out.resolve() / KILLED}" in log
    assert f"{KILLED}: TensorBoard: {trackers / 'tensorboard'} (look: tensorboard --logdir {trackers / 'tensorboard'})" \
        in log
    assert f"{KILLED}: MLflow: sqlite:///{trackers / 'mlflow.db'}" in log
    assert f"{KILLED}: W&B: {trackers / 'wandb'}" in log
    assert {p.name for p in trackers.iterdir()} >= {"tensorboard", "mlflow.db", "mlflow-artifacts", "wandb"}
    assert list(cwd.iterdir()) == []  # nothing in the working folder (no ./results/trackers)


def test_a_killed_run_resumed_ends_its_mlflow_runs_and_logs_every_round_once_more(killed):
    from mlflow.tracking import MlflowClient

    resumed, out, _, _ = killed
    records = load_records(out / KILLED / "drfa" / "seed0")
    assert [r["round"] for r in records] == list(range(1, KILLED_ROUNDS + 1))
    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'trackers' / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name(KILLED)
    runs = client.search_runs([exp.experiment_id])
    parents = sorted((r for r in runs if r.data.tags.get("flowerdro.kind") == "comparison"),
                     key=lambda r: r.info.start_time)
    children = sorted((r for r in runs if "flowerdro.kind" not in r.data.tags), key=lambda r: r.info.start_time)
    assert len(parents) == 2 and len(children) == 2
    (old_parent, new_parent), (old_child, new_child) = parents, children
    # the killed process's runs are ended, not left RUNNING forever
    assert (old_parent.info.status, old_child.info.status) == ("KILLED", "KILLED")
    assert (new_parent.info.status, new_child.info.status) == ("FINISHED", "FINISHED")
    # linked: the resumed run names the run it continues and the checkpoint's round, both share the run folder
    run_dir = str((out / KILLED / "drfa" / "seed0").resolve())
    assert old_child.data.tags["flowerdro.run_dir"] == new_child.data.tags["flowerdro.run_dir"] == run_dir
    assert new_child.data.tags["flowerdro.resumes"] == old_child.info.run_id
    assert new_child.data.tags["flowerdro.resumed_after"] == str(CHECKPOINT_EVERY)
    assert new_parent.data.tags["flowerdro.resumes"] == old_parent.info.run_id
    assert old_child.data.tags["mlflow.parentRunId"] == old_parent.info.run_id
    assert new_child.data.tags["mlflow.parentRunId"] == new_parent.info.run_id
    # continuous: the resumed run holds every round, each once, equal to rounds.jsonl
    for key in ("acc_worst20", "acc_mean"):
        history = client.get_metric_history(new_child.info.run_id, f"fairness/{key}")
        assert sorted(m.step for m in history) == list(range(1, KILLED_ROUNDS + 1))
        assert {m.step: m.value for m in history} == {r["round"]: r[key] for r in records}
    assert resumed.histories["drfa"][0][-1]["acc_worst20"] == records[-1]["acc_worst20"]


def test_a_killed_run_resumed_leaves_no_gap_in_its_wandb_history(killed):
    _, out, _, _ = killed
    records = load_records(out / KILLED / "drfa" / "seed0")
    runs = [r for f in sorted((out / "trackers" / "wandb").glob("offline-run-*/run-*.wandb"))
            if (r := _wandb_run(f, check=False)) is not None]
    drfa = [r for r in runs if r["run"]["job_type"] == "drfa"]
    resumed = [r for r in drfa if r["config"].get("resumed_after") == CHECKPOINT_EVERY]
    assert len(resumed) == 1, [r["config"].get("resumed_after") for r in drfa]
    logged = resumed[0]["history"]
    assert {s: h["fairness/acc_worst20"] for s, h in logged.items() if "fairness/acc_worst20" in h} == {
        r["round"]: r["acc_worst20"] for r in records}
    run_dir = str((out / KILLED / "drfa" / "seed0").resolve())
    assert {r["config"]["run_dir"] for r in drfa} == {run_dir}


# --------------------------------------------------------------------------- TensorBoard, as its server shows it
def _get(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310  # 127.0.0.1 only
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def tensorboard(root, watched, killed):
    """A real ``tensorboard`` server with its default settings over the module's folder: its base URL.

    The default loader is the Rust data server when ``tensorboard-data-server`` ships a
    binary for this platform; that is checked through the server's own ``/data/environment``.
    """
    import tensorboard_data_server

    log = root / "tensorboard.log"
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(root), "--host",
                                 "127.0.0.1", "--port", "0"], stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline, base = time.monotonic() + 120, None
        while base is None:
            text = log.read_text()
            if " at http://127.0.0.1:" in text:
                base = "http://" + text.split(" at http://", 1)[1].split("/", 1)[0]
            assert proc.poll() is None, f"tensorboard exited ({proc.returncode}):\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"tensorboard did not start in 120 s:\n{text[-3000:]}"
            time.sleep(0.3)
        provider = _get(f"{base}/data/environment")["debug"]["data_provider"]
        if tensorboard_data_server.server_binary() is not None:
            assert provider.startswith("GrpcDataProvider"), (provider, log.read_text()[-3000:])
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _scalars(base: str, run_: str, tag: str, steps: int) -> dict[int, float]:
    """``{step: value}`` of a run's scalar, polled until the server has loaded ``steps`` steps."""
    from urllib.parse import quote

    deadline = time.monotonic() + 90
    while True:
        tags = _get(f"{base}/data/plugin/scalars/tags")
        if tag in tags.get(run_, {}):
            points = _get(f"{base}/data/plugin/scalars/scalars?run={quote(run_)}&tag={quote(tag)}")
            if len(points) >= steps or time.monotonic() > deadline:
                steps_seen = [p[1] for p in points]
                assert len(steps_seen) == len(set(steps_seen)), f"{run_} {tag}: a step shown twice: {steps_seen}"
                return {int(step): value for _, step, value in points}
        assert time.monotonic() < deadline, f"the server shows no {tag} of {run_}; it has {sorted(tags)}"
        time.sleep(0.5)


def test_tensorboards_default_ui_shows_every_scalar_of_every_round(tensorboard, watched):
    from flowerdro.trackers import round_scalars

    result, _ = watched
    for label in STRATEGIES:
        history, run_ = _history(result, label), f"watched/trackers/tensorboard/{NAME}/{label}/seed0"
        expected = {tag for r in history for tag in round_scalars(r)}
        assert _scalars(tensorboard, run_, "fairness/acc_worst20", len(history)) == {
            r["round"]: f32(r["acc_worst20"]) for r in history}
        shown = _get(f"{tensorboard}/data/plugin/scalars/tags")[run_]
        assert set(shown) == expected  # every scalar of the records, nothing dropped
        for tag in sorted(expected):
            assert _scalars(tensorboard, run_, tag, len(history)) == {
                r["round"]: f32(v) for r in history if (v := round_scalars(r).get(tag)) is not None}, tag


def test_tensorboards_hparams_dashboard_shows_every_strategys_settings_and_metrics(tensorboard, watched):
    result, _ = watched
    runs = {f"watched/trackers/tensorboard/{NAME}/{label}/seed0": label for label in STRATEGIES}
    body = {"experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                                      "STATUS_RUNNING"], "colParams": [], "startIndex": 0,
            "sliceSize": 100}
    deadline = time.monotonic() + 90
    while len(groups := {g["name"]: g for g in _get(f"{tensorboard}/data/plugin/hparams/session_groups", body)
                         ["sessionGroups"]}.keys() & runs) < len(runs):
        assert time.monotonic() < deadline, "the HParams dashboard lacks sessions"
        time.sleep(0.5)
    groups = {g["name"]: g for g in _get(f"{tensorboard}/data/plugin/hparams/session_groups", body)["sessionGroups"]}
    experiment = _get(f"{tensorboard}/data/plugin/hparams/experiment", {"experimentName": ""})
    columns = {h["name"] for h in experiment["hparamInfos"]}
    for run_, label in runs.items():
        strategy = result.strategies[label][0]
        settings = flat_settings(strategy.settings())
        assert set(settings) <= columns  # DRFA's own settings too, not only the first run's
        group = groups[run_]
        assert group["hparams"]["strategy"] == label and group["hparams"]["lr"] == strategy.training.lr == 0.05
        last = _history(result, label)[-1]
        metrics = {m["name"]["tag"]: m for m in group["metricValues"]}
        assert metrics["fairness/acc_worst20"]["value"] == f32(last["acc_worst20"])
        assert metrics["fairness/acc_worst20"]["trainingStep"] == last["round"]
        assert group["sessions"][0]["status"] == "STATUS_SUCCESS"
    assert {"fairness/acc_worst20", "fairness/acc_mean"} <= {m["name"]["tag"] for m in experiment["metricInfos"]}


def test_tensorboard_shows_a_killed_and_resumed_run_once_per_round(tensorboard, killed):
    _, out, _, _ = killed
    records = load_records(out / KILLED / "drfa" / "seed0")
    run_ = f"killed/out/trackers/tensorboard/{KILLED}/drfa/seed0"
    assert len(list((out / "trackers" / "tensorboard" / KILLED / "drfa" / "seed0").glob("events.out.*"))) == 2
    assert _scalars(tensorboard, run_, "fairness/acc_worst20", KILLED_ROUNDS) == {
        r["round"]: f32(r["acc_worst20"]) for r in records}


# --------------------------------------------------------------------------- TensorBoard, the event files
def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def _tb_scalar(acc, tag):
    return {ev.step: ev.value for ev in acc.Scalars(tag)}


def test_tensorboard_files_hold_the_histograms_images_and_settings(watched):
    result, root = watched
    for label in STRATEGIES:
        history = _history(result, label)
        acc = _events(root / "tensorboard" / NAME / label / "seed0")
        assert _tb_scalar(acc, "fairness/acc_worst20") == {r["round"]: f32(r["acc_worst20"]) for r in history}
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
        assert _tb_scalar(acc, f"lambda/{part}") == {r["round"]: f32(r["lambda"][part]) for r in drfa}
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = acc.PluginTagToContent("hparams")
    assert "_hparams_/experiment" not in content  # TensorBoard builds the experiment from every run's session
    hparams = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info.hparams
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
def _wandb_run(run_file: Path, check: bool = True) -> dict | None:
    """Run info, config and history (step -> key -> value) of an offline run, read by W&B's own
    reader of its transaction log (``wandb leet inspect --json``: one JSON object per record;
    nested keys joined by "."). With ``check`` False, None for a file the reader refuses or
    that holds no run record (a run killed before W&B wrote its records)."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                          capture_output=True, text=True, timeout=120, check=check)
    if proc.returncode != 0:
        return None
    out = proc.stdout
    run_: dict = {"history": {}}
    for line in out.splitlines():
        rec = json.loads(line)
        if rec["type"] == "run":
            run_["run"] = rec["run"]
            run_["config"] = rec["run"]["config"]["update"]
        elif rec["type"] == "history":
            items = rec["history"]["item"]
            run_["history"][int(items["_step"])] = items
    if "run" not in run_:
        assert not check, f"{run_file}: no run record"
        return None
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


def test_the_server_app_puts_tracker_files_in_its_output_dir_and_says_where(tmp_path, monkeypatch, synth_rc, caplog):
    import logging

    work = tmp_path / "superlink-folder"  # the ServerApp's working folder (under flwr run: the SuperLink's)
    work.mkdir()
    monkeypatch.chdir(work)
    rc = {**synth_rc, "num-partitions": 3, "strategies": "fedavg", "num-rounds": 1, "output-dir": "out",
          "tracker": "tensorboard"}
    with caplog.at_level(logging.INFO, logger="flwr"):
        run_strategies(InProcessGrid(client_app, 3, rc), rc)
    lines = [r.getMessage() for r in caplog.records]
    out = work / "out"
    assert f"flwr-run: results: {out}" in lines
    assert f"flwr-run: TensorBoard: {out / 'trackers' / 'tensorboard'} (look: tensorboard --logdir " \
           f"{out / 'trackers' / 'tensorboard'})" in lines
    assert any(line.startswith("flwr-run: output-dir is relative to this ServerApp's working folder "
                               f"{work}; under `flwr run` that is the folder the local SuperLink") for line in lines)
    assert (out / "trackers" / "tensorboard" / "flwr-run" / "fedavg" / "seed0").is_dir()
    assert sorted(p.name for p in work.iterdir()) == ["out"]


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
    # the resumed writer's purge_step 0 hides everything the cut run wrote, and the resumed run
    # logs rounds 1-2 from its checkpoint again: TensorBoard's loaders (the Python one of its
    # plugins here; its server above) read each round once
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("fairness/acc_worst20")
    assert [ev.step for ev in events] == [1, 2, 3, 4]
    assert [float(make_ndarray(ev.tensor_proto)) for ev in events] == [
        f32(r["acc_worst20"]) for r in _history(whole, "drfa")]
