"""ampx inside timm's train loop: ``ampx.integrations.timm.NativeScaler`` and ``hold_on_skip``.

A 2-block ViT from ``timm.create_model`` (nothing downloaded) trains in fp16 autocast on the CPU
through a loop written as timm's ``train_one_epoch`` (timm's AdamW, its cosine schedule stepped
per update with warm-up, ``ModelEmaV3`` with warm-up), for each ``clip_mode`` (norm, value, agc):
- an inf injected into one named gradient at a chosen update: that update and only it is
  skipped (the call returns True), the parameters do not move on it, the LR and the EMA hold
  there and then go on one update behind, the overflow report names the parameter;
- against timm's stock ``NativeScaler`` (torch's GradScaler) in the same loop, step by step: the
  parameters are equal (norm: ampx's fused clip, to 1e-6 relative; value and agc: bit for bit),
  and on the skipped update both leave the parameters alone while stock moves the LR and EMA;
- a norm over other parameters than the optimizer's (timm's ``exclude_head``) unscales through
  ampx and clips with torch, equal to stock; gradient accumulation (``need_update=False``);
- bf16 (``dtype=torch.bfloat16``): a static scale of 1 that still skips and names;
- ``state_dict`` round trip (the skipped count with it) and loading a stock timm checkpoint;
- the errors: a bad clip_mode or dtype, ``hold_on_skip`` given timm's own scaler.
"""
import io
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _accel_helpers import InfAt  # noqa: E402
from _frameworks import import_timm  # noqa: E402


timm = import_timm()
from timm.optim import create_optimizer_v2  # noqa: E402
from timm.scheduler import create_scheduler_v2  # noqa: E402
from timm.utils import ModelEmaV3  # noqa: E402
from timm.utils import NativeScaler as StockScaler  # noqa: E402

from ampx.integrations.timm import NativeScaler, hold_on_skip  # noqa: E402

STEPS = 5
INF_STEP = 2  # 0-based update index
NAME = "blocks.1.mlp.fc1.weight"
CLIP = {"norm": 0.5, "value": 0.01, "agc": 0.05}
SCALER = {"init_scale": 2.0**10, "growth_interval": 2}


def _model():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, img_size=32,
                             patch_size=8, embed_dim=32, depth=2, num_heads=2)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


def _setup(make_scaler, dtype, steps, hold):
    model = _model()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-2, weight_decay=0.05)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=2, warmup_epochs=1, warmup_lr=1e-4,
                                       step_on_epochs=False, updates_per_epoch=steps)
    ema = ModelEmaV3(model, decay=0.9, use_warmup=True)
    scaler = make_scaler(model, dtype)
    if hold and isinstance(scaler, NativeScaler):
        hold_on_skip(scaler, scheduler, ema)
    return model, optimizer, scheduler, ema, scaler


def _resumed(run, make_scaler, dtype, steps, hold):
    """A fresh set-up loaded from `run`'s state dicts, as timm's resume_checkpoint does."""
    new = _setup(make_scaler, dtype, steps, hold)
    for old, fresh in zip(run, new):
        fresh.load_state_dict(old.state_dict())
    return new


def _train(make_scaler, clip_mode="norm", inf_at=None, steps=STEPS, accum=1, dtype=torch.float16,
           exclude_head=False, hold=True, resume_after=None):
    """timm's train_one_epoch in miniature (with a resume from a checkpoint after update
    `resume_after`); returns per-update records."""
    run = _setup(make_scaler, dtype, steps, hold)
    model, optimizer, scheduler, ema, scaler = run
    inf = None if inf_at is None else InfAt(dict(model.named_parameters())[NAME], [inf_at], accum)
    records, num_updates = [], 0
    for i, (x, y) in enumerate(_batches(steps * accum)):
        params = [p for n, p in model.named_parameters() if not (exclude_head and n.startswith("head"))]
        need_update = (i + 1) % accum == 0
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(x), y) / accum
        skipped = scaler(loss, optimizer, clip_grad=CLIP[clip_mode], clip_mode=clip_mode, parameters=params,
                         need_update=need_update)
        if not need_update:
            continue
        num_updates += 1
        optimizer.zero_grad()
        ema.update(model, step=num_updates)
        scheduler.step_update(num_updates=num_updates)
        records.append({"skipped": skipped, "lr": optimizer.param_groups[0]["lr"],
                        "params": [p.detach().clone() for p in model.parameters()],
                        "ema": [p.detach().clone() for p in ema.module.parameters()]})
        if num_updates == resume_after:
            run = _resumed(run, make_scaler, dtype, steps, hold)
            model, optimizer, scheduler, ema, scaler = run
    if inf is not None:
        inf.handle.remove()
    return records, scaler


def _ampx(model, dtype):
    settings = SCALER if dtype == torch.float16 else {}  # bf16: the default static scale of 1
    return NativeScaler("cpu", dtype, named_parameters=model.named_parameters(), **settings)


def _stock(model, dtype):
    s = StockScaler("cpu")
    s._scaler = torch.amp.GradScaler("cpu", **SCALER)
    return s


def _same(a, b, rtol=0.0):
    for x, y in zip(a, b):
        if rtol:
            torch.testing.assert_close(x, y, rtol=rtol, atol=1e-7)
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("clip_mode", ["norm", "value", "agc"])
def test_the_injected_update_alone_is_skipped_and_the_schedule_and_ema_hold(clip_mode):
    runs, scaler = _train(_ampx, clip_mode, inf_at=INF_STEP)
    clean, _ = _train(_ampx, clip_mode)
    assert [r["skipped"] for r in runs] == [i == INF_STEP for i in range(STEPS)]
    held, before = runs[INF_STEP], runs[INF_STEP - 1]
    _same(held["params"], before["params"])
    _same(held["ema"], before["ema"])
    assert held["lr"] == before["lr"]
    # afterwards the schedule runs one update behind the clean run's
    assert [r["lr"] for r in runs[INF_STEP + 1:]] == [r["lr"] for r in clean[INF_STEP:-1]]
    report = scaler.overflow_report()
    assert report.inf == [NAME] and report.nan == []
    assert scaler.skipped_updates == 1 and scaler.stats()["skipped_steps"] == 1


@pytest.mark.parametrize("clip_mode", ["norm", "value", "agc"])
def test_equal_to_timms_stock_scaler_step_by_step(clip_mode):
    ours, _ = _train(_ampx, clip_mode, inf_at=INF_STEP)
    stock, _ = _train(_stock, clip_mode, inf_at=INF_STEP)
    rtol = 1e-6 if clip_mode == "norm" else 0.0  # ampx's norm is accumulated in float64
    for i in range(INF_STEP):
        _same(ours[i]["params"], stock[i]["params"], rtol)
        _same(ours[i]["ema"], stock[i]["ema"], rtol)
        assert ours[i]["lr"] == stock[i]["lr"]
    # on the overflow both leave the parameters alone; stock moves the LR and the EMA anyway
    _same(ours[INF_STEP]["params"], stock[INF_STEP]["params"], rtol)
    _same(stock[INF_STEP]["params"], stock[INF_STEP - 1]["params"])
    assert stock[INF_STEP]["lr"] != stock[INF_STEP - 1]["lr"]
    assert any(not torch.equal(a, b) for a, b in zip(stock[INF_STEP]["ema"], stock[INF_STEP - 1]["ema"]))


def test_a_norm_over_other_parameters_unscales_then_clips_with_torch():
    ours, scaler = _train(_ampx, "norm", exclude_head=True, steps=3)
    stock, _ = _train(_stock, "norm", exclude_head=True, steps=3)
    for a, b in zip(ours, stock):
        _same(a["params"], b["params"])
    assert scaler.last_norm is not None


def test_gradient_accumulation_steps_only_on_updates():
    ours, scaler = _train(_ampx, "norm", inf_at=1, steps=3, accum=2)
    stock, _ = _train(_stock, "norm", inf_at=1, steps=3, accum=2)
    assert [r["skipped"] for r in ours] == [False, True, False]
    assert scaler.stats()["steps"] == 3
    _same(ours[0]["params"], stock[0]["params"], 1e-6)
    _same(ours[1]["params"], ours[0]["params"])


def test_bf16_checks_and_skips_at_a_static_scale_of_one():
    runs, scaler = _train(_ampx, "norm", inf_at=INF_STEP, dtype=torch.bfloat16, steps=3)
    assert [r["skipped"] for r in runs] == [False, False, True]
    assert scaler.scaler.get_scale() == 1.0 and scaler.overflow_report().inf == [NAME]
    _same(runs[2]["params"], runs[1]["params"])


def test_state_dict_round_trip_and_a_stock_checkpoint():
    _, scaler = _train(_ampx, "norm", inf_at=1, steps=3)
    sd = scaler.state_dict()
    fresh = NativeScaler("cpu")
    fresh.load_state_dict(sd)
    assert fresh.skipped_updates == 1 and fresh.scaler.get_scale() == scaler.scaler.get_scale()
    loaded, saved = fresh.scaler.state_dict(), scaler.scaler.state_dict()
    # (the clip-route hints wait for the resumed run's first clip before they are saved again)
    assert {k: v for k, v in loaded.items() if k != "_clip_active"} == {
        k: v for k, v in saved.items() if k != "_clip_active"}
    stock = torch.amp.GradScaler("cpu", init_scale=64.0)
    fresh.load_state_dict(stock.state_dict())
    assert fresh.skipped_updates == 0 and fresh.scaler.get_scale() == 64.0
    assert NativeScaler.state_dict_key == StockScaler.state_dict_key


def test_a_resumed_run_holds_the_same_offsets_as_the_uninterrupted_one():
    whole, _ = _train(_ampx, "norm", inf_at=1, steps=4)
    resumed, scaler = _train(_ampx, "norm", inf_at=1, steps=4, resume_after=2)
    assert scaler.skipped_updates == 1
    for a, b in zip(whole, resumed):
        assert a["skipped"] == b["skipped"] and a["lr"] == b["lr"]
        _same(a["params"], b["params"])
        _same(a["ema"], b["ema"])


def test_errors():
    with pytest.raises(ValueError, match="clip_mode must be one of"):
        NativeScaler("cpu")(torch.zeros((), requires_grad=True), None, clip_grad=1.0, clip_mode="max")
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        NativeScaler("cpu", torch.float32)
    with pytest.raises(TypeError, match="loss_scaler must be ampx.integrations.timm.NativeScaler"):
        hold_on_skip(StockScaler("cpu"))
    with pytest.raises(TypeError, match="has no step_update"):
        hold_on_skip(NativeScaler("cpu"), lr_scheduler=object())


def test_holding_leaves_the_state_dicts_alone_and_twice_subclasses_once():
    model, optimizer, scheduler, ema, scaler = _setup(_ampx, torch.float16, STEPS, hold=False)
    before = set(scheduler.state_dict())
    hold_on_skip(scaler, scheduler, ema)
    held = type(scheduler)
    hold_on_skip(NativeScaler("cpu"), scheduler, ema)
    assert type(scheduler) is held and held.__mro__[1].__name__ == held.__name__
    assert isinstance(ema, ModelEmaV3) and type(ema).__mro__[1] is ModelEmaV3
    assert set(scheduler.state_dict()) == before  # nothing of ampx's goes into a checkpoint
    torch.save(scheduler.state_dict(), io.BytesIO())


def test_a_norm_over_the_optimizers_parameters_is_one_fused_pass(monkeypatch):
    calls = []
    torch_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: calls.append(1) or torch_clip(*a, **k))
    _, scaler = _train(_ampx, "norm", steps=2)
    assert calls == [] and scaler.stats()["last_norm"] > 0
    _train(_ampx, "norm", steps=2, exclude_head=True)
    assert calls == [1, 1]
