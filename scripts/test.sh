#!/usr/bin/env bash
# Set up (if needed), lint (ruff), and run the unit and integration suites, spread over the
# machine's cores (pytest-xdist). The end-to-end tests (flwr run, deployments, a Ray cluster)
# run with scripts/test_e2e.sh; CI (.ci/run) runs both, then scripts/test_newest.sh.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit` or `scripts/test.sh -n 0`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
echo "test: ruff check"
ruff check .
python -m pytest -q -p no:cacheprovider -m "not e2e" -n auto --dist worksteal --durations=15 "$@"
