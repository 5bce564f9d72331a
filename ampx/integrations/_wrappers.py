"""Which optimizer the scaler works on when it is handed a framework's optimizer wrapper.

Accelerate, Lightning and Lightning Fabric hand their users wrapped optimizers; the scaler must
key its per-step state on the optimizer whose gradients count, and step Fabric's through its
wrapper. The wrappers are recognised by class name and module, so no framework is imported.
``ampx.GradScaler`` calls ``resolve_optimizer`` in every method that takes an optimizer, and
``fabric_stepper`` / ``drives_scaler_itself`` in ``step``.
"""
import inspect
import weakref

import torch

from ..compile_guard import eager_function

__all__ = ["resolve_optimizer", "fabric_stepper", "drives_scaler_itself", "is_fabric_wrapper", "named_module"]

# Module wrappers whose own named_parameters() prefix the names the user knows the parameters by:
# (class name, the attribute that holds the wrapped module). Recognised by name: nothing imported.
_MODULE_WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module",
                    "_FabricModule": "module", "OptimizedModule": "_orig_mod"}


def named_module(module):
    """The module whose parameter names are the ones the user knows: DDP, DataParallel, Fabric's
    ``_FabricModule`` and ``torch.compile``'s ``OptimizedModule`` followed to the module they
    wrap (the names in its ``state_dict``, not "_forward_module.module.0.weight")."""
    for _ in range(16):  # a wrapper of a wrapper ...
        inner = getattr(module, _MODULE_WRAPPERS.get(type(module).__name__, ""), None)
        if not isinstance(inner, torch.nn.Module) or inner is module:
            return module
        module = inner
    return module


def resolve_optimizer(optimizer, method, needs="param_groups"):
    """The optimizer whose gradients and per-step state ``method`` works on.

    A framework's optimizer wrapper is followed through its ``.optimizer`` to the optimizer it
    wraps, so the scaler keys one per-step state whichever object the caller holds (the wrapper
    for clipping, the inner optimizer in the framework's own step): nothing is unscaled twice.
    Followed: an object that is not a ``torch.optim.Optimizer`` but whose ``.optimizer`` is one
    (Lightning's ``LightningOptimizer`` and the like), Accelerate's ``AcceleratedOptimizer`` and
    Lightning Fabric's ``_FabricOptimizer`` (Optimizer subclasses wrapping the optimizer whose
    gradients count; recognised by name, so neither framework is ever imported; ``step`` still
    steps Fabric's through the wrapper: ``fabric_stepper``). Never followed: any
    other Optimizer subclass, whose own ``step`` may do work (``ampx.MasterWeights``,
    Lookahead-style wrappers).

    Raises TypeError naming ``method`` when the object is no optimizer at all (it lacks
    ``needs``: ``param_groups``, or for a disabled scaler's step only ``step``) and wraps none.
    """
    opt = optimizer
    for _ in range(16):  # a wrapper of a wrapper ...; a cycle ends here
        if isinstance(opt, torch.optim.Optimizer) and not _is_delegating_wrapper(opt):
            break
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    if not isinstance(opt, torch.optim.Optimizer):
        opt = optimizer  # the chain reaches no optimizer: not a wrapper ampx knows
    if not hasattr(opt, needs):
        raise TypeError(
            f"ampx.GradScaler.{method}: the optimizer argument must be a torch.optim.Optimizer, or a "
            f"wrapper whose .optimizer is one (as Accelerate's and Lightning's are), not "
            f"{type(optimizer).__name__}")
    return opt


def fabric_stepper(scaler, optimizer):
    """Lightning Fabric's optimizer wrapper when ``scaler.step()`` is given one, else None. Its per-step
    state is the inner optimizer's (resolve_optimizer), but it is stepped through the wrapper,
    as torch's scaler does: Fabric's strategy may step something else (DeepSpeed's engine)
    and runs its callbacks. Refused when Fabric's precision plugin drives this scaler itself:
    the wrapper's step would call step() again."""
    if not is_fabric_wrapper(optimizer):
        return None
    precision = getattr(getattr(optimizer, "_strategy", None), "precision", None)
    if scaler._enabled and getattr(precision, "scaler", None) is scaler:
        raise RuntimeError(
            "ampx.GradScaler.step: Lightning Fabric's precision plugin already steps and updates this "
            "scaler; call optimizer.step() (Fabric's optimizer) instead of scaler.step(optimizer)")
    return optimizer


_DRIVES_SCALER = weakref.WeakKeyDictionary()  # step function -> whether it takes grad_scaler=


@eager_function  # dynamo cannot trace the weak dictionary ("weak object has gone away")
def drives_scaler_itself(step):
    """Whether an optimizer's ``step`` takes ``grad_scaler=`` (torch's deprecated contract).
    Cached per function: inspect.signature costs about 65 us, a tenth of a small model's step."""
    fn = getattr(step, "__func__", step)
    try:
        return _DRIVES_SCALER[fn]
    except (KeyError, TypeError):
        pass
    found = "grad_scaler" in inspect.signature(step).parameters
    try:
        _DRIVES_SCALER[fn] = found
    except TypeError:  # not weak-referenceable: ask every time
        pass
    return found


# Optimizer subclasses that wrap the optimizer whose gradients and per-step state count:
# Accelerate's AcceleratedOptimizer (only delegates) and Lightning Fabric's _FabricOptimizer (a
# class made at run time from the wrapper and the wrapped optimizer's class, so
# isinstance(Optimizer) holds; its step goes through Fabric's strategy and callbacks, so
# step() calls it rather than the inner one: fabric_stepper).
_FABRIC = ("_FabricOptimizer", ("lightning.fabric.", "lightning_fabric."))
_DELEGATING = (("AcceleratedOptimizer", ("accelerate.",)), _FABRIC)


def _has_class(opt, name, modules):
    """Whether a class named `name` from a module starting with one of `modules` is in opt's MRO."""
    return any(c.__name__ == name and c.__module__.startswith(modules) for c in type(opt).__mro__)


def _is_delegating_wrapper(opt):
    return any(_has_class(opt, *wrapper) for wrapper in _DELEGATING)


def is_fabric_wrapper(opt):
    return _has_class(opt, *_FABRIC)
