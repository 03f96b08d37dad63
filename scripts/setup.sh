#!/usr/bin/env bash
# Create the virtual environment (if needed) and install flowerdro with its dev tools.
# torch==2.13.0 is installed FIRST (CPU build where available), then everything else, so
# that no dependency pulls a newer, CUDA-sized torch.
#   default:                 .venv, the package under constraints.txt (the pinned environment)
#   VENV=DIR NEWEST=1:       DIR, the package with the newest releases its ranges admit
#                            (no constraints, --upgrade): what `pip install flowerdro` resolves
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
NEWEST=${NEWEST:-0}
# pip warns once per package about index locations of the local pip config that do
# not exist; they are harmless, so keep them out of the log (pip's exit status is kept).
quiet_pip() {
  local log rc=0
  log=$(mktemp)
  python -m pip "$@" >"$log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  return "$rc"
}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '2.13.0' else 1)" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  quiet_pip install -q "torch==2.13.0"
fi
if [ "$NEWEST" = 1 ]; then
  echo "setup: installing flowerdro[dev] with the newest releases its ranges admit"
  quiet_pip install -q --upgrade --upgrade-strategy eager -e ".[dev]" "torch==2.13.0"
else
  echo "setup: installing flowerdro[dev] with constraints.txt"
  quiet_pip install -q -c constraints.txt -e ".[dev]"
fi
python -c "import flowerdro, flwr, torch; print(f'setup: ok (flowerdro {flowerdro.__version__}, flwr {flwr.__version__}, torch {torch.__version__})')"
