"""The scaler ``ampx.prepare`` returns under DeepSpeed: the loop's scaler calls, routed to the engine.

DeepSpeed's engine scales the loss, checks for overflow and steps itself (configured from the
policy by ``Policy.deepspeed_config``), so this object only keeps the training loop the same as on
every other backend: ``scale(loss).backward()`` is ``engine.backward(loss)`` and ``step`` is
``engine.step()``.
"""

import torch

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
    """

    def __init__(self, engine, policy):
        self.engine = engine
        self._enabled = policy.loss_scaling != "none"
        self.last_step_skipped = False

    def scale(self, loss):
        return _EngineLoss(self.engine, loss)

    def step(self, optimizer=None, *args, **kwargs):
        before = getattr(self.engine, "skipped_steps", 0)
        self.engine.step(*args, **kwargs)
        self.last_step_skipped = getattr(self.engine, "skipped_steps", 0) != before

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

    def state_dict(self):
        # DeepSpeed saves its loss scaler in its own checkpoints (engine.save_checkpoint).
        return {}

    def load_state_dict(self, state_dict):
        if state_dict:
            raise RuntimeError("DeepSpeed restores its loss scale from engine.load_checkpoint(), "
                               "not from a scaler state_dict")

    def __repr__(self):
        return f"DeepSpeedScaler(engine={type(self.engine).__name__}, scale={self.get_scale()})"
