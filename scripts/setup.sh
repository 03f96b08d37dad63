#!/usr/bin/env bash
# Create .venv (if needed) and install flowerdro with its dev tools.
# torch==2.13.0 is installed FIRST (CPU build where available), then everything else under
# constraints.txt, so that no dependency pulls a newer, CUDA-sized torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip warns once per package about index locations of the local pip config that do
# not exist; they are harmless, so keep them out of the log.
quiet_pip() {
  local log rc=0
  log=$(mktemp)
  python -m pip "$@" >"$log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  return "$rc"
}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '2.13.0' else 1)" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  quiet_pip install -q "torch==2.13.0"
fi
echo "setup: installing flowerdro[dev] with constraints.txt"
quiet_pip install -q -c constraints.txt -e ".[dev]"
python -c "import flowerdro, flwr, torch; print(f'setup: ok (flowerdro {flowerdro.__version__}, flwr {flwr.__version__}, torch {torch.__version__})')"
