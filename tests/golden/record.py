"""Record (or compare against) the golden runs: every registered strategy on one small config.

``python tests/golden/record.py --write`` stores, for each strategy, its round records
(without wall times) and its final model under ``tests/golden/``; without ``--write`` it
reruns the same config and prints, per strategy, whether records and model are
bit-identical to the stored ones and the largest difference otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RECORDS, MODELS = HERE / "golden_records.json", HERE / "golden_models.npz"

#: Keys of a round record that measure the machine, not the algorithm.
VOLATILE = ("time_s", "server_step_s")

#: The golden config: 6 synthetic clients, 3 rounds, every strategy with its algorithm keys
#: set explicitly (defaults may change; these values must not).
CONFIG = {
    "name": "golden",
    "num-rounds": 3,
    "seeds": [0],
    "num-partitions": 6,
    "run-config": {
        "dataset": "synthetic", "partition": "natural", "model": "logreg",
        "synthetic-dim": 20, "synthetic-classes": 5, "lr": 0.05, "local-steps": 3, "batch-size": 8,
        "fraction-train": 0.5, "dual-lr": 0.01, "q": 0.5, "proximal-mu": 0.1, "eps": 0.2,
        "mu": 6.0, "topology": "ring", "adv-lr": 0.01, "affine-lambda": 1.0, "adv-eps": 0.5,
        "pgd-steps": 3,
    },
    "strategies": [
        "fedavg", "fedprox", "qfedavg", "drfa", "drfa-prox", "afl", "afl-full", "scaffpd", "scaffold",
        "drdsgd", "dsgd", "fedrobust", "fedavg-fgm", "fedavg-pgd", "fedmgda+", "fedmgda", "fedavg-n",
        "fedavg-mgda", "mgda-prox",
    ],
    "strategy": {"drdsgd": {"local-steps": 1}, "dsgd": {"local-steps": 1}},
}


def _clean(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in VOLATILE}


def run_all() -> tuple[dict[str, list[dict]], dict[str, np.ndarray]]:
    """Run the golden config; return the cleaned records and the flat final model per strategy."""
    from flowerdro.experiments import run

    res = run(CONFIG, output_root=None, verbose=False)
    records, models = {}, {}
    for label in CONFIG["strategies"]:
        records[label] = [_clean(r) for r in res.histories[label][0]]
        arrays = res.final_arrays[label][0]
        models[label] = np.concatenate([arrays[k].numpy().astype(np.float64).ravel() for k in arrays.keys()])
    return records, models


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="store the runs as the golden fixture")
    args = ap.parse_args()
    records, models = run_all()
    if args.write:
        RECORDS.write_text(json.dumps(records, indent=1, sort_keys=True))
        np.savez(MODELS, **models)
        print(f"wrote {RECORDS.name} and {MODELS.name} for {len(records)} strategies")
        return 0
    gold_rec = json.loads(RECORDS.read_text())
    gold_mod = np.load(MODELS)
    same = True
    for label in CONFIG["strategies"]:
        changed, added, removed = compare_records(records[label], gold_rec[label])
        diff = float(np.max(np.abs(models[label] - gold_mod[label])))
        note = "identical" if not changed else f"DIFFER in {', '.join(changed)}"
        extra = (f"; new keys {', '.join(added)}" if added else "") + (f"; lost keys {', '.join(removed)}"
                                                                        if removed else "")
        print(f"{label:12s} records {note}{extra}  model max|diff| {diff:.3g}")
        same &= not changed and not removed and diff == 0.0
    return 0 if same else 1


def compare_records(new: list[dict], gold: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """Keys whose values differ in a round both hold, keys only ``new`` has, keys only ``gold`` has."""
    changed, added, removed = set(), set(), set()
    if len(new) != len(gold):
        changed.add("number of rounds")
    for a, b in zip(new, gold, strict=False):
        added |= set(a) - set(b)
        removed |= set(b) - set(a)
        changed |= {k for k in set(a) & set(b) if json.dumps(a[k], sort_keys=True) != json.dumps(b[k], sort_keys=True)}
    return sorted(changed), sorted(added), sorted(removed)


if __name__ == "__main__":
    sys.exit(main())
