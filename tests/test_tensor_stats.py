"""ampx.ops.tensor_stats: one row per tensor (ampx/stats.py's layout) from one read, against
ampx.stats.reference (plain torch ops in float64) on every SIMD level, one thread and several,
at sizes either side of every vector (8, 16 lanes, the 2 x 16 unrolled loop), the 4-table
histogram, chunk and task boundary; on data with +-inf, NaN, -0.0, subnormals of every
format and the formats' extremes. Then what it refuses, and the torch op torch sees. (The CUDA
kernel: test_tensor_stats_cuda.py.)"""
import math

import pytest
import torch

from ampx import _C, ops
from ampx import stats as S

from conftest import CUDA, force_threads, special_values, use_simd

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# either side of 1, 8 (AVX2), 16 (AVX-512), 32 (the unrolled pair), 64, a chunk (65536)
SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 65535, 65536, 65537]
INF, NAN = math.inf, math.nan


def _assert_rows(got, tensors, msg=""):
    want = S.reference(tensors)
    assert got.dtype == torch.float64 and got.shape == (len(tensors), S.WIDTH), (got.shape, msg)
    for i in range(len(tensors)):
        bad = (got[i] != want[i]).nonzero().flatten().tolist()
        assert not bad, (msg, i, tensors[i].dtype, tensors[i].numel(),
                         [(j, got[i, j].item(), want[i, j].item()) for j in bad[:6]])


def _data(dtype, n, rng):
    return special_values(dtype, n, rng, p_special=0.2, scale_range=(-12, 12))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_equal_the_float64_reference(dtype, simd, threaded, rng):
    tensors = [_data(dtype, n, rng) for n in SIZES]
    _assert_rows(ops.tensor_stats(tensors), tensors, (simd, threaded))
    for t in tensors:  # one tensor a call: the tail and vector loops alone
        _assert_rows(ops.tensor_stats(t), [t], (simd, threaded, t.numel()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_special_value_at_every_lane(dtype, simd):
    """Each special alone at each of 48 positions of finite data, so it reaches every lane of
    each vector width, the unrolled pair and the scalar tail; and runs of one exponent (the four
    histogram tables)."""
    fi = torch.finfo(dtype)
    tiny = fi.smallest_normal * fi.eps
    specials = [INF, -INF, NAN, -0.0, 0.0, tiny, -tiny, fi.smallest_normal / 2, fi.max, -fi.max, fi.tiny]
    if dtype == torch.float32:
        specials += [1e-45, 1.1754942e-38]
    tensors = []
    for v in specials:
        for pos in range(48):
            x = torch.full((48,), 1.5, dtype=dtype)
            x[pos] = v
            tensors.append(x)
    _assert_rows(ops.tensor_stats(tensors), tensors, simd)


def test_float64_beyond_float32s_range_and_float64_subnormals():
    x = torch.tensor([1e-300, -1e300, 2.0 ** 127, 2.0 ** 128, 2.0 ** -149, 2.0 ** -150, 5e-324, -0.0, INF, NAN],
                     dtype=torch.float64)
    row = ops.tensor_stats(x)[0]
    _assert_rows(row[None], [x])
    h = row[S.HIST:]
    assert h[0] == 3 and h[-1] == 2  # 1e-300, 2**-150, 5e-324 below; -1e300, 2**128 above
    assert row[S.AMAX] == 1e300 and row[S.AMIN] == 5e-324


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rows_do_not_depend_on_the_thread_count_or_level(dtype, rng):
    """Tensors cut by task boundaries (pieces counted by two tasks) and whole ones."""
    sizes = [3, (1 << 18) + 5, 17, 0, (1 << 17) - 1, (1 << 19) + 77, 1]
    tensors = [_data(dtype, n, rng) for n in sizes]
    rows = []
    for level in ops.available_simd_levels():
        with use_simd(level):
            for nthreads in (1, 2, 3, 7):
                with force_threads(nthreads):
                    rows.append(ops.tensor_stats(tensors))
    _assert_rows(rows[0], tensors)
    for r in rows[1:]:
        assert torch.equal(r, rows[0])


def test_a_tensor_over_2_to_the_31_elements_worth_of_counts_is_flushed_in_runs():
    """One kernel call counts at most 2**30 elements in its uint32 tables; a longer tensor is
    several runs. Checked on 2**30 + 5 bfloat16 zeros and ones (2 GiB)."""
    try:
        x = torch.zeros((1 << 30) + 5, dtype=torch.bfloat16)
    except RuntimeError:
        pytest.skip("no memory for a 2 GiB tensor")
    x[-3:] = 1.0
    row = ops.tensor_stats(x)[0]
    assert row[S.ZERO] == (1 << 30) + 2 and row[S.HIST + 1 + 0 - S.EXP_MIN] == 3
    del x


def test_non_contiguous_mixed_dtypes_and_views(rng):
    base = _data(torch.float32, 4096, rng)
    tensors = [base.view(64, 64).t(), base[::3], base[100:2000], base.to(torch.bfloat16)[::2],
               base.double().view(64, 64)[:, 5], torch.empty(0, 3), base.half()]
    _assert_rows(ops.tensor_stats(tensors), tensors)


def test_reads_only_and_bumps_no_version(rng):
    x = _data(torch.float32, 5000, rng)
    before, version = x.clone(), x._version
    ops.tensor_stats([x, x])
    assert torch.equal(x.view(torch.int32), before.view(torch.int32)) and x._version == version


def test_empty_list_and_out(rng):
    assert ops.tensor_stats([]).shape == (0, S.WIDTH)
    xs = [_data(torch.float16, 300, rng), _data(torch.float32, 7, rng)]
    out = torch.full((2, S.WIDTH), 7.0, dtype=torch.float64)
    assert ops.tensor_stats(xs, out=out) is out
    _assert_rows(out, xs)
    flat = torch.empty(2 * S.WIDTH, dtype=torch.float64)
    ops.tensor_stats(xs, out=flat)
    assert torch.equal(flat.view(2, S.WIDTH), out)


def test_layout_constants_match_the_c_header():
    assert (_C.STATS_WIDTH, _C.STATS_HIST, _C.STATS_EXP_MIN, _C.STATS_EXP_MAX) == (
        S.WIDTH, S.HIST, S.EXP_MIN, S.EXP_MAX)


@pytest.mark.parametrize("out, match", [
    (lambda: torch.empty(2, S.WIDTH, dtype=torch.float32), "out must have dtype torch.float64"),
    (lambda: torch.empty(3, S.WIDTH, dtype=torch.float64), "out must have"),
    (lambda: torch.empty(S.WIDTH, 2, dtype=torch.float64).t(), "out"),
    (lambda: torch.empty(2, S.WIDTH, dtype=torch.float64, requires_grad=True), "out requires grad"),
    (lambda: torch.empty(2, S.WIDTH, dtype=torch.float64, device="meta"), "out"),
])
def test_bad_out_is_refused_and_nothing_written(out, match):
    xs = [torch.ones(5), torch.ones(3)]
    with pytest.raises((TypeError, ValueError), match=match):
        ops.tensor_stats(xs, out=out())


def test_out_overlapping_an_input_is_refused():
    out = torch.zeros(2 * S.WIDTH, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"out overlaps tensors\[1\]"):
        ops.tensor_stats([torch.ones(3), out[10:20]], out=out)
    assert not out.any()


@pytest.mark.parametrize("bad, match", [
    ([torch.ones(3), torch.ones(2, dtype=torch.int32)], r"tensors\[1\].*int32"),
    ([torch.ones(3), "x"], r"tensors\[1\]"),
    ([torch.ones(3, dtype=torch.complex64)], r"tensors\[0\]"),
    (3.0, "tensors must be a Tensor or a sequence"),
])
def test_bad_tensors_are_named(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ops.tensor_stats(bad)


# ---- the torch op ---------------------------------------------------------------------------

def test_opcheck():
    xs = [torch.randn(40), torch.randn(3, 5).half(), torch.randn(7, dtype=torch.float64)]
    torch.library.opcheck(torch.ops.ampx.tensor_stats.default, (xs,))


def test_fake_and_meta_give_the_shape_and_refuse_what_the_kernel_refuses():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        got = ops.tensor_stats([torch.empty(10), torch.empty(4, dtype=torch.bfloat16)])
        assert got.shape == (2, S.WIDTH) and got.dtype == torch.float64
        with pytest.raises(TypeError, match=r"tensors\[0\] has dtype torch.int64"):
            ops.tensor_stats([torch.empty(3, dtype=torch.int64)])
        with pytest.raises(ValueError, match="out= is taken only eagerly"):
            ops.tensor_stats([torch.empty(3)], out=torch.empty(1, S.WIDTH, dtype=torch.float64))
    meta = ops.tensor_stats([torch.empty(5, device="meta")])
    assert meta.device.type == "meta" and meta.shape == (1, S.WIDTH)


def test_profiler_names_the_op():
    xs = [torch.randn(100)]
    with torch.profiler.profile() as prof:
        ops.tensor_stats(xs)
    assert "ampx::tensor_stats" in {e.name for e in prof.events()}


def test_compiled_fullgraph_gives_the_eager_rows(rng):
    xs = [_data(torch.float32, 999, rng), _data(torch.bfloat16, 70, rng)]

    @torch.compile(fullgraph=True, backend="inductor")
    def f(a, b):
        return ops.tensor_stats([a * 2, b])

    got = f(*xs)
    _assert_rows(got, [xs[0] * 2, xs[1]])


def test_fractions_from_the_kernel_row_match_a_cast():
    """The point of the histogram: what fp16 would overflow and flush at a scale, from the row,
    without another pass. Values kept clear of the bucket-exact edges (stats.py)."""
    g = torch.Generator().manual_seed(3)
    x = torch.exp2(torch.randint(-40, 30, (20000,), generator=g).float()) * 1.25
    row = ops.tensor_stats(x)[0]
    for scale in (1.0, 2.0 ** 10, 2.0 ** -8):
        f = S.fractions(row, "float16", scale)
        y = (x * scale).half()
        assert f["overflow"] == pytest.approx(y.isinf().double().mean().item(), abs=0)
        assert f["underflow"] == pytest.approx((y == 0).double().mean().item(), abs=0)


def test_cuda_tensors_give_the_cpu_rows(rng):
    """The CUDA kernel itself is tested in test_tensor_stats_cuda.py (emulated, and on a GPU);
    here: the same list on both devices gives the same rows, on the tensors' device."""
    if not CUDA:
        pytest.skip("no CUDA device usable by ampx")
    tensors = [_data(dt, n, rng) for dt in DTYPES for n in (0, 5, 65537)]
    got = ops.tensor_stats([t.cuda() for t in tensors])
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), ops.tensor_stats(tensors))

