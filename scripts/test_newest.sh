#!/usr/bin/env bash
# The unit and integration suites on the newest Flower that pyproject.toml's range admits
# (what `pip install flowerdro` resolves today), in a second environment, .venv-newest
# (scripts/setup.sh with NEWEST=1: torch==2.13.0 first, then the package without
# constraints.txt and with --upgrade). CI (.ci/run) runs it after the README's test command
# and the end-to-end tests; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${VENV:-.venv-newest}
NEWEST=1 bash scripts/setup.sh
. "$VENV/bin/activate"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -m pytest -q -p no:cacheprovider -m "not e2e" -n auto --dist worksteal "$@"
