"""CUDA-only behaviour of ampx.GradScaler, MasterWeights and the sharded scaler (skipped
without a GPU).

The rules are tested on the CPU (test_scaler.py, test_scaler_parity.py, test_master.py);
these check what only a GPU run shows: the scaler's passes on ampx's CUDA kernels under CUDA
autocast and fused/foreach CUDA optimizers give torch's scaler's results, bfloat16 gradients
that torch's CUDA unscale refuses are unscaled, and a fused-optimizer step, with clipping and
with an NCCL process group, never waits for the host (torch.cuda.set_sync_debug_mode("error")
turns any synchronizing call into an error).
"""
import contextlib
import math

import pytest
import torch

import ampx
from conftest import CUDA, NO_CUDA_REASON

gpu = pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON)


@contextlib.contextmanager
def _sync_is_an_error(on=True):
    """Any host synchronization inside the block raises (when on)."""
    prev = torch.cuda.get_sync_debug_mode()
    if on:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).cuda()


def _opt(kind, params):
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


@gpu
@pytest.mark.parametrize("kind", ["fused", "foreach"])
@pytest.mark.parametrize("clip", [False, True])
def test_cuda_scaler_matches_torch(kind, clip):
    ma, mt = _model(), _model()
    oa, ot = _opt(kind, ma.parameters()), _opt(kind, mt.parameters())
    sa = ampx.GradScaler("cuda", init_scale=2.0**12, growth_interval=5)
    st = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=5)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(60):
        x = torch.randn(16, 32, device="cuda", generator=g)
        for m, o, s in ((ma, oa, sa), (mt, ot, st)):
            o.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = m(x).float().square().mean()
            s.scale(loss).backward()
            if step % 9 == 4:
                next(m.parameters()).grad.view(-1)[3] = math.inf
            if clip:
                if s is sa:
                    sa.clip_grad_norm_(o, 0.5)
                else:
                    st.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            s.step(o)
            s.update()
        assert sa.get_scale() == st.get_scale(), step
    for p, q in zip(ma.parameters(), mt.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    stats = sa.stats()
    assert stats["steps"] == 60 and stats["skipped_steps"] == 7
    assert sa.overflow_report() is not None


@gpu
def test_cuda_fused_step_with_clip_makes_no_host_sync():
    m = _model()
    o = _opt("fused", m.parameters())
    s = ampx.GradScaler("cuda", init_scale=2.0**10)
    x = torch.randn(16, 32, device="cuda")

    def one(check):
        o.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = m(x).float().square().mean()
        s.scale(loss).backward()
        with _sync_is_an_error(check):
            norm = s.clip_grad_norm_(o, 1.0)
            s.step(o)
            s.update()
        return norm

    one(False)  # optimizer state, kernels loaded, workspaces allocated
    for _ in range(3):
        norm = one(True)
    assert math.isfinite(norm.item())
    assert s.stats()["steps"] == 4


@gpu
def test_cuda_bf16_gradients_which_torch_refuses():
    p = torch.nn.Parameter(torch.ones(1000, device="cuda", dtype=torch.bfloat16))
    o = torch.optim.SGD([p], lr=1.0)
    s = ampx.GradScaler("cuda", init_scale=4.0)
    s.scale(torch.ones((), device="cuda"))
    p.grad = torch.full_like(p, 8.0)
    s.unscale_(o)
    assert torch.all(p.grad == 2.0)


@gpu
def test_cuda_master_weights_with_the_scaler():
    m = _model().to(torch.float16)
    o = ampx.MasterWeights(torch.optim.AdamW(m.parameters(), lr=1e-3))
    s = ampx.GradScaler("cuda", init_scale=2.0**10)
    x = torch.randn(16, 32, device="cuda", dtype=torch.float16)
    for step in range(10):
        o.zero_grad()
        s.scale(m(x).float().square().mean()).backward()
        if step == 3:
            next(m.parameters()).grad.view(-1)[0] = math.nan
        s.clip_grad_norm_(o, 1.0)
        s.step(o)
        s.update()
    for mm, p in zip(o.masters, m.parameters()):
        assert mm.device == p.device and torch.equal(mm.half(), p.detach())
    assert s.stats()["skipped_steps"] == 1


@gpu
def test_cuda_sharded_scaler_on_one_nccl_rank_makes_no_host_sync():
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("NCCL is not built in")
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        m = _model()
        o = _opt("fused", m.parameters())
        s = ampx.GradScaler("cuda", init_scale=2.0**10, process_group=dist.group.WORLD)
        x = torch.randn(16, 32, device="cuda")
        norms = []
        for i in range(3):
            o.zero_grad(set_to_none=False)
            s.scale(m(x).square().mean()).backward()
            ref = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in m.parameters()])) / 2.0**10
            with _sync_is_an_error(i > 0):
                norm = s.clip_grad_norm_(o, 1.0)
                s.step(o)
                s.update()
            norms.append((norm.item(), ref.item()))
        for n, r in norms:
            assert n == pytest.approx(r, rel=1e-5)
    finally:
        dist.destroy_process_group()


@gpu
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_cuda_grad_buffer_of_many_params_reports_by_name_without_sync(kind):
    """1,200 parameters in a GradBuffer: the scaler's pass runs as one span with span tables
    (ampx._C._last_spans() == 1), never waits for the host, and its overflow report still
    names the parameters that overflowed; parameters match the same run without coalescing."""
    def run(coalesce):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(600)]).cuda()
        buf = ampx.GradBuffer(model.parameters())
        opt = _opt(kind, model.parameters())
        scaler = ampx.GradScaler("cuda", init_scale=2.0**10, named_parameters=model.named_parameters())
        prev = ampx._C._set_coalesce(coalesce)
        spans = []
        try:
            g = torch.Generator(device="cuda").manual_seed(2)
            for step in range(6):
                x = torch.randn(4, 8, device="cuda", generator=g)
                opt.zero_grad()
                scaler.scale(model(x).square().mean()).backward()
                if step == 3:
                    model[17].weight.grad[0, 1] = math.inf
                    model[402].bias.grad[5] = math.nan
                with _sync_is_an_error(step >= 2):
                    scaler.step(opt)
                    scaler.update()
                spans.append(ampx._C._last_spans())
        finally:
            ampx._C._set_coalesce(prev)
        report = scaler.overflow_report()
        buf.close()
        return model, report, spans

    ma, ra, spans = run(True)
    mb, rb, _ = run(False)
    assert spans[0] == 1, spans  # one span: the whole buffer
    assert ra is not None and ra.inf == ["17.weight"] and ra.nan == ["402.bias"], ra
    assert (rb.inf, rb.nan) == (ra.inf, ra.nan)
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)
