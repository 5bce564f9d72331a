"""ampx's kernels as torch custom ops (ampx/_torch_ops.py): what the rest of PyTorch sees.

Covers, for each public op of ampx.ops and the scaler's two passes:
- torch.library.opcheck (schema, fake, autograd registration, AOT dispatch);
- torch.compile(fullgraph=True) with the "eager" and "aot_eager" backends (and inductor for
  two cases, inductor being slow to compile on the CPU): the same bits as eager, outputs and
  every tensor written;
- the profiler: the call is named ampx::<name>;
- FakeTensorMode and meta tensors: outputs of the right shape, dtype and device, no data read;
  a list mixing meta and real tensors is refused in both orders;
- torch.export of a module using the ops, which then runs as eager does;
- the eager path: no dispatcher (the profiler's absence of an ampx:: event shows it), and
  the fallbacks taken where torch lacks a private function the routing asks;
- a profiled scaler step (its passes named ampx::*, its bits unchanged);
- torch.compile(train_step) with ampx.GradScaler (the "weak object has gone away" crash), the
  same bits as eager.
Everything runs with both tensor readers (the C shim and Python attributes, as in
tests/test_tensor_shim.py), and once in a process started with AMPX_TENSOR_SHIM=0.
"""
import math
import os
import subprocess
import sys
import types

import pytest
import torch

import ampx
from ampx import _C, ops
from conftest import assert_bits_equal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _each_reader(reader):
    """Every test here runs with each tensor reader (conftest's ``reader``)."""
    return reader


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- the cases: inputs built by a function of the device, a call made through ampx.ops -------

def _grads(device="cpu"):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(37, generator=g), torch.randn(5, 3, generator=g).to(torch.bfloat16),
          torch.randn(8, generator=g).to(torch.float16), torch.randn(4, generator=g).double()]
    xs[1][2, 1] = math.inf
    return [x.to(device) for x in xs]


def _state(device="cpu"):
    """The tensors one call works on: a list and its 1-element outputs."""
    return {"xs": _grads(device), "found_inf": torch.zeros(1, device=device),
            "flags": torch.zeros(4, dtype=torch.uint8, device=device),
            "inv": torch.full((1,), 0.25, device=device)}


def _unscale(s):
    ops.unscale_(s["xs"], s["inv"], s["found_inf"], flags=s["flags"])


def _check(s):
    ops.check_finite(s["xs"], s["found_inf"], flags=s["flags"])


def _norm(s):
    return ops.norm(s["xs"], 2.0, factor=s["inv"], found_inf=s["found_inf"], flags=s["flags"], per_tensor=True)


def _norm_inf(s):
    return ops.norm(s["xs"][::2], math.inf)


def _unscale_norm(s):
    return ops.unscale_norm_(s["xs"], 0.5, s["found_inf"], ord=1.0, flags=s["flags"], per_tensor=True)


def _mul(s):
    ops.mul_(s["xs"], 3.0)


def _cast(s):
    out = [torch.empty(x.shape, dtype=torch.float32, device=x.device) for x in s["xs"]]
    ops.cast_(s["xs"], out, inv_scale=s["inv"], found_inf=s["found_inf"], flags=s["flags"])
    return out


def _cast_stochastic(s):
    src = [x.float() for x in s["xs"]]
    out = [torch.empty(x.shape, dtype=torch.bfloat16, device=x.device) for x in s["xs"]]
    ops.cast_(src, out, rounding="stochastic", seed=2**64 - 3, offset=2**63 + 11)  # the int64 bits travel
    return out


def _update_scale(s):
    scale = torch.full((1,), 1024.0, device=s["inv"].device)
    tracker = torch.zeros(1, dtype=torch.int32, device=scale.device)
    hyst = torch.full((1,), 2, dtype=torch.int32, device=scale.device)
    ops.update_scale_(scale, tracker, s["found_inf"] + 1, 2.0, 0.5, 3, hysteresis=2, hysteresis_tracker=hyst,
                      max_scale=4096.0)
    return scale, tracker, hyst


def _scaler_unscale(s):
    return ops._scaler_pass(s["xs"], _C.REDUCE_SUMSQ, s["inv"], s["found_inf"], s["flags"], True, False, -1)


def _scaler_check(s):
    return ops._scaler_pass(s["xs"], _C.REDUCE_MAXABS, s["inv"], s["found_inf"], s["flags"], False, False, -1)


CASES = {"unscale_": _unscale, "check_finite": _check, "norm": _norm, "norm_inf": _norm_inf,
         "unscale_norm_": _unscale_norm, "mul_": _mul, "cast_": _cast, "cast_stochastic": _cast_stochastic,
         "update_scale_": _update_scale, "_scaler_unscale_": _scaler_unscale, "_scaler_check": _scaler_check}
OP_OF = {"norm_inf": "norm", "cast_stochastic": "cast_"}  # the ampx:: op a case calls


def _flat(out):
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _run(case, fn=None, device="cpu"):
    s = _state(device)
    out = (fn or CASES[case])(s)
    return _flat(out) + s["xs"] + [s["found_inf"], s["flags"]]


def _same_bits(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), (i, a, b)
        assert_bits_equal(a.cpu(), b.cpu(), f"tensor {i}")


# ---- opcheck ----------------------------------------------------------------------------

def _opcheck_args(name):
    s = _state()
    xs, fi, fl = s["xs"], s["found_inf"], s["flags"]
    return {
        "unscale_": (xs, s["inv"], None, fi, fl),
        "check_finite": (xs, fi, fl),
        "norm": (xs, _C.REDUCE_SUMSQ, None, 0.5, fi, fl, True, ops.SPLIT_DYNAMIC),
        "unscale_norm_": (xs, None, 0.5, fi, fl, _C.REDUCE_SUMABS, False),
        "mul_": (xs, None, 2.0, ops.SPLIT_FUSED),
        "cast_": (xs, [torch.empty(x.shape) for x in xs], s["inv"], None, fi, fl, False, -3, 5, None),
        "update_scale_": (torch.full((1,), 8.0), torch.zeros(1, dtype=torch.int32), fi, 2.0, 0.5, 2, 1, None,
                          False, 0.0, math.inf),
        "_scaler_unscale_": (xs, _C.REDUCE_SUMSQ, s["inv"], None, fi, fl, False, ops.SPLIT_DYNAMIC),
        "_scaler_check": (xs, _C.REDUCE_NONE, None, None, fi, fl, False, ops.SPLIT_ELEMENTWISE),
        "tensor_stats": (xs,),
        # the traced Adam step (ampx/graph_step.py): float32 parameters, their moments and steps
        "_fused_adam_": ([torch.randn(5), torch.randn(3, 2)], [torch.randn(5), torch.randn(3, 2)],
                         [torch.zeros(5), torch.zeros(3, 2)], [torch.zeros(5), torch.zeros(3, 2)], [],
                         [torch.zeros(()), torch.zeros(())], None, 1e-2, 0.9, 0.999, 0.01, 1e-8, False, False,
                         True, torch.full((), 4.0), torch.zeros(())),
    }[name]


@pytest.mark.parametrize("name", sorted(ampx._torch_ops.SCHEMAS))
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.ampx, name).default, _opcheck_args(name))


# ---- torch.compile --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_fullgraph_gives_eager_bits(case, backend):
    want = _run(case)
    got = _run(case, torch.compile(CASES[case], fullgraph=True, backend=backend))
    _same_bits(got, want)


@pytest.mark.parametrize("case", ["unscale_norm_", "cast_"])
def test_inductor_runs_the_same_kernel(case):
    want = _run(case)
    got = _run(case, torch.compile(CASES[case], fullgraph=True, backend="inductor"))
    _same_bits(got, want)


def test_compiled_graph_holds_the_op():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(_unscale_norm, fullgraph=True, backend=backend)(_state())
    assert any("ampx.unscale_norm_" in t for t in seen), seen


# ---- the profiler -----------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
def test_profiler_names_the_op(case):
    want = _run(case)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = _run(case)
    names = {e.name for e in prof.events()}
    assert f"ampx::{OP_OF.get(case, case)}" in names, sorted(n for n in names if "ampx" in n)
    _same_bits(got, want)


def test_eager_calls_skip_the_dispatcher():
    """Outside a profiler, compile, a dispatch mode and meta/fake inputs, nothing goes through
    torch.ops.ampx (a TorchDispatchMode would see it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    s = _state()
    seen = []
    assert not ops._dispatching(s["xs"])
    with Log():
        _unscale_norm(s)
    assert "ampx.unscale_norm_.default" in seen, seen  # a mode does see the op


def test_a_profiled_dtensor_or_sparse_list_stays_eager():
    sp = torch.randn(4).to_sparse()
    with torch.profiler.profile():
        assert not ops._dispatching([torch.zeros(2), sp])
        assert ops._dispatching([torch.zeros(2)])


# ---- FakeTensorMode, meta, export ---------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
def test_fake_tensor_mode(case):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    want = _run(case)
    with FakeTensorMode():
        s = _state()
        out = _flat(CASES[case](s))
    assert all(isinstance(t, FakeTensor) for t in out)
    assert [(t.shape, t.dtype, t.device) for t in out] == [(t.shape, t.dtype, t.device) for t in want[:len(out)]]


@pytest.mark.parametrize("case", sorted(c for c in CASES if not c.startswith("_scaler")))
def test_meta_tensors_run_the_fake(case):
    want = _run(case)
    s = _state("meta")
    out = _flat(CASES[case](s))
    assert all(t.is_meta for t in out)
    assert [(t.shape, t.dtype) for t in out] == [(t.shape, t.dtype) for t in want[:len(out)]]


@pytest.mark.parametrize("op", ["unscale_", "norm", "mul_"])
def test_meta_mixed_with_real_is_refused(op):
    call = {"unscale_": lambda xs: ops.unscale_(xs, 0.5, None), "norm": ops.norm,
            "mul_": lambda xs: ops.mul_(xs, 2.0)}[op]
    with pytest.raises(ValueError, match=r"tensors\[1\] is on device meta"):
        call([torch.zeros(3), torch.zeros(3, device="meta")])
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cpu, but this call runs on meta"):
        call([torch.zeros(3, device="meta"), torch.zeros(3)])


@pytest.mark.parametrize("case", ["_scaler_unscale_", "_scaler_check"])
def test_the_scalers_passes_refuse_meta_gradients(case):
    """A scaler steps real gradients (a meta one is a module not yet materialized): its passes
    keep the kernel's refusal; FakeTensorMode (above) still traces them."""
    with pytest.raises(ValueError, match=r"tensors\[0\] is on device meta"):
        CASES[case](_state("meta"))


def test_meta_found_inf_beside_real_tensors_is_refused():
    with pytest.raises(ValueError, match="found_inf is on meta"):
        ops.unscale_([torch.zeros(3)], 0.5, torch.zeros(1, device="meta"))


class _UsesOps(torch.nn.Module):
    def forward(self, x, y):
        grads = [x * 3, y.to(torch.bfloat16)]
        found = torch.zeros(1)
        total = ops.unscale_norm_(grads, 0.125, found)
        out = [torch.empty(g.shape) for g in grads]
        ops.cast_(grads, out, inv_scale=2.0)
        return total, found, out[0], out[1], ops.norm(out, math.inf)


def test_export_matches_eager():
    x, y = torch.randn(10), torch.randn(3, 2)
    y[0, 0] = math.nan
    ep = torch.export.export(_UsesOps(), (x, y))
    assert "ampx.unscale_norm_.default" in str(ep.graph_module.code)
    _same_bits(list(ep.module()(x, y)), list(_UsesOps()(x, y)))


# Bad input that the fake kernel refuses, each with the eager exception and its words: the
# fake kernel is what a trace runs, so the refusal comes before any kernel touches data.
_BAD_UNDER_TRACE = {
    "found_inf of the wrong dtype": (
        lambda xs, ys: ops.unscale_(xs, 0.5, torch.zeros(1, dtype=torch.int32)),
        TypeError, "ampx.ops.unscale_: found_inf must have dtype torch.float32, not torch.int32"),
    "cast_ lists of unequal sizes": (
        lambda xs, ys: ops.cast_(xs, ys[:1]),
        ValueError, "ampx.ops.cast_: src has 2 tensors but dst has 1"),
    "stochastic rounding into float32": (
        lambda xs, ys: ops.cast_(xs, ys, rounding="stochastic"),
        ValueError, "stochastic rounding writes bfloat16, but dst[0] has dtype torch.float32"),
    # an argument value, checked in Python before the op: its eager exception even when traced
    "an unknown rounding": (
        lambda xs, ys: ops.cast_(xs, ys, rounding="up"),
        ValueError, "rounding must be 'nearest' or 'stochastic'"),
}
_CHECKED_BEFORE_THE_OP = {"an unknown rounding"}


@pytest.mark.parametrize("bad", sorted(_BAD_UNDER_TRACE))
@pytest.mark.parametrize("how", ["eager", "fullgraph", "graph_breaks_allowed", "export"])
def test_bad_input_in_a_trace_names_the_problem_and_writes_nothing(bad, how):
    """Under torch.compile torch re-raises an op's refusal as its TorchRuntimeError (a
    RuntimeError) carrying the op's message, as for torch's own ops; without fullgraph it still
    raises (a refusal is not a graph break). torch.export raises the eager exception itself.
    In every case no tensor has changed."""
    call, eager_type, words = _BAD_UNDER_TRACE[bad]
    xs = [torch.tensor([1.0, math.inf, -0.0]), torch.full((5,), 3.0)]
    ys = [torch.full((3,), 7.0), torch.full((5,), 7.0)]
    before = [t.clone() for t in xs + ys]

    def fn(a, b, c, d):
        call([a, b], [c, d])
        return a + 1

    class _Module(torch.nn.Module):
        def forward(self, a, b, c, d):
            return fn(a, b, c, d)

    runs = {"eager": lambda: fn(*xs, *ys),
            "fullgraph": lambda: torch.compile(fn, fullgraph=True, backend="aot_eager")(*xs, *ys),
            "graph_breaks_allowed": lambda: torch.compile(fn, backend="aot_eager")(*xs, *ys),
            "export": lambda: torch.export.export(_Module(), (*xs, *ys))}
    before_op = bad in _CHECKED_BEFORE_THE_OP
    if how == "fullgraph":  # a Python raise is a graph break, which fullgraph refuses
        want = torch._dynamo.exc.Unsupported if before_op else torch._dynamo.exc.TorchRuntimeError
    elif how == "graph_breaks_allowed":  # the break runs the wrapper eagerly
        want = eager_type if before_op else torch._dynamo.exc.TorchRuntimeError
    else:
        want = eager_type
    with pytest.raises(want) as err:
        runs[how]()
    assert words in str(err.value)
    _same_bits(xs + ys, before)


def test_torch_treats_its_own_python_checks_as_ampx_does():
    """The control for _CHECKED_BEFORE_THE_OP (and docs/ERRORS.md's claim): a check torch makes in
    Python (F.pad's mode) is a graph break too, Unsupported under fullgraph and the eager
    exception without it. If a torch changes this, ampx's choice must be looked at again."""
    import torch.nn.functional as F

    def fn(x):
        return F.pad(x, (1, 1), mode="bogus")

    x = torch.zeros(1, 1, 4)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(fn, fullgraph=True, backend="eager")(x)
    with pytest.raises(NotImplementedError, match="bogus"):
        torch.compile(fn, backend="eager")(x)


# ---- the routing's fallbacks ------------------------------------------------------------------

def test_fallbacks_where_torch_lacks_the_private_functions(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert ops.DISPATCH_FALLBACKS == []
    try:
        with monkeypatch.context() as m:  # torch itself needs the module back at once
            m.setitem(sys.modules, "torch._subclasses.fake_tensor", None)  # its import now fails
            # a torch._C without the profiler's and the mode stack's functions
            fallbacks = ops._probe_dispatch_hooks(types.SimpleNamespace(_autograd=types.SimpleNamespace()))
        assert len(fallbacks) == 3, fallbacks
        want = _run("unscale_norm_")
        with torch.profiler.profile():  # the profiler is no longer seen: the eager path
            assert not ops._dispatching(_state()["xs"])
        _same_bits(_run("unscale_norm_"), want)
        assert ops.norm([torch.zeros(3, device="meta")]).is_meta  # meta is asked publicly
        with FakeTensorMode() as mode:  # a fake tensor is known by its fake_mode
            fake = mode.from_tensor(torch.zeros(3))
            assert ops._dispatching([fake])
            assert ops.norm([fake]).shape == ()
        _same_bits(_run("unscale_norm_", torch.compile(_unscale_norm, fullgraph=True, backend="eager")), want)
    finally:
        monkeypatch.undo()
        assert ops._probe_dispatch_hooks() == []


# ---- the scaler under torch.compile -------------------------------------------------------------

def _train(opt_kind, compiled, scaler_cls=ampx.GradScaler, backend="eager", steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = {"fused_adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
           "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
           "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True)}[opt_kind](model.parameters())
    scaler = scaler_cls("cpu", init_scale=2.0**15, growth_interval=2)
    xs = [torch.randn(16, 8) for _ in range(steps)]
    xs[2][0, 0] = math.inf  # one skipped step

    def train_step(x):
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss

    step = torch.compile(train_step, backend=backend) if compiled else train_step
    for x in xs:
        step(x)
    return [p.detach().clone() for p in model.parameters()] + [scaler._scale.clone(), scaler._growth_tracker.clone()]


@pytest.mark.parametrize("opt_kind", ["fused_adamw", "sgd"])
def test_compiled_train_step_with_the_scaler(opt_kind):
    """Regression: torch.compile(train_step) crashed with "TypeError: weak object has gone away"
    (fused optimizers). Now it runs, and gives eager's bits (dynamo with the eager backend; the
    model's own graph then runs as eager)."""
    _same_bits(_train(opt_kind, True), _train(opt_kind, False))


def test_compiled_foreach_adam_gives_eager_bits():
    """Dynamo traces a foreach Adam's step into other ops than eager's, so torch's scaler, whose
    step dynamo traces into, gives other bits compiled than eager. ampx's step, unscale_,
    clip_grad_norm_ and update run eagerly under compile (ampx/compile_guard.py), the
    optimizer's step with them: compiled, ampx gives its eager bits."""
    _same_bits(_train("adam_foreach", True), _train("adam_foreach", False))
    torchs = _train("adam_foreach", True, torch.amp.GradScaler)
    assert not all(torch.equal(a, b) for a, b in zip(torchs, _train("adam_foreach", False, torch.amp.GradScaler)))


def test_fullgraph_post_backward_step_says_why_and_what_to_compile():
    """A plain optimizer's post-backward calls cannot be one graph (whether it steps is decided on
    the host): under fullgraph=True the error names the call, why, and what to compile instead.
    unscale_ is host-driven with a fused optimizer too. (A fused Adam/AdamW's clip, step and
    update do trace: tests/test_graph_step.py.)"""
    from ampx.compile_guard import _TAKES_REASON

    model = torch.nn.Linear(4, 4)
    plain = torch.optim.SGD(model.parameters(), lr=1e-3)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
    before = [p.detach().clone() for p in model.parameters()] + [p.grad.clone() for p in model.parameters()]
    for call in ("clip_grad_norm_", "step", "update", "unscale_"):
        fn = {"clip_grad_norm_": lambda: scaler.clip_grad_norm_(plain, 1.0, error_if_nonfinite=True),
              "step": lambda: scaler.step(plain), "update": lambda: scaler.update(),
              "unscale_": lambda: scaler.unscale_(fused)}[call]
        with pytest.raises(Exception) as info:
            torch.compile(fn, fullgraph=True, backend="eager")()
        text = str(info.value)
        assert "torch.compiler.disable" in text, text
        if _TAKES_REASON:
            assert f"ampx.GradScaler.{call}() runs eagerly under torch.compile" in text, text
            assert "outside the fullgraph function" in text
        torch._dynamo.reset()
    _same_bits([p.detach() for p in model.parameters()] + [p.grad for p in model.parameters()], before)


def test_host_driven_without_a_reason_keyword():
    """A torch whose compiler.disable takes no reason: the call is still disabled, without one."""
    from ampx.compile_guard import host_driven

    def f(x):
        return x + 1

    g = host_driven(f, takes_reason=False)
    assert g(torch.ones(1)).item() == 2.0
    with pytest.raises(Exception, match="torch.compiler.disable"):
        torch.compile(lambda x: g(x), fullgraph=True, backend="eager")(torch.ones(1))


def test_compiled_train_step_under_inductor_matches_torchs_scaler():
    """Inductor rounds the model's own maths its own way; ampx's scaler under it gives what
    torch's scaler under it gives."""
    got = _train("fused_adamw", True, backend="inductor", steps=3)
    want = _train("fused_adamw", True, torch.amp.GradScaler, backend="inductor", steps=3)
    _same_bits(got, want)


# ---- a process whose reader is Python attributes from the start ------------------------------

_CHILD = """
import math, torch, ampx
from ampx import ops
assert ops.tensor_reader().startswith("python attributes"), ops.tensor_reader()
xs = [torch.randn(9), torch.randn(4).bfloat16()]
f = torch.compile(lambda xs: ops.unscale_norm_(xs, 0.5, None), fullgraph=True, backend="aot_eager")
ys = [x.clone() for x in xs]
assert torch.equal(f(xs), ops.unscale_norm_(ys, 0.5, None))
with torch.profiler.profile() as prof:
    ops.mul_(xs, 2.0)
assert "ampx::mul_" in {e.name for e in prof.events()}
assert ops.norm([torch.zeros(2, device="meta")]).is_meta
print("ok")
"""


def test_a_process_started_with_attributes_only(reader):
    if reader == "shim":
        pytest.skip("the child chooses its own reader: run once")
    env = dict(os.environ, AMPX_TENSOR_SHIM="0")
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_a_profiled_scaler_step_names_its_passes_and_keeps_its_bits():
    want = _train("sgd", False, steps=3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = _train("sgd", False, steps=3)
    names = {e.name for e in prof.events()}
    assert {"ampx::_scaler_unscale_", "ampx::update_scale_"} <= names, sorted(n for n in names if "ampx" in n)
    _same_bits(got, want)
