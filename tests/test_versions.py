"""Autograd's version counters: every ampx write bumps them, as torch's in-place ops do.

Without the bump, a tensor saved for backward and then unscaled or cast into by ampx would give a
silently wrong gradient (gradient-penalty training keeps gradients in the graph); with it,
autograd raises its usual "modified by an inplace operation" error. Covers each writing op of
ampx.ops and the scaler's own pass, and that reads (norm, check_finite) bump nothing; both ways
of bumping (from C through torch's exported functions, and the Python fallback); inference
tensors, which torch lets in-place ops write only inside torch.inference_mode(): refused
outside it before anything is written, naming op, argument and position, and written inside.
"""
import os

import pytest
import torch

import ampx
from ampx import ops
from conftest import switched

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


def bumps_from_c(on):
    if on and ops._VERSIONS_WHY_NOT is not None:
        pytest.skip(f"no bump from C here: {ops._VERSIONS_WHY_NOT}")
    return switched(ampx._C._set_versions, on)


def test_c_bumps_where_the_probe_passed():
    """On this torch the start-up probe must pass: the C bump is what keeps the cost low."""
    if not ampx._C._set_tensor_shim():
        pytest.skip(f"the shim is off: {ops.tensor_reader()}")
    if os.environ.get("AMPX_VERSIONS_FROM_C") == "0":
        pytest.skip("the C route is turned off by AMPX_VERSIONS_FROM_C=0")
    assert ops._VERSIONS_WHY_NOT is None
    assert ampx._C._set_versions() is True


@pytest.mark.parametrize("from_c", [True, False], ids=["c", "python"])
def test_each_written_tensor_is_bumped_once(from_c):
    base = torch.zeros(12)
    ts = [base[:4], base[4:8], torch.randn(3, 4).t(), torch.nn.Parameter(torch.randn(2)).detach(),
          torch.empty(0), torch.randn(2).as_subclass(Sub)]
    before = [t._version for t in ts]
    with bumps_from_c(from_c):
        ops.mul_(ts, 2.0)
    # the two views share their base's counter: each write bumps it once
    assert [t._version - b for t, b in zip(ts, before)] == [2, 2, 1, 1, 1, 1]
    assert base._version == 2


class Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("from_c", [True, False], ids=["c", "python"])
def test_the_public_fallback_bumps_the_same(monkeypatch, from_c):
    """Tensors C cannot bump (subclasses; all of them when the probe failed) go through
    torch._C._increment_version (private) where it exists, else the public
    torch.autograd.graph.increment_version one tensor at a time."""
    monkeypatch.setattr(ops, "_increment_version", ops._bump_each)
    ts = [torch.randn(5), torch.randn(3, 4).t(), torch.randn(2).as_subclass(Sub)]
    before = [t._version for t in ts]
    with bumps_from_c(from_c):
        ops.mul_(ts, 2.0)
    assert all(t._version == b + 1 for t, b in zip(ts, before))


# ---- inference tensors ---------------------------------------------------------------------


def inference_tensor(n, value=1.0):
    with torch.inference_mode():
        return torch.full((n,), value)


INFERENCE_WRITERS = {
    "unscale_": (lambda ts: ops.unscale_(ts, 0.5, torch.zeros(1)), "ampx.ops.unscale_: tensors"),
    "unscale_norm_": (lambda ts: ops.unscale_norm_(ts, 0.5, torch.zeros(1)), "ampx.ops.unscale_norm_: tensors"),
    "mul_": (lambda ts: ops.mul_(ts, 0.5), "ampx.ops.mul_: tensors"),
    "cast_": (lambda ts: ops.cast_([torch.full(t.shape, 3.0) for t in ts], ts), "ampx.ops.cast_: dst"),
    "scaler pass": (lambda ts: ops._scaler_pass(ts, 0, torch.tensor([0.5]), torch.zeros(1), None, True, False, -1),
                    "ampx.GradScaler: tensors"),
}


@pytest.mark.parametrize("from_c", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("name", list(INFERENCE_WRITERS))
def test_inference_tensors_are_refused_outside_inference_mode(name, from_c):
    run, prefix = INFERENCE_WRITERS[name]
    normal = torch.full((4,), 2.0)
    ts = [normal, torch.full((3, 4), 2.0).t(), inference_tensor(5), inference_tensor(0)]
    before = [t.clone() for t in ts]
    versions = [t._version for t in ts[:2]]
    with bumps_from_c(from_c), pytest.raises(RuntimeError) as e:
        run(ts)
    msg = str(e.value)
    assert msg.startswith(prefix + "[2] is an inference tensor") and "inference_mode()" in msg, msg
    for t, b in zip(ts, before):
        assert torch.equal(t, b), "nothing may be written"
    assert [t._version for t in ts[:2]] == versions


@pytest.mark.parametrize("from_c", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("name", list(INFERENCE_WRITERS))
def test_inference_tensors_are_written_inside_inference_mode(name, from_c):
    run, _ = INFERENCE_WRITERS[name]
    normal = torch.full((4,), 2.0)
    inf = inference_tensor(5, 2.0)
    v = normal._version
    with bumps_from_c(from_c), torch.inference_mode():
        run([normal, inf])
    want = 3.0 if name == "cast_" else 1.0  # cast_ writes its sources (3.0), the rest halve 2.0
    assert torch.equal(inf, torch.full((5,), want)) and torch.equal(normal, torch.full((4,), want))
    assert normal._version == v + 1  # torch bumps normal tensors inside inference mode too
    # torch's own rule, for comparison
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        inf.mul_(2.0)


def test_inference_tensors_may_be_read_anywhere():
    inf = inference_tensor(5)
    assert ops.norm([inf, torch.ones(4)]).item() == 3.0
    found = torch.zeros(1)
    ops.check_finite(inf, found)
    assert found.item() == 0.0
