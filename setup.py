"""Build of ampx: one C extension (ampx._C), no torch and no pybind11 needed.

The extension uses Python's limited API, so one build serves CPython 3.9 and
later (an abi3 wheel), and it talks to torch only through Python attributes,
so it serves every torch version without a rebuild.

SIMD: the kernel body is compiled once per instruction-set level, each file
with its own -m flags, and ampx picks the level at run time. The rest of the
code gets the toolchain's default target (never -march=native).

CUDA: when nvcc is found ($CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, then
PATH), cuda/ampx_kernels.cu is compiled into ampx/_kernels.fatbin (SASS for
sm_80, sm_86, sm_89, sm_90 and PTX for compute_90), shipped inside the
package. The C extension never links against CUDA: it opens libcuda.so.1 at
run time and loads the fatbin through the driver API, so the same build
imports everywhere. Neither step needs torch or a GPU.

Environment:
  AMPX_DEBUG=1       build with -O0 -g (and AMPX_SANITIZE=address,undefined adds sanitizers)
  AMPX_CUDA=1        build the fatbin, failing when nvcc is missing or fails; AMPX_CUDA=0 skips it
                     (an existing fatbin is left alone); unset: build it when nvcc is found, and
                     when nvcc fails, warn and build the CPU-only package

Hygiene: every build compiles every object afresh (--force), in a scratch directory outside the
source tree that is removed afterwards, so no build reuses an object made with other flags (a
sanitizer build, another SIMD flag set) and none leaves build/ or ampx.egg-info behind.
  AMPX_NVCC_FLAGS    extra nvcc flags (e.g. -allow-unsupported-compiler)
"""
import atexit
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"

# Files compiled with extra instruction-set flags (x86-64 only).
ISA_SOURCES = {
    "cpu_kernels_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "cpu_kernels_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}
COMMON_SOURCES = ["module.c", "tensor_meta.c", "tensor_list.c", "overlap.c", "entry.c", "entry_cpu.c",
                  "entry_cuda.c", "collect_grads.c", "multi_tensor.c", "threadpool.c", "cpu_dispatch.c",
                  "cpu_kernels_portable.c", "cuda_driver.c", "cuda_launch.c", "torch_shim.c"]

# The CUDA kernels: one source, one fatbin next to the extension module.
CUDA_SOURCE = os.path.join("cuda", "ampx_kernels.cu")
CUDA_DEPENDS = [CUDA_SOURCE] + [os.path.join(CSRC, h) for h in ("ampx_numerics.h", "cuda_args.h", "cuda_driver.h")]
FATBIN_NAME = "_kernels.fatbin"
# SASS for each listed architecture, PTX for the last (the driver compiles it for newer GPUs).
CUDA_ARCHS = ["80", "86", "89", "90"]


def is_x86_64():
    return platform.machine().lower() in ("x86_64", "amd64")


def c_flags():
    flags = ["-std=c11", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    if os.environ.get("AMPX_DEBUG"):
        flags += ["-O0", "-g"]
    else:
        flags += ["-O3"]
    sanitize = os.environ.get("AMPX_SANITIZE")
    if sanitize:
        flags += ["-fsanitize=" + sanitize, "-fno-omit-frame-pointer", "-g"]
    if sys.platform.startswith("linux"):
        # Old glibc symbol versions, so the wheel loads on glibc < 2.34 (see the header).
        flags += ["-include", os.path.join(HERE, CSRC, "glibc_compat.h")]
    return flags


def find_nvcc():
    """nvcc from $CUDA_HOME, /usr/local/cuda, then PATH; None if there is none."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return shutil.which("nvcc")


def cuda_wanted():
    """(build the fatbin?, required?, nvcc path); exits when AMPX_CUDA=1 and there is no nvcc."""
    mode = os.environ.get("AMPX_CUDA", "").strip().lower()
    if mode in ("0", "no", "off", "false"):
        return False, False, None
    nvcc = find_nvcc()
    if mode in ("1", "yes", "on", "true"):
        if nvcc is None:
            sys.exit("AMPX_CUDA=1 but nvcc was not found ($CUDA_HOME/bin, /usr/local/cuda/bin, PATH)")
        return True, True, nvcc
    if mode:
        sys.exit(f"AMPX_CUDA={mode!r}: expected 1 or 0")
    return nvcc is not None, False, nvcc


def nvcc_command(nvcc, out):
    cmd = [nvcc, "-std=c++17", "-O3", "--fatbin", "-I" + CSRC, "--threads", "0"]
    for a in CUDA_ARCHS[:-1]:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    last = CUDA_ARCHS[-1]
    cmd += ["-gencode", f"arch=compute_{last},code=[sm_{last},compute_{last}]"]
    cmd += shlex.split(os.environ.get("AMPX_NVCC_FLAGS", ""))
    return cmd + ["-o", out, CUDA_SOURCE]


def up_to_date(target, sources):
    if not os.path.isfile(target) or os.path.getsize(target) == 0:
        return False
    t = os.path.getmtime(target)
    return all(os.path.getmtime(s) <= t for s in sources)


_SCRATCH = []


def scratch_dir(what):
    """A fresh directory outside the source tree for this build's intermediates, removed at exit."""
    if not _SCRATCH:
        root = tempfile.mkdtemp(prefix="ampx-build-")
        _SCRATCH.append(root)
        atexit.register(shutil.rmtree, root, True)
    path = os.path.join(_SCRATCH[0], what)
    os.makedirs(path, exist_ok=True)
    return path


def link_flags():
    flags = ["-pthread"]
    if sys.platform.startswith("linux"):
        # On glibc < 2.34 the old dlopen/pthread_create versions (glibc_compat.h) live in libdl
        # and libpthread: name them as dependencies, whatever the linker's --as-needed default.
        flags += ["-Wl,--push-state,--no-as-needed", "-l:libdl.so.2", "-l:libpthread.so.0", "-Wl,--pop-state"]
    sanitize = os.environ.get("AMPX_SANITIZE")
    if sanitize:
        flags += ["-fsanitize=" + sanitize]
    return flags


class BuildExt(build_ext):
    """Builds the CUDA fatbin (when wanted), then compiles the per-ISA kernel
    files with their own flags and links them in."""

    def finalize_options(self):
        super().finalize_options()
        self.force = True  # objects are cheap to rebuild and dangerous to reuse (see the top)
        self.build_temp = scratch_dir("temp")

    def run(self):
        self.build_fatbin()
        super().run()

    def fatbin_path(self):
        # Next to the extension module: the source tree for in-place and editable
        # builds, build_lib (and so the wheel) otherwise.
        return os.path.join(os.path.dirname(self.get_ext_fullpath("ampx._C")), FATBIN_NAME)

    def build_fatbin(self):
        want, required, nvcc = cuda_wanted()
        if not want:
            why = "AMPX_CUDA=0" if os.environ.get("AMPX_CUDA") else "nvcc not found"
            print(f"ampx: CUDA kernels not built ({why})")
            return
        out = self.fatbin_path()
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if not self.force and up_to_date(out, [os.path.join(HERE, d) for d in CUDA_DEPENDS]):
            return
        fd, tmp = tempfile.mkstemp(suffix=".fatbin", dir=os.path.dirname(out))
        os.close(fd)
        cmd = nvcc_command(nvcc, tmp)
        print("ampx: " + " ".join(shlex.quote(c) for c in cmd))
        try:
            subprocess.run(cmd, cwd=HERE, check=True)
            if os.path.getsize(tmp) == 0:
                raise RuntimeError("nvcc wrote an empty fatbin")
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if required:
                sys.exit(f"ampx: building the CUDA kernels failed ({e}); AMPX_CUDA=0 builds without them")
            # Found but broken (a toolkit too new for the host compiler, a half-installed CUDA):
            # a CPU user must still get a working package. A fatbin left from an older build no
            # longer matches the sources (that is why nvcc ran), so it goes too.
            if os.path.exists(out):
                os.unlink(out)
            print(f"ampx: WARNING: nvcc ({nvcc}) failed ({e}); building the CPU-only package. "
                  "ampx.cuda.is_available() will say why; set AMPX_CUDA=1 to make this an error",
                  file=sys.stderr)

    def get_outputs(self):
        outputs = super().get_outputs()
        out = self.fatbin_path()
        if os.path.isfile(out):
            outputs.append(out)
        return outputs

    def build_extension(self, ext):
        if ext.name == "ampx._C" and is_x86_64() and self.compiler.compiler_type == "unix":
            objects = []
            for name, isa in ISA_SOURCES.items():
                objects += self.compiler.compile(
                    [os.path.join(CSRC, name)],
                    output_dir=self.build_temp,
                    include_dirs=ext.include_dirs,
                    extra_postargs=c_flags() + isa,
                    depends=ext.depends,
                )
            ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)


ext = Extension(
    "ampx._C",
    sources=[os.path.join(CSRC, s) for s in COMMON_SOURCES],
    include_dirs=[CSRC],
    depends=[os.path.join(CSRC, h) for h in os.listdir(os.path.join(HERE, CSRC)) if h.endswith(".h")],
    extra_compile_args=c_flags(),
    extra_link_args=link_flags(),
    libraries=["dl"] if sys.platform.startswith("linux") else [],
    py_limited_api=True,
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    options={
        "bdist_wheel": {"py_limited_api": "cp39"},
        # Keep build/ and ampx.egg-info out of the source tree (see the top).
        "build": {"build_base": scratch_dir("build")},
        "egg_info": {"egg_base": scratch_dir("egg")},
    },
)
