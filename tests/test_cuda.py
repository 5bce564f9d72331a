"""CUDA-only behaviour: what has no CPU counterpart.

What each op computes is tested once, on every device, where the op lives (test_ops.py,
test_numerics.py, test_errors.py: their `device` fixture adds a "cuda" run that also
checks the GPU's bits against ampx's CPU kernels). This file keeps the rest.

Everywhere (no GPU needed):
  * ampx imports; ampx.cuda says whether it is available and, when not, why;
  * the fatbin was built into the package when nvcc is present, with SASS for sm_80, 86, 89,
    90, 100, 120 and PTX for compute_80, by CUDA 12 when its ptxas is installed, and the toolkit
    recorded beside it;
  * the C host layer validates CUDA calls before touching the driver, and reports a missing
    driver as an exception;
  * the multi-tensor launcher (csrc/cuda_launch.c), compiled against a fake driver that records
    launches: every element of every tensor is covered exactly once, launches respect the
    parameter-block limits, the workspace layout fits its allocation;
  * an independent (numpy) implementation of the stochastic-rounding hash agrees with ampx's CPU
    cast, so it can check the GPU's bits past 2**32 elements;
  * the kernel source itself (cuda/ampx_kernels.cu), emulated on the CPU through the real
    launcher: stored values, flags and norms equal the CPU kernels'.

On a CUDA machine (skipped elsewhere): tensors on two devices refused, kernels run on the
tensors' device whatever the current one, on a side stream, no host synchronisation in a
fused-AdamW step, a scaler sequence captured into a CUDA graph and replayed, and 64-bit
element indices (past 2**31 and 2**32 elements).
"""
import math
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest
import torch

import ampx
from ampx import _C, ops
from conftest import (
    CHUNK,
    CUDA,
    FLOAT_DTYPES,
    NO_CUDA_REASON,
    SMALL_SIZES,
    assert_bits_equal,
    assert_exactly_equal,
    assert_norm_close,
    assert_same_float,
    clones,
    dt_id,
    expected_flags,
    f32,
    finite_values,
    host,
    norm_ref64,
    rand_list,
    special_values,
    unscale_ref,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG_INF, FLAG_NAN = ops.FLAG_INF, ops.FLAG_NAN

gpu = pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON)
two_gpus = pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")

BLOCK = _C.CUDA_BLOCK
MAX_T = _C.CUDA_MAX_TENSORS
assert _C.CUDA_CHUNK == CHUNK


# ============================================================== everywhere ==


def _find_nvcc():
    """The nvcc setup.py would use (same search order)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            c = os.path.join(os.environ[var], "bin", "nvcc")
            if os.path.isfile(c) and os.access(c, os.X_OK):
                return c
    if os.path.isfile("/usr/local/cuda/bin/nvcc") and os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        return "/usr/local/cuda/bin/nvcc"
    return shutil.which("nvcc")


def test_import_and_availability_is_explained():
    reason = ampx.cuda.unavailable_reason()
    assert ampx.cuda.is_available() is (reason is None)
    if reason is not None:
        assert isinstance(reason, str) and len(reason) > 20
    if not torch.cuda.is_available():
        assert ampx.cuda.is_available() is False
        assert reason


def _fatbin_entries(data):
    """(kind, arch) of each entry of a fatbin: kind 1 is PTX, 2 is an ELF cubin. The container
    layout (as nvcc 12 and 13 write it): a 16-byte header (magic 0xBA55ED50, version,
    header size, payload size), then entries whose header holds the kind (u16 at 0), the header
    size (u32 at 4), the payload size (u64 at 8) and the architecture (u32 at 28)."""
    magic, _, hsz, size = struct.unpack_from("<IHHQ", data, 0)
    assert magic == 0xBA55ED50, hex(magic)
    out, off = [], hsz
    while off < hsz + size:
        kind, _, ehs, psize = struct.unpack_from("<HHIQ", data, off)
        arch = struct.unpack_from("<I", data, off + 28)[0]
        out.append((kind, arch, data[off + ehs: off + ehs + psize]))
        off += ehs + psize
    return out


def _elf_sm(cubin):
    """The SM architecture an ELF cubin was built for, from its e_flags."""
    assert cubin[:4] == b"\x7fELF"
    flags = struct.unpack_from("<I", cubin, 48)[0]
    abi_version = cubin[8]
    return (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF


@pytest.mark.skipif(_find_nvcc() is None or os.environ.get("AMPX_CUDA", "") == "0",
                    reason="no nvcc: ampx is built without its CUDA kernels")
def test_fatbin_was_built_into_the_package_with_every_arch():
    path = ampx.cuda.fatbin_path()
    assert os.path.dirname(path) == os.path.dirname(ampx.__file__)
    assert os.path.isfile(path) and os.path.getsize(path) > 100_000, path
    data = open(path, "rb").read()
    entries = _fatbin_entries(data)
    sass = sorted(arch for kind, arch, _ in entries if kind == 2)
    ptx = sorted(arch for kind, arch, _ in entries if kind == 1)
    info = ampx.cuda.build_info()
    # Blackwell SASS needs CUDA 12.8 (an older toolkit leaves those GPUs to the PTX).
    want = [80, 86, 89, 90, 100, 120] if info.get("sass_toolkit", 0) >= 12080 else [80, 86, 89, 90]
    assert sass == want, ([(k, a) for k, a, _ in entries], info)
    assert ptx == [80]
    for kind, arch, payload in entries:  # the container's arch agrees with each cubin's own
        if kind == 2:
            assert _elf_sm(payload) == arch
    assert info["sass"] == sass and info["ptx"] == ptx, info
    # The PTX's ISA version is the one the recorded PTX release's driver JITs: the CUDA 12 route
    # stamps CUDA 12.0's (8.0, any R525+ driver); nvcc 13 alone writes 9.0. (Uncompressed here.)
    isa = {12000: b"8.0", 13000: b"9.0"}.get(info["ptx_toolkit"])
    assert isa is not None or info["ptx_toolkit"] < 12000, info
    if isa is not None:
        assert b"\n.version " + isa + b"\n" in data, info


def test_fatbin_prefers_a_cuda12_ptxas_so_old_drivers_load_it():
    """With the nvidia-cuda-nvcc-cu12 package present (CI installs it), the SASS comes from CUDA
    12 (any R525+ driver loads it), whatever release the system nvcc is."""
    if not os.path.isfile(ampx.cuda.fatbin_path()):
        pytest.skip("ampx was built without its CUDA kernels")
    import importlib.util

    if importlib.util.find_spec("nvidia") is None or not any(
            os.path.isfile(os.path.join(p, "cuda_nvcc", "bin", "ptxas"))
            for p in importlib.util.find_spec("nvidia").submodule_search_locations):
        pytest.skip("nvidia-cuda-nvcc-cu12 is not installed (pip install nvidia-cuda-nvcc-cu12)")
    assert 12080 <= ampx.cuda.build_info()["sass_toolkit"] < 13000, ampx.cuda.build_info()


def test_cuda_entry_points_validate_before_the_driver():
    """Bad input to the CUDA entry points is refused before any driver call (so the messages are
    the same with or without a GPU), and a driver that cannot be used is an exception."""
    mode = _C.MODE_SCALE | _C.MODE_WRITE | _C.MODE_CHECK
    alloc = None
    with pytest.raises(ValueError, match=r"tensors\[0\] is on cpu.*cuda:0"):
        _C.scale_reduce("op", [torch.ones(3)], mode, factor=0.5, device=0, stream=0, alloc=alloc)
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a torch.Tensor"):
        _C.scale_reduce("op", [7], mode, factor=0.5, device=0, stream=0, alloc=alloc)
    with pytest.raises(ValueError, match=r"src\[0\] is on cpu"):
        _C.cast("op", [torch.ones(2)], [torch.ones(2)], device=0, stream=0, alloc=alloc)
    with pytest.raises(ValueError, match=r"scale is on cpu"):
        _C.update_scale(torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 10,
                        hysteresis=1, consecutive=False, min_scale=0.0, max_scale=math.inf, device=0, stream=0)
    with pytest.raises(ValueError, match="no kernel for mode"):
        _C.scale_reduce("op", [torch.ones(3)], 31 + 1, factor=0.5, device=0, stream=0, alloc=alloc)
    if not torch.cuda.is_available():
        assert isinstance(_C.cuda_probe(0), str)
        with pytest.raises((RuntimeError, ValueError)):
            ampx.cuda.device_info(0)


def test_cpu_call_with_a_cuda_tensor_names_it():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cuda:0.*CPU"):
        ops.unscale_([torch.ones(3), torch.ones(3, device="cuda")], 0.5, torch.zeros(1))


# ---- the launcher against a fake driver -------------------------------------------------

_FAKE_DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cuda_driver.h"

/* The driver calls cuda_launch.c makes, recorded: each launch replays the kernel's chunk-to-slot
 * mapping (run_chunks in cuda/ampx_kernels.cu) and prints one line per chunk. */
static int depth;
int ampx_cu_push(const ampx_cu_dev *dev, ampx_cu_error *err) { (void)dev; (void)err; depth++; return 0; }
int ampx_cu_pop(ampx_cu_error *err) { (void)err; depth--; return 0; }
int ampx_cu_memset32(ampx_cu_deviceptr p, unsigned value, size_t count, ampx_cu_stream s, ampx_cu_error *err)
{
    (void)s; (void)err;
    printf("memset %llu %u %zu %d\n", (unsigned long long)p, value, count, depth);
    return 0;
}
int ampx_cu_launch(ampx_cu_function f, unsigned grid, unsigned block, ampx_cu_stream s, void *args,
                   const char *what, ampx_cu_error *err)
{
    (void)f; (void)s; (void)what; (void)err;
    const ampx_cu_args *a = (const ampx_cu_args *)args;
    printf("launch %u %u %u %u %u %d %llu %llu %llu %llu %llu %u %llu\n", grid, block, a->ntensors, a->nchunks,
           a->chunk_base, depth, (unsigned long long)a->tcount, (unsigned long long)a->done,
           (unsigned long long)a->partials, (unsigned long long)a->pt, (unsigned long long)a->flags_out, a->kind,
           (unsigned long long)a->per_out);
    for (uint32_t c = 0; c < a->nchunks; c++) {
        int lo = 0, hi = (int)a->ntensors - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (a->first[mid] <= c) lo = mid; else hi = mid - 1;
        }
        uint32_t j = c - a->first[lo], nch = a->first[lo + 1] - a->first[lo];
        int64_t start = (int64_t)j << AMPX_CU_CHUNK_LOG2;
        int64_t len = a->numel[lo] - start;
        if (len > AMPX_CU_CHUNK) len = AMPX_CU_CHUNK;
        if (len < 0) len = 0;
        printf("chunk %u %lld %lld %u %u %llu %d %llu\n", a->index[lo], (long long)start, (long long)len,
               a->chunk_base + a->first[lo] + j, nch, (unsigned long long)a->ptr[lo], a->dtype[lo],
               (unsigned long long)a->src[lo]);
    }
    return 0;
}

int main(void)
{
    int n, with_flags, with_total, sequential, stats;
    if (scanf("%d %d %d %d %d", &n, &with_flags, &with_total, &sequential, &stats) != 5) return 2;
    ampx_cu_tensor *ts = calloc((size_t)n + 1, sizeof *ts);
    for (int i = 0; i < n; i++) {
        long long numel; int dt;
        if (scanf("%lld %d", &numel, &dt) != 2) return 2;
        ts[i].numel = numel; ts[i].dtype = dt; ts[i].index = (uint32_t)i;
        ts[i].ptr = 0x100000000ull * (uint64_t)(i + 1);
    }
    ampx_cu_job job; memset(&job, 0, sizeof job);
    job.kind = AMPX_CU_SCALE; job.reduce = with_total ? 1 : 0; job.write = 1; job.scale = 1;
    job.flags_out = with_flags ? 0xF1A60000ull : 0; job.total_out = with_total ? 0x7074000ull : 0;
    if (stats) { /* tensor_stats: rows only */
        memset(&job, 0, sizeof job);
        job.kind = AMPX_CU_STATS; job.per_out = 0x57A70000ull;
    }
    int64_t chunks = 0;
    int64_t bytes = ampx_cu_workspace_bytes(&job, ts, n, &chunks);
    printf("ws %lld %lld\n", (long long)bytes, (long long)chunks);
    static ampx_cu_dev dev;
    dev.scale[job.reduce][1][1] = (ampx_cu_function)&dev; /* any non-NULL */
    dev.stats = (ampx_cu_function)&dev;
    static ampx_cu_launcher L;
    ampx_cu_error err;
    uint64_t ws = bytes > 0 ? 0x5000000000ull : 0;
    if (ampx_cu_begin(&L, &dev, NULL, &job, n, chunks, ws, &err)) { printf("error %s\n", err.msg); return 1; }
    for (int i = 0; i < n; i++) {
        if (ampx_cu_add(&L, &ts[i], &err)) { printf("error %s\n", err.msg); return 1; }
        if (sequential && ampx_cu_flush(&L, &err)) { printf("error %s\n", err.msg); return 1; }
    }
    if (ampx_cu_flush(&L, &err)) { printf("error %s\n", err.msg); return 1; }
    printf("end %d\n", depth);
    free(ts);
    return 0;
}
"""


@pytest.fixture(scope="module")
def fake_launcher(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("fake_launcher")
    src = d / "fake.c"
    src.write_text(_FAKE_DRIVER)
    exe = d / "fake"
    subprocess.run([cc, "-std=c11", "-O1", "-Wall", "-Werror", "-I", os.path.join(ROOT, "csrc"), str(src),
                    os.path.join(ROOT, "csrc", "cuda_launch.c"), "-o", str(exe)], check=True)
    return str(exe)


def _run_fake(exe, numels, flags, total, sequential, dtypes=None, stats=False):
    dtypes = dtypes or [0] * len(numels)
    inp = f"{len(numels)} {int(flags)} {int(total)} {int(sequential)} {int(stats)}\n" + "".join(
        f"{n} {dt}\n" for n, dt in zip(numels, dtypes))
    out = subprocess.run([exe], input=inp, capture_output=True, text=True, check=True).stdout.split("\n")
    return [line.split() for line in out if line]


@pytest.mark.parametrize("case", ["small", "launch_edges", "big", "empties", "mixed"])
@pytest.mark.parametrize("outputs", ["none", "flags", "total"])
@pytest.mark.parametrize("sequential", [False, True])
def test_launcher_covers_every_element_once(fake_launcher, case, outputs, sequential):
    rng = np.random.default_rng(len(case) * 7 + len(outputs) + sequential)
    if case == "small":
        numels = [1, 5, 1000]
    elif case == "launch_edges":
        numels = [int(rng.integers(1, 300)) for _ in range(2 * MAX_T + 3)]
    elif case == "big":
        numels = [CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, (1 << 31) + 3, 17]
    elif case == "empties":
        numels = [0, 0, 5, 0, CHUNK + 1, 0]
    else:
        numels = [int(rng.integers(0, 3 * CHUNK)) for _ in range(300)]
    with_ws = outputs != "none"
    rows = _run_fake(fake_launcher, numels, outputs == "flags", outputs == "total", sequential)
    assert rows[0][0] == "ws", rows[:3]
    ws_bytes, nchunks_ws = int(rows[0][1]), int(rows[0][2])
    assert rows[-1] == ["end", "0"]  # every push popped
    expected_chunks = [max(1 if with_ws else 0, -(-n // CHUNK)) for n in numels]
    if with_ws:
        assert nchunks_ws == sum(expected_chunks)
        assert ws_bytes >= 4 * (len(numels) + 1) + 16 * nchunks_ws + 8 * len(numels)
    else:
        assert ws_bytes == 0
    memsets = [r for r in rows if r[0] == "memset"]
    if with_ws:
        assert len(memsets) == 1 and int(memsets[0][3]) == len(numels) + 1 and memsets[0][2] == "0"
        assert memsets[0][4] == "1"  # inside a pushed context
    else:
        assert memsets == []
    covered = {i: [] for i in range(len(numels))}
    slots = set()
    launches = [r for r in rows if r[0] == "launch"]
    chunk_base = 0
    for r in rows:
        if r[0] == "launch":
            grid, block, ntensors, nch, base, depth = (int(x) for x in r[1:7])
            assert block == BLOCK and depth == 1
            assert 1 <= ntensors <= MAX_T and grid == min(nch, 1 << 20)
            assert base == chunk_base
            chunk_base += nch
            if sequential:
                assert ntensors == 1
            if with_ws:
                tcount, done, partials, pt = (int(x) for x in r[7:11])
                ws = 0x5000000000
                assert tcount == ws and done == ws + 4 * len(numels)
                assert partials >= done + 4 and partials % 16 == 0
                assert pt == partials + 16 * nchunks_ws
                assert pt + 8 * len(numels) <= ws + ws_bytes
        elif r[0] == "chunk":
            idx, start, length, pslot, nch = (int(x) for x in r[1:6])
            assert int(r[6]) == 0x100000000 * (idx + 1)
            covered[idx].append((start, length))
            assert nch == expected_chunks[idx]
            if with_ws:
                assert pslot not in slots and pslot < nchunks_ws
                slots.add(pslot)
    assert len(launches) >= (1 if sum(expected_chunks) else 0)
    for i, n in enumerate(numels):
        spans = sorted(covered[i])
        if n == 0:
            assert spans == ([(0, 0)] if with_ws else []), (i, spans)
            continue
        pos = 0
        for start, length in spans:
            assert start == pos and 0 < length <= CHUNK, (i, spans[:3])
            pos += length
        assert pos == n


@pytest.mark.parametrize("case", ["small", "launch_edges", "big", "empties", "mixed"])
def test_launcher_gives_a_stats_job_one_accumulator_row_per_long_tensor(fake_launcher, case):
    """tensor_stats: every tensor gets its chunks (an empty one, one of length 0) so its row is
    written; each tensor of several chunks its own accumulator row of the workspace (its src),
    zeroed by one memset; one-chunk tensors none."""
    rng = np.random.default_rng(len(case))
    numels = {"small": [1, 5, 1000], "launch_edges": [int(rng.integers(0, 300)) for _ in range(2 * MAX_T + 3)],
              "big": [CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 17, 2 * CHUNK],
              "empties": [0, 0, 5, 0, CHUNK + 1, 0],
              "mixed": [int(rng.integers(0, 3 * CHUNK)) for _ in range(300)]}[case]
    rows = _run_fake(fake_launcher, numels, False, False, False, stats=True)
    ws_bytes, nacc = int(rows[0][1]), int(rows[0][2])
    row_bytes, ws = 8 * _C.STATS_WIDTH, 0x5000000000
    long_ones = [i for i, n in enumerate(numels) if n > CHUNK]
    assert nacc == len(long_ones) and ws_bytes == row_bytes * nacc and rows[-1] == ["end", "0"]
    memsets = [r for r in rows if r[0] == "memset"]
    assert memsets == ([["memset", str(ws), "0", str(ws_bytes // 4), "1"]] if nacc else [])
    src, covered = {}, {i: 0 for i in range(len(numels))}
    for r in rows:
        if r[0] == "launch":
            assert int(r[12]) == 2 and int(r[13]) == 0x57A70000  # AMPX_CU_STATS (cuda_args.h), the rows
        elif r[0] == "chunk":
            idx, length = int(r[1]), int(r[3])
            covered[idx] += length
            src.setdefault(idx, set()).add(int(r[8]))
    assert covered == dict(enumerate(numels)) and sorted(src) == list(range(len(numels)))
    for i in range(len(numels)):
        assert src[i] == ({ws + row_bytes * long_ones.index(i)} if i in long_ones else {0}), i


# ---- the stochastic-rounding hash, reimplemented --------------------------------------------

M32 = 0xFFFFFFFF


def _mix32(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def _sr_key(seed, offset, tensor, e_hi):
    h = _mix32(e_hi ^ 0x9E3779B9)
    h = _mix32(h ^ tensor)
    h = _mix32(h ^ (offset & M32))
    h = _mix32(h ^ (offset >> 32))
    h = _mix32(h ^ (seed & M32))
    a = _mix32(h ^ (seed >> 32))
    return a, _mix32(a ^ 0x85EBCA6B)


def sr_reference(value_f32, seed, offset, tensor, e):
    """The bfloat16 bits ampx's stochastic rounding stores for a finite float32 value at element
    e of tensor `tensor` (csrc/ampx_numerics.h, independently written)."""
    a, b = _sr_key(seed, offset, tensor, e >> 32)
    rnd = _mix32(_mix32((e & M32) ^ a) ^ b)
    u = int(np.array([value_f32], dtype=np.float32).view(np.uint32)[0])
    return ((u + (rnd & 0xFFFF)) & M32) >> 16


def test_sr_reference_matches_ampx_cpu():
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal(3000).astype(np.float32))
    for seed, offset in ((0, 0), (123, 9), (2**64 - 1, 2**63 + 5)):
        d = [torch.empty(5, dtype=torch.bfloat16), torch.empty(3000, dtype=torch.bfloat16)]
        ops.cast_([x[:5].clone(), x], d, rounding="stochastic", seed=seed, offset=offset)
        got = d[1].view(torch.int16).numpy().astype(np.uint16)
        for e in (0, 1, 2, 777, 2999):
            assert got[e] == sr_reference(float(x[e]), seed, offset, 1, e), (seed, offset, e)


# ---- the kernels themselves, emulated on the CPU ---------------------------------------------
#
# cuda/emulate.h compiles cuda/ampx_kernels.cu as C++ with one thread per CUDA thread (blocks of
# EMU_BLOCK threads, one block at a time, barriers for __syncthreads and the warp shuffles);
# cuda/emulate_driver.cpp runs them through the real launcher (csrc/cuda_launch.c) over an
# "arena" of bytes standing for device memory. Float16/bfloat16 conversions there are
# ampx_numerics.h's, so stored values must equal the CPU's bit for bit (NaN payloads too).

EMU_BLOCK = 64


def _build_emulator(d, block):
    cxx = shutil.which("g++") or shutil.which("c++")
    cc = shutil.which("gcc") or shutil.which("cc")
    if cxx is None or cc is None:
        pytest.skip("no C/C++ compiler")
    csrc, cuda = os.path.join(ROOT, "csrc"), os.path.join(ROOT, "cuda")
    flags = [f"-DAMPX_CU_BLOCK={block}", "-I", csrc, "-I", cuda, "-O1", "-pthread"]
    objs = []
    for lang, src in (("c++", os.path.join(cuda, "ampx_kernels.cu")), ("c++", os.path.join(cuda, "emulate_driver.cpp")),
                      ("c", os.path.join(csrc, "cuda_launch.c")), ("c", os.path.join(csrc, "coalesce.c"))):
        obj = str(d / (os.path.basename(src) + ".o"))
        if lang == "c":
            cmd = [cc, "-std=c11"] + flags + ["-c", src, "-o", obj]
        else:
            cmd = [cxx, "-std=c++17", "-ffp-contract=off", "-Wno-unknown-pragmas", "-DAMPX_CUDA_EMULATION",
                   "-include", os.path.join(cuda, "emulate.h")] + flags + ["-x", "c++", "-c", src, "-o", obj]
        subprocess.run(cmd, check=True)
        objs.append(obj)
    exe = str(d / f"emulate{block}")
    subprocess.run([cxx, "-pthread"] + objs + ["-o", exe], check=True)
    return exe


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Emulator(_build_emulator(tmp_path_factory.mktemp("emu"), EMU_BLOCK), EMU_BLOCK,
                    tmp_path_factory.mktemp("emu_run"))


@pytest.fixture(scope="module")
def emulator_full(tmp_path_factory):
    """The emulator at the real block size."""
    return Emulator(_build_emulator(tmp_path_factory.mktemp("emu_full"), BLOCK), BLOCK,
                    tmp_path_factory.mktemp("emu_full_run"))


class Arena:
    """Bytes standing for device memory; regions 256-byte aligned, plus an optional offset."""

    def __init__(self):
        self.buf = bytearray()

    def put(self, data, mis=0):
        off = (len(self.buf) + 255) // 256 * 256 + mis
        self.buf += b"\0" * (off - len(self.buf)) + bytes(data)
        return off

    def tensor(self, t, mis_elems=0):
        flat = t.detach().reshape(-1).contiguous()
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return self.put(data, mis_elems * flat.element_size())

    @staticmethod
    def read(buf, off, dtype, n):
        if n == 0:
            return torch.empty(0, dtype=dtype)
        es = torch.empty(0, dtype=dtype).element_size()
        return torch.frombuffer(bytearray(buf[off:off + n * es]), dtype=dtype).clone()


DT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


class Emulator:
    def __init__(self, exe, block, workdir):
        self.exe, self.block, self.dir = exe, block, str(workdir)

    def run(self, job, arena):
        jp, ap = os.path.join(self.dir, "job"), os.path.join(self.dir, "arena")
        with open(jp, "w") as f:
            f.write(job)
        with open(ap, "wb") as f:
            f.write(bytes(arena.buf) + b"\0" * 256)
        r = subprocess.run([self.exe, jp, ap], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return open(ap, "rb").read()

    def scale(self, tensors, *, reduce=0, write=False, scale=False, factor=1.0, factor_dev=False, found=False,
              flags=False, per=False, total=False, sequential=False, grid_cap=0, mis=0, spans=False, packed=None):
        """spans: the launcher gets coalesced span slots (with span tables when flags are
        wanted), as csrc/entry_cuda.c makes them. packed: "up" lays the tensors back to back in
        list order, "down" in reverse list order (DDP's bucket views), each starting `mis`
        elements past a 256-byte boundary; None gives each its own region."""
        ar = Arena()
        if packed is None:
            offs = [ar.tensor(t, mis) for t in tensors]
        else:
            blobs = [t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
                     for t in tensors]
            order = list(range(len(tensors))) if packed == "up" else list(range(len(tensors)))[::-1]
            base = ar.put(b"".join(blobs[i] for i in order), mis * (tensors[0].element_size() if tensors else 0))
            offs, at = [0] * len(tensors), base
            for i in order:
                offs[i], at = at, at + len(blobs[i])
        n = len(tensors)
        fo = ar.put(struct.pack("<f", factor)) if factor_dev else -1
        found_o = ar.put(b"\0" * 4) if found else -1
        flags_o = ar.put(b"\xff" * n) if flags else -1
        per_o = ar.put(b"\xee" * 4 * n) if per else -1
        total_o = ar.put(b"\xee" * 4) if total else -1
        job = (f"scale {reduce} {int(write)} {int(scale)} {float(factor).hex()} {fo} {found_o} {flags_o} {per_o} "
               f"{total_o} {int(sequential)} {grid_cap} {n} {int(spans)}\n")
        job += "".join(f"{DT_CODE[t.dtype]} 0 {t.numel()} {o} -1\n" for t, o in zip(tensors, offs))
        buf = self.run(job, ar)
        out = {"tensors": [Arena.read(buf, o, t.dtype, t.numel()).reshape(t.shape) for t, o in zip(tensors, offs)]}
        out["found"] = Arena.read(buf, found_o, torch.float32, 1) if found else None
        out["flags"] = Arena.read(buf, flags_o, torch.uint8, n) if flags else None
        out["per"] = Arena.read(buf, per_o, torch.float32, n) if per else None
        out["total"] = Arena.read(buf, total_o, torch.float32, 1)[0] if total else None
        return out

    def cast(self, srcs, dst_dtypes, *, factor=1.0, factor_dev=False, stochastic=False, seed=0, offset=0,
             rng_dev=False, found=False, flags=False, grid_cap=0, mis_src=0, mis_dst=0):
        """rng_dev: seed and offset travel in "device memory" (the kernel reads them there) and
        the job's own seed/offset fields hold other values."""
        ar = Arena()
        so = [ar.tensor(t, mis_src) for t in srcs]
        dsts = [torch.full((t.numel(),), 7.0, dtype=dt) for t, dt in zip(srcs, dst_dtypes)]
        do = [ar.tensor(t, mis_dst) for t in dsts]
        n = len(srcs)
        fo = ar.put(struct.pack("<f", factor)) if factor_dev else -1
        found_o = ar.put(b"\0" * 4) if found else -1
        flags_o = ar.put(b"\xff" * n) if flags else -1
        rng_o = ar.put(struct.pack("<QQ", seed, offset)) if rng_dev else -1
        if rng_dev:
            seed, offset = (seed + 1) % 2**64, (offset + 12345) % 2**64
        job = (f"cast {int(stochastic)} {seed} {offset} {rng_o} {float(factor).hex()} {fo} {found_o} {flags_o} "
               f"{grid_cap} {n}\n")
        job += "".join(f"{DT_CODE[d.dtype]} {DT_CODE[s.dtype]} {s.numel()} {o2} {o1}\n"
                       for s, d, o1, o2 in zip(srcs, dsts, so, do))
        buf = self.run(job, ar)
        out = {"dsts": [Arena.read(buf, o, d.dtype, d.numel()) for d, o in zip(dsts, do)],
               "srcs": [Arena.read(buf, o, s.dtype, s.numel()) for s, o in zip(srcs, so)]}
        out["found"] = Arena.read(buf, found_o, torch.float32, 1) if found else None
        out["flags"] = Arena.read(buf, flags_o, torch.uint8, n) if flags else None
        return out

    def stats(self, tensors, *, grid_cap=0, mis=0):
        """tensor_stats' rows ([n, WIDTH] float64) of tensors, each starting `mis` elements past a
        256-byte boundary; the rows start out as garbage (the kernel must write every column)."""
        ar = Arena()
        offs = [ar.tensor(t, mis) for t in tensors]
        n, width = len(tensors), _C.STATS_WIDTH
        rows_o = ar.put(b"\xee" * 8 * width * n)
        job = f"stats {rows_o} {grid_cap} {n}\n"
        job += "".join(f"{DT_CODE[t.dtype]} 0 {t.numel()} {o} -1\n" for t, o in zip(tensors, offs))
        buf = self.run(job, ar)
        return Arena.read(buf, rows_o, torch.float64, n * width).reshape(n, width)


def _emu_sizes(block, big=True):
    edges = {m * w * block for w in (2, 4, 8) for m in (1, 4)}
    sizes = set(SMALL_SIZES) | {e + d for e in edges for d in (-1, 0, 1)}
    if big:
        sizes |= {CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1}
    return sorted(sizes)


_REDUCE_ORD = {1: 2.0, 2: 1.0, 3: math.inf}
_EMU_MODES = {
    # name: (reduce, write, scale, check)
    "unscale_": (0, True, True, True),
    "mul_": (0, True, True, False),
    "check_finite": (0, False, False, True),
    "norm2": (1, False, False, True),
    "norm1": (2, False, False, True),
    "norminf": (3, False, False, True),
    "norm2_factor": (1, False, True, True),
    "norm1_factor": (2, False, True, True),
    "norminf_factor": (3, False, True, True),
    "unscale_norm2": (1, True, True, True),
    "unscale_norm1": (2, True, True, True),
    "unscale_norminf": (3, True, True, True),
}


def _cpu_same_call(name, tensors, factor):
    """ampx's CPU op for an _EMU_MODES entry: (tensors after, found, flags, per, total)."""
    reduce, write, scale, check = _EMU_MODES[name]
    c = clones(tensors)
    found = torch.zeros(1)
    flags = torch.zeros(len(c), dtype=torch.uint8)
    total = per = None
    f = torch.tensor([factor])
    if name == "unscale_":
        ops.unscale_(c, f, found, flags=flags)
    elif name == "mul_":
        ops.mul_(c, f)
    elif name == "check_finite":
        ops.check_finite(c, found, flags=flags)
    elif write:
        total, per = ops.unscale_norm_(c, f, found, ord=_REDUCE_ORD[reduce], flags=flags, per_tensor=True)
    else:
        total, per = ops.norm(c, _REDUCE_ORD[reduce], factor=f if scale else None, found_inf=found, flags=flags,
                              per_tensor=True)
    return c, found, flags, per, total


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dt_id)
@pytest.mark.parametrize("name", list(_EMU_MODES))
def test_emulated_kernels_match_cpu(emulator, dtype, name, rng):
    reduce, write, scale, check = _EMU_MODES[name]
    make = finite_values if reduce and not write and rng.random() < 0.5 else special_values
    tensors = [make(dtype, n, rng) for n in _emu_sizes(emulator.block)]
    factor = 0.37
    got = emulator.scale(tensors, reduce=reduce, write=write, scale=scale, factor=factor, factor_dev=True,
                         found=check, flags=check, per=reduce > 0, total=reduce > 0)
    c, found, flags, per, total = _cpu_same_call(name, tensors, factor)
    for i, (a, b) in enumerate(zip(got["tensors"], c)):
        assert_exactly_equal(a, b, f"{name} tensor {i} (n={b.numel()})")
    if check:
        assert got["flags"].tolist() == flags.tolist() == expected_flags(tensors)
        assert got["found"].item() == found.item()
    if reduce:
        assert_same_float(got["total"], total, "total")
        for i, (a, b) in enumerate(zip(got["per"].tolist(), per.tolist())):
            assert_same_float(a, b, f"per[{i}]")
        stored = c if write else ([unscale_ref(t, factor) for t in tensors] if scale else tensors)
        total_ref, per_ref = norm_ref64(stored, _REDUCE_ORD[reduce])
        assert_norm_close(float(got["total"]), total_ref)
        for a, r in zip(got["per"].tolist(), per_ref):
            assert_norm_close(a, r)
    if reduce:
        # the same bits whatever the alignment (scalar path), the grid (blocks looping over
        # chunks), and one launch per tensor
        for kw in ({"mis": 1}, {"grid_cap": 3}, {"sequential": True}):
            if kw.get("mis") and dtype == torch.float64:
                kw = {"mis": 1}  # 8 bytes: still not 16-byte aligned
            other = emulator.scale(tensors, reduce=reduce, write=write, scale=scale, factor=factor, factor_dev=True,
                                   per=True, total=True, **kw)
            assert_exactly_equal(other["per"], got["per"], f"{kw}")
            assert_exactly_equal(other["total"], got["total"], f"{kw}")
            for a, b in zip(other["tensors"], c):
                assert_exactly_equal(a, b)
    if name == "unscale_":  # the path without workspace: found_inf only
        fo = emulator.scale(tensors, write=True, scale=True, factor=factor, factor_dev=True, found=True)
        assert fo["found"].item() == found.item()
        for a, b in zip(fo["tensors"], c):
            assert_exactly_equal(a, b)


@pytest.mark.parametrize("src", FLOAT_DTYPES, ids=dt_id)
@pytest.mark.parametrize("dst", FLOAT_DTYPES, ids=dt_id)
def test_emulated_cast_matches_cpu(emulator, src, dst, rng):
    sizes = _emu_sizes(emulator.block, big=False) + [CHUNK + 3]
    srcs = [special_values(src, n, rng) for n in sizes]
    for factor, mis in ((1.0, (0, 0)), (0.37, (1, 0)), (2.0**-10, (0, 3))):
        got = emulator.cast(srcs, [dst] * len(srcs), factor=factor, factor_dev=factor != 1.0, found=True, flags=True,
                            mis_src=mis[0], mis_dst=mis[1])
        dc = [torch.full((t.numel(),), 7.0, dtype=dst) for t in srcs]
        found = torch.zeros(1)
        flags = torch.zeros(len(srcs), dtype=torch.uint8)
        ops.cast_(srcs, dc, inv_scale=None if factor == 1.0 else torch.tensor([factor]), found_inf=found, flags=flags)
        for i, (a, b) in enumerate(zip(got["dsts"], dc)):
            assert_exactly_equal(a, b, f"n={sizes[i]} factor={factor} mis={mis}")
        for a, b in zip(got["srcs"], srcs):
            assert_exactly_equal(a, b.reshape(-1), "source changed")
        assert got["flags"].tolist() == flags.tolist()
        assert got["found"].item() == found.item()


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.bfloat16], ids=dt_id)
def test_emulated_stochastic_rounding_matches_cpu(emulator, src, rng):
    sizes = _emu_sizes(emulator.block, big=False) + [2 * CHUNK + 5]
    srcs = [special_values(src, n, rng) for n in sizes]
    for seed, offset, cap, rng_dev in ((0, 0, 0, False), (123, 9, 2, False), (2**64 - 1, 2**63 + 5, 0, False),
                                       (123, 9, 2, True), (2**64 - 1, 2**63 + 5, 0, True)):
        # rng_dev: the kernel reads seed and offset from device memory (MasterWeights on CUDA,
        # so that a CUDA graph's replays take the offset the tensor holds then).
        got = emulator.cast(srcs, [torch.bfloat16] * len(srcs), factor=0.5, stochastic=True, seed=seed, offset=offset,
                            rng_dev=rng_dev, grid_cap=cap)
        dc = [torch.empty(t.numel(), dtype=torch.bfloat16) for t in srcs]
        ops.cast_(srcs, dc, inv_scale=0.5, rounding="stochastic", seed=seed, offset=offset)
        for i, (a, b) in enumerate(zip(got["dsts"], dc)):
            assert_exactly_equal(a, b, f"n={sizes[i]} seed={seed}")


@pytest.mark.parametrize("count", [MAX_T - 1, MAX_T, MAX_T + 1, 2 * MAX_T + 1])
def test_emulated_launch_splits_and_empty_tensors(emulator, count, rng):
    tensors = rand_list(rng, count, 2 * emulator.block)
    tensors[count // 2] = torch.empty(0)
    tensors[-1] = torch.empty(0, dtype=torch.float16)
    got = emulator.scale(tensors, reduce=1, write=True, scale=True, factor=0.5, found=True, flags=True, per=True,
                         total=True)
    c, found, flags, per, total = _cpu_same_call("unscale_norm2", tensors, 0.5)
    for a, b in zip(got["tensors"], c):
        assert_exactly_equal(a, b)
    assert got["flags"].tolist() == flags.tolist()
    assert got["found"].item() == found.item()
    assert_same_float(got["total"], total)
    for a, b in zip(got["per"].tolist(), per.tolist()):
        assert_same_float(a, b)
    assert got["per"][count // 2].item() == 0.0 and got["flags"][-1].item() == 0


def _span_case(dtype, rng, block):
    """Tensors for a coalesced call: many small ones, empties, ones straddling chunk
    boundaries, and non-finite values placed where attribution could slip: the last element
    of one tensor next to the first of the next, a tensor all NaN, both kinds in one."""
    sizes = [0, 1, 3, 2 * block - 1, 0, 17, CHUNK - 5, 9, CHUNK + 7, 0] + [int(rng.integers(1, 300)) for _ in range(150)]
    sizes += [4 * block + 1, 1, 0]
    tensors = [finite_values(dtype, n, rng) for n in sizes]
    nonempty = [i for i, n in enumerate(sizes) if n > 0]
    inf, nan = float("inf"), float("nan")
    a, b = nonempty[5], nonempty[6]  # adjacent in the list and in memory
    tensors[a][-1], tensors[b][0] = -inf, nan
    # one thread's first vector, either packing: a -inf, then a NaN in the next tensor
    tensors[1][0], tensors[2][0] = -inf, nan  # sizes 1 and 3, list order ("up")
    tensors[-2][0], tensors[-3][0] = -inf, nan  # sizes 1 and 4*block+1, reversed ("down")
    tensors[nonempty[2]][:] = nan  # a whole tensor: the noter remembers it
    big = sizes.index(CHUNK + 7)
    tensors[big][CHUNK - 1], tensors[big][CHUNK] = inf, nan  # both sides of its chunk boundary
    for i in rng.choice(nonempty[8:], size=12, replace=False):
        j = int(rng.integers(0, sizes[i]))
        tensors[i][j] = [inf, -inf, nan][int(rng.integers(0, 3))]
    return tensors


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dt_id)
@pytest.mark.parametrize("packed", ["up", "down"])
@pytest.mark.parametrize("name", ["unscale_", "check_finite", "unscale_norm2", "norm2", "norminf_factor"])
def test_emulated_spans_keep_per_tensor_flags(emulator, dtype, packed, name, rng):
    """Back-to-back tensors streamed as span slots still report flags tensor by tensor (the
    span tables), and everything else matches ampx's CPU op."""
    reduce, write, scale, check = _EMU_MODES[name]
    tensors = _span_case(dtype, rng, emulator.block)
    factor = 0.37
    c, found, flags, per, total = _cpu_same_call(name, tensors, factor)
    want = expected_flags(tensors)
    assert sum(1 for f in want if f) >= 10  # the case holds what it claims
    for kw in ({}, {"grid_cap": 3}, {"mis": 1}):
        got = emulator.scale(tensors, reduce=reduce, write=write, scale=scale, factor=factor, factor_dev=True,
                             found=check, flags=check, total=reduce > 0, spans=True, packed=packed, **kw)
        assert got["flags"].tolist() == flags.tolist() == want, kw
        assert got["found"].item() == found.item() == 1.0
        for i, (x, y) in enumerate(zip(got["tensors"], c)):
            assert_exactly_equal(x, y, f"tensor {i} {kw}")
        if reduce:
            stored = c if write else ([unscale_ref(t, factor) for t in tensors] if scale else tensors)
            total_ref, _ = norm_ref64(stored, _REDUCE_ORD[reduce])
            assert_norm_close(float(got["total"]), total_ref)


def test_emulated_spans_flag_inputs_not_outputs(emulator, rng):
    """With a factor above 1 a finite input can overflow when scaled: its tensor's flag stays
    clear (flags describe the inputs, as on the CPU and in torch), while a real inf elsewhere
    in the same chunk is still found."""
    tensors = [finite_values(torch.float32, n, rng) for n in [4, 1, 1, 2] + [100] * 40]
    tensors[1][0] = 3e38  # * 1024 -> inf in the output
    tensors[2][0] = float("inf")  # in the same 16-byte vector: the same thread sees both
    tensors[9][7] = 3e38
    got = emulator.scale(tensors, write=True, scale=True, factor=1024.0, factor_dev=True, found=True, flags=True,
                         spans=True, packed="up")
    c = clones(tensors)
    flags = torch.zeros(len(c), dtype=torch.uint8)
    ops.unscale_(c, torch.tensor([1024.0]), torch.zeros(1), flags=flags)
    assert got["flags"].tolist() == flags.tolist() == expected_flags(tensors)
    assert got["flags"][1].item() == 0 and got["flags"][2].item() == 1 and got["flags"][9].item() == 0
    assert math.isinf(got["tensors"][1][0].item()) and math.isinf(got["tensors"][9][7].item())
    for x, y in zip(got["tensors"], c):
        assert_exactly_equal(x, y)


def test_span_tables_threshold_setting():
    """The launches span tables must save: returned when replaced; a negative count is refused
    and changes nothing."""
    prev = _C._set_span_tables_min_launches(7)
    try:
        assert _C._set_span_tables_min_launches(prev) == 7
        with pytest.raises(ValueError, match="_set_span_tables_min_launches: the count must be >= 0"):
            _C._set_span_tables_min_launches(-1)
        assert _C._set_span_tables_min_launches(prev) == prev
    finally:
        _C._set_span_tables_min_launches(prev)


_EDGE_FACTORS = [0.37, 1.0, 1 - 2.0**-40, 1 + 2.0**-40, 2.0, 1e-40, 1e-50, 0.0, -0.0, -1.0, math.inf, math.nan]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dt_id)
@pytest.mark.parametrize("factor", _EDGE_FACTORS, ids=repr)
def test_emulated_spans_flags_whatever_the_factor(emulator, dtype, factor, rng):
    """Per-tensor flags through span tables are those of the inputs for any factor: in (0, 1]
    the kernel reads the stored values again; above 1 (finite values overflow), zero (inf
    times 0 is NaN), subnormal in float32 (flushed or not), non-finite, or rounding to 1 in
    float32 but not in float64, it notes before writing. The largest finite value of the
    dtype sits next to an inf and a NaN of other tensors in one vector, so any confusion of
    stored and input values shows."""
    sizes = [3, 1, 1, 2 * emulator.block + 5, 7, 4 * emulator.block + 1] + [int(rng.integers(1, 200)) for _ in range(20)]
    tensors = [finite_values(dtype, n, rng) for n in sizes]
    top = float(torch.finfo(dtype).max)
    tensors[0][2], tensors[1][0], tensors[2][0] = top, math.inf, math.nan  # elements 2, 3, 4
    tensors[4][3], tensors[5][-1], tensors[9][0] = -top, -math.inf, math.nan
    want = expected_flags(tensors)
    for packed, on_device in (("up", True), ("down", False)):
        got = emulator.scale(tensors, write=True, scale=True, factor=factor, factor_dev=on_device, found=True,
                             flags=True, spans=True, packed=packed)
        assert got["flags"].tolist() == want, (packed, on_device)
        assert got["found"].item() == 1.0
    got = emulator.scale(tensors, reduce=3, scale=True, factor=factor, factor_dev=True, found=True, flags=True,
                         total=True, spans=True, packed="up")
    assert got["flags"].tolist() == want


def test_emulated_spans_of_clean_tensors_clear_stale_flags(emulator, rng):
    """Flags start as garbage (0xff) in the harness: every tensor of a clean span, empties
    included, gets its 0 written; a list of separate tensors still works with spans on."""
    tensors = [finite_values(torch.bfloat16, n, rng) for n in (5, 0, 300, 1, 0, 2 * emulator.block + 3)]
    for packed in ("up", "down", None):
        got = emulator.scale(tensors, found=True, flags=True, spans=True, packed=packed)
        assert got["flags"].tolist() == [0] * len(tensors), packed
        assert got["found"].item() == 0.0


def test_emulated_update_scale_matches_cpu(emulator, rng):
    for hysteresis, consecutive, lo, hi in ((1, 0, 0.0, math.inf), (3, 0, 2.0**10, 2.0**18), (2, 1, 0.0, 2.0**20)):
        cs, ct, ch = torch.full((1,), 2.0**16), torch.zeros(1, dtype=torch.int32), torch.full((1,), hysteresis,
                                                                                              dtype=torch.int32)
        state = (2.0**16, 0, hysteresis)
        for step in range(40):
            f = float(rng.random() < 0.3)
            cev = ops._update_scale_events(cs, ct, torch.tensor([f]), 2.0, 0.5, 3, hysteresis,
                                           ch if hysteresis > 1 else None, bool(consecutive), lo, hi)
            ar = Arena()
            so = ar.put(struct.pack("<f", state[0]))
            to = ar.put(struct.pack("<i", state[1]))
            ho = ar.put(struct.pack("<i", state[2])) if hysteresis > 1 else -1
            fo = ar.put(struct.pack("<f", f))
            eo = ar.put(struct.pack("<i", -1))
            buf = emulator.run(f"update {so} {to} {ho} {fo} {eo} {2.0.hex()} {0.5.hex()} 3 {hysteresis} {consecutive} "
                               f"{lo.hex() if math.isfinite(lo) else 'inf'} {hi.hex() if math.isfinite(hi) else 'inf'}\n",
                               ar)
            s = struct.unpack_from("<f", buf, so)[0]
            t = struct.unpack_from("<i", buf, to)[0]
            h = struct.unpack_from("<i", buf, ho)[0] if hysteresis > 1 else hysteresis
            ev = struct.unpack_from("<i", buf, eo)[0]
            assert (s, t, ev) == (cs.item(), ct.item(), cev), step
            if hysteresis > 1:
                assert h == ch.item()
            state = (s, t, h)


def test_emulated_kernels_at_full_block_size(emulator_full, rng):
    """The real block size on the boundaries it defines."""
    emu = emulator_full
    tensors = [special_values(dt, n, rng) for dt in (torch.float32, torch.bfloat16)
               for n in _emu_sizes(emu.block, big=False) if n > 1000] + [finite_values(torch.float16, CHUNK + 9, rng)]
    got = emu.scale(tensors, reduce=1, write=True, scale=True, factor=0.37, factor_dev=True, found=True,
                            flags=True, per=True, total=True)
    c, found, flags, per, total = _cpu_same_call("unscale_norm2", tensors, 0.37)
    for a, b in zip(got["tensors"], c):
        assert_exactly_equal(a, b)
    assert got["flags"].tolist() == flags.tolist()
    assert_same_float(got["total"], total)
    for a, b in zip(got["per"].tolist(), per.tolist()):
        assert_same_float(a, b)
    srcs = [finite_values(torch.float32, n, rng) for n in (4095, 4096, 4097, CHUNK + 1)]
    sr = emu.cast(srcs, [torch.bfloat16] * 4, stochastic=True, seed=5, offset=6)
    dc = [torch.empty(t.numel(), dtype=torch.bfloat16) for t in srcs]
    ops.cast_(srcs, dc, rounding="stochastic", seed=5, offset=6)
    for a, b in zip(sr["dsts"], dc):
        assert_exactly_equal(a, b)


# ================================================================= on a GPU ==


@two_gpus
def test_cuda_tensors_on_two_devices_are_refused():
    a = torch.ones(10, device="cuda:0")
    b = torch.ones(10, device="cuda:1")
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cuda:1.*cuda:0"):
        ops.unscale_([a, b], 0.5, None)
    with pytest.raises(ValueError, match=r"found_inf is on cuda:0.*cuda:1"):
        ops.unscale_([b], 0.5, torch.zeros(1, device="cuda:0"))


@two_gpus
def test_cuda_runs_on_the_tensors_device_whatever_the_current_device(rng):
    x = finite_values(torch.float32, 3 * CHUNK + 7, rng)
    with torch.cuda.device(0):
        g = x.to("cuda:1")
        found = torch.zeros(1, device="cuda:1")
        total = ops.unscale_norm_([g], 0.5, found)
        assert total.device == torch.device("cuda:1")
        torch.cuda.synchronize(1)
        assert_bits_equal(g.cpu(), unscale_ref(x, 0.5))
        assert_norm_close(total.item(), norm_ref64([unscale_ref(x, 0.5)], 2)[0])


@gpu
def test_cuda_on_a_side_stream(rng):
    x = finite_values(torch.float32, 4 * CHUNK, rng)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = x.to("cuda", non_blocking=False)
        for _ in range(5):
            ops.mul_(g, 2.0)
        total = ops.norm([g], 1)
        out = total.clone()
    s.synchronize()
    assert_norm_close(out.item(), norm_ref64([x * 32], 1)[0])


@gpu
def test_cuda_fused_adamw_step_makes_no_host_sync():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scale = torch.full((1,), 2.0**16, device="cuda")
    tracker = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = torch.randn(32, 64, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        (model(x).float().square().mean() * scale).backward()
        grads = [p.grad for p in model.parameters()]
        found = torch.zeros(1, device="cuda")
        inv = scale.double().reciprocal().float()
        norm = ops.unscale_norm_(grads, inv, found)
        coef = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        ops.mul_(grads, coef.reshape(1))
        opt.grad_scale = None
        opt.found_inf = found
        opt.step()
        del opt.found_inf
        ops.update_scale_(scale, tracker, found, 2.0, 0.5, 2000)
        return norm

    step()  # creates the optimizer state (its own host-to-device copies)
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            norm = step()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert math.isfinite(norm.item())


@gpu
def test_cuda_scaler_sequence_captures_into_a_cuda_graph_and_replays(rng):
    shapes = [(CHUNK + 3,), (257,), (64, 64), (3,)]
    grads = [torch.zeros(s, device="cuda", dtype=dt) for s, dt in
             zip(shapes, [torch.float32, torch.bfloat16, torch.float32, torch.float16])]
    scale = torch.full((1,), 2.0**16, device="cuda")
    tracker = torch.zeros(1, dtype=torch.int32, device="cuda")
    found = torch.zeros(1, device="cuda")
    flags = torch.zeros(len(grads), dtype=torch.uint8, device="cuda")

    def body():
        found.zero_()
        inv = scale.double().reciprocal().float()
        total, per = ops.unscale_norm_(grads, inv, found, flags=flags, per_tensor=True)
        ops.update_scale_(scale, tracker, found, 2.0, 0.5, 2)
        return total, per

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (kernels loaded, allocator primed)
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(s)
    scale.fill_(2.0**16)
    tracker.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        total, per = body()

    sc, tr = torch.full((1,), 2.0**16), torch.zeros(1, dtype=torch.int32)
    scale.fill_(2.0**16)
    tracker.zero_()
    for it in range(5):
        data = [finite_values(gr.dtype, gr.numel(), rng).reshape(gr.shape) for gr in grads]
        if it == 3:
            data[1].view(-1)[7] = math.inf
        for gr, d in zip(grads, data):
            gr.copy_(d)
        g.replay()
        torch.cuda.synchronize()
        cfound = torch.zeros(1)
        c = clones(data)
        cinv = torch.tensor([f32(1.0 / float(sc))])
        ctotal, cper = ops.unscale_norm_(c, cinv, cfound, per_tensor=True)
        ops.update_scale_(sc, tr, cfound, 2.0, 0.5, 2)
        for a, b in zip(host(grads), c):
            assert_bits_equal(a, b, f"replay {it}")
        assert found.item() == cfound.item()
        assert_same_float(total.item(), ctotal.item(), f"replay {it}")
        for a, b in zip(per.tolist(), cper.tolist()):
            assert_same_float(a, b)
        assert_exactly_equal(scale.cpu(), sc)
        assert_exactly_equal(tracker.cpu(), tr)
        assert flags.tolist()[1] == (FLAG_INF if it == 3 else 0)


def _views_with_specials(order, rng, count=1000):
    """`count` views of one float32 buffer (reversed for "down": DDP's bucket order), CPU and
    CUDA copies, with non-finite values at view boundaries and scattered."""
    sizes = [int(rng.integers(1, 3000)) for _ in range(count)]
    sizes[5] = 0
    flat = finite_values(torch.float32, sum(sizes), rng)
    views = list(flat.split(sizes))
    views[1][-1], views[2][0] = -math.inf, math.nan  # last of one view, first of the next
    views[7][:] = math.nan
    for i in rng.choice(range(10, count), size=20, replace=False):
        views[i][int(rng.integers(0, sizes[i]))] = [math.inf, -math.inf, math.nan][int(rng.integers(0, 3))]
    dev = flat.cuda()
    dviews = list(dev.split(sizes))
    if order == "down":
        views, dviews = views[::-1], dviews[::-1]
    return views, dviews


@gpu
@pytest.mark.parametrize("order", ["up", "down"])
def test_cuda_views_keep_per_tensor_flags(order, rng):
    """Many views of one buffer with flags wanted (the scaler's unscale) run as one span slot
    with span tables: flags tensor by tensor, values and found_inf as on the CPU."""
    views, dviews = _views_with_specials(order, rng)
    want = expected_flags(views)
    for name in ("unscale_", "check_finite", "unscale_norm_"):
        c, dv = clones(views), [v for v in dviews]
        dflat = dv[0]._base if dv[0]._base is not None else None
        snapshot = dflat.clone() if dflat is not None else None
        found, flags = torch.zeros(1, device="cuda"), torch.full((len(dv),), 255, dtype=torch.uint8, device="cuda")
        cfound, cflags = torch.zeros(1), torch.zeros(len(c), dtype=torch.uint8)
        inv = torch.tensor([0.5], device="cuda")
        if name == "unscale_":
            ops.unscale_(dv, inv, found, flags=flags)
            spans = _C._last_spans()
            ops.unscale_(c, torch.tensor([0.5]), cfound, flags=cflags)
        elif name == "check_finite":
            ops.check_finite(dv, found, flags=flags)
            spans = _C._last_spans()
            ops.check_finite(c, cfound, flags=cflags)
        else:
            total = ops.unscale_norm_(dv, inv, found, flags=flags)
            spans = _C._last_spans()
            ctotal = ops.unscale_norm_(c, torch.tensor([0.5]), cfound, flags=cflags)
            assert math.isnan(total.item()) == math.isnan(ctotal.item())
        assert spans == 1, name  # read before the CPU reference call resets it
        torch.cuda.synchronize()
        assert flags.cpu().tolist() == cflags.tolist() == want, name
        assert found.item() == cfound.item() == 1.0
        for a, b in zip(host(dv), c):
            assert_bits_equal(a, b, name)
        if snapshot is not None:  # the next op starts from the same data
            dflat.copy_(snapshot)


@gpu
def test_cuda_few_views_and_capture_run_tensor_by_tensor(rng):
    """Span tables are used only where they save launches, and never inside a graph capture
    (a replay would copy whatever the pinned buffer then held): flags still per tensor."""
    views, dviews = _views_with_specials("up", rng, count=2 * MAX_T)
    flags = torch.zeros(len(dviews), dtype=torch.uint8, device="cuda")
    found = torch.zeros(1, device="cuda")
    ops.check_finite(dviews, found, flags=flags)
    assert _C._last_spans() == -1  # two launches: not worth a table
    assert flags.cpu().tolist() == expected_flags(views)
    views, dviews = _views_with_specials("down", rng)
    flags = torch.zeros(len(dviews), dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.check_finite(dviews, found, flags=flags)  # warm-up outside the capture
        assert _C._last_spans() == 1  # outside a capture the same call uses span tables
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        found.zero_()
        flags.zero_()
        ops.check_finite(dviews, found, flags=flags)
        spans_in_capture = _C._last_spans()
    g.replay()
    torch.cuda.synchronize()
    assert spans_in_capture == -1
    assert flags.cpu().tolist() == expected_flags(views)
    assert found.item() == 1.0


def _free_gib():
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


@gpu
def test_cuda_64_bit_element_indices():
    """Past 2**31 and 2**32 elements: 64-bit sizes and offsets, and stochastic rounding keys of
    elements past 2**32 (checked against the independent reference of the hash)."""
    if _free_gib() < 40:
        pytest.skip("needs about 30 GiB of free GPU memory")
    n = 2**31 + 5
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    assert ops.norm(x, 1).item() == f32(n)
    found = torch.zeros(1, device="cuda")
    x[-1] = math.nan
    ops.unscale_(x, 2.0, found)
    assert found.item() == 1.0
    tail = x[-4:].float().cpu()
    assert tail[:3].tolist() == [2.0, 2.0, 2.0] and math.isnan(tail[3])
    del x
    n = 2**32 + 1000
    v = 1.0 + 2.0**-9 + 2.0**-20  # not a bfloat16: the random bits decide
    src = torch.full((n,), v, dtype=torch.float32, device="cuda")
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    ops.cast_([src[:7], src], [torch.empty(7, dtype=torch.bfloat16, device="cuda"), dst], rounding="stochastic",
              seed=77, offset=5)
    idx = [0, 2**32 - 2, 2**32 - 1, 2**32, 2**32 + 1, 2**32 + 999]
    got = dst[torch.tensor(idx, device="cuda")].view(torch.int16).cpu().numpy().astype(np.uint16)
    for e, gbits in zip(idx, got):
        assert gbits == sr_reference(v, 77, 5, 1, e), e
