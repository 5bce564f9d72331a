"""The dtype of the norm ``GradScaler.clip_grad_norm_`` returns, and its ``clip_norm`` setting.

ampx computes a clip's norm exactly (squares summed in float64, rounded to float32 once) and
clips by that float32 value whatever the gradients' dtype. torch's
``torch.nn.utils.clip_grad_norm_`` works in the gradients' dtype: per-tensor norms by
``_foreach_norm`` in each gradient's dtype, combined by ``vector_norm(stack(norms))`` (so a mix of
dtypes promotes, as ``torch.stack`` does: bf16 with fp16 gives float32), and returns that dtype.
For bf16 or fp16 gradients its norm is rounded several times (about 0.2% off for a bf16 model).

``clip_norm="exact"`` (the default) keeps ampx's exact norm and coefficient and returns the norm
in torch's dtype, rounded to it from the float32 value (float32 gradients: the float32 tensor
itself, unchanged). ``clip_norm="torch"`` takes torch's own route: ``unscale_``, then
``torch.nn.utils.clip_grad_norm_``, for a norm and gradients bit-identical to torch's.

The low-precision value is the float32 one rounded again (the kernels hand back float32): it
equals the float64 norm rounded once to bf16/fp16 except when the float32 rounding lands exactly
on a midpoint of the narrower format (about one norm in 2**16 for bf16, 2**13 for fp16), where it
may be one bf16/fp16 ulp off. A float64 gradient in the list makes the result float64, holding
the float32 value.

``ampx.MasterWeights`` clips the float32 masters' gradients, so its norm is float32 (as torch's
clip of those float32 gradients would be).
"""
import torch

from .settings import CLIP_NORMS  # noqa: F401 (the setting's values, checked there)


def torch_norm_dtype(grads):
    """The dtype torch's clip_grad_norm_ returns for these gradients (float32 for none): the
    promotion of their dtypes, as torch.stack of their per-tensor norms makes it."""
    dtype = None
    for d in {g.dtype for g in grads}:  # (a set first: ~20 us for 288 tensors, not ~100)
        dtype = d if dtype is None else torch.promote_types(dtype, d)
    return torch.float32 if dtype is None else dtype


def as_torch_dtype(total, dtype):
    """``total`` (ampx's float32 norm) in ``dtype`` (``torch_norm_dtype``'s): the same tensor
    when that is float32, else one rounding of it (on its device, no host read)."""
    if total is None or dtype == total.dtype:
        return total
    return total.to(dtype)
