"""Multi-process scenarios for test_doctor_distributed.py (gloo, CPU, 2 ranks).

One rank's forward pass overflows float16 in a named Linear at one step (a pre-hook on that
rank alone scales the Linear's input); the other ranks' tensors stay finite, and their
gradients become non-finite only through the gradient reduction (DDP's all-reduce, FSDP2's
reduce-scatter). Each rank saves what its scaler and monitor reported.
"""
import torch

import ampx

import _dist_workers  # noqa: E402  (tests/ is on sys.path, as for this file)

STEPS = 5
BAD_STEP = 2
BAD_RANK = 1
BAD_MODULE = "2"


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _train(rank, forward, inner, params, scaler, monitor, full_params, clip=False):
    """STEPS fp16-autocast steps (with ``clip``, scaler.clip_grad_norm_ first: the scaler's
    collective then sums, where without it it takes the max); returns per step: skipped, the
    report's origin and advice, whether the parameters changed."""
    opt = torch.optim.SGD(params, lr=0.1)
    bad = inner[int(BAD_MODULE)]
    out = {"steps": []}
    for step in range(STEPS):
        handle = None
        if step == BAD_STEP and rank == BAD_RANK:
            handle = bad.register_forward_pre_hook(lambda m, args: (args[0] * 1e6,))
        x, y = _batch(rank, step)
        before = full_params()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(forward(x).float(), y)
        scaler.scale(loss).backward()
        if clip:
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if handle is not None:
            handle.remove()
        rep = scaler.overflow_report()
        skipped = bool(scaler.last_step_skipped)
        out["steps"].append({"skipped": skipped, "unchanged": all(torch.equal(a, b) for a, b in
                                                                     zip(before, full_params())),
                             "origin": rep.origin if skipped else None, "advice": rep.advice if skipped else None,
                             "names": (rep.inf + rep.nan) if skipped else []})
    monitor.remove()
    return out


def scenario_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner = _model()
    scaler = ampx.GradScaler("cpu", init_scale=2.0**8)
    monitor = ampx.PrecisionMonitor(inner, scaler, every=1)
    scaler.watch(inner)
    model = DDP(inner)
    return _train(rank, model, inner, model.parameters(), scaler, monitor,
                  lambda: [p.detach().clone() for p in inner.parameters()])


def scenario_fsdp2(rank, world, clip=False):
    model = _model()
    mesh = _dist_workers.fsdp2_shard(model, world)
    scaler = ampx.GradScaler("cpu", init_scale=2.0**8, process_group=mesh.get_group())
    monitor = ampx.PrecisionMonitor(model, scaler, every=1)
    scaler.watch(model)
    return _train(rank, model, model, model.parameters(), scaler, monitor,
                  lambda: [p.detach().to_local().clone() for p in model.parameters()], clip)


SCENARIOS = {"ddp": scenario_ddp, "fsdp2": scenario_fsdp2,
             "fsdp2_clip": lambda rank, world: scenario_fsdp2(rank, world, clip=True)}


def run(rank, world, store, out_dir, names):
    _dist_workers.run(rank, world, store, out_dir, names, SCENARIOS)
