"""Fused multi-tensor kernels: the building blocks of ampx's scaler.

Every function takes a list (or tuple) of tensors, or a single tensor, in any
mix of float32, float16, bfloat16 and float64 and of any sizes, and processes
them all in one call of C code that runs with the GIL released, vectorised
(AVX-512, AVX2 or portable C, chosen at run time) and threaded on torch's own
OpenMP team when torch has one loaded, else on a small pool of ampx's
(``torch.get_num_threads()`` threads, or AMPX_NUM_THREADS; see
``thread_backend()``).

CUDA tensors take ampx's CUDA kernels (see ``ampx.cuda``) when the first
tensor of a call is on a CUDA device: every tensor of the call, and every
tensor argument (``found_inf``, ``flags``, ``scale``...), must be on that
device. The kernels run there, on torch's current stream of that device, and
never wait for the host: outputs (``found_inf``, ``flags``, norms, the scale)
are written on the device, and the returned norms are device tensors. Factors
may be Python numbers, 1-element float32 tensors on the device (read by the
kernels) or on the CPU. Norms there accumulate in float64 too, in a fixed
order of their own (the same bits on every run, close to but not always the
CPU's bits); stored values equal the CPU's except NaN payloads.

Scalars that live with the tensors (``inv_scale``, ``found_inf``, ``scale``)
are 1-element float32 tensors, as in torch; ``growth_tracker`` is int32.

Non-finite detection reads the input values: ``found_inf`` is set to 1.0 when
any of them is inf or NaN and is never cleared here (callers zero it). The
optional ``flags`` output holds one byte per tensor: bit 0 (``FLAG_INF``) if
that tensor held +-inf, bit 1 (``FLAG_NAN``) if it held a NaN.

Tensors need not be contiguous (a slower path copies them) and may alias one
another: in-place ops then give the result of applying the op to each tensor
in list order. An empty list is a no-op. Bad input raises TypeError or
ValueError naming the argument, position and dtype or device, and leaves
every tensor untouched.

These kernels bypass autograd: they are meant for gradients and optimizer
state, not for tensors that need a backward pass. Like torch's in-place ops,
they add one to the version counter of every tensor they write (so autograd
refuses a saved tensor modified since), and they write inference tensors only
inside ``torch.inference_mode()`` (outside it they raise before writing).

Consecutive tensors lying back to back in memory (views of one flat buffer:
DDP's bucket views, FSDP's flat parameters) are streamed as one span when no
per-tensor norm is asked for; per-tensor ``flags`` stay per tensor.
"""
import contextlib
import math
import os
import sys

import torch

from . import _C
from . import cuda as _cuda
from . import settings

__all__ = [
    "unscale_",
    "check_finite",
    "norm",
    "unscale_norm_",
    "mul_",
    "cast_",
    "update_scale_",
    "tensor_stats",
    "FLAG_INF",
    "FLAG_NAN",
    "simd_level",
    "available_simd_levels",
    "thread_backend",
    "tensor_reader",
]

FLAG_INF = _C.FLAG_INF
FLAG_NAN = _C.FLAG_NAN

_REDUCE = {2.0: _C.REDUCE_SUMSQ, 1.0: _C.REDUCE_SUMABS, math.inf: _C.REDUCE_MAXABS}
_SCALE, _WRITE, _CHECK, _SHIFT = _C.MODE_SCALE, _C.MODE_WRITE, _C.MODE_CHECK, _C.MODE_REDUCE_SHIFT

_env_threads = os.environ.get("AMPX_NUM_THREADS")
if _env_threads is not None:
    try:
        _FIXED_THREADS = int(_env_threads)
        if _FIXED_THREADS < 1:
            raise ValueError
    except ValueError:
        raise ImportError(f"AMPX_NUM_THREADS={_env_threads!r} must be a positive integer") from None
else:
    _FIXED_THREADS = None


def _shim_probes():
    """Plain tensors and Parameters of every kind the fast read must get right or decline.

    Built without the random generator (importing ampx must not move torch's random
    stream); the caller sets the device and grad mode (ampx may be imported inside
    torch.no_grad(), inference_mode() or with another default device)."""
    f32 = torch.float32
    base = torch.arange(24, dtype=f32)
    leaf = torch.ones(3, dtype=f32, requires_grad=True)
    leaf.grad = torch.full((3,), 2.0, dtype=f32)  # as AccumulateGrad leaves a gradient: a plain tensor
    probes = [torch.empty(0, dtype=f32), torch.empty(0, 5, dtype=f32), base.clone(), base.view(4, 6).t(),
              base[2:], base.view(2, 12)[:, 1], torch.nn.Parameter(base[:7].clone()), leaf.grad,
              torch.empty(2, 0, 3, dtype=f32).transpose(0, 2)]
    probes += [torch.arange(7, dtype=dt) for dt in (f32, torch.float16, torch.bfloat16, torch.float64)]
    return probes


def _enable_tensor_shim():
    """Turns on the fast read of plain tensors through torch's C shim; returns None or why not."""
    if os.environ.get("AMPX_TENSOR_SHIM", "1") == "0":
        return "turned off by AMPX_TENSOR_SHIM=0"
    if not sys.platform.startswith("linux"):
        return "only looked for on Linux"
    lib = _shim_library()
    if not os.path.exists(lib):
        return f"{lib} does not exist"
    try:
        with torch.device("cpu"), torch.inference_mode(False), torch.enable_grad():
            return _C._enable_tensor_shim(lib, torch.nn.Parameter, _shim_probes())
    except Exception as e:  # the attribute reader always works: never fail the import over this
        return f"the probe failed: {type(e).__name__}: {e}"


def _shim_library():
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")


_SHIM_WHY_NOT = _enable_tensor_shim()


def _after_failed_probe(fn, *args):
    """(tests, docs/ERRORS.md) fn(*args) as on a torch whose shim fails its start-up probe
    (torch 2.9.1's did): the probe is re-run on a tensor it refuses (a meta one), and afterwards
    on the real probes again, which brings every C route back as it was."""
    was_on = _C._set_tensor_shim()
    try:
        with contextlib.suppress(ValueError):
            _C._enable_tensor_shim(_shim_library(), torch.nn.Parameter, [torch.empty(0, device="meta")])
        return fn(*args)
    finally:
        if _SHIM_WHY_NOT is None:
            _enable_tensor_shim()
            _C._set_tensor_shim(was_on)


def tensor_reader():
    """How the kernels read a plain tensor's pointer, size, dtype and device: "torch C shim"
    (torch's stable C functions, about ten times cheaper than Python attribute reads, which
    matters with thousands of small tensors), or "python attributes: <why>". Tensor
    subclasses, non-contiguous and unusual tensors always take the attribute path."""
    if _C._set_tensor_shim():
        return "torch C shim"
    return f"python attributes: {_SHIM_WHY_NOT or 'turned off'}"


def _threads():
    return _FIXED_THREADS if _FIXED_THREADS is not None else torch.get_num_threads()


# How a CPU call's threads share its tensors (multi_tensor.h): long runs handed out as threads
# come free, or each thread the part of each tensor that torch's next kernel will give the thread
# of the same number (its fused optimizers / its elementwise ops), so that each core finds in its
# own cache what it will write next. The scaler picks by optimizer (GradScaler._split).
SPLIT_DYNAMIC, SPLIT_FUSED, SPLIT_ELEMENTWISE = 0, 1, 2


def _on(op, device, split=SPLIT_DYNAMIC):
    """Where a _C call runs, as its keywords: the CPU (device -1) with its thread count (and how
    they share the work), or a CUDA device with its current stream and workspace allocator
    (``ampx.cuda``)."""
    if device < 0:
        return {"nthreads": _threads(), "split": split} if split else {"nthreads": _threads()}
    return _cuda._launch_args(op, device)


def _as_list(tensors, name, op):
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, (list, tuple)):
        return tensors
    try:
        return list(tensors)
    except TypeError:
        raise TypeError(f"{op}: {name} must be a Tensor or a sequence of Tensors, not "
                        f"{type(tensors).__name__}") from None


def _check_outputs(op, **outputs):
    """Tensors ampx writes in place (found_inf, flags) may not require grad: autograd forbids
    in-place writes into them, and torch's own kernels refuse them."""
    for name, t in outputs.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{op}: {name} requires grad, and ampx writes it in place; pass a tensor "
                             "that does not (e.g. torch.zeros(1))")


def _reduce_code(op, ord):
    try:
        return _REDUCE[float(ord)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{op}: ord must be 2, 1 or inf, not {ord!r}") from None


def _outputs(tensors, per_tensor, device=-1):
    if device >= 0:  # written by the kernels
        dev = torch.device("cuda", device)
        total = torch.empty((), dtype=torch.float32, device=dev)
        per = torch.empty(len(tensors), dtype=torch.float32, device=dev) if per_tensor else None
        return total, per
    total = torch.zeros((), dtype=torch.float32)
    per = torch.empty(len(tensors), dtype=torch.float32) if per_tensor else None
    return total, per


def _cuda_device(tensors):
    """The CUDA device index of the first tensor (the call then runs there), or -1."""
    if len(tensors):
        t = tensors[0]
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.get_device()
    return -1


def _bump_each(tensors):
    """The public way to bump version counters, one tensor at a time."""
    from torch.autograd.graph import increment_version

    for t in tensors:
        increment_version(t)


# What torch.autograd.graph.increment_version calls, for a whole list in one C++ loop; a torch
# without it gets the public function (tests run both).
_increment_version = getattr(torch._C, "_increment_version", _bump_each)


def _bump_list(tensors):
    """What _C calls for the written tensors it cannot bump itself (tensor subclasses, or all of
    them when the probe below failed); looked up at each call, so tests can swap it."""
    _increment_version(tensors)


def _versions_probe():
    """Whether _C's own bump of version counters (torch_shim.h) agrees with torch on probe
    tensors: the counter's address shared by a view and its base, distinct for another tensor,
    absent for an inference tensor; inference mode seen on and off; one bump adding exactly
    one. Returns None when it does (and turns it on), else why not."""
    if not _C._set_tensor_shim():
        return "needs the torch C shim"
    if _C._shim_inference_mode() is None:
        return "torch's version-counter functions were not found"
    with torch.device("cpu"), torch.inference_mode(False):
        a, b = torch.zeros(4), torch.zeros(3)
        v = a.view(2, 2)
        with torch.inference_mode():
            inf = torch.zeros(2)
            mode_on = _C._shim_inference_mode()
        ca, cv, cb = (_C._shim_version_counter(t) for t in (a, v, b))
        if not (ca and ca == cv and cb and cb != ca and _C._shim_version_counter(inf) == 0):
            return "the counters' addresses disagree with torch's views"
        if not mode_on or _C._shim_inference_mode():
            return "inference mode is not seen as torch sets it"
        before_a, before_b = a._version, b._version
        _C._shim_bump(v)
        _C._shim_bump(b)
        _C._shim_bump(b)
        if (a._version, b._version) != (before_a + 1, before_b + 2):
            return "a bump from C does not move the version as torch's does"
    _C._set_versions(True)
    return None


def _enable_versions():
    _C._set_autograd(_bump_list, torch.is_inference_mode_enabled)
    if os.environ.get("AMPX_VERSIONS_FROM_C", "1") == "0":
        return "turned off by AMPX_VERSIONS_FROM_C=0"
    try:
        return _versions_probe()
    except Exception as e:  # Python's bump always works: never fail the import over this
        return f"the probe failed: {type(e).__name__}: {e}"


_VERSIONS_WHY_NOT = _enable_versions()


def _need_factor(op, name, value):
    """A multiplying op's factor may not be left out: None would read as "multiply by 1"."""
    if value is None:
        raise TypeError(f"{op}: {name} must be a float or a 1-element float32 tensor, not None")


# ---- when a call goes through torch's dispatcher (the ampx:: ops of ampx/_torch_ops.py) --------
# Eager calls go straight to _C: the dispatcher would cost microseconds a call for nothing. A call
# takes the registered op only where torch must see it: while torch.compile (or export) traces,
# while a profiler records, under a TorchDispatchMode (FakeTensorMode, FlopCounterMode ...), and
# for meta or fake tensors. Two of these questions have no public answer in torch, so each is
# asked through a private function when this torch has it, else through a fallback that never
# routes a real tensor wrongly (the calls then run eagerly, as before the ops existed).


def _profiler_probe(torch_c):
    """What tells whether a torch profiler records: (function, why the private one is not used)."""
    enabled = getattr(getattr(torch_c, "_autograd", None), "_profiler_enabled", None)
    if callable(enabled):
        return enabled, None
    return (lambda: False), "torch._C._autograd._profiler_enabled is missing: profiled calls run eagerly"


def _modes_probe(torch_c):
    """What tells whether a TorchDispatchMode is active: (function, why the private one is not used)."""
    depth = getattr(torch_c, "_len_torch_dispatch_stack", None)
    if callable(depth):
        return depth, None
    return (lambda: 0), "torch._C._len_torch_dispatch_stack is missing: calls under a dispatch mode run eagerly"


def _fake_probe():
    """What tells a FakeTensor: (function, why the private class is not used). The fallback asks for
    the fake_mode attribute every FakeTensor carries."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return (lambda t: getattr(t, "fake_mode", None) is not None), "torch._subclasses.fake_tensor is missing"
    return (lambda t: isinstance(t, FakeTensor)), None


def _probe_dispatch_hooks(torch_c=torch._C):
    """Sets the three questions; returns the list of fallbacks taken (empty on a usual torch).
    torch_c: where to look for torch's private functions (tests pass a torch that lacks them)."""
    global _profiling, _dispatch_modes, _is_fake
    (_profiling, a), (_dispatch_modes, b) = _profiler_probe(torch_c), _modes_probe(torch_c)
    _is_fake, c = _fake_probe()
    return [why for why in (a, b, c) if why]


DISPATCH_FALLBACKS = _probe_dispatch_hooks()
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling  # the same function (dynamo knows it), looked up once


def _dispatching(tensors, meta=True):
    """Whether this call must go through torch.ops.ampx (see above); ``tensors`` is the call's
    tensor list, already a list or tuple. The first tensor stands for the list: a list mixing
    meta or fake tensors with real ones is refused either way (by _C or by the fake).
    meta=False: meta tensors keep the eager path (and its refusal)."""
    if _is_compiling():
        return True
    if len(tensors):
        first = tensors[0]
        if type(first) in _PLAIN:
            if meta and first.is_meta:
                return True
        elif isinstance(first, torch.Tensor) and ((meta and first.is_meta) or _is_fake(first)):
            return True
    if _dispatch_modes():
        return True
    # Under a profiler only lists of plain dense tensors: a DTensor, sparse or nested gradient has
    # no ampx:: kernel and keeps the eager path (and the scaler's fallbacks for it).
    return _profiling() and all(type(t) in _PLAIN and t.layout is torch.strided for t in tensors)


def _detached(outputs):
    """A norm from the dispatcher as eager gives it, outside autograd: the ops have no autograd
    kernel, so torch's fallback would hand a norm of parameters a grad_fn that only warns."""
    return tuple(t.detach() for t in outputs)


def _factor(op, name, value):
    """A factor argument as the schemas take it: (tensor or None, float or None)."""
    if value is None or isinstance(value, torch.Tensor):
        return value, None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, not {type(value)!r}")
    try:
        return None, float(value)
    except OverflowError:
        raise ValueError(f"{op}: {name} is an integer too large for a float ({value!r})") from None


def unscale_(tensors, inv_scale, found_inf, *, flags=None):
    """Multiplies every tensor in place by ``inv_scale`` and checks for inf/NaN.

    The contract of ``torch._amp_foreach_non_finite_check_and_unscale_``, for
    any dtype mix: values are multiplied even when a non-finite is present.

    Args:
        tensors: a Tensor or a sequence of Tensors (float32/16, bfloat16, float64).
        inv_scale: 1-element float32 tensor, or a Python float.
        found_inf: 1-element float32 tensor, set to 1.0 if any input element is
            inf or NaN; may be None when the check result is not wanted.
        flags: optional uint8 tensor with one element per tensor (see module doc).

    Raises:
        TypeError: a non-tensor, or a tensor of a non-floating or complex dtype.
        ValueError: a tensor on an unsupported device, an output of the wrong
            size or dtype, an in-place write into a tensor whose elements may
            share memory (an expanded or overlapping strided view).
    """
    tensors = _as_list(tensors, "tensors", "ampx.ops.unscale_")
    _need_factor("ampx.ops.unscale_", "inv_scale", inv_scale)
    _check_outputs("ampx.ops.unscale_", found_inf=found_inf, flags=flags)
    if _dispatching(tensors):
        torch.ops.ampx.unscale_(tensors, *_factor("ampx.ops.unscale_", "inv_scale", inv_scale), found_inf, flags)
        return
    _unscale(tensors, inv_scale, found_inf, flags)


def _unscale(tensors, inv_scale, found_inf, flags):
    """The kernel call of unscale_ (and ampx::unscale_'s CPU and CUDA implementation)."""
    op = "ampx.ops.unscale_"
    _C.scale_reduce(op, tensors, _SCALE | _WRITE | _CHECK, factor=inv_scale, factor_name="inv_scale",
                    found_inf=found_inf, flags=flags, **_on(op, _cuda_device(tensors)))


def check_finite(tensors, found_inf, *, flags=None):
    """Sets ``found_inf`` to 1.0 if any element is inf or NaN; reads only.

    The check of ``unscale_`` without the multiply and without a write, for
    callers that leave unscaling to someone else (fused optimizers).
    Arguments and errors as for ``unscale_``.
    """
    tensors = _as_list(tensors, "tensors", "ampx.ops.check_finite")
    _check_outputs("ampx.ops.check_finite", found_inf=found_inf, flags=flags)
    if _dispatching(tensors):
        torch.ops.ampx.check_finite(tensors, found_inf, flags)
        return
    _check_finite(tensors, found_inf, flags)


def _check_flags(tensors, flags):
    """check_finite(tensors, None, flags=flags) for callers that make it many times a step on a
    few small tensors (the PrecisionMonitor's hooks): on the CPU, outside torch.compile, the
    profiler and dispatch modes, the C kernel's positional entry (about 1 us a call where the
    public op's keyword parsing and checks cost 3-4 us more); else the public op. ``flags``:
    a uint8 tensor that does not require grad, one element per tensor."""
    if tensors and type(tensors[0]) in _PLAIN and tensors[0].is_cpu and not _dispatching(tensors):
        _C.check_flags(tensors, flags, _threads())
    else:
        check_finite(tensors, None, flags=flags)


def _check_finite(tensors, found_inf, flags):
    op = "ampx.ops.check_finite"
    _C.scale_reduce(op, tensors, _CHECK, found_inf=found_inf, flags=flags, **_on(op, _cuda_device(tensors)))


def norm(tensors, ord=2.0, *, factor=None, found_inf=None, flags=None, per_tensor=False, _split=SPLIT_DYNAMIC):
    """The total norm of all the tensors' elements, read-only.

    Args:
        tensors: a Tensor or a sequence of Tensors.
        ord: 2 (Euclidean), 1, or ``math.inf`` (largest magnitude).
        factor: optional multiplier (float or 1-element float32 tensor): the
            norm is then that of the products, formed and rounded exactly as
            ``unscale_`` would store them, without writing anything.
        found_inf: optional 1-element float32 tensor set to 1.0 on inf/NaN.
        flags: optional uint8 tensor, one element per tensor.
        per_tensor: also return each tensor's norm.

    Returns:
        A 0-dim float32 tensor (inf or NaN when the inputs hold them), or
        ``(total, per_tensor_norms)`` with a float32 tensor of one norm per
        tensor. Squares and sums accumulate in float64 in a fixed order, so
        the same input gives the same bits on every run.

    Raises:
        TypeError, ValueError: as ``unscale_``, and ValueError for another ``ord``.
    """
    tensors = _as_list(tensors, "tensors", "ampx.ops.norm")
    op = "ampx.ops.norm"
    _check_outputs(op, found_inf=found_inf, flags=flags)
    r = _reduce_code(op, ord)
    if _dispatching(tensors):
        total, per = _detached(torch.ops.ampx.norm(tensors, r, *_factor(op, "factor", factor), found_inf, flags,
                                                   bool(per_tensor), _split))
    else:
        total, per = _norm(tensors, r, factor, found_inf, flags, per_tensor, _split)
    return (total, per) if per_tensor else total


def _norm(tensors, reduce, factor, found_inf, flags, per_tensor, split):
    """The kernel call of norm; returns (total, per-tensor norms or None)."""
    op = "ampx.ops.norm"
    mode = _CHECK | (reduce << _SHIFT) | (_SCALE if factor is not None else 0)
    dev = _cuda_device(tensors)
    total, per = _outputs(tensors, per_tensor, dev)
    _C.scale_reduce(op, tensors, mode, factor=factor, found_inf=found_inf, flags=flags, per_tensor=per, out=total,
                    **_on(op, dev, split))
    return total, per


def unscale_norm_(tensors, inv_scale, found_inf, *, ord=2.0, flags=None, per_tensor=False):
    """``unscale_`` and ``norm`` of the unscaled values in one pass over memory.

    Returns what ``norm(tensors, ord)`` would return after ``unscale_``: the
    norm of the values as stored (rounded to float16/bfloat16 for those).
    When tensors alias one another, each tensor's norm is taken right after
    that tensor is unscaled (the op applied tensor by tensor, in list order).
    Arguments and errors as for ``unscale_`` and ``norm``.
    """
    tensors = _as_list(tensors, "tensors", "ampx.ops.unscale_norm_")
    op = "ampx.ops.unscale_norm_"
    _check_outputs(op, found_inf=found_inf, flags=flags)
    r = _reduce_code(op, ord)
    if _dispatching(tensors):
        total, per = _detached(torch.ops.ampx.unscale_norm_(tensors, *_factor(op, "inv_scale", inv_scale), found_inf,
                                                            flags, r, bool(per_tensor)))
    else:
        total, per = _unscale_norm(tensors, inv_scale, found_inf, flags, r, per_tensor)
    return (total, per) if per_tensor else total


def _unscale_norm(tensors, inv_scale, found_inf, flags, reduce, per_tensor):
    op = "ampx.ops.unscale_norm_"
    dev = _cuda_device(tensors)
    total, per = _outputs(tensors, per_tensor, dev)
    _C.scale_reduce(op, tensors, _SCALE | _WRITE | _CHECK | (reduce << _SHIFT), factor=inv_scale,
                    factor_name="inv_scale", found_inf=found_inf, flags=flags, per_tensor=per, out=total,
                    **_on(op, dev))
    return total, per


def mul_(tensors, factor, *, _split=SPLIT_DYNAMIC):
    """Multiplies every tensor in place by ``factor`` (float or 1-element float32 tensor).

    Products are formed in float32 with the factor rounded to float32, or,
    for float64 tensors, in float64 with the factor as given; then rounded
    to the tensor's dtype. Errors as for ``unscale_``.
    """
    tensors = _as_list(tensors, "tensors", "ampx.ops.mul_")
    _need_factor("ampx.ops.mul_", "factor", factor)
    if _dispatching(tensors):
        torch.ops.ampx.mul_(tensors, *_factor("ampx.ops.mul_", "factor", factor), _split)
        return
    _mul(tensors, factor, _split)


def _mul(tensors, factor, split):
    op = "ampx.ops.mul_"
    _C.scale_reduce(op, tensors, _SCALE | _WRITE, factor=factor, **_on(op, _cuda_device(tensors), split))


_U64 = 1 << 64


def cast_(src, dst, *, inv_scale=None, found_inf=None, flags=None, rounding="nearest", seed=0, offset=0,
          rng=None):
    """Writes ``src[i] * inv_scale`` into ``dst[i]``, converting the dtype.

    The "copy model gradients into float32 master gradients" path (bfloat16 or
    float16 -> float32, fused with unscaling and the inf/NaN check of the
    source values) and the "write float32 master weights back into the
    model" path (float32 -> bfloat16 / float16).

    Args:
        src, dst: Tensors or equal-length sequences of Tensors; src[i] and
            dst[i] hold the same number of elements (shapes may differ:
            elements pair up in row-major order). dst[i] may be src[i] itself
            (same dtype); any other sharing of memory with a dst is refused.
        inv_scale: optional multiplier (float or 1-element float32 tensor).
        found_inf, flags: as in ``unscale_``, for the source values.
        rounding: "nearest" (ties to even) or "stochastic" (bfloat16 dst only:
            rounds up with probability equal to the discarded fraction, so the
            rounding is unbiased).
        seed, offset: integers in [0, 2**64) choosing the random bits of
            stochastic rounding; the same (seed, offset) and inputs give the
            same bits, on CPU and GPU alike. Pass a new offset each step.
        rng: instead of seed and offset, a 2-element int64 tensor ``[seed, offset]`` (as
            two's-complement uint64) on the tensors' device. A CUDA kernel reads it when it
            runs, so a captured CUDA graph replays with the value it holds then (advance it
            with ``rng[1:].add_(1)`` after the call, inside the graph).

    Conversion from float64 to float16/bfloat16 is rounded once (no double
    rounding through float32).

    Raises:
        TypeError, ValueError: as ``unscale_``; ValueError for mismatched
        lengths or sizes, shared memory, a bad ``rounding`` or seed/offset.
    """
    src = _as_list(src, "src", "ampx.ops.cast_")
    dst = _as_list(dst, "dst", "ampx.ops.cast_")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"ampx.ops.cast_: rounding must be 'nearest' or 'stochastic', not {rounding!r}")
    for name, v in (("seed", seed), ("offset", offset)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _U64:
            raise ValueError(f"ampx.ops.cast_: {name} must be an integer in [0, 2**64), not {v!r}")
    op = "ampx.ops.cast_"
    if rng is not None and (not isinstance(rng, torch.Tensor) or rng.dtype != torch.int64 or rng.numel() != 2
                            or not rng.is_contiguous()):
        raise ValueError(f"{op}: rng must be a contiguous int64 tensor of 2 elements [seed, offset], not "
                         f"{type(rng).__name__ if not isinstance(rng, torch.Tensor) else (rng.dtype, tuple(rng.shape))}")
    _check_outputs(op, found_inf=found_inf, flags=flags)
    stochastic = rounding == "stochastic"
    if _dispatching(src if len(src) else dst):
        # the schema's ints are int64: seed and offset travel as their two's-complement bits
        torch.ops.ampx.cast_(src, dst, *_factor(op, "inv_scale", inv_scale), found_inf, flags, stochastic,
                             _signed64(seed), _signed64(offset), rng)
        return
    _cast(src, dst, inv_scale, found_inf, flags, stochastic, seed, offset, rng)


def _signed64(v):
    return v - _U64 if v >= _U64 // 2 else v


def _cast(src, dst, inv_scale, found_inf, flags, stochastic, seed, offset, rng):
    """The kernel call of cast_ (seed and offset in [0, 2**64))."""
    op = "ampx.ops.cast_"
    dev = _cuda_device(src) if len(src) else _cuda_device(dst)
    _C.cast(op, src, dst, inv_scale=inv_scale, found_inf=found_inf, flags=flags, stochastic=stochastic,
            seed=seed, offset=offset, rng=None if rng is None else rng.view(torch.uint8), **_on(op, dev))


_is_real = settings.is_real
_is_count = settings.is_count


def check_scale_rule(op, *, growth_factor=2.0, backoff_factor=0.5, growth_interval=1, hysteresis=1,
                     min_scale=0.0, max_scale=math.inf):
    """Raises ValueError, naming ``op``, the argument and the rule, for settings the scale
    update cannot honour. The one set of rules for update_scale_, GradScaler's constructor and
    its load_state_dict (which passes "state_dict['<key>']"-style names through ``op``)."""
    def bad(name, value, rule):
        raise ValueError(f"{op}: {name} must be {rule}, not {value!r}")

    if not (_is_real(growth_factor) and 1.0 <= growth_factor < math.inf):
        bad("growth_factor", growth_factor, "a finite number >= 1")
    if not (_is_real(backoff_factor) and 0.0 < backoff_factor <= 1.0):
        bad("backoff_factor", backoff_factor, "a number in (0, 1]")
    if not (_is_count(growth_interval) and growth_interval >= 1):
        bad("growth_interval", growth_interval, "an integer >= 1")
    if not (_is_count(hysteresis) and hysteresis >= 1):
        bad("hysteresis", hysteresis, "an integer >= 1")
    if not (_is_real(min_scale) and 0.0 <= min_scale < math.inf):
        bad("min_scale", min_scale, "a finite number >= 0")
    if not (_is_real(max_scale) and max_scale >= min_scale):
        bad("max_scale", max_scale, f"a number >= min_scale ({min_scale!r}), inf for none")


def _update_scale_events(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval,
                         hysteresis, hysteresis_tracker, consecutive_hysteresis, min_scale, max_scale):
    """The update; returns its events (AMPX_UPD_* bits): an int on the CPU, and for a CUDA
    ``scale`` a 0-dim int32 tensor on its device, written by the kernel (reading it waits).
    The settings are the caller's to check (``check_scale_rule``)."""
    if hysteresis > 1 and hysteresis_tracker is None:
        raise ValueError("ampx.ops.update_scale_: hysteresis > 1 needs a hysteresis_tracker (int32, 1 element)")
    if isinstance(scale, torch.Tensor) and _dispatching([scale]):
        return torch.ops.ampx.update_scale_(scale, growth_tracker, found_inf, float(growth_factor),
                                            float(backoff_factor), int(growth_interval), int(hysteresis),
                                            hysteresis_tracker, bool(consecutive_hysteresis), float(min_scale),
                                            float(max_scale))
    return _update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval,
                         hysteresis, hysteresis_tracker, consecutive_hysteresis, min_scale, max_scale)


def _update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval,
                  hysteresis, hysteresis_tracker, consecutive_hysteresis, min_scale, max_scale):
    dev = scale.get_device() if isinstance(scale, torch.Tensor) and scale.is_cuda else -1
    events = torch.empty((), dtype=torch.int32, device=scale.device) if dev >= 0 else None
    ev = _C.update_scale(scale, growth_tracker, found_inf, float(growth_factor), float(backoff_factor),
                         int(growth_interval), hysteresis_tracker=hysteresis_tracker, hysteresis=int(hysteresis),
                         consecutive=bool(consecutive_hysteresis), min_scale=float(min_scale),
                         max_scale=float(max_scale), events=events, **_on("ampx.ops.update_scale_", dev))
    return events if dev >= 0 else ev


def update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, *,
                  hysteresis=1, hysteresis_tracker=None, consecutive_hysteresis=False, min_scale=0.0,
                  max_scale=math.inf):
    """Updates the loss scale in place after a step; returns ``scale``.

    Without the keyword extras this is ``torch._amp_update_scale_`` exactly:
    on overflow (``found_inf`` non-zero) ``scale *= backoff_factor`` and the
    tracker resets; otherwise the tracker counts clean steps and after
    ``growth_interval`` of them ``scale *= growth_factor`` (if still finite).

    Extras (DeepSpeed's and Megatron's meaning):
        hysteresis: overflows tolerated before backing off; each overflow
            spends one unit from ``hysteresis_tracker`` (int32, 1 element,
            start it at ``hysteresis``) until one is left; a growth refills it.
        consecutive_hysteresis: refill on every clean step instead.
        min_scale, max_scale: bounds the scale never leaves.

    On CUDA (a CUDA ``scale``; the other tensors on its device) the update is a
    one-thread kernel on the current stream: nothing waits for the device.

    Raises:
        TypeError, ValueError: a tensor of the wrong dtype, size or device; a
        setting the rule cannot honour (growth_factor < 1, backoff_factor outside
        (0, 1], growth_interval or hysteresis < 1, NaN or negative bounds,
        min_scale > max_scale); hysteresis > 1 without a tracker.
    """
    check_scale_rule("ampx.ops.update_scale_", growth_factor=growth_factor, backoff_factor=backoff_factor,
                     growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
                     max_scale=max_scale)
    _update_scale_events(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval,
                         hysteresis, hysteresis_tracker, consecutive_hysteresis, min_scale, max_scale)
    return scale


def tensor_stats(tensors, *, out=None):
    """Per-tensor statistics from one read of every tensor: a ``[len(tensors), WIDTH]`` float64
    tensor on the tensors' device, one row per tensor in the layout ``ampx.stats`` documents
    (largest and smallest non-zero magnitude, counts of +inf, -inf, NaN and zeros, and a
    histogram of base-2 exponents over float32's range, subnormals one bucket each).
    ``ampx.stats.fractions(row, fmt, scale)`` turns a row into what float16, bfloat16 or
    float8 would overflow and flush to zero at a scale, with no further pass over the data.

    Reads only; never waits for a CUDA device.

    Args:
        tensors: a Tensor or a sequence of Tensors (float32/16, bfloat16, float64), all on one
            device; non-contiguous ones are read through a contiguous copy.
        out: optional contiguous float64 tensor of ``len(tensors) * WIDTH`` elements on that
            device that no input overlaps; written and returned (as ``[n, WIDTH]`` when it has
            that shape). By default a new one.

    Raises:
        TypeError, ValueError: as ``unscale_`` for the tensors; an ``out`` of the wrong dtype,
        size or device, one that overlaps an input, or one that requires grad.
    """
    op = "ampx.ops.tensor_stats"
    tensors = _as_list(tensors, "tensors", op)
    _check_outputs(op, out=out)
    if _dispatching(tensors):
        if out is not None:
            raise ValueError(f"{op}: out= is taken only eagerly; under torch.compile, FakeTensor or meta "
                             "tensors the op returns a new tensor")
        return torch.ops.ampx.tensor_stats(tensors)
    return _tensor_stats(tensors, out)


def _tensor_stats(tensors, out=None):
    """The kernel call of tensor_stats (and ampx::tensor_stats' CPU and CUDA implementation)."""
    op = "ampx.ops.tensor_stats"
    device = _cuda_device(tensors)
    if out is None:
        dev = torch.device("cuda", device) if device >= 0 else torch.device("cpu")
        out = torch.empty((len(tensors), _C.STATS_WIDTH), dtype=torch.float64, device=dev)
    _C.tensor_stats(op, tensors, out, **_on(op, device))
    return out


def _scaler_pass(tensors, mode_reduce, factor, found_inf, flags, write, refuse_fp16, device, split=SPLIT_DYNAMIC):
    """The scaler's one pass over its gradients (private), on ``device`` (a CUDA index, or -1
    for the CPU): the scaler has already split its gradients by device.

    write=True: unscale in place (and reduce if mode_reduce); write=False:
    read-only check (and norm of the products with factor if mode_reduce).
    split: SPLIT_* (how the CPU threads share the tensors: written values and flags never
    depend on it; a norm's float64 sum is grouped by thread part, so its last bits may).
    Returns the total as a 0-dim float32 tensor when reducing, else None.
    Raises _C.LayoutError (a ValueError) for sparse tensors before writing.
    """
    # A scaler steps real gradients: meta ones beside a real scale stay refused (FakeTensorMode
    # and compile, which trace a step, still take the ops).
    if _dispatching(tensors, meta=False):
        kernel = torch.ops.ampx._scaler_unscale_ if write else torch.ops.ampx._scaler_check
        total = kernel(tensors, mode_reduce, *_factor("ampx.GradScaler", "inv_scale", factor), found_inf, flags,
                       bool(refuse_fp16), split)
        return total if mode_reduce else None
    return _scaler_kernel(tensors, mode_reduce, factor, found_inf, flags, write, refuse_fp16, device, split)


def _scaler_kernel(tensors, mode_reduce, factor, found_inf, flags, write, refuse_fp16, device, split):
    mode = _CHECK | (mode_reduce << _SHIFT)
    if write:
        mode |= _SCALE | _WRITE
    elif mode_reduce and factor is not None:
        mode |= _SCALE
    op = "ampx.GradScaler"
    total = _outputs(tensors, False, device)[0] if mode_reduce else None
    _C.scale_reduce(op, tensors, mode, factor=factor, found_inf=found_inf, flags=flags, out=total,
                    refuse_fp16=refuse_fp16, **_on(op, device, split))
    return total


def simd_level():
    """The CPU kernel level in use: "avx512", "avx2" or "portable"."""
    return _C.simd()


def thread_backend():
    """Where multi-threaded CPU calls run: the path of the OpenMP runtime torch loaded (ampx
    joins its team rather than competing with it), or "ampx pool" (no runtime loaded, a
    forked child, or AMPX_THREADING=pool)."""
    return _C.thread_backend()


def available_simd_levels():
    """The levels this processor supports, best first (AMPX_SIMD=... forces one)."""
    return list(_C.simd_levels())
