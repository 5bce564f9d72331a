#!/usr/bin/env python3
"""Benchmark of ampx's fused multi-tensor CPU kernels against their torch equivalents.

For every op and case it prints the median time of ampx and of the torch
equivalent(s), the effective bandwidth (GB/s, logical bytes the op must move:
read + write for in-place and cast ops, read only for norms), the ratio
torch time / ampx time, and the fraction of a bandwidth ceiling measured in the
same loop:

  * read-write ops: an in-place ``x.mul_(1.0)`` on a float32 tensor whose
    read + write traffic equals the op's bytes;
  * read-only ops (norm): ``x.sum()`` over a float32 tensor of the op's bytes.

The machine this was written for is a small, noisy VM, so every measurement
interleaves the contenders (ampx, torch, ceiling) in one loop, rotating their
order on each repetition, after a warm-up, and reports the median.

In-place ops run with a multiplier of exactly 1.0 (a 1-element float32 tensor
for unscale), so repeated runs leave the data (standard-normal values) as they
were; no reset is needed between repetitions. Neither ampx nor torch skips the
multiply/store for 1.0 (torch's kernel still stores every element).

Real parameter shapes (``--shapes``; benchmarks/model_shapes.py builds them from configs, no
weights): GPT-2 124M, a 350M decoder (GPT-2 medium) and a LoRA set (rank 8 on every linear of a
24-layer d=1024 decoder), each as separately allocated tensors and as ``ampx.GradBuffer``-style
views of one flat buffer laid back to back, through unscale_, norm, unscale_norm_ and mul_
against torch and the ceiling.

Usage:
    python benchmarks/bench_kernels.py [--shapes SETS] [--quick] [--simd LEVEL] [--threads N] [--json PATH]

--shapes takes a comma-separated list of: synthetic (the 64M and 10,000 x 1,000 cases and their
targets), lora, gpt2, gpt2-medium, real (the three), all (the default).

The exit code is 0 whatever the PASS/FAIL verdicts: this is a report.
"""
import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time

import torch

import ampx
from ampx import _C
from ampx import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_shapes  # noqa: E402

REAL = ("lora", "gpt2", "gpt2-medium")

M = 1 << 20


# --------------------------------------------------------------------------- timing

def interleaved(fns, reps, warmup):
    """Times each callable of the dict ``fns`` ``reps`` times, alternating them.

    Each repetition runs every callable once, in an order rotated by one per
    repetition (so no contender always runs right after the same other one).
    Returns {name: [seconds, ...]} without the warm-up runs.
    """
    names = list(fns)
    times = {n: [] for n in names}
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(warmup + reps):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                f = fns[n]
                t0 = time.perf_counter()
                f()
                t1 = time.perf_counter()
                if r >= warmup:
                    times[n].append(t1 - t0)
    finally:
        if gc_was:
            gc.enable()
    return times


def summary(ts):
    return {
        "median_s": statistics.median(ts),
        "min_s": min(ts),
        "max_s": max(ts),
        "reps": len(ts),
    }


# --------------------------------------------------------------------------- helpers

def make_tensors(count, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if count == 1:
        return [torch.randn(numel, generator=g, dtype=torch.float32).to(dtype)]
    # One allocation per tensor, as separate gradients would be.
    flat = torch.randn(count * numel, generator=g, dtype=torch.float32).to(dtype)
    return [flat[i * numel:(i + 1) * numel].clone() for i in range(count)]


def total_bytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def torch_total_norm(ts):
    """What clip_grad_norm_(foreach=True) computes: per-tensor norms, then the norm of those."""
    norms = torch._foreach_norm(ts)
    return torch.linalg.vector_norm(torch.stack(norms))


def ceiling_fns(nbytes, kind):
    """A float32 buffer moving ``nbytes`` bytes: mul_ (read+write) or sum (read)."""
    if kind == "rw":
        n = max(1, nbytes // 8)  # read 4 B + write 4 B per element
        x = torch.randn(n)
        return "ceiling x.mul_(1.0)", (lambda: x.mul_(1.0))
    n = max(1, nbytes // 4)
    x = torch.randn(n)
    return "ceiling x.sum()", (lambda: x.sum())


# --------------------------------------------------------------------------- one measurement

class Bench:
    def __init__(self, reps_small, reps_big, warmup, big_threshold):
        self.reps_small = reps_small
        self.reps_big = reps_big
        self.warmup = warmup
        self.big_threshold = big_threshold
        self.results = []

    def reps_for(self, nbytes):
        return self.reps_big if nbytes >= self.big_threshold else self.reps_small

    def measure(self, case, op, nbytes, kind, ampx_fn, torch_fns, extra_ampx=None):
        """Times ampx, each torch equivalent and the ceiling together; records and prints rows."""
        cname, cfn = ceiling_fns(nbytes, kind)
        fns = {"ampx": ampx_fn}
        if extra_ampx:
            fns.update(extra_ampx)
        fns.update(torch_fns)
        fns[cname] = cfn
        reps = self.reps_for(nbytes)
        times = interleaved(fns, reps, self.warmup)
        ceil_t = statistics.median(times[cname])
        ceil_gbps = nbytes / ceil_t / 1e9
        ampx_t = statistics.median(times["ampx"])
        rows = []
        for name in fns:
            s = summary(times[name])
            t = s["median_s"]
            gbps = nbytes / t / 1e9
            row = {
                "impl": name,
                **s,
                "gbps": gbps,
                # torch time / ampx time, for the torch rows
                "ratio": (t / ampx_t) if name in torch_fns else None,
                "frac_ceiling": gbps / ceil_gbps,
            }
            rows.append(row)
        rec = {
            "case": case,
            "op": op,
            "bytes": nbytes,
            "kind": kind,
            "ceiling_gbps": ceil_gbps,
            "rows": rows,
        }
        self.results.append(rec)
        print_record(rec)
        return rec


def fmt_ms(s):
    ms = s * 1e3
    return f"{ms:9.3f}" if ms < 100 else f"{ms:9.1f}"


def print_table_header():
    print(f"{'op':<22} {'impl':<50} {'median ms':>9} {'GB/s':>7} {'torch/ampx':>10} {'of ceiling':>10}")
    print("-" * 113)


def print_record(rec):
    first = True
    for row in rec["rows"]:
        op = rec["op"] if first else ""
        first = False
        ratio = f"{row['ratio']:9.2f}x" if row["ratio"] is not None else f"{'':>10}"
        frac = f"{row['frac_ceiling']:10.2f}"
        print(f"{op:<22} {row['impl']:<50} {fmt_ms(row['median_s'])} {row['gbps']:7.2f} {ratio} {frac}")
    sys.stdout.flush()


# --------------------------------------------------------------------------- cases

def run_case(bench, case, count, numel, dtype, seed, breakdown):
    ts = make_tensors(count, numel, dtype, seed)
    nb = total_bytes(ts)
    n_elem = count * numel
    dname = str(dtype).replace("torch.", "")
    desc = (f"{count:,} tensor(s) x {numel:,} {dname} elements = {n_elem / M:.1f} Mi elements, "
            f"{nb / 1e6:.1f} MB")
    print()
    print(f"=== {case}: {desc}")

    inv = torch.ones(1, dtype=torch.float32)  # 1.0: repeated in-place runs keep the data stable
    fi_a = torch.zeros(1)
    fi_t = torch.zeros(1)

    # Sanity: both sides compute the norm of these (finite, standard-normal) inputs; print their
    # relative error against a float64 reference (torch's bfloat16 path returns bfloat16 norms).
    ref = math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))
    err_a = abs(float(ops.norm(ts)) - ref) / ref
    err_t = abs(float(torch_total_norm(ts).float()) - ref) / ref
    print(f"check: L2 norm {ref:.6g} (float64 reference); relative error: ampx {err_a:.1e}, "
          f"torch _foreach_norm path {err_t:.1e}")
    if err_a > 1e-4:
        print(f"  WARNING: {case}: ampx norm is off by {err_a:.1e}")
    print_table_header()

    # unscale_ (read + write)
    rec_unscale = bench.measure(
        case, "unscale_", 2 * nb, "rw",
        lambda: ops.unscale_(ts, inv, fi_a),
        {"torch._amp_foreach_non_finite_check_and_unscale_":
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(ts, fi_t, inv)})

    # norm (read only)
    torch_norms = {"torch._foreach_norm + vector_norm(stack)": lambda: torch_total_norm(ts)}
    if hasattr(torch.nn.utils, "get_total_norm"):
        torch_norms["torch.nn.utils.get_total_norm(foreach=True)"] = (
            lambda: torch.nn.utils.get_total_norm(ts, 2.0, foreach=True))
    bench.measure(case, "norm (L2)", nb, "r", lambda: ops.norm(ts), torch_norms)

    # unscale_norm_ (one pass: read + write) vs torch's two passes
    def torch_unscale_then_norm():
        torch._amp_foreach_non_finite_check_and_unscale_(ts, fi_t, inv)
        return torch_total_norm(ts)

    rec_un = bench.measure(
        case, "unscale_norm_", 2 * nb, "rw",
        lambda: ops.unscale_norm_(ts, inv, fi_a),
        {"torch unscale + _foreach_norm + vector_norm": torch_unscale_then_norm})

    # mul_ (read + write)
    bench.measure(case, "mul_", 2 * nb, "rw",
                  lambda: ops.mul_(ts, 1.0),
                  {"torch._foreach_mul_": lambda: torch._foreach_mul_(ts, 1.0)})

    # casts
    if dtype == torch.float32:
        dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in ts]
        cbytes = nb + nb // 2  # read 4 B, write 2 B per element
        bench.measure(case, "cast_ f32->bf16", cbytes, "rw",
                      lambda: ops.cast_(ts, dst),
                      {"torch._foreach_copy_(dst, src)": lambda: torch._foreach_copy_(dst, ts),
                       "[d.copy_(s) for d, s in zip(dst, src)]":
                           lambda: [d.copy_(s) for d, s in zip(dst, ts)]})
        bench.measure(case, "cast_ f32->bf16 (SR)", cbytes, "rw",
                      lambda: ops.cast_(ts, dst, rounding="stochastic", seed=1234, offset=0),
                      {})
    else:
        dst = [torch.empty_like(t, dtype=torch.float32) for t in ts]
        cbytes = nb * 3  # read 2 B, write 4 B per element
        fi_c = torch.zeros(1)

        def torch_copy_then_unscale():
            torch._foreach_copy_(dst, ts)
            torch._amp_foreach_non_finite_check_and_unscale_(dst, fi_t, inv)

        bench.measure(case, "cast_ bf16->f32 *inv", cbytes, "rw",
                      lambda: ops.cast_(ts, dst, inv_scale=inv, found_inf=fi_c),
                      {"torch._foreach_copy_ + unscale": torch_copy_then_unscale})

    if fi_a.item() != 0.0 or fi_t.item() != 0.0:
        print(f"  WARNING: {case}: found_inf was set on finite data (ampx {fi_a.item()}, torch {fi_t.item()})")

    out = {"unscale_": rec_unscale, "unscale_norm_": rec_un}
    if breakdown:
        out["breakdown"] = run_breakdown(bench, case, ts, inv)
    del ts, dst
    gc.collect()
    return out


def run_breakdown(bench, case, ts, inv):
    """Where the time of the many-tensor unscale_ goes: per-tensor overhead vs streaming the data."""
    n = len(ts)
    numel = ts[0].numel()
    dtype = ts[0].dtype
    one = [torch.randn(n * numel).to(dtype)]           # same bytes, one tensor
    views = list(one[0].split(numel))                   # same count and bytes, one block of memory
    tiny = [torch.randn(1).to(dtype) for _ in range(n)]  # same count, ~no bytes
    fi = torch.zeros(1)

    def py_loop():
        for t in ts:
            t.data_ptr()
            t.numel()
            t.is_contiguous()
            t.dtype
            t.is_cpu

    def empty_loop():
        for t in ts:
            pass

    def one_attr(expr):
        # e.g. "t.data_ptr()": the loop above with only that attribute
        code = compile(f"def f(ts):\n    for t in ts:\n        {expr}\n", "<attr>", "exec")
        ns = {}
        exec(code, ns)
        f = ns["f"]
        return lambda: f(ts)

    fns = {
        f"ampx unscale_ {n:,} x {numel:,} (pre-built list)": lambda: ops.unscale_(ts, inv, fi),
        f"ampx unscale_ 1 x {n * numel:,} (same bytes)": lambda: ops.unscale_(one, inv, fi),
        f"ampx unscale_ {n:,} x 1 (per-tensor cost only)": lambda: ops.unscale_(tiny, inv, fi),
        f"ampx unscale_ {n:,} x {numel:,} views of one block": lambda: ops.unscale_(views, inv, fi),
        f"torch unscale {n:,} x {numel:,} views of one block":
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(views, fi, inv),
        "Python loop: data_ptr/numel/is_contiguous/dtype/is_cpu": py_loop,
        "  of which: empty `for t in ts` loop": empty_loop,
    }
    for expr in ("t.data_ptr()", "t.numel()", "t.is_contiguous()", "t.dtype", "t.is_cpu"):
        fns[f"  loop reading only {expr}"] = one_attr(expr)
    reps = bench.reps_small
    times = interleaved(fns, reps, bench.warmup)
    med = {k: statistics.median(v) for k, v in times.items()}
    names = list(fns)
    base = med[names[0]]
    per_tensor_us = (base - med[names[1]]) / n * 1e6
    print()
    print(f"--- {case}: breakdown of unscale_ on {n:,} tensors (median of {reps})")
    print(f"{'what':<60} {'median ms':>9} {'us/tensor':>10} {'of ampx':>8}")
    rows = []
    for k in names:
        t = med[k]
        print(f"{k:<60} {fmt_ms(t)} {t / n * 1e6:10.3f} {t / base:8.2f}")
        rows.append({"what": k, "median_s": t, "us_per_tensor": t / n * 1e6, "frac_of_ampx": t / base})
    print(f"{'=> per-tensor overhead of ampx (list - one tensor) / count':<60} "
          f"{'':>9} {per_tensor_us:10.3f} {(base - med[names[1]]) / base:8.2f}")
    attr = med[names[5]] - med[names[6]]  # the five reads, less the bare loop
    print(f"   Reading the 5 attributes costs {attr / n * 1e6:.3f} us/tensor in Python "
          f"(loop overhead removed): {attr / base:.0%} of the ampx call, "
          f"{attr / max(base - med[names[1]], 1e-12):.0%} of its per-tensor overhead.")
    print(f"   The same count and bytes as views of one block of memory: ampx {fmt_ms(med[names[3]]).strip()} ms, "
          f"torch {fmt_ms(med[names[4]]).strip()} ms ({med[names[4]] / med[names[3]]:.2f}x); separately allocated "
          f"tensors cost ampx {base / med[names[3]]:.2f}x that (their memory is scattered between allocator blocks).")
    del one, tiny, views
    return {"case": case, "count": n, "numel": numel, "reps": reps, "rows": rows,
            "per_tensor_overhead_us": per_tensor_us, "python_attr_read_us_per_tensor": attr / n * 1e6}


# --------------------------------------------------------------------------- real shapes

def shape_tensors(shapes, layout, seed):
    """Standard-normal float32 tensors of the given shapes: "separate" (one allocation each, as
    autograd leaves gradients) or "buffer" (views of one flat tensor, back to back in list order,
    as ampx.GradBuffer lays them out)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "separate":
        return [torch.randn(s, generator=g) for s in shapes]
    flat = torch.randn(sum(model_shapes.numel(s) for s in shapes), generator=g)
    out, off = [], 0
    for s in shapes:
        n = model_shapes.numel(s)
        out.append(flat[off:off + n].view(s))
        off += n
    return out


def run_shape_set(bench, key, quick):
    """unscale_ / norm / unscale_norm_ / mul_ over one real parameter set, in both layouts."""
    title, named = model_shapes.shape_set(key, quick)
    shapes = [s for _, s in named]
    out = {}
    for layout in ("separate", "buffer"):
        ts = shape_tensors(shapes, layout, seed=7)
        nb = total_bytes(ts)
        case = f"{key} {layout}"
        print()
        print(f"=== {title}, {'one allocation per tensor' if layout == 'separate' else 'views of one buffer'}: "
              f"{len(ts)} float32 tensors, {nb / 4 / M:.1f} Mi elements, {nb / 1e6:.1f} MB")
        print_table_header()
        inv = torch.ones(1)
        fi_a, fi_t = torch.zeros(1), torch.zeros(1)
        recs = {}
        recs["unscale_"] = bench.measure(
            case, "unscale_", 2 * nb, "rw", lambda: ops.unscale_(ts, inv, fi_a),
            {"torch._amp_foreach_non_finite_check_and_unscale_":
                lambda: torch._amp_foreach_non_finite_check_and_unscale_(ts, fi_t, inv)})
        recs["norm"] = bench.measure(
            case, "norm (L2)", nb, "r", lambda: ops.norm(ts),
            {"torch._foreach_norm + vector_norm(stack)": lambda: torch_total_norm(ts)})

        def torch_unscale_then_norm():
            torch._amp_foreach_non_finite_check_and_unscale_(ts, fi_t, inv)
            return torch_total_norm(ts)

        recs["unscale_norm_"] = bench.measure(
            case, "unscale_norm_", 2 * nb, "rw", lambda: ops.unscale_norm_(ts, inv, fi_a),
            {"torch unscale + _foreach_norm + vector_norm": torch_unscale_then_norm})
        recs["mul_"] = bench.measure(
            case, "mul_", 2 * nb, "rw", lambda: ops.mul_(ts, 1.0),
            {"torch._foreach_mul_": lambda: torch._foreach_mul_(ts, 1.0)})
        if fi_a.item() != 0.0 or fi_t.item() != 0.0:
            print(f"  WARNING: {case}: found_inf was set on finite data")
        out[layout] = recs
        del ts
        gc.collect()
    print()
    print(f"--- {title}: ampx's share of the ceiling (separate -> buffer), torch time / ampx time")
    for op in ("unscale_", "norm", "unscale_norm_", "mul_"):
        a = [next(r for r in out[lay][op]["rows"] if r["impl"] == "ampx") for lay in ("separate", "buffer")]
        t = [next(r for r in out[lay][op]["rows"] if r["ratio"] is not None) for lay in ("separate", "buffer")]
        print(f"  {op:<14} of ceiling {a[0]['frac_ceiling']:.2f} -> {a[1]['frac_ceiling']:.2f}   "
              f"vs torch {t[0]['ratio']:.2f}x -> {t[1]['ratio']:.2f}x")
    return out


def run_synthetic(bench, big, count, numel, quick):
    """The 64M and count x numel cases of float32 and bfloat16, and their targets."""
    big_label = f"{big // M}M"
    many_label = f"{count:,}x{numel:,}"
    cases = [
        (f"A f32 1x{big_label}", 1, big, torch.float32, 1, False),
        (f"B f32 {many_label}", count, numel, torch.float32, 2, True),
        (f"C bf16 1x{big_label}", 1, big, torch.bfloat16, 3, False),
        (f"D bf16 {many_label}", count, numel, torch.bfloat16, 4, True),
    ]
    case_out = {}
    for name, c, n, dt, seed, bd in cases:
        case_out[name] = run_case(bench, name, c, n, dt, seed, bd)

    # ---- targets
    A = case_out[cases[0][0]]
    B = case_out[cases[1][0]]

    def row(rec, impl_prefix):
        return next(r for r in rec["rows"] if r["impl"].startswith(impl_prefix))

    t1 = row(A["unscale_"], "ampx")["frac_ceiling"]
    t2 = row(A["unscale_norm_"], "torch")["ratio"]
    t3 = row(B["unscale_"], "torch")["ratio"]
    targets = [
        {"name": f"unscale_ on {big_label} float32 reaches >= 0.9 of the mul_ ceiling",
         "value": t1, "threshold": 0.9, "unit": "of ceiling", "pass": t1 >= 0.9},
        {"name": f"unscale_norm_ on {big_label} float32 >= 1.8x faster than torch unscale + norm",
         "value": t2, "threshold": 1.8, "unit": "x", "pass": t2 >= 1.8},
        {"name": f"unscale_ on {count:,} x {numel:,} float32 >= 5x faster than torch",
         "value": t3, "threshold": 5.0, "unit": "x", "pass": t3 >= 5.0},
    ]
    print()
    print("=== targets" + ("  (--quick: reduced sizes, indicative only)" if quick else ""))
    for t in targets:
        verdict = "PASS" if t["pass"] else "FAIL"
        val = f"{t['value']:.2f}{' ' if t['unit'] != 'x' else ''}{t['unit']}"
        print(f"{verdict}: {t['name']}: measured {val} (target >= {t['threshold']})")
    return case_out, targets


# --------------------------------------------------------------------------- machine

def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info():
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "torch_num_threads": torch.get_num_threads(),
        "ampx_threads": ops._threads(),
        "ampx_simd": ops.simd_level(),
        "ampx_tensor_reader": ops.tensor_reader(),
        "ampx_simd_available": ops.available_simd_levels(),
        "torch_version": torch.__version__,
        "ampx_version": getattr(ampx, "__version__", "?"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def cpu_snapshot():
    """(wall s, busy CPU s of the whole machine, steal s, this process's CPU s), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    steal = v[7] if len(v) > 7 else 0
    busy = sum(v[:8]) - idle - steal  # user..softirq (guest time is already inside user)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), busy / hz, steal / hz, ru.ru_utime + ru.ru_stime


def interference(a, b):
    """CPU time that other processes (and the hypervisor, as steal) took between two snapshots."""
    if a is None or b is None:
        return None
    wall = b[0] - a[0]
    other = max(0.0, (b[1] - a[1]) - (b[3] - a[3]))
    return {"wall_s": wall, "other_cpu_s": other, "other_cores_avg": other / wall,
            "steal_s": b[2] - a[2], "own_cpu_s": b[3] - a[3]}


# --------------------------------------------------------------------------- main

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (smoke run)")
    p.add_argument("--simd", metavar="LEVEL", help="force an ampx SIMD level (avx512, avx2, portable)")
    p.add_argument("--threads", type=int, metavar="N", help="torch.set_num_threads(N) (ampx follows it)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--shapes", default="all", metavar="SETS",
                   help="comma-separated: synthetic, lora, gpt2, gpt2-medium, real (the three models), all")
    args = p.parse_args(argv)
    sets = []
    for k in args.shapes.split(","):
        for e in {"all": ["synthetic", *REAL], "real": list(REAL)}.get(k.strip(), [k.strip()]):
            if e != "synthetic" and e not in model_shapes.SETS:
                p.error(f"--shapes: unknown set {e!r} (choose from synthetic, {', '.join(REAL)}, real, all)")
            if e not in sets:
                sets.append(e)

    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.simd:
        try:
            _C.set_simd(args.simd)
        except ValueError as e:
            p.error(f"--simd {args.simd}: {e}")

    if args.quick:
        big, count, numel = 4 * M, 1000, 1000
        bench = Bench(reps_small=5, reps_big=5, warmup=1, big_threshold=1 << 62)
    else:
        big, count, numel = 64 * M, 10_000, 1_000
        # 64M-element cases move 256-768 MB per call: 21 repeats keep the whole run near 1-2 minutes.
        bench = Bench(reps_small=41, reps_big=21, warmup=3, big_threshold=200 * 10**6)

    t_start = time.perf_counter()
    snap0 = cpu_snapshot()
    info = machine_info()
    try:
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    print("ampx kernel benchmark" + ("  [--quick: reduced sizes and repeats]" if args.quick else ""))
    print(f"CPU:     {info['cpu_model']}  ({info['cpu_count']} logical CPUs, {info['cpus_usable']} usable)")
    print(f"threads: torch.get_num_threads() = {info['torch_num_threads']}, ampx threads = {info['ampx_threads']}")
    print(f"SIMD:    ampx {info['ampx_simd']} (available: {', '.join(info['ampx_simd_available'])})")
    print(f"Tensors: ampx reads them through {info['ampx_tensor_reader']}")
    print(f"torch:   {info['torch_version']}   ampx: {info['ampx_version']}   python: {info['python']}")
    if "loadavg_at_start" in info:
        print("load:    1/5/15-min load average at start: " + " / ".join(f"{x:.2f}" for x in info["loadavg_at_start"]))
    print(f"repeats: median of {bench.reps_small} (small cases) / {bench.reps_big} (>= 200 MB moved), "
          f"{bench.warmup} warm-up, contenders interleaved; real shapes: "
          f"{'3' if args.quick else '11 / 5 (>= 200 MB moved)'}, 1 warm-up")
    print(f"sets:    {', '.join(sets)}")
    print("GB/s: logical bytes (read+write for in-place/cast ops, read for norm) / median time. "
          "torch/ampx: torch time / ampx time. of ceiling: GB/s / ceiling GB/s measured in the same loop "
          "(float32 x.mul_(1.0) moving the same bytes for read-write ops, x.sum() over the same bytes for norm).")

    case_out, targets = {}, []
    if "synthetic" in sets:
        case_out, targets = run_synthetic(bench, big, count, numel, args.quick)
    real = {}
    real_bench = (Bench(reps_small=3, reps_big=3, warmup=1, big_threshold=1 << 62) if args.quick else
                  Bench(reps_small=11, reps_big=5, warmup=1, big_threshold=200 * 10**6))
    for key in sets:
        if key != "synthetic":
            real[key] = run_shape_set(real_bench, key, args.quick)
    bench.results.extend(real_bench.results)
    elapsed = time.perf_counter() - t_start
    noise = interference(snap0, cpu_snapshot())
    print(f"\ntotal benchmark time: {elapsed:.0f} s")
    if noise is not None:
        print(f"interference: other processes used {noise['other_cpu_s']:.1f} CPU-s during the run "
              f"({noise['other_cores_avg']:.2f} cores on average of {info['cpus_usable']}); "
              f"hypervisor steal {noise['steal_s']:.1f} s"
              + ("  <- results disturbed by other load" if noise["other_cores_avg"] > 0.1 else ""))

    if args.json:
        doc = {
            "machine": info,
            "args": vars(args),
            "quick": args.quick,
            "results": bench.results,
            "breakdown": [v["breakdown"] for v in case_out.values() if "breakdown" in v],
            "targets": targets,
            "real_shapes": {k: {lay: {op: rec for op, rec in recs.items()} for lay, recs in v.items()}
                            for k, v in real.items()},
            "elapsed_s": elapsed,
            "interference": noise,
        }
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
