"""Parity of ampx.GradScaler with torch.amp.GradScaler, on CPU.

PyTorch checks its scaler with the device-generic ``test_grad_scaling_*`` tests of
``test/test_torch.py`` (plus a few neighbours: ``test_pickle_gradscaler``,
``test_grad_scale_will_not_overflow``, ``test_grad_scaler_pass_itself``,
``test_params_invalidated_with_grads_invalidated_between_unscale_and_step`` and
``test_optim.py::test_grad_scaling_autocast_fused_optimizers``).  Every behaviour those
tests check has a counterpart here, written against ``ampx.GradScaler(device="cpu")``;
the section headers below name the torch test each group mirrors.

Two kinds of reference are used:

* an unscaled fp32 run of a twin model that skips the same optimizer step the scaled
  run overflows on (torch's own method), and
* the same scaled run driven by ``torch.amp.GradScaler`` (ampx claims to be a drop-in,
  so its scale, growth tracker, gradients, optimizer state and parameters must agree).

torch's helpers ``_create_scaling_models_optimizers`` / ``_create_scaling_case`` live in
``torch.testing._internal.common_cuda``, which needs the ``expecttest`` package to import;
this file therefore builds the same case (two 8x8 Linear layers, four 8x8 batches, MSE,
lr=1, an overflow injected at iteration 2) itself.

Known deviations of ampx from torch were kept as ``xfail(strict=True)`` tests whose
reason starts with "BUG:".
"""
import copy
import io
import math
import pickle
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.amp.grad_scaler import OptState

import ampx

FLT_MIN_NORMAL = 1.1754943508222875e-38  # float32's smallest normal: the floor of ampx's dynamic scale
from conftest import CHUNK, special_values

TORCH_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
OVERFLOW_ITER = 2  # the iteration of the 4 whose step the scaled runs force to overflow
N_ITERS = 4


# ------------------------------------------------------------------ helpers --


def ampx_scaler(**kw):
    return ampx.GradScaler(device="cpu", **kw)


def torch_scaler(**kw):
    return torch.amp.GradScaler("cpu", **kw)


def two_layer(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def twins(seed=0):
    """Two models with identical weights."""
    a = two_layer(seed)
    return a, copy.deepcopy(a)


def batches(seed=123, n=N_ITERS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


def make_opt(cls, model, kw=None):
    return cls(model.parameters(), **{"lr": 1.0, **(kw or {})})


mse = nn.MSELoss()


def poison(model):
    """What an fp16 overflow looks like: an inf in one gradient."""
    with torch.no_grad():
        model[1].weight.grad.fill_(float("inf"))


def same(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=msg or None)


def close(actual, expected, atol, rtol=1e-5, msg=""):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=msg or None)


def check_twin_state(ref, sut, opt_ref, opt_sut, cmp):
    for (name, pr), ps in zip(ref.named_parameters(), sut.parameters()):
        cmp(ps.grad, pr.grad, f"grad of {name}")
        sr, ss = opt_ref.state[pr], opt_sut.state[ps]
        assert set(sr) == set(ss), name
        for k in sr:
            a, b = ss[k], sr[k]
            if torch.is_tensor(a) and torch.is_tensor(b) and a.numel() == b.numel() == 1:
                a, b = a.reshape(()), b.reshape(())
            cmp(a, b, f"optimizer state {k} of {name}")
        cmp(ps, pr, f"parameter {name}")


def versus_unscaled(loop, *, grows, backs, atol=1e-7, opt_cls=torch.optim.SGD, opt_kw=None):
    """torch's _run_scaling_case, for ampx.

    ``loop(data, model, opt, scaler, overflow)`` trains for N_ITERS iterations; with
    ``scaler=None`` it is the plain fp32 reference, which must skip the step of
    iteration OVERFLOW_ITER when ``overflow`` is true (where the scaled run injects an inf).
    It may return a replacement scaler (after pickling).  Runs enabled and disabled.
    """
    for enabled in (True, False):
        ref, sut = twins()
        opt_ref, opt_sut = make_opt(opt_cls, ref, opt_kw), make_opt(opt_cls, sut, opt_kw)
        scaler = ampx_scaler(init_scale=128.0, growth_factor=2.0, growth_interval=1, enabled=enabled)
        data = batches()
        loop(data, ref, opt_ref, None, enabled)
        scaler = loop(data, sut, opt_sut, scaler, enabled) or scaler
        assert isinstance(scaler, ampx.GradScaler)
        if enabled:
            assert scaler.get_scale() == 128.0 * 2.0**grows * 0.5**backs
        else:
            assert scaler.get_scale() == 1.0
        check_twin_state(ref, sut, opt_ref, opt_sut, lambda a, b, m: close(a, b, atol, msg=m))


def versus_torch(loop, *, opt_cls=torch.optim.SGD, opt_kw=None, scaler_kw=None, cmp=same):
    """Runs the same scaled loop under torch's scaler and under ampx's; all must agree."""
    skw = {"init_scale": 128.0, "growth_factor": 2.0, "growth_interval": 1, **(scaler_kw or {})}
    ref, sut = twins()
    opt_ref, opt_sut = make_opt(opt_cls, ref, opt_kw), make_opt(opt_cls, sut, opt_kw)
    data = batches()
    s_ref = loop(data, ref, opt_ref, torch_scaler(**skw), True) or None
    s_sut = loop(data, sut, opt_sut, ampx_scaler(**skw), True) or None
    if s_ref is not None:
        assert s_sut.get_scale() == s_ref.get_scale()
        assert s_sut._get_growth_tracker() == s_ref._get_growth_tracker()
    check_twin_state(ref, sut, opt_ref, opt_sut, cmp)


# Training loops, each in the (data, model, opt, scaler, overflow) form above.


def loop_autocast(pickle_each_iter=False):
    def loop(data, model, opt, scaler, overflow):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                loss = mse(model(x), y)
            if scaler is None:
                loss.backward()
                if not (overflow and i == OVERFLOW_ITER):
                    opt.step()
                continue
            scaler.scale(loss).backward()
            if overflow and i == OVERFLOW_ITER and scaler.is_enabled():
                poison(model)
            scaler.step(opt)
            scaler.update()
            if pickle_each_iter:
                scaler = pickle.loads(pickle.dumps(scaler))
        return scaler

    return loop


def loop_plain(data, model, opt, scaler, overflow):
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = mse(model(x), y)
        if scaler is None:
            loss.backward()
            if not (overflow and i == OVERFLOW_ITER):
                opt.step()
            continue
        scaler.scale(loss).backward()
        if overflow and i == OVERFLOW_ITER and scaler.is_enabled():
            poison(model)
        scaler.step(opt)
        scaler.update()
    return scaler


# --------------------------------------------------------------- drop-in --


def test_is_a_torch_grad_scaler():
    s = ampx_scaler()
    assert isinstance(s, torch.amp.GradScaler)
    assert s.is_enabled()
    assert s.get_scale() == 2.0**16
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (2.0, 0.5, 2000)


def test_constructor_emits_no_deprecation_warning():
    # test_grad_scaler_deprecated_warning: only torch.cpu.amp.GradScaler(...) warns.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ampx_scaler(init_scale=2.0)


@pytest.mark.parametrize("kw", [{"growth_factor": 1.0}, {"growth_factor": 0.5}, {"backoff_factor": 1.0},
                                {"backoff_factor": 2.0}])
def test_constructor_rejects_bad_factors_like_torch(kw):
    with pytest.raises(AssertionError) as t:
        torch_scaler(**kw)
    with pytest.raises(AssertionError) as a:
        ampx_scaler(**kw)
    assert str(a.value) == str(t.value)


# ----------------------------------------------------- test_grad_scaling_unscale --

HSET_UNSCALE = settings(max_examples=40, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _scaler_with_grads(scaler, grads, scale=4.0):
    """An optimizer over fresh params that hold ``grads`` (any layout); scale lazily set."""
    params = [nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.SGD(params, lr=1.0)
    scaler.scale(torch.ones(()))
    if scale is not None:
        scaler.update(float(scale))  # sets the scale; nothing recorded yet
    return params, opt


def _found_inf(scaler, opt):
    per_device = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    return sum(v.item() for v in per_device.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unscale_dense_layouts(dtype):
    g = torch.full((20, 20), 4.0, dtype=dtype)
    ginf, gnan = g.clone(), g.clone()
    ginf[2, 2] = math.inf
    gnan[2, 2] = math.nan
    cases = [
        ([g.clone(), g.clone()], False),
        ([g.clone(), g.clone().t()], False),  # not contiguous, but dense
        ([g.clone(), g.clone()[:, :5]], False),  # not dense
        ([g.clone()[:, :5], g.clone()[:, :5]], False),
        ([g.clone(), ginf.clone()], True),
        ([g.clone(), gnan.clone()], True),
        ([g.clone(), ginf.clone()[:, :5]], True),
        ([g.clone(), gnan.clone()[:, :5]], True),
        ([ginf.clone(), g.clone()[:, :5]], True),
        ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
        ([g.clone().t()[::2], gnan.clone().t()[2::3]], True),
    ]
    for grads, bad in cases:
        scaler = ampx_scaler()
        params, opt = _scaler_with_grads(scaler, grads)
        scaler.unscale_(opt)
        assert _found_inf(scaler, opt) == (1.0 if bad else 0.0), [t.stride() for t in grads]
        if not bad:
            for p in params:
                same(p.grad, torch.ones_like(p.grad))
        assert all(p.grad is g_ for p, g_ in zip(params, grads)), "dense grads are unscaled in place"
        assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED


def _perfect_storm(inject):
    g = torch.full((20, 20), 4.0)
    grads = [g.clone(), g.clone()[:, :5], g.half(), g.half(), g.bfloat16(), g.double().t(), g.clone()[::2, 1:]]
    if inject >= 0:
        grads[inject][2, 2] = math.inf
    return grads


def test_unscale_grads_hook_mixed_dtypes_and_layouts():
    # torch's "perfect storm": grads of several dtypes and layouts in one optimizer; an
    # inf planted in any one of them must be found; without it all are unscaled.
    scaler = ampx_scaler()
    params = [torch.empty_like(t) for t in _perfect_storm(-1)]
    opt = torch.optim.SGD(params, lr=1.0)
    inv = torch.full((1,), 0.25)
    for inject in range(-1, len(params)):
        grads = _perfect_storm(inject)
        for p, t in zip(params, grads):
            p.grad = t
        found = torch.full((1,), 0.0)
        per_device = scaler._unscale_grads_(opt, inv, found, True)
        assert list(per_device) == [torch.device("cpu")]
        assert sum(v.item() for v in per_device.values()) == (0.0 if inject < 0 else 1.0), inject
        if inject < 0:
            for t in grads:
                same(t, torch.ones_like(t))


def test_unscale_grads_hook_leaves_found_inf_argument_alone():
    for make in (torch_scaler, ampx_scaler):
        scaler = make()
        p = nn.Parameter(torch.zeros(3))
        p.grad = torch.tensor([1.0, math.inf, 2.0])
        opt = torch.optim.SGD([p], lr=1.0)
        found = torch.zeros(1)
        per_device = scaler._unscale_grads_(opt, torch.ones(1), found, False)
        assert per_device[torch.device("cpu")].item() == 1.0
        assert found.item() == 0.0, type(scaler)
        assert per_device[torch.device("cpu")] is not found


def _odd_grads():
    """The same values and layouts on every call: several dtypes, strides, subnormals."""
    g = torch.Generator().manual_seed(7)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return [r(33, 17) * 1e3, r(5, 40, dtype=torch.float64), r(64).bfloat16(), r(10, 10)[:, 3:], r(9, 4).t(),
            torch.zeros(0), r(3) * 1e-41, r(6, 6)[::2, ::3] * 1e-3, r(2, 3, dtype=torch.float64).t() * 1e300]


@pytest.mark.parametrize("scale", [3.0, 2.0**-7, 65536.0, 1e-30, 7e30, 0.1])
def test_unscale_bitwise_matches_torch(scale, simd):
    runs = []
    for make in (torch_scaler, ampx_scaler):
        scaler = make()
        params, opt = _scaler_with_grads(scaler, _odd_grads(), scale=scale)
        scaler.unscale_(opt)
        runs.append(([p.grad for p in params], _found_inf(scaler, opt)))
    (g_t, f_t), (g_a, f_a) = runs
    assert f_a == f_t
    for a, b in zip(g_a, g_t):
        assert a.dtype == b.dtype and a.stride() == b.stride()
        same(a, b)


def test_unscale_found_inf_matches_torch_on_nonfinite_values():
    # torch still unscales every gradient of an overflowing step; so must ampx.
    for bad in (math.inf, -math.inf, math.nan):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            outs = []
            for make in (torch_scaler, ampx_scaler):
                g = torch.linspace(-3, 3, 50).to(dtype)
                g[17] = bad
                scaler = make()
                params, opt = _scaler_with_grads(scaler, [g, torch.full((3,), 6.0)], scale=3.0)
                scaler.unscale_(opt)
                outs.append((_found_inf(scaler, opt), [p.grad for p in params]))
            assert outs[0][0] == outs[1][0] == 1.0, (bad, dtype)
            for a, b in zip(outs[1][1], outs[0][1]):
                same(a, b)


@pytest.mark.parametrize("where", [-1, 0, 1, 2])
def test_unscale_large_grads_threaded_matches_torch(where, threaded):
    # Gradients past the kernels' parallel threshold (and its single-thread twin): the
    # unscaled values and the overflow flag must be torch's, wherever the inf sits.
    n = ampx._C.PARALLEL_MIN + 4099
    outs = []
    for make in (torch_scaler, ampx_scaler):
        g = torch.Generator().manual_seed(11)
        grads = [torch.randn(n, generator=g), torch.randn(n // 3, 3, generator=g).t(),
                 torch.randn(n, generator=g).bfloat16()]
        if where >= 0:
            grads[where][(-1,) * grads[where].dim()] = math.inf  # the last element
        scaler = make()
        params, opt = _scaler_with_grads(scaler, grads, scale=1 / 3)
        scaler.unscale_(opt)
        outs.append((_found_inf(scaler, opt), [p.grad for p in params]))
    assert outs[1][0] == outs[0][0] == (0.0 if where < 0 else 1.0)
    for a, b in zip(outs[1][1], outs[0][1]):
        same(a, b)


@HSET_UNSCALE
@given(
    seed=st.integers(0, 2**32 - 1),
    sizes=st.lists(st.sampled_from([0, 1, 7, 8, 9, 15, 16, 17, 33, 100, CHUNK - 1, CHUNK + 1]), min_size=1,
                   max_size=4),
    scale=st.sampled_from([1.0, 3.0, 1 / 3, 2.0**24, 2.0**-24, 1.2e-38, 1e38]),
    p_special=st.sampled_from([0.0, 0.001, 0.2]),
)
def test_unscale_random_special_values_match_torch(seed, sizes, scale, p_special):
    # Random gradients of every dtype the scaler unscales (fp16 excluded: refused), some
    # strided, with inf/NaN/-0/subnormals/near-max values sprinkled in.
    import numpy as np

    def build():
        rng = np.random.default_rng(seed)
        grads = []
        for k, n in enumerate(sizes):
            dt = (torch.float32, torch.bfloat16, torch.float64)[int(rng.integers(0, 3))]
            t = special_values(dt, 2 * n if k % 2 else n, rng, p_special=p_special)
            grads.append(t[::2] if k % 2 else t)
        return grads

    outs = []
    for make in (torch_scaler, ampx_scaler):
        scaler = make()
        params, opt = _scaler_with_grads(scaler, build(), scale=scale)
        scaler.unscale_(opt)
        outs.append((_found_inf(scaler, opt), [p.grad for p in params]))
    assert outs[1][0] == outs[0][0]
    for a, b in zip(outs[1][1], outs[0][1]):
        same(a, b)


def test_unscale_overflow_from_huge_finite_values():
    # A finite grad times inv_scale > 1 can overflow to inf; torch's check looks at the
    # input only, so the step is not skipped: the result must match torch bit for bit.
    outs = []
    for make in (torch_scaler, ampx_scaler):
        scaler = make()
        params, opt = _scaler_with_grads(scaler, [torch.tensor([3e38, -3e38, 1.0])], scale=0.25)
        scaler.unscale_(opt)
        outs.append((params[0].grad.clone(), _found_inf(scaler, opt)))
    same(outs[1][0], outs[0][0])
    assert outs[1][1] == outs[0][1]


def test_unscale_refuses_fp16_grads_like_torch():
    msgs = []
    for make in (torch_scaler, ampx_scaler):
        scaler = make()
        _, opt = _scaler_with_grads(scaler, [torch.ones(4), torch.ones(4, dtype=torch.float16)])
        with pytest.raises(ValueError) as e:
            scaler.unscale_(opt)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] == "Attempting to unscale FP16 gradients."


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float16), (torch.float16, torch.float32),
                                    (torch.bfloat16, torch.float32, torch.float16)], ids=str)
def test_fp16_refusal_leaves_every_grad_untouched(dtypes):
    # torch refuses before unscaling anything, and the optimizer stays READY.
    for make in (torch_scaler, ampx_scaler):
        scaler = make()
        grads = [torch.full((40,), 8.0, dtype=d) for d in dtypes]
        params, opt = _scaler_with_grads(scaler, grads)
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            scaler.unscale_(opt)
        for p in params:
            same(p.grad, torch.full((40,), 8.0, dtype=p.dtype))
        assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY


def test_unscale_skips_params_without_grads():
    scaler = ampx_scaler()
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    a.grad = torch.full((3,), 8.0)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=1.0)
    scaler.scale(torch.ones(()))
    scaler.update(4.0)
    scaler.unscale_(opt)
    same(a.grad, torch.full((3,), 2.0))
    assert b.grad is None


# ------------------------------------------------ test_grad_scaling_update_scale --


def _one_iteration(scaler, opt, p, overflow):
    scaler.scale(torch.ones(()))
    p.grad = torch.full_like(p, math.inf if overflow else 1.0)
    scaler.step(opt)
    scaler.update()


def test_update_rule_grow_after_interval_and_back_off():
    scaler = ampx_scaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    _one_iteration(scaler, opt, p, False)
    assert (scaler._get_growth_tracker(), scaler.get_scale()) == (1, 4.0)
    _one_iteration(scaler, opt, p, False)
    assert (scaler._get_growth_tracker(), scaler.get_scale()) == (0, 8.0)
    _one_iteration(scaler, opt, p, True)
    assert (scaler._get_growth_tracker(), scaler.get_scale()) == (0, 2.0)
    _one_iteration(scaler, opt, p, False)
    _one_iteration(scaler, opt, p, True)  # an overflow also resets a half-filled tracker
    assert (scaler._get_growth_tracker(), scaler.get_scale()) == (0, 0.5)
    assert scaler._scale.dtype == torch.float32 and scaler._growth_tracker.dtype == torch.int32


HSET = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@HSET
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=12),
    init_scale=st.sampled_from([1.0, 3.0, 65536.0, 2.0**-20, 1e38, 3e-39, 0.1, 0.0, math.inf]),
    growth=st.sampled_from([2.0, 3.0, 1.5, 1.0000001, 1e10]),
    backoff=st.sampled_from([0.5, 0.25, 0.3, 0.9999999, 1e-10, 0.0]),
    interval=st.integers(0, 4),
    start_tracker=st.integers(0, 6),
)
def test_update_rule_matches_torch(flags, init_scale, growth, backoff, interval, start_tracker):
    kw = dict(init_scale=init_scale, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    if init_scale in (0.0, math.inf, 3e-39) or backoff == 0.0 or interval == 0:
        # Beyond torch: settings that give a zero, inf or subnormal scale (NaN in the model)
        # or a tracker that can never count are refused where they enter (torch takes them).
        torch_scaler(**kw)
        with pytest.raises(ValueError):
            ampx_scaler(**kw)
        return
    scalers = [torch_scaler(**kw), ampx_scaler(**kw)]
    for s in scalers:
        # A tracker (even one past the interval, as a checkpoint may hold) via load_state_dict.
        s.load_state_dict({**torch_scaler(**kw).state_dict(), "_growth_tracker": start_tracker})
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for i, flag in enumerate(flags):
        for s in scalers:
            _one_iteration(s, opt, p, flag)
        t, a = scalers
        if t.get_scale() < FLT_MIN_NORMAL:  # torch's scale went subnormal or 0: ampx's stops at the floor
            assert a.get_scale() == torch.tensor(FLT_MIN_NORMAL, dtype=torch.float32).item()
            return
        assert a._scale.view(torch.int32).item() == t._scale.view(torch.int32).item(), (i, t._scale, a._scale)
        assert a._get_growth_tracker() == t._get_growth_tracker(), i


def test_update_with_explicit_new_scale_like_torch():
    # A float, a 0-dim tensor and (refused by torch's copy_ into its 0-dim scale) a 1-element
    # 1-dim tensor: ampx must do what torch does with each.
    for value in (8.0, torch.tensor(16.0)):
        outcomes = []
        for make in (torch_scaler, ampx_scaler):
            s = make(init_scale=2.0)
            s.scale(torch.ones(()))
            try:
                s.update(value)
                outcomes.append(s.get_scale())
            except Exception as e:  # noqa: BLE001
                outcomes.append((type(e), str(e)))
        assert outcomes[1] == outcomes[0], value
        assert outcomes[0] == float(value)
    # Beyond torch: a 1-element 1-dim tensor, which torch's copy_ into its 0-dim scale refuses
    s = ampx_scaler(init_scale=2.0)
    s.scale(torch.ones(()))
    s.update(torch.tensor([32.0]))
    assert s.get_scale() == 32.0
    # The scaler keeps its own copy of a tensor new_scale.
    s = ampx_scaler()
    s.scale(torch.ones(()))
    v = torch.tensor(5.0)
    s.update(v)
    v.fill_(9.0)
    assert s.get_scale() == 5.0


def test_scale_growth_never_overflows():
    # test_grad_scale_will_not_overflow: a growth that would give inf is not applied.
    results = []
    for make in (torch_scaler, ampx_scaler):
        torch.manual_seed(0)
        model = nn.Linear(5, 1)
        opt = torch.optim.Adam(model.parameters())
        scaler = make(growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
        x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        assert math.isfinite(scaler.get_scale())
        results.append(scaler.get_scale())
    assert results[0] == results[1]
    # And the pure rule, with no overflow at all: 1e38 * 16 is not finite in float32.
    scaler = ampx_scaler(growth_interval=1, growth_factor=16.0, init_scale=1e38)
    p = nn.Parameter(torch.zeros(1))
    _one_iteration(scaler, torch.optim.SGD([p], lr=0.0), p, False)
    assert scaler.get_scale() == torch.tensor(1e38).item()
    assert scaler._get_growth_tracker() == 0


# ----------------------------------------------- test_grad_scaling_unscale_sparse --


def test_unscale_grads_hook_sparse():
    scaler = ampx_scaler()
    cpu = torch.device("cpu")
    inv = torch.full((1,), 0.25)
    idx = torch.tensor([[0, 1, 1], [2, 0, 2]])
    s = torch.sparse_coo_tensor(idx, torch.tensor([16.0, 32.0, 64.0]), (2, 3), check_invariants=True)

    p = s.clone()
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone()
    found = scaler._unscale_grads_(opt, inv, torch.zeros(1), False)[cpu]
    assert found.item() == 0.0
    same(p.grad.to_dense(), (s / 4).to_dense())

    for bad in (math.inf, math.nan):
        p.grad = torch.sparse_coo_tensor(idx, torch.tensor([16.0, 32.0, bad]), (2, 3), check_invariants=True)
        found = scaler._unscale_grads_(opt, inv, torch.zeros(1), False)[cpu]
        assert found.item() == 1.0, bad

    p = s.clone().half()
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone().half()
    found = scaler._unscale_grads_(opt, inv, torch.zeros(1), True)[cpu]
    assert found.item() == 0.0
    same(p.grad.to_dense(), (s.half() / 4).to_dense())

    # fp16 with a duplicated index: each value fits in fp16, their sum (128000) does not.
    # The gradient must be coalesced before the check, so the overflow is reported.
    dup = torch.tensor([[0, 1, 0], [2, 0, 2]])
    p.grad = torch.sparse_coo_tensor(dup, torch.tensor([64000.0, 32.0, 64000.0]), (2, 3), dtype=torch.float16,
                                     check_invariants=True)
    assert not p.grad.is_coalesced()
    found = scaler._unscale_grads_(opt, inv, torch.zeros(1), True)[cpu]
    assert found.item() == 1.0
    # and fp16 sparse grads are refused by unscale_ proper, as torch does
    p.grad = s.clone().half()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler._unscale_grads_(opt, inv, torch.zeros(1), False)


class EmbedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.head = nn.Linear(6, 1)

    def forward(self, idx):
        return self.head(self.emb(idx)).sum()


@pytest.mark.parametrize("dense_first", [False, True])
def test_unscale_mixed_dense_and_sparse_grads_once_each(dense_first):
    torch.manual_seed(3)
    nets = [EmbedNet(), None]
    nets[1] = copy.deepcopy(nets[0])
    idx = torch.tensor([[1, 4, 4, 7], [4, 9, 1, 1]])
    grads = []
    for make, net in zip((torch_scaler, ampx_scaler), nets):
        scaler = make(init_scale=3.0)
        params = [net.emb.weight, net.head.weight, net.head.bias]
        if dense_first:
            params = params[1:] + params[:1]
        opt = torch.optim.SGD(params, lr=0.1)
        scaler.scale(net(idx)).backward()
        scaled = net.head.weight.grad.clone()
        scaled_sparse = net.emb.weight.grad.coalesce().to_dense()
        assert net.emb.weight.grad.is_sparse
        scaler.unscale_(opt)
        inv = torch.tensor(1.0 / 3.0, dtype=torch.float32)
        same(net.head.weight.grad, scaled * inv)
        close(net.emb.weight.grad.coalesce().to_dense(), scaled_sparse * inv, atol=1e-6)
        assert _found_inf(scaler, opt) == 0.0
        grads.append([p.grad.to_dense() for p in net.parameters()])
    for a, b in zip(grads[1], grads[0]):
        same(a, b)


def test_sparse_training_matches_torch():
    torch.manual_seed(5)
    nets = [EmbedNet(), None]
    nets[1] = copy.deepcopy(nets[0])
    g = torch.Generator().manual_seed(9)
    data = [torch.randint(0, 20, (3, 5), generator=g) for _ in range(5)]
    scalers = []
    for make, net in zip((torch_scaler, ampx_scaler), nets):
        scaler = make(init_scale=256.0, growth_interval=2)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        for i, idx in enumerate(data):
            opt.zero_grad()
            scaler.scale(net(idx)).backward()
            if i == 3:
                net.emb.weight.grad._values()[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
        scalers.append(scaler)
    # grows after iteration 1, backs off at iteration 3
    assert scalers[0].get_scale() == scalers[1].get_scale() == 256.0 * 2 * 0.5
    for a, b in zip(nets[1].parameters(), nets[0].parameters()):
        same(a, b)


# ------------------------------------------------ test_grad_scaling_state_dict --


@pytest.mark.parametrize("lazy_init", [True, False])
def test_state_dict_round_trip(lazy_init):
    s0 = ampx_scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = ampx_scaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7  # to be overwritten
    if lazy_init:
        s1.scale(torch.full((1,), 4.0))
        assert isinstance(s1._scale, torch.Tensor) and s1._scale.device.type == "cpu"
        assert s1._scale.dtype == torch.float32
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0
    assert s1._get_growth_tracker() == 0
    if lazy_init:
        assert s1._scale.item() == 3.0
        same(s1.scale(torch.full((1,), 4.0)), torch.full((1,), 12.0))


def test_state_dict_mid_training_matches_torch():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    sds = []
    for make in (torch_scaler, ampx_scaler):
        s = make(init_scale=32.0, growth_interval=3)
        for flag in (False, False, True, False, False):
            _one_iteration(s, opt, p, flag)
        sds.append(s.state_dict())
    assert TORCH_KEYS <= set(sds[1])
    assert {k: sds[1][k] for k in TORCH_KEYS} == sds[0] == {
        "scale": 32.0 * 0.5, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
        "_growth_tracker": 2}
    # The resumed scaler continues exactly where the saved one would have.
    r = ampx_scaler()
    r.load_state_dict(sds[1])
    _one_iteration(r, opt, p, False)
    assert (r.get_scale(), r._get_growth_tracker()) == (32.0, 0)


def test_state_dict_through_torch_save():
    s = ampx_scaler(init_scale=8.0, hysteresis=2)
    s.scale(torch.ones(()))
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sd == s.state_dict()


def test_load_empty_state_dict_raises_like_torch():
    msgs = []
    for make in (torch_scaler, ampx_scaler):
        with pytest.raises(RuntimeError) as e:
            make().load_state_dict({})
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]
    # A disabled scaler's (empty) state dict, loaded by an enabled one, is that case.
    with pytest.raises(RuntimeError, match="disabled instance"):
        ampx_scaler().load_state_dict(ampx_scaler(enabled=False).state_dict())


# ------------------------------------------------- interchange with torch's scaler --


def test_ampx_state_dict_loads_into_torch_scaler():
    a = ampx_scaler(init_scale=64.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=5, hysteresis=3,
                    min_scale=1.0, max_scale=2.0**20)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for flag in (False, False):
        _one_iteration(a, opt, p, flag)
    for lazy in (False, True):
        t = torch_scaler()
        if lazy:
            t.scale(torch.ones(()))
        t.load_state_dict(a.state_dict())
        assert t.get_scale() == 64.0
        assert (t.get_growth_factor(), t.get_backoff_factor(), t.get_growth_interval()) == (3.0, 0.25, 5)
        assert t._get_growth_tracker() == 2
        assert set(t.state_dict()) == TORCH_KEYS


def test_torch_state_dict_loads_into_ampx_with_default_extras():
    t = torch_scaler(init_scale=64.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=5)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    _one_iteration(t, opt, p, False)
    tsd = t.state_dict()
    for lazy in (False, True):
        a = ampx_scaler()
        if lazy:
            a.scale(torch.ones(()))
        a.load_state_dict(tsd)
        sd = a.state_dict()
        assert {k: sd[k] for k in TORCH_KEYS} == tsd
        fresh = ampx_scaler().state_dict()
        for k in set(fresh) - TORCH_KEYS:
            assert sd[k] == fresh[k], k
        # and it trains on exactly as torch's would
        t2 = torch_scaler()
        t2.load_state_dict(tsd)
        for flag in (True, False, False, False, False, False):
            _one_iteration(a, opt, p, flag)
            _one_iteration(t2, opt, p, flag)
            assert a.get_scale() == t2.get_scale() and a._get_growth_tracker() == t2._get_growth_tracker()


def test_torch_state_dict_keeps_ampx_constructor_extras():
    t = torch_scaler(init_scale=64.0)
    a = ampx_scaler(hysteresis=3, min_scale=2.0, max_scale=1024.0, dynamic=True)
    a.load_state_dict(t.state_dict())
    sd = a.state_dict()
    assert (sd["hysteresis"], sd["min_scale"], sd["max_scale"], sd["_hysteresis_tracker"]) == (3, 2.0, 1024.0, 3)
    assert sd["scale"] == 64.0


def test_ampx_state_dict_round_trip_keeps_extras():
    a = ampx_scaler(init_scale=16.0, hysteresis=3, consecutive_hysteresis=True, min_scale=0.5, max_scale=64.0,
                    dynamic=True)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    _one_iteration(a, opt, p, True)  # spends one hysteresis unit, scale kept
    assert a.get_scale() == 16.0
    sd = a.state_dict()
    assert sd["_hysteresis_tracker"] == 2
    b = ampx_scaler()
    b.load_state_dict(sd)
    assert b.state_dict() == sd
    for flag in (True, True, False):
        _one_iteration(a, opt, p, flag)
        _one_iteration(b, opt, p, flag)
        assert a.state_dict() == b.state_dict()


# ------------------------------------------------------- test_pickle_gradscaler --


@pytest.mark.parametrize("lazy_init", [True, False])
def test_pickle(lazy_init):
    a = ampx_scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    assert a.is_enabled()
    if lazy_init:
        a.scale(torch.tensor([4.0]))
        assert a._scale.device.type == "cpu"
    b = pickle.loads(pickle.dumps(a))
    assert type(b) is ampx.GradScaler
    assert b.is_enabled() == a.is_enabled()
    assert b.get_scale() == 3.0
    assert (b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (4.0, 0.5, 2)
    assert b._init_growth_tracker == 0
    fresh = b._per_optimizer_states["fdsa"]
    assert fresh["stage"] is OptState.READY and fresh["found_inf_per_device"] == {}
    if lazy_init:
        same(b.scale(torch.tensor([4.0])), torch.tensor([12.0]))
    d = pickle.loads(pickle.dumps(ampx_scaler(enabled=False)))
    assert not d.is_enabled() and d.get_scale() == 1.0


def test_pickle_mid_training_resumes_identically():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    a = ampx_scaler(init_scale=32.0, growth_interval=3, hysteresis=2)
    for flag in (False, True):
        _one_iteration(a, opt, p, flag)
    b = pickle.loads(pickle.dumps(a))
    assert b.state_dict() == a.state_dict()
    for flag in (True, False, False, False, True):
        _one_iteration(a, opt, p, flag)
        _one_iteration(b, opt, p, flag)
        assert b.state_dict() == a.state_dict()


def test_pickle_mid_iteration_refused_like_torch():
    msgs = []
    for make in (torch_scaler, ampx_scaler):
        s = make()
        p = nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=0.0)
        s.scale(torch.ones(()))
        p.grad = torch.ones(1)
        s.step(opt)
        with pytest.raises(AssertionError) as e:
            pickle.dumps(s)
        msgs.append(str(e.value))
        s.update()
        pickle.dumps(s)  # fine again after update
    assert msgs[0] == msgs[1]


# -------------------------------------------------- test_grad_scaling_autocast --
# (SGD, Adam, AdamW) x (for-loop, foreach, fused) x (pickle the scaler every iteration or not)

OPT_VARIANTS = [
    pytest.param(cls, kw, id=f"{cls.__name__}-{name}")
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
    for name, kw in (("forloop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True}))
]


@pytest.mark.parametrize("pickled", [False, True], ids=["plain", "pickled"])
@pytest.mark.parametrize("opt_kw", [{"foreach": False}, {"foreach": True}, {"fused": True}],
                         ids=["forloop", "foreach", "fused"])
def test_autocast_sgd_vs_unscaled_fp32(opt_kw, pickled):
    # fp16 autocast + scaling against pure fp32: close (atol 1e-3), and the same skipped step.
    versus_unscaled(loop_autocast(pickled), grows=3, backs=1, atol=1e-3, opt_cls=torch.optim.SGD, opt_kw=opt_kw)


@pytest.mark.parametrize("pickled", [False, True], ids=["plain", "pickled"])
@pytest.mark.parametrize("opt_cls,opt_kw", OPT_VARIANTS)
def test_autocast_matches_torch_scaler(opt_cls, opt_kw, pickled):
    # torch's own test cannot hold Adam/AdamW to an fp32 reference (their update amplifies
    # fp16 noise), so ampx is held to torch's scaler on the identical run instead.
    versus_torch(loop_autocast(pickled), opt_cls=opt_cls, opt_kw=opt_kw)


@pytest.mark.parametrize("opt_cls,opt_kw", OPT_VARIANTS)
def test_overflowing_step_is_skipped(opt_cls, opt_kw):
    model = two_layer()
    opt = make_opt(opt_cls, model, opt_kw)
    scaler = ampx_scaler(init_scale=128.0)
    x, y = batches()[0]
    # one clean step so that optimizer state exists
    scaler.scale(mse(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    before = copy.deepcopy(model.state_dict())
    state_before = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    scaler.scale(mse(model(x), y)).backward()
    with torch.no_grad():
        model[0].bias.grad[3] = math.nan
    scaler.step(opt)
    assert scaler.last_step_skipped
    scaler.update()
    assert scaler.get_scale() == 64.0
    for k, v in model.state_dict().items():
        same(v, before[k], msg=k)
    for pid, st_ in opt.state_dict()["state"].items():
        for k, v in st_.items():
            same(v, state_before["state"][pid][k], msg=k)


@pytest.mark.parametrize("opt_cls,opt_kw", [OPT_VARIANTS[2], OPT_VARIANTS[5], OPT_VARIANTS[7]])
def test_bf16_autocast_matches_torch_scaler(opt_cls, opt_kw):
    def loop(data, model, opt, scaler, overflow):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = mse(model(x), y)
            scaler.scale(loss).backward()
            if i == OVERFLOW_ITER:
                poison(model)
            scaler.step(opt)
            scaler.update()
        return scaler

    versus_torch(loop, opt_cls=opt_cls, opt_kw=opt_kw)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_fp16_params_with_fused_optimizer_match_torch(opt_cls):
    # fp16 grads cannot be unscale_()d, but a fused optimizer unscales them itself: the
    # scaler only checks them (read-only), as torch's does.
    outs = []
    for make in (torch_scaler, ampx_scaler):
        model = two_layer().half()
        opt = opt_cls(model.parameters(), lr=1e-3, fused=True)
        scaler = make(init_scale=2.0**10, growth_interval=1)
        for i, (x, _) in enumerate(batches()):
            opt.zero_grad()
            scaler.scale(model(x.half()).float().pow(2).mean()).backward()
            if i == OVERFLOW_ITER:
                poison(model)
            scaler.step(opt)
            assert make is torch_scaler or bool(scaler.last_step_skipped) == (i == OVERFLOW_ITER)
            scaler.update()
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            scaler.scale(model(x.half()).float().sum()).backward()
            scaler.unscale_(opt)
        outs.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    assert outs[0][0] == outs[1][0] == 2.0**10 * 2 * 2 * 0.5 * 2
    for a, b in zip(outs[1][1], outs[0][1]):
        same(a, b)


# ------------- test_params_invalidated_with_grads_invalidated_between_unscale_and_step --


@pytest.mark.parametrize("opt_cls,opt_kw", OPT_VARIANTS)
def test_grads_broken_after_unscale_are_not_rechecked(opt_cls, opt_kw):
    # The inf check happens in unscale_; gradients broken afterwards reach the optimizer,
    # whose parameters then turn to inf/NaN (torch's behaviour, fused optimizers included).
    scales = []
    for make in (torch_scaler, ampx_scaler):
        model = two_layer()
        opt = make_opt(opt_cls, model, opt_kw)
        scaler = make(init_scale=128.0)
        for i, (x, y) in enumerate(batches()):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            for j, p in enumerate(model.parameters()):
                p.grad.copy_(torch.full_like(p.grad, math.inf if j % 2 else math.nan))
            scaler.step(opt)
            scaler.update()
            if i == 0:
                # the first step was taken (its grads were finite at unscale_ time)
                assert scaler.get_scale() == 128.0
                assert all(bool(p.isnan().any() or p.isinf().any()) for p in model.parameters())
        assert all(bool(p.isnan().any() or p.isinf().any()) for p in model.parameters())
        scales.append(scaler.get_scale())
    assert scales[1] == scales[0]


# --------------------------- test_optim.py::test_grad_scaling_autocast_fused_optimizers --


@pytest.mark.parametrize("separate_unscale", [False, True])
@pytest.mark.parametrize("opt_cls,opt_kw", [
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True, "maximize": True}),
], ids=["SGD-momentum", "Adam", "Adam-amsgrad", "AdamW", "AdamW-amsgrad-maximize"])
def test_fused_optimizer_vs_unfused(opt_cls, opt_kw, separate_unscale):
    # Control: the unfused optimizer with torch's scaler (grads unscaled before the step).
    # Test: the fused optimizer with ampx's scaler (grads unscaled inside the fused step,
    # or beforehand when unscale_ is called).
    ref, sut = twins()
    opt_ref = make_opt(opt_cls, ref, {**opt_kw, "foreach": False})
    opt_sut = make_opt(opt_cls, sut, {**opt_kw, "fused": True})
    s_ref, s_sut = torch_scaler(init_scale=128.0), ampx_scaler(init_scale=128.0)
    tol = {"atol": 2e-5, "rtol": 2e-5}
    for i, (x, y) in enumerate(batches()):
        for model, opt, scaler, sep in ((ref, opt_ref, s_ref, False), (sut, opt_sut, s_sut, separate_unscale)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(model(x), y)
            scaler.scale(loss).backward()
            if i == OVERFLOW_ITER:
                poison(model)
            if sep:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        if i == OVERFLOW_ITER:
            # skipped step: a fused optimizer leaves its grads scaled (it never ran), the
            # unfused path has unscaled them; parameters and state must be untouched alike
            for name, v in sut.state_dict().items():
                close(v, ref.state_dict()[name], msg=name, **tol)
        else:
            check_twin_state(ref, sut, opt_ref, opt_sut, lambda a, b, m: close(a, b, msg=m, **tol))
    assert s_sut.get_scale() == s_ref.get_scale() == 128.0 * 0.5


# ------------------------------------------------ test_grad_scaling_clipping --


def loop_clip_scaled(data, model, opt, scaler, overflow):
    max_norm = 0.2
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = mse(model(x), y)
        if scaler is None:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if not (overflow and i == OVERFLOW_ITER):
                opt.step()
            continue
        scaler.scale(loss).backward()
        # clipping the still-scaled grads to a scaled threshold
        nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
        if overflow and i == OVERFLOW_ITER and scaler.is_enabled():
            poison(model)
        scaler.step(opt)
        scaler.update()
    return scaler


def test_clipping_scaled_grads():
    versus_unscaled(loop_clip_scaled, grows=3, backs=1, atol=1e-5)


def loop_clip_after_unscale(data, model, opt, scaler, overflow):
    max_norm = 0.2
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = mse(model(x), y)
        if scaler is None:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if not (overflow and i == OVERFLOW_ITER):
                opt.step()
            continue
        scaler.scale(loss).backward()
        if overflow and i == OVERFLOW_ITER and scaler.is_enabled():
            poison(model)
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
        scaler.step(opt)
        scaler.update()
    return scaler


def test_clipping_after_unscale():
    versus_unscaled(loop_clip_after_unscale, grows=3, backs=1)


def test_clipping_after_unscale_matches_torch_scaler():
    versus_torch(loop_clip_after_unscale)


# ----------------------------------------------------- test_grad_scaling_penalty --


def loop_penalty(data, model, opt, scaler, overflow):
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = mse(model(x), y)
        if scaler is None:
            gs = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        else:
            scaled = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
            inv = 1.0 / scaler.get_scale()
            gs = [g * inv for g in scaled]
        penalty = torch.stack([g.pow(2).sum() for g in gs]).sum().sqrt()
        loss = loss + penalty
        if scaler is None:
            loss.backward()
            if not (overflow and i == OVERFLOW_ITER):
                opt.step()
            continue
        scaler.scale(loss).backward()
        if overflow and i == OVERFLOW_ITER and scaler.is_enabled():
            poison(model)
        scaler.step(opt)
        scaler.update()
    return scaler


def test_gradient_penalty():
    versus_unscaled(loop_penalty, grows=3, backs=1)


# ------------------------------------------------ test_grad_scaling_accumulation --


def loop_accumulate(data, model, opt, scaler, overflow):
    every = 2
    for i, (x, y) in enumerate(data):
        loss = mse(model(x), y) / every
        (loss if scaler is None else scaler.scale(loss)).backward()
        if (i + 1) % every:
            continue
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return scaler


def test_gradient_accumulation():
    versus_unscaled(loop_accumulate, grows=2, backs=0)


@pytest.mark.parametrize("loop", [loop_plain, loop_clip_scaled, loop_clip_after_unscale, loop_penalty, loop_accumulate],
                         ids=["plain", "clip_scaled", "clip_after_unscale", "penalty", "accumulate"])
@pytest.mark.parametrize("opt_cls,opt_kw", [OPT_VARIANTS[0], OPT_VARIANTS[5], OPT_VARIANTS[8]])
def test_torch_loops_bitwise_like_torch_scaler(loop, opt_cls, opt_kw):
    # The fp32 loops of the torch tests above, under torch's scaler and under ampx's.
    versus_torch(loop, opt_cls=opt_cls, opt_kw={**(opt_kw or {}), "lr": 0.01})


def test_gradient_accumulation_overflow_in_any_micro_batch_skips():
    model = two_layer()
    opt = make_opt(torch.optim.SGD, model)
    scaler = ampx_scaler(init_scale=128.0)
    before = copy.deepcopy(model.state_dict())
    (x0, y0), (x1, y1) = batches()[:2]
    scaler.scale(mse(model(x0), y0)).backward()
    poison(model)  # the first micro-batch overflowed
    scaler.scale(mse(model(x1), y1)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 64.0
    for k, v in model.state_dict().items():
        same(v, before[k])


# --------------------------------------------------- test_grad_scaling_multiple --


def test_two_models_two_optimizers_two_losses():
    for enabled in (True, False):
        ref0, sut0 = twins(0)
        ref1, sut1 = twins(1)
        opts_ref = [make_opt(torch.optim.SGD, m) for m in (ref0, ref1)]
        opts_sut = [make_opt(torch.optim.SGD, m) for m in (sut0, sut1)]
        scaler = ampx_scaler(init_scale=128.0, growth_factor=2.0, growth_interval=1, enabled=enabled)
        data = batches()

        def run(m0, m1, o0, o1, use_scaler):
            for i, (x, y) in enumerate(data):
                o0.zero_grad()
                o1.zero_grad()
                out0, out1 = m0(x), m1(x)
                loss_a = mse(0.3 * out0 + 0.7 * out1, y)
                loss_b = mse(0.6 * out0 - 0.4 * out1, y)
                overflow = enabled and i == OVERFLOW_ITER
                if not use_scaler:
                    loss_a.backward(retain_graph=True)
                    loss_b.backward()
                    o0.step()  # only model 1 overflows: model 0 still steps
                    if not overflow:
                        o1.step()
                    continue
                scaler.scale(loss_a).backward(retain_graph=True)
                scaler.scale(loss_b).backward()
                if overflow:
                    poison(m1)
                scaler.unscale_(o0)  # one optimizer unscaled explicitly, the other in step
                scaler.step(o0)
                assert not scaler.last_step_skipped
                scaler.step(o1)
                assert bool(scaler.last_step_skipped) == overflow
                scaler.update()

        run(ref0, ref1, *opts_ref, False)
        run(sut0, sut1, *opts_sut, True)
        assert scaler.get_scale() == (128.0 * 2.0**3 * 0.5 if enabled else 1.0)
        for c, s in zip(list(ref0.parameters()) + list(ref1.parameters()),
                        list(sut0.parameters()) + list(sut1.parameters())):
            close(s, c, atol=1e-7)


@pytest.mark.parametrize("poisoned", [(0,), (1,), (0, 1)], ids=["first", "second", "both"])
def test_two_optimizers_over_one_model_match_torch(poisoned):
    # Optimizers of different kinds (one fused) sharing a scaler, against torch's scaler;
    # an overflow in either or both backs the scale off once.
    def loop(data, model, _opt, scaler, overflow):
        o0 = torch.optim.SGD(model[0].parameters(), lr=0.5, momentum=0.9)
        o1 = torch.optim.Adam(model[1].parameters(), lr=0.01, fused=True)
        for i, (x, y) in enumerate(data):
            o0.zero_grad()
            o1.zero_grad()
            scaler.scale(mse(model(x), y)).backward()
            if overflow and i == OVERFLOW_ITER:
                with torch.no_grad():
                    for k in poisoned:
                        model[k].weight.grad[0, 0] = math.inf
            scaler.step(o0)
            scaler.step(o1)
            scaler.update()
        return scaler

    versus_torch(loop)
    s = loop(batches(), two_layer(), None, ampx_scaler(init_scale=128.0, growth_interval=1), True)
    assert s.get_scale() == 128.0 * 2.0**3 * 0.5


# ---------------------------------------------- test_grad_scaler_pass_itself --


class _AmpAwareOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})
        self._step_supports_amp_scaling = True
        self.calls = []


class _OldContractOptimizer(_AmpAwareOptimizer):
    def step(self, closure=None, *, grad_scaler=None):
        self.calls.append((grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf")))


class _NewContractOptimizer(_AmpAwareOptimizer):
    def step(self, closure=None):
        self.calls.append((self.grad_scale.clone(), self.found_inf.clone()))
        return "stepped"


@pytest.mark.parametrize("make", [torch_scaler, ampx_scaler], ids=["torch", "ampx"])
def test_step_supports_amp_scaling_contracts(make):
    torch.manual_seed(0)
    x, m = torch.randn(4, 4), nn.Linear(4, 1)
    o1, o2 = _OldContractOptimizer(m.parameters()), _NewContractOptimizer(m.parameters())
    scaler = make(init_scale=2.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(x).mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    assert o1.calls == [(scaler, False, False)]
    o2.grad_scale = torch.tensor(3.0)  # a grad_scale the user already set is multiplied in
    assert scaler.step(o2) == "stepped"
    (gs, fi), = o2.calls
    assert gs.item() == 6.0 and fi.item() == 0.0
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")
    scaler.update()

    # overflow found by the read-only check; after unscale_ the optimizer gets grad_scale=None
    o3 = _NewContractOptimizer(m.parameters())
    scaler.scale(m(x).mean()).backward()
    m.bias.grad.fill_(math.nan)
    scaler.step(o3)
    assert o3.calls[0][1].item() == 1.0
    scaler.update()
    assert scaler.get_scale() == 1.0
    o4 = _AmpAwareOptimizer(m.parameters())
    seen = []
    o4.step = lambda closure=None: seen.append(o4.grad_scale)
    scaler.scale(m(x).mean()).backward()
    scaler.unscale_(o4)
    scaler.step(o4)
    assert seen == [None]


def test_fused_step_leaves_grads_like_torch():
    # With a fused optimizer the scaler hands grad_scale/found_inf to the kernel and
    # does not unscale on its own: the grads after step must be what torch leaves.
    grads = []
    for make in (torch_scaler, ampx_scaler):
        model = two_layer()
        opt = make_opt(torch.optim.Adam, model, {"fused": True, "lr": 0.01})
        scaler = make(init_scale=1024.0)
        x, y = batches()[0]
        scaler.scale(mse(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        grads.append([p.grad.clone() for p in model.parameters()] + [p.detach().clone() for p in model.parameters()])
    for a, b in zip(grads[1], grads[0]):
        same(a, b)


def test_step_forwards_arguments_and_return_value():
    class Tagged(torch.optim.SGD):
        def step(self, tag=None, closure=None, *, scale_lr=1.0):
            for g in self.param_groups:
                g["lr"] *= scale_lr
            super().step()
            return tag

    outs = []
    for make in (torch_scaler, ampx_scaler):
        model = two_layer()
        opt = Tagged(model.parameters(), lr=0.1)
        scaler = make(init_scale=8.0)
        got = []
        for i, (x, y) in enumerate(batches()):
            opt.zero_grad()
            scaler.scale(mse(model(x), y)).backward()
            if i == 1:
                poison(model)
            got.append(scaler.step(opt, f"it{i}", scale_lr=0.5))
            scaler.update()
        outs.append((got, opt.param_groups[0]["lr"], [p.detach().clone() for p in model.parameters()]))
    assert outs[0][0] == outs[1][0] == ["it0", None, "it2", "it3"]
    assert outs[0][1] == outs[1][1] == 0.1 * 0.5**3
    for a, b in zip(outs[1][2], outs[0][2]):
        same(a, b)


def test_deepcopy_and_setters_like_torch():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scalers = [torch_scaler(init_scale=16.0, growth_interval=2), ampx_scaler(init_scale=16.0, growth_interval=2)]
    for flag in (False, True, False):
        for s in scalers:
            _one_iteration(s, opt, p, flag)
    scalers = [copy.deepcopy(s) for s in scalers]
    for s in scalers:
        s.set_growth_factor(3.0)
        s.set_backoff_factor(0.125)
        s.set_growth_interval(1)
    for flag in (False, True, False, False):
        for s in scalers:
            _one_iteration(s, opt, p, flag)
        assert scalers[0].get_scale() == scalers[1].get_scale()
        assert scalers[0]._get_growth_tracker() == scalers[1]._get_growth_tracker()
    # The tracker stood at 1 when the interval became 1: torch only grows when the tracker
    # hits the interval exactly, so the first clean step after that does not grow.
    assert scalers[1].get_scale() == 16.0 * 0.5 * 0.125 * 3 * 3
    assert isinstance(scalers[1], ampx.GradScaler)


# ------------------------------------------------------- test_grad_scaling_scale --
# (test_cuda.py; the CPU part: nested outputs and the lazy scale tensor)


def test_scale_nested_outputs():
    s = ampx_scaler(init_scale=2.0)
    t1, t2 = torch.full((1,), 4.0), torch.full((1,), 4.0, dtype=torch.float64)
    assert s.scale(t1).item() == 8.0
    out = s.scale([t1, (t2, t1), iter([t1])])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert out[0].item() == 8.0 and out[1][0].item() == 8.0 and out[1][1].item() == 8.0
    assert [t.item() for t in out[2]] == [8.0]
    assert out[1][0].dtype == torch.float64
    assert s._scale.device == t1.device and s._scale.dtype == torch.float32
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        s.scale([t1, 3.0])


# ------------------------------------------------------------- misuse errors --


def _setup(make):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make()
    return scaler, model, opt


def _backward(scaler, model):
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()


def mis_unscale_twice(scaler, model, opt):
    _backward(scaler, model)
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def mis_unscale_after_step(scaler, model, opt):
    _backward(scaler, model)
    scaler.step(opt)
    scaler.unscale_(opt)


def mis_step_twice(scaler, model, opt):
    _backward(scaler, model)
    scaler.step(opt)
    scaler.step(opt)


def mis_step_twice_after_unscale(scaler, model, opt):
    _backward(scaler, model)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.step(opt)


def mis_closure(scaler, model, opt):
    _backward(scaler, model)
    scaler.step(opt, closure=lambda: 0.0)


def mis_unscale_before_scale(scaler, model, opt):
    model(torch.ones(1, 3)).sum().backward()
    scaler.unscale_(opt)


def mis_step_before_scale(scaler, model, opt):
    model(torch.ones(1, 3)).sum().backward()
    scaler.step(opt)


def mis_update_before_scale(scaler, model, opt):
    scaler.update()


def mis_update_without_step(scaler, model, opt):
    _backward(scaler, model)
    scaler.update()


def mis_new_scale_two_elements(scaler, model, opt):
    _backward(scaler, model)
    scaler.update(torch.tensor([1.0, 2.0]))


def mis_new_scale_requires_grad(scaler, model, opt):
    _backward(scaler, model)
    scaler.update(torch.tensor(1.0, requires_grad=True))


def mis_step_fused_twice(scaler, model, opt):
    opt = torch.optim.Adam(model.parameters(), fused=True)
    _backward(scaler, model)
    scaler.step(opt)
    scaler.step(opt)


def mis_unscale_fused_after_step(scaler, model, opt):
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    _backward(scaler, model)
    scaler.step(opt)
    scaler.unscale_(opt)


def mis_unscale_fused_twice(scaler, model, opt):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    _backward(scaler, model)
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def mis_closure_fused(scaler, model, opt):
    opt = torch.optim.Adam(model.parameters(), fused=True)
    _backward(scaler, model)
    scaler.step(opt, closure=lambda: 0.0)


MISUSES = [mis_unscale_twice, mis_unscale_after_step, mis_step_twice, mis_step_twice_after_unscale, mis_closure,
           mis_unscale_fused_twice, mis_closure_fused,
           mis_unscale_before_scale, mis_step_before_scale, mis_update_before_scale, mis_update_without_step,
           mis_new_scale_two_elements, mis_new_scale_requires_grad, mis_step_fused_twice,
           mis_unscale_fused_after_step]


def _outcome(fn, make):
    scaler, model, opt = _setup(make)
    try:
        fn(scaler, model, opt)
    except Exception as e:  # noqa: BLE001 - the exception is the outcome compared
        # ampx.SettingError is the AssertionError torch raises (also a ValueError); ampx adds
        # what it got after torch's own words
        if isinstance(e, ampx.SettingError):
            return AssertionError, str(e).split(" (ampx.GradScaler.update got")[0]
        return type(e), str(e)
    return None


@pytest.mark.parametrize("fn", MISUSES, ids=lambda f: f.__name__[4:])
def test_misuse_raises_like_torch(fn):
    expected = _outcome(fn, torch_scaler)
    assert expected is not None, "torch no longer rejects this; the scenario needs revisiting"
    assert _outcome(fn, ampx_scaler) == expected


def test_misuse_messages_are_torchs():
    # spelled out, so a change of wording on either side shows up here
    msg = dict((f.__name__, _outcome(f, ampx_scaler)) for f in MISUSES)
    assert msg["mis_unscale_twice"] == (
        RuntimeError, "unscale_() has already been called on this optimizer since the last update().")
    assert msg["mis_unscale_after_step"] == (RuntimeError, "unscale_() is being called after step().")
    assert msg["mis_step_twice"] == (RuntimeError, "step() has already been called since the last update().")
    assert msg["mis_closure"] == (RuntimeError, "Closure use is not currently supported if GradScaler is enabled.")
    assert msg["mis_update_without_step"] == (AssertionError, "No inf checks were recorded prior to update.")
    assert msg["mis_step_before_scale"][0] is AssertionError
    assert msg["mis_step_before_scale"][1].startswith("Attempted step but _scale is None.")


def mis_step_without_any_grad(scaler, model, opt):
    scaler.scale(torch.ones(()))  # a loss that does not reach this optimizer's params
    scaler.step(opt)


def mis_update_after_gradless_step(scaler, model, opt):
    scaler.scale(torch.ones(()))
    try:
        scaler.step(opt)
    except AssertionError:
        pass
    scaler.update()


@pytest.mark.parametrize("fn", [mis_step_without_any_grad, mis_update_after_gradless_step],
                         ids=["step", "update"])
def test_gradless_optimizer_raises_like_torch(fn):
    expected = _outcome(fn, torch_scaler)
    assert expected is not None and expected[0] is AssertionError
    assert _outcome(fn, ampx_scaler) == expected


def test_non_tensor_param_message_like_torch():
    def fn(scaler, model, opt):
        _backward(scaler, model)
        opt.param_groups[0]["params"].append(3)
        scaler.unscale_(opt)

    expected = _outcome(fn, torch_scaler)
    got = _outcome(fn, ampx_scaler)
    # ampx's words are torch 2.13's; torch 2.10's assert has no message (scripts/check_torch.sh
    # 2.10.0): the same exception, and ampx's words wherever torch has them
    assert got == (AssertionError, "expected param to be torch.Tensor, got int")
    assert expected[0] is AssertionError and expected[1] in ("", got[1])


# ------------------------------------------------- a disabled scaler is transparent --


def test_disabled_scaler_is_transparent():
    scaler = ampx_scaler(enabled=False)
    assert not scaler.is_enabled()
    t = torch.randn(3)
    assert scaler.scale(t) is t
    nested = [t, (t,)]
    assert scaler.scale(nested) is nested
    model = two_layer()
    ref = copy.deepcopy(model)
    opt, opt_ref = make_opt(torch.optim.SGD, model), make_opt(torch.optim.SGD, ref)
    for x, y in batches():
        for m, o, use in ((model, opt, True), (ref, opt_ref, False)):
            o.zero_grad()
            loss = mse(m(x), y)
            if use:
                scaler.scale(loss).backward()
                scaler.unscale_(o)
                scaler.unscale_(o)  # no-ops, not errors
                closure_calls = []
                ret = scaler.step(o, closure=lambda: closure_calls.append(1) or loss)
                assert closure_calls == [1] and ret is loss
                scaler.update()
            else:
                loss.backward()
                o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        same(a, b)
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    scaler.load_state_dict({"scale": 5.0})  # ignored
    assert scaler.get_scale() == 1.0
    assert scaler._get_growth_tracker() == 0


# ---------------------------------------------------------------- ampx extras --


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("opt_cls,opt_kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                            (torch.optim.Adam, {"lr": 0.01}),
                                            (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})],
                         ids=["SGD", "Adam", "AdamW"])
def test_clip_grad_norm_matches_unscale_then_torch_clip(opt_cls, opt_kw, fused):
    for norm_type in (2.0, 1.0, math.inf, 3.0):
        ref, sut = twins()
        kw = {**opt_kw, "fused": True} if fused else opt_kw
        opt_ref, opt_sut = make_opt(opt_cls, ref, kw), make_opt(opt_cls, sut, kw)
        s_ref = torch_scaler(init_scale=2.0**12, growth_interval=1)
        s_sut = ampx_scaler(init_scale=2.0**12, growth_interval=1)
        for i, (x, y) in enumerate(batches()):
            opt_ref.zero_grad()
            opt_sut.zero_grad()
            s_ref.scale(mse(ref(x), y)).backward()
            s_sut.scale(mse(sut(x), y)).backward()
            if i == OVERFLOW_ITER:
                poison(ref)
                poison(sut)
            s_ref.unscale_(opt_ref)
            n_ref = nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
            n_sut = s_sut.clip_grad_norm_(opt_sut, 0.05, norm_type)
            close(n_sut, n_ref, atol=0, rtol=1e-5)
            s_ref.step(opt_ref)
            s_sut.step(opt_sut)
            s_ref.update()
            s_sut.update()
            assert s_sut.get_scale() == s_ref.get_scale()
            if i != OVERFLOW_ITER:
                assert s_sut.stats()["last_norm"] == pytest.approx(n_ref.item(), rel=1e-5)
        check_twin_state(ref, sut, opt_ref, opt_sut, lambda a, b, m: close(a, b, atol=1e-6, rtol=1e-4, msg=m))


def test_clip_grad_norm_records_last_norm_for_any_norm_type():
    scaler, model, opt = _setup(ampx_scaler)
    _backward(scaler, model)
    n = scaler.clip_grad_norm_(opt, 1e-3, norm_type=3.0)
    assert scaler.stats()["last_norm"] == pytest.approx(n.item())


def test_clip_grad_norm_sparse_grad_is_right_or_refused():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    scaler = ampx_scaler(init_scale=4.0)
    scaler.scale(emb(torch.tensor([1, 2, 2, 2, 5])).sum()).backward()
    assert not emb.weight.grad.is_coalesced()
    true_norm = (emb.weight.grad.coalesce().to_dense() / 4.0).norm().item()
    try:
        n = scaler.clip_grad_norm_(opt, 100.0)
    except (NotImplementedError, RuntimeError, ValueError):
        return  # refusing, as torch does, is fine
    assert n.item() == pytest.approx(true_norm, rel=1e-6)


def test_clip_grad_norm_misuse():
    scaler, model, opt = _setup(ampx_scaler)
    _backward(scaler, model)
    scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="clip_grad_norm_.. has already been called"):
        scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="unscale_.. has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    _backward(scaler, model)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(\) is being called after step\(\)"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.update()
    _backward(scaler, model)
    scaler.clip_grad_norm_(opt, 1.0)  # allowed again after update
    # fused optimizers: nothing is unscaled by the clip, but unscale_ is still refused
    fused = torch.optim.Adam(model.parameters(), fused=True)
    scaler.step(opt)
    scaler.update()
    _backward(scaler, model)
    scaler.clip_grad_norm_(fused, 1.0)
    with pytest.raises(RuntimeError, match="unscale_.. has already been called"):
        scaler.unscale_(fused)


def test_clip_grad_norm_error_if_nonfinite_and_disabled():
    scaler, model, opt = _setup(ampx_scaler)
    _backward(scaler, model)
    model.bias.grad[0] = math.inf
    with pytest.raises(RuntimeError, match="non-finite"):
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)
    # disabled (bf16 / fp32 training): nothing to unscale, but the same fused norm and multiply
    # as the enabled scaler, so torch's clip to float32 rounding of the norm; the norm itself
    # is the float64 one rounded once.
    ref, sut = twins()
    scaler = ampx_scaler(enabled=False)
    x, y = batches()[0]
    mse(ref(x), y).backward()
    scaler.scale(mse(sut(x), y)).backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in sut.parameters()]))
    n_ref = nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    n_sut = scaler.clip_grad_norm_(make_opt(torch.optim.SGD, sut), 0.1)
    assert n_sut.dtype == torch.float32 and n_sut.item() == want.float().item()
    torch.testing.assert_close(n_sut, n_ref, rtol=2e-7, atol=0)
    for a, b in zip(sut.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-7, atol=0)
    assert scaler.stats()["last_norm"] == n_sut.item()  # telemetry sees the clip, as when enabled
    # torch's clip where the kernels have no norm or must raise: other p, error_if_nonfinite
    ref, sut = twins()
    mse(ref(x), y).backward()
    mse(sut(x), y).backward()
    same(scaler.clip_grad_norm_(make_opt(torch.optim.SGD, sut), 0.1, norm_type=3.0),
         nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type=3.0))


@pytest.mark.parametrize("first_clip_clips", [False, True], ids=["hint_unscale_first", "hint_norm_first"])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_clip_error_if_nonfinite_writes_nothing_then_steps_as_torch(first_clip_clips, bad):
    """A clip that refuses a non-finite norm leaves the gradients and the stage as they were,
    whichever route the last step's clip chose (a clip that did not clip makes the next one
    unscale while it reads: that route once wrote the gradients, then raised with the stage still
    READY, so the step after unscaled them a second time). The step and update that follow
    match torch's unscale_ + clip_grad_norm_ + step + update bit for bit."""
    max_norm = 1e-3 if first_clip_clips else 1e6
    runs = {}
    for name, make in (("torch", torch_scaler), ("ampx", ampx_scaler)):
        model = two_layer()
        opt = make_opt(torch.optim.SGD, model, {"lr": 0.1, "momentum": 0.9})
        scaler = make(init_scale=4.0)

        def clip(error):
            if name == "torch":
                scaler.unscale_(opt)
                return nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=error)
            return scaler.clip_grad_norm_(opt, max_norm, error_if_nonfinite=error)

        x, y = batches()[0]
        scaler.scale(mse(model(x), y)).backward()
        clip(False)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scaler.scale(mse(model(x), y)).backward()
        model[0].bias.grad[1] = bad
        before = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match="non-finite"):
            clip(True)
        if name == "ampx":
            for p, b in zip(model.parameters(), before):
                same(p.grad, b)  # nothing written
            assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY
        scaler.step(opt)
        scaler.update()
        runs[name] = ([p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()],
                      scaler.get_scale(), scaler._get_growth_tracker())
    (p_t, g_t, s_t, t_t), (p_a, g_a, s_a, t_a) = runs["torch"], runs["ampx"]
    for a, b in zip(p_a + g_a, p_t + g_t):
        same(a, b)  # the gradients unscaled once, as torch's
    assert (s_a, t_a) == (s_t, t_t) == (2.0, 0)


def test_clip_error_if_nonfinite_then_a_retry_clips():
    """After the refusal the same step can still be clipped (it was not marked as clipped)."""
    model = two_layer()
    opt = make_opt(torch.optim.SGD, model, {"lr": 0.1})
    scaler = ampx_scaler(init_scale=4.0)
    x, y = batches()[0]
    scaler.scale(mse(model(x), y)).backward()
    model[1].weight.grad[0, 0] = math.inf
    with pytest.raises(RuntimeError, match="non-finite"):
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)
    assert not math.isfinite(scaler.clip_grad_norm_(opt, 1.0).item())
    scaler.step(opt)
    assert scaler.last_step_skipped


def test_clip_grad_norm_overflow_skips_step():
    for opt_kw in ({}, {"fused": True}):
        model = two_layer()
        opt = make_opt(torch.optim.AdamW, model, {"lr": 0.01, **opt_kw})
        scaler = ampx_scaler(init_scale=256.0)
        before = copy.deepcopy(model.state_dict())
        x, y = batches()[0]
        scaler.scale(mse(model(x), y)).backward()
        poison(model)
        norm = scaler.clip_grad_norm_(opt, 1.0)
        assert not math.isfinite(norm.item())
        scaler.step(opt)
        assert scaler.last_step_skipped
        scaler.update()
        assert scaler.get_scale() == 128.0
        for k, v in model.state_dict().items():
            same(v, before[k])


def test_hysteresis_delays_backoff():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    s = ampx_scaler(init_scale=64.0, growth_interval=100, hysteresis=2)
    _one_iteration(s, opt, p, True)
    assert s.last_step_skipped and s.get_scale() == 64.0
    _one_iteration(s, opt, p, True)
    assert s.get_scale() == 32.0
    _one_iteration(s, opt, p, True)
    assert s.get_scale() == 16.0  # the tracker is only refilled by a growth


def test_consecutive_hysteresis_refills_on_clean_steps():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    pattern = (True, False, True, False, True, True)
    got = {}
    for cons in (False, True):
        s = ampx_scaler(init_scale=64.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=cons)
        got[cons] = []
        for flag in pattern:
            _one_iteration(s, opt, p, flag)
            got[cons].append(s.get_scale())
    assert got[False] == [64.0, 64.0, 32.0, 32.0, 16.0, 8.0]
    assert got[True] == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0]


def test_static_scale_and_bounds():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    s = ampx_scaler(init_scale=64.0, growth_interval=1, dynamic=False)
    for flag in (False, True, False):
        _one_iteration(s, opt, p, flag)
        assert bool(s.last_step_skipped) == flag and s.get_scale() == 64.0
    s = ampx_scaler(init_scale=64.0, growth_interval=1, max_scale=128.0, min_scale=32.0, on_min_scale="raise")
    for flag, expect in ((False, 128.0), (False, 128.0), (True, 64.0), (True, 32.0)):
        _one_iteration(s, opt, p, flag)
        assert s.get_scale() == expect
    with pytest.raises(RuntimeError, match="min_scale"):
        _one_iteration(s, opt, p, True)
    with pytest.raises(ValueError):
        ampx_scaler(min_scale=4.0, max_scale=2.0)
    with pytest.raises(ValueError):
        ampx_scaler(hysteresis=0)


def test_on_min_scale_warns(caplog):
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    s = ampx_scaler(init_scale=4.0, min_scale=4.0)
    with caplog.at_level("WARNING", logger="ampx"):
        _one_iteration(s, opt, p, True)
    assert s.get_scale() == 4.0 and s.last_step_skipped
    assert any("min_scale" in r.getMessage() for r in caplog.records)
    caplog.clear()
    s = ampx_scaler(init_scale=4.0, min_scale=4.0, on_min_scale="ignore")
    with caplog.at_level("WARNING", logger="ampx"):
        _one_iteration(s, opt, p, True)
    assert not caplog.records


def test_overflow_report_names_and_stats():
    model = two_layer()
    reports = []
    scaler = ampx_scaler(init_scale=128.0, named_parameters=model.named_parameters(), on_overflow=reports.append)
    opt = make_opt(torch.optim.SGD, model)
    for i, (x, y) in enumerate(batches()):
        opt.zero_grad()
        scaler.scale(mse(model(x), y)).backward()
        if i == 1:
            with torch.no_grad():
                model[1].weight.grad[0, 0] = math.inf
                model[0].bias.grad[0] = math.nan
        scaler.step(opt)
        scaler.update()
    assert scaler.overflow_report() is reports[0] and len(reports) == 1
    r = reports[0]
    assert r.inf == ["1.weight"] and r.nan == ["0.bias"] and r.step == 2
    st_ = scaler.stats()
    assert st_["steps"] == 4 and st_["skipped_steps"] == 1 and st_["scale"] == 64.0
    assert st_["min_scale_seen"] == 64.0 and st_["max_scale_seen"] == 128.0
    assert [h[0] for h in st_["history"]] == [1, 2, 3, 4]


def test_fresh_optimizer_state_matches_torchs_private_one():
    """ampx builds its per-optimizer state itself instead of importing torch's private
    ``_refresh_per_optimizer_state``; where torch still has it, the two must agree."""
    from ampx import scaler as scaler_mod

    torchs = getattr(torch.amp.grad_scaler, "_refresh_per_optimizer_state", None)
    if torchs is None:
        pytest.skip("this torch has no _refresh_per_optimizer_state to compare with")
    ours = scaler_mod._fresh_opt_state()
    assert {k: ours[k] for k in torchs()} == torchs()
    assert ours == torchs()  # exactly torch's two keys: ampx's own are added when first set
    assert ampx.GradScaler("cpu")._per_optimizer_states["x"] == ours


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_pickled_scaler_fresh_state_is_torchs(lazy_init_scale):
    """PyTorch's own test_pickle_gradscaler, in its shape: an unpickled scaler's fresh
    per-optimizer state equals torch's, key for key (it failed when ampx declared three more)."""
    import pickle

    a = ampx.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    if lazy_init_scale:
        a.scale(torch.tensor([4.0]))
    b = pickle.loads(pickle.dumps(a))
    assert (b.get_scale(), b.get_growth_factor(), b.get_growth_interval()) == (3.0, 4.0, 2)
    fresh = {"stage": torch.amp.grad_scaler.OptState.READY, "found_inf_per_device": {}}
    assert b._per_optimizer_states["fdsa"] == fresh


def test_ampx_keys_appear_when_used_and_go_at_update():
    """The clip route sets ampx's keys on first use; update() starts every optimizer afresh."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ampx.GradScaler("cpu", init_scale=2.0)
    s.scale(torch.tensor(1.0))  # the scale is made lazily, as torch's
    p.grad = torch.full((4,), 2.0)
    s.clip_grad_norm_(opt, 1.0)
    st = s._per_optimizer_states[id(opt)]
    assert st["clipped"] is True and set(st) > {"stage", "found_inf_per_device"}
    with pytest.raises(RuntimeError):
        s.clip_grad_norm_(opt, 1.0)  # a second clip in one step is still refused
    s.step(opt)
    s.update()
    assert s._per_optimizer_states[id(opt)] == {"stage": torch.amp.grad_scaler.OptState.READY,
                                                "found_inf_per_device": {}}
