"""Shared round loop for flowerdro strategies (Flower Message API).

:class:`FairStrategy` extends :class:`flwr.serverapp.strategy.Strategy` with what every
algorithm of this package needs and Flower's loop does not give:

* seeded node sampling from the strategy's own ``numpy.random.Generator``
  (node ids are sorted first, so a seed gives the same clients on every run);
* a map node id → partition id, learned from the ``partition-id`` in every reply;
* per-client evaluation kept per client and summarised by
  :func:`flowerdro.core.fairness.summarize` (mean, worst, worst-10%, worst-20%, best-20%, std);
* failure handling: a reply that is an error, never arrives (timeout), carries NaN/Inf
  metrics, or carries arrays of the wrong keys/shapes/non-finite values is dropped from
  its phase, counted and logged; the round goes on with the rest, or its update is skipped
  when nobody is left;
* bytes sent and received per round, wall time per round;
* a JSON-lines log (``rounds.jsonl``), the final model (``final_model.npz``), optional
  periodic checkpoints, and a PNG plot of worst/mean client accuracy at the end.

Algorithms with one train phase per round implement ``configure_train`` /
``aggregate_train`` like any Flower strategy; two-phase algorithms (DRFA, SCAFF-PD)
override :meth:`FairStrategy.train_round`, using :meth:`FairStrategy.communicate` to talk to
the clients so that failure handling and accounting stay in one place.
:meth:`FairStrategy.communicate_stream` does the same through Flower's
``push_messages``/``pull_messages`` and hands the valid replies over as they arrive
(FedMGDA+ builds its server step on them while later clients still train).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common import log
from flwr.common.constant import SType
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flowerdro.core.fairness import summarize

#: Metric keys every reply must carry.
NUM_EXAMPLES, PARTITION_ID = "num-examples", "partition-id"


def record_bytes(content: RecordDict) -> int:
    """Bytes of all arrays in a RecordDict (serialised size of each Array's buffer)."""
    total = 0
    for rec in content.array_records.values():
        for arr in rec.values():
            total += len(arr.data)
    return total


_NPY_MAGIC = b"\x93NUMPY"
_NPY_DESCR = re.compile(rb"'descr':\s*'([^']+)'")


def array_view(array: Array) -> np.ndarray:
    """A Flower ``Array`` as a read-only numpy view of its serialised buffer (no copy).

    ``Array.data`` holds the ``.npy`` bytes of a C-ordered array: magic, version, header
    length, a header naming dtype and order, then the values. The view skips the header
    with ``np.frombuffer`` instead of ``np.load`` (which parses the header with
    ``ast.literal_eval`` and copies the values); anything else (Fortran order, structured
    dtypes, another serialisation) goes through ``Array.numpy()``. Same values, dtype
    and shape as ``Array.numpy()``.
    """
    data = array.data
    if array.stype == SType.NUMPY and data[:6] == _NPY_MAGIC and data[6] in (1, 2, 3):
        start = 10 if data[6] == 1 else 12
        end = start + int.from_bytes(data[8:start], "little")
        header = data[start:end]
        descr = _NPY_DESCR.search(header)
        shape = tuple(int(n) for n in array.shape)
        if descr is not None and b"'fortran_order': False" in header:
            dtype = np.dtype(descr.group(1).decode("ascii"))
            count = math.prod(shape)
            if not dtype.hasobject and len(data) - end == count * dtype.itemsize:
                return np.frombuffer(data, dtype=dtype, count=count, offset=end).reshape(shape)
    return array.numpy()


def arrays_to_numpy(arrays: ArrayRecord) -> list[np.ndarray]:
    """The arrays of a record as numpy arrays, in key order."""
    return [arrays[k].numpy() for k in arrays.keys()]


def numpy_to_arrays(keys: Sequence[str], values: Sequence[np.ndarray]) -> ArrayRecord:
    """An ArrayRecord with ``keys`` mapped to ``values`` (order kept)."""
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(keys, values, strict=True)})


def check_arrays(reference: ArrayRecord, candidate: ArrayRecord) -> str | None:
    """Why ``candidate`` cannot stand in for ``reference`` (keys, shapes, finiteness), or None."""
    ref_keys, cand_keys = list(reference.keys()), list(candidate.keys())
    if ref_keys != cand_keys:
        return f"array keys {cand_keys[:3]}... differ from the model's {ref_keys[:3]}..."
    for k in ref_keys:
        r, c = reference[k], candidate[k]
        if tuple(r.shape) != tuple(c.shape):
            return f"array '{k}' has shape {tuple(c.shape)}, expected {tuple(r.shape)}"
        a = array_view(c)
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
            return f"array '{k}' holds NaN or Inf"
    return None


@dataclass
class Failure:
    """A dropped reply: which round, phase, node and why."""

    round: int
    phase: str
    node_id: int
    partition_id: int | None
    kind: str
    reason: str


class FairStrategy(Strategy):
    """Base of flowerdro strategies: seeded sampling, per-client metrics, failures, logs.

    Parameters
    ----------
    fraction_train : float (default: 1.0)
        Fraction of connected nodes sampled for training each round, in (0, 1].
    min_train_nodes : int (default: 1)
        At least this many nodes are sampled for training.
    fraction_evaluate : float (default: 1.0)
        Fraction of nodes asked to evaluate, in [0, 1] (0 disables federated evaluation).
    evaluate_every : int (default: 1)
        Evaluate every k rounds (and always after the last round).
    min_available_nodes : int (default: 1)
        Wait until this many nodes are connected before a round starts.
    seed : int (default: 0)
        Seed of the strategy's own random generator (sampling, snapshot steps, …).
    output_dir : str or Path, optional
        Where ``rounds.jsonl``, ``final_model.npz``, checkpoints and ``progress.png`` go.
    checkpoint_every : int (default: 0)
        Save the global model every k rounds (0: only the final model).
    wait_timeout : float (default: 120.0)
        Seconds to wait for ``min_available_nodes`` before giving up with an error.
    run_name : str, optional
        Label used in logs and file names (defaults to the strategy's ``name``).
    """

    #: Short name used in logs and the registry.
    name: str = "fair-base"
    #: Metric every ``evaluate`` reply must carry (a reply without it is dropped).
    #: ``"test_acc"`` for classification; set ``"test_loss"`` for a regression task, whose
    #: clients report no accuracy (the round summary then has ``loss_*`` fields only).
    eval_metric: str = "test_acc"

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        min_train_nodes: int = 1,
        fraction_evaluate: float = 1.0,
        evaluate_every: int = 1,
        min_available_nodes: int = 1,
        seed: int = 0,
        output_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        wait_timeout: float = 120.0,
        run_name: str | None = None,
    ) -> None:
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train: must be in (0, 1], got {fraction_train}")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate: must be in [0, 1], got {fraction_evaluate}")
        if min_train_nodes < 1:
            raise ValueError(f"min_train_nodes: must be >= 1, got {min_train_nodes}")
        if evaluate_every < 1:
            raise ValueError(f"evaluate_every: must be >= 1, got {evaluate_every}")
        if min_available_nodes < 1:
            raise ValueError(f"min_available_nodes: must be >= 1, got {min_available_nodes}")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: must be >= 0, got {checkpoint_every}")
        self.fraction_train = fraction_train
        self.min_train_nodes = min_train_nodes
        self.fraction_evaluate = fraction_evaluate
        self.evaluate_every = evaluate_every
        self.min_available_nodes = min_available_nodes
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.output_dir = Path(output_dir) if output_dir else None
        self.checkpoint_every = checkpoint_every
        self.wait_timeout = wait_timeout
        self.run_name = run_name or self.name
        self.node_to_partition: dict[int, int] = {}
        self.failures: list[Failure] = []
        self.history: list[dict[str, Any]] = []
        self.client_metrics: dict[int, dict[str, float]] = {}
        self.timeout: float = 3600.0
        #: Seconds :meth:`communicate_stream` sleeps after a pull that brought no reply.
        self.pull_interval: float = 0.05
        self._round = 0
        self._bytes = [0, 0]
        self._on_round: list[Callable[[dict[str, Any]], None]] = []

    # ------------------------------------------------------------------ settings/summary
    def settings(self) -> dict[str, Any]:
        """The strategy's hyper-parameters (extended by subclasses) for logs and results."""
        return {
            "fraction_train": self.fraction_train,
            "min_train_nodes": self.min_train_nodes,
            "fraction_evaluate": self.fraction_evaluate,
            "evaluate_every": self.evaluate_every,
            "seed": self.seed,
        }

    def summary(self) -> None:
        """Log the settings as a small tree."""
        items = list(self.settings().items())
        log(INFO, "\t├──> %s settings:", self.run_name)
        for i, (k, v) in enumerate(items):
            log(INFO, "\t│\t%s── %s: %s", "└" if i == len(items) - 1 else "├", k, v)

    def add_round_callback(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(record)`` after every round (progress bars, early stopping, tests)."""
        self._on_round.append(fn)

    # ------------------------------------------------------------------ nodes and sampling
    def nodes(self, grid: Grid) -> list[int]:
        """Connected node ids, sorted; waits (up to ``wait_timeout``) for ``min_available_nodes``."""
        start = time.monotonic()
        while True:
            ids = sorted(int(n) for n in grid.get_node_ids())
            if len(ids) >= self.min_available_nodes:
                return ids
            if time.monotonic() - start > self.wait_timeout:
                raise RuntimeError(
                    f"min_available_nodes: waited {self.wait_timeout:.0f} s for "
                    f"{self.min_available_nodes} nodes, only {len(ids)} connected"
                )
            log(INFO, "Waiting for nodes: %d connected, %d needed", len(ids), self.min_available_nodes)
            time.sleep(1.0)

    def num_train_nodes(self, num_nodes: int) -> int:
        """How many nodes to sample: ``max(min_train_nodes, round(fraction·N))``, at most N."""
        return int(min(num_nodes, max(self.min_train_nodes, round(self.fraction_train * num_nodes))))

    def sample(
        self, node_ids: Sequence[int], k: int, *, p: np.ndarray | None = None, replace: bool = False
    ) -> list[int]:
        """Draw ``k`` node ids from the strategy's generator (with probabilities ``p`` when given)."""
        if k > len(node_ids) and not replace:
            raise ValueError(f"k: cannot sample {k} of {len(node_ids)} nodes without replacement")
        idx = self.rng.choice(len(node_ids), size=k, replace=replace, p=p)
        return [int(node_ids[i]) for i in np.atleast_1d(idx)]

    def partition(self, node_id: int) -> int | None:
        """Partition id of a node, once one of its replies has told us."""
        return self.node_to_partition.get(int(node_id))

    # ------------------------------------------------------------------ messaging
    @staticmethod
    def build_messages(
        node_ids: Iterable[int], content: RecordDict | Callable[[int], RecordDict], message_type: str
    ) -> list[Message]:
        """One message per node; ``content`` may be a function node id → RecordDict."""
        out = []
        for nid in node_ids:
            rec = content(nid) if callable(content) else content
            out.append(Message(content=rec, dst_node_id=int(nid), message_type=message_type))
        return out

    def communicate(
        self,
        grid: Grid,
        messages: Sequence[Message],
        *,
        phase: str,
        reference: ArrayRecord | None = None,
        array_keys: Sequence[str] = ("arrays",),
        required_metrics: Sequence[str] = (),
    ) -> list[Message]:
        """Send ``messages``, wait for replies, and return only the valid ones.

        A reply is dropped (and counted under ``phase``) when it is an error, does not
        arrive before ``self.timeout``, lacks a MetricRecord or one of ``required_metrics``,
        carries NaN/Inf metrics, or, when ``reference`` is given, any ArrayRecord named in
        ``array_keys`` whose keys/shapes differ from ``reference`` or hold NaN/Inf. The
        valid replies come back in the order of ``messages``, not of arrival, so that
        aggregations sum in the same order on every run.
        """
        messages = list(messages)
        if not messages:
            return []
        self._count_sent(messages)
        replies = list(grid.send_and_receive(messages, timeout=self.timeout))
        valid: list[Message] = []
        answered: set[int] = set()
        for reply in replies:
            nid = int(reply.metadata.src_node_id)
            answered.add(nid)
            if self._accept(reply, nid, phase, reference, array_keys, required_metrics):
                valid.append(reply)
        self._fail_unanswered(phase, [int(m.metadata.dst_node_id) for m in messages if
                                      int(m.metadata.dst_node_id) not in answered])
        position = {int(m.metadata.dst_node_id): i for i, m in enumerate(messages)}
        valid.sort(key=lambda r: position.get(int(r.metadata.src_node_id), len(position)))
        return valid

    def communicate_stream(
        self,
        grid: Grid,
        messages: Sequence[Message],
        on_replies: Callable[[list[Message]], None],
        *,
        phase: str,
        reference: ArrayRecord | None = None,
        array_keys: Sequence[str] = ("arrays",),
        required_metrics: Sequence[str] = (),
    ) -> list[Message]:
        """Like :meth:`communicate`, but hand the valid replies over as they arrive.

        The messages are pushed once (``grid.push_messages``); the outstanding ones are then
        pulled (``grid.pull_messages``) until every node has answered or ``self.timeout``
        has passed, sleeping :attr:`pull_interval` seconds only after a pull that brought
        nothing. Each pull's valid replies go to ``on_replies`` at once (one call per pull,
        never with an empty list), so the caller can work on early replies while later
        ones are still being computed; the time ``on_replies`` takes counts against the
        timeout. Replies are matched to their messages by ``reply_to_message_id`` and
        checked exactly as in :meth:`communicate` (errors, NaN/Inf metrics, wrong or
        non-finite arrays are dropped and counted under ``phase``; the nodes still
        outstanding at the deadline are counted as ``timeout``). A grid whose
        ``push_messages`` raises ``NotImplementedError`` is served by one
        ``send_and_receive`` and a single ``on_replies`` call.

        Returns
        -------
        list of Message
            All valid replies, in arrival order (the concatenation of the ``on_replies`` batches).
        """
        messages = list(messages)
        if not messages:
            return []
        try:
            ids = list(grid.push_messages(messages))
        except NotImplementedError:
            valid = self.communicate(grid, messages, phase=phase, reference=reference, array_keys=array_keys,
                                     required_metrics=required_metrics)
            if valid:
                on_replies(valid)
            return valid
        self._count_sent(messages)
        if len(ids) == len(messages):  # Flower keeps the order and puts None where a push failed
            pairs = list(zip(ids, messages, strict=True))
        else:  # a grid that leaves failed pushes out: match by the message ids it assigned
            pushed = {str(i) for i in ids if i}
            pairs = [(m.metadata.message_id if m.metadata.message_id in pushed else None, m) for m in messages]
        pending: dict[str, int] = {}
        for mid, msg in pairs:
            nid = int(msg.metadata.dst_node_id)
            if mid:
                pending[str(mid)] = nid
            else:
                self._fail(phase, nid, "error", "the grid could not push the message")
        valid: list[Message] = []
        deadline = time.monotonic() + self.timeout
        while pending:
            replies = list(grid.pull_messages(list(pending)))
            batch: list[Message] = []
            for reply in replies:
                nid = pending.pop(str(reply.metadata.reply_to_message_id), None)
                if nid is None:  # not (or no longer) outstanding: a duplicate or a stray reply
                    continue
                if self._accept(reply, nid, phase, reference, array_keys, required_metrics):
                    batch.append(reply)
            if batch:
                valid.extend(batch)
                on_replies(batch)
            now = time.monotonic()
            if not pending or now >= deadline:
                break
            if not replies:
                time.sleep(min(self.pull_interval, deadline - now))
        self._fail_unanswered(phase, list(pending.values()))
        return valid

    def _count_sent(self, messages: Sequence[Message]) -> None:
        for m in messages:
            self._bytes[0] += record_bytes(m.content)

    def _accept(
        self,
        reply: Message,
        node_id: int,
        phase: str,
        reference: ArrayRecord | None,
        array_keys: Sequence[str],
        required_metrics: Sequence[str],
    ) -> bool:
        """Whether ``reply`` (from ``node_id``) is usable; count its bytes, or log why it is dropped."""
        if reply.has_error():
            self._fail(phase, node_id, "error", str(reply.error.reason)[:300])
            return False
        self._bytes[1] += record_bytes(reply.content)
        why = self._validate(reply, reference, array_keys, required_metrics)
        if why is not None:
            self._fail(phase, node_id, why[0], why[1])
            return False
        return True

    def _fail_unanswered(self, phase: str, node_ids: Iterable[int]) -> None:
        seen: set[int] = set()
        for nid in node_ids:
            if nid not in seen:
                seen.add(nid)
                self._fail(phase, nid, "timeout", f"no reply within {self.timeout:g} s")

    def _validate(
        self,
        reply: Message,
        reference: ArrayRecord | None,
        array_keys: Sequence[str],
        required_metrics: Sequence[str],
    ) -> tuple[str, str] | None:
        content = reply.content
        if len(content.metric_records) == 0:
            return "bad-metrics", "reply has no MetricRecord"
        metrics = content.metric_records.get("metrics") or next(iter(content.metric_records.values()))
        for key in (NUM_EXAMPLES, PARTITION_ID, *required_metrics):
            if key not in metrics:
                return "bad-metrics", f"metric '{key}' missing"
        for key, value in metrics.items():
            vals = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in vals):
                return "nonfinite", f"metric '{key}' is {value}"
        self.node_to_partition[int(reply.metadata.src_node_id)] = int(metrics[PARTITION_ID])
        if reference is not None:
            for key in array_keys:
                rec = content.array_records.get(key)
                if rec is None:
                    return "bad-arrays", f"ArrayRecord '{key}' missing"
                why = check_arrays(reference, rec)
                if why is not None:
                    return ("nonfinite" if "NaN" in why else "bad-arrays"), why
        return None

    def _fail(self, phase: str, node_id: int, kind: str, reason: str) -> None:
        f = Failure(self._round, phase, node_id, self.partition(node_id), kind, reason)
        self.failures.append(f)
        log(
            WARNING,
            "[%s] round %d %s: dropped node %d (partition %s): %s: %s",
            self.run_name, f.round, phase, node_id, f.partition_id, kind, reason,
        )

    # ------------------------------------------------------------------ Flower's Strategy API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Default: send the global model to a seeded sample of nodes (``train``)."""
        nodes = self.nodes(grid)
        chosen = self.sample(nodes, self.num_train_nodes(len(nodes)))
        config["server-round"] = server_round
        content = RecordDict({"arrays": arrays, "config": config})
        return self.build_messages(chosen, content, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Default: average the models weighted by ``num-examples`` (FedAvg)."""
        contents = [m.content for m in replies]
        if not contents:
            return None, None
        return aggregate_arrayrecords(contents, NUM_EXAMPLES), _mean_metrics(contents)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Ask (a fraction of) all nodes to evaluate ``arrays`` on their own test sets."""
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self.nodes(grid)
        k = max(1, round(self.fraction_evaluate * len(nodes)))
        chosen = nodes if k >= len(nodes) else sorted(self.sample(nodes, k))
        config["server-round"] = server_round
        content = RecordDict({"arrays": arrays, "config": config})
        return self.build_messages(chosen, content, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Keep every client's test accuracy/loss and summarise them (fairness metrics)."""
        per_client: dict[int, dict[str, float]] = {}
        for m in replies:
            mr = m.content.metric_records.get("metrics") or next(iter(m.content.metric_records.values()))
            pid = int(mr[PARTITION_ID])
            per_client[pid] = {k: float(v) for k, v in mr.items() if isinstance(v, int | float)}
        if not per_client:
            return None
        self.client_metrics = per_client
        acc = {p: v["test_acc"] for p, v in per_client.items() if "test_acc" in v}
        loss = {p: v["test_loss"] for p, v in per_client.items() if "test_loss" in v}
        out: dict[str, float] = {}
        if acc:
            out.update({f"acc_{k}": v for k, v in summarize(acc).items()})
            w = np.array([per_client[p][NUM_EXAMPLES] for p in acc], dtype=float)
            out["acc_weighted"] = float(np.dot(w, list(acc.values())) / max(w.sum(), 1.0))
        if loss:
            s = summarize(loss, higher_is_better=False)
            out.update({"loss_mean": s["mean"], "loss_worst": s["worst"]})
        return MetricRecord(out)

    # ------------------------------------------------------------------ hooks for subclasses
    def train_round(
        self, server_round: int, grid: Grid, arrays: ArrayRecord, config: ConfigRecord
    ) -> tuple[ArrayRecord, MetricRecord | None]:
        """One round of training; returns the new global model (default: one train phase)."""
        messages = list(self.configure_train(server_round, arrays, ConfigRecord(dict(config)), grid))
        replies = self.communicate(grid, messages, phase="train", reference=arrays)
        if not replies:
            log(WARNING, "[%s] round %d: no valid training reply; model unchanged", self.run_name, server_round)
            return arrays, None
        new_arrays, metrics = self.aggregate_train(server_round, replies)
        return (new_arrays if new_arrays is not None else arrays), metrics

    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model clients evaluate (e.g. DRFA's averaged iterate); default: ``arrays``."""
        return arrays

    def output_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model a run returns; default: the last global model."""
        return arrays

    def round_extras(self) -> dict[str, Any]:
        """Extra per-round fields for the log (e.g. λ keyed by partition id)."""
        return {}

    # ------------------------------------------------------------------ the loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run ``num_rounds`` rounds: train (one or more phases), evaluate every client, log."""
        if num_rounds < 1:
            raise ValueError(f"num_rounds: must be >= 1, got {num_rounds}")
        if not timeout > 0:
            raise ValueError(f"timeout: must be > 0, got {timeout}")
        self.timeout = float(timeout)
        log(INFO, "Starting %s (%d rounds)", self.run_name, num_rounds)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "rounds.jsonl").write_text("")
            (self.output_dir / "settings.json").write_text(json.dumps(self.settings(), indent=2, default=str))
        result = Result()
        arrays = initial_arrays
        t_run = time.time()
        for rnd in range(1, num_rounds + 1):
            self._round, self._bytes = rnd, [0, 0]
            n_fail_before = len(self.failures)
            t0 = time.time()
            arrays, train_metrics = self.train_round(rnd, grid, arrays, ConfigRecord(dict(train_config)))
            result.arrays = arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            eval_metrics = None
            if rnd % self.evaluate_every == 0 or rnd == num_rounds:
                msgs = list(
                    self.configure_evaluate(rnd, self.evaluation_arrays(arrays), ConfigRecord(dict(evaluate_config)), grid)
                )
                replies = self.communicate(grid, msgs, phase="evaluate", required_metrics=(self.eval_metric,))
                eval_metrics = self.aggregate_evaluate(rnd, replies)
                if eval_metrics is not None:
                    result.evaluate_metrics_clientapp[rnd] = eval_metrics
            if evaluate_fn is not None:
                res = evaluate_fn(rnd, self.evaluation_arrays(arrays))
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
            record = self._round_record(rnd, time.time() - t0, train_metrics, eval_metrics, n_fail_before)
            self.history.append(record)
            self._log_round(record, num_rounds)
            self._write(record)
            if self.output_dir is not None and self.checkpoint_every and rnd % self.checkpoint_every == 0:
                save_arrays(self.output_dir / f"checkpoint_round{rnd:04d}.npz", arrays)
            for fn in self._on_round:
                fn(record)
        final = self.output_arrays(arrays)
        result.arrays = final
        log(INFO, "[%s] finished %d rounds in %.1f s (%d dropped replies)", self.run_name, num_rounds,
            time.time() - t_run, len(self.failures))
        if self.output_dir is not None:
            save_arrays(self.output_dir / "final_model.npz", final)
            try:
                from flowerdro.experiments.plots import plot_history

                plot_history({self.run_name: self.history}, self.output_dir / "progress.png", title=self.run_name)
            except Exception as exc:  # plotting must never fail a run
                log(WARNING, "[%s] could not draw the plot: %s", self.run_name, exc)
        return result

    def _round_record(
        self,
        rnd: int,
        seconds: float,
        train_metrics: MetricRecord | None,
        eval_metrics: MetricRecord | None,
        n_fail_before: int,
    ) -> dict[str, Any]:
        new_fail = self.failures[n_fail_before:]
        rec: dict[str, Any] = {
            "strategy": self.run_name,
            "round": rnd,
            "time_s": round(seconds, 4),
            "bytes_sent": self._bytes[0],
            "bytes_received": self._bytes[1],
            "failures": dict(Counter(f"{f.phase}:{f.kind}" for f in new_fail)),
        }
        if train_metrics is not None:
            rec["train"] = {k: v for k, v in train_metrics.items()
                            if isinstance(v, int | float) and k != PARTITION_ID}
        if eval_metrics is not None:
            rec.update({k: v for k, v in eval_metrics.items() if isinstance(v, int | float)})
            rec["client_acc"] = {
                str(p): round(v["test_acc"], 6) for p, v in sorted(self.client_metrics.items()) if "test_acc" in v
            }
            if not rec["client_acc"]:  # regression: per-client test loss instead
                rec["client_loss"] = {
                    str(p): v["test_loss"] for p, v in sorted(self.client_metrics.items()) if "test_loss" in v
                }
        rec.update(self.round_extras())
        return rec

    def _log_round(self, rec: dict[str, Any], num_rounds: int) -> None:
        parts = [f"[{self.run_name}] round {rec['round']}/{num_rounds}"]
        if "acc_mean" in rec:
            parts.append(
                f"acc mean {rec['acc_mean']:.4f} worst {rec['acc_worst']:.4f} "
                f"w20 {rec['acc_worst20']:.4f} std {rec['acc_std']:.4f} | loss {rec['loss_mean']:.4f}"
            )
        elif "loss_mean" in rec:
            parts.append(f"loss mean {rec['loss_mean']:.6g} worst {rec['loss_worst']:.6g}")
        parts.append(f"{rec['time_s']:.2f}s sent {rec['bytes_sent'] / 1e6:.2f}MB recv {rec['bytes_received'] / 1e6:.2f}MB")
        if rec["failures"]:
            parts.append(f"dropped {sum(rec['failures'].values())}")
        log(INFO, " | ".join(parts))

    def _write(self, rec: dict[str, Any]) -> None:
        if self.output_dir is None:
            return
        with (self.output_dir / "rounds.jsonl").open("a") as fh:
            fh.write(json.dumps(rec, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def _mean_metrics(contents: Sequence[RecordDict]) -> MetricRecord:
    """Example-weighted mean of the scalar metrics every reply shares."""
    return mean_of_metric_records(
        [c.metric_records.get("metrics") or next(iter(c.metric_records.values())) for c in contents])


def mean_of_metric_records(mrs: Sequence[MetricRecord]) -> MetricRecord:
    """Σ_i n_i v_i / Σ_i n_i for each scalar metric v all records share (n_i = ``num-examples``)."""
    keys = set.intersection(*(set(k for k, v in m.items() if isinstance(v, int | float)) for m in mrs))
    keys -= {PARTITION_ID}
    w = np.array([float(m[NUM_EXAMPLES]) for m in mrs])
    out: dict[str, float] = {}
    for k in sorted(keys):
        if k == NUM_EXAMPLES:
            out[k] = float(w.sum())
        else:
            out[k] = float(np.dot(w, [float(m[k]) for m in mrs]) / max(w.sum(), 1e-12))
    return MetricRecord(out)


def save_arrays(path: Path, arrays: ArrayRecord) -> None:
    """Save an ArrayRecord as ``.npz`` (one entry per key)."""
    np.savez(path, **{k: arrays[k].numpy() for k in arrays.keys()})


def load_arrays(path: str | Path) -> ArrayRecord:
    """Load an ArrayRecord saved by :func:`save_arrays`."""
    with np.load(path) as data:
        return numpy_to_arrays(list(data.files), [data[k] for k in data.files])
