#!/usr/bin/env bash
# Set up (if needed) and run the main job: `flwr run .` with the default run config
# (a fairness comparison on the offline synthetic data set, 20 simulated clients).
# Exits non-zero when the run fails. Each run replaces the previous one's results in
# results/flwr-run/. Extra arguments go to scripts/flwr_run.py,
# e.g. `scripts/run.sh --run-config "num-rounds=5"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python scripts/flwr_run.py --num-supernodes 20 --overwrite "$@"
