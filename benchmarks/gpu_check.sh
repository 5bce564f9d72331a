#!/usr/bin/env bash
# One-shot check of ampx's CUDA path on a fresh GPU machine (no internet needed), in about
# 4-6 minutes: machine report, build (fatbin + extension), the GPU tests, the benchmarks.
#
#   bash benchmarks/gpu_check.sh            # everything
#   SKIP_TESTS=1 bash benchmarks/gpu_check.sh
#   QUICK=1 bash benchmarks/gpu_check.sh    # smaller benchmark sizes
#
# Uses the machine's python3 (with torch) unless PYTHON is set. Logs go to $OUT (when set, as
# on the device tool) or /tmp/ampx_gpu_check. Every stage runs even if an earlier one failed;
# the exit status is that of the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LOGS="${OUT:-/tmp/ampx_gpu_check}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
start=$(date +%s)
status=0
stage() { echo; echo "==== $1  (t=$(( $(date +%s) - start ))s)"; }

stage "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
"$PY" - <<'EOF' 2>&1
import platform, sys
print("python", sys.version.split()[0], platform.machine())
try:
    import setuptools; print("setuptools", setuptools.__version__)
except Exception as e: print("setuptools: missing", e)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "cc", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
          "mem GiB", round(p.total_memory / 2**30, 1))
EOF
NVCC=""
for c in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc "$(command -v nvcc 2>/dev/null)"; do
  if [ -n "$c" ] && [ -x "$c" ]; then NVCC="$c"; break; fi
done
echo "nvcc: ${NVCC:-not found}"; [ -n "$NVCC" ] && "$NVCC" --version | tail -2
echo "cores: $(nproc)"

stage "build (AMPX_CUDA=1: the fatbin must build)"
export AMPX_CUDA=1
built=0
if "$PY" -m pip install --no-build-isolation --no-deps -e . >"$LOGS/build.log" 2>&1; then
  built=1
  grep -E "^ampx:|warning" "$LOGS/build.log" | head -20
else
  echo "pip install -e . failed (log tail below); falling back to setup.py build_ext --inplace"
  tail -25 "$LOGS/build.log"
  # An older setuptools rejects pyproject.toml's metadata (license = "..." needs >= 77):
  # build from a copy without it, then bring the extension and the fatbin back.
  tmp=$(mktemp -d)
  cp -r setup.py csrc cuda ampx "$tmp"/
  if (cd "$tmp" && "$PY" setup.py build_ext --inplace) >"$LOGS/build_fallback.log" 2>&1; then
    cp "$tmp"/ampx/_C*.so "$tmp"/ampx/_kernels.fatbin ampx/ && built=1
    grep -E "^ampx:" "$LOGS/build_fallback.log" | head -5
  else
    echo "fallback build failed too:"; tail -40 "$LOGS/build_fallback.log"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ $built = 1 ] || status=1
ls -la ampx/_kernels.fatbin ampx/_C*.so 2>&1
for tool in cuobjdump "$(dirname "${NVCC:-/x}")/cuobjdump"; do
  if command -v "$tool" >/dev/null 2>&1; then "$tool" --list-elf --list-ptx ampx/_kernels.fatbin 2>&1 | head; break; fi
done

stage "ampx on CUDA"
"$PY" - <<'EOF' 2>&1 || status=1
import ampx, torch
print("unavailable_reason:", ampx.cuda.unavailable_reason())
print("is_available:", ampx.cuda.is_available())
print("device_info:", ampx.cuda.device_info(0))
x = torch.randn(1000, device="cuda")
found = torch.zeros(1, device="cuda")
t = ampx.ops.unscale_norm_([x], 0.5, found)
print("smoke unscale_norm_:", t.item(), "vs torch", torch.linalg.vector_norm(x).item(), "found", found.item())
EOF

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stage "tests (tests/test_cuda.py on the GPU)"
  # The emulated-kernel tests are for machines without a GPU (slow here, and redundant).
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider -ra --durations=8 -k "not emulated" \
      tests/test_cuda.py tests/test_scaler_cuda.py tests/test_threads.py 2>&1 | tee "$LOGS/tests.log" | tail -60
  rc=${PIPESTATUS[0]}
  echo "pytest exit status: $rc"
  [ "$rc" = 0 ] || status=1
fi

stage "benchmarks"
timeout 240 "$PY" benchmarks/gpu_check.py ${QUICK:+--quick} --json "$LOGS/bench.json" 2>&1 | tee "$LOGS/bench.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || status=1

stage "done: exit status $status, $(( $(date +%s) - start ))s in all; logs in $LOGS"
exit $status
