"""The scaler's share of a training step: ampx.GradScaler vs torch.amp.GradScaler + clip_grad_norm_.

For each model and optimizer it times, on the same gradients:
  bare   optimizer.step() alone (what any loop pays),
  torch  scaler.unscale_(opt); clip_grad_norm_(params, max_norm); scaler.step(opt); scaler.update()
  ampx   scaler.clip_grad_norm_(opt, max_norm); scaler.step(opt); scaler.update()
and reports what each scaler path adds over the bare step. Forward and backward are excluded;
the gradients are restored from a saved copy before every repetition, outside the timing.
Target on the development machine: ampx adds at most half of what torch adds, in every case.

    python benchmarks/bench_step.py [--quick] [--repeats N] [--json PATH]
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import ampx


def machine():
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"ampx {ampx.__version__} (SIMD {ampx.ops.simd_level()}, tensors read through {ampx.ops.tensor_reader()}), "
            f"Python {platform.python_version()}")


def make_params(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in sizes]
    grads = [torch.randn(n, generator=g) * 3.0 for n in sizes]
    return params, grads


def bench_case(name, sizes, opt_kw, repeats, max_norm=1.0):
    params, grads = make_params(sizes)
    # init_scale 1.0 keeps restored gradients meaningful from one repetition to the next.
    opt = torch.optim.AdamW(params, lr=1e-4, **opt_kw)
    t_scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
    a_scaler = ampx.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
    for s in (t_scaler, a_scaler):
        s.scale(torch.ones(()))

    def restore():
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    def run_bare():
        opt.step()

    def run_torch():
        t_scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        t_scaler.step(opt)
        t_scaler.update()

    def run_ampx():
        a_scaler.clip_grad_norm_(opt, max_norm)
        a_scaler.step(opt)
        a_scaler.update()

    runs = {"bare": run_bare, "torch": run_torch, "ampx": run_ampx}
    times = {k: [] for k in runs}
    for k, fn in runs.items():  # warm-up (allocates optimizer state)
        restore()
        fn()
    for _ in range(repeats):
        for k, fn in runs.items():  # interleaved: the machine's noise hits all three alike
            restore()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    torch_add = med["torch"] - med["bare"]
    ampx_add = med["ampx"] - med["bare"]
    ratio = ampx_add / torch_add if torch_add > 0 else float("nan")
    return {"case": name, "bare_ms": med["bare"], "torch_ms": med["torch"], "ampx_ms": med["ampx"],
            "torch_added_ms": torch_add, "ampx_added_ms": ampx_add, "added_ratio": ratio,
            "pass": ratio <= 0.5}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    small_n, small_size = (500, 200) if args.quick else (10_000, 1_000)
    large = [1 << 16] * 3 if args.quick else [1 << 24] * 4
    repeats = args.repeats or (3 if args.quick else 15)

    print(f"machine: {machine()}")
    print(f"command: python benchmarks/bench_step.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    cases = [
        (f"{small_n} x {small_size} params, AdamW foreach", [small_size] * small_n, {"foreach": True}),
        (f"{small_n} x {small_size} params, AdamW fused", [small_size] * small_n, {"fused": True}),
        (f"{len(large)} x {large[0]} params, AdamW foreach", large, {"foreach": True}),
        (f"{len(large)} x {large[0]} params, AdamW fused", large, {"fused": True}),
        # Extra, not a target case: the norm stays under max_norm, so nothing needs scaling after
        # the unscale (ampx then takes its one-pass route for optimizers reading plain gradients).
        (f"{len(large)} x {large[0]}, foreach, clip not hit", large, {"foreach": True}, 1e9),
    ]
    results = []
    header = f"{'case':<40} {'bare ms':>9} {'torch ms':>9} {'ampx ms':>9} {'torch +':>9} {'ampx +':>9} {'ratio':>6}  target"
    print(header)
    print("-" * len(header))
    for name, sizes, kw, *max_norm in cases:
        r = bench_case(name, sizes, kw, repeats, *max_norm)
        results.append(r)
        verdict = "(extra case)" if max_norm else f"{'PASS' if r['pass'] else 'FAIL'} (<= 0.50)"
        print(f"{name:<40} {r['bare_ms']:9.2f} {r['torch_ms']:9.2f} {r['ampx_ms']:9.2f} "
              f"{r['torch_added_ms']:9.2f} {r['ampx_added_ms']:9.2f} {r['added_ratio']:6.2f}  {verdict}",
              flush=True)
    print("ratio = (ampx - bare) / (torch - bare): the share of torch's scaler overhead ampx still pays")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
