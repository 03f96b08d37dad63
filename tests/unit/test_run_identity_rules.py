"""The rules of a run's identity and of its key, checked on small hand-made cases."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import pytest

from flowerdro.runs.checkpoint import (
    CheckpointError,
    check_model_arrays,
    read_checkpoint,
    save_checkpoint,
)
from flowerdro.runs.identity import compare_identities, own_key_digest, run_identity
from flowerdro.runs.integrity import KEY_ENV, KEY_FILE_ENV, RunKey, run_key
from flowerdro.strategies.registry import build_strategy, known_keys, strategy_identity

BASE = {"strategy": "drfa", "lr": 0.05, "data-seed": 0, "device": "auto", "threads": 1, "data-dir": "",
        "flowerdro-version": "0.1.0", "flwr-version": "1.41.0"}


def _keys(diffs):
    return [d.key for d in diffs]


@pytest.mark.parametrize("change,refused,warned", [
    ({"lr": 0.1}, ["lr"], []),
    ({"data-seed": 1, "lr": 0.1}, ["data-seed", "lr"], []),
    ({"device": "cpu", "threads": 4, "data-dir": "/data"}, [], ["data-dir", "device", "threads"]),
    ({"flwr-version": "1.41.2"}, [], ["flwr-version"]),        # a patch release: the same minor series
    ({"flwr-version": "1.42.0"}, ["flwr-version"], []),        # another minor release: refused
    ({"flowerdro-version": "0.1.1"}, [], ["flowerdro-version"]),
    ({"flowerdro-version": "0.2.0"}, ["flowerdro-version"], []),
    ({"flwr-version": "1.41.0rc1"}, [], ["flwr-version"]),
    ({"flwr-version": "unknown"}, ["flwr-version"], []),       # no major.minor to compare: refused
])
def test_what_is_refused_and_what_is_warned(change, refused, warned):
    r, w = compare_identities(BASE, {**BASE, **change})
    assert (_keys(r), _keys(w)) == (refused, warned)


def test_a_key_one_side_lacks_is_refused_unless_flowerdros_version_differs():
    r, w = compare_identities(BASE, {**BASE, "new-setting": 1})
    assert (_keys(r), _keys(w)) == (["new-setting"], [])
    assert r[0].text() == "new-setting: not recorded in the run, 1 now"
    r, w = compare_identities(BASE, {**BASE, "new-setting": 1, "flowerdro-version": "0.1.1"})
    assert (_keys(r), _keys(w)) == ([], ["flowerdro-version", "new-setting"])


def test_the_identity_holds_the_data_model_and_own_keys_and_leaves_out_the_plan():
    rc = {"dataset": "synthetic", "synthetic-alpha": 0.5, "model": "mlp", "hidden": "16", "my-path": "/secret/x",
          "num-rounds": 7, "checkpoint-every": 2, "output-dir": "out", "lr": 0.1}
    ident = strategy_identity(build_strategy("afl", rc), rc, algorithm="afl")
    assert ident["strategy"] == "afl" and ident["local-steps"] == 1  # the registry's fixed τ = 1
    assert (ident["synthetic-alpha"], ident["model"], ident["hidden"], ident["lr"]) == (0.5, "mlp", [16], 0.1)
    assert ident["num-partitions"] is None  # the nodes' config decides
    assert ident["own:my-path"] == "sha256:" + hashlib.sha256(b'"/secret/x"').hexdigest()
    assert "/secret/x" not in str(ident)
    for left_out in ("num-rounds", "checkpoint-every", "output-dir", "resume", "max-failed-rounds",
                     "min-available-nodes", "round-timeout"):
        assert left_out not in ident
    other = strategy_identity(build_strategy("afl", {**rc, "my-path": "/secret/y"}), {**rc, "my-path": "/secret/y"},
                              algorithm="afl")
    assert _keys(compare_identities(ident, other)[0]) == ["own:my-path"]
    assert own_key_digest({"b": 1, "a": [1, 2]}) == own_key_digest({"a": (1, 2), "b": 1})


def test_the_identity_takes_the_keys_it_knows_and_the_settings_that_shape_a_result_from_its_caller():
    """The run folders know no strategy: which keys are flowerdro's, and central DP's settings, are handed in."""
    from flowerdro.privacy import PrivacySettings

    rc = {"dataset": "synthetic", "lr": 0.1, "my-key": 3, "dp-noise-multiplier": 0.7}
    strategy = build_strategy("drfa", rc)
    bare = run_identity(strategy, rc, known_keys=known_keys())
    assert bare["own:my-key"] == own_key_digest(3) and "dp-noise-multiplier" not in bare
    given = run_identity(strategy, rc, known_keys=known_keys() | {"my-key"}, settings_classes=[PrivacySettings])
    assert "own:my-key" not in given
    assert (given["dp-noise-multiplier"], given["dp"], given["dp-clipping-norm"]) == (0.7, "", 1.0)
    assert strategy_identity(strategy, rc) == {**given, "own:my-key": own_key_digest(3)}
    with pytest.raises(TypeError, match="known_keys is required"):
        run_identity(strategy, rc)
    assert "dataset" not in run_identity(strategy)  # no run config: what the strategy knows


# --------------------------------------------------------------------------- the key
def test_a_key_comes_from_the_environment_and_is_refused_where_it_protects_nothing(tmp_path):
    assert run_key(environ={}) is None
    key = run_key(environ={KEY_ENV: "s" * 20})
    assert key.secret == b"s" * 20 and key.key_id == hmac.new(b"s" * 20, b"flowerdro key id",
                                                                hashlib.sha256).hexdigest()[:16]
    with pytest.raises(ValueError, match=f"{KEY_ENV}: the key has 5 bytes; at least 16"):
        run_key(environ={KEY_ENV: "short"})
    with pytest.raises(ValueError, match="are both set"):
        run_key(environ={KEY_ENV: "s" * 20, KEY_FILE_ENV: "/x"})
    (tmp_path / "out").mkdir()
    inside = tmp_path / "out" / "key"
    inside.write_text("s" * 20 + "\n")
    with pytest.raises(ValueError, match="lies inside the output folder"):
        run_key(tmp_path / "out", environ={KEY_FILE_ENV: str(inside)})
    outside = tmp_path / "key"
    outside.write_text("s" * 20 + "\n")
    assert run_key(tmp_path / "out", environ={KEY_FILE_ENV: str(outside)}).secret == b"s" * 20
    with pytest.raises(ValueError, match="cannot read the key file"):
        run_key(environ={KEY_FILE_ENV: str(tmp_path / "missing")})


def test_the_hmac_is_that_of_the_payload_under_the_key(tmp_path):
    key = RunKey(b"k" * 32)
    path = save_checkpoint(tmp_path / "c.npz", {"round": 1, "x": np.arange(3.0)}, identity={"lr": 0.1}, key=key)
    with np.load(path, allow_pickle=False) as data:
        meta, mac, a0 = data["meta"].tobytes(), data["hmac"].tobytes().decode(), data["a0"]
    # recomputed by hand: meta, then each array's name, dtype, shape and bytes
    expected = hmac.new(b"k" * 32, meta + f"\0a0\0{a0.dtype.str}\0{a0.shape}\0".encode() + a0.tobytes(),
                        hashlib.sha256).hexdigest()
    assert mac == expected
    ckpt = read_checkpoint(path, key=key)
    assert ckpt.identity == {"lr": 0.1} and ckpt.key_id == key.key_id and ckpt.round == 1


# --------------------------------------------------------------------------- the model in a checkpoint
def test_a_checkpoints_model_is_checked_by_name_shape_and_dtype():
    model = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)}
    good = {"arrays": dict(model), "state": {"control": [np.zeros((3, 2)), np.zeros(3)]}}
    check_model_arrays(good, model, "c.npz")
    cases = [
        ({"arrays": {"w": model["w"]}}, "checkpoint c.npz holds a model that is not this run's: it lacks b "
                                        "(the clients' model has w, b)"),
        ({"arrays": {"b": model["b"], "w": model["w"]}}, "its arrays are in another order"),
        ({"arrays": {**model, "w": np.zeros((3, 2), np.float64)}},
         "array 'w' has shape (3, 2) and dtype float64, the clients' model (3, 2) and float32"),
        ({"arrays": model, "state": {"control": [np.zeros((2, 2)), np.zeros(3)]}},
         "checkpoint c.npz holds state that does not fit the model: state['control'] has shape (2, 2) for 'w', "
         "the clients' model (3, 2)"),
    ]
    for state, error in cases:
        with pytest.raises(CheckpointError) as err:
            check_model_arrays(state, model, "c.npz")
        assert error in str(err.value)
