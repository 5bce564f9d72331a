"""What ``torch.compile`` sees of the scaler's host-driven calls.

``unscale_``, ``clip_grad_norm_``, ``step`` and ``update`` decide on the host: whether the
optimizer steps (the found-inf flag of a plain optimizer), the next scale's bookkeeping, the
telemetry and the overflow report. Dynamo cannot trace that into a graph, and tracing into it
used to fail deep inside (a private torch helper dynamo skips, or "weak object has gone away").
So each runs eagerly under ``torch.compile``, as one clean graph break, the way torch's own
scaler's host reads break its graphs; ``scale`` stays traceable. Under ``fullgraph=True`` a
break is an error, and that error carries the reason below: why, and what to compile instead.

With a fused torch optimizer the post-backward calls trace instead (ampx/graph_step.py);
``eager_under_compile`` is the eager call for the others, its reason saying which condition failed.

``torch.compiler.disable`` takes a ``reason`` from torch 2.7 on; where it does not (probed, not
assumed), the call is disabled without one.
"""
import inspect

import torch

__all__ = ["host_driven", "REASON", "eager_under_compile"]

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


def host_driven(fn, takes_reason=None, name=None):
    """fn, run eagerly under torch.compile, with REASON for fn's name (or ``name``) on a fullgraph
    error. takes_reason: whether torch.compiler.disable accepts reason= (None: as probed).
    Everything fn calls runs eagerly too: called without it, a frame running outside a graph
    would be offered to dynamo frame by frame (the optimizer's step compiled on its own)."""
    why = REASON.format(name=name or fn.__name__)
    if _TAKES_REASON if takes_reason is None else takes_reason:
        return torch.compiler.disable(fn, reason=why)
    return torch.compiler.disable(fn)


def _run(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _runners(takes_reason):
    from .graph_step import REASONS

    out = {}
    for name in ("clip_grad_norm_", "step", "update"):
        for key, why in REASONS.items():
            text = REASON.format(name=name) + ". It could not be traced into the graph here because " + why
            out[name, key] = torch.compiler.disable(_run, reason=text) if takes_reason else torch.compiler.disable(_run)
    return out


_RUNNERS = None


def eager_under_compile(name, key):
    """A runner ``run(fn, *args, **kwargs)`` that calls fn eagerly under torch.compile, with the
    reason for scaler method ``name`` and graph_step.REASONS[key] on a fullgraph error. Made when
    ampx.scaler is imported (make_runners): the scaler asks for one while dynamo traces, where
    making it would be traced too."""
    return _RUNNERS[name, key]


def make_runners():
    global _RUNNERS
    if _RUNNERS is None:
        _RUNNERS = _runners(_TAKES_REASON)
