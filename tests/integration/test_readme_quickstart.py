"""The README's conversion of Flower's quickstart-pytorch, executed as written, on both APIs.

The snippets are read from README.md (``_quickstart.readme_snippets``) and applied to
offline stand-ins of the two published quickstarts (tests/fixtures/quickstart_pytorch:
``load_data(partition_id, num_partitions, batch_size)`` with dict batches, ``train(...)``
looping ``for _ in range(epochs)``, ``test(...) -> (loss, accuracy)``, the Message-API
server's ``train_config`` and ``evaluate_fn``); the converted projects then run on an
in-process grid. A README edit that breaks a pasted snippet fails here.
"""

from __future__ import annotations

import logging
import tomllib

import pytest

from flowerdro.strategies import strategy_names

from ._quickstart import (
    APIS,
    FIXTURES,
    PACKAGE,
    SNIPPETS,
    apply_snippet,
    convert,
    load,
    readme_snippets,
    run_config,
    run_in_process,
)

#: Every message type once (train, train.sgd, train.drfa + query.loss, query.loss_grad + train.scaffpd,
#: train.scaffold, train.fgm, train.drdsgd) and Flower's three baselines; all 19 run by hand, see the report.
STRATEGIES = ("fedavg", "fedprox", "qfedavg", "drfa", "scaffpd", "scaffold", "fedavg-fgm", "drdsgd", "fedmgda+")


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """Both stand-ins converted by the README (the Message-API server writes final_model.pt to the working folder)."""
    monkeypatch.chdir(tmp_path)
    return {api: convert(api, tmp_path / "converted") for api in APIS}


def _inner(api, out):
    strategy = out["strategies"][-1]
    return strategy.strategy if api == "legacy-api" else strategy


def test_the_readme_holds_every_snippet_the_tests_apply():
    snippets = readme_snippets()
    wanted = {"run-config", *(name for files in SNIPPETS.values() for name in files.values())}
    assert wanted <= set(snippets), sorted(wanted - set(snippets))
    config = tomllib.loads(snippets["run-config"][1])["tool"]["flwr"]["app"]["config"]
    assert config["strategy"] in strategy_names()


def test_a_replaced_statement_keeps_its_indentation_and_the_added_lines_go_before_it():
    source = "def f():\n    x = g(\n        1,\n    )\n    return x\n"
    got = apply_snippet(source, "import h\ny = h(  # note\n    2)  # was: x = g(...)\n")
    assert got == "def f():\n    import h\n    y = h(  # note\n        2)  # was: x = g(...)\n    return x\n"
    with pytest.raises(ValueError, match="0 statements begin with 'z = 1'"):
        apply_snippet(source, "z = 2  # was: z = 1\n")


@pytest.mark.parametrize("api", APIS)
def test_the_conversion_changes_only_the_snippets_lines(converted, api):
    import difflib

    snippets = readme_snippets()
    for name, snippet in SNIPPETS[api].items():
        before = (FIXTURES / api / PACKAGE / name).read_text().splitlines()
        after = (converted[api] / PACKAGE / name).read_text().splitlines()
        added = [line[1:].strip() for line in difflib.unified_diff(before, after, lineterm="", n=0)
                 if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
        expected = [line.strip() for line in snippets[snippet][1].splitlines() if line.strip() not in ("", "...")]
        assert added == expected, name


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("api", APIS)
def test_a_strategy_runs_through_the_converted_quickstart(converted, api, name):
    import torch

    root = converted[api]
    torch.manual_seed(0)
    out = run_in_process(api, root, run_config(root, strategy=name, **{"num-server-rounds": 2}))
    strategy = _inner(api, out)
    assert len(strategy.history) == 2
    assert not any(r["failures"] for r in strategy.history), strategy.history[-1]["failures"]
    for record in strategy.history:
        assert "train_loss" in record["train"]  # one meaning in every strategy: the received model's loss
        assert record["acc_n"] == 2  # fraction-evaluate = 0.5 of the 4 clients
    if api == "message-api":
        result = out["results"][-1]
        assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]  # the user's evaluate_fn, as Flower runs it
        for metrics in result.train_metrics_clientapp.values():
            assert "partition-id" not in metrics and "user-train-fn" not in metrics  # identifiers are not averaged
        assert set(result.evaluate_metrics_clientapp[2]) >= {"accuracy", "loss", "acc_mean", "acc_worst20"}


def test_the_clients_get_the_train_configs_lr_integer_epochs_and_the_settings_log_says_so(converted, caplog):
    # the quickstart's ServerApp passes train_config={"lr": learning-rate}; its train loops range(epochs)
    import torch

    root = converted["message-api"]
    client, server = load(root)
    seen, train = [], client.train_fn

    def spy(net, loader, epochs, lr, device):
        seen.append((type(epochs), epochs, lr))
        return train(net, loader, epochs, lr, device)

    client.kit.train_fn = lambda net, loader, a: spy(net, loader, a.epochs, a.lr, a.device)
    caplog.set_level(logging.INFO, logger="flwr")
    torch.manual_seed(0)
    rc = run_config(root, strategy="fedavg", **{"num-server-rounds": 1, "learning-rate": 0.2})
    run_in_process("message-api", root, rc, modules=(client, server))
    assert set(seen) == {(int, 1, 0.2)}
    assert "lr = 0.2 (the train config passed to the strategy; the setting says 0.05)" in caplog.text


def test_an_algorithm_that_overrides_the_train_configs_lr_says_so(converted, caplog):
    import torch

    root = converted["message-api"]
    caplog.set_level(logging.INFO, logger="flwr")
    torch.manual_seed(0)
    run_in_process("message-api", root, run_config(root, strategy="scaffold", **{"num-server-rounds": 1}))
    assert ("lr = 0.05 (scaffold's own; the train config passed to the strategy asks for 0.1, which is not used)"
            in caplog.text)


@pytest.mark.parametrize("api", APIS)
def test_dict_batches_without_batch_keys_name_the_class_the_user_built(converted, api):
    import torch

    root = converted[api]
    path = root / PACKAGE / "client_app.py"
    path.write_text(path.read_text().replace(', batch_keys=("img", "label")', ""))
    torch.manual_seed(0)
    # the Message API stops in round 1 (every client fails alike); the legacy adapter cannot get its initial model
    with pytest.raises(RuntimeError, match="all 4 clients failed with the same error|query.init failed") as err:
        run_in_process(api, root, run_config(root, strategy="fedavg", **{"num-server-rounds": 1}))
    owner = "ClientKit" if api == "message-api" else "LegacyClientApp"
    assert f"pass batch_keys=(input key, label key) to {owner}, e.g. batch_keys=('img', 'label')" in str(err.value)


@pytest.mark.parametrize("returned", ["accuracy", "my_acc"])
def test_a_metric_name_set_once_in_the_run_config_reaches_the_legacy_client(converted, returned):
    # accuracy-metric = "my_acc" in the run config only: the NumPyClient's evaluate may return its
    # accuracy as "my_acc" or as "accuracy", and no LegacyClientApp(..., test_accuracy_key=...) is needed
    import torch

    root = converted["legacy-api"]
    path = root / PACKAGE / "client_app.py"
    path.write_text(path.read_text().replace('{"accuracy": accuracy}', f'{{"{returned}": accuracy}}'))
    torch.manual_seed(0)
    out = run_in_process("legacy-api", root, run_config(root, strategy="drfa", **{
        "num-server-rounds": 1, "accuracy-metric": "my_acc"}))
    record = _inner("legacy-api", out).history[-1]
    assert not record["failures"] and record["acc_n"] == 2  # fraction-evaluate = 0.5 of 4 clients
