#!/usr/bin/env python3
"""Per-call cost of ampx.ops on the eager path (issue 25): does registering the kernels as torch
custom ops (ampx/_torch_ops.py) slow the calls that do not need the dispatcher?

Eager calls check whether torch must see them (compile, profiler, dispatch mode, meta/fake
input) and then call the C kernel directly, as before; those checks are the whole added cost.
Cases:
  * 1 tensor of 1,000 float32: ``unscale_`` (found_inf), ``norm``, ``mul_``: the fixed cost;
  * 10,000 x 1,000 float32 (separate tensors): ``unscale_norm_`` with found_inf and flags, as
    the scaler's clip runs it (target: at most 5% slower than before);
  * the routing check alone (``ops._dispatching``) on the 10,000 list: all that the eager path
    adds, whatever the list's length (the load of a shared VM swamps it in the list's timing),
    and, in one process, interleaved, the public 10k call against the kernel call it makes;
  * for reference, the same one-tensor ``unscale_`` through ``torch.ops.ampx`` (the dispatcher
    route that compile and the profiler take), when the build has it.

With ``--baseline DIR`` (another ampx source tree, built in place: e.g. ``git archive`` of the
commit before, then ``setup.py build_ext --inplace``) each repetition runs this script once per
build, in fresh processes, the order alternating, and prints after/before ratios.

    .venv/bin/python benchmarks/bench_op_overhead.py [--baseline DIR] [--repeats 3]

A report: the exit code is 0 whatever the ratios. On a shared VM compare ratios of one run.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMALL_CALLS, SMALL_BLOCKS = 2000, 15
N_TENSORS, SIZE, LIST_ITERS, AB_PAIRS = 10_000, 1_000, 41, 100


def _per_call(fn, calls, blocks):
    """The fastest block's time per call, in microseconds: the other helpers' load on a shared VM
    only ever adds time, so the minimum is the figure that compares builds."""
    fn()
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times)


def measure():
    """{case: microseconds per call} for the ampx on sys.path."""
    import torch

    import ampx  # noqa: F401
    from ampx import _C, ops

    one = [torch.randn(SIZE)]
    found = torch.zeros(1)
    out = {
        "unscale_, 1 tensor": _per_call(lambda: ops.unscale_(one, 1.0, found), SMALL_CALLS, SMALL_BLOCKS),
        "norm, 1 tensor": _per_call(lambda: ops.norm(one), SMALL_CALLS, SMALL_BLOCKS),
        "mul_, 1 tensor": _per_call(lambda: ops.mul_(one, 1.0), SMALL_CALLS, SMALL_BLOCKS),
    }
    pads, many = [], []
    for _ in range(N_TENSORS):  # separate tensors, not back to back in memory
        many.append(torch.randn(SIZE))
        pads.append(torch.empty(16))
    flags = torch.zeros(N_TENSORS, dtype=torch.uint8)
    out["unscale_norm_, 10k x 1k"] = _per_call(
        lambda: ops.unscale_norm_(many, 1.0, found, flags=flags), 1, LIST_ITERS)
    if hasattr(ops, "_dispatching"):  # the whole of what the eager path adds, for either list
        out["routing check alone, 10k list"] = _per_call(lambda: ops._dispatching(many), SMALL_CALLS, SMALL_BLOCKS)
        # In one process, interleaved, so that the load of other work falls on both alike: the
        # public call against the kernel call it makes (the path before the ops, minus checks).
        public = lambda: ops.unscale_norm_(many, 1.0, found, flags=flags)  # noqa: E731
        direct = lambda: ops._unscale_norm(many, 1.0, found, flags, _C.REDUCE_SUMSQ, False)  # noqa: E731
        pairs = [(_per_call(public, 1, 1), _per_call(direct, 1, 1)) for _ in range(AB_PAIRS)]
        out["unscale_norm_ 10k: public / direct kernel call (ratio)"] = (min(a for a, _ in pairs)
                                                                         / min(b for _, b in pairs))
    if hasattr(torch.ops.ampx, "unscale_"):
        kernel = torch.ops.ampx.unscale_
        out["torch.ops.ampx.unscale_, 1 tensor (dispatcher)"] = _per_call(
            lambda: kernel(one, None, 1.0, found, None), SMALL_CALLS, SMALL_BLOCKS)
    return out


def _child(path):
    env = dict(os.environ, PYTHONPATH=path)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, capture_output=True,
                       text=True, timeout=600, cwd="/")
    if r.returncode:
        raise SystemExit(f"the run with PYTHONPATH={path} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fmt(us, case=""):
    if case.endswith("(ratio)"):
        return f"{us:9.3f}   "
    return f"{us / 1000:9.3f} ms" if us >= 1000 else f"{us:9.2f} us"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="an ampx source tree built in place, timed as 'before'")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    builds = [("after", ROOT)] + ([("before", os.path.abspath(args.baseline))] if args.baseline else [])
    for rep in range(args.repeats):
        order = builds if rep % 2 == 0 else builds[::-1]
        got = {label: _child(path) for label, path in order}
        print(f"run {rep + 1} (order: {', '.join(label for label, _ in order)})")
        for case, after in got["after"].items():
            line = f"  {case:56s} after {_fmt(after, case)}"
            before = got.get("before", {}).get(case)
            if before is not None:
                line += f"   before {_fmt(before)}   after/before {after / before:6.3f}"
            print(line)


if __name__ == "__main__":
    main()
