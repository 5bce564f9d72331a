"""Every ```python block of the README runs, so the examples cannot rot."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
# Frameworks an example may need; where one is not installed (check_package.sh's venvs), its
# examples are skipped, not failed.
OPTIONAL = ("lightning", "accelerate", "transformers")


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    code = BLOCKS[index]
    for module in OPTIONAL:
        if re.search(rf"^(import|from) {module}\b", code, flags=re.M):
            pytest.importorskip(module)
    exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})
