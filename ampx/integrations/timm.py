"""ampx inside timm's train loop: ``NativeScaler`` here in place of ``timm.utils.NativeScaler``.

Two changes to timm's ``train.py`` (or any loop written like it):

    loss_scaler = NativeScaler(device=device.type)          # from ampx.integrations.timm
    hold_on_skip(loss_scaler, lr_scheduler, model_ema)      # after the scheduler is made

- ``NativeScaler`` is called as timm's is (``loss_scaler(loss, optimizer, clip_grad=...,
  clip_mode=..., parameters=..., create_graph=..., need_update=...)``) and saves under the same
  checkpoint key. It drives an ``ampx.GradScaler``: ``clip_mode="norm"`` over the optimizer's own
  parameters is the scaler's one fused pass (unscale, inf check and norm together); ``"value"``
  and ``"agc"`` (and a norm over other parameters) unscale through ampx and then run timm's
  own clip. The call returns whether the step was skipped (``last_step_skipped`` keeps it).
- timm's loop advances ``lr_scheduler.step_update(num_updates)`` and ``model_ema.update(model,
  step=num_updates)`` after every update, skipped or not. ``hold_on_skip`` makes both do nothing
  on a skipped step and, afterwards, see ``num_updates`` less the updates skipped so far, so the
  schedule and the EMA's decay warm-up go on as if the skipped step had not happened. The count
  travels in the scaler's checkpoint, so a resumed run holds the same offsets.
- ``NativeScaler(dtype=torch.bfloat16)`` (timm uses no scaler for bf16) is a static scale of 1:
  nothing is scaled, but steps whose gradients hold inf/NaN are still skipped and named.
"""
import torch

from . import require
from ._hold import hold_method
from ..scaler import GradScaler
from ._wrappers import resolve_optimizer

require("timm", "timm")
from timm.utils.agc import adaptive_clip_grad  # noqa: E402

__all__ = ["NativeScaler", "hold_on_skip"]

_CLIP_MODES = ("norm", "value", "agc")


class NativeScaler:
    """A drop-in for ``timm.utils.NativeScaler`` on ``ampx.GradScaler``.

    Args:
        device: the device type of the scale (timm passes ``device.type``).
        dtype: the autocast dtype: torch.float16 (default) scales dynamically; torch.bfloat16
            keeps a static scale of 1, which only checks and skips.
        named_parameters: ``model.named_parameters()``, so overflow reports name parameters.
        **scaler_kwargs: any other ``ampx.GradScaler`` setting (``init_scale``, ``hysteresis``...).

    Attributes:
        scaler (also ``_scaler``, timm's name): the ``ampx.GradScaler``.
        last_step_skipped: whether the last update was skipped (False before any).
        skipped_updates: updates skipped so far (saved in ``state_dict``).
        last_norm: the total gradient norm of the last ``clip_mode="norm"`` update, else None.
    """

    state_dict_key = "amp_scaler"  # timm's checkpoint key for its scaler

    def __init__(self, device="cuda", dtype=torch.float16, *, named_parameters=None, **scaler_kwargs):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"ampx.integrations.timm.NativeScaler: dtype must be torch.float16 or "
                             f"torch.bfloat16, not {dtype}")
        if dtype == torch.bfloat16:
            scaler_kwargs = {"init_scale": 1.0, "dynamic": False, **scaler_kwargs}
        self.scaler = GradScaler(device, named_parameters=named_parameters, **scaler_kwargs)
        self.last_step_skipped = False
        self.skipped_updates = 0
        self.last_norm = None

    @property
    def _scaler(self):
        return self.scaler  # timm's attribute name, for code that reads the scale through it

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None,
                 create_graph=False, need_update=True):
        """Backward of the scaled loss; with ``need_update``, clip, step and update.

        As timm's: ``clip_grad`` is the max norm (``"norm"``), the bound (``"value"``) or the
        clip factor (``"agc"``) over ``parameters`` (default here: the optimizer's).

        Returns:
            True when this update was skipped (inf/NaN gradients), else False (also when
            ``need_update`` is False: nothing was stepped).

        Raises:
            ValueError: an unknown ``clip_mode`` (before the backward).
        """
        if clip_grad is not None and clip_mode not in _CLIP_MODES:
            raise ValueError(f"ampx.integrations.timm.NativeScaler: clip_mode must be one of {_CLIP_MODES}, "
                             f"not {clip_mode!r}")
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if not need_update:
            return False
        self.last_norm = None
        if clip_grad is not None:
            self._clip(optimizer, clip_grad, clip_mode, parameters)
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = bool(self.scaler.last_step_skipped)
        self.last_step_skipped = skipped
        self.skipped_updates += skipped
        return skipped

    def _clip(self, optimizer, clip_grad, clip_mode, parameters):
        """One fused pass for a norm over exactly the optimizer's parameters; otherwise ampx
        unscales and timm's (or torch's) clip runs on the unscaled gradients."""
        params = _optimizer_params(optimizer) if parameters is None else _as_list(parameters)
        if clip_mode == "norm" and _same_grads(params, _optimizer_params(optimizer)):
            self.last_norm = self.scaler.clip_grad_norm_(optimizer, clip_grad)
            return
        self.scaler.unscale_(optimizer)
        if clip_mode == "norm":
            self.last_norm = torch.nn.utils.clip_grad_norm_(params, clip_grad)
        elif clip_mode == "value":
            torch.nn.utils.clip_grad_value_(params, clip_grad)
        else:
            adaptive_clip_grad(params, clip_grad)

    def state_dict(self):
        """The scaler's state_dict and the count of skipped updates."""
        return {"scaler": self.scaler.state_dict(), "skipped_updates": self.skipped_updates}

    def load_state_dict(self, state_dict):
        """Loads this class's state_dict, or a stock timm checkpoint's (torch's scaler state:
        the count of skipped updates then starts at 0)."""
        if "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
            self.skipped_updates = int(state_dict.get("skipped_updates", 0))
        else:
            self.scaler.load_state_dict(state_dict)
            self.skipped_updates = 0

    def overflow_report(self):
        """The scaler's ``OverflowReport`` of the last skipped update (names the parameters)."""
        return self.scaler.overflow_report()

    def stats(self):
        return self.scaler.stats()


def hold_on_skip(loss_scaler, lr_scheduler=None, model_ema=None):
    """Makes timm's per-update schedule and EMA hold on the updates ``loss_scaler`` skipped.

    ``lr_scheduler.step_update(num_updates, ...)`` and ``model_ema.update(model, step=...)``
    then do nothing right after a skipped update, and otherwise receive the update count less
    the updates skipped so far. Epoch-based schedules (``lr_scheduler.step(epoch)``) are left
    as they are. Either may be None; holding an object again makes it follow the new
    ``loss_scaler`` (as after a resume). Their state_dicts are left as they were.

    Raises:
        TypeError: ``loss_scaler`` is not this module's ``NativeScaler``, or ``lr_scheduler`` /
            ``model_ema`` lacks ``step_update`` / ``update``.
    """
    if not isinstance(loss_scaler, NativeScaler):
        raise TypeError(f"hold_on_skip: loss_scaler must be ampx.integrations.timm.NativeScaler, not "
                        f"{type(loss_scaler).__name__} (timm's own scaler does not say which steps it skipped)")
    if lr_scheduler is not None:
        _hold(lr_scheduler, "step_update", "num_updates", loss_scaler)
    if model_ema is not None:
        _hold(model_ema, "update", "step", loss_scaler)
    return loss_scaler


def _hold(obj, method, count_arg, loss_scaler):
    """``obj.<method>`` does nothing right after a skipped update and otherwise gets its
    ``count_arg`` argument less the updates skipped so far."""
    position = 0 if method == "step_update" else 1  # step_update(num_updates), update(model, step)

    def rule(original, *args, **kwargs):
        if loss_scaler.last_step_skipped:
            return None
        args = list(args)
        if count_arg in kwargs:
            kwargs[count_arg] = _less(kwargs[count_arg], loss_scaler.skipped_updates)
        elif len(args) > position:
            args[position] = _less(args[position], loss_scaler.skipped_updates)
        return original(*args, **kwargs)

    try:
        hold_method(obj, method, rule)
    except TypeError as exc:
        raise TypeError(f"hold_on_skip: {exc}") from None


def _less(count, skipped):
    return count if count is None else count - skipped


def _as_list(parameters):
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _optimizer_params(optimizer):
    optimizer = resolve_optimizer(optimizer, "clip_grad_norm_")
    return [p for g in optimizer.param_groups for p in g["params"]]


def _same_grads(a, b):
    """Whether two parameter lists hold the same set of parameters with gradients."""
    ids = lambda ps: {id(p) for p in ps if p.grad is not None}  # noqa: E731
    return ids(a) == ids(b)

