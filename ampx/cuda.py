"""ampx.cuda: whether ampx's CUDA kernels can be used, and the plumbing of the CUDA path.

The kernels are compiled at build time by nvcc into ``ampx/_kernels.fatbin`` (SASS for sm_80,
sm_86, sm_89 and sm_90, PTX for compute_90) and loaded at run time through the CUDA driver API:
ampx opens ``libcuda.so.1`` on first use and never links against CUDA, so the same build imports
and runs on the CPU on machines without a GPU or driver. ``ampx.ops`` takes the CUDA path when
the first tensor of a call is a CUDA tensor: the kernels run on that tensor's device (whatever
the current device is), on torch's current stream of that device, with no host synchronisation
(a whole scaler step can be captured into a CUDA graph).

Use ``is_available()`` to ask whether ampx can run on CUDA here and ``unavailable_reason()`` to
learn why not.
"""
import functools
import os
import threading

import torch

from . import _C

__all__ = ["is_available", "unavailable_reason", "fatbin_path", "device_info"]

_FATBIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kernels.fatbin")
_NOT_BUILT = ("ampx was built without its CUDA kernels (nvcc was not found when it was built, or "
              "AMPX_CUDA=0 was set); reinstall ampx where nvcc is available (AMPX_CUDA=1 makes a "
              "missing nvcc a build error)")

_lock = threading.Lock()
_image_loaded = False
_allocators = {}

try:  # the current stream of a device as a raw handle, without building a Stream object
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # a CPU build of torch: no CUDA tensors can reach ampx's CUDA path
    _raw_stream = None


def fatbin_path():
    """Where the CUDA kernels' fatbin lives in this installation (it may not exist)."""
    return _FATBIN


def _built():
    try:
        return os.path.getsize(_FATBIN) > 0
    except OSError:
        return False


def _load_image():
    """Hands the fatbin to the C layer once; False when ampx was built without it."""
    global _image_loaded
    if _image_loaded:
        return True
    with _lock:
        if not _image_loaded:
            if not _built():
                return False
            with open(_FATBIN, "rb") as f:
                _C.cuda_set_image(f.read())
            _image_loaded = True
    return True


def _index(device):
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"ampx.cuda: {device!r} is not a CUDA device")
    return d.index if d.index is not None else _index(None)


def unavailable_reason(device=None):
    """None when ampx's CUDA kernels can run on ``device``, else a sentence saying why not.

    ``device``: an index, ``"cuda:N"`` or a ``torch.device``; by default torch's current CUDA
    device (0 when torch has not initialised CUDA). The check loads the driver and reads the
    device's compute capability (8.0 or newer is needed); it creates no CUDA context. When
    torch has already made the device's context, the kernels are also loaded into it, so a
    driver too old for them is reported here rather than at the first call.
    """
    if not _built():
        return _NOT_BUILT
    _load_image()
    return _C.cuda_probe(_index(device))


def is_available(device=None):
    """True when ampx can run its kernels on CUDA tensors (see ``unavailable_reason``)."""
    return unavailable_reason(device) is None


def device_info(device=None):
    """``{"capability": (major, minor), "multiprocessors": n, "driver_version": v}`` of a
    device, loading ampx's kernels into it (raises RuntimeError if they cannot run there)."""
    if not _load_image():
        raise RuntimeError(_NOT_BUILT)
    major, minor, sms, driver = _C.cuda_device_info(_index(device))
    return {"capability": (major, minor), "multiprocessors": sms, "driver_version": driver}


# ---- the CUDA path of ampx.ops (private) ----------------------------------------------------


def _launch_args(op, device):
    """The keywords of a _C call on CUDA device `device`: the device, its current stream and
    its workspace allocator. ValueError when ampx was built without its CUDA kernels (driver
    problems surface as RuntimeError from the call itself)."""
    if not _image_loaded and not _load_image():
        raise ValueError(f"{op}: the tensors are on cuda:{device}, but {_NOT_BUILT}")
    alloc = _allocators.get(device)
    if alloc is None:
        alloc = _allocators[device] = functools.partial(
            torch.empty, dtype=torch.uint8, device=torch.device("cuda", device))
    if _raw_stream is not None:
        stream = _raw_stream(device)
    else:  # pragma: no cover - CUDA tensors without torch's CUDA bindings
        stream = torch.cuda.current_stream(device).cuda_stream
    return {"device": device, "stream": stream, "alloc": alloc}
