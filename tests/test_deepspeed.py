"""Policy.deepspeed_config against DeepSpeed's own config classes, and a short CPU run.

DeepSpeed installs from PyPI without building its ops; its CPU accelerator (DS_ACCELERATOR=cpu)
trains in bf16 but refuses fp16 ("Type fp16 is not supported on your device"), so the fp16
section is validated by DeepSpeed's config classes only (see docs/DESIGN.md).
"""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import torch  # noqa: E402

import ampx  # noqa: E402
from ampx import policy as policy_mod  # noqa: E402


@pytest.mark.parametrize("kw", [{}, {"init_scale": 2.0**10, "growth_interval": 100, "hysteresis": 3,
                                     "consecutive_hysteresis": True, "min_scale": 2.0},
                                {"loss_scaling": "static", "init_scale": 64.0}])
def test_fp16_section_is_valid_for_deepspeed(kw):
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config, get_float16_config

    p = ampx.Policy("fp16", device="cpu", **kw)
    cfg = p.deepspeed_config({"train_batch_size": 4})
    DeepSpeedFP16Config(**cfg["fp16"])  # extra="forbid": an unknown key would raise
    parsed = get_float16_config(cfg)
    sk = p.scaler_kwargs
    assert parsed.enabled
    assert parsed.initial_scale_power == int(sk["init_scale"]).bit_length() - 1
    assert parsed.loss_scale_window == sk["growth_interval"]
    assert parsed.hysteresis == sk["hysteresis"]
    assert parsed.consecutive_hysteresis == sk["consecutive_hysteresis"]
    assert parsed.min_loss_scale == (1 if sk["min_scale"] is None else sk["min_scale"])
    assert parsed.loss_scale == (0 if p.loss_scaling == "dynamic" else sk["init_scale"])


def test_bf16_section_is_valid_for_deepspeed(monkeypatch):
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    monkeypatch.setattr(policy_mod, "_cpu_has_native_bf16", lambda: True)
    cfg = ampx.Policy("bf16", device="cpu").deepspeed_config({"train_batch_size": 4})
    assert get_bfloat16_config(cfg).enabled and not get_float16_config(cfg).enabled


def test_short_deepspeed_bf16_training_run_on_cpu(tmp_path):
    script = textwrap.dedent("""
        import os
        os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561",
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        import torch, deepspeed, ampx
        from ampx import policy as pm
        pm._cpu_has_native_bf16 = lambda: True
        p = ampx.Policy("bf16", device="cpu")
        cfg = p.deepspeed_config({"train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        losses = []
        for _ in range(20):
            out = engine(x.to(torch.bfloat16)).float()
            loss = torch.nn.functional.mse_loss(out, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        print("LOSSES", losses[0], losses[-1])
    """)
    f = tmp_path / "ds_run.py"
    f.write_text(script)
    p = subprocess.run([sys.executable, str(f)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    first, last = map(float, p.stdout.split("LOSSES")[1].split())
    assert last < 0.8 * first


# ---- ampx.GradScaler(growth_timing="deepspeed") against DeepSpeed's own DynamicLossScaler ----

def _deepspeed_scaler(monkeypatch, **kw):
    from deepspeed.runtime.fp16 import loss_scaler as ds_ls

    monkeypatch.setattr(ds_ls.dist, "get_rank", lambda *a, **k: 0)  # it logs from rank 0 only
    return ds_ls.DynamicLossScaler(raise_error_at_min_scale=False, **kw)


@pytest.mark.parametrize("seed", range(4))
def test_deepspeed_growth_timing_matches_dynamic_loss_scaler(monkeypatch, seed):
    """Thousands of random overflow sequences: identical scales every step."""
    import random

    rng = random.Random(seed)
    cases = 0
    for _ in range(300 if seed else 1200):
        window = rng.choice([1, 2, 3, 5, 8])
        hyst = rng.choice([1, 1, 2, 3])
        consec = rng.random() < 0.3
        power = rng.randint(1, 20)
        min_scale = rng.choice([1, 2, 16])
        p_overflow = rng.choice([0.0, 0.05, 0.2, 0.5])
        ds = _deepspeed_scaler(monkeypatch, init_scale=2.0**power, scale_window=window, min_scale=min_scale,
                               delayed_shift=hyst, consecutive_hysteresis=consec)
        s = ampx.GradScaler("cpu", init_scale=2.0**power, growth_interval=window, hysteresis=hyst,
                            consecutive_hysteresis=consec, min_scale=float(min_scale), on_min_scale="ignore",
                            growth_timing="deepspeed")
        for step in range(rng.randint(5, 40)):
            overflow = rng.random() < p_overflow
            assert s.get_scale() == ds.cur_scale, (step, window, hyst, consec)
            _one_update(s, overflow)
            ds.update_scale(overflow)
        assert s.get_scale() == ds.cur_scale
        cases += 1
    assert cases >= 300


def _one_update(scaler, overflow):
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([float("inf") if overflow else 1.0, 0.0])
    opt = torch.optim.SGD([p], lr=0.0)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()


def test_torch_timing_grows_one_step_earlier_than_deepspeed(monkeypatch):
    ds = _deepspeed_scaler(monkeypatch, init_scale=256.0, scale_window=2, min_scale=1, delayed_shift=1,
                           consecutive_hysteresis=False)
    torch_like = ampx.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    ds_like = ampx.GradScaler("cpu", init_scale=256.0, growth_interval=2, growth_timing="deepspeed")
    got = {"ds": [], "torch": [], "ampx-ds": []}
    for _ in range(5):
        got["ds"].append(ds.cur_scale)
        got["torch"].append(torch_like.get_scale())
        got["ampx-ds"].append(ds_like.get_scale())
        ds.update_scale(False)
        _one_update(torch_like, False)
        _one_update(ds_like, False)
    # the scale each step ran with (the issue lists the scale after each update: one step on)
    assert got["torch"] == [256, 256, 512, 512, 1024]
    assert got["ds"] == got["ampx-ds"] == [256, 256, 256, 512, 512]


def test_deepspeed_timing_survives_a_checkpoint(monkeypatch):
    a = ampx.GradScaler("cpu", init_scale=64.0, growth_interval=3, growth_timing="deepspeed")
    b = ampx.GradScaler("cpu", init_scale=64.0, growth_interval=3)
    pattern = [False, True, False, False, False, False, True, False, False, False, False]
    for ov in pattern[:4]:
        _one_update(a, ov)
    b.load_state_dict(a.state_dict())
    for ov in pattern[4:]:
        _one_update(a, ov)
        _one_update(b, ov)
        assert a.get_scale() == b.get_scale()


def test_hysteresis_for_zero_stage_0_warns():
    p = ampx.Policy("fp16", device="cpu", hysteresis=2)
    with pytest.warns(UserWarning, match="no effect with ZeRO stage 0"):
        p.deepspeed_config({})
    quiet = ampx.Policy("fp16", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.deepspeed_config({"zero_optimization": {"stage": 2}})
        quiet.deepspeed_config({})  # hysteresis 1: nothing to warn about
    assert p.grad_scaler(growth_timing="deepspeed")._growth_timing == "deepspeed"
