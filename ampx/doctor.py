"""``ampx.PrecisionMonitor``: where the first non-finite value of a step appeared, and how much
range each layer has left.

The monitor hooks a model's modules (leaf modules by default, or those whose qualified name
matches a pattern): a forward hook on each, which also registers a tensor hook on each output
that requires grad, so the gradient arriving at that output (the module's ``grad_output``) is
seen in the backward pass. Two levels of work:

* every step, each hooked call writes one byte per tensor (``ampx.ops.check_finite``'s flags:
  bit 0 inf, bit 1 NaN) into the next slots of one buffer on the model's device, and appends
  what the slots are to a host list. Nothing is read back: the buffer is handed to the scaler
  at ``update()`` and read only when that step overflowed (``_Trace``), so the first flagged
  slot, in call order, is where the first non-finite value appeared;
* every ``every`` steps, the same tensors also get ``ampx.ops.tensor_stats`` rows, kept per
  (module, phase, tensor) as the latest statistics, which ``report()``, ``plot()`` and the
  advice read (amax before an overflow, headroom, underflow at the current scale).

Forward passes without grad (evaluation, ``torch.no_grad()``) are not watched. Without a scaler
the user ends each step with ``monitor.step()`` (e.g. bf16 training); with
an ``ampx.GradScaler`` (``scaler=`` or ``scaler.monitor(...)``), its ``update()`` does.
"""
import fnmatch
import math

import torch

from . import ops
from . import stats as S

__all__ = ["PrecisionMonitor"]

FORWARD, BACKWARD = "forward", "backward"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _tensors_of(out):
    """The floating tensors of a module's output, in a fixed order: a tensor, the items of a
    tuple or list, the values of a dict (Transformers' ModelOutput too), recursively."""
    if isinstance(out, torch.Tensor):
        return [out] if out.dtype in _FLOATS and out.layout is torch.strided else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors_of(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors_of(o)]
    return []


def _select(model, modules, leaf_only):
    """(name, module) pairs to hook: those matching a pattern of ``modules`` (fnmatch on the
    qualified name), else the leaf modules (or every module with leaf_only=False)."""
    named = [(n, m) for n, m in model.named_modules()]
    if modules is not None:
        patterns = [modules] if isinstance(modules, str) else list(modules) if isinstance(modules, (list, tuple)) else None
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise TypeError("ampx.PrecisionMonitor: modules must be a name pattern or a list of them "
                            f"(fnmatch, e.g. 'h.*.mlp.*'), not {modules!r}")
        picked = []
        for p in patterns:
            hits = [(n, m) for n, m in named if n and fnmatch.fnmatchcase(n, p)]
            if not hits:
                some = ", ".join(n for n, _ in named[1:6]) or "none"
                raise ValueError(f"ampx.PrecisionMonitor: the pattern {p!r} matches no module of the model "
                                 f"(its modules are named like: {some}); nothing was hooked")
            picked += [h for h in hits if all(h[1] is not q for _, q in picked)]
        return picked
    picked = [(n or "<model>", m) for n, m in named if not leaf_only or not any(True for _ in m.children())]
    if picked == [("<model>", model)] and not any(True for _ in model.parameters()):
        picked = []  # a bare module with no parameters and no submodules: nothing to learn from it
    if not picked:
        raise ValueError(f"ampx.PrecisionMonitor: {type(model).__name__} has no submodule and no parameter to "
                         "hook; pass the model that computes the loss")
    return picked


def _device_probe(model):
    """(dict, key) where the model's first parameter (else buffer) lives: the owning module's
    ``_parameters`` / ``_buffers`` dict, so that a tensor replaced by ``model.to(...)`` is read
    as it is now; None for a model with neither."""
    for kind in ("_parameters", "_buffers"):
        for mod in model.modules():
            for key, t in getattr(mod, kind).items():
                if t is not None:
                    return getattr(mod, kind), key
    return None


def _device_of(model):
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


class _Trace:
    """One step's flags: a copy of the buffer's used slots (on the device until read) and, per
    hooked call in call order, (phase, module name, first slot, number of tensors, index of
    the first tensor among the module's outputs)."""

    def __init__(self, flags, calls, step, scale=None):
        self.flags = flags
        self.calls = calls
        self.step = step
        self.scale = scale

    def first_nonfinite(self):
        """(phase, module, tensor index, flag bits) of the first flagged slot in call order, or None."""
        flags = self.flags.cpu()
        hit = torch.nonzero(flags).flatten()
        if hit.numel() == 0:
            return None
        first = int(hit[0])
        for phase, name, start, k, base in self.calls:
            if start <= first < start + k:
                return phase, name, base + first - start, int(flags[first])
        return None


class PrecisionMonitor:
    """Finds where a step's first inf or NaN appeared, and keeps per-layer range statistics.

    Args:
        model: the ``torch.nn.Module`` to watch (build the monitor after moving it to its device).
        scaler: an ``ampx.GradScaler`` whose ``update()`` ends each step and whose overflow
            reports then carry ``origin`` and ``advice``; None to call ``step()`` yourself.
        every: full statistics (``ampx.ops.tensor_stats``) every this many steps (0: never; the
            per-step flags stay on).
        modules: a qualified-name pattern (fnmatch) or a list of them selecting the modules to
            hook; by default the leaf modules.
        leaf_only: with ``modules=None``, False hooks every module, containers too.

    Raises:
        TypeError: model is not a Module, a pattern is not a string, every is not an int >= 0.
        ValueError: no module to hook, a pattern that matches nothing (nothing is hooked then).
    """

    def __init__(self, model, scaler=None, every=100, modules=None, *, leaf_only=True):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ampx.PrecisionMonitor: model must be a torch.nn.Module, not {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise TypeError(f"ampx.PrecisionMonitor: every must be an int >= 0 (0: flags only), not {every!r}")
        self._targets = _select(model, modules, leaf_only)
        self._model = model
        self._device = _device_of(model)
        self._probe = _device_probe(model)
        self.every = every
        self.steps = 0
        self._order = {name: i for i, (name, _) in enumerate(self._targets)}
        self._buf = None
        self._views = {}
        self._calls = []
        self._producers = {}   # id(output tensor) -> (module, index), this step's forward
        self._consumer = {}    # (module, output index) -> (module taking it, argument index)
        self._used = 0
        self._rows = {}        # (phase, module, tensor index) -> latest stats row (device)
        self._rows_step = None
        self._rows_before = (None, {})  # the statistics before the latest step's
        self._pending_rows = {}
        self._seen = {}        # (phase, module, tensor index) -> dtype of the tensor
        self.last_origin = None
        self._handles = []
        self._scaler = None
        self._flagged_ranks = None  # this step's sharding.FlaggedRanks, set by a sharded scaler
        self._hook_all()
        if scaler is not None:
            scaler._attach_monitor(self)

    # ---- hooks ------------------------------------------------------------------------

    def _hook_all(self):
        self._handles.append(self._model.register_forward_pre_hook(self._check_device))
        hooked = {id(m) for _, m in self._targets}
        for name, mod in self._targets:
            self._handles.append(mod.register_forward_hook(self._forward_hook(name)))
        for name, mod in self._model.named_modules():  # the others only note what they consume
            if id(mod) not in hooked:
                self._handles.append(mod.register_forward_hook(self._link_hook(name or "<model>")))

    def remove(self):
        """Removes every hook (the monitor then sees nothing; reports keep what it saw)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._scaler is not None:
            self._scaler._detach_monitor(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def _check_device(self, module, args):
        # The probed tensor's own dict first (a read per forward; walking the model took 15 us on
        # the demo's): the model's first tensor is then found again only when that one moved.
        probe = self._probe
        if probe is not None:
            t = probe[0].get(probe[1])
            if t is not None and t.device == self._device:
                return
        now = _device_of(self._model)
        if now != self._device:
            self.remove()
            raise RuntimeError(f"ampx.PrecisionMonitor: the model is on {now} but the monitor was built for "
                               f"{self._device} (it was moved after the monitor was built); its hooks are "
                               "removed: build the monitor after model.to(...)")

    def _stats_step(self):
        return self.every > 0 and self.steps % self.every == 0

    def _link(self, name, args):
        """Notes which hooked outputs module `name` took as arguments: the backward of the first
        module (innermost) to take one produces the gradient that output receives."""
        for j, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                src = self._producers.get(id(a))
                if src is not None and src not in self._consumer:
                    self._consumer[src] = (name, j)

    def _link_hook(self, name):
        def hook(module, args, out):
            if self._producers:
                self._link(name, args)
        return hook

    def _forward_hook(self, name):
        def hook(module, args, out):
            if not torch.is_grad_enabled():
                return  # evaluation: no step of the scaler's to explain
            if self._producers:
                self._link(name, args)
            ts = _tensors_of(out)
            if not ts:
                return
            self._flag(FORWARD, name, ts)
            for i, t in enumerate(ts):
                self._producers[id(t)] = (name, i)
                if t.requires_grad:
                    self._hook_grad(t, name, i)
        return hook

    def _hook_grad(self, t, name, i):
        """Flags the gradient arriving at output i of module `name` (tensor t) in the backward
        pass: a pre-hook on the autograd node that made t (torch's Node.register_prehook, which
        costs less than Tensor.register_hook: no Python handle bookkeeping), reading t's slot of
        the node's grad_outputs; a tensor hook for a leaf output (no node)."""
        node = t.grad_fn
        if node is None:
            def on_grad(g):
                if g is not None and g.dtype in _FLOATS:
                    self._flag(BACKWARD, name, [g], base=i)
            t.register_hook(on_grad)
            return
        k = t.output_nr

        def on_grads(grad_outputs):
            g = grad_outputs[k] if k < len(grad_outputs) else None
            if g is not None and g.dtype in _FLOATS:
                self._flag(BACKWARD, name, [g], base=i)
        node.register_prehook(on_grads)

    def _slots(self, k, first):
        """k consecutive one-byte slots of the step's buffer (grown, on the device of tensor
        ``first``)."""
        need = self._used + k
        if self._buf is None or need > self._buf.numel():
            device = first.device
            size = max(64, 2 * need, 2 * (self._buf.numel() if self._buf is not None else 0))
            buf = torch.zeros(size, dtype=torch.uint8, device=device)
            if self._buf is not None and self._used:
                buf[:self._used].copy_(self._buf[:self._used])
            self._buf = buf
            self._views = {}
        start = self._used
        self._used = need
        view = self._views.get((start, k))
        if view is None:
            view = self._views[(start, k)] = self._buf[start:start + k]
        return start, view

    def _flag(self, phase, name, ts, base=0):
        if len(ts) > 1:
            device = ts[0].device
            if any(t.device != device for t in ts):
                ts = [t for t in ts if t.device == device]
        start, view = self._slots(len(ts), ts[0])
        ops._check_flags(ts, view)
        self._calls.append((phase, name, start, len(ts), base))
        for j, t in enumerate(ts):
            self._seen.setdefault((phase, name, base + j), t.dtype)
        if self._stats_step():
            rows = ops.tensor_stats([t.detach() for t in ts])
            for j in range(len(ts)):
                key = (phase, name, base + j)
                old = self._pending_rows.get(key)
                self._pending_rows[key] = rows[j] if old is None else S.combine([old, rows[j]])

    # ---- steps ------------------------------------------------------------------------

    def _flagged_now(self):
        """Whether a hooked tensor of the step so far was non-finite: a 0/1 device tensor (no
        host read), for the sharded scaler's one collective; None before any hooked call."""
        if not self._used:
            return None
        return (self._buf[:self._used] != 0).any()

    def _end_step(self, scale=None):
        """Closes the step: returns its _Trace and starts the next.
        ``scale``: the scaler's scale tensor before its update (copied: the step's scale, read
        on an overflow only)."""
        step_scale = scale.detach().clone() if scale is not None else None
        if self._used:
            trace = _Trace(self._buf[:self._used].clone(), self._calls, self.steps, step_scale)
            self._buf[:self._used].zero_()
        else:
            trace = _Trace(torch.zeros(0, dtype=torch.uint8), [], self.steps, step_scale)
        if self._pending_rows:
            self._rows_before = (self._rows_step, self._rows)
            self._rows = {**self._rows, **self._pending_rows}
            self._rows_step = self.steps
            self._pending_rows = {}
        trace.consumer = self._consumer
        trace.flagged_ranks, self._flagged_ranks = self._flagged_ranks, None
        self._calls = []
        self._producers = {}
        self._consumer = {}
        self._used = 0
        self.steps += 1
        return trace

    def step(self):
        """Ends a step when no scaler does: returns where its first non-finite value appeared
        (the ``origin`` dict a report would carry) or None, and remembers it as ``last_origin``.
        Reads the step's flags (a device sync on CUDA)."""
        trace = self._end_step()
        origin = self._origin(trace) if trace is not None else None
        if origin is not None:
            self.last_origin = origin
        return origin

    def _origin(self, trace, scale=None):
        """The origin dict of a trace, or None when no hooked tensor was non-finite."""
        found = trace.first_nonfinite()
        if found is None:
            return _remote_origin(trace)
        phase, name, index, bits = found
        key = (phase, name, index)
        row = self._rows_for(trace.step)[1].get(key)
        if row is not None and float(row[S.POSINF] + row[S.NEGINF] + row[S.NAN]) > 0:
            row = None  # those statistics saw an overflow already
        kind = "nan" if bits & ops.FLAG_NAN and not bits & ops.FLAG_INF else "inf"
        what = f"output {index}" if phase == FORWARD else f"grad_output {index}"
        if phase == BACKWARD and (name, index) in getattr(trace, "consumer", {}):
            # the gradient at name's output came out of the backward of the module that took it
            name, j = trace.consumer[(name, index)]
            what = f"grad_input {j} (the gradient of {found[1]}'s output {index})"
        module = dict(self._targets).get(name)
        origin = {"phase": phase, "module": name, "tensor": what, "kind": kind,
                  "dtype": str(self._seen.get(key, "")).replace("torch.", ""),
                  "amax_before": float(row[S.AMAX]) if row is not None else None,
                  "module_type": type(module).__name__ if module is not None else None,
                  "param_amax": _param_amax(module), "rank": _rank()}
        return origin

    def _rows_for(self, step):
        """(statistics step, rows) of the latest statistics taken before `step` (those of the
        step itself may have seen its overflow), or (None, {})."""
        if self._rows_step is not None and self._rows_step < step:
            return self._rows_step, self._rows
        return self._rows_before

    def _lost_gradients(self, step):
        """(statistics step, fraction) of the 16-bit gradient values reaching the hooked modules
        that were zero or subnormal at the latest clean statistics step before `step`, or
        (None, None) when there is none."""
        k, rows = self._rows_for(step)
        picked = [r for (phase, name, i), r in rows.items() if phase == BACKWARD
                  and self._seen.get((phase, name, i)) in (torch.float16, torch.bfloat16)]
        if not picked:
            return None, None
        row = S.combine([r.detach().cpu() for r in picked])
        if float(row[S.POSINF] + row[S.NEGINF] + row[S.NAN]) > 0 or row[S.NUMEL] == 0:
            return None, None
        sub = S.fractions(row, "float16", 1.0)["subnormal"]
        return k, float(row[S.ZERO] / row[S.NUMEL]) + sub

    # ---- reading the statistics ---------------------------------------------------------

    def rows(self):
        """One dict per hooked tensor seen at the latest statistics step, activations in forward
        order, then gradients in backward order: module, phase, tensor, dtype, amax (of the
        values as they were: gradients carry the loss scale), fp16 headroom (whole powers of two
        between amax and 65504; negative: beyond), the fractions float16 would flush to zero
        (``fp16_underflow``) and that are subnormal in it, the fraction already non-finite, and
        whether bfloat16 and float8 e4m3 would hold amax."""
        out = []
        for (phase, name, i), row in sorted(self._rows.items(), key=lambda kv: (
                kv[0][0] != FORWARD, self._order.get(kv[0][1], 0) * (1 if kv[0][0] == FORWARD else -1), kv[0][2])):
            row = row.detach().cpu()
            amax = float(row[S.AMAX])
            f16 = S.fractions(row, "float16", 1.0)
            bad = (row[S.POSINF] + row[S.NEGINF] + row[S.NAN]).item() / max(1.0, row[S.NUMEL].item())
            out.append({
                "module": name, "phase": phase, "tensor": i,
                "dtype": str(self._seen.get((phase, name, i), "")).replace("torch.", ""),
                "amax": amax, "fp16_headroom": _headroom(amax, 65504.0), "fp16_underflow": f16["underflow"],
                "fp16_subnormal": f16["subnormal"], "nonfinite": bad,
                "bf16_holds": amax <= torch.finfo(torch.bfloat16).max and bad == 0,
                "e4m3_holds": amax <= 448.0 and bad == 0,
            })
        return out

    def report(self):
        """The headroom table of the latest statistics step, as text (``print(monitor.report())``)."""
        rows = self.rows()
        if not rows:
            return ("ampx.PrecisionMonitor: no statistics yet (they are taken every "
                    f"{self.every} steps, from step 0; every=0 takes none)")
        head = (f"{'module':<32} {'phase':<8} {'t':>2} {'dtype':<9} {'amax':>10} {'fp16 headroom':>13} "
                f"{'fp16 underflow':>14} {'bf16':>4} {'e4m3':>4}")
        lines = [f"ampx.PrecisionMonitor: statistics of step {self._rows_step}", head, "-" * len(head)]
        for r in rows:
            hr = r["fp16_headroom"]
            lines.append(f"{r['module'][-32:]:<32} {r['phase']:<8} {r['tensor']:>2} "
                         f"{r['dtype']:<9} {r['amax']:>10.3g} "
                         f"{('2^%d' % hr) if hr is not None else '-':>13} {r['fp16_underflow']:>14.2%} "
                         f"{'yes' if r['bf16_holds'] else 'NO':>4} {'yes' if r['e4m3_holds'] else 'NO':>4}")
        return "\n".join(lines)

    def plot(self, path):
        """Writes a heatmap of the exponent histograms per hooked tensor (forward order;
        activations left, gradients right) with the float16, bfloat16 and float8 e4m3 ranges
        as bands, to ``path`` (needs matplotlib). Returns path."""
        from .doctor_plot import plot_rows

        return plot_rows(self, path)


def _headroom(amax, limit):
    """Whole powers of two between amax and a format's largest value (None for amax 0 or inf)."""
    if not (amax > 0 and math.isfinite(amax)):
        return None
    return int(math.floor(math.log2(limit / amax)))


def _param_amax(module):
    """The largest finite magnitude among a module's own parameters (None without any): read
    on an overflow only, to tell a weight that autocast's cast made inf from an activation."""
    if module is None:
        return None
    # A sharded parameter (an FSDP2 DTensor) is read through its local shard: a DTensor's own
    # reduction would be a collective that only this rank, the one that overflowed, enters.
    ps = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters(recurse=False)]
    ps = [p.detach() for p in ps if p.is_floating_point() and p.numel()]
    if not ps:
        return None
    return max(float(torch.nan_to_num(p.abs().float(), nan=0.0, posinf=0.0).max()) for p in ps)


def _remote_origin(trace):
    """The origin of a step whose first non-finite value another rank's monitor saw (the
    sharded scaler's collective says which rank), or None."""
    ranks = getattr(trace, "flagged_ranks", None)
    first = ranks.first() if ranks is not None else None
    if first is None or first == _rank():
        return None
    return {"phase": None, "module": None, "tensor": None, "kind": None, "dtype": None, "amax_before": None,
            "module_type": None, "param_amax": None, "rank": first, "seen_on": _rank()}


def _rank():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None
