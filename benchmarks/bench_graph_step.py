#!/usr/bin/env python3
"""The post-backward step compiled as one graph (issue 25) against the same step eagerly.

Fused AdamW over a synthetic parameter set; one contender each, with its own parameters,
gradients, optimizer and scaler (all equal at the start), timed interleaved and in a rotated
order, medians reported:
  bare           opt.step() alone, no scaler (what any loop pays)
  torch          torch.amp.GradScaler: unscale_, torch.nn.utils.clip_grad_norm_, step, update
  ampx eager     ampx.GradScaler: clip_grad_norm_, step, update
  ampx compiled  the same three calls under torch.compile(fullgraph=True) (inductor by default)
  ceiling        x.mul_(1.0) over float32 of the bytes the fused step reads and writes
                 (parameters, gradients and both moments, read and written: 8 x 4 B a parameter)
Every repetition first restores each contender's gradients from one saved copy, outside the
timing: the fused kernel writes the unscaled gradients back, so without it they would shrink.
Checks, before timing, that eager and compiled ampx give the same bits after 3 steps.

    python benchmarks/bench_graph_step.py [--tensors N] [--numel N] [--repeats N] [--backend B]

The exit code is 0 whatever the figures: this is a report.
"""
import argparse
import os
import statistics
import sys
import time

import torch

import ampx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402


def contender(params0, grads0, kind, backend):
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

    def restore():
        for p, g in zip(params, grads0):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    if kind == "bare":
        return params, restore, opt.step
    if kind == "torch":
        scaler = torch.amp.GradScaler("cpu")
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))

        def step():
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
        return params, restore, step
    scaler = ampx.GradScaler("cpu")
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))

    def post():
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    if kind == "ampx compiled":
        post = torch.compile(post, fullgraph=True, backend=backend)
    return params, restore, post


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--numel", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args(argv)
    info = bk.machine_info()
    print(f"# {info['cpu_model']}, {info['cpus_usable']} CPUs, torch {info['torch_version']}, ampx simd "
          f"{info['ampx_simd']}, {info['ampx_threads']} threads; fused AdamW, {args.tensors} x {args.numel} float32, "
          f"backend {args.backend}")
    g = torch.Generator().manual_seed(0)
    params0 = [torch.randn(args.numel, generator=g) for _ in range(args.tensors)]
    grads0 = [torch.randn(args.numel, generator=g) * 2.0**16 * 1e-3 for _ in range(args.tensors)]
    kinds = ["bare", "torch", "ampx eager", "ampx compiled"]
    runs = {k: contender(params0, grads0, k, args.backend) for k in kinds}

    # same bits: eager and compiled ampx after 3 steps (the compile happens here too)
    for _ in range(3):
        for k in ("ampx eager", "ampx compiled"):
            runs[k][1]()
            runs[k][2]()
    same = all(torch.equal(a, b) for a, b in zip(runs["ampx eager"][0], runs["ampx compiled"][0]))
    print(f"eager and compiled ampx bit-identical after 3 steps: {same}")

    _, ceiling = bk.ceiling_fns(8 * 4 * args.tensors * args.numel, "rw")
    fns = {k: runs[k] for k in kinds}
    times = {k: [] for k in kinds + ["ceiling"]}
    for r in range(3 + args.repeats):
        order = kinds + ["ceiling"]
        order = order[r % len(order):] + order[:r % len(order)]
        for k in order:
            if k == "ceiling":
                t0 = time.perf_counter()
                ceiling()
                dt = time.perf_counter() - t0
            else:
                fns[k][1]()
                t0 = time.perf_counter()
                fns[k][2]()
                dt = time.perf_counter() - t0
            if r >= 3:
                times[k].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in kinds + ["ceiling"]:
        print(f"  {k:14s} {med[k] * 1e3:8.2f} ms   (min {min(times[k]) * 1e3:.2f}, max {max(times[k]) * 1e3:.2f})")
    bare = med["bare"]
    print(f"added over the bare step: torch {(med['torch'] - bare) * 1e3:.2f} ms, ampx eager "
          f"{(med['ampx eager'] - bare) * 1e3:.2f} ms, ampx compiled {(med['ampx compiled'] - bare) * 1e3:.2f} ms")
    print(f"compiled / eager ampx x{med['ampx compiled'] / med['ampx eager']:.3f}; compiled / torch "
          f"x{med['ampx compiled'] / med['torch']:.3f}; ceiling / compiled {med['ceiling'] / med['ampx compiled']:.2f}")


if __name__ == "__main__":
    main()
