#!/usr/bin/env bash
# The GPU device check of issue #28 in one go (docs/gpu.md): installs the wheels bench/gpu_wheels.sh downloaded into
# .whl/ (the device image lacks them and has no network), then runs bench/gpu_check.py, which writes
# bench/results/gpu.md. Arguments go to gpu_check.py (--device cpu --quick: the same steps on a CPU, small).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$PY" bench/gpu_check.py "$@"
