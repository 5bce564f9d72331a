"""ampx's kernels as torch custom ops (namespace ``ampx``): what torch.compile, the profiler,
FakeTensor, meta tensors and torch.export see.

Each public op of ``ampx.ops`` and each pass the scaler makes is one ``torch.ops.ampx.<name>``
whose schema says which arguments it writes (``Tensor(a!)[]``: every tensor of the list), so
functionalization and inductor know what changes. A list of tensors is one call, as in eager.

* CPU and CUDA: the same kernel call the eager path makes (``ops._unscale`` ...).
* Fake (also the meta kernel): checks what shapes, dtypes and devices the kernel would refuse,
  with the kernel's own words, and allocates the outputs; reads and writes no data.

``ampx.ops`` calls these only where torch must see the call (``ops._dispatching``): eagerly,
the kernels are called directly, as before, because the dispatcher costs microseconds a call.
Arguments reach the ops already checked by the ``ampx.ops`` wrappers (ord, rounding, seed range,
outputs that require grad); a factor travels as a tensor or a float (two optional arguments),
seed and offset as their int64 bits.
"""
import torch

from . import ops

LIB = torch.library.Library("ampx", "DEF")

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_U64_MASK = (1 << 64) - 1

# name -> schema (the ampx:: op's arguments after its name)
SCHEMAS = {
    "unscale_": "(Tensor(a!)[] tensors, Tensor? inv_scale, float? inv_scale_value, Tensor(b!)? found_inf, "
                "Tensor(c!)? flags) -> ()",
    "check_finite": "(Tensor[] tensors, Tensor(a!)? found_inf, Tensor(b!)? flags) -> ()",
    "norm": "(Tensor[] tensors, int reduce, Tensor? factor, float? factor_value, Tensor(a!)? found_inf, "
            "Tensor(b!)? flags, bool per_tensor, int split) -> (Tensor, Tensor)",
    "unscale_norm_": "(Tensor(a!)[] tensors, Tensor? inv_scale, float? inv_scale_value, Tensor(b!)? found_inf, "
                     "Tensor(c!)? flags, int reduce, bool per_tensor) -> (Tensor, Tensor)",
    "mul_": "(Tensor(a!)[] tensors, Tensor? factor, float? factor_value, int split) -> ()",
    "cast_": "(Tensor[] src, Tensor(a!)[] dst, Tensor? inv_scale, float? inv_scale_value, Tensor(b!)? found_inf, "
             "Tensor(c!)? flags, bool stochastic, int seed, int offset, Tensor? rng) -> ()",
    "update_scale_": "(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, float growth_factor, "
                     "float backoff_factor, int growth_interval, int hysteresis, Tensor(c!)? hysteresis_tracker, "
                     "bool consecutive, float min_scale, float max_scale) -> Tensor",
    "tensor_stats": "(Tensor[] tensors) -> Tensor",
    "_scaler_unscale_": "(Tensor(a!)[] tensors, int reduce, Tensor? inv_scale, float? inv_scale_value, "
                        "Tensor(b!) found_inf, Tensor(c!) flags, bool refuse_fp16, int split) -> Tensor",
    "_scaler_check": "(Tensor[] tensors, int reduce, Tensor? factor, float? factor_value, Tensor(a!) found_inf, "
                     "Tensor(b!) flags, bool refuse_fp16, int split) -> Tensor",
    # torch's fused Adam/AdamW step for one device and dtype, in place (ampx/graph_step.py says why)
    "_fused_adam_": "(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, "
                    "Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] state_steps, Tensor? lr, float lr_value, "
                    "float beta1, float beta2, float weight_decay, float eps, bool amsgrad, bool maximize, "
                    "bool decoupled, Tensor? grad_scale, Tensor? found_inf) -> ()",
}


def _pick(t, v):
    """The factor as the kernels take it: the tensor, else the float (or None)."""
    return t if t is not None else v


def _per_out(total, per):
    """(total, per): the schema returns a tensor in both places; an empty one for no per-tensor norms."""
    if per is None:
        per = total.new_empty((0,))
    return total, per


# ---- the CPU and CUDA implementations: the eager kernel calls --------------------------------

def _unscale_impl(tensors, inv_t, inv_v, found_inf, flags):
    ops._unscale(tensors, _pick(inv_t, inv_v), found_inf, flags)


def _check_finite_impl(tensors, found_inf, flags):
    ops._check_finite(tensors, found_inf, flags)


def _norm_impl(tensors, reduce, f_t, f_v, found_inf, flags, per_tensor, split):
    total, per = ops._norm(tensors, reduce, _pick(f_t, f_v), found_inf, flags, per_tensor, split)
    return _per_out(total, per)


def _unscale_norm_impl(tensors, inv_t, inv_v, found_inf, flags, reduce, per_tensor):
    total, per = ops._unscale_norm(tensors, _pick(inv_t, inv_v), found_inf, flags, reduce, per_tensor)
    return _per_out(total, per)


def _mul_impl(tensors, f_t, f_v, split):
    ops._mul(tensors, _pick(f_t, f_v), split)


def _cast_impl(src, dst, inv_t, inv_v, found_inf, flags, stochastic, seed, offset, rng):
    ops._cast(src, dst, _pick(inv_t, inv_v), found_inf, flags, stochastic, seed & _U64_MASK, offset & _U64_MASK, rng)


def _update_scale_impl(scale, tracker, found_inf, growth, backoff, interval, hysteresis, h_tracker, consecutive,
                       lo, hi):
    ev = ops._update_scale(scale, tracker, found_inf, growth, backoff, interval, hysteresis, h_tracker,
                           consecutive, lo, hi)
    if isinstance(ev, torch.Tensor):
        return ev
    return torch.tensor(ev, dtype=torch.int32)  # the CPU kernel returns its events as an int


def _tensor_stats_impl(tensors):
    return ops._tensor_stats(tensors)


def _scaler_pass_impl(write):
    def impl(tensors, reduce, f_t, f_v, found_inf, flags, refuse_fp16, split):
        dev = ops._cuda_device(tensors)
        total = ops._scaler_kernel(tensors, reduce, _pick(f_t, f_v), found_inf, flags, write, refuse_fp16, dev,
                                   split)
        return total if total is not None else found_inf.new_zeros(())
    return impl


def _fused_adam_impl(*args):
    from . import graph_step  # (imported here: graph_step imports the scaler's modules)

    graph_step.adam_kernel(*args)


# ---- the fakes: the checks the kernel makes before touching data, and the outputs -----------

def _check_tensor(op, what, t):
    """What the kernel asks of each tensor before any data: a Tensor of a dtype ampx has kernels for."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, not {type(t)!r}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {what} has dtype {t.dtype}; expected float32, float16, bfloat16 or float64")


def _where(op, tensors, arg="tensors"):
    """The device of a list's call (its first tensor's; None for [], a no-op that checks no
    device), after each tensor's _check_tensor and the check that it lies on that device."""
    device = None
    for i, t in enumerate(tensors):
        _check_tensor(op, f"{arg}[{i}]", t)
        if device is None:
            device = t.device
        elif t.device != device:
            _other_device(op, f"{arg}[{i}]", t.device, device)
    return device


def _other_device(op, what, got, device):
    raise ValueError(f"{op}: {what} is on {got}, but this call runs on {device} (the device of its first "
                     "tensor); all the tensors of one call must be on one device")


def _scalar(op, name, t, device, dtype, numel, cpu_ok=False):
    """A tensor argument (found_inf, flags, a factor ...): its dtype, size and device."""
    if t is None:
        return
    if t.dtype != dtype:
        raise TypeError(f"{op}: {name} must have dtype {dtype}, not {t.dtype}")
    if t.numel() != numel:
        raise ValueError(f"{op}: {name} must have {numel} element(s), not {t.numel()}")
    if device is not None and t.device != device and not (cpu_ok and t.device.type == "cpu"):
        _other_device(op, name, t.device, device)


def _check_pass(op, tensors, factor, found_inf, flags, factor_name="inv_scale"):
    device = _where(op, tensors)
    _scalar(op, factor_name, factor, device, torch.float32, 1, cpu_ok=True)
    _scalar(op, "found_inf", found_inf, device, torch.float32, 1)
    _scalar(op, "flags", flags, device, torch.uint8, len(tensors))
    return device


def _norm_outputs(tensors, device, per_tensor):
    device = device if device is not None else torch.device("cpu")  # as eager: [] has a CPU norm
    total = torch.empty((), dtype=torch.float32, device=device)
    per = torch.empty((len(tensors) if per_tensor else 0,), dtype=torch.float32, device=device)
    return total, per


def _unscale_fake(tensors, inv_t, inv_v, found_inf, flags):
    _check_pass("ampx.ops.unscale_", tensors, inv_t, found_inf, flags)


def _check_finite_fake(tensors, found_inf, flags):
    _check_pass("ampx.ops.check_finite", tensors, None, found_inf, flags)


def _norm_fake(tensors, reduce, f_t, f_v, found_inf, flags, per_tensor, split):
    device = _check_pass("ampx.ops.norm", tensors, f_t, found_inf, flags, "factor")
    return _norm_outputs(tensors, device, per_tensor)


def _unscale_norm_fake(tensors, inv_t, inv_v, found_inf, flags, reduce, per_tensor):
    device = _check_pass("ampx.ops.unscale_norm_", tensors, inv_t, found_inf, flags)
    return _norm_outputs(tensors, device, per_tensor)


def _mul_fake(tensors, f_t, f_v, split):
    _check_pass("ampx.ops.mul_", tensors, f_t, None, None, "factor")


def _cast_fake(src, dst, inv_t, inv_v, found_inf, flags, stochastic, seed, offset, rng):
    op = "ampx.ops.cast_"
    if len(src) != len(dst):
        raise ValueError(f"{op}: src has {len(src)} tensors but dst has {len(dst)}")
    device = _where(op, src, "src")
    for i, (s, d) in enumerate(zip(src, dst)):
        _check_tensor(op, f"dst[{i}]", d)
        if d.device != device:
            _other_device(op, f"dst[{i}]", d.device, device)
        if s.numel() != d.numel():
            raise ValueError(f"{op}: src[{i}] has {s.numel()} elements but dst[{i}] has {d.numel()}")
        if stochastic and d.dtype != torch.bfloat16:
            raise ValueError(f"{op}: stochastic rounding writes bfloat16, but dst[{i}] has dtype {d.dtype}")
    _scalar(op, "inv_scale", inv_t, device, torch.float32, 1, cpu_ok=True)
    _scalar(op, "found_inf", found_inf, device, torch.float32, 1)
    _scalar(op, "flags", flags, device, torch.uint8, len(src))
    _scalar(op, "rng", rng, device, torch.int64, 2)


def _update_scale_fake(scale, tracker, found_inf, growth, backoff, interval, hysteresis, h_tracker, consecutive,
                       lo, hi):
    op = "ampx.ops.update_scale_"
    _scalar(op, "scale", scale, None, torch.float32, 1)
    _scalar(op, "growth_tracker", tracker, scale.device, torch.int32, 1)
    _scalar(op, "found_inf", found_inf, scale.device, torch.float32, 1)
    _scalar(op, "hysteresis_tracker", h_tracker, scale.device, torch.int32, 1)
    return torch.empty((), dtype=torch.int32, device=scale.device)


def _tensor_stats_fake(tensors):
    device = _where("ampx.ops.tensor_stats", tensors)
    return torch.empty((len(tensors), ops._C.STATS_WIDTH), dtype=torch.float64,
                       device=device if device is not None else "cpu")


def _scaler_pass_fake(tensors, reduce, f_t, f_v, found_inf, flags, refuse_fp16, split):
    op = "ampx.GradScaler"
    device = _check_pass(op, tensors, f_t, found_inf, flags)
    if refuse_fp16 and any(t.dtype == torch.float16 for t in tensors):
        raise ValueError("Attempting to unscale FP16 gradients.")
    return torch.empty((), dtype=torch.float32, device=device if device is not None else "cpu")


def _fused_adam_fake(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, lr_t, lr_v, beta1, beta2, weight_decay,
                     eps, amsgrad, *args):
    """Writes in place and returns nothing: the lists only have to line up (torch's own kernel
    checks the rest when it runs)."""
    lists = [("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("state_steps", steps)]
    if amsgrad:
        lists.append(("max_exp_avg_sqs", maxes))
    for name, lst in lists:
        if len(lst) != len(params):
            raise ValueError(f"ampx GradScaler's traced Adam step: {name} has {len(lst)} tensors but params has "
                             f"{len(params)}")


_IMPLS = {
    "unscale_": (_unscale_impl, _unscale_fake),
    "check_finite": (_check_finite_impl, _check_finite_fake),
    "norm": (_norm_impl, _norm_fake),
    "unscale_norm_": (_unscale_norm_impl, _unscale_norm_fake),
    "mul_": (_mul_impl, _mul_fake),
    "cast_": (_cast_impl, _cast_fake),
    "update_scale_": (_update_scale_impl, _update_scale_fake),
    "tensor_stats": (_tensor_stats_impl, _tensor_stats_fake),
    "_scaler_unscale_": (_scaler_pass_impl(True), _scaler_pass_fake),
    "_scaler_check": (_scaler_pass_impl(False), _scaler_pass_fake),
    "_fused_adam_": (_fused_adam_impl, _fused_adam_fake),
}


def _register():
    for name, schema in SCHEMAS.items():
        LIB.define(name + schema)
        impl, fake = _IMPLS[name]
        for key in ("CPU", "CUDA"):
            LIB.impl(name, impl, key)
        torch.library.register_fake(f"ampx::{name}", fake, lib=LIB)


_register()
