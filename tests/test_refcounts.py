"""The C extension must release every reference it takes, on success and on error."""
import gc
import sys

import pytest
import torch

import ampx
from ampx import ops


def _calls():
    """(name, fn) pairs exercising every entry point and the slow paths."""
    x = torch.randn(300)
    y = torch.randn(40, 30).t()  # non-contiguous
    h = torch.randn(300).to(torch.bfloat16)
    fi = torch.zeros(1)
    fl = torch.zeros(3, dtype=torch.uint8)
    inv = torch.tensor([0.5])
    dst = [torch.empty(300, dtype=torch.bfloat16), torch.empty(30, 40).t(), torch.empty(300)]
    scale, tracker = torch.tensor([4.0]), torch.zeros(1, dtype=torch.int32)
    hyst = torch.full((1,), 2, dtype=torch.int32)
    # The extension takes references to the dtypes, the layout and bools while
    # reading tensors, and owns temporary contiguous copies: all must go back.
    shared = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int32,
              torch.strided, torch.sparse_coo]
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    params[0].grad = torch.ones(3)
    params[2].grad = torch.ones(3)
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    meta.grad = torch.zeros(3, device="meta")
    mixed = [{"params": params + [meta]}]
    mkldnn = torch.randn(4).to_mkldnn()  # grads on two devices: collect_grads lists them
    objs = [x, y, h, fi, fl, inv, scale, tracker, hyst, meta] + dst + shared + params + [p.grad for p in params[::2]]
    calls = [
        ("unscale_", lambda: ops.unscale_([x, y, h], inv, fi, flags=fl)),
        ("unscale_alias", lambda: ops.unscale_([x, x, y], 1.0, fi)),
        ("norm", lambda: ops.norm([x, y, h], per_tensor=True, factor=inv, found_inf=fi, flags=fl)),
        ("unscale_norm_", lambda: ops.unscale_norm_([x, y, h], 1.0, fi, per_tensor=True)),
        ("mul_", lambda: ops.mul_([x, y, h], 1.0)),
        ("check_finite", lambda: ops.check_finite([x, y, h], fi, flags=fl)),
        ("cast_", lambda: ops.cast_([x, y.t().contiguous().t(), h], dst, inv_scale=inv, found_inf=fi)),
        ("cast_sr", lambda: ops.cast_([x], [dst[0]], rounding="stochastic", seed=1, offset=2)),
        ("collect_grads", lambda: ampx._C.collect_grads(groups)),
        ("collect_grads_mixed", lambda: ampx._C.collect_grads(mixed)),
        ("update_scale_", lambda: ops.update_scale_(scale, tracker, fi, 2.0, 0.5, 10, hysteresis=2,
                                                     hysteresis_tracker=hyst)),
    ]
    bad = [
        ("bad_dtype", lambda: ops.unscale_([x, torch.zeros(3, dtype=torch.int64)], 1.0, fi)),
        ("bad_device", lambda: ops.norm([x, torch.zeros(3, device="meta")])),
        ("bad_flags", lambda: ops.unscale_([x, y], 1.0, fi, flags=fl)),
        ("bad_overlap", lambda: ops.unscale_([torch.zeros(1).expand(4)], 1.0, fi)),
        ("bad_cast_alias", lambda: ops.cast_([x, x], [dst[2], dst[2]])),
        ("bad_sparse", lambda: ops.norm([torch.zeros(3).to_sparse()])),
        ("bad_type", lambda: ops.norm([x, "nope"])),
        ("bad_param", lambda: ampx._C.collect_grads([{"params": [params[0], 3]}])),
        ("bad_no_storage", lambda: ops.unscale_([x, mkldnn], 1.0, fi)),  # torch's error, re-worded
    ]
    return objs, calls, bad


@pytest.mark.parametrize("index", range(11))
def test_no_reference_leaks_on_success(index):
    objs, calls, _ = _calls()
    name, fn = calls[index]
    fn()
    gc.collect()
    before = [sys.getrefcount(o) for o in objs]
    for _ in range(50):
        fn()
    gc.collect()
    after = [sys.getrefcount(o) for o in objs]
    # A leak adds a reference per call (50 here); torch itself may move a count by one.
    assert all(a - b < 10 for a, b in zip(after, before)), (name, before, after)


def _live_tensors():
    gc.collect()
    # type() rather than isinstance(): isinstance probes a deprecated torch.distributed
    # module object that warns.
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_no_tensor_leaks():
    objs, calls, bad = _calls()
    for _, fn in calls:
        fn()
    before = _live_tensors()
    for _ in range(20):
        for _, fn in calls:
            fn()
        for _, fn in bad:
            _raise_and_forget(fn)
    assert _live_tensors() <= before


def _raise_and_forget(fn):
    try:
        fn()
    except (TypeError, ValueError, AssertionError):
        return
    raise AssertionError("no error raised")


@pytest.mark.parametrize("index", range(8))
def test_no_reference_leaks_on_error(index):
    objs, _, bad = _calls()
    name, fn = bad[index]
    for _ in range(3):
        _raise_and_forget(fn)
    gc.collect()
    before = [sys.getrefcount(o) for o in objs]
    for _ in range(50):
        _raise_and_forget(fn)
    gc.collect()
    after = [sys.getrefcount(o) for o in objs]
    # A leak adds a reference per call (50 here); a count that drops is a cache
    # (a traceback) letting go, not ours.
    assert all(a - b < 10 for a, b in zip(after, before)), (name, before, after)
