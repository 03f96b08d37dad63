#!/usr/bin/env bash
# The GPU check: the `gpu` benchmark (docs/performance.md) and the unit and integration
# suites with CUDA present, on a machine that has Python with torch and CUDA but not
# flowerdro's other dependencies.
#
# Run from the repository root (or anywhere: it changes there):
#   OUT=/some/folder bash scripts/gpu_check.sh
# Wheels in .whl/ (flwr and the packages the machine lacks; see docs/performance.md, "The
# GPU check") are installed into /tmp/site first; Fashion-MNIST is read from .data/ when
# that folder exists, else from FLOWERDRO_DATA or ../shared/data. Everything it writes
# (versions.txt, benchmark.log, pytest.log, junit.xml, performance.md) goes to $OUT.
# Time limits (seconds): BENCH_TIMEOUT (default 240) and SUITE_TIMEOUT (default 330);
# BENCH_ARGS adds benchmark options (e.g. "--rounds 3"), TESTS replaces the test paths.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flowerdro-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  echo "gpu_check: installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: the wheels did not install" | tee "$OUT/versions.txt"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -d .data ]; then
  export FLOWERDRO_DATA=${FLOWERDRO_DATA:-$PWD/.data}
fi
# reproducible CUDA kernels for the bit-for-bit tests (tests/conftest.py also sets them)
export CUBLAS_WORKSPACE_CONFIG=:4096:8 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1

"$PY" - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib.metadata as md
import os
import platform

import torch

print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
else:
    print("no CUDA device: the suites and the benchmark run on the CPU")
print(f"{os.cpu_count()} CPUs; FLOWERDRO_DATA={os.environ.get('FLOWERDRO_DATA', '')}")
for name in ("flwr", "numpy", "scipy", "grpcio", "protobuf", "cryptography", "clarabel", "cvxpy", "datasets",
             "flwr-datasets", "networkx", "matplotlib", "pytest", "pytest-xdist"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
EOF
if ! "$PY" -c "import flwr.clientapp, flwr.serverapp, flwr.server, flowerdro.apps.client_app, flowerdro.legacy, \
flowerdro.experiments" 2>>"$OUT/versions.txt"; then
  echo "gpu_check: flwr or flowerdro does not import (see $OUT/versions.txt); missing wheels?"
  tail -3 "$OUT/versions.txt"
  exit 1
fi

# 1. the benchmark first, alone on the machine
# shellcheck disable=SC2086  # BENCH_ARGS: options, split on spaces
OMP_NUM_THREADS=1 timeout "${BENCH_TIMEOUT:-240}" "$PY" scripts/benchmarks.py gpu ${BENCH_ARGS:-} --write-docs 2>&1 \
  | tee "$OUT/benchmark.log"
bench=${PIPESTATUS[0]}
cp docs/performance.md "$OUT/performance.md"

# 2. the unit and integration suites (e2e starts Flower's processes: not here)
xdist=()
if "$PY" -c "import xdist" 2>/dev/null; then
  xdist=(-n "${WORKERS:-8}" --dist loadfile)  # a file's tests in one worker, in their order
fi
# shellcheck disable=SC2086  # TESTS: paths, split on spaces
OMP_NUM_THREADS=1 timeout "${SUITE_TIMEOUT:-330}" "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
  -m "not e2e" -rfEs --durations=15 --junitxml="$OUT/junit.xml" ${TESTS:-tests/unit tests/integration} 2>&1 \
  | tee "$OUT/pytest.log" | grep -v "^\s*$" | tail -60
suite=${PIPESTATUS[0]}

echo "gpu_check: benchmark exit $bench, suites exit $suite (124: stopped at the time limit)" | tee -a "$OUT/versions.txt"
[ "$bench" -eq 0 ] && [ "$suite" -eq 0 ]
