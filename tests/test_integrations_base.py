"""The integrations package: frameworks stay optional and a missing one names its extra."""
import subprocess
import sys

import pytest

from ampx.integrations import require


def test_import_ampx_imports_no_framework():
    code = ("import sys, ampx, ampx.integrations; "
            "bad = [m for m in ('accelerate', 'transformers', 'lightning', 'pytorch_lightning', "
            "'deepspeed', 'timm', 'torchtune') if m in sys.modules]; print(bad); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_framework_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install ampx\[lightning\]") as info:
        require("ampx_no_such_framework_xyz", "lightning")
    assert "ampx_no_such_framework_xyz" in str(info.value)


def test_present_module_is_returned():
    assert require("json", "accelerate").__name__ == "json"


@pytest.mark.parametrize("module, missing, extra", [("accelerate", "accelerate", "accelerate"),
                                                    ("transformers", "transformers", "transformers"),
                                                    ("transformers", "accelerate", "transformers"),
                                                    ("timm", "timm", "timm"),
                                                    ("torchtune", "torchtune", "torchtune")])
def test_an_integration_without_its_framework_names_the_extra(module, missing, extra):
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            f"try:\n    import ampx.integrations.{module}\nexcept ImportError as e:\n    print(e)\n"
            "else:\n    raise SystemExit('imported')")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert f"pip install ampx[{extra}]" in out and f"'{missing}'" in out
