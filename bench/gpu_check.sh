#!/usr/bin/env bash
# The GPU device check of issue #28 in one go (docs/gpu.md): installs what bench/gpu_wheels.sh downloaded into .whl/
# (the device image lacks it and has no network): the wheels, then the few sdists built there; then runs
# bench/gpu_check.py, which writes bench/results/gpu.md after every step. Arguments go to gpu_check.py
# (--dry-run: the plan; --device cpu --quick: the same steps on a CPU, small).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if compgen -G ".whl/*.tar.gz" >/dev/null; then
  # A source package that does not build costs only what needs it (examples/rl_reasoning_gym.toml's smoke).
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.tar.gz || echo "gpu_check.sh: warning: the sdists in .whl/ did not all build" >&2
fi
exec "$PY" bench/gpu_check.py "$@"
