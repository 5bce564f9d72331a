"""clip_grad_norm_'s returned norm: torch's dtype, ampx's exact value rounded to it (the default
clip_norm="exact"), and clip_norm="torch", bit-identical to torch's unscale_ + clip_grad_norm_.

References: the norm in float64 of the unscaled gradients (exact), and torch's own scaler and
torch.nn.utils.clip_grad_norm_. The data makes torch's low-precision norm differ from the exact
one (asserted), so a scaler that returned either in place of the other fails here.
"""
import math

import pytest
import torch

import ampx

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
SCALE = 2.0**10
MAX_NORM = 0.5
SIZES = (1000, 37, 5, 300)
# dtype lists: one dtype, and mixes (bf16 with fp16 promotes to float32 in torch)
ENABLED_LISTS = {"f32": [F32] * 4, "bf16": [BF16] * 4, "bf16+f32": [BF16, F32, BF16, F32]}
DISABLED_LISTS = dict(ENABLED_LISTS, f16=[F16] * 4, **{"bf16+f16": [BF16, F16, BF16, F16],
                                                      "mixed": [BF16, F16, F32, F64]})


def _params(dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dt)) for n, dt in zip(SIZES, dtypes)]


def _grads(dtypes, seed=7, inf_at=None):
    """Unscaled gradients (exactly representable also times SCALE)."""
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(n, generator=g) * 0.1).to(dt) for n, dt in zip(SIZES, dtypes)]
    if inf_at is not None:
        out[inf_at][3] = math.inf
    return out


def _exact_norm(grads):
    return torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()


def _make_opt(kind, params):
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.AdamW(params, lr=1e-2)


def _run_ampx(dtypes, enabled, kind, clip_norm, inf_at=None):
    params = _params(dtypes)
    opt = _make_opt(kind, params)
    scaler = ampx.GradScaler("cpu", init_scale=SCALE, enabled=enabled, clip_norm=clip_norm)
    factor = SCALE if enabled else 1.0
    for p, g in zip(params, _grads(dtypes, inf_at=inf_at)):
        p.grad = g * factor
    if enabled:
        scaler.scale(torch.ones(()))  # starts the scale as a training step would
    norm = scaler.clip_grad_norm_(opt, MAX_NORM)
    scaler.step(opt)
    scaler.update()
    return norm, params


def _run_torch(dtypes, enabled, kind, inf_at=None):
    params = _params(dtypes)
    opt = _make_opt(kind, params)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=enabled)
    factor = SCALE if enabled else 1.0
    for p, g in zip(params, _grads(dtypes, inf_at=inf_at)):
        p.grad = g * factor
    if enabled:
        scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    scaler.step(opt)
    scaler.update()
    return norm, params


def _same(a, b):
    return a.dtype == b.dtype and (torch.equal(a, b) or (a.isnan().all() and b.isnan().all()))


def _cases():
    for enabled, lists in ((True, ENABLED_LISTS), (False, DISABLED_LISTS)):
        for name, dtypes in lists.items():
            for kind in ("plain", "fused"):
                yield pytest.param(dtypes, enabled, kind, id=f"{'scaled' if enabled else 'disabled'}-{name}-{kind}")


@pytest.mark.parametrize("dtypes,enabled,kind", list(_cases()))
def test_exact_norm_in_torchs_dtype(dtypes, enabled, kind):
    norm, _ = _run_ampx(dtypes, enabled, kind, "exact")
    ref, _ = _run_torch(dtypes, enabled, kind)
    exact = _exact_norm(_grads(dtypes))
    assert norm.dtype == ref.dtype and norm.dim() == 0
    # ampx's float32 norm is the float64 one rounded once; then once more to torch's dtype
    assert norm.item() == exact.float().to(norm.dtype).item()
    if norm.dtype != F64:  # (float64 in the list: float64 as torch's, holding the float32 value)
        assert norm.item() == exact.to(norm.dtype).item()  # no double rounding for this data
    if norm.dtype in (F16, BF16):
        assert ref.item() != norm.item()  # torch's norm in that dtype differs: the test can tell them apart


@pytest.mark.parametrize("dtypes,enabled,kind", list(_cases()))
def test_clip_norm_torch_is_torchs_clip_bit_for_bit(dtypes, enabled, kind):
    norm, params = _run_ampx(dtypes, enabled, kind, "torch")
    ref, ref_params = _run_torch(dtypes, enabled, kind)
    assert _same(norm, ref)
    for p, q in zip(params, ref_params):
        assert p.dtype == q.dtype and torch.equal(p, q)


def test_float32_gradients_are_unchanged_bit_for_bit():
    """float32 gradients: the returned tensor is the float32 norm the scaler kept (stats too)."""
    params = _params([F32] * 4)
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = ampx.GradScaler("cpu", init_scale=SCALE)
    for p, g in zip(params, _grads([F32] * 4)):
        p.grad = g * SCALE
    scaler.scale(torch.ones(()))
    norm = scaler.clip_grad_norm_(opt, MAX_NORM)
    assert norm is scaler._last_norm and norm.dtype == F32
    assert norm.item() == _exact_norm(_grads([F32] * 4)).float().item()


def test_exact_mode_params_differ_from_torchs():
    """The default's clip coefficient is ampx's (from the float32 exact norm): bf16 parameters
    after one clipped step differ from torch's, which clip_norm="torch" reproduces."""
    _, exact = _run_ampx([BF16] * 4, False, "plain", "exact")
    _, ref = _run_torch([BF16] * 4, False, "plain")
    assert any(not torch.equal(p, q) for p, q in zip(exact, ref))


@pytest.mark.parametrize("clip_norm", ["exact", "torch"])
@pytest.mark.parametrize("kind", ["plain", "fused"])
@pytest.mark.parametrize("name", ["bf16", "bf16+f32"])
def test_overflowing_step(clip_norm, kind, name):
    dtypes = ENABLED_LISTS[name]
    norm, params = _run_ampx(dtypes, True, kind, clip_norm, inf_at=0)
    ref, ref_params = _run_torch(dtypes, True, kind, inf_at=0)
    assert norm.dtype == ref.dtype and not math.isfinite(norm.item())
    if clip_norm == "torch":
        assert _same(norm, ref)
    for p, q, p0 in zip(params, ref_params, _params(dtypes)):
        assert torch.equal(p, q) and torch.equal(p, p0)  # skipped, as torch's


def _masters_run(clip_norm, enabled, inf_at=None):
    model = _params([BF16] * 4)
    opt = ampx.MasterWeights(torch.optim.SGD(model, lr=1.0))
    scaler = ampx.GradScaler("cpu", init_scale=SCALE, enabled=enabled, clip_norm=clip_norm)
    factor = SCALE if enabled else 1.0
    for p, g in zip(model, _grads([BF16] * 4, inf_at=inf_at)):
        p.grad = g * factor
    if enabled:
        scaler.scale(torch.ones(()))
    norm = scaler.clip_grad_norm_(opt, MAX_NORM)
    scaler.step(opt)
    scaler.update()
    return norm, [m.detach().clone() for m in opt.masters]


def _masters_reference(inf_at=None):
    """torch's clip of the float32 masters' gradients, and an SGD step of the masters."""
    masters = [torch.nn.Parameter(p.detach().float()) for p in _params([BF16] * 4)]
    for m, g in zip(masters, _grads([BF16] * 4, inf_at=inf_at)):
        m.grad = g.float()
    norm = torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
    if math.isfinite(norm.item()):
        torch.optim.SGD(masters, lr=1.0).step()
    return norm, [m.detach() for m in masters]


@pytest.mark.parametrize("enabled", [True, False], ids=["scaled", "disabled"])
@pytest.mark.parametrize("clip_norm", ["exact", "torch"])
def test_master_weights_norm_is_float32(enabled, clip_norm):
    norm, masters = _masters_run(clip_norm, enabled)
    ref, ref_masters = _masters_reference()
    assert norm.dtype == F32
    if clip_norm == "exact" and enabled:
        assert norm.item() == _exact_norm(_grads([BF16] * 4)).float().item()
    elif clip_norm == "exact":  # a disabled scaler clips the masters with torch's float32 clip
        assert torch.equal(norm, ref)
    else:
        assert torch.equal(norm, ref)
        assert all(torch.equal(m, r) for m, r in zip(masters, ref_masters))


def test_master_weights_overflow_with_torch_clip_skips():
    norm, masters = _masters_run("torch", True, inf_at=2)
    assert not math.isfinite(norm.item()) and norm.dtype == F32
    start = [p.detach().float() for p in _params([BF16] * 4)]
    assert all(torch.equal(m, s) for m, s in zip(masters, start))


def test_stats_last_norm_is_the_exact_float32_value():
    params = _params([BF16] * 4)
    scaler = ampx.GradScaler("cpu", init_scale=SCALE)
    opt = torch.optim.SGD(params, lr=1.0)
    for p, g in zip(params, _grads([BF16] * 4)):
        p.grad = g * SCALE
    scaler.scale(torch.ones(()))
    norm = scaler.clip_grad_norm_(opt, MAX_NORM)
    scaler.step(opt)
    scaler.update()
    exact = _exact_norm(_grads([BF16] * 4)).float().item()
    assert scaler.stats()["last_norm"] == exact and norm.item() == torch.tensor(exact).to(BF16).item()


@pytest.mark.filterwarnings("ignore:.*emulates fp16")
def test_clip_norm_setting_travels_and_is_checked():
    a = ampx.GradScaler("cpu", clip_norm="torch")
    sd = a.state_dict()
    assert sd["clip_norm"] == "torch"
    b = ampx.GradScaler("cpu")
    b.load_state_dict(sd)
    assert b._clip_norm == "torch"
    bad = dict(sd, clip_norm="fast")
    with pytest.raises(ValueError, match=r"state_dict\['clip_norm'\] must be one of"):
        b.load_state_dict(bad)
    assert b._clip_norm == "torch"  # unchanged by the refused load
    with pytest.raises(ValueError, match="clip_norm must be one of"):
        ampx.GradScaler("cpu", clip_norm="fast")
    with pytest.raises(ValueError, match="clip_norm must be one of"):
        ampx.Policy("bf16", device="cpu", clip_norm="fast")
    assert ampx.Policy("bf16", device="cpu", clip_norm="torch").grad_scaler()._clip_norm == "torch"
    assert ampx.Policy("fp16", device="cpu").grad_scaler()._clip_norm == "exact"
