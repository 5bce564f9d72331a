"""ampx.PrecisionMonitor and the origin and advice of overflow reports (issue 26).

Each case trains a small model in float16 autocast on the CPU with an ampx.GradScaler and
a monitor, forces one kind of non-finite value at one step in one named place, and checks
that the report of that step names that place (phase, module, tensor, kind) and that the
advice says what fits it. Then the flags' bookkeeping, the statistics, the table, and what the
monitor refuses."""
import math

import pytest
import torch
from torch import nn

import ampx
from ampx import stats as S

BAD_STEP = 3


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(self.act(self.up(x))))


class Net(nn.Module):
    def __init__(self, d=16, inner=None):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.inner = inner if inner is not None else nn.Identity()
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.inner(x))


def train(model, steps=BAD_STEP + 2, before_step=None, every=2, scaler=None, device="cpu", **monitor_kw):
    """Runs `steps` steps on `device` (where the model already is); before_step(step, model) may
    change things. Returns the scaler, the monitor and the reports of skipped steps keyed by
    step index."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = scaler if scaler is not None else ampx.GradScaler(device, init_scale=2.0 ** 8)
    mon = scaler.monitor(model, every=every, **monitor_kw)
    reports = {}
    for step in range(steps):
        if before_step is not None:
            before_step(step, model)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)
        with torch.autocast(device, dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        skipped_before = scaler.stats()["skipped_steps"]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.stats()["skipped_steps"] > skipped_before:
            reports[step] = scaler.overflow_report()
    return scaler, mon, reports


def only_report(reports, step=BAD_STEP):
    assert list(reports) == [step], reports
    return reports[step]


def test_forward_overflow_in_a_named_linear():
    # 65000 + x.W (x.W ~ 500): past 65504 in float16; each parameter is below
    _, _, reports = train(Net(), before_step=_push_up)
    r = only_report(reports)
    o = r.origin
    assert (o["phase"], o["module"], o["tensor"], o["kind"], o["dtype"]) == (
        "forward", "blocks.1.up", "output 0", "inf", "float16")
    assert o["module_type"] == "Linear"
    assert o["amax_before"] is not None and 0 < o["amax_before"] < 65504  # from step 2's statistics
    assert "blocks.1.up" in r.advice and "float32" in r.advice and "bfloat16" in r.advice
    assert "lowering it does not help" in r.advice
    # the parameters' report names almost everything: the origin is what tells
    assert len(r.nan) + len(r.inf) > 10


class Attention(nn.Module):
    """Scores q.k^T then a softmax module: the overflow is in the softmax's input."""

    def __init__(self, d=16):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.scores = Scores()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        return self.softmax(self.scores(self.q(x), self.k(x))) @ x


class Scores(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = 1.0

    def forward(self, q, k):
        return (q * self.gain) @ k.transpose(-1, -2)


def test_forward_overflow_in_a_softmax_input():
    att = Attention()

    def push(step, model):
        att.scores.gain = 1e5 if step == BAD_STEP else 1.0

    _, _, reports = train(Net(inner=att), before_step=push)
    o = only_report(reports).origin
    assert (o["phase"], o["module"], o["tensor"], o["kind"]) == ("forward", "inner.scores", "output 0", "inf")


class HalfLayerNorm(nn.LayerNorm):
    """A LayerNorm computed and returned in float16 (autocast would run nn.LayerNorm in float32)."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return nn.functional.layer_norm(x.half(), self.normalized_shape, self.weight.half(), self.bias.half(),
                                            self.eps)


def test_forward_overflow_in_a_float16_layernorm():
    model = Net()
    model.blocks[0].norm = HalfLayerNorm(16)

    def push(step, model):  # a gain of 4e4 (held by float16) times normalised values past 1.64
        with torch.no_grad():
            model.blocks[0].norm.weight.fill_(4e4 if step == BAD_STEP else 1.0)

    _, _, reports = train(model, before_step=push)
    o = only_report(reports).origin
    assert (o["phase"], o["module"], o["tensor"], o["dtype"]) == ("forward", "blocks.0.norm", "output 0", "float16")
    assert o["module_type"] == "HalfLayerNorm" and o["param_amax"] == 4e4


class Boom(torch.autograd.Function):
    """Identity forward; backward multiplies by `gain` (inf at the bad step)."""

    gain = 1.0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * Boom.gain


class Exploding(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(Boom.apply(x))


def test_backward_overflow_from_a_custom_autograd_function():
    model = Net(inner=Exploding())

    def push(step, model):
        Boom.gain = math.inf if step == BAD_STEP else 1.0

    try:
        _, _, reports = train(model, before_step=push)
    finally:
        Boom.gain = 1.0
    r = only_report(reports)
    o = r.origin
    # the gradient inner.lin's backward passed on was finite; the one inner's Boom passed on was not
    assert (o["phase"], o["module"], o["kind"]) == ("backward", "inner", "inf")
    assert o["tensor"] == "grad_input 0 (the gradient of blocks.1.norm's output 0)"
    assert "backward of inner" in r.advice and "loss scale 2^8" in r.advice


class LogOf(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = 0.0

    def forward(self, x):
        return torch.log(x.abs() + 1.0 - self.shift)


def test_nan_from_a_log_of_a_negative():
    log = LogOf()

    def push(step, model):
        log.shift = 1e3 if step == BAD_STEP else 0.0

    _, _, reports = train(Net(inner=log), before_step=push)
    r = only_report(reports)
    o = r.origin
    assert (o["phase"], o["module"], o["kind"]) == ("forward", "inner", "nan")
    assert "invalid operation" in r.advice and "not a range problem" in r.advice


def test_gradient_underflow_at_the_scale_floor_says_so_with_the_fraction():
    """Overflows at the floor (min_scale = init_scale = 2^-4) with tiny weights: the float16
    gradients reaching the modules are mostly zero there, and the advice gives that fraction,
    from the statistics of the step before, as the reference counts it."""
    scaler = ampx.GradScaler("cpu", init_scale=2.0 ** -4, min_scale=2.0 ** -4, on_min_scale="ignore")
    model = Net()
    grads, at = {}, {}

    def keep(m, a, out):
        if out.requires_grad:
            out.register_hook(lambda g: seen_grad(g))

    def seen_grad(g):
        if at["step"] == 2:
            grads[len(grads)] = g.detach().clone()
        return None  # the gradient itself unchanged

    def push(step, model):
        at["step"] = step
        with torch.no_grad():
            if step == 1:
                for p in model.parameters():
                    p.mul_(1e-4)  # tiny gradients from here on
            model.blocks[1].up.bias.fill_(7e4 if step == BAD_STEP else 0.0)
        if step == BAD_STEP - 1:
            for name, m in model.named_modules():
                if name and not any(True for _ in m.children()):
                    m.register_forward_hook(keep)

    _, mon, reports = train(model, before_step=push, scaler=scaler, every=1, steps=BAD_STEP + 1)
    r = only_report(reports)
    assert "floor (2^-4)" in r.advice and "underflow" in r.advice and "statistics of step 2" in r.advice
    seen = [g for g in grads.values() if g.dtype == torch.float16]
    assert seen
    flat = torch.cat([g.reshape(-1).float() for g in seen])
    want = ((flat == 0) | (flat.abs() < 2.0 ** -14)).double().mean().item()
    assert f"{want:.1%}" in r.advice and want > 0.5


def test_every_step_flags_cost_no_host_read_and_clean_steps_have_no_origin():
    _, mon, reports = train(Net(), every=0)
    assert reports == {} and mon.last_origin is None and mon.steps == BAD_STEP + 2


def test_report_table_and_rows():
    _, mon, _ = train(Net(), every=2)
    rows = mon.rows()
    names = [(r["phase"], r["module"]) for r in rows]
    assert names[0] == ("forward", "inp") and names[-1] == ("backward", "inp")
    assert ("backward", "head") in names
    r0 = rows[0]
    assert r0["dtype"] == "float16" and r0["amax"] > 0 and r0["fp16_headroom"] > 5
    text = mon.report()
    assert "blocks.0.up" in text and "fp16 headroom" in text and f"step {mon._rows_step}" in text


def test_statistics_rows_equal_the_reference_of_the_hooked_tensors():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    mon = ampx.PrecisionMonitor(model, every=1)
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    x = torch.randn(5, 8)
    model(x)
    mon.step()
    got = mon._rows[("forward", "0", 0)]
    assert torch.equal(got, S.reference([seen[0]])[0])


def test_monitor_without_a_scaler_returns_the_origin_from_step():
    model = nn.Sequential(nn.Linear(4, 4), LogOf(), nn.Linear(4, 1))
    mon = ampx.PrecisionMonitor(model, every=0)
    model(torch.randn(2, 4)).sum().backward()
    assert mon.step() is None
    model[1].shift = 100.0
    model(torch.randn(2, 4)).sum().backward()
    o = mon.step()
    assert (o["phase"], o["module"], o["kind"]) == ("forward", "1", "nan") and mon.last_origin is o


def test_explain_overflows_arms_after_the_first_overflow():
    model = Net()
    scaler = ampx.GradScaler("cpu", init_scale=2.0 ** 8, explain_overflows=True)
    scaler.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    reports = []
    for step in range(6):
        with torch.no_grad():
            model.blocks[1].up.bias.fill_(7e4 if step in (1, 4) else 0.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step in (1, 4):
            reports.append(scaler.overflow_report())
    assert reports[0].origin is None and "next overflow" in reports[0].note
    assert reports[1].origin["module"] == "blocks.1.up" and reports[1].origin["phase"] == "forward"


def test_explain_overflows_without_the_model_says_what_to_do():
    model = nn.Linear(4, 1)
    scaler = ampx.GradScaler("cpu", explain_overflows=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.full((1, 4), math.inf)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert "scaler.watch(model)" in scaler.overflow_report().note


# ---- what the monitor refuses ----------------------------------------------------------------

def test_a_model_with_nothing_to_hook_is_refused():
    with pytest.raises(ValueError, match="has no submodule and no parameter"):
        ampx.PrecisionMonitor(nn.Identity())


def test_a_pattern_matching_nothing_is_refused_and_nothing_hooked():
    model = Net()
    with pytest.raises(ValueError, match=r"'blocks\.\*\.attn' matches no module"):
        ampx.PrecisionMonitor(model, modules=["blocks.*.up", "blocks.*.attn"])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_patterns_select_modules():
    model = Net()
    mon = ampx.PrecisionMonitor(model, modules="blocks.*.up")
    assert [n for n, _ in mon._targets] == ["blocks.0.up", "blocks.1.up"]
    mon.remove()
    assert not any(m._forward_hooks for m in model.modules())


def test_a_model_moved_after_the_monitor_was_built_is_refused_and_unhooked():
    model = Net()
    mon = ampx.PrecisionMonitor(model)
    model.to(torch.float64)  # same device, still fine
    model(torch.randn(2, 8, dtype=torch.float64))
    model.to("meta")
    with pytest.raises(RuntimeError, match="moved after the monitor was built"):
        model(torch.randn(2, 8, device="meta"))
    assert not mon._handles and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("kw, match", [({"every": -1}, "every must be"), ({"every": 1.5}, "every must be"),
                                       ({"modules": 3}, "modules must be")])
def test_bad_arguments(kw, match):
    with pytest.raises(TypeError, match=match):
        ampx.PrecisionMonitor(Net(), **kw)


def test_a_second_monitor_on_one_scaler_is_refused():
    scaler = ampx.GradScaler("cpu")
    scaler.monitor(Net())
    with pytest.raises(ValueError, match="attached already"):
        scaler.monitor(Net())


def test_a_pickled_scaler_leaves_its_monitor_behind():
    import pickle

    scaler = ampx.GradScaler("cpu")
    scaler.monitor(Net())
    back = pickle.loads(pickle.dumps(scaler))
    assert back._monitor is None and scaler._monitor is not None


@pytest.mark.parametrize("bad, match", [(3, "monitor must be True or a dict"), ({"evry": 2}, "not evry")])
def test_integrations_refuse_a_bad_monitor_argument(bad, match):
    pytest.importorskip("accelerate")
    from ampx.integrations.accelerate import _monitor_kwargs

    with pytest.raises(TypeError, match=match):
        _monitor_kwargs(bad)
    assert _monitor_kwargs(True) == {} and _monitor_kwargs(None) is None


def test_the_origin_travels_with_the_deferred_telemetry_of_a_device_scale():
    """With a device scale the step's flags are copied without blocking and read when the update
    is accounted for (here the CPU scale forced onto that path): the same origin."""
    scaler = ampx.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler._force_lazy_telemetry = True

    def push(step, model):
        with torch.no_grad():
            model.blocks[1].up.bias.fill_(7e4 if step == BAD_STEP else 0.0)

    _, _, reports = train(Net(), before_step=push, scaler=scaler)
    o = only_report(reports).origin
    assert (o["phase"], o["module"], o["param_amax"]) == ("forward", "blocks.1.up", 7e4)


def _push_up(step, model):
    """At BAD_STEP, pushes blocks.1.up's output past float16's range (each parameter within it);
    restores the layer the step after."""
    up = model.blocks[1].up
    with torch.no_grad():
        if step == BAD_STEP:
            _push_up.saved = up.weight.clone(), up.bias.clone()
            up.weight.mul_(1000.0)
            up.bias.fill_(65000.0)
        elif step == BAD_STEP + 1:
            up.weight.copy_(_push_up.saved[0])
            up.bias.copy_(_push_up.saved[1])


def _loop(model, opt, scaler, autocast, dtype, steps=BAD_STEP + 2):
    """Trains with `opt` (a MasterWeights or an optimizer whose grads live in a GradBuffer),
    pushing blocks.1.up at BAD_STEP; returns the reports of skipped steps and the parameters
    seen before and after each step."""
    reports, seen = {}, []
    for step in range(steps):
        _push_up(step, model)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(dtype)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        skipped = scaler.stats()["skipped_steps"]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append((before, [p.detach().clone() for p in model.parameters()]))
        if scaler.stats()["skipped_steps"] > skipped:
            reports[step] = scaler.overflow_report()
    return reports, seen


def _assert_origin_in_up(reports, seen):
    r = only_report(reports)
    assert (r.origin["phase"], r.origin["module"], r.origin["tensor"], r.origin["kind"]) == (
        "forward", "blocks.1.up", "output 0", "inf")
    assert r.origin["dtype"] == "float16" and "blocks.1.up" in r.advice
    before, after = seen[BAD_STEP]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the skipped step changed nothing
    before, after = seen[BAD_STEP + 1]
    assert not all(torch.equal(a, b) for a, b in zip(before, after))  # the next one trained


def test_the_origin_under_master_weights_with_a_float16_model():
    torch.manual_seed(0)
    model = Net()
    opt = ampx.MasterWeights(torch.optim.SGD(model.parameters(), lr=1e-2), model=model, dtype=torch.float16)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    scaler = ampx.GradScaler("cpu", init_scale=2.0 ** 8)
    mon = scaler.monitor(model, every=2)
    reports, seen = _loop(model, opt, scaler, autocast=False, dtype=torch.float16)
    _assert_origin_in_up(reports, seen)
    assert mon.steps == BAD_STEP + 2


def test_the_origin_with_gradients_in_a_grad_buffer():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    buf = ampx.GradBuffer(opt)
    scaler = ampx.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.monitor(model, every=2)
    reports, seen = _loop(model, opt, scaler, autocast=True, dtype=torch.float32)
    _assert_origin_in_up(reports, seen)
    buf.check()
