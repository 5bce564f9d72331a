"""What the TRL, PEFT and diffusers integration tests share: a tiny GPT-2 and a word-level
tokenizer built in code (nothing downloaded), the stock path they are compared with (the same
framework with torch's GradScaler), a Trainer callback recording each step, and the step-by-step
comparison.

The stock fp16 path on the CPU: Accelerate (and so every Trainer) runs ``mixed_precision="fp16"``
on the CPU in float32 without a word, so the stock run here is Accelerate's own native-AMP path
switched on as ampx switches it on (``native_amp=True``) with ``torch.amp.GradScaler`` as its
scaler: fp16 autocast and torch's loss scaling. Stock bf16 is Accelerate's bf16 autocast as it is
(no scaler, no check).
"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

from _accel_helpers import InfAt

SCALER = {"init_scale": 2.0**10, "growth_interval": 3}


def tiny_tokenizer():
    """A word-level tokenizer over the words t0 ... t63 (t0 pads, t1 is unknown, t2 ends)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t1", eos_token="t2")


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                      bos_token_id=2, eos_token_id=2, pad_token_id=0, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def words(generator, n):
    return " ".join(f"t{i}" for i in torch.randint(3, 64, (n,), generator=generator).tolist())


def use_torch_scaler(accelerator):
    """The stock path: fp16 gets Accelerate's native AMP on the CPU with torch's GradScaler (call it
    before ``prepare``); bf16 stays as Accelerate runs it."""
    if accelerator.mixed_precision == "fp16":
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", **SCALER)
    return accelerator


class StockMixin:
    """A Trainer class's stock counterpart to AmpxTrainerMixin: ``class S(StockMixin, SFTTrainer)``."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        use_torch_scaler(self.accelerator)


class Steps(TrainerCallback):
    """Injects an inf into parameter ``name``'s gradient at step ``inf_step`` and records, after
    each optimizer step, whether it was skipped, the LR and the trainable parameters."""

    def __init__(self, name, inf_step):
        self.name, self.inf_step, self.trainer, self.rows = name, inf_step, None, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        InfAt(dict(model.named_parameters())[self.name], (self.inf_step,))

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        self.rows.append({"skipped": self.trainer.accelerator.optimizer_step_was_skipped,
                          "lr": lr_scheduler.get_last_lr()[0], "params": snapshot(model)})

    def losses(self):
        return [h["loss"] for h in self.trainer.state.log_history if "loss" in h]


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def rel_diff(a, b):
    """The largest relative difference of two parameter snapshots (0.0 when bit-identical)."""
    return max(float((a[n].double() - b[n].double()).abs().max() / b[n].double().abs().max().clamp_min(1e-30))
               for n in b)


def assert_ampx_run(rows, scaler, inf_step, name, before):
    """Only ``inf_step`` skipped; the parameters unchanged on it and moving on the others; the LR
    held there; the report naming ``name``. ``before``: the snapshot before training."""
    assert [r["skipped"] for r in rows] == [i == inf_step for i in range(len(rows))]
    assert scaler.stats()["skipped_steps"] == 1 and scaler.overflow_report().inf == [name]
    params = [before] + [r["params"] for r in rows]
    for i in range(len(rows)):
        assert (rel_diff(params[i + 1], params[i]) == 0.0) == (i == inf_step), i
    lrs = [r["lr"] for r in rows]
    assert lrs[inf_step] == lrs[inf_step - 1]
    assert all(lrs[i] != lrs[i - 1] for i in range(1, len(lrs)) if i != inf_step)


def assert_stock_parity(precision, rows, stock_rows, losses, stock_losses, inf_step, tol):
    """Step by step against the stock run: the losses and parameters agree (relative ``tol``) up to
    the skipped step. On it, fp16's stock (torch's GradScaler) skips too, so the parameters still
    agree, but its fused AdamW steps inside the skip, so Accelerate sees no skip and the LR moves on;
    stock bf16 has no check, and the inf reaches the parameters. Returns the per-step differences."""
    diffs = [rel_diff(r["params"], s["params"]) for r, s in zip(rows, stock_rows)]
    for i in range(inf_step):
        assert diffs[i] <= tol and abs(losses[i] - stock_losses[i]) <= tol * abs(stock_losses[i]), (i, diffs)
        assert rows[i]["lr"] == stock_rows[i]["lr"]
    assert losses[inf_step] == stock_losses[inf_step] or abs(losses[inf_step] - stock_losses[inf_step]) <= \
        tol * abs(stock_losses[inf_step])
    if precision == "fp16":
        assert diffs[inf_step] <= tol
        assert not stock_rows[inf_step]["skipped"] and stock_rows[inf_step]["lr"] != stock_rows[inf_step - 1]["lr"]
    else:
        assert not all(torch.isfinite(p).all() for p in stock_rows[inf_step]["params"].values())
    return diffs


def train(base, config, precision, ampx, tmp_path, *, model, data, name, inf_step, steps, clip=0.0, args=None,
          **kwargs):
    """``base`` (a Trainer class) with ampx's mixin or the stock path, ``steps`` steps of batch 4 on
    the CPU, an inf into ``name``'s gradient at ``inf_step``; returns (trainer, Steps, the
    trainable parameters before training). ``args``: more of ``config``'s arguments."""
    from ampx.integrations.transformers import AmpxTrainerMixin

    cls = type("T", (AmpxTrainerMixin, base) if ampx else (StockMixin, base), {})
    args = config(str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, max_steps=steps,
                  per_device_train_batch_size=4, learning_rate=1e-2, max_grad_norm=clip, logging_steps=1,
                  save_strategy="no", dataloader_num_workers=0, train_sampling_strategy="sequential",
                  **{precision: True, **(args or {})})
    before = snapshot(model)
    record = Steps(name, inf_step)
    if ampx:
        kwargs["ampx_scaler"] = SCALER
    trainer = cls(model=model, args=args, train_dataset=data, callbacks=[record], **kwargs)
    record.trainer = trainer
    trainer.train()
    return trainer, record, before
