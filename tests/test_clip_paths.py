"""clip_grad_norm_ for optimizers that read plain gradients: two routes, the same result.

When the previous step did not clip, the scaler unscales in place while computing the norm and
multiplies by the clip coefficient only if it is < 1 (one pass when nothing clips); after a step
that clipped it reads the norm first and writes once. Both must leave exactly the gradients
torch leaves after ``unscale_`` + ``clip_grad_norm_``, whichever route a step takes.
"""
import math

import pytest
import torch

import ampx


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_both_routes_leave_torchs_gradients(norm_type):
    torch.manual_seed(0)
    shapes = [(300,), (17, 5), (4096 + 3,)]
    pa = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    pt = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    oa = torch.optim.SGD(pa, lr=0.1, foreach=True)
    ot = torch.optim.SGD(pt, lr=0.1, foreach=True)
    sa = ampx.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    st = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    sa.scale(torch.ones(()))
    st.scale(torch.ones(()))
    # big (clips), small (does not) in runs, so both routes and both transitions occur
    s = 1e-5
    pattern = [5.0, s, s, s, 5.0, 5.0, s, 5.0, s, s, float("inf"), s, 5.0]
    routes = []
    for step, mag in enumerate(pattern):
        grads = [torch.randn(s) * (mag if math.isfinite(mag) else 1.0) for s in shapes]
        if not math.isfinite(mag):
            grads[1][2, 3] = math.inf
        for p, q, g in zip(pa, pt, grads):
            p.grad = g * sa.get_scale()
            q.grad = g * st.get_scale()
        routes.append(sa.__dict__.get("_clip_active", {}).get(id(oa), True))
        na = sa.clip_grad_norm_(oa, 1.0, norm_type)
        st.unscale_(ot)
        nt = torch.nn.utils.clip_grad_norm_(pt, 1.0, norm_type)
        if math.isfinite(float(nt)):
            assert float(na) == pytest.approx(float(nt), rel=1e-5), step
            for p, q in zip(pa, pt):
                torch.testing.assert_close(p.grad, q.grad, rtol=2e-6, atol=0)
        else:
            assert not math.isfinite(float(na))
        sa.step(oa)
        st.step(ot)
        sa.update()
        st.update()
        assert sa.get_scale() == st.get_scale()
        for p, q in zip(pa, pt):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
    # both routes were taken: after non-clipping steps the one-pass route, after clipping ones not
    assert True in routes and False in routes
