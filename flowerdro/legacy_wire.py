"""flowerdro's messages in the legacy API's format: FitIns/FitRes and EvaluateIns/EvaluateRes.

:class:`~flowerdro.legacy.LegacyStrategy` sends each training and evaluate message of a
flowerdro strategy through Flower's legacy ``Server`` as a ``FitIns``/``EvaluateIns``
(so legacy wrappers and workflows see it): its parameters are the model's arrays, its
config the message's config plus ``flowerdro.type`` (the message type, e.g.
``train.drfa``), ``flowerdro.keys`` (the model's array keys, JSON) and any extra record
of the message (SCAFFOLD's c, FedRobust's shift) as ``flowerdro.record.<name>`` (``.npz``
bytes, read without pickle). The ``FitRes`` parameters are the reply's model followed by
its extra records (DRFA's snapshot, SCAFFOLD's Δc_i), laid out in its metric
``flowerdro.records``; a secure sum over such parameters sums every record. A client
answers these with the route of their message type (:func:`serve_ins`): flowerdro's
ClientApp, a kit app and :class:`~flowerdro.legacy.LegacyClientApp` all do.

This module needs neither torch nor the data code.
"""

from __future__ import annotations

import copy
import io
import json
import math
from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import (
    Code,
    EvaluateRes,
    FitRes,
    Parameters,
    Scalar,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.compat.common import recorddict_compat as compat

from flowerdro.client_errors import error_reply
from flowerdro.protocol import NUM_EXAMPLES

__all__ = ["FromLegacy", "fitres_to_content", "flowerdro_ins", "ins_to_content", "message_to_ins",
           "reply_to_fitres", "serve_ins"]

#: Config keys of a flowerdro FitIns/EvaluateIns, and the FitRes metric listing its records.
TYPE_KEY, KEYS_KEY, RECORD_PREFIX, RECORDS_KEY = "flowerdro.type", "flowerdro.keys", "flowerdro.record.", \
    "flowerdro.records"


# --------------------------------------------------------------------------- conversions
def _record_bytes(rec: ArrayRecord) -> bytes:
    """An ArrayRecord as ``.npz`` bytes (read back without pickle)."""
    buf = io.BytesIO()
    np.savez(buf, **{f"a{i}": rec[k].numpy() for i, k in enumerate(rec.keys())},
             __keys__=np.array(json.dumps(list(rec.keys()))))
    return buf.getvalue()


def _record_of(data: bytes) -> ArrayRecord:
    """The inverse of :func:`_record_bytes`."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        keys = json.loads(str(z["__keys__"]))
        return ArrayRecord({k: Array(np.array(z[f"a{i}"])) for i, k in enumerate(keys)})


def message_to_ins(message: Message) -> tuple[Parameters, dict[str, Scalar]]:
    """A flowerdro training or evaluate message as the (parameters, config) of a FitIns/EvaluateIns."""
    content = message.content
    model = content.array_records["arrays"]
    config: dict[str, Scalar] = {}
    cfg = content.config_records.get("config")
    for k, v in (cfg or {}).items():
        config[k] = json.dumps(v) if isinstance(v, list) else v  # type: ignore[assignment]
    config[TYPE_KEY] = message.metadata.message_type
    config[KEYS_KEY] = json.dumps(list(model.keys()))
    for name, rec in content.array_records.items():
        if name != "arrays":
            config[RECORD_PREFIX + name] = _record_bytes(rec)
    return ndarrays_to_parameters([model[k].numpy() for k in model.keys()]), config


def ins_to_content(parameters: Parameters, config: Mapping[str, Scalar]) -> tuple[str, RecordDict]:
    """The message type and Message-API content of a flowerdro FitIns/EvaluateIns (client side)."""
    keys = json.loads(str(config[KEYS_KEY]))
    values = parameters_to_ndarrays(parameters)
    if len(values) != len(keys):
        raise ValueError(f"{TYPE_KEY}: {len(values)} arrays for {len(keys)} keys")
    content = RecordDict({"arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(keys, values, strict=True)})})
    cfg = {}
    for k, v in config.items():
        if k.startswith(RECORD_PREFIX):
            content[k[len(RECORD_PREFIX):]] = _record_of(bytes(v))  # type: ignore[arg-type]
        elif not k.startswith("flowerdro."):
            cfg[k] = v
    content["config"] = ConfigRecord(cfg)
    return str(config[TYPE_KEY]), content


def _metrics(reply: Message) -> MetricRecord:
    content = reply.content
    rec = content.get("metrics")
    return rec if isinstance(rec, MetricRecord) else next(iter(content.metric_records.values()))


def reply_to_fitres(reply: Message, *, uniform: bool) -> FitRes:
    """A flowerdro training reply as a FitRes: the model, then its extra records, as parameters."""
    if reply.has_error():
        return FitRes(Status(Code.FIT_NOT_IMPLEMENTED, str(reply.error.reason)), Parameters([], ""), 0, {})
    content = reply.content
    names = ["arrays", *sorted(n for n in content.array_records if n != "arrays")]
    arrays, layout = [], []
    for name in names:
        rec = content.array_records[name]
        arrays.extend(rec[k].numpy() for k in rec.keys())
        layout.append([name, list(rec.keys())])
    metrics = {k: v for k, v in _metrics(reply).items() if isinstance(v, int | float)}
    metrics[RECORDS_KEY] = json.dumps(layout)
    n = 1 if uniform else int(metrics.get(NUM_EXAMPLES, 1))
    return FitRes(Status(Code.OK, "Success"), ndarrays_to_parameters(arrays), n, metrics)  # type: ignore[arg-type]


def fitres_to_content(res: FitRes) -> RecordDict:
    """The Message-API content of a flowerdro FitRes (server side): the model, its extra records, the metrics."""
    metrics = dict(res.metrics)
    layout = json.loads(str(metrics.pop(RECORDS_KEY)))
    values = parameters_to_ndarrays(res.parameters)
    content, i = RecordDict(), 0
    for name, keys in layout:
        content[name] = ArrayRecord({k: Array(np.asarray(values[i + j])) for j, k in enumerate(keys)})
        i += len(keys)
    if i != len(values):
        raise ValueError(f"{RECORDS_KEY}: {len(values)} arrays returned, {i} listed")
    # a bool (the legacy adaptive clipping mod's norm bit) as 0/1: a MetricRecord holds numbers only
    content["metrics"] = MetricRecord({k: int(v) if isinstance(v, bool) else v for k, v in metrics.items()
                                       if isinstance(v, int | float)})
    return content




def flowerdro_ins(message: Message) -> tuple[Parameters, dict[str, Scalar], str] | None:
    """(parameters, config, "fitins" | "evaluateins") of a flowerdro FitIns/EvaluateIns, else None."""
    if not message.has_content():
        return None
    for kind in ("fitins", "evaluateins"):
        cfg = message.content.config_records.get(f"{kind}.config")
        if cfg is not None and TYPE_KEY in cfg:
            convert = compat.recorddict_to_fitins if kind == "fitins" else compat.recorddict_to_evaluateins
            ins = convert(message.content, keep_input=True)
            return ins.parameters, dict(ins.config), kind
    return None


def serve_ins(message: Message, context: Context, handler_for: Callable[[str], Callable[[Message, Context], Message]]
              ) -> Message:
    """Answer a flowerdro FitIns/EvaluateIns with ``handler_for(<its message type>)``, in the legacy format."""
    ins = flowerdro_ins(message)
    if ins is None:
        raise ValueError("serve_ins: the message is not a flowerdro FitIns/EvaluateIns")
    parameters, config, kind = ins
    ftype, content = ins_to_content(parameters, config)
    metadata = copy.copy(message.metadata)
    metadata.message_type = ftype
    inner = Message(content=content, metadata=metadata)
    try:
        reply = handler_for(ftype)(inner, context)
    except Exception as exc:  # noqa: BLE001 - a FitRes/EvaluateIns failure names the client's error
        reply = error_reply(inner, exc)
    if kind == "fitins":
        res = reply_to_fitres(reply, uniform=config.get("flowerdro.weight") == "uniform")
        return Message(content=compat.fitres_to_recorddict(res, keep_input=True), reply_to=message)
    if reply.has_error():
        return Message(reply.error, reply_to=message)
    metrics = dict(_metrics(reply))
    loss = float(metrics.get(str(content["config"].get("loss-metric", "test_loss")), math.nan))
    res = EvaluateRes(Status(Code.OK, "Success"), loss, int(metrics.get(NUM_EXAMPLES, 0)), metrics)
    return Message(content=compat.evaluateres_to_recorddict(res), reply_to=message)


class FromLegacy:
    """A ``train``/``evaluate`` route that also answers flowerdro's FitIns/EvaluateIns (see :func:`serve_ins`).

    A module-level class (not a closure), so a pickled ClientApp holds a reference to it.
    """

    def __init__(self, inner: Callable[[Message, Context], Message],
                 handler_for: Callable[[str], Callable[[Message, Context], Message]]) -> None:
        self.inner, self.handler_for = inner, handler_for

    def __call__(self, message: Message, context: Context) -> Message:  # noqa: D102
        if flowerdro_ins(message) is None:
            return self.inner(message, context)
        return serve_ins(message, context, self.handler_for)
