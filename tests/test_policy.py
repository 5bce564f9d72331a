"""ampx.Policy: choosing a dtype, explaining it, and each backend's native configuration."""
import warnings

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


def test_auto_on_this_cpu_matches_its_flags(monkeypatch):
    monkeypatch.delenv("AMPX_CPU_BF16", raising=False)  # CI forces the probe; this test reads the real CPU
    flags = open("/proc/cpuinfo").read() if hasattr(torch.cpu, "_is_avx512_bf16_supported") else ""
    expect = torch.bfloat16 if ("avx512_bf16" in flags or "amx_tile" in flags) else torch.float32
    assert ampx.Policy.auto("cpu").dtype == expect


@pytest.mark.parametrize("value,native", [("0", False), ("1", True)])
def test_the_cpu_probe_can_be_forced(monkeypatch, value, native):
    monkeypatch.setenv("AMPX_CPU_BF16", value)
    assert policy_mod._cpu_has_native_bf16() is native
    assert ampx.Policy.auto("cpu").dtype == (torch.bfloat16 if native else torch.float32)


def test_a_bad_probe_override_is_named(monkeypatch):
    monkeypatch.setenv("AMPX_CPU_BF16", "yes")
    with pytest.raises(ValueError, match="AMPX_CPU_BF16='yes'"):
        ampx.Policy.auto("cpu")


def test_bf16_on_slow_hardware_is_honoured_with_a_warning(fake_cuda, cpu_bf16):
    with pytest.warns(ampx.PerformanceWarning, match="compute capability 7.0"):
        p = ampx.Policy("bf16", device=fake_cuda(7, 0))
    assert p.dtype == torch.bfloat16 and "7.0" in p.explain()
    cpu_bf16(False)
    with pytest.warns(ampx.PerformanceWarning, match="no native bf16"):
        p = ampx.Policy("bf16", device="cpu")
    assert p.dtype == torch.bfloat16 and p.loss_scaling == "none"
    assert "no native bf16" in p.explain() and "slower" in p.explain()
    with p.autocast():  # torch runs it: the policy only had to stop refusing
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16


def test_native_bf16_gives_no_warning(cpu_bf16, recwarn):
    cpu_bf16(True)
    p = ampx.Policy("bf16", device="cpu")
    assert p.explain().endswith("as asked.")
    assert not [w for w in recwarn if issubclass(w.category, ampx.PerformanceWarning)]


def test_fp16_on_a_cpu_without_native_fp16_warns(monkeypatch):
    monkeypatch.setattr(policy_mod, "_cpu_has_native_fp16", lambda: False)
    with pytest.warns(ampx.PerformanceWarning, match="no native fp16"):
        assert ampx.Policy("fp16", device="cpu").dtype == torch.float16
    monkeypatch.setattr(policy_mod, "_cpu_has_native_fp16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ampx.PerformanceWarning)
        ampx.Policy("fp16", device="cpu")


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without CUDA, whatever this one has (a login node generating configs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_policy_for_a_device_this_machine_lacks_builds_every_config(no_cuda, dtype, recwarn):
    p = ampx.Policy(dtype, device="cuda")
    assert str(p.device) == "cuda" and "not checked" in p.explain()
    assert not [w for w in recwarn if issubclass(w.category, ampx.PerformanceWarning)]
    section = "bf16" if dtype == "bf16" else "fp16"
    assert p.deepspeed_config({"train_batch_size": 8})[section]["enabled"] is True
    assert p.fsdp_mixed_precision().param_dtype == p.dtype
    assert p.fsdp2_policy().param_dtype == p.dtype
    assert repr(p).startswith("Policy(dtype=")
    assert ampx.Policy(dtype, device="cuda:3").deepspeed_config()[section]["enabled"] is True


def test_auto_for_a_device_this_machine_lacks_assumes_bf16_and_says_so(no_cuda):
    with pytest.warns(UserWarning, match="not checked"):
        p = ampx.Policy.auto("cuda")
    assert p.dtype == torch.bfloat16 and "not checked" in p.explain()


def test_the_capability_probe_survives_a_torch_without_cuda(monkeypatch):
    def broken(*a, **k):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", broken)
    assert policy_mod._cuda_capability(torch.device("cuda", 0)) is None


def test_repr_works_on_any_instance():
    half = ampx.Policy.__new__(ampx.Policy)
    assert repr(half).startswith("Policy(")
    half.dtype = torch.float16
    assert "fp16" in repr(half)
    with pytest.raises(ValueError, match="loss_scaling"):
        ampx.Policy("fp16", loss_scaling="bogus", device="cpu")


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


@pytest.mark.parametrize("stage,own,other", [(0, "ignore", "warn"), (1, "raise", "warn"), (2, "raise", "ignore"),
                                            (3, "raise", "warn"), (0, "ignore", "raise")])
def test_deepspeed_config_refuses_an_on_min_scale_the_stage_does_not_follow(stage, own, other):
    base = {"zero_optimization": {"stage": stage}}
    # unset: DeepSpeed's own behaviour, no key; the same choice as DeepSpeed's: accepted
    for kw in ({}, {"on_min_scale": own}):
        assert ampx.Policy("fp16", device="cpu", **kw).deepspeed_config(base)["fp16"]["enabled"]
    with pytest.raises(ValueError, match=f"on_min_scale='{other}'.*stage {stage}.*on_min_scale='{own}'.*ampx.prepare"):
        ampx.Policy("fp16", device="cpu", on_min_scale=other).deepspeed_config(base)
    # ampx.prepare's route leaves it to its DeepSpeedScaler, which carries it
    p = ampx.Policy("fp16", device="cpu", on_min_scale=other)
    assert p._deepspeed_config(base, scaler_carries_floor=True)["fp16"]["enabled"]
    # static scaling never reaches a floor: nothing to refuse
    assert ampx.Policy("fp16", device="cpu", loss_scaling="static", on_min_scale=other).deepspeed_config(base)


def test_deepspeed_config_refuses_torch_growth_timing_when_asked_for():
    with pytest.raises(ValueError, match="growth_timing='torch'.*one step later"):
        ampx.Policy("fp16", device="cpu", growth_timing="torch").deepspeed_config()
    for kw in ({}, {"growth_timing": "deepspeed"}):
        assert ampx.Policy("fp16", device="cpu", **kw).deepspeed_config()["fp16"]["enabled"]
    # unset still means torch's timing for ampx's own scaler
    assert ampx.Policy("fp16", device="cpu").grad_scaler()._growth_timing == "torch"
    assert ampx.Policy("fp16", device="cpu").scaler_kwargs["on_min_scale"] == "warn"


def test_deepspeed_bf16_conflicts(cpu_bf16):
    cpu_bf16(True)
    with pytest.raises(ValueError, match="cannot enable both"):
        ampx.Policy("bf16", device="cpu").deepspeed_config({"fp16": {"enabled": True}})
    with pytest.raises(ValueError, match="fp32"):
        ampx.Policy("fp32", device="cpu").deepspeed_config({"bf16": {"enabled": True}})


def test_the_cpu_probe_survives_a_torch_without_its_private_probes(monkeypatch):
    """torch.cpu._is_avx512_bf16_supported and _is_amx_tile_supported are private: without them
    the probe says no native bf16 (on x86) instead of failing."""
    monkeypatch.delenv("AMPX_CPU_BF16", raising=False)
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    monkeypatch.setattr(policy_mod.platform, "machine", lambda: "x86_64")
    assert policy_mod._cpu_has_native_bf16() is False
    assert ampx.Policy.auto("cpu").dtype == torch.float32
