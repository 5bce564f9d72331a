"""The torch-op registration (issue 25) and the precision monitor (issue 26) on each device.

Every test runs on the CPU here and on CUDA where a GPU is lent (benchmarks/gpu_check.sh runs
this file), so the GPU half checks the same thing the CPU half has already shown can fail:
  * each ampx:: op called on the device's tensors shows in the profiler under its own name, and
    gives the eager call's bits when traced with fullgraph=True (aot_eager and inductor: the
    CUDA registration is what runs there);
  * FakeTensorMode keeps the device of the outputs;
  * the compiled post-backward step (ampx/graph_step.py) replays bit-identical to eager;
  * the monitor finds a forward overflow in a named Linear and reads no host value on clean
    steps.
"""
import math

import pytest
import torch

import ampx
from conftest import CUDA, NO_CUDA_REASON, assert_bits_equal
from test_torch_ops import CASES, OP_OF, _flat, _state

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON))]


def _run(case, device, fn=None):
    s = _state(device)
    out = (fn or CASES[case])(s)
    return _flat(out) + s["xs"] + [s["found_inf"], s["flags"]]


def _same_bits(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), (i, a, b)
        assert_bits_equal(a.cpu(), b.cpu(), f"tensor {i}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_profiler_names_the_op_on_the_device(case, device):
    want = _run(case, device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = _run(case, device)
    names = {e.name for e in prof.events()}
    assert f"ampx::{OP_OF.get(case, case)}" in names, sorted(n for n in names if "ampx" in n)
    _same_bits(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", ["unscale_norm_", "cast_", "update_scale_", "_scaler_check"])
def test_fullgraph_on_the_device_gives_eager_bits(case, backend, device):
    torch._dynamo.reset()
    want = _run(case, device)
    got = _run(case, device, torch.compile(CASES[case], fullgraph=True, backend=backend))
    _same_bits(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["unscale_norm_", "norm", "cast_", "_scaler_unscale_"])
def test_fake_tensor_mode_keeps_the_device(case, device):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    want = _run(case, device)
    with FakeTensorMode():
        out = _flat(CASES[case](_state(device)))
    assert out and all(isinstance(t, FakeTensor) for t in out)
    assert [(t.shape, t.dtype, t.device.type) for t in out] == [
        (t.shape, t.dtype, t.device.type) for t in want[:len(out)]]


def _post_backward_run(device, compiled, steps=5):
    """clip_grad_norm_ + step + update of a fused AdamW, an inf in the input at step 2."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True,
                            capturable=device == "cuda")
    scaler = ampx.GradScaler(device, init_scale=2.0 ** 15, growth_interval=2)

    def post():
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    f = torch.compile(post, fullgraph=True) if compiled else post
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(16, 32, generator=g)
        if i == 2:
            x[0, 0] = math.inf
        scaler.scale(model(x.to(device)).float().pow(2).mean()).backward()
        f()
        opt.zero_grad(set_to_none=False)
    return model, opt, scaler


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_post_backward_step_on_the_device_gives_eager_bits(device):
    me, oe, se = _post_backward_run(device, False)
    mc, oc, sc = _post_backward_run(device, True)
    for a, b in zip(me.parameters(), mc.parameters()):
        assert_bits_equal(a.detach().cpu(), b.detach().cpu(), "parameter")
    for (pa, sa), (pb, sb) in zip(oe.state.items(), oc.state.items()):
        for k in sa:
            assert_bits_equal(sa[k].cpu(), sb[k].cpu(), k)
    assert se.stats() == sc.stats()
    assert sc.stats()["skipped_steps"] == 1


class _Block(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("device", DEVICES)
def test_monitor_finds_a_forward_overflow_on_the_device(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), _Block(), _Block(), torch.nn.Linear(16, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = ampx.GradScaler(device, init_scale=2.0 ** 8)
    scaler.monitor(model, every=2)
    skipped = {}
    for step in range(5):
        up = model[2].up
        if step == 3:
            with torch.no_grad():
                saved = up.weight.clone(), up.bias.clone()
                up.weight.mul_(1000.0)
                up.bias.fill_(65000.0)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)
        with torch.autocast(device, dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        before = scaler.stats()["skipped_steps"]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.stats()["skipped_steps"] > before:
            skipped[step] = scaler.overflow_report()
        if step == 3:
            with torch.no_grad():
                up.weight.copy_(saved[0])
                up.bias.copy_(saved[1])
    assert list(skipped) == [3], skipped
    o = skipped[3].origin
    assert (o["phase"], o["module"], o["tensor"], o["kind"]) == ("forward", "2.up", "output 0", "inf"), o
