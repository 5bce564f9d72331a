"""ampx.stats: the row layout tensor_stats writes, its torch reference and the per-format
fractions, checked against values worked out by hand."""
import math

import pytest
import torch

from ampx import stats as S

INF, NAN = math.inf, math.nan


def _hist(row):
    h = row[S.HIST:]
    return {S.bucket_exponent(int(j)): int(h[j]) for j in h.nonzero().flatten()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_row_by_hand(dtype):
    x = torch.tensor([0.0, -0.0, 1.0, -3.0, INF, -INF, NAN, 2.0 ** -149, 7e5, 0.75], dtype=dtype)
    row = S.reference([x])[0]
    assert row.dtype == torch.float64 and row.shape == (S.WIDTH,)
    assert row[S.AMAX] == 7e5 and row[S.AMIN] == 2.0 ** -149
    assert (row[S.POSINF], row[S.NEGINF], row[S.NAN], row[S.ZERO], row[S.NUMEL]) == (1, 1, 1, 2, 10)
    assert _hist(row) == {-149: 1, -1: 1, 0: 1, 1: 1, 19: 1}  # 0.75, 1, 3, 7e5 (2**19 <= 7e5 < 2**20)


def test_float64_values_beyond_float32_go_to_the_end_buckets():
    row = S.reference(torch.tensor([1e-300, 1e300, 2.0 ** 127], dtype=torch.float64))[0]
    assert _hist(row) == {S.EXP_MIN - 1: 1, S.EXP_MAX + 1: 1, 127: 1}


def test_every_row_adds_up_and_an_empty_tensor_is_a_zero_row():
    torch.manual_seed(0)
    ts = [torch.randn(n) * 10.0 ** torch.randint(-40, 38, (n,)) for n in (0, 1, 15, 16, 17, 1000)]
    rows = S.reference(ts)
    total = rows[:, S.POSINF:S.NUMEL].sum(1) + rows[:, S.HIST:].sum(1)
    assert torch.equal(total, rows[:, S.NUMEL])
    assert rows[0, S.AMAX] == 0 and rows[0, S.AMIN] == INF and rows[0, S.NUMEL] == 0


def test_combine_of_shards_is_the_row_of_the_whole():
    x = torch.tensor([1.0, -5.0, INF, 0.0, 1e-40, NAN, 3.0])
    whole = S.reference(x)[0]
    parts = S.reference([x[:3], x[3:]])
    assert torch.equal(S.combine(parts), whole)


def test_fractions_for_float16():
    x = torch.tensor([1e5, 40000.0, 1.0, 2.0 ** -26, 2.0 ** -20, INF, 0.0, 2.0 ** -25])
    row = S.reference(x)[0]
    f = S.fractions(row, "float16")
    assert f["overflow"] == 2 / 8  # 1e5 (2**16 bucket) and inf; 40000 is in fp16's top bucket
    assert f["underflow"] == 1 / 8  # 2**-26 is below half fp16's smallest subnormal
    assert f["subnormal"] == 2 / 8  # 2**-20 and 2**-25 (the half-subnormal bucket counts as held)
    assert f["headroom"] == pytest.approx(math.log2(65504 / 1e5))
    g = S.fractions(row, "float16", 2.0 ** -2)  # scaling by 1/4 moves every value down 2 buckets
    assert g["overflow"] == 1 / 8 and g["underflow"] == 2 / 8


def test_fractions_for_float8_and_bfloat16():
    row = S.reference(torch.tensor([500.0, 448.0, 2.0 ** -8, 2.0 ** -11]))[0]
    f = S.fractions(row, "float8_e4m3fn")
    assert f["overflow"] == 0.0  # 500 and 448 share e4m3's top bucket (2**8): bucket-exact, as documented
    assert f["underflow"] == 1 / 4 and f["subnormal"] == 1 / 4
    assert S.fractions(row, "bfloat16") == {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0,
                                            "headroom": pytest.approx(math.log2(S.FORMATS["bfloat16"][3] / 500))}


def test_fractions_refuse_an_unknown_format_or_a_bad_scale():
    row = S.reference(torch.ones(3))[0]
    with pytest.raises(KeyError, match="unknown format 'fp16'"):
        S.fractions(row, "fp16")
    for bad in (0.0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match="positive finite"):
            S.fractions(row, "float16", bad)
