"""ampx inside TRL's trainers: ``class T(AmpxTrainerMixin, SFTTrainer)`` (and ``DPOTrainer``).

A 2-layer GPT-2 and a word-level tokenizer built in code (nothing downloaded) train on the CPU
for 4 steps in fp16 and bf16 autocast, an inf injected into the gradient of one named parameter
at step 2 (a tensor hook), through TRL's SFTTrainer (pre-tokenized data) and DPOTrainer (a
``ref_model`` from the same config). Each run checks:
- that step alone is skipped (``optimizer_step_was_skipped``, ``stats()["skipped_steps"] == 1``),
  the parameters unchanged on it and moving on every other step, the LR schedule held there;
- ``overflow_report()`` names the parameter;
- step by step against the same TRL trainer on the stock path (tests/_hf_helpers.py: torch's
  GradScaler for fp16, Accelerate's bf16 autocast as it is), unclipped: losses and parameters
  bit-identical before the skip; on it, stock fp16 skips too but advances the LR (its fused AdamW
  steps inside the skip, so Accelerate sees none), and stock bf16 lets the inf into the parameters.
- with the Trainer's clip (max_grad_norm=0.5, ampx's fused clip): the same skip checks; against
  stock the first step's norm differs in the last bits (ampx sums in float64: 1.648558259 against
  torch's 1.648558378 on SFT fp16), so the parameters are 2e-7 relative apart after it, and AdamW's
  sign-like early steps then flip near-zero elements: no step-by-step equality is claimed there.
"""
import os
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl)")
datasets = pytest.importorskip("datasets", reason="TRL needs the datasets package")
import torch  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _accel_helpers import fresh_accelerate  # noqa: E402,F401
from _hf_helpers import (assert_ampx_run, assert_stock_parity, rel_diff, tiny_gpt2, tiny_tokenizer, train,  # noqa: E402
                         words)

STEPS = 4
INF_STEP = 2
NAME = "transformer.h.1.mlp.c_fc.weight"
TOL = 0.0  # bit-identical


def _sft_data():
    g = torch.Generator().manual_seed(5)
    return datasets.Dataset.from_dict({"input_ids": torch.randint(3, 64, (4 * STEPS, 12), generator=g).tolist()})


def _dpo_data():
    g = torch.Generator().manual_seed(6)
    n = 4 * STEPS
    return datasets.Dataset.from_dict({"prompt": [words(g, 4) + " " for _ in range(n)],
                                       "chosen": [words(g, 4) for _ in range(n)],
                                       "rejected": [words(g, 4) for _ in range(n)]})


CASES = {"sft": (SFTTrainer, SFTConfig, _sft_data), "dpo": (DPOTrainer, DPOConfig, _dpo_data)}


def _run(kind, precision, ampx, tmp_path, clip=0.0):
    base, config, data = CASES[kind]
    extra = {"ref_model": tiny_gpt2()} if kind == "dpo" else {}
    return train(base, config, precision, ampx, tmp_path, model=tiny_gpt2(), data=data(), name=NAME,
                 inf_step=INF_STEP, steps=STEPS, clip=clip, args={"gradient_checkpointing": False},
                 processing_class=tiny_tokenizer(), **extra)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_skip_hold_report_and_stock_parity(kind, precision, tmp_path, fresh_accelerate):
    trainer, steps, before = _run(kind, precision, True, tmp_path / "ampx")
    assert_ampx_run(steps.rows, trainer.accelerator.scaler, INF_STEP, NAME, before)
    stock, stock_steps, _ = _run(kind, precision, False, tmp_path / "stock")
    assert not hasattr(stock.accelerator.scaler, "overflow_report")
    diffs = assert_stock_parity(precision, steps.rows, stock_steps.rows, steps.losses(), stock_steps.losses(),
                                INF_STEP, TOL)
    print(kind, precision, "per-step parameter differences vs stock:", diffs)


def test_with_the_trainers_clip(tmp_path, fresh_accelerate):
    trainer, steps, before = _run("sft", "fp16", True, tmp_path / "ampx", clip=0.5)
    assert_ampx_run(steps.rows, trainer.accelerator.scaler, INF_STEP, NAME, before)
    stock, stock_steps, _ = _run("sft", "fp16", False, tmp_path / "stock", clip=0.5)
    assert steps.losses()[0] == stock_steps.losses()[0]
    first = rel_diff(steps.rows[0]["params"], stock_steps.rows[0]["params"])
    print("clipped, after step 0 vs stock:", first)
    assert 0 < first < 1e-6
