"""Run by test_integration_lightning_strategies.py: Lightning's ModelParallelStrategy (FSDP2,
``fully_shard`` over the data-parallel dimension) on 2 gloo processes on the CPU.

``python _lightning_model_parallel_worker.py OUTDIR``: Lightning's launcher starts the second rank
by running this script again; both ranks then run the same three fits in turn (the launcher
starts the second rank once, at the first fit):

- ``stock``: Lightning's MixedPrecision("bf16-mixed"), gradient_clip_val (torch's clip, which
  takes the norm of the whole DTensor gradient);
- ``ampx``: AmpxPrecision("bf16-mixed"), the same clip through ampx's scaler;
- ``inf``: AmpxPrecision("16-mixed", hysteresis=2) with the clip; an inf enters the local shard
  of one gradient on rank 0 only, at step BAD_STEP (after backward: nothing else would carry it
  to rank 1).

Each rank writes OUTDIR/<fit>-rank<r>.json: the full parameters, its own shards of them, the steps it skipped, the
scaler's scale, norm and group, the scheduler's last_epoch.
"""
import json
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning as L  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from ampx.integrations.lightning import AmpxPrecision  # noqa: E402
from test_integration_lightning import Net, batches  # noqa: E402
from _worker_exit import end_group, exit_now  # noqa: E402

BAD_STEP = 5
STEPS = 12


class Sharded(Net):
    """Net with each Linear and the whole net under FSDP2 over the data-parallel dimension."""

    def __init__(self, inject_at=()):
        super().__init__("foreach")
        self.inject_on_rank0 = set(inject_at)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_after_backward(self):
        if self.global_rank == 0 and self.global_step in self.inject_on_rank0:
            self.net[0].weight.grad.to_local().view(-1)[0] = float("inf")  # rank 0's shard only


def fit(name, plugin, outdir, inject_at=()):
    model = Sharded(inject_at)
    trainer = L.Trainer(accelerator="cpu", devices=2, plugins=[plugin], max_epochs=1, gradient_clip_val=0.05,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model, torch.utils.data.DataLoader(batches(STEPS), batch_size=None))
    full = [p.full_tensor() for p in model.parameters()]  # a collective: every rank, same order
    out = {"params": [p.detach().double().flatten().tolist() for p in full],
           "local": [p.to_local().detach().double().flatten().tolist() for p in model.parameters()],
           "last_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch}
    if isinstance(plugin, AmpxPrecision):
        stats = plugin.scaler.stats()
        out.update(skipped=[g - 1 for g, s in sorted(model.skipped.items()) if s],
                   scale=float(plugin.scaler.get_scale()), norm=float(stats["last_norm"]),
                   skipped_steps=stats["skipped_steps"], sharded=plugin.scaler.process_group is not None)
    with open(os.path.join(outdir, f"{name}-rank{trainer.global_rank}.json"), "w") as f:
        json.dump(out, f)


def main(outdir):
    warnings.simplefilter("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    fit("stock", MixedPrecision("bf16-mixed", "cpu"), outdir)
    fit("ampx", AmpxPrecision("bf16-mixed"), outdir)
    fit("inf", AmpxPrecision("16-mixed", hysteresis=2), outdir, inject_at={BAD_STEP})
    end_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
