#!/usr/bin/env bash
# Set up (if needed) and run the end-to-end tests, one at a time: `flwr run .` of the
# shipped app and the examples, loopback deployments (SuperLink and SuperNodes as separate
# processes: restarts, TLS and node authentication, duplicate nodes, one run per folder) and
# a simulation on a local Ray cluster. CI (.ci/run) runs them after scripts/test.sh.
# Extra arguments go to pytest, e.g. `scripts/test_e2e.sh -k restart`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -m pytest -q -p no:cacheprovider -m e2e --durations=15 "$@"
