"""The typed-settings machinery: parsing, validation in one place, unknown keys, fixed fields."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from flowerdro.protocol import NodeSettings, TrainingSettings
from flowerdro.settings import (
    Settings,
    _osa_distance,
    check_known_keys,
    check_near_misses,
    describe,
    near_miss,
    read_settings,
    setting,
)
from flowerdro.strategies.base import LoopSettings
from flowerdro.strategies.registry import known_keys


@dataclass(frozen=True)
class Toy(Settings):
    gamma: float = setting(0.01, "γ", gt=0)
    steps: int = setting(10, "τ", ge=1)
    mode: str = setting("a", "a mode", choices=("a", "b"))
    ids: tuple[int, ...] = setting((), "ids", ge=0)
    flag: bool = setting(False, "a switch")
    cap: float | None = setting(None, "optional cap", gt=0)
    cell_size: int = setting(3, "a key that is not the field name", key="cell")


def test_values_from_strings_and_typed_values_give_the_same_settings():
    typed = read_settings(Toy, {"gamma": 0.5, "steps": 3, "mode": "b", "ids": [1, 2], "flag": True, "cap": 2.0})
    text = read_settings(Toy, {"gamma": "0.5", "steps": "3", "mode": "b", "ids": "1, 2", "flag": "true", "cap": "2"})
    assert typed == text == Toy(gamma=0.5, steps=3, mode="b", ids=(1, 2), flag=True, cap=2.0)


def test_unset_values_take_the_default_and_keys_follow_the_declaration():
    s = read_settings(Toy, {"gamma": "", "cap": None, "cell": 7})
    assert (s.gamma, s.cap, s.cell_size) == (0.01, None, 7)
    assert Toy.keys() == ("gamma", "steps", "mode", "ids", "flag", "cap", "cell")


@pytest.mark.parametrize("config,message", [
    ({"gamma": -1}, "gamma: must be > 0, got -1.0"),
    ({"gamma": "abc"}, "gamma: expected a number, got 'abc'"),
    ({"gamma": float("nan")}, "gamma: expected a finite number"),
    ({"steps": 2.5}, "steps: expected an integer, got 2.5"),
    ({"steps": 0}, "steps: must be >= 1, got 0"),
    ({"steps": True}, "steps: expected an integer, got True"),
    ({"mode": "c"}, "mode: unknown value 'c'; allowed: a, b"),
    ({"ids": "1,x"}, "ids: expected a comma-separated list of int"),
    ({"ids": "1,-2"}, "ids: must be >= 0, got -2"),
    ({"flag": "maybe"}, "flag: expected true or false"),
    ({"cell": "x"}, "cell: expected an integer"),
])
def test_bad_values_name_the_run_config_key_and_what_is_allowed(config, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        read_settings(Toy, config)


def test_direct_construction_is_validated_by_the_same_code():
    with pytest.raises(ValueError, match="^gamma: must be > 0"):
        Toy(gamma=0.0)


def test_fixed_fields_are_not_read_from_the_run_config():
    s = read_settings(Toy, {"steps": 10}, steps=1)
    assert s.steps == 1


def test_unknown_keys_are_refused_naming_the_closest_known_key():
    known = set(TrainingSettings.keys()) | set(LoopSettings.keys())
    with pytest.raises(ValueError, match=r"unknown keys 'learning-rate', 'local_steps' \(did you mean 'local-steps'\?\)"):
        check_known_keys({"local_steps": 3, "learning-rate": 0.1, "lr": 0.1}, known)
    check_known_keys({"lr": 0.1, "local-steps": 3}, known)  # known keys pass


def test_edit_distance_counts_edits_and_neighbour_swaps():
    # hand-worked: kitten → sitting is 3 substitutions/insertions; a swap of neighbours is 1
    assert _osa_distance("kitten", "sitting") == 3
    assert _osa_distance("lcoal", "local") == 1 and _osa_distance("ab", "ba") == 1
    assert _osa_distance("", "abc") == 3 and _osa_distance("same", "same") == 0
    assert _osa_distance("ca", "abc") == 3  # optimal string alignment: no edit of a swapped pair


@pytest.mark.parametrize("key,meant", [
    ("dual-lrr", "dual-lr"), ("lcoal-steps", "local-steps"), ("num-round", "num-rounds"),
    ("dual_lr", "dual-lr"), ("accuracy_metric", "accuracy-metric"), ("Batch-Size", "batch-size"),
    ("LR", "lr"), ("local-step", "local-steps"), ("dirichlet-alfa", "dirichlet-alpha"),
    ("fraction-evalute", "fraction-evaluate"),
])
def test_near_misses_of_flowerdro_keys_are_found(key, meant):
    assert near_miss(key, known_keys()) == meant


@pytest.mark.parametrize("key", [
    "num-server-rounds", "fraction-fit", "my-model-width", "local-epochs", "strategy", "partitioner",
    "min-available-clients", "momentum", "mode", "seeds", "mu2", "model-name", "learning-rate", "num-classes",
])
def test_a_projects_own_keys_are_no_near_misses(key):
    assert near_miss(key, known_keys()) is None


def test_near_misses_are_refused_together_and_own_keys_pass():
    known = known_keys()
    with pytest.raises(ValueError, match=r"'dual_lr' \(did you mean 'dual-lr'\?\), 'num-round' \(did you mean "
                                         r"'num-rounds'\?\).*own_keys=\('dual_lr', 'num-round',\)"):
        check_near_misses({"num-round": 3, "dual_lr": 0.1, "my-key": 1, "lr": 0.1}, known)
    check_near_misses({"num-round": 3, "dual_lr": 0.1}, known, own=("num-round", "dual_lr"))
    with pytest.raises(ValueError, match="own_keys: 'lr' is a flowerdro key"):
        check_near_misses({"lr": 0.1}, known, own=("lr",))


def test_describe_lists_every_key_with_its_default_and_meaning():
    rows = {r.key: r for r in describe(Toy)}
    assert rows["gamma"].default == 0.01 and rows["gamma"].allowed == "> 0" and rows["gamma"].meaning == "γ"
    assert rows["mode"].allowed == "a, b"
    assert rows["cap"].type == "float or unset"
    assert rows["ids"].type == "list of int"


@pytest.mark.parametrize("config,key", [
    ({"lr": -0.1}, "lr"), ({"lr": "abc"}, "lr"), ({"lr": 0}, "lr"), ({"lr": float("nan")}, "lr"),
    ({"local-steps": 0}, "local-steps"), ({"local-steps": 2.5}, "local-steps"), ({"batch-size": 0}, "batch-size"),
])
def test_client_training_settings_fail_on_the_server(config, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        read_settings(TrainingSettings, config)


@pytest.mark.parametrize("config,key", [
    ({"malicious-ids": "1;2"}, "malicious-ids"), ({"attack": "flip"}, "attack"), ({"hidden": "a,b"}, "hidden"),
    ({"model": "resnet"}, "model"),
])
def test_node_settings_fail_on_the_server(config, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        read_settings(NodeSettings, config)


def test_model_names_match_the_models_the_clients_can_build():
    from flowerdro.models import MODEL_NAMES

    assert set(NodeSettings.__dataclass_fields__["model"].metadata["choices"]) == set(MODEL_NAMES)
