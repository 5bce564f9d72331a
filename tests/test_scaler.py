"""ampx.GradScaler: equivalence with torch.amp.GradScaler, and the extras against plain models."""
import logging
import math
import pickle
import random
import warnings

import pytest
import torch

import ampx

OPTIMIZERS = ["SGD", "Adam", "AdamW"]
IMPLS = [{"foreach": False}, {"foreach": True}, {"fused": True}]


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(scaler, opt_name, impl, steps, seed, overflow_steps, clip=None, dtype=torch.bfloat16):
    """Trains a small MLP; returns (scales after each update, skip decisions, final params)."""
    model = _model(seed)
    opt = getattr(torch.optim, opt_name)(model.parameters(), lr=1e-3, **impl)
    gen = torch.Generator().manual_seed(seed + 1)
    scales, skips = [], []
    for i in range(steps):
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen)
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if i in overflow_steps:
            p = list(model.parameters())[overflow_steps[i] % 4]
            p.grad.view(-1)[i % p.numel()] = float("inf") if i % 2 else float("nan")
        if clip is not None:
            if isinstance(scaler, ampx.GradScaler):
                scaler.clip_grad_norm_(opt, clip)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = scaler.get_scale()
        scaler.step(opt)
        found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        skips.append(bool(found))
        if isinstance(scaler, ampx.GradScaler):
            assert bool(scaler.last_step_skipped) == bool(found)
        del before
    return scales, skips, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("impl", IMPLS, ids=["forloop", "foreach", "fused"])
def test_equivalent_to_torch_over_300_steps(opt_name, impl):
    rng = random.Random(7)
    overflow = {s: rng.randrange(1000) for s in rng.sample(range(300), 40)}
    kw = dict(init_scale=2.0**12, growth_interval=5)
    s_t, k_t, p_t = _train(torch.amp.GradScaler("cpu", **kw), opt_name, impl, 300, 3, overflow)
    s_a, k_a, p_a = _train(ampx.GradScaler("cpu", **kw), opt_name, impl, 300, 3, overflow)
    assert s_a == s_t
    assert k_a == k_t
    assert sum(k_t) >= 30  # the injected overflows really were skipped
    assert len(set(s_t)) > 3  # and the scale really moved both ways
    for a, t in zip(p_a, p_t):
        torch.testing.assert_close(a, t, rtol=0, atol=0)


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("impl", IMPLS, ids=["forloop", "foreach", "fused"])
def test_clip_grad_norm_matches_unscale_then_torch_clip(opt_name, impl):
    rng = random.Random(11)
    overflow = {s: rng.randrange(1000) for s in rng.sample(range(60), 6)}
    kw = dict(init_scale=2.0**12, growth_interval=5)
    s_t, k_t, p_t = _train(torch.amp.GradScaler("cpu", **kw), opt_name, impl, 60, 5, overflow, clip=0.05)
    s_a, k_a, p_a = _train(ampx.GradScaler("cpu", **kw), opt_name, impl, 60, 5, overflow, clip=0.05)
    assert s_a == s_t and k_a == k_t
    for a, t in zip(p_a, p_t):
        torch.testing.assert_close(a, t, rtol=1e-4, atol=1e-4)


def _grads_model(seed=0):
    model = _model(seed)
    x = torch.randn(32, 16)
    model(x).square().sum().backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_clip_grad_norm_returns_torch_norm_and_clips(norm_type):
    ref_model, model = _grads_model(), _grads_model()
    scale = 2.0**8
    for m in (ref_model, model):
        for p in m.parameters():
            p.grad.mul_(scale)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    ref_scaler.scale(torch.ones(()))
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref_scaler.unscale_(ref_opt)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5, norm_type)

    scaler = ampx.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norm = scaler.clip_grad_norm_(opt, 0.5, norm_type)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    assert norm.item() > 0.5  # so clipping really happened
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.clip_grad_norm_(opt, 0.5, norm_type)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)


def test_clip_is_folded_into_a_fused_optimizers_grad_scale():
    model = _grads_model()
    for p in model.parameters():
        p.grad.mul_(2.0**8)
    scaled = [p.grad.clone() for p in model.parameters()]
    scaler = ampx.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(torch.ones(()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    seen = {}
    real_step = opt.step

    def spy_step(*a, **k):
        seen["grad_scale"] = opt.grad_scale.clone()
        seen["grads"] = [p.grad.clone() for p in model.parameters()]
        return real_step(*a, **k)

    opt.step = spy_step
    norm = scaler.clip_grad_norm_(opt, 0.5)
    # Nothing was written: the gradients are still scaled when the fused step runs,
    for g, s in zip([p.grad for p in model.parameters()], scaled):
        assert torch.equal(g, s)
    scaler.step(opt)
    for g, s in zip(seen["grads"], scaled):
        assert torch.equal(g, s)
    # and the optimizer divides by scale / clip_coef.
    coef = min(1.0, 0.5 / (norm.item() + 1e-6))
    assert seen["grad_scale"].item() == pytest.approx(2.0**8 / coef, rel=1e-6)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.05), amsgrad=True, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, fused=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, fused=True),
], ids=["adamw", "adam-amsgrad-tensor-lr", "sgd-nesterov", "adagrad"])
@pytest.mark.parametrize("route", ["step", "unscale_"])
def test_cpu_fused_step_is_handed_found_inf_only_when_set(make_opt, route):
    """On the CPU a clear flag is not handed to torch's fused step (it would only add and
    subtract 0 from every step counter); a set one is, and the step is skipped as torch's would
    be. Parameters and every parameter's state match torch's GradScaler bit for bit."""
    runs = {}
    for kind in ("ampx", "torch"):
        model = _grads_model()
        opt = make_opt(list(model.parameters()))
        if not getattr(opt, "_step_supports_amp_scaling", False):  # torch 2.10's fused Adagrad
            pytest.skip(f"this torch's fused {type(opt).__name__} does not take grad_scale/found_inf")
        scaler = (ampx.GradScaler if kind == "ampx" else torch.amp.GradScaler)("cpu", init_scale=2.0**8)
        seen = []
        opt.register_step_pre_hook(
            lambda o, args, kwargs, _seen=seen: _seen.append(None if o.found_inf is None else float(o.found_inf)))
        for it in range(4):
            scaler.scale(torch.ones(()))
            for i, p in enumerate(model.parameters()):
                p.grad = torch.full_like(p, 0.01 * (i + 1) * 2.0**8)
                if it == 1 and i == 2:
                    p.grad.view(-1)[0] = float("inf")
            if route == "unscale_":
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        state = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
                 for p in model.parameters()]
        runs[kind] = (seen, [p.detach().clone() for p in model.parameters()], state)
    assert runs["ampx"][0] == [None, 1.0, None, None]
    assert runs["torch"][0] == [0.0, 1.0, 0.0, 0.0]
    for a, b in zip(runs["ampx"][1], runs["torch"][1]):
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(runs["ampx"][2], runs["torch"][2])):
        assert a.keys() == b.keys(), i
        for k in a:
            x, y = torch.as_tensor(a[k]), torch.as_tensor(b[k])
            assert x.dtype == y.dtype and torch.equal(x, y), (i, k)


def test_fused_step_against_separate_unscale_clip_step():
    models = [_grads_model(), _grads_model()]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01, fused=True) for m in models]
    for m in models:
        for p in m.parameters():
            p.grad.mul_(2.0**8)
    s1 = ampx.GradScaler("cpu", init_scale=2.0**8)
    s2 = ampx.GradScaler("cpu", init_scale=2.0**8)
    for s in (s1, s2):
        s.scale(torch.ones(()))
    s1.clip_grad_norm_(opts[0], 0.5)  # folded
    s1.step(opts[0])
    s2.unscale_(opts[1])  # separate
    torch.nn.utils.clip_grad_norm_(models[1].parameters(), 0.5)
    s2.step(opts[1])
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ---- extras against a plain-Python model of their rules ------------------------------------

def _model_update(state, overflow, cfg):
    """DeepSpeed/Megatron's rule on Python floats (float32 rounding via torch)."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float64).float().item()  # noqa: E731
    if overflow:
        state["tracker"] = 0
        if state["hyst"] > 1:
            state["hyst"] -= 1
            return
        state["scale"] = max(f32(state["scale"] * cfg["backoff_factor"]), cfg["min_scale"])
        return
    if cfg["consecutive_hysteresis"]:
        state["hyst"] = cfg["hysteresis"]
    state["tracker"] += 1
    if state["tracker"] == cfg["growth_interval"]:
        new = min(f32(state["scale"] * cfg["growth_factor"]), cfg["max_scale"])
        if math.isfinite(new):
            state["scale"] = new
        state["tracker"] = 0
        state["hyst"] = cfg["hysteresis"]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 4])
def test_extras_follow_the_model(hysteresis, consecutive):
    cfg = dict(init_scale=2.0**6, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
               hysteresis=hysteresis, consecutive_hysteresis=consecutive, min_scale=1.0, max_scale=2.0**9)
    scaler = ampx.GradScaler("cpu", **cfg, on_min_scale="ignore")
    state = {"scale": cfg["init_scale"], "tracker": 0, "hyst": hysteresis}
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.0)
    rng = random.Random(hysteresis * 10 + consecutive)
    for step in range(400):
        overflow = rng.random() < 0.3
        scaler.scale(p.sum()).backward()
        if overflow:
            p.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        _model_update(state, overflow, cfg)
        assert scaler.get_scale() == state["scale"], step
        assert 1.0 <= scaler.get_scale() <= 2.0**9


def test_min_scale_actions(caplog):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)

    def overflow_step(scaler):
        scaler.scale(p.sum()).backward()
        p.grad[0] = float("nan")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    s = ampx.GradScaler("cpu", init_scale=4.0, min_scale=2.0, on_min_scale="raise")
    overflow_step(s)  # 4 -> 2
    assert s.get_scale() == 2.0
    with pytest.raises(RuntimeError, match="min_scale"):
        overflow_step(s)
    s = ampx.GradScaler("cpu", init_scale=2.0, min_scale=2.0, on_min_scale="warn")
    with caplog.at_level(logging.WARNING, logger="ampx"):
        overflow_step(s)
    assert s.get_scale() == 2.0
    assert any("min_scale" in r.message for r in caplog.records)
    with pytest.raises(ValueError):
        ampx.GradScaler("cpu", on_min_scale="explode")
    with pytest.raises(ValueError):
        ampx.GradScaler("cpu", min_scale=4.0, max_scale=2.0)
    with pytest.raises(ValueError):
        ampx.GradScaler("cpu", hysteresis=0)


def test_static_scaling_keeps_the_scale_and_still_skips():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    s = ampx.GradScaler("cpu", init_scale=128.0, growth_interval=1, dynamic=False)
    for i in range(6):
        s.scale(p.sum()).backward()
        if i == 2:
            p.grad[0] = float("inf")
        before = p.detach().clone()
        s.step(opt)
        s.update()
        opt.zero_grad()
        assert s.get_scale() == 128.0
        assert torch.equal(p.detach(), before) == (i == 2)
        assert bool(s.last_step_skipped) == (i == 2)


def test_overflow_report_names_parameters_and_telemetry():
    model = _model(0)
    reports = []
    s = ampx.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, named_parameters=model.named_parameters(),
                        history=5, on_overflow=reports.append)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(12):
        s.scale(model(torch.randn(4, 16)).sum()).backward()
        if i == 4:
            model[0].weight.grad[0, 0] = float("inf")
            model[2].bias.grad[1] = float("nan")
        s.step(opt)
        s.update()
        opt.zero_grad()
    assert len(reports) == 1
    rep = s.overflow_report()
    assert rep is reports[0]
    assert rep.inf == ["0.weight"] and rep.nan == ["2.bias"] and rep.step == 5
    st = s.stats()
    assert st["steps"] == 12 and st["skipped_steps"] == 1
    assert st["min_scale_seen"] == 2.0**10 and st["max_scale_seen"] >= 2.0**12
    assert len(st["history"]) == 5 and st["history"][-1] == (12, s.get_scale())


def test_messages_go_through_logging_not_print(capsys, caplog):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ampx.GradScaler("cpu", init_scale=1.0, min_scale=1.0)
    with caplog.at_level(logging.DEBUG, logger="ampx"):
        s.scale(p.sum()).backward()
        p.grad[0] = float("inf")
        s.step(opt)
        s.update()
    assert capsys.readouterr() == ("", "")
    assert caplog.records


def test_state_dict_extras_round_trip_and_pickle():
    s = ampx.GradScaler("cpu", init_scale=8.0, hysteresis=3, consecutive_hysteresis=True, min_scale=0.5,
                        max_scale=1024.0, dynamic=True)
    s.scale(torch.ones(()))
    s._hysteresis_tracker.fill_(2)
    sd = s.state_dict()
    for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
        assert k in sd
    assert sd["hysteresis"] == 3 and sd["_hysteresis_tracker"] == 2 and sd["max_scale"] == 1024.0
    t = ampx.GradScaler("cpu")
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    u = pickle.loads(pickle.dumps(s))
    assert u.state_dict() == sd


# ---- one way down: the scaler splits by device once, from what collect_grads saw ----------

@pytest.mark.parametrize("shim", [True, False])
def test_collect_grads_says_where_the_grads_are(shim):
    prev = ampx._C._set_tensor_shim(shim)
    try:
        a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
        a.grad, c.grad = torch.ones(2), torch.ones(2)
        params, grads, devices = ampx._C.collect_grads([{"params": [a, b]}, {"params": [c]}])
        assert params == [a, c] and grads[0] is a.grad and devices is None  # one device
        m = torch.nn.Parameter(torch.zeros(2, device="meta"))
        m.grad = torch.zeros(2, device="meta")
        sub = torch.nn.Parameter(torch.zeros(2))
        sub.grad = torch.ones(4)[::2]  # a non-contiguous view: the shim leaves it to the attributes
        _, _, devices = ampx._C.collect_grads([{"params": [a, m, sub, c]}])
        assert devices == [-1, -2, -1, -1]
        assert ampx._C.collect_grads([{"params": [m, a]}])[2] == [-2, -1]
        assert ampx._C.collect_grads([{"params": []}]) == ([], [], None)
    finally:
        ampx._C._set_tensor_shim(prev)


def test_each_device_gets_one_kernel_call(monkeypatch):
    """The scaler's list goes down once per device: no failed first try, no second dispatch."""
    from ampx import ops

    calls = []
    real = ops._scaler_pass

    def spy(tensors, *args):
        calls.append((len(tensors), args[6]))  # (..., refuse_fp16, device, split)
        return real(tensors, *args)

    monkeypatch.setattr(ops, "_scaler_pass", spy)
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 16)).sum()).backward()
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    assert calls[0] == (4, -1) and all(c == (4, -1) for c in calls)  # CPU, all four grads each time
    # Gradients on two devices: one call per device, in first-seen order, each told its device.
    calls.clear()
    extra = torch.nn.Parameter(torch.zeros(3, device="meta"))
    extra.grad = torch.zeros(3, device="meta")
    opt.add_param_group({"params": [extra]})
    scaler.scale(model(torch.randn(4, 16)).sum()).backward()
    calls.clear()
    with pytest.raises(ValueError, match="meta"):
        scaler._check_inf_per_device(opt)  # read only: each device's list goes down once
    assert calls == [(4, -1), (1, -1)]


# ---- ShardedGradScaler: torch's class identity and signatures -------------------------------

def test_sharded_scaler_is_torchs_sharded_scaler_too():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    s = ampx.ShardedGradScaler("cpu", init_scale=8.0, backoff_factor=0.25, growth_factor=4.0)
    assert isinstance(s, TorchSharded) and isinstance(s, ampx.GradScaler)
    # torch's argument order, and none of torch's sharded overrides in charge
    assert (s.get_backoff_factor(), s.get_growth_factor()) == (0.25, 4.0)
    for name in ("update", "unscale_", "_unscale_grads_", "scale"):
        assert getattr(type(s), name).__module__.startswith(("ampx", "torch.amp")), name


def test_sharded_unscale_grads_has_torchs_default_allow_fp16():
    """torch's own sharded-scaler tests call _unscale_grads_(opt, inv, found) on fp16 grads."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.tensor([2.0, 4.0, 8.0, float("inf")], dtype=torch.float16)
    opt = torch.optim.SGD([p], lr=0.1)
    s = ampx.ShardedGradScaler("cpu")
    found = s._unscale_grads_(opt, torch.full((), 0.5), torch.zeros(()))
    assert torch.equal(p.grad[:3], torch.tensor([1.0, 2.0, 4.0], dtype=torch.float16))
    assert float(sum(found.values())) == 1.0
    with pytest.raises(ValueError, match="FP16"):
        ampx.GradScaler("cpu")._unscale_grads_(opt, torch.full((), 0.5), torch.zeros(()), False)


# ---- load_state_dict: the whole dict checked before anything changes ------------------------

def _loaded_scaler():
    s = ampx.GradScaler("cpu", init_scale=256.0, growth_interval=3, hysteresis=3, min_scale=2.0, max_scale=2.0**20)
    s.scale(torch.ones(()))  # the scale tensors exist, as in a run
    return s


def _everything(s):
    return (s.state_dict(), float(s._scale), int(s._growth_tracker), int(s._hysteresis_tracker),
            s._init_scale, s._init_growth_tracker, s._init_hysteresis_tracker)


@pytest.mark.parametrize("key,value,error,match", [
    ("scale", -4.0, ValueError, r"state_dict\['scale'\] must be a number from float32"),
    ("scale", float("nan"), ValueError, "'scale'"),
    ("scale", "big", ValueError, "'scale'"),
    ("growth_factor", 0.5, ValueError, "growth_factor.*> 1"),
    ("backoff_factor", -1.0, ValueError, "backoff_factor"),
    ("growth_interval", 2.5, ValueError, "growth_interval"),
    ("_growth_tracker", -1, ValueError, "_growth_tracker"),
    ("hysteresis", "x", ValueError, r"hysteresis.\] must be an integer from 1"),
    ("hysteresis", 0, ValueError, "hysteresis"),
    ("hysteresis", -2, ValueError, "hysteresis"),
    ("hysteresis", 2.7, ValueError, "hysteresis"),
    ("min_scale", "x", ValueError, "min_scale"),
    ("min_scale", float("nan"), ValueError, "min_scale"),
    ("min_scale", 2.0**30, ValueError, "max_scale.*must be None, inf or a number >= min_scale"),
    ("dynamic", "False", ValueError, r"state_dict\['dynamic'\] must be True or False"),
    ("consecutive_hysteresis", 1, ValueError, "consecutive_hysteresis"),
    ("on_min_scale", "explode", ValueError, r"state_dict\['on_min_scale'\] must be one of"),
    ("on_min_scale", None, ValueError, "on_min_scale"),
    ("_hysteresis_tracker", None, ValueError, "_hysteresis_tracker"),
    ("_hysteresis_tracker", 5, ValueError, r"from 1 to hysteresis \(3\)"),
    ("scale", None, KeyError, "has no 'scale'"),
])
def test_a_bad_checkpoint_changes_nothing(key, value, error, match):
    good = _loaded_scaler()
    for _ in range(2):
        good.update(good.get_scale() * 2)
    sd = good.state_dict()
    if value is None and error is KeyError:
        del sd[key]
    else:
        sd[key] = value
    s = _loaded_scaler()
    before = _everything(s)
    with pytest.raises(error, match=match):
        s.load_state_dict(sd)
    assert _everything(s) == before
    s.load_state_dict(good.state_dict())  # and a good one still loads afterwards
    assert s.get_scale() == good.get_scale()


def test_torchs_state_dict_loads_and_keeps_the_extras():
    t = torch.amp.GradScaler("cpu", init_scale=64.0)
    s = _loaded_scaler()
    s.load_state_dict(t.state_dict())
    assert s.get_scale() == 64.0 and s._hysteresis == 3 and s._min_scale == 2.0
    assert s._on_min_scale == "warn"


def test_on_min_scale_travels_with_the_checkpoint():
    """A run saved with on_min_scale='raise' raises at the floor when resumed into a default
    scaler (it warned before: the setting was not saved), and a torch checkpoint keeps it."""
    def at_floor(scaler):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.scale(p.sum()).backward()
        p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()

    saved = ampx.GradScaler("cpu", init_scale=2.0, min_scale=2.0, on_min_scale="raise")
    saved.scale(torch.ones(()))
    sd = saved.state_dict()
    assert sd["on_min_scale"] == "raise"
    resumed = ampx.GradScaler("cpu")
    resumed.load_state_dict(sd)
    assert resumed.state_dict() == sd
    with pytest.raises(RuntimeError, match="on_min_scale='raise'"):
        at_floor(resumed)
    assert resumed.get_scale() == 2.0
    quiet = ampx.GradScaler("cpu", on_min_scale="ignore")
    quiet.load_state_dict(torch.amp.GradScaler("cpu", init_scale=2.0).state_dict())
    assert quiet._on_min_scale == "ignore"  # (torch's dict has no such key: the setting stays)


@pytest.mark.parametrize("kw,match", [
    ({"growth_factor": 0.5}, "growth_factor must be a finite number >= 1"),
    ({"growth_factor": math.inf}, "growth_factor"),
    ({"backoff_factor": -1.0}, r"backoff_factor must be a number in \(0, 1\]"),
    ({"backoff_factor": 0.0}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"min_scale": 4.0, "max_scale": 2.0}, "max_scale must be a number >= min_scale"),
    ({"min_scale": math.nan}, "min_scale"),
    ({"max_scale": math.nan}, "max_scale"),
    ({"hysteresis": 0}, "hysteresis"),
])
def test_update_scale_refuses_settings_it_cannot_honour(kw, match):
    from ampx import ops

    scale, tracker = torch.tensor([8.0]), torch.zeros(1, dtype=torch.int32)
    args = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
    extra = {k: v for k, v in kw.items() if k not in args}
    args.update({k: v for k, v in kw.items() if k in args})
    with pytest.raises(ValueError, match="ampx.ops.update_scale_: " + match):
        ops.update_scale_(scale, tracker, torch.ones(1), args["growth_factor"], args["backoff_factor"],
                          args["growth_interval"], **extra)
    assert scale.item() == 8.0 and tracker.item() == 0


@pytest.mark.parametrize("kw", [{"init_scale": -1.0}, {"init_scale": math.nan}, {"min_scale": math.nan},
                                {"max_scale": -1.0}, {"hysteresis": 2.5}, {"backoff_factor": -1.0}])
def test_constructor_refuses_what_load_state_dict_refuses(kw):
    with pytest.raises(ValueError):
        ampx.GradScaler("cpu", **kw)


# ---- exact resume: the clip route travels with the checkpoint --------------------------------

@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
@pytest.mark.parametrize("via", ["state_dict", "pickle"])
@pytest.mark.parametrize("fused_first", [False, True])
def test_resume_takes_the_same_clip_route(opt_name, via, fused_first):
    """Plain optimizers clip by one of two routes, chosen by whether the last step clipped; the
    two differ in the last bit with a scale that is not a power of two, so a resumed run must
    take the route the uninterrupted one takes. fused_first: a fused optimizer (which records no
    route) is clipped first each step, and must not take the plain one's saved route."""
    norms = [0.1, 0.2, 0.1, 5.0, 7.0, 0.3]  # steps 0-2 do not clip; the save is after step 2

    def fresh():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (37, 300, 5, 11)]
        opts = [getattr(torch.optim, opt_name)(params[:3], lr=0.1)]
        if fused_first:
            opts.insert(0, torch.optim.AdamW(params[3:], lr=0.1, fused=True))
        return params, opts, ampx.GradScaler("cpu", init_scale=3000.0)

    def run(params, opts, scaler, steps):
        for k in steps:
            scaler.scale(torch.ones(()))  # as the loss would be
            gen = torch.Generator().manual_seed(k)
            for p in params:
                g = torch.randn(p.shape, generator=gen)
                p.grad = g * (norms[k] / 3.0) * scaler.get_scale()
            for opt in opts:
                scaler.clip_grad_norm_(opt, 1.0)
            for opt in opts:
                scaler.step(opt)
            scaler.update()

    pa, oa, sa = fresh()
    run(pa, oa, sa, range(6))
    pb, ob, sb = fresh()
    run(pb, ob, sb, range(3))
    if via == "pickle":
        blob = pickle.dumps(sb)
    saved = ([p.detach().clone() for p in pb], [o.state_dict() for o in ob], sb.state_dict())
    pc, oc, sc = fresh()
    with torch.no_grad():
        for p, q in zip(pc, saved[0]):
            p.copy_(q)
    for o, sd in zip(oc, saved[1]):
        o.load_state_dict(sd)
    if via == "pickle":
        sc = pickle.loads(blob)
    else:
        sc.load_state_dict(saved[2])
    assert saved[2]["_clip_active"] == [False]
    run(pc, oc, sc, range(3, 6))
    for p, q in zip(pa, pc):
        assert torch.equal(p, q)


def test_unscale_with_a_gradient_on_an_unusable_device_writes_nothing_and_can_retry():
    """CPU and meta gradients: the error comes before any gradient is unscaled, names the
    parameter, and leaves the stage READY, so a retry does not unscale twice."""
    model = _model(0)
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [meta]}], lr=0.1)
    scaler = ampx.GradScaler("cpu", init_scale=4.0, named_parameters=[("meta.w", meta)])
    scaler.scale(model(torch.randn(4, 16)).sum()).backward()
    meta.grad = torch.zeros(3, device="meta")
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="gradient of meta.w is on device meta.*nothing was unscaled"):
        scaler.unscale_(opt)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    meta.grad = None  # the user fixes it; the retry unscales exactly once
    scaler.unscale_(opt)
    assert all(torch.equal(p.grad, b / 4) for p, b in zip(model.parameters(), before))


def test_a_failing_collective_in_a_sharded_clip_writes_nothing(tmp_path, monkeypatch):
    """Sharded plain optimizers never take the clip route that unscales before the step's one
    all-reduce: if that collective fails, every gradient is as it was and a retry is safe."""
    import torch.distributed as dist

    from ampx import sharding

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampx.GradScaler("cpu", init_scale=3000.0, process_group=dist.group.WORLD)
        for attempt in range(2):  # the first step leaves the "did not clip" hint behind
            scaler.scale(model(torch.randn(4, 16)).sum()).backward()
            if attempt == 1:
                before = [p.grad.clone() for p in model.parameters()]

                def broken(*a, **k):
                    raise RuntimeError("Connection closed by peer (injected)")

                monkeypatch.setattr(sharding, "_all_reduce", broken)
                with pytest.raises(RuntimeError, match=r"ampx\.GradScaler\(process_group=\.\.\.\): the step's "
                                   r"all-reduce of the overflow flag and the local norm over .*gloo, 1 ranks.*"
                                   r"Connection closed by peer \(injected\)"):
                    scaler.clip_grad_norm_(opt, 1e6)
                assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
                monkeypatch.undo()
            scaler.clip_grad_norm_(opt, 1e6)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("args,exc,words", [
    ((None,), TypeError, "max_norm must be a real number or a one-element tensor, not None"),
    ((torch.ones(2),), ValueError, "max_norm must be a real number"),
    ((1.0, "fro"), ValueError, "norm_type must be a real number or a one-element tensor, not 'fro'"),
])
def test_clip_arguments_are_checked_before_any_pass(args, exc, words):
    """issue 29: a bad clip argument is refused before the pass (sharded, before the step's
    collective, so it can reach the other ranks): nothing unscaled, and a retry works."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ampx.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    p.grad = torch.full((3,), 8.0)
    with pytest.raises(exc, match=r"ampx\.GradScaler\.clip_grad_norm_: " + words):
        scaler.clip_grad_norm_(opt, *args)
    assert torch.equal(p.grad, torch.full((3,), 8.0))
    assert float(scaler.clip_grad_norm_(opt, 1e9)) == pytest.approx(2.0 * math.sqrt(3))


def test_check_written_refuses_what_a_write_would_and_writes_nothing():
    """_C.check_written (the sharded clip's check before its collective) against the write itself:
    the same refusals with the same text, and no version bumped."""
    views = [torch.arange(6.0).view(2, 3).t(), torch.zeros(4)]
    before = [v._version for v in views]
    ampx._C.check_written("ampx.ops.mul_", views, -1)  # non-contiguous is fine to write
    assert [v._version for v in views] == before
    with torch.inference_mode():
        inf = torch.zeros(2)
    for bad in (torch.zeros(1).expand(4), inf):
        with pytest.raises(Exception) as want:
            ampx.ops.mul_([torch.zeros(2), bad], 2.0)
        with pytest.raises(type(want.value)) as got:
            ampx._C.check_written("ampx.ops.mul_", [torch.zeros(2), bad], -1)
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize("call", [
    lambda fi: ampx.ops.unscale_([torch.ones(2)], 0.5, fi),
    lambda fi: ampx.ops.check_finite([torch.ones(2)], fi),
    lambda fi: ampx.ops.norm([torch.ones(2)], found_inf=fi),
    lambda fi: ampx.ops.cast_([torch.ones(2)], [torch.zeros(2)], found_inf=fi),
])
def test_a_found_inf_that_requires_grad_is_refused(call):
    fi = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match=r"ampx\.ops\.\w+: found_inf requires grad"):
        call(fi)
    assert fi.item() == 0.0


def test_a_non_list_argument_names_the_op():
    with pytest.raises(TypeError, match=r"ampx\.ops\.cast_: src must be a Tensor or a sequence of Tensors, not NoneType"):
        ampx.ops.cast_(None, [torch.zeros(2)])


def test_a_disabled_scaler_falls_back_to_torchs_clip_where_ampx_cannot_read(monkeypatch):
    """A disabled scaler clips with ampx's kernels; where they refuse the gradients (a CUDA
    machine without ampx's kernels, wrapper tensors) torch's clip does it instead, unchanged."""
    from ampx import ops

    def refuse(*a, **k):
        raise ValueError("ampx.ops.norm: tensors[0] is on cuda:0, but ampx was built without its CUDA kernels")

    model, ref = _model(0), _model(0)
    x = torch.randn(4, 16)
    for m in (model, ref):
        m(x).sum().backward()
    monkeypatch.setattr(ops, "norm", refuse)
    scaler = ampx.GradScaler("cpu", enabled=False)
    got = scaler.clip_grad_norm_(torch.optim.SGD(model.parameters(), lr=0.1), 0.01)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert torch.equal(got, want) and scaler.stats()["last_norm"] == want.item()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


class _DrivesScaler(torch.optim.SGD):
    """An optimizer on torch's deprecated contract: its step takes the scaler itself."""
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.seen.append(grad_scaler)
        grad_scaler._check_inf_per_device(self)  # what such optimizers do with it


def test_optimizer_taking_grad_scaler_is_handed_the_scaler_every_step():
    p = torch.nn.Parameter(torch.ones(3))
    opt = _DrivesScaler([p], lr=0.1)
    opt.seen = []
    scaler = ampx.GradScaler("cpu")
    for _ in range(3):  # the signature check is cached after the first step: still right
        scaler.scale(p.sum()).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(opt)
        scaler.update()
    assert opt.seen == [scaler] * 3
    assert ampx.integrations._wrappers.drives_scaler_itself(torch.optim.SGD([p]).step) is False
