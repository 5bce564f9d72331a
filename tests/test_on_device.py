"""The torch-op registration (issue 25) and the precision monitor (issue 26) on each device.

Every test runs on the CPU here and on CUDA where a GPU is lent (benchmarks/gpu_check.sh runs
this file), so the GPU half checks the same thing the CPU half has already shown can fail:
  * each ampx:: op called on the device's tensors shows in the profiler under its own name, and
    gives the eager call's bits when traced with fullgraph=True (aot_eager and inductor: the
    CUDA registration is what runs there);
  * FakeTensorMode keeps the device of the outputs;
  * the compiled post-backward step (ampx/graph_step.py) replays bit-identical to eager;
  * the monitor finds a forward overflow in a named Linear (tests/test_doctor.py's model and
    push, on the device).
The CPU half repeats a few of tests/test_torch_ops.py's CPU cases; it is what shows these
tests run and pass before a GPU ever sees them.
"""
import math

import pytest
import torch

import ampx
from conftest import CUDA, NO_CUDA_REASON, assert_bits_equal
from test_doctor import Net, _push_up, only_report, train
from test_torch_ops import CASES, OP_OF, _flat, _run, _same_bits, _state

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_profiler_names_the_op_on_the_device(case, device):
    want = _run(case, device=device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = _run(case, device=device)
    names = {e.name for e in prof.events()}
    assert f"ampx::{OP_OF.get(case, case)}" in names, sorted(n for n in names if "ampx" in n)
    _same_bits(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", ["unscale_norm_", "cast_", "update_scale_", "_scaler_check"])
def test_fullgraph_on_the_device_gives_eager_bits(case, backend, device):
    torch._dynamo.reset()
    want = _run(case, device=device)
    got = _run(case, torch.compile(CASES[case], fullgraph=True, backend=backend), device)
    _same_bits(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["unscale_norm_", "norm", "cast_", "_scaler_unscale_"])
def test_fake_tensor_mode_keeps_the_device(case, device):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    want = _run(case, device=device)
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


@pytest.mark.parametrize("device", DEVICES)
def test_monitor_finds_a_forward_overflow_on_the_device(device):
    _, _, reports = train(Net().to(device), before_step=_push_up, device=device)
    o = only_report(reports).origin
    assert (o["phase"], o["module"], o["tensor"], o["kind"]) == ("forward", "blocks.1.up", "output 0", "inf"), o
