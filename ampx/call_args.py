"""Checks of the arguments ``ampx.GradScaler``'s calls take, made before anything is touched.

An argument that would fail only after the gradients were unscaled and the inf check recorded
(an optimizer step's extra arguments, a clip's max_norm) is refused here first, so a call that
raises leaves every gradient and every bit of the scaler's state as it was.
"""
import inspect
import math

import torch

__all__ = ["check_step_args", "clip_args"]


def check_step_args(stepper, args, kwargs):
    """Refuses, before any gradient is unscaled, arguments the optimizer's step cannot take
    (otherwise they would fail only after the unscale and the inf check were recorded)."""
    try:
        sig = inspect.signature(stepper.step)
    except (TypeError, ValueError):  # no signature to read: the step itself will say
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"ampx.GradScaler.step: {type(stepper).__name__}.step() {e} (nothing was unscaled or "
                        "stepped)") from None


def clip_args(max_norm, norm_type, error_if_nonfinite):
    """clip_grad_norm_'s arguments as (float, float, bool), checked before anything is touched.
    Numbers and 1-element tensors are taken, as torch's clip takes them."""
    op = "ampx.GradScaler.clip_grad_norm_"

    def number(name, x):
        bad = isinstance(x, torch.Tensor) and (x.numel() != 1 or x.layout != torch.strided or x.device.type == "meta")
        try:
            if bad:
                raise ValueError  # (as float() of a several-element tensor)
            if isinstance(x, bool):
                raise TypeError
            return float(x)
        except (TypeError, ValueError, RuntimeError) as e:  # what float() raises, naming the argument
            kind = ValueError if isinstance(e, ValueError) else TypeError
            raise kind(f"{op}: {name} must be a real number or a one-element tensor, not {x!r:.60} (nothing was "
                       "unscaled or clipped)") from None

    max_norm, norm_type = number("max_norm", max_norm), number("norm_type", norm_type)
    if not max_norm >= 0.0:
        raise ValueError(f"{op}: max_norm must be a number >= 0 (inf for no clipping), not {max_norm!r}: a NaN or "
                         "negative one would write NaN or sign-flipped gradients (nothing was unscaled or clipped)")
    if math.isnan(norm_type):
        raise ValueError(f"{op}: norm_type must be a number (2, 1, inf or another p), not nan")
    if isinstance(error_if_nonfinite, torch.Tensor) and error_if_nonfinite.numel() != 1:
        raise TypeError(f"{op}: error_if_nonfinite must be True or False, not a tensor of shape "
                        f"{tuple(error_if_nonfinite.shape)}")
    try:
        return max_norm, norm_type, bool(error_if_nonfinite)
    except (RuntimeError, TypeError, ValueError) as e:
        raise TypeError(f"{op}: error_if_nonfinite must be True or False ({e})") from None
