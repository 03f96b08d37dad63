"""The checkpoint file: every kind of server state back exactly, damage named, nothing executed on load."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import zipfile

import numpy as np
import pytest

import flowerdro.strategies  # noqa: F401  # registers the algorithms' state classes
from flowerdro.runs.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from flowerdro.runs.codec import CodecError, decode, encode, register_state
from flowerdro.strategies.drfa import DRFAState
from flowerdro.strategies.replies import Failure
from flowerdro.strategies.scaffpd import SCAFFPDState


def _identical(a, b, where="state"):
    """Assert ``a`` and ``b`` equal in type, value, dtype, shape and bits (an independent walk)."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, np.ndarray | np.generic):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _identical(k, list(b)[list(a).index(k)], f"{where} key")
            _identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _identical(x, y, f"{where}[{i}]")
    elif isinstance(a, set | frozenset):
        assert a == b, where
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _identical(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, float):
        assert repr(a) == repr(b), where  # -0.0, nan and inf included
    else:
        assert a == b, where


def _state() -> dict:
    """A checkpoint with every kind of value the strategies keep."""
    rng = np.random.default_rng(123)
    rng.random(7)  # a state with a non-zero position and large integers
    return {
        "round": 3,
        "arrays": {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.arange(3, dtype=np.float64)},
        "rng": rng.bit_generator.state,
        "node_to_partition": {1234567890123: 0, 42: 1},
        "partitions_seen": [0, 1],
        "failures": [Failure(2, "train", 42, None, "timeout", "no reply within 1.0 s")],
        "results": {0: {"test_acc": 0.5, "test_loss": float("nan")}, 1: {"test_acc": -0.0, "x": float("inf")}},
        "history": [{"round": 1, "client_acc": {"0": 0.25}, "lambda": np.float32(0.1), "n": np.int64(7)}],
        "failed_in_row": 0,
        "state": SCAFFPDState(
            partitions=[0, 1], lam=np.array([0.25, 0.75]), loss_prev={0: 1.5, 1: 2.5},
            memory={0: (1.5, [np.ones(2, dtype=np.float32), np.zeros((2, 2))])}, steps=(0.1, 0.2, 0.3, 0.4)),
        "misc": {"flag": np.bool_(True), "empty": np.zeros((0, 5), dtype=np.int16), "scalar0d": np.array(2.5),
                 "uint": np.arange(4, dtype=np.uint8), "frozen": frozenset({3, 1}), "set": {2}, "none": None,
                 (1, "a"): "tuple key", "big": 2**130 + 1},
        "drfa": DRFAState(partitions=[0, 1], lam=np.array([0.5, 0.5]), dual_lr=None, sizes={0: 10, 1: 20},
                          average=None, num_averaged=0),
    }


def test_every_kind_of_value_comes_back_identical(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path / "checkpoint_round0003.npz", state)
    back = load_checkpoint(path)
    _identical(back, state)
    # the generator state continues the same stream
    a, b = np.random.default_rng(), np.random.default_rng()
    a.bit_generator.state, b.bit_generator.state = state["rng"], back["rng"]
    np.testing.assert_array_equal(a.random(5), b.random(5))


def test_the_file_is_an_npz_of_plain_arrays_and_json(tmp_path):
    path = save_checkpoint(tmp_path / "c.npz", _state())
    with zipfile.ZipFile(path) as z:
        names = sorted(z.namelist())
    assert "meta.npy" in names and "sha256.npy" in names
    with np.load(path, allow_pickle=False) as data:  # readable without pickle, every entry
        assert all(not data[n].dtype.hasobject for n in data.files)
        import json
        meta = json.loads(data["meta"].tobytes())
    assert (meta["format"], meta["version"], meta["round"]) == ("flowerdro-checkpoint", 2, 3)


def test_a_failed_write_leaves_no_temporary_file_and_the_old_checkpoint(tmp_path, monkeypatch):
    import errno

    import flowerdro.runs.files as files

    path = save_checkpoint(tmp_path / "checkpoint_round0003.npz", _state())

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError) as err:
        save_checkpoint(path, {**_state(), "round": 3, "failed_in_row": 1})
    assert str(err.value) == f"could not write checkpoint {path}: [Errno 28] No space left on device"
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert load_checkpoint(path)["failed_in_row"] == 0


# --------------------------------------------------------------------------- what is refused
def test_values_without_an_exact_form_are_refused_naming_where():
    @dataclasses.dataclass
    class Unregistered:
        x: int = 0

    with pytest.raises(CodecError, match=r"state\['state'\].*Unregistered is not a registered"):
        encode({"state": Unregistered()})
    with pytest.raises(CodecError, match=r"state\['a'\]\[1\]: an array of dtype object"):
        encode({"a": [1, np.array([None, 1], dtype=object)]})
    with pytest.raises(CodecError, match=r"state\['f'\]: a value of type builtins.function"):
        encode({"f": lambda: 0})
    with pytest.raises(CodecError, match="not fields: cache"):
        st = DRFAState()
        st.cache = 1
        encode(st)


def test_a_class_name_in_the_file_is_looked_up_never_imported():
    tree, arrays = encode(DRFAState())
    for name in ("os.system", "subprocess.Popen", "builtins.eval", "Popen"):
        with pytest.raises(CodecError, match="is not registered"):
            decode({**tree, "type": name}, arrays)
    fields = dict(tree["fields"])
    fields.pop("sizes")
    with pytest.raises(CodecError, match="holds fields"):
        decode({**tree, "fields": fields}, arrays)
    with pytest.raises(CodecError, match="unknown tag"):
        decode({"@": "pickle", "v": "gASV"}, {})


def test_two_state_classes_of_one_name_are_refused():
    @dataclasses.dataclass
    class DRFAState:  # noqa: F811  # same name as the registered one, on purpose
        x: int = 0

    with pytest.raises(TypeError, match="has the name of the registered"):
        register_state(DRFAState)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "checksum", "bit flip"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    path = save_checkpoint(tmp_path / "checkpoint_round0003.npz", _state())
    data = path.read_bytes()
    if damage == "truncated":
        _write(path, data[: len(data) // 2])
    elif damage == "garbage":
        _write(path, os.urandom(len(data)))
    elif damage == "empty":
        _write(path, b"")
    elif damage == "checksum":  # a valid archive whose content was changed after the checksum
        with np.load(path, allow_pickle=False) as z:
            entries = {n: z[n] for n in z.files}
        entries["a0"] = entries["a0"] + 1
        buf = io.BytesIO()
        np.savez(buf, **entries)
        _write(path, buf.getvalue())
    else:  # one bit of the stored JSON: the zip CRC or the checksum sees it
        flipped = bytearray(data)
        flipped[data.index(b'"flowerdro-checkpoint"') + 3] ^= 0x01
        _write(path, bytes(flipped))
    with pytest.raises(CheckpointError, match=f"checkpoint {path} (is damaged|cannot be used)"):
        load_checkpoint(path)


class _Marker:
    """Unpickling this creates a folder: the proof that code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("form", ["pickle as .npz", "object array in .npz", "pickle as .pkl"])
def test_a_crafted_file_is_refused_and_its_code_never_runs(tmp_path, form):
    marker = tmp_path / "code-ran"
    payload = {"round": 3, "state": _Marker(marker)}
    if form == "pickle as .npz":
        path = _write(tmp_path / "checkpoint_round0003.npz", pickle.dumps(payload))
    elif form == "object array in .npz":
        path = tmp_path / "checkpoint_round0003.npz"
        obj = np.empty(1, dtype=object)
        obj[0] = _Marker(marker)
        with path.open("wb") as fh:
            np.savez(fh, meta=np.frombuffer(b"{}", dtype=np.uint8), sha256=np.zeros(64, np.uint8), a0=obj)
    else:
        path = _write(tmp_path / "checkpoint_round0003.pkl", pickle.dumps(payload))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)
    if form == "pickle as .pkl":
        assert f"python -m flowerdro.runs.migrate {tmp_path}" in str(err.value)
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Marker(marker)))  # the payload does run code when unpickled
    assert marker.is_dir()
