#!/usr/bin/env python3
"""Benchmark of the overflow doctor's pieces (issue 26).

``stats``: ``ampx.ops.tensor_stats`` over 10,000 x 1,000 float32 tensors and one 64M float32
tensor, against torch's per-tensor equivalent over the same list (for each tensor:
``torch.aminmax`` of |x|, ``torch.histc`` of log2|x| over float32's exponent range and
``torch.isfinite(x).all()``) and against the read ceiling measured in the same loop
(``x.sum()`` over a float32 tensor of the same bytes). Contenders are interleaved, their order
rotated each repetition, medians reported (bench_kernels.interleaved). Targets: at least 0.85
of the read ceiling, at least 5x torch on the 10,000-tensor list.

The output rows ([n, 286] float64: 2,288 bytes a tensor) are written too; the table gives the
fraction of the ceiling for the bytes read alone and for read + written.

Usage:
    python benchmarks/bench_doctor.py [--quick] [--sections stats] [--json PATH]

The exit code is 0 whatever the verdicts: this is a report.
"""
import argparse
import json
import os
import statistics
import sys

import torch

from ampx import ops
from ampx import stats as S

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402


def torch_stats(ts):
    """torch's nearest per-tensor equivalent of one tensor_stats row, tensor by tensor."""
    out = []
    for x in ts:
        a = x.abs()
        mn, mx = torch.aminmax(a)
        h = torch.histc(torch.log2(a.float()), bins=S.HIST_BUCKETS, min=S.EXP_MIN - 1, max=S.EXP_MAX + 2)
        out.append((mn, mx, h, torch.isfinite(x).all()))
    return out


def stats_case(name, ts, reps, warmup, results):
    nbytes = bk.total_bytes(ts)
    out_bytes = len(ts) * S.WIDTH * 8
    out = torch.empty(len(ts), S.WIDTH, dtype=torch.float64)
    cname, cfn = bk.ceiling_fns(nbytes, "read")
    fns = {"ampx tensor_stats": lambda: ops.tensor_stats(ts, out=out),
           "torch aminmax+histc+isfinite": lambda: torch_stats(ts), cname: cfn}
    times = bk.interleaved(fns, reps, warmup)
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    ceil_gbps = nbytes / med[cname] / 1e9
    a = med["ampx tensor_stats"]
    rec = {"case": name, "bytes_read": nbytes, "bytes_written": out_bytes, "ceiling_gbps": ceil_gbps,
           "ampx_s": a, "torch_s": med["torch aminmax+histc+isfinite"], "ceiling_s": med[cname],
           "spread": spread, "vs_torch": med["torch aminmax+histc+isfinite"] / a,
           "frac_ceiling_read": (nbytes / a / 1e9) / ceil_gbps,
           "frac_ceiling_read_write": ((nbytes + out_bytes) / a / 1e9) / ceil_gbps}
    results.append(rec)
    print(f"{name:<22} ampx {a * 1e3:8.2f} ms  torch {rec['torch_s'] * 1e3:9.2f} ms  "
          f"ceiling {med[cname] * 1e3:7.2f} ms ({ceil_gbps:5.1f} GB/s)  x{rec['vs_torch']:6.1f} vs torch  "
          f"{rec['frac_ceiling_read']:.2f} of ceiling (read), {rec['frac_ceiling_read_write']:.2f} (read+out)")
    return rec


def run_stats(quick, results):
    g = torch.Generator().manual_seed(0)
    count, numel = (1000, 1000) if quick else (10000, 1000)
    flat = torch.randn(count * numel, generator=g)
    many = [flat[i * numel:(i + 1) * numel].clone() for i in range(count)]
    del flat
    big = [torch.randn((4 << 20) if quick else (64 << 20), generator=g)]
    reps, warmup = (3, 1) if quick else (15, 3)
    stats_case(f"{count} x {numel} f32", many, reps, warmup, results)
    stats_case(f"1 x {big[0].numel() >> 20}M f32", big, reps, warmup, results)
    for dt in (torch.bfloat16, torch.float16):
        stats_case(f"1 x {big[0].numel() >> 20}M {str(dt)[6:]}", [big[0].to(dt)], reps, warmup, results)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions (a smoke run)")
    p.add_argument("--sections", default="stats", help="comma-separated: stats")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    info = bk.machine_info()
    print(f"# {info['cpu_model']}, {info['cpus_usable']} CPUs, torch {info['torch_version']}, "
          f"ampx simd {info['ampx_simd']}, {info['ampx_threads']} threads")
    results = []
    if "stats" in args.sections.split(","):
        run_stats(args.quick, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
