#!/usr/bin/env python3
"""Benchmark of the overflow doctor's pieces (issue 26).

``stats``: ``ampx.ops.tensor_stats`` over 10,000 x 1,000 float32 tensors and one 64M float32
tensor, against torch's per-tensor equivalent over the same list (for each tensor:
``torch.aminmax`` of |x|, ``torch.histc`` of log2|x| over float32's exponent range and
``torch.isfinite(x).all()``) and against the read ceiling measured in the same loop
(``x.sum()`` over a float32 tensor of the same bytes), with ``ampx.ops.norm`` (one plain read
pass of ampx's) beside it: the time an element of each says whether the histogram or the memory
bounds the kernel. Contenders are interleaved, their order
rotated each repetition, medians reported (bench_kernels.interleaved). Targets: at least 0.85
of the read ceiling, at least 5x torch on the 10,000-tensor list.

The output rows ([n, 286] float64: 2,288 bytes a tensor) are written too; the table gives the
fraction of the ceiling for the bytes read alone and for read + written.

``monitor``: the step time of float16-autocast training with ``ampx.GradScaler`` on the demo's
model (batch 64) and on GPT-2 124M shapes (transformers' GPT2LMHeadModel built from a config,
batch 1 x 128 tokens, a short CPU run), without a monitor, with ``PrecisionMonitor(every=0)``
(the per-step flags) and with ``every=100`` (flags plus full statistics every 100 steps, the
statistics steps included at their rate), and Transformers' ``DebugUnderflowOverflow`` on the
same model, side by side. Variants are interleaved step by step (the same batches); medians of
the per-step times. Targets: flags at most 1.03x, every=100 at most 1.05x.

Usage:
    python benchmarks/bench_doctor.py [--quick] [--sections stats,monitor|demo|gpt2] [--json PATH]

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
           "torch aminmax+histc+isfinite": lambda: torch_stats(ts), cname: cfn,
           "ampx norm": lambda: ops.norm(ts)}
    times = bk.interleaved(fns, reps, warmup)
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    ceil_gbps = nbytes / med[cname] / 1e9
    a = med["ampx tensor_stats"]
    rec = {"case": name, "bytes_read": nbytes, "bytes_written": out_bytes, "ceiling_gbps": ceil_gbps,
           "ampx_s": a, "torch_s": med["torch aminmax+histc+isfinite"], "ceiling_s": med[cname],
           "norm_s": med["ampx norm"], "numel": sum(t.numel() for t in ts),
           "spread": spread, "vs_torch": med["torch aminmax+histc+isfinite"] / a,
           "frac_ceiling_read": (nbytes / a / 1e9) / ceil_gbps,
           "frac_ceiling_read_write": ((nbytes + out_bytes) / a / 1e9) / ceil_gbps}
    results.append(rec)
    print(f"{name:<22} ampx {a * 1e3:8.2f} ms  torch {rec['torch_s'] * 1e3:9.2f} ms  "
          f"ceiling {med[cname] * 1e3:7.2f} ms ({ceil_gbps:5.1f} GB/s)  x{rec['vs_torch']:6.1f} vs torch  "
          f"{rec['frac_ceiling_read']:.2f} of ceiling (read), {rec['frac_ceiling_read_write']:.2f} (read+out); "
          f"{a / rec['numel'] * 1e9:.2f} ns an element (ampx norm {rec['norm_s'] / rec['numel'] * 1e9:.2f})")
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


def _demo_model():
    from ampx import demo

    torch.manual_seed(0)
    model = demo.CharMLP(32)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, demo.UNKNOWN, (64, 32), generator=g)
    y = torch.randint(0, demo.UNKNOWN, (64,), generator=g)
    return model, lambda m: torch.nn.functional.cross_entropy(m(x).float(), y)


def _gpt2(quick):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2 if quick else 12, n_embd=256 if quick else 768, n_head=4 if quick else 12,
                     n_positions=128, vocab_size=50257)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


class _Variant:
    """One copy of the model with its optimizer and scaler, and what watches it."""

    def __init__(self, make, kind):
        import ampx

        self.model, self.loss = make()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.scaler = ampx.GradScaler("cpu", init_scale=2.0 ** 12)
        self.kind = kind
        if kind == "flags (every=0)":
            self.scaler.monitor(self.model, every=0)
        elif kind == "every=100":
            self.scaler.monitor(self.model, every=100)
        elif kind == "HF DebugUnderflowOverflow":
            from transformers.debug_utils import DebugUnderflowOverflow

            self.debug = DebugUnderflowOverflow(self.model, max_frames_to_save=1)

    def step(self):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = self.loss(self.model)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)


KINDS = ("none", "flags (every=0)", "every=100", "HF DebugUnderflowOverflow")


def monitor_case(name, make, steps, results):
    import time

    variants = [_Variant(make, k) for k in KINDS]
    times = {k: [] for k in KINDS}
    for v in variants:  # warm-up
        v.step()
    for i in range(steps):
        order = variants[i % len(variants):] + variants[:i % len(variants)]
        for v in order:
            t0 = time.perf_counter()
            v.step()
            times[v.kind].append(time.perf_counter() - t0)
    base = statistics.median(times["none"])
    rec = {"case": name, "steps": steps, "median_s": {k: statistics.median(t) for k, t in times.items()},
           "ratio": {k: statistics.median(t) / base for k, t in times.items()}}
    # every=100's statistics steps at their rate: one in 100 costs what one measured statistics step costs
    stats_v = variants[2]
    mon = stats_v.scaler._monitor
    mon.steps = 0  # the next step takes statistics
    t0 = time.perf_counter()
    stats_v.step()
    full = time.perf_counter() - t0
    with_rate = (99 * rec["median_s"]["every=100"] + full) / 100
    rec["stats_step_s"] = full
    rec["ratio"]["every=100 (incl. its statistics steps)"] = with_rate / base
    results.append(rec)
    print(f"{name}: step {base * 1e3:.2f} ms without a monitor; " + ", ".join(
        f"{k} x{r:.3f}" for k, r in rec["ratio"].items() if k != "none") +
        f"; one statistics step {full * 1e3:.2f} ms")
    return rec


def run_monitor(quick, results, demo=True, gpt2=True):
    if demo:
        monitor_case("demo CharMLP batch 64", _demo_model, 10 if quick else 60, results)
    if not gpt2:
        return
    try:
        monitor_case("GPT-2 124M shapes, 1 x 128" if not quick else "GPT-2 (2 layers, d=256), 1 x 128",
                     lambda: _gpt2(quick), 3 if quick else 12, results)
    except ImportError as e:
        print(f"GPT-2 case skipped: {e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions (a smoke run)")
    p.add_argument("--sections", default="stats,monitor",
                   help="comma-separated: stats, monitor (= demo and gpt2; GPT-2 124M in fp16 takes tens of minutes "
                        "on a CPU without native fp16 matmuls)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    info = bk.machine_info()
    print(f"# {info['cpu_model']}, {info['cpus_usable']} CPUs, torch {info['torch_version']}, "
          f"ampx simd {info['ampx_simd']}, {info['ampx_threads']} threads")
    results = []
    sections = args.sections.split(",")
    if "stats" in sections:
        run_stats(args.quick, results)
    demo, gpt2 = ("monitor" in sections or "demo" in sections), ("monitor" in sections or "gpt2" in sections)
    if demo or gpt2:
        run_monitor(args.quick, results, demo, gpt2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
