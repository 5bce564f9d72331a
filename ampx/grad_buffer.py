"""GradBuffer: every parameter's gradient a view into one flat buffer per (dtype, device).

Without it each ``p.grad`` is its own allocation, scattered through the allocator's heap, so a
multi-tensor kernel over thousands of gradients pays per-tensor metadata reads and streams small
blocks from all over memory. ``GradBuffer`` allocates, once, one flat tensor per (dtype, device)
of the parameters and makes each gradient a view into it, laid back to back (no gaps) in the
order the optimizer lists its parameters: the order in which ``ampx.GradScaler`` collects them
(``_C.collect_grads`` over ``param_groups``; for ``ampx.MasterWeights`` its model parameters).
Kernels that recognise consecutive views of one storage can then stream a whole group as one span.

How the views survive what a training loop does to ``p.grad`` (docs/DESIGN.md, "GradBuffer"):

- a hook registered with ``Tensor.register_post_accumulate_grad_hook`` runs after autograd has
  accumulated each parameter's gradient. When ``p.grad`` is already the view (backward
  accumulated into it in place: gradient accumulation, ``zero_grad(set_to_none=False)``,
  ``GradBuffer.zero_grad()``) it returns at once. Otherwise (``zero_grad(set_to_none=True)``
  left None, so autograd stored a fresh tensor; or the user assigned ``p.grad = other``) it
  copies that gradient into the view and points ``p.grad`` back at the view, as DDP does for
  its bucket views;
- ``optimizer.load_state_dict`` and ``model.load_state_dict`` never touch ``p.grad``, so the
  views stay (``load_state_dict(..., assign=True)`` replaces the Parameters: build a new buffer).
"""
import weakref

import torch

__all__ = ["GradBuffer"]

# id(parameter) -> (weakref to it, weakref to the open GradBuffer covering it): one buffer per
# parameter at a time (two would move its gradient between them at every backward).
_OWNERS = {}


class GradBuffer:
    """Contiguous gradient storage for a model's parameters on one process (opt-in).

    ``buf = ampx.GradBuffer(optimizer)`` allocates one zeroed flat tensor per (dtype, device)
    of the optimizer's trainable parameters, makes every gradient a view into it, and keeps it
    so across ``zero_grad`` and ``load_state_dict``. Nothing else in the loop changes.

    Args:
        params: what to cover, in the order the buffer lays it out: a torch optimizer (its
            ``param_groups`` order; ``ampx.MasterWeights``: the model's parameters, in the order
            the scaler reads their gradients), a ``torch.nn.Module`` (``parameters()`` order,
            which is the optimizer's when it was built from ``model.parameters()``), or an
            iterable of parameters or of param-group dicts. Parameters with
            ``requires_grad=False`` are left out; a parameter listed twice is laid out once.
        named_parameters: optional iterable of (name, parameter), e.g.
            ``model.named_parameters()``, for error messages (a Module gives its own).
        replace: take over parameters that another open GradBuffer covers, closing that one
            once this one is built (nothing changes if building raises). Without it such a
            parameter is refused.

    What it changes:
        - Memory: the buffers are allocated (and zeroed) up front, as large as all trainable
          gradients together; a gradient is never freed, even after ``zero_grad()``.
        - ``p.grad`` is the view whenever it is set. ``optimizer.zero_grad()`` (set_to_none=True)
          still sets it to None, exactly as without the buffer, and the next backward copies
          autograd's fresh gradient into the view (one read and one write of each gradient;
          results bit-identical to a run without the buffer, and parameters without a gradient
          are still skipped by the optimizer). ``buf.zero_grad()`` instead zeroes each buffer
          with one memset and leaves every ``p.grad`` a zero view, never None; backward then adds
          into it in place. With it, parameters that got no gradient this step hold zeros and
          optimizers step them (weight decay, momentum), as with ``set_to_none=False``.
        - ``p.grad = other``: the next backward accumulates into ``other`` (autograd's rule),
          then the hook copies the result into the view and points ``p.grad`` back at it. A
          ``p.grad`` that is a view of some other buffer (DDP's ``gradient_as_bucket_view=True``)
          is refused with a RuntimeError, because the two would copy back and forth every step.
          ``p.grad.data = other`` (which ``model.to(...)`` does to existing gradients) is refused
          at the next backward; ``check()`` finds it at once.
        - ``backward(create_graph=True)`` builds gradients that carry a graph: they stay
          autograd's own tensors (not views) until the next ``zero_grad``.
        - Casting or moving the model (``model.to(...)``, ``.half()``) after building the buffer
          is refused at the next backward, whether or not gradients existed (build the buffer
          after the model is in its final dtype and device, and after ``ampx.MasterWeights``
          has cast it).

    Not for sharded training: FSDP, FSDP2 and DeepSpeed own their gradient storage (FSDP1's flat
    parameters already are one buffer). With DDP use either DDP's ``gradient_as_bucket_view=True``
    (its bucket views are contiguous already; no GradBuffer) or ``gradient_as_bucket_view=False``
    with a GradBuffer over the wrapped module's parameters (DDP then copies the averaged
    gradients into the views). Sparse gradients are refused.

    Raises:
        TypeError: an entry of ``params`` is not a tensor, or is a tensor subclass that owns its
            storage (DTensor, FSDP's FlatParameter).
        ValueError: no trainable parameter; a sparse or meta parameter; a DDP module with
            ``gradient_as_bucket_view=True``; a parameter another open GradBuffer covers
            (``close()`` it first, or ``ampx.grad_buffer.release(params)``).

    Lifetime: the parameters' hooks keep the buffer alive, and it holds only weak references
    to them, so a dropped model frees its parameters, gradients and buffer without ``close()``
    (a strong reference back would form a cycle through tensor hooks, which Python's garbage
    collector cannot free).
    """

    def __init__(self, params, *, named_parameters=None, replace=False):
        self._names = {}
        if isinstance(params, torch.nn.Module):
            _refuse_bucket_views(params)
            named_parameters = params.named_parameters() if named_parameters is None else named_parameters
            params = list(params.parameters())
        if named_parameters is not None:
            for name, p in named_parameters:
                self._names.setdefault(id(p), name)
        params = _trainable(_ordered_params(params), self._describe)
        if not params:
            raise ValueError("GradBuffer: no parameter with requires_grad=True to hold gradients for")
        others = []
        for p in params:
            other = _owner(p)
            if other is not None and not replace:
                raise ValueError(
                    f"GradBuffer: {self._describe(p)} is already covered by another open GradBuffer "
                    f"({other!r}); close() that one first, or pass replace=True (two buffers would move the "
                    "gradient between them at every backward)")
            if other is not None and other not in others:
                others.append(other)
        # Weak references only: the parameters' hooks hold this object, so a strong reference
        # back would make a cycle through tensor hooks, which the garbage collector never frees
        # (a dropped model, a finished hyperparameter trial, would stay in memory for good).
        self._refs = [weakref.ref(p) for p in params]
        self._index = {id(p): i for i, p in enumerate(params)}
        self._buffers = {}  # (dtype, device) -> flat tensor, in first-seen order
        self._views = []  # one per parameter, same order
        self._ptrs = []  # each view's data_ptr(), to see a swapped storage
        self._layout = []  # (key, offset) per parameter
        self._allocate(params)
        for other in others:  # built: only now is anything of theirs given up
            other.close()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(params)]
        me = weakref.ref(self, _forgetter([id(p) for p in params]))
        for p in params:
            _OWNERS[id(p)] = (weakref.ref(p), me)

    # ---- layout --------------------------------------------------------------------------

    @property
    def _params(self):
        """The covered parameters still alive, in layout order (with their indices: _live)."""
        return [p for _, p in self._live()]

    def _live(self):
        out = []
        for i, r in enumerate(self._refs):
            p = r()
            if p is not None:
                out.append((i, p))
        return out

    def _allocate(self, params):
        sizes = {}
        for p in params:
            key = (p.dtype, p.device)
            self._layout.append((key, sizes.get(key, 0)))
            sizes[key] = sizes.get(key, 0) + p.numel()
        for p in params:  # checked before any p.grad changes
            if p.grad is not None:
                _check_dense(p.grad, self._describe(p))
        for key, n in sizes.items():
            self._buffers[key] = torch.zeros(n, dtype=key[0], device=key[1])
        with torch.no_grad():
            for p, (key, offset) in zip(params, self._layout):
                view = _view_like(self._buffers[key], offset, p)
                self._views.append(view)
                self._ptrs.append(view.data_ptr())
                if p.grad is not None:  # keep what has accumulated so far
                    view.copy_(p.grad)
                    p.grad = view

    def _hook_for(self, i):
        # The closure holds the index, not the parameter: hooks live on the parameter itself.
        def reattach(p):
            g = p.grad
            if g is self._views[i]:
                if g.data_ptr() != self._ptrs[i]:  # the view's storage swapped (p.grad.data = ...)
                    self._moved(i, p)
                return
            # backward(create_graph=True) leaves a gradient with a graph (a gradient penalty
            # differentiates through it): that one stays autograd's
            if not g.requires_grad:
                self._adopt(i, p)
        return reattach

    def _moved(self, i, p):
        raise RuntimeError(
            f"GradBuffer: the gradient of {self._describe(p)} no longer lives in the buffer: its storage was "
            "replaced (p.grad.data = ..., or model.to(...) / .half() / .cuda() after the buffer was built, "
            "which moves gradients that way). Build the GradBuffer after the model is in its final dtype "
            "and device (and after ampx.MasterWeights has cast it).")

    def _adopt(self, i, p):
        """Copies p.grad (set, not the view) into the view and points p.grad at the view."""
        g, view = p.grad, self._views[i]
        where = self._describe(p)
        key = self._layout[i][0]
        if (p.dtype, p.device) != key or p.shape != view.shape:
            raise RuntimeError(
                f"GradBuffer: {where} is now {p.dtype} on {p.device} with shape {tuple(p.shape)}, but its "
                f"buffer holds {key[0]} on {key[1]} with shape {tuple(view.shape)}: the model was cast or "
                "moved after the buffer was built. Build the GradBuffer after model.to(...) / MasterWeights.")
        _check_dense(g, where)
        if g._base is not None and g.numel() < g._base.numel():
            raise RuntimeError(
                f"GradBuffer: the gradient of {where} is a view into another buffer (DDP with "
                "gradient_as_bucket_view=True makes its gradients views of its buckets). The two would copy "
                "every gradient back and forth each step: use DDP's bucket views without a GradBuffer, or "
                "gradient_as_bucket_view=False with one.")
        with torch.no_grad():
            view.copy_(g)
        p.grad = view

    def _describe(self, p):
        name = self._names.get(id(p))
        return f"parameter {name!r}" if name else f"the parameter of shape {tuple(p.shape)} ({p.dtype}, {p.device})"

    # ---- public ----------------------------------------------------------------------------

    @property
    def params(self):
        """The covered parameters still alive, in layout order."""
        return self._params

    @property
    def buffers(self):
        """{(dtype, device): flat tensor}, in the order first seen."""
        return dict(self._buffers)

    def view(self, param):
        """The view that holds ``param``'s gradient."""
        i = self._index.get(id(param))
        if i is not None:
            return self._views[i]
        raise KeyError(f"GradBuffer: {self._describe(param)} is not covered by this buffer")

    @property
    def nbytes(self):
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @torch.no_grad()
    def zero_grad(self):
        """Zeroes every buffer (one memset each) and points every ``p.grad`` at its view.

        Afterwards no covered ``p.grad`` is None: backward adds into the views in place.
        """
        for b in self._buffers.values():
            b.zero_()
        for i, p in self._live():
            if p.grad is not self._views[i]:
                p.grad = self._views[i]

    def reattach(self):
        """Puts every set gradient back in its view (copying it there if it lives elsewhere);
        gradients that are None stay None. What the backward hook does, for code that assigned
        ``p.grad`` after the last backward."""
        for i, p in self._live():
            if p.grad is not None and p.grad is not self._views[i]:
                self._adopt(i, p)

    def check(self):
        """Raises RuntimeError naming every parameter whose gradient is set but does not live at
        its place in the buffer (assigned after the last backward, or ``p.grad.data`` swapped)."""
        bad = []
        for i, p in self._live():
            v, (key, offset) = self._views[i], self._layout[i]
            g = p.grad
            if g is None:
                continue
            flat = self._buffers[key]
            at = flat.data_ptr() + offset * flat.element_size()
            same_storage = g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            if g is not v or g.data_ptr() != at or not same_storage:
                bad.append(self._describe(p))
        if bad:
            raise RuntimeError(f"GradBuffer: {len(bad)} gradient(s) are not views of the buffer: "
                               + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
                               + ". Call reattach() to copy them back in.")

    def close(self):
        """Removes the backward hooks, so another GradBuffer may cover these parameters. Gradients
        stay where they are (views keep the buffer alive until they are replaced)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for i, p in self._live():
            if _owner(p) is self:
                del _OWNERS[id(p)]

    @property
    def closed(self):
        """Whether close() was called (the gradients are no longer kept in the buffer)."""
        return not self._hooks

    def __repr__(self):
        parts = ", ".join(f"{str(k[0]).replace('torch.', '')} on {k[1]}: {b.numel():,}"
                          for k, b in self._buffers.items())
        return f"GradBuffer({len(self._refs)} parameters; {parts}{'; closed' if self.closed else ''})"


# ---- helpers ----------------------------------------------------------------------------------

def _forgetter(ids):
    """A callback for the weak reference to a buffer: drops its _OWNERS entries when it dies."""
    def forget(ref):
        for k in ids:
            entry = _OWNERS.get(k)
            if entry is not None and entry[1] is ref:
                del _OWNERS[k]
    return forget


def _owner(p):
    """The open GradBuffer covering parameter p, or None."""
    entry = _OWNERS.get(id(p))
    if entry is None:
        return None
    param, buf = entry[0](), entry[1]()
    if param is not p or buf is None or buf.closed:  # a stale entry (an id reused, a buffer gone)
        return None
    return buf


def release(params):
    """Closes the open GradBuffers that cover any of ``params`` (an optimizer, a module or
    parameters, as GradBuffer takes them). To hand the parameters to a new buffer, prefer
    ``GradBuffer(params, replace=True)``, which closes them only once the new one is built."""
    if isinstance(params, torch.nn.Module):
        params = list(params.parameters())
    for p in _ordered_params(params):
        buf = _owner(p) if isinstance(p, torch.Tensor) else None
        if buf is not None:
            buf.close()

def _ordered_params(params):
    """The parameters of an optimizer, module-free iterable or param groups, in order."""
    from .master import MasterWeights

    if isinstance(params, MasterWeights):
        # The scaler reads the model's gradients, low-precision parameters first (master.py).
        return list(params._model_params) + list(params._others)
    if isinstance(params, torch.optim.Optimizer):
        return [p for g in params.param_groups for p in g["params"]]
    if isinstance(params, torch.Tensor):
        return [params]
    out = []
    for item in params:
        if isinstance(item, dict):
            group = item["params"]
            out.extend([group] if isinstance(group, torch.Tensor) else list(group))
        else:
            out.append(item)
    return out


def _trainable(params, describe):
    seen, out = set(), []
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"GradBuffer: params[{i}] is a {type(p).__name__}, not a tensor")
        if type(p) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"GradBuffer: params[{i}] is a {type(p).__name__}: tensor subclasses (DTensor, "
                            "FSDP's FlatParameter) keep gradients of their own; GradBuffer is for plain "
                            "parameters on one process")
        if p.layout is not torch.strided or p.is_meta:
            raise ValueError(f"GradBuffer: params[{i}] ({describe(p)}) is {'meta' if p.is_meta else p.layout}: "
                             "only strided tensors with storage can have their gradients in a buffer")
        if p.requires_grad and not p.is_leaf:
            raise ValueError(f"GradBuffer: params[{i}] ({describe(p)}) is not a leaf tensor: autograd "
                             "stores gradients only on leaves")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _view_like(flat, offset, p):
    """A view of flat at offset with p's shape, and p's strides when p is dense (so a
    channels-last parameter gets a channels-last gradient, as autograd would give it)."""
    return flat.as_strided(p.shape, _dense_strides(p), offset)


def _dense_strides(p):
    """p.stride() when p covers exactly numel() elements without overlap, else contiguous strides."""
    dims = sorted((st, sz) for st, sz in zip(p.stride(), p.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return torch.empty(p.shape, device="meta").stride()
        expected *= sz
    return p.stride()


def _check_dense(g, where):
    if g.layout is not torch.strided:
        raise RuntimeError(f"GradBuffer: {where} received a {g.layout} gradient; GradBuffer holds dense "
                           "gradients only: leave that parameter out (or use a dense embedding)")


def _refuse_bucket_views(module):
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel) and getattr(module, "gradient_as_bucket_view", False):
        raise ValueError(
            "GradBuffer: this DistributedDataParallel model has gradient_as_bucket_view=True, so its "
            "gradients are already views of DDP's contiguous buckets. Use those without a GradBuffer, or "
            "wrap with gradient_as_bucket_view=False and build the GradBuffer over the model: DDP then "
            "copies the averaged gradients into the buffer's views.")
