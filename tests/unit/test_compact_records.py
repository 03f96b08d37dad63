"""Compact per-client arrays in rounds.jsonl: what the readers get back is the record written."""

from __future__ import annotations

import json

import numpy as np

from flowerdro.runs.records import COMPACT_MIN, compact_record, expand_record, record_line
from flowerdro.runs.results import load_records


def _record(n: int, ids=None) -> dict:
    rng = np.random.default_rng(0)
    ids = range(n) if ids is None else ids
    return {"round": 3, "acc_mean": 0.5, "missing": {"4": "timeout"},
            "lambda": {str(i): float(v) for i, v in zip(ids, rng.dirichlet(np.ones(n)), strict=True)},
            "client_acc": {str(i): round(float(v), 6) for i, v in zip(ids, rng.uniform(size=n), strict=True)}}


def test_large_per_client_mappings_round_trip_and_small_ones_stay_dicts(tmp_path):
    n = COMPACT_MIN + 5
    sparse = sorted(np.random.default_rng(1).choice(10 * n, size=n, replace=False).tolist())
    for rec in (_record(n), _record(n, ids=[i + 7 for i in range(n)]), _record(n, ids=sparse), _record(5)):
        line = record_line(rec)
        assert expand_record(json.loads(line)) == rec
    small = compact_record(_record(5))
    assert small["lambda"] == _record(5)["lambda"] and small["missing"] == {"4": "timeout"}
    dense = compact_record(_record(n))["lambda"]
    assert dense["__client_ids__"] == [0, n]  # a range is two numbers, not n keys


def test_load_records_expands_what_the_writer_wrote_and_the_line_is_shorter(tmp_path):
    n = 10_000
    recs = [_record(n), {**_record(n), "round": 4}]
    (tmp_path / "rounds.jsonl").write_text("".join(record_line(r) for r in recs))
    assert load_records(tmp_path) == recs
    plain = len(json.dumps(recs[0]))
    assert len(record_line(recs[0])) < 0.75 * plain  # keys "1234": dropped: about a third of each entry
