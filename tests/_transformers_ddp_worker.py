"""One rank of test_integration_transformers.py's DDP tests (2 gloo processes on the CPU).

``python _transformers_ddp_worker.py OUTDIR MODE...`` runs each MODE, one after the other in the
same process group, as a run of ``ampx.integrations.transformers.Trainer`` on the test file's
tiny GPT-2 in fp16 with ampx's scaler settings SCALER and max_grad_norm 0.5; each rank takes
half of the single-process test's batch, so the two together take the same samples per step.

- "plain": an inf enters rank 1's gradient of NAME at INF_STEP during backward (a tensor hook,
  so before DDP's all-reduce, which then hands it to both ranks);
- "buffer": the same with ``ampx_grad_buffer=True``; records, when the optimizer is about to
  step, whether every gradient is a view of the buffer;
- "accum", "accum-buffer": the same two with 2 micro-batches per step (DDP's no_sync on the
  first);
- "late": the inf enters rank 1's gradient only, after DDP's all-reduce (at the end of
  ``training_step``: backward done, the Trainer's clip still to come), so only an agreement
  between the ranks' scalers could make rank 0 skip; then the same injection in a DDP loop on
  ``torch.amp.GradScaler``, for comparison;
- "resume": a run with ampx settings of its own saves a checkpoint at step 3 (the Trainer
  writes scaler.pt from rank 0 only); a second Trainer, given ampx's defaults, resumes from it
  on both ranks.

For each mode each rank writes OUTDIR/<mode>-rank<r>.json (what it saw at every step, its
training logs, the overflow report) and OUTDIR/<mode>-rank<r>.pt (its parameters at the end).
"""
import json
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: nothing to fetch
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

import ampx  # noqa: E402
from _accel_helpers import InfAt, count_clips, reset_accelerate  # noqa: E402
from _worker_exit import end_group, exit_now  # noqa: E402
from ampx.integrations.accelerate import is_patched  # noqa: E402
from ampx.integrations.transformers import Trainer  # noqa: E402
from test_integration_transformers import BATCH, INF_STEP, NAME, SCALER, STEPS, _data, _model  # noqa: E402

PER_RANK = BATCH // 2
PROBE = "transformer.h.0.mlp.c_fc"  # a layer whose output dtype says whether fp16 autocast ran


def _rank():
    return dist.get_rank()


class Watch(TrainerCallback):
    """Per optimizer step: skipped or not and the LR after it; with a GradBuffer, whether every
    gradient is a view of it when the optimizer is about to step; the dtype the probed layer
    computes in. An inf enters NAME's gradient before the all-reduce on ``inf_steps`` (counted
    from the start of this ``train()``)."""

    def __init__(self, inf_steps, accum):
        self.inf_steps, self.accum, self.trainer = inf_steps, accum, None
        self.rows, self.views, self.dtypes = [], [], set()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.inf_steps:
            InfAt(dict(model.named_parameters())[NAME], self.inf_steps, self.accum)
        model.get_submodule(PROBE).register_forward_hook(lambda mod, inp, out: self.dtypes.add(str(out.dtype)))

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        buf = getattr(optimizer, "ampx_grad_buffer", None)
        if buf is not None:
            flat = [b.untyped_storage().data_ptr() for b in buf.buffers.values()]
            self.views.append(all(p.grad is not None and p.grad.untyped_storage().data_ptr() in flat
                                  for p in model.parameters() if p.requires_grad))

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.rows.append({"skipped": self.trainer.accelerator.optimizer_step_was_skipped,
                          "lr": lr_scheduler.get_last_lr()[0]})


class LateInfTrainer(Trainer):
    """Rank 1 alone gets an inf in NAME's gradient at INF_STEP, after DDP's all-reduce."""

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        if _rank() == 1 and self.state.global_step == INF_STEP:
            with torch.no_grad():
                dict(self.model.named_parameters())[NAME].grad.view(-1)[0] = math.inf
        return loss


# mode: what its Trainer run changes from the plain one
MODES = {"plain": {}, "buffer": {"grad_buffer": True}, "accum": {"accum": 2},
         "accum-buffer": {"accum": 2, "grad_buffer": True}, "late": {"late": True, "inf_steps": ()}}
RESUME_SCALER = {"init_scale": 2.0**10, "growth_interval": 2, "hysteresis": 2}


def _trainer(out_dir, *, accum=1, inf_steps=(INF_STEP,), late=False, grad_buffer=False, scaler=SCALER, **extra):
    """A Trainer on this rank's half batches; rank 1 alone gets the inf on ``inf_steps``."""
    args = TrainingArguments(out_dir, **{**dict(
        use_cpu=True, ddp_backend="gloo", fp16=True, report_to=[], disable_tqdm=True, max_steps=STEPS,
        per_device_train_batch_size=PER_RANK, gradient_accumulation_steps=accum, learning_rate=1e-2,
        max_grad_norm=0.5, logging_steps=1, save_strategy="no", train_sampling_strategy="sequential"), **extra})
    watch = Watch(inf_steps if _rank() == 1 else (), accum)
    cls = LateInfTrainer if late else Trainer
    trainer = cls(model=_model(), args=args, train_dataset=_data(BATCH * accum * 8), callbacks=[watch],
                  ampx_scaler=scaler, ampx_grad_buffer=grad_buffer)
    trainer.model_accepts_loss_kwargs = False  # a per-batch mean loss, as the single-process tests
    watch.trainer = trainer
    return trainer, watch


def run_trainer(out_dir, mode):
    """One Trainer run; returns the trainer and what this rank saw."""
    reset_accelerate()  # each run its own Accelerate state; the process group stays
    trainer, watch = _trainer(os.path.join(out_dir, mode), **MODES[mode])
    with count_clips() as clips:
        trainer.train()
    acc = trainer.accelerator
    scaler = acc.scaler if is_patched(acc) else None  # None: the test says so rather than this rank crash
    report = scaler and scaler.overflow_report()
    return trainer, {
        "ampx_file": ampx.__file__, "world": acc.num_processes, "dist_world": dist.get_world_size(),
        "kind": acc.distributed_type.name, "patched": is_patched(acc), "clips": len(clips),
        "ddp": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
        "dtypes": sorted(watch.dtypes), "rows": watch.rows, "views": watch.views,
        "report": report.inf if report else None, "scale": scaler and scaler.get_scale(),
        "logs": [h for h in trainer.state.log_history if "loss" in h],
    }


def torch_scaler_late_inf():
    """The "late" injection in a DDP loop on torch.amp.GradScaler: the steps this rank skips."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    skipped = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * _rank() + step))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if _rank() == 1 and step == INF_STEP:
            model.module.weight.grad.view(-1)[0] = math.inf
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        opt.zero_grad()
    return skipped


def run_resume(out_dir):
    """A run saving a checkpoint at step 3 (rank 0 writes scaler.pt), then a Trainer with ampx's
    defaults resuming from it on both ranks: returns the resumed trainer and what it saw."""
    reset_accelerate()
    full, _ = _trainer(os.path.join(out_dir, "full"), inf_steps=(1, 4), scaler=RESUME_SCALER,
                       save_strategy="steps", save_steps=3)
    full.train()
    reset_accelerate()
    resumed, watch = _trainer(os.path.join(out_dir, "resumed"), inf_steps=(1,), scaler={})  # step 4 of the run
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "full", "checkpoint-3"))
    if not is_patched(resumed.accelerator):
        return resumed, {"patched": False}
    scaler = resumed.accelerator.scaler
    return resumed, {
        "patched": True, "rows": watch.rows, "hysteresis": scaler.state_dict()["hysteresis"],
        "skipped_steps": scaler.stats()["skipped_steps"], "scale": scaler.get_scale(),
        "full_scale": full.accelerator.scaler.get_scale(),
        "full_skipped_steps": full.accelerator.scaler.stats()["skipped_steps"],
        "same_as_full": all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), full.model.parameters())),
    }


def main(out_dir, *modes):
    for mode in modes:
        if mode == "resume":
            trainer, seen = run_resume(os.path.join(out_dir, mode))
        else:
            trainer, seen = run_trainer(out_dir, mode)
        if mode == "late":
            seen["torch_skipped"] = torch_scaler_late_inf()
        stem = os.path.join(out_dir, f"{mode}-rank{_rank()}")
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, stem + ".pt")
        with open(stem + ".json", "w") as f:
            json.dump(seen, f)
    end_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_now()
