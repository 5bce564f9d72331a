"""What ``torch.compile`` sees of the scaler's host-driven calls.

``unscale_``, ``clip_grad_norm_``, ``step`` and ``update`` decide on the host: whether the
optimizer steps (the found-inf flag of a plain optimizer), the next scale's bookkeeping, the
telemetry and the overflow report. Dynamo cannot trace that into a graph, and tracing into it
used to fail deep inside (a private torch helper dynamo skips, or "weak object has gone away").
So each runs eagerly under ``torch.compile``, as one clean graph break, the way torch's own
scaler's host reads break its graphs; ``scale`` stays traceable. Under ``fullgraph=True`` a
break is an error, and that error carries the reason below: why, and what to compile instead.

``torch.compiler.disable`` takes a ``reason`` from torch 2.7 on; where it does not (probed, not
assumed), the call is disabled without one.
"""
import inspect

import torch

__all__ = ["host_driven", "REASON"]

REASON = ("ampx.GradScaler.{name}() runs eagerly under torch.compile (a graph break; an error with "
          "fullgraph=True): it decides on the host whether the optimizer steps and how the loss scale "
          "moves. Compile the forward and backward (the loss and scaler.scale(loss).backward()) and, for a "
          "fused optimizer, optimizer.step itself; call scaler.{name}() outside the fullgraph function")


def _disable_takes_reason():
    try:
        return "reason" in inspect.signature(torch.compiler.disable).parameters
    except (TypeError, ValueError):
        return False


_TAKES_REASON = _disable_takes_reason()


def host_driven(fn, takes_reason=None):
    """fn, run eagerly under torch.compile, with REASON for fn's name on a fullgraph error.
    takes_reason: whether torch.compiler.disable accepts reason= (None: as probed)."""
    why = REASON.format(name=fn.__name__)
    if _TAKES_REASON if takes_reason is None else takes_reason:
        return torch.compiler.disable(fn, reason=why)
    return torch.compiler.disable(fn)
