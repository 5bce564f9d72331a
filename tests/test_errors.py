"""Bad input: the right exception type, a message naming the argument,
position and dtype/device, and every tensor left exactly as it was.

Covers non-floating, complex, non-tensor, meta, sparse and expanded tensors, tensors
on another device than the list's (on every device), bad auxiliary arguments
(found_inf, flags, inv_scale, ord, rounding, seed/offset), cast_ length and size
mismatches and shared memory, update_scale_'s arguments, and the SIMD/thread settings.
"""
import math
import re

import numpy as np
import pytest
import torch

import ampx
from ampx import ops
from conftest import assert_exactly_equal

OPS = ["unscale_", "check_finite", "norm", "unscale_norm_", "mul_", "cast_src", "cast_dst"]


def good_list():
    return [torch.randn(10), torch.randn(3, 4).half(), torch.randn(5).bfloat16(), torch.randn(7, dtype=torch.float64)]


def snapshot(objs):
    return [o.clone() if isinstance(o, torch.Tensor) and o.device.type == "cpu" and o.layout == torch.strided else o
            for o in objs]


def assert_untouched(objs, snap):
    for o, s in zip(objs, snap):
        if isinstance(o, torch.Tensor) and o.device.type == "cpu" and o.layout == torch.strided:
            assert_exactly_equal(o, s, "a tensor was modified by a call that raised")


def call(op, tensors, found=None, flags=None):
    """Runs `op` with `tensors` as its (first) tensor list."""
    if op == "unscale_":
        ops.unscale_(tensors, 0.5, found, flags=flags)
    elif op == "check_finite":
        ops.check_finite(tensors, torch.zeros(1) if found is None else found, flags=flags)
    elif op == "norm":
        ops.norm(tensors, found_inf=found, flags=flags)
    elif op == "unscale_norm_":
        ops.unscale_norm_(tensors, 0.5, found, flags=flags)
    elif op == "mul_":
        ops.mul_(tensors, 0.5)
    elif op == "cast_src":
        dst = [torch.empty(t.numel()) if isinstance(t, torch.Tensor) and t.layout == torch.strided else torch.empty(1)
               for t in tensors]
        ops.cast_(tensors, dst, found_inf=found, flags=flags)
    elif op == "cast_dst":
        src = [torch.ones(t.numel()) if isinstance(t, torch.Tensor) and t.layout == torch.strided else torch.ones(1)
               for t in tensors]
        ops.cast_(src, tensors, found_inf=found, flags=flags)
    else:  # pragma: no cover
        raise AssertionError(op)


def arg_name(op):
    return {"cast_src": "src", "cast_dst": "dst"}.get(op, "tensors")


def check_bad_element(op, bad, exc, patterns, position=2):
    tensors = good_list()
    tensors.insert(position, bad)
    found = torch.zeros(1)
    flags = torch.full((len(tensors),), 7, dtype=torch.uint8)
    snap = snapshot(tensors + [found, flags])
    with pytest.raises(exc) as info:
        call(op, tensors, found, flags)
    msg = str(info.value)
    assert f"{arg_name(op)}[{position}]" in msg, msg
    for p in patterns:
        assert re.search(p, msg), (p, msg)
    assert_untouched(tensors + [found, flags], snap)
    # the bad tensor itself is untouched too
    if isinstance(bad, torch.Tensor) and bad.layout == torch.strided and bad.device.type == "cpu":
        assert torch.equal(bad, snap[position])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8, torch.int8])
def test_non_floating_dtype_is_type_error(op, dtype):
    bad = torch.ones(6, dtype=dtype)
    check_bad_element(op, bad, TypeError, [re.escape(str(dtype))])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_dtype_is_type_error(op, dtype):
    check_bad_element(op, torch.ones(6, dtype=dtype), TypeError, [re.escape(str(dtype))])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad", [3.0, None, [1.0, 2.0], np.ones(3, dtype=np.float32), "x"], ids=repr)
def test_non_tensor_element_is_type_error(op, bad):
    check_bad_element(op, bad, TypeError, ["Tensor"], position=1)


@pytest.mark.parametrize("op", OPS)
def test_meta_device_is_value_error_naming_device(op):
    check_bad_element(op, torch.empty(6, device="meta"), ValueError, ["meta"], position=3)


def test_tensor_on_another_device_names_position_and_device(device):
    """A list on one device with a tensor or an output elsewhere: a ValueError naming the
    argument, its position and the device, before anything is written. Elsewhere is the meta
    device for a CPU list (refused outright) and the CPU for a CUDA list."""
    other = "meta" if device == "cpu" else "cpu"
    good = [torch.randn(10, device=device), torch.randn(5, device=device).bfloat16()]
    on = rf"is on (device )?{other}"
    with pytest.raises(ValueError, match=rf"tensors\[2\] {on}" + (".*cuda:0" if device == "cuda" else "")):
        ops.unscale_(good + [torch.ones(3, device=other)], 0.5, torch.zeros(1, device=device))
    with pytest.raises(ValueError, match=rf"found_inf {on}"):
        ops.unscale_(good, 0.5, torch.zeros(1, device=other))
    with pytest.raises(ValueError, match=rf"flags {on}"):
        ops.norm(good, flags=torch.zeros(2, dtype=torch.uint8, device=other))
    with pytest.raises(ValueError, match=rf"dst\[0\] {on}"):
        ops.cast_(good, [torch.empty(10, device=other), torch.empty(5, device=other)])
    with pytest.raises(ValueError, match=rf"growth_tracker {on}"):
        ops.update_scale_(torch.ones(1, device=device), torch.zeros(1, dtype=torch.int32, device=other),
                          torch.zeros(1, device=device), 2.0, 0.5, 10)
    with pytest.raises(TypeError, match=r"tensors\[1\].*int64"):
        ops.norm([good[0], torch.ones(3, dtype=torch.int64, device=device)])
    index = -1 if device == "cpu" else torch.device(device).index or 0  # the scaler's device index
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        ops._scaler_pass([torch.ones(3, dtype=torch.float16, device=device)], 0, 0.5,
                         torch.zeros(1, device=device), None, True, True, index)
    x = good[0].clone()
    with pytest.raises(ValueError):
        ops.unscale_([good[0], torch.ones(3, device=other)], 0.5, None)
    assert torch.equal(good[0], x)  # nothing written before the error


@pytest.mark.parametrize("op", OPS)
def test_sparse_tensor_is_value_error(op):
    sp = torch.eye(3).to_sparse()
    check_bad_element(op, sp, ValueError, ["sparse", "layout"], position=0)


@pytest.mark.filterwarnings("ignore:Sparse CSR")
@pytest.mark.parametrize("op", ["unscale_", "check_finite", "norm", "mul_"])
def test_sparse_csr_tensor_is_value_error(op):
    check_bad_element(op, torch.eye(3).to_sparse_csr(), ValueError, ["layout"], position=1)


@pytest.mark.parametrize("op", ["unscale_", "check_finite", "norm", "mul_", "cast_"])
def test_not_a_sequence_is_type_error(op):
    with pytest.raises(TypeError, match="must be a Tensor or a sequence"):
        if op == "unscale_":
            ops.unscale_(5, 0.5, torch.zeros(1))
        elif op == "check_finite":
            ops.check_finite(1.5, torch.zeros(1))
        elif op == "norm":
            ops.norm(3.0)
        elif op == "mul_":
            ops.mul_(None, 2.0)
        else:
            ops.cast_(7, [torch.ones(1)])


# ------------------------------------------------------ auxiliary tensors --


def _aux_call(op, tensors, **kw):
    if op == "unscale_":
        ops.unscale_(tensors, kw.get("factor", 0.5), kw.get("found_inf", torch.zeros(1)), flags=kw.get("flags"))
    elif op == "unscale_norm_":
        ops.unscale_norm_(tensors, kw.get("factor", 0.5), kw.get("found_inf", torch.zeros(1)), flags=kw.get("flags"))
    elif op == "norm":
        ops.norm(tensors, factor=kw.get("factor"), found_inf=kw.get("found_inf"), flags=kw.get("flags"))
    elif op == "check_finite":
        ops.check_finite(tensors, kw.get("found_inf", torch.zeros(1)), flags=kw.get("flags"))
    elif op == "mul_":
        ops.mul_(tensors, kw.get("factor", 0.5))
    else:
        ops.cast_(tensors, [torch.empty(t.shape, dtype=torch.bfloat16) for t in tensors],
                  inv_scale=kw.get("factor"), found_inf=kw.get("found_inf"), flags=kw.get("flags"))


BAD_AUX = [
    ("found_inf", torch.zeros(1, dtype=torch.float64), TypeError, "found_inf.*float32"),
    ("found_inf", torch.zeros(1, dtype=torch.float16), TypeError, "found_inf.*float32"),
    ("found_inf", torch.zeros(1, dtype=torch.int32), TypeError, "found_inf"),
    ("found_inf", torch.zeros(2), ValueError, "found_inf.*1 element"),
    ("found_inf", torch.zeros(0), ValueError, "found_inf"),
    ("found_inf", 0.0, TypeError, "found_inf"),
    ("found_inf", torch.zeros(1, device="meta"), ValueError, "found_inf.*meta"),
    ("flags", torch.zeros(4, dtype=torch.int32), TypeError, "flags.*uint8"),
    ("flags", torch.zeros(4, dtype=torch.bool), TypeError, "flags"),
    ("flags", torch.zeros(3, dtype=torch.uint8), ValueError, "flags.*4"),
    ("flags", torch.zeros(5, dtype=torch.uint8), ValueError, "flags.*4"),
    ("flags", torch.zeros(8, dtype=torch.uint8)[::2], ValueError, "flags.*contiguous"),
    ("flags", [0, 0, 0, 0], TypeError, "flags"),
    ("factor", torch.tensor([0.5], dtype=torch.float64), TypeError, "float32"),
    ("factor", torch.tensor([0.5, 0.5]), ValueError, "1 element"),
    ("factor", "0.5", TypeError, "Tensor"),
    ("factor", np.float32(0.5), TypeError, "Tensor"),
    ("factor", torch.ones(1, device="meta"), ValueError, "meta"),
]


def _aux_params():
    for op in ("unscale_", "check_finite", "unscale_norm_", "norm", "mul_", "cast_"):
        for k, (which, bad, exc, pattern) in enumerate(BAD_AUX):
            if op == "mul_" and which != "factor":
                continue  # mul_ has no found_inf / flags
            if op == "check_finite" and which == "factor":
                continue  # nor has check_finite a factor
            yield pytest.param(op, which, bad, exc, pattern, id=f"{op}-{which}-{k}")


@pytest.mark.parametrize("op,which,bad,exc,pattern", list(_aux_params()))
def test_bad_auxiliary_argument(op, which, bad, exc, pattern):
    tensors = good_list()
    keep = torch.zeros(1)
    snap = snapshot(tensors + [keep, bad])
    kw = {which: bad}
    if which != "found_inf" and op in ("unscale_", "check_finite", "unscale_norm_", "cast_", "norm"):
        kw["found_inf"] = keep
    with pytest.raises(exc) as info:
        _aux_call(op, tensors, **kw)
    assert re.search(pattern, str(info.value)), str(info.value)
    assert_untouched(tensors + [keep, bad], snap)


@pytest.mark.parametrize("op", ["unscale_", "unscale_norm_"])
def test_bad_inv_scale_message_names_inv_scale(op):
    with pytest.raises(ValueError, match="inv_scale"):
        _aux_call(op, [torch.ones(3)], factor=torch.ones(2))


def test_cast_bad_inv_scale_names_inv_scale():
    with pytest.raises(ValueError, match="inv_scale"):
        ops.cast_([torch.ones(3)], [torch.ones(3)], inv_scale=torch.ones(2))


def test_norm_bad_ord_leaves_outputs_alone():
    found = torch.zeros(1)
    x = torch.tensor([math.inf])
    with pytest.raises(ValueError, match="ord"):
        ops.norm([x], 3, found_inf=found)
    assert found.item() == 0.0


# ------------------------------------------------------------------ cast_ --


def test_cast_length_mismatch():
    src, dst = [torch.ones(3), torch.ones(2)], [torch.zeros(3)]
    with pytest.raises(ValueError, match="src has 2 tensors but dst has 1"):
        ops.cast_(src, dst)
    assert dst[0].tolist() == [0.0, 0.0, 0.0]


def test_cast_element_count_mismatch_names_position():
    src = [torch.ones(3), torch.ones(4), torch.ones(5)]
    dst = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(6)]
    with pytest.raises(ValueError, match=r"src\[2\] has 5 elements but dst\[2\] has 6"):
        ops.cast_(src, dst)
    assert all((d == 0).all() for d in dst)


@pytest.mark.parametrize("dst_dtype", [torch.float16, torch.float32, torch.float64])
def test_cast_stochastic_needs_bfloat16(dst_dtype):
    src = [torch.ones(3), torch.ones(3)]
    dst = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=dst_dtype)]
    found = torch.zeros(1)
    with pytest.raises(ValueError, match=r"dst\[1\].*" + re.escape(str(dst_dtype))):
        ops.cast_([s * math.inf for s in src], dst, rounding="stochastic", found_inf=found)
    assert all((d == 0).all() for d in dst) and found.item() == 0.0


@pytest.mark.parametrize("rounding", ["Nearest", "stochastic ", "up", "", None, 0])
def test_cast_bad_rounding(rounding):
    dst = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rounding"):
        ops.cast_(torch.ones(3), dst, rounding=rounding)
    assert (dst == 0).all()


@pytest.mark.parametrize("name", ["seed", "offset"])
@pytest.mark.parametrize("value", [-1, 2**64, 1.0, True, "1", None, -(2**70)], ids=repr)
def test_cast_bad_seed_offset(name, value):
    dst = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=name):
        ops.cast_(torch.ones(3) / 3, dst, rounding="stochastic", **{name: value})
    assert (dst == 0).all()


def test_cast_seed_offset_extremes_accepted():
    dst = torch.zeros(3, dtype=torch.bfloat16)
    ops.cast_(torch.ones(3), dst, rounding="stochastic", seed=2**64 - 1, offset=2**64 - 1)
    assert dst.tolist() == [1.0, 1.0, 1.0]


def _overlap_cases():
    buf = torch.zeros(20)
    yield "two dsts overlap", [torch.ones(10), torch.ones(10)], [buf[0:10], buf[5:15]], buf
    buf = torch.zeros(20)
    yield "same dst twice", [torch.ones(10), torch.ones(10)], [buf[0:10], buf[0:10]], buf
    buf = torch.arange(20.0)
    yield "dst[0] is src[1]", [torch.ones(10), buf[0:10]], [buf[0:10], torch.zeros(10)], buf
    buf = torch.arange(20.0)
    yield "dst partly over its own src", [buf[0:10]], [buf[2:12]], buf
    buf = torch.arange(20.0)
    yield "dst over src, other dtype", [buf[0:10]], [buf[0:10].view(torch.float16)[:10]], buf
    h = torch.ones(10, dtype=torch.float16)
    yield "same memory, other dtype", [h], [h.view(torch.bfloat16)], h


@pytest.mark.parametrize("case", list(range(6)))
def test_cast_shared_memory_is_refused(case):
    name, src, dst, buf = list(_overlap_cases())[case]
    snap = buf.clone()
    with pytest.raises(ValueError, match="share memory"):
        ops.cast_(src, dst)
    assert_exactly_equal(buf, snap, name)


def _nc_overlap_cases():
    buf = torch.arange(16.0).reshape(4, 4)
    yield "dsts: a transposed view and the buffer", [torch.ones(16), torch.full((16,), 2.0)], [buf.t(), buf], buf
    buf = torch.arange(16.0).reshape(4, 4)
    yield "src is a transposed view of dst", [buf.t()], [buf], buf
    buf = torch.arange(16.0).reshape(4, 4)
    yield "dst is a transposed view of src", [buf], [buf.t()], buf
    buf = torch.arange(32.0)
    yield "src[1] strided view over dst[0]", [torch.ones(16), buf[::2]], [buf[:16], torch.zeros(16)], buf


@pytest.mark.parametrize("case", list(range(4)))
def test_cast_shared_memory_through_noncontiguous_view_is_refused(case):
    name, src, dst, buf = list(_nc_overlap_cases())[case]
    snap = buf.clone()
    with pytest.raises(ValueError, match="share memory"):
        ops.cast_(src, dst)
    assert_exactly_equal(buf, snap, name)


def test_cast_exact_alias_allowed_but_not_other_index():
    x = torch.ones(8)
    ops.cast_([x], [x], inv_scale=2.0)
    assert x.tolist() == [2.0] * 8
    y = torch.ones(8)
    with pytest.raises(ValueError, match="share memory"):
        ops.cast_([x, y], [y, x])
    assert x.tolist() == [2.0] * 8 and y.tolist() == [1.0] * 8


# ------------------------------------------------------- internal overlap --


@pytest.mark.parametrize("op", ["unscale_", "unscale_norm_", "mul_", "cast_dst"])
def test_expanded_tensor_cannot_be_written(op):
    base = torch.tensor([3.0])
    exp = base.expand(6)
    good = torch.ones(4)
    tensors = [good, exp]
    found = torch.zeros(1)
    with pytest.raises(ValueError, match=r"\[1\].*internal overlap"):
        if op == "cast_dst":
            ops.cast_([torch.ones(4), torch.ones(6)], tensors)
        elif op == "mul_":
            ops.mul_(tensors, 0.5)
        else:
            getattr(ops, op)(tensors, 0.5, found)
    assert base.item() == 3.0 and good.tolist() == [1.0] * 4 and found.item() == 0.0
    # reading it is fine
    assert ops.norm(exp, 1).item() == 18.0
    d = torch.empty(6)
    ops.cast_(exp, d)
    assert d.tolist() == [3.0] * 6


@pytest.mark.parametrize("op", ["unscale_", "mul_", "cast_dst"])
def test_overlapping_as_strided_view_cannot_be_written(op):
    base = torch.arange(10.0)
    view = base.as_strided((4, 4), (2, 1))  # rows overlap: element 2 is view[0,2] and view[1,0]
    snap = base.clone()
    with pytest.raises(ValueError, match="overlap"):
        if op == "cast_dst":
            ops.cast_([torch.ones(16)], [view])
        elif op == "mul_":
            ops.mul_([view], 0.5)
        else:
            ops.unscale_([view], 0.5, torch.zeros(1))
    assert_exactly_equal(base, snap)


# ----------------------------------------------------------- update_scale_ --


def _us_args():
    return torch.tensor([1024.0]), torch.tensor([3], dtype=torch.int32), torch.zeros(1)


BAD_UPDATE = [
    (dict(scale=torch.tensor([1.0], dtype=torch.float64)), TypeError, "scale.*float32"),
    (dict(scale=torch.tensor([1.0, 2.0])), ValueError, "scale.*1 element"),
    (dict(scale=1024.0), TypeError, "scale"),
    (dict(scale=torch.ones(1, device="meta")), ValueError, "scale.*meta"),
    (dict(growth_tracker=torch.tensor([0], dtype=torch.int64)), TypeError, "growth_tracker.*int32"),
    (dict(growth_tracker=torch.tensor([0.0])), TypeError, "growth_tracker"),
    (dict(growth_tracker=torch.zeros(2, dtype=torch.int32)), ValueError, "growth_tracker"),
    (dict(found_inf=torch.ones(1, dtype=torch.float64)), TypeError, "found_inf"),
    (dict(found_inf=torch.ones(2)), ValueError, "found_inf"),
    (dict(hysteresis=0), ValueError, "hysteresis"),
    (dict(hysteresis=-3, hysteresis_tracker=torch.ones(1, dtype=torch.int32)), ValueError, "hysteresis"),
    (dict(hysteresis=2), ValueError, "hysteresis_tracker"),
    (dict(hysteresis=2, hysteresis_tracker=torch.ones(1)), TypeError, "hysteresis_tracker"),
    (dict(hysteresis=2, hysteresis_tracker=torch.ones(2, dtype=torch.int32)), ValueError, "hysteresis_tracker"),
]


@pytest.mark.parametrize("kw,exc,pattern", BAD_UPDATE, ids=lambda v: str(v)[:40] if isinstance(v, dict) else "")
def test_update_scale_bad_input(kw, exc, pattern):
    scale, tracker, found = _us_args()
    found.fill_(1.0)
    args = dict(scale=scale, growth_tracker=tracker, found_inf=found)
    extras = {k: v for k, v in kw.items() if k not in args}
    args.update({k: v for k, v in kw.items() if k in args})
    snap = snapshot([scale, tracker, found])
    with pytest.raises(exc) as info:
        ops.update_scale_(args["scale"], args["growth_tracker"], args["found_inf"], 2.0, 0.5, 10, **extras)
    assert re.search(pattern, str(info.value)), str(info.value)
    assert_untouched([scale, tracker, found], snap)


# ------------------------------------------------------------ test hooks --


def test_set_simd_rejects_unknown_and_restores():
    prev = ops.simd_level()
    with pytest.raises(ValueError, match="unknown SIMD level"):
        ampx._C.set_simd("sse9")
    assert ops.simd_level() == prev
    for level in ops.available_simd_levels():
        old = ampx._C.set_simd(level)
        assert ops.simd_level() == level
        assert ampx._C.set_simd(old) == level
    assert ops.simd_level() == prev
    assert ops.available_simd_levels()[-1] == "portable"


def test_set_parallel_threshold_rejects_negative():
    with pytest.raises(ValueError):
        ampx._C.set_parallel_threshold(-1)
    prev = ampx._C.set_parallel_threshold(123)
    assert ampx._C.set_parallel_threshold(prev) == 123
