#!/usr/bin/env python3
"""ampx's CUDA kernels against torch's, on one GPU (driven by benchmarks/gpu_check.sh).

By default: the targets of the CUDA issue, each in its own guarded section, then ONE table with
every target (measured value, goal, PASS/FAIL/ERROR):
  * unscale_norm_ bandwidth against a device-to-device copy, 64M float32 (goal >= 0.90);
  * the full scaler step (ampx.GradScaler clip_grad_norm_ + fused AdamW step + update) against
    torch's (GradScaler.unscale_ + clip_grad_norm_ + step + update) on 10,000 small parameters
    (goal >= 2.5x) and on 4 x 16M (goal >= 1.0x);
  * host synchronisations per step with a fused optimizer (torch's sync debug mode counts
    them; goal 0);
  * the same step captured in a CUDA graph and replayed gives the eager step's bits;
  * issue 17 (real shapes, many small tensors): unscale_norm_ over 10,000 x 1,000 float32 as
    views of one buffer against the same bytes as one tensor (goal >= 0.85) and as separate
    tensors against torch's unscale + norm (goal >= 3x); on the parameter shapes of a LoRA set,
    GPT-2 124M and a 350M decoder (benchmarks/model_shapes.py), the time ampx.GradScaler adds
    over a bare optimizer step against the time torch's scaler adds (clip_grad_norm_ + step +
    update vs unscale_ + clip_grad_norm_ + step + update): fused AdamW <= 0.3 (LoRA) / 0.35
    (GPT-2), foreach AdamW with clipping active <= 0.3 / 0.6.
Then issue 26's target: ampx.ops.tensor_stats on 1 x 64M and 10,000 x 1,000 float32 against
the read ceiling (x.sum() over the same bytes; goal >= 0.85 on both), rows checked against
ampx.stats.reference; and (measured, no goal) the span-table sweep.
With --extended, also the older detailed sections below.

Measures, with CUDA events after a warm-up, the median of repeats:
  * the bandwidth ceiling: a device-to-device copy (and an in-place x.mul_(1.0));
  * unscale_, norm and unscale_norm_ on 1 billion float32 elements (and bfloat16), ampx vs
    torch._amp_foreach_non_finite_check_and_unscale_ / torch._foreach_norm;
  * the same on 10,000 small tensors (host-bound: wall and event times, plus both replayed from
    a CUDA graph, which shows the GPU time alone);
  * a full scaler step: unscale + inf check, clip to max_norm, fused AdamW step, scale update;
    ampx (norm of the unscaled grads in one read-only pass, clip folded into the fused step's
    grad_scale, update kernel) vs torch (GradScaler.unscale_, clip_grad_norm_, GradScaler.step,
    update), on many small parameters and on a few large ones; the bare fused step too.
Prints every number as it goes and a table at the end; --json writes them all.

Targets (H200): unscale_norm_ >= 90% of the copy ceiling; full scaler step >= 2.5x torch's.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

import ampx
from ampx import _C, ops

RESULTS = []
ROWS = []
DEVICE = "cuda"  # the issue-17 targets are written for any device (--cpu-smoke sets "cpu")
SMOKE = False  # --cpu-smoke: small sizes, CPU wall-clock timing; checks the code, measures nothing


def log(*a):
    print(*a, flush=True)


def bench(fn, reps=15, inner=1, warmup=3):
    """(median event ms, min event ms, median wall ms) per call of fn."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev, wall = [], []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        e.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3 / inner)
        ev.append(s.elapsed_time(e) / inner)
    return statistics.median(ev), min(ev), statistics.median(wall)


def graph_of(fn, warmup=2):
    """fn captured into a CUDA graph (warmed up on a side stream first); returns replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def record(section, name, ms, nbytes=None, ceiling=None, extra=None):
    r = {"section": section, "name": name, "ms": ms}
    if nbytes:
        r["GB/s"] = nbytes / ms / 1e6
        if ceiling:
            r["of_copy"] = r["GB/s"] / ceiling
    if extra:
        r.update(extra)
    RESULTS.append(r)
    bw = f"  {r['GB/s']:8.1f} GB/s" if nbytes else ""
    frac = f"  {100 * r['of_copy']:5.1f}% of copy" if "of_copy" in r else ""
    log(f"  {section:<22} {name:<44} {ms:9.3f} ms{bw}{frac}")
    return r


def row(what, ampx_ms, torch_ms, note=""):
    ROWS.append((what, ampx_ms, torch_ms, note))


def section(title):
    log("")
    log(f"--- {title}")


FAILED_SECTIONS = []


def guarded(fn):
    try:
        fn()
    except Exception:  # one shot: report and go on
        FAILED_SECTIONS.append(getattr(fn, "__name__", "?"))
        log("!!! section failed:")
        traceback.print_exc(file=sys.stdout)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the section's tensors are gone with its frame


# ---------------------------------------------------------------------------------------------

def ceiling(n):
    section(f"bandwidth ceiling: device-to-device copy of {n:,} float32")
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    ms, mn, _ = bench(lambda: y.copy_(x))
    copy = record("ceiling", "copy (read + write)", ms, 8 * n)
    record("ceiling", "copy, best repeat", mn, 8 * n)
    ms, _, _ = bench(lambda: x.mul_(1.0))
    record("ceiling", "in-place x.mul_(1.0)", ms, 8 * n)
    ms, _, _ = bench(lambda: x.sum())
    record("ceiling", "x.sum() (read only)", ms, 4 * n)
    return copy["GB/s"]


def large(n, copy_gbs, dtype=torch.float32):
    tag = "f32" if dtype == torch.float32 else "bf16"
    section(f"one tensor of {n:,} {tag}")
    es = torch.empty(0, dtype=dtype).element_size()
    x = torch.randn(n, device="cuda").to(dtype)
    inv = torch.ones(1, device="cuda")  # multiplying by 1.0 leaves the data as it is
    found = torch.zeros(1, device="cuda")
    a_un, _, _ = bench(lambda: ops.unscale_([x], inv, found))
    record(f"large {tag}", "ampx unscale_", a_un, 2 * es * n, copy_gbs)
    t_un = None
    if dtype != torch.bfloat16:  # torch's CUDA kernel refuses bfloat16
        t_un, _, _ = bench(lambda: torch._amp_foreach_non_finite_check_and_unscale_([x], found, inv))
        record(f"large {tag}", "torch _amp_foreach_non_finite_check_and_unscale_", t_un, 2 * es * n, copy_gbs)
    row(f"unscale_ 1 x {n:,} {tag}", a_un, t_un)

    a_n, _, _ = bench(lambda: ops.norm([x]))
    record(f"large {tag}", "ampx norm", a_n, es * n, copy_gbs)
    t_n, _, _ = bench(lambda: torch._foreach_norm([x]))
    record(f"large {tag}", "torch _foreach_norm", t_n, es * n, copy_gbs)
    row(f"norm 1 x {n:,} {tag}", a_n, t_n)

    a_un_n, a_best, _ = bench(lambda: ops.unscale_norm_([x], inv, found))
    r = record(f"large {tag}", "ampx unscale_norm_", a_un_n, 2 * es * n, copy_gbs)
    record(f"large {tag}", "ampx unscale_norm_, best repeat", a_best, 2 * es * n, copy_gbs)
    t_un_n = None
    if t_un is not None:
        def torch_un_n():
            torch._amp_foreach_non_finite_check_and_unscale_([x], found, inv)
            return torch._foreach_norm([x])
        t_un_n, _, _ = bench(torch_un_n)
        record(f"large {tag}", "torch unscale + _foreach_norm", t_un_n, 3 * es * n, copy_gbs)
    row(f"unscale_norm_ 1 x {n:,} {tag}", a_un_n, t_un_n,
        f"{100 * r.get('of_copy', 0):.1f}% of copy")
    if dtype == torch.float32:
        RESULTS.append({"target": "unscale_norm_ >= 90% of copy", "value": r.get("of_copy"),
                        "pass": r.get("of_copy", 0) >= 0.90})
    # correctness on the way
    got = ops.norm([x]).item()
    ref = torch.linalg.vector_norm(x.double()).item()
    log(f"  check: ampx norm {got!r} vs float64 {ref!r} (rel {abs(got - ref) / ref:.2e}); "
        f"found_inf {found.item()}")
    again = ops.norm([x]).item()
    log(f"  check: same bits run to run: {again == got}")


def small(count, size, copy_gbs):
    section(f"{count:,} tensors of {size:,} float32")
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(size, device="cuda", generator=g) for _ in range(count)]
    inv = torch.ones(1, device="cuda")
    found = torch.zeros(1, device="cuda")
    nbytes = 4 * count * size
    reps, inner = 7, 3

    def both(name, a_fn, t_fn, bytes_a, bytes_t):
        a = bench(a_fn, reps, inner)
        record("small", f"ampx {name} (events)", a[0], bytes_a, copy_gbs, {"wall_ms": a[2]})
        t = None
        if t_fn is not None:
            t = bench(t_fn, reps, inner)
            record("small", f"torch {name} (events)", t[0], bytes_t, copy_gbs, {"wall_ms": t[2]})
        log(f"    wall per call: ampx {a[2]:.3f} ms" + (f", torch {t[2]:.3f} ms" if t else ""))
        row(f"{name} {count:,} x {size:,}", a[0], t[0] if t else None)
        return a, t

    both("unscale_", lambda: ops.unscale_(ts, inv, found),
         lambda: torch._amp_foreach_non_finite_check_and_unscale_(ts, found, inv), 2 * nbytes, 2 * nbytes)

    def torch_total_norm():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts)))
    both("norm (total)", lambda: ops.norm(ts), torch_total_norm, nbytes, nbytes)

    def torch_un_n():
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, inv)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts)))
    both("unscale_norm_", lambda: ops.unscale_norm_(ts, inv, found), torch_un_n, 2 * nbytes, 3 * nbytes)

    # the GPU time alone: both replayed from CUDA graphs
    try:
        ga = graph_of(lambda: ops.unscale_norm_(ts, inv, found))
        a = bench(ga, reps, inner)
        record("small", "ampx unscale_norm_ (graph replay)", a[0], 2 * nbytes, copy_gbs)
        gt = graph_of(torch_un_n)
        t = bench(gt, reps, inner)
        record("small", "torch unscale + norm (graph replay)", t[0], 3 * nbytes, copy_gbs)
        row(f"unscale_norm_ {count:,} x {size:,}, graph replay", a[0], t[0], "GPU time only")
    except Exception:
        log("  graph replay failed:")
        traceback.print_exc(file=sys.stdout)
    got = ops.norm(ts).item()
    ref = torch_total_norm().item()
    log(f"  check: ampx total norm {got!r} vs torch {ref!r}")


def _param_maker(shapes):
    """make() -> (float32 parameters of `shapes` with random grads, fused AdamW over them)."""
    g = torch.Generator(device="cuda").manual_seed(1)

    def make():
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.01) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
        return ps, torch.optim.AdamW(ps, lr=1e-4, fused=True)
    return make


def step(label, shapes, max_norm=1e30):
    """Full scaler steps on parameters of `shapes` (float32, fused AdamW)."""
    section(f"full scaler step: {label}")
    numel = sum(math.prod(s) for s in shapes)
    log(f"  {len(shapes):,} parameters, {numel:,} elements")
    make = _param_maker(shapes)

    # torch: the documented recipe with a GradScaler (scale 1.0 keeps the grads as they are)
    tp, topt = make()
    scaler = torch.amp.GradScaler("cuda", init_scale=1.0, growth_interval=10**9)
    scaler.scale(torch.ones((), device="cuda"))  # creates its scale tensor

    def torch_step():
        scaler.unscale_(topt)
        torch.nn.utils.clip_grad_norm_(tp, max_norm)
        scaler.step(topt)
        scaler.update()

    # ampx: one read-only pass (inf check + norm of the unscaled grads), the clip folded into the
    # fused step's grad_scale, the update as a kernel; no host sync anywhere
    ap, aopt = make()
    grads = [p.grad for p in ap]
    scale = torch.ones(1, device="cuda")
    tracker = torch.zeros(1, dtype=torch.int32, device="cuda")
    found = torch.zeros(1, device="cuda")

    def ampx_step():
        found.zero_()
        inv = scale.double().reciprocal().float()
        total = ops.norm(grads, 2, factor=inv, found_inf=found)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        aopt.grad_scale = scale / coef
        aopt.found_inf = found
        aopt.step()
        del aopt.grad_scale, aopt.found_inf
        ops.update_scale_(scale, tracker, found, 2.0, 0.5, 2000)

    bp, bopt = make()
    reps, inner = 7, 2
    t = bench(torch_step, reps, inner)
    record("step", f"{label}: torch GradScaler unscale_+clip+step+update", t[0], extra={"wall_ms": t[2]})
    a = bench(ampx_step, reps, inner)
    record("step", f"{label}: ampx norm+folded clip+step+update", a[0], extra={"wall_ms": a[2]})
    b = bench(lambda: bopt.step(), reps, inner)
    record("step", f"{label}: bare fused AdamW step", b[0], extra={"wall_ms": b[2]})
    log(f"    wall per step: torch {t[2]:.3f} ms, ampx {a[2]:.3f} ms, bare step {b[2]:.3f} ms")
    row(f"scaler step {label}", a[0], t[0], f"scaler overhead ampx {a[0] - b[0]:.3f} vs torch {t[0] - b[0]:.3f} ms")
    RESULTS.append({"target": f"full scaler step >= 2.5x torch ({label})", "value": t[0] / a[0],
                    "pass": t[0] / a[0] >= 2.5})
    try:  # ampx.GradScaler itself, if it drives CUDA gradients in this build
        sp, sopt = make()
        ascaler = ampx.GradScaler("cuda", init_scale=1.0, growth_interval=10**9)
        ascaler.scale(torch.ones((), device="cuda"))

        def ampx_scaler_step():
            ascaler.clip_grad_norm_(sopt, max_norm)
            ascaler.step(sopt)
            ascaler.update()
        s = bench(ampx_scaler_step, reps, inner)
        record("step", f"{label}: ampx.GradScaler clip_grad_norm_+step+update", s[0], extra={"wall_ms": s[2]})
        row(f"ampx.GradScaler step {label}", s[0], t[0])
    except Exception as e:
        log(f"  ampx.GradScaler on CUDA: {type(e).__name__}: {e}")


# ---- the targets: one table ----------------------------------------------------------

TARGETS = []  # (what, measured text, goal text, verdict)


def target(what, goal):
    """Decorator: runs a target section; the function returns (measured text, passed)."""
    def wrap(fn):
        def run():
            try:
                shown, ok = fn()
                TARGETS.append((what, shown, goal, "PASS" if ok else "FAIL"))
                # as it comes, so that a run cut short by the time limit still shows it
                log(f"TARGET {what}: {shown}, goal {goal}: {'PASS' if ok else 'FAIL'}")
            except Exception as e:
                log(f"!!! target {what!r} failed:")
                traceback.print_exc(file=sys.stdout)
                TARGETS.append((what, f"{type(e).__name__}: {str(e)[:60]}", goal, "ERROR"))
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        run.__name__ = fn.__name__
        return run
    return wrap


@target("unscale_norm_ / D2D copy bandwidth, 64M float32", ">= 0.90")
def t_bandwidth(n=64 * 2**20):
    section(f"target: unscale_norm_ against a device-to-device copy, {n:,} float32")
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    inv, found = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    copy = record("target", "copy (read + write)", bench(lambda: y.copy_(x), 21)[0], 8 * n)
    un = record("target", "ampx unscale_norm_", bench(lambda: ops.unscale_norm_([x], inv, found), 21)[0], 8 * n)
    ratio = un["GB/s"] / copy["GB/s"]
    return f"{ratio:.3f} ({un['GB/s']:.0f} / {copy['GB/s']:.0f} GB/s)", ratio >= 0.90


def _step_pair(shapes, reps=7, inner=2):
    """(ampx ms, torch ms): ampx.GradScaler vs torch.amp.GradScaler, clip + fused AdamW + update."""
    make = _param_maker(shapes)

    tp, topt = make()
    ts = torch.amp.GradScaler("cuda", init_scale=1.0, growth_interval=10**9)
    ts.scale(torch.ones((), device="cuda"))

    def torch_step():
        ts.unscale_(topt)
        torch.nn.utils.clip_grad_norm_(tp, 1.0)
        ts.step(topt)
        ts.update()

    ap_, aopt = make()
    sa = ampx.GradScaler("cuda", init_scale=1.0, growth_interval=10**9)
    sa.scale(torch.ones((), device="cuda"))

    def ampx_step():
        sa.clip_grad_norm_(aopt, 1.0)
        sa.step(aopt)
        sa.update()

    t = bench(torch_step, reps, inner)
    a = bench(ampx_step, reps, inner)
    record("target", f"torch scaler step, {len(shapes):,} params", t[0], extra={"wall_ms": t[2]})
    record("target", f"ampx scaler step, {len(shapes):,} params", a[0], extra={"wall_ms": a[2]})
    # A step costs what the host or the device takes, whichever is longer: compare walls too.
    return max(a[0], a[2]), max(t[0], t[2])


@target("scaler step vs torch, 10,000 small params", ">= 2.5x")
def t_step_small():
    section("target: full scaler step, 10,000 small parameters")
    gs = torch.Generator().manual_seed(3)
    a, t = _step_pair([(int(k),) for k in torch.randint(500, 5000, (10_000,), generator=gs)])
    return f"{t / a:.2f}x ({a:.2f} vs {t:.2f} ms)", t / a >= 2.5


@target("scaler step vs torch, 4 x 16M params", ">= 1.0x")
def t_step_large():
    section("target: full scaler step, 4 x 16M parameters")
    a, t = _step_pair([(16 * 2**20,)] * 4)
    return f"{t / a:.2f}x ({a:.2f} vs {t:.2f} ms)", t / a >= 1.0


def _graph_helpers():
    """tests/test_cuda_graphs.py: the scaler step the GPU tests capture, shared so both check
    the same thing."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import test_cuda_graphs

    return test_cuda_graphs


@target("host syncs per step, fused AdamW + clip", "0")
def t_syncs(steps=10):
    section("target: host synchronisations per step (torch.cuda sync debug mode)")
    helpers = _graph_helpers()
    model, opt, scaler = helpers._cuda_setup(0, width=256)
    x = torch.randn(64, 256, device="cuda")
    helpers._train_step(model, opt, scaler, x)  # first step: kernels load, state made
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                opt.zero_grad(set_to_none=False)
                helpers._train_step(model, opt, scaler, x)
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    for w in syncs[:3]:
        log(f"  sync: {w.filename}:{w.lineno}: {w.message}")
    per = len(syncs) / steps
    return f"{per:g}", per == 0


@target("graph-captured step == eager step (bits)", "identical")
def t_graph():
    section("target: a captured scaler step replays with the eager step's bits")
    (me, se), (mg, sg) = _graph_helpers().captured_vs_eager(steps=9, width=256)
    same = all(torch.equal(a, b) for a, b in zip(mg.parameters(), me.parameters()))
    same = same and sg.get_scale() == se.get_scale()
    return ("identical" if same else "DIFFERENT") + f" (7 replays, scale {sg.get_scale():g})", same


@target("compiled post-backward step (fullgraph, reduce-overhead) == eager (bits)", "identical")
def t_compiled(steps=6):
    """Issue 25: clip_grad_norm_ + step + update of a fused, capturable AdamW in one
    torch.compile(fullgraph=True, mode="reduce-overhead") graph, against the same calls eagerly,
    an inf at step 3. Says whether inductor used CUDA graphs (its cudagraph_skips counter)."""
    section("target: the compiled post-backward step (ampx/graph_step.py) against eager, on CUDA")
    import math

    from torch._dynamo.utils import counters

    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        scaler = ampx.GradScaler("cuda", init_scale=2.0**15, growth_interval=2)

        def post():
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()

        f = torch.compile(post, fullgraph=True, mode="reduce-overhead") if compiled else post
        g = torch.Generator(device="cuda").manual_seed(1)
        for i in range(steps):
            x = torch.randn(64, 256, device="cuda", generator=g)
            if i == 2:
                x[0, 0] = math.inf
            scaler.scale(model(x).float().pow(2).mean()).backward()
            f()
            opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        return model, scaler

    me, se = run(False)
    skips_before = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
    mc, sc = run(True)
    skips = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)) - skips_before
    same = all(torch.equal(a, b) for a, b in zip(me.parameters(), mc.parameters())) and se.stats() == sc.stats()
    log(f"  eager stats {se.stats()}")
    log(f"  compiled stats {sc.stats()}; inductor cudagraph skips: {skips}")
    return (("identical" if same else "DIFFERENT") + f" ({steps} steps, {sc.stats()['skipped_steps']} skipped, "
            f"CUDA graphs {'skipped' if skips else 'used'})"), same


# ---- issue 17: many small tensors and real model shapes ---------------------------------------

def _shape_set(key):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import model_shapes

    return model_shapes.shape_set(key, quick=SMOKE)


def _small_count():
    return 500 if SMOKE else 10_000


def _timed(fn, reps=9, inner=2):
    """What a call costs, host or device, whichever is longer (ms)."""
    ev, _, wall = bench(fn, reps, inner)
    return max(ev, wall)


@target("10k x 1k views: one-tensor / views time", ">= 0.85")
def t_views():
    section("target: unscale_norm_ over 10,000 x 1,000 float32 as views of one buffer vs one tensor")
    flat = torch.randn(_small_count() * 1_000, device=DEVICE)
    views = list(torch.split(flat, 1_000))
    inv, found = torch.ones(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    one = _timed(lambda: ops.unscale_norm_([flat], inv, found))
    many = _timed(lambda: ops.unscale_norm_(views, inv, found))
    record("target", "unscale_norm_, one tensor of 10M", one)
    record("target", "unscale_norm_, 10,000 views of it", many)
    # With per-tensor flags, as the scaler asks: span tables on CUDA, against the same call
    # tensor by tensor (coalescing off: 90 launches of 112 tensors).
    flags = torch.zeros(len(views), dtype=torch.uint8, device=DEVICE)
    flagged = _timed(lambda: ops.unscale_norm_(views, inv, found, flags=flags))
    _C._set_coalesce(False)
    try:
        per_tensor = _timed(lambda: ops.unscale_norm_(views, inv, found, flags=flags))
    finally:
        _C._set_coalesce(True)
    record("target", "unscale_norm_ + per-tensor flags, 10,000 views (span tables)", flagged)
    record("target", "unscale_norm_ + per-tensor flags, 10,000 views, coalescing off", per_tensor)
    return (f"{one / many:.2f} ({one:.3f} / {many:.3f} ms; with flags {one / flagged:.2f}, "
            f"{per_tensor:.3f} ms without spans)"), one / many >= 0.85


@target("10k x 1k separate: torch / ampx unscale+norm", ">= 3x")
def t_separate():
    section("target: unscale_norm_ over 10,000 separate x 1,000 float32 vs torch's unscale + norm")
    xs = [torch.randn(1_000, device=DEVICE) for _ in range(_small_count())]
    inv, found = torch.ones(1, device=DEVICE), torch.zeros(1, device=DEVICE)

    def torch_un_n():
        torch._amp_foreach_non_finite_check_and_unscale_(xs, found, inv)
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(xs)))
    a = _timed(lambda: ops.unscale_norm_(xs, inv, found))
    t = _timed(torch_un_n)
    record("target", "ampx unscale_norm_, 10,000 separate", a)
    record("target", "torch unscale + foreach_norm, 10,000 separate", t)
    return f"{t / a:.2f}x ({a:.3f} vs {t:.3f} ms)", t / a >= 3.0


@target("tensor_stats / read ceiling, 64M + 10k x 1k f32", ">= 0.85")
def tensor_stats_check(n=64 * 2**20, count=10_000, size=1_000):
    """ampx.ops.tensor_stats (one read per tensor) against the read ceiling, x.sum() over the same
    bytes: one tensor of n float32 and `count` separate tensors of `size` (a launch per
    CUDA_MAX_TENSORS of them); the rows checked against ampx.stats.reference on the way."""
    from ampx import stats as S
    if SMOKE:
        n, count, size = 1 << 16, 200, 100
    section(f"tensor_stats: 1 x {n:,} and {count:,} x {size:,} float32 against x.sum()")
    x = torch.randn(n, device=DEVICE)
    x[::1000] = 0.0
    read = record("tensor_stats", "x.sum() (read ceiling)", bench(lambda: x.sum(), 21)[0], 4 * n)
    r = record("tensor_stats", f"ampx tensor_stats 1 x {n:,}", bench(lambda: ops.tensor_stats(x), 21)[0], 4 * n)
    one = r['GB/s'] / read['GB/s']
    log(f"    {one:.3f} of the read ceiling")
    assert torch.equal(ops.tensor_stats(x).cpu(), S.reference(x.cpu())), "tensor_stats row != reference"
    flat = torch.randn(count * size, device=DEVICE)
    ts = [t.clone() for t in flat.split(size)]
    read = record("tensor_stats", f"one-tensor sum of {count * size:,}", bench(lambda: flat.sum(), 21)[0],
                  4 * count * size)
    med, _, wall = bench(lambda: ops.tensor_stats(ts), 9, 2)
    r = record("tensor_stats", f"ampx tensor_stats {count:,} x {size:,}", med, 4 * count * size,
               extra={"wall_ms": wall})
    many = r['GB/s'] / read['GB/s']
    log(f"    {many:.3f} of the read ceiling; wall per call {wall:.3f} ms")
    some = ts[:: max(1, count // 50)]
    assert torch.equal(ops.tensor_stats(some).cpu(), S.reference([t.cpu() for t in some])), "rows != reference"
    return f"{one:.2f} and {many:.2f} (rows == reference)", min(one, many) >= 0.85


def span_table_sweep():
    """Where CUDA span tables start to pay (csrc/entry_cuda.c uses them when coalescing saves
    >= 4 launches of 112 tensors; a guess until this runs): unscale_ with per-tensor flags over
    N views of 1,000 float32, tables forced against coalescing off. Informational."""
    section("span tables: unscale_ + flags over N views of 1,000 float32, tables forced vs per tensor")
    inv, found = torch.ones(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    for count in ((20, 120) if SMOKE else (113, 225, 449, 1009, 4000)):
        views = list(torch.split(torch.randn(count * 1_000, device=DEVICE), 1_000))
        flags = torch.zeros(count, dtype=torch.uint8, device=DEVICE)
        prev = _C._set_span_tables_min_launches(0)
        try:
            tables = _timed(lambda: ops.unscale_(views, inv, found, flags=flags))
            _C._set_coalesce(False)
            per_tensor = _timed(lambda: ops.unscale_(views, inv, found, flags=flags))
        finally:
            _C._set_coalesce(True)
            _C._set_span_tables_min_launches(prev)
        record("span tables", f"{count:,} views, span tables", tables)
        record("span tables", f"{count:,} views, tensor by tensor", per_tensor)
        log(f"  {count:>6,} views: per tensor / tables = {per_tensor / tables:.2f}")


def added_ratio(key, kind):
    """(ampx's added ms, torch's added ms) over the bare step: parameters of model set `key`,
    AdamW `kind` ("fused", or "foreach" with clipping active), gradients of norm ~1e3 clipped
    to 1.0, scale 1.0 (so repeated steps keep meaningful gradients)."""
    _, named = _shape_set(key)
    shapes = [s for _, s in named]
    g = torch.Generator(device=DEVICE).manual_seed(7)

    def make():
        ps = [torch.nn.Parameter(torch.randn(s, device=DEVICE, generator=g) * 0.02) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, device=DEVICE, generator=g) * 3.0
        return ps, torch.optim.AdamW(ps, lr=1e-4, **{kind: True})

    bp, bopt = make()
    tp, topt = make()
    ts = torch.amp.GradScaler(DEVICE, init_scale=1.0, growth_interval=10**9)
    ts.scale(torch.ones((), device=DEVICE))
    ap_, aopt = make()
    sa = ampx.GradScaler(DEVICE, init_scale=1.0, growth_interval=10**9)
    sa.scale(torch.ones((), device=DEVICE))

    def torch_step():
        ts.unscale_(topt)
        torch.nn.utils.clip_grad_norm_(tp, 1.0, foreach=True)
        ts.step(topt)
        ts.update()

    def ampx_step():
        sa.clip_grad_norm_(aopt, 1.0)
        sa.step(aopt)
        sa.update()

    bare = _timed(bopt.step)
    t = _timed(torch_step)
    a = _timed(ampx_step)
    record("target", f"{key} {kind}: bare AdamW step", bare)
    record("target", f"{key} {kind}: torch scaler step", t)
    record("target", f"{key} {kind}: ampx scaler step", a)
    return a - bare, t - bare


def _shape_target(key, kind, goal):
    title = {"lora": "LoRA r=8", "gpt2": "GPT-2 124M", "gpt2-medium": "GPT-2 350M"}[key]

    @target(f"{title} {kind}{'+clip' if kind == 'foreach' else ''}: ampx / torch added", f"<= {goal}")
    def run():
        section(f"target: the scaler's added time, {title}, AdamW {kind}")
        a, t = added_ratio(key, kind)
        ratio = a / t if t > 0 else float("nan")
        return f"{ratio:.2f} ({a:.3f} / {t:.3f} ms)", ratio <= goal
    run.__name__ = f"t_{key}_{kind}".replace("-", "_")
    return run


SHAPE_TARGETS = [_shape_target(k, kind, goal) for k, kind, goal in (
    ("lora", "fused", 0.3), ("lora", "foreach", 0.3), ("gpt2", "fused", 0.35), ("gpt2", "foreach", 0.6),
    ("gpt2-medium", "fused", 0.35), ("gpt2-medium", "foreach", 0.6))]


def print_targets(header):
    log("")
    log("=" * 106)
    log(header)
    log(f"{'target':<50}{'measured':<38}{'goal':<11}verdict")
    log("-" * 106)
    for what, shown, goal, verdict in TARGETS:
        log(f"{what:<50}{shown:<38}{goal:<11}{verdict}")
    log("=" * 106)


def cpu_smoke():
    """The issue-17 targets' and the tensor_stats target's code on the CPU at small sizes (CI
    runs it: the GPU sections can otherwise only break where a GPU is lent). Timing by wall
    clock; the verdicts mean nothing."""
    global DEVICE, SMOKE, bench
    DEVICE, SMOKE = "cpu", True

    def wall_bench(fn, reps=15, inner=1, warmup=3):
        for _ in range(warmup):
            fn()
        w = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            w.append((time.perf_counter() - t0) * 1e3 / inner)
        return statistics.median(w), min(w), statistics.median(w)
    bench = wall_bench
    torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a: None  # this process only
    for fn in (t_views, t_separate, *SHAPE_TARGETS, tensor_stats_check):
        fn()
    span_table_sweep()
    print_targets("--cpu-smoke: the targets' code at small sizes on the CPU (verdicts mean nothing)")
    errors = [t for t in TARGETS if t[3] == "ERROR"]
    return 1 if errors or len(TARGETS) != 3 + len(SHAPE_TARGETS) else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--extended", action="store_true", help="also the older detailed sections")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the targets' code on the CPU at small sizes (no GPU needed; for CI)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.cpu_smoke:
        return cpu_smoke()
    if not torch.cuda.is_available():
        log("no CUDA device")
        return 1
    reason = ampx.cuda.unavailable_reason()
    header = (f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; ampx.cuda: "
              f"{reason or 'available'}; {ampx.cuda.device_info(0) if reason is None else ''}")
    log(header)
    t0 = time.time()
    for fn in (t_bandwidth, t_step_small, t_step_large, t_syncs, t_graph, t_compiled, t_views, t_separate,
               *SHAPE_TARGETS):
        fn()
    tensor_stats_check()  # issue 26's CUDA target, before the informational sweep
    guarded(span_table_sweep)
    print_targets(header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": TARGETS, "results": RESULTS}, f, indent=1)
    if not args.extended:
        log(f"targets took {time.time() - t0:.0f} s")
        return 0 if all(v == "PASS" for *_, v in TARGETS) else 1
    n = 100_000_000 if args.quick else 1_000_000_000
    copy = [None]

    def c():
        copy[0] = ceiling(n)
    guarded(c)
    guarded(lambda: large(n, copy[0]))
    guarded(lambda: large(n, copy[0], torch.bfloat16))
    guarded(lambda: small(10_000, 1_000, copy[0]))
    guarded(lambda: small(10_000, 10_000, copy[0]))
    gs = torch.Generator().manual_seed(3)
    many = [(int(k),) for k in torch.randint(500, 5000, (10_000,), generator=gs)]
    guarded(lambda: step("10,000 small params", many))
    guarded(lambda: step("64 x 4M params", [(2048, 2048)] * 64))
    guarded(lambda: step("mixed 500 params", [(4096, 1024)] * 100 + [(1024,)] * 400))

    log("")
    log("=" * 100)
    log(f"{'':<46}{'ampx ms':>10}{'torch ms':>10}{'speedup':>9}  note")
    for what, a, t, note in ROWS:
        sp = f"{t / a:8.2f}x" if (a and t) else "       -"
        ts = f"{t:10.3f}" if t else "         -"
        log(f"{what:<46}{a:10.3f}{ts}{sp}  {note}")
    log("-" * 100)
    for r in RESULTS:
        if "target" in r:
            v = r["value"]
            log(f"TARGET {r['target']:<52} {'PASS' if r['pass'] else 'FAIL'}  ({v:.3f})" if v is not None
                else f"TARGET {r['target']}: not measured")
    log(f"benchmarks took {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": TARGETS, "results": RESULTS}, f, indent=1)
    if FAILED_SECTIONS:
        log(f"sections that failed: {', '.join(FAILED_SECTIONS)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
