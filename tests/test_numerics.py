"""The shared numerics (csrc/ampx_numerics.h) as seen through ampx.ops.

- float16 / bfloat16 <-> float32 / float64 conversions: exhaustive decoding,
  every rounding boundary of the encoders, single rounding from float64;
- stochastic rounding to bfloat16: the counter-based random bits (bit-exact
  against a Python model of the documented formula, from float32, float16 and
  float64 sources, on every device), neighbours, unbiasedness, reproducibility,
  SIMD levels and threads;
- the loss-scale update rule: torch._amp_update_scale_ step by step, and the
  hysteresis / min / max extras against a plain-Python model of DeepSpeed's
  rule, on every device (on CUDA the kernel's events equal the CPU's).
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ampx
from ampx import ops
from conftest import (
    CHUNK,
    FLOAT_DTYPES,
    LEVELS,
    LOW_DTYPES,
    assert_bits_equal,
    assert_exactly_equal,
    f32,
    force_single,
    finite_values,
    force_threads,
    round_f64_to,
    sizes,
    special_values,
    to_device,
    use_simd,
)

DT_IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
U16 = torch.uint16 if hasattr(torch, "uint16") else None


def dt_id(dt):
    return DT_IDS[dt]


def all_patterns(dtype):
    """Every one of the 65536 bit patterns of a 16-bit float type."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def cast(src, dst_dtype, **kw):
    dst = torch.empty(src.shape, dtype=dst_dtype)
    ops.cast_(src, dst, **kw)
    return dst


def u16(t):
    """bfloat16 bits as non-negative ints (numpy uint32)."""
    return t.contiguous().view(torch.int16).numpy().astype(np.uint32) & 0xFFFF


# -------------------------------------------------------------- decoding --


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dt_id)
def test_decode_every_16bit_pattern(simd, dtype):
    x = all_patterns(dtype)
    for wide in (torch.float32, torch.float64):
        got = cast(x, wide)
        assert_bits_equal(got, x.to(wide), f"{dtype} -> {wide}")
    # widening must keep the NaN payload so that narrowing back is exact
    back = cast(cast(x, torch.float32), dtype)
    assert_exactly_equal(back[~torch.isnan(x)], x[~torch.isnan(x)])
    assert torch.isnan(back).sum() == torch.isnan(x).sum()


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dt_id)
def test_load_store_identity_every_pattern(simd, dtype):
    """unscale_ by 1.0 loads and stores every value unchanged (NaN stays NaN)."""
    x = all_patterns(dtype)
    y = x.clone()
    found = torch.zeros(1)
    flags = torch.zeros(1, dtype=torch.uint8)
    ops.unscale_(y, 1.0, found, flags=flags)
    assert_bits_equal(y, x)
    assert found.item() == 1.0 and flags.item() == ops.FLAG_INF | ops.FLAG_NAN
    assert ops.norm(x[torch.isfinite(x)], math.inf).item() == torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dt_id)
def test_classify_every_pattern(simd, dtype):
    x = all_patterns(dtype)
    flags = torch.zeros(len(x) // 256, dtype=torch.uint8)
    pieces = list(x.split(256))
    ops.norm(pieces, flags=flags)
    for i, p in enumerate(pieces):
        exp = (ops.FLAG_INF if torch.isinf(p).any() else 0) | (ops.FLAG_NAN if torch.isnan(p).any() else 0)
        assert flags[i].item() == exp, i


# -------------------------------------------------------------- encoding --


def _boundary_points(dtype):
    """float32 values at and around every rounding boundary of `dtype`:
    each representable value, the midpoints to its neighbours, and the float32
    values one ulp either side of those."""
    x = all_patterns(dtype)
    x = x[torch.isfinite(x)]
    v = torch.unique(x.float())  # sorted, -0.0 and 0.0 merged
    v64 = v.double()
    mids = ((v64[1:] + v64[:-1]) / 2).float()  # exact in float32
    emax = 16 if dtype == torch.float16 else 128
    over = torch.tensor([(torch.finfo(dtype).max + 2.0**emax) / 2]).float()  # the tie above max: -> inf
    pts = torch.cat([v, mids, over, -over])
    up = torch.nextafter(pts, torch.full_like(pts, math.inf))
    down = torch.nextafter(pts, torch.full_like(pts, -math.inf))
    extra = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38])
    return torch.cat([pts, up, down, extra])


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dt_id)
def test_encode_every_rounding_boundary(simd, dtype):
    pts = _boundary_points(dtype)
    got = cast(pts, dtype)
    assert_bits_equal(got, pts.to(dtype))
    # also through the in-place rounding of mul_ on a float16/bfloat16 tensor:
    # x * 1.0 must give the same as the cast for values already in the type
    fi = torch.finfo(dtype)
    assert cast(torch.tensor([fi.max]), dtype).item() == fi.max


def test_encode_overflow_thresholds(simd):
    # float16: 65519.99 rounds to 65504, 65520 (the midpoint, odd max) to inf
    x = torch.tensor([65504.0, 65519.996, 65520.0, -65520.0, 65536.0, 1e9])
    assert cast(x, torch.float16).tolist() == [65504.0, 65504.0, math.inf, -math.inf, math.inf, math.inf]
    bmax = torch.finfo(torch.bfloat16).max
    mid = (bmax + 2.0**128) / 2
    x = torch.tensor([bmax, f32(mid) * (1 - 2**-23), mid, 3.4028235e38], dtype=torch.float32)
    assert cast(x, torch.bfloat16).tolist() == [bmax, bmax, math.inf, math.inf]


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dt_id)
def test_encode_random_bit_patterns(simd, dtype, rng):
    u = rng.integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    x = torch.from_numpy(u.view(np.float32))
    assert_bits_equal(cast(x, dtype), x.to(dtype))
    # the subnormal range of the target in particular
    lo = float(torch.finfo(dtype).smallest_normal)
    y = torch.from_numpy(rng.uniform(-2 * lo, 2 * lo, size=1 << 15).astype(np.float32))
    assert_bits_equal(cast(y, dtype), y.to(dtype))


def test_encode_nan_stays_nan_with_sign_kept(simd):
    nans = torch.tensor([0x7FC00000, 0xFFC00000 - 2**32, 0x7F800001, 0x7FBFFFFF, 0xFF800001 - 2**32] * 4,
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    for dt in LOW_DTYPES:
        out = cast(nans, dt)
        assert torch.isnan(out).all(), dt
        signs = out.view(torch.int16) < 0
        assert signs.tolist() == (nans.view(torch.int32) < 0).tolist(), dt


# ---------------------------------------------- float64 -> narrow types --


def test_round_reference_agrees_with_numpy_and_torch(rng):
    """The test's own single-rounding reference against numpy (float64 ->
    float16 directly) and torch (float64 -> float32)."""
    a = np.concatenate([
        rng.standard_normal(20000) * 10.0 ** rng.uniform(-9, 6, 20000),
        np.array([65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 0.0, -0.0, np.inf, -np.inf]),
    ])
    t = torch.from_numpy(a)
    with np.errstate(over="ignore"):
        ref16 = torch.from_numpy(a.astype(np.float16))
    assert_bits_equal(round_f64_to(t, torch.float16), ref16)
    assert_bits_equal(round_f64_to(t * 1e30, torch.float32), (t * 1e30).float())


def _double_rounding_witnesses():
    """float64 values just past a midpoint of the narrow type: rounding them
    through float32 first lands exactly on the midpoint, and then to even."""
    out = {}
    for dt, p in ((torch.float16, 11), (torch.bfloat16, 8)):
        vals = []
        for base in (1.0, 1.5, 3.0, 1000.0 if dt == torch.float16 else 1e30, 2.0**-20):
            ulp = math.ldexp(1.0, math.frexp(base)[1] - p)
            mid = base + ulp / 2  # a tie between base (even) and base + ulp
            vals += [mid + ulp * 2.0**-25, -(mid + ulp * 2.0**-25), mid - ulp * 2.0**-25, mid]
        out[dt] = torch.tensor(vals, dtype=torch.float64)
    return out


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dt_id)
def test_float64_to_narrow_is_rounded_once(simd, dtype, rng):
    w = _double_rounding_witnesses()[dtype]
    got = cast(w, dtype)
    assert_bits_equal(got, round_f64_to(w, dtype))
    # the first witness rounds up, not down to 1.0 as a float32 detour would
    assert got[0].item() > 1.0
    # random float64 values right next to every midpoint of the type
    x = all_patterns(dtype)
    v = torch.unique(x[torch.isfinite(x)].double())
    mids = (v[1:] + v[:-1]) / 2
    eps = torch.from_numpy(rng.uniform(-1, 1, size=mids.numel())) * mids.abs() * 2.0**-28
    pts = torch.cat([mids, mids + eps, mids * (1 + 2.0**-40), mids * (1 - 2.0**-40), v])
    assert_bits_equal(cast(pts, dtype), round_f64_to(pts, dtype))
    # a list mixing both paths (vector and scalar code)
    ys = special_values(torch.float64, 3000, rng, scale_range=(-40, 38))
    assert_bits_equal(cast(ys, dtype), round_f64_to(ys, dtype))
    assert_bits_equal(cast(ys, dtype, inv_scale=0.37), round_f64_to(ys * f32(0.37), dtype))


def test_float64_subnormal_and_overflow_edges(simd):
    # below half the smallest bfloat16 subnormal: 0; just above: the subnormal
    t = 2.0**-133
    x = torch.tensor([t / 2, t / 2 * (1 + 2**-40), -t / 2 * (1 + 2**-40), 1e-300, -1e-300, 5e-324,
                      3.39e38, 3.4e38, 1e39, 1e308], dtype=torch.float64)
    assert_bits_equal(cast(x, torch.bfloat16), round_f64_to(x, torch.bfloat16))
    got = cast(x, torch.bfloat16)
    assert got[0].item() == 0.0 and got[1].item() == t and got[2].item() == -t
    assert str(got[4].item()) == "-0.0"
    y = torch.tensor([2.0**-25, 2.0**-25 * (1 + 2**-40), 65519.999999, 65520.0, 1e300], dtype=torch.float64)
    assert cast(y, torch.float16).tolist() == [0.0, 2.0**-24, 65504.0, math.inf, math.inf]


# ------------------------------------------------------ stochastic rounding --

M32 = 0xFFFFFFFF


def _mix32(x):
    x = np.asarray(x, dtype=np.uint64) & M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(M32)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(M32)
    x ^= x >> np.uint64(16)
    return x


def _sr_key(seed, offset, tensor, e_hi):
    h = int(_mix32(e_hi ^ 0x9E3779B9))
    h = int(_mix32(h ^ tensor))
    h = int(_mix32(h ^ (offset & M32)))
    h = int(_mix32(h ^ (offset >> 32)))
    h = int(_mix32(h ^ (seed & M32)))
    a = int(_mix32(h ^ (seed >> 32)))
    b = int(_mix32(a ^ 0x85EBCA6B))
    return a, b


def sr_model(x, seed, offset, tensor_index):
    """bfloat16 bits of ampx's stochastic rounding of float32 `x` (flattened),
    from the formula documented in ampx_numerics.h."""
    u = x.contiguous().view(-1).view(torch.int32).numpy().view(np.uint32).astype(np.uint64)
    a, b = _sr_key(seed, offset, tensor_index, 0)
    e = np.arange(u.size, dtype=np.uint64)
    rnd = _mix32(_mix32(e ^ np.uint64(a)) ^ np.uint64(b))
    out = ((u + (rnd & np.uint64(0xFFFF))) >> np.uint64(16)) & np.uint64(0xFFFF)
    special = (u & np.uint64(0x7F800000)) == np.uint64(0x7F800000)
    keep = (u >> np.uint64(16)) | np.where((u & np.uint64(0x7FFFFF)) != 0, np.uint64(0x40), np.uint64(0))
    out = np.where(special, keep, out)
    return out.astype(np.uint32)


def sr(src, seed=0, offset=0, inv_scale=None):
    lst = isinstance(src, (list, tuple))
    srcs = list(src) if lst else [src]
    dsts = [torch.empty(s.shape, dtype=torch.bfloat16, device=s.device) for s in srcs]
    ops.cast_(srcs, dsts, rounding="stochastic", seed=seed, offset=offset, inv_scale=inv_scale)
    return dsts if lst else dsts[0]


def f64_to_f32_round_odd(x):
    """float64 values rounded to float32 toward zero, the last bit set when inexact (round to
    odd, so that a second rounding sees the discarded bits); past float32's range, the
    nearest rounding's inf."""
    a = x.detach().double().contiguous().numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        near = a.astype(np.float32)
        tz = np.where(np.abs(near.astype(np.float64)) > np.abs(a), np.nextafter(near, np.float32(0)), near)
        odd = tz.view(np.uint32) | (tz.astype(np.float64) != a).astype(np.uint32)
    out = np.where(np.isfinite(near), odd, near.view(np.uint32))
    return torch.from_numpy(out.view(np.float32).copy()).reshape(x.shape)


def sr_source(src, inv=None):
    """The float32 value stochastic rounding rounds: x * inv in float32, or for float64
    sources in float64 (inv as given), rounded to odd into float32."""
    if src.dtype == torch.float64:
        return f64_to_f32_round_odd(src if inv is None else src * inv)
    return src.float() * torch.tensor(f32(1.0 if inv is None else inv))


def model_bf16(bits):
    """sr_model's bits as a bfloat16 tensor."""
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


def neighbours(x):
    """(toward zero, away from zero) bfloat16 bit patterns of float32 x."""
    u = x.view(torch.int32).numpy().view(np.uint32).astype(np.uint64)
    lo = (u >> np.uint64(16)).astype(np.uint32)
    return lo, lo + 1, (u & np.uint64(0xFFFF)) == 0


@pytest.mark.parametrize("seed,offset", [(0, 0), (1, 2), (2**64 - 1, 2**64 - 1), (0xDEADBEEF12345678, 2**33 + 5)])
def test_sr_bits_match_documented_generator(simd, threaded, seed, offset, rng):
    """The random bits are a pure function of (seed, offset, tensor, element):
    the same bits on every device and every code path."""
    sizes = [1, 7, 16, 17, 33, 1000, CHUNK + 1, 2 * CHUNK + 1]
    srcs = [special_values(torch.float32, n, rng) for n in sizes]
    outs = sr(srcs, seed, offset)
    for i, (s, o) in enumerate(zip(srcs, outs)):
        np.testing.assert_array_equal(u16(o), sr_model(s, seed, offset, i), err_msg=f"tensor {i} n={s.numel()}")


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float64, torch.float16], ids=dt_id)
def test_sr_rounds_the_product_with_the_documented_bits(device, simd, src_dtype, rng):
    """Every source dtype, every size, with inv_scale: the bits of the documented generator
    applied to the product (sr_source); on CUDA also bit-identical to the CPU."""
    if src_dtype == torch.float32:
        x = special_values(torch.float32, 5000, rng)
        got = sr(x.to(device), 7, 8, inv_scale=0.37)
        model = sr_model(sr_source(x, 0.37), 7, 8, 0)
        if device == "cpu":  # NaN payloads included
            np.testing.assert_array_equal(u16(got), model)
        assert_bits_equal(got.cpu(), model_bf16(model))
    lengths = sizes(device) + [3 * CHUNK + 1]
    srcs = [finite_values(src_dtype, n, rng) for n in lengths]
    for seed, offset in ((0, 0), (123, 9), (2**64 - 1, 2**63 + 5)):
        outs = sr(to_device(srcs, device), seed, offset, inv_scale=0.5)
        for i, (x, o) in enumerate(zip(srcs, outs)):
            np.testing.assert_array_equal(u16(o.cpu()), sr_model(sr_source(x, 0.5), seed, offset, i),
                                          err_msg=f"n={lengths[i]} seed={seed} offset={offset}")
        if device == "cuda":
            for a, c in zip(outs, sr(srcs, seed, offset, inv_scale=0.5)):
                assert_exactly_equal(a.cpu(), c, f"seed={seed} offset={offset} vs ampx CPU")
    special = [special_values(src_dtype, n, rng) for n in (17, 5000)]
    outs = sr(to_device(special, device), 1, 2)
    for i, (x, o) in enumerate(zip(special, outs)):
        assert_bits_equal(o.cpu(), model_bf16(sr_model(sr_source(x), 1, 2, i)), f"special values, tensor {i}")
    if device == "cuda":
        for a, c in zip(outs, sr(special, 1, 2)):
            assert_bits_equal(a.cpu(), c, "special values vs ampx CPU")


def test_sr_results_are_neighbours(simd, rng):
    x = special_values(torch.float32, 100000, rng, scale_range=(-40, 38))
    got = u16(sr(x, 3, 4))
    fin = torch.isfinite(x).numpy()
    lo, hi, exact = neighbours(x)
    ok = (got == lo) | ((got == hi) & ~exact)
    assert ok[fin].all(), np.nonzero(~ok & fin)[0][:5]
    # representable values are kept as they are
    assert (got[exact & fin] == lo[exact & fin]).all()
    # inf and NaN pass through
    res = sr(x, 3, 4)
    assert torch.equal(torch.isnan(res), torch.isnan(x))
    inf = torch.isinf(x)
    assert torch.equal(res[inf].float(), x[inf])


def test_sr_from_float64_and_float16_gives_neighbours(simd, rng):
    for dt in (torch.float64, torch.float16):
        x = special_values(dt, 20000, rng)
        got = sr(x, 11, 12)
        nearest = cast(x, torch.bfloat16)
        fin = torch.isfinite(x) & torch.isfinite(nearest)
        # the neighbours of the exact value: the nearest one and the one past it
        g, n = got[fin].double(), nearest[fin].double()
        xv = x[fin].double()
        same = g == n
        other = ~same
        # the other neighbour lies on the other side of x than the nearest one
        assert ((g[other] - xv[other]) * (n[other] - xv[other]) <= 0).all()
        # and at most one ulp of bfloat16 away from the nearest
        both = torch.isfinite(g)
        gap = (g - n).abs()[both]
        ulp = (n.abs() * 2.0**-7).clamp(min=2.0**-133)[both]
        assert (gap <= ulp).all()
        assert torch.equal(torch.isnan(got), torch.isnan(x))


def test_sr_special_values_pass_through(simd):
    x = torch.tensor([math.inf, -math.inf, math.nan, -math.nan, 0.0, -0.0] * 7)
    for off in range(5):
        got = sr(x, 1, off)
        assert_bits_equal(got[torch.isfinite(x)], x[torch.isfinite(x)].to(torch.bfloat16))
        assert torch.isnan(got[2::6]).all() and torch.isnan(got[3::6]).all()
        assert got[0::6].tolist() == [math.inf] * 7 and got[1::6].tolist() == [-math.inf] * 7
        assert str(got[5].item()) == "-0.0"
    # the largest values may round up to inf (the next bfloat16 step past max)
    big = torch.full((4096,), torch.finfo(torch.float32).max)
    got = sr(big, 5, 6)
    bmax = torch.finfo(torch.bfloat16).max
    assert set(got.float().tolist()) <= {bmax, math.inf}


def _up_fraction(value, n, offsets, seed=99):
    x = torch.full((n,), value, dtype=torch.float32)
    lo = neighbours(x[:1])[0][0]
    ups = 0
    total = 0.0
    for off in offsets:
        bits_ = u16(sr(x, seed, off))
        assert set(np.unique(bits_).tolist()) <= {int(lo), int(lo) + 1}
        ups += int((bits_ == lo + 1).sum())
        total += float(sr(x, seed, off).double().sum())
    return ups / (n * len(offsets)), total / (n * len(offsets))


@pytest.mark.parametrize("value", [1.0 + 0.3 * 2**-7, -(1.0 + 0.8 * 2**-7), 3.0e-39, 12345.678, 1.0e30 * 1.11])
def test_sr_is_unbiased(value):
    value = f32(value)
    u = int(np.float32(value).view(np.uint32))
    p = (u & 0xFFFF) / 65536.0  # probability of rounding the magnitude up
    n, offsets = 4096, range(40)
    N = n * len(offsets)
    frac, mean = _up_fraction(value, n, offsets)
    sigma = math.sqrt(p * (1 - p) / N)
    assert abs(frac - p) <= 6 * sigma + 1e-12, (frac, p, sigma)
    # the mean of the rounded values converges to the value itself
    down = np.uint32(u & 0xFFFF0000).view(np.float32)
    ulp = abs(float(np.uint32((u & 0xFFFF0000) + 0x10000).view(np.float32)) - float(down))
    assert abs(mean - value) <= 6 * ulp * sigma + abs(value) * 1e-12, (mean, value)


def test_sr_unbiased_per_element_over_offsets():
    """One element position, 2000 offsets: the offset alone decorrelates."""
    value = f32(1.0 + 0.25 * 2**-7)
    p = (int(np.float32(value).view(np.uint32)) & 0xFFFF) / 65536.0
    x = torch.full((3,), value)
    ups = sum(int(u16(sr(x, 5, off))[1] & 1) for off in range(2000))  # 1.0..: lo is even
    sigma = math.sqrt(p * (1 - p) / 2000)
    assert abs(ups / 2000 - p) <= 6 * sigma


def test_sr_unbiased_on_random_data(rng):
    x = torch.from_numpy((rng.standard_normal(200000) * 3).astype(np.float32))
    err = sr(x, 17, 1).double() - x.double()
    # each error has |e| < 1 ulp; the mean is zero in expectation
    ulps = torch.where(x != 0, x.abs().double() * 2.0**-7, torch.ones_like(err))
    z = (err / ulps)
    se = float(z.std()) / math.sqrt(len(z))
    assert abs(float(z.mean())) <= 6 * se
    # round-to-nearest is not what this is: about as many round "the far way"
    far = (sr(x, 17, 1) != x.to(torch.bfloat16)).double().mean().item()
    assert 0.1 < far < 0.4


def test_sr_reproducible_and_keyed(simd, rng):
    x = torch.from_numpy(rng.standard_normal(5000).astype(np.float32))
    a = sr(x, 1, 10)
    assert_exactly_equal(sr(x, 1, 10), a)
    assert not torch.equal(sr(x, 1, 11), a)
    assert not torch.equal(sr(x, 2, 10), a)
    assert not torch.equal(sr(x, 1, 10 + 2**32), a)  # the high half of the offset counts
    assert not torch.equal(sr(x, 1 + 2**32, 10), a)  # and of the seed
    # the position in the list is part of the key
    b, c = sr([x, x], 1, 10)
    assert_exactly_equal(b, a)
    assert not torch.equal(c, a)


def test_sr_identical_across_levels_and_threads(rng):
    srcs = [special_values(torch.float32, n, rng) for n in (5, 33, CHUNK - 1, 2 * CHUNK + 1, 3 * CHUNK)]
    ref = None
    for level in LEVELS:
        for mode in (force_single, force_threads):
            with use_simd(level), mode():
                out = sr(srcs, 1234, 5678, inv_scale=0.5)
            if ref is None:
                ref = out
            for a, b in zip(out, ref):
                assert_exactly_equal(a, b, f"{level} {mode.__name__}")


def test_sr_in_place_bfloat16(simd, rng):
    x = special_values(torch.bfloat16, 1000, rng)
    o = x.clone()
    ops.cast_(x, x, rounding="stochastic", seed=1, offset=2)  # representable: unchanged
    assert_bits_equal(x, o)
    ops.cast_(x, x, rounding="stochastic", seed=1, offset=2, inv_scale=0.3)
    prod = o.float() * torch.tensor(f32(0.3))
    np.testing.assert_array_equal(u16(x), sr_model(prod, 1, 2, 0))


# --------------------------------------------------------- update_scale_ --


def _torch_update(scale, tracker, found, g, b, interval):
    torch._amp_update_scale_(scale, tracker, found, g, b, interval)


def _state(scale=65536.0, tracker=0, device="cpu"):
    return (torch.tensor([scale], dtype=torch.float32, device=device),
            torch.tensor([tracker], dtype=torch.int32, device=device))


@pytest.mark.parametrize(
    "growth,backoff,interval,start,p_inf",
    [
        (2.0, 0.5, 1, 65536.0, 0.3),
        (2.0, 0.5, 3, 65536.0, 0.2),
        (2.0, 0.5, 7, 2.0**100, 0.05),  # grows to the float32 limit: growth skipped at inf
        (1.5, 0.25, 2, 1.0, 0.3),
        (1.0001, 0.9999, 1, 3.0, 0.5),  # products that need rounding to float32
        (1.7, 0.3, 5, 1e-30, 0.1),
        (65536.0, 0.125, 1, 2.0**100, 0.02),
        (3.0, 1.0 / 3.0, 4, 7.0, 0.25),
    ],
)
def test_update_scale_matches_torch_step_by_step(device, growth, backoff, interval, start, p_inf, rng):
    s_a, t_a = _state(start, device=device)
    s_t, t_t = _state(start, device=device)
    at_top = 0  # steps spent where one more growth would overflow float32
    for step in range(1500):
        r = rng.random()
        val = 0.0 if r >= p_inf else [1.0, math.inf, math.nan, 0.5, -1.0][int(rng.integers(0, 5))]
        found = torch.tensor([val], device=device)
        ret = ops.update_scale_(s_a, t_a, found, growth, backoff, interval)
        assert ret is s_a
        _torch_update(s_t, t_t, found, growth, backoff, interval)
        assert_exactly_equal(s_a.cpu(), s_t.cpu(), f"scale at step {step}")
        assert t_a.item() == t_t.item(), f"tracker at step {step}"
        assert found.item() == val or math.isnan(val)  # found_inf is read, not written
        at_top += not math.isfinite(f32(s_a.item() * growth))
    assert math.isfinite(s_a.item())
    if start >= 2.0**100:
        assert at_top > 10, "the sequence never reached the float32 limit"



def test_update_scale_growth_stops_below_float32_overflow():
    s_a, t_a = _state(2.0**120)
    s_t, t_t = _state(2.0**120)
    zero = torch.zeros(1)
    for _ in range(50):
        ops.update_scale_(s_a, t_a, zero, 2.0, 0.5, 1)
        _torch_update(s_t, t_t, zero, 2.0, 0.5, 1)
        assert_exactly_equal(s_a, s_t)
    assert s_a.item() == 2.0**127  # 2**128 would be inf: never applied
    assert t_a.item() == 0
    s, t = _state(3.0e38)
    ops.update_scale_(s, t, zero, 1.5, 0.5, 1)
    assert s.item() == f32(3.0e38)


def test_update_scale_tracker_semantics():
    s, t = _state(8.0, 0)
    zero, one = torch.zeros(1), torch.ones(1)
    for k in range(1, 4):
        ops.update_scale_(s, t, zero, 2.0, 0.5, 4)
        assert (s.item(), t.item()) == (8.0, k)
    ops.update_scale_(s, t, zero, 2.0, 0.5, 4)
    assert (s.item(), t.item()) == (16.0, 0)
    ops.update_scale_(s, t, zero, 2.0, 0.5, 4)
    ops.update_scale_(s, t, one, 2.0, 0.5, 4)
    assert (s.item(), t.item()) == (8.0, 0)
    ops.update_scale_(s, t, torch.tensor([math.nan]), 2.0, 0.5, 4)  # NaN counts as an overflow
    assert (s.item(), t.item()) == (4.0, 0)


def model_update(state, found, growth, backoff, interval, hysteresis, consecutive, min_scale, max_scale):
    """DeepSpeed's rule as described: products in float64, rounded to float32."""
    scale, gt, ht = state
    if found != 0.0 or math.isnan(found):
        gt = 0
        if ht is not None and ht > 1:
            return scale, gt, ht - 1
        scale = max(f32(scale * backoff), min_scale)
        return scale, gt, ht
    if ht is not None and consecutive:
        ht = hysteresis
    gt += 1
    if gt == interval:
        new = min(f32(scale * growth), max_scale)
        if math.isfinite(new):
            scale = new
        gt = 0
        if ht is not None:
            ht = hysteresis
    return scale, gt, ht


EXTRA_CASES = [
    # growth, backoff, interval, hysteresis, consecutive, min_scale, max_scale, start, p_inf
    (2.0, 0.5, 3, 2, False, 0.0, math.inf, 65536.0, 0.3),
    (2.0, 0.5, 2, 4, True, 1.0, 2.0**24, 65536.0, 0.4),
    (2.0, 0.5, 1, 3, False, 0.25, 2.0**20, 1.0, 0.5),
    (1.5, 0.3, 5, 1, False, 16.0, 1e6, 1000.0, 0.2),
    (2.0, 0.5, 1, 2, True, 0.0, 2.0**126, 2.0**100, 0.05),  # max_scale bounds growth
    (4.0, 0.25, 1, 1, False, 0.0, f32(3.0e38), 2.0**110, 0.02),  # product overflows: clamped to max
    (1.0001, 0.9999, 2, 5, True, 0.5, 10.0, 3.0, 0.6),
    (2.0, 0.5, 7, 6, False, 2.0**-10, math.inf, 1.0, 0.7),  # sits at min_scale
]


@pytest.mark.parametrize("case", EXTRA_CASES)
def test_update_scale_extras_match_deepspeed_model(device, case, rng):
    growth, backoff, interval, hyst, consec, min_s, max_s, start, p_inf = case
    s, t = _state(start, device=device)
    h = torch.tensor([hyst], dtype=torch.int32, device=device)
    cpu = _state(start) + (torch.tensor([hyst], dtype=torch.int32),)  # the CPU's state, on CUDA
    state = (f32(start), 0, hyst)
    seen = set()
    for step in range(1500):
        val = 0.0 if rng.random() >= p_inf else [1.0, math.inf, math.nan][int(rng.integers(0, 3))]
        if device == "cpu":
            ops.update_scale_(s, t, torch.tensor([val]), growth, backoff, interval, hysteresis=hyst,
                              hysteresis_tracker=h, consecutive_hysteresis=consec, min_scale=min_s,
                              max_scale=max_s)
        else:  # the events, a 0-dim tensor the kernel writes on the device, are the CPU's
            ev = ops._update_scale_events(s, t, torch.tensor([val], device=device), growth, backoff, interval,
                                          hyst, h if hyst > 1 else None, consec, min_s, max_s)
            cev = ops._update_scale_events(cpu[0], cpu[1], torch.tensor([val]), growth, backoff, interval,
                                           hyst, cpu[2] if hyst > 1 else None, consec, min_s, max_s)
            assert isinstance(ev, torch.Tensor) and ev.device.type == "cuda"
            assert int(ev.item()) == cev, step
        state = model_update(state, val, growth, backoff, interval, hyst, consec, min_s, max_s)
        got = (s.item(), t.item(), h.item())
        assert got == state, f"step {step}: got {got}, model {state}"
        assert s.item() >= min_s and s.item() <= max_s
        seen.add(s.item())
    assert len(seen) > 2  # the sequence really moved the scale


def test_update_scale_hysteresis_absorbs_overflows():
    s, t = _state(1024.0, 2)
    h = torch.tensor([3], dtype=torch.int32)
    one, zero = torch.ones(1), torch.zeros(1)
    kw = dict(hysteresis=3, hysteresis_tracker=h)
    ops.update_scale_(s, t, one, 2.0, 0.5, 10, **kw)
    assert (s.item(), t.item(), h.item()) == (1024.0, 0, 2)
    ops.update_scale_(s, t, one, 2.0, 0.5, 10, **kw)
    assert (s.item(), t.item(), h.item()) == (1024.0, 0, 1)
    ops.update_scale_(s, t, one, 2.0, 0.5, 10, **kw)
    assert (s.item(), t.item(), h.item()) == (512.0, 0, 1)
    ops.update_scale_(s, t, one, 2.0, 0.5, 10, **kw)
    assert (s.item(), t.item(), h.item()) == (256.0, 0, 1)
    ops.update_scale_(s, t, zero, 2.0, 0.5, 10, **kw)  # not consecutive: no refill yet
    assert (s.item(), t.item(), h.item()) == (256.0, 1, 1)
    ops.update_scale_(s, t, zero, 2.0, 0.5, 10, consecutive_hysteresis=True, **kw)
    assert (s.item(), t.item(), h.item()) == (256.0, 2, 3)


def test_update_scale_min_and_max_bounds():
    s, t = _state(3.0)
    one, zero = torch.ones(1), torch.zeros(1)
    ops.update_scale_(s, t, one, 2.0, 0.5, 1, min_scale=2.0)
    assert s.item() == 2.0
    ops.update_scale_(s, t, one, 2.0, 0.5, 1, min_scale=2.0)
    assert s.item() == 2.0
    ops.update_scale_(s, t, zero, 2.0, 0.5, 1, max_scale=3.0)
    assert s.item() == 3.0
    ops.update_scale_(s, t, zero, 2.0, 0.5, 1, max_scale=3.0)
    assert s.item() == 3.0


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.sampled_from([0.0, 0.0, 0.0, 1.0, math.inf, math.nan]), min_size=1, max_size=60),
    growth=st.sampled_from([2.0, 1.5, 1.0001, 10.0]),
    backoff=st.sampled_from([0.5, 0.25, 0.9999, 0.1]),
    interval=st.integers(1, 6),
    start=st.sampled_from([1.0, 65536.0, 2.0**120, 1e-20, 3.0e38]),
)
def test_hyp_update_scale_equals_torch(steps, growth, backoff, interval, start):
    s_a, t_a = _state(start)
    s_t, t_t = _state(start)
    for v in steps:
        f = torch.tensor([v])
        ops.update_scale_(s_a, t_a, f, growth, backoff, interval)
        _torch_update(s_t, t_t, f, growth, backoff, interval)
        assert_exactly_equal(s_a, s_t)
        assert t_a.item() == t_t.item()


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.sampled_from([0.0, 0.0, 1.0, math.nan]), min_size=1, max_size=60),
    hyst=st.integers(1, 4),
    consec=st.booleans(),
    interval=st.integers(1, 4),
    min_s=st.sampled_from([0.0, 1.0, 256.0]),
    max_s=st.sampled_from([math.inf, 2.0**20, 1e5]),
)
def test_hyp_update_scale_extras(steps, hyst, consec, interval, min_s, max_s):
    s, t = _state(1024.0)
    h = torch.tensor([hyst], dtype=torch.int32)
    state = (1024.0, 0, hyst)
    for v in steps:
        ops.update_scale_(s, t, torch.tensor([v]), 2.0, 0.5, interval, hysteresis=hyst, hysteresis_tracker=h,
                          consecutive_hysteresis=consec, min_scale=min_s, max_scale=max_s)
        state = model_update(state, v, 2.0, 0.5, interval, hyst, consec, min_s, max_s)
        assert (s.item(), t.item(), h.item()) == state


# ---------------------------------------------------------- hypothesis --

@settings(max_examples=100, deadline=None)
@given(vals=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), max_size=40),
       dtype=st.sampled_from(LOW_DTYPES))
def test_hyp_float32_to_narrow_equals_torch(vals, dtype):
    x = torch.tensor(vals, dtype=torch.float32)
    for level in LEVELS:
        with use_simd(level):
            assert_bits_equal(cast(x, dtype), x.to(dtype))


@settings(max_examples=100, deadline=None)
@given(vals=st.lists(st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True), max_size=40),
       dtype=st.sampled_from(LOW_DTYPES + [torch.float32]))
def test_hyp_float64_to_narrow_rounds_once(vals, dtype):
    x = torch.tensor(vals, dtype=torch.float64)
    assert_bits_equal(cast(x, dtype), round_f64_to(x, dtype))


@settings(max_examples=60, deadline=None)
@given(vals=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=40),
       seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**64 - 1))
def test_hyp_sr_matches_model_and_neighbours(vals, seed, offset):
    x = torch.tensor(vals, dtype=torch.float32)
    got = u16(sr(x, seed, offset))
    np.testing.assert_array_equal(got, sr_model(x, seed, offset, 0))
    lo, hi, exact = neighbours(x)
    assert (((got == lo)) | ((got == hi) & ~exact)).all()
