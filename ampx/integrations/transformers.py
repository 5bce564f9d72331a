"""ampx inside the Transformers ``Trainer``: ``Trainer(..., ampx_scaler={...})``.

``AmpxTrainerMixin`` goes in front of any ``transformers.Trainer`` class (``Trainer`` here is it
in front of the stock one). It overrides two methods the Trainer documents for overriding:

- ``create_accelerator_and_postprocess``: every accelerator the Trainer creates, the first in
  ``__init__`` and each new one ``hyperparameter_search`` makes per trial, is given
  ``ampx.integrations.accelerate.patch`` before anything is prepared. Through it the Trainer's
  clip (``accelerator.clip_grad_norm_``) is ampx's fused clip, ``optimizer_step_was_skipped``
  is true on skipped steps, so the Trainer holds the LR schedule there (with its default fused
  AdamW too), fp16 on the CPU runs fp16 autocast with the scaler, and the scaler's state (ampx's
  settings included) travels in the Trainer's checkpoints (``scaler.pt``).
- ``log``: training logs get ``loss_scale`` and ``skipped_steps`` (the run's count so far).
"""
from . import require

transformers = require("transformers", "transformers")
require("accelerate", "transformers")  # the Trainer's own dependency, in ampx[transformers] too
from .accelerate import is_patched, patch  # noqa: E402

__all__ = ["AmpxTrainerMixin", "Trainer"]


class AmpxTrainerMixin:
    """Put it first in the bases of a Trainer class: ``class MyTrainer(AmpxTrainerMixin, SFTTrainer)``.

    Args:
        ampx_scaler: a dict of ``ampx.GradScaler`` settings (``{"hysteresis": 2}``), passed to
            ``ampx.integrations.accelerate.patch``; the other arguments are the Trainer's.
        ampx_grad_buffer: give the Trainer's optimizer an ``ampx.GradBuffer`` when the
            accelerator prepares it (``trainer.optimizer.ampx_grad_buffer``).
        ampx_monitor: True or a dict of ``ampx.PrecisionMonitor`` settings: the model is watched
            and overflow reports carry the origin and advice (``trainer.accelerator.ampx_monitor``).
    """

    def __init__(self, *args, ampx_scaler=None, ampx_grad_buffer=False, ampx_monitor=None, **kwargs):
        # set before the Trainer's __init__, which creates the first accelerator
        self.ampx_scaler_kwargs = dict(ampx_scaler or {})
        self.ampx_grad_buffer = bool(ampx_grad_buffer)
        self.ampx_monitor = ampx_monitor
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        patch(self.accelerator, grad_buffer=self.ampx_grad_buffer, monitor=self.ampx_monitor, **self.ampx_scaler_kwargs)

    def log(self, logs, *args, **kwargs):
        """The Trainer's ``log``; a training log (one with ``loss``) also gets the loss scale and
        the number of steps skipped so far."""
        accelerator = getattr(self, "accelerator", None)
        if "loss" in logs and accelerator is not None and is_patched(accelerator) and accelerator.scaler.is_enabled():
            stats = accelerator.scaler.stats()
            logs["loss_scale"] = stats["scale"]
            logs["skipped_steps"] = stats["skipped_steps"]
        return super().log(logs, *args, **kwargs)


class Trainer(AmpxTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with ampx: ``ampx.integrations.transformers.Trainer(model, args, ...,
    ampx_scaler={"hysteresis": 2})``."""
