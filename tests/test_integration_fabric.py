"""ampx.GradScaler inside Lightning Fabric (CPU), through Fabric's own MixedPrecision plugin.

Fabric takes any torch.amp.GradScaler: ``MixedPrecision("16-mixed", device, scaler=ampx.GradScaler(...))``.
Fabric hands out ``_FabricOptimizer``, an Optimizer subclass made at run time that delegates to
the optimizer the strategy steps; ampx follows it to that optimizer, so clipping through
``scaler.clip_grad_norm_(fabric_optimizer, ...)`` while Fabric steps the inner optimizer unscales
once and clips what is stepped (before the fix, foreach AdamW was unscaled twice and fused AdamW
stepped unclipped, silently). Covers: foreach and fused AdamW with injected overflows (one
consecutive pair, so hysteresis shows) against the same loop written on ampx directly, bit for
bit; Fabric's own clip (``fabric.clip_gradients``) with a foreach optimizer against torch's
scaler in the same plugin (a parity check: Fabric unwraps before clipping); ``scaler.step`` on
Fabric's optimizer going through Fabric (strategy, callbacks) when the scaler is driven by hand,
and refused while Fabric's plugin drives it. Tested with lightning 2.6.6.
"""
import pytest
import torch

L = pytest.importorskip("lightning")

import ampx  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402
from conftest import quiet_frameworks  # noqa: E402

INF_AT = (2, 3)


@pytest.fixture(autouse=True)
def quiet():
    """Lightning's banners, tips and performance warnings say nothing these tests check."""
    with quiet_frameworks("lightning.fabric", "lightning"):
        yield


def _setup(kind, scaler, fabric):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})
    if fabric:
        f = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        model, opt = f.setup(model, opt)
        return f, model, opt
    return None, model, opt


def _data(steps=7):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(steps)]


def _inject(model, step):
    if step in INF_AT:
        next(model.parameters()).grad.view(-1)[0] = float("inf")


def _run_fabric(kind, scaler, clip):
    """clip: "ampx" (scaler.clip_grad_norm_ on Fabric's optimizer), "fabric" (fabric.clip_gradients)."""
    f, model, opt = _setup(kind, scaler, True)
    assert type(opt).__name__.startswith("Fabric")  # the wrapper ampx must see through
    for step, (x, y) in enumerate(_data()):
        opt.zero_grad()
        f.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        _inject(model, step)
        if clip == "ampx":
            scaler.clip_grad_norm_(opt, 1.0)
        else:
            f.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _run_direct(kind, scaler):
    _, model, opt = _setup(kind, scaler, False)
    for step, (x, y) in enumerate(_data()):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        _inject(model, step)
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()]


def _scaler():
    return ampx.GradScaler("cpu", init_scale=2.0**10, hysteresis=2)


@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_ampx_clip_through_fabrics_optimizer_matches_the_direct_loop(kind):
    sf, sd = _scaler(), _scaler()
    got, want = _run_fabric(kind, sf, "ampx"), _run_direct(kind, sd)
    for p, q in zip(got, want):
        assert torch.equal(p, q)
    assert sf.stats()["skipped_steps"] == sd.stats()["skipped_steps"] == 2
    assert sf.get_scale() == sd.get_scale() == 2.0**9  # hysteresis 2: one backoff for two overflows
    assert sf.overflow_report().inf == sd.overflow_report().inf


def test_fabrics_own_clip_with_ampx_matches_torchs_scaler():
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ampx_scaler = ampx.GradScaler("cpu", init_scale=2.0**10)
    got = _run_fabric("foreach", ampx_scaler, "fabric")
    want = _run_fabric("foreach", torch_scaler, "fabric")
    for p, q in zip(got, want):
        assert torch.equal(p, q)
    assert ampx_scaler.get_scale() == torch_scaler.get_scale() == 2.0**8


def test_scaler_step_on_fabrics_optimizer_goes_through_fabric():
    """Outside Fabric's precision plugin (precision "32-true", the scaler driven by hand),
    scaler.step(fabric_optimizer) steps through Fabric's wrapper, as torch's scaler does: the
    strategy steps and Fabric's callbacks run (not on a skipped step); the parameters are the
    direct loop's."""
    class Counts:
        def __init__(self):
            self.after = 0

        def on_after_optimizer_step(self, strategy, optimizer):
            self.after += 1

    counts = Counts()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    f = Fabric(accelerator="cpu", devices=1, precision="32-true", callbacks=[counts])
    model, opt = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True))
    scaler = _scaler()
    for step, (x, y) in enumerate(_data()):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        f.backward(scaler.scale(torch.nn.functional.mse_loss(out.float(), y)))
        _inject(model, step)
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    assert counts.after == len(_data()) - len(INF_AT)
    want = _run_direct("foreach", _scaler())
    for p, q in zip(model.parameters(), want):
        assert torch.equal(p.detach(), q)


def test_scaler_step_is_refused_when_fabrics_plugin_drives_the_scaler():
    scaler = _scaler()
    f, model, opt = _setup("foreach", scaler, True)
    x, y = _data()[0]
    f.backward(torch.nn.functional.mse_loss(model(x).float(), y))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"call optimizer\.step\(\)"):
        scaler.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.step()  # the way Fabric steps: its plugin calls scaler.step and update
    assert scaler.stats()["steps"] == 1


# ---- DDP over two gloo processes ----------------------------------------------------------------

def test_fabric_ddp_two_ranks_skip_name_and_hold_like_stock(tmp_path):
    """tests/_fabric_ddp_worker.py: an inf in rank 0's gradient of "0.weight" at step 3, before
    DDP's all-reduce. Both ranks skip that step alone and name the parameter (``scaler.watch`` of
    Fabric's module); the loop holds the LR on it; up to the skip the run is bit-identical to the
    same loop on torch's scaler, which cannot tell the loop it skipped and so steps the LR."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    for mode in ("ampx", "stock"):
        proc = subprocess.run([sys.executable, os.path.join(here, "_fabric_ddp_worker.py"), str(tmp_path), mode],
                              env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"ampx-rank{r}.json").read_text()) for r in range(2)]
    stock = [json.loads((tmp_path / f"stock-rank{r}.json").read_text()) for r in range(2)]
    skips = [s == 3 for s in range(7)]
    for r in range(2):
        a, s = got[r], stock[r]
        assert a["world_size"] == 2 and a["skipped"] == s["skipped"] == skips
        assert a["changed"] == [not k for k in skips]  # the skipped step changed no parameter
        assert a["reports"][:3] == [None] * 3 and a["reports"][3] == [["0.weight"], []]
        assert a["stats"] == {"steps": 7, "skipped_steps": 1}
        assert a["lrs"][3] == a["lrs"][2] and len(set(a["lrs"])) == 6  # held on the skip alone
        assert s["lrs"][3] < s["lrs"][2]  # stock steps it anyway
        assert a["params"][:4] == s["params"][:4]  # bit for bit up to and including the skip
    assert got[0]["params"] == got[1]["params"]
