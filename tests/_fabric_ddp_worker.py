"""Run by test_integration_fabric.py: Lightning Fabric DDP over 2 gloo processes on the CPU.

``python _fabric_ddp_worker.py OUTDIR MODE``: Fabric's launcher starts the second rank by running
this script again. MODE "ampx" puts ``ampx.GradScaler`` into Fabric's own ``MixedPrecision`` and
holds the LR schedule on a skipped step (``scaler.last_step_skipped``); "stock" is the same loop
with torch's GradScaler, whose loop cannot tell and steps the schedule every time. An inf enters
the gradient of "0.weight" on rank 0 only, at step BAD_STEP, through a hook that runs before DDP's
all-reduce, so both ranks receive it. Each rank writes what it saw to OUTDIR/<MODE>-rank<r>.json.
"""
import json
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402

import ampx  # noqa: E402
from _worker_exit import end_group, exit_now  # noqa: E402

BAD_STEP, STEPS = 3, 7


def main(outdir, mode):
    warnings.simplefilter("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    scaler = ampx.GradScaler("cpu", init_scale=2.0**10) if mode == "ampx" else torch.amp.GradScaler("cpu", init_scale=2.0**10)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp",
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    model, opt = fabric.setup(net, opt)
    if mode == "ampx":
        scaler.watch(model)  # Fabric's module around DDP's: named as net's own parameters
    state = {"step": 0}

    def poison(grad):
        if fabric.global_rank == 0 and state["step"] == BAD_STEP:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    net[0].weight.register_hook(poison)
    g = torch.Generator().manual_seed(1 + fabric.global_rank)
    rec = {"params": [], "changed": [], "lrs": [], "skipped": [], "reports": []}
    for step in range(STEPS):
        state["step"] = step
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        scale = scaler.get_scale()
        opt.step()  # Fabric's plugin: scaler.step(opt) and scaler.update()
        skipped = scaler.last_step_skipped if mode == "ampx" else scaler.get_scale() < scale
        if mode == "stock" or not scaler.last_step_skipped:
            sched.step()
        after = [p.detach().clone() for p in model.parameters()]
        rec["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
        rec["params"].append([p.double().sum().item() for p in after])
        rec["lrs"].append(opt.param_groups[0]["lr"])
        rec["skipped"].append(bool(skipped))
        if mode == "ampx":
            report = scaler.overflow_report()
            rec["reports"].append(None if report is None else [report.inf, report.nan])
    if mode == "ampx":
        rec["stats"] = {k: scaler.stats()[k] for k in ("steps", "skipped_steps")}
    rec["world_size"] = fabric.world_size
    with open(os.path.join(outdir, f"{mode}-rank{fabric.global_rank}.json"), "w") as f:
        json.dump(rec, f)
    end_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_now()
