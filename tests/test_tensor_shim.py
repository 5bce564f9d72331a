"""The fast tensor read through torch's C shim (csrc/torch_shim.c).

Plain tensors are read through torch's stable C functions when the start-up
probe passes, everything else through Python attributes. Both readers must
give the kernels the same tensors, and the same errors; the probe must refuse
a shim that disagrees with the attributes; and casts must see a tensor's
negative bit, which neither reader's pointer shows.
"""
import os
import subprocess
import sys

import pytest
import torch

import ampx
from ampx import _C, ops
from conftest import assert_bits_equal, special_values

ON_LINUX = sys.platform.startswith("linux")


class Sub(torch.Tensor):
    pass


def mixed_list(rng, n=60):
    """Tensors of every kind a caller may pass: plain, Parameter, subclass,
    views with offsets, non-contiguous, empty, each dtype, and special values."""
    out = []
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    for i in range(n):
        dt = dtypes[i % 4]
        size = int(rng.integers(0, 300))
        base = special_values(dt, size + 5, rng)
        kind = i % 6
        if kind == 0:
            t = base[:size].clone()
        elif kind == 1:
            t = torch.nn.Parameter(base[:size].clone(), requires_grad=False)
        elif kind == 2:
            t = base[:size].clone().as_subclass(Sub)
        elif kind == 3:
            t = base[3 : 3 + size]  # a view at an offset into its storage
        elif kind == 4:
            t = base[: (size + 5) // 2 * 2].view(-1, 2)[:, 0]  # non-contiguous
        else:
            t = base[:size].clone().view(1, -1) if size else torch.empty(0, 4, dtype=dt)
        out.append(t)
    return out


def test_reader_is_the_shim_on_linux_with_this_torch():
    if not ON_LINUX:
        pytest.skip("the shim is only looked for on Linux")
    assert ops.tensor_reader() == "torch C shim", ops.tensor_reader()
    # The probe also found where a TensorImpl keeps its storage (used only to aim prefetches).
    assert _C._tensor_shim_storage_offset() >= 0


CUDA = torch.cuda.is_available() and ampx.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA, reason="no CUDA device usable by ampx: " + str(ampx.cuda.unavailable_reason())))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["unscale_", "norm", "unscale_norm_", "mul_", "check_finite"])
def test_both_readers_give_identical_results(op, device, rng):
    """The probe checks CPU tensors; on a GPU machine this also covers CUDA tensors, whose
    device index the shim reads."""
    base = [t.to(device) if not isinstance(t, Sub) else t.as_subclass(torch.Tensor).to(device).as_subclass(Sub)
            for t in mixed_list(rng)]
    results = {}
    prev = _C._set_tensor_shim()
    try:
        for mode in ([True, False] if prev else [False]):
            _C._set_tensor_shim(mode)
            ts = [t.detach().clone() if t.is_contiguous() else t.detach().clone().t().contiguous().t()
                  for t in base]
            ts = [t if not isinstance(b, Sub) else t.as_subclass(Sub) for t, b in zip(ts, base)]
            found = torch.zeros(1, device=device)
            flags = torch.zeros(len(ts), dtype=torch.uint8, device=device)
            out = None
            if op == "unscale_":
                ops.unscale_(ts, torch.full((1,), 0.25, device=device), found, flags=flags)
            elif op == "norm":
                out = ops.norm(ts, found_inf=found, flags=flags, per_tensor=True)
            elif op == "unscale_norm_":
                out = ops.unscale_norm_(ts, torch.full((1,), 0.25, device=device), found, flags=flags,
                                        per_tensor=True)
            elif op == "mul_":
                ops.mul_(ts, 3.0)
            else:
                ops.check_finite(ts, found, flags=flags)
            results[mode] = (ts, found, flags, out)
    finally:
        _C._set_tensor_shim(prev)
    if len(results) < 2:
        pytest.skip("the shim is off here")
    a, b = results[True], results[False]
    for x, y in zip(a[0], b[0]):
        assert_bits_equal(x, y)
    assert_bits_equal(a[1], b[1])
    assert torch.equal(a[2], b[2])
    if a[3] is not None:
        ta, pa = a[3]
        tb, pb = b[3]
        assert_bits_equal(ta, tb)
        assert_bits_equal(pa, pb)


def test_results_match_a_float64_reference(reader, rng):
    ts = mixed_list(rng)
    ref = [t.detach().double().clone() for t in ts]  # .double() of float64 is no copy
    total, per = ops.norm(ts, per_tensor=True)
    for k, (r, p) in enumerate(zip(ref, per)):
        want = (r.norm() if r.numel() else torch.zeros((), dtype=torch.float64)).float()  # as returned
        if torch.isfinite(want):
            assert abs(p.item() - want.item()) <= 1e-5 * max(1.0, want.item()), k
        else:
            assert not torch.isfinite(p), k
    ops.mul_(ts, 0.5)
    for t, r in zip(ts, ref):
        assert_bits_equal(t, (r * 0.5).to(t.dtype))


def test_fp16_refusal_and_type_errors_are_the_same(reader):
    from ampx.ops import _scaler_pass

    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        _scaler_pass([torch.randn(3), torch.randn(2).half()], 0, 1.0, torch.zeros(1), None, True, True, -1)
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch.int64"):
        ops.mul_([torch.randn(2), torch.arange(3)], 2.0)
    with pytest.raises(ValueError, match=r"tensors\[1\] is on device meta"):  # (all-meta runs the fake)
        ops.mul_([torch.randn(2), torch.empty(3, device="meta")], 2.0)
    with pytest.raises(ValueError, match="layout"):
        ops.mul_([torch.randn(2), torch.randn(3, 3).to_sparse()], 2.0)


def test_tensors_that_the_shim_declines_take_the_attribute_path(reader):
    """Subclasses, non-contiguous and expanded tensors are never read by the shim."""
    base = torch.arange(12, dtype=torch.float32)
    nc = base.view(3, 4)[:, 1]
    sub = torch.ones(4).as_subclass(Sub)
    ops.mul_([nc, sub], 2.0)
    assert torch.equal(base.view(3, 4)[:, 1], torch.tensor([2.0, 10.0, 18.0]))
    assert torch.equal(sub, torch.full((4,), 2.0))
    with pytest.raises(ValueError, match="overlap"):
        ops.mul_([torch.ones(1).expand(4)], 2.0)


def test_a_probe_that_disagrees_keeps_the_shim_off():
    prev = _C._set_tensor_shim()
    try:
        # A library that is not loaded: nothing is opened, the reason is given.
        why = _C._enable_tensor_shim("/nonexistent/libtorch_cpu.so", torch.nn.Parameter, [torch.randn(3)])
        if why is not None:  # the shim had not been opened before (e.g. not Linux)
            assert isinstance(why, str) and why
            assert not _C._set_tensor_shim()
        with pytest.raises(TypeError, match="plain tensors"):
            _C._enable_tensor_shim("/nonexistent/libtorch_cpu.so", torch.nn.Parameter,
                                   [torch.randn(3).as_subclass(Sub)])
        assert not _C._set_tensor_shim()
    finally:
        if prev:
            lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
            assert _C._enable_tensor_shim(lib, torch.nn.Parameter, ops._shim_probes()) is None
        assert _C._set_tensor_shim() == prev


def test_turning_on_needs_a_passed_probe_in_a_fresh_process():
    code = ("import ampx, sys\n"
            "from ampx import _C\n"
            "print(ampx.ops.tensor_reader())\n"
            "for switch in (_C._set_tensor_shim, _C._set_versions):\n"
            "    try:\n        switch(True)\n    except RuntimeError as e:\n        print('refused:', e)\n")
    env = dict(os.environ, AMPX_TENSOR_SHIM="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python attributes: turned off by AMPX_TENSOR_SHIM=0" in out.stdout
    for switch in ("_set_tensor_shim", "_set_versions"):
        assert f"refused: {switch}(True): the tensor shim did not pass its start-up probe" in out.stdout


def test_every_c_route_stays_off_after_a_failed_probe():
    """issue 29: where the shim opens but its probe fails (torch 2.9.1), no switch may turn on a C
    route that reads tensors through the unchecked layout (C's version bump segfaulted there);
    the routes on before a failed re-probe go off, and come back with a passing one."""
    before = (_C._set_tensor_shim(), _C._set_versions())

    def inside():
        assert (_C._set_tensor_shim(), _C._set_versions()) == (False, False)
        for switch in (_C._set_tensor_shim, _C._set_versions):
            with pytest.raises(RuntimeError, match=r"\(True\): the tensor shim did not pass its start-up probe"):
                switch(True)
        with pytest.raises(TypeError, match="the probed shim"):
            _C._shim_bump(torch.zeros(2))
        t = torch.zeros(3)
        version = t._version
        ops.mul_([t], 2.0)  # Python's bump, the attribute reader
        assert t._version == version + 1
        return "ran"

    assert ops._after_failed_probe(inside) == "ran"
    assert (_C._set_tensor_shim(), _C._set_versions()) == before


# ------------------------------------------------------------ negative bit --


def neg_view(t):
    v = torch._neg_view(t)
    assert v.is_neg()
    return v


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cast_reads_a_negated_source_by_its_values(reader, dst_dtype, rng):
    x = special_values(torch.float32, 300, rng)
    src = neg_view(x.clone())
    dst = torch.empty(300, dtype=dst_dtype)
    found = torch.zeros(1)
    ops.cast_([src], [dst], inv_scale=0.5, found_inf=found)
    assert_bits_equal(dst, (src.resolve_neg() * 0.5).to(dst_dtype))  # a float32 multiply, then the cast
    assert found.item() == float(not torch.isfinite(x).all())
    # A non-contiguous negated source too.
    base = torch.randn(20, 2)
    nc = neg_view(base)[:, 1]
    d2 = torch.empty(20)
    ops.cast_([nc], [d2])
    assert torch.equal(d2, -base[:, 1])


def test_cast_writes_a_negated_destination_by_its_values(reader):
    mem = torch.zeros(8)
    dst = neg_view(mem)
    src = torch.arange(8, dtype=torch.float32).bfloat16()
    ops.cast_([src], [dst])
    assert torch.equal(dst, src.float())          # what the caller reads
    assert torch.equal(mem, -src.float())         # what memory holds
    # Stochastic rounding into a negated bfloat16 destination: values, not stored bits.
    m2 = torch.zeros(1000, dtype=torch.bfloat16)
    s2 = torch.full((1000,), 1.0 + 2.0 ** -10)
    ops.cast_([s2], [neg_view(m2)], rounding="stochastic", seed=3)
    vals = neg_view(m2).resolve_neg().float()
    assert set(vals.unique().tolist()) <= {1.0, 1.0078125}
    assert (vals > 1.0).any() and (vals == 1.0).any()


@pytest.mark.parametrize("op", ["unscale_", "norm", "mul_"])
def test_scale_and_norm_ops_are_right_on_negated_tensors(reader, op, rng):
    x = special_values(torch.float32, 500, rng)
    v = neg_view(x.clone())
    want = v.resolve_neg()
    if op == "unscale_":
        found = torch.zeros(1)
        ops.unscale_([v], torch.full((1,), 0.5), found)
        assert_bits_equal(v.resolve_neg(), want * 0.5)
        assert found.item() == float(not torch.isfinite(x).all())
    elif op == "mul_":
        ops.mul_([v], 4.0)
        assert_bits_equal(v.resolve_neg(), want * 4.0)
    else:
        y = x.clone()
        y[~torch.isfinite(y)] = 1.0
        want = y.double().norm().float().item()  # rounded to the float32 the kernel returns
        assert ops.norm([neg_view(y)]).item() == pytest.approx(want, rel=1e-6)


# ------------------------------------------------------- import conditions --


@pytest.mark.parametrize("setup", [
    "torch.manual_seed(0); ctx = torch.no_grad()",
    "torch.manual_seed(0); ctx = torch.inference_mode()",
    "torch.manual_seed(0); torch.set_default_device('meta'); torch.set_default_dtype(torch.float64); "
    "ctx = contextlib.nullcontext()",
])
def test_import_works_in_any_grad_mode_and_default_device_and_leaves_the_rng_alone(setup):
    """The probe runs at import: it must not fail under no_grad/inference_mode or another
    default device, and must not draw random numbers (seeded runs stay reproducible)."""
    code = ("import contextlib, torch\n" + setup + "\n"
            "with ctx:\n    import ampx\n"
            "torch.set_default_device('cpu')\n"
            "print(ampx.ops.tensor_reader()); print(torch.rand(1, dtype=torch.float32).item())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reader, value = out.stdout.split("\n")[:2]
    if ON_LINUX:
        assert reader == "torch C shim", reader
    torch.manual_seed(0)
    assert float(value) == torch.rand(1).item()


def test_enable_refuses_a_parameter_type_that_is_not_a_tensor_class():
    prev = _C._set_tensor_shim()
    try:
        for bad in (int, Sub.__mro__[-1], 3):
            with pytest.raises(TypeError, match="parameter_type"):
                _C._enable_tensor_shim("/nonexistent", bad, [])
    finally:
        assert _C._set_tensor_shim() == prev


def test_writes_through_staged_copies_reach_leaves_that_require_grad(reader):
    """Non-contiguous or negated destinations are written through a copy and copied back;
    the copy-back bypasses autograd, so a Parameter (or a view of one) is no obstacle and
    no tensor is left half-written."""
    p = torch.nn.Parameter(torch.zeros(4, 2))
    first = torch.zeros(3)
    ops.cast_([torch.ones(3), torch.full((4,), 5.0)], [first, p[:, 0]])
    assert torch.equal(first, torch.ones(3))
    assert torch.equal(p.detach()[:, 0], torch.full((4,), 5.0)) and torch.equal(p.detach()[:, 1], torch.zeros(4))
    q = torch.nn.Parameter(torch.ones(4, 2))
    ops.mul_([q[:, 1]], 3.0)
    assert torch.equal(q.detach()[:, 1], torch.full((4,), 3.0)) and torch.equal(q.detach()[:, 0], torch.ones(4))
