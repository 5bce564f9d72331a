"""ampx inside Hugging Face Accelerate: ``patch(accelerator, **scaler_kwargs)``.

One call on an ``Accelerator`` (made by the user, by the Transformers ``Trainer`` or by any other
library), before ``prepare``:

- ``accelerator.scaler`` becomes an ``ampx.GradScaler`` built from the accelerator's own
  ``GradScalerKwargs`` plus ``scaler_kwargs`` (any of ampx's settings: ``hysteresis=2`` ...).
  fp16 gets a dynamic scaler; bf16 a static scale of 1, which scales nothing but still checks the
  gradients, skips steps that hold inf/NaN and names the parameters (``enabled=False`` turns that
  off). Accelerate's ``save_state``/``load_state`` and the Trainer's checkpoints carry its
  ``state_dict`` (ampx's settings included) as they carry torch's.
- ``accelerator.clip_grad_norm_`` and ``unscale_gradients`` go through the scaler: when the
  parameters are exactly one optimizer's, one fused pass unscales, checks and takes the norm, and
  a fused optimizer gets the clip folded into its own step; otherwise every optimizer is unscaled
  by ampx and Accelerate's own clip runs on the unscaled gradients.
- ``optimizer.step_was_skipped`` and ``accelerator.optimizer_step_was_skipped`` report the scaler's
  ``last_step_skipped`` (Accelerate infers a skip from the inner ``step`` not running, which a
  fused optimizer always does), so ``AcceleratedScheduler`` and the Trainer hold the LR schedule
  on skipped steps.
- ``mixed_precision="fp16"`` on the CPU, which Accelerate runs in float32 without a word, runs
  fp16 autocast with the scaler (logged).
- ``grad_buffer=True``: every optimizer the accelerator prepares gets an ``ampx.GradBuffer``
  (``optimizer.ampx_grad_buffer``): its gradients become views of one flat buffer per dtype and
  device (README, "Contiguous gradients"). Not with DDP's ``gradient_as_bucket_view=True``.
- FSDP, DeepSpeed and Megatron-LM set-ups are left on Accelerate's own path (logged).

``hold_on_skip(accelerator, obj)`` makes a per-step object the loop steps itself (diffusers'
``EMAModel.step``) do nothing right after a step the accelerator skipped.

Why a function that patches an instance, not an ``Accelerator`` subclass: see docs/DESIGN.md
("Framework integrations").
"""
import logging
import operator
import os
import weakref
from types import MethodType

import torch

from . import require
from .. import _C
from ..grad_buffer import GradBuffer, _refuse_bucket_views
from ..scaler import GradScaler
from ._hold import hold_method
from ._wrappers import resolve_optimizer

require("accelerate", "accelerate")
from accelerate.optimizer import AcceleratedOptimizer, patch_optimizer_step  # noqa: E402

__all__ = ["patch", "is_patched", "hold_on_skip", "AmpxAcceleratedOptimizer"]

logger = logging.getLogger("ampx")

_SCALER_FILE = "scaler.pt"  # Accelerate's name for the scaler's state in a save_state folder
_OWN_PATH = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


class AmpxAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, with the skipped-step signal taken from the ampx scaler.

    ``patch`` turns the wrappers its accelerator prepares into this class; nothing else changes.
    The scaler's ``last_step_skipped`` is kept as it is (read from the device only when asked)."""

    def step(self, closure=None):
        super().step(closure)
        if self.gradient_state.sync_gradients and isinstance(self.scaler, GradScaler):
            self._is_overflow = self.scaler.last_step_skipped

    @property
    def step_was_skipped(self):
        """Whether the last optimizer step was skipped (inf/NaN gradients), as ampx saw it."""
        return bool(self._is_overflow)


def patch(accelerator, *, grad_buffer=False, monitor=None, **scaler_kwargs):
    """Puts ampx's GradScaler, fused clip and truthful skipped steps into ``accelerator``.

    Call it right after creating the accelerator, before ``prepare`` (optimizers and models
    prepared earlier are adopted, but a model prepared before fp16 autocast was switched on for
    the CPU runs without it). Calling it again replaces the scaler with one built from the new
    settings. Returns the accelerator.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        grad_buffer: give each optimizer it prepares (and those prepared already) an
            ``ampx.GradBuffer`` over its parameters, kept as ``optimizer.ampx_grad_buffer``.
            Raises ValueError if a prepared model is DDP with ``gradient_as_bucket_view=True``
            (its buckets are contiguous already).
        monitor: True, or a dict of ``ampx.PrecisionMonitor`` settings (``{"every": 100,
            "modules": "model.layers.*"}``), to watch the first model the accelerator prepares:
            overflow reports (``accelerator.scaler.overflow_report()``) then carry the origin and
            advice, and ``accelerator.ampx_monitor`` is the monitor (its ``report()``, ``plot()``).
        **scaler_kwargs: ``ampx.GradScaler`` settings; they override the accelerator's
            ``GradScalerKwargs``. ``named_parameters`` is filled in from each prepared model.
    """
    if not hasattr(accelerator, "distributed_type"):
        raise TypeError(f"ampx.integrations.accelerate.patch: accelerator must be an accelerate.Accelerator, not "
                        f"{type(accelerator).__name__}")
    kind = accelerator.distributed_type
    if kind.name in _OWN_PATH or getattr(accelerator, "is_fsdp2", False):
        logger.warning("ampx: Accelerate runs %s with its own mixed precision; ampx leaves it there "
                       "(no ampx scaler installed%s)", kind.name,
                       ", and no GradBuffer: it owns its gradients" if grad_buffer else "")
        return accelerator
    precision = accelerator.mixed_precision
    if precision not in ("fp16", "bf16"):
        logger.info("ampx: mixed_precision=%r needs no loss scaler; the accelerator is left as it is", precision)
        if grad_buffer:
            logger.warning("ampx: grad_buffer=True is ignored with mixed_precision=%r: without ampx's scaler "
                           "nothing reads the gradients as one buffer, which would only cost a copy of each", precision)
        return accelerator
    device = accelerator.device.type
    scaler = _make_scaler(accelerator, precision, device, scaler_kwargs)  # a bad setting raises before any change
    monitor_kwargs = _monitor_kwargs(monitor)
    if precision == "fp16" and not accelerator.native_amp:
        logger.info("ampx: mixed_precision='fp16' on %s, which Accelerate would run in float32: ampx runs "
                    "float16 autocast with its GradScaler instead", device)
        accelerator.native_amp = True
        if accelerator._models:
            logger.warning("ampx: %d model(s) were prepared before patch(): they run without fp16 autocast; "
                           "call patch() before prepare()", len(accelerator._models))
    accelerator.scaler = scaler
    accelerator._ampx_grad_buffer = bool(grad_buffer)
    accelerator._ampx_monitor_kwargs = monitor_kwargs
    accelerator.ampx_monitor = None
    for name, method in _METHODS.items():
        setattr(accelerator, name, MethodType(method, accelerator))
    for model in accelerator._models:
        _watch(accelerator, model)
    for opt in accelerator._optimizers:
        _adopt(opt, accelerator)
    return accelerator


def _make_scaler(accelerator, precision, device, scaler_kwargs):
    """The ampx scaler for this accelerator: Accelerate's GradScalerKwargs, then ampx's defaults
    for the precision, then the caller's settings."""
    handler = getattr(accelerator, "scaler_handler", None)
    kwargs = handler.to_kwargs() if handler is not None else {}
    if precision == "bf16":
        kwargs.update(init_scale=1.0, dynamic=False)  # check and skip, never scale
    kwargs.update(scaler_kwargs)
    return GradScaler(device, **kwargs)


def _adopt(opt, accelerator):
    """An optimizer wrapper prepared by this accelerator steps through its scaler and reports its
    skipped steps (Accelerate's wrapper only routes through a scaler it was given when built),
    and gets its GradBuffer when the patch asked for them."""
    if type(opt) is AcceleratedOptimizer:
        opt.__class__ = AmpxAcceleratedOptimizer
    if opt.scaler is None:
        opt._accelerate_step_called = False
        opt._optimizer_original_step_method = opt.optimizer.step
        opt._optimizer_patched_step_method = patch_optimizer_step(opt, opt.optimizer.step)
    opt.scaler = accelerator.scaler
    if not getattr(accelerator, "_ampx_in_prepare", False):
        _give_buffer(opt, accelerator)


def _give_buffer(opt, accelerator):
    """The optimizer's GradBuffer, when the patch asked for them; built once the models it steps
    are prepared (on their device, wrapped), so after ``prepare`` returns."""
    if getattr(accelerator, "_ampx_grad_buffer", False) and getattr(opt, "ampx_grad_buffer", None) is None:
        # DDP's bucket views would fight the buffer's views. (accelerator._models keeps the
        # unwrapped models: the wrappers are the ones prepare_model returned.)
        for ref in getattr(accelerator, "_ampx_wrapped", ()):
            if ref() is not None:
                _refuse_bucket_views(ref())
        # replace: a buffer an earlier optimizer over these parameters had (re-prepared, a new
        # Trainer) is closed once this one is built
        opt.ampx_grad_buffer = GradBuffer(resolve_optimizer(opt, "GradBuffer"), replace=True)


def _monitor_kwargs(monitor, who="ampx.integrations.accelerate.patch"):
    """An integration's monitor= as PrecisionMonitor keywords, or None (checked before any change)."""
    if monitor is None or monitor is False:
        return None
    if monitor is True:
        return {}
    if isinstance(monitor, dict):
        unknown = set(monitor) - {"every", "modules", "leaf_only"}
        if unknown:
            raise TypeError(f"{who}: monitor= takes every, modules and leaf_only, not "
                            f"{', '.join(sorted(unknown))}")
        return dict(monitor)
    raise TypeError(f"{who}: monitor must be True or a dict of ampx.PrecisionMonitor "
                    f"settings, not {type(monitor).__name__}")


def _watch(accelerator, model):
    if isinstance(accelerator.scaler, GradScaler):
        inner = accelerator.unwrap_model(model)
        accelerator.scaler.watch(inner.named_parameters())
        kw = getattr(accelerator, "_ampx_monitor_kwargs", None)
        if kw is not None and isinstance(inner, torch.nn.Module) and accelerator.scaler._monitor is None:
            accelerator.ampx_monitor = accelerator.scaler.monitor(inner, **kw)


# ---- the accelerator's methods, as patch() installs them on the instance -----------------------

def _prepare(self, *args, **kwargs):
    """Accelerate's ``prepare``; the GradBuffers (``grad_buffer=True``) are built at its end,
    whatever order the model and the optimizer came in."""
    self._ampx_in_prepare = True
    try:
        result = type(self).prepare(self, *args, **kwargs)
    finally:
        self._ampx_in_prepare = False
    for opt in self._optimizers:
        if isinstance(opt, AcceleratedOptimizer):
            _give_buffer(opt, self)
    return result


def _prepare_model(self, model, *args, **kwargs):
    model = type(self).prepare_model(self, model, *args, **kwargs)
    _watch(self, model)  # overflow reports name parameters as the user's model does
    if isinstance(model, torch.nn.Module) and model is not self.unwrap_model(model):
        wrapped = self.__dict__.setdefault("_ampx_wrapped", [])
        wrapped.append(weakref.ref(model))  # DDP and the like, for _give_buffer's bucket-view check
    return model


def _prepare_optimizer(self, optimizer, *args, **kwargs):
    opt = type(self).prepare_optimizer(self, optimizer, *args, **kwargs)
    if isinstance(opt, AcceleratedOptimizer):
        _adopt(opt, self)
    return opt


def _unscale_gradients(self, optimizer=None):
    """Accelerate's ``unscale_gradients``, each optimizer unscaled by ampx in one fused pass."""
    if optimizer is None:
        optimizer = self._optimizers
    elif not isinstance(optimizer, (list, tuple)):
        optimizer = [optimizer]
    for opt in optimizer:
        self.scaler.unscale_(opt)  # the scaler follows Accelerate's wrapper to the optimizer


def _clip_grad_norm_(self, parameters, max_norm, norm_type=2):
    """Accelerate's ``clip_grad_norm_``: ampx's fused clip when ``parameters`` are exactly the
    parameters with gradients of one prepared optimizer (the usual ``model.parameters()``);
    otherwise ampx unscales every optimizer and Accelerate's own clip runs."""
    params = list(parameters)
    opt = _owner(self, params)
    if opt is None:
        logger.debug("ampx: clip_grad_norm_ over parameters that are not one optimizer's: Accelerate's clip")
        return type(self).clip_grad_norm_(self, params, max_norm, norm_type)
    return self.scaler.clip_grad_norm_(opt, max_norm, norm_type)


def _owner(accelerator, params):
    """The one prepared optimizer whose parameters with gradients are those of ``params``, or None.
    (For ``ampx.MasterWeights`` those are the model's low-precision parameters.) The usual case,
    the same parameters in the same order, is settled by an identity walk in C (LoRA's 288
    parameters: 0.06 ms a step as Python sets); anything else is compared as sets."""
    haves = [GradScaler._params_with_grads(resolve_optimizer(opt, "clip_grad_norm_"))[0]
             for opt in accelerator._optimizers]
    try:
        wanted, _, _ = _C.collect_grads([{"params": params}])
    except (TypeError, ValueError, AssertionError):  # not all tensors: left to the set comparison (and the stock clip)
        wanted = [p for p in params if getattr(p, "grad", None) is not None]
    for opt, have in zip(accelerator._optimizers, haves):
        if len(have) == len(wanted) and all(map(operator.is_, have, wanted)):
            return opt
    ids = {id(p) for p in wanted}
    for opt, have in zip(accelerator._optimizers, haves):
        if {id(p) for p in have} == ids:
            return opt
    return None


def _load_state(self, input_dir=None, *args, **kwargs):
    """Accelerate's ``load_state``; a folder saved without a scaler (bf16 or CPU fp16 on the stock
    path) loads too, the scaler keeping its settings."""
    if input_dir is not None and not os.path.isfile(os.path.join(input_dir, _SCALER_FILE)):
        logger.info("ampx: %s holds no scaler state; the ampx scaler keeps its settings", input_dir)
        scaler, self.scaler = self.scaler, None
        try:
            return type(self).load_state(self, input_dir, *args, **kwargs)
        finally:
            self.scaler = scaler
    return type(self).load_state(self, input_dir, *args, **kwargs)


_METHODS = {"prepare": _prepare, "prepare_model": _prepare_model, "prepare_optimizer": _prepare_optimizer,
            "unscale_gradients": _unscale_gradients, "clip_grad_norm_": _clip_grad_norm_,
            "load_state": _load_state}


def is_patched(accelerator):
    """Whether ``patch`` installed an ampx scaler on this accelerator."""
    return isinstance(getattr(accelerator, "scaler", None), GradScaler) and "clip_grad_norm_" in vars(accelerator)


def hold_on_skip(accelerator, obj, method="step"):
    """From now on ``obj.<method>(...)`` does nothing (returns None) when the accelerator's last
    optimizer step was skipped (``accelerator.optimizer_step_was_skipped``), and otherwise runs
    as before: for what the loop steps itself after ``optimizer.step()``, such as diffusers'
    ``EMAModel.step(model.parameters())``, whose decay warm-up then counts only the steps taken.
    (A scheduler the accelerator prepared holds already.) The object's state_dict is unchanged.
    Returns ``obj``.

    Raises:
        TypeError: ``obj`` has no such method.
    """
    def rule(original, *args, **kwargs):
        if accelerator.optimizer_step_was_skipped:
            return None
        return original(*args, **kwargs)

    try:
        return hold_method(obj, method, rule)
    except TypeError as exc:
        raise TypeError(f"hold_on_skip: {exc}") from None
