"""ampx.cuda: whether ampx's CUDA kernels can be used, and the plumbing of the CUDA path.

The kernels are compiled at build time into ``ampx/_kernels.fatbin`` (SASS for sm_80, 86, 89,
90, 100 and 120, PTX for compute_80) and loaded at run time through the CUDA driver API: ampx
opens ``libcuda.so.1`` on first use and never links against CUDA, so the same build imports and
runs on the CPU on machines without a GPU or driver. ``ampx/_kernels.json`` records the CUDA
release that built the fatbin: built by CUDA 12 (the default when the ``nvidia-cuda-nvcc-cu12``
package is installed), the kernels run on every R525-or-newer driver; built by CUDA 13, only on
R580 or newer. ``unavailable_reason()`` names the driver the kernels need whenever they cannot
run.

``ampx.ops`` takes the CUDA path when the first tensor of a call is a CUDA tensor: the kernels
run on that tensor's device (whatever the current device is), on torch's current stream of that
device, with no host synchronisation. Each device's kernels load once, on first use, without
the GIL. A forked child forgets the parent's driver state and starts afresh (CUDA itself does
not survive ``fork()``: use the 'spawn' start method).

CUDA graphs: a scaler step made of ``clip_grad_norm_``, ``step()`` of a fused optimizer built
with ``capturable=True``, and ``update()`` captures and replays; stochastic rounding in
``MasterWeights`` takes its seed and offset from a device tensor that advances at every replay.
Inside a capture ``update()`` does no host work (no event query, no pinned copy), so the
telemetry of replayed steps (``stats()``, overflow reports, ``on_overflow``) is not collected;
and ``step()`` of a non-fused optimizer (which must read ``found_inf`` on the host to decide
whether to step, as torch's does) and ``on_min_scale="raise"`` raise a RuntimeError during
capture. Run one eager step before capturing, so that ampx loads its kernels outside it.

Use ``is_available()`` to ask whether ampx can run on CUDA here and ``unavailable_reason()`` to
learn why not.
"""
import json
import os
import threading

import torch

from . import _C

__all__ = ["is_available", "unavailable_reason", "fatbin_path", "device_info", "build_info"]

_FATBIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kernels.fatbin")
_BUILD_INFO = os.path.join(os.path.dirname(_FATBIN), "_kernels.json")  # written by setup.py
_NOT_BUILT = ("ampx was built without its CUDA kernels (nvcc was not found when it was built, or "
              "AMPX_CUDA=0 was set); reinstall ampx where nvcc is available, e.g. `pip install .` from "
              "a source checkout, which builds kernels for every R525+ NVIDIA driver (AMPX_CUDA=1 makes a "
              "missing nvcc a build error)")
# The oldest NVIDIA driver branch that loads the kernels (SASS and PTX) of each CUDA major release.
_DRIVER_FOR_CUDA = {12: "R525", 13: "R580"}

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


def build_info():
    """What built the fatbin: ``{"sass_toolkit": 12090, "ptx_toolkit": 12000, "sass": [80, ...],
    "ptx": [80]}`` (CUDA releases as ``cuDriverGetVersion`` numbers), or {} when unknown."""
    try:
        with open(_BUILD_INFO) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _load_image():
    """Hands the fatbin to the C layer once; False when ampx was built without it."""
    global _image_loaded
    if _image_loaded:
        return True
    with _lock:
        if not _image_loaded:
            if not _built():
                return False
            info = build_info()
            targets = ""
            if info.get("sass") and info.get("ptx"):
                targets = (f"SASS for {', '.join(f'sm_{a}' for a in info['sass'])} and PTX for "
                           f"{', '.join(f'compute_{a}' for a in info['ptx'])}")
            with open(_FATBIN, "rb") as f:
                _C.cuda_set_image((f.read(), int(info.get("sass_toolkit", 0)), int(info.get("ptx_toolkit", 0)),
                                   targets))
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
    """None when ampx's CUDA kernels run on ``device``, else a sentence saying why not and
    what to do.

    ``device``: an index, ``"cuda:N"`` or a ``torch.device``; by default torch's current CUDA
    device (0 when torch has not initialised CUDA). The check loads the driver, compares its
    release with the one that built the kernels, loads the kernels into the device's primary
    context (creating it, as torch's first use of the device does) and launches an empty
    kernel there and waits for it: None means ampx's code has run on that device. A success
    is remembered per device; a failure is checked again at the next call.
    """
    if not _built():
        return _NOT_BUILT
    _load_image()
    reason = _C.cuda_probe(_index(device))
    need = _driver_needed()
    if reason is None or need is None or need[0] in reason:
        return reason
    return f"{reason} ({need[1]})"


def _driver_needed():
    """("R580", "ampx's kernels here were built with CUDA 13.0 and need an NVIDIA driver R580 or
    newer") from _kernels.json, or None when the build did not record its toolkit. The branch
    follows the CUDA major release of the SASS (any 12.x build loads on R525+, 13.x on R580+)."""
    info = build_info()
    sass, ptx = int(info.get("sass_toolkit") or 0), int(info.get("ptx_toolkit") or 0)
    branch = _DRIVER_FOR_CUDA.get(sass // 1000)
    if branch is None:
        return None
    made = f"CUDA {sass // 1000}.{sass % 1000 // 10}"
    if ptx and ptx != sass:
        made += f" (PTX ISA of CUDA {ptx // 1000}.{ptx % 1000 // 10})"
    return branch, f"ampx's kernels here were built with {made} and need an NVIDIA driver {branch} or newer"


def is_available(device=None):
    """True when ampx can run its kernels on CUDA tensors (see ``unavailable_reason``)."""
    return unavailable_reason(device) is None


def device_info(device=None):
    """``{"capability": (major, minor), "multiprocessors": n, "driver_version": v, "toolkit": t}``
    of a device (``t``: the CUDA release that built the kernels), loading ampx's kernels into it
    (raises RuntimeError if they cannot run there)."""
    if not _load_image():
        raise RuntimeError(_NOT_BUILT)
    major, minor, sms, driver = _C.cuda_device_info(_index(device))
    return {"capability": (major, minor), "multiprocessors": sms, "driver_version": driver,
            "toolkit": build_info().get("sass_toolkit")}


# ---- the CUDA path of ampx.ops (private) ----------------------------------------------------


def _launch_args(op, device):
    """The keywords of a _C call on CUDA device `device`: the device, its current stream and
    its workspace allocator. ValueError when ampx was built without its CUDA kernels (driver
    problems surface as RuntimeError from the call itself)."""
    if not _image_loaded and not _load_image():
        raise ValueError(f"{op}: the tensors are on cuda:{device}, but {_NOT_BUILT}")
    alloc = _allocators.get(device)
    if alloc is None:
        alloc = _allocators[device] = _allocator(torch.device("cuda", device))
    if _raw_stream is not None:
        stream = _raw_stream(device)
    else:  # pragma: no cover - CUDA tensors without torch's CUDA bindings
        stream = torch.cuda.current_stream(device).cuda_stream
    return {"device": device, "stream": stream, "alloc": alloc}


def _allocator(dev):
    """The ``alloc`` of a _C call on ``dev``: ``alloc(nbytes)`` is a workspace (uint8, on the
    current stream through torch's caching allocator); ``alloc(nbytes, data)`` is a device
    copy of ``data`` (a bytearray of nbytes: span tables) on that stream, or None when no
    pinned memory can be had (the call then runs tensor by tensor). The C side never asks for
    a copy while the stream is capturing a CUDA graph."""
    def alloc(nbytes, data=None):
        if data is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=dev)
        try:  # pinned by torch's host allocator, which keeps the buffer until the copy has run
            host = torch.frombuffer(data, dtype=torch.uint8).pin_memory()
        except RuntimeError:  # e.g. a locked-memory limit
            return None
        return host.to(dev, non_blocking=True)
    return alloc


def _capturing(device):
    """Whether torch is capturing a CUDA graph on ``device``'s current stream (False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
