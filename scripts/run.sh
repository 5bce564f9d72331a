#!/usr/bin/env bash
# One entry point that does all set-up on a fresh machine, then runs a job.
#
#   bash scripts/run.sh demo    the main job: python -m ampx demo (train a real model 5 ways)
#   bash scripts/run.sh test    the test suite (what CI runs)
#   bash scripts/run.sh bench   the kernel and scaler-step benchmarks
#
# It creates .venv (once), installs torch==2.13.0 (pinned: an unpinned torch
# pulls a multi-gigabyte CUDA build) and what the job needs (demo: matplotlib and
# tqdm; test: also pytest, hypothesis, numpy, DeepSpeed, Accelerate, Transformers, Lightning, and
# (AMPX_TEST_FRAMEWORKS=0 leaves these out) timm, torchtune, TRL, PEFT and diffusers;
# bench: numpy), builds
# ampx in place (editable) when its sources or build settings changed since the last build, and
# runs the job. Extra arguments go to the job (test: to pytest; name test files to run only those).
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
pip_q() { "$V/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
# What each job needs, and nothing more (torch pinned every time: a bare requirement would let
# pip swap in a multi-gigabyte CUDA build).
base=("torch==2.13.0" "setuptools>=77" wheel)
case "$job" in
  demo)  need=(matplotlib tqdm);              probe="import torch, matplotlib, tqdm, setuptools, wheel" ;;
  bench) need=(numpy);                        probe="import torch, numpy, setuptools, wheel" ;;
  # DeepSpeed is only for the tests of Policy.deepspeed_config and prepare(); DS_BUILD_OPS=0
  # builds none of its ops. Accelerate, Transformers and Lightning are for the tests of
  # ampx.integrations (tested: accelerate 1.16.0, transformers 5.24.0, lightning 2.6.6).
  # nvidia-cuda-nvcc-cu12 brings the CUDA 12 ptxas that builds the kernels for every R525+
  # driver (setup.py's top says how; ~40 MB, no GPU needed).
  # The frameworks are pinned to the versions the README says are tested; so are the ones
  # installed without their dependencies below.
  test)  need=("pytest>=7" "hypothesis>=6" numpy matplotlib tqdm deepspeed==0.19.8 accelerate==1.16.0
              transformers==5.24.0 lightning==2.6.6 "nvidia-cuda-nvcc-cu12==12.9.*")
         probe="import torch, pytest, hypothesis, numpy, matplotlib, tqdm, deepspeed, accelerate, transformers, lightning, setuptools, wheel, nvidia.cuda_nvcc" ;;
esac
# timm, torchtune, TRL, PEFT and diffusers (for the tests of their integrations) come without
# their declared dependencies, which would replace the pinned torch, transformers or accelerate
# (torchtune's and TRL's ask for newer ones; timm's torchvision is a CUDA build): their few
# other needs are pinned beside them, and timm's torchvision goes into a folder of its own that
# tests/_frameworks.py puts on the path only while timm is imported (it says why).
nodeps=(timm==1.0.31 torchtune==0.6.1 torchao==0.11.0 torchdata==0.11.0 trl==1.16.0 peft==0.21.2 diffusers==0.42.1)
their_needs=(datasets==5.2.0 omegaconf==2.4.0 tiktoken==0.14.0 sentencepiece==0.2.3 blobfile==3.3.0
             kagglehub==1.0.3 lazy-importer==0.1.0 importlib-metadata==10.2.0)
install_nodeps() {
  pip_q --no-deps "${nodeps[@]}"
  DS_BUILD_OPS=0 pip_q "${base[@]}" "${their_needs[@]}" "${need[@]}"
  pip_q --no-deps --target .venv/torchvision-for-timm torchvision==0.28.0
}
nodeps_probe() {
  "$V/python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
    ('timm', 'torchtune', 'torchao', 'torchdata', 'trl', 'peft', 'diffusers', 'datasets', 'omegaconf', 'tiktoken')))" \
    2>/dev/null && [ -d .venv/torchvision-for-timm/torchvision ]
}
# Whatever the job, when nvcc will build the CUDA kernels the in-place build (no build isolation,
# so build_backend/ampx_build.py cannot bring it) needs the CUDA 12 ptxas too: without it a CUDA 13
# nvcc makes kernels that only R580+ drivers load.
if [ "${AMPX_CUDA:-}" != 0 ] && { command -v nvcc || [ -x "${AMPX_NVCC:-}" ] || [ -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ] ||
     [ -x /usr/local/cuda/bin/nvcc ]; } >/dev/null 2>&1 && [[ "$probe" != *nvidia.cuda_nvcc* ]]; then
  need+=("nvidia-cuda-nvcc-cu12==12.9.*"); probe="$probe, nvidia.cuda_nvcc"
fi
if ! "$V/python" -c "$probe" 2>/dev/null; then
  pip_q --upgrade pip
  DS_BUILD_OPS=0 pip_q "${base[@]}" "${need[@]}"
fi
if [ "$job" = test ] && [ "${AMPX_TEST_FRAMEWORKS:-1}" != 0 ] && ! nodeps_probe; then
  install_nodeps
fi
# Build in place only when an input of the build changed since the last finished one (with nvcc
# present a build takes minutes: it compiles the CUDA fatbin). scripts/build_stamp.py says what
# counts and prints why it rebuilds; AMPX_REBUILD=1 builds regardless. The stamp is removed before
# the build (its inputs noted then) and written after it, so an interrupted build is redone.
if [ "${AMPX_REBUILD:-0}" != 1 ] && "$V/python" scripts/build_stamp.py check; then
  echo "run.sh: build up to date (set-up took ${SECONDS}s)" >&2
else
  "$V/python" scripts/build_stamp.py begin
  "$V/python" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
  "$V/python" scripts/build_stamp.py finish
  echo "run.sh: set-up and build done in ${SECONDS}s" >&2
fi

case "$job" in
  demo)  exec "$V/python" -m ampx demo "$@" ;;
  # Extra arguments go to pytest; with no test path among them, pyproject's testpaths (tests/) runs.
  test)  exec "$V/python" -m pytest -q "$@" ;;
  bench) "$V/python" benchmarks/bench_kernels.py "$@"
         exec "$V/python" benchmarks/bench_step.py ;;
esac
