"""The scaler's post-backward step as tensor code, for ``torch.compile(fullgraph=True)`` (issue 25).

With torch's fused Adam or AdamW (``fused=True``: the optimizer takes the scale itself), nothing in ``clip_grad_norm_`` -> ``step`` -> ``update`` has to reach the host:
the inf check and the norm are one ``ampx::_scaler_check`` op, the clip coefficient folds into
the ``grad_scale`` the optimizer's own kernel reads, the optimizer skips on ``found_inf`` itself,
and the scale moves by ``ampx::update_scale_``. So under ``torch.compile`` the scaler traces
those calls into the graph instead of breaking it (``traceable`` says when), and the graph runs
the same kernels with the same bits as the eager calls. The optimizer's step itself is stepped
here, not through ``optimizer.step()``, which torch keeps out of every graph
(``_probe_fused_adam`` says why and how).

What the eager calls keep on the host is kept on the device instead, and read when the host asks:
- the per-step telemetry (scale after the update, found_inf, the update's events) goes into a
  ring of the last ``history`` steps plus running counts (``_Log``); ``stats()``,
  ``overflow_report()``, ``state_dict()`` and the next eager update account for it, oldest first,
  as a CUDA scale's deferred telemetry is (an ``on_overflow`` callback and the min-scale warning
  come then, late, as there);
- ``last_step_skipped`` reads one persistent flag when asked;
- the report of a skipped traced step names no parameter (its per-tensor flags stay in the
  graph) and says so.
The per-optimizer stage machine lives in ``scaler._graph_pending`` between the calls of one step
(cleared by ``update``), so the traced calls never touch the eager state: a compiled step and an
eager one can follow each other, but not share one step (an error says so).
"""
import logging
import math

import torch
from torch.amp.grad_scaler import OptState
from torch.optim import optimizer as torch_optimizer

from . import _C, ops, settings
from .call_args import clip_args
from .clip_dtype import as_torch_dtype, torch_norm_dtype
from .scaler_helpers import _ORD, _clip_coef, _split
from .telemetry import _LazySkip

logger = logging.getLogger("ampx")

__all__ = ["traceable", "clip", "step", "update", "drain", "reset", "graph_buffers", "mixed_step_error"]

# Why a call cannot be traced -> what to do instead (the reason a fullgraph error carries).
REASONS = {
    "plain": "the optimizer is not one of torch's fused ones (fused=True), so whether it steps is decided "
             "on the host from found_inf: build it with fused=True, or call scaler.step/update outside "
             "the fullgraph function",
    "wrapped": "the optimizer is not a torch.optim optimizer itself (a framework's wrapper or a subclass): "
               "pass the fused torch optimizer it wraps, or call the scaler outside the fullgraph function",
    "sharded": "a process_group or check_ranks agrees with other ranks through a collective that runs "
               "eagerly: call the scaler outside the fullgraph function",
    "monitor": "a PrecisionMonitor or explain_overflows keeps per-step bookkeeping on the host: remove it "
               "(monitor.remove(), explain_overflows=False) or call the scaler outside the fullgraph function",
    "raise": "on_min_scale='raise' reads the update's result on the host: use 'warn' or 'ignore'",
    "clip": "only clip_norm='exact' norms of order 2, 1 and inf without error_if_nonfinite are traced "
            "(error_if_nonfinite reads the norm on the host)",
    "eager": "this step's earlier calls ran eagerly: run clip_grad_norm_, step and update of one step all "
             "inside or all outside the compiled function",
    "devices": "the gradients are not all dense tensors on the scale's device: call the scaler outside the "
               "compiled function",
    "new_scale": "update(new_scale) checks the value it is given on the host: call it outside the fullgraph function",
    "hooks": "the optimizer has step pre/post hooks, which run around torch's own step only: remove them, or "
             "call scaler.step outside the fullgraph function",
    "no_scale": "scaler.scale(loss) has not run yet, so there is no scale to step with: scale the loss "
                "first (eagerly this is torch's AssertionError '_scale is None')",
    "patched": "optimizer.step is replaced on this optimizer object (a wrapper of its own), which a traced step "
               "would not run: remove the wrapper, or call scaler.step outside the fullgraph function",
    "nothing": "no inf checks were recorded prior to update(): none of the optimizers given to "
               "clip_grad_norm_/step this step had a gradient (eagerly torch's AssertionError)",
    "torch_step": "torch breaks the graph around every optimizer step on purpose, and ampx steps only "
                  "fused Adam and AdamW inside a graph itself (ampx/graph_step.py): use one of those, or call "
                  "scaler.step outside the fullgraph function",
}


def _is_fused_torch(optimizer):
    """A torch optimizer that takes grad_scale and found_inf itself: fused, in every group (a
    group may turn it off, and torch then refuses the scale eagerly)."""
    return (type(optimizer).__module__.startswith("torch.optim.") and bool(optimizer.defaults.get("fused"))
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(g.get("fused", True) for g in optimizer.param_groups))


_GROUP_KEYS = ("betas", "amsgrad", "lr", "weight_decay", "eps", "maximize", "capturable", "differentiable",
               "decoupled_weight_decay", "fused")


def _probe_fused_adam(aten=None):
    """torch's in-place fused Adam kernels ({decoupled: (float-lr overload, tensor-lr overload)}),
    or None.

    No graph can hold ``optimizer.step()`` of a fused optimizer: torch wraps every step in
    ``_use_grad_for_differentiable``, which calls ``torch._dynamo.graph_break()`` around it on
    purpose, and dynamo disables ``torch.optim.adam._fused_adam`` ("don't trace into fused
    optimizer"). Tracing ``aten::_fused_adamw_`` itself fails functionalization (aot_eager and
    inductor: "mutating a non-functional tensor with a functional tensor"), and its functional
    twin ``aten::_fused_adamw`` allocates new parameters, gradients and moments every step for
    copies back (7-10x the eager step on the CPU: fresh pages on every call). So ampx steps Adam
    and AdamW through its own op, ``ampx::_fused_adam_``, whose schema says it writes those lists
    in place: inductor calls it in place, and it runs what ``_fused_adam`` runs, in its order
    (steps + 1, torch's in-place kernel, steps - found_inf). Same kernel, same bits. These are
    torch's private ops and methods, so they are probed (the overloads, the schema's arguments
    and that they return nothing, ``_init_group``'s arity); anything else gives None and the step
    runs eagerly (a graph break; under fullgraph an error saying so)."""
    import inspect

    aten = torch.ops.aten if aten is None else aten
    want_args = ["self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "lr", "beta1",
                 "beta2", "weight_decay", "eps", "amsgrad", "maximize", "grad_scale", "found_inf"]
    ops_ = {}
    try:
        for decoupled, name in ((False, "_fused_adam_"), (True, "_fused_adamw_")):
            packet = getattr(aten, name)
            pair = (packet.default, packet.tensor_lr)
            for op in pair:
                schema = op._schema
                if [a.name for a in schema.arguments] != want_args or len(schema.returns) != 0:
                    return None
            ops_[decoupled] = pair
        if len(inspect.signature(torch.optim.Adam._init_group).parameters) != 8:
            return None
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return ops_


_FUSED_ADAM = _probe_fused_adam()


def _by_dtype(lists):
    """The parameter-aligned lists split by the parameters' dtype, in order of first appearance
    (torch's fused Adam takes one call per device and dtype)."""
    groups = {}
    for i, p in enumerate(lists[0]):
        groups.setdefault(p.dtype, []).append(i)
    return [[[lst[i] for i in idx] if lst else [] for lst in lists] for idx in groups.values()]


def adam_kernel(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, lr_t, lr_v, beta1, beta2, weight_decay, eps,
                amsgrad, maximize, decoupled, grad_scale, found_inf):
    """The CPU and CUDA body of ``ampx::_fused_adam_``: what ``torch.optim.adam._fused_adam`` does
    for one device and dtype, with torch's in-place kernel."""
    float_op, tensor_op = _FUSED_ADAM[bool(decoupled)]
    op, lr = (tensor_op, lr_t) if lr_t is not None else (float_op, lr_v)
    torch._foreach_add_(steps, 1)
    op(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, lr=lr, beta1=beta1, beta2=beta2,
       weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale,
       found_inf=found_inf)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


def _fused_adam_step(optimizer, grad_scale, found_inf):
    """``Adam.step`` of a fused Adam/AdamW, traceable (see _probe_fused_adam)."""
    for group in optimizer.param_groups:
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = [], [], [], [], [], []
        beta1, beta2 = group["betas"]
        optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        if not params:
            continue
        lr = group["lr"]
        lr_t, lr_v = (lr, 0.0) if isinstance(lr, torch.Tensor) else (None, lr)
        for ps, gs, ms, vs, maxes, steps in _by_dtype([params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                                       state_steps]):
            torch.ops.ampx._fused_adam_(ps, gs, ms, vs, maxes, steps, lr_t, lr_v, float(beta1), float(beta2),
                                        group["weight_decay"], group["eps"], group["amsgrad"], group["maximize"],
                                        bool(group["decoupled_weight_decay"]), grad_scale, found_inf)


def _traced_step_fn(optimizer):
    """How a traced step steps this optimizer, or None when it cannot be traced."""
    if _FUSED_ADAM is None or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    for g in optimizer.param_groups:
        if not all(k in g for k in _GROUP_KEYS) or any(isinstance(b, torch.Tensor) for b in g["betas"]):
            return None
    return _fused_adam_step


def _step_hooks(optimizer):
    """Whether any optimizer step hook (this optimizer's or torch's global ones) is registered;
    True when that cannot be told (a torch without the private dicts)."""
    dicts = [getattr(optimizer, "_optimizer_step_pre_hooks", None), getattr(optimizer, "_optimizer_step_post_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_post_hooks", None)]
    return any(d is None or len(d) > 0 for d in dicts)


def traceable(scaler, optimizer=None, norm_type=None, error_if_nonfinite=False, max_norm=0.0, stepping=False):
    """None when this call can be traced into a graph, else the key of REASONS saying why not.
    Pure attribute reads: dynamo evaluates it while tracing and guards on what it read."""
    d = scaler.__dict__
    enabled = d.get("_enabled")
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer) or not type(optimizer).__module__.startswith("torch.optim."):
            return "wrapped"
    if norm_type is not None:
        ord_ = float(norm_type) if isinstance(norm_type, (int, float)) and not isinstance(norm_type, bool) else None
        if (ord_ not in _ORD or error_if_nonfinite is not False or d.get("_clip_norm") == "torch"
                or not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool)):
            return "clip"
    if not enabled:
        if optimizer is not None and not _grads_on(optimizer, None):
            return "devices"
        return _step_refusal(optimizer) if stepping else None
    if d.get("_scale") is None:
        return "no_scale"
    if d.get("_sharded") or d.get("_check_ranks"):
        return "sharded"
    if d.get("_monitor") is not None or d.get("_explain"):
        return "monitor"
    if d.get("_on_min_scale") == "raise" and d.get("_dynamic", True):
        return "raise"
    for st in scaler._per_optimizer_states.values():
        if st["stage"] is not OptState.READY or st.get("inf_checked"):
            return "eager"
    if optimizer is not None:
        if not _is_fused_torch(optimizer):
            return "plain"
        if not _grads_on(optimizer, d["_scale"].device):
            return "devices"
        return _step_refusal(optimizer)  # (clip too: its step must trace after it)
    return None


def _step_refusal(optimizer):
    """Why ampx cannot step this optimizer inside a graph itself, or None."""
    if _traced_step_fn(optimizer) is None:
        return "torch_step"
    if _step_hooks(optimizer):
        return "hooks"
    own = optimizer.__dict__.get("step")
    if own is not None and not getattr(own, "_wrapped_by_lr_sched", False):
        return "patched"
    return None


def _grads_on(optimizer, device):
    """Whether every gradient is a dense tensor on `device` (None: on one device), so the
    traced passes can take them as one list; else the eager call splits them by device."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided or hasattr(g, "to_local"):
                return False
            if device is None:
                device = g.device
            elif g.device != device:
                return False
    return True


def mixed_step_error(scaler, method):
    """A RuntimeError for an eager call in a step whose earlier calls ran in a compiled graph."""
    if not scaler.__dict__.get("_graph_pending"):
        return None
    return RuntimeError(
        f"ampx.GradScaler.{method}: this step's clip_grad_norm_/step ran inside a compiled graph; run "
        "clip_grad_norm_, step and update of one step all inside or all outside the compiled function")


class _Log:
    """Device-side telemetry of traced updates. ring: [capacity, 3] float64 rows (scale after the
    update, found_inf, events) at position n % capacity; tally: float64 [n, skipped, floor hits,
    lowest scale, highest scale] over every traced step since the last drain."""

    def __init__(self, device, capacity):
        self.capacity = max(1, int(capacity))
        self.ring = torch.zeros(self.capacity, 3, dtype=torch.float64, device=device)
        self.tally = torch.tensor([0.0, 0.0, 0.0, math.inf, 0.0], dtype=torch.float64, device=device)
        self.found = torch.zeros((), dtype=torch.float32, device=device)


def _log(scaler):
    """The scaler's _Log on its scale's device, made eagerly when the scale is (graph_buffers)."""
    return scaler.__dict__.get("_graph_log")


def graph_buffers(scaler):
    """Makes the device-side telemetry buffers beside a new scale (called eagerly or traced),
    and marks every tensor a traced update writes as a static address (see _mark_static)."""
    log = _Log(scaler._scale.device, scaler.__dict__.get("_history_len", 1000))
    scaler._graph_log = log
    scaler._graph_skip = _LazySkip(log.found)
    _mark_static([scaler._scale, scaler._growth_tracker, scaler.__dict__.get("_hysteresis_tracker"), log.ring,
                  log.tally, log.found])


def _mark_static(tensors):
    """CUDA graphs (``mode="reduce-overhead"``) replay only when every input a graph writes is at
    a fixed address; torch marks the optimizer's parameters, gradients and state so when
    ``_init_group`` is traced, and the scaler's own tensors are marked here. guard=False: a
    tensor replaced later makes cudagraphs re-record, not recompile. Skipped where this torch
    has no such function (the step then replays without CUDA graphs, as before)."""
    mark = getattr(getattr(torch, "_dynamo", None), "mark_static_address", None)
    if mark is None or torch.compiler.is_compiling():
        return
    for t in tensors:
        if isinstance(t, torch.Tensor):
            mark(t, guard=False)


def _grads(optimizer):
    """The optimizer's gradients, in order (traceable() has checked they are one dense list)."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _pending(scaler):
    pending = scaler.__dict__.get("_graph_pending")  # (not setdefault: torch 2.10's dynamo cannot trace it)
    if pending is None:
        pending = []
        scaler._graph_pending = pending
    return pending


def _check_pass(scaler, optimizer, reduce, refuse_fp16):
    """One traced read of the optimizer's gradients, as the eager call makes it:
    (grads, found_inf, total or None)."""
    scale = scaler._scale
    found = torch.zeros((), dtype=torch.float32, device=scale.device)
    grads = _grads(optimizer)
    if not grads:
        return grads, found, (torch.zeros((), dtype=torch.float32, device=scale.device) if reduce else None)
    inv = scale.double().reciprocal().float()  # torch's reciprocal: in float64, then rounded
    flags = torch.zeros(len(grads), dtype=torch.uint8, device=scale.device)
    index = scale.device.index if scale.device.type == "cuda" else -1
    with torch.no_grad():
        total = ops._scaler_pass(grads, reduce, inv if reduce else None, found, flags, False, refuse_fp16, index,
                                 _split(optimizer))
    if reduce and total is None:
        total = torch.zeros((), dtype=torch.float32, device=scale.device)
    return grads, found, total


def clip(scaler, optimizer, max_norm, norm_type):
    """clip_grad_norm_ traced. Enabled: the norm and the inf check in one op, and the
    coefficient waits for step(), which folds it into the fused optimizer's grad_scale.
    Disabled: one norm and one multiply, as eagerly. Returns the norm in torch's dtype for
    these gradients, as the eager call."""
    max_norm, norm_type, _ = clip_args(max_norm, norm_type, False)
    reduce = _ORD[norm_type]
    if not scaler._enabled:
        grads = _grads(optimizer)
        if not grads:
            return torch.nn.utils.clip_grad_norm_([], max_norm, norm_type)
        with torch.no_grad():
            total = ops.norm(grads, norm_type, _split=_split(optimizer))
            ops.mul_(grads, _clip_coef(max_norm, total), _split=_split(optimizer))
        scaler._last_norm = total
        return as_torch_dtype(total, torch_norm_dtype(grads))
    pending = _pending(scaler)
    # (entries: (optimizer, found, clip coefficient or None, stepped); eager's checks, in its order)
    if any(entry[0] is optimizer and entry[2] is not None for entry in pending):
        raise RuntimeError("clip_grad_norm_() has already been called on this optimizer since the last update().")
    if any(entry[0] is optimizer for entry in pending):
        raise RuntimeError("clip_grad_norm_() is being called after step().")
    grads, found, total = _check_pass(scaler, optimizer, reduce, True)
    coef = _clip_coef(max_norm, total)
    scaler._last_norm = total
    if grads:  # (no gradient: no inf check recorded, as eagerly; update() then refuses)
        pending.append((optimizer, found, coef, False))
    return as_torch_dtype(total, torch_norm_dtype(grads))


def step(scaler, optimizer, args, kwargs):
    """step traced: the fused optimizer gets grad_scale (the scale over the clip coefficient)
    and found_inf as attributes for its step, and skips on found_inf itself."""
    if "closure" in kwargs:
        raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
    if args or kwargs:
        raise TypeError("ampx.GradScaler.step under torch.compile: a traced step takes no arguments beyond the "
                        "optimizer (its closure is refused eagerly too)")
    if not scaler._enabled:
        scaler.last_step_skipped = False
        with torch.no_grad():
            _traced_step_fn(optimizer)(optimizer, None, None)
        return None
    pending = _pending(scaler)
    # (found by identity and replaced by index: torch 2.10's dynamo compares tuples of tensors by value)
    at = next((i for i, e in enumerate(pending) if e[0] is optimizer), None)
    if at is not None and pending[at][3]:
        raise RuntimeError("step() has already been called since the last update().")
    if at is None:
        grads, found, _ = _check_pass(scaler, optimizer, _C.REDUCE_NONE, False)
        coef = None
        if not grads:  # nothing to step, no inf check recorded: as eagerly
            scaler.last_step_skipped = False
            return None
    else:
        _, found, coef, _ = pending[at]
    grad_scale = scaler._scale * getattr(optimizer, "grad_scale", 1)
    if coef is not None:
        grad_scale = grad_scale / coef
    with torch.no_grad():  # (fused optimizers are never differentiable)
        _traced_step_fn(optimizer)(optimizer, grad_scale, found)
    # (an LR scheduler's wrapper of optimizer.step is not run, so its first step warns falsely:
    # marking the optimizer here is dropped by torch 2.13's dynamo and an error under 2.10's)
    if at is None:
        pending.append((optimizer, found, coef, True))
    else:
        pending[at] = (optimizer, found, coef, True)
    _log(scaler).found.copy_(found)  # last_step_skipped reads this step's flag, as eagerly
    scaler.last_step_skipped = scaler._graph_skip
    return None


def update(scaler):
    """update traced: the scale rule on the device, the step's telemetry into the _Log."""
    if not scaler._enabled:
        return
    pending = _pending(scaler)
    founds = [e[1] for e in pending]
    if not founds:
        raise AssertionError("No inf checks were recorded prior to update.")
    found = founds[0]
    for f in founds[1:]:
        found = found + f
    scale, tracker = scaler._scale, scaler._growth_tracker
    if scaler._dynamic:
        events = ops._update_scale_events(
            scale, tracker, found, scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval,
            scaler._hysteresis, scaler._hysteresis_tracker if scaler._hysteresis > 1 else None,
            scaler._consecutive_hysteresis, settings.scale_floor(scaler._min_scale), scaler._max_scale)
        if scaler._growth_timing == "deepspeed":
            tracker.copy_(torch.where(found.reshape(tracker.shape) != 0, torch.full_like(tracker, -1), tracker))
        events = events.double().reshape(())
    else:
        events = torch.zeros((), dtype=torch.float64, device=scale.device)
    log = _log(scaler)
    s = scale.double().reshape(())
    f = found.double().reshape(())
    n = log.tally[0]
    pos = torch.remainder(n, log.capacity).long().reshape(1)
    log.ring.index_copy_(0, pos, torch.stack([s, f, events]).reshape(1, 3))
    skipped = (f != 0).double()
    floor = (torch.bitwise_and(events.long(), _C.UPD_AT_MIN) != 0).double()
    t = log.tally
    log.tally.copy_(torch.stack([t[0] + 1, t[1] + skipped, t[2] + floor, torch.minimum(t[3], s), torch.maximum(t[4], s)]))
    pending.clear()  # (log.found stays the last stepped optimizer's flag: last_step_skipped, as eagerly)
    scaler.last_step_skipped = scaler._graph_skip
    scaler._graph_dirty = True  # (only ever written in a graph: read eagerly, by drain)


NOTE = ("this step ran inside a compiled graph (torch.compile with a fused optimizer), whose per-parameter "
        "flags are not kept; run the step eagerly, or with scaler.watch(...) and a PrecisionMonitor outside "
        "the graph, to name the parameters")


def drain(scaler):
    """Eagerly, accounts for the traced updates since the last drain, oldest first: counts,
    scale range, history, reports and callbacks of skipped steps, the min-scale warning."""
    log = _log(scaler)
    if log is None or not scaler.__dict__.get("_graph_dirty"):
        return
    scaler._graph_dirty = False
    n, skipped, floor_hits, lo, hi = log.tally.tolist()
    n = int(n)
    if n == 0:
        return
    kept = min(n, log.capacity)
    rows = log.ring.tolist()
    first = n - kept
    kept_rows = [rows[i % log.capacity] for i in range(first, n)]
    lost_skipped = int(skipped) - sum(1 for r in kept_rows if r[1] != 0)
    lost_floor = int(floor_hits) - sum(1 for r in kept_rows if int(r[2]) & _C.UPD_AT_MIN)
    reset(scaler)
    if lost_skipped or lost_floor:
        _warn_lost(scaler, first, lost_skipped, lost_floor, log.capacity)
    # steps older than the ring: counted, their scales in the range, no history entry
    scaler._steps += first
    scaler._skipped += lost_skipped
    if first:
        scaler._scale_lo = min(scaler._scale_lo, lo)
        scaler._scale_hi = max(scaler._scale_hi, hi)
    for i in range(first, n):
        s, f, e = rows[i % log.capacity]
        scaler._steps += 1
        scaler._account(scaler._steps, s, f != 0, int(e), [], note=NOTE)


def _warn_lost(scaler, lost, skipped, floor, capacity):
    """The steps older than the ring are counted, but what each one would have said eagerly
    (its on_overflow callback, its report, the min-scale warning) is gone: say so, once."""
    what = []
    if skipped:
        what.append(f"{skipped} of them skipped (inf/NaN gradients)" +
                    (": their on_overflow callbacks were not made" if scaler._on_overflow is not None else ""))
    if floor and scaler._on_min_scale == "warn":
        what.append(f"{floor} of them overflowed with the scale at its floor")
    if what:
        logger.warning(
            "ampx.GradScaler: %d compiled steps were older than the scaler's device ring (history=%d) when its "
            "telemetry was read; they are counted, but %s. Read it at least every `history` steps (stats(), "
            "overflow_report(), state_dict() or an eager update), or raise history.", lost, capacity,
            "; ".join(what))


def reset(scaler):
    """Forgets the traced updates not yet accounted for (after a drain, or a loaded state_dict)."""
    log = _log(scaler)
    if log is not None:
        log.tally.copy_(torch.tensor([0.0, 0.0, 0.0, math.inf, 0.0], dtype=torch.float64))
    scaler._graph_dirty = False
