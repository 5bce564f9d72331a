"""build_backend/ampx_build.py, ampx's PEP 517 backend: it asks for the CUDA 12 ptxas exactly when
the build compiles CUDA kernels that would otherwise load only on the newest drivers, and a build
that can still make only CUDA 13 kernels says so first, naming the driver they need."""
import os
import pathlib
import sys


import pytest
from _fake_cuda_tools import fake_cuda_tool

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_backend"))
import ampx_build  # noqa: E402


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A clean build environment: no AMPX_* settings, setuptools' own requirements stubbed out."""
    for var in ("AMPX_CUDA", "AMPX_NVCC", "AMPX_PTXAS", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ampx_build._setuptools, "get_requires_for_build_wheel", lambda cs=None: ["wheel"])
    monkeypatch.setattr(ampx_build._setuptools, "get_requires_for_build_editable", lambda cs=None: ["wheel"])
    monkeypatch.setattr(ampx_build, "find_ptxas12", lambda: None)  # none on sys.path
    return monkeypatch, tmp_path


def use_nvcc(env, release):
    monkeypatch, tmp_path = env
    if release is None:
        monkeypatch.setattr(ampx_build, "find_nvcc", lambda: None)
    else:
        monkeypatch.setenv("AMPX_NVCC", fake_cuda_tool(tmp_path / "nvcc", release))


@pytest.mark.parametrize("hook", ["get_requires_for_build_wheel", "get_requires_for_build_editable"])
@pytest.mark.parametrize("release,ampx_cuda,asks", [
    ("13.0", None, True),     # the case: a CUDA 13 nvcc alone would make R580+ kernels
    ("12.4", None, True),     # too old for sm_100/120: the 12.9 ptxas builds them
    ("12.9", None, False),    # a CUDA 12.8+ nvcc builds portable kernels itself
    ("13.0", "0", False),     # no CUDA kernels wanted
    (None, None, False),      # no nvcc, no CUDA kernels
])
def test_asks_for_the_cuda12_ptxas_when_it_matters(env, hook, release, ampx_cuda, asks):
    use_nvcc(env, release)
    if ampx_cuda is not None:
        env[0].setenv("AMPX_CUDA", ampx_cuda)
    want = ["wheel"] + ([ampx_build.CUDA12_PTXAS_REQUIREMENT] if asks else [])
    assert getattr(ampx_build, hook)() == want


def test_a_chosen_ptxas_is_left_alone(env):
    use_nvcc(env, "13.0")
    env[0].setenv("AMPX_PTXAS", "0")
    assert ampx_build.get_requires_for_build_wheel() == ["wheel"]


def test_the_requirement_is_the_cuda12_ptxas_package():
    name, _, marker = ampx_build.CUDA12_PTXAS_REQUIREMENT.partition(";")
    assert name.strip() == "nvidia-cuda-nvcc-cu12==12.9.*" and "Linux" in marker


def test_cuda13_only_build_warns_naming_the_driver(env):
    use_nvcc(env, "13.0")
    message = ampx_build.cuda13_only_warning()
    assert message.startswith("ampx: WARNING: ") and "CUDA 13.0" in message and "R580 or newer" in message
    assert "nvidia-cuda-nvcc-cu12" in message


@pytest.mark.parametrize("case", ["cuda12 ptxas", "cuda12 nvcc", "AMPX_CUDA=0", "no nvcc"])
def test_no_warning_when_the_kernels_are_portable_or_absent(env, case):
    monkeypatch, tmp_path = env
    use_nvcc(env, {"cuda12 nvcc": "12.9", "no nvcc": None}.get(case, "13.0"))
    if case == "cuda12 ptxas":
        ptxas = fake_cuda_tool(tmp_path / "ptxas", "12.9")
        monkeypatch.setattr(ampx_build, "find_ptxas12", lambda: ptxas)
    if case == "AMPX_CUDA=0":
        monkeypatch.setenv("AMPX_CUDA", "0")
    assert ampx_build.cuda13_only_warning() is None


def test_the_warning_is_the_first_thing_a_build_prints(env, capsys):
    use_nvcc(env, "13.0")
    env[0].setattr(ampx_build._setuptools, "build_wheel", lambda *a: print("setuptools output") or "x.whl")
    assert ampx_build.build_wheel("dist") == "x.whl"
    out, err = capsys.readouterr()
    assert err.splitlines()[0].startswith("ampx: WARNING: the CUDA kernels will be built by CUDA 13.0 alone")


def test_pyproject_and_sdist_use_the_backend():
    tomllib = pytest.importorskip("tomllib")
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert build["build-backend"] == "ampx_build" and build["backend-path"] == ["build_backend"]
    assert "recursive-include build_backend *.py" in (ROOT / "MANIFEST.in").read_text()


def test_setup_py_decides_with_the_same_look_ups():
    text = (ROOT / "setup.py").read_text()
    assert "from ampx_build import" in text and "def find_nvcc" not in text


def test_add_to_wheel_lists_the_files_in_record(tmp_path):
    import zipfile

    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("x/__init__.py", "")
        z.writestr("x-1.0.dist-info/RECORD", ampx_build.record_row("x/__init__.py", b"") + "\nx-1.0.dist-info/RECORD,,\n")
    ampx_build.add_to_wheel(str(wheel), {"g.py": b"print(1)\n", "g.pth": b"import g\n"})
    with zipfile.ZipFile(wheel) as z:
        rows = z.read("x-1.0.dist-info/RECORD").decode().splitlines()
        assert sorted(z.namelist()) == ["g.pth", "g.py", "x-1.0.dist-info/RECORD", "x/__init__.py"]
        assert z.read("g.pth") == b"import g\n"
    assert rows[-1] == "x-1.0.dist-info/RECORD,," and len(rows) == 4
    assert ampx_build.record_row("g.py", b"print(1)\n") in rows


def test_editable_wheels_carry_the_shadow_guard(tmp_path, monkeypatch):
    import zipfile

    def fake_build(wheel_directory, *a):
        with zipfile.ZipFile(pathlib.Path(wheel_directory) / "ampx-0.1.0-0.editable-py3-none-any.whl", "w") as z:
            z.writestr("ampx-0.1.0.dist-info/RECORD", "ampx-0.1.0.dist-info/RECORD,,\n")
        return "ampx-0.1.0-0.editable-py3-none-any.whl"

    monkeypatch.setattr(ampx_build._setuptools, "build_editable", fake_build)
    monkeypatch.setattr(ampx_build, "cuda13_only_warning", lambda: None)
    name = ampx_build.build_editable(str(tmp_path))
    with zipfile.ZipFile(tmp_path / name) as z:
        assert z.read(ampx_build.GUARD_MODULE + ".pth").decode() == f"import {ampx_build.GUARD_MODULE}; {ampx_build.GUARD_MODULE}.install()\n"
        assert z.read(ampx_build.GUARD_MODULE + ".py") == (ROOT / "build_backend" / "ampx_shadow_guard.py").read_bytes()
