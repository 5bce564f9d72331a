#!/usr/bin/env bash
# One entry point that does all set-up on a fresh machine, then runs a job.
#
#   bash scripts/run.sh bench   the main job (for now: the CPU kernel benchmark)
#   bash scripts/run.sh test    the test suite (what CI runs)
#
# It creates .venv (once), installs torch==2.13.0 (pinned: an unpinned torch
# pulls a multi-gigabyte CUDA build) and the test tools, builds ampx in
# place (editable), and runs the job. Extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."

job="${1:-}"
shift || true
case "$job" in
  bench|test) ;;
  *) echo "usage: bash scripts/run.sh {bench|test} [args...]" >&2; exit 2 ;;
esac

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
V=.venv/bin
if ! "$V/python" -c "import torch, pytest, hypothesis, numpy" 2>/dev/null; then
  "$V/python" -m pip install -q --upgrade pip
  "$V/python" -m pip install -q "torch==2.13.0"
  "$V/python" -m pip install -q "pytest>=7" "hypothesis>=6" numpy "setuptools>=77" wheel
fi
# Rebuild every time: cheap, and never a stale extension.
"$V/python" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null

case "$job" in
  bench) exec "$V/python" benchmarks/bench_kernels.py "$@" ;;
  test)  exec "$V/python" -m pytest -q tests "$@" ;;
esac
