"""ampx.ShardedGradScaler: torch's ShardedGradScaler constructor over ampx.GradScaler.

A module of its own, imported on first use of ``ampx.ShardedGradScaler``: deriving from torch's
class means importing torch.distributed.fsdp, which costs about a third of a second, and most
users never need it.
"""

from . import rank_check
from .scaler import GradScaler, _TorchScaler

__all__ = ["ShardedGradScaler"]


def _torch_sharded_scaler():
    """torch's ShardedGradScaler class, or None where torch.distributed is not built."""
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as cls
    except ImportError:  # pragma: no cover - torch without distributed support
        return None
    return cls


class ShardedGradScaler(GradScaler, *filter(None, [_torch_sharded_scaler()])):
    """A drop-in for ``torch.distributed.fsdp.ShardedGradScaler``, on ampx's kernels.

    It is an instance of torch's class too (FSDP-aware code checks for it), but none of torch's
    sharded overrides run: every method comes from ``ampx.GradScaler`` or torch's plain scaler.

    Same constructor as torch's class (note its order: ``backoff_factor`` before
    ``growth_factor``), same default group (the default process group, looked up at each step),
    and, as there, gradients may be float16. Unlike torch's class, one collective per step
    carries both the overflow flag and the norm that ``clip_grad_norm_`` needs, and the
    extras of ``ampx.GradScaler`` are available as keyword arguments. Without an initialised
    process group it acts on one process and issues no collective.
    """

    def __init__(self, device="cuda", init_scale=2.0**16, backoff_factor=0.5, growth_factor=2.0,
                 growth_interval=2000, enabled=True, process_group=None, **extras):
        rank_check.checked("ampx.ShardedGradScaler", extras.get("check_ranks", False), True)
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled,
                         process_group=process_group, **extras)
        self._sharded = True

    # torch's plain method, not its sharded override (the result is the same: scale times the loss)
    scale = _TorchScaler.scale

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        # torch's ShardedGradScaler signature: fp16 gradients allowed by default (FSDP keeps them)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
