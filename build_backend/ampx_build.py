"""ampx's PEP 517 build backend: setuptools' own (setuptools.build_meta), plus the CUDA 12 ptxas.

pyproject.toml names this module (backend-path = ["build_backend"]), so every source install,
`pip install .` and `pip install ampx-*.tar.gz` alike, goes through it. What it adds:

- When the build will compile the CUDA kernels (nvcc found, AMPX_CUDA not 0) with an nvcc that
  is not itself a CUDA 12.8+ one (and no AMPX_PTXAS chosen), get_requires_for_build_wheel (and
  _editable) asks for nvidia-cuda-nvcc-cu12: pip installs it into the isolated build environment,
  and setup.py's find_ptxas12 finds its ptxas there, so the kernels load on every R525+ driver
  rather than only on the drivers of the system nvcc's release (CUDA 13: R580+).
- A build that can still make only CUDA 13 kernels (--no-build-isolation without that package,
  AMPX_PTXAS=0, a registry that lacks it) says so in its first line of output. pip shows a
  backend's output only with -v or when the build fails (pypa/pip#6634 asks for a channel; there
  is none), so the line also goes to the controlling terminal, /dev/tty, when there is one: an
  interactive `pip install .` shows it; a log without -v cannot.

- An editable install also gets ampx_shadow_guard.py (with a .pth that runs it at start-up): it
  explains the case where the checkout folder shadows the editable install (that file says how).

setup.py imports the toolkit look-ups below, so the backend and the build decide alike.
"""
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401  (the hooks ampx does not change)
    build_sdist,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

HERE = os.path.dirname(os.path.abspath(__file__))
# The top-level module name the shadow guard is installed under (setuptools' own editable files
# are named __editable___<dist>_<version>_finder, so this one cannot clash with a real module).
GUARD_MODULE = "__editable___ampx_shadow_guard"
# The CUDA 12 ptxas (it ships no nvcc): 12.9 builds SASS for every target ampx has (sm_120 too).
CUDA12_PTXAS_REQUIREMENT = 'nvidia-cuda-nvcc-cu12==12.9.*; platform_system == "Linux"'
# The oldest driver branch that loads kernels of each CUDA major release (SASS and PTX 8.x/9.x).
DRIVER_FOR_CUDA = {12: "R525", 13: "R580"}


def cuda_mode():
    """'off', 'on' (a missing or failing nvcc is an error) or 'auto', from $AMPX_CUDA."""
    mode = os.environ.get("AMPX_CUDA", "").strip().lower()
    if mode in ("0", "no", "off", "false"):
        return "off"
    if mode in ("1", "yes", "on", "true"):
        return "on"
    if mode:
        sys.exit(f"AMPX_CUDA={mode!r}: expected 1 or 0")
    return "auto"


def find_nvcc():
    """nvcc from $AMPX_NVCC, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, then PATH; None if none."""
    candidates = [os.environ["AMPX_NVCC"]] if os.environ.get("AMPX_NVCC") else []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return shutil.which("nvcc")


def tool_release(tool):
    """(major, minor) of a CUDA tool from its --version ("release 12.9"); None if it will not say."""
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def find_ptxas12():
    """A CUDA 12 ptxas able to target every arch: $AMPX_PTXAS, else nvidia-cuda-nvcc-cu12's."""
    env = os.environ.get("AMPX_PTXAS", "").strip()
    if env.lower() in ("0", "no", "off", "false"):
        return None
    if env:
        return env
    for base in sys.path:  # the pip package installs nvidia/cuda_nvcc/bin/ptxas
        c = os.path.join(base or ".", "nvidia", "cuda_nvcc", "bin", "ptxas")
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def is_cuda12_builder(release):
    """Whether a CUDA tool of `release` makes SASS for every ampx target that R525+ drivers load."""
    return release is not None and (12, 8) <= release < (13, 0)


def wants_cuda12_ptxas():
    """Whether this build compiles CUDA kernels and needs the CUDA 12 ptxas package to make them
    portable: nvcc found, AMPX_CUDA not 0, no AMPX_PTXAS chosen, nvcc not a CUDA 12.8+ one."""
    if cuda_mode() == "off" or os.environ.get("AMPX_PTXAS", "").strip():
        return False
    nvcc = find_nvcc()
    return nvcc is not None and not is_cuda12_builder(tool_release(nvcc))


def cuda13_only_warning():
    """The warning for a build whose kernels only the newest drivers load, else None."""
    if cuda_mode() == "off":
        return None
    nvcc = find_nvcc()
    release = tool_release(nvcc) if nvcc else None
    if release is None or release[0] < 13:
        return None
    ptxas = find_ptxas12()
    if ptxas and is_cuda12_builder(tool_release(ptxas)):
        return None
    need = DRIVER_FOR_CUDA.get(release[0], f"a CUDA {release[0]}")
    return (f"ampx: WARNING: the CUDA kernels will be built by CUDA {release[0]}.{release[1]} alone and load only "
            f"with NVIDIA driver {need} or newer (no CUDA 12.8+ ptxas in the build environment). For kernels "
            f"that load on every R525+ driver, build with isolation (the default: it installs "
            f"nvidia-cuda-nvcc-cu12) or pip install 'nvidia-cuda-nvcc-cu12==12.9.*' first; AMPX_CUDA=0 builds none.")


def say_first(message):
    """Prints `message` on stderr and, when a terminal is attached, on it too (see the top)."""
    print(message, file=sys.stderr, flush=True)
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(message + "\n")
    except OSError:
        pass


def _warn_if_cuda13_only():
    message = cuda13_only_warning()
    if message:
        say_first(message)


def get_requires_for_build_wheel(config_settings=None):
    extra = [CUDA12_PTXAS_REQUIREMENT] if wants_cuda12_ptxas() else []
    return _setuptools.get_requires_for_build_wheel(config_settings) + extra


def get_requires_for_build_editable(config_settings=None):
    extra = [CUDA12_PTXAS_REQUIREMENT] if wants_cuda12_ptxas() else []
    return _setuptools.get_requires_for_build_editable(config_settings) + extra


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _warn_if_cuda13_only()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _warn_if_cuda13_only()
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    with open(os.path.join(HERE, "ampx_shadow_guard.py"), "rb") as f:
        guard = f.read()
    add_to_wheel(os.path.join(wheel_directory, name),
                 {GUARD_MODULE + ".py": guard, GUARD_MODULE + ".pth": f"import {GUARD_MODULE}; {GUARD_MODULE}.install()\n".encode()})
    return name


def record_row(name, data):
    """The RECORD line of a wheel file (PEP 376/427: urlsafe base64 sha256 without padding, size)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def add_to_wheel(path, files):
    """Adds {name: bytes} to the wheel at `path` and to its RECORD (rewriting it in place)."""
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for item in src.infolist():
            if item.filename != record:
                dst.writestr(item, src.read(item))
        rows = [r for r in src.read(record).decode().splitlines() if r and not r.startswith(record + ",")]
        for name, data in files.items():
            dst.writestr(name, data)
            rows.append(record_row(name, data))
        dst.writestr(record, "\n".join(rows + [record + ",,"]) + "\n")
    os.replace(tmp, path)
