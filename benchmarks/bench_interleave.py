"""ampx's and torch's unscale of one 64M float32 tensor, alternated in one loop.

Shows the effect of libgomp's spinning worker threads: right after a torch parallel op they keep
spinning for a while and ampx's pool must share a core with them. Compare

    python benchmarks/bench_interleave.py
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_interleave.py
"""
import os
import statistics
import time

import torch

from ampx import ops


def main(repeats=25):
    x = torch.randn(64 * 1024 * 1024)
    found, inv = torch.zeros(1), torch.tensor([1.0])
    a, t = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ops.unscale_([x], inv, found)
        a.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch._amp_foreach_non_finite_check_and_unscale_([x], found, inv)
        t.append(time.perf_counter() - t0)
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}: median of {repeats}: "
          f"ampx {statistics.median(a) * 1e3:.2f} ms, torch {statistics.median(t) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
