"""Build of ampx: one C extension (ampx._C), no torch and no pybind11 needed.

The extension uses Python's limited API, so one build serves CPython 3.9 and
later (an abi3 wheel), and it talks to torch only through Python attributes,
so it serves every torch version without a rebuild.

SIMD: the kernel body is compiled once per instruction-set level, each file
with its own -m flags, and ampx picks the level at run time. The rest of the
code gets the toolchain's default target (never -march=native).

Environment:
  AMPX_DEBUG=1       build with -O0 -g (and AMPX_SANITIZE=address,undefined adds sanitizers)
"""
import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"

# Files compiled with extra instruction-set flags (x86-64 only).
ISA_SOURCES = {
    "cpu_kernels_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "cpu_kernels_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}
COMMON_SOURCES = ["module.c", "multi_tensor.c", "threadpool.c", "cpu_dispatch.c", "cpu_kernels_portable.c"]


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
    return flags


def link_flags():
    flags = ["-pthread"]
    sanitize = os.environ.get("AMPX_SANITIZE")
    if sanitize:
        flags += ["-fsanitize=" + sanitize]
    return flags


class BuildExt(build_ext):
    """Compiles the per-ISA kernel files with their own flags, then links them in."""

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
    py_limited_api=True,
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
