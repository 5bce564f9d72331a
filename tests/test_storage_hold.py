"""Storages held while the GIL is released (issue 14 item 11).

A call that releases the GIL holds the tensor objects of its lists, but `t.data = other` in
another thread swaps the storage inside t's own TensorImpl and frees the old one while the
kernels may still be touching it (a use-after-free: a crash where the memory was unmapped, and
an AddressSanitizer report anywhere). ampx holds each storage (one reference per run of views
of one buffer) for the call. Covers: separate large tensors, views of one buffer whose only
owners are the views, a cast's source and destination lists, a read-only norm, a staged
(non-contiguous) list, and a Parameter list, each against a thread that keeps replacing `.data`
of the list's members, or of the found_inf and flags outputs (a replacement while ampx reads the list, possible where reading it
runs torch code, is refused with RuntimeError before anything is written); and that many small separate tensors keep the GIL instead (the holds
would cost more than releasing it gains) while views of one buffer release it.

Each race runs in a child process (a crash fails the test instead of killing the run) for
about 0.3 s; scripts/sanitize.sh runs this file under ASan.
"""
import subprocess
import sys
import threading

import pytest
import torch

import ampx
from ampx import ops

RACE = """
import threading, time, torch, ampx
from ampx import ops
torch.manual_seed(0)
N = 1 << 18   # 1 MB of float32 per tensor: unmapped when freed on many allocators

def race(victims, call):
    stop = threading.Event()
    def swapper():
        while not stop.is_set():
            for t in victims:
                t.data = torch.ones_like(t.data)
    th = threading.Thread(target=swapper)
    th.start()
    t0, calls = time.time(), 0
    try:
        while time.time() - t0 < 0.25 or calls < 5:
            try:
                call()
            except RuntimeError as e:  # a replacement seen while the list was read: refused whole
                if "had its storage replaced" not in str(e):
                    raise
            calls += 1
    finally:
        stop.set()
        th.join()
    return calls
"""

# (what the child sets up, the victims whose .data the other thread replaces, the call)
CASES = {
    "separate": ("ts = [torch.randn(N) for _ in range(6)]", "ts", "ops.unscale_norm_(ts, 0.5, torch.zeros(1))"),
    "views of one buffer": ("ts = list(torch.randn(6 * N).split(N))", "ts", "ops.mul_(ts, 0.5)"),
    "cast": ("src = [torch.randn(N) for _ in range(4)]; dst = [torch.empty(N, dtype=torch.bfloat16) "
             "for _ in range(4)]", "src + dst", "ops.cast_(src, dst, inv_scale=0.5)"),
    "norm": ("ts = list(torch.randn(4 * N).split(N))", "ts", "ops.norm(ts)"),
    # the staged tensor itself is left alone: torch's own copies of a tensor whose storage is
    # replaced meanwhile are not safe (ASan reports them inside torch), and ampx stages through them
    "staged": ("ts = [torch.randn(N), torch.randn(512, 512).t(), torch.randn(N)]", "[ts[0], ts[2]]",
               "ops.unscale_(ts, 0.5, torch.zeros(1))"),
    "parameters": ("ts = [torch.nn.Parameter(torch.randn(N)) for _ in range(4)]", "ts", "ops.norm(ts, 1.0)"),
    # the outputs: written after the GIL-free kernels, from pointers read before
    "outputs": ("ts = [torch.randn(N) for _ in range(4)]; outs = [torch.zeros(1), torch.zeros(4, dtype=torch.uint8)]",
                "outs", "ops.unscale_norm_(ts, 1.0, outs[0], flags=outs[1])"),
    "cast outputs": ("src = [torch.randn(N) for _ in range(4)]; dst = [torch.empty(N, dtype=torch.bfloat16) "
                     "for _ in range(4)]; outs = [torch.zeros(1), torch.zeros(4, dtype=torch.uint8)]", "outs",
                     "ops.cast_(src, dst, inv_scale=0.5, found_inf=outs[0], flags=outs[1])"),
}


def test_replacing_data_during_a_call_is_safe():
    """Every case in one child (one torch import): each must survive and say so."""
    body = [RACE]
    for name, (setup, victims, call) in CASES.items():
        body.append(f"{setup}\nprint({name!r}, race({victims}, lambda: {call}), flush=True)")
    p = subprocess.run([sys.executable, "-c", "\n".join(body)], capture_output=True, text=True, timeout=300)
    survived = [line.rsplit(" ", 1)[0] for line in p.stdout.splitlines()]
    assert p.returncode == 0, f"rc={p.returncode} after {survived}\n{p.stderr[-3000:]}"
    assert survived == list(CASES)


def _seen_mid_call(ts):
    """Whether another Python thread saw ops.mul_(ts, 2.0) half done: the first tensor's first
    element already doubled while the last tensor's last element is not yet. That state
    exists only inside the kernels, so it is seen only if they released the GIL."""
    first, last = ts[0].detach().numpy(), ts[-1].detach().numpy()  # ones: stay finite below
    seen = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            if first[0] != last[-1]:
                seen[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    th = threading.Thread(target=watch)
    th.start()
    try:
        for k in range(30):
            ops.mul_(ts, 2.0 if k % 2 == 0 else 0.5)
            if seen[0]:
                break
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    return seen[0] > 0


def test_many_small_separate_tensors_keep_the_gil_and_views_release_it():
    prev = ampx._C.set_simd("portable")
    try:
        views = list(torch.ones(2000 * 1000, dtype=torch.float16).split(1000))
        separate = [torch.ones(1000, dtype=torch.float16) for _ in range(2000)]
        if ampx._C._set_tensor_shim():  # without it, views cannot be told to share a storage
            assert _seen_mid_call(views)
        assert not _seen_mid_call(separate)
    finally:
        ampx._C.set_simd(prev)
