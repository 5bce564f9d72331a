"""Run by test_integration_lightning.py: Lightning DDP over 2 gloo processes on the CPU.

``python _lightning_ddp_worker.py OUTDIR``: Lightning's own launcher starts the second rank by
running this script again. An inf enters one gradient on rank 0 only, through a hook that runs
before DDP's all-reduce, so both ranks receive it; each rank writes what it saw to
OUTDIR/rank<r>.json.
"""
import json
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning as L  # noqa: E402

from ampx.integrations.lightning import AmpxPrecision  # noqa: E402
from test_integration_lightning import Net, batches  # noqa: E402
from _worker_exit import end_group, exit_now  # noqa: E402

BAD_STEP = 5


class RankZeroInf(Net):
    def on_fit_start(self):
        weight = self.net[0].weight

        def poison(grad):
            if self.global_rank == 0 and self.global_step == BAD_STEP:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
            return grad

        weight.register_hook(poison)


def main(outdir):
    warnings.simplefilter("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model = RankZeroInf("foreach")
    plugin = AmpxPrecision("16-mixed", hysteresis=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=0.05, use_distributed_sampler=False)
    trainer.fit(model, torch.utils.data.DataLoader(batches(12), batch_size=None))
    report = plugin.scaler.overflow_report()
    out = {
        "world_size": trainer.world_size,
        "skipped": [g - 1 for g, s in sorted(model.skipped.items()) if s],
        "last_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        "report": None if report is None else report.inf,
        "scale": plugin.scaler.get_scale(),
        "params": [p.detach().double().sum().item() for p in model.parameters()],
    }
    with open(os.path.join(outdir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(out, f)
    end_group()  # Lightning leaves the gloo group up (_worker_exit.py says why it must end here)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
