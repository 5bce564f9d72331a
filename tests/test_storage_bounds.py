"""Tensors whose storage is smaller than their shape says, and scalar arguments with a negative bit.

`t.untyped_storage().resize_(n)` shrinks a storage under every tensor that views it; the tensor
keeps its shape, so its elements then reach past the storage's end. torch 2.13's own CPU ops
(`mul_`, `_foreach_mul_`, `_foreach_norm`, `_amp_foreach_non_finite_check_and_unscale_`) read
and write such a tensor anyway, past the allocation. ampx checks every tensor it touches against
its storage before the first byte moves (both readers: torch's C shim and the attributes), and
refuses, with every tensor of the call left as it was.

A scalar argument (found_inf, inv_scale or another factor tensor, flags, a scale state tensor)
with torch's negative bit would be read and written by its stored bits, the negation of its
values: it is refused.

Under scripts/sanitize.sh (ASan) these tests also show that nothing is read or written out of
bounds on the way to the error.
"""
import pytest
import torch

from ampx import ops

OOB = "reaches past the end of its storage"
EMPTY = "its storage holds no bytes"


def shrunk(n=64, keep_bytes=8, dtype=torch.float32):
    """A contiguous tensor of n elements whose storage holds keep_bytes bytes."""
    t = torch.ones(n, dtype=dtype)
    t.untyped_storage().resize_(keep_bytes)
    return t


def shrunk_strided(keep_bytes=8):
    """A non-contiguous view (every other element of 64) whose storage holds keep_bytes bytes."""
    t = torch.ones(64, 2)[:, 0]
    t.untyped_storage().resize_(keep_bytes)
    return t


def shrunk_offset():
    """A view at an offset: its last element lies one past the shrunk storage's end."""
    base = torch.ones(64)
    v = base[10:]
    base.untyped_storage().resize_(63 * 4)
    return v


BAD = {
    "contiguous": shrunk,
    "strided": shrunk_strided,
    "offset": shrunk_offset,
    "empty storage": lambda: shrunk(keep_bytes=0),
}


def calls(bad):
    """Every op with `bad` as one list item (the second of three), and its other tensors."""
    good = [torch.full((100,), 3.0), torch.full((5,), 5.0)]
    found = torch.zeros(1)
    dst = [torch.zeros(100, dtype=torch.bfloat16), torch.zeros(bad.numel(), dtype=torch.bfloat16),
           torch.zeros(5, dtype=torch.bfloat16)]
    lst = [good[0], bad, good[1]]
    return {
        "unscale_": (lambda: ops.unscale_(lst, 0.5, found), good + [found]),
        "check_finite": (lambda: ops.check_finite(lst, found), good + [found]),
        "norm": (lambda: ops.norm(lst), good),
        "unscale_norm_": (lambda: ops.unscale_norm_(lst, 0.5, found), good + [found]),
        "mul_": (lambda: ops.mul_(lst, 2.0), good),
        "cast_ src": (lambda: ops.cast_(lst, dst, inv_scale=0.5), good + dst),
        "cast_ dst": (lambda: ops.cast_([torch.ones(100), torch.ones(bad.numel()), torch.ones(5)],
                                        [good[0], bad, good[1]]), good),
    }


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("op", ["unscale_", "check_finite", "norm", "unscale_norm_", "mul_", "cast_ src",
                                "cast_ dst"])
def test_a_tensor_past_its_storage_is_refused_and_nothing_changes(reader, kind, op):
    bad = BAD[kind]()
    call, others = calls(bad)[op]
    before = [o.clone() for o in others]
    with pytest.raises(RuntimeError, match=EMPTY if kind == "empty storage" else OOB) as e:
        call()
    assert f"[1]" in str(e.value)  # names the list item
    for o, b in zip(others, before):
        assert torch.equal(o, b)


def test_a_tensor_that_ends_exactly_at_its_storage_end_is_accepted(reader):
    base = torch.ones(64)
    v = base[10:]
    base.untyped_storage().resize_(64 * 4)  # the same size: every element inside
    ops.mul_([v], 2.0)
    assert torch.equal(v, torch.full((54,), 2.0))
    w = torch.ones(64, 2)[:, 0]
    w.untyped_storage().resize_(127 * 4)  # the last element read is element 126
    ops.mul_([w], 2.0)
    assert torch.equal(w, torch.full((64,), 2.0))
    assert ops.norm([w]).item() == pytest.approx(16.0)


def test_large_lists_that_release_the_gil_are_checked_too(reader):
    big = torch.ones(1 << 16)  # above the size at which the call releases the GIL
    bad = shrunk(1 << 16, keep_bytes=(1 << 16) * 2)
    with pytest.raises(RuntimeError, match=OOB):
        ops.mul_([big, bad], 2.0)
    assert torch.equal(big, torch.ones(1 << 16))


@pytest.mark.parametrize("which", ["found_inf", "flags", "per_tensor", "out"])
def test_a_shrunk_output_tensor_is_refused(reader, which):
    xs = [torch.ones(3), torch.ones(4)]
    kw = {"found_inf": torch.zeros(1), "flags": torch.zeros(2, dtype=torch.uint8)}
    size = {"found_inf": 1, "flags": 2, "per_tensor": 2, "out": 1}[which]
    dtype = torch.uint8 if which == "flags" else torch.float32
    t = torch.zeros(size, dtype=dtype)
    t.untyped_storage().resize_(0)
    if which in ("found_inf", "flags"):
        kw[which] = t
        call = lambda: ops.unscale_(xs, 0.5, kw["found_inf"], flags=kw["flags"])  # noqa: E731
    else:
        mode = ops._CHECK | (ops._reduce_code("ampx.ops.norm", 2.0) << ops._SHIFT)
        call = lambda: ops._C.scale_reduce("ampx.ops.norm", xs, mode, **{which: t})  # noqa: E731
    with pytest.raises(RuntimeError, match=EMPTY) as e:
        call()
    assert which in str(e.value)
    assert torch.equal(xs[0], torch.ones(3))


@pytest.mark.parametrize("which", ["scale", "growth_tracker", "found_inf"])
def test_shrunk_scale_state_is_refused(reader, which):
    args = {"scale": torch.ones(1), "growth_tracker": torch.zeros(1, dtype=torch.int32),
            "found_inf": torch.zeros(1)}
    args[which].untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=EMPTY):
        ops.update_scale_(args["scale"], args["growth_tracker"], args["found_inf"], 2.0, 0.5, 10)


def neg(t):
    v = torch._neg_view(t)
    assert v.is_neg()
    return v


def conj_imag_zero():
    """A float32 view with the negative bit, as `x.conj().imag` gives: its stored value is 0."""
    v = torch.zeros(1, dtype=torch.complex64).conj().imag
    assert v.is_neg()
    return v


@pytest.mark.parametrize("make", [lambda: neg(torch.zeros(1)), conj_imag_zero], ids=["neg_view", "conj_imag"])
def test_a_found_inf_with_the_negative_bit_is_refused(reader, make):
    found = make()
    x = torch.tensor([float("inf"), 2.0])
    with pytest.raises(ValueError, match="found_inf has torch's negative bit"):
        ops.unscale_([x], 0.5, found)
    assert x[1].item() == 2.0 and found.item() == 0.0
    with pytest.raises(ValueError, match="found_inf has torch's negative bit"):
        ops.update_scale_(torch.ones(1), torch.zeros(1, dtype=torch.int32), found, 2.0, 0.5, 10)


def test_a_factor_with_the_negative_bit_is_refused(reader):
    inv = neg(torch.full((1,), -1.0))  # value +1.0, stored -1.0
    src, dst = [torch.full((4,), 2.0)], [torch.zeros(4)]
    with pytest.raises(ValueError, match="inv_scale has torch's negative bit"):
        ops.cast_(src, dst, inv_scale=inv)
    assert torch.equal(dst[0], torch.zeros(4))
    with pytest.raises(ValueError, match="factor has torch's negative bit"):
        ops.mul_(src, inv)
    assert torch.equal(src[0], torch.full((4,), 2.0))
    # The resolved tensor is the advice, and it works.
    ops.cast_(src, dst, inv_scale=inv.resolve_neg())
    assert torch.equal(dst[0], torch.full((4,), 2.0))


def test_scale_state_with_the_negative_bit_is_refused(reader):
    scale = neg(torch.full((1,), -4.0))
    with pytest.raises(ValueError, match="scale has torch's negative bit"):
        ops.update_scale_(scale, torch.zeros(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 10)
    assert scale.item() == 4.0
