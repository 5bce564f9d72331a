"""Settings checked where they enter, and calls that refuse leave everything as it was.

The reliability issue's items: half-applied checkpoints and constructors, the int32 trackers,
state changed by a failing step/clip, silent acceptance of nonsense, the zero-scale floor, and
what an unpickled scaler names in its reports. Each test fails on the code before the fix.
"""
import copy
import logging
import math
import pickle
import re
import subprocess
import sys

import pytest
import torch

import ampx
from ampx import settings

import test_probe as probe
from test_probe import snapshot

FLT_MIN = settings.FLOAT32_MIN_NORMAL


_model_opt = probe._model_opt
_scaled = probe._scaler


# ---- load_state_dict: checked whole, nothing changed on error ------------------------------


@pytest.mark.parametrize("key,value", [
    ("_growth_tracker", 2**31), ("_growth_tracker", 2**31 - 1), ("_growth_tracker", -1), ("scale", 1e300),
    ("scale", 0.0), ("scale", 1e-40), ("scale", math.inf), ("growth_interval", 0), ("growth_interval", -5),
    ("growth_interval", 2**31), ("growth_factor", math.nan), ("growth_factor", 1.0), ("backoff_factor", 0.0),
    ("backoff_factor", 1.0), ("hysteresis", 2**31), ("min_scale", 1e39), ("max_scale", 0.5 * FLT_MIN),
])
def test_a_bad_checkpoint_changes_nothing(key, value):
    s = _scaled()
    sd = _scaled(growth_interval=7, hysteresis=3).state_dict()  # every other key differs from s's
    sd[key] = value
    before = snapshot([s])
    with pytest.raises(ValueError, match=re.escape(f"state_dict[{key!r}]")):
        s.load_state_dict(sd)
    assert snapshot([s]) == before


def test_a_good_checkpoint_at_the_int32_edge_loads_and_steps_without_wrapping():
    s = _scaled(growth_interval=2**31 - 1)
    sd = s.state_dict()
    sd["_growth_tracker"] = 2**31 - 2
    s.load_state_dict(sd)
    m, opt = _model_opt()
    s.step(opt)
    s.update()  # the (2**31 - 1)-th clean step: grow and restart, not wrap
    assert s._get_growth_tracker() == 0
    assert s.get_scale() == 16.0


# ---- the constructor and Policy: the same rules, before anything is built -------------------


@pytest.mark.parametrize("kw", [
    dict(growth_interval=0), dict(growth_interval=-1), dict(growth_interval=2**40), dict(growth_factor=math.nan),
    dict(growth_factor=math.inf), dict(min_scale=1e39), dict(hysteresis=2**31), dict(hysteresis=0),
    dict(init_scale=0), dict(init_scale=1e300), dict(init_scale=math.nan), dict(backoff_factor=0),
    dict(backoff_factor=-0.5), dict(backoff_factor=math.nan), dict(growth_factor=0.5), dict(backoff_factor=2.0),
    dict(on_min_scale="shout"), dict(growth_timing="x"),
])
def test_scaler_and_policy_refuse_the_same_settings(kw):
    with pytest.raises(ValueError):
        ampx.GradScaler("cpu", **kw)
    with pytest.raises(ValueError):
        ampx.Policy("fp16", device="cpu", **kw)


def test_torchs_assertion_errors_stay_assertion_errors():
    """torch raises AssertionError for these two: code written for torch still catches it, and it
    is a ValueError naming the setting (python -O does not strip it: it is raised, not asserted)."""
    for kw in (dict(growth_factor=1.0), dict(backoff_factor=1.0)):
        with pytest.raises(AssertionError) as info:
            ampx.GradScaler("cpu", **kw)
        assert isinstance(info.value, ValueError) and type(info.value) is ampx.SettingError
        assert str(info.value) in ("The growth factor must be > 1.0.", "The backoff factor must be < 1.0.")


@pytest.mark.parametrize("kw", [dict(init_scale=0.0), dict(init_scale=math.nan), dict(growth_factor=1.0),
                                dict(backoff_factor=1.0), dict(growth_interval=0), dict(growth_factor=math.nan)])
def test_a_disabled_scaler_takes_the_settings_torchs_takes(kw):
    """A scaler that is off reads none of torch's four settings, and torch's checks none of them
    (a config may turn AMP off and keep a DeepSpeed-style loss_scale of 0): ampx's takes what
    torch's takes and behaves as it does; ampx's own settings are still checked."""
    ref = torch.amp.GradScaler("cpu", enabled=False, **kw)
    sut = ampx.GradScaler("cpu", enabled=False, **kw)
    assert not sut.is_enabled() and sut.state_dict() == ref.state_dict() == {}
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    loss = p.sum()
    assert sut.scale(loss) is loss
    loss.backward()
    sut.step(opt)
    sut.update()
    assert torch.equal(p.detach(), torch.full((3,), 0.5))
    with pytest.raises(ValueError, match="hysteresis"):
        ampx.GradScaler("cpu", enabled=False, hysteresis=0, **kw)
    with pytest.raises(ValueError, match="on_min_scale"):
        ampx.GradScaler("cpu", enabled=False, on_min_scale="shout", **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
def test_a_cuda_scaler_that_torch_turns_off_takes_the_settings_torchs_takes():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        ref = torch.amp.GradScaler(init_scale=0.0, growth_factor=1.0)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        sut = ampx.GradScaler(init_scale=0.0, growth_factor=1.0)
    assert not ref.is_enabled() and not sut.is_enabled()


def test_unscale_before_scale_refuses_as_torch_and_leaves_no_state():
    """torch refuses unscale_ before the first scale(); the refusal leaves no per-optimizer entry
    behind, so the scaler still pickles (torch's rule: only between iterations)."""
    for make in (torch.amp.GradScaler, ampx.GradScaler):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = make("cpu")
        with pytest.raises(AssertionError, match="scale"):
            scaler.unscale_(opt)
        assert len(scaler._per_optimizer_states) == 0, make
        pickle.loads(pickle.dumps(scaler))


@pytest.mark.parametrize("hysteresis", [1, 2])
@pytest.mark.parametrize("lazy", [False, True], ids=["host_telemetry", "device_telemetry"])
def test_on_min_scale_raise_changes_nothing(hysteresis, lazy, monkeypatch):
    """update() at the floor with on_min_scale='raise' raises before anything changes: the scale,
    both trackers, the step counts, the report, the history and the per-optimizer states are as
    they were (so a retry raises again), and update(new_scale) still sets a scale by hand."""
    monkeypatch.setattr(ampx.GradScaler, "_force_lazy_telemetry", lazy)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ampx.GradScaler("cpu", init_scale=2.0, min_scale=2.0, growth_interval=10, hysteresis=hysteresis,
                        on_min_scale="raise")

    def step(bad):
        s.scale(torch.ones(()))
        p.grad = torch.full((4,), math.nan if bad else 1.0)
        s.step(opt)

    def state():
        st = s.stats()
        return (s.state_dict(), st["steps"], st["skipped_steps"], list(st["history"]), s.overflow_report(),
                {k: dict(v) for k, v in s._per_optimizer_states.items()}, p.detach().clone())

    for bad in [False, False] + [True] * (hysteresis - 1):  # hysteresis: the overflows it absorbs first
        step(bad)
        s.update()
    step(True)
    before = state()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="min_scale=2.*on_min_scale='raise'"):
            s.update()
        after = state()
        assert after[:5] == before[:5] and after[5].keys() == before[5].keys() and torch.equal(after[6], before[6])
    s.update(new_scale=8.0)
    assert s.get_scale() == 8.0 and s.stats()["steps"] == before[1] + 1


def test_deepspeed_config_never_sees_a_refused_setting():
    with pytest.raises(ValueError, match="hysteresis"):
        ampx.Policy("fp16", device="cpu", hysteresis=0)
    with pytest.raises(ValueError, match="min_scale"):
        ampx.Policy("fp16", device="cpu", min_scale=-5)
    with pytest.raises(TypeError, match="base must be a dict"):
        ampx.Policy("fp16", device="cpu").deepspeed_config([1])


def test_bare_attribute_errors_are_gone():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ampx.prepare(None)
    with pytest.raises(TypeError, match="optimizer must be"):
        ampx.prepare(torch.nn.Linear(2, 2), optimizer=object())
    accel = pytest.importorskip("ampx.integrations.accelerate")
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator"):
        accel.patch(None)


# ---- update(new_scale): docstring and behaviour agree ----------------------------------------


@pytest.mark.parametrize("value,expect", [(65536, 65536.0), (2.5, 2.5), (torch.tensor([4.0]), 4.0),
                                          (torch.tensor(3.0), 3.0), (torch.tensor([[0.25]], dtype=torch.float64), 0.25)])
def test_update_takes_what_its_docstring_says(value, expect):
    s = _scaled()
    s.update(value)
    assert s.get_scale() == expect and s._scale.shape == torch.Size([])


@pytest.mark.parametrize("value,exc", [
    (math.nan, ValueError), (math.inf, ValueError), (-1.0, ValueError), (0.0, ValueError), (0, ValueError),
    (1e-40, ValueError), (1e39, ValueError), ("x", TypeError), (None, None), ([4.0], TypeError),
    (torch.tensor([math.nan]), ValueError), (torch.zeros(1), ValueError), (torch.ones(2), AssertionError),
    (torch.ones(1, dtype=torch.int64), AssertionError), (torch.ones(1, requires_grad=True), AssertionError),
    (torch.ones(1, device="meta"), AssertionError),
])
def test_update_refuses_nonsense_and_changes_nothing(value, exc):
    s = _scaled()
    m, opt = _model_opt()
    s.step(opt)
    if exc is None:  # None is the ordinary update
        s.update(value)
        return
    before = snapshot([s])
    with pytest.raises(exc):
        s.update(value)
    assert snapshot([s]) == before
    assert "update(new_scale)" in type(s).update.__doc__ and "int" in type(s).update.__doc__


# ---- a failing step or clip changes nothing ----------------------------------------------------


@pytest.mark.parametrize("args", [dict(max_norm=None), dict(max_norm="x"), dict(max_norm=math.nan), dict(max_norm=-1),
                                  dict(max_norm=torch.ones(2)), dict(norm_type=math.nan), dict(norm_type=None),
                                  dict(error_if_nonfinite=torch.ones(3))])
def test_clip_refuses_bad_arguments_before_any_work(args):
    m, opt = _model_opt()
    s = _scaled()
    call = dict(max_norm=1.0, norm_type=2.0, error_if_nonfinite=False) | args
    before = snapshot([m, opt, s])
    with pytest.raises((TypeError, ValueError)):
        s.clip_grad_norm_(opt, **call)
    assert snapshot([m, opt, s]) == before
    # and the same scaler then clips normally
    assert torch.isfinite(s.clip_grad_norm_(opt, 1.0))


def test_clip_takes_numbers_and_one_element_tensors_as_torch_does():
    """A 1-element tensor max_norm (torch's clip takes float(max_norm)) clips as the float."""
    out = []
    for max_norm in (0.5, torch.tensor(0.5), torch.tensor([0.5], dtype=torch.float64)):
        m, opt = _model_opt()
        s = ampx.GradScaler("cpu", init_scale=1.0)
        s.scale(torch.ones(()))
        s.clip_grad_norm_(opt, max_norm, norm_type=2)
        out.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for o in out[1:] for a, b in zip(out[0], o))
    assert not torch.equal(out[0][0], _model_opt()[0].weight.grad)  # it did clip


def test_step_refuses_an_argument_the_optimizer_cannot_take_before_unscaling():
    m, opt = _model_opt()
    s = _scaled()
    before = snapshot([m, opt, s])
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'.*nothing was unscaled"):
        s.step(opt, bogus=1)
    assert snapshot([m, opt, s]) == before
    s.step(opt)  # still a fresh iteration
    s.update()


def test_step_passes_arguments_the_optimizer_takes():
    class WithArg(torch.optim.SGD):
        def step(self, closure=None, *, scale_lr=1.0):
            self.seen = scale_lr
            return super().step(closure)

    m, _ = _model_opt()
    opt = WithArg(m.parameters(), lr=0.1)
    s = _scaled()
    s.step(opt, scale_lr=0.5)
    assert opt.seen == 0.5


# ---- the zero-scale floor ------------------------------------------------------------------


def _overflow_steps(s, n, m, opt):
    for _ in range(n):
        s.scale(torch.ones(()))
        for p in m.parameters():
            p.grad = torch.full_like(p, math.inf)
        s.step(opt)
        s.update()


def test_a_long_overflow_streak_floors_at_the_smallest_normal_and_never_writes_nan(caplog):
    m, opt = _model_opt()
    s = ampx.GradScaler("cpu", init_scale=1.0)
    with caplog.at_level(logging.WARNING, logger="ampx"):
        _overflow_steps(s, 200, m, opt)
    assert s.get_scale() == pytest.approx(FLT_MIN, rel=1e-7) and s.get_scale() > 0
    assert "float32's smallest normal number" in caplog.text
    # the next clean step unscales by a finite 1/scale and steps
    s.scale(torch.ones(()))
    for p in m.parameters():
        p.grad = torch.full_like(p, FLT_MIN)
    w = m.weight.detach().clone()
    s.step(opt)
    assert not s.last_step_skipped
    assert all(torch.isfinite(p).all() for p in m.parameters()) and not torch.equal(w, m.weight)
    # torch's scaler under the same streak reaches 0 (the poison ampx refuses)
    t = torch.amp.GradScaler("cpu", init_scale=1.0)
    m2, opt2 = _model_opt()
    _overflow_steps(t, 200, m2, opt2)
    assert t.get_scale() == 0.0


def test_a_min_scale_above_the_floor_is_the_floor():
    m, opt = _model_opt()
    s = ampx.GradScaler("cpu", init_scale=1.0, min_scale=0.25, on_min_scale="ignore")
    _overflow_steps(s, 10, m, opt)
    assert s.get_scale() == 0.25


# ---- MasterWeights: refusals before the first cast, groups as torch's ------------------------


def test_master_weights_refuses_fp16_stochastic_before_casting_the_model():
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = snapshot([m, opt])
    with pytest.raises(ValueError, match="nothing was cast"):
        ampx.MasterWeights(opt, model=m, dtype=torch.float16, rounding="stochastic")
    assert snapshot([m, opt]) == before and m.weight.dtype == torch.float32


def _mw():
    m = torch.nn.Linear(4, 3).to(torch.bfloat16)
    return m, ampx.MasterWeights(torch.optim.SGD(m.parameters(), lr=0.1))


@pytest.mark.parametrize("group,exc", [
    (lambda m: {"params": [m.weight]}, ValueError),  # already held
    (lambda m: {"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))] * 2}, ValueError),
    (lambda m: {"params": {torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))}}, TypeError),
    (lambda m: {"params": [torch.ones(2, dtype=torch.bfloat16, requires_grad=True) * 2]}, ValueError),
    (lambda m: {"params": ["x"]}, TypeError),
    (lambda m: [1], TypeError),
])
def test_add_param_group_refuses_as_torch_and_changes_nothing(group, exc):
    m, mw = _mw()
    g = group(m)
    before = snapshot([m, mw])
    with pytest.raises(exc):
        mw.add_param_group(g)
    assert snapshot([m, mw]) == before and len(mw.masters) == 2


def test_add_param_group_undoes_its_masters_when_the_optimizer_refuses(monkeypatch):
    m, mw = _mw()
    extra = torch.nn.Parameter(torch.ones(2))  # float32: cast to the dtype below
    mw._dtype = torch.bfloat16

    def refuse(group):
        raise ValueError("refused by the optimizer")

    monkeypatch.setattr(mw.optimizer, "add_param_group", refuse)
    before = snapshot([m, mw])
    with pytest.raises(ValueError, match="refused by the optimizer"):
        mw.add_param_group({"params": [extra]})
    assert snapshot([m, mw]) == before and extra.dtype == torch.float32 and len(mw.masters) == 2


@pytest.mark.parametrize("key,value", [("seed", -1), ("seed", 2**64), ("seed", "x"), ("steps", "x"), ("steps", -1),
                                       ("rounding", "up"), ("masters", [None, None]),
                                       ("masters", [torch.zeros(3, 4, device="meta"), torch.zeros(3, device="meta")])])
def test_master_load_checks_everything_before_loading_the_optimizer(key, value):
    m, mw = _mw()
    sd = copy.deepcopy(mw.state_dict())
    sd["ampx_master_weights"][key] = value
    sd["param_groups"][0]["lr"] = 0.5
    before = snapshot([m, mw])
    with pytest.raises(ValueError):
        mw.load_state_dict(sd)
    assert snapshot([m, mw]) == before and mw.param_groups[0]["lr"] == 0.1


# ---- ops: a factor cannot be left out ----------------------------------------------------------


def test_ops_refuse_a_missing_factor():
    t = torch.ones(3)
    with pytest.raises(TypeError, match="inv_scale must be"):
        ampx.ops.unscale_([t], None, torch.zeros(1))
    with pytest.raises(TypeError, match="factor must be"):
        ampx.ops.mul_([t], None)
    assert torch.equal(t, torch.ones(3))


# ---- GradBuffer after model.half(): refused, the buffer untouched ----------------------------


def test_grad_buffer_refuses_a_cast_model_without_touching_the_buffer():
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    buf = ampx.GradBuffer(opt)
    m.half()
    flats = [b.clone() for b in buf.buffers.values()]
    with pytest.raises(RuntimeError, match="the model was cast or moved after the buffer was built"):
        m(torch.ones(2, 4, dtype=torch.half)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(flats, buf.buffers.values()))


# ---- reports after unpickling --------------------------------------------------------------


_UNPICKLED = r"""
import math, pickle, sys, torch, ampx
s = pickle.loads(sys.stdin.buffer.read())
torch.manual_seed(0)
m = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
def step():
    s.scale(torch.ones(()))
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    m.bias.grad[0] = math.inf
    s.step(opt); s.update()
    return s.overflow_report()
r = step()
print("BEFORE", r.inf, repr(r.note))
s.watch(m.named_parameters())
r = step()
print("AFTER", r.inf, repr(r.note))
"""


def test_an_unpickled_scaler_says_it_lost_the_names_until_watch():
    m = torch.nn.Linear(4, 3)
    s = ampx.GradScaler("cpu", named_parameters=m.named_parameters())
    out = subprocess.run([sys.executable, "-c", _UNPICKLED], input=pickle.dumps(s), capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().splitlines()
    before, after = lines[0], lines[1]
    assert "param[1] (3,)" in before and "call scaler.watch(model.named_parameters())" in before
    assert "weight" not in before and "'bias'" not in before  # no name from a stale id
    assert after.startswith("AFTER ['bias'] ''")
