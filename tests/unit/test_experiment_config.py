"""Experiment files and run configs: typos and malformed values fail before any training."""

from __future__ import annotations

import pytest

from flowerdro.experiments.runner import plans_of
from flowerdro.strategies.registry import check_run_config

BASE = {"name": "t", "strategies": ["fedavg"], "run-config": {"dataset": "synthetic", "lr": 0.1}}


@pytest.mark.parametrize("config,message", [
    ({"run-config": {"learning-rate": 0.1}}, r"\[run-config\]: unknown key 'learning-rate'"),
    ({"run-config": {"local_steps": 3}}, r"'local_steps' \(did you mean 'local-steps'\?\)"),
    ({"strategy": {"fedavg": {"lr": 0.1, "fraction_train": 0.5}}},
     r"\[strategy.fedavg\]: unknown key 'fraction_train' \(did you mean 'fraction-train'\?\)"),
    ({"num_rounds": 3}, r"experiment file .*unknown key 'num_rounds' \(did you mean 'num-rounds'\?\)"),
    ({"seeds": []}, r"seeds: expected a non-empty list"),
    ({"seeds": "0,1"}, r"seeds: expected a non-empty list"),
    ({"strategies": []}, r"strategies: expected a non-empty list"),
    ({"round-timeout": -1}, r"round-timeout: must be a number of seconds > 0"),
    ({"num-rounds": 0}, r"num-rounds: must be an integer >= 1"),
])
def test_bad_experiment_files_fail_naming_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        plans_of({**BASE, **config}, None)


def test_strategies_as_one_comma_separated_string_name_each_strategy():
    plans = plans_of({**BASE, "strategies": "fedavg, drfa"}, None)
    assert [p.algorithm for p in plans] == ["fedavg", "drfa"]


def test_a_run_config_with_a_typo_is_refused_by_flowerdros_entry_points():
    with pytest.raises(ValueError, match=r"run config: unknown key 'num-round' \(did you mean 'num-rounds'\?\)"):
        check_run_config({"num-round": 3})


def test_pyprojects_default_run_config_holds_only_known_keys_with_valid_values():
    import tomllib
    from pathlib import Path

    from flowerdro.settings import read_settings
    from flowerdro.strategies.registry import settings_groups

    config = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    run_config = config["tool"]["flwr"]["app"]["config"]
    check_run_config(run_config)
    for group in settings_groups().values():
        for cls in group:
            read_settings(cls, run_config)  # every default value is valid where it is declared
