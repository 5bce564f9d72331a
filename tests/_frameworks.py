"""Importing the optional frameworks whose import needs help on some machines."""
import importlib.util
import sys

import pytest
import torch


def import_timm():
    """timm, or a skip. torchvision's CUDA wheels cannot load their C ops under a CPU-only torch,
    and torchvision 0.28's import then fails registering fake kernels for two of them; timm
    needs only torchvision's Python parts, so the two schemas are declared when that happens."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (pip install ampx[timm])", allow_module_level=True)
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("timm needs torchvision, which is not installed", allow_module_level=True)
    try:
        import timm
    except RuntimeError as exc:
        if "torchvision::" not in str(exc) or getattr(import_timm, "lib", None) is not None:
            raise
        for name in [m for m in sys.modules if m.split(".")[0] in ("torchvision", "timm")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import_timm.lib = lib  # kept alive: the schemas go with it
        import timm
    return timm
