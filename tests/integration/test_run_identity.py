"""A run knows what it is: a resume with other data, model or settings is refused by name, a
checkpoint of another run or another model is named and not used, a keyed checkpoint or a
keyed finished run edited without the key is refused, and no file is written through a
link planted in the output folder (in-process clients, the experiments runner)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from flowerdro.experiments import run
from flowerdro.runs import load_records
from flowerdro.runs.checkpoint import CheckpointError, read_checkpoint, save_checkpoint
from flowerdro.runs.identity import RunIdentityError
from flowerdro.runs.integrity import KEY_ENV, KEY_FILE_ENV, IntegrityError, RunKey

from ..conftest import records_without_wall_time


@pytest.fixture(autouse=True)
def no_plots(monkeypatch, request):
    """The figures take most of a small run's time; the link test draws them."""
    if request.node.name.startswith("test_links_planted"):
        return
    import flowerdro.runs.plots

    monkeypatch.setattr(flowerdro.runs.plots, "plot_comparison", lambda *a, **k: None)


def _experiment(root, name="drfa", rounds=4, **rc) -> dict:
    run_config = {"dataset": "synthetic", "partition": "natural", "model": "logreg", "lr": 0.05,
                  "local-steps": 3, "batch-size": 16, "synthetic-dim": 12, "synthetic-classes": 4,
                  "fraction-train": 0.5, "checkpoint-every": 1, **rc}
    return {"name": "ident", "num-rounds": rounds, "seeds": [0], "num-partitions": 4, "strategies": [name],
            "run-config": run_config, "output-root": str(root)}


def _run_dir(root, name="drfa"):
    return root / "ident" / name / "seed0"


def _same_run(a, b, name="drfa") -> None:
    assert records_without_wall_time(a.histories[name][0]) == records_without_wall_time(b.histories[name][0])
    for k in a.final_arrays[name][0].keys():
        np.testing.assert_array_equal(a.final_arrays[name][0][k].numpy(), b.final_arrays[name][0][k].numpy())


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    """A DRFA run cut after round 2 (its records and checkpoints of rounds 1 and 2 on disk), kept as a template."""
    from _pytest.monkeypatch import MonkeyPatch

    from flowerdro.strategies.observers import Observers

    root = tmp_path_factory.mktemp("cut")
    mp = MonkeyPatch()
    original = Observers.notify

    class Crash(Exception):
        pass

    def crashing(self, strategy, event, *args):
        original(self, strategy, event, *args)
        if event == "on_round" and args[0]["round"] == 2:
            raise Crash

    import flowerdro.runs.plots

    mp.setattr(flowerdro.runs.plots, "plot_comparison", lambda *a, **k: None)
    mp.setattr(Observers, "notify", crashing)
    try:
        with pytest.raises(Crash):
            run(_experiment(root), verbose=False)
    finally:
        mp.undo()
    return root


def _copy_cut(cut_run, tmp_path):
    import shutil

    shutil.copytree(cut_run, tmp_path / "cut")
    return tmp_path / "cut"


# --------------------------------------------------------------------------- a resume with other settings
#: Data and model keys of the run, a value other than the run's, and the line that names them.
CHANGED = [("data-seed", 1, "data-seed: 0 in the run, 1 now"),
           ("synthetic-alpha", 0.5, "synthetic-alpha: 1.0 in the run, 0.5 now"),
           ("synthetic-beta", 0.0, "synthetic-beta: 1.0 in the run, 0.0 now"),
           ("samples-per-client", 20, "samples-per-client: 0 in the run, 20 now"),
           ("validation-fraction", 0.2, "validation-fraction: 0.0 in the run, 0.2 now"),
           ("test-fraction", 0.3, "test-fraction: 0.2 in the run, 0.3 now"),
           ("synthetic-dim", 10, "synthetic-dim: 12 in the run, 10 now"),
           ("model", "mlp", "model: 'logreg' in the run, 'mlp' now"),
           ("hidden", "32", "hidden: [128, 64] in the run, [32] now"),
           ("precision", "float64", "precision: 'float32' in the run, 'float64' now"),
           ("model-seed", 3, "model-seed: unset in the run, 3 now"),
           ("lr", 0.1, "lr: 0.05 in the run, 0.1 now"),
           ("dual-lr", 0.1, "dual-lr: unset in the run, 0.1 now"),
           ("fraction-train", 1.0, "fraction-train: 0.5 in the run, 1.0 now")]


@pytest.mark.parametrize("key,new,line", CHANGED, ids=[c[0] for c in CHANGED])
def test_a_resume_with_another_data_or_model_key_is_refused_naming_it(cut_run, tmp_path, key, new, line):
    root = _copy_cut(cut_run, tmp_path)
    before = (_run_dir(root) / "rounds.jsonl").read_text()
    with pytest.raises(RunIdentityError) as err:
        run({**_experiment(root, **{key: new}), "resume": True}, verbose=False)
    msg = str(err.value)
    assert f"resume: the run in {_run_dir(root)} was started with other settings ({key})" in msg
    assert f"\n  {line}\n" in msg, msg
    assert (_run_dir(root) / "rounds.jsonl").read_text() == before  # refused before any message


def test_every_key_that_differs_is_named_with_both_values(cut_run, tmp_path):
    root = _copy_cut(cut_run, tmp_path)
    with pytest.raises(RunIdentityError) as err:
        run({**_experiment(root, **{"data-seed": 2, "model": "mlp", "lr": 0.1}), "resume": True}, verbose=False)
    lines = str(err.value).splitlines()
    assert "  data-seed: 0 in the run, 2 now" in lines
    assert "  lr: 0.05 in the run, 0.1 now" in lines
    assert "  model: 'logreg' in the run, 'mlp' now" in lines


def test_a_finished_run_asked_to_continue_with_other_settings_says_so(tmp_path):
    done = run(_experiment(tmp_path, rounds=2), verbose=False)
    with pytest.raises(RunIdentityError, match=r"finished its 2 rounds with other settings \(data-seed\):\n"
                                               r"  data-seed: 0 in the run, 1 now\nIt is kept as it is"):
        run({**_experiment(tmp_path, rounds=2, **{"data-seed": 1}), "resume": True}, verbose=False)
    again = run({**_experiment(tmp_path, rounds=2), "resume": True}, verbose=False)  # the same settings: read back
    _same_run(again, done)


def test_where_and_with_which_patch_release_a_run_goes_on_is_logged_not_refused(cut_run, tmp_path, monkeypatch,
                                                                                caplog):
    import flowerdro.runs.identity as identity

    whole = run(_experiment(tmp_path / "whole"), verbose=False)
    root = _copy_cut(cut_run, tmp_path)
    real = identity.versions()
    major, minor, patch = (real["flwr-version"].split(".") + ["0", "0"])[:3]
    monkeypatch.setattr(identity, "versions", lambda: {**real, "flwr-version": f"{major}.{minor}.{int(patch) + 1}"})
    with caplog.at_level(logging.WARNING):
        resumed = run({**_experiment(root, **{"data-dir": str(tmp_path)}), "resume": True}, verbose=False)
    assert "goes on, although it computed elsewhere or under other versions" in caplog.text
    assert f"data-dir: '' in the run, '{tmp_path}' now" in caplog.text
    assert f"flwr-version: '{real['flwr-version']}' in the run, '{major}.{minor}.{int(patch) + 1}' now" in caplog.text
    _same_run(resumed, whole)

    monkeypatch.setattr(identity, "versions", lambda: {**real, "flwr-version": f"{major}.{int(minor) + 1}.0"})
    root2 = _copy_cut(cut_run, tmp_path / "second")
    with pytest.raises(RunIdentityError, match=r"flwr-version: '[^']+' in the run, '[^']+' now"):
        run({**_experiment(root2), "resume": True}, verbose=False)


def test_another_run_in_the_folder_is_named_with_both_values(tmp_path):
    run(_experiment(tmp_path, rounds=1), verbose=False)
    with pytest.raises(ValueError, match=r"holds another run \(settings differ in synthetic-alpha\):\n"
                                         r"  synthetic-alpha: 1.0 there, 0.3 now"):
        run(_experiment(tmp_path, rounds=1, **{"synthetic-alpha": 0.3}), verbose=False)
    # what does not shape the result is not "another run"
    run(_experiment(tmp_path, rounds=1, **{"checkpoint-every": 0, "max-failed-rounds": 5}), verbose=False)


# --------------------------------------------------------------------------- checkpoints of another run or model
def test_a_checkpoint_copied_from_another_run_is_named_and_not_used(cut_run, tmp_path, caplog):
    other = tmp_path / "other"
    run(_experiment(other, rounds=3, **{"data-seed": 5}), verbose=False)
    root = _copy_cut(cut_run, tmp_path)
    whole = run(_experiment(tmp_path / "whole"), verbose=False)
    planted = _run_dir(root) / "checkpoint_round0003.npz"
    planted.write_bytes((_run_dir(other) / "checkpoint_round0003.npz").read_bytes())
    with caplog.at_level(logging.WARNING):
        resumed = run({**_experiment(root), "resume": True}, verbose=False)
    assert f"checkpoint {planted} belongs to another run (its data-seed differ)" in caplog.text
    assert "data-seed: 5 in the checkpoint, 0 in this run" in caplog.text
    _same_run(resumed, whole)  # resumed from round 2, its own


def test_a_checkpoint_whose_arrays_have_other_shapes_is_named_when_loaded(cut_run, tmp_path):
    root = _copy_cut(cut_run, tmp_path)
    path = _run_dir(root) / "checkpoint_round0002.npz"
    ckpt = read_checkpoint(path)
    state = dict(ckpt.state)
    weight = next(k for k in state["arrays"] if state["arrays"][k].ndim == 2)
    shape = state["arrays"][weight].shape
    state["arrays"] = {**state["arrays"], weight: np.zeros((shape[0], shape[1] - 2), state["arrays"][weight].dtype)}
    save_checkpoint(path, state, identity=ckpt.identity)  # its SHA-256 recomputed: intact as a file
    before = (_run_dir(root) / "rounds.jsonl").read_text()
    with pytest.raises(CheckpointError) as err:
        run({**_experiment(root), "resume": True}, verbose=False)
    assert str(err.value) == (f"checkpoint {path} holds a model that is not this run's: array '{weight}' has shape "
                              f"{(shape[0], shape[1] - 2)} and dtype float32, the clients' model {shape} and float32")
    assert (_run_dir(root) / "rounds.jsonl").read_text() == before  # no training message was sent


# --------------------------------------------------------------------------- the key
KEY = "k" * 32


def _edit_keeping_the_hmac(path) -> None:
    """Change the checkpoint's state in its meta entry, keep its HMAC entry and recompute its SHA-256."""
    from flowerdro.runs.checkpoint import _digest

    data = dict(np.load(path, allow_pickle=False))
    meta = json.loads(data["meta"].tobytes())
    meta["state"]["items"]["failed_in_row"] = 2
    data["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    arrays = {k: v for k, v in data.items() if k.startswith("a")}
    data["sha256"] = np.frombuffer(_digest(data["meta"].tobytes(), arrays).encode(), dtype=np.uint8)
    with path.open("wb") as fh:
        np.savez(fh, **data)


def test_a_keyed_checkpoint_edited_without_the_key_is_refused(tmp_path, monkeypatch, crash_after, caplog):
    monkeypatch.setenv(KEY_ENV, KEY)
    key = RunKey(KEY.encode())
    whole = run(_experiment(tmp_path / "whole"), verbose=False)
    for case in ("resaved", "hmac-kept"):
        cut = _experiment(tmp_path / case)
        crash_after(cut, 3)
        folder = _run_dir(tmp_path / case)
        third = folder / "checkpoint_round0003.npz"
        ckpt = read_checkpoint(third, key=key)
        assert ckpt.key_id == key.key_id
        if case == "resaved":  # another λ planted, the file written again: a fresh SHA-256 but no HMAC (no key)
            forged = dict(ckpt.state)
            forged["state"].lam = np.full_like(forged["state"].lam, 1.0 / len(forged["state"].lam))
            save_checkpoint(third, forged, identity=ckpt.identity)
            why = f"checkpoint {third} is not signed, and the run's key is set ({KEY_ENV})"
        else:  # the old HMAC entry kept, the SHA-256 fixed
            _edit_keeping_the_hmac(third)
            why = f"checkpoint {third} is refused: its HMAC does not match its content"
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            resumed = run({**cut, "resume": True}, verbose=False)
        assert why in caplog.text, caplog.text
        assert f"resuming from {folder / 'checkpoint_round0002.npz'} (round 2)" in caplog.text
        _same_run(resumed, whole)  # the intact checkpoint before it: the run as if nothing had happened


def test_a_keyed_run_is_refused_without_its_key_or_under_another(tmp_path, monkeypatch, crash_after):
    monkeypatch.setenv(KEY_ENV, KEY)
    cut = _experiment(tmp_path)
    crash_after(cut, 2)
    folder = _run_dir(tmp_path)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(CheckpointError, match=f"is signed \\(key id {RunKey(KEY.encode()).key_id}\\) but no key is "
                                              f"set: set {KEY_ENV} or {KEY_FILE_ENV}"):
        run({**cut, "resume": True}, verbose=False)
    monkeypatch.setenv(KEY_ENV, "x" * 32)
    with pytest.raises(CheckpointError, match="it was signed with another key"):
        run({**cut, "resume": True}, verbose=False)
    assert len(load_records(folder)) == 2


def test_a_keyed_finished_run_edited_afterwards_is_not_taken_from_disk(tmp_path, monkeypatch):
    key_file = tmp_path / "secret" / "run.key"
    key_file.parent.mkdir()
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    done = run(_experiment(tmp_path / "out", rounds=2), verbose=False)
    folder = _run_dir(tmp_path / "out")
    assert json.loads((folder / "signature.json").read_text())["key-id"] == RunKey(KEY.encode()).key_id
    again = run({**_experiment(tmp_path / "out", rounds=2), "resume": True}, verbose=False)
    _same_run(again, done)
    lines = (folder / "rounds.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    record["acc_worst"] = 1.0  # a better worst client, planted
    (folder / "rounds.jsonl").write_text("\n".join([*lines[:-1], json.dumps(record)]) + "\n")
    with pytest.raises(IntegrityError, match=f"{folder}/rounds.jsonl does not match its HMAC in signature.json"):
        run({**_experiment(tmp_path / "out", rounds=2), "resume": True}, verbose=False)


def test_a_key_file_inside_the_output_folder_is_refused(tmp_path, monkeypatch):
    key_file = tmp_path / "ident" / "key"
    key_file.parent.mkdir(parents=True)
    key_file.write_text(KEY)
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    with pytest.raises(ValueError, match=f"{KEY_FILE_ENV}: {key_file} lies inside the output folder"):
        run(_experiment(tmp_path, rounds=1), verbose=False)


# --------------------------------------------------------------------------- links planted in the output folder
def test_links_planted_in_the_output_folder_leave_their_targets_untouched(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    run_dir = _run_dir(out, "fedavg")
    run_dir.mkdir(parents=True)
    planted = {out / "ident" / "summary.json": outside / "summary.txt",
               out / "ident" / "table.md": outside / "table.txt",
               out / "ident" / "comparison.png": outside / "comparison.txt",
               run_dir / "progress.png": outside / "progress.txt",
               run_dir / "final_model.npz": outside / "model.txt",
               run_dir / "rounds.jsonl": outside / "rounds.txt"}
    for link, target in planted.items():
        target.write_text(f"precious {target.name}")
        os.symlink(target, link)
    run(_experiment(out, name="fedavg", rounds=1), verbose=False)
    for link, target in planted.items():
        assert target.read_text() == f"precious {target.name}", target
        assert link.is_file() and not link.is_symlink(), link
    assert (out / "ident" / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "ident" / "summary.json").read_text())["seeds"] == [0]

    # a file flowerdro reads back from the folder is refused as a link, never read through
    settings = run_dir / "settings.json"
    settings.unlink()
    os.symlink(outside / "summary.txt", settings)
    with pytest.raises(OSError, match=f"could not read settings {settings}: \\[Errno \\d+\\] it is a symbolic link"):
        run(_experiment(out, name="fedavg", rounds=1), verbose=False)
    assert (outside / "summary.txt").read_text() == "precious summary.txt"


def test_a_run_folder_planted_as_a_link_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "out" / "ident" / "fedavg").mkdir(parents=True)
    os.symlink(outside, tmp_path / "out" / "ident" / "fedavg" / "seed0")
    with pytest.raises(OSError, match="it is a symbolic link"):
        run(_experiment(tmp_path / "out", name="fedavg", rounds=1), verbose=False)
    assert not any(outside.iterdir())


def test_a_round_record_is_never_appended_through_a_link(tmp_path):
    from flowerdro.runs.files import RunFileError, append_text

    target = tmp_path / "target"
    target.write_text("precious\n")
    os.symlink(target, tmp_path / "rounds.jsonl")
    with pytest.raises(RunFileError, match=f"could not append the round record to {tmp_path / 'rounds.jsonl'}: "
                                           r"\[Errno \d+\] it is a symbolic link"):
        append_text(tmp_path / "rounds.jsonl", "{}\n", "the round record to")
    assert target.read_text() == "precious\n"


def test_the_lock_file_is_never_opened_through_a_link(tmp_path):
    from flowerdro.runs.files import RunFileError
    from flowerdro.runs.lock import FolderLock

    target = tmp_path / "target"
    target.write_text("precious\n")
    (tmp_path / "out").mkdir()
    os.symlink(target, tmp_path / "out" / "run.lock")
    with pytest.raises(RunFileError, match=f"could not take the lock {tmp_path / 'out' / 'run.lock'}: "
                                           r"\[Errno \d+\] it is a symbolic link"):
        FolderLock(tmp_path / "out").acquire()
    assert target.read_text() == "precious\n"
