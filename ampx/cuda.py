"""ampx.cuda: whether ampx's CUDA kernels can be used.

The CUDA kernels (compiled by nvcc into a fatbin and loaded through the driver API) are not
built yet, so every CUDA tensor given to ``ampx.ops`` or ``ampx.GradScaler`` is refused with a
ValueError naming its device. Code that picks a device for ampx asks here first.
"""

__all__ = ["is_available"]


def is_available():
    """True when ampx can run its kernels on CUDA tensors (not yet in this build)."""
    return False
