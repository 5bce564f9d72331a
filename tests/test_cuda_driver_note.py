"""ampx.cuda.unavailable_reason() names the NVIDIA driver the installed kernels need, from the
toolkit _kernels.json records, whatever the reason they cannot run (here: stubbed probes)."""
import pytest

import ampx
import ampx.cuda as cuda


class _Probe:
    def __init__(self, reason):
        self.reason = reason

    def cuda_probe(self, index):
        return self.reason


@pytest.fixture
def built(monkeypatch):
    """A build with kernels, whose probe says `reason`, recorded as made by `info`."""
    def make(reason, info):
        monkeypatch.setattr(cuda, "_built", lambda: True)
        monkeypatch.setattr(cuda, "_load_image", lambda: True)
        monkeypatch.setattr(cuda, "_C", _Probe(reason))
        monkeypatch.setattr(cuda, "build_info", lambda: info)
        return cuda.unavailable_reason(0)
    return make


@pytest.mark.parametrize("info,branch,made", [
    ({"sass_toolkit": 13000, "ptx_toolkit": 13000}, "R580", "CUDA 13.0 and"),
    ({"sass_toolkit": 12090, "ptx_toolkit": 12000}, "R525", "CUDA 12.9 (PTX ISA of CUDA 12.0) and"),
])
def test_reason_names_the_driver(built, info, branch, made):
    reason = built("no CUDA driver: libcuda.so.1 could not be loaded", info)
    assert reason.startswith("no CUDA driver: libcuda.so.1 could not be loaded (ampx's kernels here were built with ")
    assert made in reason and f"need an NVIDIA driver {branch} or newer)" in reason


def test_a_reason_that_names_the_driver_is_left_alone(built):
    reason = "built with CUDA 13.0 and need a driver for CUDA 13.0 (R580 or newer)"
    assert built(reason, {"sass_toolkit": 13000, "ptx_toolkit": 13000}) == reason


@pytest.mark.parametrize("info", [{}, {"sass_toolkit": 99000}])
def test_unknown_toolkit_adds_nothing(built, info):
    assert built("no GPU", info) == "no GPU"


def test_available_stays_none(built):
    assert built(None, {"sass_toolkit": 13000}) is None


def test_not_built_says_how_to_get_portable_kernels(monkeypatch):
    monkeypatch.setattr(cuda, "_built", lambda: False)
    assert "R525+" in cuda.unavailable_reason() and "nvcc" in cuda.unavailable_reason()
