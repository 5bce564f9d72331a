"""Coalesced views (issue 17): back-to-back tensors streamed as one span.

When consecutive tensors of a list are contiguous views lying back to back in memory (DDP's
bucket views, FSDP's flat parameters, a gradient buffer), the CPU kernels run them as one span
when no per-tensor reduction is asked for; per-tensor flags stay per tensor. Covers, against
float64 references and against the same call with coalescing off: runs of views of every op,
sizes either side of the chunk and vector boundaries, dtypes mixed inside a buffer's list, gaps,
reversed order, non-contiguous and zero-size views, overlapping views (never merged; writes
still take the one-at-a-time path), inf/NaN in one view reported at its own index, factors for
which flags cannot be told apart after a write (the per-tensor path then), and that coalescing
really happened where it should (ampx._C._last_spans).
"""
import math

import pytest
import torch

import ampx
from ampx import ops
from conftest import (
    CHUNK,
    assert_bits_equal,
    assert_norm_close,
    expected_flags,
    finite_values,
    force_threads,
    norm_ref64,
    special_values,
    switched,
    unscale_ref,
)

# sizes either side of the vector widths (8, 16) and of the chunk
EDGE_SIZES = [1, 7, 8, 9, 15, 16, 17, 1000, CHUNK - 1, CHUNK, CHUNK + 1, 3, 0, 2 * CHUNK + 5]


def coalescing(on):
    return switched(ampx._C._set_coalesce, on)


def views(buf, sizes):
    """Back-to-back views of buf with these element counts, shaped 1-D."""
    return list(torch.split(buf[: sum(sizes)], sizes))


def filled(dtype, n, rng, special):
    return special_values(dtype, n, rng, p_special=0.002) if special else finite_values(dtype, n, rng)


# ---- layouts -------------------------------------------------------------------------------


def layout_runs(rng, special):
    return views(filled(torch.float32, sum(EDGE_SIZES), rng, special), EDGE_SIZES)


def layout_mixed_dtypes(rng, special):
    a = views(filled(torch.float32, 3000, rng, special), [1000, 17, 1983])
    b = views(filled(torch.bfloat16, 2000, rng, special), [999, 1001])
    c = views(filled(torch.float16, 64, rng, special), [16, 48])
    d = views(filled(torch.float64, 40, rng, special), [9, 31])
    # a buffer's bytes read as another dtype lie back to back with the first, but never merge
    e = filled(torch.float32, 200, rng, special)
    return a[:2] + b + c + [a[2]] + d + [e[:100], e[100:].view(torch.bfloat16)[:100]]


def layout_gaps(rng, special):
    buf = filled(torch.float32, 5000, rng, special)
    return [buf[0:1000], buf[1001:2000], buf[2000:3000], buf[3008:4000], buf[4000:5000]]


def layout_reversed(rng, special):
    return views(filled(torch.float32, 6000, rng, special), [1000, 2000, 3000])[::-1]


def layout_zigzag(rng, special):
    # grows at both ends: the middle third, the last, then the first
    v = views(filled(torch.float32, 6000, rng, special), [2000, 2000, 2000])
    return [v[1], v[2], v[0]]


def layout_zero_sizes(rng, special):
    buf = filled(torch.float32, 3000, rng, special)
    return [buf[:0], buf[0:1000], buf[1000:1000], buf[1000:3000], buf[3000:], torch.empty(0)]


def layout_non_contiguous(rng, special):
    buf = filled(torch.float32, 4000, rng, special)
    return [buf[0:1000], buf[1000:2000].view(20, 50).t(), buf[2000:3000], buf[3000:4000]]


def layout_separate(rng, special):
    return [filled(torch.float32, n, rng, special) for n in (1000, 17, 1000)]


LAYOUTS = {
    "runs": layout_runs,
    "mixed_dtypes": layout_mixed_dtypes,
    "gaps": layout_gaps,
    "reversed": layout_reversed,
    "zigzag": layout_zigzag,
    "zero_sizes": layout_zero_sizes,
    "non_contiguous": layout_non_contiguous,
    "separate": layout_separate,
}


def fresh(layout, rng, special):
    """The layout built on fresh memory, and clones of its tensors (the reference's inputs)."""
    ts = LAYOUTS[layout](rng, special)
    return ts, [t.clone() for t in ts]


# ---- the ops against float64 references ------------------------------------------------------


@pytest.mark.parametrize("special", [False, True], ids=["finite", "special"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("factor", [0.5, 1.0, 3.0, 2.0**-20])
def test_unscale_norm_with_flags_matches_float64(simd, layout, factor, special, rng):
    ts, orig = fresh(layout, rng, special)
    found = torch.zeros(1)
    flags = torch.zeros(len(ts), dtype=torch.uint8)
    total = ops.unscale_norm_(ts, factor, found, flags=flags)
    stored = [unscale_ref(t, factor) for t in orig]
    for i, (t, r) in enumerate(zip(ts, stored)):
        assert_bits_equal(t, r, f"tensor {i}")
    assert flags.tolist() == expected_flags(orig)
    assert found.item() == (1.0 if any(expected_flags(orig)) else 0.0)
    assert_norm_close(total.item(), norm_ref64(stored, 2)[0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("ord", [2.0, 1.0, math.inf])
def test_read_only_ops_match_float64(simd, layout, ord, rng):
    ts, orig = fresh(layout, rng, True)
    found = torch.zeros(1)
    flags = torch.zeros(len(ts), dtype=torch.uint8)
    total = ops.norm(ts, ord, factor=0.25, found_inf=found, flags=flags)
    for t, o in zip(ts, orig):
        assert_bits_equal(t, o, "norm is read-only")
    assert flags.tolist() == expected_flags(orig)
    assert_norm_close(total.item(), norm_ref64([unscale_ref(t, 0.25) for t in orig], ord)[0])
    found.zero_()
    flags.zero_()
    ops.check_finite(ts, found, flags=flags)
    assert flags.tolist() == expected_flags(orig)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unscale_and_mul_store_the_bits_of_the_per_tensor_path(simd, threaded, layout, rng):
    ts, orig = fresh(layout, rng, True)
    twin = [t.clone() for t in ts]
    found, found2 = torch.zeros(1), torch.zeros(1)
    ops.unscale_(ts, 0.125, found)
    ops.mul_(ts, 3.0)
    with coalescing(False):
        ops.unscale_(twin, 0.125, found2)
        ops.mul_(twin, 3.0)
    for i, (a, b, o) in enumerate(zip(ts, twin, orig)):
        assert_bits_equal(a, b, f"tensor {i}")
        assert_bits_equal(a, unscale_ref(unscale_ref(o, 0.125), 3.0), f"tensor {i} vs reference")
    assert found.item() == found2.item()


# ---- one bad view among thousands ----------------------------------------------------------


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, 1, 2047, 4095])
def test_a_non_finite_value_is_reported_at_its_own_index(simd, bad, where, rng):
    buf = finite_values(torch.float32, 4096 * 100, rng)
    ts = list(buf.split(100))
    ts[where][37] = bad
    flags = torch.zeros(len(ts), dtype=torch.uint8)
    found = torch.zeros(1)
    ops.unscale_(ts, 0.5, found, flags=flags)
    assert ampx._C._last_spans() == 1
    want = [0] * len(ts)
    want[where] = ops.FLAG_NAN if math.isnan(bad) else ops.FLAG_INF
    assert flags.tolist() == want
    assert found.item() == 1.0


def test_the_scaler_names_the_overflowing_view(rng):
    """The scaler's pass on gradients that are views of one buffer (a gradient buffer / DDP
    bucket): the overflow flags land on the right parameter."""
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    for p, g in zip(params, torch.split(flat, [p.numel() for p in params])):
        p.grad = g.view_as(p)
    flat.copy_(torch.randn(flat.numel()))
    params[5].grad[3] = math.inf
    found = torch.zeros(1)
    flags = torch.zeros(len(params), dtype=torch.uint8)
    total = ops._scaler_pass([p.grad for p in params], ampx._C.REDUCE_SUMSQ, torch.tensor([2.0**-10]), found,
                             flags, True, False, -1)
    assert ampx._C._last_spans() == 1
    assert flags.tolist() == [ops.FLAG_INF if i == 5 else 0 for i in range(len(params))]
    assert math.isinf(total.item())


# ---- when spans are used, and when not -----------------------------------------------------


def test_views_of_one_buffer_run_as_one_span(rng):
    ts = views(finite_values(torch.float32, 10_000 * 3, rng), [3] * 10_000)
    ops.unscale_(ts, 0.5, torch.zeros(1))
    assert ampx._C._last_spans() == 1
    ops.norm(ts)
    assert ampx._C._last_spans() == 1
    ops.norm(ts, per_tensor=True)  # per-tensor norms: tensor by tensor
    assert ampx._C._last_spans() == -1
    ops.unscale_(ts, 2.0, None, flags=torch.zeros(len(ts), dtype=torch.uint8))  # flags not recoverable
    assert ampx._C._last_spans() == -1
    ops.unscale_(ts, 2.0, None)  # no flags wanted: any factor
    assert ampx._C._last_spans() == 1
    with coalescing(False):
        ops.norm(ts)
    assert ampx._C._last_spans() == -1


def test_spans_follow_the_layout(rng):
    ops.norm(layout_mixed_dtypes(rng, False))
    assert ampx._C._last_spans() == -1  # 12 tensors, 9 runs: not worth it
    ops.norm(layout_runs(rng, False))
    assert ampx._C._last_spans() == 1
    ops.norm(layout_zero_sizes(rng, False))
    assert ampx._C._last_spans() == 1
    ops.norm(layout_gaps(rng, False))
    assert ampx._C._last_spans() == -1
    ops.norm(layout_reversed(rng, False))
    assert ampx._C._last_spans() == 1  # descending, as DDP's bucket views lie
    ops.norm(layout_zigzag(rng, False))
    assert ampx._C._last_spans() == 1
    ops.unscale_(layout_non_contiguous(rng, False), 0.5, None)
    assert ampx._C._last_spans() == -1  # staged: one at a time


def test_overlapping_views_never_merge(simd, rng):
    buf = finite_values(torch.float32, 3000, rng)
    ts = [buf[0:1000], buf[1000:2000], buf[1000:2000], buf[2000:3000]]
    # a read: the duplicate counts twice
    total = ops.norm(ts, 1.0)
    assert ampx._C._last_spans() == 2  # [0, 1] and [2, 3]: the repeat starts a new span
    assert_norm_close(total.item(), norm_ref64(ts, 1.0)[0])
    # a write: applied tensor by tensor in list order, as before
    orig = buf.clone()
    ops.mul_(ts, 0.5)
    assert ampx._C._last_spans() == -1
    want = orig.clone()
    want[1000:2000] *= 0.25
    want[:1000] *= 0.5
    want[2000:] *= 0.5
    assert_bits_equal(buf, want)
    half = [buf[0:1000], buf[500:1500]]
    with pytest.raises(ValueError, match="share memory"):
        ops.cast_([torch.zeros(1000), torch.zeros(1000)], half)


def test_threads_give_the_same_bits_on_spans(rng):
    ts = views(special_values(torch.float32, 700 * 1000, rng, p_special=0.0), [700] * 1000)
    one = ops.norm(ts)
    with force_threads(4):
        for _ in range(3):
            assert ops.norm(ts).item() == one.item()
