"""ampx in a diffusers training loop: ``UNet2DModel`` + ``EMAModel`` in an Accelerate loop patched by
``ampx.integrations.accelerate.patch``, the EMA held by ``ampx.integrations.accelerate.hold_on_skip``.

A tiny UNet2DModel (8x8 samples, 2 blocks of 8 and 16 channels, built from its arguments) learns
DDPM's noise prediction for 4 steps on the CPU in fp16 and bf16 autocast, as diffusers'
train_unconditional.py loops (AdamW as it makes it, ``diffusers.optimization.get_scheduler``
prepared by the accelerator, ``ema_model.step(unet.parameters())`` after each synced step), an inf
injected into the gradient of one named parameter at step 2. Each run checks:
- that step alone is skipped (``stats()["skipped_steps"] == 1``), the parameters unchanged on it and
  moving on every other step, the LR schedule held there;
- the EMA held there too: its shadow parameters unchanged and its ``optimization_step`` (the decay
  warm-up's count) one behind the steps; it stays an EMAModel whose state_dict a stock one loads;
- ``overflow_report()`` names the parameter;
- step by step against the stock loop (torch's GradScaler for fp16, Accelerate's bf16 autocast
  as it is), unclipped: fp16 losses and parameters bit-identical on every step, the skipped one
  included (torch's scaler skips too and, AdamW not being fused, Accelerate sees the skip and holds
  the LR), but the stock EMA steps on the skipped step and differs from then on; stock bf16 is
  bit-identical before the skip and lets the inf into the parameters on it.
"""
import os
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install diffusers)")
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from diffusers import DDPMScheduler, UNet2DModel  # noqa: E402
from diffusers.optimization import get_scheduler  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402

from ampx.integrations.accelerate import hold_on_skip, patch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _accel_helpers import InfAt, reset_accelerate  # noqa: E402
from _hf_helpers import SCALER, assert_ampx_run, rel_diff, snapshot, use_torch_scaler  # noqa: E402

STEPS = 4
INF_STEP = 2
NAME = "down_blocks.1.resnets.0.conv1.weight"


def _unet():
    torch.manual_seed(0)
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=4)


def _batches():
    g = torch.Generator().manual_seed(3)
    noise_scheduler = DDPMScheduler(num_train_timesteps=100)
    for _ in range(STEPS):
        clean, noise = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
        t = torch.randint(0, 100, (4,), generator=g)
        yield noise_scheduler.add_noise(clean, noise, t), t, noise


def _run(precision, ampx, clip=None):
    reset_accelerate()
    acc = Accelerator(cpu=True, mixed_precision=precision)
    acc = patch(acc, **SCALER) if ampx else use_torch_scaler(acc)
    unet = _unet()
    before = snapshot(unet)
    ema = EMAModel(unet.parameters(), decay=0.9, use_ema_warmup=True, inv_gamma=1.0, power=0.75)
    if ampx:
        hold_on_skip(acc, ema)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-2, weight_decay=1e-6)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=STEPS)
    unet, opt, sched = acc.prepare(unet, opt, sched)
    InfAt(dict(unet.named_parameters())[NAME], (INF_STEP,))
    rows, losses = [], []
    for noisy, t, noise in _batches():
        with acc.accumulate(unet):
            loss = torch.nn.functional.mse_loss(unet(noisy, t).sample.float(), noise)
            acc.backward(loss)
            if acc.sync_gradients and clip is not None:
                acc.clip_grad_norm_(unet.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            ema.step(unet.parameters())
        losses.append(loss.item())
        rows.append({"skipped": acc.optimizer_step_was_skipped, "lr": sched.get_last_lr()[0],
                     "params": snapshot(unet), "ema": [p.clone() for p in ema.shadow_params],
                     "ema_step": ema.optimization_step})
    if ampx:  # the held EMA is still an EMAModel, and its checkpoint a stock one
        assert isinstance(ema, EMAModel) and set(ema.state_dict()) == set(EMAModel(_unet().parameters()).state_dict())
        EMAModel(_unet().parameters()).load_state_dict(ema.state_dict())
    return acc.scaler, rows, losses, before


def _differ(a, b):
    return any(not torch.equal(x, y) for x, y in zip(a, b))


def _ema_moved(rows, i):
    return _differ(rows[i]["ema"], rows[i - 1]["ema"])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_skip_hold_lr_and_ema_report_and_stock_parity(precision):
    scaler, rows, losses, before = _run(precision, True)
    assert_ampx_run(rows, scaler, INF_STEP, NAME, before)
    assert [r["ema_step"] for r in rows] == [i + (i < INF_STEP) for i in range(STEPS)]
    assert [_ema_moved(rows, i) for i in range(1, STEPS)] == [i != INF_STEP for i in range(1, STEPS)]
    _, stock, stock_losses, _ = _run(precision, False)
    reset_accelerate()
    diffs = [rel_diff(r["params"], s["params"]) for r, s in zip(rows, stock)]
    print(precision, "per-step parameter differences vs stock:", diffs)
    assert losses[:INF_STEP + 1] == stock_losses[:INF_STEP + 1] and diffs[:INF_STEP] == [0.0] * INF_STEP
    assert [r["lr"] for r in rows[:INF_STEP]] == [s["lr"] for s in stock[:INF_STEP]]
    assert not any(_differ(r["ema"], s["ema"]) for r, s in zip(rows[:INF_STEP], stock))
    assert stock[-1]["ema_step"] == STEPS and _ema_moved(stock, INF_STEP)  # stock's EMA steps on the skip
    if precision == "fp16":  # torch's scaler skips too, and Accelerate holds the LR (AdamW is not fused)
        assert losses == stock_losses and diffs == [0.0] * STEPS
        assert [r["lr"] for r in rows] == [s["lr"] for s in stock]
        assert _differ(rows[INF_STEP]["ema"], stock[INF_STEP]["ema"])
    else:
        assert not all(torch.isfinite(p).all() for p in stock[INF_STEP]["params"].values())


def test_with_accelerators_clip():
    """accelerator.clip_grad_norm_ (ampx's fused clip): the same skip and holds; against stock's
    unscale and torch clip the norms may differ in the last bits (ampx sums in float64, torch in
    float32), so the parameters are held to 1e-6 relative (measured: bit-identical on these four
    steps; a fifth step ends 1.0e-7 apart)."""
    scaler, rows, losses, before = _run("fp16", True, clip=0.1)
    assert_ampx_run(rows, scaler, INF_STEP, NAME, before)
    assert rows[-1]["ema_step"] == STEPS - 1 and not _ema_moved(rows, INF_STEP)
    _, stock, stock_losses, _ = _run("fp16", False, clip=0.1)
    reset_accelerate()
    diffs = [rel_diff(r["params"], s["params"]) for r, s in zip(rows, stock)]
    print("clipped, per-step parameter differences vs stock:", diffs)
    assert losses[0] == stock_losses[0] and max(diffs) < 1e-6
