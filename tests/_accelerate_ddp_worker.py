"""One rank of test_integration_accelerate.py's DDP test (gloo, CPU): a patched Accelerator trains
a tiny MLP in fp16 with clipping; an inf is injected into rank 1's gradient of "2.weight" at step
2 only. Writes what this rank saw (skipped steps, overflow report, parameters) to rank<N>.json.
Mode (second argument): "plain"; "buffer" (patch(grad_buffer=True), DDP copying into the views);
"bucket" (grad_buffer=True with gradient_as_bucket_view=True, which must be refused)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from accelerate import Accelerator, DistributedDataParallelKwargs  # noqa: E402

from _accel_helpers import InfAt  # noqa: E402
from _worker_exit import exit_now  # noqa: E402
from ampx.integrations.accelerate import patch  # noqa: E402


def main(out_dir, mode="plain"):
    handlers = [DistributedDataParallelKwargs(gradient_as_bucket_view=True)] if mode == "bucket" else []
    acc = patch(Accelerator(mixed_precision="fp16", kwargs_handlers=handlers), init_scale=2.0**10,
                grad_buffer=mode != "plain")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    rank = acc.process_index
    if mode == "bucket":
        try:
            acc.prepare(model, opt)
            refused = None
        except ValueError as e:
            refused = str(e)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"refused": refused}, f)
        acc.wait_for_everyone()
        acc.end_training()
        return
    model, opt = acc.prepare(model, opt)
    views = []
    InfAt(acc.unwrap_model(model)[2].weight, [2] if rank == 1 else [])
    skipped = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        acc.clip_grad_norm_(model.parameters(), 0.5)
        if mode == "buffer":
            flat = [b.untyped_storage().data_ptr() for b in opt.ampx_grad_buffer.buffers.values()]
            views.append(all(p.grad.untyped_storage().data_ptr() in flat for p in model.parameters()))
        opt.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
    report = acc.scaler.overflow_report()
    seen = {"world": acc.num_processes, "kind": acc.distributed_type.name, "skipped": skipped,
            "report": report.inf if report else None,
            "params": [p.detach().double().sum().item() for p in model.parameters()], "views": views}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    acc.wait_for_everyone()  # neither rank tears gloo down while the other still talks
    acc.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_now()
