"""What bumping autograd's version counters costs ampx's writes (issue 14).

Times one unscale of 10,000 tensors through ampx._C directly, without and with
torch._C._increment_version over the list (what ampx.ops now does after every write), for tiny
tensors (the per-tensor cost) and 4 KB ones (the counters then sit out of cache after the
kernel). Medians of 41 runs; run it on a quiet machine:

    .venv/bin/python benchmarks/bench_versions.py
"""
import time

import torch

import ampx
from ampx import ops


def median_ms(fn, n=41):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[n // 2] * 1e3


def main():
    found = torch.zeros(1)
    where = ops._on("bench", -1)
    mode = ops._SCALE | ops._WRITE | ops._CHECK
    print(f"{'case':<28}{'kernel only':>14}{'with bump':>12}{'bump alone':>12}   (ms)")
    for size in (1, 1000):
        ts = [torch.randn(size) for _ in range(10_000)]

        def kernel():
            ampx._C.scale_reduce("bench", ts, mode, factor=1.0, found_inf=found, **where)

        def both():
            kernel()
            torch._C._increment_version(ts)

        bare, bumped = median_ms(kernel), median_ms(both)
        print(f"{'10,000 x ' + format(size, ','):<28}{bare:>14.3f}{bumped:>12.3f}{bumped - bare:>12.3f}")


if __name__ == "__main__":
    main()
