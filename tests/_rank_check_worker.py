"""2-rank DDP scenarios for test_rank_check.py (gloo, CPU), run by _dist_workers.run.

An inf is written into rank 1's gradient after backward (after DDP's all-reduce), as a
rank-local fault would; each route of the step is run with and without check_ranks.
"""
import math
import time

import torch
import torch.distributed as dist

import ampx
import _dist_workers as W

STEPS = 12
INJECT = {3: math.inf, 8: math.nan}
ROUTES = ("clip", "step", "unscale_clip", "fused_clip", "fused_step", "torch_clip")


def _ddp(route):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(W._model())
    if route.startswith("fused"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


def _step(scaler, opt, route, max_norm=1.0, error_if_nonfinite=False):
    if route == "unscale_clip":
        scaler.unscale_(opt)
    if route in ("clip", "unscale_clip", "fused_clip", "torch_clip"):
        scaler.clip_grad_norm_(opt, max_norm, error_if_nonfinite=error_if_nonfinite)
    scaler.step(opt)
    scaler.update()


def _run(rank, world, route, check_ranks, refuse_at=None, error_if_nonfinite=False):
    model, opt = _ddp(route)
    scaler = ampx.GradScaler("cpu", init_scale=2.0**10, growth_interval=10, check_ranks=check_ranks,
                             clip_norm="torch" if route == "torch_clip" else "exact")
    first = next(model.parameters())
    per = W.GLOBAL_BATCH // world
    rec = {"params": [], "skipped": [], "collectives": [], "scale": [], "refused": [], "raised": []}
    for step in range(STEPS):
        x, y = W._batch(step)
        opt.zero_grad(set_to_none=True)
        scaler.scale(W._loss(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])).backward()
        if step in INJECT and rank == 1:
            first.grad.view(-1)[0] = INJECT[step]  # after DDP's all-reduce: rank 1 only
        with W.CountCollectives() as cc:
            if step == refuse_at and rank == 1:
                try:
                    scaler.clip_grad_norm_(opt, -1.0)  # refused on this rank only
                except ValueError as e:
                    rec["refused"].append(str(e))
                scaler.step(opt)
                scaler.update()
            elif error_if_nonfinite:
                try:
                    _step(scaler, opt, route, error_if_nonfinite=True)
                    raised = None
                except RuntimeError as e:
                    raised = str(e)
                    scaler.step(opt)  # skips (the ranks agreed on the overflow), and the scale backs off
                    scaler.update()
                rec["raised"].append(raised)
            else:
                _step(scaler, opt, route)
        rec["collectives"].append(cc.count)
        rec["skipped"].append(bool(scaler.last_step_skipped))
        rec["scale"].append(scaler.get_scale())
        rec["params"].append(torch.cat([p.detach().flatten() for p in model.module.parameters()]))
    return rec


def scenario_routes(rank, world):
    return {(route, check): _run(rank, world, route, check) for route in ROUTES for check in (True, False)}


def scenario_refusal(rank, world):
    return _run(rank, world, "clip", True, refuse_at=5)


def scenario_nonfinite(rank, world):
    """clip_grad_norm_(error_if_nonfinite=True) in a loop that catches its error and then lets
    the scaler skip the step (step + update)."""
    return {route: _run(rank, world, route, True, error_if_nonfinite=True)
            for route in ("clip", "unscale_clip", "fused_clip", "torch_clip")}


def scenario_timing(rank, world, steps=300):
    """Seconds per clip + step + update, without overflows, with and without check_ranks
    (alternating blocks, so drift on a shared machine hits both alike)."""
    out = {True: [], False: []}
    runs = {c: (_ddp("clip"), ampx.GradScaler("cpu", init_scale=2.0**10, check_ranks=c)) for c in (True, False)}
    x, y = W._batch(0)
    for block in range(10):
        for check, ((model, opt), scaler) in runs.items():
            for _ in range(steps // 10):
                opt.zero_grad(set_to_none=True)
                scaler.scale(W._loss(model, x, y)).backward()
                dist.barrier()
                t = time.perf_counter()
                _step(scaler, opt, "clip", max_norm=1e9)
                out[check].append(time.perf_counter() - t)
    buf = torch.zeros(2, dtype=torch.float64)  # the collective's buffer: flag and monitor code
    out["bare"] = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        out["bare"].append(time.perf_counter() - t)
    return out


SCENARIOS = {"routes": scenario_routes, "refusal": scenario_refusal, "nonfinite": scenario_nonfinite,
             "timing": scenario_timing}
