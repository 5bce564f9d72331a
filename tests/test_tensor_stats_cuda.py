"""ampx.ops.tensor_stats' CUDA kernel (ampx_k_tensor_stats in cuda/ampx_kernels.cu) against
ampx.stats.reference (plain torch ops in float64), row for row and bit for bit.

Everywhere (no GPU needed): the kernel source emulated on the CPU through the real launcher
(cuda/emulate.h, cuda/emulate_driver.cpp, csrc/cuda_launch.c; see tests/test_cuda.py), on data
with +-inf, NaN, -0.0, subnormals of every dtype, float64 beyond float32's range, sizes either
side of the vector, block and chunk boundaries (one-chunk tensors write their rows directly;
longer ones go through accumulator rows and a finishing block), misaligned starts, a capped
grid (blocks looping over chunks), empty tensors and lists longer than one launch's parameter
block. The launcher's workspace for a stats job: one accumulator row per several-chunk tensor.

On a CUDA machine (skipped elsewhere): the same comparison through ampx.ops.tensor_stats on
the GPU, including views, out=, a side stream and no host synchronisation.
"""
import math

import pytest
import torch

from ampx import _C, ops
from ampx import stats as S
from conftest import CHUNK, CUDA, NO_CUDA_REASON, special_values
from test_cuda import EMU_BLOCK, Emulator, _build_emulator

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INF, NAN = math.inf, math.nan
MAX_T = _C.CUDA_MAX_TENSORS

gpu = pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON)


def _assert_rows(got, tensors, msg=""):
    want = S.reference([t.cpu() for t in tensors])
    got = got.cpu()
    assert got.dtype == torch.float64 and got.shape == (len(tensors), S.WIDTH), (got.shape, msg)
    for i in range(len(tensors)):
        same = (got[i] == want[i]) | (got[i].isnan() & want[i].isnan())
        bad = (~same).nonzero().flatten().tolist()
        assert not bad, (msg, i, tensors[i].dtype, tensors[i].numel(),
                         [(j, got[i, j].item(), want[i, j].item()) for j in bad[:6]])
    # -0.0 never stands for a 0 count or AMAX
    assert not (got.view(torch.int64) == -(2 ** 63)).any(), msg


def _data(dtype, n, rng):
    return special_values(dtype, n, rng, p_special=0.2, scale_range=(-12, 12))


def _sizes(block):
    """Either side of a thread's vector, the block's vectors, the 4-vectors-in-flight loop and
    one and two chunks."""
    edges = {w * block * m for w in (2, 4, 8) for m in (1, 4)}
    small = {0, 1, 2, 3, 7, 8, 9, 15, 16, 17}
    return sorted(small | {e + d for e in edges for d in (-1, 0, 1)} | {CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3})


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Emulator(_build_emulator(tmp_path_factory.mktemp("emu"), EMU_BLOCK), EMU_BLOCK,
                    tmp_path_factory.mktemp("emu_run"))


# ============================================================== everywhere ==


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulated_rows_equal_the_float64_reference(emulator, dtype, rng):
    tensors = [_data(dtype, n, rng) for n in _sizes(emulator.block)]
    _assert_rows(emulator.stats(tensors), tensors, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulated_misaligned_starts_and_a_capped_grid(emulator, dtype, rng):
    """Scalar loads (a start off 16 bytes), and 3 blocks looping over every chunk of the call
    (several-chunk tensors finished by whichever block counts their last chunk)."""
    sizes = [1, 5, 2 * emulator.block * 8 + 3, CHUNK + 7, 0, 3 * CHUNK - 1, 17]
    tensors = [_data(dtype, n, rng) for n in sizes]
    _assert_rows(emulator.stats(tensors, mis=1), tensors, "misaligned")
    _assert_rows(emulator.stats(tensors, grid_cap=3), tensors, "grid 3")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulated_every_special_value(emulator, dtype):
    """Each special value alone in finite data, at the start, inside a vector and in the tail,
    in a one-chunk and a two-chunk tensor; and tensors of nothing but one special."""
    fi = torch.finfo(dtype)
    tiny = fi.smallest_normal * fi.eps
    specials = [INF, -INF, NAN, -0.0, 0.0, tiny, -tiny, 3 * tiny, fi.smallest_normal / 2, fi.smallest_normal,
                fi.max, -fi.max]
    if dtype == torch.float64:
        specials += [1e-300, -1e300, 2.0 ** 127, 2.0 ** 128, 2.0 ** -149, 2.0 ** -150, 1.5 * 2.0 ** -127]
    tensors = []
    for v in specials:
        for n, pos in ((37, 0), (37, 17), (37, 36), (CHUNK + 5, CHUNK + 2)):
            x = torch.full((n,), -1.5, dtype=dtype)
            x[pos] = v
            tensors.append(x)
        tensors.append(torch.full((9,), v, dtype=dtype))
    _assert_rows(emulator.stats(tensors), tensors, dtype)


def test_emulated_float64_end_buckets_and_extremes(emulator):
    x = torch.tensor([1e-300, -1e300, 2.0 ** 127, 2.0 ** 128, 2.0 ** -149, 2.0 ** -150, 5e-324, -0.0, INF, NAN,
                      torch.finfo(torch.float64).max], dtype=torch.float64)
    row = emulator.stats([x])[0]
    _assert_rows(row[None], [x])
    h = row[S.HIST:]
    assert h[0] == 3 and h[-1] == 3 and row[S.AMAX] == torch.finfo(torch.float64).max and row[S.AMIN] == 5e-324


def test_emulated_every_float32_subnormal_bucket_and_every_exponent(emulator):
    """Every power of two float32 holds (each bucket once), and of float16 / bfloat16."""
    for dtype, lo, hi in ((torch.float32, -149, 127), (torch.float16, -24, 15), (torch.bfloat16, -133, 127)):
        x = torch.tensor([2.0 ** e for e in range(lo, hi + 1)], dtype=torch.float64).to(dtype)
        y = torch.tensor([-(2.0 ** (e + 1)) * (1 - 2.0 ** -7) for e in range(lo + 8, hi)],
                         dtype=torch.float64).to(dtype)
        row = emulator.stats([x, y])
        _assert_rows(row, [x, y], dtype)
        assert row[0, S.HIST:].sum() == hi - lo + 1 and (row[0, S.HIST:] <= 1).all()


def test_emulated_many_tensors_across_launches(emulator, rng):
    """More tensors than one parameter block holds (several launches of one call), of mixed
    dtypes and sizes, with empty ones and several-chunk ones among them; rows in list order."""
    n = 2 * MAX_T + 7
    tensors = []
    for i in range(n):
        dtype = DTYPES[int(rng.integers(0, 4))]
        size = [0, 1, int(rng.integers(2, 300)), CHUNK + 1][int(rng.integers(0, 4))] if i % 50 else CHUNK + 1
        tensors.append(_data(dtype, size, rng))
    _assert_rows(emulator.stats(tensors), tensors)


def test_emulated_empty_tensors_only(emulator):
    tensors = [torch.empty(0), torch.empty(0, dtype=torch.float64)]
    rows = emulator.stats(tensors)
    _assert_rows(rows, tensors)
    assert rows[:, S.AMIN].tolist() == [INF, INF] and rows[:, S.AMAX].tolist() == [0.0, 0.0]


def test_emulated_at_full_block_size(emulator_full_stats, rng):
    emu = emulator_full_stats
    tensors = [_data(dt, n, rng) for dt in DTYPES for n in (2 * 8 * emu.block - 1, 4 * 8 * emu.block + 1, CHUNK + 9)]
    _assert_rows(emu.stats(tensors), tensors)


@pytest.fixture(scope="module")
def emulator_full_stats(tmp_path_factory):
    from test_cuda import BLOCK
    return Emulator(_build_emulator(tmp_path_factory.mktemp("emu_full"), BLOCK), BLOCK,
                    tmp_path_factory.mktemp("emu_full_run"))


def test_emulated_rows_leave_the_tensors_as_they_were(emulator, rng):
    tensors = [_data(torch.bfloat16, CHUNK + 3, rng), _data(torch.float32, 100, rng)]
    before = [t.clone() for t in tensors]
    emulator.stats(tensors)
    for a, b in zip(tensors, before):
        assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32))


# ================================================================= on a GPU ==


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_rows_equal_the_float64_reference(dtype, rng):
    tensors = [_data(dtype, n, rng).cuda() for n in _sizes(_C.CUDA_BLOCK) + [(1 << 20) + 3]]
    _assert_rows(ops.tensor_stats(tensors), tensors, dtype)
    for t in tensors[::7]:
        _assert_rows(ops.tensor_stats(t), [t], t.numel())


@gpu
def test_cuda_many_tensors_views_and_out(rng):
    base = _data(torch.float32, 1 << 16, rng).cuda()
    tensors = [base.view(256, 256).t(), base[::3], base[5:60000], base.to(torch.bfloat16)[::2],
               base.double().view(256, 256)[:, 5], torch.empty(0, 3, device="cuda"), base.half()]
    tensors += [_data(DTYPES[i % 4], i * 37 % 5000, rng).cuda() for i in range(3 * MAX_T)]
    out = torch.full((len(tensors), S.WIDTH), 7.0, dtype=torch.float64, device="cuda")
    assert ops.tensor_stats(tensors, out=out) is out
    _assert_rows(out, tensors)


@gpu
def test_cuda_on_a_side_stream_without_a_host_sync(rng):
    x = _data(torch.float32, 3 * CHUNK + 11, rng).cuda()
    ops.tensor_stats(x)  # kernels loaded
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda.set_sync_debug_mode("error")
        try:
            rows = ops.tensor_stats([x, x[:5]])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    s.synchronize()
    _assert_rows(rows, [x, x[:5]])
