#!/usr/bin/env bash
# One entry point that does all set-up on a fresh machine, then runs a job.
#
#   bash scripts/run.sh demo    the main job: python -m ampx demo (train a real model 4 ways)
#   bash scripts/run.sh test    the test suite (what CI runs)
#   bash scripts/run.sh bench   the kernel and scaler-step benchmarks
#
# It creates .venv (once), installs torch==2.13.0 (pinned: an unpinned torch
# pulls a multi-gigabyte CUDA build) and the test tools, builds ampx in
# place (editable), and runs the job. Extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."

job="${1:-}"
shift || true
case "$job" in
  demo|bench|test) ;;
  *) echo "usage: bash scripts/run.sh {demo|test|bench} [args...]" >&2; exit 2 ;;
esac

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
V=.venv/bin
if ! "$V/python" -c "import torch, pytest, hypothesis, numpy, matplotlib, deepspeed" 2>/dev/null; then
  "$V/python" -m pip install -q --upgrade pip
  "$V/python" -m pip install -q "torch==2.13.0"
  # DeepSpeed is only for the tests of Policy.deepspeed_config; DS_BUILD_OPS=0 builds none of its ops.
  DS_BUILD_OPS=0 "$V/python" -m pip install -q "pytest>=7" "hypothesis>=6" numpy matplotlib deepspeed \
    "setuptools>=77" wheel "torch==2.13.0"
fi
# Rebuild every time: cheap, and never a stale extension.
"$V/python" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null

case "$job" in
  demo)  exec "$V/python" -m ampx demo "$@" ;;
  test)  exec "$V/python" -m pytest -q tests "$@" ;;
  bench) "$V/python" benchmarks/bench_kernels.py "$@"
         exec "$V/python" benchmarks/bench_step.py ;;
esac
