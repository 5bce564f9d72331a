"""CUDA graphs and several GPUs: what the scaler, MasterWeights and the telemetry promise there.

Everywhere (no GPU needed):
  * an update's overflow report waits for the copies of every gradient device's stream, not
    only the scale device's: emulated devices whose streams finish lazily and out of order
    (the scale device at once, the other only when an event of its own is waited on);
  * inside a capture (``ampx.cuda._capturing`` stubbed to say so) ``update()`` does no host
    work (no event, no pinned copy, no telemetry), and what cannot be captured raises a
    RuntimeError with the fix before changing anything: ``step()`` of a non-fused optimizer,
    ``on_min_scale="raise"``;
  * ``ops.cast_(rng=...)``: seed and offset from a tensor give the bits of the same integers;
    MasterWeights with its key in a tensor (as on CUDA, forced here) gives the host key's bits,
    continues from the tensor's count after (simulated) replays, and checkpoints that count.
On a CUDA machine (skipped elsewhere): the whole step (clip_grad_norm_, fused AdamW with
capturable=True, update) captured and replayed gives the eager step's bits; MasterWeights'
stochastic rounding draws new bits at every replay, the eager run's; with gradients on two
GPUs the overflow report names the parameter on the second one.
Cost on the CPU: about 3 s.
"""
import math

import pytest
import torch

import ampx
from ampx import ops, telemetry
from conftest import CUDA, NO_CUDA_REASON

gpu = pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON)
two_gpus = pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")


# ---- overflow reports wait for every device's stream ------------------------------------------


class _LazyDevices:
    """Emulated devices with one stream each. A copy queued on a stream lands only when the
    stream runs up to it: device "d0" runs at once, the others only when an event recorded on
    them is synchronized (so they finish late, and out of order with d0)."""

    def __init__(self, device_of):
        self.device_of = device_of  # id(tensor) -> emulated device name
        self.queues = {}

    def host_copy(self, t):
        out = torch.zeros_like(t)  # stands for pinned memory not yet written
        dev = self.device_of.get(id(t), "d0")
        self.queues.setdefault(dev, []).append(lambda: out.copy_(t))
        if dev == "d0":
            self.run(dev, len(self.queues[dev]))
        return out

    def run(self, dev, upto):
        q = self.queues.setdefault(dev, [])
        for fn in q[:upto]:
            fn()
        del q[:upto]

    def event(self, dev):
        devices, mark = self, len(self.queues.get(dev, []))

        class Event:
            def query(self):
                return dev == "d0" or mark == 0

            def synchronize(self):
                devices.run(dev, mark)

        return Event()


def test_overflow_report_waits_for_every_gradient_devices_stream(monkeypatch):
    p0, p1 = [torch.zeros(3), torch.zeros(2)], [torch.zeros(4), torch.zeros(5)]
    flags0 = torch.tensor([0, 0], dtype=torch.uint8)
    flags1 = torch.tensor([0, ops.FLAG_NAN], dtype=torch.uint8)  # on "d1": the second param is bad
    lazy = _LazyDevices({id(flags1): "d1"})
    monkeypatch.setattr(telemetry, "_host_copy", lazy.host_copy)
    monkeypatch.setattr(telemetry, "_record_event", lazy.event)
    monkeypatch.setattr(telemetry, "_device_of", lambda t: lazy.device_of.get(id(t), "d0"))
    scale, found = torch.tensor([1024.0]), torch.tensor([1.0])
    pending = telemetry._Pending(7, scale, found, 0, [[(p0, flags0)], [(p1, flags1)]])
    assert not pending.ready()  # d1 has not run its copy yet
    step, s, skipped, events, sources, trace = pending.values()
    assert trace is None  # no monitor
    assert (step, s, skipped) == (7, 1024.0, True)
    report = ampx.GradScaler("cpu")._make_report(step, sources)
    assert report.nan == ["param[1] (5,)"] and report.inf == [], report


def test_the_devices_of_a_pending_update_are_the_scales_then_each_flag_tensors():
    scale = torch.ones(1)
    a, b = torch.zeros(2, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    assert telemetry._stream_devices(scale, [[([], a)], [([], b)]]) == [torch.device("cpu")]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        c = torch.zeros(1, dtype=torch.uint8, device="cuda:1")
        assert telemetry._stream_devices(scale, [[([], a)], [([], c)]]) == [torch.device("cpu"),
                                                                             torch.device("cuda:1")]


# ---- nothing on the host inside a capture --------------------------------------------------------


def _model_and_grads(seed=0, bad=False):
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 3)
    loss = m(torch.randn(5, 4)).square().sum()
    return m, loss


@pytest.fixture
def capturing(monkeypatch):
    """Makes the scaler believe a CUDA graph is being captured (off from the start)."""
    state = {"on": False}
    monkeypatch.setattr(ampx.scaler, "_capturing", lambda device: state["on"])
    return state


def test_a_non_fused_step_refuses_capture_and_changes_nothing(capturing):
    m, loss = _model_and_grads()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = ampx.GradScaler("cpu", init_scale=8.0)
    scaler.scale(loss).backward()
    grads = [p.grad.clone() for p in m.parameters()]
    weights = [p.detach().clone() for p in m.parameters()]
    capturing["on"] = True
    with pytest.raises(RuntimeError, match=r"not fused.*capturable=True"):
        scaler.step(opt)
    for p, g, w in zip(m.parameters(), grads, weights):
        assert torch.equal(p.grad, g) and torch.equal(p.detach(), w)  # not even unscaled
    capturing["on"] = False
    scaler.step(opt)  # the same step, outside the capture, goes on as usual
    scaler.update()


def test_update_inside_a_capture_does_no_host_work(capturing, monkeypatch):
    m, loss = _model_and_grads()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
    scaler = ampx.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    scaler._force_lazy_telemetry = True  # the CPU run takes the device-scale route
    scaler.scale(loss).backward()
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    capturing["on"] = True

    def no_host_work(*a, **k):
        raise AssertionError("host work (event, pinned copy, telemetry) inside a capture")

    monkeypatch.setattr(telemetry, "_Pending", no_host_work)
    monkeypatch.setattr(torch.cuda, "Event", no_host_work)
    scaler.update()
    assert scaler.get_scale() == 16.0  # the update itself ran (on the scale's device)
    capturing["on"] = False
    monkeypatch.undo()
    assert scaler.stats()["history"] == []  # a captured step leaves no telemetry


def test_on_min_scale_raise_refuses_capture(capturing):
    m, loss = _model_and_grads()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
    scaler = ampx.GradScaler("cpu", on_min_scale="raise")
    scaler.scale(loss).backward()
    scaler.step(opt)
    capturing["on"] = True
    scale = scaler.get_scale()
    with pytest.raises(RuntimeError, match="on_min_scale='raise'.*capture"):
        scaler.update()
    assert scaler.get_scale() == scale


# ---- stochastic rounding's key from a tensor ----------------------------------------------------


@pytest.mark.parametrize("seed,offset", [(0, 0), (5, 17), (2**64 - 1, 2**63 + 5)])
def test_cast_rng_tensor_gives_the_bits_of_its_integers(seed, offset):
    torch.manual_seed(0)
    src = [torch.randn(1000) * 3, torch.randn(70_000)]
    a = [torch.empty(t.shape, dtype=torch.bfloat16) for t in src]
    b = [torch.empty(t.shape, dtype=torch.bfloat16) for t in src]
    ops.cast_(src, a, rounding="stochastic", seed=seed, offset=offset)
    rng = torch.tensor([v - 2**64 if v >= 2**63 else v for v in (seed, offset)], dtype=torch.int64)
    ops.cast_(src, b, rounding="stochastic", seed=99, offset=99, rng=rng)  # rng wins
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    c = [torch.empty(t.shape, dtype=torch.bfloat16) for t in src]
    ops.cast_(src, c, rounding="stochastic", seed=seed, offset=(offset + 1) % 2**64)
    assert not torch.equal(c[1].view(torch.int16), a[1].view(torch.int16))  # the offset matters


def test_cast_rng_must_be_two_int64():
    src, dst = [torch.ones(3)], [torch.empty(3, dtype=torch.bfloat16)]
    for bad in (torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), [1, 2]):
        with pytest.raises(ValueError, match="rng must be a contiguous int64 tensor of 2 elements"):
            ops.cast_(src, dst, rounding="stochastic", rng=bad)


# ================================================================= on a GPU ==


def _cuda_setup(seed, count=6, width=64):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(width, width) for _ in range(count)]
    model = torch.nn.Sequential(*[x for layer in layers for x in (layer, torch.nn.Tanh())]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    scaler = ampx.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    return model, opt, scaler


def _train_step(model, opt, scaler, x):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.clip_grad_norm_(opt, 0.5)
    scaler.step(opt)
    scaler.update()


def _inputs(n, width=64):
    g = torch.Generator(device="cuda").manual_seed(3)
    xs = [torch.randn(32, width, device="cuda", generator=g) for _ in range(n)]
    xs[4] = xs[4] * math.inf  # one overflowing step: skipped in both runs, the scale halves
    return xs


def captured_vs_eager(steps=9, width=64):
    """The scaler step (clip, fused AdamW with capturable=True, update) run eagerly `steps`
    times, and the same run with steps 2.. replayed from one captured step (two eager warm-up
    steps on a side stream first: kernels loaded, optimizer state made). Returns the eager and
    the graph run's (model, scaler). Shared with benchmarks/gpu_check.py."""
    xs = _inputs(steps, width)
    me, oe, se = _cuda_setup(0, width=width)
    for x in xs:
        oe.zero_grad(set_to_none=False)
        _train_step(me, oe, se, x)
    mg, og, sg = _cuda_setup(0, width=width)
    static_x = xs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs[:2]:
            og.zero_grad(set_to_none=False)
            _train_step(mg, og, sg, x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    og.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        _train_step(mg, og, sg, static_x)
    for x in xs[2:]:
        static_x.copy_(x)
        og.zero_grad(set_to_none=False)
        graph.replay()
    torch.cuda.synchronize()
    return (me, se), (mg, sg)


@gpu
def test_cuda_whole_scaler_step_replays_with_the_eager_bits():
    (me, se), (mg, sg) = captured_vs_eager()
    for a, b in zip(mg.parameters(), me.parameters()):
        assert torch.equal(a, b)
    assert sg.get_scale() == se.get_scale()
    assert torch.equal(sg._growth_tracker, se._growth_tracker)


@gpu
def test_cuda_stochastic_rounding_draws_new_bits_at_every_replay():
    def setup():
        torch.manual_seed(1)
        model = torch.nn.Linear(256, 256).cuda().to(torch.bfloat16)
        opt = ampx.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True),
                                 model=model, rounding="stochastic", seed=7)
        return model, opt

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def step(model, opt):
        model(x).float().square().mean().backward()
        opt.step()

    me, oe = setup()
    eager = []
    for _ in range(5):
        oe.zero_grad(set_to_none=False)
        step(me, oe)
        eager.append(me.weight.detach().clone())
    mg, og = setup()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        og.zero_grad(set_to_none=False)
        step(mg, og)  # eager warm-up: offset 0
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    og.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        step(mg, og)
    got = [mg.weight.detach().clone()]
    for _ in range(4):
        og.zero_grad(set_to_none=False)
        graph.replay()
        got.append(mg.weight.detach().clone())
    torch.cuda.synchronize()
    for k, (a, b) in enumerate(zip(got[1:], eager[1:])):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"replay {k}"
    assert og.state_dict()["ampx_master_weights"]["steps"] == 5  # the device's count


@two_gpus
def test_cuda_overflow_report_names_a_parameter_on_the_second_gpu():
    a = torch.nn.Parameter(torch.ones(4, device="cuda:0"))
    b = torch.nn.Parameter(torch.ones(1 << 20, device="cuda:1"))
    opt = torch.optim.SGD([a, b], lr=0.1)
    scaler = ampx.GradScaler("cuda")
    loss = a.sum() + (b.sum() * math.inf).to("cuda:0")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.overflow_report()
    assert report is not None and len(report.inf) + len(report.nan) == 1, report


# ---- MasterWeights' device-side key, its bookkeeping checked on the CPU -------------------------


def _master_run(monkeypatch, on_device, steps, seed=7):
    """A bfloat16 model under MasterWeights with stochastic rounding; the key in a tensor (as on
    CUDA) when on_device. Returns (model, optimizer) after `steps` steps."""
    monkeypatch.setattr(ampx.MasterWeights, "_rng_on_device", lambda self: on_device)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    opt = ampx.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.01), model=model, rounding="stochastic",
                             seed=seed)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    return model, opt, x


def test_master_weights_device_key_gives_the_host_keys_bits(monkeypatch):
    a, _, _ = _master_run(monkeypatch, False, 4)
    b, ob, _ = _master_run(monkeypatch, True, 4)
    assert torch.equal(a.weight.view(torch.int16), b.weight.view(torch.int16))
    assert ob._rng.tolist() == [7, 4] and ob.state_dict()["ampx_master_weights"]["steps"] == 4


def test_master_weights_device_key_outruns_the_host_after_replays(monkeypatch):
    # Replays of a captured step advance the device's offset without the host knowing: the next
    # eager step continues from the device's count, and a checkpoint records it.
    model, opt, x = _master_run(monkeypatch, True, 2)
    opt._rng[1:].add_(3)  # three replays
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()
    assert opt._rng.tolist() == [7, 6]
    assert opt.state_dict()["ampx_master_weights"]["steps"] == 6
    # A loaded checkpoint resets the device key from the host: its last write-back, then on.
    sd = opt.state_dict()
    model2, opt2, _ = _master_run(monkeypatch, True, 0)
    opt2.load_state_dict(sd)
    assert torch.equal(model2.weight.view(torch.int16), model.weight.view(torch.int16))
    assert opt2.state_dict()["ampx_master_weights"]["steps"] == 6


def test_master_weights_device_key_is_rewritten_in_place(monkeypatch):
    # A captured graph holds the key tensor's address: a load or a new seed must write into that
    # tensor, never rebind it (the graph would read and advance freed memory).
    model, opt, x = _master_run(monkeypatch, True, 2)
    captured = opt._rng.data_ptr()
    opt.load_state_dict(opt.state_dict())
    assert opt._rng.data_ptr() == captured
    opt.seed = 8
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()
    assert opt._rng.data_ptr() == captured and opt._rng.tolist() == [8, 3]


def test_master_weights_load_rewrites_a_device_key_that_ran_ahead(monkeypatch):
    # The loading optimizer's own device key ran ahead (replays) to exactly the value the
    # checkpoint's last write-back needs on the host's count: the load must still write the
    # checkpoint's parameters, with the checkpoint's offset.
    saved, osaved, _ = _master_run(monkeypatch, True, 2)
    sd = osaved.state_dict()
    model, opt, _ = _master_run(monkeypatch, True, 1)
    opt._rng[1:].add_(3)  # three replays: the device's offset is 4, the host's count 1
    opt.load_state_dict(sd)
    assert torch.equal(model.weight.view(torch.int16), saved.weight.view(torch.int16))
    assert opt.state_dict()["ampx_master_weights"]["steps"] == 2
