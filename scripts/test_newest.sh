#!/usr/bin/env bash
# The unit and integration suites on the newest Flower that pyproject.toml's range admits
# (what `pip install flowerdro` resolves today), in a second environment, .venv-newest:
# torch==2.13.0 first (the CPU build, as scripts/setup.sh), then the package and its dev tools
# without constraints.txt and with --upgrade, so that pip takes the newest release of every
# other dependency its range admits. CI (.ci/run) runs it after the README's test command;
# extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip warns once per package about index locations of the local pip config that do not
# exist; they are harmless, so keep them out of the log (pip's exit status is kept)
quiet_pip() {
  local log rc=0
  log=$(mktemp)
  python -m pip "$@" >"$log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  return "$rc"
}
VENV=${VENV:-.venv-newest}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "test_newest: creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '2.13.0' else 1)" 2>/dev/null; then
  echo "test_newest: installing torch==2.13.0"
  quiet_pip install -q "torch==2.13.0"
fi
echo "test_newest: installing flowerdro[dev] with the newest releases its ranges admit"
quiet_pip install -q --upgrade --upgrade-strategy eager -e ".[dev]" "torch==2.13.0"
python -c "import flowerdro, flwr, torch; print(f'test_newest: ok (flowerdro {flowerdro.__version__}, flwr {flwr.__version__}, torch {torch.__version__})')"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -m pytest -q -p no:cacheprovider -m "not e2e" -n auto --dist worksteal "$@"
