"""Shared test fixtures: offline hub, the real data folder, small in-process federations."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# trackers never reach the network in tests: W&B offline and quiet, no MLflow telemetry
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "true"

# On CUDA, tests that compare two paths (or a run and its resumed copy) bit for bit need
# reproducible kernels: cuBLAS reads its workspace setting when its first handle is made, so
# it is set here, before any test touches CUDA (see pytest_configure).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_configure(config: pytest.Config) -> None:
    """Deterministic float32 CUDA kernels where CUDA is present (nothing changes on a CPU-only machine).

    ``warn_only``: an op that torch lists as having no deterministic CUDA implementation
    warns instead of failing every test that touches it; a bit-for-bit test that such an op
    breaks then fails on its own comparison, naming the test. cuDNN's convolutions use TF32
    (a 10-bit mantissa) by default; the tests' tolerances are float32's, so TF32 is off.
    """
    import torch

    if torch.cuda.is_available():
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def real_data_dir() -> Path | None:
    """The real data files (``../shared/data`` beside the checkout, or FLOWERDRO_DATA)."""
    env = os.environ.get("FLOWERDRO_DATA")
    for cand in ([Path(env)] if env else []) + [SHARED_DATA]:
        if (cand / "fashion_mnist").is_dir() or (cand / "mnist").is_dir():
            return cand
    return None


@pytest.fixture
def data_dir() -> Path:
    """Folder with the real Fashion-MNIST / MNIST / Adult files, or skip."""
    d = real_data_dir()
    if d is None:
        pytest.skip("real data files not found: put them in ../shared/data or set FLOWERDRO_DATA")
    return d


#: A small, fast federation on the offline synthetic data set.
SYNTH_RC = {
    "dataset": "synthetic",
    "partition": "natural",
    "model": "logreg",
    "lr": 0.05,
    "local-steps": 5,
    "batch-size": 16,
    "synthetic-dim": 20,
    "synthetic-classes": 5,
}


@pytest.fixture
def synth_rc() -> dict:
    """Run config of a small synthetic federation (copy; safe to edit)."""
    return dict(SYNTH_RC)


# --------------------------------------------------------------------------- crash and resume
class _Crash(Exception):
    """Raised by the patched round hook to cut a run short."""


def records_without_wall_time(history: list[dict]) -> list[dict]:
    """A run's round records less their wall times (``time_s``), which no two runs share."""
    return [{k: v for k, v in r.items() if k != "time_s"} for r in history]


@pytest.fixture
def crash_after(monkeypatch):
    """``crash(experiment, crash_round)``: run the experiment config and stop it right after
    round ``crash_round`` was written with its checkpoint, as a crash of the ServerApp would."""
    from flowerdro.experiments import run
    from flowerdro.strategies.observers import Observers

    def crash(experiment: dict, crash_round: int) -> None:
        original = Observers.notify

        def crashing(self, strategy, event, *args):
            original(self, strategy, event, *args)
            if event == "on_round" and args[0]["round"] == crash_round:
                raise _Crash

        monkeypatch.setattr(Observers, "notify", crashing)
        with pytest.raises(_Crash):
            run(experiment, verbose=False)
        monkeypatch.setattr(Observers, "notify", original)

    return crash


@pytest.fixture
def crash_and_resume(tmp_path, crash_after):
    """Check that a run cut after a round and resumed equals an uninterrupted run.

    Returns ``check(name, experiment, crash_round=2) -> (whole, resumed)``: ``experiment(root)``
    is the experiment config (with ``checkpoint-every`` 1) writing under ``root``. ``check`` runs
    it once whole (``tmp_path/"whole"``), once crashing right after round ``crash_round`` was
    written with its checkpoint (``tmp_path/"cut"``), then resumes the cut run in its folder.
    It asserts that both give the same round records (wall times aside) and bit-identical
    final models, and returns both :class:`~flowerdro.runs.Comparison` results.
    """
    import numpy as np

    from flowerdro.experiments import run

    def check(name: str, experiment, crash_round: int = 2):
        whole = run(experiment(tmp_path / "whole"), verbose=False)
        crash_after(experiment(tmp_path / "cut"), crash_round)
        resumed = run({**experiment(tmp_path / "cut"), "resume": True}, verbose=False)

        assert records_without_wall_time(resumed.histories[name][0]) == records_without_wall_time(
            whole.histories[name][0])
        a, b = whole.final_arrays[name][0], resumed.final_arrays[name][0]
        assert list(a.keys()) == list(b.keys())
        for k in a.keys():
            np.testing.assert_array_equal(a[k].numpy(), b[k].numpy())
        return whole, resumed

    return check


def pytest_collection_finish(session) -> None:
    """Keep what the test modules imported (torch, flwr, datasets) out of the collector's walks.

    Flower's ``ArrayRecord.to_numpy_ndarrays(keep_input=False)`` calls ``gc.collect()`` for
    every array (q-FedAvg: per reply), and a walk over everything torch and flwr allocate at
    import costs a tenth of a second or more each time; the experiments runner and the
    ServerApp freeze the same way (docs/architecture.md, "Performance notes").
    """
    import gc

    gc.collect()
    gc.freeze()
