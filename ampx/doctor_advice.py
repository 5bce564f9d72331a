"""What to do about an overflow: the ``advice`` of an ``OverflowReport``, from its ``origin``
(ampx/doctor.py), the scale and the monitor's latest statistics. One or two sentences a user
can act on; every figure in them is measured, none guessed."""
import math

from . import stats as S

__all__ = ["advise", "param_origin"]


def _pow2(x):
    """'2^k' for a power-of-two scale, else the number."""
    if x > 0 and math.isfinite(x) and math.log2(x) == int(math.log2(x)):
        return f"2^{int(math.log2(x))}"
    return f"{x:g}"


def _before(origin, limit=65504.0):
    amax = origin.get("amax_before")
    if amax is None:
        return ""
    if amax > 0 and math.isfinite(amax):
        room = math.floor(math.log2(limit / amax))
        return (f" (its largest magnitude at the last statistics step was {amax:.4g}, {room} powers of two "
                f"below {limit:g})")
    return f" (its largest magnitude at the last statistics step was {amax:.4g})"


_LIMIT = {"float16": 65504.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _forward(origin):
    m, t, dtype = origin["module"], origin["tensor"], origin.get("dtype") or "?"
    where = f"{m} ({origin.get('module_type') or 'module'}) {t}"
    limit = _LIMIT.get(dtype)
    pmax = origin.get("param_amax")
    if limit is not None and pmax is not None and pmax > limit:
        return (f"{where} became {origin['kind']} in the forward pass because a parameter of {m} ({pmax:.4g}) is "
                f"beyond {dtype}'s range ({limit:g}): autocast's cast of it gave inf. Keep {m} in float32 (run it "
                "under torch.autocast(device_type, enabled=False)) or train in bfloat16; and look at why that "
                "weight grew (learning rate, weight decay off).")
    amax = origin.get("amax_before")
    near = limit is not None and amax is not None and amax > 0 and math.log2(limit / amax) < 2
    if origin["kind"] == "nan" and near:
        return (f"{where} became NaN in the forward pass and was within a factor 4 of {dtype}'s largest value "
                f"before{_before(origin, limit)}: an overflow turned NaN inside the module (inf - inf, 0 * inf). "
                f"Keep {m} in float32 (torch.autocast(device_type, enabled=False)) or train in bfloat16.")
    if origin["kind"] == "nan":
        return (f"{where} became NaN in the forward pass from finite inputs: an invalid operation (log or "
                "sqrt of a negative number, 0/0, inf - inf), not a range problem, so neither a lower loss "
                f"scale nor bfloat16 fixes it; check {m}'s inputs (clamp before log, add an eps).")
    if dtype in ("float16", "float8_e4m3fn", "float8_e5m2"):
        return (f"{where} overflowed {dtype} in the forward pass{_before(origin, limit)}. Keep {m} in float32 (run it "
                "under torch.autocast(device_type, enabled=False) on float32 inputs) or train in bfloat16; "
                "the loss scale does not touch the forward pass, so lowering it does not help.")
    return (f"{where} reached inf in the forward pass even in {dtype}: the values themselves diverge "
            "(learning rate, a missing normalisation), which no precision setting fixes.")


def _backward(origin, scale):
    m, t = origin["module"], origin["tensor"]
    where = f"the backward of {m} produced it, in its {t}" if t.startswith("grad_input") else \
        f"it arrived at {m}'s {t.replace('grad_', '')}"
    if origin["kind"] == "nan":
        return (f"NaN first appeared in the backward pass: {where}. That is an invalid operation in a backward "
                "(sqrt or a division at 0, a custom autograd function) rather than an overflow; lowering the "
                "loss scale does not fix it.")
    k = int(math.floor(math.log2(scale))) if scale > 0 and math.isfinite(scale) else None
    lower = f"init_scale=2.0**{k - 4}" if k is not None else "a lower init_scale"
    return (f"A gradient overflowed in the backward pass at loss scale {_pow2(scale)}: {where}{_before(origin)}. "
            f"If it recurs, start lower ({lower}) or keep {m} in float32; a rare one needs nothing: the scaler "
            "backs off by itself.")


def _floor(monitor, scale, step):
    k, lost = monitor._lost_gradients(step) if monitor is not None else (None, None)
    if lost is None:
        return (f"The loss scale is at its floor ({_pow2(scale)}): below it gradients would underflow. Train in "
                "bfloat16, or keep the overflowing module in float32.")
    return (f"The loss scale is at its floor ({_pow2(scale)}) and the gradients underflow there: {lost:.1%} of the "
            f"16-bit gradient values reaching the monitored modules were zero or subnormal (statistics of step {k}). "
            "Train in bfloat16, whose range needs no loss scale.")


def _remote(origin):
    here = origin.get("seen_on")
    return (f"The first non-finite value of this step appeared on rank {origin['rank']}, whose report names the "
            f"module and the pass; every monitored tensor on this rank{f' ({here})' if here is not None else ''} "
            "was finite, and its gradients became non-finite through the gradient reduction.")


def _replicas():
    """What to add when the gradients were averaged over several ranks (DDP) and no collective
    said which rank's monitor saw the first non-finite value."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return ""
    return (f" No monitored tensor on this rank ({dist.get_rank()}) was non-finite, and gradients are averaged "
            "over the ranks: if another rank's report names a module, the value came from there.")


def param_origin(report, monitor):
    """An origin for an overflow seen only in parameter gradients (no hooked tensor flagged):
    the first named parameter and the module that owns it."""
    names = report.inf + [n for n in report.nan if n not in report.inf]
    if not names:
        return None
    name = names[0]
    owner = name.rsplit(".", 1)[0] if "." in name else "<model>"
    return {"phase": "backward", "module": owner, "tensor": f"gradient of {name}",
            "kind": "inf" if name in report.inf else "nan", "dtype": None, "amax_before": None,
            "module_type": None, "param_amax": None, "rank": None}


def advise(report, monitor, scale, at_floor, step):
    """The advice sentence(s) for a skipped step's report (its origin already set, or None);
    `step` is the monitor's number of that step."""
    parts = []
    origin = report.origin
    if origin is not None:
        if origin["phase"] is None:
            parts.append(_remote(origin))
        elif origin["phase"] == "forward":
            parts.append(_forward(origin))
        elif origin["tensor"].startswith("gradient of "):
            parts.append(f"The {origin['tensor']} overflowed as it was computed, at loss scale {_pow2(scale)}: "
                         "lower init_scale, or keep that parameter's module in float32." + _replicas())
        else:
            parts.append(_backward(origin, scale))
    if at_floor:
        parts.append(_floor(monitor, scale, step))
    return " ".join(parts) if parts else None
