"""The scaler ``ampx.prepare`` returns under DeepSpeed: the loop's scaler calls, routed to the engine.

DeepSpeed's engine scales the loss, checks for overflow and steps itself (configured from the
policy by ``Policy.deepspeed_config``), so this object only keeps the training loop the same as on
every other backend: ``scale(loss).backward()`` is ``engine.backward(loss)`` and ``step`` is
``engine.step()``. It reports like ``ampx.GradScaler`` (``stats()``, ``overflow_report()``,
``last_step_skipped``) from the engine's own counters, and carries the policy's
``on_min_scale`` where DeepSpeed's config cannot.
"""
import logging
import math
from collections import deque

import torch

from . import ops
from .policy import deepspeed_floor_action
from .telemetry import OverflowReport, flagged_names

logger = logging.getLogger("ampx")

__all__ = ["DeepSpeedScaler"]


class _EngineLoss:
    """What ``DeepSpeedScaler.scale(loss)`` returns: ``.backward()`` goes through the engine,
    which applies its own loss scale. Other attributes read through to the loss."""

    def __init__(self, engine, loss):
        self._engine = engine
        self.loss = loss

    def backward(self, *args, **kwargs):
        return self._engine.backward(self.loss, *args, **kwargs)

    def __getattr__(self, name):
        if name == "loss":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loss, name)


class DeepSpeedScaler:
    """The GradScaler API over a DeepSpeed engine, so the training loop stays the same.

    DeepSpeed scales the loss (fp16), unscales, checks for overflow, clips (``gradient_clipping``
    in its config) and steps inside ``engine.backward`` / ``engine.step``. So ``scale(loss)``
    returns an object whose ``backward()`` is ``engine.backward(loss)``, ``step(optimizer)``
    is ``engine.step()``, and ``update()`` does nothing.

    Reporting, as ``ampx.GradScaler``'s: ``stats()`` takes ``steps`` and ``skipped_steps``
    from the engine's ``global_steps`` / ``skipped_steps`` (so they survive DeepSpeed's own
    checkpoints), ``last_norm`` from ``engine.get_global_grad_norm()``; ``overflow_report()``
    names the parameters whose ``.grad`` held inf/NaN on a skipped step. To name them, each
    optimizer step with loss scaling reads the gradients once (one fused pass, flags kept on
    the device and read only when the engine skipped). Under ZeRO 1-3 the gradients live in
    DeepSpeed's partitions, not in ``.grad``: each rank reads its own part there (see
    ``_local_grads``), and on a skipped step the ranks' flags are summed (one small all-reduce),
    so every rank names every parameter that held inf/NaN.

    ``on_min_scale`` (set explicitly in the policy) is carried where DeepSpeed does otherwise:
    under ZeRO 1-3 DeepSpeed raises at ``min_loss_scale``, so for "warn"/"ignore" its loss
    scaler's ``raise_error_at_min_scale`` is turned off and this object warns (or not); under
    stage 0 DeepSpeed stays at the floor, so "warn"/"raise" are done here after the skipped
    step. DeepSpeed's own raise surfaces as ampx's RuntimeError.
    """

    def __init__(self, engine, policy, history=1000):
        self.engine = engine
        self._enabled = policy.loss_scaling != "none"
        self._dynamic = policy.loss_scaling == "dynamic"
        self.last_step_skipped = False
        self._names = {}
        module = getattr(engine, "module", None)
        if isinstance(module, torch.nn.Module):
            self.watch(module.named_parameters())
        self._history = deque(maxlen=int(history))
        self._scale_lo, self._scale_hi = math.inf, 0.0
        self._last_report = None
        self._last_norm = None
        self._floor = self._carry_floor(policy)

    # ---- the floor -----------------------------------------------------------------------

    def _stage(self):
        stage = getattr(self.engine, "zero_optimization_stage", None)
        return stage() if callable(stage) else 0

    def _carry_floor(self, policy):
        """What this object does itself at the floor: "warn", "raise" or None (DeepSpeed's own)."""
        if not (self._enabled and self._dynamic) or "on_min_scale" not in getattr(policy, "_explicit", ()):
            return None
        want, own = policy.scaler_kwargs["on_min_scale"], deepspeed_floor_action(self._stage())
        if want == own:
            return None
        if own == "raise":
            ls = getattr(getattr(self.engine, "optimizer", None), "loss_scaler", None)
            if not hasattr(ls, "raise_error_at_min_scale"):
                raise RuntimeError(f"ampx.prepare(backend='deepspeed'): cannot carry on_min_scale={want!r}: this "
                                   f"DeepSpeed's ZeRO stage {self._stage()} loss scaler ({type(ls).__name__}) has no "
                                   "raise_error_at_min_scale to turn off; pass on_min_scale='raise' or leave it unset")
            ls.raise_error_at_min_scale = False
        return None if want == "ignore" else want

    def _min_scale(self):
        opt = getattr(self.engine, "optimizer", None)
        for holder, name in ((getattr(opt, "loss_scaler", None), "min_scale"),
                             (getattr(opt, "loss_scale_config", None), "min_loss_scale")):
            value = getattr(holder, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return 1.0  # DeepSpeed's default min_loss_scale

    def _floor_message(self, floor):
        return (f"ampx.DeepSpeedScaler: gradients overflowed with DeepSpeed's loss scale already at min_loss_scale="
                f"{floor:g}; the step was skipped and the scale cannot fall further.")

    # ---- the loop's calls ----------------------------------------------------------------

    def watch(self, named_parameters):
        """Names parameters for overflow reports (the engine's module is watched already)."""
        if isinstance(named_parameters, torch.nn.Module):
            named_parameters = named_parameters.named_parameters()
        for name, p in named_parameters:
            self._names[id(p)] = name
        return self

    def scale(self, loss):
        return _EngineLoss(self.engine, loss)

    def step(self, optimizer=None, *args, **kwargs):
        engine = self.engine
        boundary = getattr(engine, "is_gradient_accumulation_boundary", None)
        at_boundary = boundary() if callable(boundary) else True
        flagged = self._flag_grads() if at_boundary and self._enabled else None
        before = getattr(engine, "skipped_steps", 0)
        scale = self.get_scale()
        try:
            engine.step(*args, **kwargs)
        except Exception as e:
            if "loss scale already at minimum" in str(e):
                raise RuntimeError(self._floor_message(self._min_scale()) + " (DeepSpeed raises at its floor "
                                   "under ZeRO stages 1-3; on_min_scale='warn' in the policy goes on)") from e
            raise
        self.last_step_skipped = getattr(engine, "skipped_steps", 0) != before
        if at_boundary:
            self._account(scale, flagged)

    def _flag_grads(self):
        """(params, flags) from one fused pass over the gradients this rank holds before
        ``engine.step()``; (None, why) where they cannot be read."""
        module = getattr(self.engine, "module", None)
        if not isinstance(module, torch.nn.Module):
            return None, "the engine has no torch module whose parameters could be named"
        params, grads, why = _local_grads(module, self._stage())
        if params is None:
            return None, why
        keep = [(p, g) for p, g in zip(params, grads) if isinstance(g, torch.Tensor) and g.layout == torch.strided
                and g.dtype in (torch.float32, torch.float16, torch.bfloat16) and g.numel()]
        if not keep:
            return [], None
        device = keep[0][1].device
        keep = [(p, g) for p, g in keep if g.device == device]
        flags = torch.zeros(len(keep), dtype=torch.uint8, device=device)
        ops.check_finite([g for _, g in keep], None, flags=flags)
        return [p for p, _ in keep], flags

    def _account(self, scale_before, flagged):
        engine = self.engine
        new_scale = self.get_scale()
        norm = getattr(engine, "get_global_grad_norm", None)
        norm = norm() if callable(norm) else None
        self._last_norm = None if norm is None else float(norm)
        step = getattr(engine, "global_steps", len(self._history))
        self._scale_lo = min(self._scale_lo, new_scale)
        self._scale_hi = max(self._scale_hi, new_scale)
        self._history.append((step, new_scale))
        if not self.last_step_skipped:
            return
        self._last_report = self._report(step, flagged)
        floor = self._min_scale()
        if self._floor is not None and self._dynamic and scale_before <= floor:
            if self._floor == "raise":
                raise RuntimeError(self._floor_message(floor) + " (on_min_scale='raise')")
            logger.warning(self._floor_message(floor))

    def _report(self, step, flagged):
        inf, nan, note = [], [], ""
        read = flagged is not None and flagged[0] is not None
        if flagged is not None and self._stage() > 0 and _world_size() > 1:
            # every rank joins the merge, one that could not read its part with no flags
            merged = self._merge_ranks(*(flagged if read else ([], None)))
            flagged, read = (merged, True) if merged[1].any() or read else (flagged, False)
        if not read:
            why = "no gradients were read" if flagged is None else flagged[1]
            note = f"DeepSpeed's ZeRO stage {self._stage()}: the parameters cannot be named ({why})"
        elif flagged[1] is not None:
            inf, nan = flagged_names([flagged], self._names)
        return OverflowReport(step, inf, nan, note)

    def _merge_ranks(self, held, flags):
        """(params, flags) over every parameter: under ZeRO 1-3 each rank read only its own
        partition, so the flags are summed over the partition group, one small all-reduce on a
        skipped step (DeepSpeed skips on every rank at once, so every rank issues it)."""
        every = [p for p in self.engine.module.parameters() if p.requires_grad]
        where = {id(p): i for i, p in enumerate(every)}
        device = flags.device if flags is not None else _collective_device()
        bits = torch.zeros(2, len(every), dtype=torch.float32, device=device)
        if flags is not None and held:
            index = torch.tensor([where[id(p)] for p in held], device=device)
            bits[0, index] = ((flags & ops.FLAG_INF) != 0).float()
            bits[1, index] = ((flags & ops.FLAG_NAN) != 0).float()
        group = getattr(getattr(self.engine, "optimizer", None), "dp_process_group", None)
        torch.distributed.all_reduce(bits, group=group)
        merged = (bits[0] > 0).to(torch.uint8) * ops.FLAG_INF + (bits[1] > 0).to(torch.uint8) * ops.FLAG_NAN
        return every, merged

    def update(self, new_scale=None):
        if new_scale is not None:
            raise RuntimeError("update(new_scale): DeepSpeed owns the loss scale; set it through "
                               "the fp16 section of its config")

    def unscale_(self, optimizer):
        raise RuntimeError("under DeepSpeed the engine unscales inside engine.step(); clip by "
                           "setting 'gradient_clipping' in the DeepSpeed config")

    def clip_grad_norm_(self, optimizer, max_norm, *args, **kwargs):
        raise RuntimeError("under DeepSpeed clipping happens inside engine.step(); set "
                           f"'gradient_clipping': {max_norm} in the DeepSpeed config")

    def get_scale(self):
        """The engine's current loss scale (1.0 when it does not scale)."""
        opt = getattr(self.engine, "optimizer", None)
        for name in ("loss_scale", "cur_scale"):
            try:
                value = getattr(opt, name, None)
            except Exception:  # a property that cannot answer in this mode
                value = None
            if isinstance(value, torch.Tensor):
                return float(value.item())
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return 1.0

    def is_enabled(self):
        return self._enabled

    # ---- reporting -----------------------------------------------------------------------

    def overflow_report(self):
        """The ``OverflowReport`` of the most recent skipped step, or None."""
        return self._last_report

    def stats(self):
        """As ``ampx.GradScaler.stats()``: steps and skipped_steps are the engine's own counts."""
        engine = self.engine
        seen = bool(self._history)
        return {
            "steps": int(getattr(engine, "global_steps", len(self._history))),
            "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
            "scale": self.get_scale(),
            "min_scale_seen": self._scale_lo if seen else None,
            "max_scale_seen": self._scale_hi if seen else None,
            "last_norm": self._last_norm,
            "history": list(self._history),
        }

    def state_dict(self):
        # DeepSpeed saves its loss scaler and its step counts in its own checkpoints
        # (engine.save_checkpoint); stats() reads the counts from the engine.
        return {}

    def load_state_dict(self, state_dict):
        if state_dict:
            raise RuntimeError("DeepSpeed restores its loss scale from engine.load_checkpoint(), "
                               "not from a scaler state_dict")

    def __repr__(self):
        return f"DeepSpeedScaler(engine={type(self.engine).__name__}, scale={self.get_scale()})"


def _local_grads(module, stage):
    """(params, grads, None), the gradient (or this rank's part of it) of each parameter as DeepSpeed
    holds it between ``engine.backward`` at an accumulation boundary and ``engine.step()``; or
    (None, None, why) where this DeepSpeed does not expose them.

    Stage 0 keeps them in ``.grad``. Stages 1 and 2 keep this rank's reduced partition in flat
    buffers; each parameter whose fragment lives on this rank carries the mapping DeepSpeed's own
    ``safe_get_full_grad`` reads (``_hp_mapping.get_lp_grad_fragment``), a view, no copy and no
    collective. Stage 3: this rank's partition as a view where the optimizer has the method
    DeepSpeed's ``safe_get_local_grad`` reads it through (``_stage3_view``), else that public call,
    which copies it to float32 (about 5x the read time of the view: 5.0 against 0.9 ms on 100
    parameters of 65K here).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    # DeepSpeed gives every parameter _hp_mapping (None where no fragment is on this rank) and
    # those with one their _index_in_param_group
    mapped = all(hasattr(p, "_hp_mapping") for p in params)
    if stage == 0 or (stage in (1, 2) and not mapped and any(p.grad is not None for p in params)):
        return params, [p.grad for p in params], None  # a DeepSpeed that leaves them in .grad: read there
    if stage in (1, 2):
        if not mapped:
            return None, None, "this DeepSpeed's parameters carry no gradient-fragment mapping"
        held = [p for p in params if p._hp_mapping is not None and hasattr(p, "_index_in_param_group")]
        try:
            return held, [p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group) for p in held], None
        except (AttributeError, ValueError, KeyError, IndexError) as e:
            return None, None, f"its gradient fragments could not be read: {e}"
    if stage == 3:
        try:
            from deepspeed.utils import safe_get_local_grad
        except ImportError:
            return None, None, "this DeepSpeed has no deepspeed.utils.safe_get_local_grad"
        held = [p for p in params if hasattr(p, "ds_id")]
        try:
            views = [_stage3_view(p) for p in held]
            return held, [safe_get_local_grad(p) if v is None else v for p, v in zip(held, views)], None
        except (AttributeError, AssertionError, ValueError, KeyError) as e:
            return None, None, f"its gradient partitions could not be read: {e}"
    return None, None, f"unknown ZeRO stage {stage}"


def _stage3_view(param):
    """This rank's ZeRO-3 gradient partition of ``param`` as DeepSpeed holds it (no copy), or
    None where its optimizer has no ``_get_fp32_grad_state_partition`` (then the public
    ``safe_get_local_grad`` is used)."""
    opt = getattr(param, "_z3_optimizer", None)
    read = getattr(opt, "_get_fp32_grad_state_partition", None)
    # (with the optimizer offloaded the read may swap buffers in, which only the public call
    # releases again: that case takes it)
    if not callable(read) or not getattr(param, "requires_grad", False) or getattr(opt, "offload_optimizer", True):
        return None
    grad = read(param=param, release_swap_buffers=False)[0]
    return grad if isinstance(grad, torch.Tensor) else None


def _world_size():
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _collective_device():
    """Where a tensor for the default group's collectives lives: the current CUDA device under
    NCCL, else the CPU."""
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")
