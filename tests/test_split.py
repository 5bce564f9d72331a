"""Threads sharing a call as torch's next kernel will (multi_tensor.h, AMPX_SPLIT_*).

For calls of at most ``set_split_max_bytes`` bytes on torch's OpenMP team, the scaler asks the
CPU kernels to give each thread exactly the part of each tensor that torch's next kernel gives
the thread of the same number (its fused optimizers: every tensor's 64-byte lines shared evenly;
its elementwise ops: tensors of up to 32,768 elements on thread 0). Covers, against float64
references and the dynamic split: every op and dtype at sizes either side of the line unit, the
grain and the chunk, 2, 3 and 5 threads, inf/NaN reported at their own index; that the split
really ran where it should and fell back where it should not (``_C._last_split``): over the byte
limit, on ampx's own pool, in a team smaller than asked; spans not merged under it; a bad
``split`` refused by name; and that the scaler picks it by optimizer. (A forked child after a
split call: tests/test_threads.py, test_forked_child_runs_parallel_calls_on_the_pool.)
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ampx
from ampx import ops
from conftest import (
    CHUNK,
    assert_bits_equal,
    assert_norm_close,
    expected_flags,
    force_threads,
    norm_ref64,
    special_values,
    switched,
    unscale_ref,
)

# either side of a 64-byte line (8/16/32 elements), of the elementwise grain and of the chunk
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 4095, 4096, 4097, 32767, 32768, 32769,
         CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 17]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SPLITS = [ops.SPLIT_FUSED, ops.SPLIT_ELEMENTWISE]
_MODE = {"unscale": ops._SCALE | ops._WRITE | ops._CHECK, "norm": ops._CHECK | (1 << ops._SHIFT),
         "unscale_norm": ops._SCALE | ops._WRITE | ops._CHECK | (1 << ops._SHIFT), "mul": ops._SCALE | ops._WRITE}


ON_POOL = ops.thread_backend() == "ampx pool"
needs_team = pytest.mark.skipif(ON_POOL, reason="work runs on ampx's pool (AMPX_THREADING=pool or no OpenMP): "
                                                "the split never follows torch's there")
pytestmark = needs_team


def split_limit(n):
    return switched(ampx._C.set_split_max_bytes, n)


@pytest.fixture(autouse=True)
def _torch_thread_count(monkeypatch):
    # ampx's calls take torch's thread count (not a fixed AMPX_NUM_THREADS), as the split requires
    monkeypatch.setattr(ops, "_FIXED_THREADS", None)


def data(rng, dtype, sizes):
    return [special_values(dtype, n, rng, p_special=0.01) for n in sizes]


def run(op, tensors, split, nthreads, inv=0.25):
    """One _C.scale_reduce of `op`; returns (found_inf, flags, total, per-tensor)."""
    found = torch.zeros(())
    flags = torch.zeros(len(tensors), dtype=torch.uint8)
    total = torch.zeros(()) if "norm" in op else None
    per = torch.zeros(len(tensors)) if "norm" in op else None
    kw = {"factor": inv} if op != "norm" else {}
    if op != "mul":
        kw.update(found_inf=found, flags=flags)
    ampx._C.scale_reduce("test", tensors, _MODE[op], out=total, per_tensor=per, split=split, nthreads=nthreads, **kw)
    return found, flags, total, per


@pytest.mark.parametrize("nthreads", [2, 3, 5])
@pytest.mark.parametrize("split", SPLITS, ids=["fused", "elementwise"])
@pytest.mark.parametrize("op", list(_MODE))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_split_against_references(rng, dtype, op, split, nthreads):
    xs = data(rng, dtype, SIZES)
    orig = [x.clone() for x in xs]
    same = [x.clone() for x in xs]
    with force_threads(nthreads), split_limit(1 << 40):
        found, flags, total, per = run(op, xs, split, nthreads)
        assert ampx._C._last_split() == split
        with split_limit(0):
            d_found, d_flags, d_total, d_per = run(op, same, split, nthreads)
            assert ampx._C._last_split() == ops.SPLIT_DYNAMIC
    if op in ("unscale", "unscale_norm", "mul"):
        for x, o in zip(xs, orig):
            assert_bits_equal(x, unscale_ref(o, 0.25))
        for x, y in zip(xs, same):
            assert_bits_equal(x, y)
    else:
        for x, o in zip(xs, orig):
            assert_bits_equal(x, o)  # read only
    if op != "mul":
        assert flags.tolist() == expected_flags(orig)
        assert torch.equal(flags, d_flags)
        assert float(found) == float(d_found) == (1.0 if bool(flags.any()) else 0.0)
    if "norm" in op:
        ref_total, ref_per = norm_ref64(xs, 2)
        assert_norm_close(total, ref_total)
        for i, (g, r) in enumerate(zip(per.tolist(), ref_per)):
            assert_norm_close(g, r, msg=f"tensor {i} ({xs[i].numel()} elements)")
        # flags of the NaN/inf tensors agree; finite totals agree to float32 rounding
        assert_norm_close(total, float(d_total))


@pytest.mark.parametrize("nthreads", [2, 3, 5])
@pytest.mark.parametrize("split", SPLITS, ids=["fused", "elementwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_split_norms_of_finite_data(rng, dtype, split, nthreads):
    # finite values (no NaN to hide a wrong sum), subnormals and -0.0 included
    xs = [torch.tensor(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n), dtype=dtype) for n in SIZES]
    tiny = torch.finfo(dtype).tiny
    for x in xs:
        if x.numel() > 2:
            x[0], x[-1] = -0.0, tiny / 4 if dtype != torch.bfloat16 else tiny
    orig = [x.clone() for x in xs]
    with force_threads(nthreads), split_limit(1 << 40):
        found, flags, total, per = run("unscale_norm", xs, split, nthreads, inv=0.5)
        assert ampx._C._last_split() == split
        n_found, _, n_total, n_per = run("norm", orig, split, nthreads)
    assert float(found) == float(n_found) == 0.0 and not bool(flags.any())
    ref_total, ref_per = norm_ref64(xs, 2)  # of the values as stored
    assert_norm_close(total, ref_total)
    for i, (g, r) in enumerate(zip(per.tolist(), ref_per)):
        assert_norm_close(g, r, msg=f"tensor {i} ({xs[i].numel()} elements)")
    ref_total, ref_per = norm_ref64(orig, 2)
    assert_norm_close(n_total, ref_total)
    for i, (g, r) in enumerate(zip(n_per.tolist(), ref_per)):
        assert_norm_close(g, r, msg=f"tensor {i}")


def _torch_parallel_for(begin, end, grain, T):
    """torch's at::parallel_for on OpenMP (ParallelOpenMP.h, invoke_parallel), as parts per thread."""
    n = end - begin
    if n <= 0:
        return [(begin, begin)] * T
    if not (n > grain and n > 1 and T > 1):  # runs inline on the caller (thread 0)
        return [(begin, end)] + [(begin, begin)] * (T - 1)
    used = min(T, -(-n // grain)) if grain > 0 else T
    chunk = -(-n // used)
    parts = []
    for t in range(T):
        b = begin + t * chunk
        parts.append((b, min(end, b + chunk)) if t < used and b < end else (begin, begin))
    return parts


@pytest.mark.parametrize("elem", [2, 4, 8])
@pytest.mark.parametrize("nthreads", [1, 2, 3, 4, 7, 16, 64])
def test_parts_are_torchs(elem, nthreads):
    sizes = sorted({0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 1000, 4095, 4096, 4097}
                   | {g + d for g in (32768, 65536, 98304, 200000) for d in (-17, -1, 0, 1, 17)})
    unit = 64 // elem
    for numel in sizes:
        # LINES: torch's fused optimizers, parallel_for(0, ceil(numel / unit), 0) over 64-byte lines
        lines = _torch_parallel_for(0, -(-numel // unit), 0, nthreads)
        # ELEMENTS: torch's elementwise ops, parallel_for(0, numel, 32768)
        elems = _torch_parallel_for(0, numel, 32768, nthreads)
        for t in range(nthreads):
            b, e = lines[t]
            want = (min(b * unit, numel), min(e * unit, numel))
            got = ampx._C._torch_part(ops.SPLIT_FUSED, numel, elem, nthreads, t)
            assert (got[0] == got[1] and want[0] == want[1]) or got == want, ("lines", numel, nthreads, t, got, want)
            b, e = elems[t]
            got = ampx._C._torch_part(ops.SPLIT_ELEMENTWISE, numel, elem, nthreads, t)
            assert (got[0] == got[1] and b == e) or got == (b, e), ("elements", numel, nthreads, t, got, (b, e))


def test_split_falls_back_over_the_byte_limit(rng):
    xs = data(rng, torch.float32, [1000, 5000])
    nbytes = 6000 * 4
    with force_threads(2):
        with split_limit(nbytes):
            run("norm", xs, ops.SPLIT_FUSED, 2)
            assert ampx._C._last_split() == ops.SPLIT_FUSED
        with split_limit(nbytes - 1):
            run("norm", xs, ops.SPLIT_FUSED, 2)
            assert ampx._C._last_split() == ops.SPLIT_DYNAMIC


def test_one_thread_never_follows(rng):
    xs = data(rng, torch.float32, [70000])
    with force_threads(1), split_limit(1 << 40):
        run("norm", xs, ops.SPLIT_FUSED, 1)
        assert ampx._C._last_split() == ops.SPLIT_DYNAMIC


def test_other_team_sizes_never_follow(rng):
    # parts line up with torch's only for its own team size; past AMPX_MAX_THREADS never
    xs = data(rng, torch.float32, [70000])
    with force_threads(2), split_limit(1 << 40):
        for n in (3, 300):
            found, flags, total, _ = run("norm", xs, ops.SPLIT_FUSED, n)
            assert ampx._C._last_split() == ops.SPLIT_DYNAMIC
            assert flags.tolist() == expected_flags(xs)


def test_small_calls_never_follow(rng):
    xs = data(rng, torch.float32, [1000, 2000])
    with force_threads(2), split_limit(1 << 40), switched(ampx._C.set_parallel_threshold, 1 << 20):
        run("norm", xs, ops.SPLIT_FUSED, 2)
        assert ampx._C._last_split() == ops.SPLIT_DYNAMIC


def test_views_are_not_merged_under_the_split(rng):
    buf = special_values(torch.float32, 40000, rng, p_special=0.001)
    vs = list(torch.split(buf, [10000] * 4))
    with force_threads(2), split_limit(1 << 40):
        ops.mul_(vs, 0.5, _split=ops.SPLIT_FUSED)
        assert ampx._C._last_split() == ops.SPLIT_FUSED and ampx._C._last_spans() == -1
        ops.mul_(vs, 2.0)
        assert ampx._C._last_split() == ops.SPLIT_DYNAMIC and ampx._C._last_spans() == 1


@pytest.mark.parametrize("bad", [-1, 3, 99])
def test_bad_split_is_refused_by_name(bad):
    x = torch.ones(10)
    with pytest.raises(ValueError, match="split must be 0"):
        ampx._C.scale_reduce("test", [x], _MODE["mul"], factor=2.0, split=bad, nthreads=2)
    assert torch.equal(x, torch.ones(10))


def test_split_max_bytes_refuses_negative():
    with pytest.raises(ValueError, match="set_split_max_bytes"):
        ampx._C.set_split_max_bytes(-1)


_SUB = textwrap.dedent("""
    import sys, torch, ampx
    from ampx import ops
    torch.manual_seed(0)
    torch.set_num_threads(4)
    xs = [torch.randn(n) for n in (5, 4097, 40000, 70001)]
    ref = [x.double() * 0.25 for x in xs]
    ampx._C.set_parallel_threshold(0)
    ampx._C.set_split_max_bytes(1 << 40)
    found = torch.zeros(())
    ampx._C.scale_reduce("t", xs, ops._SCALE | ops._WRITE | ops._CHECK, factor=0.25, found_inf=found,
                         split=1, nthreads=4)
    ok = all(torch.equal(x.double(), r) for x, r in zip(xs, ref)) and float(found) == 0.0
    print(ampx._C._last_split(), ops.thread_backend(), ok, sep="|")
""")


def _sub(env):
    out = subprocess.run([sys.executable, "-c", _SUB], env=dict(os.environ, **env), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    split, backend, ok = out.stdout.strip().split("|")
    return int(split), backend, ok == "True"


def test_pool_backend_shares_dynamically():
    split, backend, ok = _sub({"AMPX_THREADING": "pool"})
    assert backend == "ampx pool" and split == ops.SPLIT_DYNAMIC and ok


def test_a_team_smaller_than_asked_still_covers_every_part():
    # OMP_THREAD_LIMIT=1: the runtime gives one thread where four were asked; it must run all four parts.
    split, backend, ok = _sub({"OMP_THREAD_LIMIT": "1"})
    assert backend != "ampx pool" and split == ops.SPLIT_FUSED and ok


# ---- the scaler picks the split by optimizer ------------------------------------------------


def _model_grads(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(40, 40), (4096,), (33, 7)] * (n // 3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 512.0
    return params


@pytest.mark.parametrize("kind,expected", [("fused", ops.SPLIT_FUSED), ("foreach", ops.SPLIT_ELEMENTWISE),
                                           ("plain", ops.SPLIT_ELEMENTWISE)])
def test_scaler_follows_the_optimizers_kernel(kind, expected):
    results = {}
    for limit in (1 << 40, 0):
        params = _model_grads()
        kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "plain": {"foreach": False}}[kind]
        opt = torch.optim.AdamW(params, lr=1e-3, **kw)
        scaler = ampx.GradScaler("cpu", init_scale=512.0)
        scaler.scale(torch.ones(()))
        with force_threads(2), split_limit(limit):
            scaler.clip_grad_norm_(opt, 1.0)
            assert ampx._C._last_split() == (expected if limit else ops.SPLIT_DYNAMIC)
            scaler.step(opt)
            scaler.update()
        results[limit] = [p.detach().clone() for p in params]
    for a, b in zip(results[1 << 40], results[0]):
        # the norm's float64 sum is grouped by thread part under the split: the same to float32 rounding
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_master_weights_keep_the_dynamic_split():
    from ampx.scaler import _split
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    mw = ampx.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    assert _split(mw) == ops.SPLIT_DYNAMIC
    assert _split(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), fused=True)) == ops.SPLIT_FUSED


def test_concurrent_python_threads_under_the_split(rng):
    """Several Python threads, each a split call big enough to release the GIL: each result right."""
    import threading

    datas = [data(rng, torch.float32, [70000, 33000, 5]) for _ in range(4)]
    refs = [[unscale_ref(x, 0.25) for x in xs] for xs in datas]
    errors = []

    def work(xs):
        try:
            for _ in range(5):
                run("unscale", xs, ops.SPLIT_FUSED, 2, inv=1.0)
            run("unscale", xs, ops.SPLIT_FUSED, 2, inv=0.25)
        except Exception as e:  # reported below
            errors.append(e)

    with force_threads(2), split_limit(1 << 40):
        threads = [threading.Thread(target=work, args=(xs,)) for xs in datas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    for xs, rs in zip(datas, refs):
        for x, r in zip(xs, rs):
            assert_bits_equal(x, r)
