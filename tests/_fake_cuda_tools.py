"""A stand-in for a CUDA tool (nvcc, ptxas) that only answers --version, for the build tests."""
import stat


def fake_cuda_tool(path, release):
    """Writes an executable at `path` (a pathlib.Path) that says it is CUDA `release`; returns it as str."""
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)
