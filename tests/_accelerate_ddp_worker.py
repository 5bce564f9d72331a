"""One rank of test_integration_accelerate.py's DDP test (gloo, CPU): a patched Accelerator trains
a tiny MLP in fp16 with clipping; an inf is injected into rank 1's gradient of "2.weight" at step
2 only. Writes what this rank saw (skipped steps, overflow report, parameters) to rank<N>.json."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from accelerate import Accelerator  # noqa: E402

from _accel_helpers import InfAt  # noqa: E402
from ampx.integrations.accelerate import patch  # noqa: E402


def main(out_dir):
    acc = patch(Accelerator(mixed_precision="fp16"), init_scale=2.0**10)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = acc.prepare(model, opt)
    rank = acc.process_index
    InfAt(acc.unwrap_model(model)[2].weight, [2] if rank == 1 else [])
    skipped = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
    report = acc.scaler.overflow_report()
    seen = {"world": acc.num_processes, "kind": acc.distributed_type.name, "skipped": skipped,
            "report": report.inf if report else None,
            "params": [p.detach().double().sum().item() for p in model.parameters()]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    acc.wait_for_everyone()  # neither rank tears gloo down while the other still talks
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
