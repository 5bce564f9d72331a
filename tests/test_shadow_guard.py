"""The shadow guard an editable install carries (build_backend/ampx_shadow_guard.py): Python started
in the folder that holds a checkout named `ampx` would import that folder as an empty namespace
package; the guard turns that into an ImportError that says so, and changes nothing else."""
import os
import pathlib
import subprocess
import sys

import pytest

BACKEND = pathlib.Path(__file__).resolve().parent.parent / "build_backend"
# What the .pth does at start-up, then the user's import; run from `cwd`, so '' (cwd) leads sys.path.
SCRIPT = (f"import sys; sys.path.append({str(BACKEND)!r}); import ampx_shadow_guard; ampx_shadow_guard.install(); "
          "import ampx; print('imported', ampx.__name__, getattr(ampx, 'WHO', None))")


def run_from(cwd):
    # -S and no PYTHONPATH: no installed ampx on the path, as with an editable install (whose
    # finder runs after the path search); a regular install would rightly win over the folder.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-S", "-c", SCRIPT], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_checkout_folder_named_ampx_is_explained(tmp_path):
    (tmp_path / "ampx" / "ampx").mkdir(parents=True)
    (tmp_path / "ampx" / "ampx" / "__init__.py").write_text("")
    r = run_from(tmp_path)
    assert r.returncode != 0 and "ImportError: `import ampx` found " in r.stderr, r.stderr
    assert f"{tmp_path / 'ampx'}, an ampx source checkout" in r.stderr and "Start Python from another folder" in r.stderr


def test_a_real_package_in_the_folder_is_left_alone(tmp_path):
    (tmp_path / "ampx").mkdir()
    (tmp_path / "ampx" / "__init__.py").write_text("WHO = 'here'\n")
    r = run_from(tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["imported", "ampx", "here"], r.stderr


def test_an_unrelated_namespace_folder_is_left_alone(tmp_path):
    (tmp_path / "ampx").mkdir()
    r = run_from(tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["imported", "ampx", "None"], r.stderr


@pytest.mark.parametrize("name", ["ampx.ops", "torch", "ampxx"])
def test_other_names_are_not_looked_at(name):
    sys.path.insert(0, str(BACKEND))
    try:
        import ampx_shadow_guard
    finally:
        sys.path.remove(str(BACKEND))
    assert ampx_shadow_guard.ShadowGuard.find_spec(name, None if "." not in name else ["x"]) is None
