"""Build of ampx: one C extension (ampx._C), no torch and no pybind11 needed.

The extension uses Python's limited API, so one build serves CPython 3.9 and
later (an abi3 wheel), and it talks to torch only through Python attributes,
so it serves every torch version without a rebuild.

SIMD: the kernel body is compiled once per instruction-set level, each file
with its own -m flags, and ampx picks the level at run time. The rest of the
code gets the toolchain's default target (never -march=native).

CUDA: when nvcc is found ($AMPX_NVCC, $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc,
then PATH), cuda/ampx_kernels.cu is compiled into ampx/_kernels.fatbin (SASS for
sm_80, 86, 89, 90, 100 and 120, PTX for compute_80), shipped inside the package
with ampx/_kernels.json (the toolkit that built it, so ampx can say which driver
it needs). The CUDA release decides the drivers served: SASS from CUDA 12.x loads
on every R525+ driver, from CUDA 13 only on R580+. So a CUDA 12 ptxas is
preferred: $AMPX_PTXAS, else the one of the nvidia-cuda-nvcc-cu12 package (it
ships ptxas but no nvcc; ampx's build backend, build_backend/ampx_build.py, asks pip for it
whenever nvcc is found, so a source install with build isolation has it). With it, nvcc (any
release) writes PTX for compute_80, that PTX is stamped with CUDA 12.0's ISA
version, 8.0 (so every R525+ driver can JIT it; a PTX instruction that ISA lacks
then fails the build, never the run), ptxas compiles each SASS target and fatbinary packs the lot.
Without it nvcc builds everything itself (a CUDA 13 nvcc: R580+ drivers only). The C extension never links against CUDA: it opens libcuda.so.1 at
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
  AMPX_NVCC          the nvcc to use (before $CUDA_HOME and the rest)
  AMPX_PTXAS         a CUDA 12 ptxas for the SASS (before the nvidia-cuda-nvcc-cu12 package's);
                     AMPX_PTXAS=0 makes nvcc build everything itself
"""
import atexit
import json
import os
import re
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
# The toolkit look-ups are shared with the PEP 517 backend, so that what it asks pip for (the CUDA
# 12 ptxas) and what this build then uses are decided alike.
sys.path.insert(0, os.path.join(HERE, "build_backend"))
from ampx_build import DRIVER_FOR_CUDA, cuda_mode, find_nvcc, find_ptxas12, is_cuda12_builder, tool_release  # noqa: E402
CSRC = "csrc"

# Files compiled with extra instruction-set flags (x86-64 only).
ISA_SOURCES = {
    "cpu_kernels_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "cpu_kernels_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}
COMMON_SOURCES = ["module.c", "tensor_meta.c", "tensor_list.c", "overlap.c", "entry.c", "entry_cpu.c", "stats_cpu.c",
                  "entry_cuda.c", "collect_grads.c", "multi_tensor.c", "coalesce.c", "threadpool.c", "cpu_dispatch.c",
                  "cpu_kernels_portable.c", "cuda_driver.c", "cuda_launch.c", "torch_shim.c"]

# The CUDA kernels: one source, one fatbin next to the extension module.
CUDA_SOURCE = os.path.join("cuda", "ampx_kernels.cu")
CUDA_DEPENDS = [CUDA_SOURCE] + [os.path.join(CSRC, h) for h in ("ampx_numerics.h", "cuda_args.h", "cuda_driver.h")]
FATBIN_NAME = "_kernels.fatbin"
BUILD_INFO_NAME = "_kernels.json"  # the toolkit that built the fatbin (read by ampx.cuda)
# SASS for each architecture; PTX for the first, the oldest (the driver compiles it for GPUs
# newer than every SASS target). Blackwell (100, 120) needs CUDA 12.8 or newer.
CUDA_ARCHS = ["80", "86", "89", "90", "100", "120"]
# The PTX is stamped with CUDA 12.0's ISA version (8.0), so every driver that loads the CUDA 12
# SASS (R525+) can also JIT the PTX. Every CUDA 12 ptxas accepts it, and rejects an instruction
# that ISA lacks, so the stamp can never hide a newer instruction. (Measured with ptxas 12.9:
# the SASS is byte-identical whether the PTX says 8.0 or 8.8, for sm_80 to sm_120.)
PTX_ISA, PTX_ISA_RELEASE = "8.0", (12, 0)


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


def cuda_wanted():
    """(build the fatbin?, required?, nvcc path); exits when AMPX_CUDA=1 and there is no nvcc."""
    mode = cuda_mode()
    if mode == "off":
        return False, False, None
    nvcc = find_nvcc()
    if mode == "on" and nvcc is None:
        sys.exit("AMPX_CUDA=1 but nvcc was not found ($CUDA_HOME/bin, /usr/local/cuda/bin, PATH)")
    return nvcc is not None, mode == "on", nvcc


def nvcc_flags():
    return ["-std=c++17", "-O3", "-I" + CSRC] + shlex.split(os.environ.get("AMPX_NVCC_FLAGS", ""))


def archs_for(release):
    """The SASS targets a CUDA release can build: Blackwell (100, 120) needs 12.8 (before, the
    compute_80 PTX serves those GPUs through the driver's JIT)."""
    return [a for a in CUDA_ARCHS if release >= (12, 8) or int(a) < 100]


def nvcc_command(nvcc, out, archs):
    """nvcc doing it all: SASS for each arch, PTX for the first."""
    cmd = [nvcc] + nvcc_flags() + ["--fatbin", "--threads", "0"]
    first = archs[0]
    cmd += ["-gencode", f"arch=compute_{first},code=[sm_{first},compute_{first}]"]
    for a in archs[1:]:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return cmd + ["-o", out, CUDA_SOURCE]


def run_logged(cmd):
    print("ampx: " + " ".join(shlex.quote(c) for c in cmd))
    subprocess.run(cmd, cwd=HERE, check=True)


def build_with_ptxas12(nvcc, ptxas, release, out, tmpdir):
    """The CUDA 12 route (see the top): nvcc's PTX for the oldest arch, restamped with CUDA
    12.0's ISA version (PTX_ISA), ptxas (CUDA 12.`release[1]`) for each SASS target in parallel,
    fatbinary to pack them. Raises CalledProcessError/RuntimeError on failure."""
    isa = PTX_ISA
    first = CUDA_ARCHS[0]
    ptx = os.path.join(tmpdir, f"ampx_kernels.compute_{first}.ptx")
    run_logged([nvcc] + nvcc_flags() + ["-ptx", f"-arch=compute_{first}", "-o", ptx, CUDA_SOURCE])
    with open(ptx) as f:
        text = f.read()
    text, n = re.subn(r"^\.version \d+\.\d+$", ".version " + isa, text, count=1, flags=re.M)
    if n != 1:
        raise RuntimeError(f"no .version line in {ptx}")
    with open(ptx, "w") as f:
        f.write(text)
    cubins, procs = [], []
    for a in CUDA_ARCHS:
        cubin = os.path.join(tmpdir, f"ampx_kernels.sm_{a}.cubin")
        cmd = [ptxas, f"-arch=sm_{a}", "-m64", "-O3", ptx, "-o", cubin]
        print("ampx: " + " ".join(shlex.quote(c) for c in cmd))
        procs.append((subprocess.Popen(cmd, cwd=HERE), cmd))
        cubins.append((a, cubin))
    for p, cmd in procs:
        if p.wait() != 0:
            raise subprocess.CalledProcessError(p.returncode, cmd)
    fatbinary = os.path.join(os.path.dirname(nvcc), "fatbinary")
    # Uncompressed: a compression scheme newer than the driver reads as an invalid image.
    cmd = [fatbinary, f"--create={out}", "-64", "--compress=false"]
    cmd += [f"--image3=kind=elf,sm={a},file={c}" for a, c in cubins]
    cmd += [f"--image3=kind=ptx,sm={first},file={ptx}"]
    run_logged(cmd)


def build_info(release, ptx_release, archs):
    """What ampx/_kernels.json records: the CUDA releases that made the SASS and the PTX (as
    cuDriverGetVersion numbers, 1000*major + 10*minor) and the targets."""
    return {"sass_toolkit": release[0] * 1000 + release[1] * 10,
            "ptx_toolkit": ptx_release[0] * 1000 + ptx_release[1] * 10,
            "sass": [int(a) for a in archs], "ptx": [int(archs[0])]}


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

    def build_info_path(self):
        return os.path.join(os.path.dirname(self.fatbin_path()), BUILD_INFO_NAME)

    def compile_fatbin(self, nvcc, tmp):
        """Writes the fatbin to tmp; returns its build_info."""
        nvcc_release = tool_release(nvcc)
        if nvcc_release is None:
            raise RuntimeError(f"{nvcc} --version names no CUDA release")
        # A CUDA 12.8+ nvcc does it all; any other takes a CUDA 12.8+ ptxas when there is one.
        ptxas = find_ptxas12() if not is_cuda12_builder(nvcc_release) else None
        ptxas_release = tool_release(ptxas) if ptxas else None
        if is_cuda12_builder(ptxas_release):
            with tempfile.TemporaryDirectory(dir=scratch_dir("cuda")) as work:
                build_with_ptxas12(nvcc, ptxas, ptxas_release, tmp, work)
            return build_info(ptxas_release, PTX_ISA_RELEASE, CUDA_ARCHS)
        if ptxas is not None:
            print(f"ampx: WARNING: {ptxas} is not a CUDA 12.8+ ptxas; nvcc builds everything", file=sys.stderr)
        elif nvcc_release[0] > 12:
            need = DRIVER_FOR_CUDA.get(nvcc_release[0], "of that release")
            print(f"ampx: WARNING: CUDA {nvcc_release[0]}.{nvcc_release[1]} kernels need an NVIDIA driver {need} "
                  "or newer; pip install 'nvidia-cuda-nvcc-cu12==12.9.*' builds kernels for every R525+ driver",
                  file=sys.stderr)
        archs = archs_for(nvcc_release)
        run_logged(nvcc_command(nvcc, tmp, archs))
        return build_info(nvcc_release, nvcc_release, archs)

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
        info_path = self.build_info_path()
        try:
            info = self.compile_fatbin(nvcc, tmp)
            if os.path.getsize(tmp) == 0:
                raise RuntimeError("nvcc wrote an empty fatbin")
            os.chmod(tmp, 0o644)
            with open(info_path, "w") as f:
                json.dump(info, f)
            os.replace(tmp, out)
            print(f"ampx: CUDA kernels built: {info}")
        except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if required:
                sys.exit(f"ampx: building the CUDA kernels failed ({e}); AMPX_CUDA=0 builds without them")
            # Found but broken (a toolkit too new for the host compiler, a half-installed CUDA):
            # a CPU user must still get a working package. A fatbin left from an older build no
            # longer matches the sources (that is why nvcc ran), so it goes too.
            for stale in (out, info_path):
                if os.path.exists(stale):
                    os.unlink(stale)
            print(f"ampx: WARNING: nvcc ({nvcc}) failed ({e}); building the CPU-only package. "
                  "ampx.cuda.is_available() will say why; set AMPX_CUDA=1 to make this an error",
                  file=sys.stderr)

    def get_outputs(self):
        outputs = super().get_outputs()
        for out in (self.fatbin_path(), self.build_info_path()):
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
