"""What ampx.GradScaler reports about itself: counts, scale history, overflow reports.

Owns ``OverflowReport`` and the bookkeeping mixin that ``GradScaler`` inherits. The scaler's
stage machine (ampx/scaler.py) calls ``_account`` once per update with that update's results;
with a device scale it hands them over as a ``_Pending`` copy instead, accounted for once the
copy has landed, so ``update()`` never waits for the device. Nothing here touches gradients.
"""
import logging
import math
from collections import deque

import torch

from . import _C, ops, settings

__all__ = ["OverflowReport"]

logger = logging.getLogger("ampx")


class OverflowReport:
    """Which parameters held inf or NaN gradients on a skipped step.

    Attributes:
        step: the scaler's step count (``stats()["steps"]``) of the skipped step.
        inf: names of parameters whose gradient held +-inf.
        nan: names of parameters whose gradient held NaN.
        note: why something is missing, when it is ("" otherwise): a scaler unpickled in
            another process has lost the names until ``watch`` is called again; an origin not
            yet known (``explain_overflows``).
        origin: with an ``ampx.PrecisionMonitor``, where the step's first non-finite value
            appeared: a dict with ``phase`` ("forward" or "backward"), ``module`` (qualified
            name), ``tensor`` ("output i" / "grad_output i", or "gradient of <param>"),
            ``kind`` ("inf" or "nan"), ``dtype``, ``amax_before`` (that tensor's largest
            magnitude at the last statistics step, or None), ``module_type`` and ``rank``
            (under torch.distributed, else None); None without a monitor.
        advice: one or two sentences to act on, or None.
    """

    def __init__(self, step, inf, nan, note="", origin=None, advice=None):
        self.step = step
        self.inf = inf
        self.nan = nan
        self.note = note
        self.origin = origin
        self.advice = advice

    def __repr__(self):
        note = f", note={self.note!r}" if self.note else ""
        extra = f", origin={self.origin!r}, advice={self.advice!r}" if self.origin or self.advice else ""
        return f"OverflowReport(step={self.step}, inf={self.inf}, nan={self.nan}{note}{extra})"


def _host_copy(t):
    """A copy of t in host memory, queued without blocking on t's device's current stream."""
    return t.to("cpu", non_blocking=True)


def _device_of(t):
    return t.device


def _stream_devices(scale, sources):
    """The devices whose streams carry a _Pending's copies: the scale's, then each flag tensor's."""
    devices = [_device_of(scale)]
    for _, fl in (pair for src in sources for pair in src):
        if _device_of(fl) not in devices:
            devices.append(_device_of(fl))
    return devices


def _record_event(device):
    """An event recorded on `device`'s current stream (None off CUDA: nothing to wait for)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class _Pending:
    """One update's telemetry on its way from the device: scale, found_inf, the update's events
    and the per-tensor flags, copied without blocking into host memory, with one event per
    device whose stream carries a copy: with gradients on several GPUs the flags travel on
    each gradient device's own stream, and nothing is read before every one has landed."""

    def __init__(self, step, scale, found, events, sources, trace=None):
        self.step = step
        self.trace = trace
        vals = torch.stack([scale.reshape(()).double(), found.reshape(()).double(),
                            (events.reshape(()).double() if isinstance(events, torch.Tensor)
                             else scale.new_full((), float(events), dtype=torch.float64))])
        self.vals = _host_copy(vals)
        self.sources = [[(ps, _host_copy(fl)) for ps, fl in src] for src in sources]
        devices = _stream_devices(scale, sources)
        if trace is not None:
            if trace.flags.device not in devices:
                devices.append(trace.flags.device)
            trace.flags = _host_copy(trace.flags)
        # Recorded after the copies were queued, on each stream that carries one.
        self.events = [e for e in map(_record_event, devices) if e is not None]

    def ready(self):
        return all(e.query() for e in self.events)

    def values(self):
        for e in self.events:
            if not e.query():
                e.synchronize()
        s, f, e = self.vals.tolist()
        return self.step, s, bool(f), int(e), self.sources, self.trace


class _LazySkip:
    """A bool that reads a device flag only when asked (no sync until then)."""

    def __init__(self, found_inf):
        self._found_inf = found_inf

    def __bool__(self):
        f = self._found_inf
        return bool(f.item()) if isinstance(f, torch.Tensor) else bool(f)

    def __repr__(self):
        return repr(bool(self))


class TelemetryMixin:
    """Counts, scale range and history, the last norm and overflow report, the overflow
    callback and the ``on_min_scale`` floor action. ``GradScaler`` inherits it; the attributes
    live on the scaler (``_init_telemetry`` sets them) so pickles keep their old shape."""

    def _init_telemetry(self, history, on_overflow):
        self._on_overflow = on_overflow
        self._history = deque(maxlen=int(history))
        self._history_len = max(1, int(history))  # the compiled steps' ring (ampx/graph_step.py)
        self._steps = 0
        self._skipped = 0
        self._scale_lo = math.inf
        self._scale_hi = 0.0
        self._last_norm = None
        self._last_report = None
        self._pending = deque()  # device-side updates whose telemetry has not been read yet

    def _record(self, skipped):
        """Telemetry of an update(new_scale) step (the scale was set by hand)."""
        self._drain(wait=True)  # first: compiled steps before this one take their numbers here
        self._steps += 1
        self._account(self._steps, float(self._scale.item()), skipped, 0, [])

    def _defer(self, scale, found, events, sources, trace=None):
        """Hands one device-side update's telemetry over without waiting for the device."""
        self._pending.append(_Pending(self._steps, scale, found, events, sources, trace))
        self._drain(wait=False)

    def _drain(self, wait):
        """Accounts for finished device-side updates, oldest first (all of them if wait), then
        for the updates compiled graphs ran since (which wait for the device)."""
        graph = self.__dict__.get("_graph_dirty", False)
        while self._pending and (wait or graph or self._pending[0].ready()):
            e = self._pending.popleft()
            self._account(*e.values())
        if graph:
            from .graph_step import drain

            drain(self)

    def _account(self, step, scale, skipped, events, sources, trace=None, note=""):
        """One update's telemetry: counts, report and callback, the floor, scale history."""
        if skipped:
            self._skipped += 1
            self._last_report = self._make_report(step, sources)
            if note:
                self._last_report.note = note
            self._explain_report(self._last_report, scale, events, trace)
            logger.debug("ampx.GradScaler: step %d skipped (inf/NaN gradients); scale -> %s", step, scale)
            if self._on_overflow is not None:
                self._on_overflow(self._last_report)
        # (on_min_scale="raise" never gets here at the floor: update() raised before changing anything)
        if events & _C.UPD_AT_MIN and self._on_min_scale == "warn":
            logger.warning(self._at_floor_message())
        self._scale_lo = min(self._scale_lo, scale)
        self._scale_hi = max(self._scale_hi, scale)
        self._history.append((step, scale))

    def _at_floor_message(self):
        floor = (f"min_scale={self._min_scale}" if self._min_scale >= settings.FLOAT32_MIN_NORMAL else
                 f"its floor, float32's smallest normal number {settings.FLOAT32_MIN_NORMAL:.4g} (min_scale "
                 f"{self._min_scale} is lower; a smaller scale would underflow to 0 and write NaN)")
        return (f"ampx.GradScaler: gradients overflowed with the loss scale already at {floor}; the step "
                "was skipped and the scale cannot fall further.")

    def _make_report(self, step, sources):
        inf, nan = flagged_names((pair for src in sources for pair in src), self._param_names)
        note = ""
        if (inf or nan) and self.__dict__.get("_names_dropped"):
            note = ("parameter names are not pickled with the scaler (they are keyed by object id): call "
                    "scaler.watch(model.named_parameters()) after unpickling to name them")
        return OverflowReport(step, inf, nan, note)

    def _explain_report(self, report, scale, events, trace):
        """Adds origin and advice to a skipped step's report (ampx/doctor_advice.py): from the
        monitor's trace of that step, or, without a monitor, arms one when explain_overflows."""
        monitor = self.__dict__.get("_monitor")
        if monitor is not None and trace is not None:
            from .doctor_advice import advise, param_origin

            report.origin = monitor._origin(trace) or param_origin(report, monitor)
            if report.origin is not None:
                monitor.last_origin = report.origin
            step_scale = float(trace.scale.item()) if trace.scale is not None else scale
            report.advice = advise(report, monitor, step_scale, bool(events & _C.UPD_AT_MIN), trace.step)
            return
        if self.__dict__.get("_explain") and monitor is None:
            model = self.__dict__.get("_explain_model")
            if model is None:
                report.note = (report.note + "; " if report.note else "") + (
                    "explain_overflows=True needs the model: call scaler.watch(model)")
                return
            from .doctor import PrecisionMonitor

            PrecisionMonitor(model, scaler=self, every=0)
            report.note = (report.note + "; " if report.note else "") + (
                "where this overflow began is not known: explain_overflows=True has now hooked the model, "
                "so the next overflow's report gives its origin")

    def overflow_report(self):
        """The ``OverflowReport`` of the most recent skipped step, or None (with a CUDA scale,
        this waits for the device to finish the steps not yet accounted for)."""
        self._drain(wait=True)
        return self._last_report

    def stats(self):
        """Telemetry: steps, skipped_steps, scale, min/max scale seen, last_norm, history.

        With a CUDA scale, the counts, history and overflow callbacks of a step are taken from
        the device without waiting, so they may arrive a few steps late; ``stats()`` itself
        waits for all of them."""
        self._drain(wait=True)
        return {
            "steps": self._steps,
            "skipped_steps": self._skipped,
            "scale": self.get_scale(),
            "min_scale_seen": None if self._steps == 0 else self._scale_lo,
            "max_scale_seen": None if self._steps == 0 else self._scale_hi,
            "last_norm": None if self._last_norm is None else float(self._last_norm),
            "history": list(self._history),
        }

    # -- checkpointing (ampx/checkpoint.py puts this under state_dict()["telemetry"]) --------

    def _telemetry_state(self):
        """The counters and history ``stats()`` reports, as plain numbers and lists (what
        ``torch.load(weights_only=True)`` accepts); pending device reads are drained first."""
        self._drain(wait=True)
        return {
            "steps": self._steps,
            "skipped_steps": self._skipped,
            "min_scale_seen": None if self._steps == 0 else self._scale_lo,
            "max_scale_seen": None if self._steps == 0 else self._scale_hi,
            "last_norm": None if self._last_norm is None else float(self._last_norm),
            "history": [[int(step), float(scale)] for step, scale in self._history],
        }

    def _checked_telemetry(self, op, tele):
        """``_telemetry_state``'s dict checked whole, as the attribute values it restores.

        Raises ValueError naming ``state_dict['telemetry'][key]`` and its rule; changes nothing."""
        def bad(key, rule):
            value = tele.get(key) if isinstance(tele, dict) else tele
            where = "state_dict['telemetry']" + (f"[{key!r}]" if key else "")
            raise ValueError(f"{op}: {where} must be {rule}, not {value!r} (save it with ampx's "
                             "state_dict(), or leave the key out to keep the counters)")

        keys = {"steps", "skipped_steps", "min_scale_seen", "max_scale_seen", "last_norm", "history"}
        if not (isinstance(tele, dict) and set(tele) == keys):
            bad("", f"a dict with the keys {sorted(keys)}")
        steps, skipped = tele["steps"], tele["skipped_steps"]
        if not (settings.is_count(steps) and steps >= 0):
            bad("steps", "an integer >= 0")
        if not (settings.is_count(skipped) and 0 <= skipped <= steps):
            bad("skipped_steps", f"an integer from 0 to steps ({steps})")
        lo, hi = (_checked_seen(tele, key, steps, bad) for key in ("min_scale_seen", "max_scale_seen"))
        if steps and lo > hi:
            bad("min_scale_seen", f"<= max_scale_seen ({hi})")
        norm = tele["last_norm"]
        if not (norm is None or _is_real(norm)):
            bad("last_norm", "None or a number")
        history = tele["history"]
        if not (isinstance(history, (list, tuple)) and all(_is_history_entry(e) for e in history)):
            bad("history", "a list of [step, scale] pairs (an integer >= 0 and a number > 0)")
        return {"_steps": int(steps), "_skipped": int(skipped), "_scale_lo": lo, "_scale_hi": hi,
                "_last_norm": None if norm is None else float(norm),
                "_history": [(int(s), float(v)) for s, v in history]}

    def _load_telemetry(self, new):
        """Sets what ``_checked_telemetry`` returned (nothing here can fail)."""
        from .graph_step import reset

        self._pending.clear()
        reset(self)
        new = dict(new)
        history = new.pop("_history")
        self.__dict__.update(new)
        self._history.clear()
        self._history.extend(history)  # the deque's own maxlen keeps the newest entries


def _is_real(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_history_entry(e):
    return (isinstance(e, (list, tuple)) and len(e) == 2 and settings.is_count(e[0]) and e[0] >= 0
            and _is_real(e[1]) and e[1] > 0 and math.isfinite(e[1]))


def _checked_seen(tele, key, steps, bad):
    """min/max_scale_seen as the attribute holds it: None with no steps, else a finite number > 0."""
    v = tele[key]
    if steps == 0:
        if v is not None:
            bad(key, "None while steps is 0")
        return math.inf if key == "min_scale_seen" else 0.0
    if not (_is_real(v) and v > 0 and math.isfinite(v)):
        bad(key, "a finite number > 0 once steps > 0")
    return float(v)


def flagged_names(pairs, names):
    """(inf, nan): the names of the parameters whose flag (ops.FLAG_INF / FLAG_NAN bits) is set.

    pairs: (params, flags) with one uint8 flag per parameter; names: id(param) -> name (a
    parameter without one is called by its index and shape)."""
    inf, nan = [], []
    for params, flags in pairs:
        flags = flags.cpu()
        for i in torch.nonzero(flags).flatten().tolist():
            p, f = params[i], int(flags[i])
            name = names.get(id(p)) or f"param[{i}] {tuple(p.shape)}"
            if f & ops.FLAG_INF:
                inf.append(name)
            if f & ops.FLAG_NAN:
                nan.append(name)
    return inf, nan
