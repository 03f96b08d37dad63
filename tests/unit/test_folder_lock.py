"""One run per output folder: the lock, its holder file, a stale lock, errors that name the path."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flowerdro.runs.files import RunFileError, append_text
from flowerdro.runs.lock import FolderInUseError, FolderLock


def test_a_second_holder_is_refused_naming_the_folder_and_the_holder(tmp_path):
    first, second = FolderLock(tmp_path / "out", run_id=77), FolderLock(tmp_path / "out")
    first.acquire()
    holder = json.loads((tmp_path / "out" / "run.lock.json").read_text())
    assert (holder["pid"], holder["host"], holder["run_id"]) == (os.getpid(), socket.gethostname(), 77)
    with pytest.raises(FolderInUseError) as err:
        second.acquire()
    msg = str(err.value)
    assert f"output-dir: {tmp_path / 'out'} is in use by another run" in msg
    assert f"flwr run 77, pid {os.getpid()} on host {socket.gethostname()}, started {holder['started']}" in msg
    first.release()
    assert not (tmp_path / "out" / "run.lock.json").exists()
    second.acquire()  # free again
    assert second.held and json.loads((tmp_path / "out" / "run.lock.json").read_text())["run_id"] is None
    second.release()
    second.release()  # twice is harmless


def test_the_lock_of_a_killed_process_is_taken_over_with_a_warning(tmp_path, caplog):
    # another process takes the lock and writes its holder file as FolderLock does
    # (filelock and json only, so it starts fast), then is killed without releasing
    folder = tmp_path / "out"
    folder.mkdir()
    code = ("import filelock, json, os, socket, sys, time\n"
            f"lock = filelock.FileLock({str(folder / 'run.lock')!r})\nlock.acquire()\n"
            f"open({str(folder / 'run.lock.json')!r}, 'w').write(json.dumps("
            "{'pid': os.getpid(), 'host': socket.gethostname(), 'run_id': 5, 'started': 'earlier'}))\n"
            "print('held', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUseError, match=f"flwr run 5, pid {proc.pid} on host"):
            FolderLock(folder).acquire()  # held by another process
        os.kill(proc.pid, signal.SIGKILL)  # it never releases: its holder file stays
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert json.loads((folder / "run.lock.json").read_text())["pid"] == proc.pid
    lock = FolderLock(folder)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert lock.held
    assert f"taking over the lock of {folder} from flwr run 5, pid {proc.pid}" in caplog.text
    assert f"process {proc.pid} is gone" in caplog.text
    assert json.loads((folder / "run.lock.json").read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_folder_without_write_permission_is_named(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(RunFileError, match=f"could not take the lock {folder / 'run.lock'}: \\[Errno 13\\]"):
            FolderLock(folder).acquire()
    finally:
        folder.chmod(0o700)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_device_is_named_with_its_path():
    # /dev/full answers every write with ENOSPC: the kernel's own "No space left on device"
    with pytest.raises(RunFileError) as err:
        append_text(Path("/dev/full"), "x" * 10_000 + "\n", "the round record to")
    assert err.value.errno == errno.ENOSPC
    assert str(err.value) == "could not append the round record to /dev/full: [Errno 28] No space left on device"


def test_a_permission_error_names_the_file_and_leaves_the_old_one(tmp_path, monkeypatch):
    # root writes into read-only folders, so the refusal is simulated where the file is created
    import tempfile

    from flowerdro.runs.files import write_atomic

    target = tmp_path / "settings.json"
    target.write_text("{}")

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(RunFileError) as err:
        write_atomic(target, lambda fh: fh.write(b"{}"), "settings")
    assert str(err.value) == f"could not write settings {target}: [Errno 13] Permission denied"
    assert isinstance(err.value, OSError) and err.value.errno == errno.EACCES
    assert [p.name for p in tmp_path.iterdir()] == ["settings.json"] and target.read_text() == "{}"
