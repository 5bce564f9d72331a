"""Every ```python block of the README runs, so the examples cannot rot.

A block whose first line is ``# needs: <module>`` uses an optional framework: it is skipped when
the module is missing and otherwise runs as its own program (a fresh process in a temporary
directory), as a user would run it, so the framework's process-wide state and files stay there.
"""
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path):
    code = BLOCKS[index]
    needs = re.match(r"# needs: (\w+)\n", code)
    if needs is None:
        exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})
        return
    pytest.importorskip(needs.group(1))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"README.md[python block {index}]:\n{run.stdout[-2000:]}{run.stderr[-3000:]}"
