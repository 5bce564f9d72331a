"""The scaler's module-level helpers: routes, checks and small pieces of state that
``ampx.scaler.GradScaler`` uses (kept apart so that scaler.py holds the scaler itself)."""
import math

import torch
from torch.amp.grad_scaler import OptState

from . import _C, ops
from .compile_guard import eager_function
from .master import MasterWeights
from .sharding import LayoutRefused

_ORD = {2.0: _C.REDUCE_SUMSQ, 1.0: _C.REDUCE_SUMABS, math.inf: _C.REDUCE_MAXABS}


def _takes_no_found_inf(optimizer):
    """Whether a torch.optim fused optimizer (whose step treats found_inf=None as clear)."""
    return type(optimizer).__module__.startswith("torch.optim.") and bool(optimizer.defaults.get("fused"))


@eager_function  # host-driven: dynamo loses the attributes set here across its graph breaks
def _step_handing_scale(stepper, optimizer, grad_scale, found_inf, args, kwargs):
    """Steps an optimizer that handles scaling itself, handing it grad_scale and found_inf as
    attributes for the step only; returns (what its step returns, the found_inf handed)."""
    optimizer.grad_scale = grad_scale
    # On the CPU the flag is a host value already, so reading it costs no sync: when it is
    # clear, torch's own fused optimizers are not handed it, which spares their step
    # adding it to and subtracting it from every step counter (one small op per parameter
    # each way: ~0.1 ms a step on LoRA's 288 tensors) and leaves the same state, bit for
    # bit. Other optimizers of this contract may expect the tensor: they always get it.
    if (_takes_no_found_inf(optimizer) and isinstance(found_inf, torch.Tensor)
            and found_inf.device.type == "cpu" and not found_inf.item()):
        found_inf = None
    optimizer.found_inf = found_inf
    try:
        retval = stepper.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf
    return retval, found_inf


def _who(names, p, i):
    """How errors name the i-th parameter with a gradient: its watched name, else its place."""
    return names.get(id(p)) or f"parameter {i} with a gradient, shape {tuple(p.shape)}"


def _check_written(grads):
    """Raises now what the clip's in-place multiply of these gradients would refuse after the
    step's collective (a gradient that overlaps itself, as an expanded one): one device at a time."""
    by_device = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for dev, gs in by_device.items():
        _C.check_written("ampx.ops.mul_", gs, dev.index if dev.type == "cuda" else -1)


def _reduce_of(norm_type):
    """The reduce code of a clip's norm_type, as its collective will carry it (a bad one: L2,
    what the other ranks most likely ask for)."""
    try:
        return _ORD.get(float(norm_type))
    except (TypeError, ValueError, RuntimeError):
        return _C.REDUCE_SUMSQ


def _group_size(group):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _or_found(state, found_per_device):
    """Adds overflows to what the optimizer's state has recorded for this step."""
    have = state["found_inf_per_device"]
    for dev, f in found_per_device.items():
        have[dev] = f if dev not in have else torch.maximum(have[dev], f)


def _refuse_plain_beside_dtensors(params, names):
    """A norm summed over the ranks, of DTensor gradients (each rank a shard) and plain ones
    beside them: a plain gradient is then a whole copy on every rank (a module left out of
    fully_shard or of a tensor-parallel plan), which the sum would count once per rank."""
    if not any(hasattr(p.grad, "to_local") for p in params):
        return  # plain gradients only: FSDP1's flat shards, or hand-sharded ones
    for i, p in enumerate(params):
        if not hasattr(p.grad, "to_local"):
            who = _who(names, p, i)
            raise LayoutRefused(
                f"ampx.GradScaler(process_group=...): the gradient of {who} is a plain tensor beside DTensor "
                "gradients, so every rank holds a whole copy of it and a norm summed over the group would count "
                "it once per rank; shard the module that holds it (fully_shard, or its tensor-parallel plan) "
                "(nothing was unscaled or clipped)")


def _split(optimizer):
    """How the CPU threads share the scaler's passes over this optimizer's gradients: as the
    kernel that reads them next will (ops.SPLIT_*). A fused optimizer's own kernel (grad_scale
    route) shares each tensor's cache lines evenly; other optimizers step with torch's
    elementwise ops; master weights read them in ampx's own cast."""
    if isinstance(optimizer, MasterWeights):
        return ops.SPLIT_DYNAMIC
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return ops.SPLIT_FUSED
    return ops.SPLIT_ELEMENTWISE


def _by_device(params, grads, devices):
    """[(params, grads)] per device, in first-seen order (one pair when devices is None)."""
    if devices is None:
        return [(params, grads)]
    groups = {}
    for p, g, d in zip(params, grads, devices):
        ps, gs = groups.setdefault(d, ([], []))
        ps.append(p)
        gs.append(g)
    return list(groups.values())


def _clip_coef(max_norm, total):
    """torch's rule: coef = max_norm / (norm + 1e-6), at most 1 (a 0-dim tensor, no host read)."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


def _fresh_opt_state():
    """One optimizer's state for one step, as torch's scaler makes it: exactly torch's two keys
    (torch builds them in a private function, so ampx builds its own; a test compares the two,
    and PyTorch's own pickle test compares a fresh state with torch's).

    stage: torch's OptState (READY, UNSCALED, STEPPED).
    found_inf_per_device: {device: found_inf} from the pass that checked the gradients.

    ampx's own keys are added when first set, so every read of them defaults:
    inf_checked (False): the gradients were checked but left scaled (stage still READY): the
        fused-optimizer clip route, whose unscale happens inside the optimizer's own kernel.
    clipped (False): clip_grad_norm_ ran this step (a second call is an error).
    clip_coef (None): that route's clip coefficient, folded into the fused optimizer's grad_scale.
    norm_dtype: the dtype torch's clip would return for the gradients the clip's pass read (set
        by that pass, before it is read).
    """
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _fresh_states():
    from collections import defaultdict

    return defaultdict(_fresh_opt_state)
