"""Autograd's version counters: every ampx write bumps them, as torch's in-place ops do.

Without the bump, a tensor saved for backward and then unscaled or cast into by ampx would give a
silently wrong gradient (gradient-penalty training keeps gradients in the graph); with it,
autograd raises its usual "modified by an inplace operation" error. Covers each writing op of
ampx.ops and the scaler's own pass, and that reads (norm, check_finite) bump nothing.
"""
import pytest
import torch

import ampx
from ampx import ops

WRITERS = {
    "unscale_": lambda ts: ops.unscale_(ts, 0.5, torch.zeros(1)),
    "unscale_norm_": lambda ts: ops.unscale_norm_(ts, 0.5, torch.zeros(1)),
    "mul_": lambda ts: ops.mul_(ts, 0.5),
    "cast_ (dst)": lambda ts: ops.cast_([t.clone() for t in ts], ts),
}
READERS = {
    "norm": lambda ts: ops.norm(ts),
    "check_finite": lambda ts: ops.check_finite(ts, torch.zeros(1)),
}


@pytest.mark.parametrize("name", list(WRITERS))
def test_writes_bump_versions_and_autograd_notices(name):
    ts = [torch.randn(5), torch.randn(3, 4).t(), torch.randn(7).bfloat16()]  # staged one included
    before = [t._version for t in ts]
    WRITERS[name](ts)
    assert all(t._version > b for t, b in zip(ts, before)), name
    w = torch.randn(5, requires_grad=True)
    g = torch.randn(5)
    out = (w * g).sum()  # saves g for backward
    WRITERS[name]([g])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


@pytest.mark.parametrize("name", list(READERS))
def test_reads_leave_versions_alone(name):
    ts = [torch.randn(5), torch.randn(3, 4).t()]
    before = [t._version for t in ts]
    READERS[name](ts)
    assert [t._version for t in ts] == before


def test_the_scalers_unscale_bumps_the_gradients():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    before = [p.grad._version for p in model.parameters()]
    scaler.unscale_(opt)
    assert all(p.grad._version > b for p, b in zip(model.parameters(), before))


def test_a_failed_write_bumps_nothing():
    ts = [torch.randn(5), torch.zeros(3, dtype=torch.int64)]
    before = ts[0]._version
    with pytest.raises(TypeError):
        ops.mul_(ts, 2.0)
    assert ts[0]._version == before


def test_the_public_fallback_bumps_the_same(monkeypatch):
    """ampx uses torch._C._increment_version (private) where it exists, else the public
    torch.autograd.graph.increment_version one tensor at a time."""
    monkeypatch.setattr(ops, "_increment_version", ops._bump_each)
    ts = [torch.randn(5), torch.randn(3, 4).t()]
    before = [t._version for t in ts]
    ops.mul_(ts, 2.0)
    assert all(t._version > b for t, b in zip(ts, before))
