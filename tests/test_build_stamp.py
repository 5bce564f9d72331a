"""scripts/build_stamp.py, the stamp that lets scripts/run.sh skip a build: it passes only for a
finished build whose inputs, settings and artifacts are all unchanged, and names what changed."""
import importlib.util
import os
import pathlib

import pytest
from _fake_cuda_tools import fake_cuda_tool

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("build_stamp", ROOT / "scripts" / "build_stamp.py")
build_stamp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_stamp)


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A miniature source tree that has just been built, and the environment it was built in."""
    for rel, text in {"csrc/module.c": "int x;", "cuda/k.cu": "// k", "setup.py": "# s",
                      "pyproject.toml": "# p", "ampx/_C.abi3.so": "ELF", "ampx/_kernels.fatbin": "FAT"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    env = {"PATH": os.environ.get("PATH", ""), "AMPX_NVCC": fake_cuda_tool(tmp_path / "nvcc", "12.9")}
    monkeypatch.setattr(build_stamp, "editable_install", lambda root: os.path.realpath(root))
    build_stamp.begin_build(str(tmp_path), env)
    build_stamp.finish_build(str(tmp_path))
    return tmp_path, env


def reasons(tree):
    root, env = tree
    return build_stamp.reasons_to_build(str(root), env)


def test_no_stamp_means_build(tmp_path):
    assert build_stamp.reasons_to_build(str(tmp_path), {}) == ["no finished build recorded"]


def test_unchanged_build_stands(tree):
    assert reasons(tree) == []


def test_a_source_edit_rebuilds_and_is_named(tree):
    (tree[0] / "csrc" / "module.c").write_text("int y;")
    assert reasons(tree) == ["file csrc/module.c changed"]


def test_a_new_source_file_rebuilds(tree):
    (tree[0] / "cuda" / "new.h").write_text("//")
    assert reasons(tree) == ["file cuda/new.h added"]


def test_a_build_setting_rebuilds(tree):
    tree[1]["AMPX_CUDA"] = "0"
    why = reasons(tree)
    assert "env AMPX_CUDA changed" in why


def test_another_nvcc_release_rebuilds(tree):
    fake_cuda_tool(tree[0] / "nvcc", "13.0")
    assert reasons(tree) == [f"tool {tree[0] / 'nvcc'} changed"]


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_missing_or_replaced_artifact_rebuilds(tree, how):
    fatbin = tree[0] / "ampx" / "_kernels.fatbin"
    if how == "deleted":
        fatbin.unlink()
        assert reasons(tree) == ["ampx/_kernels.fatbin missing"]
    else:
        fatbin.write_text("half-written")
        assert reasons(tree) == ["ampx/_kernels.fatbin changed since the build"]


def test_a_torn_stamp_rebuilds(tree):
    (tree[0] / build_stamp.STAMP).write_text('{"inputs": ')
    assert reasons(tree) == ["no finished build recorded"]


def test_a_lost_editable_install_rebuilds(tree, monkeypatch):
    monkeypatch.setattr(build_stamp, "editable_install", lambda root: None)
    assert len(reasons(tree)) == 1 and "has no editable install of this tree" in reasons(tree)[0]


def test_an_interrupted_build_rebuilds(tree):
    root, env = tree
    build_stamp.begin_build(str(root), env)  # ... and the build never finishes
    assert build_stamp.reasons_to_build(str(root), env) == ["no finished build recorded"]


def test_a_source_edited_during_the_build_rebuilds(tree):
    root, env = tree
    build_stamp.begin_build(str(root), env)
    (root / "setup.py").write_text("# edited while the compiler ran")
    build_stamp.finish_build(str(root))
    assert build_stamp.reasons_to_build(str(root), env) == ["file setup.py changed"]


def test_run_sh_begins_the_stamp_before_building_and_finishes_it_after():
    """The order that keeps an interrupted build from passing for a finished one."""
    text = (ROOT / "scripts" / "run.sh").read_text()
    steps = ("build_stamp.py begin", "pip install -q --no-build-isolation", "build_stamp.py finish")
    begin, build, finish = (text.index(s) for s in steps)
    assert begin < build < finish
