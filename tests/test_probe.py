"""An adversarial probe of every public entry point: one malformed argument at a time.

Each entry point has a well-formed call, built afresh for every case. The probe replaces one
argument at a time with each value of a catalogue of bad ones (wrong types, wrong dtypes and
devices, wrong shapes, non-finite and out-of-range numbers, views with internal overlap or the
negative bit, storages shrunk under their tensor, empty and nested lists), snapshots every tensor
and every bit of state the call can reach, and checks:
- the call never crashes the process and never escapes with an exception that says nothing
  (AttributeError, SystemError, AssertionError, NameError, UnboundLocalError, ZeroDivisionError);
- a call that raises leaves every tensor and all scaler, optimizer and master-weight state as it
  was (all or nothing);
- a call that is accepted leaves the scale a finite number > 0 and writes no NaN into a
  parameter that had none.

It runs a few thousand calls in well under a minute. A finding is a failing case named by its
entry point, argument and bad value.
"""
import copy
import math

import pytest
import torch

import ampx
from ampx import ops

BARE = (AttributeError, SystemError, AssertionError, NameError, UnboundLocalError, ZeroDivisionError)
OK_ERRORS = (TypeError, ValueError, RuntimeError, KeyError, IndexError, NotImplementedError, OverflowError)


def _shrunk():
    t = torch.ones(8)
    t.untyped_storage().resize_(4)
    return t


def bad_values():
    """Name -> a maker of one bad value (made afresh: some are written to)."""
    return {
        "None": lambda: None,
        "str": lambda: "x",
        "bool": lambda: True,
        "nan": lambda: math.nan,
        "inf": lambda: math.inf,
        "-inf": lambda: -math.inf,
        "-1": lambda: -1,
        "0": lambda: 0,
        "0.0": lambda: 0.0,
        "huge int": lambda: 2 ** 70,
        "huge float": lambda: 1e300,
        "list of None": lambda: [None],
        "empty list": lambda: [],
        "nested list": lambda: [[torch.ones(2)]],
        "dict": lambda: {"a": 1},
        "int64 tensor": lambda: torch.zeros(3, dtype=torch.int64),
        "float64 tensor": lambda: torch.zeros(1, dtype=torch.float64),
        "complex tensor": lambda: torch.zeros(1, dtype=torch.complex64),
        "bool tensor": lambda: torch.zeros(1, dtype=torch.bool),
        "meta tensor": lambda: torch.zeros(1, device="meta"),
        "0-dim tensor": lambda: torch.tensor(1.0),
        "2-elem tensor": lambda: torch.zeros(2),
        "nan tensor": lambda: torch.full((1,), math.nan),
        "expanded": lambda: torch.zeros(1).expand(4),
        "sparse": lambda: torch.zeros(3).to_sparse(),
        "neg view": lambda: torch._neg_view(torch.zeros(1)),
        "shrunk storage": _shrunk,
        "requires grad": lambda: torch.zeros(1, requires_grad=True),
        "list of shrunk": lambda: [_shrunk()],
        "list of meta": lambda: [torch.zeros(2, device="meta")],
        "list of int": lambda: [torch.zeros(2, dtype=torch.int32)],
        "list of expanded": lambda: [torch.zeros(1).expand(3)],
        "object": lambda: object(),
    }


# ---- snapshots -----------------------------------------------------------------------------


def _freeze(x, seen):
    """A comparable deep copy of x: tensors as (dtype, shape, bytes), containers recursively."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta" or x.layout != torch.strided:
            return ("tensor", str(x.device), x.dtype, tuple(x.shape))
        try:
            if x.untyped_storage().nbytes() < (x.storage_offset() + x.numel()) * x.element_size():
                return ("shrunk", x.dtype, tuple(x.shape))
        except RuntimeError:
            return ("nostorage", x.dtype, tuple(x.shape))
        d = x.detach().resolve_conj().resolve_neg().contiguous().cpu()
        return ("tensor", x.dtype, tuple(x.shape), bytes(d.view(-1).view(torch.uint8).numpy()) if d.numel() else b"")
    if id(x) in seen:
        return ("seen",)
    if isinstance(x, (list, tuple)):
        seen[id(x)] = x  # (kept alive: a freed temporary's id could be taken by a later object)
        return (type(x).__name__, tuple(_freeze(v, seen) for v in x))
    if isinstance(x, dict):
        seen[id(x)] = x  # (kept alive: a freed temporary's id could be taken by a later object)
        return ("dict", tuple((repr(k) if not isinstance(k, torch.Tensor) else ("t", id(k)), _freeze(v, seen))
                              for k, v in x.items()))
    if isinstance(x, (int, float, str, bool, type(None))):
        return x if not (isinstance(x, float) and math.isnan(x)) else ("nan",)
    if isinstance(x, torch.optim.Optimizer):
        seen[id(x)] = x  # (kept alive: a freed temporary's id could be taken by a later object)
        return ("opt", _freeze(x.param_groups, seen), _freeze(dict(x.state), seen))
    if isinstance(x, torch.nn.Module):
        seen[id(x)] = x  # (kept alive: a freed temporary's id could be taken by a later object)
        return ("module", _freeze(list(x.parameters()), seen), _freeze([p.grad for p in x.parameters()], seen))
    if hasattr(x, "__dict__") and type(x).__module__.startswith("ampx"):
        seen[id(x)] = x  # (kept alive: a freed temporary's id could be taken by a later object)
        return (type(x).__name__, _freeze({k: v for k, v in vars(x).items() if not k.startswith("__")}, seen))
    return ("obj", type(x).__name__)


def snapshot(objs):
    return [_freeze(o, {}) for o in objs]


# ---- the entry points ----------------------------------------------------------------------


def _model_opt(dtype=torch.float32):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3).to(dtype)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _scaler(**kw):
    """A scaler that has scaled a loss this iteration, as a loop's scaler has at step()."""
    s = ampx.GradScaler("cpu", init_scale=8.0, **kw)
    s.scale(torch.ones(()))
    return s


def _ops_cases():
    """(name, make) with make() -> (fn, args, kwargs, state objects)."""
    def t():
        return [torch.randn(5), torch.randn(3)]

    def f():
        return torch.zeros(1)

    def unscale():
        ts, found = t(), f()
        return ops.unscale_, [ts, 0.5, found], {"flags": torch.zeros(2, dtype=torch.uint8)}, [ts, found]

    def check():
        ts, found = t(), f()
        return ops.check_finite, [ts, found], {}, [ts, found]

    def norm():
        ts = t()
        return ops.norm, [ts, 2.0], {"factor": 0.5, "found_inf": f()}, [ts]

    def unscale_norm():
        ts, found = t(), f()
        return ops.unscale_norm_, [ts, 0.5, found], {"ord": 2.0}, [ts, found]

    def mul():
        ts = t()
        return ops.mul_, [ts, 2.0], {}, [ts]

    def cast():
        src, dst = t(), [torch.zeros(5, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)]
        return ops.cast_, [src, dst], {"inv_scale": 0.5, "found_inf": f(), "rounding": "nearest", "seed": 1,
                                       "offset": 0}, [src, dst]

    def update():
        s, g, found = torch.full((1,), 8.0), torch.zeros(1, dtype=torch.int32), f()
        return ops.update_scale_, [s, g, found, 2.0, 0.5, 10], {}, [s, g, found]

    return [("ops.unscale_", unscale), ("ops.check_finite", check), ("ops.norm", norm),
            ("ops.unscale_norm_", unscale_norm), ("ops.mul_", mul), ("ops.cast_", cast),
            ("ops.update_scale_", update)]


def _scaler_cases():
    def scaled_grads(scaler, opt):
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad.mul_(scaler.get_scale())

    def ctor():
        return ampx.GradScaler, ["cpu"], {"init_scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                          "growth_interval": 10, "hysteresis": 1, "min_scale": 1.0,
                                          "max_scale": 1024.0}, []

    def step():
        m, opt = _model_opt()
        s = _scaler()
        scaled_grads(s, opt)
        return s.step, [opt], {}, [m, opt, s]

    def unscale():
        m, opt = _model_opt()
        s = _scaler()
        return s.unscale_, [opt], {}, [m, opt, s]

    def clip():
        m, opt = _model_opt()
        s = _scaler()
        return s.clip_grad_norm_, [opt, 1.0], {"norm_type": 2.0, "error_if_nonfinite": False}, [m, opt, s]

    def update():
        m, opt = _model_opt()
        s = _scaler()
        s.step(opt)
        return s.update, [4.0], {}, [m, opt, s]

    def scale():
        s = _scaler()
        return s.scale, [torch.ones(2)], {}, [s]

    def load():
        s = _scaler()
        sd = _scaler(growth_interval=7).state_dict()
        return s.load_state_dict, [sd], {}, [s]

    return [("GradScaler()", ctor), ("GradScaler.step", step), ("GradScaler.unscale_", unscale),
            ("GradScaler.clip_grad_norm_", clip), ("GradScaler.update", update), ("GradScaler.scale", scale),
            ("GradScaler.load_state_dict", load)]


def _master_cases():
    def model16():
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3).to(torch.bfloat16)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def ctor():
        m, opt = model16()
        return ampx.MasterWeights, [opt], {"rounding": "nearest", "seed": 0}, [m, opt]

    def add_group():
        m, opt = model16()
        mw = ampx.MasterWeights(opt)
        extra = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        return mw.add_param_group, [{"params": [extra], "lr": 0.01}], {}, [m, mw]

    def load():
        m, opt = model16()
        mw = ampx.MasterWeights(opt)
        return mw.load_state_dict, [mw.state_dict()], {}, [m, mw]

    return [("MasterWeights()", ctor), ("MasterWeights.add_param_group", add_group),
            ("MasterWeights.load_state_dict", load)]


def _policy_cases():
    def ctor():
        return ampx.Policy, ["bf16"], {"device": "cpu"}, []

    def ds():
        p = ampx.Policy("bf16", device="cpu")
        return p.deepspeed_config, [{"train_batch_size": 2}], {}, []

    return [("Policy()", ctor), ("Policy.deepspeed_config", ds)]


CASES = _ops_cases() + _scaler_cases() + _master_cases() + _policy_cases()


def _slots(args, kwargs):
    """Each positional and keyword argument, and one keyword the call does not take."""
    return [("arg", i) for i in range(len(args))] + [("kw", k) for k in kwargs] + [("kw", "bogus")]


def _run_case(name, make):
    """Every (slot, bad value) of one entry point; returns the findings as strings."""
    findings = []
    fn, args, kwargs, _ = make()
    for slot in _slots(args, kwargs):
        for bname, bad in bad_values().items():
            fn, args, kwargs, state = make()
            args, kwargs = list(args), dict(kwargs)
            if slot[0] == "arg":
                args[slot[1]] = bad()
            else:
                kwargs[slot[1]] = bad()
            where = f"{name} {slot[0]} {slot[1]!r} = {bname}"
            finding = _probe_one(fn, args, kwargs, state)
            if finding:
                findings.append(f"{where}: {finding}")
    return findings


def _params(state):
    out = []
    for o in state:
        if isinstance(o, torch.nn.Module):
            out += list(o.parameters())
    return out


def _probe_one(fn, args, kwargs, state):
    before = snapshot(state)
    had_nan = [bool(torch.isnan(p).any()) for p in _params(state)]
    try:
        result = fn(*args, **kwargs)
    except BARE as e:
        if type(e) in BARE or not isinstance(e, OK_ERRORS):  # (ampx.SettingError is both kinds)
            return f"bare {type(e).__name__}: {e}"
        return _after_refusal(e, before, state)
    except OK_ERRORS as e:
        return _after_refusal(e, before, state)
    except Exception as e:  # noqa: BLE001 - any other type is a finding too
        return f"unexpected {type(e).__name__}: {e}"
    return _after_acceptance(result, state, had_nan)


def _after_refusal(e, before, state):
    if not str(e):
        return f"{type(e).__name__} with no message"
    after = snapshot(state)
    if after != before:
        changed = [i for i, (a, b) in enumerate(zip(after, before)) if a != b]
        return f"raised {type(e).__name__} ({str(e)[:80]}) but changed state objects {changed}"
    return None


def _after_acceptance(result, state, had_nan):
    for s in state + ([result] if isinstance(result, ampx.GradScaler) else []):
        if isinstance(s, ampx.GradScaler) and s.is_enabled() and s._scale is not None:
            if s._scale.device.type != "cpu" or s._scale.dtype != torch.float32 or s._scale.numel() != 1:
                return f"accepted, and the scale became {s._scale!r}"
            v = float(s._scale.item())
            if not (math.isfinite(v) and v > 0):
                return f"accepted, and the scale became {v}"
    for p, nan_before in zip(_params(state), had_nan):
        if not nan_before and bool(torch.isnan(p).any()):
            return "accepted, and wrote NaN into a parameter"
    return None


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_probe(name, make):
    findings = _run_case(name, make)
    assert not findings, f"{len(findings)} finding(s):\n" + "\n".join(findings[:40])


def test_the_probe_can_fail():
    """The probe's checks see a half-applied failure, a NaN write and a bare error."""
    t = torch.ones(3)

    def half_applied(x):
        t.mul_(2.0)
        raise ValueError("refused after writing")

    assert "changed state" in _probe_one(half_applied, [1], {}, [t])
    m = torch.nn.Linear(2, 2)

    def poison():
        with torch.no_grad():
            m.weight.fill_(math.nan)

    assert "NaN" in _probe_one(poison, [], {}, [m])
    assert "bare AttributeError" in _probe_one(lambda: None.x, [], {}, [])
    s = ampx.GradScaler("cpu")
    s._lazy_init_scale_growth_tracker(torch.device("cpu"))

    def zero_scale():
        s._scale.fill_(0.0)

    assert "scale became 0.0" in _probe_one(zero_scale, [], {}, [s])
    # and a clean refusal is no finding
    assert _probe_one(lambda: (_ for _ in ()).throw(ValueError("no")), [], {}, [t]) is None


def test_snapshot_sees_scaler_state():
    s = ampx.GradScaler("cpu")
    a = snapshot([s])
    s._growth_interval = 5
    assert snapshot([s]) != a
    b = snapshot([s])
    s2 = copy.copy(s)
    assert snapshot([s2]) == b
