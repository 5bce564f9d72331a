"""The layout of ``ampx.ops.tensor_stats``'s output, and what follows from one row of it.

One call of ``tensor_stats(tensors)`` reads every tensor once and writes one float64 row per
tensor into a ``[len(tensors), WIDTH]`` tensor on the tensors' device (float64 holds every
float32 value exactly and counts exactly up to 2**53). The columns:

    AMAX      largest |x| over the finite values (0.0 when there is none)
    AMIN      smallest nonzero |x| over the finite values (+inf when there is none)
    POSINF    count of +inf
    NEGINF    count of -inf
    NAN       count of NaN
    ZERO      count of +0.0 and -0.0
    NUMEL     number of elements
    HIST ...  HIST_BUCKETS counts of the nonzero finite values by e = floor(log2 |x|):
              bucket HIST + 1 + (e - EXP_MIN) holds e in [EXP_MIN, EXP_MAX] (float32's
              exponents, its subnormals -149..-127 one bucket each); bucket HIST holds every
              e below EXP_MIN and bucket HIST + HIST_BUCKETS - 1 every e above EXP_MAX (only a
              float64 tensor can put values there).

So POSINF + NEGINF + NAN + ZERO + sum(HIST...) == NUMEL for every row. Rows of one tensor's
shards combine exactly: max of AMAX, min of AMIN, sum of the rest (``combine``).

From the histogram, how much of a tensor a format would lose at a power-of-two scale follows
without another pass over the data (``fractions``): multiplying by 2**k moves every value k
buckets. The fractions are bucket-exact: a value within the top bucket of a format (fp16's
[32768, 65504]) counts as held even where it would round up past the format's largest value
(65520 and above), and a value in the bucket just below the format's smallest subnormal
(fp16's [2**-25, 2**-24)) counts as held, as a subnormal, even where it would round to zero.

``reference`` computes the same rows with plain torch ops in float64: the independent
reference the kernel is tested against, and a slow path for what the kernel does not take.
"""
import math

import torch

__all__ = ["AMAX", "AMIN", "POSINF", "NEGINF", "NAN", "ZERO", "NUMEL", "HIST", "HIST_BUCKETS", "WIDTH",
           "EXP_MIN", "EXP_MAX", "FORMATS", "bucket_exponent", "combine", "fractions", "reference"]

AMAX, AMIN, POSINF, NEGINF, NAN, ZERO, NUMEL = range(7)
HIST = 7
EXP_MIN = -149  # float32's smallest subnormal is 2**-149
EXP_MAX = 127  # float32's largest finite value is below 2**128
HIST_BUCKETS = (EXP_MAX - EXP_MIN + 1) + 2  # 277 exponents, one bucket below, one above
WIDTH = HIST + HIST_BUCKETS


def bucket_exponent(j):
    """The exponent e = floor(log2 |x|) that histogram bucket j (0-based, within HIST...) holds;
    the two end buckets answer EXP_MIN - 1 and EXP_MAX + 1 (everything beyond them)."""
    return j - 1 + EXP_MIN


# name -> (exponent of the largest finite value, exponent of the smallest normal, exponent of the
# smallest subnormal, largest finite value, whether the format has an inf)
FORMATS = {
    "float32": (127, -126, -149, torch.finfo(torch.float32).max, True),
    "float16": (15, -14, -24, 65504.0, True),
    "bfloat16": (127, -126, -133, torch.finfo(torch.bfloat16).max, True),
    "float8_e4m3fn": (8, -6, -9, 448.0, False),
    "float8_e5m2": (15, -14, -16, 57344.0, True),
}


def combine(rows):
    """One row from several rows of the same tensor (its shards, or one per rank): a
    ``[k, WIDTH]`` tensor (or a list of rows) -> a ``[WIDTH]`` tensor."""
    rows = torch.stack(list(rows)) if not isinstance(rows, torch.Tensor) else rows
    out = rows.sum(0)
    out[AMAX] = rows[:, AMAX].max()
    out[AMIN] = rows[:, AMIN].min()
    return out


def fractions(row, fmt, scale=1.0):
    """What a format would do to the values of one row multiplied by ``scale`` (a power of two;
    another scale is taken at its power of two below): a dict of fractions of NUMEL

        overflow   beyond the format's largest finite exponent, or already inf/NaN
        underflow  nonzero values below half the format's smallest subnormal: flushed to zero
        subnormal  values the format holds only as subnormals (precision lost), not flushed
        headroom   log2(format max) - log2(AMAX * scale): how many doublings are left
                   (-inf when AMAX is 0: no finite nonzero value, so no measure)

    Raises KeyError naming the formats when ``fmt`` is none of FORMATS, ValueError for a scale
    that is not a positive finite number.
    """
    if fmt not in FORMATS:
        raise KeyError(f"ampx.stats.fractions: unknown format {fmt!r}; one of {sorted(FORMATS)}")
    scale = float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"ampx.stats.fractions: scale must be a positive finite number, got {scale}")
    e_max, e_norm, e_sub, fmax, _ = FORMATS[fmt]
    k = math.floor(math.log2(scale))
    row = row.double().cpu()
    n = float(row[NUMEL])
    hist = row[HIST:HIST + HIST_BUCKETS]
    exps = torch.arange(HIST_BUCKETS, dtype=torch.float64) - 1 + EXP_MIN + k  # exponent after scaling
    bad = float(row[POSINF] + row[NEGINF] + row[NAN])
    over = bad + float(hist[exps > e_max].sum())
    under = float(hist[exps < e_sub - 1].sum())
    sub = float(hist[(exps >= e_sub - 1) & (exps < e_norm)].sum())
    amax = float(row[AMAX]) * scale
    head = math.log2(fmax) - math.log2(amax) if amax > 0 else -math.inf
    if n == 0:
        return {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0, "headroom": head}
    return {"overflow": over / n, "underflow": under / n, "subnormal": sub / n, "headroom": head}


def reference(tensors):
    """The rows ``ampx.ops.tensor_stats`` writes, computed with torch ops in float64 on the
    tensors' device: one pass per statistic, so slow; for tests and for what the kernel refuses."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    dev = tensors[0].device if tensors else torch.device("cpu")
    out = torch.zeros(len(tensors), WIDTH, dtype=torch.float64, device=dev)
    for i, t in enumerate(tensors):
        x = t.detach().reshape(-1).to(torch.float64)
        fin = torch.isfinite(x)
        a = x[fin].abs()
        nz = a[a != 0]
        out[i, AMAX] = a.max() if a.numel() else 0.0
        out[i, AMIN] = nz.min() if nz.numel() else math.inf
        out[i, POSINF] = (x == math.inf).sum()
        out[i, NEGINF] = (x == -math.inf).sum()
        out[i, NAN] = torch.isnan(x).sum()
        out[i, ZERO] = (x == 0).sum()
        out[i, NUMEL] = x.numel()
        if nz.numel():
            e = torch.frexp(nz).exponent.to(torch.int64) - 1  # nz = m * 2**(e+1), m in [0.5, 1)
            j = (e - EXP_MIN + 1).clamp(0, HIST_BUCKETS - 1)
            out[i, HIST:] = torch.bincount(j, minlength=HIST_BUCKETS).to(torch.float64)
    return out
