"""ampx inside PyTorch Lightning: a precision plugin, added with one line.

    trainer = lightning.Trainer(plugins=[AmpxPrecision("16-mixed", hysteresis=2)], gradient_clip_val=1.0)

``AmpxPrecision`` is Lightning's ``MixedPrecision`` (autocast, loss scaling, checkpoints) with an
``ampx.GradScaler`` behind it, and with what the stock plugin loses:

- ``gradient_clip_val`` goes through ``scaler.clip_grad_norm_`` (one pass unscales, checks and
  measures; folded into the step of fused optimizers, which the stock plugin refuses to clip);
- a skipped step holds the LR schedule (Lightning steps its schedulers regardless);
- ampx's settings travel in checkpoints; a checkpoint of the stock plugin loads too;
- ``16-mixed`` on the CPU is real float16 autocast with loss scaling (the stock path switches to
  bf16); ``bf16-mixed`` gets a static ampx scaler at 1.0, so overflowing steps are still skipped
  and reported (``enabled=False`` turns that off);
- ``grad_buffer=True`` gives each optimizer an ``ampx.GradBuffer`` (contiguous gradients) for the fit.

Strategies: single device, DDP, and ``ModelParallelStrategy`` (FSDP2, tensor parallel), where the
scaler is built sharded over the default group (one all-reduce per step: every rank skips the
same steps and clips by the global norm). ``FSDPStrategy`` and ``DeepSpeedStrategy`` scale and
step through their own precision plugins; the plugin refuses them when the fit sets up.

Which Lightning entry points are overridden, and why, is in docs/DESIGN.md ("Lightning").
Lightning (the ``lightning`` package, 2.4 or later) is imported here, never by ``import ampx``.
"""
import logging
import weakref

import torch

from . import require

require("lightning.pytorch", "lightning")

from lightning.pytorch import Callback  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision, Precision  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from lightning.pytorch.utilities.model_helpers import is_overridden  # noqa: E402

from ..grad_buffer import GradBuffer, _refuse_bucket_views  # noqa: E402
from ..scaler import GradScaler, _group_size  # noqa: E402

__all__ = ["AmpxPrecision"]

log = logging.getLogger("ampx.integrations.lightning")

PRECISIONS = ("16-mixed", "bf16-mixed")
# Keys under which Lightning stored a precision plugin's state (it uses the class's __qualname__):
# ours, the stock plugin's, and its name before Lightning 2.0.
CHECKPOINT_KEYS = ("AmpxPrecision", "MixedPrecision", "MixedPrecisionPlugin")
# bf16 needs no loss scaling: a static scale of 1 only checks for inf/NaN and skips such steps.
BF16_DEFAULTS = {"init_scale": 1.0, "dynamic": False}


class AmpxPrecision(MixedPrecision):
    """Lightning's mixed-precision plugin on an ``ampx.GradScaler``.

    Args:
        precision: "16-mixed" (float16 autocast, dynamic loss scaling) or "bf16-mixed" (bfloat16
            autocast, a static ampx scaler at 1.0 unless ``scaler_kwargs`` say otherwise).
        device: the autocast device ("cpu", "cuda"); None takes the model's device when
            Lightning connects the plugin.
        scaler: an ``ampx.GradScaler`` to use as it is (then no ``scaler_kwargs``).
        log_stats: log ``ampx/loss_scale`` and ``ampx/skipped_steps`` through the LightningModule
            after every optimizer step (reads the scale on the host: a sync on CUDA).
        grad_buffer: give each of the fit's optimizers an ``ampx.GradBuffer`` when Lightning
            connects the plugin (the model on its device): every gradient a view of one flat
            buffer per dtype and device until the fit ends (README, "Contiguous gradients").
            Not with DDP's ``gradient_as_bucket_view=True``.
        monitor: True, or a dict of ``ampx.PrecisionMonitor`` settings (``{"every": 100}``), to
            watch the LightningModule from its first training step: the scaler's overflow reports
            carry the origin and advice; ``plugin.monitor`` is the monitor (``report()``, ``plot()``).
        **scaler_kwargs: ``ampx.GradScaler`` keywords (``hysteresis=2``, ``init_scale``,
            ``growth_interval``, ``min_scale``, ``on_overflow`` ...).

    Raises:
        ValueError: an unknown ``precision``.
        TypeError: ``scaler`` is not an ``ampx.GradScaler``, or comes with ``scaler_kwargs``.

    When the fit (or validate, test, predict) sets up, before any step, it also raises
    MisconfigurationException under ``FSDPStrategy`` or ``DeepSpeedStrategy`` (each needs
    Lightning's own plugin; the message says which); ValueError when a ``scaler`` given is
    unsharded under a multi-process ``ModelParallelStrategy``, or sharded under any other
    multi-process strategy; RuntimeError under a multi-process ``ModelParallelStrategy``
    without a default process group. A sharded clip raises ValueError for a model with no
    DTensor parameter (each plain one whole on every rank).
    """

    def __init__(self, precision="16-mixed", device=None, scaler=None, *, log_stats=False, grad_buffer=False,
                 monitor=None, **scaler_kwargs):
        if precision not in PRECISIONS:
            # Lightning's own wording (its tests match on it), then ampx's
            raise ValueError(f"`Passed `AmpxPrecision(precision={precision!r})`. Precision must be '16-mixed' or "
                             f"'bf16-mixed' (AmpxPrecision: precision must be one of {PRECISIONS})")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(f"AmpxPrecision: scaler must be an ampx.GradScaler, not {type(scaler).__name__} "
                            "(or leave it out and pass ampx.GradScaler's keywords)")
        if scaler is not None and scaler_kwargs:
            raise TypeError(f"AmpxPrecision: pass either scaler or scaler keywords, not both "
                            f"(got {sorted(scaler_kwargs)})")
        from .accelerate import _monitor_kwargs

        self._monitor_kwargs = _monitor_kwargs(monitor, "AmpxPrecision")
        self.monitor = None
        self._device_given = device is not None
        self._scaler_given = scaler is not None
        self._scaler_kwargs = dict(BF16_DEFAULTS if precision == "bf16-mixed" else {}, **scaler_kwargs)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # The stock constructor refuses a scaler with bf16; ours is set right after it.
        super().__init__(precision, device, scaler=None)
        self.scaler = scaler if scaler is not None else GradScaler(device, **self._scaler_kwargs)
        self._last_skipped = {}  # id(optimizer) -> did its last step skip (a bool or a lazy flag)
        # id(optimizer) whose gradients the scaler has already unscaled or clipped this step
        # (by the plugin, or by a manual-optimization clip before opt.step())
        self._unscaled = set()
        self._no_clip = False  # set while the hooks of a step without backward run
        self._watched = None  # id of the LightningModule whose parameter names the scaler has
        self._held = []  # schedulers this plugin holds on skipped steps
        self.log_stats = log_stats
        self.grad_buffer = bool(grad_buffer)
        self.grad_buffers = {}  # id(optimizer) -> its GradBuffer, for the current fit

    # ---- set-up (Lightning calls connect once the model is on its device) --------------------

    def convert_module(self, module):
        """Refuses a strategy the plugin cannot serve (the first call a strategy's setup makes)."""
        _refuse_strategy(_strategy_of(module))
        return super().convert_module(module)

    def connect(self, model, optimizers, lr_scheduler_configs):
        """Refuses a strategy the plugin cannot serve, settles the device from the model, shards
        the scaler under ModelParallelStrategy, and makes the step schedulers hold on skipped
        steps."""
        strategy = _strategy_of(model)
        _refuse_strategy(strategy)
        device = self.device if self._device_given else _model_device(model, self.device)
        self._settle_scaler(device, _shards_gradients(strategy))
        self._last_skipped.clear()  # (ids of another fit's optimizers may be reused)
        if self.precision == "16-mixed" and self.device == "cpu":
            log.info("ampx: 16-mixed on the CPU runs float16 autocast with ampx's loss scaler "
                     "(Lightning's own MixedPrecision would switch to bf16)")
        for config in lr_scheduler_configs:
            if config.interval == "step" and _hold_scheduler(config.scheduler, self):
                self._held.append(config.scheduler)
        if self.grad_buffer and _fitting(model):
            self._give_buffers(model, optimizers)
        return super().connect(model, optimizers, lr_scheduler_configs)

    def _give_buffers(self, model, optimizers):
        if isinstance(model, torch.nn.Module):
            _refuse_bucket_views(model)  # DDP's bucket views would fight the buffer's views
        for opt in optimizers:
            opt = _unwrap(opt)
            if id(opt) not in self.grad_buffers:  # replace: another plugin's or trainer's buffer
                self.grad_buffers[id(opt)] = GradBuffer(opt, replace=True)

    def _settle_scaler(self, device, sharded):
        """Makes the scaler fit this fit: on the model's device and, when the gradients are
        sharded, agreeing over the default group (and not when they are not: DDP's identical
        gradients summed over the ranks would count each one once per rank). The plugin's own
        scaler is rebuilt when it does not fit, keeping its state (a plugin reused for a fit
        under another strategy); a scaler the user gave is refused instead."""
        grouped = self.scaler.sharded
        if self._scaler_given:
            if sharded and not grouped:
                raise ValueError(
                    "AmpxPrecision: under ModelParallelStrategy each rank holds a shard of the gradients, and "
                    "the scaler passed has no process_group, so ranks would skip different steps and clip by "
                    "their own shard's norm. Leave scaler out (the plugin then builds one over the default "
                    "group) and pass ampx.GradScaler's settings as keywords, or pass "
                    "ampx.GradScaler(process_group=...)")
            if grouped and not sharded and _group_size(self.scaler.process_group) > 1:
                raise ValueError(
                    "AmpxPrecision: the scaler passed is sharded (a process_group, or ampx.ShardedGradScaler), "
                    "but under this strategy every rank holds the whole gradients (DDP averages them), so a norm "
                    "summed over the group would count each gradient once per rank. Pass an ampx.GradScaler "
                    "without process_group (sharded scalers are for sharded gradients: ModelParallelStrategy)")
        elif device != self.device or sharded != grouped:
            if sharded and not torch.distributed.is_initialized():
                raise RuntimeError(
                    "AmpxPrecision: the strategy shards gradients over several processes, but torch.distributed "
                    "has no default process group, so ranks could not agree on overflow or on the norm; "
                    "initialise it before the plugin connects (Lightning's own launchers do)")
            group = torch.distributed.group.WORLD if sharded else None
            scaler = GradScaler(device, process_group=group, **self._scaler_kwargs)
            state = self.scaler.state_dict()  # the scale and tracker so far ({} when disabled)
            if state:
                scaler.load_state_dict(state)
            self.scaler = scaler
            self._watched = None  # the new scaler has no parameter names yet
        self.device = device

    def teardown(self):
        """Gives the schedulers back their own class and ends the fit's GradBuffers."""
        while self._held:
            _release_scheduler(self._held.pop())
        for buf in self.grad_buffers.values():
            buf.close()  # the gradients stay as they are; later backwards leave them autograd's
        self.grad_buffers.clear()
        super().teardown()

    # ---- the step ----------------------------------------------------------------------------

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """Runs the closure (forward, backward), Lightning's hooks and clipping, then the scaler's
        step and update; records whether the step was skipped."""
        optimizer = _unwrap(optimizer)
        if not self.scaler.is_enabled():
            self._last_skipped[id(optimizer)] = False
            return Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        self._watch(model)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward, no step; not an overflow (Lightning's
            # schedule goes on, as with the stock plugin). Its hooks still run, as with the stock
            # plugin, but not the clip: the gradients will not be stepped (the stock plugin would
            # clip them as they are, still scaled), and ampx's clip prepares the next step.
            self._no_clip = True
            try:
                self._after_closure(model, optimizer)
            finally:
                self._no_clip = False
            self._last_skipped[id(optimizer)] = False
            return closure_result
        if id(optimizer) not in self._unscaled and _hooks_read_gradients(model):
            # Lightning's contract: hooks that may read gradients see them unscaled, fused
            # optimizers included (the stock plugin leaves theirs scaled; ampx's scaler steps a
            # fused optimizer after unscale_ with no grad_scale).
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))
        self._after_closure(model, optimizer)  # on_before_optimizer_step, then clipping
        try:
            out = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
        finally:
            self._unscaled.discard(id(optimizer))
        self._last_skipped[id(optimizer)] = self.scaler.last_step_skipped
        if self.log_stats:
            self._log(model)
        return out

    def step_was_skipped(self, optimizer):
        """Whether ``optimizer``'s last step through this plugin was skipped (inf/NaN gradients)."""
        return bool(self._last_skipped.get(id(_unwrap(optimizer)), False))

    def _log(self, model):
        stats = self.scaler.stats()
        model.log("ampx/loss_scale", float(self.scaler.get_scale()), on_step=True, on_epoch=False)
        model.log("ampx/skipped_steps", float(stats["skipped_steps"]), on_step=True, on_epoch=False)

    def _watch(self, model):
        if self._watched != id(model):
            self.scaler.watch(model.named_parameters())  # overflow reports name the parameters
            self._watched = id(model)
        if self._monitor_kwargs is not None and (self.monitor is None or self.monitor._scaler is not self.scaler
                                                 or self.monitor._model is not model):
            if self.monitor is not None:
                self.monitor.remove()
            self.monitor = self.scaler.monitor(model, **self._monitor_kwargs)

    # ---- clipping ----------------------------------------------------------------------------

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM):
        """Clips through ampx: by norm with ``scaler.clip_grad_norm_`` (any optimizer, fused ones
        included, the clip folded into their step); by value after an in-memory unscale."""
        if not clip_val or clip_val <= 0 or self._no_clip:
            return
        optimizer = _unwrap(optimizer)
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            if self.scaler.sharded and _group_size(self.scaler.process_group) > 1:
                _refuse_plain_parameters(optimizer, self.scaler)  # each clip: a layer may be unfrozen later
            self.scaler.clip_grad_norm_(optimizer, clip_val)
            if self.scaler.is_enabled():
                self._unscaled.add(id(optimizer))
            return
        if self.scaler.is_enabled() and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))
        self.clip_grad_by_value(optimizer, clip_val)

    # ---- checkpoints -------------------------------------------------------------------------

    def on_load_checkpoint(self, checkpoint):
        """Loads the scaler state that another plugin class saved (Lightning itself loads only
        the key of this class's name): the stock MixedPrecision's, or AmpxPrecision's into a
        subclass of it."""
        own = type(self).__qualname__
        if own in checkpoint:
            return
        for key in CHECKPOINT_KEYS:
            if key != own and key in checkpoint:
                self.load_state_dict(checkpoint[key])
                log.info("ampx: loaded the loss-scaler state saved under %r", key)
                return


def _trainer_of(model):
    """The Trainer of the LightningModule ``model`` is or wraps (DDP's ``.module``), or None."""
    for m in (model, getattr(model, "module", None), getattr(getattr(model, "module", None), "module", None)):
        trainer = getattr(m, "_trainer", None)
        if trainer is not None:
            return trainer
    return None


def _strategy_of(model):
    return getattr(_trainer_of(model), "strategy", None)


def _fitting(model):
    """Whether the trainer that connects the plugin is fitting (Lightning keeps the last fit's
    optimizers for validate/test/predict, which need no gradient buffer). True when unknown."""
    trainer = _trainer_of(model)
    if trainer is None:
        return True
    return getattr(getattr(trainer, "state", None), "fn", "fit") == "fit"


def _refuse_plain_parameters(optimizer, scaler):
    """Before each clip by a sharded scaler, for an optimizer with no DTensor parameter at all (a
    model configure_model left unparallelized): each plain parameter holds a whole copy of its
    gradient on every rank, which the norm summed over the ranks would add once per rank. Decided
    from ``requires_grad`` (the same on every rank, so every rank refuses together: none waits in
    the all-reduce); unfreezing a layer later is seen at the next clip. Plain parameters beside
    DTensor ones are refused by the scaler itself, on every rank together."""
    groups = optimizer.param_groups
    if any(hasattr(p, "device_mesh") for group in groups for p in group["params"]):
        return  # (at the first parameter, for a parallelized model: this runs at every clip)
    for i, p in enumerate(p for group in groups for p in group["params"]):
        if p.requires_grad:
            who = scaler._param_names.get(id(p)) or f"{i} (shape {tuple(p.shape)})"
            raise ValueError(
                f"AmpxPrecision: under ModelParallelStrategy the parameter {who} is a plain tensor, not a "
                "DTensor, so every rank holds a whole copy of its gradient and the clip's norm, summed over "
                "the ranks, would count it once per rank. Parallelize or fully_shard the module that holds "
                "it in configure_model (nothing was clipped)")


def _model_device(model, default):
    param = next(iter(model.parameters()), None)
    return default if param is None else param.device.type


def _unwrap(optimizer):
    """The torch optimizer inside Lightning's LightningOptimizer (the scaler keys its per-step
    state by the optimizer object: two objects for one optimizer would unscale twice)."""
    while isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _hooks_read_gradients(model):
    """Whether a hook between backward and the step may read gradients: the module's
    on_before_optimizer_step or configure_gradient_clipping, or a callback's
    on_before_optimizer_step. Without one, unscaling waits for the clip or the step (one pass)."""
    if is_overridden("on_before_optimizer_step", model) or is_overridden("configure_gradient_clipping", model):
        return True
    trainer = getattr(model, "_trainer", None)
    callbacks = trainer.callbacks if trainer is not None else []
    return any(is_overridden("on_before_optimizer_step", cb, Callback) for cb in callbacks)


# ---- strategies ---------------------------------------------------------------------------------
# Lightning pairs FSDPStrategy and DeepSpeedStrategy with precision plugins of their own. FSDP's
# setter refuses any other (a TypeError when the Trainer is built), but a subclass may lift that;
# DeepSpeed's takes any plugin, and then its engine scales and steps in its own way while the
# plugin scales and steps around it (measured: crashes mid-step, or DeepSpeed's own errors, never a
# clear word). ModelParallelStrategy (FSDP2, tensor parallel) takes any plugin too; it needs the
# scaler sharded, which the plugin does itself (see _shards_gradients).

_REFUSED = (
    (DeepSpeedStrategy,
     "DeepSpeed's engine runs the backward, its own loss scaling and the optimizer step, so ampx's "
     "scaler would scale on top of it or step around it. Leave AmpxPrecision out and pass "
     "precision='16-mixed' or 'bf16-mixed' (Lightning's DeepSpeedPrecision); to give DeepSpeed's "
     "scaler ampx's settings, pass DeepSpeedStrategy(config=ampx.Policy('fp16', ...)"
     ".deepspeed_config({...}))."),
    (FSDPStrategy,
     "FSDP shards and reduces the gradients itself and clips through its root module, which a "
     "MixedPrecision plugin cannot do. Leave AmpxPrecision out and pass precision='16-mixed' or "
     "'bf16-mixed' (Lightning's FSDPPrecision), with FSDPStrategy(mixed_precision=ampx.Policy(...)"
     ".fsdp_mixed_precision()) for ampx's dtypes and, for ampx's one-collective scaler, "
     "plugin.scaler = ampx.ShardedGradScaler() on an FSDPPrecision('16-mixed'); or use "
     "ModelParallelStrategy (FSDP2), under which AmpxPrecision works."),
)


def _refuse_strategy(strategy):
    """Raises MisconfigurationException, naming the strategy and what to use instead, when
    ``strategy`` is one whose gradients and steps AmpxPrecision cannot handle correctly."""
    for cls, why in _REFUSED:
        if isinstance(strategy, cls):
            raise MisconfigurationException(
                f"AmpxPrecision does not work with {type(strategy).__name__} ({cls.__name__}): {why}")


def _shards_gradients(strategy):
    """Whether each rank holds only a shard of the gradients, so that the scaler must agree over
    the default group: a multi-process ModelParallelStrategy, whose gradients are DTensor shards.
    Their norm summed over the ranks counts each element once only where the gradient is sharded
    over every rank (FSDP2 alone, or FSDP2 x TP for the layers parallelized over both
    dimensions); a gradient repeated on several ranks (Replicate over a mesh dimension, a
    sub-mesh such as FSDP2's data-parallel one under TP for a layer left out of the TP plan, a
    plain tensor) is refused at the clip with its name, never counted twice. Overflow agreement
    needs no such care (a max). Not DDP: its gradients are identical on every rank after the
    all-reduce."""
    return isinstance(strategy, ModelParallelStrategy) and strategy.world_size > 1


# ---- holding the LR schedule on skipped steps ---------------------------------------------------
# Lightning steps a "step"-interval scheduler after every optimizer step, skipped or not, and has
# no hook a precision plugin could use to stop it (its lr_scheduler_step hook belongs to the
# user's LightningModule). So the plugin gives each such scheduler a subclass of its own class
# whose step() returns at once when its optimizer's last step was skipped, the way Lightning
# itself re-classes optimizers (LightningOptimizer); teardown gives the class back. Nothing is
# added to the scheduler's __dict__, so its state_dict is unchanged.

_HOLDERS = weakref.WeakKeyDictionary()  # scheduler -> the AmpxPrecision holding it
_HOLDING_CLASSES = {}  # scheduler class -> its holding subclass


class _HoldOnSkip:
    def step(self, *args, **kwargs):
        plugin = _HOLDERS.get(self)
        if plugin is not None and plugin.step_was_skipped(self.optimizer):
            log.debug("ampx: the optimizer step was skipped; %s holds", type(self).__name__)
            return None
        return super().step(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        # Pickled (and copied) as the scheduler's own class: the hold belongs to the plugin.
        getstate = getattr(self, "__getstate__", None)
        state = getstate() if getstate is not None else self.__dict__
        return _rebuild_unheld, (type(self)._ampx_base, state)


def _rebuild_unheld(cls, state):
    obj = cls.__new__(cls)
    if hasattr(obj, "__setstate__"):
        obj.__setstate__(state)
    else:
        obj.__dict__.update(state)
    return obj


def _hold_scheduler(scheduler, plugin):
    """Makes ``scheduler`` hold when its optimizer's step was skipped; False if it cannot be."""
    cls = type(scheduler)
    if isinstance(scheduler, _HoldOnSkip):
        _HOLDERS[scheduler] = plugin
        return True
    if not hasattr(scheduler, "optimizer"):
        log.warning("ampx: %s has no .optimizer; its schedule is not held on skipped steps", cls.__name__)
        return False
    sub = _HOLDING_CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (_HoldOnSkip, cls), {"__module__": cls.__module__, "_ampx_base": cls})
        _HOLDING_CLASSES[cls] = sub
    try:
        scheduler.__class__ = sub
    except TypeError as exc:
        log.warning("ampx: %s cannot be held on skipped steps (%s)", cls.__name__, exc)
        return False
    _HOLDERS[scheduler] = plugin
    return True


def _release_scheduler(scheduler):
    _HOLDERS.pop(scheduler, None)
    if isinstance(scheduler, _HoldOnSkip):
        scheduler.__class__ = type(scheduler)._ampx_base
