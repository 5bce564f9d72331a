#!/usr/bin/env bash
# Builds ampx's C code with AddressSanitizer and UndefinedBehaviorSanitizer into a
# scratch copy and runs the kernel and error-path tests against it.
# Needs .venv (made by scripts/run.sh) and gcc's libasan/libubsan.
set -euo pipefail
cd "$(dirname "$0")/.."
V="$PWD/.venv/bin"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the working tree as it is: tracked files and new ones not yet added (ignored ones excluded)
git ls-files -z --cached --others --exclude-standard |
  xargs -0 -I{} sh -c 'if [ -e "$1" ]; then cp --parents "$1" "$2"; fi' _ {} "$work"
cd "$work"
# AMPX_CUDA=0: no fatbin (CI builds it in the main run); the C host code of the CUDA path is
# compiled and its validation paths run all the same.
export AMPX_CUDA=0
AMPX_DEBUG=1 AMPX_SANITIZE=address,undefined "$V/python" setup.py -q build_ext --inplace >/dev/null
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
LD_PRELOAD="$asan:$ubsan" ASAN_OPTIONS=detect_leaks=0 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONPATH="$work" \
  "$V/python" -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_errors.py \
  tests/test_numerics.py tests/test_refcounts.py tests/test_threads.py tests/test_cuda.py \
  tests/test_tensor_shim.py tests/test_errors_table.py tests/test_versions.py tests/test_coalesce.py \
  tests/test_storage_hold.py tests/test_storage_bounds.py tests/test_cuda_driver.py tests/test_cuda_graphs.py tests/test_split.py \
  tests/test_tensor_stats.py tests/test_doctor.py \
  -k "not emulated and not launcher and not compiled_fullgraph and not over_2_to_the_31"
