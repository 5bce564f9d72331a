#!/usr/bin/env bash
# Does ampx work with a given torch? One ampx wheel (abi3, built without torch) installed beside
# torch==VERSION in a fresh venv, then the test suite (the README's examples included:
# tests/test_readme.py) run against that installed package from an empty folder.
#
#   bash scripts/check_torch.sh VERSION [pytest args...]     e.g. bash scripts/check_torch.sh 2.13.0
#
# AMPX_WHEEL=path uses that wheel; else scripts/build_wheel.sh builds one into dist/check_torch/,
# which later runs reuse while the sources are unchanged. DeepSpeed, Accelerate, Transformers and
# Lightning are installed too, as scripts/run.sh test does; AMPX_CHECK_FRAMEWORKS=0 leaves them out
# (their tests then skip, all but one of test_integrations_base.py, which assumes Transformers).
# Cost: torch 2.13.0 is a local CPU wheel (about a minute of set-up); any other version comes from
# the registry, whose Linux torch is the CUDA build with its nvidia-* libraries (torch 2.10.0:
# a 915 MB wheel plus 15 nvidia packages, over 3 GB in all). Prints the venv's size and the time.
# Where pip's config caps torch (a constraint file, as on this project's VMs: torch<=2.14.1),
# PIP_CONFIG_FILE=/dev/null in front lifts it for this run (2.15.0 was measured that way).
set -euo pipefail
version="${1:?usage: bash scripts/check_torch.sh VERSION [pytest args...]}"
shift
cd "$(dirname "$0")/.."
root="$PWD"
PY="${PYTHON:-python3}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
quiet_pip() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

wheel="${AMPX_WHEEL:-}"
if [ -z "$wheel" ]; then
  # dist/check_torch/HASH/ holds the wheel built from the sources as they are now.
  hash=$(cat setup.py pyproject.toml $(git ls-files csrc cuda build_backend 'ampx/*.py') | sha256sum | cut -c1-16)
  wheel=$(ls dist/check_torch/"$hash"/ampx-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    echo "== building the wheel (scripts/build_wheel.sh)"
    wheel=$(bash scripts/build_wheel.sh "$root" "$root/dist/check_torch/$hash" | tail -1)
  fi
fi
echo "== torch==$version with $(basename "$wheel")"
"$PY" -m venv "$work/venv"
V="$work/venv/bin"
extra=(deepspeed accelerate transformers "lightning>=2.4")
if [ "${AMPX_CHECK_FRAMEWORKS:-1}" = 0 ]; then extra=(); fi
# torch pinned in the same command, so no framework can swap it for another release.
DS_BUILD_OPS=0 quiet_pip "$V/python" -m pip install -q --disable-pip-version-check "torch==$version" \
  "pytest>=7" "hypothesis>=6" numpy matplotlib tqdm "${extra[@]}"
quiet_pip "$V/python" -m pip install -q --disable-pip-version-check --no-deps "$wheel"
echo "   set-up: ${SECONDS}s, venv $(du -sh "$work/venv" | cut -f1)"
mkdir "$work/empty"
cd "$work/empty"  # so `import ampx` can only find the installed package
"$V/python" -c "import ampx, torch, sys; assert '/site-packages/' in ampx.__file__, ampx.__file__; print('   ampx from', ampx.__file__, 'with torch', torch.__version__)"
set +e
"$V/python" -m pytest -q -p no:cacheprovider "$root/tests" "$@"
rc=$?
set -e
echo "check_torch: torch==$version: pytest exit $rc after ${SECONDS}s"
exit $rc
