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

Deferred until dynamo is imported. ``torch.compiler.disable`` imports ``torch._dynamo`` (1.8 s
on 2 cores, about 40% of ``import ampx``), and a process that never compiles does not need it:
dynamo cannot trace what it has not been imported for. So ``import ampx`` only marks what is to
be disabled (``eager_method``, ``eager_function``, ``when_dynamo_loads``), and the disabled
versions are made the moment ``torch._dynamo`` finishes importing (now, if it already has), by
a ``sys.meta_path`` entry that watches for that one import and lets the usual finders load it.
Until then the marked calls run plainly, as they would under a disabled wrapper with no dynamo.
(torch's own Optimizer imports dynamo at its first ``add_param_group``, so a training process
still pays the import there; one that makes no torch optimizer, such as the ops, the doctor,
tools and test children, does not.)

A dynamo the watch did not see (a finder ahead of it loaded torch._dynamo, or sys.meta_path was
reset) is caught up with by the first marked call to notice it. A compiled step that meets a
marked call before that runs it as dynamo runs any frame it cannot trace whole: eagerly, with
the frames inside offered to dynamo one by one, as torch's own scaler's are (correct; a traced
foreach optimizer rounds its own way); from the next call on it is the one clean break.
"""
import functools
import inspect
import sys

import torch

__all__ = ["host_driven", "REASON", "eager_under_compile", "eager_method", "eager_function", "install",
           "when_dynamo_loads"]

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
    torch._dynamo is imported (make_runners): the scaler asks for one while dynamo traces, where
    making it would be traced too (one dynamo did not come in through the watch: _catch_up)."""
    if _RUNNERS is None:
        _dynamo_loaded()  # dynamo came in unseen (see _catch_up)
    return _RUNNERS[name, key]


def make_runners():
    """Makes eager_under_compile's runners once dynamo is imported."""
    when_dynamo_loads(_make_runners_now)


def _make_runners_now():
    global _RUNNERS
    if _RUNNERS is None:
        _RUNNERS = _runners(_TAKES_REASON)


# ---- deferred until torch._dynamo is imported ---------------------------------------------------

_PENDING = []  # what to run once torch._dynamo is imported, in order
_LOADED = False  # whether that has happened (and _PENDING ran)


def when_dynamo_loads(make):
    """Runs make() once torch._dynamo is imported: now if it is, else right after its import."""
    if _LOADED:
        make()
    else:
        _PENDING.append(make)


def _dynamo_loaded():
    """Runs what waited for dynamo (once; idempotent). Called by the import watch, at ampx's import
    when dynamo came first, and by _catch_up."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    while _PENDING:
        _PENDING.pop(0)()


_MARK = "_ampx_eager"  # on the plain version eager_method makes: (the method, its fullgraph name)


def _catch_up():
    """Where dynamo came in unseen by the watch (a finder ahead of it loaded torch._dynamo, or
    sys.meta_path was reset): makes what waited, at the first marked call to notice."""
    if not _LOADED and "torch._dynamo" in sys.modules:
        _dynamo_loaded()


def eager_method(name=None):
    """Marks a method to run eagerly under torch.compile (as host_driven, with REASON for
    ``name`` or its own name); ``install(cls)`` puts the disabled version on the class once
    dynamo is imported. The class attribute is what dynamo looks up when it meets the call, so
    from then on it sees the disabled function itself: one clean graph break. Until then the
    method runs plainly (after _catch_up)."""
    def mark(fn):
        @functools.wraps(fn)
        def plain(*args, **kwargs):
            _catch_up()
            return fn(*args, **kwargs)
        setattr(plain, _MARK, (fn, name or fn.__name__))
        return plain
    return mark


def install(cls):
    """Arranges for every method of cls marked by eager_method to be replaced on the class by its
    host_driven version once dynamo is imported; returns cls."""
    marked = [(attr, plain) for attr, plain in vars(cls).items() if hasattr(plain, _MARK)]

    def replace():
        for attr, plain in marked:
            if vars(cls).get(attr) is plain:  # (not replaced since)
                fn, name = getattr(plain, _MARK)
                setattr(cls, attr, host_driven(fn, name=name))
    when_dynamo_loads(replace)
    return cls


def eager_function(fn):
    """fn, run eagerly under torch.compile (torch.compiler.disable, no reason), for a module-level
    function that callers import by name: the returned function calls the disabled fn once dynamo
    is imported, fn itself before."""
    disabled = []

    def make():
        disabled.append(torch.compiler.disable(fn))
    when_dynamo_loads(make)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not disabled:
            _catch_up()
            if not disabled:
                return fn(*args, **kwargs)
        return disabled[0](*args, **kwargs)
    return call


class _DynamoWatch:
    """A sys.meta_path entry that sees the first import of torch._dynamo. It finds the module with
    the finders after it, as the import would have, and has that module's loader run
    _dynamo_loaded right after the module's body ran (an attribute on that one loader, removed
    again then); every other import, and every later one, it leaves to the others."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch._dynamo" or _LOADED:
            return None
        try:
            after = sys.meta_path[sys.meta_path.index(self) + 1:]
        except ValueError:
            return None
        for finder in after:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec  # an old-style loader: _catch_up covers it

        def exec_then_set_up(module):
            try:
                exec_module(module)
            finally:
                try:
                    del loader.exec_module
                except AttributeError:
                    pass
            # importlib binds torch._dynamo on torch only after this returns; torch.compiler.disable
            # reads it from there
            setattr(sys.modules["torch"], "_dynamo", module)
            _dynamo_loaded()
        try:
            loader.exec_module = exec_then_set_up
        except (AttributeError, TypeError):
            pass  # a loader that takes no attributes: _catch_up covers it
        return spec


def _watch():
    if "torch._dynamo" in sys.modules:
        _dynamo_loaded()  # (each when_dynamo_loads then runs at once)
    elif not any(isinstance(f, _DynamoWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoWatch())


_watch()
