"""ampx with PEFT adapters: a LoRA GPT-2 through ampx's Trainer mixin, and a LoRA and a DoRA one
through an Accelerate loop with ``ampx.integrations.accelerate.patch``.

A 2-layer GPT-2 built from a config (nothing downloaded) gets a rank-4 adapter on every
``c_attn`` and ``c_fc`` (``peft.get_peft_model``: only the adapter trains) and runs 4 steps on the
CPU in fp16 and bf16 autocast, an inf injected into the gradient of one LoRA parameter
(``...h.1.attn.c_attn.lora_A.default.weight``) at step 2. Each run checks:
- that step alone is skipped (``stats()["skipped_steps"] == 1``), the adapter unchanged on it and
  moving on every other step, the LR schedule held there;
- ``overflow_report()`` names the LoRA parameter by its name in the PEFT model;
- step by step against the same set-up on the stock path (tests/_hf_helpers.py: torch's GradScaler
  for fp16, Accelerate's bf16 autocast as it is), unclipped, with fused AdamW: losses and adapter
  bit-identical before the skip; on it stock fp16 skips too but advances the LR (the fused step
  runs inside the skip, so Accelerate sees none), and stock bf16 lets the inf into the adapter.

PEFT 0.21 refuses to build any LoRA layer when an older torchao (below 0.16) is installed, as
torchtune's pin leaves it in this project's test environment; the models here are not torchao
models, so the fixture ``no_torchao`` tells PEFT's two checks that torchao is absent.
"""
import os
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install peft)")
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from ampx.integrations.accelerate import patch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _accel_helpers import InfAt, fresh_accelerate, reset_accelerate  # noqa: E402,F401
from _hf_helpers import (SCALER, assert_ampx_run, assert_stock_parity, snapshot, tiny_gpt2, train,  # noqa: E402
                         use_torch_scaler)

STEPS = 4
INF_STEP = 2
NAME = "base_model.model.transformer.h.1.attn.c_attn.lora_A.default.weight"


@pytest.fixture(autouse=True)
def no_torchao(monkeypatch):
    from peft.tuners.lora import torchao
    from peft.utils import quantization_utils

    for module in (torchao, quantization_utils):
        monkeypatch.setattr(module, "is_torchao_available", lambda: False)


def _model(dora=False):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                          lora_dropout=0.0, use_dora=dora)
    model = peft.get_peft_model(tiny_gpt2(), cfg)
    torch.manual_seed(1)
    with torch.no_grad():  # LoRA's B starts at zero, which leaves A's gradient zero at first
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def _data():
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": x, "labels": x} for x in torch.randint(3, 64, (4 * STEPS, 12), generator=g)]


def _trainer_run(precision, ampx, tmp_path):
    trainer, record, before = train(Trainer, TrainingArguments, precision, ampx, tmp_path, model=_model(),
                                    data=_data(), name=NAME, inf_step=INF_STEP, steps=STEPS)
    return trainer.accelerator.scaler, record.rows, record.losses(), before


def _accelerate_run(precision, ampx, dora=False):
    """The usual Accelerate loop over the PEFT model, patched by ampx or on the stock path."""
    reset_accelerate()
    acc = Accelerator(cpu=True, mixed_precision=precision)
    acc = patch(acc, **SCALER) if ampx else use_torch_scaler(acc)
    model = _model(dora)
    before = snapshot(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / STEPS)
    model, opt, sched = acc.prepare(model, opt, sched)
    InfAt(dict(model.named_parameters())[NAME], (INF_STEP,))
    rows, losses = [], []
    for batch in torch.utils.data.DataLoader(_data(), batch_size=4):
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        rows.append({"skipped": acc.optimizer_step_was_skipped, "lr": sched.get_last_lr()[0],
                     "params": snapshot(model)})
    return acc.scaler, rows, losses, before


def _check(precision, ampx_run, stock_run):
    scaler, rows, losses, before = ampx_run
    assert_ampx_run(rows, scaler, INF_STEP, NAME, before)
    assert "lora_A" in scaler.overflow_report().inf[0]
    _, stock_rows, stock_losses, _ = stock_run
    return assert_stock_parity(precision, rows, stock_rows, losses, stock_losses, INF_STEP, 0.0)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_lora_through_the_trainer_mixin(precision, tmp_path, fresh_accelerate):
    ampx_run = _trainer_run(precision, True, tmp_path / "ampx")
    reset_accelerate()
    print("trainer", precision, _check(precision, ampx_run, _trainer_run(precision, False, tmp_path / "stock")))


def test_dora_through_accelerate_patch(fresh_accelerate):
    print("dora", _check("fp16", _accelerate_run("fp16", True, dora=True), _accelerate_run("fp16", False, dora=True)))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_lora_through_accelerate_patch(precision, fresh_accelerate):
    diffs = _check(precision, _accelerate_run(precision, True), _accelerate_run(precision, False))
    print("accelerate", precision, diffs)
