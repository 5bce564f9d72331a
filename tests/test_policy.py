"""ampx.Policy: choosing a dtype, explaining it, and each backend's native configuration."""
import pytest
import torch

import ampx
from ampx import policy as policy_mod


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretends a CUDA device of a chosen compute capability exists."""
    def make(major, minor=0):
        monkeypatch.setattr(policy_mod, "_cuda_capability", lambda device: (major, minor))
        return torch.device("cuda", 0)
    return make


@pytest.fixture
def cpu_bf16(monkeypatch):
    def make(native):
        monkeypatch.setattr(policy_mod, "_cpu_has_native_bf16", lambda: native)
    return make


@pytest.mark.parametrize("cap,dtype,scaling", [((9, 0), torch.bfloat16, "none"), ((8, 0), torch.bfloat16, "none"),
                                               ((7, 5), torch.float16, "dynamic"), ((6, 1), torch.float16, "dynamic")])
def test_auto_on_cuda_by_capability(fake_cuda, cap, dtype, scaling):
    p = ampx.Policy.auto(fake_cuda(*cap))
    assert p.dtype == dtype and p.loss_scaling == scaling
    text = p.explain()
    assert f"{cap[0]}.{cap[1]}" in text and ("bf16" in text or "fp16" in text)


@pytest.mark.parametrize("native,dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu(cpu_bf16, native, dtype):
    cpu_bf16(native)
    p = ampx.Policy.auto("cpu")
    assert p.dtype == dtype and p.loss_scaling == "none"
    assert ("natively" in p.explain()) == native


def test_auto_on_this_cpu_matches_its_flags():
    flags = open("/proc/cpuinfo").read() if hasattr(torch.cpu, "_is_avx512_bf16_supported") else ""
    expect = torch.bfloat16 if ("avx512_bf16" in flags or "amx_tile" in flags) else torch.float32
    assert ampx.Policy.auto("cpu").dtype == expect


def test_bf16_without_hardware_is_a_clear_error(fake_cuda, cpu_bf16):
    with pytest.raises(ValueError, match="compute capability 7.0"):
        ampx.Policy("bf16", device=fake_cuda(7, 0))
    cpu_bf16(False)
    with pytest.raises(ValueError, match="no native bf16"):
        ampx.Policy("bf16", device="cpu")


@pytest.mark.parametrize("kw,match", [({"dtype": "int8"}, "dtype"), ({"loss_scaling": "sometimes"}, "loss_scaling"),
                                      ({"backend": "horovod"}, "backend"),
                                      ({"dtype": "fp32", "loss_scaling": "dynamic"}, "fp32"),
                                      ({"dtype": torch.int64}, "dtype")])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        ampx.Policy(device="cpu", **kw)


def test_autocast_and_grad_scaler(cpu_bf16):
    cpu_bf16(True)
    p = ampx.Policy("bf16", device="cpu")
    with p.autocast():
        y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == torch.bfloat16
    s = p.grad_scaler()
    assert isinstance(s, ampx.GradScaler) and not s.is_enabled()
    f = ampx.Policy("fp16", device="cpu", init_scale=2.0**10, hysteresis=3, min_scale=1.0)
    s = f.grad_scaler()
    assert s.is_enabled() and s.get_scale() == 2.0**10 and s._hysteresis == 3 and s._min_scale == 1.0
    st = ampx.Policy("fp16", loss_scaling="static", device="cpu", init_scale=128.0).grad_scaler()
    assert st.is_enabled() and not st._dynamic
    with ampx.Policy("fp32", device="cpu").autocast():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32


def test_the_same_loop_trains_under_every_policy(cpu_bf16):
    cpu_bf16(True)
    for dtype in ("bf16", "fp16", "fp32"):
        p = ampx.Policy(dtype, device="cpu")
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = p.grad_scaler()
        x, y = torch.randn(64, 8), torch.randn(64, 1)
        losses = []
        for _ in range(30):
            with p.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < 0.7 * losses[0], dtype


def test_fsdp_configs(cpu_bf16):
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    cpu_bf16(True)
    mp = ampx.Policy("bf16", device="cpu").fsdp_mixed_precision()
    assert isinstance(mp, MixedPrecision)
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    mp2 = ampx.Policy("fp16", device="cpu").fsdp2_policy()
    assert isinstance(mp2, MixedPrecisionPolicy)
    assert (mp2.param_dtype, mp2.reduce_dtype) == (torch.float16, torch.float32)
    assert ampx.Policy("fp32", device="cpu").fsdp_mixed_precision() is None
    assert ampx.Policy("fp32", device="cpu").fsdp2_policy() is None


def test_deepspeed_fp16_mapping():
    p = ampx.Policy("fp16", device="cpu", init_scale=2.0**12, growth_interval=500, hysteresis=2,
                    consecutive_hysteresis=True, min_scale=4.0)
    base = {"train_batch_size": 8, "fp16": {"auto_cast": False}}
    cfg = p.deepspeed_config(base)
    assert cfg["train_batch_size"] == 8
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                           "hysteresis": 2, "consecutive_hysteresis": True, "min_loss_scale": 4,
                           "auto_cast": False}
    assert base == {"train_batch_size": 8, "fp16": {"auto_cast": False}}  # not modified
    static = ampx.Policy("fp16", loss_scaling="static", device="cpu", init_scale=256.0).deepspeed_config()
    assert static["fp16"]["loss_scale"] == 256.0 and static["fp16"]["initial_scale_power"] == 8
    # the dynamic keys are always named, with DeepSpeed's floor of 1 when no min_scale is given
    d = ampx.Policy("fp16", device="cpu").deepspeed_config()["fp16"]
    for k in ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale"):
        assert k in d
    assert d["min_loss_scale"] == 1 and d["initial_scale_power"] == 16 and d["loss_scale_window"] == 2000


def test_deepspeed_bf16_and_fp32(cpu_bf16):
    cpu_bf16(True)
    assert ampx.Policy("bf16", device="cpu").deepspeed_config({"a": 1}) == {"a": 1, "bf16": {"enabled": True}}
    assert ampx.Policy("fp32", device="cpu").deepspeed_config({"a": 1}) == {"a": 1}


@pytest.mark.parametrize("kw,base,match", [
    ({"growth_factor": 4.0}, None, "growth_factor"),
    ({"backoff_factor": 0.25}, None, "backoff_factor"),
    ({"max_scale": 2.0**20}, None, "max_scale"),
    ({"init_scale": 1000.0}, None, "power of two"),
    ({"min_scale": 0.5}, None, "integer"),
    ({"loss_scaling": "none"}, None, "always scales"),
    ({}, {"fp16": {"hysteresis": 5}}, "fp16.hysteresis"),
    ({}, {"bf16": {"enabled": True}}, "cannot enable both"),
])
def test_deepspeed_refuses_what_it_cannot_express(kw, base, match):
    with pytest.raises(ValueError, match=match):
        ampx.Policy("fp16", device="cpu", **kw).deepspeed_config(base)


def test_deepspeed_bf16_conflicts(cpu_bf16):
    cpu_bf16(True)
    with pytest.raises(ValueError, match="cannot enable both"):
        ampx.Policy("bf16", device="cpu").deepspeed_config({"fp16": {"enabled": True}})
    with pytest.raises(ValueError, match="fp32"):
        ampx.Policy("fp32", device="cpu").deepspeed_config({"bf16": {"enabled": True}})
