"""What GradScaler(check_ranks=True) adds to a DDP step: 2 gloo ranks on this host, the small
MLP of tests/_dist_workers.py, clip_grad_norm_ + step + update timed per step with and without
it (alternating blocks of steps), medians in microseconds. The difference is the one all-reduce
of the overflow flag (README, next to the DDP text).

    python benchmarks/bench_rank_check.py
"""
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import _dist_workers as W  # noqa: E402
import _rank_check_worker as R  # noqa: E402


def main():
    with tempfile.TemporaryDirectory() as d:
        torch.multiprocessing.spawn(W.run, args=(2, os.path.join(d, "store"), d, ["timing"], R.SCENARIOS),
                                    nprocs=2, join=True)
        ranks = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False)["timing"] for r in range(2)]
    for r, t in enumerate(ranks):
        if "error" in t:
            raise SystemExit(t["error"])
        on, off = statistics.median(t[True]) * 1e6, statistics.median(t[False]) * 1e6
        print(f"rank {r}: clip + step + update {off:.1f} us without check_ranks, {on:.1f} us with "
              f"(+{on - off:.1f} us per step; {len(t[True])} steps each); a bare 2-element gloo "
              f"all_reduce: {statistics.median(t['bare']) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
