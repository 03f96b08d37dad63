"""What the trackers log of a round record, and the run-config keys that choose them (no tracker library needed)."""

from __future__ import annotations

import numpy as np
import pytest

from flowerdro.runs import RunSettings
from flowerdro.runs.records import compact_record
from flowerdro.settings import read_settings
from flowerdro.strategies.registry import check_run_config
from flowerdro.trackers import client_distributions, flat_settings, load_factory, round_scalars

#: A DRFA-like round record, written out by hand.
RECORD = {
    "strategy": "drfa", "round": 4, "time_s": 0.25, "bytes_sent": 6760, "bytes_received": 1352,
    "failures": {"train:timeout": 2, "evaluate:error": 1},
    "train": {"num-examples": 96.0, "train_loss": 3.5},
    "acc_mean": 0.5, "acc_worst": 0.0, "acc_worst20": 0.125, "acc_n": 3.0, "loss_mean": 1.25,
    "client_acc": {"2": 0.75, "0": 0.0, "1": 0.75},
    "missing": {"3": "timeout"},
    "lambda": {"0": 0.5, "1": 0.25, "2": 0.25},
    "dual_lr": 0.02, "dual_step": "3/3 losses", "sampled": [0, 0, 2], "query_loss": {"0": 1.0},
}


def test_round_scalars_of_a_hand_written_record():
    assert round_scalars(RECORD) == {
        "cost/time_s": 0.25, "cost/bytes_sent": 6760.0, "cost/bytes_received": 1352.0,
        "failures/dropped": 3.0, "failures/train_timeout": 2.0, "failures/evaluate_error": 1.0,
        "failures/missing": 1.0,
        "train/num-examples": 96.0, "train/train_loss": 3.5,
        "fairness/acc_mean": 0.5, "fairness/acc_worst": 0.0, "fairness/acc_worst20": 0.125, "fairness/acc_n": 3.0,
        "fairness/loss_mean": 1.25,
        "lambda/0": 0.5, "lambda/1": 0.25, "lambda/2": 0.25,
        "server/dual_lr": 0.02,
    }


def test_client_distributions_are_in_partition_order():
    dists = client_distributions(RECORD)
    assert set(dists) == {"client_acc", "lambda"}
    np.testing.assert_array_equal(dists["client_acc"], [0.0, 0.75, 0.75])
    np.testing.assert_array_equal(dists["lambda"], [0.5, 0.25, 0.25])


def test_a_compacted_lambda_over_many_clients_is_a_histogram_unless_allowed_as_scalars():
    lam = {str(i): 1.0 / 1200 for i in range(1200)}
    rec = compact_record({"round": 1, "lambda": lam})
    assert not any(k.startswith("lambda/") for k in round_scalars(rec))
    assert len([k for k in round_scalars(rec, max_client_scalars=1200) if k.startswith("lambda/")]) == 1200
    np.testing.assert_array_equal(client_distributions(rec)["lambda"], np.full(1200, 1.0 / 1200))


def test_settings_become_hyperparameters():
    out = flat_settings({"lr": np.float64(0.1), "hidden": (128, 64), "dual_lr": None, "full": False, "n": 3})
    assert out == {"lr": 0.1, "hidden": "128,64", "dual_lr": "unset", "full": False, "n": 3}
    assert type(out["lr"]) is float


@pytest.mark.parametrize(("config", "message"), [
    ({"tracker": "tensorboard,comet"}, "tracker: unknown value 'comet'; allowed: tensorboard, mlflow, wandb"),
    ({"tracker": "mlflow,mlflow"}, "tracker: names an entry twice"),
    ({"wandb-mode": "cloud"}, "wandb-mode: unknown value 'cloud'; allowed: offline, online"),
])
def test_tracker_keys_are_validated_naming_the_key_and_allowed_values(config, message):
    with pytest.raises(ValueError, match=message):
        read_settings(RunSettings, config)


def test_the_tracker_files_follow_the_output_folder_unless_tracker_dir_is_set(tmp_path):
    from flowerdro.trackers.setup import tracker_root, where

    unset = read_settings(RunSettings, {"tracker": "tensorboard,mlflow,wandb"})
    assert tracker_root(unset, tmp_path / "out") == tmp_path / "out" / "trackers"
    assert tracker_root(read_settings(RunSettings, {"tracker": "wandb", "tracker-dir": " "}), tmp_path) == \
        tmp_path / "trackers"
    chosen = read_settings(RunSettings, {"tracker": "wandb", "tracker-dir": str(tmp_path / "t")})
    assert tracker_root(chosen, tmp_path / "out") == tmp_path / "t"
    with pytest.raises(ValueError, match="tracker-dir: unset, and this run writes no output folder for wandb"):
        tracker_root(read_settings(RunSettings, {"tracker": "mlflow,wandb", "mlflow-tracking-uri": "http://x"}), None)
    assert tracker_root(read_settings(RunSettings, {"tracker": "mlflow", "mlflow-tracking-uri": "http://x"}),
                        None) is None
    trackers = tmp_path / "out" / "trackers"
    assert where(unset, tmp_path / "out") == [
        f"results: {tmp_path / 'out'}",
        f"TensorBoard: {trackers / 'tensorboard'} (look: tensorboard --logdir {trackers / 'tensorboard'})",
        f"MLflow: sqlite:///{trackers / 'mlflow.db'} (look: mlflow ui --backend-store-uri "
        f"sqlite:///{trackers / 'mlflow.db'})",
        f"W&B: {trackers / 'wandb'} (upload: wandb sync {trackers / 'wandb'}/offline-run-*)"]


def test_a_misspelt_tracker_key_is_refused_naming_the_right_one():
    with pytest.raises(ValueError, match="'trackers' \\(did you mean 'tracker'\\?\\)"):
        check_run_config({"trackers": "tensorboard"})


@pytest.mark.parametrize(("path", "message"), [
    ("json.dumps", "expected an import path 'package.module:function'"),
    ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
    ("json:no_such_function", "'json' has no attribute 'no_such_function'"),
    ("json:__doc__", "is not callable"),
])
def test_observer_import_paths_are_checked(path, message):
    with pytest.raises(ValueError, match=f"observers: .*{message}"):
        load_factory(path)


def test_an_observer_import_path_gives_the_factory():
    import json

    assert load_factory("json:dumps") is json.dumps
    assert read_settings(RunSettings, {"observers": "a.b:c, d:e"}).observers == ("a.b:c", "d:e")


def test_the_run_settings_offer_exactly_the_trackers_and_wandb_modes_there_are():
    from flowerdro import trackers
    from flowerdro.runs import settings

    assert settings.TRACKERS == trackers.TRACKERS
    assert settings.WANDB_MODES == trackers.WANDB_MODES
