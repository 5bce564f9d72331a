"""Holding a framework object's per-step method (an LR scheduler's step, an EMA's update) on the
steps a scaler skipped, without touching the object's own state.

The object's class is swapped for a subclass whose method asks a per-object rule first, and the
rule lives here in a weak table, not on the object: LR schedulers save their whole ``__dict__``
as their state_dict (torch's and timm's do), so a rule stored on the instance would travel into
checkpoints (where a closure cannot be pickled) and a loaded state_dict would bring back an
earlier run's rule.
"""
import weakref

__all__ = ["hold_method"]

_RULES = weakref.WeakKeyDictionary()  # object -> {method name: rule}
_CLASSES = {}  # (class, method name) -> its held subclass


def hold_method(obj, method, rule):
    """From now on ``obj.<method>(*args, **kwargs)`` returns ``rule(original, *args, **kwargs)``,
    ``original`` being the method as the object's class defines it. Holding the same method
    again replaces the rule. Raises TypeError when ``obj`` has no such method."""
    if not callable(getattr(obj, method, None)):
        raise TypeError(f"{type(obj).__name__} has no {method}() to hold")
    _RULES.setdefault(obj, {})[method] = rule
    cls = type(obj)
    if getattr(cls, "_ampx_held_method", None) != method:
        obj.__class__ = _held_class(cls, method)
    return obj


def _held_class(cls, method):
    key = (cls, method)
    if key not in _CLASSES:
        def held(self, *args, **kwargs):
            original = getattr(super(sub, self), method)
            rule = _RULES.get(self, {}).get(method)
            return original(*args, **kwargs) if rule is None else rule(original, *args, **kwargs)

        held.__name__ = method
        sub = type(cls.__name__, (cls,), {method: held, "_ampx_held_method": method,
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _CLASSES[key] = sub
    return _CLASSES[key]
