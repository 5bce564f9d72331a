"""Policy.deepspeed_config against DeepSpeed's own config classes, and a short CPU run.

DeepSpeed installs from PyPI without building its ops; its CPU accelerator (DS_ACCELERATOR=cpu)
trains in bf16 but refuses fp16 ("Type fp16 is not supported on your device"), so the fp16
section is validated by DeepSpeed's config classes only (see docs/DESIGN.md).
"""
import os
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

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
