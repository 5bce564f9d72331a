"""ampx.GradScaler: a drop-in for torch.amp.GradScaler on fused kernels, with what torch lacks.

It subclasses ``torch.amp.GradScaler`` (see docs/DESIGN.md for why), keeps its attributes,
stage machine, error messages and ``state_dict`` keys, and replaces the work: every unscale,
inf check, norm and scale update is one call of an ``ampx.ops`` kernel over all gradients of a
device, whatever their dtypes.
"""
import contextlib
import math

import torch
from torch.amp.grad_scaler import OptState

from . import _C, ops, settings
from . import rank_check
from .clip_dtype import as_torch_dtype, torch_norm_dtype
from .cuda import _capturing
from .master import MasterWeights
from .checkpoint import CheckpointMixin
from .sharding import agree, check_sharded_placements, combine, is_sharded_dtensor, refusals_shared
from .telemetry import OverflowReport, TelemetryMixin, _LazySkip
from .call_args import check_step_args, clip_args
from . import graph_step
from . import compile_guard
from .compile_guard import eager_method, eager_under_compile, make_runners
from .scaler_helpers import (_ORD, _by_device, _check_written, _clip_coef, _fresh_opt_state,  # noqa: F401
                             _fresh_states, _group_size, _or_found, _reduce_of, _refuse_plain_beside_dtensors,
                             _split, _step_handing_scale, _takes_no_found_inf, _who)
from .integrations._wrappers import drives_scaler_itself, fabric_stepper, named_module, resolve_optimizer

__all__ = ["GradScaler", "ShardedGradScaler", "OverflowReport"]

_TorchScaler = torch.amp.GradScaler



class GradScaler(TelemetryMixin, CheckpointMixin, torch.amp.GradScaler):
    """Loss scaling for mixed-precision training; a drop-in for ``torch.amp.GradScaler``.

    Without the keyword-only extras it behaves exactly as torch's scaler (same scale after
    every update, same skipped steps, same state_dict), only faster.

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in
            ``torch.amp.GradScaler``.
        hysteresis: overflows tolerated before the scale backs off (DeepSpeed's
            ``hysteresis`` / Megatron's ``hysteresis``); refilled when the scale grows.
        consecutive_hysteresis: refill the hysteresis on every clean step instead.
        min_scale, max_scale: bounds the scale never leaves (default: none, as torch).
        on_min_scale: what an overflow does while the scale already sits at ``min_scale``:
            "warn" (log a warning and go on), "raise" (RuntimeError, as DeepSpeed, raised by
            ``update()`` before it changes anything: a retry raises again, and
            ``update(new_scale)`` can still set a scale by hand) or "ignore".
        dynamic: False for static loss scaling: the scale stays at ``init_scale`` (steps with
            inf/NaN gradients are still skipped).
        growth_timing: "torch" (grow on the ``growth_interval``-th clean step in a row) or
            "deepspeed": DeepSpeed's DynamicLossScaler grows one step later after the start and
            after every overflow (on the (w+1)-th clean step, then every w-th); with it, and
            growth 2 / backoff 0.5, ampx reproduces DeepSpeed's scale sequence exactly.
        named_parameters: an iterable of (name, parameter), e.g. ``model.named_parameters()``,
            used to name parameters in overflow reports (see ``watch``).
        history: how many (step, scale) pairs ``stats()`` keeps.
        on_overflow: optional callable receiving an ``OverflowReport`` after each skipped step.
        explain_overflows: True to explain overflows without a monitor running from the start:
            after the first overflow the scaler hooks the model given to ``watch(model)`` with an
            ``ampx.PrecisionMonitor`` (flags only), so the next overflow's report carries its
            origin; clean steps before then cost nothing.
        process_group: the ``torch.distributed`` group across which the gradients are sharded
            (FSDP, FSDP2, ZeRO-style optimizers, tensor parallelism). Each step then issues one
            all-reduce that carries both the overflow flag and the local sum of squares, so all
            ranks skip the same steps and ``clip_grad_norm_`` clips by the global norm. Leave it
            None for DDP and single-process training: their gradients are already identical
            on every rank and need no collective.
        clip_norm: how ``clip_grad_norm_`` computes the norm of low-precision gradients
            (ampx/clip_dtype.py): "exact" (ampx's norm, accumulated in float64 and returned in
            the dtype torch's clip returns: bf16 for bf16 gradients) or "torch" (unscale, then
            ``torch.nn.utils.clip_grad_norm_``: torch's norm and gradients, bit for bit). Both
            give the same for float32 gradients' norms up to float32 rounding.
        check_ranks: True under DDP (no ``process_group``) to make every rank skip the step when
            any rank's gradients hold inf/NaN after the all-reduce (a rank-local fault, a hook
            writing after the reduction), which otherwise lets that rank skip while the others
            step (torch's scaler too). The step's one gradient pass then all-reduces the overflow
            flag over the default group: one 16-byte all-reduce per step (about 180 us on gloo
            on a CPU host, plus waiting for the slowest rank; ampx/rank_check.py). The norm is not reduced (DDP's is the same on every rank). Without an
            initialised process group it does nothing; with ``process_group`` (already agreeing)
            it is refused. A disabled scaler checks nothing, so it has no effect there either.

    Raises:
        ampx.SettingError (a ValueError, and an AssertionError as torch raises): growth_factor
            <= 1 or backoff_factor >= 1 (torch's two rules).
        ValueError: any other setting the scaler cannot honour (ampx/settings.py has the rules):
            init_scale not a finite number in (0, float32's largest]; growth_factor NaN or inf;
            backoff_factor NaN or <= 0; growth_interval or hysteresis not an integer from 1 to
            2**31 - 1; min_scale not in [0, float32's largest]; max_scale < min_scale; an unknown
            on_min_scale, growth_timing or clip_norm; check_ranks not True/False, or True with
            process_group. Every configuration torch accepts that trains without
            writing NaN works the same here.
    """

    # Tests set this to run the device-side (deferred) telemetry path on a CPU scale.
    _force_lazy_telemetry = False

    @staticmethod
    def _fresh_states():
        return _fresh_states()

    def __init__(self, device="cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, *, hysteresis=1, consecutive_hysteresis=False,
                 min_scale=None, max_scale=None, on_min_scale="warn", dynamic=True,
                 named_parameters=None, history=1000, on_overflow=None, process_group=None,
                 growth_timing="torch", explain_overflows=False, clip_norm="exact", check_ranks=False):
        # torch's own methods are named, not reached through super(): ampx.ShardedGradScaler
        # also derives from torch's ShardedGradScaler, whose overrides must not run here.
        # torch's constructor runs first to settle whether scaling is on (enabled, and for
        # device="cuda" a CUDA torch can use): a scaler that is off checks none of torch's
        # settings, as torch's does not.
        try:
            _TorchScaler.__init__(self, device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
            refused = None
        except (AssertionError, TypeError) as e:  # (only while on; said again below in ampx's words)
            refused = e
        # Then every setting is checked before anything else is built (torch's own two rules
        # included, so its bare AssertionError becomes a SettingError naming the setting, and a
        # NaN that slips past torch's comparisons is refused).
        lo, hi = settings.check_settings(
            "ampx.GradScaler", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale,
            on_min_scale=on_min_scale, growth_timing=growth_timing, clip_norm=clip_norm, scaling=self._enabled)
        if refused is not None:
            raise refused
        check_ranks = rank_check.checked("ampx.GradScaler", check_ranks, process_group is not None)
        self._per_optimizer_states = _fresh_states()  # torch's has only torch's keys
        self.process_group = process_group
        self._sharded = process_group is not None
        self._check_ranks = check_ranks
        self._hysteresis = int(hysteresis)
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        self._min_scale = lo
        self._max_scale = hi
        self._on_min_scale = on_min_scale
        self._dynamic = bool(dynamic)
        self._growth_timing = growth_timing
        self._clip_norm = clip_norm
        if growth_timing == "deepspeed":
            self._init_growth_tracker = -1  # DeepSpeed grows on the (w+1)-th clean step first
        self._init_hysteresis_tracker = self._hysteresis
        self._hysteresis_tracker = None
        self._param_names = {}
        if named_parameters is not None:
            self.watch(named_parameters)
        self._init_telemetry(history, on_overflow)
        self._monitor = None
        self._explain = bool(explain_overflows)
        self._explain_model = None
        self.last_step_skipped = False
        # Per optimizer, for the overflow report: (params, per-tensor flags) of the last pass.
        self._flag_sources = {}
        self._last_grads = None
        # Per optimizer, in the order they were first clipped: did its last clip_grad_norm_ scale
        # (coef < 1)? Saved in state_dict as a list in that order; a loaded list waits in
        # _clip_hints_loaded for the optimizers of the resumed run, taken in the same order.
        self._clip_active = {}
        self._clip_hints_loaded = []

    # ---- set-up -----------------------------------------------------------------------

    @property
    def sharded(self):
        """Whether ranks agree on overflow and the norm over a process group: ``process_group``
        given, or an ``ampx.ShardedGradScaler`` (the default group)."""
        return self._sharded

    def watch(self, named_parameters):
        """Names parameters for overflow reports: ``scaler.watch(model.named_parameters())``, or
        ``scaler.watch(model)``, which also gives ``explain_overflows=True`` the model to hook. A
        model wrapped by DDP, DataParallel, Fabric or ``torch.compile`` is named as the module it
        wraps ("0.weight", as in its state_dict, not "module.0.weight")."""
        if isinstance(named_parameters, torch.nn.Module):
            self._explain_model = named_parameters
            named_parameters = named_module(named_parameters).named_parameters()
        for name, p in named_parameters:
            self._param_names[id(p)] = name
        self._names_dropped = False
        return self

    def monitor(self, model, every=100, modules=None, **kwargs):
        """An ``ampx.PrecisionMonitor`` of ``model`` driven by this scaler (its ``update()`` ends
        each step; overflow reports carry ``origin`` and ``advice``); also names the model's
        parameters in reports. Arguments as ``PrecisionMonitor``."""
        from .doctor import PrecisionMonitor

        self.watch(model.named_parameters())
        return PrecisionMonitor(model, scaler=self, every=every, modules=modules, **kwargs)

    def _attach_monitor(self, monitor):
        if self._monitor is not None and self._monitor is not monitor:
            raise ValueError("ampx.GradScaler: a PrecisionMonitor is attached already; call its remove() first")
        self._monitor = monitor
        monitor._scaler = self

    def _detach_monitor(self, monitor):
        if self._monitor is monitor:
            self._monitor = None
            monitor._scaler = None

    def _lazy_init_scale_growth_tracker(self, dev):
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        graph_step.graph_buffers(self)

    # ---- the passes over gradients ----------------------------------------------------

    @staticmethod
    def _params_with_grads(optimizer, unscaled=False):
        """(params, grads, devices) for the optimizer's parameters whose .grad is set, in order;
        devices is None when every grad is on one device, else each grad's device key. For
        ``ampx.MasterWeights`` these are the model's gradients, before they reach the masters,
        or with ``unscaled`` (after unscale_) the masters' gradients, where the unscaled values are."""
        if isinstance(optimizer, MasterWeights):
            return optimizer._ampx_unscaled_grads() if unscaled else optimizer._ampx_grads()
        return _C.collect_grads(optimizer.param_groups)

    def _dense_views(self, params, allow_fp16, for_norm):
        """The tensors the kernels see: each grad, a DTensor grad's local shard, or a sparse
        grad's values.

        A sparse grad is coalesced first when it is float16 (torch's rule: duplicates summed
        in fp16 may overflow, so check the sum) and whenever a norm is wanted (the norm of
        uncoalesced values is not the norm of the gradient).
        """
        if for_norm and self._sharded:
            _refuse_plain_beside_dtensors(params, self._param_names)
        out = []
        for p in params:
            g = p.grad
            if (not allow_fp16) and g.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if hasattr(g, "to_local"):  # DTensor (FSDP2): work on this rank's shard in place
                if for_norm and self._sharded:
                    check_sharded_placements(g, self._param_names.get(id(p)), len(out), self.process_group)
                elif for_norm and is_sharded_dtensor(g) and _group_size(None) > 1:
                    who = _who(self._param_names, p, len(out))
                    raise ValueError(
                        f"ampx.GradScaler: the gradient of {who} is a DTensor sharded over {g.device_mesh.size()} "
                        "ranks, and this scaler agrees over none, so its norm would be this rank's shards' only "
                        "(each rank clipping by another norm). Pass process_group= the group the gradients are "
                        "sharded over (the mesh's), or use ampx.ShardedGradScaler (nothing was unscaled or clipped)")
                g = g.to_local()
            if g.is_sparse:
                if g.dtype is torch.float16 or (for_norm and not g.is_coalesced()):
                    p.grad = g = g.coalesce()
                g = g._values()
            out.append(g)
        return out

    def _grad_pass(self, optimizer, inv_scale, found_inf, allow_fp16, write, reduce=_C.REDUCE_NONE, need_found=True,
                   unscaled=False, then_written=False):
        """One kernel call over the optimizer's gradients; returns ({device: found_inf}, total).

        write: unscale in place by inv_scale; otherwise read only (norm of grads * inv_scale).
        Sparse gradients take a slower path through their values. Like torch, the returned
        found_inf is a fresh tensor (the argument is left alone), and an optimizer without
        gradients records no inf check at all, except in sharded mode, where every rank
        takes part in the step's one collective (``sharding.agree``) whether it holds gradients or not,
        and where an error before it reaches the other ranks as an overflow (``_refusals``).
        need_found=False: only the total is wanted from the collective.
        unscaled=True: the gradients unscale_ left (for master weights, the masters' ones).
        then_written=True: a read whose gradients the caller writes after the collective; sharded,
        what that write would refuse is refused before it (``_C.check_written``).

        The call runs on the gradients' device (CPU, or ampx's CUDA kernels on the caller's
        stream, with no host sync). Gradients spread over several devices (model parallel,
        CPU offload) take one call per device.
        """
        sharded = self._sharded
        if not (sharded or (need_found and self.__dict__.get("_check_ranks"))):
            return self._local_pass(optimizer, inv_scale, found_inf, allow_fp16, write, reduce, unscaled)
        # (check_ranks: the flag alone is agreed on, over the default group; the norm stays local)
        # torch's ShardedGradScaler allows fp16 (FSDP may keep fp16 gradients)
        with self._refusals(optimizer, found_inf.device, reduce, need_found):
            per_device, total = self._local_pass(optimizer, inv_scale, found_inf, allow_fp16 or sharded, write,
                                                 reduce, unscaled)
            if sharded and then_written and not write:
                _check_written(self._last_grads)
            if not per_device:
                found = found_inf.clone()
            elif len(per_device) > 1:
                found = sum(f.to(found_inf.device) for f in per_device.values())
            else:
                found = next(iter(per_device.values()))
        monitor = self._monitor
        flagged = monitor._flagged_now() if monitor is not None else None
        found, agreed, ranks = agree(found if need_found else None, total if sharded else None,
                                     reduce if sharded else _C.REDUCE_NONE, self.process_group, flagged)
        total = agreed if sharded else total
        if monitor is not None:
            monitor._flagged_ranks = ranks
        return ({} if found is None else {found.device: found}), total

    def _local_pass(self, optimizer, inv_scale, found_inf, allow_fp16, write, reduce, unscaled):
        """_grad_pass on this rank's gradients alone: ({device: found_inf}, total)."""
        params, grads, devices = self._params_with_grads(optimizer, unscaled)
        if isinstance(optimizer, MasterWeights):
            allow_fp16 = True  # fp16 gradients are unscaled on their way into float32 masters (Apex O2)
        if not params:
            self._flag_sources[id(optimizer)] = []
            self._last_grads = []
            return {}, (torch.zeros((), dtype=torch.float32, device=found_inf.device) if reduce else None)
        if devices is not None and write:
            # Several calls, the first of which writes before the next validates: check now
            # what would stop a later one, so an error leaves every gradient as it was.
            self._check_split(params, grads, devices, allow_fp16)
        # The split by device is decided here, once, from what collect_grads saw: one kernel
        # call per device, each told its device, and the results combined below.
        parts = [self._device_pass(optimizer, ps, gs, inv_scale, found_inf, allow_fp16, write, reduce)
                 for ps, gs in _by_device(params, grads, devices)]
        self._flag_sources[id(optimizer)] = [(ps, fl) for ps, fl, _, _, _ in parts]
        self._last_grads = parts[0][2] if len(parts) == 1 else [g for _, _, gs, _, _ in parts for g in gs]
        per_device = {}
        for _, _, _, f, _ in parts:
            per_device[f.device] = f if f.device not in per_device else per_device[f.device] + f
        total = combine([t for _, _, _, _, t in parts], reduce, found_inf.device) if reduce else None
        return per_device, total

    def _refusals(self, optimizer, device, reduce, need_found=True, clipping=False):
        """Sharded: the with-block before the call's collective, whose errors reach the group's
        other ranks as an overflow (``sharding.refusals_shared``; ``device``: the flag's). This
        rank then records the same overflow, as checked (and as clipped when ``clipping``), so
        that a step() after the error skips as theirs do and a retried call raises instead of
        issuing a collective they would not join (the one exception to all-or-nothing)."""
        if not self._sharded:
            if not self.__dict__.get("_check_ranks"):
                return contextlib.nullcontext()
            reduce = _C.REDUCE_NONE  # check_ranks' collective carries the flag only

        def settle():
            state = self._per_optimizer_states[id(optimizer)]
            _or_found(state, {device: torch.ones((), dtype=torch.float32, device=device)})
            state["inf_checked"] = True
            state["stage"] = OptState.UNSCALED
            state["clipped"] = state.get("clipped", False) or clipping

        return refusals_shared(self.process_group, device, reduce, need_found, settle)

    def _check_split(self, params, grads, devices, allow_fp16):
        """Before the passes of gradients on several devices: every device is one ampx runs on,
        and no float16 gradient is refused; errors name the parameter as the optimizer has it."""
        for i, (p, g, d) in enumerate(zip(params, grads, devices)):
            who = _who(self._param_names, p, i)
            if d < -1:
                raise ValueError(f"ampx.GradScaler: the gradient of {who} is on device {g.device}; ampx "
                                 "works on CPU and CUDA tensors (nothing was unscaled)")
            if not allow_fp16 and g.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")

    def _device_pass(self, optimizer, params, grads, inv_scale, found_inf, allow_fp16, write, reduce):
        """The pass over gradients that all live on one device; returns
        (params, flags, grads seen, found_inf, total), all outputs on that device."""
        dev = grads[0].device
        if found_inf.device == dev:
            found = found_inf.clone()
        else:
            found = torch.zeros_like(found_inf, device=dev)
            if isinstance(inv_scale, torch.Tensor):
                inv_scale = inv_scale.to(dev, non_blocking=True)
        flags = torch.zeros(len(params), dtype=torch.uint8, device=dev)
        index = dev.index if dev.type == "cuda" else -1  # anything else: the CPU call names it
        total = None
        if write and isinstance(optimizer, MasterWeights):
            # model gradients -> master gradients, unscaled and checked, in one cast pass
            optimizer._ampx_cast_grads_(inv_scale, found, flags)
        else:
            with torch.no_grad():
                try:
                    total = ops._scaler_pass(grads, reduce, inv_scale, found, flags, write, not allow_fp16, index,
                                             _split(optimizer))
                except _C.LayoutError:
                    grads = self._dense_views(params, allow_fp16, bool(reduce))
                    total = ops._scaler_pass(grads, reduce, inv_scale, found, flags, write, not allow_fp16, index,
                                             _split(optimizer))
        if reduce and total is None:
            total = torch.zeros((), dtype=torch.float32, device=dev)
        return params, flags, grads, found, total

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # torch's hook, kept with its signature: libraries call it.
        per_device, _ = self._grad_pass(optimizer, inv_scale, found_inf, allow_fp16, write=True)
        return per_device

    def _inv_scale(self):
        # torch forms the reciprocal in float64, then rounds to float32.
        return self._scale.double().reciprocal().float()

    def _new_found_inf(self):
        return torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)

    def _check_inf_per_device(self, optimizer):
        # Read-only: torch multiplies every gradient by 1.0 to learn the same thing.
        self._check_scale_growth_tracker("_check_inf_per_device")
        per_device, _ = self._grad_pass(optimizer, None, self._new_found_inf(), True, write=False)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = per_device
        return per_device

    # ---- clipping ---------------------------------------------------------------------

    def clip_grad_norm_(self, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Unscales and clips the optimizer's gradients; returns their total norm (unscaled).

        Replaces ``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, max_norm)``.
        The norm comes from the same pass that checks for inf/NaN. Then:

        * optimizers that handle scaling themselves (torch's fused Adam/AdamW/SGD): nothing is
          written; the clip coefficient is folded into the ``grad_scale`` that ``step`` hands
          them, so gradients stay scaled until the optimizer's own kernel reads them;
        * other optimizers: one in-place pass multiplies by ``inv_scale * clip_coef``.

        Call it once per optimizer per step, after backward and before ``step``. If
        ``unscale_`` was called first, it clips the already-unscaled gradients.

        Args:
            optimizer: the optimizer whose gradients to clip (a framework's wrapper of it, as
                Accelerate's or Lightning's, stands for the optimizer it wraps: see
                ``ampx.integrations._wrappers.resolve_optimizer``; so do the other methods that take an optimizer).
            max_norm: the largest allowed total norm.
            norm_type: 2, 1 or inf (others fall back to torch's clip_grad_norm_).
            error_if_nonfinite: raise RuntimeError if the norm is inf/NaN (forces a host sync;
                an overflowing step is normally just skipped).

        Returns:
            The total norm as a 0-dim tensor (inf/NaN on an overflowing step) of the dtype torch's
            clip returns for these gradients: float32 for float32 ones and for ``MasterWeights``
            (its float32 masters), bf16 for bf16 ones, the promoted dtype for a mix. With
            ``clip_norm="exact"`` it is ampx's exact norm rounded to that dtype (the clip itself
            uses the float32 value); with ``clip_norm="torch"``, torch's own.

        Raises:
            RuntimeError: called twice, or after ``step``, in the same iteration.
            TypeError / ValueError: max_norm not a number >= 0 (NaN or a negative one would
                write NaN or flipped gradients, which torch's clip does), norm_type not a number
                or NaN, error_if_nonfinite not a truth value; nothing has changed then.

        Under ``torch.compile`` with a fused torch optimizer it traces into the graph
        (ampx/graph_step.py); otherwise it runs eagerly there (a graph break).
        """
        if ops._is_compiling():
            why = graph_step.traceable(self, optimizer, norm_type, error_if_nonfinite, max_norm)
            if why is None:
                return graph_step.clip(self, optimizer, max_norm, norm_type)
            return eager_under_compile("clip_grad_norm_", why)(
                self._clip_grad_norm, optimizer, max_norm, norm_type, error_if_nonfinite)
        return self._clip_grad_norm(optimizer, max_norm, norm_type, error_if_nonfinite)

    @eager_method("clip_grad_norm_")
    def _clip_grad_norm(self, optimizer, max_norm, norm_type, error_if_nonfinite):
        """clip_grad_norm_ run eagerly (under torch.compile too: see compile_guard.eager_method)."""
        _no_compiled_step(self, "clip_grad_norm_")
        optimizer = resolve_optimizer(optimizer, "clip_grad_norm_")
        # check_ranks: only a clip whose pass carries the flag (not after unscale_) shares a refusal
        seen = self._per_optimizer_states.get(id(optimizer)) or {}  # (.get: a refused call adds no state)
        agreeing = self._sharded or (self._enabled and self.__dict__.get("_check_ranks", False)
                                     and seen.get("stage", OptState.READY) is OptState.READY
                                     and not seen.get("inf_checked"))
        if not (self._enabled and agreeing):  # (agreeing with other ranks: inside the refusal block below)
            max_norm, norm_type, error_if_nonfinite = clip_args(max_norm, norm_type, error_if_nonfinite)
        if not self._enabled:
            return self._clip_without_scaling(optimizer, max_norm, norm_type, error_if_nonfinite)
        self._check_scale_growth_tracker("clip_grad_norm_")
        state = self._per_optimizer_states[id(optimizer)]
        if state.get("clipped"):
            raise RuntimeError("clip_grad_norm_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        # Sharded, a bad argument on one rank reaches the others as this call's collective would.
        with (self._refusals(optimizer, self._scale.device, _reduce_of(norm_type), clipping=True) if agreeing
              else contextlib.nullcontext()):
            if agreeing:
                max_norm, norm_type, error_if_nonfinite = clip_args(max_norm, norm_type, error_if_nonfinite)
            return self._clip(optimizer, state, max_norm, norm_type, error_if_nonfinite)

    def _clip(self, optimizer, state, max_norm, norm_type, error_if_nonfinite):
        """clip_grad_norm_ past its checks: picks the route."""
        reduce = _ORD.get(norm_type)
        if reduce is None or self.__dict__.get("_clip_norm") == "torch":
            return self._clip_other_norm(optimizer, state, max_norm, norm_type, error_if_nonfinite)
        # An optimizer that reads plain gradients needs them unscaled and clipped in memory. If
        # the last step did not clip (norm <= max_norm), expect the same: unscale in place while
        # computing the norm (one read-write pass, torch's own order of operations), and multiply
        # by the coefficient only if it turns out to be < 1. Otherwise read the norm first and
        # write once with inv_scale * coef. Either way at most two passes; the hint needs the
        # norm on the host, so it is used with a CPU scale only.
        plain = not (getattr(optimizer, "_step_supports_amp_scaling", False) or isinstance(optimizer, MasterWeights))
        on_cpu = self._scale.device.type == "cpu"
        hints = self.__dict__.setdefault("_clip_active", {})  # (absent from older pickles)
        loaded = self.__dict__.setdefault("_clip_hints_loaded", [])
        if plain and on_cpu and id(optimizer) not in hints and loaded:
            # a resumed run takes the same route as the saved one; hints exist only for the
            # optimizers that record them below, so only those take one
            hints[id(optimizer)] = loaded.pop(0)
        # (Not when sharded: that route writes before the step's collective, which may fail; nor
        # with error_if_nonfinite, whose refusal must come before any gradient is written.)
        if (state["stage"] is OptState.READY and plain and on_cpu and not self._sharded
                and not error_if_nonfinite and not hints.get(id(optimizer), True)):
            total, coef = self._clip_unscaling_first(optimizer, state, max_norm, reduce)
        else:
            total, coef = self._clip_norm_first(optimizer, state, max_norm, reduce, norm_type,
                                                error_if_nonfinite)
        if plain and on_cpu:
            hints[id(optimizer)] = float(coef) < 1.0
        if isinstance(optimizer, MasterWeights):
            return total  # the float32 masters' norm
        return as_torch_dtype(total, state["norm_dtype"])

    def _clip_without_scaling(self, optimizer, max_norm, norm_type, error_if_nonfinite):
        """A disabled scaler (bf16, fp32): no unscale, but still one fused norm and one fused
        multiply (torch's rule for the coefficient; the norm accumulated in float64, as the
        scaler's). Sparse gradients, other norms and error_if_nonfinite take torch's clip."""
        if isinstance(optimizer, MasterWeights):
            optimizer._ampx_cast_grads_()  # clip the float32 copies, not the bf16 gradients
            params, grads, devices = [p for g in optimizer.param_groups for p in g["params"]], None, None
        else:
            params, grads, devices = self._params_with_grads(optimizer)
        ord_ = float(norm_type)
        exact = self.__dict__.get("_clip_norm") != "torch"
        if exact and grads and ord_ in _ORD and not error_if_nonfinite and devices is None:
            with torch.no_grad():
                try:
                    total = ops.norm(grads, ord_, _split=_split(optimizer))  # reads only: nothing to undo
                except ValueError:  # sparse or wrapper gradients, CUDA without ampx's kernels
                    total = None
                if total is not None:
                    ops.mul_(grads, _clip_coef(max_norm, total), _split=_split(optimizer))
                    self._last_norm = total
                    if isinstance(optimizer, MasterWeights):
                        return total  # the float32 masters' norm
                    return as_torch_dtype(total, torch_norm_dtype(grads))
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        self._last_norm = total
        return total

    def _clip_other_norm(self, optimizer, state, max_norm, norm_type, error_if_nonfinite):
        """Route 1, a norm the kernels do not compute (p other than 2, 1, inf), or clip_norm="torch":
        unscale, then torch's own clip (of the masters' gradients, for master weights)."""
        what = f"norm_type={float(norm_type)}" if _ORD.get(norm_type) is None else "clip_norm='torch'"
        if self._sharded and _group_size(self.process_group) > 1 and not all(
                hasattr(g, "to_local") for g in self._params_with_grads(optimizer)[1]):
            # (DTensor gradients are fine: torch's clip reduces their norm over their meshes)
            raise ValueError(
                f"ampx.GradScaler(process_group=...): clip_grad_norm_ with {what} would take "
                "torch's norm of this rank's plain gradient shards only, so ranks would clip by different norms; "
                "the norms the ranks agree on are ampx's own (clip_norm='exact') of order 2, 1 and inf "
                "(nothing was unscaled or clipped)")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        params, _, _ = self._params_with_grads(optimizer, unscaled=isinstance(optimizer, MasterWeights))
        if error_if_nonfinite and self._agreed_overflow(state["found_inf_per_device"]):
            # every rank refuses (see _check_clip_norm), before torch's clip writes anything
            local = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)
            self._check_clip_norm(local, norm_type, True, state["found_inf_per_device"])
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        state["clipped"] = True
        self._last_norm = total
        return total

    def _clip_unscaling_first(self, optimizer, state, max_norm, reduce):
        """Route 2, a plain optimizer whose last step did not clip: one read-write pass unscales
        while it computes the norm, and a second multiplies by the coefficient only if it is < 1.
        Never with error_if_nonfinite (its refusal must come before any write: route 3).
        Returns (norm, clip coefficient)."""
        per_device, total = self._grad_pass(optimizer, self._inv_scale(), self._new_found_inf(), False,
                                            write=True, reduce=reduce)
        state["found_inf_per_device"] = per_device
        state["norm_dtype"] = torch_norm_dtype(self._last_grads)
        coef = _clip_coef(max_norm, total)
        self._last_norm = total
        state["clipped"] = True
        if float(coef) < 1.0:
            with torch.no_grad():
                ops.mul_(self._last_grads, coef, _split=_split(optimizer))
        self._last_grads = None
        state["stage"] = OptState.UNSCALED
        return total, coef

    def _clip_norm_first(self, optimizer, state, max_norm, reduce, norm_type, error_if_nonfinite):
        """Route 3, the norm read first (also after unscale_()). A fused optimizer gets the clip
        folded into its grad_scale at step() and nothing is written now; master weights get it on
        the way into the masters; anything else one in-place pass by inv_scale * coef.
        Returns (norm, clip coefficient)."""
        if state["stage"] is OptState.READY:
            inv = self._inv_scale()
            found_inf = self._new_found_inf()
            written = not getattr(optimizer, "_step_supports_amp_scaling", False)  # below, by inv * coef
            per_device, total = self._grad_pass(optimizer, inv, found_inf, False, write=False, reduce=reduce,
                                                then_written=written and not isinstance(optimizer, MasterWeights))
        else:  # already unscaled by unscale_() (master weights: into the masters' gradients)
            inv = None
            sources = self._flag_sources.get(id(optimizer))
            # Sharded, the flag travels too: a rank that refuses its gradients sends an overflow,
            # which every rank then adds to unscale_'s (all skip the step).
            agreed, total = self._grad_pass(optimizer, None, self._new_found_inf(), True, write=False,
                                            reduce=reduce, need_found=self._sharded, unscaled=True,
                                            then_written=not isinstance(optimizer, MasterWeights))
            if self._sharded:
                _or_found(state, agreed)
            if sources is not None:  # the overflow report stays unscale_'s, by parameter
                self._flag_sources[id(optimizer)] = sources
        norm_dtype = torch_norm_dtype(self._last_grads)  # the dtype torch's clip would return
        self._check_clip_norm(total, norm_type, error_if_nonfinite,  # (before any state is recorded)
                              per_device if inv is not None else state["found_inf_per_device"])
        if inv is not None:
            state["found_inf_per_device"] = per_device
        state["norm_dtype"] = norm_dtype
        coef = _clip_coef(max_norm, total)
        self._last_norm = total
        state["clipped"] = True
        if inv is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            self._last_grads = None
            # Folded into the fused optimizer's grad_scale at step(); nothing written now.
            state["clip_coef"] = coef
            state["inf_checked"] = True
            return total, coef
        factor = coef if inv is None else inv * coef
        if isinstance(optimizer, MasterWeights):
            if inv is None:
                optimizer._ampx_scale_master_grads_(coef)
            else:
                optimizer._ampx_cast_grads_(factor)  # unscale + clip on the way to the masters
        else:
            with torch.no_grad():
                ops.mul_(self._last_grads, factor, _split=_split(optimizer))  # the pass's dense views
        self._last_grads = None
        state["stage"] = OptState.UNSCALED
        return total, coef

    def _check_clip_norm(self, total, norm_type, error_if_nonfinite, found=None):
        """error_if_nonfinite's refusal (torch's words), of a non-finite ``total``. With
        check_ranks, also of an overflow the ranks agreed on (``found``, {device: flag}) while
        this rank's own norm is finite: the rank whose gradients held inf/NaN raises, so every
        rank raises with it, and a loop that catches the error stays in step on every rank
        (not one rank retrying or skipping while the others step and update)."""
        if not error_if_nonfinite:
            return
        if not math.isfinite(total.item()):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                "norm anyway, set `error_if_nonfinite=False`")
        if self._agreed_overflow(found):
            raise RuntimeError(
                f"ampx.GradScaler(check_ranks=True): the total norm of order {float(norm_type)} is finite on this "
                "rank, but another rank's gradients held inf/NaN (or it refused this call), so it raises; "
                "every rank raises with it (error_if_nonfinite=True), so the ranks stay in step. To skip such "
                "steps on every rank instead, set `error_if_nonfinite=False`")

    def _agreed_overflow(self, found):
        """Whether the overflow flag the ranks agreed on (check_ranks, not sharded) is set; reads
        it on the host (error_if_nonfinite waits for the norm already)."""
        if self._sharded or not found or not self.__dict__.get("_check_ranks") or _group_size(None) < 2:
            return False
        return any(bool(f.item()) for f in found.values())

    # ---- step and update --------------------------------------------------------------

    @eager_method()
    def unscale_(self, optimizer):
        """Unscales the optimizer's gradients in place and checks them for inf/NaN (as torch)."""
        optimizer = resolve_optimizer(optimizer, "unscale_")
        if not self._enabled:
            return
        _no_compiled_step(self, "unscale_")
        # (.get: a call torch refuses, before any scale(), must not leave an entry behind, which
        # would stop the scaler from pickling until the next update())
        state = self._per_optimizer_states.get(id(optimizer)) or {}
        if state.get("inf_checked") and state["stage"] is OptState.READY:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        _TorchScaler.unscale_(self, optimizer)

    def step(self, optimizer, *args, **kwargs):
        """Steps the optimizer unless its gradients held inf/NaN; returns what its step returns.

        As ``torch.amp.GradScaler.step``. ``last_step_skipped`` tells afterwards whether the
        step was skipped (for optimizers that handle scaling themselves, reading it waits for
        the device; nothing else does). One difference visible to step hooks: torch's own fused
        optimizers on the CPU see ``optimizer.found_inf`` None rather than a zero tensor when
        nothing overflowed (the same result, without a per-parameter op on the step counters).

        Under ``torch.compile`` with a fused torch optimizer it traces into the graph
        (ampx/graph_step.py); otherwise it runs eagerly there (a graph break).
        """
        if ops._is_compiling():
            why = graph_step.traceable(self, optimizer, stepping=True)
            if why is None:
                return graph_step.step(self, optimizer, args, kwargs)
            return eager_under_compile("step", why)(self._step, optimizer, *args, **kwargs)
        return self._step(optimizer, *args, **kwargs)

    @eager_method("step")
    def _step(self, optimizer, *args, **kwargs):
        """step run eagerly (under torch.compile too: see compile_guard.eager_method)."""
        _no_compiled_step(self, "step")
        stepper = fabric_stepper(self, optimizer)
        optimizer = resolve_optimizer(optimizer, "step", "param_groups" if self._enabled else "step")
        stepper = stepper or optimizer
        if not self._enabled:
            self.last_step_skipped = False
            return stepper.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if args or kwargs:
            check_step_args(stepper, args, kwargs)
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if drives_scaler_itself(optimizer.step):
                # The deprecated contract: the optimizer drives the scaler itself.
                return super().step(optimizer, *args, **kwargs)
            if state["stage"] is OptState.READY and not state.get("inf_checked"):
                self._check_inf_per_device(optimizer)
            found = list(state["found_inf_per_device"].values())
            found_inf = found[0] if len(found) == 1 else sum(t.to(self._scale.device) for t in found)
            if state["stage"] is OptState.UNSCALED:
                grad_scale = getattr(optimizer, "grad_scale", None)
            else:
                grad_scale = self._scale * getattr(optimizer, "grad_scale", 1)
                coef = state.get("clip_coef")
                if coef is not None:
                    grad_scale = grad_scale / coef
            retval, found_inf = _step_handing_scale(stepper, optimizer, grad_scale, found_inf, args, kwargs)
            state["stage"] = OptState.STEPPED
            self.last_step_skipped = _LazySkip(found_inf) if found_inf is not None else False
            return retval

        if _capturing(self._scale.device):
            raise RuntimeError(
                "ampx.GradScaler.step: this optimizer is not fused, so step() must read found_inf on the "
                "host to decide whether to step, which cannot happen inside a CUDA graph capture. To capture "
                "the whole step, use a fused optimizer built with capturable=True (e.g. torch.optim.AdamW("
                "..., fused=True, capturable=True)), or capture only forward and backward.")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        skipped = bool(sum(v.item() for v in state["found_inf_per_device"].values()))
        retval = None if skipped else stepper.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        self.last_step_skipped = skipped
        return retval

    def update(self, new_scale=None):
        """Updates the scale after all optimizers stepped (torch's rule, plus the extras).

        ``update(new_scale)`` sets the scale, as in torch, to a number (a float, or here also an
        int) from float32's smallest normal to its largest, or to a 1-element floating tensor on
        the scaler's device without requires_grad (any shape: ``torch.tensor([4.])`` too, which
        torch's scaler refuses). A CPU tensor's value is checked as a number is; a CUDA one is
        taken as it is (checking it would wait for the device).

        Raises:
            TypeError: new_scale is neither a number nor a tensor.
            ValueError: a number or CPU tensor value that is NaN, inf, <= 0, subnormal or past
                float32's range.
            ampx.SettingError (also an AssertionError, as torch raises): a tensor on another
                device type, with more than one element, with requires_grad, or not floating.

        Under ``torch.compile`` it traces into the graph when the step's calls did (a fused
        torch optimizer, ampx/graph_step.py); otherwise it runs eagerly there (a graph break).
        """
        if ops._is_compiling():
            why = "new_scale" if new_scale is not None else graph_step.traceable(self)
            if why is None and self.__dict__.get("_graph_pending"):
                return graph_step.update(self)
            if why is None and self._enabled:
                # nothing recorded in the graph: the step's calls ran eagerly, or had no gradients
                why = "eager" if self._per_optimizer_states else "nothing"
            if why is None:
                return None
            return eager_under_compile("update", why)(self._update, new_scale)
        return self._update(new_scale)

    @eager_method("update")
    def _update(self, new_scale=None):
        """update run eagerly (under torch.compile too: see compile_guard.eager_method)."""
        if not self._enabled:
            return
        _no_compiled_step(self, "update")
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            new_scale = self._checked_new_scale(new_scale)
            if isinstance(new_scale, float):
                scale.fill_(new_scale)
            else:
                scale.copy_(new_scale.detach().reshape(scale.shape))
            self._per_optimizer_states = _fresh_states()  # torch's has only torch's keys
            self._record(skipped=False)
            return
        capturing = _capturing(scale.device)
        if capturing and self._on_min_scale == "raise" and self._dynamic:
            raise RuntimeError("ampx.GradScaler.update: on_min_scale='raise' reads the update's result on the "
                               "host, which cannot happen inside a CUDA graph capture; use 'warn' or 'ignore' "
                               "for captured steps.")
        found_infs = [f.to(device=scale.device, non_blocking=True)
                      for st in self._per_optimizer_states.values()
                      for f in st["found_inf_per_device"].values()]
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = found_infs[0]
        for f in found_infs[1:]:
            found = found + f
        hysteresis = self._hysteresis_tracker if self._hysteresis > 1 else None
        updated, events = None, 0
        if self._dynamic and self._on_min_scale == "raise":
            updated, events = self._update_on_copies(scale, tracker, hysteresis, found)  # (may raise)
        trace = None
        if self._monitor is not None:  # the step's flags, and the scale it ran at
            trace = self._monitor._end_step(scale)
        if updated is not None:
            for live, new in zip((scale, tracker, hysteresis), updated):
                if live is not None:
                    live.copy_(new)
        elif self._dynamic:
            events = self._scale_rule(scale, tracker, hysteresis, found)
        if self._dynamic:
            if self._growth_timing == "deepspeed":
                # DeepSpeed counts clean steps from the overflow step itself: restart one lower,
                # on the device, without a host read.
                tracker.copy_(torch.where(found.reshape(tracker.shape) != 0, torch.full_like(tracker, -1), tracker))
        sources = list(self._flag_sources.values())
        self._per_optimizer_states = _fresh_states()
        self._flag_sources = {}
        if self.__dict__.get("_graph_dirty"):
            self._drain(wait=True)  # the compiled steps before this one are counted first
        self._steps += 1
        if capturing:
            # No host work inside a capture (no event query, no pinned copy): replayed steps
            # leave no telemetry (ampx/cuda.py's docstring says so).
            return
        if scale.device.type == "cpu" and not self._force_lazy_telemetry:
            self._account(self._steps, float(scale.item()), bool(found.item()), int(events), sources, trace)
            return
        # A device scale: the telemetry travels in one small non-blocking copy and is read once
        # the device has got there (at a later update, or when stats() or a report asks), so
        # the step never waits for the host.
        self._defer(scale, found, events, sources, trace)

    def _scale_rule(self, scale, tracker, hysteresis_tracker, found):
        """The scale update in place on these tensors; returns its events (ops._update_scale_events)."""
        return ops._update_scale_events(
            scale, tracker, found, self._growth_factor, self._backoff_factor, self._growth_interval,
            self._hysteresis, hysteresis_tracker, self._consecutive_hysteresis,
            settings.scale_floor(self._min_scale), self._max_scale)

    def _update_on_copies(self, scale, tracker, hysteresis_tracker, found):
        """on_min_scale="raise", all or nothing: the update run on copies of the three trackers,
        returned with its events for update() to keep; an overflow at the floor raises instead,
        with every tensor and counter as it was before update() (a retry raises again, and
        update(new_scale) can still set a scale by hand). Reads the events: waits for a device."""
        copies = tuple(None if t is None else t.clone() for t in (scale, tracker, hysteresis_tracker))
        events = self._scale_rule(*copies, found)
        if int(events) & _C.UPD_AT_MIN:
            raise RuntimeError(self._at_floor_message() + " (on_min_scale='raise')")
        return copies, events

    def _checked_new_scale(self, new_scale):
        """update(new_scale)'s argument as a float or a tensor to copy, after every check."""
        op = "ampx.GradScaler.update"
        if settings.is_real(new_scale):
            settings.check_scale_value(op, "new_scale", new_scale)
            return float(new_scale)
        if not isinstance(new_scale, torch.Tensor):
            raise TypeError(f"{op}: new_scale must be a float or a 1-element float tensor, not "
                            f"{type(new_scale).__name__}")
        if (new_scale.device.type != self._scale.device.type or new_scale.numel() != 1 or new_scale.requires_grad
                or not new_scale.dtype.is_floating_point or new_scale.layout != torch.strided):
            # torch's own words (code may compare them), then what was passed
            raise settings.SettingError(
                "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with "
                f"requires_grad=False. (ampx.GradScaler.update got a {new_scale.dtype} {new_scale.device.type} tensor "
                f"of shape {tuple(new_scale.shape)}{' with requires_grad' if new_scale.requires_grad else ''})")
        if new_scale.device.type == "cpu":
            settings.check_scale_value(op, "new_scale", float(new_scale.item()))
        return new_scale


def _no_compiled_step(scaler, method):
    """Refuses an eager call in a step whose earlier calls ran inside a compiled graph."""
    err = graph_step.mixed_step_error(scaler, method)
    if err is not None:
        raise err


compile_guard.install(GradScaler)
make_runners()


def __getattr__(name):
    # ShardedGradScaler lives in its own module, imported on first use (see there why).
    if name == "ShardedGradScaler":
        from .sharded_scaler import ShardedGradScaler

        return ShardedGradScaler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
