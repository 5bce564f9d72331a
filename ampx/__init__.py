"""ampx: mixed-precision training for PyTorch on fused C and CUDA kernels.

``ampx.ops`` holds the multi-tensor kernels (unscale, norm, cast, scale update).
"""
import os as _os

import torch as _torch

try:
    from . import _C
except ImportError as _e:  # a source tree without its build, often one that shadows an install
    raise ImportError(
        f"ampx's C extension (ampx._C) could not be imported from {_os.path.dirname(__file__)}: {_e}. "
        "If that folder is an ampx source checkout (for instance because Python was started in the "
        "folder that holds it, which shadows an installed ampx), build it in place with "
        "`bash scripts/run.sh test` or `pip install -e .`, or start Python from another folder."
    ) from _e

_C._init(
    _torch.Tensor,
    _torch.float32,
    _torch.float16,
    _torch.bfloat16,
    _torch.float64,
    _torch.uint8,
    _torch.int32,
    _torch.strided,
    _torch._C.TensorBase.__dict__["dtype"],
    _torch._C.TensorBase.__dict__["is_cpu"],
    _torch._C.TensorBase.__dict__["nbytes"],
)

_simd = _os.environ.get("AMPX_SIMD")
if _simd:
    try:
        _C.set_simd(_simd)
    except ValueError as e:
        raise ImportError(f"AMPX_SIMD={_simd!r}: {e}") from None

from . import cuda, ops  # noqa: E402
from . import _torch_ops  # noqa: E402,F401  (defines torch.ops.ampx.*)
from .doctor import PrecisionMonitor  # noqa: E402
from .grad_buffer import GradBuffer  # noqa: E402
from .master import MasterWeights  # noqa: E402
from .policy import PerformanceWarning, Policy  # noqa: E402
from .prepare import prepare  # noqa: E402  (the function; the module is sys.modules['ampx.prepare'])
from .scaler import GradScaler, OverflowReport  # noqa: E402
from .settings import SettingError  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name):
    # ampx.ShardedGradScaler is imported on first use (ampx/sharded_scaler.py says why).
    if name == "ShardedGradScaler":
        from .sharded_scaler import ShardedGradScaler

        return ShardedGradScaler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
__all__ = ["ops", "cuda", "GradScaler", "ShardedGradScaler", "OverflowReport", "PrecisionMonitor", "MasterWeights", "GradBuffer", "Policy", "PerformanceWarning", "prepare", "SettingError", "__version__"]
