/*
 * ampx_numerics.h: the numerics that the CPU and the CUDA kernels share.
 *
 * Written once and included by the C compiler (csrc/) and by nvcc (cuda/), so
 * that the CPU test suite pins down what both devices compute:
 *   - the lists named once: dtype codes and sizes, reduce codes, the scale
 *     kernel's modes (X-macros, numbering pinned by static asserts),
 *   - per-tensor flag bits,
 *   - float32 <-> float16 / bfloat16 conversions (round to nearest even),
 *   - float32 -> bfloat16 stochastic rounding and its counter-based random bits,
 *   - the loss-scale update rule (torch's, plus hysteresis and bounds).
 *
 * Everything here is a pure function of its arguments: no globals, no I/O.
 */
#ifndef AMPX_NUMERICS_H
#define AMPX_NUMERICS_H

#ifdef __CUDACC__
#define AMPX_HD __host__ __device__ __forceinline__
#else
#define AMPX_HD static inline
#endif

#include <stdint.h>
#if !defined(__CUDA_ARCH__)
#include <string.h>
#endif

#ifdef __cplusplus
#define AMPX_STATIC_ASSERT(c, msg) static_assert(c, msg)
#else
#define AMPX_STATIC_ASSERT(c, msg) _Static_assert(c, msg)
#endif

/* The dtypes, named once: X(code name, torch name, element size in bytes).
 * The codes number them in this order; ampx/__init__.py hands torch's dtypes
 * to _C._init in the same order, and the kernel tables are indexed by them. */
#define AMPX_DTYPE_LIST(X) X(F32, float32, 4) X(F16, float16, 2) X(BF16, bfloat16, 2) X(F64, float64, 8)

#define AMPX_X_DTYPE_CODE(code, torch_name, size) AMPX_##code,
#define AMPX_X_DTYPE_SIZE(code, torch_name, size) AMPX_SIZE_##code = size,
enum { AMPX_DTYPE_LIST(AMPX_X_DTYPE_CODE) AMPX_NUM_DTYPES };
enum { AMPX_DTYPE_LIST(AMPX_X_DTYPE_SIZE) };
#undef AMPX_X_DTYPE_CODE
#undef AMPX_X_DTYPE_SIZE
AMPX_STATIC_ASSERT(AMPX_F32 == 0 && AMPX_F16 == 1 && AMPX_BF16 == 2 && AMPX_F64 == 3 && AMPX_NUM_DTYPES == 4,
                   "dtype codes: the order of _C._init's arguments and of torch_shim.c's table");

/* tensor_stats' row: AMPX_STATS_WIDTH float64 values per tensor, the layout
 * ampx/stats.py documents (and tests/test_stats_layout.py pins to these
 * numbers through _C): AMAX, AMIN, POSINF, NEGINF, NAN, ZERO, NUMEL, then
 * AMPX_STATS_BUCKETS histogram counts by floor(log2 |x|): bucket 0 below
 * 2^EXP_MIN, 1 + e - EXP_MIN for e in [EXP_MIN, EXP_MAX], the last above. */
enum {
    AMPX_STATS_AMAX, AMPX_STATS_AMIN, AMPX_STATS_POSINF, AMPX_STATS_NEGINF, AMPX_STATS_NAN, AMPX_STATS_ZERO,
    AMPX_STATS_NUMEL, AMPX_STATS_HIST
};
#define AMPX_STATS_EXP_MIN (-149)
#define AMPX_STATS_EXP_MAX 127
#define AMPX_STATS_BUCKETS (AMPX_STATS_EXP_MAX - AMPX_STATS_EXP_MIN + 3)
#define AMPX_STATS_WIDTH (AMPX_STATS_HIST + AMPX_STATS_BUCKETS)

/* Bytes per element of dtype code dt (0 for an unknown code). */
AMPX_HD int64_t ampx_elem_size(int dt)
{
    switch (dt) {
#define AMPX_X_DTYPE_CASE(code, torch_name, size)                                                  \
    case AMPX_##code:                                                                              \
        return size;
        AMPX_DTYPE_LIST(AMPX_X_DTYPE_CASE)
#undef AMPX_X_DTYPE_CASE
    }
    return 0;
}

/* Per-tensor flag bits written by the checking kernels. */
#define AMPX_FLAG_INF 1u /* held +inf or -inf */
#define AMPX_FLAG_NAN 2u /* held a NaN */

/* The reductions the norm kernels compute, named once: X(name, code).
 * NONE: none; SUMSQ: L2 (sum of squares, sqrt taken at the end); SUMABS: L1;
 * MAXABS: L-infinity. _C exports them as REDUCE_<name> for ampx/ops.py. */
#define AMPX_REDUCE_LIST(X) X(NONE, 0) X(SUMSQ, 1) X(SUMABS, 2) X(MAXABS, 3)

#define AMPX_X_REDUCE(name, code) AMPX_REDUCE_##name = code,
enum { AMPX_REDUCE_LIST(AMPX_X_REDUCE) AMPX_NUM_REDUCE };
#undef AMPX_X_REDUCE

/* ---- the scale kernel's modes ---------------------------------------------- */

/* Mode bits of the scale-and-reduce kernel. */
#define AMPX_M_SCALE 1 /* multiply by the factor */
#define AMPX_M_WRITE 2 /* store the result back in place */
#define AMPX_M_CHECK 4 /* classify non-finite inputs into flags */
#define AMPX_M_REDUCE_SHIFT 3 /* then 2 bits holding an AMPX_REDUCE_* code */
#define AMPX_NUM_MODES 32

#define AMPX_MODE_REDUCE(mode) (((mode) >> AMPX_M_REDUCE_SHIFT) & 3)
AMPX_STATIC_ASSERT(AMPX_NUM_REDUCE == 4 && AMPX_REDUCE_MAXABS == 3, "reduce codes fit the mode's 2 bits");

/* The modes that have kernels, named once: X(name, mode, reduce, write, scale,
 * check, cuda). Any other mode is refused. `mode` is a literal because it
 * becomes part of the CPU kernels' names (cpu_kernels_body.h); reduce, write
 * and scale because they name the CUDA kernel (ampx_k_scale_r<reduce>_w<write>_s<scale>,
 * cuda/ampx_kernels.cu). The CUDA kernels leave the check to the host (it
 * passes no found_inf and flags without it), so MUL shares UNSCALE's kernel:
 * `cuda` is 1 on the one row that defines each CUDA kernel. */
#define AMPX_SCALE_MODE_LIST(X)                                                                    \
    X(MUL, 3, 0, 1, 1, 0, 0)                                                                       \
    X(CHECK, 4, 0, 0, 0, 1, 1)                                                                     \
    X(UNSCALE, 7, 0, 1, 1, 1, 1)                                                                   \
    X(UNSCALE_NORM_L2, 15, 1, 1, 1, 1, 1)                                                          \
    X(UNSCALE_NORM_L1, 23, 2, 1, 1, 1, 1)                                                          \
    X(UNSCALE_NORM_LINF, 31, 3, 1, 1, 1, 1)                                                        \
    X(NORM_L2, 12, 1, 0, 0, 1, 1)                                                                  \
    X(NORM_L1, 20, 2, 0, 0, 1, 1)                                                                  \
    X(NORM_LINF, 28, 3, 0, 0, 1, 1)                                                                \
    X(NORM_SCALED_L2, 13, 1, 0, 1, 1, 1)                                                           \
    X(NORM_SCALED_L1, 21, 2, 0, 1, 1, 1)                                                           \
    X(NORM_SCALED_LINF, 29, 3, 0, 1, 1, 1)

#define AMPX_X_MODE_ENUM(name, mode, rd, wr, sc, ck, cuda) AMPX_MODE_##name = mode,
enum { AMPX_SCALE_MODE_LIST(AMPX_X_MODE_ENUM) };
#undef AMPX_X_MODE_ENUM
/* Each row's number is its bits: the literals cannot drift from the names. */
#define AMPX_X_MODE_PIN(name, mode, rd, wr, sc, ck, cuda)                                          \
    AMPX_STATIC_ASSERT(mode == ((sc) * AMPX_M_SCALE | (wr) * AMPX_M_WRITE | (ck) * AMPX_M_CHECK |  \
                                (rd) << AMPX_M_REDUCE_SHIFT) && mode < AMPX_NUM_MODES,             \
                       "mode " #name ": its number is not its bits");
AMPX_SCALE_MODE_LIST(AMPX_X_MODE_PIN)
#undef AMPX_X_MODE_PIN

/* Expands to its arguments when c is 1, to nothing when c is 0 (for the
 * `cuda` column, and any other 0/1 literal of a list). */
#define AMPX_IF(c, ...) AMPX_IF_##c(__VA_ARGS__)
#define AMPX_IF_0(...)
#define AMPX_IF_1(...) __VA_ARGS__

/* ---- bit casts ---------------------------------------------------------- */

AMPX_HD uint32_t ampx_f32_bits(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

AMPX_HD float ampx_bits_f32(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

AMPX_HD uint64_t ampx_f64_bits(double d)
{
#ifdef __CUDA_ARCH__
    return (uint64_t)__double_as_longlong(d);
#else
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
#endif
}

AMPX_HD double ampx_bits_f64(uint64_t u)
{
#ifdef __CUDA_ARCH__
    return __longlong_as_double((long long)u);
#else
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
#endif
}

/* Non-finite classification of one float32 value: 0, AMPX_FLAG_INF or AMPX_FLAG_NAN. */
AMPX_HD unsigned ampx_classify_f32(float f)
{
    uint32_t a = ampx_f32_bits(f) & 0x7fffffffu;
    if (a < 0x7f800000u)
        return 0u;
    return a == 0x7f800000u ? AMPX_FLAG_INF : AMPX_FLAG_NAN;
}

AMPX_HD unsigned ampx_classify_f64(double d)
{
    uint64_t a = ampx_f64_bits(d) & 0x7fffffffffffffffull;
    if (a < 0x7ff0000000000000ull)
        return 0u;
    return a == 0x7ff0000000000000ull ? AMPX_FLAG_INF : AMPX_FLAG_NAN;
}

/* ---- bfloat16 ------------------------------------------------------------ */

AMPX_HD float ampx_bf16_to_f32(uint16_t h)
{
    return ampx_bits_f32((uint32_t)h << 16);
}

/* Round to nearest, ties to even. NaN stays NaN (quiet, sign kept); values
 * past the largest bfloat16 round to infinity, as IEEE rounding does. */
AMPX_HD uint16_t ampx_f32_to_bf16(float f)
{
    uint32_t u = ampx_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Stochastic rounding: round the magnitude up with probability equal to the
 * discarded low 16 bits / 2^16, using the low 16 bits of `rnd`. Unbiased in
 * expectation; inf and NaN pass through. */
AMPX_HD uint16_t ampx_f32_to_bf16_sr(float f, uint32_t rnd)
{
    uint32_t u = ampx_f32_bits(f);
    if ((u & 0x7f800000u) == 0x7f800000u) /* inf or NaN */
        return (uint16_t)((u >> 16) | ((u & 0x007fffffu) ? 0x0040u : 0u));
    u += rnd & 0xffffu;
    return (uint16_t)(u >> 16);
}

/* ---- float16 (IEEE binary16) --------------------------------------------- */

AMPX_HD float ampx_f16_to_f32(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t mant = (uint32_t)h & 0x3ffu;
    if (exp == 0x1fu) /* inf / NaN, payload kept */
        return ampx_bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0u) { /* zero or subnormal: mant * 2^-24, exact in float32 */
        float mag = (float)mant * 5.9604644775390625e-8f;
        return ampx_bits_f32(ampx_f32_bits(mag) | sign);
    }
    return ampx_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* Round to nearest, ties to even, with float16 subnormals; overflow -> inf;
 * NaN -> quiet NaN with the top payload bits (what the x86 F16C unit does). */
AMPX_HD uint16_t ampx_f32_to_f16(float f)
{
    uint32_t u = ampx_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520: rounds to inf (inf itself included) */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below 2^-14: float16 subnormal or zero */
        if (a <= 0x33000000u) /* <= 2^-25, half of the smallest subnormal: ties to 0 */
            return (uint16_t)sign;
        uint32_t e = a >> 23;
        uint32_t mant = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14 .. 24 */
        uint32_t res = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (res & 1u)))
            res += 1u; /* may carry into the smallest normal: still correct */
        return (uint16_t)(sign | res);
    }
    uint32_t r = a - (112u << 23);
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

/* ---- float64 -> narrower types without double rounding ------------------- */

/* float64 -> float32 rounded to odd: an inexact result gets an odd mantissa.
 * Rounding that once more to a type with at least two fewer mantissa bits
 * (float16, bfloat16) then equals rounding the float64 directly. */
AMPX_HD float ampx_f64_to_f32_odd(double d)
{
    float f = (float)d; /* round to nearest even */
    uint32_t u = ampx_f32_bits(f);
    if ((u & 0x7f800000u) == 0x7f800000u || (double)f == d || (u & 1u))
        return f;
    /* Inexact with an even mantissa: step one ulp toward d, onto the odd
     * neighbour. f and d share a sign, so that is a step in magnitude. */
    double af = (double)f < 0.0 ? -(double)f : (double)f;
    double ad = d < 0.0 ? -d : d;
    if (af < ad)
        u += 1u;
    else
        u -= 1u;
    return ampx_bits_f32(u);
}

/* ---- counter-based random bits for stochastic rounding -------------------- */

/* A 32-bit integer mixer with full avalanche (constants from the public
 * "hash prospector" search results). */
AMPX_HD uint32_t ampx_mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* The random bits for element e of tensor i under (seed, offset) are
 *     ampx_mix32(ampx_mix32((uint32_t)e ^ k.a) ^ k.b)
 * with k = ampx_sr_key(seed, offset, i, e >> 32). Every element of a launch
 * gets its own bits, the CPU and the GPU give the same ones, and a kernel
 * can derive a chunk's key once and then spend two mixes per element. */
typedef struct {
    uint32_t a, b;
} ampx_sr_key_t;

AMPX_HD ampx_sr_key_t ampx_sr_key(uint64_t seed, uint64_t offset, uint32_t tensor, uint32_t e_hi)
{
    ampx_sr_key_t k;
    uint32_t h = ampx_mix32(e_hi ^ 0x9e3779b9u);
    h = ampx_mix32(h ^ tensor);
    h = ampx_mix32(h ^ (uint32_t)offset);
    h = ampx_mix32(h ^ (uint32_t)(offset >> 32));
    h = ampx_mix32(h ^ (uint32_t)seed);
    k.a = ampx_mix32(h ^ (uint32_t)(seed >> 32));
    k.b = ampx_mix32(k.a ^ 0x85ebca6bu);
    return k;
}

AMPX_HD uint32_t ampx_sr_bits(ampx_sr_key_t k, uint32_t e_lo)
{
    return ampx_mix32(ampx_mix32(e_lo ^ k.a) ^ k.b);
}

/* ---- the loss-scale update rule ------------------------------------------ */

/* Events reported by ampx_update_scale (bit flags). */
#define AMPX_UPD_BACKOFF 1 /* the scale was multiplied by backoff_factor */
#define AMPX_UPD_GROWTH 2 /* the scale was multiplied by growth_factor */
#define AMPX_UPD_HYSTERESIS 4 /* an overflow was absorbed by hysteresis */
#define AMPX_UPD_AT_MIN 8 /* an overflow backed off while the scale sat at min_scale */

/* One update of (scale, growth_tracker, hysteresis_left) after a step whose
 * combined found_inf is given (non-zero, NaN included, means overflow).
 *
 * Without extras (hysteresis_left == NULL, min_scale 0, max_scale inf) this
 * is torch's _amp_update_scale_ to the bit: products formed in double and
 * rounded to float, growth only when the grown scale is finite.
 *
 * Extras, as DeepSpeed and Megatron define them: with hysteresis_left an
 * overflow first spends one unit of hysteresis (while more than one is
 * left) instead of backing off; a growth refills it to `hysteresis`, and so
 * does every clean step when `consecutive` is set. The scale never falls
 * below min_scale nor grows above max_scale. */
AMPX_HD int ampx_update_scale(float *scale, int32_t *growth_tracker, int32_t *hysteresis_left,
                              float found_inf, double growth_factor, double backoff_factor,
                              int64_t growth_interval, int32_t hysteresis, int consecutive,
                              float min_scale, float max_scale)
{
    float s = *scale;
    if (found_inf != 0.0f) {
        *growth_tracker = 0;
        if (hysteresis_left != 0 && *hysteresis_left > 1) {
            *hysteresis_left -= 1;
            return AMPX_UPD_HYSTERESIS;
        }
        int ev = AMPX_UPD_BACKOFF;
        if (s <= min_scale)
            ev |= AMPX_UPD_AT_MIN;
        float ns = (float)((double)s * backoff_factor);
        if (ns < min_scale)
            ns = min_scale;
        *scale = ns;
        return ev;
    }
    if (hysteresis_left != 0 && consecutive)
        *hysteresis_left = hysteresis;
    int32_t successful = *growth_tracker + 1;
    if ((int64_t)successful != growth_interval) {
        *growth_tracker = successful;
        return 0;
    }
    float ns = (float)((double)s * growth_factor);
    if (ns > max_scale)
        ns = max_scale;
    if (ampx_classify_f32(ns) == 0u)
        *scale = ns;
    *growth_tracker = 0;
    if (hysteresis_left != 0)
        *hysteresis_left = hysteresis;
    return AMPX_UPD_GROWTH;
}

#endif /* AMPX_NUMERICS_H */
