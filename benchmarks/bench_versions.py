"""What bumping autograd's version counters costs ampx's writes (issue 14).

Every writing op bumps the counter of each tensor it wrote. ampx does it from C, through torch's
exported torch::autograd::impl::bump_version (torch_shim.h), right after the kernels; where the
start-up probe did not pass, it calls torch._C._increment_version over the list from Python
(and asks each tensor is_inference() first). This times one unscale of 10,000 tensors both
ways, for tiny tensors (the per-tensor cost), 4 KB tensors, and 4 KB views of one buffer, next
to torch._C._increment_version alone. Medians of 41 runs; run it on a quiet machine:

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
    print(f"bump from C: {'on' if ampx._C._set_versions() else 'off: ' + str(ops._VERSIONS_WHY_NOT)}")
    print(f"{'case':<28}{'C bump':>10}{'Python bump':>13}{'torch bump alone':>18}   (ms)")
    cases = {
        "10,000 x 1": [torch.randn(1) for _ in range(10_000)],
        "10,000 x 1,000": [torch.randn(1000) for _ in range(10_000)],
        "10,000 x 1,000 views": list(torch.randn(10_000 * 1000).split(1000)),
    }
    for name, ts in cases.items():
        def call():
            ampx._C.scale_reduce("bench", ts, mode, factor=1.0, found_inf=found, **where)

        on = median_ms(call)
        prev = ampx._C._set_versions(False)
        try:
            off = median_ms(call)
        finally:
            ampx._C._set_versions(prev)
        alone = median_ms(lambda: torch._C._increment_version(ts))
        print(f"{name:<28}{on:>10.3f}{off:>13.3f}{alone:>18.3f}")


if __name__ == "__main__":
    main()
