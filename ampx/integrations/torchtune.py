"""ampx inside a torchtune recipe: ``RecipePrecision(model, optimizer, ...)``.

torchtune's full-finetune recipes have no scaler and no autocast: ``dtype: bf16`` makes the
model, its gradients and the optimizer's state bfloat16, the LR scheduler steps on every step,
and ``float16`` is refused. ``RecipePrecision`` is what a recipe adds to get, instead:

- ``masters=True`` (default): the model's parameters in ``dtype`` (bf16 or fp16) and the
  optimizer stepping float32 masters of them (``ampx.MasterWeights``); build the model in float32
  and the masters start from its exact values (a model built in bf16 gives masters of its bf16
  values). fp16 gets a dynamic ``ampx.GradScaler``; bf16 a static scale of 1, which scales
  nothing but checks every gradient, skips the step that holds inf/NaN and names the parameter.
- ``masters=False``: float32 parameters and ``dtype`` autocast (``autocast()``), with the same
  scaler rule; the optimizer stays the recipe's.
- ``step(max_norm)`` replaces the recipe's clip, ``optimizer.step()`` and ``zero_grad``: one
  fused pass unscales, checks and takes the norm, then the step runs unless the gradients held
  inf/NaN. ``hold(lr_scheduler)`` makes the recipe's own ``lr_scheduler.step()`` do nothing after
  a skipped step, so the schedule counts only the steps taken.

The recipe's lines that change are in the README ("torchtune").
"""
import contextlib

import torch

from . import require
from ._hold import hold_method
from ..master import MasterWeights
from ..scaler import GradScaler

require("torchtune", "torchtune")

__all__ = ["RecipePrecision"]

_LOW = (torch.bfloat16, torch.float16)
_NAME = "ampx.integrations.torchtune.RecipePrecision"


class RecipePrecision:
    """fp32 masters (or autocast) and an ampx scaler for a torchtune full-finetune recipe.

    Args:
        model: the recipe's model (float32 parameters; with ``masters=True`` also bf16/fp16).
        optimizer: the recipe's optimizer over the model's parameters.
        dtype: torch.bfloat16 or torch.float16: the parameters' dtype (masters) or autocast's.
        masters: keep float32 masters (``ampx.MasterWeights``); False for autocast instead.
        rounding: the masters' write-back, "nearest" or "stochastic" (bf16 only).
        **scaler_kwargs: ``ampx.GradScaler`` settings (``init_scale``, ``hysteresis``...); they
            override the defaults for ``dtype``.

    Attributes:
        optimizer: what the recipe steps and checkpoints from now on (the masters' wrapper, or
            the recipe's optimizer).
        scaler: the ``ampx.GradScaler``.
        last_step_skipped: whether the last ``step`` was skipped.
        skipped_steps: steps skipped so far (saved in ``state_dict``).

    Raises:
        ValueError: ``dtype`` not bf16/fp16, or ``masters=False`` with parameters that are not
            float32 (autocast needs float32 parameters), naming the first such parameter.
    """

    def __init__(self, model, optimizer, *, dtype=torch.bfloat16, masters=True, rounding="nearest",
                 **scaler_kwargs):
        if dtype not in _LOW:
            raise ValueError(f"{_NAME}: dtype must be torch.bfloat16 or torch.float16, not {dtype}")
        named = list(model.named_parameters())
        if not named:
            raise ValueError(f"{_NAME}: the model has no parameters")
        if not masters:
            _refuse_low_params(named)
        self.dtype = dtype
        self.masters = bool(masters)
        self.device_type = named[0][1].device.type
        if masters:
            cast = any(p.dtype == torch.float32 for _, p in named)
            optimizer = MasterWeights(optimizer, model=model if cast else None, dtype=dtype if cast else None,
                                      rounding=rounding)
        self.optimizer = optimizer
        if dtype == torch.bfloat16:
            scaler_kwargs = {"init_scale": 1.0, "dynamic": False, **scaler_kwargs}
        self.scaler = GradScaler(self.device_type, named_parameters=named, **scaler_kwargs)
        self.last_step_skipped = False
        self.skipped_steps = 0

    def autocast(self):
        """The forward's context: ``dtype`` autocast with ``masters=False``; with masters the
        parameters are ``dtype`` already and nothing is needed."""
        if self.masters:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss):
        """``loss.backward()`` on the scaled loss."""
        self.scaler.scale(loss).backward()

    def step(self, max_norm=None):
        """Clips (when ``max_norm`` is given: the recipe's ``clip_grad_norm``), steps unless the
        gradients held inf/NaN, updates the scale and zeroes the gradients.

        Returns:
            The total gradient norm (unscaled; inf/NaN on a skipped step) when clipping, else None.
        """
        norm = None
        if max_norm is not None:
            norm = self.scaler.clip_grad_norm_(self.optimizer, float(max_norm))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        skipped = bool(self.scaler.last_step_skipped)
        self.last_step_skipped = skipped
        self.skipped_steps += skipped
        return norm

    def hold(self, lr_scheduler):
        """Makes ``lr_scheduler.step()`` do nothing right after a skipped ``step``; returns the
        scheduler (its state_dict is left as it was). Holding it again makes it follow this
        ``RecipePrecision`` (as after a resume).

        Raises:
            TypeError: ``lr_scheduler`` has no ``step()``.
        """
        def rule(original, *args, **kwargs):
            return None if self.last_step_skipped else original(*args, **kwargs)

        try:
            return hold_method(lr_scheduler, "step", rule)
        except TypeError as exc:
            raise TypeError(f"{_NAME}.hold: {exc}") from None

    def overflow_report(self):
        """The ``OverflowReport`` of the last skipped step (names the parameters), or None."""
        return self.scaler.overflow_report()

    def stats(self):
        return self.scaler.stats()

    def state_dict(self):
        """The scaler's state and the skipped-step count (the masters are in the optimizer's)."""
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict):
        self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))


def _refuse_low_params(named):
    for name, p in named:
        if p.dtype != torch.float32:
            raise ValueError(
                f"{_NAME}(masters=False): parameter {name!r} is {p.dtype}, but autocast needs float32 "
                "parameters: build the model in float32 (the recipe's dtype: fp32), or keep masters=True")
