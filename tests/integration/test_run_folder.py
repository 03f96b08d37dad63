"""Operator faults around a run's folder, with in-process clients: damaged and pickled
checkpoints on resume, the plan on resume, one run per folder, a full disk."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle

import numpy as np
import pytest

from flowerdro.experiments import run
from flowerdro.runs import load_records
from flowerdro.runs.checkpoint import CheckpointError, load_checkpoint
from flowerdro.runs.files import RunFileError
from flowerdro.runs.lock import FolderInUseError, FolderLock

from ..conftest import records_without_wall_time


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """The figures are not under test here and take most of a small run's time."""
    import flowerdro.runs.plots

    monkeypatch.setattr(flowerdro.runs.plots, "plot_comparison", lambda *a, **k: None)


def _experiment(root, name="drfa", rounds=4, **rc) -> dict:
    run_config = {"dataset": "synthetic", "partition": "natural", "model": "logreg", "lr": 0.05,
                  "local-steps": 5, "batch-size": 16, "synthetic-dim": 20, "synthetic-classes": 5,
                  "fraction-train": 0.5, "checkpoint-every": 1, **rc}
    return {"name": "faults", "num-rounds": rounds, "seeds": [0], "num-partitions": 4, "strategies": [name],
            "run-config": run_config, "output-root": str(root)}


def _run_dir(root, name="drfa"):
    return root / "faults" / name / "seed0"


def _same_run(a, b, name="drfa") -> None:
    assert records_without_wall_time(a.histories[name][0]) == records_without_wall_time(b.histories[name][0])
    for k in a.final_arrays[name][0].keys():
        np.testing.assert_array_equal(a.final_arrays[name][0][k].numpy(), b.final_arrays[name][0][k].numpy())


# --------------------------------------------------------------------------- damaged checkpoints
def test_a_damaged_latest_checkpoint_is_named_and_the_one_before_it_resumed(crash_after, tmp_path, caplog):
    whole = run(_experiment(tmp_path / "whole"), verbose=False)
    cut = _experiment(tmp_path / "cut")
    crash_after(cut, 3)
    folder = _run_dir(tmp_path / "cut")
    third = folder / "checkpoint_round0003.npz"
    third.write_bytes(third.read_bytes()[:100])  # truncated
    with caplog.at_level(logging.WARNING):
        resumed = run({**cut, "resume": True}, verbose=False)
    assert f"checkpoint {third} is damaged" in caplog.text
    assert f"resuming from {folder / 'checkpoint_round0002.npz'} (round 2): 1 newer checkpoint damaged" in caplog.text
    _same_run(resumed, whole)
    assert [r["round"] for r in load_records(folder)] == [1, 2, 3, 4]


def test_a_run_whose_checkpoints_are_all_damaged_fails_naming_every_file(crash_after, tmp_path):
    cut = _experiment(tmp_path)
    crash_after(cut, 3)
    folder = _run_dir(tmp_path)
    (folder / "checkpoint_round0003.npz").write_bytes(b"")
    (folder / "checkpoint_round0002.npz").write_bytes(os.urandom(64))
    with pytest.raises(CheckpointError) as err:
        run({**cut, "resume": True}, verbose=False)
    msg = str(err.value)
    assert f"{folder} holds no intact checkpoint" in msg
    assert f"checkpoint {folder / 'checkpoint_round0003.npz'} is damaged: the file is empty" in msg
    assert f"checkpoint {folder / 'checkpoint_round0002.npz'} is damaged: not an .npz archive" in msg
    assert len(load_records(folder)) == 3  # refused before the run started: nothing rewritten
    FolderLock(folder).acquire()  # and released


def test_pickled_checkpoints_are_refused_until_migrated(crash_after, tmp_path):
    from flowerdro.runs.migrate import main as migrate

    whole = run(_experiment(tmp_path / "whole"), verbose=False)
    cut = _experiment(tmp_path / "cut")
    crash_after(cut, 2)
    folder = _run_dir(tmp_path / "cut")
    for rnd in (1, 2):  # the checkpoints as an older flowerdro pickled them
        npz = folder / f"checkpoint_round{rnd:04d}.npz"
        (folder / f"checkpoint_round{rnd:04d}.pkl").write_bytes(pickle.dumps(load_checkpoint(npz)))
        npz.unlink()
    with pytest.raises(CheckpointError, match=f"python -m flowerdro.runs.migrate {folder}"):
        run({**cut, "resume": True}, verbose=False)

    assert migrate([str(tmp_path / "cut")]) == 0
    assert sorted(p.name for p in folder.glob("checkpoint_round*")) == [
        "checkpoint_round0001.npz", "checkpoint_round0002.npz"]
    _same_run(run({**cut, "resume": True}, verbose=False), whole)


# --------------------------------------------------------------------------- the plan on resume
def test_num_rounds_on_resume_keeps_the_plan_or_extends_it_explicitly(crash_after, tmp_path, caplog):
    cut = _experiment(tmp_path / "cut", name="fedavg")
    crash_after(cut, 2)
    folder = _run_dir(tmp_path / "cut", "fedavg")
    for rounds, match in [(1, "num-rounds: 1 is below round 2, which the run in"),
                          (3, "num-rounds: 3 is below the 4 rounds the run in"),
                          (6, "num-rounds: 6 is above the 4 rounds the run in .* set extend = true")]:
        with pytest.raises(ValueError, match=match):
            run({**cut, "resume": True, "num-rounds": rounds}, verbose=False)
        assert len(load_records(folder)) == 2  # refused before any round
    with pytest.raises(ValueError, match="extend: only with resume = true"):
        run({**cut, "num-rounds": 6, "extend": True}, verbose=False)

    with caplog.at_level(logging.WARNING):
        extended = run({**cut, "resume": True, "num-rounds": 6, "extend": True}, verbose=False)
    assert "planned for 4 rounds goes on to 6" in caplog.text
    settings = json.loads((folder / "settings.json").read_text())
    assert settings["num_rounds"] == 6
    assert settings["extensions"] == [{"from": 4, "to": 6, "after_round": 2}]
    assert [r["round"] for r in load_records(folder)] == [1, 2, 3, 4, 5, 6]
    # the extension continues the same run: its first 4 rounds are those of the planned run
    planned = run(_experiment(tmp_path / "planned", name="fedavg"), verbose=False)
    assert (records_without_wall_time(extended.histories["fedavg"][0][:4])
            == records_without_wall_time(planned.histories["fedavg"][0]))


def test_resume_without_a_checkpoint_says_so_and_starts_afresh(crash_after, tmp_path, caplog):
    whole = run(_experiment(tmp_path / "whole", **{"checkpoint-every": 0}), verbose=False)
    cut = _experiment(tmp_path / "cut", **{"checkpoint-every": 0})
    crash_after(cut, 2)
    folder = _run_dir(tmp_path / "cut")
    with caplog.at_level(logging.WARNING):
        resumed = run({**cut, "resume": True}, verbose=False)
    assert f"resume: no checkpoint in {folder}, starting afresh from round 1 (its 2 round records are replaced)" \
        in caplog.text
    _same_run(resumed, whole)


# --------------------------------------------------------------------------- one run per folder
def test_a_second_run_on_a_folder_in_use_is_refused_before_any_message(tmp_path):
    experiment = _experiment(tmp_path)
    holder = FolderLock(tmp_path / "faults", name="comparison", run_id=9)
    holder.acquire()  # another run of the comparison holds its folder
    try:
        with pytest.raises(FolderInUseError, match=f"output-dir: {tmp_path / 'faults'} is in use by another run "
                                                   f"\\(flwr run 9, pid {os.getpid()} on host"):
            run(experiment, verbose=False)
        assert not _run_dir(tmp_path).exists()
    finally:
        holder.release()
    run_lock = FolderLock(_run_dir(tmp_path))  # a run folder of it in use (a run of another comparison)
    run_lock.acquire()
    try:
        with pytest.raises(FolderInUseError, match=f"output-dir: {_run_dir(tmp_path)} is in use"):
            run(experiment, verbose=False)
        assert not (_run_dir(tmp_path) / "rounds.jsonl").exists()
    finally:
        run_lock.release()


def test_a_run_that_raised_leaves_its_folders_unlocked(crash_after, tmp_path):
    crash_after(_experiment(tmp_path), 2)
    assert not (_run_dir(tmp_path) / "run.lock.json").exists()
    assert not (tmp_path / "faults" / "comparison.lock.json").exists()
    for lock in (FolderLock(_run_dir(tmp_path)), FolderLock(tmp_path / "faults", name="comparison")):
        lock.acquire()
        lock.release()


# --------------------------------------------------------------------------- a full disk
def test_a_full_disk_fails_the_run_naming_the_checkpoint_and_a_resume_completes(tmp_path, monkeypatch):
    import flowerdro.runs.files as files

    whole = run(_experiment(tmp_path / "whole"), verbose=False)
    cut = _experiment(tmp_path / "cut")
    folder = _run_dir(tmp_path / "cut")
    real_fsync = os.fsync
    written: list[int] = []

    def fsync(fd):  # the disk fills up while round 3's checkpoint is written
        if folder.is_dir() and any(n.startswith(".checkpoint_round0003") for n in os.listdir(folder)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    with pytest.raises(RunFileError) as err:
        run(cut, verbose=False)
    monkeypatch.undo()
    assert str(err.value) == (f"could not write checkpoint {folder / 'checkpoint_round0003.npz'}: "
                              "[Errno 28] No space left on device")
    assert written, "the earlier files went through the patched write"
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert [r["round"] for r in load_records(folder)] == [1, 2, 3]
    _same_run(run({**cut, "resume": True}, verbose=False), whole)  # space freed: the run goes on from round 2
