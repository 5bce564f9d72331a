"""ampx inside Hugging Face Accelerate: ``ampx.integrations.accelerate.patch``.

A tiny MLP trains on the CPU through a patched ``Accelerator``, in fp16 (which stock Accelerate
runs in float32 on the CPU) and in bf16, against the same loop written on ampx directly:
- an inf injected into a named gradient at a chosen step: that step and only that step is
  skipped, ``optimizer.step_was_skipped`` and ``accelerator.optimizer_step_was_skipped`` say so,
  the LR schedule holds there, and the overflow report names the parameter;
- ``accelerator.clip_grad_norm_`` is ampx's fused clip (counted) and the parameters match the
  direct loop (rtol 1e-6) for plain, foreach and fused AdamW; gradient accumulation too;
- ``save_state`` / ``load_state`` mid-run: ampx's settings come back and the run continues the
  uninterrupted trajectory; a folder saved without a scaler loads;
- DDP over 2 gloo processes: both ranks skip the same steps and end with the same parameters;
- ``accelerator.unscale_gradients`` unscales once, through ampx, in bf16 too; the Trainer's
  norm-only call (max_norm=inf) changes nothing; ``ampx.MasterWeights`` under
  ``accelerator.clip_grad_norm_`` gets the unscaled norm and the clip; ``GradScalerKwargs``
  and ampx's settings merge;
- what stays on Accelerate's path: ``mixed_precision="no"``, and DeepSpeed/FSDP (logged).
"""
import json
import logging
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

import ampx  # noqa: E402
from ampx.integrations.accelerate import AmpxAcceleratedOptimizer, is_patched, patch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _accel_helpers import (DTYPES, InfAt, adamw, assert_same_params, assert_skipped_only,  # noqa: E402
                            count_clips, direct_step, fresh_accelerate, reference_scaler,  # noqa: F401
                            reset_accelerate)

STEPS = 8
INF_STEP = 3
NAME = "2.weight"  # the parameter whose gradient gets the inf


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _model_and(kind):
    """A model and an AdamW of ``kind`` over it."""
    model = _model()
    return model, adamw(model.parameters(), kind)


def _batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _loss(out, y):
    return torch.nn.functional.mse_loss(out.float(), y) * 40


def _train_accelerate(precision, kind, *, accum=1, steps=STEPS, inf_steps=(INF_STEP,), clip=0.5,
                      scaler_kwargs=None, stop=None, save_to=None, resume_from=None, grad_buffer=False,
                      optimizer_first=False):
    """The loop written against Accelerate; returns (model, accelerator, per-step records)."""
    acc = patch(Accelerator(cpu=True, mixed_precision=precision, gradient_accumulation_steps=accum),
                grad_buffer=grad_buffer, **(scaler_kwargs or {"init_scale": 2.0**10, "growth_interval": 3}))
    model = _model()
    opt = adamw(model.parameters(), kind)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    if optimizer_first:
        opt, model, sched = acc.prepare(opt, model, sched)
    else:
        model, opt, sched = acc.prepare(model, opt, sched)
    InfAt(dict(model.named_parameters())[NAME], inf_steps, accum)
    views = []
    start = 0
    if resume_from is not None:
        acc.load_state(resume_from)
        start = stop
    records = []
    for step in range(start, steps if save_to is None else stop):
        for micro in range(accum):
            x, y = _batch(step * accum + micro)
            with acc.accumulate(model):
                acc.backward(_loss(model(x), y))
                if acc.sync_gradients and clip is not None:
                    acc.clip_grad_norm_(model.parameters(), clip)
                if grad_buffer and acc.sync_gradients:  # every gradient a view of the buffer as it steps
                    views.append(_all_views(model, opt.ampx_grad_buffer))
                opt.step()
                sched.step()
                opt.zero_grad()
        records.append({"skipped": opt.step_was_skipped, "acc_skipped": acc.optimizer_step_was_skipped,
                        "lr": sched.get_last_lr()[0]})
    if save_to is not None:
        acc.save_state(save_to)
    if grad_buffer:
        records = [dict(r, views=v) for r, v in zip(records, views)]
    return model, acc, records


def _all_views(model, buf):
    flat = [b.untyped_storage().data_ptr() for b in buf.buffers.values()]
    return all(p.grad is not None and p.grad.untyped_storage().data_ptr() in flat for p in model.parameters())


def _train_direct(precision, kind, *, accum=1, steps=STEPS, inf_steps=(INF_STEP,), clip=0.5):
    """The same loop on ampx directly: autocast, ampx.GradScaler, its clip, a held schedule."""
    model = _model()
    opt = adamw(model.parameters(), kind)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = reference_scaler(precision, init_scale=2.0**10, growth_interval=3)
    InfAt(dict(model.named_parameters())[NAME], inf_steps, accum)
    for step in range(steps):
        for micro in range(accum):
            x, y = _batch(step * accum + micro)
            with torch.autocast("cpu", dtype=DTYPES[precision]):
                out = model(x)
            scaler.scale(_loss(out, y) / accum).backward()
        direct_step(scaler, opt, sched, clip)
    return model, scaler


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_skip_clip_and_parity(precision, kind, fresh_accelerate):
    with count_clips() as clips:
        model, acc, records = _train_accelerate(precision, kind)
    assert len(clips) == STEPS  # every accelerator.clip_grad_norm_ was ampx's fused clip
    assert isinstance(acc.scaler, ampx.GradScaler) and is_patched(acc)
    assert_skipped_only(records, INF_STEP, ("skipped", "acc_skipped"))
    stats = acc.scaler.stats()
    assert stats["skipped_steps"] == 1 and stats["last_norm"] is not None
    report = acc.scaler.overflow_report()
    assert report.inf == [NAME] and report.step == INF_STEP + 1
    ref, ref_scaler = _train_direct(precision, kind)
    assert acc.scaler.get_scale() == ref_scaler.get_scale()
    assert_same_params(model, ref)


@pytest.mark.parametrize("optimizer_first", [False, True])
@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_grad_buffer_trains_bit_identically(kind, optimizer_first, fresh_accelerate):
    """patch(grad_buffer=True): the prepared optimizer gets a GradBuffer (whatever order prepare()
    got its arguments in), every gradient is a view of it, and the run (with its skipped step and
    clip) is bit for bit the one without it."""
    model, acc, records = _train_accelerate("fp16", kind, accum=2, grad_buffer=True, optimizer_first=optimizer_first)
    assert [r.pop("views") for r in records] == [True] * STEPS
    opt = acc._optimizers[0]
    buf = opt.ampx_grad_buffer
    assert isinstance(buf, ampx.GradBuffer)
    x, y = _batch(99)
    acc.backward(_loss(model(x), y))  # the last step zeroed them: refill, then look
    buf.check()
    flat = next(iter(buf.buffers.values()))
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert_skipped_only(records, INF_STEP, ("skipped", "acc_skipped"))
    plain_model, plain_acc, plain_records = _train_accelerate("fp16", kind, accum=2)
    assert records == plain_records
    assert acc.scaler.get_scale() == plain_acc.scaler.get_scale()
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.equal(p, q), name


def test_clip_owner_is_found_in_any_order_and_only_for_all_its_parameters(fresh_accelerate):
    from ampx.integrations.accelerate import _owner

    acc = patch(Accelerator(cpu=True, mixed_precision="bf16"))
    model, opt = acc.prepare(*_model_and("fused"))
    params = list(model.parameters())
    acc.backward(_loss(model(_batch(0)[0]), _batch(0)[1]))
    assert _owner(acc, params) is opt  # the usual call: same parameters, same order
    assert _owner(acc, params[::-1]) is opt  # another order: compared as sets
    assert _owner(acc, params + [torch.nn.Parameter(torch.ones(2))]) is opt  # one without a gradient
    assert _owner(acc, params[1:]) is None  # a subset: Accelerate's own clip
    extra = torch.nn.Parameter(torch.ones(2))
    extra.grad = torch.ones(2)
    assert _owner(acc, params + [extra]) is None  # a gradient the optimizer does not step


def test_grad_buffer_is_not_built_without_mixed_precision(fresh_accelerate, caplog):
    with caplog.at_level(logging.WARNING, logger="ampx"):
        acc = patch(Accelerator(cpu=True), grad_buffer=True)
    model, opt = acc.prepare(*_model_and("plain"))
    assert getattr(opt, "ampx_grad_buffer", None) is None
    assert "grad_buffer=True is ignored" in caplog.text


def test_grad_buffer_waits_for_prepare_to_place_the_model(fresh_accelerate):
    """prepare(optimizer, model) prepares the optimizer first: the buffer must not be laid out
    before the model is placed (on a GPU the parameters would move after)."""
    acc = patch(Accelerator(cpu=True, mixed_precision="fp16"), grad_buffer=True)
    model, opt = _model_and("fused")
    seen = []
    real = acc.prepare_model

    def spy(m, *a, **k):
        seen.append(acc._optimizers and getattr(acc._optimizers[0], "ampx_grad_buffer", None))
        return real(m, *a, **k)

    acc.prepare_model = spy
    opt, model = acc.prepare(opt, model)
    assert seen == [None]  # the optimizer was prepared already, its buffer not yet built
    assert isinstance(opt.ampx_grad_buffer, ampx.GradBuffer)


def test_a_re_prepared_optimizer_gets_a_new_buffer(fresh_accelerate):
    """free_memory() and a new optimizer over the same model (a second stage of training): the
    old buffer is closed and the new one covers the parameters."""
    acc = patch(Accelerator(cpu=True, mixed_precision="fp16"), grad_buffer=True)
    model, opt = acc.prepare(*_model_and("fused"))
    first = opt.ampx_grad_buffer
    x, y = _batch(0)
    acc.backward(_loss(model(x), y))
    acc.free_memory()
    opt2 = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    assert first.closed and not opt2.ampx_grad_buffer.closed
    opt2.zero_grad()
    acc.backward(_loss(model(x), y))
    opt2.ampx_grad_buffer.check()
    opt2.step()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gradient_accumulation(precision, fresh_accelerate):
    model, acc, records = _train_accelerate(precision, "fused", accum=2, steps=5, inf_steps=(2,))
    assert_skipped_only(records, 2, ("skipped", "acc_skipped"))
    assert acc.scaler.stats()["steps"] == 5  # one scaler step per optimizer step, not per micro-batch
    ref, _ = _train_direct(precision, "fused", accum=2, steps=5, inf_steps=(2,))
    assert_same_params(model, ref)


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_norm_only_clip_changes_nothing(kind, fresh_accelerate):
    """The Trainer asks for the norm alone with max_norm=inf: that run ends where the unclipped
    direct loop does."""
    model, acc, _ = _train_accelerate("fp16", kind, clip=float("inf"))
    assert acc.scaler.stats()["last_norm"] > 1.0
    ref, _ = _train_direct("fp16", kind, clip=None)
    assert_same_params(model, ref)


def test_master_weights_under_accelerates_clip(fresh_accelerate):
    """fp16 parameters with fp32 masters: accelerator.clip_grad_norm_ returns the unscaled norm and
    clips on the way into the masters, as the direct loop does."""
    def build():
        model = _model()
        return model, ampx.MasterWeights(adamw(model.parameters(), "plain"), model=model, dtype=torch.float16)

    acc = patch(Accelerator(cpu=True, mixed_precision="fp16"), init_scale=2.0**10)
    model, opt = build()
    model, opt = acc.prepare(model, opt)
    ref_model, ref_opt = build()
    scaler = reference_scaler("fp16", init_scale=2.0**10)
    for step in range(4):
        x, y = _batch(step)
        acc.backward(_loss(model(x.half()), y))
        norm = acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref_model(x.half())
        scaler.scale(_loss(out, y)).backward()
        ref_norm = scaler.clip_grad_norm_(ref_opt, 0.5)
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        assert float(norm) == float(ref_norm) and 0.5 < float(norm) < 1e3  # unscaled, and it clips
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert p.dtype == torch.float16 and torch.equal(p, q)


def test_settings_merge_over_grad_scaler_kwargs(fresh_accelerate):
    from accelerate.utils import GradScalerKwargs

    acc = Accelerator(cpu=True, mixed_precision="fp16",
                      kwargs_handlers=[GradScalerKwargs(init_scale=2.0**9, growth_interval=7)])
    patch(acc, hysteresis=2, growth_interval=5)
    sd = acc.scaler.state_dict()
    assert (sd["scale"], sd["growth_interval"], sd["hysteresis"]) == (2.0**9, 5, 2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_unscale_gradients_is_ampxs(precision, fresh_accelerate):
    """accelerator.unscale_gradients unscales once through ampx (stock bf16 does nothing, so an
    inf would go unnoticed); the step after it neither unscales again nor misses the inf."""
    acc = patch(Accelerator(cpu=True, mixed_precision=precision), **({"init_scale": 2.0**10}
                                                                     if precision == "fp16" else {}))
    model, opt = acc.prepare(*_model_and("fused"))
    InfAt(model[2].weight, [1])
    for step in range(2):
        x, y = _batch(step)
        acc.backward(_loss(model(x), y))
        scaled = [p.grad.clone() for p in model.parameters()]
        acc.unscale_gradients()
        with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
            acc.unscale_gradients(opt)
        for g, p in zip(scaled, model.parameters()):
            assert torch.equal(p.grad, g / acc.scaler.get_scale())
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert moved == (step == 0) and acc.optimizer_step_was_skipped == (step == 1)


def test_a_bad_setting_changes_nothing(fresh_accelerate):
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    with pytest.raises(ValueError, match="hysteresis"):
        patch(acc, hysteresis=0)
    assert acc.scaler is None and not acc.native_amp and not is_patched(acc)


def test_fp16_on_the_cpu_runs_fp16_autocast(fresh_accelerate, caplog):
    with caplog.at_level(logging.INFO, logger="ampx"):
        acc = patch(Accelerator(cpu=True, mixed_precision="fp16"))
    assert "float16 autocast" in caplog.text
    model = acc.prepare(_model())
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(torch.randn(2, 8))
    assert seen == [torch.float16] and out.dtype == torch.float32  # Accelerate's fp32 outputs kept
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_save_and_resume_mid_run(precision, tmp_path, fresh_accelerate):
    settings = {"init_scale": 2.0**10, "growth_interval": 2, "hysteresis": 2}
    full, acc_full, rec_full = _train_accelerate(precision, "plain", steps=8, inf_steps=(2, 5),
                                                 scaler_kwargs=settings)
    reset_accelerate()
    _train_accelerate(precision, "plain", steps=8, inf_steps=(2, 5), scaler_kwargs=settings, stop=4,
                      save_to=str(tmp_path))
    reset_accelerate()
    # resumed with ampx's defaults: the checkpoint brings the settings back
    resumed, acc, rec = _train_accelerate(precision, "plain", steps=8, inf_steps=(2 - 4, 5 - 4),
                                          scaler_kwargs={}, stop=4, resume_from=str(tmp_path))
    assert acc.scaler.state_dict()["hysteresis"] == 2
    assert acc.scaler.get_scale() == acc_full.scaler.get_scale()
    assert [r["skipped"] for r in rec] == [r["skipped"] for r in rec_full[4:]]
    for p, q in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(p, q)


def test_a_folder_saved_without_a_scaler_loads(tmp_path, fresh_accelerate):
    acc = Accelerator(cpu=True, mixed_precision="bf16")  # stock: no scaler, so no scaler.pt
    model, opt = acc.prepare(*_model_and("plain"))
    acc.save_state(str(tmp_path))
    reset_accelerate()
    acc = patch(Accelerator(cpu=True, mixed_precision="bf16"), hysteresis=3)
    acc.prepare(*_model_and("plain"))
    acc.load_state(str(tmp_path))
    assert acc.scaler.state_dict()["hysteresis"] == 3


def test_optimizers_prepared_before_the_patch_are_adopted(fresh_accelerate):
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model, opt = acc.prepare(*_model_and("fused"))
    patch(acc)
    assert isinstance(opt, AmpxAcceleratedOptimizer) and opt.scaler is acc.scaler


def test_nothing_to_do_without_mixed_precision(fresh_accelerate, caplog):
    with caplog.at_level(logging.INFO, logger="ampx"):
        acc = patch(Accelerator(cpu=True))
    assert acc.scaler is None and not is_patched(acc) and "needs no loss scaler" in caplog.text


def test_deepspeed_and_fsdp_stay_on_accelerates_path(fresh_accelerate, caplog):
    """A stand-in for a DeepSpeed or FSDP accelerator (neither can start on one CPU process here):
    patch reads the accelerator's distributed type and leaves it alone, saying so."""
    from accelerate.utils import DistributedType

    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        acc = Accelerator(cpu=True, mixed_precision="bf16")
        acc.state.distributed_type = kind
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ampx"):
            patch(acc, hysteresis=2)
        assert acc.scaler is None and not is_patched(acc)
        assert f"runs {kind.name} with its own mixed precision" in caplog.text
        reset_accelerate()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_run(tmp_path, mode):
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    worker = os.path.join(os.path.dirname(__file__), "_accelerate_ddp_worker.py")
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, ACCELERATE_USE_CPU="yes", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, worker, str(tmp_path), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_ddp_two_ranks_skip_the_same_steps(tmp_path):
    seen = _ddp_run(tmp_path / "plain", "plain")
    for s in seen:
        assert s["world"] == 2 and s["kind"] == "MULTI_CPU"
        assert s["skipped"] == [i == 2 for i in range(6)]  # the inf was on rank 1 only
        assert s["report"] == ["2.weight"]
    assert seen[0]["params"] == seen[1]["params"]
    # patch(grad_buffer=True): DDP copies the averaged gradients into the buffer's views; the
    # same run, bit for bit. With DDP's own bucket views the buffer is refused at prepare().
    buffered = _ddp_run(tmp_path / "buffer", "buffer")
    for s, b in zip(seen, buffered):
        assert b["views"] == [True] * 6 and b["skipped"] == s["skipped"] and b["params"] == s["params"]
    for r in _ddp_run(tmp_path / "bucket", "bucket"):
        assert r["refused"] is not None and "gradient_as_bucket_view=True" in r["refused"]
