"""Importing the optional frameworks whose import needs help on some machines.

timm needs torchvision, and torchvision's wheels on PyPI are built against a CUDA torch: under the
CPU-only torch of this project's test environment its C ops cannot load, and torchvision 0.28's
import then fails registering fake kernels for two of them. Installed where Python finds it, such
a torchvision breaks every library that imports it when present (the Transformers models). So the
test set-up installs it apart (``pip install --no-deps --target <venv>/torchvision-for-timm``,
or the folder ``AMPX_TORCHVISION_DIR`` names), and ``import_timm`` puts it on the path only while
timm is imported, declaring the two ops' schemas if their library did not load, and then takes
it off again (path and modules), so that nothing else sees a torchvision.
"""
import importlib.util
import os
import sys

import pytest
import torch

_TORCHVISION_OPS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def import_timm():
    """timm, imported once (with the set-aside torchvision where there is no other), or a skip."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (pip install ampx[timm])", allow_module_level=True)
    if "timm" in sys.modules:
        return sys.modules["timm"]
    apart = None
    if importlib.util.find_spec("torchvision") is None:
        apart = os.environ.get("AMPX_TORCHVISION_DIR") or os.path.join(sys.prefix, "torchvision-for-timm")
        if not os.path.isdir(os.path.join(apart, "torchvision")):
            pytest.skip(f"timm needs torchvision, which is neither installed nor in {apart}", allow_module_level=True)
        sys.path.append(apart)
    try:
        return _import_timm_declaring_ops()
    finally:
        if apart is not None:
            sys.path.remove(apart)
            for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
                del sys.modules[name]


def _import_timm_declaring_ops():
    try:
        import timm
    except RuntimeError as exc:
        if "torchvision::" not in str(exc) or getattr(import_timm, "lib", None) is not None:
            raise
        for name in [m for m in sys.modules if m.split(".")[0] in ("torchvision", "timm")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "DEF")
        for schema in _TORCHVISION_OPS:
            lib.define(schema)
        import_timm.lib = lib  # kept alive: the schemas go with it
        import timm
    return timm
