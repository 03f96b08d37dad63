"""Checks of a run config and of the nodes' configs, made on the server before any training message.

A value the clients would trip over in round 1 (inside a long traceback, or every round
as an error reply that never names the key) is refused here, naming the key, the value
and what is allowed:

* :func:`check_run_config_values`: the data keys of a run config (types, ranges and their
  combinations: a partition the data set has, ``num-partitions`` a partition allows, a
  model the data set can feed). flowerdro's comparison driver calls it for every run
  before the first message (the ServerApp and the experiments runner); the round loop,
  the clients' training and model keys and the algorithms' keys are checked where their
  strategy is built (:func:`~flowerdro.strategies.registry.build_strategy`).
* :func:`check_node_config`: a node's ``partition-id`` and ``num-partitions`` (integers,
  ``0 <= partition-id < num-partitions``). A node answers the server's roll call
  (``query.init`` with ``weights = false``) with the raw values of a node config that
  fails it (:func:`roll_call_reply`), and the server, which checks every roll-call reply
  (:func:`roll_call_problem`), refuses the node at the roll call with the reason, before
  any training message: ``partition-id: expected an integer, got 'abc'``. With the run
  config at hand (flowerdro's driver gives the Communicator its run config) the node's
  ``num-partitions`` is also checked against the data keys (``one-class`` with more
  partitions than classes, Adult's domain split with other than 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowerdro.settings import Settings, read_settings, setting, unset

if TYPE_CHECKING:
    from flwr.app import Context, Message

    from flowerdro.data.config import DataConfig

__all__ = ["IMAGE_DATASETS", "NODE_CONFIG_RECORD", "NodeConfig", "check_model_data", "check_node_config",
           "check_run_config_values", "data_config", "roll_call_problem", "roll_call_reply"]

#: Data sets whose inputs are images (channels, height, width): the ones a CNN can take.
IMAGE_DATASETS: tuple[str, ...] = ("fashion_mnist", "mnist", "cifar10")
#: Models that take images.
IMAGE_MODELS: tuple[str, ...] = ("cnn_cifar10", "cnn_femnist", "cnn_fmnist", "cnn_mnist", "lenet")
#: Models with one real output (a regression data set needs one; a classification data set cannot use one).
REGRESSION_MODELS: tuple[str, ...] = ("linear",)
#: The ConfigRecord of a roll-call reply that carries the node config's raw values.
NODE_CONFIG_RECORD = "node-config"


@dataclass(frozen=True)
class NodeConfig(Settings):
    """A SuperNode's ``--node-config`` keys that say which part of the federation it is."""

    partition_id: int | None = setting(None, "the node's partition (0 .. num-partitions - 1)", ge=0)
    num_partitions: int | None = setting(None, "N, the number of partitions of the federation", ge=1)

    def check(self) -> None:
        """``partition-id`` lies in ``0 .. num-partitions - 1``."""
        if self.partition_id is not None and self.num_partitions is not None \
                and not self.partition_id < self.num_partitions:
            raise ValueError(f"partition-id {self.partition_id} is outside 0..{self.num_partitions - 1} "
                             f"(num-partitions = {self.num_partitions})")


def check_node_config(node_config: Mapping[str, Any]) -> NodeConfig:
    """A node config's ``partition-id`` and ``num-partitions``, checked (absent keys are None).

    Raises
    ------
    ValueError
        Naming the key, the value and what is allowed (``partition-id: expected an
        integer, got 'abc'``; ``partition-id 5 is outside 0..3 (num-partitions = 4)``).
    """
    return read_settings(NodeConfig, {k: node_config.get(k) for k in NodeConfig.keys()})


def roll_call_reply(message: Message, context: Context) -> Message | None:
    """A node's roll-call reply when its node config fails :func:`check_node_config`, else None.

    The reply holds ``metrics`` ``{num-examples: 0}`` and the ConfigRecord
    :data:`NODE_CONFIG_RECORD` with the raw ``partition-id`` and ``num-partitions``, so that
    the server refuses the node naming the key and the value (:func:`roll_call_problem`)
    instead of every later message failing on the node without naming them.
    """
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    cfg = context.node_config
    try:
        check_node_config(cfg)
    except ValueError:
        raw = {k: cfg[k] for k in NodeConfig.keys() if k in cfg}
        content = RecordDict({"metrics": MetricRecord({"num-examples": 0}),
                              NODE_CONFIG_RECORD: ConfigRecord(raw)})
        return Message(content=content, reply_to=message)
    return None


def roll_call_problem(reply: Message, run_config: Mapping[str, Any] | None = None) -> str | None:
    """Why the server refuses the node that sent roll-call ``reply`` (None: it does not).

    The node config's values are those of the reply's :data:`NODE_CONFIG_RECORD` when it
    has one (a node whose config failed its own check), else the ``partition-id`` and
    ``num-partitions`` of its metrics; :func:`check_node_config` checks them. With
    ``run_config``, the node's ``num-partitions`` must also suit the data keys
    (:func:`check_run_config_values`).
    """
    content = reply.content
    raw: dict[str, Any] = {}
    record = content.config_records.get(NODE_CONFIG_RECORD)
    if record is not None:
        raw = dict(record)
    else:
        metrics = content.metric_records.get("metrics")
        if metrics is not None:
            raw = {k: metrics[k] for k in ("partition-id", "num-partitions") if k in metrics}
            if not raw.get("num-partitions"):  # 0: a node that does not know N (a ClientKit without it)
                raw.pop("num-partitions", None)
    try:
        node = check_node_config(raw)
    except ValueError as exc:
        return f"its node config: {exc}"
    if run_config is not None and node.num_partitions is not None:
        try:
            check_run_config_values({**run_config, "num-partitions": node.num_partitions})
        except ValueError as exc:
            return f"its node config's num-partitions = {node.num_partitions} does not suit the run config: {exc}"
    return None


def _neutral_partitions(config: Mapping[str, Any]) -> int:
    """A ``num-partitions`` every partition rule allows (2 for the Adult domain split, else 1)."""
    dataset = str(config.get("dataset") or "synthetic").strip().lower().replace("-", "_")
    partition = str(config.get("partition") or "natural").strip().lower()
    return 2 if partition == "domain" or (dataset == "adult" and partition == "natural") else 1


def data_config(run_config: Mapping[str, Any]) -> DataConfig:
    """The run config's :class:`~flowerdro.data.DataConfig`, validated.

    Without ``num-partitions`` in the run config (the nodes' config gives it) the rules
    that need N are left to the roll call: the record is built with an N every
    partition allows (its ``num_partitions`` then means nothing).

    Raises
    ------
    ValueError
        A data key's value or a combination of them (naming the key and what is allowed).
    """
    from flowerdro.data.config import DataConfig

    fixed = None if not unset(run_config, "num-partitions") else _neutral_partitions(run_config)
    return DataConfig.from_run_config(run_config, num_partitions=fixed)


def check_model_data(model: str, dataset: str) -> None:
    """A model the data set can feed: a CNN takes images, a regression data set a one-output model.

    Raises
    ------
    ValueError
        Naming ``model``, its value, the data set and the models allowed for it.
    """
    from flowerdro.data.config import REGRESSION_DATASETS
    from flowerdro.protocol import MODEL_NAMES

    if dataset in REGRESSION_DATASETS:
        allowed = REGRESSION_MODELS
    else:
        allowed = tuple(m for m in MODEL_NAMES if m not in REGRESSION_MODELS
                        and (dataset in IMAGE_DATASETS or m not in IMAGE_MODELS))
    if model not in allowed:
        why = ("its inputs are not images" if model in IMAGE_MODELS and dataset not in IMAGE_DATASETS else
               "a regression data set needs a model with one output" if dataset in REGRESSION_DATASETS else
               "a classification data set needs one output per class")
        raise ValueError(f"model: {model!r} cannot be used with dataset {dataset!r} ({why}); allowed for "
                         f"{dataset}: {', '.join(allowed)}")


def check_run_config_values(run_config: Mapping[str, Any]) -> None:
    """Refuse data keys (and the model) that the clients could not build, before any message.

    The data keys' types, ranges and combinations (:class:`~flowerdro.data.DataConfig`;
    the rules that need N only when ``num-partitions`` is in the run config), then the
    model against the data set (:func:`check_model_data`).

    Raises
    ------
    ValueError
        Naming the key, the value and what is allowed, e.g. ``partition: 'iid' is not
        available for dataset 'synthetic'; allowed: natural``.
    """
    from flowerdro.protocol import NodeSettings

    data = data_config(run_config)
    check_model_data(read_settings(NodeSettings, run_config).model, data.dataset)
