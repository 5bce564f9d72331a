"""fp32 master weights (ampx.MasterWeights) and stochastic rounding."""
import copy
import math

import pytest
import torch

import ampx
import ampx.policy as policy_mod
from ampx import ops


@pytest.fixture
def native_bf16(monkeypatch):
    """Policy("bf16") on any CPU: these tests are about master weights, not the hardware check."""
    monkeypatch.setattr(policy_mod, "_cpu_has_native_bf16", lambda: True)

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
}


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def _bf16_values(shape, gen):
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


# ---- exactness: the masters follow the optimizer's float32 math --------------------------

@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_masters_step_exactly_as_float32_with_the_same_gradients(name):
    ref = _mlp()
    low = copy.deepcopy(ref)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    opt = ampx.MasterWeights(OPTIMIZERS[name](low.parameters()), model=low, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in low.parameters())
    for m, p in zip(opt.masters, ref.parameters()):
        assert torch.equal(m, p.detach())  # taken before the cast: exact float32
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(ref.parameters(), low.parameters()):
            g = _bf16_values(p.shape, gen)
            p.grad = g.float()
            q.grad = g
        ref_opt.step()
        opt.step()
        for m, p, q in zip(opt.masters, ref.parameters(), low.parameters()):
            assert torch.equal(m, p.detach())
            assert torch.equal(q.detach(), p.detach().to(torch.bfloat16))  # round to nearest even
        opt.zero_grad()
        assert all(q.grad is None for q in low.parameters())


def test_params_already_low_precision_and_fp32_params_mixed():
    w = torch.nn.Parameter(torch.randn(7, 5).to(torch.float16))
    b = torch.nn.Parameter(torch.randn(5))  # float32: stepped as it is
    opt = ampx.MasterWeights(torch.optim.SGD([w, b], lr=0.5))
    assert opt.param_groups[0]["params"][1] is b
    assert opt.masters[0].dtype == torch.float32 and torch.equal(opt.masters[0], w.detach().float())
    w.grad = torch.full((7, 5), 0.25, dtype=torch.float16)
    b.grad = torch.full((5,), 2.0)
    before_b = b.detach().clone()
    expect_w = w.detach().float() - 0.125
    opt.step()
    torch.testing.assert_close(b.detach(), before_b - 1.0)
    assert torch.equal(opt.masters[0], expect_w)
    assert torch.equal(w.detach(), expect_w.half())


# ---- training: bf16 params + fp32 masters track fp32 training ----------------------------

def _regression_data():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 12, generator=gen)
    w = torch.randn(12, 3, generator=gen)
    y = torch.tanh(x @ w) + 0.01 * torch.randn(256, 3, generator=gen)
    return x, y


def _train(model, opt, steps, dtype, scaler=None):
    x, y = _regression_data()
    x = x.to(dtype)
    losses = []
    for step in range(steps):
        i = (step * 32) % 256
        out = model(x[i:i + 32])
        loss = torch.nn.functional.mse_loss(out.float(), y[i:i + 32])
        losses.append(loss.item())
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(opt, 10.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return losses


def test_bf16_training_with_masters_matches_fp32_training():
    """Stated tolerance: after 300 Adam steps the bf16+masters model's loss is within 10% of
    the fp32 model's, and its masters within 2e-2 of the fp32 weights (bf16 forward/backward
    noise); bf16 weights without masters are shown to drift further."""
    ref = _mlp()
    low = copy.deepcopy(ref)
    plain = copy.deepcopy(ref).to(torch.bfloat16)
    ref_l = _train(ref, torch.optim.Adam(ref.parameters(), lr=3e-3), 300, torch.float32)
    opt = ampx.MasterWeights(torch.optim.Adam(low.parameters(), lr=3e-3), model=low, dtype=torch.bfloat16)
    low_l = _train(low, opt, 300, torch.bfloat16)
    plain_l = _train(plain, torch.optim.Adam(plain.parameters(), lr=3e-3), 300, torch.bfloat16)
    final = lambda ls: sum(ls[-20:]) / 20  # noqa: E731
    assert final(ref_l) < 0.5 * ref_l[0]  # it learned
    assert abs(final(low_l) - final(ref_l)) <= 0.10 * final(ref_l)
    dm = max(float((m - p.detach()).abs().max()) for m, p in zip(opt.masters, ref.parameters()))
    dp = max(float((q.detach().float() - p.detach()).abs().max()) for q, p in zip(plain.parameters(),
                                                                                 ref.parameters()))
    assert dm < 2e-2
    assert dm < dp


def test_fp16_masters_with_the_scaler_skip_overflows_and_match_unscaled_math():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64).half())
    opt = ampx.MasterWeights(torch.optim.SGD([w], lr=0.1))
    scaler = ampx.GradScaler("cpu", init_scale=2.0**8, named_parameters=[("w", w)])
    scaler.scale(torch.ones(()))
    g = torch.randn(64).half()
    w.grad = g * 2**8  # a scaled gradient, exact in fp16
    before = opt.masters[0].clone()
    norm = scaler.clip_grad_norm_(opt, 1e9)
    assert float(norm) == pytest.approx(float(g.float().norm()), rel=1e-6)
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(opt.masters[0], before - 0.1 * g.float(), rtol=0, atol=2.4e-7)  # unscaled on the way
    assert torch.equal(w.detach(), opt.masters[0].half())
    # an overflow: the step is skipped, masters and model untouched, the scale backs off
    w.grad = g * 2**8
    w.grad[3] = math.inf
    snap_m, snap_w = opt.masters[0].clone(), w.detach().clone()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    assert torch.equal(opt.masters[0], snap_m) and torch.equal(w.detach(), snap_w)
    assert scaler.get_scale() == 2.0**7
    assert scaler.overflow_report().inf == ["w"]


@pytest.mark.parametrize("unscale_first", [False, True], ids=["clip", "unscale-then-clip"])
def test_clip_with_masters_equals_torch_clip_of_the_fp32_gradients(unscale_first):
    """Also after unscale_, which leaves the unscaled values in the masters' gradients (the
    model's stay scaled): the norm is theirs (it once read the model's, init_scale times too big)."""
    torch.manual_seed(2)
    ps = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (100, 3, 1000)]
    extra = torch.nn.Parameter(torch.randn(10))
    opt = ampx.MasterWeights(torch.optim.SGD(ps + [extra], lr=1.0))
    scaler = ampx.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    grads = [torch.randn(p.shape).to(torch.bfloat16) for p in ps]
    eg = torch.randn(10)
    for p, g in zip(ps, grads):
        p.grad = g * 4
    extra.grad = eg * 4
    fp32 = [g.float() for g in grads] + [eg.clone()]
    holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in fp32]
    for h, g in zip(holders, fp32):
        h.grad = g  # clipped in place by torch
    ref_norm = torch.nn.utils.clip_grad_norm_(holders, 2.0)
    assert float(ref_norm) > 2.0
    if unscale_first:
        scaler.unscale_(opt)
    norm = scaler.clip_grad_norm_(opt, 2.0)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
    got = [m.grad for m in opt.masters] + [extra.grad]
    for a, b in zip(got, fp32):
        torch.testing.assert_close(a, b, rtol=5e-7, atol=0)  # a few float32 ulps: coef rounds differently


def test_unscale_then_clip_with_masters_reports_the_overflow_by_name():
    """The clip after unscale_ reads the masters' gradients; the overflow report stays unscale_'s,
    by the model's parameter names (the masters have none)."""
    ps = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (4, 3)]
    opt = ampx.MasterWeights(torch.optim.SGD(ps, lr=1.0))
    scaler = ampx.GradScaler("cpu", init_scale=4.0, named_parameters=[("a", ps[0]), ("b", ps[1])])
    scaler.scale(torch.ones(()))
    ps[0].grad = torch.ones(4, dtype=torch.bfloat16)
    ps[1].grad = torch.tensor([1.0, math.inf, 2.0], dtype=torch.bfloat16)
    before = [m.clone() for m in opt.masters]
    scaler.unscale_(opt)
    assert not math.isfinite(float(scaler.clip_grad_norm_(opt, 1.0)))
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0
    assert scaler.overflow_report().inf == ["b"]
    assert all(torch.equal(m, b) for m, b in zip(opt.masters, before))


def test_a_disabled_scaler_and_an_lr_scheduler_drive_masters(native_bf16):
    model = _mlp()
    opt = ampx.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1), model=model, dtype=torch.bfloat16)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = ampx.Policy("bf16", device="cpu").grad_scaler()
    assert not scaler.is_enabled()
    x = torch.randn(4, 12).to(torch.bfloat16)
    loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    norm = scaler.clip_grad_norm_(opt, 1e-3)
    scaler.step(opt)
    scaler.update()
    sched.step()
    assert float(norm) > 1e-3
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


# ---- checkpoints -------------------------------------------------------------------------

def _steps_on_random_grads(model, opt, steps, seed):
    """`steps` optimizer steps on bf16 gradients drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = _bf16_values(p.shape, gen)
        opt.step()
        opt.zero_grad()


def test_state_dict_holds_fp32_masters_and_resumes_exactly():
    a = _mlp()
    opt_a = ampx.MasterWeights(torch.optim.AdamW(a.parameters(), lr=1e-2), model=a, dtype=torch.bfloat16,
                               rounding="stochastic", seed=9)
    _steps_on_random_grads(a, opt_a, 3, 0)
    sd = copy.deepcopy(opt_a.state_dict())
    assert all(m.dtype == torch.float32 for m in sd["ampx_master_weights"]["masters"])
    b = _mlp(seed=1).to(torch.bfloat16)
    opt_b = ampx.MasterWeights(torch.optim.AdamW(b.parameters(), lr=1e-2), rounding="stochastic", seed=9)
    opt_b.load_state_dict(sd)
    for m, n in zip(opt_a.masters, opt_b.masters):
        assert torch.equal(m, n)
    _steps_on_random_grads(a, opt_a, 3, 1)
    _steps_on_random_grads(b, opt_b, 3, 1)
    for m, n in zip(opt_a.masters, opt_b.masters):
        assert torch.equal(m, n)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)  # same stochastic bits: same seed, same step offsets


def test_load_state_dict_errors():
    opt = ampx.MasterWeights(torch.optim.SGD([torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))], lr=1))
    with pytest.raises(ValueError, match="ampx_master_weights"):
        opt.load_state_dict(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1).state_dict())
    other = ampx.MasterWeights(torch.optim.SGD([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], lr=1))
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(other.state_dict())


# ---- stochastic rounding ------------------------------------------------------------------

def test_stochastic_rounding_is_unbiased():
    # 1 + 2**-9 lies a quarter of the way from 1 to the next bfloat16 (1 + 2**-7).
    for frac in (0.25, 0.5, 0.9):
        x = 1.0 + frac * 2.0**-7
        src = torch.full((1 << 20,), x)
        dst = torch.empty(1 << 20, dtype=torch.bfloat16)
        means = []
        for offset in range(4):
            ops.cast_(src, dst, rounding="stochastic", seed=123, offset=offset)
            vals = dst.double()
            assert set(vals.unique().tolist()) <= {1.0, 1.0 + 2.0**-7}
            means.append(float(vals.mean()))
        # per draw: std of the mean = 2**-7 * sqrt(f(1-f)/n); allow 6 sigma
        sigma = 2.0**-7 * math.sqrt(frac * (1 - frac) / (1 << 20))
        for m in means:
            assert abs(m - x) < 6 * sigma, (frac, m, x)
        assert len(set(means)) == 4  # each offset draws new bits
    nearest = torch.empty(8, dtype=torch.bfloat16)
    ops.cast_(torch.full((8,), 1.0 + 0.25 * 2.0**-7), nearest)
    assert torch.all(nearest == 1.0)  # round to nearest: biased to 1


def test_stochastic_rounding_keeps_learning_where_nearest_stalls():
    """bf16 weights updated directly (no fp32 copy) by tiny steps: 2000 steps of +1e-4 from
    1.0 (a tenth of bf16's spacing there is 7.8e-4) should reach 1.2. Round to nearest
    never moves; stochastic rounding gets there within its noise."""
    n, steps, delta = 4096, 2000, 1e-4
    rn = torch.ones(n, dtype=torch.bfloat16)
    sr = torch.ones(n, dtype=torch.bfloat16)
    tmp = torch.empty(n)
    for t in range(steps):
        torch.add(rn.float(), delta, out=tmp)
        ops.cast_(tmp, rn)
        torch.add(sr.float(), delta, out=tmp)
        ops.cast_(tmp, sr, rounding="stochastic", seed=5, offset=t)
    assert torch.all(rn == 1.0)
    target = 1.0 + steps * delta
    assert abs(float(sr.double().mean()) - target) < 2e-3


def test_master_writeback_with_stochastic_rounding_is_unbiased():
    w = torch.nn.Parameter(torch.ones(1 << 16, dtype=torch.bfloat16))
    opt = ampx.MasterWeights(torch.optim.SGD([w], lr=1.0), rounding="stochastic", seed=1)
    w.grad = torch.full_like(w, -0.3 * 2.0**-7)  # the master moves to about 1 + 0.3 ulp
    target = 1.0 - float(w.grad[0])
    opt.step()
    assert torch.all(opt.masters[0] == target)
    f = (target - 1.0) / 2.0**-7
    assert 0.29 < f < 0.31
    assert set(w.double().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(float(w.detach().double().mean()) - target) < 6 * 2.0**-7 * math.sqrt(f * (1 - f) / (1 << 16))


# ---- errors -------------------------------------------------------------------------------

def test_errors_name_the_problem():
    bf = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        ampx.MasterWeights(object())
    opt = ampx.MasterWeights(torch.optim.SGD([bf], lr=1))
    with pytest.raises(TypeError, match="already"):
        ampx.MasterWeights(opt)
    with pytest.raises(ValueError, match="rounding"):
        ampx.MasterWeights(torch.optim.SGD([bf], lr=1), rounding="up")
    half = torch.nn.Parameter(torch.ones(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"stochastic rounding writes bfloat16.*\(2, 3\).*float16"):
        ampx.MasterWeights(torch.optim.SGD([half], lr=1), rounding="stochastic")
    with pytest.raises(ValueError, match="none of the optimizer's parameters"):
        ampx.MasterWeights(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1))
    with pytest.raises(ValueError, match="dtype"):
        ampx.MasterWeights(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1), dtype=torch.float64)


def test_state_already_held_moves_to_the_master_in_float32():
    bf = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    used = torch.optim.SGD([bf], lr=1, momentum=0.9)
    bf.grad = torch.full((2,), 0.5, dtype=torch.bfloat16)
    used.step()
    assert used.state[bf]["momentum_buffer"].dtype == torch.bfloat16
    opt = ampx.MasterWeights(used)
    m = opt.masters[0]
    assert bf not in opt.state and opt.state[m]["momentum_buffer"].dtype == torch.float32
    bf.grad = torch.full((2,), 0.5, dtype=torch.bfloat16)
    opt.step()  # momentum 0.9 * 0.5 + 0.5 = 0.95
    assert torch.equal(m, torch.full((2,), 0.5 - 0.95))


def test_policy_master_weights_optimizer(native_bf16):
    model = _mlp()
    first = next(model.parameters()).detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert ampx.Policy("bf16", device="cpu").master_weights_optimizer(opt) is opt
    wrapped = ampx.Policy("bf16", device="cpu", master_weights=True).master_weights_optimizer(
        opt, model, rounding="stochastic", seed=3)
    assert isinstance(wrapped, ampx.MasterWeights) and wrapped.rounding == "stochastic"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(wrapped.masters[0], first)
    with pytest.raises(ValueError, match="master_weights=True needs dtype bf16 or fp16"):
        ampx.Policy("fp32", device="cpu", master_weights=True).master_weights_optimizer(opt)


@pytest.mark.parametrize("order", ["model first", "optimizer first"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_resume_restores_the_model_bit_for_bit_in_either_order(order, rounding):
    """The model's bf16 weights after loading equal the saved ones, whichever is loaded first
    (stochastic rounding rewrote them with nearest rounding: one ulp off in ~1,000 weights)."""
    a = _mlp()
    opt_a = ampx.MasterWeights(torch.optim.AdamW(a.parameters(), lr=1e-2), model=a, dtype=torch.bfloat16,
                               rounding=rounding, seed=9)
    _steps_on_random_grads(a, opt_a, 3, 0)
    model_sd, opt_sd = copy.deepcopy(a.state_dict()), copy.deepcopy(opt_a.state_dict())
    b = _mlp(seed=1)
    opt_b = ampx.MasterWeights(torch.optim.AdamW(b.parameters(), lr=1e-2), model=b, dtype=torch.bfloat16,
                               rounding=rounding, seed=9)
    if order == "model first":
        b.load_state_dict(model_sd)
        opt_b.load_state_dict(opt_sd)
    else:
        opt_b.load_state_dict(opt_sd)
        b.load_state_dict(model_sd)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    _steps_on_random_grads(a, opt_a, 2, 1)
    _steps_on_random_grads(b, opt_b, 2, 1)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
