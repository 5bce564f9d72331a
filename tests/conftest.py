"""Shared fixtures and helpers for the ampx.ops test suite.

Fixtures:
    device       parametrised "cpu" / "cuda", so a test written once runs on both;
                 "cuda" is skipped, with ampx.cuda.unavailable_reason(), where
                 torch or ampx cannot use a GPU.
    simd         parametrised over every SIMD level this processor supports;
                 switches with ampx._C.set_simd and restores the previous one.
    threaded     parametrised "single" / "threaded": "threaded" forces the
                 thread pool (set_parallel_threshold(0), 4 torch threads).
                 simd and threaded choose CPU code paths: a test that also takes
                 `device` runs every combination of them on "cpu" and once on
                 "cuda", where they are None and change nothing.
    force_threads, force_single
                 context managers for tests that compare the two paths.
    rng          a numpy Generator seeded per test.

Helpers (plain functions, imported by the test modules):
    special_values(dtype, n, rng, ...)  random data with inf/-inf/NaN/-0.0,
                 subnormals of the dtype and values near its max.
    assert_bits_equal(a, b)  same dtype/shape, NaN at the same positions and
                 every other element bit-identical (so -0.0 != 0.0).
    assert_same_float(a, b)  equal, or one float32 ulp apart (two float64 sums
                 of the same terms in different orders).
    unscale_ref(x, inv)      torch's float32 multiply rounded to x's dtype.
    norm_ref64(tensors, ord) float64 reference norm.
    sizes(device)            sizes either side of every boundary of that
                 device's kernels (vector widths and chunks; on CUDA also blocks).
    to_device(tensors, device), host(tensors)  copies of a list on a device / on the CPU.
"""
import contextlib
import itertools
import math
import os

import numpy as np
import pytest
import torch

import ampx
from ampx import ops


@contextlib.contextmanager
def quiet_frameworks(*names):
    """Loggers `names` at ERROR and warnings ignored for the block: a framework's banners, tips
    and performance warnings, which say nothing the tests check."""
    import logging
    import warnings

    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for n, lvl in levels.items():
            logging.getLogger(n).setLevel(lvl)

LEVELS = ops.available_simd_levels()
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LOW_DTYPES = [torch.float16, torch.bfloat16]
CHUNK = ampx._C.CHUNK

# Sizes on both sides of every vector width (1, 8, 16 float32 lanes) and chunk.
SMALL_SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33]
CHUNK_SIZES = [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1]
ALL_SIZES = SMALL_SIZES + CHUNK_SIZES

# Either side of every boundary of the CUDA kernels: vector widths (2, 4, 8 elements), one
# block's vectors (BLOCK * W), the unrolled group (4 * BLOCK * W), chunks.
CUDA_BLOCK = ampx._C.CUDA_BLOCK
CUDA_MAX_TENSORS = ampx._C.CUDA_MAX_TENSORS
_CUDA_EDGES = sorted({m * w * CUDA_BLOCK for w in (2, 4, 8) for m in (1, 4)} | {CHUNK, 2 * CHUNK})
CUDA_SIZES = sorted(set(SMALL_SIZES) | {e + d for e in _CUDA_EDGES for d in (-1, 0, 1)} | {3 * CHUNK + 4097})

CUDA = torch.cuda.is_available() and ampx.cuda.is_available()
NO_CUDA_REASON = "no CUDA device usable by ampx: " + str(ampx.cuda.unavailable_reason() or "torch sees no GPU")

_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.uint8: torch.uint8,
    torch.int32: torch.int32,
    torch.int64: torch.int64,
}


# ---------------------------------------------------------------- fixtures --


# simd and threaded select CPU code paths; on CUDA they have one value, None.
_CPU_AXES = {"simd": LEVELS, "threaded": ["single", "threaded"]}


def _mark_parametrized(metafunc):
    names = set()
    for mark in metafunc.definition.iter_markers("parametrize"):
        args = mark.args[0] if mark.args else mark.kwargs["argnames"]
        names.update(a.strip() for a in args.split(",")) if isinstance(args, str) else names.update(args)
    return names


def pytest_generate_tests(metafunc):
    """Parametrises the device, simd and threaded fixtures (a parametrize mark on the test wins).

    With `device`, the CPU axes are crossed with "cpu" only: ids "cpu-avx2-single", ..., "cuda"."""
    taken = _mark_parametrized(metafunc)
    axes = [n for n in _CPU_AXES if n in metafunc.fixturenames and n not in taken]
    if "device" in metafunc.fixturenames and "device" not in taken:
        params = [pytest.param("cpu", *combo, id="-".join(("cpu",) + combo))
                  for combo in itertools.product(*(_CPU_AXES[n] for n in axes))]
        params.append(pytest.param("cuda", *[None] * len(axes), id="cuda"))
        metafunc.parametrize(["device"] + axes, params, indirect=True)
        return
    for n in axes:
        metafunc.parametrize(n, _CPU_AXES[n], indirect=True)


@pytest.fixture
def device(request):
    if request.param == "cuda" and not CUDA:
        pytest.skip(NO_CUDA_REASON)
    return request.param


@pytest.fixture
def simd(request):
    if request.param is None:  # a CUDA run: no CPU level to choose
        yield None
        return
    prev = ampx._C.set_simd(request.param)
    assert ops.simd_level() == request.param
    try:
        yield request.param
    finally:
        ampx._C.set_simd(prev)


@contextlib.contextmanager
def use_simd(level):
    prev = ampx._C.set_simd(level)
    try:
        yield level
    finally:
        ampx._C.set_simd(prev)


@contextlib.contextmanager
def switched(setter, value):
    """Runs the block with a switch of ampx._C (setter(value) -> previous value) set, then
    restores it."""
    prev = setter(value)
    try:
        yield
    finally:
        setter(prev)


@contextlib.contextmanager
def force_threads(nthreads=4):
    """Every call, however small, goes through the thread pool."""
    prev_thr = ampx._C.set_parallel_threshold(0)
    prev_n = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        yield
    finally:
        torch.set_num_threads(prev_n)
        ampx._C.set_parallel_threshold(prev_thr)


@contextlib.contextmanager
def force_single():
    """Every call runs on the calling thread."""
    prev_thr = ampx._C.set_parallel_threshold(1 << 62)
    try:
        yield
    finally:
        ampx._C.set_parallel_threshold(prev_thr)


@pytest.fixture
def threaded(request):
    if request.param is None:  # a CUDA run
        yield None
        return
    cm = force_threads() if request.param == "threaded" else force_single()
    with cm:
        yield request.param


@pytest.fixture(params=["shim", "attributes"])
def reader(request):
    """Runs the test once with each tensor reader (the C shim, Python attributes); restores the previous state."""
    if request.param == "shim" and not ampx._C._set_tensor_shim():
        pytest.skip(f"the shim is off here: {ops.tensor_reader()}")
    prev = ampx._C._set_tensor_shim(request.param == "shim")
    try:
        yield request.param
    finally:
        ampx._C._set_tensor_shim(prev)


@pytest.fixture
def rng(request):
    # A stable per-test seed, so a failure reproduces.
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)


# ---- the CPU's bf16 probe: who reads it ---------------------------------------------------
# CI's pass 2 reruns, with AMPX_CPU_BF16=1, only the files listed in tests/_cpu_probe_files.py.
# Every read of the probe in this process is counted, and a test from a file not listed that
# reads it fails: pass 2 would never run it with the probe forced the other way.
from _cpu_probe_files import FILES as _CPU_PROBE_FILES  # noqa: E402
import ampx.policy as _policy  # noqa: E402

_cpu_probe_readers = set()  # test files (or the marker below) that read the probe
_cpu_probe_reported = set()
_OUTSIDE_A_TEST = "<collection or session set-up>"
_real_cpu_probe = _policy._cpu_has_native_bf16


def _counted_cpu_probe():
    # PYTEST_CURRENT_TEST is "tests/x.py::test_y (setup|call|teardown)" while any fixture of any
    # scope runs for that test, so a read in a module- or session-scoped fixture is charged to the
    # file whose test set it up; unset, the read came at collection or outside every test.
    current = os.environ.get("PYTEST_CURRENT_TEST")
    _cpu_probe_readers.add(current.split("::")[0] if current else _OUTSIDE_A_TEST)
    return _real_cpu_probe()


_policy._cpu_has_native_bf16 = _counted_cpu_probe


@pytest.fixture(autouse=True)
def _cpu_probe_readers_are_listed(request):
    yield
    unlisted = sorted(_cpu_probe_readers - set(_CPU_PROBE_FILES) - _cpu_probe_reported)
    if unlisted:
        _cpu_probe_reported.update(unlisted)
        pytest.fail(f"{', '.join(unlisted)} read the CPU's bf16 probe (ampx.policy._cpu_has_native_bf16) "
                    "but is not in tests/_cpu_probe_files.py: CI's pass 2, which forces the probe to 1, "
                    "would never run it that way. Add it there.", pytrace=False)


@pytest.fixture(autouse=True)
def _restore_global_state():
    """No test may leak a SIMD level, threshold or thread count."""
    level = ops.simd_level()
    n = torch.get_num_threads()
    thr = ampx._C.set_parallel_threshold(ampx._C.PARALLEL_MIN)
    ampx._C.set_parallel_threshold(thr)
    yield
    assert ops.simd_level() == level, "a test leaked its SIMD level"
    ampx._C.set_simd(level)
    torch.set_num_threads(n)
    ampx._C.set_parallel_threshold(thr)


# ------------------------------------------------------------ data helpers --


def finfo(dtype):
    return torch.finfo(dtype)


def special_values(dtype, n, rng, *, p_special=0.15, nonfinite=True, scale_range=(-3, 3)):
    """n values of `dtype`: random magnitudes plus (with probability
    p_special each) one of the special values of that dtype: +-inf, NaN,
    +-0.0, subnormals, values near the max, the smallest normal."""
    fi = torch.finfo(dtype)
    mags = 10.0 ** rng.uniform(scale_range[0], scale_range[1], size=n)
    vals = rng.standard_normal(n) * mags
    sub_max = fi.smallest_normal
    tiny = float(fi.smallest_normal) * float(fi.eps)  # smallest subnormal
    specials = [
        0.0,
        -0.0,
        tiny,
        -tiny,
        3 * tiny,
        sub_max * 0.5,
        -sub_max * 0.75,
        sub_max,
        -sub_max,
        fi.max,
        -fi.max,
        fi.max * (1 - fi.eps),
        fi.max / 2,
        1.0,
        -1.0,
    ]
    if dtype == torch.float32:
        specials += [1e-40, -3e-42, 1.17e-38]
    if nonfinite:
        specials += [math.inf, -math.inf, math.nan]
    if n:
        mask = rng.random(n) < p_special
        picks = rng.integers(0, len(specials), size=n)
        vals = np.where(mask, np.array(specials, dtype=np.float64)[picks], vals)
    t = torch.from_numpy(vals.astype(np.float64))
    if dtype == torch.float64:
        return t.clone()
    # float16 / bfloat16 overflow of the random part is fine: it only adds infs.
    return t.to(dtype)


def finite_values(dtype, n, rng, scale_range=(-3, 3)):
    return special_values(dtype, n, rng, nonfinite=False, scale_range=scale_range)


def bits(t):
    """The raw bits of a float tensor as integers (other dtypes as they are)."""
    view = _INT_VIEW.get(t.dtype)
    return t.contiguous() if view is None else t.contiguous().view(view)


def assert_bits_equal(actual, expected, msg=""):
    """NaN positions equal, every other element bit-identical (sign of zero too)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype, msg)
    assert actual.shape == expected.shape, (actual.shape, expected.shape, msg)
    a = actual.detach().contiguous()
    e = expected.detach().contiguous()
    an, en = torch.isnan(a), torch.isnan(e)
    if not torch.equal(an, en):
        idx = torch.nonzero(an != en).flatten()[:5].tolist()
        raise AssertionError(f"{msg}: NaN positions differ at flat indices {idx}")
    ab = bits(a).reshape(-1)
    eb = bits(e).reshape(-1)
    keep = ~an.reshape(-1)
    diff = (ab != eb) & keep
    if diff.any():
        idx = torch.nonzero(diff).flatten()[:5].tolist()
        af, ef = a.reshape(-1), e.reshape(-1)
        detail = ", ".join(f"[{i}] got {af[i].item()!r} expected {ef[i].item()!r}" for i in idx)
        raise AssertionError(f"{msg}: {int(diff.sum())} element(s) differ: {detail}")


def assert_exactly_equal(actual, expected, msg=""):
    """Bit for bit, NaN payloads included."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, msg
    if not torch.equal(bits(actual), bits(expected)):
        d = torch.nonzero(bits(actual).reshape(-1) != bits(expected).reshape(-1)).flatten()[:5].tolist()
        raise AssertionError(f"{msg}: bits differ at {d}")


def f32(v):
    """A Python float rounded to float32."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def unscale_ref(x, inv):
    """What unscale_/mul_ must store: the float32 product rounded to x's dtype
    (float64 tensors: x times inv in float64, inv as given: a Python float keeps
    its double precision, a float32 tensor contributes its float32 value)."""
    if isinstance(inv, torch.Tensor):
        inv = float(inv)
    if x.dtype == torch.float64:
        return x * inv
    return (x.float() * torch.tensor(f32(inv), dtype=torch.float32)).to(x.dtype)


def norm_ref64(tensors, ord):
    """Per-tensor and total float64 norms (NaN if any NaN, inf if any inf)."""
    per = []
    for t in tensors:
        v = t.detach().reshape(-1).double()
        if v.numel() == 0:
            per.append(0.0)
            continue
        if ord == 2:
            per.append(float(torch.sum(v * v)))
        elif ord == 1:
            per.append(float(torch.sum(v.abs())))
        else:
            if torch.isnan(v).any():
                per.append(math.nan)
            else:
                per.append(float(v.abs().max()))
    if ord == 2:
        total = math.sqrt(sum(per)) if not any(math.isnan(p) for p in per) else math.nan
        per = [math.sqrt(p) for p in per]
    elif ord == 1:
        total = sum(per)
    else:
        total = math.nan if any(math.isnan(p) for p in per) else max(per, default=0.0)
    return total, per


def assert_norm_close(got, ref, rel=1e-6, msg=""):
    """got: a float (from a float32 tensor); ref: float64 value."""
    got = float(got)
    if math.isnan(ref):
        assert math.isnan(got), f"{msg}: expected NaN, got {got!r}"
        return
    with np.errstate(over="ignore"):
        ref32 = float(np.float32(ref))
    if math.isinf(ref32):
        # Past float32's range the float32 result must be inf (or, at the very
        # edge of the range, the largest float32).
        assert math.isinf(got) or abs(got) >= float(np.finfo(np.float32).max) * (1 - 1e-6), (msg, got, ref)
        return
    assert not math.isnan(got), f"{msg}: got NaN, expected {ref!r}"
    assert abs(got - ref) <= rel * abs(ref) + 1e-45, f"{msg}: got {got!r}, expected {ref!r}"


def rand_list(rng, count, max_size, dtypes=FLOAT_DTYPES, special=True):
    out = []
    for _ in range(count):
        dt = dtypes[int(rng.integers(0, len(dtypes)))]
        n = int(rng.integers(0, max_size + 1))
        out.append(special_values(dt, n, rng) if special else finite_values(dt, n, rng))
    return out


_ROUND_PARAMS = {
    # significand bits (with the implicit one), smallest normal exponent, overflow exponent
    torch.float16: (11, -14, 16),
    torch.bfloat16: (8, -126, 128),
    torch.float32: (24, -126, 128),
}


def round_f64_to(x, dtype):
    """Round float64 values once, to nearest even, into float16/bfloat16/float32.

    An independent reference (numpy integer-exact arithmetic): torch's own
    float64 -> float16/bfloat16 conversion goes through float32 and so rounds
    twice."""
    p, emin, emax = _ROUND_PARAMS[dtype]
    a = x.detach().double().contiguous().numpy()
    out = a.copy()
    fin = np.isfinite(a)
    mag = np.abs(a[fin])
    _, e = np.frexp(mag)  # mag in [2^(e-1), 2^e)
    qexp = np.maximum(e - p, emin - (p - 1))  # the unit in the last place
    with np.errstate(over="ignore"):
        r = np.rint(np.ldexp(mag, -qexp))  # exact scaling; rint is ties-to-even
        v = np.ldexp(r, qexp)
    v = np.where(v >= 2.0**emax, np.inf, v)
    out[fin] = np.copysign(v, a[fin])
    return torch.from_numpy(out).reshape(x.shape).to(dtype)  # exact: already representable


# ---- shared by the CPU and CUDA kernel tests ----------------------------------------------

DT_IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}


def dt_id(dt):
    return DT_IDS[dt]


def expected_flags(tensors):
    """Per-tensor flag bytes (bit 0 inf, bit 1 NaN), computed with torch on the host."""
    from ampx.ops import FLAG_INF, FLAG_NAN

    out = []
    for t in tensors:
        v = t.detach().cpu()
        f = 0
        if v.numel() and torch.isinf(v).any():
            f |= FLAG_INF
        if v.numel() and torch.isnan(v).any():
            f |= FLAG_NAN
        out.append(f)
    return out


def assert_same_float(got, ref, msg=""):
    """Two float32 results of the same quantity accumulated in float64 in different orders:
    equal, or one float32 ulp apart; NaN and inf exactly where the other has them."""
    g, r = float(got), float(ref)
    if math.isnan(r) or math.isnan(g):
        assert math.isnan(r) and math.isnan(g), (msg, g, r)
        return
    if math.isinf(r) or math.isinf(g):
        assert g == r, (msg, g, r)
        return
    assert abs(g - r) <= 2.0**-23 * abs(r) + 1e-45, (msg, g, r)


def any_nonfinite(tensors):
    return any(f != 0 for f in expected_flags(tensors))


def clones(tensors):
    return [t.clone() for t in tensors]


# ---- devices ---------------------------------------------------------------------------------


def sizes(device):
    """Sizes either side of every boundary of `device`'s kernels."""
    return CUDA_SIZES if device == "cuda" else ALL_SIZES


def to_device(tensors, device):
    """Copies of `tensors` on `device` (fresh copies on the CPU too)."""
    return [t.to(device, copy=True) for t in tensors]


def host(tensors):
    return [t.detach().cpu() for t in tensors]
